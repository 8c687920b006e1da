"""
Benchmarks. Each measures ours and a baseline side by side in the same run and prints, as its last line,
one JSON object with the figures and `ratio`.

    python bench.py logprobs     # chunked vs naive token logprobs: peak extra memory
    python bench.py capture      # agents through the capture server vs calling the engine directly
    python bench.py train        # our FSDP2+EP trainer vs transformers' Qwen3MoeForCausalLM under FSDP2 (GPU)
    python bench.py async        # streaming rollout pool vs synchronous generate-then-train
    python bench.py sync         # trainer -> engine weight broadcast vs raw NCCL broadcast (2 GPUs)
    python bench.py lora         # grouped-GEMM experts with LoRA adapters on a frozen base vs full fine-tuning (GPU)
    python bench.py objectstore  # image trajectories to trainer ranks by ref vs gathered in the driver: driver memory
    python bench.py vl           # our Qwen3-VL-MoE forward/backward vs transformers' (1 GPU): parity, tokens/s
"""
import json
import sys

# -----------------------------------------------------------------------------
# each benchmark is one function bench_NAME(args) returning a dict with at least "ratio"; their options


def _int_options(args, **defaults):
    """--key=value overrides of integer defaults; an unknown key is an error."""
    out = dict(defaults)
    for arg in args:
        key, _, value = arg.lstrip("-").partition("=")
        if key not in out:
            sys.exit(f"unknown option {arg!r}; options: {', '.join('--%s=%s' % kv for kv in defaults.items())}")
        out[key] = int(value)
    return out

# -----------------------------------------------------------------------------
# logprobs: chunked token logprobs (loss.token_logprobs) vs the naive full-logits computation


def _peak_extra_bytes(logprob_fn, T, V, D, chunk_size, with_entropy, fake):
    """Peak bytes alive at once during forward + backward of logprob_fn, beyond its inputs.

    How it is measured: a TorchDispatchMode sees every op's outputs while active; it adds the bytes of each new
    storage to a live counter and subtracts them when a weakref finalizer reports the storage freed, keeping the
    maximum. Everything the computation allocates is counted: intermediates, tensors autograd saves for backward,
    the outputs, and the gradients (hidden.grad, weight.grad: the same for both methods). CPU torch has no caching
    allocator, so live storage bytes are what the allocator holds. With fake=True the inputs are FakeTensorMode
    tensors (shapes, no data): the same ops run and are counted without allocating, so sizes that would not fit in
    this machine's RAM (naive at T=32768, V=151936 needs ~95 GB) are measured by the same code; the caller checks
    on a smaller size that fake and real give the same figure."""
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
                    storage = t.untyped_storage()  # the same Python object for every view of one storage
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


def bench_logprobs(*args):
    """Peak extra memory of token logprobs + entropy, forward and backward, chunked vs naive, for a long sequence
    with Qwen3's vocabulary (measured on fake tensors), then a real-tensor check at check_T tokens: the same
    peaks as the fake measurement there, and chunked values and gradients equal to naive."""
    import torch
    from loss import naive_token_logprobs, token_logprobs
    opt = _int_options(args, T=32768, V=151936, D=64, chunk_size=1024, with_entropy=1, check_T=512)
    shape = (opt["V"], opt["D"], opt["chunk_size"], bool(opt["with_entropy"]))
    naive, _ = _peak_extra_bytes(naive_token_logprobs, opt["T"], *shape, fake=True)
    chunked, _ = _peak_extra_bytes(token_logprobs, opt["T"], *shape, fake=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    check_naive, want = _peak_extra_bytes(naive_token_logprobs, opt["check_T"], *shape, fake=False)
    check_chunked, got = _peak_extra_bytes(token_logprobs, opt["check_T"], *shape, fake=False)
    fake_check = (_peak_extra_bytes(naive_token_logprobs, opt["check_T"], *shape, fake=True)[0],
                  _peak_extra_bytes(token_logprobs, opt["check_T"], *shape, fake=True)[0])
    mb = 2 ** 20
    print(f"T={opt['T']} V={opt['V']} D={opt['D']}: naive {naive / mb:.0f} MB, chunked ({opt['chunk_size']} tokens) "
          f"{chunked / mb:.0f} MB extra at peak; full fp32 logits alone are {opt['T'] * opt['V'] * 4 / mb:.0f} MB")
    return dict(T=opt["T"], V=opt["V"], D=opt["D"], chunk_size=opt["chunk_size"], with_entropy=bool(opt["with_entropy"]),
                naive_peak_extra_mb=round(naive / mb, 1), chunked_peak_extra_mb=round(chunked / mb, 1),
                check_T=opt["check_T"], check_naive_mb=round(check_naive / mb, 1),
                check_chunked_mb=round(check_chunked / mb, 1),
                check_fake_equals_real=fake_check == (check_naive, check_chunked),
                check_max_abs_diff=max((a - b).abs().max().item() for a, b in zip(got, want)),
                ratio=round(chunked / naive, 4))


# -----------------------------------------------------------------------------
# sync: the trainer's bucketed weight broadcast (weights_sync) vs one raw broadcast of the same bytes


def bench_sync(*args):
    """Rank 0 holds a Qwen3-30B-A3B-shaped model with a few layers (fp32 master weights, several GB in bf16) and
    sends it with weights_sync.WeightSender (cast to bf16, pack per-expert HF tensors into buckets, broadcast with
    double buffering) to rank 1, which receives like an engine worker (weights_sync.BucketReceiver) and copies
    every tensor into its own per-parameter tensor (as load_weights does; here one multi-tensor copy per bucket).
    Baseline, same run, same process group: one broadcast of a flat buffer of the same bytes. Prints GB/s of both
    and ours / raw (target >= 0.85), and checks that rank 1 ends up with exactly rank 0's weights. Then the same
    model with LoRA adapters of rank lora_rank on every target (0: skip): a LoRA run's sync, the fp32 adapters alone
    (lora_bytes, lora_s, and full_over_lora, the full sync's time over the LoRA one's).

        torchrun --nproc_per_node=2 bench.py sync                # 2 GPUs, NCCL
        python bench.py sync                                     # spawns the 2 ranks itself (CPU: gloo, tiny)
        python bench.py sync --layers=2 --bucket_mb=256 --iters=5 --tiny=0 --lora_rank=16
    """
    import os
    import torch
    import torch.multiprocessing as mp
    from weights_sync import free_port
    cuda = torch.cuda.is_available()
    opt = _int_options(args, layers=4, bucket_mb=512 if cuda else 1, iters=5 if cuda else 3, tiny=int(not cuda),
                       lora_rank=8)
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
    from weights_sync import BucketReceiver, WeightSender, free_port, stateless_process_group
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")  # only to hand the plan and the port to rank 1
    cfg = TINY_CONFIG if opt["tiny"] else ModelConfig(  # Qwen3-30B-A3B, fewer layers
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=opt["layers"],
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768)
    sender = WeightSender(bucket_bytes=opt["bucket_mb"] << 20, dtype=torch.bfloat16, device=device)
    if rank == 0:
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device=device)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        plan = sender.plan(model)
        shared = [plan[0], free_port(os.environ["MASTER_ADDR"])]
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
        dest = {name: torch.empty(shape, dtype=getattr(torch, dt), device=device)  # the engine's parameters
                for b in buckets for name, dt, shape, _ in b["tensors"]}
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    token = torch.zeros(1, device=device)

    def barrier():
        group.allreduce([token]).wait()
        if cuda:
            torch.cuda.synchronize()

    def ours():
        if rank == 0:
            sender.send(model, plan)
        else:  # one multi-tensor copy per bucket: ~170 tensors of 3 MB per 512 MB bucket cost ~1 ms of launches
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
        want = {k: v.to(torch.bfloat16) for k, v in ours_to_hf(dict(model.named_parameters()), cfg).items()}
        sums = [want[name].double().sum().item() for b in buckets for name, *_ in b["tensors"]]
    else:
        sums = [dest[name].double().sum().item() for b in buckets for name, *_ in b["tensors"]]
    gathered = [None, None]
    dist.all_gather_object(gathered, sums)
    lora_result = _lora_sync(rank, opt, cfg, model if rank == 0 else None, group, device, timed) if opt["lora_rank"] else {}
    group.shutdown()
    dist.destroy_process_group()
    raw_t, ours_t = statistics.median(raw_s), statistics.median(ours_s)
    result = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", backend=backend,
                  layers=cfg.num_hidden_layers, gb=round(total / 1e9, 3), buckets=len(buckets),
                  bucket_mb=opt["bucket_mb"], iters=opt["iters"], raw_gbps=round(total / raw_t / 1e9, 2),
                  ours_gbps=round(total / ours_t / 1e9, 2), raw_s=round(raw_t, 4), ours_s=round(ours_t, 4),
                  match=gathered[0] == gathered[1], ratio=round(raw_t / ours_t, 3))
    if lora_result:
        result.update(lora_result, full_bytes=total, full_over_lora=round(ours_t / lora_result["lora_s"], 1))
    if rank == 0:
        print(f"{result['gb']} GB in {len(buckets)} buckets: ours {result['ours_gbps']} GB/s, "
              f"raw broadcast {result['raw_gbps']} GB/s, ratio {result['ratio']}, receiver matches: {result['match']}")
        if lora_result:
            print(f"LoRA rank {opt['lora_rank']}: {result['lora_bytes'] / 1e6:.2f} MB per sync in {result['lora_s']} s, "
                  f"full weights {total / 1e6:.1f} MB in {result['ours_s']} s ({result['full_over_lora']}x the time); "
                  f"receiver matches: {result['lora_match']}")
        if results is not None:
            results.put(result)
    return result


