"""
The whole RL loop on one GPU (placement="colocated"), run through bench.py:

    python bench.py loop                  # 1 GPU: Qwen3-30B-A3B dims, 4 layers, random weights
    python bench.py loop --dense=1        # 1 GPU: a dense Qwen3 of 1.7B (28 layers of hidden 2048)
    python bench.py loop --smoke          # CPU, the tiny model: the same code, the engine awake
                                          # (the CPU engine has no sleep mode; placement "separate")

The model has real shapes and random weights, the tiny tokenizer (its vocabulary: 2,048 tokens)
and the calculator task (agents/calculator.py: a verifiable reward). A random model rarely samples
its end token, so generations run to max_tokens. The loop is train.py's: the rollout pool, the
capture server, the engine as a Ray actor, rl_step (the engine asleep through the train step, the
in-place weight sync waking it). The figure: trained tokens (every token of the batch the trainer
steps on) per second of wall time, and where the wall time went. The ceiling, in the same run on
the same GPU: the engine's own generation throughput (the last batch's prompts, all at once, each
to the length the loop generated for it; no agents, no capture server) and the train step's
throughput on the batch's tokens (the engine asleep); `ratio` = the time those two would take
back to back on the timed steps' tokens / the steps' wall time. Memory: the GPU's used bytes
(every process), sampled every 20 ms, against the dry run's colocated peak (plan.plan_colocated).
"""
import asyncio
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
GiB = 2**30


class UsedMemory:
    """The most GPU memory in use (total - free: every process on the device) while it runs, in
    all and in each phase (`phase`, set by the caller), sampled every `period_s` in a thread
    (NOTE: each sample is a cudaMemGetInfo)."""

    def __init__(self, period_s=0.02):
        import torch
        self.peaks, self.phase, self.period_s, self.running = {}, None, period_s, True
        self.sample = lambda: (lambda free, total: total - free)(*torch.cuda.mem_get_info())
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            used, phase = self.sample(), self.phase
            self.peaks[phase] = max(self.peaks.get(phase, 0), used)
            time.sleep(self.period_s)

    def stop(self):
        self.running = False
        self.thread.join()
        return max(self.peaks.values(), default=0)  # the peak over every phase


def loop_model(layers, dense, smoke):
    """(model config, model directory): random weights in bf16 with the tiny tokenizer."""
    from bench_model import QWEN3_30B_A3B
    from model import ModelConfig
    from tiny import TINY_CONFIG, ensure_tiny_model
    if smoke:
        return TINY_CONFIG, ensure_tiny_model()
    vocab = dict(vocab_size=TINY_CONFIG.vocab_size)
    mcfg = ModelConfig(**vocab, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True) if dense else ModelConfig(
        **dict(QWEN3_30B_A3B, **vocab), num_hidden_layers=layers)
    path = os.path.join(ROOT, ".cache", f"bench-loop-{'dense-1.7b' if dense else f'moe-{layers}l'}")
    # built once, aside then renamed (a directory with config.json is whole); its weights may be
    # sharded, where ensure_tiny_model looks for model.safetensors alone
    if not os.path.isfile(os.path.join(path, "config.json")):
        ensure_tiny_model(path, cfg=mcfg)
    return mcfg, path


