"""
Benchmarks. Each measures ours and a baseline side by side in the same run and
prints, as its last line, one JSON object with the figures and `ratio`. This file
holds the entry point and the system benchmarks (capture server, rollout, weight
sync, object store, logprobs); bench_model.py the model and trainer speed benchmarks.

    python bench.py logprobs     # chunked vs naive token logprobs: peak extra memory
    python bench.py capture      # agents through the capture server vs calling the engine directly
    python bench.py train        # our FSDP2+EP trainer vs transformers' Qwen3MoeForCausalLM under FSDP2 (GPU)
    python bench.py layer        # the MoE decoder layer alone (two layer counts): ours vs transformers, torchtitan (GPU)
    python bench.py async        # streaming rollout pool vs synchronous generate-then-train
    python bench.py sync         # trainer -> engine weight broadcast vs raw NCCL broadcast (2 GPUs)
    python bench.py lora         # grouped-GEMM experts with LoRA adapters on a frozen base vs full fine-tuning (GPU)
    python bench.py objectstore  # image trajectories to trainer ranks by ref vs gathered in the driver: driver memory
    python bench.py spec         # MTP drafting vs none on the tiny hybrid: tokens/s, acceptance (CPU)
    python bench.py vl           # our Qwen3-VL-MoE forward/backward vs transformers' (1 GPU): parity, tokens/s
    python bench.py loop         # the whole RL loop on one GPU (colocated) vs its ceiling
    python bench.py fp8learn     # the default run on one GPU with FP8 rollouts vs bf16: held-out success

Each benchmark is a function bench_NAME whose keyword arguments are its options (all
integers): `--key=value` sets one, a bare `--key` means 1, an unknown key is an error.
"""
import inspect
import json
import sys

import bench_fp8
import bench_loop
import bench_model

# -----------------------------------------------------------------------------
# logprobs: chunked token logprobs (loss.token_logprobs) vs the naive full-logits computation


def _peak_extra_bytes(logprob_fn, T, V, D, chunk_size, with_entropy, fake):
    """Peak bytes alive at once during forward + backward of logprob_fn, beyond its inputs.

    How it is measured: a TorchDispatchMode sees every op's outputs while active; it adds the
    bytes of each new storage to a live counter and subtracts them when a weakref finalizer
    reports the storage freed, keeping the maximum. Everything the computation allocates is
    counted: intermediates, tensors autograd saves for backward, the outputs, and the gradients
    (hidden.grad, weight.grad: the same for both methods). CPU torch has no caching allocator, so
    live storage bytes are what the allocator holds. With fake=True the inputs are FakeTensorMode
    tensors (shapes, no data): the same ops run and are counted without allocating, so sizes that
    would not fit in this machine's RAM (naive at T=32768, V=151936 needs ~95 GB) are measured by
    the same code; the caller checks on a smaller size that fake and real give the same figure."""
    import contextlib
    import weakref

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.current, self.peak = {}, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()  # the same Python object for
                                                   # every view of one storage
                    if id(storage) not in self.live:
                        self.live[id(storage)] = storage.nbytes()
                        self.current += storage.nbytes()
                        self.peak = max(self.peak, self.current)
                        weakref.finalize(storage, self._free, id(storage))
            return out

        def _free(self, key):
            self.current -= self.live.pop(key)

    with FakeTensorMode() if fake else contextlib.nullcontext():
        gen = None if fake else torch.Generator().manual_seed(0)
        hidden = (torch.randn(T, D, generator=gen) / D ** 0.5).requires_grad_()  # (T, D)
        weight = torch.randn(V, D, generator=gen).requires_grad_()  # (V, D)
        targets = torch.randint(0, V, (T,), generator=gen)  # (T,)
        tracker = LiveBytes()
        with tracker:
            logprobs, entropy = logprob_fn(hidden, weight, targets, 1.0, chunk_size, with_entropy)
            objective = logprobs.sum() + (entropy.sum() if with_entropy else 0)
            objective.backward()
            result = None if fake else (logprobs.detach(), hidden.grad, weight.grad)
        del logprobs, entropy, objective
    return tracker.peak, result


