"""
Before any work: every config key checked, and the dry-run
planner (per-GPU memory, GPU counts, weight-sync volume).

    python train.py --config configs/moe_700b.py --dry_run=True    # plan any config on a CPU, in seconds
    .venv/bin/python -m pytest tests/test_config.py tests/test_dry_run.py -q

`check_config` runs before Ray, the engines or the model start: a wrong value stops the run with one
sentence naming the key and what it accepts. The dry run (train.dry_run_main) shards the model on
the meta device with the trainer's own code against torch's fake process group and hands this file
the sharded model, whose rank 0 shards measure_shards counts; the arithmetic here turns them into
bytes per GPU, GPU counts and the weight-sync volume. This file never imports the trainer.
"""

import ast
import dataclasses
import importlib.util
import math
import os
import sys

import torch
from torch.distributed.fsdp import FSDPModule

import lora
import loss
from experts import local as local_tensor
from model import ModelConfig, is_stacked_experts, load_config, num_params, write_json
from tiny import tiny_model_config
from weights_sync import BUCKET_BYTES, bucket_layout


class ConfigError(ValueError):
    """A config value the run cannot work with: one sentence naming the key and what it accepts."""


# -----------------------------------------------------------------------------
# config checks

# what each numeric key accepts: (test, the words for it)
# -> keys. Types are checked earlier (train.configure).
RANGES = {
    (lambda v: v >= 1, ">= 1"): ("checkpoint_every", "num_engines", "tensor_parallel_size",
                                 "group_size", "groups_per_batch", "groups_in_flight", "max_tokens",
                                 "max_steps", "microbatch_tokens", "logprob_chunk_size",
                                 "train_world_size", "ep_size", "cp_size", "gpus_per_node",
                                 "max_images_per_prompt"),
    (lambda v: v >= 0, ">= 0 (0: no drafting)"): ("speculative_tokens",),
    (lambda v: v >= 2, ">= 2"): ("engine_max_model_len",),
    (lambda v: v >= 0, ">= 0"): ("warmup_steps", "min_lr", "weight_decay", "eval_temperature"),
    (lambda v: v >= 0, ">= 0 (0: no evaluation)"): ("eval_every",),
    (lambda v: v >= 0, ">= 0 (0: none)"): ("view_groups_per_step", "view_max_attempts"),
    (lambda v: 0 <= v <= 65535, "a port in [0, 65535] (0: no viewer)"): ("view_port",),
    (lambda v: 0 <= v <= 512, "in [0, 512] (0: full fine-tuning; vLLM serves ranks up to 512)"): (
        "lora_rank",),
    (lambda v: v >= 0, ">= 0 (0 never stops)"): ("max_failed_rounds",),
    (lambda v: v >= 0, ">= 0 (0 never clips)"): ("grad_clip",),
    (lambda v: v > 0, "> 0"): ("learning_rate", "adam_eps", "attempt_timeout_s", "gpu_memory_gib",
                               "lora_alpha", "lora_learning_rate"),
    (lambda v: v > 0, "> 0 (the trainer divides logits by it, as the engine samples)"): (
        "temperature",),
    (lambda v: 0 < v <= 1, "in (0, 1]"): ("top_p", "engine_memory_fraction"),
    (lambda v: 0 <= v < 1, "in [0, 1)"): ("beta1", "beta2"),
}
CHOICES = {"failed_group_rule": ("drop", "complete"), "param_dtype": ("float32", "bfloat16"),
           "constrained_tokens": ("train", "mask"), "rollout_dtype": ("bfloat16", "fp8"),
           "placement": ("separate", "colocated")}


def resolve_config(argv, defaults):
    """The config: `defaults` (train.py's), then `--config FILE` (plain assignments), then
    `--key=value` overrides, each type-checked against the default; an unknown key is an error."""
    cfg = dict(defaults)
    def put(key, value, where):
        if key not in cfg:
            raise ConfigError(
                f"unknown config key {key!r} ({where}); known keys: {', '.join(sorted(cfg))}")
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
            try:  # a string key takes the text as it is
                value = val if isinstance(cfg.get(key), str) else ast.literal_eval(val)
            except (SyntaxError, ValueError):
                value = val  # a bare string
            put(key, value, f"--{key}")
        else:
            raise ConfigError(f"cannot parse argument {arg!r}: use --config FILE or --key=value")
    return cfg


def loss_config(cfg):
    """The loss's options (loss.LossConfig: it declares
    them and checks their values) from the config."""
    return loss.LossConfig(**{f.name: cfg[f.name] for f in dataclasses.fields(loss.LossConfig)})


