"""
Agentic RL trainer: config, the loop and the short Ray driver,
FSDP2 + expert parallel training (checkpoints: checkpoint.py).

    python train.py                                            # tiny MoE on a laptop CPU (configs/tiny.py)
    python train.py --config configs/tiny.py --max_steps=5     # any config, with --key=value overrides
    torchrun --nproc_per_node=2 train.py --train_world_size=2 --ep_size=2   # 2 ranks (gloo on CPU, NCCL on GPU)
    torchrun --nproc_per_node=8 train.py --config configs/qwen3_30b_a3b.py
    python train.py --config configs/moe_700b.py --dry_run=True    # plan memory and GPUs: CPU, seconds (plan.py)
    python train.py --export_hf_dir=out/tiny/hf                # out_dir's last checkpoint as HF safetensors

Defaults are the globals below; `--config FILE` executes a file of plain assignments over them;
`--key=value` overrides are type-checked against the default; then plan.check_config checks every
key. A bad key, type or value stops the run before any work. Sections, in order: config; the loop
(main, train); the driver's plumbing; the train step; parallelism (meshes, fully_shard, the dry
run); model build. Expert-parallel dispatch and combine and the kernels are experts.py's; sharded
checkpoints, the HF export and weight loading checkpoint.py's; the dry run's arithmetic plan.py's.
"""

import asyncio
import dataclasses
import datetime
import inspect
import json
import math
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters as dynamo_counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard, register_fsdp_forward_method)
from torch.distributed.tensor import DTensor, Shard

import engine
import lora
import loss
import plan
import runlog
import vl
from checkpoint import (copy_shard, export_hf, latest_checkpoint, load_checkpoint, load_hf_weights,
                        local_tensor, save_checkpoint)
from experts import EXPERT_PROJS, AdamW, CastForCompute, Experts
from model import Transformer, init_parameters, is_stacked_experts, load_config
from context import ContextParallel, split_microbatch
from tiny import ensure_tiny_model, tiny_model_config
from plan import ConfigError, check_config, loss_config
from weights_sync import free_port

# -----------------------------------------------------------------------------
# default config values: the tiny CPU run. configs/*.py and --key=value override them. Every
# assignment between this line and the next ruler is a config key (DEFAULTS), and nothing else is.
_BEFORE_CONFIG = set(globals())
# I/O
out_dir = "out/tiny"
model_path = ".cache/tiny-qwen3-moe-sft"  # HF-format Qwen3 / Qwen3-MoE directory;
                                          # a tiny one is built if missing
model_config = {}          # config.json fields a dry run plans from when
                           # model_path has none (not downloaded yet)
resume = False             # continue from the last checkpoint in out_dir
checkpoint_every = 10      # optimizer steps between checkpoints (and at the end)
save_trajectories = False  # write every finished attempt's segments to out_dir/trajectories.jsonl
seed = 1337
dry_run = False            # build on the meta device against a fake
                           # process group, print the plan, exit
export_hf_dir = ""         # a directory: write out_dir's last checkpoint
                           # there as HF safetensors, then exit
# agent and data
agent = "agents/calculator.py"  # a module exporting `agent` (a ChatAgent or an Env)
prompts = ""               # JSONL/Parquet of prompts and labels;
                           # "" lets the agent module generate them
sft_data = ""              # JSONL/Parquet of chat transcripts: a supervised
                           # run of max_steps steps on them, no rollout
eval_every = 10            # held-out evaluation every this many steps,
                           # at the start and at the end (0: none)
eval_prompts = ""          # JSONL/Parquet of held-out prompts; "" takes
                           # the agent module's eval_prompts(), if any
eval_temperature = 0.0     # the evaluation's sampling (0: greedy)
tensorboard_dir = ""       # also write every logged number there as
                           # TensorBoard scalars (pip install tensorboard)
wandb_project = ""         # also log every number to this Weights & Biases project (pip
                           # install wandb; WANDB_MODE=offline keeps the run in out_dir/wandb)
view_port = 0              # serve the trajectory viewer on 127.0.0.1:PORT
                           # during the run (viewer.py; 0: no server)
view_groups_per_step = 1   # GRPO groups of each batch recorded for the viewer in
                           # out_dir/view/ (0: none), with the trainer's logprobs
                           # of their tokens; written off the trainer's path
view_max_attempts = 256    # the newest this many recorded attempts
                           # are kept there (older ones are deleted)
# rollout: engine.Engine's options, one key each
# (plan.ENGINE_OPTIONS); engine.py declares each default
num_engines = 1
placement = "separate"     # "separate": engines on GPUs of their own, rollouts stream while the
                           # trainer steps; "colocated": trainer and engine share one GPU and
                           # take turns, the engine asleep while the trainer steps (docs/gpu.md)
tensor_parallel_size = engine.OPTIONS["tensor_parallel_size"]
engine_max_model_len = engine.OPTIONS["max_model_len"]
# vLLM gpu_memory_utilization (host memory on CPU)
engine_memory_fraction = engine.OPTIONS["memory_fraction"]
enable_prefix_caching = engine.OPTIONS["enable_prefix_caching"]
# a weight sync empties the prefix cache; in-flight requests recompute their KV with the
# new weights (False: they go on with the old weights' KV, a hybrid of two policies)
recompute_kv_on_sync = engine.OPTIONS["recompute_kv_on_sync"]
# images one prompt may hold (vLLM's limit_mm_per_prompt); more get a 400 naming the image
max_images_per_prompt = engine.OPTIONS["max_images_per_prompt"]
# "fp8": the engines serve vLLM's block-wise FP8 weights (Hopper), and each weight sync sends the
# projections quantized the same way (weights_sync.quantize_fp8_blocks), about half the bytes
rollout_dtype = engine.OPTIONS["rollout_dtype"]
speculative_config = {}    # passed to vLLM as is, e.g. {"method":
                           # "mtp", "num_speculative_tokens": 1}
speculative_tokens = 0     # MTP speculative decoding: tokens drafted per
                           # step by the model's mtp.* layers (0: off)
group_size = 4             # attempts per prompt (GRPO group)
groups_per_batch = 8       # complete groups per optimizer step
groups_in_flight = 12      # queue depth: groups running at once; more
                           # than groups_per_batch means off-policy
temperature = 1.0
top_p = 1.0
max_tokens = 48            # per model turn
constrained_tokens = "train"  # tokens sampled under a grammar or bias (response_format,
                              # tool_choice "none"): "train" them (their behavior logprob is
                              # the masked distribution's; importance correction sees the
                              # gap) or "mask" them out of the loss (recorded as context)
attempt_timeout_s = 60.0
failed_group_rule = "drop"  # "drop" a group with a failed attempt, or
                            # "complete" it with reward 0 for the failure
max_failed_rounds = 3      # the run stops, with the last error, when this many x
                           # groups_in_flight x group_size attempts in a row failed
                           # (a broken agent or tool; not while an engine restarts)
# algorithm: loss.LossConfig's options, one key each; loss.py
# declares each default, says what it does and checks it
_loss = loss.LossConfig()
advantage_estimator = _loss.advantage_estimator  # grpo | drgrpo | rloo | reinforce | distill
loss_type = _loss.loss_type          # ppo (token ratio) | gspo (sequence ratio)
eps_low = _loss.eps_low              # the ratio is clipped to [1 - eps_low, 1 + eps_high]
eps_high = _loss.eps_high
dual_clip = _loss.dual_clip          # 0: off, else c > 1 (for A < 0 the
                                     # token loss is capped at -c * A)
is_level = _loss.is_level            # importance correction engine -> trainer:
                                     # token | sequence | geometric | none
is_mode = _loss.is_mode              # truncate | clip | mask
is_low = _loss.is_low
is_high = _loss.is_high
max_staleness = _loss.max_staleness  # tokens sampled more than this many
                                     # policy versions ago are dropped
kl_coef = _loss.kl_coef              # KL penalty to the reference policy (the initial weights)
entropy_coef = _loss.entropy_coef    # entropy bonus
mtp_loss_coef = _loss.mtp_loss_coef  # the MTP head's cross-entropy of token t
                                     # + 2 (mtp_loss), trunk detached (0: off)
# optimization
max_steps = 40
learning_rate = 5e-4       # the tiny default's RL from its warm start (docs/learning.md)
min_lr = 5e-5
warmup_steps = 2
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.95
adam_eps = 1e-5            # larger than torch's 1e-8: Adam does not blow
                           # a token's tiny gradient up to a full step
