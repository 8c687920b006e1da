"""
The FP8 expert GEMMs alone, run through bench.py (`bench.py layer --fp8` measures them inside the
decoder layer):

    python bench.py fp8gemm               # one H100: Qwen3-30B-A3B's experts, 16,384 tokens
    python bench.py fp8gemm --sweep       # and our kernel's tile configurations, each GEMM
    python bench.py fp8gemm --smoke       # CPU, Triton's interpreter, tiny shapes: the code path

The four GEMMs that fp8_experts runs in FP8 (experts.GroupedSwiGLU): the forward's gate-and-up
(x (N, D) times gate_up (E, 2H, D)) and down (h (N, H) times down (E, D, H)), and the backward's two
input gradients (dy times down, dgu times gate_up, each weight's transposed e4m3 copy), N = tokens x
top-k rows sorted by expert, routed at random. Each timed as bf16 `torch._grouped_mm` (what the
bf16 experts run), `torch._scaled_grouped_mm` and our Triton kernel (experts.fp8_grouped_mm_triton)
on the same e4m3 operands, and the row casts of the activations to e4m3 (experts.fp8_rows: our
kernel, and the compiled torch code it replaced). ratio = the bf16 GEMMs' ms / (our FP8 GEMMs' ms +
the activations' casts' ms): what FP8 saves in the layer before anything else is fused.
"""
import os
import sys


def bench_fp8gemm(tokens=16384, experts=128, topk=8, hidden=2048, inter=768, iters=50, sweep=0,
                  smoke=0, seed=0):
    """The FP8 expert GEMMs against bf16's at MoE shapes (module docstring). --sweep: each of
    our kernel's candidate tiles on each GEMM, the fastest reported per GEMM."""
    import torch
    import triton
    import experts as ex
    if smoke and not ex.triton_interpreted():  # the kernels are built
        # interpreted only when the variable is set as Triton is imported: this run again with it
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})
    if smoke:
        tokens, experts, topk, hidden, inter, iters = 64, 4, 2, 64, 32, 1
    elif not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        sys.exit("bench.py fp8gemm needs a Hopper GPU (FP8 tensor cores); on CPU use --smoke")
    device = "cpu" if smoke else "cuda"
    torch.manual_seed(seed)
    T, E, D, H = tokens, experts, hidden, inter
    ids = torch.randn(T, E, device=device).topk(topk, -1).indices.flatten()
    counts = torch.bincount(ids, minlength=E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    N = int(offs[-1])
    bf = dict(dtype=torch.bfloat16, device=device)
    x, h = torch.randn(N, D, **bf), torch.randn(N, H, **bf)
    dy, dgu = torch.randn(N, D, **bf), torch.randn(N, 2 * H, **bf)
    gate_up, down = torch.randn(E, 2 * H, D, **bf) * 0.02, torch.randn(E, D, H, **bf) * 0.02
    # (name, activation, weight (E, out, K) as the GEMM reads it, fast accumulation: forward only)
    gemms = [("gate_up", x, gate_up, True), ("down", h, down, True),
             ("d_down", dy, down.transpose(1, 2).contiguous(), False),
             ("d_gate_up", dgu, gate_up.transpose(1, 2).contiguous(), False)]

    def ms(fn):
        if smoke:
            fn()
            return 0.0
        return triton.testing.do_bench(fn, warmup=10, rep=iters)

    tiles = ((128, 256, 128, 8, 3), (128, 128, 128, 8, 3), (128, 128, 128, 8, 4),
             (64, 128, 128, 4, 4), (128, 256, 64, 8, 4), (64, 256, 128, 8, 3), (128, 128, 64, 4, 5))
    configs = [dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s, PROMOTE=p)
               for bm, bn, bk, w, s in tiles for p in (0, 1, 2)]
    if smoke:
        configs = [dict(BM=16, BN=32, BK=32, num_warps=4, num_stages=2, PROMOTE=p) for p in (0, 1, 2)]
    result = dict(device=torch.cuda.get_device_name() if not smoke else "cpu (interpreter)",
                  tokens=T, experts=E, topk=topk, hidden=D, inter=H, rows=N,
                  rows_per_expert=[int(counts.min()), int(counts.max())], gemms={})
    totals = dict(bf16=0.0, torch_fp8=0.0, ours=0.0, cast=0.0, cast_compiled=0.0)  # summed rows
    for name, a, w, fast in gemms:
        flops = 2 * N * w.shape[1] * w.shape[2]
        aq, sa = ex.fp8_rows(a)
        wq, sw = ex.fp8_weight(w)
        row = dict(bf16=ms(lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)))
        if not smoke:
            row["torch_fp8"] = ms(lambda: torch._scaled_grouped_mm(
                aq, wq.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16,
                use_fast_accum=fast))
        row["ours"] = ms(lambda: ex.fp8_grouped_mm_triton(aq, sa, wq, sw, offs, fast))
        if sweep:
            tried = {}
            # fast accumulation (PROMOTE 0) tried for the forward's GEMMs alone
            for cfg in [c for c in configs if (c["PROMOTE"] == 0) == fast]:
                key = "{BM}x{BN}x{BK} w{num_warps} s{num_stages} p{PROMOTE}".format(**cfg)
                try:
                    tried[key] = round(ms(lambda: ex.fp8_grouped_mm_triton(aq, sa, wq, sw, offs,
                                                                           fast, cfg)), 4)
                except Exception as err:  # a tile that needs more shared memory than there is
                    tried[key] = f"{type(err).__name__}"
            timed = {k: v for k, v in tried.items() if isinstance(v, float)}
            row["sweep"] = dict(sorted(timed.items(), key=lambda kv: kv[1])[:4])
            row["best"] = min(timed, key=timed.get) if timed else None
        # the kernel against torch's (the same e4m3 operands); ours against the bf16 product
        ours = ex.fp8_grouped_mm_triton(aq, sa, wq, sw, offs, fast).float()
        exact = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs).float()
        row["rel_err_vs_bf16"] = round(((ours - exact).norm() / exact.norm()).item(), 5)
        if not smoke:
            theirs = torch._scaled_grouped_mm(aq, wq.transpose(-2, -1), sa, sw, offs=offs,
                                              out_dtype=torch.bfloat16, use_fast_accum=fast)
            row["rel_diff_vs_torch_fp8"] = round(((ours - theirs.float()).norm()
                                                  / theirs.float().norm()).item(), 5)
        row["cast"] = ms(lambda: ex.fp8_rows(a))
        row["cast_compiled"] = ms(lambda: ex.fp8_rows_compiled(a))
        for k in ("bf16", "torch_fp8", "ours"):
            if k in row and not smoke:
                row[f"{k}_tflops"] = round(flops / max(row[k], 1e-9) / 1e9, 1)
        for k in totals:
            totals[k] += row.get(k, 0)
        result["gemms"][name] = {k: round(v, 4) if isinstance(v, float) else v
                                 for k, v in row.items()}
        print(name, result["gemms"][name], file=sys.stderr, flush=True)
    result["ms"] = {k: round(v, 3) for k, v in totals.items()}
    result["ratio"] = round(totals["bf16"] / max(totals["ours"] + totals["cast"], 1e-9), 3)
    result["ratio_torch_fp8"] = round(totals["bf16"] / max(totals["torch_fp8"] + totals["cast"],
                                                           1e-9), 3)
    return result