def check_config(cfg, mcfg=None, world_size=None):
    """Every key, before any work: ranges, choices, the loss's options, files, and the
    rules between keys. mcfg: the model (default: planned_model_config); world_size:
    torchrun's WORLD_SIZE, when it started this process. Returns the model config.
    Raises ConfigError with one sentence naming the key and what it accepts."""
    for (ok, accepted), keys in RANGES.items():
        for key in keys:
            if not (ok(cfg[key]) and math.isfinite(cfg[key])):
                raise ConfigError(f"{key}={cfg[key]!r} is not accepted: it must be {accepted}")
    for key, allowed in CHOICES.items():
        if cfg[key] not in allowed:
            raise ConfigError(f"{key}={cfg[key]!r} is not one of {', '.join(allowed)}")
    try:
        loss_config(cfg)
        lora.parse_targets(cfg["lora_targets"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not os.path.isfile(cfg["agent"]):
        raise ConfigError(f"agent={cfg['agent']!r}: no such file (a Python file exporting `agent`, "
                          "e.g. "
                          "agents/calculator.py)")
    for key, empty in (("prompts", "the agent generates them"), ("sft_data", "no supervised run"),
                       ("eval_prompts", "the agent module's eval_prompts(), if any")):
        if cfg[key] and not os.path.isfile(cfg[key]):
            raise ConfigError(f"{key}={cfg[key]!r}: no such file (JSONL or Parquet; \"\": {empty})")
    # optional packages
    for key, package in (("tensorboard_dir", "tensorboard"), ("wandb_project", "wandb")):
        if cfg[key] and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{key} is set, but the {package} package is missing: pip install {package}, or "
                "leave "
                f"{key} empty")
    mcfg = mcfg or planned_model_config(cfg)
    if not cfg["train_vision"] and mcfg.vision is None:
        raise ConfigError("train_vision=False freezes a vision tower, but the model has none (a "
                          "text model): "
                          "leave train_vision at True")
    W, ep = cfg["train_world_size"], cfg["ep_size"]
    if world_size is not None and world_size != W:
        raise ConfigError(f"torchrun started {world_size} ranks (WORLD_SIZE) but train_world_size "
                          f"is {W}: launch "
                          f"{W} ranks or pass --train_world_size={world_size}")
    if W % ep:
        raise ConfigError(f"train_world_size ({W}) is not divisible by ep_size ({ep}): "
                          "expert-parallel groups "
                          "need whole sets of ep_size ranks")
    check_context_parallel(cfg, W)
    check_fp8(cfg, mcfg)
    if ep > 1 and not mcfg.is_moe:
        raise ConfigError(f"ep_size={ep} needs a MoE model, but the model is dense "
                          "(num_experts=0): use ep_size=1")
    if mcfg.is_moe and mcfg.num_experts % ep:
        raise ConfigError(f"ep_size ({ep}) does not divide the number of experts "
                          f"({mcfg.num_experts})")
    if cfg["max_tokens"] >= cfg["engine_max_model_len"]:
        raise ConfigError(f"max_tokens ({cfg['max_tokens']}) leaves no room for the prompt within "
                          f"engine_max_model_len ({cfg['engine_max_model_len']})")
    if cfg["engine_max_model_len"] > mcfg.max_position_embeddings:
        raise ConfigError(f"engine_max_model_len ({cfg['engine_max_model_len']}) is above the "
                          "model's "
                          f"max_position_embeddings ({mcfg.max_position_embeddings})")
    if cfg["groups_in_flight"] < cfg["groups_per_batch"]:
        raise ConfigError(f"groups_in_flight ({cfg['groups_in_flight']}) is below groups_per_batch "
                          f"({cfg['groups_per_batch']}): a batch could never fill")
    if cfg["lora_rank"] and mcfg.vision is not None:
        raise ConfigError("lora_rank > 0 is not supported for Qwen3-VL models yet: use lora_rank=0 "
                          "(full fine-tuning)")
    if cfg["lora_rank"] and not lora.adapter_shapes(mcfg, cfg):
        raise ConfigError(f"lora_targets={cfg['lora_targets']!r} names no layer of this model (a "
                          "dense model has no "
                          "experts, an all-MoE model no dense MLP): add attention projections or "
                          "use 'all'")
    if (k := cfg["speculative_tokens"]) and (not mcfg.mtp_num_hidden_layers
                                             or cfg["speculative_config"]):
        raise ConfigError("speculative_tokens and speculative_config both turn drafting on: set "
                          "one of them" if
                          mcfg.mtp_num_hidden_layers
                          else f"speculative_tokens={k} drafts with the model's MTP layers, "
                          f"but {cfg['model_path']!r} has none (no mtp.* weights or "
                          "mtp_num_hidden_layers): use 0")
    if cfg["mtp_loss_coef"] and (not mcfg.mtp_num_hidden_layers or cfg["lora_rank"]):
        raise ConfigError(f"mtp_loss_coef={cfg['mtp_loss_coef']} trains the model's MTP layers, "
                          "but " + (
            "it has none" if not mcfg.mtp_num_hidden_layers
            else "a LoRA run freezes them (adapters only)") + ": use 0")
    if k and cfg["lora_rank"] and not torch.cuda.is_available():
        raise ConfigError(f"speculative_tokens={k} with lora_rank={cfg['lora_rank']}: on CPU, "
                          "vLLM's LoRA engine loses its "
                          "worker process on its first drafting step; use speculative_tokens=0 "
                          "(LoRA) or lora_rank=0")
    if k and cfg["enable_prefix_caching"] and not torch.cuda.is_available():
        print("speculative_tokens: enable_prefix_caching set to False (on CPU, vLLM's hybrid "
              "prefix cache runs a "
              "Triton kernel when drafting, and the engine dies)", file=sys.stderr)
        cfg["enable_prefix_caching"] = False
    check_colocated(cfg)
    peak = lora.learning_rate_key(cfg)
    if cfg["min_lr"] > cfg[peak]:
        raise ConfigError(f"min_lr ({cfg['min_lr']}) is above {peak} ({cfg[peak]}): the schedule "
                          f"decays from {peak} "
                          "to min_lr")
    return mcfg


def check_colocated(cfg):
    """placement="colocated": the trainer and one engine take turns on one GPU. Checked here:
    what the placement cannot do; whether the two fit is the dry run's (plan_run)."""
    if cfg["placement"] != "colocated":
        return
    one_gpu = (cfg["train_world_size"], cfg["num_engines"], cfg["tensor_parallel_size"])
    if one_gpu != (1, 1, 1):
        raise ConfigError("placement='colocated' runs the trainer and one engine on one GPU: set "
                          "train_world_size=1, num_engines=1 and tensor_parallel_size=1 (several "
                          "GPUs: placement='separate')")
    if cfg["lora_rank"]:
        raise ConfigError("placement='colocated' hands the engine full weights in place (CUDA "
                          "IPC), and LoRA adapters travel by broadcast: use lora_rank=0, or "
                          "placement='separate'")
    if not cfg["dry_run"] and not torch.cuda.is_available():
        raise ConfigError("placement='colocated' needs a GPU: the engine frees its memory for the "
                          "trainer with vLLM's sleep mode, which the CPU engine lacks; use "
                          "placement='separate' (on CPU the trainer and engine share the cores)")


def check_fp8(cfg, mcfg):
    """rollout_dtype="fp8" (vLLM's FP8 kernels: compute capability 8.9 or newer) and fp8_experts
    (FP8 tensor cores of Hopper, 9.0: experts.fp8_grouped_mm) need FP8 matrix multiplies, which a
    CPU has none of; a dry run plans them wherever it runs."""
    have = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    for key, on, needs, default in (
            ("rollout_dtype", cfg["rollout_dtype"] == "fp8", (8, 9), "bfloat16"),
            ("fp8_experts", cfg["fp8_experts"], (9, 0), False)):
        if on and not cfg["dry_run"] and (have is None or have < needs):
            where = "no CUDA GPU" if have is None else "a GPU of compute capability %d.%d" % have
            raise ConfigError(f"{key}={cfg[key]!r} needs FP8 matrix multiplies (an NVIDIA GPU of "
                              f"compute capability {needs[0]}.{needs[1]} or newer) and this "
                              f"machine has {where}: use {key}={default!r}")
    if cfg["fp8_experts"] and (not mcfg.is_moe or cfg["param_dtype"] != "bfloat16"
                               or cfg["lora_rank"]):
        raise ConfigError("fp8_experts=True runs the grouped expert GEMMs of a MoE model in FP8 "
                          "in place of their bf16 ones: it needs a MoE model, "
                          "param_dtype='bfloat16' and lora_rank=0")
    if cfg["rollout_dtype"] == "fp8" and cfg["lora_rank"]:
        raise ConfigError("rollout_dtype='fp8' with lora_rank > 0: vLLM's LoRA on an FP8 engine "
                          "is not supported here yet; use rollout_dtype='bfloat16'")


def check_context_parallel(cfg, W):
    """cp_size: whole groups of consecutive ranks, and the loss terms that read one sequence's
    tokens together (a sequence-level importance weight, GSPO's ratio) kept off it: each rank sees
    only its pieces of a row."""
    cp = cfg["cp_size"]
    if W % cp:
        raise ConfigError(f"train_world_size ({W}) is not divisible by cp_size ({cp}): "
                          "context-parallel groups need whole sets of cp_size ranks")
    if cp > 1 and (cfg["is_level"] in ("sequence", "geometric") or cfg["loss_type"] == "gspo"):
        raise ConfigError(f"cp_size={cp} splits each sequence over ranks, and "
                          f"is_level={cfg['is_level']!r} / loss_type={cfg['loss_type']!r} read a "
                          "whole sequence's tokens at once: use is_level 'token' or 'none' and "
                          "loss_type 'ppo', or cp_size=1")


def planned_model_config(cfg):
    """The model a run trains: model_path's config.json; else, for the
    tiny model's path, the tiny config (it is built on first use);
    else, in a dry run, model_config (a model not downloaded yet)."""
    path = cfg["model_path"]
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            return load_config(path)
        except ValueError as e:  # model.py names the model types it implements
            raise ConfigError(f"model_path={path!r}: {e}") from None
    if tiny := tiny_model_config(path):
        return tiny
    if cfg["dry_run"] and cfg["model_config"]:
        try:
            return ModelConfig.from_hf(cfg["model_config"])
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"model_config is not a usable Qwen3 config.json: {e}") from None
    where = "" if cfg["dry_run"] else " (a dry run can plan from model_config instead)"
    raise ConfigError(f"model_path={path!r} has no config.json: download the model there{where}")


