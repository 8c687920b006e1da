"""
Benchmarks. Each measures ours and a baseline side by side in the same run and prints, as its last line,
one JSON object with the figures and `ratio`.

    python bench.py logprobs     # chunked vs naive token logprobs: peak extra memory
    python bench.py capture      # agents through the capture server vs calling the engine directly
    python bench.py train        # our FSDP2+EP trainer vs transformers' Qwen3MoeForCausalLM under FSDP2 (GPU)
    python bench.py async        # streaming rollout pool vs synchronous generate-then-train
    python bench.py sync         # trainer -> engine weight broadcast vs raw NCCL broadcast (2 GPUs)
"""
import json
import sys

# -----------------------------------------------------------------------------
# each benchmark is one function bench_NAME() returning a dict with at least "ratio"


def main():
    names = sorted(k[len("bench_"):] for k in globals() if k.startswith("bench_"))
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        sys.exit(f"usage: python bench.py NAME [--key=value ...], NAME one of: {', '.join(names)}")
    result = globals()["bench_" + sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
