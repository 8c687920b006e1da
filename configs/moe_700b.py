# NNODES=64 NODE_RANK=$i ROLLOUT_NODES=16 MASTER_ADDR=node0 ./torchrun.sh --config configs/moe_700b.py   (torchrun.sh has the Slurm file)
# A Qwen3-MoE-architecture model of ~698B parameters (61 layers, 256 experts, top-8, ~32B active): 64 nodes x 8 GPUs
# train (EP 256 x FSDP 2), 128 GPUs roll out (8 engines x TP 16: the bf16 weights need 16 GPUs per engine; an
# engine must sit on one node, so until engines can span nodes, this needs 16-GPU rollout nodes).
# Check the plan first, on any machine: python train.py --config configs/moe_700b.py --dry_run=True
out_dir = "out/moe_700b"
model_path = "checkpoints/moe-700b"
model_config = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 7168,
                "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 64,
                "num_key_value_heads": 8, "head_dim": 128,
                "rope_theta": 1000000.0, "max_position_embeddings": 131072,
                "tie_word_embeddings": False, "num_experts": 256, "num_experts_per_tok": 8,
                "moe_intermediate_size": 2048, "norm_topk_prob": True}
train_world_size = 512
ep_size = 256
num_engines = 8
tensor_parallel_size = 16
engine_max_model_len = 34816
engine_memory_fraction = 0.9
group_size = 8
groups_per_batch = 64
groups_in_flight = 80
max_tokens = 32768
microbatch_tokens = 34816   # one full-length sequence (engine_max_model_len)
param_dtype = "bfloat16"
activation_checkpointing = True
cpu_offload_optimizer = False
learning_rate = 5e-7
min_lr = 5e-8
warmup_steps = 20
max_steps = 1000
checkpoint_every = 20