def bench_loop(layers=4, dense=0, max_tokens=1024, group_size=8, groups_per_batch=8,
               groups_in_flight=0, steps=4, warmup=1, memory_pct=30, smoke=0):
    """The whole loop on one GPU against its ceiling (module docstring). Options: --layers (the
    MoE's), --dense=1 (the dense 1.7B instead), --max_tokens per turn, --group_size,
    --groups_per_batch, --groups_in_flight (0: as many as groups_per_batch, every batch
    on-policy; more: the groups still open when a batch is taken go on after the sync, their
    tokens up to max_staleness versions old, and keep the engine's batch full while a batch's
    last attempts finish), --steps timed after --warmup, --memory_pct (engine_memory_fraction
    in percent), --smoke (CPU, the tiny model)."""
    opt = dict(locals())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import ray
    import torch
    import train
    import weights_sync
    from model import num_params
    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        sys.exit("bench.py loop needs a GPU; on CPU use --smoke")
    if smoke:
        max_tokens, group_size, groups_per_batch, steps, warmup = 16, 2, 2, 2, 1
        groups_in_flight = min(groups_in_flight, 3)
        opt.update(max_tokens=max_tokens, group_size=group_size,
                   groups_per_batch=groups_per_batch, steps=steps, warmup=warmup)
    groups_in_flight = opt["groups_in_flight"] = groups_in_flight or groups_per_batch
    if groups_in_flight < groups_per_batch:
        sys.exit(f"--groups_in_flight={groups_in_flight} is below --groups_per_batch="
                 f"{groups_per_batch}: a batch could never form")
    mcfg, path = loop_model(layers, dense, smoke)
    args = [f"--model_path={path}", "--agent=agents/calculator.py", f"--max_tokens={max_tokens}",
            f"--engine_max_model_len={2 * max_tokens + 512}", f"--group_size={group_size}",
            f"--groups_per_batch={groups_per_batch}", f"--groups_in_flight={groups_in_flight}",
            f"--max_steps={warmup + steps}", "--eval_every=0", "--view_groups_per_step=0",
            f"--microbatch_tokens={2 * max_tokens + 512}", "--attempt_timeout_s=1800.0",
            f"--engine_memory_fraction={memory_pct / 100}", "--learning_rate=1e-6",
            "--min_lr=1e-7", f"--out_dir={os.path.join(ROOT, '.cache', 'bench-loop-out')}"]
    if cuda:
        total = torch.cuda.mem_get_info()[1]
        args += ["--placement=colocated", "--param_dtype=bfloat16",
                 f"--gpu_memory_gib={total / GiB}"]
    cfg = train.configure(args)
    planned = train.dry_run_main(dict(cfg, dry_run=True)) if cuda else {}
    _, world, device = train.init_distributed()
    model, optimizer, _, _ = train.build_trainer(cfg, world, device)
    train.connect_ray(cfg, 0, world)
    rollout = train.start_rollout(cfg, trainer_gpus={})
    colocated = cfg["placement"] == "colocated"
    loop, sender = asyncio.new_event_loop(), weights_sync.WeightSender(in_place=colocated)
    lcfg, version = train.loss_config(cfg), 0
    train.push_weights(rollout, loop, sender, model, 0, 0, world)
    rollout.pool.start()
    rows, used = [], None
    try:
        for step in range(warmup + steps):
            if step == warmup and cuda:
                used = UsedMemory()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if used:
                used.phase = "generating"
            records = rollout.pool.next_batch(hold=colocated)
            t1 = time.perf_counter()
            if used:
                used.phase = "training and syncing"
            m = train.rl_step(rollout, loop, sender, model, optimizer, records, cfg, lcfg,
                              version, step, 0, world)
            if colocated and step + 1 < warmup + steps:
                rollout.pool.resume()
            trained, version = version, m["policy_version"]  # the version the step trained on
            wall = time.perf_counter() - t0
            sleep, wake = m.get("sleep_s", 0.0), m.get("wake_s", 0.0)  # colocated only
            sync = (m["sync_s"] or 0.0) - wake
            rows.append(dict(
                wall_s=wall, generate_s=t1 - t0, train_s=m["train_step_s"], sync_s=sync,
                sleep_s=sleep, wake_s=wake,
                idle_s=wall - (t1 - t0) - m["train_step_s"] - sync - sleep - wake,
                trained_tokens=m["tokens"],
                generated_tokens=sum(r["action_tokens"] for r in records),
                staleness=train.mean_staleness(records, trained),
                compiles=m["compiles"]))  # after the warm-up, a recompile (seconds of train_s)
            print(f"loop step {step}{' (warm-up)' if step < warmup else ''}: "
                  + ", ".join(f"{k} {v:.3g}" for k, v in rows[-1].items()), file=sys.stderr, flush=True)
        peak = used.stop() if used else 0
        rollout.pool.stop()  # no attempt competes with the ceiling's requests
        ceiling = measure_ceiling(rollout, loop, model, optimizer, records, cfg, lcfg, version,
                                  concurrency=groups_in_flight * group_size)
    finally:
        train.stop_rollout(rollout)
        sender.close()
        ray.shutdown()
        torch.distributed.destroy_process_group()
    timed = rows[warmup:]
    wall = sum(r["wall_s"] for r in timed)
    trained, generated = (sum(r[k] for r in timed) for k in ("trained_tokens", "generated_tokens"))
    back_to_back = (generated / ceiling["generate_tokens_per_s"]
                    + trained / ceiling["train_tokens_per_s"])
    split = {k.removesuffix("_s"): round(sum(r[k] for r in timed) / wall, 3)
             for k in ("generate_s", "train_s", "sync_s", "sleep_s", "wake_s", "idle_s")}
    result = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu", options=opt,
        params=num_params(mcfg), params_active=num_params(mcfg, active=True),
        placement=cfg["placement"], steps=len(timed),
        trained_tokens_per_s_per_gpu=round(trained / wall, 1),
        generated_tokens_per_s=round(generated / wall, 1),
        generated_tokens_per_attempt=round(generated / (len(timed) * groups_per_batch
                                                        * group_size), 1),
        step_s=round(wall / len(timed), 3), split=split,
        staleness=round(sum(r["staleness"] for r in timed) / len(timed), 3),
        compiles=sum(r["compiles"] for r in timed),
        ceiling={k: round(v, 1) for k, v in ceiling.items()},
        ratio=round(back_to_back / wall, 3))
    if cuda:
        result["memory"] = dict(
            peak_used_gib=round(peak / GiB, 2),
            planned_peak_gib=round(planned["coloc_peak_bytes"] / GiB, 2),
            planned_over_used=round(planned["coloc_peak_bytes"] / peak, 3),
            peak_used_by_phase_gib={k: round(v / GiB, 2) for k, v in used.peaks.items()},
            # the trainer's own share: what its tensors held at most, and its caching allocator
            trainer_peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GiB, 2),
            trainer_peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2))
    print(f"loop on one {'GPU' if cuda else 'CPU'}: {result['trained_tokens_per_s_per_gpu']:,} "
          f"trained tokens/s, split {split}; ceiling {result['ceiling']}; ratio {result['ratio']}")
    return result