def launched_world_size():
    """WORLD_SIZE when torchrun started this process, else
    None (plain `python train.py` is a world of one)."""
    return int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


# engine.Engine's keyword -> the config key that sets
# it: the one list of engine options (engine_options)
ENGINE_OPTIONS = {"max_model_len": "engine_max_model_len",
                  "memory_fraction": "engine_memory_fraction",
                  "tensor_parallel_size": "tensor_parallel_size",
                  "enable_prefix_caching": "enable_prefix_caching",
                  "speculative_config": "speculative_config",
                  "recompute_kv_on_sync": "recompute_kv_on_sync",
                  "max_images_per_prompt": "max_images_per_prompt",
                  "rollout_dtype": "rollout_dtype"}


def engine_options(cfg):
    """engine.Engine keyword arguments from the config (num_engines says
    how many engines start), routing replay's where the engine can return
    routes; LoRA runs add vLLM's LoRA options (lora.engine_options)."""
    options = {arg: cfg[key] or None if key == "speculative_config" else cfg[key] for arg,
               key in ENGINE_OPTIONS.items()}
    if cfg["speculative_tokens"]:  # MTP drafting with the model's mtp.*
                                   # layers (check_config: it has some)
        options["speculative_config"] = {"method": "mtp",
                                         "num_speculative_tokens": cfg["speculative_tokens"]}
    mcfg = planned_model_config(cfg)
    # routing replay (README, invariant 3): the engine returns each token's
    # experts for the trainer's router to reuse; vLLM returns them on GPU only
    # (Model Runner V2), so a CPU run trains on the trainer's own routing
    options["enable_return_routed_experts"] = torch.cuda.is_available() and mcfg.is_moe
    if cfg["placement"] == "colocated" and torch.cuda.is_available():
        options["enable_sleep_mode"] = True  # vLLM's, for Engine.sleep (none on CPU: a dry run)
    return {**options, **(lora.engine_options(cfg, mcfg) if cfg["lora_rank"] else {})}


def check_engine_options(cfg, model_dir, **engine_kwargs):
    """Ask vLLM whether it accepts the engine options, with the validation
    AsyncLLM runs first when an engine starts (no weights loaded, no GPU needed,
    well under a second). Raises ConfigError naming the config key it refuses."""
    from engine import Engine
    from vllm import AsyncEngineArgs

    def refusal(options):
        try:
            AsyncEngineArgs(**Engine(model_dir, **options,
                                     **engine_kwargs).engine_args).create_engine_config()
        except Exception as e:  # pydantic's ValidationError, ValueError, NotImplementedError, ...
            errors = getattr(e, "errors", None)
            msg = errors()[0]["msg"] if callable(errors) else str(e)
            return msg.removeprefix("Value error, ").strip().splitlines()[0][:400]
        return None

    options = engine_options(cfg)
    if refusal(options) is None:
        return
    if (base := refusal({})) is not None:
        raise ConfigError(f"vLLM cannot start an engine on {model_dir!r} even with default "
                          f"options: {base}")
    tried = {}
    for name, value in options.items():  # add the options one at a time:
                                         # the first one refused is named
        tried[name] = value
        if (msg := refusal(tried)) is not None:
            key = ENGINE_OPTIONS.get(name, "lora_rank")  # the others are the LoRA run's
            raise ConfigError(f"vLLM refuses engine option {key}={cfg[key]!r}: {msg}")


# -----------------------------------------------------------------------------
# the dry run: the trainer's sharding code against a fake process group, on the meta device

GiB = 2**30