def bench_logprobs(T=32768, V=151936, D=64, chunk_size=1024, with_entropy=1, check_T=512):
    """Peak extra memory of token logprobs + entropy, forward and backward, chunked
    vs naive, for a long sequence with Qwen3's vocabulary (measured on fake
    tensors), then a real-tensor check at check_T tokens: the same peaks as the
    fake measurement there, and chunked values and gradients equal to naive."""
    opt = dict(locals())  # the options, as bench.py's command line set them
    import torch
    from loss import naive_token_logprobs, token_logprobs
    shape = (opt["V"], opt["D"], opt["chunk_size"], bool(opt["with_entropy"]))
    naive, _ = _peak_extra_bytes(naive_token_logprobs, opt["T"], *shape, fake=True)
    chunked, _ = _peak_extra_bytes(token_logprobs, opt["T"], *shape, fake=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    check_naive, want = _peak_extra_bytes(naive_token_logprobs, opt["check_T"], *shape, fake=False)
    check_chunked, got = _peak_extra_bytes(token_logprobs, opt["check_T"], *shape, fake=False)
    fake_check = (_peak_extra_bytes(naive_token_logprobs, opt["check_T"], *shape, fake=True)[0],
                  _peak_extra_bytes(token_logprobs, opt["check_T"], *shape, fake=True)[0])
    mb = 2 ** 20
    print(f"T={opt['T']} V={opt['V']} D={opt['D']}: naive {naive / mb:.0f} MB, chunked "
          f"({opt['chunk_size']} tokens) "
          f"{chunked / mb:.0f} MB extra at peak; full fp32 logits alone are "
          f"{opt['T'] * opt['V'] * 4 / mb:.0f} MB")
    return dict(T=opt["T"], V=opt["V"], D=opt["D"], chunk_size=opt["chunk_size"],
                with_entropy=bool(opt["with_entropy"]),
                naive_peak_extra_mb=round(naive / mb, 1),
                chunked_peak_extra_mb=round(chunked / mb, 1), check_T=opt["check_T"],
                check_naive_mb=round(check_naive / mb, 1),
                check_chunked_mb=round(check_chunked / mb, 1),
                check_fake_equals_real=fake_check == (check_naive, check_chunked),
                check_max_abs_diff=max((a - b).abs().max().item() for a, b in zip(got, want)),
                ratio=round(chunked / naive, 4))


# -----------------------------------------------------------------------------
# sync: the trainer's bucketed weight broadcast
# (weights_sync) vs one raw broadcast of the same bytes


def bench_sync(layers=4, bucket_mb=0, iters=0, tiny=-1, lora_rank=8):
    """Rank 0 holds a Qwen3-30B-A3B-shaped model with a few layers (fp32 master weights,
    several GB in bf16) and sends it with weights_sync.WeightSender (cast to bf16, pack
    per-expert HF tensors into buckets, broadcast with double buffering) to rank 1, which
    receives like an engine worker (worker.BucketReceiver) and copies every tensor
    into its own per-parameter tensor (as load_weights does; here one multi-tensor copy per
    bucket). Baseline, same run, same process group: one broadcast of a flat buffer of the
    same bytes. Prints GB/s of both and ours / raw (target >= 0.85), and checks that rank 1
    ends up with exactly rank 0's weights. Then the same model with LoRA adapters of rank
    lora_rank on every target (0: skip): a LoRA run's sync, the fp32 adapters alone
    (lora_bytes, lora_s, and full_over_lora, the full sync's time over the LoRA one's).

        torchrun --nproc_per_node=2 bench.py sync                # 2 GPUs, NCCL
        python bench.py sync                                     # spawns the 2 ranks itself (CPU: gloo, tiny)
        python bench.py sync --layers=2 --bucket_mb=256 --iters=5 --tiny=0 --lora_rank=16
    """
    opt = dict(locals())  # the options, as bench.py's command line set them
    import os
    import torch
    import torch.multiprocessing as mp
    from weights_sync import free_port
    cuda = torch.cuda.is_available()
    opt.update(bucket_mb=bucket_mb or (512 if cuda else 1), iters=iters or (5 if cuda else 3),
               tiny=int(not cuda) if tiny < 0 else tiny)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun
        if int(os.environ["WORLD_SIZE"]) != 2:
            sys.exit(f"bench.py sync needs exactly 2 ranks (sender and receiver), "
                     f"got WORLD_SIZE={os.environ['WORLD_SIZE']}")
        result = _sync_rank(int(os.environ["RANK"]), opt, None)
        if int(os.environ["RANK"]) != 0:
            sys.exit(0)  # rank 0 prints the result
        return result
    if cuda and torch.cuda.device_count() < 2:
        sys.exit("bench.py sync needs 2 GPUs (or none, for the CPU smoke run)")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [ctx.Process(target=_sync_spawned, args=(rank, env, opt, results)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"bench.py sync: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return results.get()


def _sync_spawned(rank, env, opt, results):
    import os
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    _sync_rank(rank, opt, results)


def _sync_rank(rank, opt, results):
    import os
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from model import ModelConfig, Transformer, ours_to_hf
    from tiny import TINY_CONFIG
    from weights_sync import WeightSender, free_port, stateless_process_group
    from worker import BucketReceiver
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK",
                                                     rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")  # only to hand the layout
                                                         # and the port to rank 1
    cfg = TINY_CONFIG if opt["tiny"] else ModelConfig(  # Qwen3-30B-A3B, fewer layers
        vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=opt["layers"], num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    sender = WeightSender(bucket_bytes=opt["bucket_mb"] << 20, dtype=torch.bfloat16, device=device)
    if rank == 0:
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device=device)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        layout = sender.layout(model)
        shared = [layout[0], free_port(os.environ["MASTER_ADDR"])]
    else:
        shared = [None, None]
    dist.broadcast_object_list(shared, src=0)
    buckets, port = shared
    total = sum(b["nbytes"] for b in buckets)
    backend = "nccl" if cuda else "gloo"
    if rank == 0:
        sender.connect(os.environ["MASTER_ADDR"], port, 2, backend)
        group = sender.group
    else:
        group = stateless_process_group(os.environ["MASTER_ADDR"], port, 1, 2, backend)
        # the engine's parameters
        dest = {name: torch.empty(shape, dtype=getattr(torch, dt), device=device)
                for b in buckets for name, dt, shape, _ in b["tensors"]}
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    token = torch.zeros(1, device=device)

    def barrier():
        group.allreduce([token]).wait()
        if cuda:
            torch.cuda.synchronize()

    def ours():
        if rank == 0:
            sender.send(model, layout)
        else:  # one multi-tensor copy per bucket: a copy per tensor is launch-bound
            for tensors in BucketReceiver(group, buckets, device).iter_buckets():
                torch._foreach_copy_([dest[name] for name, _ in tensors], [t for _, t in tensors])

    def raw():
        group.broadcast(flat, 0).wait()

    def timed(fn):
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()  # the receiver has every byte in place
        return time.perf_counter() - t0

    timed(raw), timed(ours)  # warm-up: NCCL communicators, allocator
    raw_s, ours_s = [], []
    for _ in range(opt["iters"]):
        raw_s.append(timed(raw))
        ours_s.append(timed(ours))
    # correctness: what rank 1 holds equals the bf16 cast of rank 0's weights, tensor by tensor
    if rank == 0:
        want = {k: v.to(torch.bfloat16) for k,
                v in ours_to_hf(dict(model.named_parameters()), cfg).items()}
        sums = [want[name].double().sum().item() for b in buckets for name, *_ in b["tensors"]]
    else:
        sums = [dest[name].double().sum().item() for b in buckets for name, *_ in b["tensors"]]
    gathered = [None, None]
    dist.all_gather_object(gathered, sums)
    lora_result = _lora_sync(rank, opt, cfg, model if rank == 0 else None, group, device,
                             timed) if opt["lora_rank"] else {}
    group.shutdown()
    dist.destroy_process_group()
    raw_t, ours_t = statistics.median(raw_s), statistics.median(ours_s)
    result = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", backend=backend,
                  layers=cfg.num_hidden_layers, gb=round(total / 1e9, 3), buckets=len(buckets),
                  bucket_mb=opt["bucket_mb"], iters=opt["iters"],
                  raw_gbps=round(total / raw_t / 1e9, 2), ours_gbps=round(total / ours_t / 1e9, 2),
                  raw_s=round(raw_t, 4), ours_s=round(ours_t, 4), match=gathered[0] == gathered[1],
                  ratio=round(raw_t / ours_t, 3))
    if lora_result:
        result.update(lora_result, full_bytes=total,
                      full_over_lora=round(ours_t / lora_result["lora_s"], 1))
    if rank == 0:
        print(f"{result['gb']} GB in {len(buckets)} buckets: ours {result['ours_gbps']} GB/s, "
              f"raw broadcast {result['raw_gbps']} GB/s, ratio {result['ratio']}, receiver "
              f"matches: {result['match']}")
        if lora_result:
            print(f"LoRA rank {opt['lora_rank']}: {result['lora_bytes'] / 1e6:.2f} MB per sync in "
                  f"{result['lora_s']} s, full weights {total / 1e6:.1f} MB in {result['ours_s']} "
                  f"s ({result['full_over_lora']}x the time); "
                  f"receiver matches: {result['lora_match']}")
        if results is not None:
            results.put(result)
    return result


def _lora_sync(rank, opt, cfg, model, group, device, timed):
    """The same sync for a LoRA run: rank 0's model gets
    adapters (lora.py) and sends them alone, in fp32."""
    import statistics
    import torch
    import torch.distributed as dist
    import lora
    from weights_sync import WeightSender
    from worker import BucketReceiver
    adapter = lora.peft_config(opt["lora_rank"], 2.0 * opt["lora_rank"], lora.TARGETS)
    sender = WeightSender(bucket_bytes=opt["bucket_mb"] << 20, device=device, adapter=adapter)
    shared = [None]
    if rank == 0:
        lora.add_adapters(model, opt["lora_rank"], 2.0 * opt["lora_rank"], lora.TARGETS)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if lora.is_adapter(name):
                    p.normal_(0.0, 0.02)
        layout = sender.layout(model)
        shared = [layout[0]]
        sender.group = group
    dist.broadcast_object_list(shared, src=0)
    buckets = shared[0]
    dest = {name: torch.empty(shape, dtype=getattr(torch, dt), device=device)
            for b in buckets for name, dt, shape, _ in b["tensors"]}

    def send():
        if rank == 0:
            sender.send(model, layout)
        else:
            for tensors in BucketReceiver(group, buckets, device).iter_buckets():
                torch._foreach_copy_([dest[name] for name, _ in tensors], [t for _, t in tensors])
    timed(send)
    seconds = statistics.median(timed(send) for _ in range(opt["iters"]))
    if rank == 0:
        sent = lora.peft_tensors(
            {n: p.detach() for n, p in model.named_parameters() if lora.is_adapter(n)})
        sums = [sent[name].double().sum().item() for name in dest]
        sender.group = None  # the group is the caller's
    else:
        sums = [t.double().sum().item() for t in dest.values()]
    gathered = [None, None]
    dist.all_gather_object(gathered, sums)
    return dict(lora_rank=opt["lora_rank"], lora_bytes=sum(b["nbytes"] for b in buckets),
                lora_s=round(seconds, 4), lora_match=gathered[0] == gathered[1])


# -----------------------------------------------------------------------------
# async: the streaming rollout pool vs a synchronous
# generate-then-train loop, same engine and trainer


def bench_async(steps=8, group_size=4, groups_per_batch=4, groups_in_flight=8, max_tokens=16,
                tool_median_ms=500, tool_sigma_pct=150, seed=0):
    """Agents with two model turns around a tool whose latency is heavy-tailed (lognormal, median
    tool_median_ms, sigma tool_sigma_pct / 100, capped at 30 s), trained on by the real trainer
    with real weight syncs to one real engine. Baseline, same run, same engine and trainer: a
    synchronous loop that starts groups_per_batch groups, waits for all of them, trains, syncs
    and only then starts the next ones (RolloutPool.next_batch(hold=True)). Ours: the streaming
    pool with groups_in_flight groups running, a batch as soon as groups_per_batch are done. Both
    phases draw the same latency sequence. Prints attempts trained per second of both, ours /
    baseline (target >= 1.8) and the fraction of wall time the engine had no request in flight.

        python bench.py async
        python bench.py async --steps=10 --groups_in_flight=12 --tool_sigma_pct=200
    """
    opt = dict(locals())  # the options, as bench.py's command line set them
    import asyncio
    import math
    import os
    import random
    import time
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import ray
    from openai import AsyncOpenAI

    import capture
    import rollout
    import train
    import weights_sync
    from agentrl import as_run_function
    from tiny import ensure_tiny_model
    # tools like code execution or search answer in about
    # a second, with a long tail: median 0.5 s, p99 ~16 s
    path = ensure_tiny_model()
    # a tiny learning rate: both phases do the same work
    # (train step, weight sync) on a policy that stays put
    cfg = train.configure([f"--model_path={path}", "--learning_rate=1e-7", "--min_lr=1e-7",
                           "--max_staleness=8", f"--group_size={opt['group_size']}",
                           f"--groups_per_batch={opt['groups_per_batch']}"])
    _, world, device = train.init_distributed()
    model, optimizer, _, _ = train.build_trainer(cfg, world, device)
    train.start_local_ray(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
                          log_to_driver=False)
    engines, _ = rollout.start_engines(path, 1, max_model_len=1024, memory_fraction=0.3)
    router = rollout.Router(engines)
    router.mark_connected([])
    server = capture.CaptureServer(router, path, max_model_len=1024)
    server.start_in_thread()
    rollout_side = train.Rollout(router, server=server)
    loop, sender = asyncio.new_event_loop(), weights_sync.WeightSender()
    lcfg = train.loss_config(cfg)
    latency = {}

    async def agent(ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        first = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                     **ctx.sampling)
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        seconds = latency["rng"].lognormvariate(math.log(opt["tool_median_ms"] / 1000),
                                                opt["tool_sigma_pct"] / 100)
        await asyncio.sleep(min(seconds, 30.0))  # the tool
        messages.append({"role": "user", "content": "The tool says 42."})
        second = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                      **ctx.sampling)
        return float(second.choices[0].finish_reason == "stop")

    def prompts():
        for i in range(10**9):
            yield {"prompt": f"Look up item {i}."}

    version = 0

    def phase(steps, groups_in_flight, hold):
        nonlocal version
        latency["rng"] = random.Random(opt["seed"])
        pool = rollout.RolloutPool(as_run_function(agent), prompts(), server,
                                   group_size=opt["group_size"],
                                   groups_per_batch=opt["groups_per_batch"],
                                   groups_in_flight=groups_in_flight,
                                   sampling=dict(temperature=1.0, max_tokens=opt["max_tokens"]),
                                   attempt_timeout_s=120.0, failed_group_rule="drop").start()
        router.reset_idle_clock()
        t0, attempts, tokens, stale = time.perf_counter(), 0, 0, 0
        for step in range(steps):
            records = pool.next_batch(hold=hold)
            m = train.rl_step(rollout_side, loop, sender, model, optimizer, records, cfg, lcfg,
                              version, version, 0, 1)
            version = m["policy_version"]
            if hold:
                pool.resume()
            attempts += len({r["attempt_id"] for r in records})
            tokens += sum(r["action_tokens"] for r in records)
            stale += round(m["stale_frac"] * m["action_tokens"])
        elapsed, idle = time.perf_counter() - t0, router.idle_fraction()
        pool.stop()
        return dict(attempts_per_s=round(attempts / elapsed, 3),
                    generated_tokens_per_s=round(tokens / elapsed, 1),
                    engine_idle_fraction=round(idle, 3), elapsed_s=round(elapsed, 2),
                    stale_dropped=stale)

    try:
        phase(1, opt["groups_per_batch"], True)  # warm-up: first requests, first sync
        baseline = phase(opt["steps"], opt["groups_per_batch"], True)
        ours = phase(opt["steps"], opt["groups_in_flight"], False)
    finally:
        server.stop_thread()
        sender.close()
        ray.shutdown()
    ratio = ours["attempts_per_s"] / baseline["attempts_per_s"]
    print(f"synchronous: {baseline['attempts_per_s']:.2f} attempts/s, engine idle "
          f"{baseline['engine_idle_fraction']:.0%}; streaming ({opt['groups_in_flight']} groups in "
          f"flight): {ours['attempts_per_s']:.2f} attempts/s, "
          f"engine idle {ours['engine_idle_fraction']:.0%}; {ratio:.2f}x")
    return dict(options=opt, synchronous=baseline, streaming=ours, ratio=round(ratio, 3))


# -----------------------------------------------------------------------------
# spec: MTP drafting (speculative_tokens) vs none on the tiny hybrid


def bench_spec(prompts=8, tokens=64, k=2, train_prompts=16, steps=40, language=60):
    """Engine tokens/s and mean accepted length with MTP drafting (k draft tokens per step) vs
    without, greedy, on the same prompts, on the tiny hybrid (.cache/tiny-qwen36-moe). Its
    weights are random, and a random trunk's next-token distribution is nearly flat, which no
    head can predict; so first (language > 0) the trunk and its MTP head learn a synthetic
    language for `language` Adam steps (after token x always comes chain[x], a fixed random
    permutation of 512 ids: greedy continuations as predictable as a trained model's often
    are; --language=0 keeps the random trunk). Then the head alone learns (train.mtp_loss, the
    trunk frozen, Adam lr 3e-3, `steps` steps) from the drafting-off engine's own greedy
    continuations of train_prompts other prompts; the drafting engine serves those weights.
    Prints the head's loss before and after, the acceptance (draft tokens accepted / drafted),
    the mean accepted length (tokens per target step: 1 + accepted / steps), how many outputs
    equal drafting-off's, ratio = tokens/s on / off. Whether drafting keeps the logprobs exact:
    each engine also samples `tokens` tokens per prompt at temperature 1, and the fp32 trainer
    (model.py on the served weights) scores them: the mismatch KL (k3 of log rho = trainer -
    engine logprob, as loss.py logs it) with drafting on and off, and their ratio. Where a greedy output differs from
    drafting-off's, at its first differing position t (off chose a, on chose b): the drafting
    engine's own prompt logprobs of a and b there (their gap is the logit gap), the fp32
    trainer's logit gap, and one bf16 step (ulp) at the larger of the two fp32 logits.

        python bench.py spec                  # CPU, ~4 minutes
        python bench.py spec --language=0     # the random trunk
    """
    import asyncio
    import os
    import shutil
    import tempfile
    import time

    import torch
    import torch.nn.functional as F

    import tiny
    import train
    from engine import Engine
    from model import Transformer
    path = tiny.ensure_tiny_model(
        os.path.join(os.path.dirname(tiny.TINY_MODEL_PATH), "tiny-qwen36-moe"))
    def rand(n, seed):
        return torch.randint(7, 519, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    bench_prompts, train_set = [rand(24, s) for s in range(prompts)], [
        rand(24, 1000 + s) for s in range(train_prompts)]
    greedy = dict(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def serve(model_dir, spec, extra=(), off=None):
        engine = Engine(model_dir, max_model_len=1024, memory_fraction=0.3,
                        enable_prefix_caching=False, seed=0, speculative_config=spec)
        await engine.start()
        await asyncio.gather(*(engine.generate(p, greedy, f"warm{i}") for i,
                               p in enumerate(bench_prompts[:2])))
        await engine.take_drafts()
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(engine.generate(p, greedy, f"b{i}") for i, p in enumerate(bench_prompts)))
        seconds = time.perf_counter() - t0
        drafts = await engine.take_drafts()  # (accepted, drafted) over the timed outputs
        sampled = await asyncio.gather(*(engine.generate(
            p, dict(greedy, temperature=1.0, seed=i), f"s{i}") for i, p in enumerate(bench_prompts)))
        more = await asyncio.gather(
            *(engine.generate(p, greedy, f"t{i}") for i, p in enumerate(extra)))
        # each divergence: (prompt, t, a, b, engine's gap of a - b)
        for i, (a, b) in enumerate(zip(off or [], outs)):
            t = next((t for t, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y),
                     None)
            if t is not None:
                head = bench_prompts[i] + a["token_ids"][:t]
                gap = [(await engine.prompt_logprobs(head + [x]))[-1]
                       for x in (a["token_ids"][t], b["token_ids"][t])]
                more.append((i, t, a["token_ids"][t], b["token_ids"][t], gap[0] - gap[1]))
        await engine.shutdown()
        return outs, seconds, more, drafts, sampled

    def head_loss(model, x):  # x: (B, T) token ids -> the MTP loss and the
                              # trunk's states (the positions mtp_hidden uses)
        mb = dict(input_ids=x[:, :-1], targets=x[:, 1:],
                  real=torch.ones(x.shape[0], x.shape[1] - 1))
        hidden = model.hidden_states(mb["input_ids"])
        return train.mtp_loss(model, hidden, mb, train.mtp_mask(mb).sum()), hidden, mb

    torch.set_num_threads(1)  # the trainer's side, as `make train` runs
                              # it: 2 threads on 2 busy cores crawl
    model, trained = Transformer.from_pretrained(path), tempfile.mkdtemp(prefix="spec-")
    g = torch.Generator().manual_seed(0)
    chain = 7 + torch.randperm(512, generator=g)  # the language: token x is
                                                  # followed by chain[x - 7]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(language):  # trunk and head together, on fresh sentences each step
        x = [7 + torch.randint(0, 512, (16, 1), generator=g)]
        for _ in range(47):
            x.append(chain[x[-1] - 7])
        loss, hidden, mb = head_loss(model, torch.cat(x, 1))
        loss = loss + F.cross_entropy(model.lm_head(hidden).flatten(0, 1), mb["targets"].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0:
            print(f"language step {step}: next-token + MTP loss {loss.item():.3f}", flush=True)
    try:
        for f in os.listdir(path):
            if not f.endswith(".safetensors"):
                shutil.copy(os.path.join(path, f), trained)
        model.save_pretrained(trained, dtype=torch.bfloat16)
        model = Transformer.from_pretrained(trained)  # the served (bf16) trunk, in fp32
        off, off_s, continued, _, off_sampled = asyncio.run(serve(trained, None, train_set))
        x = torch.tensor([p + o["token_ids"] for p, o in zip(train_set, continued)])
        with torch.no_grad():  # the trunk's states, once: it is frozen
            _, hidden, mb = head_loss(model, x)
        mb["real"][:, :len(train_set[0]) - 1] = 0  # learn the continuations, not the random prompts
        opt, losses = torch.optim.Adam(model.mtp.parameters(), lr=3e-3), []
        for _ in range(steps):
            loss = train.mtp_loss(model, hidden, mb, train.mtp_mask(mb).sum())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.save_pretrained(trained, dtype=torch.bfloat16)  # the trunk's bits unchanged
        on, on_s, divergences, (accepted, drafted), on_sampled = asyncio.run(
            serve(trained, {"method": "mtp", "num_speculative_tokens": k}, off=off))
    finally:
        shutil.rmtree(trained, ignore_errors=True)
    ties = []
    for i, t, a, b, engine_gap in divergences:  # the fp32 trainer's logits there (the
                                                # served weights, unrounded compute)
        with torch.no_grad():
            logits = model(torch.tensor([bench_prompts[i]
                                         + off[i]["token_ids"][:t]]))[0, -1].float()
        # bf16: 8 significant bits
        ulp = 2.0 ** (torch.frexp(logits[[a, b]].abs().max()).exponent.item() - 8)
        ties.append(dict(prompt=i, t=t, engine_gap=round(engine_gap, 5),
                         fp32_gap=round((logits[a] - logits[b]).item(), 5), bf16_ulp=ulp,
                         fp32_logit=round(logits[a].item(), 4)))
    def mismatch_kl(sampled):  # the trainer's logprobs of the engine's sampled tokens
        log_rho = []
        for p, o in zip(bench_prompts, sampled):
            with torch.no_grad():
                logits = model(torch.tensor([p + o["token_ids"]]))[0, len(p) - 1:-1].float()
            mine = F.log_softmax(logits, -1).gather(-1, torch.tensor(o["token_ids"])[:, None])[:, 0]
            log_rho.append(mine.double() - torch.tensor(o["logprobs"], dtype=torch.float64))
        log_rho = torch.cat(log_rho)
        return (log_rho.exp() - 1 - log_rho).mean().item()
    n_tokens = sum(len(o["token_ids"]) for o in off)
    result = dict(prompts=prompts, tokens=tokens, k=k, language=language, mtp_loss_before=losses[0],
                  mtp_loss_after=losses[-1], off_tokens_per_s=n_tokens / off_s,
                  on_tokens_per_s=n_tokens / on_s, acceptance=accepted / max(drafted, 1),
                  mean_accepted_length=1
                  + accepted / max(drafted / k, 1),
                  same_outputs=sum(a["token_ids"] == b["token_ids"] for a, b in zip(off, on)),
                  mismatch_kl_off=mismatch_kl(off_sampled), mismatch_kl_on=mismatch_kl(on_sampled),
                  divergences=ties)
    result["ratio"] = result["on_tokens_per_s"] / result["off_tokens_per_s"]
    result["mismatch_kl_ratio"] = result["mismatch_kl_on"] / max(result["mismatch_kl_off"], 1e-12)
    print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k,
                    v in result.items()))
    return result


# -----------------------------------------------------------------------------
# capture: agents through the capture server (loopback
# HTTP) vs the same agents calling the engine directly


def bench_capture(agents=16, turns=4, tokens=48, rounds=6, spread=0, threads=0):
    """N agents run the same multi-turn workload on one tiny-model engine, in one process
    and one event loop, five ways: calling Engine.generate directly with token ids they
    extend themselves (the baseline); through the capture server with the async OpenAI SDK,
    as agents do (chat completions, and the Responses API with the output items sent back
    as input, as the OpenAI Agents SDK does); through the capture server with a bare HTTP
    client (httpx, JSON bodies), which leaves out the SDK's own client-side work; and with
    the same SDK through vLLM's own OpenAI-compatible server on the same engine (what an
    SDK agent would call without us; it records nothing). Same prompts and seeds, so the
    engine does the same work (the generated token counts are printed per mode); prefix
    caching is off so that repeating a prompt costs the same; modes alternate. Clients
    are made and connected before timing (agent set-up, the same whatever the server). Prints
    generated tokens/s of each, ratio = capture (SDK) / direct (target >= 0.95), responses_ratio
    the same for the Responses API, and sdk_vs_vllm_server = capture (SDK) / vLLM's
    server (SDK). Added latency per request = the agent's wait minus
    the engine's time on that same request (timed around the backend call), so engine noise cancels;
    p50 and p99 under the full load and with one agent alone (target <= 5 ms at p50). The loop is
    the one the server runs on in training (http_server.new_event_loop: uvloop). Every turn asks for
    `tokens` tokens, so all agents finish a turn at the same engine step and wait on each other's
    client work (the worst case); --spread=S draws each turn's max_tokens from tokens +- S instead
    (the same draws in every mode), as agents' turns differ in length. --threads=1 lays the process
    out as training does: the server and the engine's client on the server's thread and loop, the
    agents on another thread's asyncio loop (as the rollout pool runs them), sharing the GIL.

        python bench.py capture                      # CPU, tiny model, ~1.5 minutes
        python bench.py capture --spread=32          # turns of 16..80 tokens
        python bench.py capture --threads=1          # agents on their own thread, as in training
        python bench.py capture --agents=32 --turns=6 --tokens=64 --rounds=3
    """
    opt = dict(locals())  # the options, as bench.py's command line set them
    import asyncio
    import statistics
    import time

    import httpx
    import openai

    import capture
    import http_server
    from engine import Engine
    from tiny import ensure_tiny_model
    path = ensure_tiny_model()

    class TimedEngine:  # the server's backend: the engine, with
                        # the time of each call kept per session
        def __init__(self, engine):
            self.engine, self.seconds = engine, {}

        async def generate(self, prompt, sampling, request_id, session_id=None):
            start = time.perf_counter()
            out = await self.engine.generate(prompt, sampling, request_id, session_id=session_id)
            self.seconds.setdefault(session_id, []).append(time.perf_counter() - start)
            return out

    async def run():
        engine = Engine(path, max_model_len=2048, enable_prefix_caching=False,
                        worker_extension_cls=None)
        backend = TimedEngine(engine)
        server = capture.CaptureServer(backend, path, max_model_len=2048)

        async def on_server(coro):  # the server's and the engine client's
                                    # work runs on the server's loop
            if not opt["threads"]:
                return await coro
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, server.loop))

        if opt["threads"]:  # as in training: server and engine client
                            # on the server's thread, agents on this one
            server.start_in_thread()
            server.run_in_loop(engine.start())
        else:
            await engine.start()
            await server.start()
        async def start_vllm_server():  # vLLM's OpenAI-compatible app on our
                                        # engine's AsyncLLM, served like ours
            from vllm.utils.argparse_utils import FlexibleArgumentParser
            try:
                from vllm.entrypoints.launchers.api_server.app_state import init_app_state
                from vllm.entrypoints.launchers.app import build_app
                from vllm.entrypoints.launchers.cli_args import make_arg_parser
            except ImportError:  # vLLM before its launchers package: the same in the OpenAI server
                from vllm.entrypoints.openai.api_server import build_app, init_app_state
                from vllm.entrypoints.openai.cli_args import make_arg_parser
            vargs = make_arg_parser(FlexibleArgumentParser()).parse_args(
                ["--model", path, "--served-model-name", "tiny"])
            app = build_app(vargs, supported_tasks=("generate",),
                            model_config=engine.llm.model_config)
            await init_app_state(engine.llm, app.state, vargs, ("generate",))
            sock = http_server.bind_socket()
            return *(await http_server.serve_app(app, sock)), f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

        async def stop_vllm_server():
            vserver.should_exit = True
            await serving

        vserver, serving, vllm_url = await on_server(start_vllm_server())
        tok = server.tokenizer
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000))

        def user_text(agent, turn):
            return f"Agent {agent}, step {turn}: what is {agent} plus {turn}?"

        def turn_tokens(agent, turn):  # max_tokens of a turn: tokens +-
                                       # spread, the same in every mode
            return opt["tokens"] - opt["spread"] + (agent * 7919
                                                    + turn * 104729) % (2 * opt["spread"] + 1)

        async def direct(agent, session, waits):
            ids, generated = server.render([{"role": "user", "content": user_text(agent, 0)}], [],
                                           True), 0
            for turn in range(opt["turns"]):
                start = time.perf_counter()
                out = await on_server(engine.generate(ids, dict(max_tokens=turn_tokens(agent, turn),
                                                                seed=agent * 100 + turn,
                                                                stop_token_ids=server.end_ids),
                                                      f"{session.id}-{turn}"))
                waits.append(time.perf_counter() - start)
                generated += len(out["token_ids"])
                ids = ids + out["token_ids"] + ([] if out["token_ids"][-1:] == [im_end]
                                                else [im_end])
                ids += tok("\n<|im_start|>user\n" + user_text(agent, turn + 1)
                           + "<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)["input_ids"]
            return generated

        async def sdk(agent, session, waits):
            messages, generated = [{"role": "user", "content": user_text(agent, 0)}], 0
            for turn in range(opt["turns"]):
                start = time.perf_counter()
                r = await session.client.chat.completions.create(model="tiny", messages=messages,
                                                                 seed=agent * 100 + turn,
                                                                 max_tokens=turn_tokens(
                                                                     agent, turn))
                waits.append(time.perf_counter() - start)
                generated += r.usage.completion_tokens
                messages += [r.choices[0].message,
                             {"role": "user", "content": user_text(agent, turn + 1)}]
            return generated

        async def bare_http(agent, session, waits):
            url, headers = session.base_url + "/chat/completions", {
                "authorization": f"Bearer {session.api_key}"}
            messages, generated = [{"role": "user", "content": user_text(agent, 0)}], 0
            for turn in range(opt["turns"]):
                start = time.perf_counter()
                body = dict(model="tiny", messages=messages, max_tokens=turn_tokens(agent, turn),
                            seed=agent * 100 + turn)
                r = (await http.post(url, headers=headers, json=body)).json()
                waits.append(time.perf_counter() - start)
                generated += r["usage"]["completion_tokens"]
                messages += [r["choices"][0]["message"],
                             {"role": "user", "content": user_text(agent, turn + 1)}]
            return generated

        async def responses(agent, session, waits):
            items, generated = [{"role": "user", "content": user_text(agent, 0)}], 0
            for turn in range(opt["turns"]):
                start = time.perf_counter()
                r = await session.client.responses.create(model="tiny", input=items,
                                                          extra_body={"seed": agent * 100 + turn},
                                                          max_output_tokens=turn_tokens(
                                                              agent, turn))
                waits.append(time.perf_counter() - start)
                generated += r.usage.output_tokens
                items += [item.model_dump(exclude_none=True) for item in r.output]
                items.append({"role": "user", "content": user_text(agent, turn + 1)})
            return generated

        async def phase(name, agents):
            """Run the agents at once; returns (generated
            tokens, seconds, per-request added latencies)."""
            agent_fn = modes[name]
            # set-up, untimed: session, client, connection
            sessions = [server.new_session() for _ in agents]
            for s in sessions:
                s.client = openai.AsyncOpenAI(base_url=vllm_url if name == "vllm" else s.base_url,
                                              api_key=s.api_key, max_retries=0)
            if agent_fn in (sdk, responses):
                await asyncio.gather(*[s.client.models.list() for s in sessions])
            waits = [[] for _ in agents]
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(
                *[agent_fn(a, s, w) for a, s, w in zip(agents, sessions, waits)]))
            seconds = time.perf_counter() - start
            added = []
            for s, w in zip(sessions, waits):
                if name in ("sdk", "http", "responses"):  # vLLM's server calls the engine
                                                          # itself: not timed there
                    added += [a - b for a, b in zip(w, backend.seconds.pop(s.id))]
                await s.client.close()
                server.finish_session(s.id, 0.0)
                server.drop_session(s.id)
            return tokens, seconds, added

        modes = {"direct": direct, "sdk": sdk, "http": bare_http, "vllm": sdk,
                 "responses": responses}
        for name in modes:  # warm-up: first requests pay for lazy imports and allocations
            await phase(name, range(4))
        totals = {name: [0, 0.0, [], []] for name in modes}
        for r in range(opt["rounds"]):
            for name in list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]:
                tokens, seconds, added = await phase(name, range(opt["agents"]))
                totals[name][0] += tokens
                totals[name][1] += seconds
                totals[name][2] += added
                totals[name][3] += (await phase(name, [1000 + r]))[2]  # one agent alone
        await http.aclose()
        await on_server(stop_vllm_server())
        await on_server(server.stop())
        await on_server(engine.shutdown())
        return totals

    # one loop: the server's (uvloop); --threads=1: agents
    # on asyncio's loop, as the rollout pool runs them
    with asyncio.Runner(loop_factory=asyncio.new_event_loop if opt["threads"]
                        else http_server.new_event_loop) as runner:
        totals = runner.run(run())
    tput = {name: t[0] / t[1] for name, t in totals.items()}
    out = dict(agents=opt["agents"], turns=opt["turns"], tokens=opt["tokens"], rounds=opt["rounds"],
               # equal: the engine did the same work
               generated_tokens={name: t[0] for name, t in totals.items()},
               direct_tokens_per_s=round(tput["direct"], 1),
               vllm_server_tokens_per_s=round(tput["vllm"], 1))

    def percentiles(seconds):
        ms = sorted(x * 1000 for x in seconds)
        return round(statistics.median(ms), 3), round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3)
    for name in ("sdk", "http", "responses"):
        out[f"{name}_tokens_per_s"] = round(tput[name], 1)
        out[f"{name}_ratio"] = round(tput[name] / tput["direct"], 4)
        out[f"{name}_added_ms_p50"], out[f"{name}_added_ms_p99"] = percentiles(totals[name][2])
        out[f"{name}_alone_added_ms_p50"], out[f"{name}_alone_added_ms_p99"] = percentiles(
            totals[name][3])
    out["sdk_vs_vllm_server"] = round(tput["sdk"] / tput["vllm"], 4)
    out["ratio"] = out["sdk_ratio"]
    print(f"{opt['agents']} agents x {opt['turns']} turns x {opt['tokens']} tokens, "
          f"{opt['rounds']} rounds: direct {tput['direct']:.0f} tok/s; capture via the OpenAI SDK "
          f"{tput['sdk']:.0f} tok/s (x{out['sdk_ratio']:.3f}), via bare HTTP {tput['http']:.0f} "
          f"tok/s (x{out['http_ratio']:.3f}); the SDK through vLLM's own server {tput['vllm']:.0f} "
          f"tok/s (capture / vLLM's server: x{out['sdk_vs_vllm_server']:.3f}); the Responses API "
          f"via the SDK {tput['responses']:.0f} tok/s (x{out['responses_ratio']:.3f})")
    for name, label in (("sdk", "OpenAI SDK"), ("http", "bare HTTP"),
                        ("responses", "Responses API")):
        print(f"added latency per request, {label}: p50 {out[f'{name}_added_ms_p50']:.2f} ms, p99 "
              f"{out[f'{name}_added_ms_p99']:.2f} ms under load; p50 "
              f"{out[f'{name}_alone_added_ms_p50']:.2f} ms, "
              f"p99 {out[f'{name}_alone_added_ms_p99']:.2f} ms alone")
    return out


