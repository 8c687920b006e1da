# ROLLOUT_NODES=1 ./torchrun.sh --config configs/qwen3_vl_30b_a3b.py   (node 0; on node 1: ROLLOUT_NODE=1 MASTER_ADDR=node0 ./torchrun.sh)
# Qwen3-VL-30B-A3B-Instruct (the Qwen3-30B-A3B text MoE with M-RoPE, a 27-layer vision tower, deepstack into the first
# 3 layers): 8 GPUs train (ep=8), 8 GPUs roll out (8 engines x TP 1), 32 prompts x 4 samples per step, the geometry
# recipe's multi-turn image conversations. model_path: a local HF download.
# Plan it first: python train.py --config configs/qwen3_vl_30b_a3b.py --dry_run=True
out_dir = "out/qwen3_vl_30b_a3b"
model_path = "checkpoints/Qwen3-VL-30B-A3B-Instruct"
agent = "agents/geometry.py"
# the fields of its config.json that change the function the model computes
model_config = {
    "model_type": "qwen3_vl_moe", "tie_word_embeddings": False, "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "text_config": {"model_type": "qwen3_vl_moe_text", "vocab_size": 151936, "hidden_size": 2048,
                    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                    "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 262144,
                    "rope_theta": 5000000,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20],
                                                            "mrope_interleaved": True},
                    "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                    "mlp_only_layers": []},
    "vision_config": {"model_type": "qwen3_vl_moe", "depth": 27, "hidden_size": 1152,
                      "intermediate_size": 4304, "num_heads": 16, "hidden_act": "gelu_pytorch_tanh",
                      "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2,
                      "spatial_merge_size": 2, "out_hidden_size": 2048,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}}
train_world_size = 8
ep_size = 8
num_engines = 8
tensor_parallel_size = 1
engine_max_model_len = 16384
engine_memory_fraction = 0.85
group_size = 4
groups_per_batch = 32
groups_in_flight = 40
max_tokens = 8192
microbatch_tokens = 16384
param_dtype = "bfloat16"
activation_checkpointing = True
learning_rate = 1e-6
min_lr = 1e-7
warmup_steps = 10
max_steps = 500
checkpoint_every = 50