def activation_bytes(mcfg, tokens, checkpointing, dtype_bytes=2, expert_parallel=False):
    """Estimated bytes autograd saves for backward in one microbatch of `tokens` tokens (flash
    attention, balanced routing), counted from what each op of model.py saves. Per token and
    layer: each RMSNorm an fp32 copy of its input, the normed input and its output (4 + 2b) * D
    (zero-centred, Qwen3.5: the fp32 normed input, (8 + b) * D), q_norm and k_norm (4 + b) per
    element of their heads (zero-centred 8); attention q, k, v, its output and an fp32 logsumexp
    per head (gated, Qwen3.5: the output and the gate's sigmoid again); a Gated DeltaNet layer
    the conv's input, shifted copies and output, beta and the decay, what fla's
    chunk_gated_delta_rule saves (q and k normalized, their fp32 rstd, v made contiguous, g's
    fp32 cumsum, the WY matrix A of width 64 per head), the gated norm's (12 + 2b) and
    out_proj's input b per value element; a MoE layer the router's fp32 probabilities (E), its K
    input rows (sorted by expert), the K expert hidden tensors of width H five times (gate, up,
    silu(gate), their product, scaled by the routing weight; fewer where silu_mul is compiled),
    and index/weight tensors of width K (the row gathers and sums keep only int64 indices, about
    two more of width K under EP), a shared expert its four hidden tensors, output and gate; a
    dense MLP its four hidden tensors. With activation checkpointing each block keeps only its
    input (plus routing-replay ids) and one block at a time is recomputed in backward."""
    b, D, hd, K, zc = dtype_bytes, mcfg.hidden_size, mcfg.head_dim, mcfg.num_experts_per_tok, mcfg.family == "qwen3_5"
    nh, nkv = mcfg.num_attention_heads, mcfg.num_key_value_heads
    norm = ((8 + b) if zc else (4 + 2 * b)) * D + 4
    attn = (2 * norm + (8 if zc else 4 + b) * (nh + nkv) * hd + 4 * (nh + nkv)
            + b * 2 * (nh + nkv) * hd + 4 * nh +
            2 * b * nh * hd * zc)
    nk, nv, dk, dv, kc = (mcfg.linear_num_key_heads, mcfg.linear_num_value_heads,
                          mcfg.linear_key_head_dim, mcfg.linear_value_head_dim,
                          mcfg.linear_conv_kernel_dim)
    conv_dim = 2 * nk * dk + nv * dv
    # the delta rule (fla) keeps q and k per key head
    # (L2-normalized, with their fp32 rstd), the rest per value head
    gdn = 2 * norm + b * ((kc + 1) * conv_dim + kc - 1) + nk * (2 * b * dk + 8) + nv * (
        b + 16 + 64 * b + (12 + 4 * b) * dv)
    index = (5 if expert_parallel else 3) * 8 * K  # int64 ids of width K: topk ids,
                                                   # sort order, inverse (+ EP's two)
    moe = (4 * mcfg.num_experts + b * K * D + 5 * b * K * mcfg.moe_intermediate_size + index
           + (4 + b) * K + 4 +
           (4 * b * mcfg.shared_expert_intermediate_size + b * D + b
            if mcfg.shared_expert_intermediate_size else 0))
    layers = [(gdn if mcfg.layer_type(i) == "linear_attention" else attn) + (
        moe if mcfg.is_moe_layer(i) else 4 * b * mcfg.intermediate_size)
        for i in range(mcfg.num_hidden_layers)]
    once = norm + 8 + 2 * b * mcfg.rotary_dim  # the final norm, the token ids, RoPE's cos and sin
    if not checkpointing:
        return tokens * (sum(layers) + once)
    # beside each block's input, routing replay's (B, T, L_moe, K) int64 expert ids
    return tokens * (b * D * mcfg.num_hidden_layers + 8 * K * len(mcfg.moe_layers) + max(layers)
                     + once)