def _lora_sync(rank, opt, cfg, model, group, device, timed):
    """The same sync for a LoRA run: rank 0's model gets adapters (lora.py) and sends them alone, in fp32."""
    import statistics
    import torch
    import torch.distributed as dist
    import lora
    from weights_sync import BucketReceiver, WeightSender
    adapter = lora.peft_config(opt["lora_rank"], 2.0 * opt["lora_rank"], lora.TARGETS)
    sender = WeightSender(bucket_bytes=opt["bucket_mb"] << 20, device=device, adapter=adapter)
    shared = [None]
    if rank == 0:
        lora.add_adapters(model, opt["lora_rank"], 2.0 * opt["lora_rank"], lora.TARGETS)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if lora.is_adapter(name):
                    p.normal_(0.0, 0.02)
        plan = sender.plan(model)
        shared = [plan[0]]
        sender.group = group
    dist.broadcast_object_list(shared, src=0)
    buckets = shared[0]
    dest = {name: torch.empty(shape, dtype=getattr(torch, dt), device=device)
            for b in buckets for name, dt, shape, _ in b["tensors"]}

    def send():
        if rank == 0:
            sender.send(model, plan)
        else:
            for tensors in BucketReceiver(group, buckets, device).iter_buckets():
                torch._foreach_copy_([dest[name] for name, _ in tensors], [t for _, t in tensors])
    timed(send)
    seconds = statistics.median(timed(send) for _ in range(opt["iters"]))
    if rank == 0:
        sent = lora.peft_tensors({n: p.detach() for n, p in model.named_parameters() if lora.is_adapter(n)})
        sums = [sent[name].double().sum().item() for name in dest]
        sender.group = None  # the group is the caller's
    else:
        sums = [t.double().sum().item() for t in dest.values()]
    gathered = [None, None]
    dist.all_gather_object(gathered, sums)
    return dict(lora_rank=opt["lora_rank"], lora_bytes=sum(b["nbytes"] for b in buckets), lora_s=round(seconds, 4),
                lora_match=gathered[0] == gathered[1])


# -----------------------------------------------------------------------------
# lora: the routed experts' forward + backward with adapters on a frozen base vs full fine-tuning


def bench_lora(*args):
    """The grouped-GEMM experts (experts.experts_grouped_mm) forward + backward on `rows` routed rows, bf16: with
    rank-`rank` adapters on gate, up and down over a frozen base (gradients of the adapters, the rows and the routing
    weights) against full fine-tuning (gradients of the base weights too), and the frozen base without adapters (the
    floor: no weight gradient GEMMs at all). Default shape: Qwen3-30B-A3B's experts (D 2048, H 768), 16 local experts
    (128 over expert parallelism 8). Prints ms of each and ratio = LoRA / full fine-tuning (target: <= 1.0). Each step
    is timed as the trainer runs it, launches from Python included: at a few thousand rows per expert the LoRA step
    launches more kernels than the GPU needs time for on a slow host CPU.

        python bench.py lora --experts=128 --rows=32768 --rank=8
    """
    import torch
    from experts import experts_grouped_mm
    if not torch.cuda.is_available():
        sys.exit("bench.py lora needs a GPU (the grouped GEMMs are the CUDA path)")
    opt = _int_options(args, experts=16, dim=2048, hidden=768, rows=32768, rank=8, iters=20, seed=0)
    E, D, H, N, r = opt["experts"], opt["dim"], opt["hidden"], opt["rows"], opt["rank"]
    g = torch.Generator(device="cuda").manual_seed(opt["seed"])
    randn = lambda *shape, std=0.02: (torch.randn(*shape, device="cuda", generator=g) * std).bfloat16()  # noqa: E731
    counts = torch.bincount(torch.randint(0, E, (N,), device="cuda", generator=g), minlength=E)  # uniform routing
    x, scale = randn(N, D, std=1.0), torch.rand(N, device="cuda", generator=g).bfloat16()
    base = [randn(E, H, D), randn(E, H, D), randn(E, D, H)]
    adapters = [randn(E, r, D), randn(E, H, r), randn(E, r, D), randn(E, H, r), randn(E, r, H), randn(E, D, r)]
    grad = randn(N, D, std=1.0)

    def step(train_base, with_lora):
        leaves = [t.detach().requires_grad_() for t in [x, scale]]
        ws = [t.detach().requires_grad_(train_base) for t in base]
        lo = [t.detach().requires_grad_() for t in adapters]
        lora = (2.0, tuple(zip(lo[0::2], lo[1::2]))) if with_lora else None
        experts_grouped_mm(leaves[0], counts, leaves[1], *ws, lora).backward(grad)

    def ms(*variant):  # CUDA events around `iters` steps after warm-up (the first calls compile silu_mul)
        for _ in range(5):
            step(*variant)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(opt["iters"]):
            step(*variant)
        end.record()
        torch.cuda.synchronize()
        return round(start.elapsed_time(end) / opt["iters"], 3)
    full, lora, floor = ms(True, False), ms(False, True), ms(False, False)
    result = dict(opt, full_ms=full, lora_ms=lora, frozen_base_ms=floor, ratio=round(lora / full, 3),
                  over_frozen_base=round(lora / floor, 3))
    print(f"experts {E} x D {D} x H {H}, {N} rows, rank {r}: LoRA {lora} ms, full fine-tuning {full} ms, "
          f"frozen base without adapters {floor} ms (fwd + bwd)")
    return result


