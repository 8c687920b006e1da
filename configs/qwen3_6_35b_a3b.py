# ROLLOUT_NODES=1 ./torchrun.sh --config configs/qwen3_6_35b_a3b.py   (node 0; on node 1: ROLLOUT_NODE=1 MASTER_ADDR=node0 ./torchrun.sh)
# Qwen3.6-35B-A3B, the hybrid MoE VLM (40 layers: 30 Gated DeltaNet + 10 gated full attention, 256 experts top-8 plus
# a shared expert, a 27-layer vision tower, an MTP layer) on the geometry recipe's multi-turn image conversations at
# 32K context, laid out as the published multimodal workload ran it: 16 H100s, 8 train (ep=8, Adam on the CPU), 8 roll
# out (4 engines x TP 2). model_path: a local HF download.
# Plan it first: python train.py --config configs/qwen3_6_35b_a3b.py --dry_run=True
out_dir = "out/qwen3_6_35b_a3b"
model_path = "checkpoints/Qwen3.6-35B-A3B"
agent = "agents/geometry.py"
# the fields of its config.json that change the function the model computes
model_config = {
    "model_type": "qwen3_5_moe", "tie_word_embeddings": False, "image_token_id": 248056,
    "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "text_config": {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
                    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                    "head_dim": 256, "rms_norm_eps": 1e-6,
                    # every 4th: full attention
                    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                    "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                    "max_position_embeddings": 262144,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                        "partial_rotary_factor": 0.25,
                                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                    "mtp_num_hidden_layers": 1, "attention_bias": False},
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152,
                      "intermediate_size": 4304, "num_heads": 16, "hidden_act": "gelu_pytorch_tanh",
                      "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2,
                      "spatial_merge_size": 2, "out_hidden_size": 2048,
                      "num_position_embeddings": 2304}}
train_world_size = 8
ep_size = 8
cpu_offload_optimizer = True  # fp32 master weights, gradients and AdamW state in host memory
gpu_memory_gib = 79.6         # H100 80 GB
num_engines = 4
tensor_parallel_size = 2
engine_max_model_len = 32768
engine_memory_fraction = 0.85
group_size = 8
groups_per_batch = 16
groups_in_flight = 20
max_tokens = 8192
microbatch_tokens = 32768     # one full-length sequence (engine_max_model_len)
param_dtype = "bfloat16"
activation_checkpointing = True
learning_rate = 1e-6
min_lr = 1e-7
warmup_steps = 10
max_steps = 500
checkpoint_every = 50
