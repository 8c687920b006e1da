# NPROC_PER_NODE=6 ./torchrun.sh --config configs/qwen3_4b.py
# Dense Qwen3-4B on one 8-GPU node: 6 GPUs train (FSDP over 6), 2
# engines x TP 1 roll out. model_path: a local HF download. Plan it
# first: python train.py --config configs/qwen3_4b.py --dry_run=True
out_dir = "out/qwen3_4b"
model_path = "checkpoints/Qwen3-4B"
model_config = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
                "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
                "max_position_embeddings": 40960, "tie_word_embeddings": True}
train_world_size = 6
num_engines = 2
tensor_parallel_size = 1
engine_max_model_len = 16384
engine_memory_fraction = 0.85
group_size = 8
groups_per_batch = 32
groups_in_flight = 40
max_tokens = 4096
microbatch_tokens = 16384
param_dtype = "bfloat16"
activation_checkpointing = True
learning_rate = 1e-6
min_lr = 1e-7
warmup_steps = 10
max_steps = 500
checkpoint_every = 50