# -----------------------------------------------------------------------------
# async: the streaming rollout pool vs a synchronous generate-then-train loop, same engine and trainer


def bench_async(*args):
    """Agents with two model turns around a tool whose latency is heavy-tailed (lognormal, median tool_median_ms,
    sigma tool_sigma_pct / 100, capped at 30 s), trained on by the real trainer with real weight syncs to one real
    engine. Baseline, same run, same engine and trainer: a synchronous loop that starts groups_per_batch groups,
    waits for all of them, trains, syncs and only then starts the next ones (RolloutPool.next_batch(hold=True)).
    Ours: the streaming pool with groups_in_flight groups running, a batch as soon as groups_per_batch are done.
    Both phases draw the same latency sequence. Prints attempts trained per second of both, ours / baseline
    (target >= 1.8) and the fraction of wall time the engine had no request in flight.

        python bench.py async
        python bench.py async --steps=10 --groups_in_flight=12 --tool_sigma_pct=200
    """
    import asyncio
    import math
    import os
    import random
    import time
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
    # tools like code execution or search answer in about a second, with a long tail: median 0.5 s, p99 ~16 s
    opt = _int_options(args, steps=8, group_size=4, groups_per_batch=4, groups_in_flight=8, max_tokens=16,
                       tool_median_ms=500, tool_sigma_pct=150, seed=0)
    path = ensure_tiny_model()
    # a tiny learning rate: both phases do the same work (train step, weight sync) on a policy that stays put
    cfg = train.configure([f"--model_path={path}", "--learning_rate=1e-7", "--min_lr=1e-7", "--max_staleness=8",
                           f"--group_size={opt['group_size']}", f"--groups_per_batch={opt['groups_per_batch']}"])
    _, world, device = train.init_distributed()
    model, optimizer, _, _ = train.build_trainer(cfg, world, device)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    engines, _ = rollout.start_engines(path, 1, max_model_len=1024, memory_fraction=0.3)
    router = rollout.Router(engines)
    router.mark_connected([])
    server = capture.CaptureServer(router, path, max_model_len=1024)
    server.start_in_thread()
    run, loop, sender = dict(router=router), asyncio.new_event_loop(), weights_sync.WeightSender()
    latency = {}

    async def agent(ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        first = await client.chat.completions.create(model=ctx.model, messages=messages, **ctx.sampling)
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        seconds = latency["rng"].lognormvariate(math.log(opt["tool_median_ms"] / 1000), opt["tool_sigma_pct"] / 100)
        await asyncio.sleep(min(seconds, 30.0))  # the tool
        messages.append({"role": "user", "content": "The tool says 42."})
        second = await client.chat.completions.create(model=ctx.model, messages=messages, **ctx.sampling)
        return float(second.choices[0].finish_reason == "stop")

    def prompts():
        for i in range(10**9):
            yield {"prompt": f"Look up item {i}."}

    version = 0

    def phase(steps, groups_in_flight, hold):
        nonlocal version
        latency["rng"] = random.Random(opt["seed"])
        pool = rollout.RolloutPool(as_run_function(agent), prompts(), server, group_size=opt["group_size"],
                                   groups_per_batch=opt["groups_per_batch"], groups_in_flight=groups_in_flight,
                                   sampling=dict(temperature=1.0, max_tokens=opt["max_tokens"]),
                                   attempt_timeout_s=120.0).start()
        router.reset_idle_clock()
        t0, attempts, tokens, stale = time.perf_counter(), 0, 0, 0
        for step in range(steps):
            records = pool.next_batch(hold=hold)
            segments, advantages = train.share_batch(records, cfg, 0, 1)
            m = train.train_step(model, optimizer, train.pack_microbatches(segments, advantages,
                                                                           cfg["microbatch_tokens"]), cfg, version)
            version += 1
            train.push_weights(run, loop, sender, model, version, 0, 1)
            if hold:
                pool.resume()
            attempts += len({r["attempt_id"] for r in records})
            tokens += sum(r["action_tokens"] for r in records)
            stale += round(m["stale_frac"] * m["action_tokens"])
        elapsed, idle = time.perf_counter() - t0, router.idle_fraction()
        pool.stop()
        return dict(attempts_per_s=round(attempts / elapsed, 3), generated_tokens_per_s=round(tokens / elapsed, 1),
                    engine_idle_fraction=round(idle, 3), elapsed_s=round(elapsed, 2), stale_dropped=stale)

    try:
        phase(1, opt["groups_per_batch"], True)  # warm-up: first requests, first sync
        baseline = phase(opt["steps"], opt["groups_per_batch"], True)
        ours = phase(opt["steps"], opt["groups_in_flight"], False)
    finally:
        server.stop_thread()
        sender.close()
        ray.shutdown()
    ratio = ours["attempts_per_s"] / baseline["attempts_per_s"]
    print(f"synchronous: {baseline['attempts_per_s']:.2f} attempts/s, engine idle {baseline['engine_idle_fraction']:.0%}; "
          f"streaming ({opt['groups_in_flight']} groups in flight): {ours['attempts_per_s']:.2f} attempts/s, "
          f"engine idle {ours['engine_idle_fraction']:.0%}; {ratio:.2f}x")
    return dict(options=opt, synchronous=baseline, streaming=ours, ratio=round(ratio, 3))


# -----------------------------------------------------------------------------
# capture: agents through the capture server (loopback HTTP) vs the same agents calling the engine directly


def bench_capture(*args):
    """N agents run the same multi-turn workload on one tiny-model engine, in one process and one event loop,
    five ways: calling Engine.generate directly with token ids they extend themselves (the baseline); through the
    capture server with the async OpenAI SDK, as agents do (chat completions, and the Responses API with the output
    items sent back as input, as the OpenAI Agents SDK does); through the capture server with a bare HTTP client
    (httpx, JSON bodies), which leaves out the SDK's own client-side work; and with the same SDK through vLLM's own
    OpenAI-compatible server on the same engine (what an SDK agent would call without us; it records nothing).
    Same prompts and seeds, so the engine does the same work (the generated token counts are printed per mode);
    prefix caching is off so that repeating a prompt costs the same; modes alternate. Clients
    are made and connected before timing (agent set-up, the same whatever the server). Prints generated tokens/s
    of each, ratio = capture (SDK) / direct (target >= 0.95), responses_ratio the same for the Responses API, and
    sdk_vs_vllm_server = capture (SDK) / vLLM's
    server (SDK). Added latency per request = the agent's wait minus
    the engine's time on that same request (timed around the backend call), so engine noise cancels; p50 and p99
    under the full load and with one agent alone (target <= 5 ms at p50). The loop is the one the server runs on
    in training (capture.new_event_loop: uvloop). Every turn asks for `tokens` tokens, so all agents finish a turn
    at the same engine step and wait on each other's client work (the worst case); --spread=S draws each turn's
    max_tokens from tokens +- S instead (the same draws in every mode), as agents' turns differ in length.
    --threads=1 lays the process out as training does: the server and the engine's client on the server's thread
    and loop, the agents on another thread's asyncio loop (as the rollout pool runs them), sharing the GIL.

        python bench.py capture                      # CPU, tiny model, ~1.5 minutes
        python bench.py capture --spread=32          # turns of 16..80 tokens
        python bench.py capture --threads=1          # agents on their own thread, as in training
        python bench.py capture --agents=32 --turns=6 --tokens=64 --rounds=3
    """
    import asyncio
    import os
    import statistics
    import time

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import httpx
    import openai

    import capture
    from engine import Engine
    from tiny import ensure_tiny_model
    opt = _int_options(args, agents=16, turns=4, tokens=48, rounds=6, spread=0, threads=0)
    path = ensure_tiny_model()

    class TimedEngine:  # the server's backend: the engine, with the time of each call kept per session
        def __init__(self, engine):
            self.engine, self.seconds = engine, {}

        async def generate(self, prompt, sampling, request_id, session_id=None):
            start = time.perf_counter()
            out = await self.engine.generate(prompt, sampling, request_id, session_id=session_id)
            self.seconds.setdefault(session_id, []).append(time.perf_counter() - start)
            return out

    async def run():
        engine = Engine(path, max_model_len=2048, enable_prefix_caching=False, worker_extension_cls=None)
        backend = TimedEngine(engine)
        server = capture.CaptureServer(backend, path, max_model_len=2048)

        async def on_server(coro):  # the server's and the engine client's work runs on the server's loop
            if not opt["threads"]:
                return await coro
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, server.loop))

        if opt["threads"]:  # as in training: server and engine client on the server's thread, agents on this one
            server.start_in_thread()
            server.run_in_loop(engine.start())
        else:
            await engine.start()
            await server.start()
        async def start_vllm_server():  # vLLM's OpenAI-compatible app on our engine's AsyncLLM, served like ours
            from vllm.entrypoints.launchers.api_server.app_state import init_app_state
            from vllm.entrypoints.launchers.app import build_app
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
            from vllm.utils.argparse_utils import FlexibleArgumentParser
            vargs = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", path, "--served-model-name", "tiny"])
            app = build_app(vargs, supported_tasks=("generate",), model_config=engine.llm.model_config)
            await init_app_state(engine.llm, app.state, vargs, ("generate",))
            sock = capture.bind_socket()
            return *(await capture.serve_app(app, sock)), f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

        async def stop_vllm_server():
            vserver.should_exit = True
            await serving

        vserver, serving, vllm_url = await on_server(start_vllm_server())
        tok = server.tokenizer
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000))

        def user_text(agent, turn):
            return f"Agent {agent}, step {turn}: what is {agent} plus {turn}?"

        def turn_tokens(agent, turn):  # max_tokens of a turn: tokens +- spread, the same in every mode
            return opt["tokens"] - opt["spread"] + (agent * 7919 + turn * 104729) % (2 * opt["spread"] + 1)

        async def direct(agent, session, waits):
            ids, generated = server.render([{"role": "user", "content": user_text(agent, 0)}], [], True), 0
            for turn in range(opt["turns"]):
                start = time.perf_counter()
                out = await on_server(engine.generate(ids, dict(max_tokens=turn_tokens(agent, turn),
                                                                seed=agent * 100 + turn, stop_token_ids=server.end_ids),
                                                      f"{session.id}-{turn}"))
                waits.append(time.perf_counter() - start)
                generated += len(out["token_ids"])
                ids = ids + out["token_ids"] + ([] if out["token_ids"][-1:] == [im_end] else [im_end])
                ids += tok("\n<|im_start|>user\n" + user_text(agent, turn + 1) + "<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)["input_ids"]
            return generated

        async def sdk(agent, session, waits):
            messages, generated = [{"role": "user", "content": user_text(agent, 0)}], 0
            for turn in range(opt["turns"]):
                start = time.perf_counter()
                r = await session.client.chat.completions.create(model="tiny", messages=messages, seed=agent * 100 + turn,
                                                                 max_tokens=turn_tokens(agent, turn))
                waits.append(time.perf_counter() - start)
                generated += r.usage.completion_tokens
                messages += [r.choices[0].message, {"role": "user", "content": user_text(agent, turn + 1)}]
            return generated

        async def bare_http(agent, session, waits):
            url, headers = session.base_url + "/chat/completions", {"authorization": f"Bearer {session.api_key}"}
            messages, generated = [{"role": "user", "content": user_text(agent, 0)}], 0
            for turn in range(opt["turns"]):
                start = time.perf_counter()
                body = dict(model="tiny", messages=messages, max_tokens=turn_tokens(agent, turn), seed=agent * 100 + turn)
                r = (await http.post(url, headers=headers, json=body)).json()
                waits.append(time.perf_counter() - start)
                generated += r["usage"]["completion_tokens"]
                messages += [r["choices"][0]["message"], {"role": "user", "content": user_text(agent, turn + 1)}]
            return generated

        async def responses(agent, session, waits):
            items, generated = [{"role": "user", "content": user_text(agent, 0)}], 0
            for turn in range(opt["turns"]):
                start = time.perf_counter()
                r = await session.client.responses.create(model="tiny", input=items, extra_body={"seed": agent * 100 + turn},
                                                          max_output_tokens=turn_tokens(agent, turn))
                waits.append(time.perf_counter() - start)
                generated += r.usage.output_tokens
                items += [item.model_dump(exclude_none=True) for item in r.output]
                items.append({"role": "user", "content": user_text(agent, turn + 1)})
            return generated

        async def phase(name, agents):
            """Run the agents at once; returns (generated tokens, seconds, per-request added latencies)."""
            agent_fn = modes[name]
            sessions = [server.new_session() for _ in agents]  # set-up, untimed: session, client, connection
            for s in sessions:
                s.client = openai.AsyncOpenAI(base_url=vllm_url if name == "vllm" else s.base_url, api_key=s.api_key,
                                              max_retries=0)
            if agent_fn in (sdk, responses):
                await asyncio.gather(*[s.client.models.list() for s in sessions])
            waits = [[] for _ in agents]
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*[agent_fn(a, s, w) for a, s, w in zip(agents, sessions, waits)]))
            seconds = time.perf_counter() - start
            added = []
            for s, w in zip(sessions, waits):
                if name in ("sdk", "http", "responses"):  # vLLM's server calls the engine itself: not timed there
                    added += [a - b for a, b in zip(w, backend.seconds.pop(s.id))]
                await s.client.close()
                server.finish_session(s.id, 0.0)
                server.drop_session(s.id)
            return tokens, seconds, added

        modes = {"direct": direct, "sdk": sdk, "http": bare_http, "vllm": sdk, "responses": responses}
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

    # one loop: the server's (uvloop); --threads=1: agents on asyncio's loop, as the rollout pool runs them
    with asyncio.Runner(loop_factory=asyncio.new_event_loop if opt["threads"] else capture.new_event_loop) as runner:
        totals = runner.run(run())
    tput = {name: t[0] / t[1] for name, t in totals.items()}
    out = dict(agents=opt["agents"], turns=opt["turns"], tokens=opt["tokens"], rounds=opt["rounds"],
               generated_tokens={name: t[0] for name, t in totals.items()},  # equal: the engine did the same work
               direct_tokens_per_s=round(tput["direct"], 1), vllm_server_tokens_per_s=round(tput["vllm"], 1))

    def percentiles(seconds):
        ms = sorted(x * 1000 for x in seconds)
        return round(statistics.median(ms), 3), round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3)
    for name in ("sdk", "http", "responses"):
        out[f"{name}_tokens_per_s"] = round(tput[name], 1)
        out[f"{name}_ratio"] = round(tput[name] / tput["direct"], 4)
        out[f"{name}_added_ms_p50"], out[f"{name}_added_ms_p99"] = percentiles(totals[name][2])
        out[f"{name}_alone_added_ms_p50"], out[f"{name}_alone_added_ms_p99"] = percentiles(totals[name][3])
    out["sdk_vs_vllm_server"] = round(tput["sdk"] / tput["vllm"], 4)
    out["ratio"] = out["sdk_ratio"]
    print(f"{opt['agents']} agents x {opt['turns']} turns x {opt['tokens']} tokens, {opt['rounds']} rounds: direct "
          f"{tput['direct']:.0f} tok/s; capture via the OpenAI SDK {tput['sdk']:.0f} tok/s (x{out['sdk_ratio']:.3f}), "
          f"via bare HTTP {tput['http']:.0f} tok/s (x{out['http_ratio']:.3f}); the SDK through vLLM's own server "
          f"{tput['vllm']:.0f} tok/s (capture / vLLM's server: x{out['sdk_vs_vllm_server']:.3f}); the Responses API "
          f"via the SDK {tput['responses']:.0f} tok/s (x{out['responses_ratio']:.3f})")
    for name, label in (("sdk", "OpenAI SDK"), ("http", "bare HTTP"), ("responses", "Responses API")):
        print(f"added latency per request, {label}: p50 {out[f'{name}_added_ms_p50']:.2f} ms, p99 "
              f"{out[f'{name}_added_ms_p99']:.2f} ms under load; p50 {out[f'{name}_alone_added_ms_p50']:.2f} ms, "
              f"p99 {out[f'{name}_alone_added_ms_p99']:.2f} ms alone")
    return out


