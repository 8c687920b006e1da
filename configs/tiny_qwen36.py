# python train.py --config configs/tiny_qwen36.py   (CPU)
# The tiny Qwen3.6-style hybrid MoE VLM (tiny.py: Gated DeltaNet and gated full
# attention layers, a shared expert, a 2-layer vision tower, an MTP layer) in the
# Qwen3.5 / 3.6 conversation format (XML tool calls, <think> reasoning) on the geometry
# recipe: questions over images drawn locally, multi-turn with the calculator tool.
# The model directory is built on first use (python
# tiny.py .cache/tiny-qwen36-moe builds it by hand).
out_dir = "out/tiny_qwen36"
model_path = ".cache/tiny-qwen36-moe"
agent = "agents/geometry.py"