grad_clip = 1.0
train_vision = True        # a Qwen3-VL model: train its vision tower too
                           # (False: frozen, no gradients or Adam state)
microbatch_tokens = 4096   # tokens per forward/backward on one rank
logprob_chunk_size = 1024  # tokens per chunk of the lm_head + log-softmax
logprob_keep_logits = False  # keep the bf16 logits for backward (tokens
                             # * vocab * 2 bytes) instead of recomputing
# parallelism and precision
train_world_size = 1       # trainer ranks; must equal torchrun's
                           # WORLD_SIZE (the dry run plans for it)
ep_size = 1                # expert parallel degree; FSDP shards over the remaining ranks
cp_size = 1                # context parallel degree: each sequence split over this many ranks
                           # (docs/context_parallel.md)
param_dtype = "float32"    # compute dtype (bfloat16 on GPU); master
                           # weights and reductions stay fp32
activation_checkpointing = False
cpu_offload_optimizer = False
fp8_experts = False        # the MoE experts' GEMMs in FP8, forward and input gradients (Hopper;
                           # weight gradients bf16, masters fp32 as ever: experts.GroupedSwiGLU)
gpu_memory_gib = 140.0      # per-GPU memory the dry run plans against
                            # (H200: 141 GB as sold, 140.4 GiB)
gpus_per_node = 8          # GPUs of one node, for the dry run: an engine's
                           # tensor_parallel_size GPUs sit on one node
# LoRA (lora.py): train adapters of this rank on a frozen
# base (stored in param_dtype), served by vLLM's LoRA support
lora_rank = 0              # 0: full fine-tuning
lora_alpha = 16.0          # the adapters' scaling is lora_alpha / lora_rank
lora_targets = "all"       # "all" or a comma-separated list of q_proj, k_proj,
                           # v_proj, o_proj, gate_proj, up_proj, down_proj (dense
                           # MLPs), experts (every routed expert's three projections)
lora_learning_rate = 5e-3  # a LoRA run's learning_rate (learning_rate is full fine-tuning's):
                           # adapters start at B = 0 and need ~10x the rate (docs/learning.md);
                           # warm-up and decay to min_lr as for full fine-tuning
# -----------------------------------------------------------------------------

DEFAULTS = {k: v for k, v in globals().items() if k not in _BEFORE_CONFIG and not k.startswith("_")}


def configure(argv, defaults=None):
    """Resolve the config: defaults (DEFAULTS), then `--config FILE` (plain assignments), then
    `--key=value` overrides, type-checked (plan.resolve_config)."""
    return plan.resolve_config(argv, DEFAULTS if defaults is None else defaults)


# -----------------------------------------------------------------------------
# the loop: main() checks the config and starts everything, train() runs the steps


def main(argv):
    try:
        cfg = configure(argv)
        if cfg["dry_run"]:
            return dry_run_main(cfg)
        check_config(cfg, world_size=plan.launched_world_size())
        if (cfg["resume"] or cfg["export_hf_dir"]) and latest_checkpoint(cfg["out_dir"]) is None:
            raise ConfigError(
                f"{'resume=True' if cfg['resume'] else 'export_hf_dir'} needs a checkpoint, and "
                "out_dir="
                f"{cfg['out_dir']!r} holds none: train there first (without --resume)")
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    rank, world, device = init_distributed()
    if rank == 0:
        print(json.dumps(cfg, indent=1))
        os.makedirs(cfg["out_dir"], exist_ok=True)
        if tiny_model_config(cfg["model_path"]):  # the default one after its warm
                                                  # start (an SFT run of this file)
            ensure_tiny_model(cfg["model_path"])
        if not cfg["resume"] and not cfg["export_hf_dir"] and os.path.exists(
                os.path.join(cfg["out_dir"], "metrics.jsonl")):
            # a fresh run starts a fresh log
            os.remove(os.path.join(cfg["out_dir"], "metrics.jsonl"))
    dist.barrier()
    torch.manual_seed(cfg["seed"])
    model, optimizer, step, extra = build_trainer(
        dict(cfg, resume=cfg["resume"] or bool(cfg["export_hf_dir"])), world,
        device)
    if cfg["export_hf_dir"]:  # no rollout: the checkpoint as an HF
                              # directory that vLLM and transformers load
        export_hf(model, cfg["export_hf_dir"], source_dir=cfg["model_path"])
        print0(f"exported step {step} of {cfg['out_dir']} to {cfg['export_hf_dir']}")
        return dist.destroy_process_group()
    if cfg["sft_data"]:  # a supervised run: no rollout
        print0(f"done: {sft(cfg, model, optimizer, step, rank, world)} (HF), "
               f"{cfg['out_dir']}/metrics.jsonl")
        return dist.destroy_process_group()

    # the rollout side, on rank 0: engines, router, capture server, pool
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the engines' start-up and
                                                          # per-sync notes, unless asked
    ray = connect_ray(cfg, rank, world)
    from rollout import trainer_gpus  # after connect_ray: ranks import ray once its auth is set
    # colocated: the engine takes the trainer's GPU, which is then not reserved against it
    gpus = {} if cfg["placement"] == "colocated" else trainer_gpus(ray, world)
    # a resumed run's pool continues the prompt stream after the prompts its earlier life drew
    start = extra.get("data_position", 0)
    rollout = start_rollout(cfg, trainer_gpus=gpus, data_position=start) if rank == 0 else None

    evals = train(cfg, model, optimizer, rollout, step, rank, world,
                  extra.get("policy_version", step))

    if rank == 0:
        stop_rollout(rollout)
        held_out = "".join(f"held-out eval/success {evals[v]['eval/success']:.3f} at policy "
                           f"version {v}; "
                           # the first and the last
                           for v in sorted(evals)[:1] + sorted(evals)[1:][-1:])
        print(f"done: {held_out}{cfg['out_dir']}/metrics.jsonl, {cfg['out_dir']}/curves.png, "
              f"checkpoint {latest_checkpoint(cfg['out_dir'])}")
    ray.shutdown()
    dist.destroy_process_group()