# -----------------------------------------------------------------------------
# train: our FSDP2 + expert-parallel trainer vs transformers' Qwen3MoeForCausalLM under FSDP2, same GPUs, same run


def bench_train(*args):
    """Training throughput on a Qwen3-30B-A3B-shaped MoE with few layers (hidden 2048, 32 heads, 4 kv heads,
    head_dim 128, 128 experts top-8, expert hidden 768, vocab 151936), bf16 compute, fp32 master weights, AdamW,
    `accum` microbatches of `batch` sequences of `seq` tokens per GPU per optimizer step. Ours: train.py's model,
    fully_shard, expert parallel over `ep` GPUs (default: all), grouped-GEMM experts, the real train_step (chunked
    logprobs, PPO loss, clipping, AdamW). Baseline, same run and GPUs: transformers' Qwen3MoeForCausalLM (its
    default experts implementation) with each decoder layer and the root under fully_shard (same mixed precision),
    full logits + log_softmax, the same optimizer. Prints tokens/s, MFU, peak memory of both and ratio = ours / transformers tokens/s.

        torchrun --nproc_per_node=1 bench.py train               # 1 GPU
        torchrun --nproc_per_node=2 bench.py train               # 2 GPUs, ep=2
        torchrun --nproc_per_node=2 bench.py train --layers=8 --batch=2 --compile=1
        python bench.py train --smoke                            # CPU, tiny shape: exercises both code paths

    Options: --layers=4 --seq=4096 --batch=4 (sequences per microbatch) --accum=1 (microbatches per optimizer step,
    both trainers: the optimizer step and gradient clipping are per-step costs that a real RL window, many
    microbatches long, spreads out) --steps=6 --warmup=3 --ep=0 (0 = all ranks) --compile=0 (1: compile
    attention and norms of both models) --ac=0 (activation checkpointing, both) --baseline=1 --smoke=0
    --chunk=2048 (ours: tokens per logprob chunk) --keep_logits=1 (ours keeps the bf16 logits for backward, 5 GB
    at 16K tokens, instead of recomputing them; the baseline holds full logits anyway) --lora=0 (ours trains LoRA
    adapters of this rank on every target, experts included, on the frozen bf16 base; the baseline stays full).
    MFU = 6 * N * tokens/s / (989e12 * GPUs), N = active matmul weights per token (attention projections, router,
    the top-8 experts, dense MLPs, lm_head; not the embedding lookup); attention scores are not in `mfu`, and
    `mfu_with_attention` adds 6 * L * T * heads * head_dim per token (causal QK^T and AV, forward + backward).
    """
    import os
    import time
    args = ["--smoke=1" if a == "--smoke" else a for a in args]
    opt = _int_options(args, layers=4, seq=4096, batch=4, steps=6, warmup=3, ep=0, compile=0, ac=0, baseline=1,
                       smoke=0, profile=0, keep_logits=1, chunk=2048, accum=1, lora=0)
    if opt["smoke"]:
        opt.update(seq=64, batch=2, steps=2, warmup=1)
    import torch
    import torch.distributed as dist
    import train
    from model import ModelConfig, num_params
    if "TORCHELASTIC_RUN_ID" not in os.environ and torch.cuda.device_count() > 1:
        print("bench.py train: running on 1 GPU; use torchrun --nproc_per_node=N for N GPUs", flush=True)
    rank, world, device = train.init_distributed()
    cuda = device.type == "cuda"
    if not cuda and not opt["smoke"]:
        sys.exit("bench.py train needs CUDA GPUs (run it under torchrun); on CPU use --smoke")
    ep = opt["ep"] or world
    mcfg = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=opt["layers"],
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                       num_experts_per_tok=8, moe_intermediate_size=768, max_position_embeddings=40960)
    if opt["smoke"]:
        mcfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512)
    cfg = train.configure([f"--ep_size={ep}", f"--param_dtype={'bfloat16' if cuda else 'float32'}",
                           f"--activation_checkpointing={bool(opt['ac'])}", f"--logprob_chunk_size={opt['chunk']}",
                           f"--logprob_keep_logits={bool(opt['keep_logits'])}", f"--lora_rank={opt['lora']}",
                           "--learning_rate=1e-5", "--min_lr=1e-6", "--warmup_steps=1", "--max_steps=1000"])
    B, T, A = opt["batch"], opt["seq"], opt["accum"]
    g = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own data, as in training
    ids = torch.randint(0, mcfg.vocab_size, (B, T + 1), device=device, generator=g)
    microbatch = dict(input_ids=ids[:, :-1], targets=ids[:, 1:], action_mask=torch.ones(B, T, device=device),
                      behavior_logprobs=torch.full((B, T), -12.0, device=device),
                      token_versions=torch.zeros(B, T, dtype=torch.long, device=device),
                      advantages=torch.randn(B, device=device, generator=g), routed_experts=None)
    n_active = num_params(mcfg, active=True) - mcfg.vocab_size * mcfg.hidden_size  # minus the embedding lookup
    attn_per_token = 6 * mcfg.num_hidden_layers * T * mcfg.num_attention_heads * mcfg.head_dim

    def measure(name, step_fn):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(opt["warmup"]):
            step_fn(i)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(opt["steps"]):
            step_fn(opt["warmup"] + i)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        seconds = (time.perf_counter() - t0) / opt["steps"]
        peak = torch.tensor(torch.cuda.max_memory_allocated(device) if cuda else 0, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        tokens_per_s = world * B * T * A / seconds
        out = dict(tokens_per_s=round(tokens_per_s), step_s=round(seconds, 4), peak_gb=round(peak.item() / 1e9, 2),
                   mfu=round(6 * n_active * tokens_per_s / (989e12 * world), 4),
                   mfu_with_attention=round((6 * n_active + attn_per_token) * tokens_per_s / (989e12 * world), 4))
        train.print0(f"{name}: {out}")
        if opt["profile"]:  # one more step under the profiler: where the time goes, per kernel
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] +
                                        ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])) as prof:
                step_fn(opt["warmup"] + opt["steps"])
                if cuda:
                    torch.cuda.synchronize(device)
            train.print0(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                                   row_limit=opt["profile"]))
        return out

    def free_memory():
        import gc
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    # ours
    meshes = train.build_meshes(world, ep, device.type)
    model = train.build_model(cfg, meshes, device, model_config=mcfg)
    if opt["compile"]:
        _compile_attention_and_norms(model)
    optimizer = train.build_optimizer(model, cfg)
    last = {}

    def ours_step(i):
        last.update(train.train_step(model, optimizer, [microbatch] * A, cfg, policy_version=0, step=i))
    result = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", gpus=world if cuda else 0, ep=ep,
                  layers=mcfg.num_hidden_layers, seq=T, batch_per_gpu=B, microbatches_per_step=A,
                  tokens_per_step=world * B * T * A,
                  active_params=n_active, compile=bool(opt["compile"]), activation_checkpointing=bool(opt["ac"]),
                  keep_logits=bool(opt["keep_logits"]), lora_rank=opt["lora"])
    result["ours"] = measure("ours", ours_step)
    result["ours"]["loss"], result["ours"]["skipped_steps"] = last["loss"], int(last["skipped"])
    model = optimizer = None  # the closure's references too: the baseline gets the whole GPU
    free_memory()

    # transformers' Qwen3MoeForCausalLM under FSDP2
    result["ratio"] = None
    if opt["baseline"]:
        try:
            hf, hf_optimizer, info = _hf_fsdp_model(mcfg, cfg, device, bool(opt["compile"]), bool(opt["ac"]))
            result["transformers"] = info

            def hf_step(i):
                for _ in range(A):  # gradient accumulation over the window, like ours
                    logits = hf(input_ids=microbatch["input_ids"], use_cache=False).logits  # (B, T, V)
                    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, microbatch["targets"][..., None])
                    loss = -(microbatch["advantages"][:, None] * logprobs.squeeze(-1)).mean() / A
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg["grad_clip"])
                for group in hf_optimizer.param_groups:
                    group["lr"] = train.learning_rate_at(i, cfg)
                hf_optimizer.step()
                hf_optimizer.zero_grad(set_to_none=True)
            result["transformers"].update(measure("transformers", hf_step))
            result["ratio"] = round(result["ours"]["tokens_per_s"] / result["transformers"]["tokens_per_s"], 3)
        except Exception as e:  # report ours even when the baseline cannot run here
            result["transformers_error"] = f"{type(e).__name__}: {e}"
            train.print0(f"transformers baseline failed: {result['transformers_error']}")
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        sys.exit(0)  # rank 0 prints the result
    return result