def measure_ceiling(rollout, loop, model, optimizer, records, cfg, lcfg, version, concurrency):
    """The two phases alone on the last batch: the engine generating `concurrency` requests at
    once (the loop's: groups_in_flight x group_size), its segments' first prompts in turn, each
    for as many tokens as the segment holds (ignore_eos), then (the engine asleep when
    colocated) the train step on the batch's segments, twice, the second timed. Tokens per
    second of each. The engine is left asleep (the run ends)."""
    import ray
    import train
    import weights_sync
    segments, advantages = train.share_batch(records, cfg, 0, 1)
    # each segment's first prompt: its tokens before the first generated one (argmax: the first 1)
    prompts = [s["token_ids"][:s["action_mask"].argmax()].tolist() for s in segments]
    # as many tokens as the loop generated for it (its turns together): the same lengths
    lengths = [max(1, int(s["action_mask"].sum())) for s in segments]
    prompts, lengths = ([x[i % len(x)] for i in range(max(concurrency, len(x)))]
                        for x in (prompts, lengths))
    engine = rollout.engines[0]
    t0 = time.perf_counter()
    outs = ray.get([engine.generate.remote(p, dict(temperature=1.0, max_tokens=n, ignore_eos=True),
                                           f"ceiling-{i}")
                    for i, (p, n) in enumerate(zip(prompts, lengths))])
    generate = sum(len(o["token_ids"]) for o in outs) / (time.perf_counter() - t0)
    colocated = cfg["placement"] == "colocated"
    if colocated:
        loop.run_until_complete(weights_sync.sleep_engines(rollout.engines))
    for _ in range(2):  # the first warms the allocator, as the loop's warm-up steps did
        m = train.train_step(model, optimizer, train.pack_microbatches(
            segments, advantages, cfg["microbatch_tokens"]), cfg, lcfg, version)
    return dict(generate_tokens_per_s=generate, train_tokens_per_s=m["tokens"] / m["train_step_s"])


