# python train.py --config configs/tiny_vl.py   (CPU; docs/learning.md: "Learning from pixels")
# The tiny Qwen3-VL-MoE (the tiny text MoE with M-RoPE, a 3-layer vision tower with deepstack
# into both layers) on agents/colours.py: which colour is the shape in a 128x128 picture. It
# starts from a warm start built once and cached (.cache/tiny-qwen3-vl-moe-sft, tiny.py:
# VL_WARM_START) that answers with a colour word at random; RL with the exact-answer reward and a
# KL penalty to that warm start has to learn to read the picture. Every evaluation also runs the
# held-out pictures blanked (eval/success_blank): what a policy that ignores the image scores.
out_dir = "out/tiny_vl"
model_path = ".cache/tiny-qwen3-vl-moe-sft"
agent = "agents/colours.py"
max_tokens = 8
max_steps = 150
learning_rate = 1.5e-3
min_lr = 1.5e-4
kl_coef = 0.2  # the warm start answers the four names evenly: names the policy
               # cannot yet tell apart stay sampled (at 0 it answers one name for
               # every picture within ~50 steps, and GRPO groups lose their gradient)
eval_every = 50
checkpoint_every = 50
attempt_timeout_s = 300.0  # 200 held-out pictures and their blanks
                           # at once, beside training, on 2 cores