def train(cfg, model, optimizer, rollout, step, rank, world, policy_version=None):
    """The loop, from `step` to max_steps: batch -> advantages -> each rank's refs
    -> train step -> weight sync -> held-out evaluation (every eval_every steps) ->
    log -> checkpoint. Rank 0 drives (rollout: start_rollout's); the others follow
    through collectives. Returns rank 0's evaluations, {policy_version: metrics}.
    placement="colocated" (one GPU): generation and training take turns, with no overlap on the
    GPU: the engine sleeps from the batch to the sync (rl_step). The pool still keeps its groups
    going: agents' own work (tools, their code) runs on while the trainer steps, and their requests
    wait in the sleeping engine, to be sampled by the new weights. Staleness is what each token's
    policy version says, as in the separate placement. The pool starts no group between the batch
    and the sync, so with groups_in_flight = groups_per_batch every batch is on-policy (staleness
    0); above it, the groups still open carry tokens of earlier versions (their requests preempted
    at the sleep and resumed on the new weights, KV recomputed), which max_staleness bounds."""
    import weights_sync
    from tqdm import tqdm
    out_dir = cfg["out_dir"]
    loop = asyncio.new_event_loop()  # runs the weight-sync coroutines of this thread
    colocated = cfg["placement"] == "colocated"  # the engine sleeps while the trainer steps
    sender = weights_sync.WeightSender(adapter=lora.sync_config(cfg),  # LoRA: the adapters alone
                                       fp8=cfg["rollout_dtype"] == "fp8", in_place=colocated)
    writer, evals = runlog.scalar_writer(cfg, rank), {}
    reference = build_reference(cfg, model, compute_device())  # kl_coef > 0: the initial weights
    lcfg = loss_config(cfg)  # the loss's options, once for the run
    # one optimizer step that changes the weights = one policy version
    # (a resumed run: the checkpoint's); the engines start at version 0
    policy_version = step if policy_version is None else policy_version
    # the engines get the trainer's weights first: a resumed
    # run's, or whatever they were started or left with
    push_weights(rollout, loop, sender, model, policy_version, rank, world)
    if rank == 0:
        rollout.pool.start()  # after that sync, so that no attempt samples from the base weights
        if policy_version == 0 and evaluate(rollout, cfg, 0, evals):
            runlog.log_step(out_dir, dict(step=0, policy_version=0, **evals[0]), writer)
        rollout.router.reset_idle_clock()
    bar = tqdm(total=cfg["max_steps"], initial=step, disable=rank != 0, dynamic_ncols=True)
    for step in range(step, cfg["max_steps"]):
        t0 = time.perf_counter()
        # colocated: no new group starts before the sync (pool.resume), so none samples from
        # the weights the step replaces
        records = rollout.pool.next_batch(hold=colocated) if rank == 0 else None
        t_batch = time.perf_counter()
        m = rl_step(rollout, loop, sender, model, optimizer, records, cfg, lcfg, policy_version,
                    step, rank, world, reference)
        if colocated and rank == 0:
            rollout.pool.resume()
        # the version this step trained on, the new one
        trained, policy_version = policy_version, m["policy_version"]
        if rank == 0:
            pool = rollout.pool.stats()
            rewards = {r["attempt_id"]: r["reward"] for r in records}  # an attempt counts once
            step_time = time.perf_counter() - t0
            row = dict(step=step + 1, reward_mean=sum(rewards.values()) / max(len(rewards), 1),
                       policy_version=policy_version, mismatch_kl=m["mismatch_kl"],
                       mismatch_kl_current=m["mismatch_kl_current"],
                       stale_dropped=round(m["stale_frac"] * m["action_tokens"]),
                       failed_attempts=pool["failed_attempts"],
                       timed_out_attempts=pool["timed_out_attempts"],
                       dropped_groups=pool["dropped_groups"],
                       engine_restarts=rollout.router.restarts,
                       tokens_per_s=sum(r["action_tokens"] for r in records) / step_time,
                       step_time_s=step_time, response_tokens=sum(r["action_tokens"]
                                           for r in records) / max(len(rewards), 1),
                       batch_wait_s=t_batch - t0, sync_s=m["sync_s"],
                       # colocated: the engine's sleep and wake; the rest of the step is idle_s
                       **(dict(sleep_s=m["sleep_s"], wake_s=m["wake_s"], idle_s=step_time - (
                           t_batch - t0) - m["sleep_s"] - m["train_step_s"] - (m["sync_s"] or 0))
                          if colocated else {}),
                       engine_idle=rollout.router.idle_fraction(),
                       staleness=mean_staleness(records, trained),
                       attempts=len(rewards), segments=len(records))
            # every number the loss and the step report: loss, entropy, kl_ref, clip, dual-clip
            # and importance-mask fractions, advantage statistics, grad_norm, lr, skipped
            row.update({k: v for k, v in m.items() if k not in row
                        and (v is None or isinstance(v, (int, float)))},
                       **runlog.info_means(records))
            row.update(evaluate(rollout, cfg, policy_version, evals))  # after step_time: eval_s
            runlog.log_step(out_dir, row, writer)
            rollout.router.reset_idle_clock()
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", step_s=f"{step_time:.1f}",
                            stale=f"{row['staleness']:.2f}", tok_s=f"{row['tokens_per_s']:.0f}",
                            refresh=False)
        bar.update(1)
        # the prompts drawn so far (rank 0 draws them): a resumed run's pool goes on from there
        checkpoint_if_due(cfg, model, optimizer, step, extra={
            "policy_version": policy_version,
            "data_position": rollout.pool.prompts_drawn if rank == 0 else 0})
    bar.close()
    sender.close()
    loop.close()
    if rank == 0:
        runlog.plot_metrics(out_dir)
        writer and writer.close()
    return evals


def mean_staleness(records, trained):
    """Over the segments that generated tokens: the versions between the policy that sampled a
    segment's oldest token and `trained`, the one training on it."""
    generated = [r for r in records if r["action_tokens"]]
    return sum(trained - r["min_version"] for r in generated) / max(len(generated), 1)


def rl_step(rollout, loop, sender, model, optimizer, records, cfg, lcfg, policy_version, step, rank,
            world, reference=None):
    """One RL step of every rank on rank 0's batch `records`: advantages and this rank's segments
    (share_batch), the train step, the viewer's sample, and unless the step was skipped
    (non-finite gradients: no weight changed) a new policy version synced to the engines. Returns
    train_step's metrics with the new policy_version and sync_s (seconds; None: no sync).
    placement="colocated": the engine sleeps through the train step and the sync wakes it (after a
    skipped step too: asleep it dropped its weights); the metrics then hold sleep_s and wake_s."""
    import weights_sync
    sleep_s, colocated = 0.0, cfg["placement"] == "colocated"
    if rank == 0 and colocated:  # the GPU to the trainer
        sleep_s = loop.run_until_complete(weights_sync.sleep_engines(rollout.engines))
        rollout.wake_s = 0.0
    segments, advantages = share_batch(records, cfg, rank, world)
    m = train_step(model, optimizer,
                   pack_microbatches(segments, advantages, cfg["microbatch_tokens"]), cfg, lcfg,
                   policy_version, step, reference=reference)
    if rank == 0 and rollout.recorder:
        rollout.recorder.add(step, records, segments, advantages, m["logprobs"])
    m["policy_version"] = policy_version + (not m["skipped"])
    # colocated, the sync wakes the engine, whose weights were dropped asleep: it runs each step
    if not m["skipped"] or colocated:
        m["sync_s"] = push_weights(rollout, loop, sender, model, m["policy_version"], rank, world,
                                   asleep=colocated)
    else:
        m["sync_s"] = None
    if rank == 0 and colocated:
        m["sleep_s"], m["wake_s"] = sleep_s, rollout.wake_s
    if cfg["speculative_tokens"] and rank == 0 and rollout.drafts:  # the rollouts behind this step
        (accepted, drafted), rollout.drafts = rollout.drafts, None
        m["draft_acceptance"] = accepted / max(drafted, 1)
    return m


def evaluate(rollout, cfg, v, evals):
    """Rank 0, when evaluation is due at policy version v (0, every eval_every, the last):
    the held-out prompts through the rollout pool at eval_temperature, on the weights the
    engines hold (the driver waits: no weight sync meanwhile). Results per prompt go to
    out_dir/eval_results.jsonl; the means to evals[v], and back ({}: not due)."""
    due = cfg["eval_every"] and (v % cfg["eval_every"] == 0 or v == cfg["max_steps"])
    if due and rollout.eval_prompts:
        sampling, evals[v] = dict(rollout.pool.sampling, temperature=cfg["eval_temperature"]), {}
        # the held-out prompts; with images, the ablation too: each image blank (same size, same
        # tokens), *_blank
        for tail, prompts in (("", rollout.eval_prompts), ("_blank", rollout.blank_prompts)):
            path = f"{cfg['out_dir']}/eval_results{tail}.jsonl"
            means = prompts and rollout.pool.evaluate(prompts, sampling, path, v)
            evals[v].update({k + tail: x for k, x in (means or {}).items()})
        return evals[v]
    return {}