# -----------------------------------------------------------------------------
# objectstore: image trajectories to the trainer ranks by ref (ours) vs gathered in the driver first


def _image_files(n, size, noise, seed):
    """n PNG files of size x size: noise (incompressible, like photographs or screenshots) or geometry diagrams."""
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
            image = Image.fromarray(np.random.default_rng(seed + i).integers(0, 256, (size, size, 3), dtype=np.uint8))
        else:
            image = geometry.scene(geometry.KINDS[i % len(geometry.KINDS)], random.Random(seed + i))[0]
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        files.append(buf.getvalue())
    return files


def bench_objectstore(*args):
    """The driver's peak host memory while a batch of image trajectories reaches the trainer ranks. `attempts`
    segments of `images` PNG images of size x size each (plus ~200 text tokens) are recorded by a rollout-side
    actor, which puts each one in its node's object store (rollout.put_experience) and hands the driver the light
    records. Ours, as train.share_batch: the driver splits the records by tokens and sends each of `ranks`
    trainer actors its refs; each fetches its own and patches its images (vl.with_pixels, the tiny VLM's image
    processor). Baseline: the driver first gathers the batch (ray.get of every segment), then sends each rank its
    segments by value. The driver's resident memory is sampled every 5 ms; ratio = baseline peak / ours peak (above
    the driver's memory at the phase's start). Real Ray, local cluster.

        python bench.py objectstore                       # 256 attempts x 4 noise images of 448x448, 2 ranks
        python bench.py objectstore --noise=0             # geometry diagrams instead (PNG compresses them ~40x)
    Options: --attempts=256 --images=4 --size=448 --ranks=2 --noise=1 --baseline_first=0
    """
    import os
    import threading
    import time
    import psutil
    import ray
    opt = _int_options(args, attempts=256, images=4, size=448, ranks=2, noise=1, baseline_first=0)
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
            n_image = int(sum(t * h * w for t, h, w in grid)) // 4 + 2 * len(files)  # merged tokens, start/end
            out = []
            for a in range(attempts):
                imgs = files if a % 8 else _image_files(len(files), opt["size"], noise, seed=offset + a)  # some new
                T = n_image + 200 + a % 50
                out.append(rollout.put_experience(dict(
                    attempt_id=f"{offset}-{a}", segment_index=0, token_ids=[7] * T, action_mask=[0] * (T - 100) + [1] * 100,
                    behavior_logprobs=[-0.5] * T, token_versions=[-1] * (T - 100) + [0] * 100, images=imgs,
                    image_grid_thw=grid.tolist()), reward=float(a % 2), group_id=a // 4))
            return out

    @ray.remote
    class Rank:  # a trainer rank's share of the batch: fetch (refs) or receive (values), then patch the images
        def take(self, shard, by_ref):
            import vl
            segments = ray.get([r["ref"] for r in shard]) if by_ref else shard
            # one segment's patches at a time: the driver is measured here, not the ranks
            pixel_bytes = sum(vl.with_pixels(dict(s), model_path)["pixel_values"].nbytes for s in segments)
            return dict(segments=len(segments), pixel_bytes=pixel_bytes)

    import rollout
    recorder, ranks = Recorder.remote(), [Rank.remote() for _ in range(opt["ranks"])]
    warm = ray.get(recorder.record.remote(1, 1, 1, 0))  # actors up, imports and image processors loaded
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
        records = ray.get(recorder.record.remote(opt["attempts"], opt["images"], opt["noise"], offset))
        if not by_ref:  # the baseline: the whole batch in the driver first
            segments = dict(zip([r["attempt_id"] for r in records], ray.get([r["ref"] for r in records])))
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
    result = dict(attempts=opt["attempts"], images_per_attempt=opt["images"], size=opt["size"], ranks=opt["ranks"],
                  image_kind="noise" if opt["noise"] else "geometry diagrams",
                  image_mb_per_batch=round(opt["attempts"] * per_attempt / 2**20, 1))
    for by_ref in ((False, True) if opt["baseline_first"] else (True, False)):
        result["ours" if by_ref else "gather"] = phase(by_ref, 10**6 * (1 + by_ref))
    result["ratio"] = round(result["gather"]["driver_peak_mb"] / max(result["ours"]["driver_peak_mb"], 0.1), 1)
    ray.shutdown()
    return result


# -----------------------------------------------------------------------------
# vl: our Qwen3-VL-MoE (vision tower, M-RoPE, deepstack) vs transformers' Qwen3VLMoeForConditionalGeneration, 1 GPU


def _vl_batch(vc, rows, T, vocab, generator, device):
    """Rows of T tokens with images in them (random text, then per image vision_start, its t*h*w/m^2 image
    tokens, vision_end, a few text tokens), the patches of all images in order, and image_grid_thw."""
    m2 = vc.spatial_merge_size ** 2
    special = min(vc.image_token_id, vc.video_token_id, vc.vision_start_token_id, vc.vision_end_token_id)
    import torch
    ids = torch.randint(0, min(vocab, special), (len(rows), T), generator=generator, device=device)
    for r, grids in enumerate(rows):
        at = 8
        for t, h, w in grids:
            n = t * h * w // m2
            if at + n + 10 > T:
                raise ValueError(f"images {grids} do not fit in {T} tokens")
            ids[r, at], ids[r, at + 1:at + 1 + n], ids[r, at + 1 + n] = (vc.vision_start_token_id, vc.image_token_id,
                                                                         vc.vision_end_token_id)
            at += n + 10
    flat = [thw for grids in rows for thw in grids]
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    pixel_values = torch.randn(sum(t * h * w for t, h, w in flat), patch, generator=generator, device=device)
    return ids, pixel_values, torch.tensor(flat, device=device)


def bench_vl(*args):
    """The VLM's training forward + backward on one GPU at Qwen3-VL-30B-A3B shapes (configs/qwen3_vl_30b_a3b.py:
    hidden 2048, 128 experts top-8, vocab 151936, the 27-layer 1152-wide vision tower with deepstack into the
    first 3 layers) with `layers` text layers and random weights, ours (model.py) against transformers'
    Qwen3VLMoeForConditionalGeneration loaded from the checkpoint ours writes.
    1. Parity, fp32 (TF32 off): logits on sequences holding several images of several sizes (one beyond the
       48x48 learned position grid), and every parameter's gradient of a token-logprob loss, each relative to
       the reference tensor's largest entry. Then both models in bf16 against the fp32 reference logits.
    2. Speed, bf16 weights: `batch` sequences of `seq` tokens with `images` 448x448 images each (784 patches,
       196 image tokens), forward + backward of the mean token logprob (ours: hidden_states + chunked logprobs;
       transformers: full logits + log_softmax). ratio = ours / transformers tokens/s.

        python bench.py vl                      # GPU
        python bench.py vl --smoke              # CPU, tiny shapes: exercises both code paths
    Options: --layers=4 --depth=27 (vision blocks) --seq=4096 --batch=2 --images=4 --steps=6 --warmup=3 --smoke=0
    --profile=0 (N: after each measurement, one step under torch.profiler, its N costliest ops)
    """
    import dataclasses
    import runpy
    import tempfile
    import time
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForImageTextToText
    from loss import token_logprobs
    from model import ModelConfig, Transformer, init_parameters, ours_to_hf
    args = ["--smoke=1" if a == "--smoke" else a for a in args]
    opt = _int_options(args, layers=4, depth=27, seq=4096, batch=2, images=4, steps=6, warmup=3, smoke=0, profile=0)
    cuda = torch.cuda.is_available() and not opt["smoke"]
    if not cuda and not opt["smoke"]:
        sys.exit("bench.py vl needs a CUDA GPU; on CPU use --smoke")
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 parity means fp32
    hf_cfg = runpy.run_path("configs/qwen3_vl_30b_a3b.py")["model_config"]
    cfg = ModelConfig.from_hf(hf_cfg)
    vision = dataclasses.replace(cfg.vision, depth=opt["depth"],
                                 deepstack_visual_indexes=[i for i in cfg.vision.deepstack_visual_indexes
                                                           if i < opt["depth"]])
    cfg = dataclasses.replace(cfg, num_hidden_layers=opt["layers"], vision=vision)
    grids_448 = [(1, 28, 28)] * opt["images"]
    parity_rows = [[(1, 28, 28), (1, 16, 40)], [(1, 60, 52), (1, 4, 6)]]  # 60x52: beyond the 48x48 learned grid
    parity_T = 1024
    if opt["smoke"]:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=48, mrope_section=[2, 3, 3], vision=dataclasses.replace(
                                      vision, depth=3, hidden_size=64, intermediate_size=96, num_heads=2,
                                      out_hidden_size=64, patch_size=4, num_position_embeddings=64,
                                      deepstack_visual_indexes=[0, 2], image_token_id=500, video_token_id=501,
                                      vision_start_token_id=502, vision_end_token_id=503))
        opt.update(seq=128, steps=1, warmup=1)
        grids_448 = [(1, 8, 8)] * opt["images"]
        parity_rows, parity_T = [[(1, 4, 6), (1, 10, 8)], [(1, 2, 2), (1, 14, 20)]], 160
    vc = cfg.vision
    g = torch.Generator(device).manual_seed(0)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    with torch.device(device):
        ours = Transformer(cfg)
    init_parameters(ours.named_parameters(), 0.02, g)
    with torch.no_grad():  # non-trivial norms and LayerNorm biases, so a misplaced norm would show
        for n, p in ours.named_parameters():
            if "norm" in n.rsplit(".", 2)[-2]:
                p.uniform_(0.5, 1.5, generator=g) if n.endswith("weight") else p.uniform_(-0.2, 0.2, generator=g)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ours.save_pretrained(tmp)
        hf = AutoModelForImageTextToText.from_pretrained(tmp, dtype=torch.float32).to(device)
    print(f"checkpoint written and loaded by transformers in {time.perf_counter() - t0:.0f} s", flush=True)

    def hf_logits(ids, pv, grid):
        return hf(input_ids=ids, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=(ids == vc.image_token_id).int(),
                  use_cache=False).logits

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    # 1. parity
    ids, pv, grid = _vl_batch(vc, parity_rows, parity_T, cfg.vocab_size, g, device)
    targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=g, device=device)
    result = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", transformers_version=transformers.__version__,
                  torch=torch.__version__, text_layers=cfg.num_hidden_layers, vision_depth=vc.depth,
                  experts=cfg.num_experts, params=sum(p.numel() for p in ours.parameters()),
                  experts_implementation=getattr(hf.config, "_experts_implementation", None),
                  attn_implementation=hf.config._attn_implementation)
    parity = result["parity"] = dict(tokens=ids.numel(), images=len(grid), patches=len(pv))
    ref = hf_logits(ids, pv, grid)
    logits = ours(ids, pixel_values=pv, image_grid_thw=grid)
    parity["fp32_logits_max_abs"] = (logits - ref).abs().max().item()
    parity["fp32_logits_rel"] = rel(logits, ref)
    for model, out in ((ours, logits), (hf, ref)):
        (-F.log_softmax(out, -1).gather(-1, targets[..., None]).mean()).backward()
    logits = ref = None
    theirs = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    mine = ours_to_hf({n: p.grad for n, p in ours.named_parameters()}, cfg)
    worst = {}
    for name, ref_g in theirs.items():
        if name in mine:
            g_ = mine[name]
        else:  # transformers' fused experts (E, 2H, D) / (E, D, H) in memory; ours stacked per projection
            stem = name.rsplit(".", 1)[0].replace("model.language_model.", "model.") + "."
            w = {k: p.grad for k, p in ours.named_parameters() if k.startswith(stem)}
            g_ = torch.cat([w[stem + "gate_proj"], w[stem + "up_proj"]], 1) if name.endswith("gate_up_proj") else w[stem + "down_proj"]
            g_ = g_ if g_.shape == ref_g.shape else g_.transpose(1, 2)
        part = "vision" if ".visual." in name else "experts" if ".experts" in name else "text"
        worst[part] = max(worst.get(part, 0.0), rel(g_, ref_g))
    parity["fp32_grad_rel_max"] = worst
    parity["grads_compared"] = len(theirs)
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    with torch.no_grad():
        ref = hf_logits(ids, pv, grid)
        ours.to(torch.bfloat16)
        hf.to(torch.bfloat16)
        pv16 = pv.to(torch.bfloat16)
        parity["bf16_ours_vs_fp32_rel"] = rel(ours(ids, pixel_values=pv16, image_grid_thw=grid), ref)
        parity["bf16_transformers_vs_fp32_rel"] = rel(hf_logits(ids, pv16, grid), ref)
    ref = None
    print(f"parity: {parity}", flush=True)

    # 2. speed, bf16
    B, T = opt["batch"], opt["seq"]
    ids, pv, grid = _vl_batch(vc, [grids_448] * B, T, cfg.vocab_size, g, device)
    pv = pv.to(torch.bfloat16)
    targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=g, device=device)
    ours.train()
    hf.train()

    def ours_step():
        h = ours.hidden_states(ids, pixel_values=pv, image_grid_thw=grid)
        lp, _ = token_logprobs(h, ours.lm_head.weight, targets, chunk_size=2048)
        (-lp.mean()).backward()
        ours.zero_grad(set_to_none=True)

    def hf_step():
        lp = F.log_softmax(hf_logits(ids, pv, grid).float(), -1).gather(-1, targets[..., None])
        (-lp.mean()).backward()
        hf.zero_grad(set_to_none=True)

    def measure(name, step):
        for _ in range(opt["warmup"]):
            step()
        sync()
        base = torch.cuda.memory_allocated(device) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(opt["steps"]):
            step()
        sync()
        s = (time.perf_counter() - t0) / opt["steps"]
        out = dict(step_s=round(s, 4), tokens_per_s=round(B * T / s), images_per_s=round(len(grid) / s, 1),
                   peak_extra_gb=round(((torch.cuda.max_memory_allocated(device) if cuda else 0) - base) / 1e9, 2))
        print(f"{name}: {out}", flush=True)
        if opt["profile"]:  # one more step under the profiler: where the time goes, per kernel
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] +
                                        ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])) as prof:
                step()
                sync()
            print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                            row_limit=opt["profile"]), flush=True)
        return out
    result.update(seq=T, batch=B, images_per_sequence=opt["images"], image_tokens_per_sequence=int(
        (ids[0] == vc.image_token_id).sum()), ours=measure("ours", ours_step), transformers=measure("transformers", hf_step))
    result["ratio"] = round(result["ours"]["tokens_per_s"] / result["transformers"]["tokens_per_s"], 3)
    return result