def bench_fp8learn(steps=40, seed=4, which=0, smoke=0):
    """The default run (`python train.py`: the tiny model, the calculator agent) on one GPU,
    colocated, twice with the same seed and prompts: rollouts from a bf16 engine, then from an FP8
    one (rollout_dtype="fp8": the engine's weights, and each sync, in e4m3 with block scales; the
    trainer bf16). For each: the held-out success (eval/success, greedy, the agent's held-out
    prompts) at version 0 and at the end, the train reward over the first and the last 5 steps,
    the mean mismatch KL (trainer vs the engine's sampling logprobs: FP8's is the larger, and the
    importance correction sees it) and the wall time. ratio = FP8's final held-out success /
    bf16's. --which=1 runs bf16 only, 2 FP8 only (the two in separate calls). --smoke: CPU, 2
    steps, both runs on the bf16 engine (the CPU has no FP8 matrix multiplies): the code path.

        python bench.py fp8learn              # one H100: two runs of 40 steps
    """
    import json
    import subprocess
    import tempfile
    import torch
    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        sys.exit("bench.py fp8learn needs a GPU with FP8 matrix multiplies; on CPU use --smoke")
    if smoke:
        steps = 2
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu", steps=steps, seed=seed,
                  engine_dtype={"bfloat16": "bfloat16", "fp8": "fp8" if cuda else "bfloat16"})
    for dtype in [d for i, d in enumerate(("bfloat16", "fp8"), 1) if which in (0, i)]:
        out = tempfile.mkdtemp(prefix=f"fp8learn-{dtype}-")
        args = [sys.executable, "train.py", f"--seed={seed}", f"--max_steps={steps}",
                f"--out_dir={out}", "--view_groups_per_step=0"]
        if cuda:
            args += ["--placement=colocated", f"--rollout_dtype={dtype}"]
        t0 = time.perf_counter()
        r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"the {dtype} run failed ({r.returncode}):\n{r.stderr[-4000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        evals = {row["policy_version"]: row["eval/success"] for row in rows if "eval/success" in row}
        rewards = [row["reward_mean"] for row in rows if "reward_mean" in row]
        kl = [row["mismatch_kl"] for row in rows if row.get("mismatch_kl") is not None]
        result[dtype] = dict(
            eval_success={v: round(s, 3) for v, s in sorted(evals.items())},
            reward_first5=round(sum(rewards[:5]) / len(rewards[:5]), 3),
            reward_last5=round(sum(rewards[-5:]) / len(rewards[-5:]), 3),
            mismatch_kl_mean=sum(kl) / len(kl) if kl else None, wall_s=round(time.perf_counter() - t0, 1))
        print(f"{dtype}: {result[dtype]}", file=sys.stderr, flush=True)
    if "bfloat16" in result and "fp8" in result:
        last = {d: result[d]["eval_success"][max(result[d]["eval_success"])] for d in ("bfloat16", "fp8")}
        result["ratio"] = round(last["fp8"] / last["bfloat16"], 3) if last["bfloat16"] else None
    result.setdefault("ratio", None)
    return result