def sft(cfg, model, optimizer, step, rank, world):
    """A supervised run: max_steps optimizer steps of loss.sft_loss on sft_data's
    transcripts (their assistant turns), groups_per_batch x group_size transcripts a
    step in one seeded order, again each epoch (every rank renders them all and trains
    on its share). Returns out_dir/hf, an HF directory for a later run's model_path."""
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from agentrl import load_transcripts, transcript_tokens
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    # a VLM's transcripts: each image's placeholder expanded
    # to its tokens, the images patched per step (with_pixels)
    rows = [vl.transcript_images(*transcript_tokens(r, tokenizer), r["messages"], cfg["model_path"])
            for r in load_transcripts(cfg["sft_data"])]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg["seed"])).tolist()
    batch, writer = cfg["groups_per_batch"] * cfg["group_size"], runlog.scalar_writer(cfg, rank)
    for step in tqdm(range(step, cfg["max_steps"]), initial=step, total=cfg["max_steps"],
                     disable=rank != 0):
        t0 = time.perf_counter()
        # the cp_size ranks of a context-parallel group share their transcripts (train_step cuts
        # each row)
        picks = [rows[order[(step * batch + i) % len(rows)]] for i in range(batch)][
            rank // cfg["cp_size"]::world // cfg["cp_size"]]
        segments = [vl.with_pixels(
            dict(token_ids=ids, action_mask=mask, behavior_logprobs=[0.0] * len(ids),
                 token_versions=[0] * len(ids), routed_experts=None, images=images),
            cfg["model_path"]) for ids, mask, images in picks]
        m = train_step(model, optimizer,
                       pack_microbatches(segments, [0.0] * len(segments), cfg["microbatch_tokens"]),
                       cfg, None, step, step, sft=True)
        if rank == 0:
            runlog.log_step(cfg["out_dir"], dict(step=step + 1, loss=m["loss"],
                                                 grad_norm=m["grad_norm"], lr=m["lr"],
                                          kept_tokens=m["kept_tokens"],
                                          step_time_s=time.perf_counter() - t0), writer)
        checkpoint_if_due(cfg, model, optimizer, step)
    if rank == 0:
        runlog.plot_metrics(cfg["out_dir"])
    return export_hf(model, os.path.join(cfg["out_dir"], "hf"), source_dir=cfg["model_path"])


def checkpoint_if_due(cfg, model, optimizer, step, extra=None):
    """After step `step` (from 0): a checkpoint every
    checkpoint_every steps, and at the last step."""
    if (step + 1) % cfg["checkpoint_every"] == 0 or step + 1 == cfg["max_steps"]:
        save_checkpoint(cfg["out_dir"], model, optimizer, step + 1, cfg, extra=extra)


def build_trainer(cfg, world, device):
    """The sharded model and its optimizer, from the last checkpoint in
    out_dir when cfg["resume"]. Returns (model, optimizer, step, extra): extra
    is what save_checkpoint recorded beside the step ({} for a fresh run)."""
    meshes = build_meshes(world, cfg["ep_size"], device.type, cfg["cp_size"])
    model = build_model(cfg, meshes, device, weights_path=cfg["model_path"])
    optimizer = build_optimizer(model, cfg)
    if not cfg["resume"]:
        return model, optimizer, 0, {}
    path = latest_checkpoint(cfg["out_dir"])
    step, extra = load_checkpoint(path, model, optimizer)
    print0(f"resumed from {path} at step {step}")
    return model, optimizer, step, extra


def build_reference(cfg, model, device):
    """The KL penalty's reference policy (kl_coef > 0; else None): the initial
    weights. Under LoRA the model itself, its frozen base (train_step turns the
    adapters off: lora.base_only), at no memory; else a frozen copy of model_path's
    weights in param_dtype, sharded like the model (the dry run counts it)."""
    if not cfg["kl_coef"] or cfg["lora_rank"]:
        return model if cfg["kl_coef"] else None
    return build_model(dict(cfg, train_vision=False), model.meshes, device,
                       weights_path=cfg["model_path"], frozen=True)


# -----------------------------------------------------------------------------
# the driver's plumbing: Ray, engines, capture server and rollout
# pool on rank 0; every rank trains on its share of each batch


def start_local_ray(**options):
    """ray.init(**options) for a new local cluster, started a second time when the first misses Ray's fixed 30 s
    wait for its raylet (a loaded machine can: a 2-core one running make test's two workers did)."""
    import ray
    try:
        ray.init(**options)
    except Exception as e:
        if "timed out during startup" not in str(e):
            raise
        print(f"Ray's local cluster did not start ({e}); starting it again", file=sys.stderr)
        ray.shutdown()
        ray.init(**options)


def connect_ray(cfg, rank, world):
    """Rank 0 joins the cluster named by RAY_ADDRESS (torchrun.sh sets it on
    clusters) or starts a local one; the other ranks join rank 0's. On a CPU
    machine the local cluster gets one logical CPU per engine plus one."""
    address = None
    if rank == 0:
        import ray
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address="auto", include_dashboard=False)
        else:
            gpus = torch.cuda.device_count()
            start_local_ray(num_cpus=max(os.cpu_count() or 1, cfg["num_engines"] + 1) if gpus
                            else cfg["num_engines"] + 1,
                            # colocated: the one GPU the trainer has (in CUDA_VISIBLE_DEVICES' order)
                            num_gpus=1 if cfg["placement"] == "colocated" else gpus,
                            include_dashboard=False,
                            # experiences of the tiny run are a few MB
                            object_store_memory=None if gpus else 1 << 30)
        # a local cluster wants a token (in ~/.ray/auth_token) and
        # ray.init switched on token mode in this process's environment
        # only: the other ranks need that switch before they import ray
        address = (ray.get_runtime_context().gcs_address,
                   {k: v for k, v in os.environ.items()
                    if k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")})
    address, auth = from_rank0(address, world)
    if rank != 0:
        os.environ.update(auth)  # before the first `import ray`: Ray reads its auth mode at import
        import ray
        ray.init(address=address)
    return ray


@dataclasses.dataclass
class Rollout:
    """Rank 0's rollout side of a run (start_rollout starts it, stop_rollout stops it)."""
    router: object  # rollout.Router: requests to the engines, their restarts, the weight group
    engines: list = dataclasses.field(default_factory=list)  # the engine actors
    server: object = None  # capture.CaptureServer, in a background thread
    pool: object = None  # rollout.RolloutPool of agent attempts (train() starts it)
    placement: list = dataclasses.field(default_factory=list)  # placement groups, kept for the run
    eval_prompts: list = dataclasses.field(default_factory=list)  # held out ([]: no evaluation)
    blank_prompts: list = dataclasses.field(default_factory=list)  # the same, images blank
    recorder: object = None  # viewer.Recorder (None: view_groups_per_step 0)
    view: object = None  # the live viewer page's server (None: view_port 0)
    cleanup: object = None  # stops what the agent's setup started, and the viewer
    drafts: tuple = None  # (accepted, drafted): the engines' MTP drafts since the last sync
    wake_s: float = 0.0  # placement="colocated": seconds the last sync spent waking the engines


def start_rollout(cfg, engines=None, trainer_gpus=None, data_position=0):
    """Rank 0: the engines (unless given; placed away from the trainer's
    GPUs), the router, the capture server in a background thread, and the
    rollout pool for the agent module and its prompts (train() starts it)."""
    import capture
    import rollout
    import viewer  # the web server's packages: the trainer alone (bench.py train) needs none
    from agentrl import load_agent, load_prompts, read_prompts, setup_agent
    placement = []
    if engines is None:
        # torchrun's GPUs, unknown to Ray
        placement.append(rollout.reserve_trainer_gpus(trainer_gpus))
        options = plan.engine_options(cfg)
        if options.get("lora_path"):  # a fresh engine serves the adapter
                                      # at zero until its first sync
            lora.write_zero_adapter(options["lora_path"], plan.planned_model_config(cfg), cfg)
        engines, engine_pg = rollout.start_engines(cfg["model_path"], cfg["num_engines"],
                                                   seed=cfg["seed"], **options)
        placement.append(engine_pg)
        rollout.check_engine_gpus(engines, trainer_gpus)
    router = rollout.Router(engines)
    router.mark_connected([])  # the first weight sync forms the weight group
    server = capture.CaptureServer(router, cfg["model_path"],
                                   max_model_len=cfg["engine_max_model_len"],
                                   importance_correction=cfg["is_level"] != "none",
                                   constrained_tokens=cfg["constrained_tokens"],
                                   max_images_per_prompt=cfg["max_images_per_prompt"])
    server.start_in_thread()
    run_agent, agent_prompts = load_agent(cfg["agent"])
    cleanup = setup_agent(run_agent, cfg)  # what the agent needs beside the
                                           # policy (a judge's engine, ...)
    if cfg["prompts"]:
        prompts = read_prompts(cfg["prompts"], seed=cfg["seed"], row_map=run_agent.prompt_from_row)
    elif agent_prompts is not None:  # seeded, when it takes a seed
        prompts = agent_prompts(**{"seed": cfg["seed"]}
                                if "seed" in inspect.signature(agent_prompts).parameters else {})
    else:
        raise ConfigError("no prompts: set `prompts` to a JSONL file, or export prompts() from "
                          f"{cfg['agent']}")
    # held out: a file of its own, or the agent module's split that prompts() never yields
    held_out = list(load_prompts(cfg["eval_prompts"],
                                 run_agent.prompt_from_row)) if cfg["eval_prompts"] else (
                                     run_agent.eval_prompts or list)()
    writer = None
    if cfg["save_trajectories"]:
        path = os.path.join(cfg["out_dir"], "trajectories.jsonl")
        writer = lambda segments: capture.write_trajectories(path, segments, server.tokenizer)  # noqa: E731
    pool = rollout.RolloutPool(
        run_agent, prompts, server, group_size=cfg["group_size"],
        groups_per_batch=cfg["groups_per_batch"], groups_in_flight=cfg["groups_in_flight"],
        attempt_timeout_s=cfg["attempt_timeout_s"],
        failed_group_rule=cfg["failed_group_rule"], model_name=server.model_name,
        trajectory_writer=writer,
        max_failed_in_a_row=cfg["max_failed_rounds"] * cfg["groups_in_flight"] * cfg["group_size"],
        first_prompt=data_position, sampling=dict(temperature=cfg["temperature"],
                                                  top_p=cfg["top_p"], max_tokens=cfg["max_tokens"]))
    blank = [vl.blank_images(p) for p in held_out] if cfg["eval_every"] else []
    # the viewer's sample (recorder) and live page (view), as the view_* keys ask; its cleanup stops
    # them too
    return Rollout(router, engines=engines, server=server, pool=pool, placement=placement,
                   eval_prompts=held_out if cfg["eval_every"] else [],
                   blank_prompts=blank if blank != held_out else [], **viewer.start(cfg, cleanup))


def stop_rollout(rollout):
    """Stop the pool, the capture server and what the agent's setup started (the engines stay: Ray
    ends them with the driver)."""
    rollout.pool.stop()
    rollout.server.stop_thread()
    rollout.cleanup()


def share_batch(records, cfg, rank, world):
    """Rank 0: advantages per attempt (counted once across its segments),
    then the segments split over ranks by tokens. Every rank: its own
    segments fetched from the object store, with their advantages."""
    import ray
    import rollout
    shards = None
    distill = cfg["advantage_estimator"] == "distill"
    if rank == 0:
        # distill: dense per-token advantages, computed below from each segment's teacher logprobs
        advantages = [0.0] * len(records) if distill else loss.segment_advantages(
            [r["attempt_id"] for r in records], [r["group_id"] for r in records],
            [r["reward"] for r in records], cfg["advantage_estimator"])
        with_tokens = [dict(r, advantage=float(a)) for r, a in zip(records, advantages)
                       if r["ref"] is not None]
        # ray's pickler, not plain pickle: an object ref must
        # carry its owner to be fetched by another process
        data_ranks = world // cfg["cp_size"]
        shards = ray.cloudpickle.dumps(rollout.balance_by_tokens(with_tokens, data_ranks))
    # the cp_size ranks of a context-parallel group share their segments (context.split_microbatch
    # cuts them)
    mine = ray.cloudpickle.loads(from_rank0(shards, world))[rank // cfg["cp_size"]]
    segments = ray.get([r["ref"] for r in mine])  # the only copy of token data
                                                  # that reaches this rank
    # the object store hands out read-only views; torch
    # wants arrays it may write (a copy of a few KB each)
    segments = [{k: v.copy() if hasattr(v, "copy") else v for k, v in s.items()} for s in segments]
    # this rank decodes its own images only
    segments = [vl.with_pixels(s, cfg["model_path"]) for s in segments]
    if not distill:
        return segments, [r["advantage"] for r in mine]
    advantages = []  # on-policy distillation: reverse KL to the teacher
                     # on every generated token, (T,) per segment
    for s in segments:
        if s.get("teacher_logprobs") is None:
            raise ConfigError(
                "advantage_estimator='distill' needs the agent to return "
                "Result.info['teacher_logprobs'] "
                f"per segment (see agents/distill.py); {cfg['agent']} did not")
        advantages.append(loss.distill_token_rewards(torch.from_numpy(s["behavior_logprobs"]),
                                                     torch.from_numpy(s["teacher_logprobs"])))
    return segments, advantages


def pack_microbatches(segments, advantages, microbatch_tokens):
    """Segments sorted by length into microbatches of at most microbatch_tokens padded
    tokens (one longer segment gets its own); segment_rows: which segment each row holds.
    A rank with no segment trains on one empty row, so that it joins the collectives."""
    if not segments:
        segments, advantages = [
            dict(token_ids=[0, 0], action_mask=[0, 0], behavior_logprobs=[0.0, 0.0],
                 token_versions=[-1, -1], routed_experts=None)], [0.0]
    order = sorted(range(len(segments)), key=lambda i: len(segments[i]["token_ids"]))
    groups, current = [], []
    for i in order:
        if current and (len(current) + 1) * len(segments[i]["token_ids"]) > microbatch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    return [dict(collate([segments[i] for i in g], [advantages[i] for i in g]), segment_rows=g)
            for g in groups]


def push_weights(rollout, loop, sender, model, policy_version, rank, world, asleep=False):
    """Weight sync to the engines that are up; an engine restarted since the
    last sync first rejoins the weight group. Every rank takes part (rank 0
    sends, the others join the gathers). asleep: the engines sleep (rl_step, colocated) and the
    sync wakes them. Returns seconds, or None (skipped)."""
    import ray
    import weights_sync
    live = None
    if rank == 0:
        live, changed = rollout.router.live_engines()
        if live and changed:
            # engines reach it
            host = "127.0.0.1" if len(ray.nodes()) == 1 else ray.util.get_node_ip_address()
            loop.run_until_complete(
                weights_sync.connect_engines(live, sender, host=host, timeout_s=300))
            rollout.router.mark_connected(live)
    if not from_rank0(bool(live), world):  # every engine is restarting: they get
                                           # these weights at the next step's sync
        return None
    t0 = time.perf_counter()
    try:
        out = loop.run_until_complete(weights_sync.sync_weights(live, sender, model, policy_version,
                                                                asleep=asleep and rank == 0))
        if rank == 0:
            rollout.drafts, rollout.wake_s = out.get("drafts"), out["wake_s"]
    except ray.exceptions.RayActorError as e:  # an engine died during the sync:
                                               # it rejoins after its restart
        print0(f"weight sync at version {policy_version} lost an engine ({type(e).__name__}); the "
               "run goes on")
        rollout.router.mark_connected([])
    return time.perf_counter() - t0


# -----------------------------------------------------------------------------
# train step: optimizer, learning-rate schedule,
# microbatches, window-normalized loss, clipping, the step


def build_optimizer(model, cfg):
    """AdamW over the sharded parameters (fp32 master weights: FSDP keeps the sharded params in
    fp32). Experts and dense weights live on different meshes, so they are separate param groups
    (foreach kernels stay per mesh). With cpu_offload_optimizer the shards, their gradients and
    the Adam state stay in host memory (FSDP's CPUOffloadPolicy) and the step runs on the CPU."""
    # LoRA: the adapters only
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    experts = [p for n, p in trainable if is_stacked_experts(n)]
    dense = [p for n, p in trainable if not is_stacked_experts(n)]
    groups = [{"params": dense}] + ([{"params": experts}] if experts else [])
    # fused: one kernel per group, on the GPU and on the CPU (offloaded state),
    # and experts.AdamW's one per large CUDA tensor; both take the clipping factor
    return AdamW(groups, lr=cfg[lora.learning_rate_key(cfg)], betas=(cfg["beta1"], cfg["beta2"]),
                 eps=cfg["adam_eps"], weight_decay=cfg["weight_decay"], fused=True)


def learning_rate_at(step, cfg):
    """Linear warm-up to learning_rate (lora_learning_rate for LoRA)
    over warmup_steps, then cosine decay to min_lr at max_steps."""
    lr, min_lr, warmup, total = cfg[lora.learning_rate_key(cfg)], cfg["min_lr"], cfg["warmup_steps"], cfg["max_steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def collate(segments, advantages, pad_id=0):
    """Recorded segments (dicts with token_ids, action_mask, behavior_logprobs, token_versions,
    routed_experts) and one advantage each (a float, or a (T,) tensor of per-token advantages)
    -> one right-padded microbatch. Position t predicts token t + 1, so every per-token field is
    the segment's shifted by one; routed_experts stay with the input tokens that were routed."""
    B, T = len(segments), max(len(s["token_ids"]) for s in segments) - 1
    per_token = any(torch.is_tensor(a) for a in advantages)
    with_routes = all(s.get("routed_experts") is not None for s in segments)
    L, K = (len(segments[0]["routed_experts"][0]),
            len(segments[0]["routed_experts"][0][0])) if with_routes else (0, 0)
    mb = dict(input_ids=torch.full((B, T), pad_id, dtype=torch.long),
              targets=torch.full((B, T), pad_id, dtype=torch.long),
              action_mask=torch.zeros(B, T), behavior_logprobs=torch.zeros(B, T),
              real=torch.zeros(B, T), token_versions=torch.full((B, T), -1, dtype=torch.long),
              advantages=torch.zeros(B, T) if per_token
              else torch.as_tensor(advantages, dtype=torch.float32).reshape(B),
              routed_experts=torch.zeros(B, T, L, K, dtype=torch.long) if with_routes else None)
    for i, (s, a) in enumerate(zip(segments, advantages)):
        n = len(s["token_ids"]) - 1
        ids = torch.as_tensor(s["token_ids"], dtype=torch.long)
        mb["input_ids"][i, :n], mb["targets"][i, :n], mb["real"][i, :n] = ids[:-1], ids[1:], 1.0
        for k in ("action_mask", "behavior_logprobs", "token_versions"):
            mb[k][i, :n] = torch.as_tensor(s[k][1:], dtype=mb[k].dtype)
        if per_token:  # shifted by one, as every per-token field
            a = torch.as_tensor(a, dtype=torch.float32).reshape(-1)
            mb["advantages"][i, :len(a) - 1] = a[1:] if len(a) > 1 else 0.0
        if with_routes:
            mb["routed_experts"][i, :n] = torch.as_tensor(s["routed_experts"][:n], dtype=torch.long)
    return dict(mb, **vl.collate_images(segments))


def empty_microbatch(like):
    """A 1-token microbatch with nothing to learn from: ranks with fewer microbatches run these
    so that every rank takes part in the same number of FSDP and expert-parallel collectives."""
    return {k: (torch.zeros_like(v[:1, :1] if v.dim() > 1 else v[:1]) if torch.is_tensor(v) else v)
            for k, v in like.items() if k not in (*vl.IMAGE_FIELDS, "segment_rows")}


def microbatch_logprobs(model, mb, cfg, with_entropy=False, mtp_tokens=None):
    """The trainer's logprob of each target (B, T), with routing
    replay when mb carries routed_experts (and entropy, or None);
    given mtp_tokens, also mtp_loss's share of this microbatch."""
    # (B, T, D)
    hidden = model.hidden_states(mb["input_ids"], routed_experts=mb.get("routed_experts"),
                                 pixel_values=mb.get("pixel_values"),
                                 image_grid_thw=mb.get("image_grid_thw"),
                                 positions=mb.get("positions"))
    lm_head = model.lm_head.weight  # unsharded: the root FSDP unit keeps
                                    # its params gathered after forward
    # nothing to keep them for under no_grad
    keep = cfg["logprob_keep_logits"] and torch.is_grad_enabled()
    out = loss.token_logprobs(hidden, lm_head, mb["targets"], cfg["temperature"],
                              cfg["logprob_chunk_size"], with_entropy=with_entropy, keep_logits=keep)
    return out if mtp_tokens is None else (
        *out, mtp_loss(model, hidden, mb, mtp_tokens, cfg["logprob_chunk_size"]))


def mtp_loss(model, hidden, mb, mtp_tokens, chunk_size=1024):
    """MTP training (mtp_loss_coef): the MTP head's cross-entropy of token t + 2 from
    the trunk's hidden state at t and the embedding of token t + 1, summed where token
    t + 2 is in the row's segment (mtp_mask) and divided by mtp_tokens, that count over
    the window. The trunk, embeddings and lm_head are detached: only mtp.* learn."""
    h = model.mtp_hidden(hidden, mb["targets"])  # t predicts targets[t + 1], the token t + 2
    # under context parallelism the split made that target before cutting the row
    # (context.split_microbatch)
    if "mtp_targets" in mb:
        targets = mb["mtp_targets"]
    else:
        h, targets = h[:, :-1], mb["targets"][:, 1:]
    logprobs = loss.token_logprobs(h, model.lm_head.weight.detach(), targets, 1.0, chunk_size)[0]
    return -(logprobs * mtp_mask(mb)).sum() / mtp_tokens.clamp(min=1)


def mtp_mask(mb):  # collate's real tokens; packed rows
                   # (segment_ids): never across a segment boundary
    if "mtp_real" in mb:  # context parallelism: made before the row was cut
        return mb["mtp_real"]
    seg = mb.get("segment_ids")
    return mb["real"][:, 1:] * (1 if seg is None else seg[:, 1:] == seg[:, :-1])


@torch.no_grad()
def clip_grad_norm(model, max_norm, device, optimizer):
    """Total gradient norm over every shard of every parameter, then scale to max_norm (0 =
    never scale). Dense weights are sharded over all ranks and experts over ep x expert_fsdp
    ranks, so each gradient element lives on exactly one rank: the sum of squares of the
    local shards, summed over all ranks, is the global one. One all-reduce; the result stays
    on the device (no host sync here). With a fused optimizer the gradients are not
    rewritten: its step divides each one by `grad_scale` as it reads it (the hook
    torch.amp.GradScaler uses), which saves a read and a write of every gradient."""
    local = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    # .to(device): with cpu_offload_optimizer the gradients
    # are in host memory, the all-reduce on the GPU
    sq = torch.stack(torch._foreach_norm(local)).float().pow(2).sum().to(device) if local else torch.zeros((), device=device)
    dist.all_reduce(sq)
    norm = sq.sqrt()
    optimizer.grad_scale = None
    if max_norm > 0 and local:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0).to(local[0].device)
        if optimizer.defaults.get("fused"):
            optimizer.grad_scale = 1.0 / scale
        else:
            torch._foreach_mul_(local, scale)
    return norm


def train_step(model, optimizer, microbatches, cfg, lcfg, policy_version, step=None, sft=False,
               reference=None):
    """One optimizer step over this rank's microbatches of the window. Returns metrics (floats,
    same on all ranks). lcfg: the loss's options (loss.LossConfig: plan.loss_config(cfg), resolved
    once per run). sft=True: the supervised objective instead (loss.sft_loss: the mean NLL of the
    action-mask tokens, at temperature 1), which reads no loss option (lcfg may be None).

    microbatches: dicts of right-padded tensors (B, T): input_ids, targets (input_ids
    shifted by one), action_mask, behavior_logprobs, token_versions, advantages (B,) or
    (B, T), and routed_experts (B, T, L_moe, K) or None (see `collate`). With kl_coef > 0,
    `reference` (build_reference) gives each microbatch its ref_logprobs in a no-grad
    forward on its own routing. The loss is normalized by the window's kept-token count,
    all-reduced before the first backward, and gradients are summed over ranks
    (shard_model), so the step is the same however the window is split into microbatches
    and ranks. "logprobs": (segment_rows, the trainer's logprobs (B, T), detached) of each
    microbatch from pack_microbatches, for the viewer's sample (viewer.Recorder.add).
    """
    t0, graphs = time.perf_counter(), dynamo_counters["stats"]["unique_graphs"]
    step = policy_version if step is None else step
    device = compute_device()
    if not microbatches:
        raise ValueError("train_step needs at least one microbatch on every rank")
    # every rank runs the same number of forward/backward
    # passes (FSDP and all-to-all are collectives)
    n = torch.tensor(len(microbatches), device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)  # NOTE: a host sync (.item() below), once per step
    microbatches = list(microbatches) + [empty_microbatch(microbatches[0])] * (
        int(n.item()) - len(microbatches))
    microbatches = [{k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k,
                     v in mb.items()}
                    for mb in microbatches]
    # context parallelism: this rank's pieces of every row; counts and losses sum disjoint slices
    if model.context_parallel is not None:
        microbatches = [split_microbatch(mb, model.context_parallel) for mb in microbatches]

    model.train()
    if not sft and lcfg.kl_coef and reference is not None:
        with torch.no_grad(), lora.base_only(reference):
            for mb in microbatches:
                mb["ref_logprobs"] = microbatch_logprobs(reference, dict(mb, routed_experts=None),
                                                         cfg)[0]
        if reference is not model:  # FSDP2 leaves the root unit gathered after
                                    # a forward, and on one rank every unit
            for unit in (u for u in reference.modules() if isinstance(u, FSDPModule)):
                unit.reshard()
    old_logprobs = [None] * len(microbatches)
    # rejection needs the trainer's logprobs first
    if not sft and lcfg.is_mode == "mask" and lcfg.is_level != "none":
        with torch.no_grad():
            old_logprobs = [microbatch_logprobs(model, mb, cfg)[0] for mb in microbatches]
    kept = [mb["action_mask"].bool() if sft
            else loss.kept_token_mask(old, mb["behavior_logprobs"], mb["action_mask"],
            mb["token_versions"], policy_version, lcfg) for old,
            mb in zip(old_logprobs, microbatches)]
    window_tokens = loss.count_window_tokens(kept)  # one all-reduce, before the first backward
    with_mtp, entropy = not sft and lcfg.mtp_loss_coef, not sft and lcfg.entropy_coef > 0
    mtp = loss.count_window_tokens([mtp_mask(mb) for mb in microbatches]) if with_mtp else None

    metrics, kept_logprobs = [], []
    for old, mb in zip(old_logprobs, microbatches):
        logprobs, entropy, *mtp_l = microbatch_logprobs(model, mb, dict(cfg, temperature=1.0) if sft
                                                        else cfg,
                                                        with_entropy=entropy, mtp_tokens=mtp)
        mb_loss, mb_metrics = loss.sft_loss(logprobs, mb["action_mask"],
                                            window_tokens) if sft else loss.policy_loss(
            logprobs, old, mb["behavior_logprobs"], mb["advantages"], mb["action_mask"],
            mb["token_versions"],
            policy_version, lcfg, window_tokens, dp_world_size=1,  # gradients are summed over ranks
            ref_logprobs=mb.get("ref_logprobs"), entropy=entropy)
        (mb_loss + lcfg.mtp_loss_coef * mtp_l[0] if mtp_l else mb_loss).backward()
        metrics.append(dict(mb_metrics, **{"mtp_loss_sum": mtp_l[0].detach()} if mtp_l else {}))
        # B x T floats kept until the step returns
        kept_logprobs.append((mb.get("segment_rows"), logprobs.detach()))

    # NOTE: host sync, once per step: the skip decision is made on the host
    grad_norm = clip_grad_norm(model, cfg["grad_clip"], device, optimizer).item()
    lr = learning_rate_at(step, cfg)
    skipped = not math.isfinite(grad_norm)
    if skipped:
        print0(f"step {step}: non-finite gradient norm ({grad_norm}); skipping the optimizer step")
    else:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # the experts' casts of the old weights (keep_experts_local's reuse): the next step casts anew;
    # kept, they would hold a compute-dtype copy of every expert until then (colocated: through
    # the engine's whole turn on the GPU)
    for m in model.modules():
        if hasattr(m, "release_casts"):
            m.release_casts()
    out = loss.reduce_metrics(metrics)
    tokens = torch.tensor(sum(mb["targets"].numel() for mb in microbatches), device=device)
    dist.all_reduce(tokens)
    out.update(grad_norm=grad_norm, lr=lr, skipped=skipped, window_tokens=int(window_tokens.item()),
               tokens=int(tokens.item()), train_step_s=time.perf_counter() - t0,
               # graphs torch.compile made in this step on this rank (CUDA): after the first
               # steps, a recompile, which is where a slow train_step_s went
               compiles=dynamo_counters["stats"]["unique_graphs"] - graphs, logprobs=kept_logprobs)
    return out


def from_rank0(obj, world):
    """Rank 0's `obj` on every rank (a collective: pickled and broadcast)."""
    box = [obj]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def compute_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def print0(*args):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


# -----------------------------------------------------------------------------
# parallelism: process group, device meshes, expert partition, fully_shard (expert-parallel dispatch
# and combine: experts.py)
#
# Ranks are laid out as rank = expert_fsdp_index * ep_size + ep_index, so an expert-parallel group is ep_size
# consecutive ranks (one node's NVLink domain when ep_size <= GPUs per node). Dense weights (attention, norms,
# router, embeddings) are FSDP-sharded over all ranks; each EP rank keeps E / ep_size experts, FSDP-sharded over
# the world / ep_size ranks that hold the same experts. Every element of every weight lives on exactly one rank.


def init_distributed(timeout_s=600):
    """Join torchrun's process group (or make a 1-rank one). Returns (rank,
    world, device): NCCL on CUDA, gloo on CPU. A collective that waits longer
    than timeout_s (a rank died or diverged) raises instead of hanging."""
    if "RANK" not in os.environ:  # plain `python train.py`: a group of one,
                                  # so the same code path runs everywhere
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                # NCCL: bind this rank's GPU now
                                device_id=device if backend == "nccl" else None)
    return rank, world, device


def build_meshes(world, ep_size, device_type, cp_size=1):
    """All device meshes of the trainer: `fsdp` (all ranks, dense weights),
    `experts` (ep x expert_fsdp, 2-D), and its two 1-D slices `ep`
    (dispatch/combine) and `expert_fsdp` (FSDP of the local experts); `cp` (None
    when cp_size is 1): the cp_size consecutive ranks that split each sequence,
    rank = data_index * cp_size + cp_index. ep_size and cp_size divide world (plan.check_config).
    CP needs nothing of FSDP or EP: its ranks hold the same weights as any other and different
    tokens, which the window normalization and the MoE dispatch take as they take tokens of
    different sequences."""
    fsdp = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    # mesh[ep_index, expert_fsdp_index] = expert_fsdp_index * ep_size +
    # ep_index; the ep dimension comes first so that a (Shard(0), FSDP's Shard)
    # DTensor over it is the global expert tensor in expert order (checkpoints)
    layout = torch.arange(world).view(world // ep_size, ep_size).T
    experts = DeviceMesh(device_type, layout, mesh_dim_names=("ep", "expert_fsdp"))
    groups = torch.arange(world).view(world // cp_size, cp_size)  # a row: a context-parallel group
    cp = DeviceMesh(device_type, groups, mesh_dim_names=("dp", "cp"))["cp"] if cp_size > 1 else None
    return {"fsdp": fsdp, "experts": experts, "ep": experts["ep"],
            "expert_fsdp": experts["expert_fsdp"], "cp": cp}


def meta_sharded_model(mcfg, meshes, cfg, frozen=False):
    """The model on the meta device with this rank's experts only (E / ep_size of each
    layer), fully_shard applied (frozen: all of it frozen in param_dtype, lora.apply)."""
    ep = meshes["ep"].get_group() if meshes["ep"].size() > 1 else None  # experts.dispatch's group
    cp = ContextParallel(meshes["cp"]) if meshes.get("cp") is not None else None
    with torch.device("meta"):
        model = lora.apply(Transformer(mcfg, expert_parallel=ep, context_parallel=cp), cfg, frozen)
    return shard_model(model, meshes, cfg)


def shard_model(model, meshes, cfg):
    """Every fully_shard call: experts on their own mesh first (or, on a one-rank expert mesh,
    kept outside FSDP: keep_experts_local), then each block, then the root (embeddings, final
    norm, lm_head). Mixed precision: compute in param_dtype, gradients reduced in fp32."""
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg["param_dtype"]),
                              reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cfg["cpu_offload_optimizer"] else OffloadPolicy()
    kw = dict(mp_policy=mp, offload_policy=offload)
    # one FSDP rank: nothing to gather, yet resharding after forward would
    # copy and cast every block's weights again for its backward; they stay
    # unsharded from forward to backward (plan_memory counts them all)
    if meshes["fsdp"].size() == 1:
        kw["reshard_after_forward"] = False
    local_experts = experts_skip_fsdp(meshes, cfg)
    kept = set()
    for block in [*model.model.layers, *(model.mtp.layers if model.mtp is not None else [])]:
        if block.is_moe and local_experts:
            keep_experts_local(block.mlp.experts, meshes["expert_fsdp"], mp.param_dtype,
                               reuse_casts=not cfg["activation_checkpointing"])
            kept |= set(block.mlp.experts.parameters())
        elif block.is_moe:  # its own FSDP unit on its own mesh: the
                            # block's unit must not gather the experts
            fully_shard(block.mlp.experts, mesh=meshes["expert_fsdp"],
                        shard_placement_fn=expert_placement(block.mlp.experts, meshes), **kw)
        fully_shard(block, mesh=meshes["fsdp"], ignored_params=kept or None, **kw)
    # before the root: units of its own
    vl.shard_vision(model, meshes["fsdp"], cfg["train_vision"], **kw)
    fully_shard(model, mesh=meshes["fsdp"], ignored_params=kept or None, **kw)
    register_fsdp_forward_method(model, "hidden_states")  # the trainer calls
                                                          # hidden_states, not forward
    # Gradients are SUMMED over ranks, never averaged: each rank's loss is already
    # divided by the window's global token count (loss.py's window normalization), so
    # the sum over ranks is the gradient of the window loss. force-sum also keeps the
    # reduction a plain SUM, which gloo needs (it has neither AVG nor PREMUL_SUM).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if not hasattr(module, "set_force_sum_reduction_for_comms"):
                raise RuntimeError(
                    f"torch {torch.__version__} has no "
                    "FSDPModule.set_force_sum_reduction_for_comms; "
                    "the trainer needs torch >= 2.9")
            module.set_force_sum_reduction_for_comms(True)
    model.meshes = meshes
    return model


def experts_skip_fsdp(meshes, cfg):
    """True when the expert FSDP mesh has one rank (ep_size = world): FSDP would have
    nothing to gather or reduce there, yet it would still copy and cast every expert
    weight at each forward and backward and its gradient once per microbatch (a sizable
    share of a 1-GPU step). Offloaded optimizer state keeps FSDP (it moves the shards)."""
    return meshes["expert_fsdp"].size() == 1 and not cfg["cpu_offload_optimizer"]


def keep_experts_local(experts, mesh, dtype, reuse_casts=False):
    """Experts outside FSDP, on a one-rank expert FSDP mesh: the weights stay fp32 DTensors
    on that mesh, as FSDP would leave them (checkpoints, clipping, the optimizer and the
    weight export see no difference), and each forward computes with a cast of them to the
    compute dtype (CastForCompute: its backward returns the gradient in fp32, or adds it
    into .grad); floating inputs are cast as FSDP's mixed precision casts them. Without
    activation checkpointing the casts stay alive until their layer's backward (plan_memory
    counts them), and with reuse_casts the later microbatches of a window reuse them (one
    cast per weight per step, not per microbatch: the weights change only at the optimizer
    step, and the end of forward, the peak, holds every layer's casts anyway); train_step
    releases them after the optimizer step (`experts.release_casts`). With fp8_experts each
    reused cast also keeps its e4m3 copies (forward's and transposed) for the window, so
    the weights are quantized once a step, not twice a microbatch; they go with the cast."""
    for name, p in list(experts.named_parameters()):  # the three projections, and their adapters
        setattr(experts, name,
                nn.Parameter(DTensor.from_local(p.data, mesh, [Shard(0)], run_check=False),
                                            requires_grad=p.requires_grad))
    casts = {}  # ids of the params cast together -> (their versions, the cast)

    def cast(*ws):  # one weight, or several stacked on dim 1 into one tensor (Experts.weights:
                    # gate and up) a cast is reused only within one window: the weights' gradients
                    # exist (a backward ran since train_step's zero_grad(set_to_none=True), which
                    # follows every optimizer step: the guard that matters, since the fused AdamW
                    # step leaves a DTensor parameter's version counter alone, seen on an H200)
                    # and no in-place write bumped a version counter since
        key, versions = tuple(map(id, ws)), [w._version for w in ws]
        kept = casts.get(key)
        if kept is not None and kept[0] == versions and all(w.grad is not None
                                                            for w in ws) and torch.is_grad_enabled():
            return kept[1]
        out = CastForCompute.apply(dtype, *ws)
        if reuse_casts and torch.is_grad_enabled():
            casts[key] = (versions, out)
            out.fp8_cache = {}  # fp8_experts: its e4m3 copies, made once (experts.fp8_weight)
        return out
    experts.cast_weights = cast
    experts.release_casts = casts.clear  # train_step, after the optimizer step: stale by then
    experts.register_forward_pre_hook(
        lambda module, args: tuple(a.to(dtype) if torch.is_floating_point(a) else a for a in args))


def expert_placement(experts, meshes):
    """FSDP cuts this rank's (E / ep, ...) expert tensors on dim 0 when the expert
    FSDP ranks divide E / ep, else on dim 1 where they divide it (FSDP2 cuts other
    dims evenly only). E.g. 1 expert per EP rank and 2 FSDP ranks: on dim 0 one rank
    would hold the whole expert and the other padding; on dim 1 each holds half."""
    n = meshes["expert_fsdp"].size()
    shapes = [getattr(experts, name).shape for name in EXPERT_PROJS]
    dim = 1 if shapes[0][0] % n and all(shape[1] % n == 0 for shape in shapes) else 0
    # an adapter's rank may not divide
    return lambda param: Shard(dim if param.shape[1] % n == 0 else 0)


def dry_run_main(cfg):
    """--dry_run=True: plan the run on paper, in seconds on a CPU for any world size. The model
    is built on the meta device and sharded by the code above against torch's fake process
    group of train_world_size ranks; rank 0's shards are measured (FSDP cuts like torch.chunk,
    so rank 0 holds the largest shard of every parameter: its figures are the per-GPU maximum)
    and plan.py turns them into memory, GPU counts and the sync volume. Nothing is allocated.
    Exits with one sentence when the run cannot fit or is inconsistent."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    try:
        mcfg = check_config(cfg, world_size=plan.launched_world_size())
        dist.init_process_group("fake", store=FakeStore(), rank=0,
                                world_size=cfg["train_world_size"])
        try:
            meshes = build_meshes(cfg["train_world_size"], cfg["ep_size"], "cpu", cfg["cp_size"])
            shards = plan.measure_shards(meta_sharded_model(mcfg, meshes, cfg))
        finally:
            dist.destroy_process_group()
        figures = plan.plan_run(cfg, mcfg, shards)
    except ConfigError as e:
        sys.exit(f"dry run: {e}")
    plan.print_plan(cfg, figures)
    return figures


def build_model(cfg, meshes, device, weights_path=None, model_config=None, init_std=0.02,
                frozen=False):
    """The sharded trainer model: built on the meta device, experts
    partitioned, fully_shard, then each rank materializes and fills only its
    own shards (from `weights_path`, an HF directory, or random init)."""
    mcfg = model_config if model_config is not None else load_config(weights_path)
    model = meta_sharded_model(mcfg, meshes, cfg, frozen)
    model.to_empty(device=device if not cfg["cpu_offload_optimizer"] else "cpu")
    if mcfg.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("tied embeddings came untied while materializing the sharded model")
    model.activation_checkpointing = cfg["activation_checkpointing"]
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        experts.fp8 = cfg["fp8_experts"]  # the grouped GEMMs in FP8 (experts.GroupedSwiGLU)
    # the tower's collectives: model.idle_vision
    model.vision_in_every_forward = dist.get_world_size() > 1
    if weights_path is not None:
        load_hf_weights(model, weights_path)
    else:
        generator = torch.Generator(model.lm_head.weight.device).manual_seed(
            cfg["seed"] + dist.get_rank())
        init_parameters(((n, local_tensor(p)) for n, p in model.named_parameters()), init_std,
                        generator, mcfg.family == "qwen3_5")
    for p, full in lora.initial_adapters(model, cfg["seed"]):
        copy_shard(p, full)
    return model


def deliver_lost_interrupts(unraisable, report=sys.unraisablehook):
    """sys.unraisablehook of `python train.py`. Python runs the SIGINT handler at the main
    thread's next bytecode, which may be inside a weakref callback or a __del__ (the import
    machinery's module locks, a finalizer the GC runs): a KeyboardInterrupt raised there cannot
    propagate, Python only reports it, and the run goes on as if Ctrl-C had never been pressed
    (seen with a SIGINT sent while the driver imports vLLM's parsers, after its engines start).
    Signal the main thread again, from a thread of its own once this hook has returned (raised
    inside the hook, the KeyboardInterrupt would be lost the same way); a real signal, unlike
    _thread.interrupt_main, also ends a blocking call such as a sleep or a lock's wait."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        return report(unraisable)
    threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()


if __name__ == "__main__":
    sys.unraisablehook = deliver_lost_interrupts
    main(sys.argv[1:])
    # NOTE: vLLM imports triton, whose bindings print hundreds of "nanobind:
    # leaked ..." lines while the interpreter tears down; everything is
    # written, closed and shut down by now, so leave without the teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