def _compile_attention_and_norms(model):
    """torch.compile the attention and RMSNorm modules (elementwise fusion); experts and all-to-alls stay eager."""
    for module in model.modules():
        if type(module).__name__.endswith(("Attention", "RMSNorm")):
            module.compile()


def _hf_fsdp_model(mcfg, cfg, device, compile_modules, checkpointing):
    """transformers' Qwen3MoeForCausalLM built on the meta device, each decoder layer and the root under
    fully_shard with our mixed precision, shards initialized like ours, AdamW like ours."""
    import torch
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    import train
    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in mcfg.to_hf().items()
                               if k not in ("model_type", "architectures", "torch_dtype")})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(hf_cfg)
    if checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg["param_dtype"]), reduce_dtype=torch.float32)
    for layer in hf.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(hf, mp_policy=mp)
    hf.to_empty(device=device)
    from model import init_parameters
    generator = torch.Generator(device).manual_seed(cfg["seed"] + torch.distributed.get_rank())
    init_parameters(((n, train.local_tensor(p)) for n, p in hf.named_parameters()), 0.02, generator)
    # to_empty left the rotary inv_freq buffers uninitialized: build the rotary embedding again
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg).to(device)
    if compile_modules:
        _compile_attention_and_norms(hf)
    hf.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(hf.parameters(), lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]),
                                  weight_decay=cfg["weight_decay"], fused=fused)
    info = dict(version=transformers.__version__, attn_implementation=hf.config._attn_implementation,
                experts_implementation=getattr(hf.config, "_experts_implementation", None),
                params=sum(p.numel() for p in hf.parameters()))
    return hf, optimizer, info


def main():
    names = sorted(k[len("bench_"):] for k in globals() if k.startswith("bench_"))
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        sys.exit(f"usage: python bench.py NAME [--key=value ...], NAME one of: {', '.join(names)}")
    result = globals()["bench_" + sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
