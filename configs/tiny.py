# python train.py --config configs/tiny.py   (the CPU default; `python train.py` runs the same)
# A random-init tiny Qwen3-MoE (2 layers, 8 experts, top-2)
# learns a multi-turn calculator task on 2 CPU cores.
out_dir = "out/tiny"
model_path = ".cache/tiny-qwen3-moe-sft"  # built on first use: the random-init
                                          # tiny model after a short SFT (tiny.py)
agent = "agents/calculator.py"
