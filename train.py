"""
Agentic RL trainer: config, FSDP2 + expert parallel training, and the short Ray driver.

    python train.py                                            # tiny MoE on a laptop CPU (configs/tiny.py)
    python train.py --config configs/tiny.py --max_steps=5     # any config, with --key=value overrides
    torchrun --nproc_per_node=2 train.py --ep_size=2           # 2 ranks (gloo on CPU, NCCL on GPU)
    torchrun --nproc_per_node=8 train.py --config configs/qwen3_30b_a3b.py
    torchrun ... train.py --config configs/moe_700b.py --dry_run=True   # plan memory without GPUs

Defaults are the globals below; `--config FILE` executes a file of plain assignments over them; `--key=value`
overrides are type-checked against the default. Unknown keys and wrong types stop the run before any work.
"""

import ast
import json
import os
import sys

# -----------------------------------------------------------------------------
# default config values: the tiny CPU run. configs/*.py and --key=value override them.
# I/O
out_dir = "out/tiny"
model_path = ".cache/tiny-qwen3-moe"  # HF-format Qwen3 / Qwen3-MoE directory; the tiny one is built if missing
model_config = {}          # config.json fields used when model_path has none yet (dry runs, from-scratch init)
resume = False             # continue from the last checkpoint in out_dir
checkpoint_every = 10      # optimizer steps between checkpoints (and at the end)
save_trajectories = False  # write every finished attempt's segments to out_dir/trajectories.jsonl
seed = 1337
dry_run = False            # build on the meta device against a fake process group, print the plan, exit
# agent and data
agent = "agents/calculator.py"  # a module exporting `agent` (a ChatAgent or an Env)
prompts = ""               # JSONL/Parquet of prompts and labels; "" lets the agent module generate them
# rollout
num_engines = 1
tensor_parallel_size = 1
engine_max_model_len = 2048
engine_memory_fraction = 0.5   # vLLM gpu_memory_utilization (host memory on CPU)
enable_prefix_caching = True
speculative_config = {}    # passed to vLLM as is, e.g. {"method": "mtp", "num_speculative_tokens": 1}
group_size = 4             # attempts per prompt (GRPO group)
groups_per_batch = 8       # complete groups per optimizer step
groups_in_flight = 12      # queue depth: groups running at once; more than groups_per_batch means off-policy
max_staleness = 1          # tokens sampled more than this many policy versions ago are dropped from the loss
temperature = 1.0
top_p = 1.0
max_tokens = 48            # per model turn
attempt_timeout_s = 60.0
failed_group_rule = "drop"  # "drop" a group with a failed attempt, or "complete" it with reward 0 for the failure
# algorithm
advantage_estimator = "grpo"  # grpo | drgrpo | rloo | reinforce | distill
loss_type = "ppo"          # ppo | gspo
eps_low = 0.2
eps_high = 0.28
dual_clip = 0.0            # 0 = off, else the dual-clip constant c > 1
is_level = "token"         # importance correction engine->trainer: token | sequence | geometric | none
is_mode = "truncate"       # truncate | clip | mask
is_low = 0.5
is_high = 2.0
kl_coef = 0.0              # KL to the reference (initial) policy
entropy_coef = 0.0
# optimization
max_steps = 40
learning_rate = 3e-3
min_lr = 3e-4
warmup_steps = 2
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
microbatch_tokens = 4096   # tokens per forward/backward on one rank
logprob_chunk_size = 1024  # tokens per chunk of the lm_head + log-softmax
# parallelism and precision
train_world_size = 1       # trainer ranks; must equal torchrun's WORLD_SIZE (the dry run plans for it)
ep_size = 1                # expert parallel degree; FSDP shards over the remaining ranks
param_dtype = "float32"    # compute dtype (bfloat16 on GPU); master weights and reductions stay fp32
activation_checkpointing = False
cpu_offload_optimizer = False
# -----------------------------------------------------------------------------

CONFIG_KEYS = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str, dict))
               and k not in ("CONFIG_KEYS",)]


class ConfigError(ValueError):
    pass


def configure(argv, defaults=None):
    """Resolve the config: defaults, then `--config FILE` (plain assignments), then `--key=value` overrides."""
    cfg = dict(defaults if defaults is not None else {k: globals()[k] for k in CONFIG_KEYS})
    def put(key, value, where):
        if key not in cfg:
            raise ConfigError(f"unknown config key {key!r} ({where}); known keys: {', '.join(sorted(cfg))}")
        old = cfg[key]
        if type(old) is float and type(value) is int:
            value = float(value)
        if type(value) is not type(old):
            raise ConfigError(f"config key {key!r} ({where}) must be {type(old).__name__}, "
                              f"got {type(value).__name__} {value!r}")
        cfg[key] = value
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            args[i:i + 2] = ["--config=" + args[i + 1]]
            break
    for arg in args:
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
            if not os.path.isfile(path):
                raise ConfigError(f"config file {path!r} does not exist")
            scope = {}
            with open(path) as f:
                exec(compile(f.read(), path, "exec"), {}, scope)
            for k, v in scope.items():
                if not k.startswith("_") and not callable(v) and not isinstance(v, type(sys)):
                    put(k, v, path)
        elif arg.startswith("--") and "=" in arg:
            key, val = arg[2:].split("=", 1)
            try:
                value = ast.literal_eval(val)
            except (SyntaxError, ValueError):
                value = val  # a bare string
            if isinstance(cfg.get(key), str):
                value = val
            put(key, value, f"--{key}")
        else:
            raise ConfigError(f"cannot parse argument {arg!r}: use --config FILE or --key=value")
    return cfg


def main(argv):
    try:
        cfg = configure(argv)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    print(json.dumps(cfg, indent=1))
    from model import ensure_tiny_model, TINY_CONFIG  # noqa: F401
    if cfg["model_path"] == ".cache/tiny-qwen3-moe":
        ensure_tiny_model(cfg["model_path"])
    sys.exit("the training loop is not built yet: the tiny model is ready at " + cfg["model_path"])


if __name__ == "__main__":
    main(sys.argv[1:])