def vision_activation_bytes(vc, checkpointing, dtype_bytes=2, patches=784):
    """Estimated bytes the vision tower saves for backward for one image of `patches` patches
    (784: 448x448 at patch 16), counted from what each op of model.py saves. Per patch: its
    pixels (the patch embedding's input) and the rotary's fp32 cos and sin; per block, the
    inputs of both LayerNorms, qkv, q and k after the rotary, v, the attention output and
    proj's input, the MLP's hidden before and after GELU (11 D + 2 H in the compute dtype),
    an fp32 logsumexp per head and the norms' statistics; each merger (deepstack and final)
    its LayerNorm output, fc1 output and GELU output. With activation checkpointing each
    block keeps only its input, and one block at a time is recomputed in backward."""
    b, D, H = dtype_bytes, vc.hidden_size, vc.intermediate_size
    once = b * vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2 + 8 * (
        D // vc.num_heads)
    per_block = 11 * b * D + 2 * b * H + 4 * vc.num_heads + 4 * b
    # + the last block's output
    mergers = (len(vc.deepstack_visual_indexes) + 1) * 3 * b * D + b * D
    # inputs kept, one recomputed
    blocks = vc.depth * b * D + per_block if checkpointing else vc.depth * per_block
    return patches * (once + blocks + mergers)


# NCCL bandwidth the all-to-all projection uses: a broadcast between 2 H200s over NVLink, as
# `torchrun --nproc_per_node=2 bench.py sync` measures it (docs/performance.md); no 8-GPU
# all-to-all is measured
NCCL_GBPS = 370.0


def ep_all_to_all(mcfg, tokens, ep, checkpointing):
    """What expert parallelism sends per rank, MoE layer and microbatch of `tokens` tokens:
    each token crosses once to every other rank that holds one of its top-k experts
    (experts.dispatch), as bf16 rows of the model width with its routing weights and expert
    ids, and comes back the same way (its combine); backward sends the gradients back along
    both routes, and activation checkpointing runs the forward's two again. Uniform
    routing: a rank holds none of a token's k experts with probability C(E - E/ep, k) /
    C(E, k). Returns (remote rows per token, bytes, seconds at NCCL_GBPS, unoverlapped)."""
    E, k, D = mcfg.num_experts, mcfg.num_experts_per_tok, mcfg.hidden_size
    # 1 - P(none of its k here)
    remote_rows = (ep - 1) * (1 - math.comb(E - E // ep, k) / math.comb(E, k))
    dispatch_row = 2 * D + k * (2 + 8)  # the bf16 row, its k bf16 routing
                                        # weights and int64 expert ids
    passes = 3 if checkpointing else 2  # forward, backward (gradients the
                                        # other way), the recomputed forward
    # dispatch, then combine's bf16 row back
    nbytes = tokens * remote_rows * (dispatch_row + 2 * D) * passes
    return remote_rows, nbytes, nbytes / (NCCL_GBPS * 1e9)


def measure_shards(model):
    """Rank 0's parameter counts of a sharded (meta) model, for plan_memory: its shards of the dense
    and the expert weights, of what trains and of the vision tower; the unsharded sizes of the root
    fully_shard unit and of the largest block (its sub-units, the experts, included): what an
    all-gather materializes; whether the experts are kept outside FSDP (train.keep_experts_local
    gave them a cast)."""
    local = {n: local_tensor(p).numel() for n, p in model.named_parameters()}
    units = {name: 0 for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    for n, p in model.named_parameters():  # the unit that gathers p: the innermost one holding it
        units[max((u for u in units if u == "" or n.startswith(u + ".")), key=len)] += p.numel()
    blocks = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    experts = sum(v for n, v in local.items() if is_stacked_experts(n))
    # what a sync to FP8 engines sends (rollout_dtype="fp8"): the projections in e4m3 with their
    # block scales, the rest in bf16 (weights_sync.bucket_layout's, for the global shapes)
    fp8 = bucket_layout(model, 1 << 40, fp8=True)[0]
    return dict(dense=sum(local.values()) - experts, expert=experts,
                fp8_sync_bytes=sum(b["nbytes"] for b in fp8),
                trainable=sum(local[n] for n, p in model.named_parameters() if p.requires_grad),
                vision=sum(v for n, v in local.items() if n.startswith("visual.")),
                root_numel=units[""],
                block_numel=max(sum(v for u, v in units.items() if u == b or u.startswith(b + "."))
                                for b in blocks),
                experts_skip_fsdp=any(getattr(m, "cast_weights", None) is not None
                                      for m in model.modules()))


# what the torch chunked delta rule (gdn.chunk_gated_delta_rule_torch, with `incoming`: the path
# under context parallelism) saves for backward, per token and value head: 84 dk + 20 dv bytes (fp32
# pieces of width dk and dv, and of the chunk's 64), measured with
# torch.autograd.graph.saved_tensors_hooks at dk, dv in {64, 128} (Qwen3.6's 128, 128: 13,085 bytes)
GDN_TORCH_BYTES = (84, 20)


def context_parallel_bytes(mcfg, tokens, local, cp, checkpointing, b):
    """What context parallelism adds to a rank's memory, (saved for backward without activation
    checkpointing, transient): each attention layer's all-gathered K and V of the whole row of
    `tokens` (kept for backward; their gradient before the reduce-scatter as large), and the Gated
    DeltaNet layers' torch path over the rank's `local` tokens (GDN_TORCH_BYTES) instead of fla's.
    With checkpointing one layer of each kind at a time."""
    if cp == 1:
        return 0, 0
    lin = sum(mcfg.layer_type(i) == "linear_attention" for i in range(mcfg.num_hidden_layers))
    attn = mcfg.num_hidden_layers - lin + mcfg.mtp_num_hidden_layers
    kv = 2 * b * tokens * mcfg.num_key_value_heads * mcfg.head_dim  # one layer's gathered K and V
    dk, dv = mcfg.linear_key_head_dim, mcfg.linear_value_head_dim
    per_head = GDN_TORCH_BYTES[0] * dk + GDN_TORCH_BYTES[1] * dv
    delta = local * mcfg.linear_num_value_heads * per_head * (lin > 0)
    if checkpointing:
        return 0, 2 * kv + 2 * delta
    return attn * kv + lin * delta, kv + delta


def context_parallel_volume(mcfg, tokens, cp, checkpointing, b):
    """What a rank receives per microbatch under context parallelism: per attention layer the
    all-gather of the other ranks' K and V ((cp - 1) / cp of the row's) and in backward the
    reduce-scatter of their gradients; per Gated DeltaNet layer the other pieces' conv context
    (kernel - 1 rows) and state maps ((H, dk, dk + dv) fp32 a piece, whatever its length) both ways;
    activation checkpointing's recompute gathers again. Returns (bytes, bytes of the attention
    layers, seconds at NCCL_GBPS, unoverlapped)."""
    lin = sum(mcfg.layer_type(i) == "linear_attention" for i in range(mcfg.num_hidden_layers))
    attn = mcfg.num_hidden_layers - lin + mcfg.mtp_num_hidden_layers
    passes = 3 if checkpointing else 2
    kv = attn * (cp - 1) / cp * 2 * b * tokens * mcfg.num_key_value_heads * mcfg.head_dim
    nv, dk, dv = mcfg.linear_num_value_heads, mcfg.linear_key_head_dim, mcfg.linear_value_head_dim
    conv = (mcfg.linear_conv_kernel_dim - 1) * (2 * mcfg.linear_num_key_heads * dk + nv * dv) * b
    gdn = lin * (cp - 1) * 2 * (4 * nv * dk * (dk + dv) + conv)
    return passes * (kv + gdn), passes * kv, passes * (kv + gdn) / (NCCL_GBPS * 1e9)


def plan_memory(cfg, mcfg, shards):
    """Per-GPU bytes of rank 0 from its measured shards (measure_shards: parameter counts of the
    sharded meta model), and the rollout side from the config. Returns a dict of figures."""
    W, ep = cfg["train_world_size"], cfg["ep_size"]
    b = getattr(torch, cfg["param_dtype"]).itemsize  # compute dtype: what FSDP all-gathers and activations are in
    p_dense, p_expert, trainable = shards["dense"], shards["expert"], shards["trainable"]
    params = p_dense + p_expert
    # LoRA: the adapters train (fp32 master, gradient, AdamW m and v); the frozen base (LoRA's;
    # with train_vision False, the tower) is stored in param_dtype under LoRA, else in fp32
    tokens = max(cfg["microbatch_tokens"], cfg["engine_max_model_len"])
    # context parallelism: this rank's two pieces of every row (context.py); the whole row's K and V
    # and the Gated DeltaNet's torch path are the extra (context_parallel_bytes)
    cp, ckpt = cfg["cp_size"], cfg["activation_checkpointing"]
    local = tokens if cp == 1 else max(-(-tokens // (2 * cp)), 4) * 2
    cp_saved, cp_transient = context_parallel_bytes(mcfg, tokens, local, cp, ckpt, b)
    root_numel, block_numel = shards["root_numel"], shards["block_numel"]
    # a trained tower's activations, at most one 448x448 image (784 patches,
    # 196 tokens) per 196 tokens of the microbatch: the bound where every token
    # is an image token (a frozen tower keeps none); they join the text's
    images = tokens // (784 // mcfg.vision.spatial_merge_size ** 2) if mcfg.vision else 0
    images = -(-images // cp)  # under CP a rank runs the tower on its share (model.context_vision)
    per_image = {c: vision_activation_bytes(mcfg.vision, c, b) if mcfg.vision
                 and cfg["train_vision"] else 0
                 for c in (True, False)}
    figures = dict(
        world=W, ep=ep, params_total=num_params(mcfg), params_active=num_params(mcfg, active=True),
        params_dense_local=p_dense, params_expert_local=p_expert,
        # fp32 master weights (FSDP keeps the sharded parameters
        # fp32), fp32 gradients, AdamW m and v in fp32
        params_bytes=4 * trainable + (b if cfg["lora_rank"] else 4) * (params - trainable),
        grads_bytes=4 * trainable, optimizer_bytes=8 * trainable, params_trainable_local=trainable,
        params_vision_local=shards["vision"],
        # kl_coef > 0: the reference policy, a frozen copy of the initial
        # weights sharded like them, in param_dtype (train.build_reference);
        # a LoRA run's is its frozen base, at no extra memory
        reference_bytes=b * params if cfg["kl_coef"] and not cfg["lora_rank"] else 0,
        images=images, vision_act_bytes_per_image=per_image,
        # the root unit (embeddings, final norm, lm_head) stays gathered from forward to the end of
        # backward, with its gradient; blocks: the one computing plus the next one prefetched (on
        # one rank every block, kept from forward to backward: train.shard_model), and the computing
        # one's gradient unsharded in the compute dtype and in fp32 for the reduce-scatter
        gather_bytes=2 * b * root_numel
        + (mcfg.num_hidden_layers if W == 1 else 2) * b * block_numel +
        (b + 4) * block_numel,
        root_numel=root_numel, block_numel=block_numel, tokens=tokens,
        act_bytes_ckpt=activation_bytes(mcfg, local, True, b, ep > 1) + images * per_image[True],
        # + experts kept outside FSDP (train.experts_skip_fsdp): autograd keeps each
        # layer's cast of them to the compute dtype (none when that is fp32 itself), and with
        # fp8_experts the cast's two e4m3 copies, a byte each (kept for the window: the casts
        # are reused without checkpointing, experts.fp8_weight)
        act_bytes_full=activation_bytes(mcfg, local, False, b, ep > 1) + cp_saved +
        (b * p_expert if shards["experts_skip_fsdp"] and b < 4 else 0) +
        (2 * p_expert if shards["experts_skip_fsdp"] and cfg["fp8_experts"] else 0) +
        images * per_image[False],
        # chunked logprobs: fp32 logits of one chunk, their
        # softmax and its gradient (loss.token_logprobs)
        logits_bytes=3 * 4 * min(cfg["logprob_chunk_size"], local) * mcfg.vocab_size,
        # Gated DeltaNet under fla: one layer's backward recomputes its chunk states (a (dk, dv)
        # state per value head and 64 tokens) and makes their gradient, in the compute dtype
        linear_layers=[i for i in range(mcfg.num_hidden_layers)
                       if mcfg.layer_type(i) == "linear_attention"],
        gdn_state_bytes=(cp == 1) * 2 * b * -(-tokens // 64) * mcfg.linear_num_value_heads *
        mcfg.linear_key_head_dim *
        mcfg.linear_value_head_dim * ("linear_attention" in (mcfg.layer_types or [])),
        gpu_bytes=cfg["gpu_memory_gib"] * GiB, cp=cp, local_tokens=local,
        cp_transient_bytes=cp_transient,
        cp_comm=context_parallel_volume(mcfg, tokens, cp, ckpt, b) if cp > 1 else None)
    on_gpu_state = 0 if cfg["cpu_offload_optimizer"] else (figures["params_bytes"]
                                                           + figures["grads_bytes"] +
                                                          figures["optimizer_bytes"]
                                                          + figures["reference_bytes"])
    # fp8_experts: at most one MoE layer's experts (this rank's E / ep) quantized to e4m3 at once,
    # a byte each (its forward's copies, or its backward's transposed ones)
    figures["fp8_expert_bytes"] = cfg["fp8_experts"] * mcfg.num_experts // ep * 3 * (
        mcfg.moe_intermediate_size * mcfg.hidden_size)
    transient = (figures["gather_bytes"] + figures["logits_bytes"] + figures["gdn_state_bytes"] +
                 cp_transient + figures["fp8_expert_bytes"])
    ckpt, full = figures["act_bytes_ckpt"], figures["act_bytes_full"]
    # as configured, and the other
    act, other = (ckpt, full) if cfg["activation_checkpointing"] else (full, ckpt)
    figures["total_bytes"], figures["total_bytes_other_ckpt"] = (on_gpu_state + transient + a
                                                                 for a in (act, other))
    # rollout: bf16 weights split over tensor_parallel_size
    # GPUs; KV heads split too (replicated past nkv)
    tp = cfg["tensor_parallel_size"]
    # MTP drafting (speculative_tokens k): the engine builds the drafter's
    # own layers (mtp.*; the embeddings and lm_head are the target's), which
    # it drops without drafting; its attention layers hold KV, and vLLM keeps
    # k more Gated DeltaNet states per sequence (one per draft position)
    k, drafter = cfg["speculative_tokens"], num_params(mcfg) - num_params(
        dataclasses.replace(mcfg, mtp_num_hidden_layers=0))
    figures.update(drafter_weight_bytes=2 * drafter / tp if k else 0, drafter_sync_bytes=0
                   if cfg["lora_rank"] else 2 * drafter)
    # bf16, or with rollout_dtype fp8 what the sync sends (the projections e4m3 + block scales)
    fp8 = cfg["rollout_dtype"] == "fp8"
    served = shards["fp8_sync_bytes"] if fp8 else 2 * figures["params_total"]
    figures["engine_weight_bytes"] = (served - 2 * drafter) / tp + figures["drafter_weight_bytes"]
    # sent to the engines every step: the HF state dict (bf16, or the FP8 engines' projections in
    # e4m3; mtp.* included, drafting or not), or a LoRA run's fp32 adapters (never on mtp.*,
    # which LoRA freezes: lora.add_adapters)
    figures["sync_bytes"] = 4 * sum(math.prod(s)
                                    for s in lora.adapter_shapes(mcfg, cfg).values()) if cfg[
        "lora_rank"] else served
    kv_heads = max(1, math.ceil(mcfg.num_key_value_heads / tp))
    # KV in the attention layers; a Gated DeltaNet layer holds a fixed state
    # per sequence instead (fp32 delta-rule state, bf16 conv state; heads
    # split over TP), counted here per token of a full-length sequence
    lin, nv, dk, dv = len(figures["linear_layers"]), mcfg.linear_num_value_heads / tp, mcfg.linear_key_head_dim, mcfg.linear_value_head_dim
    state = 4 * nv * dk * dv + 2 * (mcfg.linear_conv_kernel_dim - 1) * (
        2 * mcfg.linear_num_key_heads * dk / tp + nv * dv)
    attention = mcfg.num_hidden_layers - lin + (mcfg.mtp_num_hidden_layers if k else 0)
    figures["kv_bytes_per_token"] = 4 * attention * kv_heads * mcfg.head_dim + (1 + k) * lin * state / cfg["engine_max_model_len"]
    figures["engine_budget_bytes"] = cfg["engine_memory_fraction"] * figures["gpu_bytes"]
    figures["kv_tokens"] = int((figures["engine_budget_bytes"] - figures["engine_weight_bytes"]) //
                               figures["kv_bytes_per_token"])
    figures["rollout_gpus"] = cfg["num_engines"] * tp
    if cfg["placement"] == "colocated":
        figures.update(plan_colocated(figures, on_gpu_state, transient + act))
    figures["moe_layers"] = len(mcfg.moe_layers)
    if mcfg.is_moe:
        figures["all_to_all"] = ep_all_to_all(mcfg, local, ep, cfg["activation_checkpointing"])
    return figures


# what a sleeping engine keeps on the GPU: its CUDA context and CUDA graphs (outside vLLM's
# sleep pool); an estimate, which `bench.py loop` measures
ENGINE_ASLEEP_BYTES = 1 * GiB


def plan_colocated(figures, on_gpu_state, training):
    """The two phases of placement="colocated" on one GPU, in bytes. Training: the trainer's state
    and its step's transient memory and activations (`training`) beside the sleeping engine.
    Generating: the engine's budget (engine_memory_fraction x GPU) beside what the trainer keeps
    (its state less the gradients, which the step frees). Syncing: the engine's weights awake (its
    KV cache still asleep), the trainer's resident state, the sender's two buckets and the
    receiver's copies of at most two. The peak is the largest of the three."""
    resident = on_gpu_state and on_gpu_state - figures["grads_bytes"]
    phases = dict(coloc_train_bytes=on_gpu_state + training + ENGINE_ASLEEP_BYTES,
                  coloc_generate_bytes=figures["engine_budget_bytes"] + resident,
                  coloc_sync_bytes=figures["engine_weight_bytes"] + resident
                  + 4 * min(BUCKET_BYTES, figures["sync_bytes"]))
    return dict(phases, coloc_resident_bytes=resident, coloc_peak_bytes=max(phases.values()))


def plan_run(cfg, mcfg, shards):
    """The figures of a dry run (train.dry_run_main measured the shards), the checks that the run
    fits, and vLLM's verdict on the engine options. Raises ConfigError when the run cannot work."""
    import tempfile
    figures = plan_memory(cfg, mcfg, shards)
    def gib(n):
        return f"{n / GiB:.1f} GiB"
    if figures["total_bytes"] > figures["gpu_bytes"]:
        raise ConfigError(f"training needs about {gib(figures['total_bytes'])} per GPU, more than "
                          f"the {cfg['gpu_memory_gib']:g} GiB of one GPU: raise train_world_size, "
                          "lower microbatch_tokens, "
                          "turn on activation_checkpointing or cpu_offload_optimizer")
    if cfg["placement"] == "colocated" and figures["coloc_peak_bytes"] > figures["gpu_bytes"]:
        raise ConfigError(f"placement='colocated' needs about {gib(figures['coloc_peak_bytes'])} "
                          f"at its peak, more than the {cfg['gpu_memory_gib']:g} GiB of the GPU "
                          f"(training {gib(figures['coloc_train_bytes'])}, generating "
                          f"{gib(figures['coloc_generate_bytes'])}): lower engine_memory_fraction "
                          "or microbatch_tokens, or turn on cpu_offload_optimizer")
    one_sequence = figures["kv_bytes_per_token"] * cfg["engine_max_model_len"]
    if figures["engine_weight_bytes"] + one_sequence > figures["engine_budget_bytes"]:
        raise ConfigError("a rollout engine cannot hold the model: "
                          f"{gib(figures['engine_weight_bytes'])} of "
                          f"{cfg['rollout_dtype'].replace('bfloat', 'bf')} "
                          "weights per GPU plus the KV cache of one "
                          f"{cfg['engine_max_model_len']}-token sequence exceed "
                          f"engine_memory_fraction x GPU = {gib(figures['engine_budget_bytes'])}: "
                          "raise "
                          "tensor_parallel_size or engine_memory_fraction")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its config notes would bury the plan
    try:
        import vllm  # noqa: F401
    except ImportError:
        figures["engine_check"] = "not checked: vLLM is not installed here"
        return figures
    if os.path.isfile(os.path.join(cfg["model_path"], "config.json")):
        check_engine_options(cfg, cfg["model_path"])
    else:  # the model is not here: vLLM validates against its config.json alone
        with tempfile.TemporaryDirectory() as tmp:
            write_json(os.path.join(tmp, "config.json"), mcfg.to_hf())
            check_engine_options(cfg, tmp, skip_tokenizer_init=True)
    figures["engine_check"] = "accepted by vLLM's engine-config validation"
    return figures


def print_plan(cfg, p):
    """The dry run's report of plan_run's figures `p`."""
    def gib(n):
        return f"{n / GiB:8.2f} GiB"

    def M(n):
        return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"
    W, ep = p["world"], p["ep"]
    ckpt = cfg["activation_checkpointing"]
    lora_note = (f"LoRA rank {cfg['lora_rank']}: {M(p['params_trainable_local'])} fp32 adapter "
                 "parameters, frozen "
                 f"base in {cfg['param_dtype']}; " if cfg["lora_rank"] else "fp32, ")
    where = "host memory (cpu_offload_optimizer)" if cfg["cpu_offload_optimizer"] else "GPU"
    lines = [
        f"dry run: {M(p['params_total'])} parameters ({M(p['params_active'])} active), "
        f"{W} trainer ranks, ep_size {ep} (fake process group; rank 0 shown: FSDP gives it the "
        "largest shard)",
        f"per-GPU memory, training ({cfg['param_dtype']} compute; fp32 master weights, gradients "
        "and AdamW state):",
        f"  parameters        {gib(p['params_bytes'])}  {lora_note}{M(p['params_dense_local'])} "
        f"dense + {M(p['params_expert_local'])} expert parameters on this rank  [{where}]",
        f"  gradients         {gib(p['grads_bytes'])}  fp32, sharded like the "
        f"parameters{' they train' * bool(lora_note)}  [{where}]",
        f"  optimizer         {gib(p['optimizer_bytes'])}  AdamW m and v, fp32  [{where}]",
    ] + ([f"  reference         {gib(p['reference_bytes'])}  kl_coef > 0: frozen copy of the "
          "initial weights, "
          f"{cfg['param_dtype']}, sharded like them  [{where}]"] if p["reference_bytes"]
          else []) + ([f"  vision tower      {M(p['params_vision_local'])} of the dense parameters "
                       "on this rank, " + (
        f"trained: activations below include {p['images']} 448x448 images per microbatch and rank "
        "(every token an image "
        f"token) at {gib(p['vision_act_bytes_per_image'][ckpt]).strip()} each"
        if cfg["train_vision"] else
        "frozen (train_vision=False): no gradients, no AdamW state, no activations kept")]
        if p["params_vision_local"] else []) + [
        f"  all-gather        {gib(p['gather_bytes'])}  unsharded: root unit "
        f"({M(p['root_numel'])}, gathered forward to end of backward, with its gradient) + 2 x "
        f"largest block ({M(p['block_numel'])} incl. "
        "its experts) + that block's gradient for the reduce-scatter",
        f"  activations       {gib(p['act_bytes_ckpt'])}  with activation checkpointing, "
        f"{p['tokens']:,} tokens per microbatch (max of microbatch_tokens, engine_max_model_len)" +
        (f", {p['local_tokens']:,} of each row on this rank (cp_size {p['cp']})"
         if p["cp"] > 1 else ""),
        f"  activations       {gib(p['act_bytes_full'])}  without activation checkpointing",
    ] + ([f"  context parallel  {gib(p['cp_transient_bytes'])}  one layer's all-gathered K and "
          "V of the whole row and their gradient" +
          (", one Gated DeltaNet layer's torch path (saved tensors and gradients)"
           if p["linear_layers"] else "") +
          (" (kept per layer: in the activations without checkpointing)" if not ckpt else "")]
         if p["cp"] > 1 else []) + (
        [f"  GDN states        {gib(p['gdn_state_bytes'])}  one Gated DeltaNet layer's chunk "
          f"states and their gradient in its backward (fla); linear-attention layers "
          f"{', '.join(map(str, p['linear_layers']))}"]
         if p["linear_layers"] and p["cp"] == 1 else []) + [
        f"  logprob chunk     {gib(p['logits_bytes'])}  fp32 logits, softmax, gradient of one "
        f"{cfg['logprob_chunk_size']}-token chunk",
    ] + ([f"  fp8 experts       {gib(p['fp8_expert_bytes'])}  one MoE layer's experts in e4m3 "
          "(fp8_experts: quantized for each forward and, transposed, for each backward; without "
          "checkpointing, experts kept outside FSDP keep both copies for the window, counted "
          "with the activations)"]
         if p["fp8_expert_bytes"] else []) + [
        f"  total             {gib(p['total_bytes'])}  of {cfg['gpu_memory_gib']:g} GiB "
        f"({100 * p['total_bytes'] / p['gpu_bytes']:.0f}%), activation checkpointing "
        f"{'on' if ckpt else 'off'}; {'off' if ckpt else 'on'}: "
        f"{gib(p['total_bytes_other_ckpt']).strip()}",
    ]
    tp, fp8 = cfg["tensor_parallel_size"], cfg["rollout_dtype"] == "fp8"
    lines += ([
        f"GPUs: 1, colocated (placement): training {gib(p['coloc_train_bytes']).strip()} (the "
        f"total above + {gib(ENGINE_ASLEEP_BYTES).strip()} the sleeping engine keeps), generating "
        f"{gib(p['coloc_generate_bytes']).strip()} (engine_memory_fraction x GPU + the trainer's "
        f"resident {gib(p['coloc_resident_bytes']).strip()}: its state less the gradients), "
        f"syncing {gib(p['coloc_sync_bytes']).strip()} (engine weights + resident + 4 buckets); "
        f"peak {gib(p['coloc_peak_bytes']).strip()} of {cfg['gpu_memory_gib']:g} GiB"
    ] if cfg["placement"] == "colocated" else [
        f"GPUs: {W} training + {p['rollout_gpus']} rollout ({cfg['num_engines']} engines x "
        f"tensor_parallel_size {tp}) = {W + p['rollout_gpus']}"]) + [
        f"rollout engine, per GPU: {gib(p['engine_weight_bytes']).strip()} "
        f"{'fp8 (projections; the rest bf16)' if fp8 else 'bf16'} weights of "
        f"{gib(p['engine_budget_bytes']).strip()} (engine_memory_fraction "
        f"{cfg['engine_memory_fraction']:g}); KV cache for {p['kv_tokens']:,} tokens = "
        f"{p['kv_tokens'] // cfg['engine_max_model_len']:,} full "
        f"{cfg['engine_max_model_len']}-token sequences per engine"
        + (f" (MTP drafting, {cfg['speculative_tokens']} tokens: "
        f"{gib(p['drafter_weight_bytes']).strip()} of the weights are the drafter's; KV includes "
        "its attention layers"
        f"{' and the extra GDN states' if p['linear_layers'] else ''})" if p["drafter_weight_bytes"]
        else ""),
        f"engine options: {p['engine_check']}",
    ]
    if p["cp"] > 1:
        nbytes, kv, seconds = p["cp_comm"]
        rest = ", the rest Gated DeltaNet state maps and conv context" if p["linear_layers"] else ""
        lines.append(f"context-parallel traffic per rank and microbatch: {nbytes / 1e9:.2f} GB "
                     f"received ({kv / 1e9:.2f} GB all-gathered K/V and their gradients' "
                     f"reduce-scatter{rest}), about {seconds * 1e3:.1f} ms at {NCCL_GBPS:g} GB/s "
                     "unoverlapped (docs/context_parallel.md)")
    if ep > 1 and p["moe_layers"]:
        rows, nbytes, seconds = p["all_to_all"]
        lines.append("expert-parallel all-to-all per rank, MoE layer and microbatch: "
                     f"{nbytes / 1e9:.2f} GB ({rows:.2f} remote rows per token at ep_size {ep}, "
                     "forward and "
                     f"backward{', forward again under activation checkpointing' if ckpt else ''}), about {seconds * 1e3:.1f} "
                     f"ms at {NCCL_GBPS:g} GB/s unoverlapped, x {p['moe_layers']} MoE layers per "
                     "microbatch")
    sent = ("fp32 LoRA adapters; the engines merge the expert ones" if cfg["lora_rank"] else
            "the projections in e4m3 with 128x128 block scales, the rest bf16" if fp8 else
            "bf16 HF state dict")
    lines += [
        f"weight sync per step: {p['sync_bytes'] / 1e9:.2f} GB ({sent}), "
        "received by each engine"
        + (f"; {p['drafter_sync_bytes'] / 1e9:.2f} GB of it the MTP layers (mtp.*), which "
                                     "only a drafting engine loads" if p["drafter_sync_bytes"]
                                     else ""),
    ]
    if tp > cfg["gpus_per_node"]:
        lines.append(f"note: an engine's {tp} GPUs must sit on one node (one placement bundle; the "
                     f"run stops at engine start otherwise): nodes of {cfg['gpus_per_node']} GPUs "
                     "(gpus_per_node) cannot hold one, and "
                     "engines spanning nodes are not supported yet")
    print("\n".join(lines), flush=True)
