# python train.py --config configs/tiny_vl.py   (CPU)
# A random-init tiny Qwen3-VL-MoE (the tiny text MoE with M-RoPE, a 3-layer vision tower with deepstack into both
# layers) on the geometry recipe: questions over images drawn locally, multi-turn with the calculator tool.
# The model directory is built on first use (python model.py .cache/tiny-qwen3-vl-moe builds it by hand).
out_dir = "out/tiny_vl"
model_path = ".cache/tiny-qwen3-vl-moe"
agent = "agents/geometry.py"
