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

# -----------------------------------------------------------------------------
# logprobs: chunked token logprobs (loss.token_logprobs) vs the naive full-logits computation


def _int_options(args, **defaults):
    """--key=value overrides of integer defaults; an unknown key is an error."""
    out = dict(defaults)
    for arg in args:
        key, _, value = arg.lstrip("-").partition("=")
        if key not in out:
            sys.exit(f"unknown option {arg!r}; options: {', '.join('--%s=%s' % kv for kv in defaults.items())}")
        out[key] = int(value)
    return out


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
    and ours / raw (target >= 0.85), and checks that rank 1 ends up with exactly rank 0's weights.

        torchrun --nproc_per_node=2 bench.py sync                # 2 GPUs, NCCL
        python bench.py sync                                     # spawns the 2 ranks itself (CPU: gloo, tiny)
        python bench.py sync --layers=2 --bucket_mb=256 --iters=5 --tiny=0
    """
    import os
    import torch
    import torch.multiprocessing as mp
    from weights_sync import free_port
    cuda = torch.cuda.is_available()
    opt = _int_options(args, layers=4, bucket_mb=512 if cuda else 1, iters=5 if cuda else 3, tiny=int(not cuda))
    if "RANK" in os.environ:  # under torchrun
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
    from model import TINY_CONFIG, ModelConfig, Transformer, ours_to_hf
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
    group.shutdown()
    dist.destroy_process_group()
    raw_t, ours_t = statistics.median(raw_s), statistics.median(ours_s)
    result = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", backend=backend,
                  layers=cfg.num_hidden_layers, gb=round(total / 1e9, 3), buckets=len(buckets),
                  bucket_mb=opt["bucket_mb"], iters=opt["iters"], raw_gbps=round(total / raw_t / 1e9, 2),
                  ours_gbps=round(total / ours_t / 1e9, 2), raw_s=round(raw_t, 4), ours_s=round(ours_t, 4),
                  match=gathered[0] == gathered[1], ratio=round(raw_t / ours_t, 3))
    if rank == 0:
        print(f"{result['gb']} GB in {len(buckets)} buckets: ours {result['ours_gbps']} GB/s, "
              f"raw broadcast {result['raw_gbps']} GB/s, ratio {result['ratio']}, receiver matches: {result['match']}")
        if results is not None:
            results.put(result)
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
    from agents import as_run_function
    from model import ensure_tiny_model
    opt = _int_options(args, steps=6, group_size=4, groups_per_batch=4, groups_in_flight=8, max_tokens=16,
                       tool_median_ms=200, tool_sigma_pct=150, seed=0)
    path = ensure_tiny_model(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache", "tiny-qwen3-moe"))
    # a tiny learning rate: both phases do the same work (train step, weight sync) on a policy that stays put
    cfg = train.configure([f"--model_path={path}", "--learning_rate=1e-7", "--min_lr=1e-7", "--max_staleness=8",
                           f"--group_size={opt['group_size']}", f"--groups_per_batch={opt['groups_per_batch']}"])
    _, world, device = train.init_distributed()
    model, optimizer, _ = train.build_trainer(cfg, world, device)
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


def main():
    names = sorted(k[len("bench_"):] for k in globals() if k.startswith("bench_"))
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        sys.exit(f"usage: python bench.py NAME [--key=value ...], NAME one of: {', '.join(names)}")
    result = globals()["bench_" + sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
