# ROLLOUT_NODES=1 ./torchrun.sh --config configs/qwen3_30b_a3b.py   (node 0; on node 1: ROLLOUT_NODE=1 MASTER_ADDR=node0 ./torchrun.sh)
# Qwen3-30B-A3B, the model of the published benchmark: 8 GPUs train (ep=8), 8 GPUs roll out (8 engines x TP 1),
# 32 prompts x 4 samples per step, 8192-token responses. model_path: a local HF download.
# Plan it first: python train.py --config configs/qwen3_30b_a3b.py --dry_run=True
out_dir = "out/qwen3_30b_a3b"
model_path = "checkpoints/Qwen3-30B-A3B"
model_config = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128,
                "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
                "moe_intermediate_size": 768, "norm_topk_prob": True}
train_world_size = 8
ep_size = 8
num_engines = 8
tensor_parallel_size = 1
engine_max_model_len = 10240
engine_memory_fraction = 0.85
group_size = 4
groups_per_batch = 32
groups_in_flight = 40
max_tokens = 8192
microbatch_tokens = 16384
param_dtype = "bfloat16"
activation_checkpointing = True
# MTP speculative decoding ({"method": "mtp", "num_speculative_tokens": 1})
# needs a model with MTP layers (Qwen3-Next, DeepSeek-V3); vLLM refuses it
# for Qwen3-MoE, and the run stops with one sentence naming this key.
speculative_config = {}
learning_rate = 1e-6
min_lr = 1e-7
warmup_steps = 10
max_steps = 500
checkpoint_every = 50