# -----------------------------------------------------------------------------
# objectstore: image trajectories to the trainer ranks by ref (ours) vs gathered in the driver first


def _image_files(n, size, noise, seed):
    """n PNG files of size x size: noise (incompressible,
    like photographs or screenshots) or geometry diagrams."""
    import io
    import random
    import numpy as np
    from PIL import Image
    if not noise:
        sys.path.insert(0, "agents")
        import geometry
        geometry.SIZE = size
    files = []
    for i in range(n):
        if noise:
            image = Image.fromarray(
                np.random.default_rng(seed + i).integers(0, 256, (size, size, 3), dtype=np.uint8))
        else:
            image = geometry.scene(geometry.KINDS[i % len(geometry.KINDS)],
                                   random.Random(seed + i))[0]
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        files.append(buf.getvalue())
    return files


def bench_objectstore(attempts=256, images=4, size=448, ranks=2, noise=1, baseline_first=0):
    """The driver's peak host memory while a batch of image trajectories reaches the trainer
    ranks. `attempts` segments of `images` PNG images of size x size each (plus ~200 text tokens)
    are recorded by a rollout-side actor, which puts each one in its node's object store
    (rollout.put_experience) and hands the driver the light records. Ours, as train.share_batch:
    the driver splits the records by tokens and sends each of `ranks` trainer actors its refs;
    each fetches its own and patches its images (vl.with_pixels, the tiny VLM's image processor).
    Baseline: the driver first gathers the batch (ray.get of every segment), then sends each rank
    its segments by value. The driver's resident memory is sampled every 5 ms; ratio = baseline
    peak / ours peak (above the driver's memory at the phase's start). Real Ray, local cluster.

        python bench.py objectstore                       # 256 attempts x 4 noise images of 448x448, 2 ranks
        python bench.py objectstore --noise=0             # geometry diagrams instead (PNG compresses them ~40x)
    Options: --attempts=256 --images=4 --size=448 --ranks=2 --noise=1 --baseline_first=0
    """
    opt = dict(locals())  # the options, as bench.py's command line set them
    import os
    import threading
    import time
    import psutil
    import ray
    here = os.path.dirname(os.path.abspath(__file__))
    from tiny import ensure_tiny_model
    model_path = ensure_tiny_model(os.path.join(here, ".cache", "tiny-qwen3-vl-moe"))
    files = _image_files(opt["images"], opt["size"], opt["noise"], seed=0)
    per_attempt = sum(map(len, files))
    ray.init(num_cpus=opt["ranks"] + 1, include_dashboard=False, object_store_memory=max(
        1 << 30, 3 * opt["attempts"] * per_attempt), runtime_env={"env_vars": {"PYTHONPATH": here}})

    @ray.remote
    class Recorder:  # the rollout side: records segments and puts them in its node's object store
        def record(self, attempts, images, noise, offset):
            import io
            from PIL import Image
            import rollout
            import vl
            grid = vl.image_processor(model_path)(images=[Image.open(io.BytesIO(b)) for b in files],
                                                  return_tensors="np")["image_grid_thw"]
            # merged tokens, start/end
            n_image = int(sum(t * h * w for t, h, w in grid)) // 4 + 2 * len(files)
            out = []
            for a in range(attempts):
                # some new
                imgs = files if a % 8 else _image_files(len(files), opt["size"], noise, seed=offset
                                                        + a)
                T = n_image + 200 + a % 50
                out.append(rollout.put_experience(dict(
                    attempt_id=f"{offset}-{a}", segment_index=0, token_ids=[7] * T,
                    action_mask=[0] * (T - 100) + [1] * 100,
                    behavior_logprobs=[-0.5] * T, token_versions=[-1] * (T - 100) + [0] * 100,
                    images=imgs, image_grid_thw=grid.tolist()), reward=float(a % 2),
                    group_id=a // 4))
            return out

    @ray.remote
    class Rank:  # a trainer rank's share of the batch: fetch (refs)
                 # or receive (values), then patch the images
        def take(self, shard, by_ref):
            import vl
            segments = ray.get([r["ref"] for r in shard]) if by_ref else shard
            # one segment's patches at a time: the driver is measured here, not the ranks
            pixel_bytes = sum(vl.with_pixels(dict(s), model_path)["pixel_values"].nbytes
                              for s in segments)
            return dict(segments=len(segments), pixel_bytes=pixel_bytes)

    import rollout
    recorder, ranks = Recorder.remote(), [Rank.remote() for _ in range(opt["ranks"])]
    warm = ray.get(recorder.record.remote(1, 1, 1, 0))  # actors up, imports and
                                                        # image processors loaded
    ray.get([r.take.remote(warm, True) for r in ranks])
    driver = psutil.Process()

    def phase(by_ref, offset):
        peak, done = [driver.memory_info().rss], threading.Event()
        start = peak[0]

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], driver.memory_info().rss)
                time.sleep(0.005)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        records = ray.get(recorder.record.remote(opt["attempts"], opt["images"], opt["noise"],
                                                 offset))
        if not by_ref:  # the baseline: the whole batch in the driver first
            segments = dict(zip([r["attempt_id"] for r in records],
                                ray.get([r["ref"] for r in records])))
        shards = rollout.balance_by_tokens(records, opt["ranks"])
        if not by_ref:
            shards = [[segments[r["attempt_id"]] for r in shard] for shard in shards]
        got = ray.get([rank.take.remote(shard, by_ref) for rank, shard in zip(ranks, shards)])
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
        out = dict(driver_peak_mb=round((peak[0] - start) / 2**20, 1), seconds=round(seconds, 2),
                   segments=sum(g["segments"] for g in got),
                   pixel_values_mb_on_ranks=round(sum(g["pixel_bytes"] for g in got) / 2**20, 1))
        if by_ref:
            out["records_kb"] = round(len(ray.cloudpickle.dumps(records)) / 1024, 1)
        print(f"{'ours (refs)' if by_ref else 'gather in the driver'}: {out}", flush=True)
        return out
    result = dict(attempts=opt["attempts"], images_per_attempt=opt["images"], size=opt["size"],
                  ranks=opt["ranks"], image_kind="noise" if opt["noise"] else "geometry diagrams",
                  image_mb_per_batch=round(opt["attempts"] * per_attempt / 2**20, 1))
    for by_ref in ((False, True) if opt["baseline_first"] else (True, False)):
        result["ours" if by_ref else "gather"] = phase(by_ref, 10**6 * (1 + by_ref))
    result["ratio"] = round(result["gather"]["driver_peak_mb"] / max(result["ours"]["driver_peak_mb"], 0.1), 1)
    ray.shutdown()
    return result


def options(fn, argv):
    """--key=value command-line overrides of fn's keyword defaults (integers; a bare --key is 1)."""
    defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}
    out = {}
    for arg in argv:
        key, eq, value = arg.lstrip("-").partition("=")
        if key not in defaults:
            sys.exit(f"unknown option {arg!r}; options: "
                     f"{', '.join('--%s=%s' % kv for kv in defaults.items())}")
        try:
            out[key] = int(value) if eq else 1
        except ValueError:
            sys.exit(f"option {arg!r} takes an integer")
    return out


def main():
    benches = {k[len("bench_"):]: f for module in (sys.modules[__name__], bench_model, bench_loop, bench_fp8)
               for k, f in vars(module).items() if k.startswith("bench_") and callable(f)}
    if len(sys.argv) < 2 or sys.argv[1] not in benches:
        sys.exit("usage: python bench.py NAME [--key=value ...], NAME one of: "
                 f"{', '.join(sorted(benches))}")
    fn = benches[sys.argv[1]]
    print(json.dumps(fn(**options(fn, sys.argv[2:]))))


if __name__ == "__main__":
    main()
