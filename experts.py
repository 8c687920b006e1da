"""
The MoE experts and their kernels: E stacked SwiGLU experts (`Experts`) computed with a plain loop
over experts (the readable reference, used on CPU) or with grouped GEMM on CUDA (`GroupedSwiGLU` on
`torch._grouped_mm`, or in FP8 on our Triton kernel: `fp8_grouped_mm`), LoRA adapters on
them (`LoRAGroupedMM`), the router's top-k, the permutation of rows to and from expert order
(`GatherRows`, `SumRows`), expert parallelism's `dispatch` and `combine` around `all_to_all`, the
cast of experts kept outside FSDP (`CastForCompute`), and the few Triton kernels on CUDA beside
their eager references (`topk_ids`, `sum_slots`, `swiglu_backward`, `grouped_grad`, `lowrank_add`,
the FP8 casts and GEMM `fp8_rows` and `fp8_grouped_mm`, and the AdamW step of large tensors,
`AdamW`). `cuda_compiled` is the
one torch.compile wrapper of the project (model.py and loss.py use it too; `compiled_for_tokens` marks
the dims that vary from microbatch to microbatch). `python bench.py layer`
measures them in the decoder layer on a GPU (`python bench.py fp8gemm`: the FP8 GEMMs alone).

This file imports nothing of ours; model.py builds its MoE layers from `Experts`.

    .venv/bin/python -m pytest tests/test_model.py tests/test_lora.py -q
"""

import functools
import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

try:  # a few small kernels on CUDA; everything else, and all of it on CPU, is plain PyTorch
    import triton
    import triton.language as tl
except ImportError:
    triton = None

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn

COMPILE_ON_CUDA = True  # fuse the elementwise chains below with torch.compile when they run on CUDA


def triton_interpreted():
    """Whether Triton's kernels run on its CPU interpreter (the tests' checks of them)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def compiled_for_tokens(fn, mode="max-autotune-no-cudagraphs",
                        mark=torch._dynamo.decorators.mark_unbacked):
    """fn through torch.compile, each call's token dims marked unbacked before it runs: every dim
    but the last (the features: hidden, vocabulary, head) of each tensor of two or more dims, and
    the one dim of a vector. Microbatches vary in rows and length every step; left to itself,
    Dynamo compiles a first shape static and makes a dim dynamic only when it changes, so a dim
    steady for a while (the rows of a microbatch) recompiles the lot steps later, each recompile
    many seconds under max-autotune. A dim marked dynamic (backed) still specializes sizes 0 and 1,
    so the first microbatch of a single row, or loss chunk of a single token, compiles afresh
    mid-run. Unbacked, a dim is never assumed to be 0, 1 or equal to another: one compile per
    function (and grad mode) for every shape and storage offset. `mark`: how a dim is marked
    (tests pass torch._dynamo.maybe_mark_dynamic, the backed marking, as their control)."""
    compiled = torch.compile(fn, mode=mode)

    @functools.wraps(fn)
    def run(*args):
        for t in args:
            if isinstance(t, torch.Tensor):
                for d in range(max(t.dim() - 1, 1) if t.dim() else 0):
                    mark(t, d)
        return compiled(*args)
    return run


def cuda_compiled(fn):
    """fn through torch.compile (compiled_for_tokens) when its first argument is a CUDA tensor:
    a chain of elementwise ops becomes one kernel forward and one backward instead of one fp32
    pass per op. Eager elsewhere (CPU runs need no compiler). Inductor tunes each kernel's launch
    configuration as it compiles (max-autotune; no CUDA graphs): faster norms than the default
    configuration."""
    compiled = None

    @functools.wraps(fn)
    def run(x, *args):
        nonlocal compiled
        if not (x.is_cuda and COMPILE_ON_CUDA):
            return fn(x, *args)
        if compiled is None:
            compiled = compiled_for_tokens(fn)
        return compiled(x, *args)
    return run


def experts_loop(x, counts, scale, gate_proj, up_proj, down_proj, lora=None):
    """Reference expert compute: x (N, D) sorted by expert, counts (E,) rows per expert,
    scale (N,) each row's routing weight -> (N, D). The weight scales the H-wide hidden row
    before the (linear) down projection: the same product as scaling the D-wide output, in
    less memory traffic. lora: (scaling, ((A, B) of gate, up, down)), stacked adapters A
    (E, r, in), B (E, out, r) adding scaling * B_e A_e to each expert's weight, or None."""
    out = torch.empty_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):  # NOTE: .tolist() is a device-to-host sync
        if n == 0:
            continue
        xs = x[start:start + n]

        def mm(h, w, i):
            y = h @ w[e].T
            if lora is not None:
                A, B = lora[1][i]
                y = y + lora[0] * ((h @ A[e].T) @ B[e].T)
            return y
        h = F.silu(mm(xs, gate_proj, 0)) * mm(xs, up_proj, 1) * scale[start:start + n, None]
        out[start:start + n] = mm(h, down_proj, 2)
        start += n
    return out


def _silu_mul(gate, up, scale):
    return F.silu(gate) * up * scale.unsqueeze(-1)


silu_mul = cuda_compiled(_silu_mul)


@cuda_compiled
def silu_mul_fp8(gate, up, scale):
    """silu_mul's rows h, and h in e4m3 with its row scales (fp8_rows(h)) from the same pass: the
    FP8 experts' down GEMM reads them (on CUDA one compiled kernel writes both)."""
    h = _silu_mul(gate, up, scale)
    return h, *_rows_to_fp8(h)


def experts_grouped_mm(x, counts, scale, gate_proj, up_proj, down_proj, lora=None):
    """Same as experts_loop in grouped GEMMs (CUDA, bf16); no host sync:
    GroupedSwiGLU on the gate and up weights stacked (Experts.compute hands it
    them stacked already). With LoRA adapters (on a frozen base, as lora.py trains
    them) through LoRAGroupedMM: gate and up in one call, down in another."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    if lora is None:
        return GroupedSwiGLU.apply(x, offs, scale, torch.cat([gate_proj, up_proj], 1), down_proj)
    s, ((A_g, B_g), (A_u, B_u), (A_d, B_d)) = lora
    # gate's and up's adapters as one of rank 2r (x read once
    # for both); the scaling goes into the (E, out, r) Bs
    gate, up = LoRAGroupedMM.apply(x, offs, torch.cat([A_g, A_u], 1), 2, gate_proj, up_proj,
                                   B_g * s, B_u * s)
    return LoRAGroupedMM.apply(silu_mul(gate, up, scale), offs, A_d, 1, down_proj, B_d * s)[0]


def swiglu_backward(gate_up, scale, dh, fp8=False):
    """silu_mul's backward from its input (N, 2H) = [gate | up]: d[gate | up] (N, 2H)
    in one tensor, dscale (N,), and with fp8 d[gate | up] in e4m3 with its row scales (what
    fp8_rows would make of it; else None). On CUDA one Triton kernel: each row read once and
    written once (torch.compile's kernel for the eager code below read every row twice,
    once for each half of the concatenation, and a second kernel again for dscale)."""
    if gate_up.is_cuda and triton is not None:
        return swiglu_backward_triton(gate_up, scale, dh, fp8)
    gate, up = gate_up.float().chunk(2, -1)
    sig, s, dh = torch.sigmoid(gate), scale.float().unsqueeze(-1), dh.float()
    silu = gate * sig
    dgate = dh * up * s * sig * (1 + gate * (1 - sig))
    dscale = (dh * silu * up).sum(-1)
    dgu = torch.cat([dgate, dh * silu * s], -1).to(gate_up.dtype)
    return dgu, dscale.to(scale.dtype), fp8_rows(dgu) if fp8 else None


def swiglu_backward_triton(gate_up, scale, dh, fp8=False):
    gate_up, dh = gate_up.contiguous(), dh.contiguous()
    N, H = dh.shape
    dgu, dscale = torch.empty_like(gate_up), torch.empty_like(scale)
    # fp8: as fp8_rows_triton, fp32 rows that torch casts under Triton's interpreter
    interpret = triton_interpreted()
    q = torch.empty(N, 2 * H, dtype=torch.float32 if interpret else FP8,
                    device=dh.device) if fp8 else dgu
    q_scale = torch.empty(N, dtype=torch.float32, device=dh.device) if fp8 else dscale
    # fp8: a row a program (its rows and their e4m3 copies live at once: fewer registers)
    rows, warps = (1, 4) if fp8 else (4, 8)
    if N:
        _swiglu_backward_kernel[(triton.cdiv(N, rows),)](gate_up, scale, dh, dgu, dscale, q, q_scale,
                                                         N, H, torch.finfo(FP8).max, FP8=fp8,
                                                         BR=rows, BH=triton.next_power_of_2(H),
                                                         num_warps=warps)
    return dgu, dscale, ((q.to(FP8) if interpret else q), q_scale) if fp8 else None


if triton is not None:
    @triton.jit
    def _e4m3_scaling(amax, fp8_max):
        """Rows' absolute maxima -> (the factor to e4m3, the row scales), as _rows_to_fp8 makes
        them: IEEE divisions (div_rn), a row's values then multiplied by its factor."""
        amax = tl.maximum(amax, 1e-12)
        return tl.math.div_rn(tl.zeros_like(amax) + fp8_max, amax), tl.math.div_rn(
            amax, tl.zeros_like(amax) + fp8_max)

    @triton.jit
    def _swiglu_backward_kernel(gu, scale, dh, dgu, dscale, q, q_scale, N, H, fp8_max,
                                FP8: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)  # BR whole rows
        cols = tl.arange(0, BH)
        mask = (rows[:, None] < N) & (cols[None, :] < H)
        at = rows[:, None] * 2 * H + cols[None, :]  # gate's columns; up's are H further
        gate = tl.load(gu + at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu + at + H, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dh + rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(scale + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dgate = (d * up * s * sig * (1 + gate * (1 - sig))).to(dgu.dtype.element_ty)
        dup = (d * silu * s).to(dgu.dtype.element_ty)
        tl.store(dgu + at, dgate, mask=mask)
        tl.store(dgu + at + H, dup, mask=mask)
        if FP8:  # the rows just stored, scaled to e4m3 by their absolute max (fp8_rows)
            dgate, dup = dgate.to(tl.float32), dup.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(dgate), 1), tl.max(tl.abs(dup), 1))
            inv, row_scale = _e4m3_scaling(amax, fp8_max)
            tl.store(q + at, (dgate * inv[:, None]).to(q.dtype.element_ty), mask=mask)
            tl.store(q + at + H, (dup * inv[:, None]).to(q.dtype.element_ty), mask=mask)
            tl.store(q_scale + rows, row_scale, mask=rows < N)
        tl.store(dscale + rows, tl.sum(d * silu * up, 1).to(dscale.dtype.element_ty), mask=rows < N)


def grouped_mm(a, w, offs):
    """a (N, K) rows sorted by expert (offs: cumulative row counts), w (E, out, K) -> (N, out):
    each expert's rows times its w_e^T, in a's dtype (bf16 on CUDA)."""
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)


def fp8_rows(t):
    """t (..., K) -> (e4m3 (..., K) contiguous, float32 scales (...,)): each row's absolute max
    maps to e4m3's largest value, t = q * scale per row. On CUDA, rows contiguous: one Triton
    kernel, each row read once (fp8_rows_triton); a strided view (a weight's transpose): one
    compiled pass; elsewhere eager."""
    if t.is_cuda and triton is not None and t.is_contiguous():
        q, scale = fp8_rows_triton(t.reshape(-1, t.shape[-1]))
        return q.view(t.shape), scale.view(t.shape[:-1])
    return fp8_rows_compiled(t)


def _rows_to_fp8(t):
    # IEEE divisions by a tensor (torch's scalar / tensor multiplies by a reciprocal: other bits)
    amax = t.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    fp8_max = amax.new_tensor(torch.finfo(FP8).max)
    return (t.float() * (fp8_max / amax)).to(FP8).contiguous(), (amax / fp8_max).squeeze(-1)


fp8_rows_compiled = cuda_compiled(_rows_to_fp8)


def fp8_rows_triton(t):
    (N, K), interpret = t.shape, triton_interpreted()
    # Triton's interpreter rounds to e4m3 wrongly where the mantissa carries into the exponent
    # (125.7 -> 64): there (the CPU test) the kernel writes the scaled fp32 rows, torch casts
    q = torch.empty(N, K, dtype=torch.float32 if interpret else FP8, device=t.device)
    scale = torch.empty(N, dtype=torch.float32, device=t.device)
    block = triton.next_power_of_2(K)
    rows = max(1, min(16, 4096 // block))
    if N:
        _fp8_rows_kernel[(triton.cdiv(N, rows),)](t, q, scale, N, K, torch.finfo(FP8).max,
                                                  BR=rows, BK=block, num_warps=4)
    return q.to(FP8) if interpret else q, scale


def fp8_weight(w, transposed=False, cache=None):
    """fp8_rows of the experts' weight w (E, out, in), or of its transpose (E, in, out): the e4m3
    operand of a forward GEMM, or of an input-gradient one. `cache`: a dict that a cast reused
    for a whole window carries (train.keep_experts_local's `fp8_cache`): each operand is
    quantized at the window's first microbatch and kept for the others (the weights change only
    at the optimizer step), not read whole again for every forward and backward."""
    if cache is not None and transposed in cache:
        return cache[transposed]
    q = fp8_rows(w.transpose(-2, -1) if transposed else w)
    if cache is not None:
        cache[transposed] = q
    return q


def fp8_grouped_mm(a, w8, offs, fast_accum=False, rows=None):
    """grouped_mm in FP8 (Hopper's tensor cores run it at twice bf16's rate): a per row (token)
    and the weight per expert and output row scaled to e4m3 (fp8_rows; w8 = fp8_weight(w): the
    e4m3 weight (E, out, K) and its scales), the scales applied in the GEMM's epilogue, out in
    bf16. On CUDA our Triton kernel (fp8_grouped_mm_triton; bench.py fp8gemm times it against
    `torch._scaled_grouped_mm`). fast_accum: the tensor cores'
    own accumulation throughout (the forward's); without, each K block of FP8_GEMM's BK is
    summed apart and added into fp32 (the gradients'; the tensor cores keep fewer bits). Off
    CUDA, the reference: the same e4m3 operands and scales, multiplied in fp32 one expert at a
    time. rows: fp8_rows(a), when made already, or (e4m3 rows, scales, index): a's row i is
    row index[i] of those (gather_fp8_rows: the GEMM gathers them as it reads)."""
    (aq, sa, *index), (wq, sw) = rows if rows is not None else fp8_rows(a), w8
    index = index[0] if index else None
    if aq.is_cuda and triton is not None:
        return fp8_grouped_mm_triton(aq, sa, wq, sw, offs, fast_accum, index=index)
    if index is not None:
        aq, sa = aq.view(torch.uint8)[index].view(FP8), sa[index]
    a32, w32 = aq.float() * sa.unsqueeze(-1), wq.float() * sw.unsqueeze(-1)
    out, start = a32.new_empty(a32.shape[0], wq.shape[1]), 0
    for e, end in enumerate(offs.tolist()):  # NOTE: .tolist() is a device-to-host sync
        out[start:end] = a32[start:end] @ w32[e].T
        start = end
    return out.to(torch.bfloat16)


# fp8_grouped_mm_triton's tile and launch (BM rows of one expert x BN output columns, BK deep) for
# fast accumulation and for the exact one (PROMOTE: 1, each K block's product added into fp32;
# 2, Triton's own promotion, max_num_imprecise_acc=BK, not yet timed on a GPU): the fastest tiles of
# `bench.py fp8gemm --sweep` on an H100 at Qwen3-30B-A3B's expert shapes
FP8_GEMM = {True: dict(BM=128, BN=256, BK=128, num_warps=8, num_stages=3, PROMOTE=0),
            False: dict(BM=128, BN=128, BK=128, num_warps=8, num_stages=4, PROMOTE=1)}


def fp8_grouped_mm_triton(aq, sa, wq, sw, offs, fast_accum=False, config=None, index=None):
    """aq (N, K) e4m3 rows sorted by expert (offs: cumulative row counts) with their scales sa
    (N,), wq (E, out, K) e4m3 with scales sw (E, out) -> (N, out) bf16: one Triton program per
    tile of BM rows of one expert and BN output columns, both operands K-contiguous (what
    Hopper's FP8 tensor cores take), the two scales applied to the fp32 tile before its store.
    Programs next to each other share a row tile (read once from memory, the expert's weight
    tile from L2). index (N,): row i is aq's row index[i] (aq then has a row per token, not
    per slot: no gathered e4m3 copy is written and read again). config: FP8_GEMM's keys
    (bench.py fp8gemm --sweep tries others)."""
    K, (E, n_out, _) = aq.shape[1], wq.shape
    N = aq.shape[0] if index is None else index.shape[0]
    cfg = {**FP8_GEMM[bool(fast_accum)], **(config or {})}
    out = torch.empty(N, n_out, dtype=torch.bfloat16, device=aq.device)
    if N:
        _fp8_grouped_mm_kernel[(triton.cdiv(n_out, cfg["BN"]), triton.cdiv(N, cfg["BM"]) + E)](
            aq, sa, wq.contiguous(), sw, offs, out, aq if index is None else index, n_out, K, E,
            BE=triton.next_power_of_2(E), GATHER=index is not None, UPCAST=triton_interpreted(),
            **cfg)
    return out


if triton is not None:
    @triton.jit
    def _expert_row_tile(t, offs, E, BE: tl.constexpr, BM: tl.constexpr):
        """Row tile t counted over the experts' tiles of BM rows (offs: the cumulative row counts;
        a grid of these has E spare tiles, as each expert's last tile may be partial) -> (its
        expert e, E or more for a spare tile; the tile's BM row indices (int64); the end of e's
        rows, which the last rows may pass). Each program counts the tiles from offs itself (E
        values, one cumulative sum), where a count on the host would launch kernels of its own."""
        experts = tl.arange(0, BE)
        ends = tl.load(offs + experts, mask=experts < E, other=0)
        starts = tl.load(offs + experts - 1, mask=(experts > 0) & (experts < E), other=0)
        tiles = (ends - starts + BM - 1) // BM
        e = tl.sum((tl.cumsum(tiles, 0) <= t).to(tl.int32))  # experts wholly before tile t
        first_tile = tl.sum(tl.where(experts < e, tiles, 0))
        row_end = tl.sum(tl.where(experts == e, ends, 0))
        rows = (tl.sum(tl.where(experts == e, starts, 0)) + (t - first_tile) * BM
                + tl.arange(0, BM)).to(tl.int64)
        return e, rows, row_end

    @triton.jit
    def _fp8_rows_kernel(x, q, scale, N, K, fp8_max, BR: tl.constexpr, BK: tl.constexpr):
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        cols = tl.arange(0, BK)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        v = tl.load(x + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        inv, s = _e4m3_scaling(tl.max(tl.abs(v), 1), fp8_max)
        tl.store(q + rows[:, None] * K + cols[None, :], (v * inv[:, None]).to(q.dtype.element_ty),
                 mask=mask)
        tl.store(scale + rows, s, mask=rows < N)

    @triton.jit
    def _fp8_grouped_mm_kernel(a, sa, w, sw, offs, out, index, n_out, K, E, BE: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                               PROMOTE: tl.constexpr, GATHER: tl.constexpr, UPCAST: tl.constexpr):
        # program (j, t): output columns j * BN to (j + 1) * BN of row tile t (_expert_row_tile)
        e, rows, row_end = _expert_row_tile(tl.program_id(1), offs, E, BE, BM)
        if e < E:
            cols = tl.program_id(0) * BN + tl.arange(0, BN)
            ks = tl.arange(0, BK)
            src = rows  # the rows of a (and sa) the tile reads
            if GATHER:
                src = tl.load(index + rows, mask=rows < row_end, other=0).to(tl.int64)
            a_at = a + src[:, None] * K + ks[None, :]
            w_at = w + e.to(tl.int64) * n_out * K + cols[:, None].to(tl.int64) * K + ks[None, :]
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, K, BK):
                at = tl.load(a_at, mask=(rows[:, None] < row_end) & (ks[None, :] < K - k),
                             other=0.0)
                wt = tl.load(w_at, mask=(cols[:, None] < n_out) & (ks[None, :] < K - k),
                             other=0.0)
                if UPCAST:  # Triton's interpreter (the CPU test) multiplies in fp32
                    at, wt = at.to(tl.float32), wt.to(tl.float32)
                if PROMOTE == 1:  # each K block's sum apart, added into fp32
                    acc += tl.dot(at, tl.trans(wt))
                elif PROMOTE == 2 and not UPCAST:
                    acc = tl.dot(at, tl.trans(wt), acc, max_num_imprecise_acc=BK)
                else:
                    acc = tl.dot(at, tl.trans(wt), acc)
                a_at += BK
                w_at += BK
            acc *= tl.load(sa + src, mask=rows < row_end, other=0.0)[:, None]
            acc *= tl.load(sw + e * n_out + cols, mask=cols < n_out, other=0.0)[None, :]
            tl.store(out + rows[:, None] * n_out + cols[None, :], acc.to(out.dtype.element_ty),
                     mask=(rows[:, None] < row_end) & (cols[None, :] < n_out))


def expert_mm(a, w, offs, fp8=False, transposed=False, cache=None, rows=None):
    """a (N, K) times each expert's w^T (w (E, out, in)), or times w itself (transposed: the
    input gradient's GEMM): grouped_mm, or fp8_grouped_mm on fp8_weight's operand (cached in
    `cache` when given) and on `rows`, a's e4m3 rows and scales where its producer made them
    (else fp8_rows(a)); the forward's FP8 GEMMs accumulate fast."""
    if not fp8:
        return grouped_mm(a, w.transpose(-2, -1) if transposed else w, offs)
    return fp8_grouped_mm(a, fp8_weight(w, transposed, cache), offs, fast_accum=not transposed,
                          rows=rows)


class GroupedSwiGLU(torch.autograd.Function):
    """The experts' SwiGLU in three grouped GEMMs: x (N, D) rows sorted by expert (offs:
    cumulative row counts), gate_up (E, 2H, D) the gate and up weights stacked (one GEMM for
    both, x read once; one GEMM for their input gradient, no add), down (E, D, H), scale
    (N,) each row's routing weight -> (N, D) = experts_loop's product. Backward forms each
    weight gradient in its weight's own (E, out, in) layout (dy^T h rather than autograd's
    (h^T dy)^T, the same GEMM). With `into` ((gate, up), (down,): fp32 parameters whose
    casts gate_up and down are, train.keep_experts_local's), it adds them into those
    parameters' .grad itself (grouped_grad, fp32 in the GEMM's epilogue) and returns none
    for the casts. Saves what autograd would: x, gate_up's output and the hidden rows h.
    fp8: the two forward GEMMs and the two input-gradient GEMMs in FP8 (fp8_grouped_mm); the
    weight gradients stay bf16 GEMMs (torchao's "rowwise with high-precision weight gradient"
    recipe), the weights themselves bf16 (or fp32 masters) as ever. A cast that carries
    `fp8_cache` (a window's reused one) keeps its e4m3 operands there for later microbatches.
    Each activation is quantized where it is made: h and d[gate | up] by the kernels that
    write them (silu_mul_fp8, swiglu_backward), x and dy (rows gathered from tokens) by
    GatherRows and SumRows's backward, which quantize each token once, handed over with the
    slots' token index as the gathered tensor's `fp8_rows` attribute (the GEMM reads each
    slot's e4m3 row through the index; absent: this function quantizes the rows itself)."""

    @staticmethod
    def forward(ctx, x, offs, scale, gate_up, down, into=None, fp8=False):
        # FP8: the e4m3 copies of a window's reused casts (keep_experts_local's fp8_cache)
        caches = [getattr(w, "fp8_cache", None) if fp8 else None for w in (gate_up, down)]
        # (x's e4m3 copy off x, which backward keeps: not held through the layers after)
        x8 = x.__dict__.pop("fp8_rows", None)
        gu = expert_mm(x, gate_up, offs, fp8, cache=caches[0], rows=x8)  # (N, 2H)
        h8 = None
        if fp8:
            h, *h8 = silu_mul_fp8(*gu.chunk(2, -1), scale)
        else:
            h = silu_mul(*gu.chunk(2, -1), scale)
        ctx.save_for_backward(x, offs, scale, gate_up, down, gu, h)
        ctx.into, ctx.fp8, ctx.caches = into, fp8, caches
        return expert_mm(h, down, offs, fp8, cache=caches[1], rows=h8)

    @staticmethod
    def backward(ctx, dy):
        x, offs, scale, gate_up, down, gu, h = ctx.saved_tensors
        fp8, (c_gate_up, c_down) = ctx.fp8, ctx.caches
        dy8 = dy.__dict__.pop("fp8_rows", None)
        dy = dy.contiguous()
        # FP8: the weights quantized along their other dimension (a transposed copy each)
        dgu, dscale, dgu8 = swiglu_backward(
            gu, scale, expert_mm(dy, down, offs, fp8, True, c_down, rows=dy8), fp8)
        dx = expert_mm(dgu, gate_up, offs, fp8, True, c_gate_up, rows=dgu8)
        if ctx.into is None:  # the weight gradients to autograd: (E, 2H, D) and (E, D, H)
            d_gate_up, d_down = torch._grouped_mm(dgu.t(), x, offs=offs), torch._grouped_mm(
                dy.t(), h, offs=offs)
            return dx, None, dscale, d_gate_up, d_down, None, None
        for params, a, b in zip(ctx.into, (dgu, dy), (x, h)):
            grads = grouped_grad(a, b, offs,
                                 [None if p.grad is None else local(p.grad) for p in params])
            for p, g in zip(params, grads):
                if p.grad is None:
                    p.grad = placed_like(p, g)
        return dx, None, dscale, None, None, None, None


class CastForCompute(torch.autograd.Function):
    """Local expert weights (fp32 DTensors on a one-rank mesh, stacked on dim 1 when several) -> one
    local tensor in the compute dtype (train.keep_experts_local's cast of experts kept outside
    FSDP). Where the grouped GEMM experts compute with the cast (CUDA), they add the weights'
    gradients into .grad themselves, in fp32 (GroupedSwiGLU's `into`), and send this backward none.
    Otherwise its backward returns each weight's gradient in fp32 (autograd takes it as .grad), or
    from a window's second microbatch on adds it into .grad in place and returns None.
    torch.autograd.grad on these weights would not see gradients added into .grad: the trainer
    accumulates into .grad."""

    @staticmethod
    def forward(ctx, dtype, *params):
        ctx.params = params
        ctx.set_materialize_grads(False)  # None when GroupedSwiGLU took the gradients
        first = local(params[0])
        width = sum(p.shape[1] for p in params)
        out = first.new_empty(first.shape[0], width, *first.shape[2:], dtype=dtype)
        for part, p in zip(out.split([p.shape[1] for p in params], 1), params):
            part.copy_(local(p))  # cast and stack in one pass
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad is None:  # GroupedSwiGLU added the gradients into .grad itself
            return (None,) * (len(ctx.params) + 1)
        out = [None]
        for p, g in zip(ctx.params, grad.split([p.shape[1] for p in ctx.params], 1)):
            if p.grad is not None:
                local(p.grad).add_(g)
                out.append(None)
            else:
                out.append(placed_like(p, g.to(p.dtype, memory_format=torch.contiguous_format)))
        return tuple(out)


class LoRAGroupedMM(torch.autograd.Function):
    """Grouped GEMMs of x (N, in), rows sorted by expert (offs: the cumulative row
    counts), with n frozen expert weights W_i (E, out_i, in), each
    plus a LoRA update: y_i = x W_i^T + (x A_i^T) B_i^T. The A_i come stacked along the rank,
    A (E, sum r_i, in), so one GEMM reads x for all of them; B_i (E, out_i, r_i), scaled.
    Gradients: x, A, the B_i; none for the base, so none of its weight-gradient GEMMs (a
    third of full fine-tuning's FLOPs). The rank-r products that write a full-width output (z
    B^T forward, dz A backward) add into the base GEMM's output with lowrank_add."""

    @staticmethod
    def forward(ctx, x, offs, A, n, *weights_and_Bs):
        Ws, Bs = weights_and_Bs[:n], weights_and_Bs[n:]
        if any(W.requires_grad for W in Ws):
            raise ValueError("LoRAGroupedMM trains adapters on a frozen base: the expert weights "
                             "must not need grad")
        z = torch._grouped_mm(x, A.transpose(-2, -1), offs=offs)  # (N, R)
        zs = z.split([B.shape[-1] for B in Bs], 1)
        ys = [lowrank_add(torch._grouped_mm(x, W.transpose(-2, -1), offs=offs), zi,
                          B.transpose(-2, -1), offs)
              for W, zi, B in zip(Ws, zs, Bs)]
        ctx.save_for_backward(x, offs, A, z, *weights_and_Bs)
        ctx.n = n
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, offs, A, z, *weights_and_Bs = ctx.saved_tensors
        Ws, Bs = weights_and_Bs[:ctx.n], weights_and_Bs[ctx.n:]
        dys = [dy.contiguous() for dy in dys]
        dz = torch.cat([torch._grouped_mm(dy, B, offs=offs) for dy, B in zip(dys, Bs)], 1)  # (N, R)
        dx = torch._grouped_mm(dys[0], Ws[0], offs=offs)
        for dy, W in zip(dys[1:], Ws[1:]):
            dx = dx + torch._grouped_mm(dy, W, offs=offs)
        dx = lowrank_add(dx, dz, A, offs)
        dA = torch._grouped_mm(dz.t(), x, offs=offs)  # (E, R, in): the rows' sum per expert
        # (E, out_i, r_i)
        dBs = [torch._grouped_mm(dy.t(), zi.contiguous(), offs=offs) for dy, zi in
               zip(dys, z.split([B.shape[-1] for B in Bs], 1))]
        return dx, None, dA, None, *[None] * ctx.n, *dBs


def lowrank_add(y, z, M, offs):
    """y (N, O) plus each row's z (N, R) @ M[e] (M (E, R, O), any strides) for the expert e of the
    row (rows sorted by expert; offs: the cumulative row counts). On CUDA one Triton kernel adds in
    place, memory-bound (y read and written once), where a grouped GEMM of inner dimension R
    writes its full-width output at a fraction of the bandwidth (about as slow as a base GEMM at
    real expert shapes) and an add then reads it again."""
    if not (y.is_cuda and triton is not None):
        return y + torch._grouped_mm(z, M, offs=offs)  # the reference; the kernel
                                                       # matches it to bf16 rounding
    return lowrank_add_triton(y, z, M, offs)


LOWRANK_BM, LOWRANK_BN = 64, 128  # lowrank_add's tile: rows of one expert x output columns


def lowrank_add_triton(y, z, M, offs):
    (N, n_out), (E, R), BM, BN = y.shape, M.shape[:2], LOWRANK_BM, LOWRANK_BN
    _lowrank_add_kernel[(triton.cdiv(N, BM) + E, triton.cdiv(n_out, BN))](
        y, z, M, offs, n_out, R, E, *z.stride(), *M.stride(), BM=BM, BN=BN,
        BR=max(16, triton.next_power_of_2(R)), BE=triton.next_power_of_2(E),
        UPCAST=triton_interpreted())
    return y


if triton is not None:
    @triton.jit
    def _lowrank_add_kernel(y, z, M, offs, n_out, R, E, sz0, sz1, sm0, sm1, sm2,
                            BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr,
                            UPCAST: tl.constexpr):
        # program (t, j): row tile t (_expert_row_tile), columns j * BN to (j + 1) * BN
        e, rows, row_end = _expert_row_tile(tl.program_id(0), offs, E, BE, BM)
        if e < E:
            cols = tl.program_id(1) * BN + tl.arange(0, BN)
            ks = tl.arange(0, BR)
            zt = tl.load(z + rows[:, None] * sz0 + ks[None, :] * sz1,
                         mask=(rows[:, None] < row_end) & (ks[None, :] < R), other=0.0)
            mt = tl.load(M + e * sm0 + ks[:, None] * sm1 + cols[None, :] * sm2,
                         mask=(ks[:, None] < R) & (cols[None, :] < n_out), other=0.0)
            mask = (rows[:, None] < row_end) & (cols[None, :] < n_out)
            ptrs = y + rows[:, None] * n_out + cols[None, :]
            if UPCAST:  # Triton's interpreter (the CPU test) gets bf16
                        # dots wrong; on the GPU bf16 in, fp32 out
                zt, mt = zt.to(tl.float32), mt.to(tl.float32)
            acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + tl.dot(zt, mt)
            tl.store(ptrs, acc.to(y.dtype.element_ty), mask=mask)


def topk_ids(probs, k):
    """The indices of each row's k largest values, largest first (N, k) int64, as torch.topk gives
    them (ties aside). On CUDA one Triton kernel holds each row (the router's E probabilities) in
    registers and takes k maxima, where torch.topk runs a radix select meant for long rows."""
    if not (probs.is_cuda and triton is not None):
        return torch.topk(probs, k, dim=-1).indices
    probs = probs.contiguous()
    (N, E), rows = probs.shape, 16
    out = torch.empty(N, k, dtype=torch.int64, device=probs.device)
    if N:
        _topk_kernel[(triton.cdiv(N, rows),)](probs, out, N, E, K=k, BR=rows,
                                              BE=triton.next_power_of_2(E))
    return out


if triton is not None:
    @triton.jit
    def _topk_kernel(probs, out, N, E, K: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr):
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        cols = tl.arange(0, BE)
        mask = (rows[:, None] < N) & (cols[None, :] < E)
        p = tl.load(probs + rows[:, None] * E + cols[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        for j in tl.static_range(K):
            best = tl.max(p, 1)
            # the first column holding the maximum, then out of the race
            at = tl.min(tl.where(p == best[:, None], cols[None, :], BE), 1)
            tl.store(out + rows * K + j, at.to(tl.int64), mask=rows < N)
            p = tl.where(cols[None, :] == at[:, None], float("-inf"), p)


class AdamW(torch.optim.AdamW):
    """torch's fused AdamW, where each large CUDA tensor (at least 2^20 elements, contiguous: the
    stacked experts, the embedding and head) steps in one Triton kernel: AdamW reads and writes 28
    bytes a parameter, and this kernel streams them closer to the memory bandwidth than torch's
    fused one. The same update, state (torch's own lazy init) and checkpoints; the fused step's
    grad_scale (train.clip_grad_norm's clipping) holds for both."""

    @torch.no_grad()
    def step(self, closure=None):
        mine = [[p for p in g["params"] if p.is_cuda and triton is not None and p.numel() >= 2 ** 20
                 and
                 local(p).is_contiguous()] for g in self.param_groups]
        kept = [g["params"] for g in self.param_groups]
        for g, ps in zip(self.param_groups, mine):  # torch's step sees the others only
            ids = set(map(id, ps))
            g["params"] = [p for p in g["params"] if id(p) not in ids]
        try:
            super().step()
        finally:
            for g, ps in zip(self.param_groups, kept):
                g["params"] = ps
        for g, ps in zip(self.param_groups, mine):
            params, grads, m, v, steps = [], [], [], [], []
            self._init_group(dict(g, params=ps), params, grads, m, v, [], steps)
            for p, grad, m1, v1, t in zip(params, grads, m, v, steps):
                t += 1
                adamw_triton(*map(local, (p, grad, m1, v1)), t, getattr(self, "grad_scale", None),
                             g)


def local(t):  # a DTensor's local shard, or the tensor itself
    return t.to_local() if hasattr(t, "to_local") else t


def placed_like(p, t):  # a local tensor placed as p is: a DTensor on
                        # p's mesh where p is one (local's inverse)
    return DTensor.from_local(t, p.device_mesh, p.placements,
                              run_check=False) if isinstance(p, DTensor) else t


def adamw_triton(p, grad, m, v, step, grad_scale, group):
    (beta1, beta2), n, block = group["betas"], p.numel(), 4096
    scale = step if grad_scale is None else grad_scale  # a pointer the kernel
                                                        # reads only when SCALED
    _adamw_kernel[(triton.cdiv(n, block),)](p, grad.contiguous(), m, v, step, scale, n,
                                            float(group["lr"]), beta1, beta2, group["eps"],
                                            group["weight_decay"], math.log2(beta1),
                                            math.log2(beta2), SCALED=grad_scale is not None,
                                            BLOCK=block)


if triton is not None:
    @triton.jit
    def _adamw_kernel(p, g, m, v, step, scale, n, lr, beta1, beta2, eps, wd, log2_beta1, log2_beta2,
                      SCALED: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        t = tl.load(step).to(tl.float32)
        grad = tl.load(g + offs, mask=mask).to(tl.float32)
        if SCALED:
            grad = grad / tl.load(scale)
        m1 = beta1 * tl.load(m + offs, mask=mask) + (1 - beta1) * grad
        v1 = beta2 * tl.load(v + offs, mask=mask) + (1 - beta2) * grad * grad
        denom = tl.sqrt(v1) / tl.sqrt(1 - tl.exp2(t * log2_beta2)) + eps
        w = tl.load(p + offs, mask=mask) * (1 - lr * wd) - lr / (1 - tl.exp2(t * log2_beta1)) * m1 / denom
        tl.store(p + offs, w, mask=mask)
        tl.store(m + offs, m1, mask=mask)
        tl.store(v + offs, v1, mask=mask)


# Rows and slots. Each row of an (N, D) tensor has K slots, slot s = row * K + j: a
# token's j-th chosen expert, or under expert parallelism a token's copy for rank j.
# `slots` (S,) lists the slots in use in the order they are wanted, and `position`
# (N*K,) is its inverse: each slot's index in `slots`, or S for a slot not in use.

def count_ids(ids, n):
    """How often each of 0..n-1 occurs in `ids` (int64 (n,)). scatter_add, not
    bincount: bincount on CUDA reads the max id back to the host (a sync)."""
    return torch.zeros(n, dtype=torch.int64,
                       device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def slot_positions(slots, n_slots):
    """The inverse of a selection of slots: position[slots[i]]
    = i, and S = len(slots) for the others."""
    S = slots.numel()
    return torch.full((n_slots,), S, dtype=slots.dtype, device=slots.device).scatter_(
        0, slots, torch.arange(S, dtype=slots.dtype, device=slots.device))


def sum_slots(y, position, K):
    """y (S, D), one row per slot in use -> (N, D): each row's sum over its K slots, unused slots
    adding zero. Deterministic (a fixed order, fp32 accumulation, no atomics). On CUDA one Triton
    kernel reads only the rows in use (the eager reference below, which a test compares it with,
    gathers them all)."""
    if y.is_cuda and triton is not None:
        return sum_slots_triton(y, position, K)
    y = torch.cat([y, y.new_zeros(1, y.shape[1])])  # row S: the zero row of unused slots
    return y.index_select(0, position).view(-1, K, y.shape[1]).sum(1)


def sum_slots_triton(y, position, K):
    y = y.contiguous()
    (S, D), N = y.shape, position.numel() // K
    out = y.new_empty(N, D)
    block = min(1024, triton.next_power_of_2(D))
    if N:
        _sum_slots_kernel[(N, triton.cdiv(D, block))](y, position, out, S, D, K=K, BLOCK=block)
    return out


if triton is not None:
    @triton.jit
    def _sum_slots_kernel(y, position, out, S, D, K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one output row, BLOCK of its columns
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(K):
            p = tl.load(position + row * K + k)  # where slot k of this row sits in y, S if unused
            acc += tl.load(y + p * D + cols, mask=(cols < D) & (cols * 0 + p < S),
                           other=0.0).to(tl.float32)
        tl.store(out + row * D + cols, acc.to(out.dtype.element_ty), mask=cols < D)


def grouped_grad(a, b, offs, grads):
    """Each expert's weight gradient a_e^T b_e in fp32, for a (N, M) and b (N, K) with rows sorted
    by expert (offs: cumulative row counts), into `grads`: one or two fp32 (E, M / n, K) tensors,
    the parts of M in order (gate's and up's halves of the stacked 2H), each added into, or made
    where it is None. Returns them. On CUDA one Triton kernel whose epilogue hands each output tile
    to TMA's reduce-add: the memory system adds it into the fp32 gradient, no bf16 gradient is
    written only to be read again and added (the largest traffic of the experts' backward), and the
    SM waits on no load of the gradient."""
    (E,), M, K, n = offs.shape, a.shape[1], b.shape[1], len(grads)
    # TMA: Hopper on
    kernel = a.is_cuda and triton is not None and torch.cuda.get_device_capability(a.device)[0] >= 9
    if not (kernel and a.dtype == torch.bfloat16 and (M // n) % 16 == 0 and K % 16 == 0):
        parts = torch._grouped_mm(a.t(), b, offs=offs).float().chunk(n, 1)  # the reference
        return [p.contiguous() if g is None else g.add_(p) for g, p in zip(grads, parts)]
    if grads[0] is None:
        return grouped_grad_triton(
            a, b, offs, [a.new_empty(E, M // n, K, dtype=torch.float32) for _ in grads], False)
    return grouped_grad_triton(a, b, offs, grads, True)


def grouped_grad_triton(a, b, offs, grads, accumulate):
    (E,), M, K, M0 = offs.shape, a.shape[1], b.shape[1], grads[0].shape[1]
    BM, (BN, BK) = next(bm for bm in (128, 64, 32, 16)
                        if M0 % bm == 0), (256, 64) if K % 256 == 0 else (128, 64)
    desc_a, desc_b = (TensorDescriptor.from_tensor(t, [BK, bs]) for t, bs in ((a, BM), (b, BN)))
    c0, c1 = (TensorDescriptor.from_tensor(g.view(-1, K), [BM, BN]) for g in (grads[0], grads[-1]))
    _grouped_grad_kernel[(E * triton.cdiv(M, BM) * triton.cdiv(K, BN),)](
        desc_a, desc_b, offs, c0, c1, M0, M, K, ACCUMULATE=accumulate, BM=BM, BN=BN, BK=BK,
        num_warps=8, num_stages=3)
    return grads


if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _grouped_grad_kernel(a, b, offs, c0, c1, M0, M, K, ACCUMULATE: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # program: expert e, output tile (tm, tn), tm fastest (the tiles of
        # one expert run together, its rows in L2); output rows below M0 go to
        # c0, the others to c1 (BM divides M0), both viewed as (E * rows, K)
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(K, BN)
        pid = tl.program_id(0)
        e, tm, tn = pid // (tiles_m * tiles_n), pid % tiles_m, pid // tiles_m % tiles_n
        start = tl.load(offs + e - 1, mask=e > 0, other=0)
        end = tl.load(offs + e)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range((end - start) // BK):  # whole blocks of rows: tensor-core
                                              # operands straight from TMA
            acc = tl.dot(a.load([start + i * BK, tm * BM]).T, b.load([start + i * BK, tn * BN]),
                         acc)
        last = start + (end - start) // BK * BK
        if last < end:  # the expert's last rows; the rest of the block is the next expert's: zeroed
            keep = (last + tl.arange(0, BK) < end)[:, None]
            acc = tl.dot(tl.where(keep, a.load([last, tm * BM]), 0).T,
                         tl.where(keep, b.load([last, tn * BN]), 0), acc)
        if tm * BM < M0:
            _put_tile(c0, e * M0 + tm * BM, tn * BN, acc, ACCUMULATE)
        else:
            _put_tile(c1, e * (M - M0) + tm * BM - M0, tn * BN, acc, ACCUMULATE)

    @triton.jit
    def _put_tile(c, row, col, acc, ACCUMULATE: tl.constexpr):
        # TMA's reduce-add (faster than loading the gradient into the accumulator before the
        # loop), or a plain store of the first gradient
        if ACCUMULATE:
            c.atomic_add([row, col], acc)
        else:
            c.store([row, col], acc)


def gather_fp8_rows(x, index):
    """fp8_rows(x[index]) as fp8_grouped_mm takes it, each row of x quantized once however often
    `index` repeats it (the FP8 experts' operand: the tokens' rows once for each of their top-k
    slots): (e4m3 rows of x, their scales, index), which the GEMM kernel gathers as it reads."""
    return (*fp8_rows(x.detach()), index)


class GatherRows(torch.autograd.Function):
    """x (N, D) -> x[slots // K] (S, D): a row once for each of its slots
    in use. Backward sums each row's slot gradients with `sum_slots`
    (autograd's own backward of x[index] would scatter with atomics).
    fp8: the gathered rows carry the tokens' e4m3 rows as `fp8_rows` (gather_fp8_rows),
    for GroupedSwiGLU's FP8 GEMM."""

    @staticmethod
    def forward(ctx, x, slots, position, K, fp8=False):
        ctx.save_for_backward(position)
        ctx.K = K
        index = slots // K
        out = x.index_select(0, index)
        if fp8:
            out.fp8_rows = gather_fp8_rows(x, index)
        return out

    @staticmethod
    def backward(ctx, grad):
        position, = ctx.saved_tensors
        return sum_slots(grad, position, ctx.K), None, None, None, None


class SumRows(torch.autograd.Function):
    """The adjoint of GatherRows: y (S, D), one row per slot
    in use -> (N, D), each row the sum of its slots. fp8: the gradient it
    hands back carries the tokens' e4m3 rows as `fp8_rows`, as GatherRows's output."""

    @staticmethod
    def forward(ctx, y, slots, position, K, fp8=False):
        ctx.save_for_backward(slots)
        ctx.K, ctx.fp8 = K, fp8
        return sum_slots(y, position, K)

    @staticmethod
    def backward(ctx, grad):
        slots, = ctx.saved_tensors
        index = slots // ctx.K
        out = grad.index_select(0, index)
        if ctx.fp8:
            out.fp8_rows = gather_fp8_rows(grad, index)
        return out, None, None, None, None


# -----------------------------------------------------------------------------
# expert parallelism: the experts of each MoE layer split over the ranks of the `ep` process group
# (train.py's `ep` mesh), and the two all-to-alls that Experts.forward calls around its local
# experts: `dispatch` sends each token to the ranks holding its experts, `combine` brings the
# weighted sums back

# the autograd all-to-all; torch 2.13 suggests the traced functional collectives instead, but this
# one is the same eager call on torch 2.11 and 2.13
warnings.filterwarnings("ignore",
                        message="torch.distributed.nn.functional.all_to_all_single is deprecated")


def all_to_all(x, out_splits, in_splits, group):
    """Autograd all-to-all of rows: backward sends the gradients back along the same routes."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return dist_nn.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


def dispatch(x, topk_ids, topk_weights, num_experts, group):
    """Send each token once to every rank of `group` holding one of its chosen experts, with its
    choices there.

    x (N, D), topk_ids (N, K) global expert ids, topk_weights (N, K). A token with several experts
    on one rank crosses once, not once per expert (with top-8 of 128 experts on 2 ranks: 2 rows per
    token instead of 8). Returns what arrived, x_recv (R, D) with ids_recv (R, K) local expert ids
    (E_local for choices held elsewhere) and weights_recv (R, K), the number of local choices among
    them (a host int), and the routes `combine` needs.
    """
    N, K = topk_ids.shape
    ep, device = group.size(), x.device
    E_local = num_experts // ep
    rank_of = topk_ids // E_local  # (N, K) the rank holding each choice
    on_rank = torch.zeros(N, ep, dtype=torch.bool, device=device)
    on_rank.scatter_(1, rank_of, True)  # (N, ep)
    # 1. counts first. For each destination rank: rows, then choices per local expert
    choices = count_ids(topk_ids.flatten(), num_experts).view(ep, E_local)
    send_counts = torch.cat([on_rank.sum(0).view(ep, 1), choices], dim=1)  # (ep, 1 + E_local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # NOTE: device-to-host sync (one per MoE layer): all_to_all_single takes its split sizes as
    # Python ints
    pairs_in = recv_counts[:, 1:].sum().view(1)
    splits = torch.cat([send_counts[:, 0], recv_counts[:, 0], pairs_in]).tolist()
    send_rows, recv_rows, pairs = splits[:ep], splits[ep:2 * ep], splits[-1]
    # 2. the rows, in (destination rank, token) order: slot n * ep + r is token n's copy for rank r
    slot_rank = torch.where(on_rank, torch.arange(ep, device=device), ep)  # (N, ep), ep: unsent
    slots = slot_rank.flatten().argsort(stable=True)[:sum(send_rows)]
    position = slot_positions(slots, N * ep)
    token, dest = slots // ep, slots % ep
    held = rank_of.index_select(0, token) == dest.unsqueeze(1)  # (S, K) what the destination holds
    ids_send = torch.where(held, topk_ids.index_select(0, token) % E_local, E_local)  # ids there
    x_recv = all_to_all(GatherRows.apply(x, slots, position, ep), recv_rows, send_rows,
                        group)  # (R, D)
    weights_recv = all_to_all(GatherRows.apply(topk_weights, slots, position, ep), recv_rows,
                              send_rows, group)  # (R, K)
    ids_recv = ids_send.new_empty((sum(recv_rows), K))
    dist.all_to_all_single(ids_recv, ids_send, recv_rows, send_rows, group=group)
    return x_recv, ids_recv, weights_recv, pairs, (slots, position, send_rows, recv_rows)


def combine(y_recv, routes, group):
    """Send each rank's weighted sums back to the tokens' ranks and add up each token's copies."""
    slots, position, send_rows, recv_rows = routes
    y_back = all_to_all(y_recv, send_rows, recv_rows, group)  # (S, D) in dispatch's send order
    return SumRows.apply(y_back, slots, position, group.size())  # (N, D)


class Experts(nn.Module):
    """E stacked SwiGLU experts. HF checkpoints name them
    `experts.{e}.gate_proj.weight` etc.; we stack them.

    `expert_parallel` (a process group, train.py's `ep` mesh's, or None): its ranks split the
    experts, and this one holds [first_expert, first_expert + E / size); `forward` sends each token
    to every rank that holds one of its chosen experts, once, and takes back one weighted sum per
    rank (`dispatch` and `combine`: two all-to-alls of rows).
    """

    def __init__(self, E, D, H, expert_parallel=None):
        super().__init__()
        ep = expert_parallel
        if ep is not None and E % ep.size():
            raise ValueError(f"{ep.size()} expert-parallel ranks cannot split {E} experts evenly")
        E_local = E if ep is None else E // ep.size()
        self.num_experts = E  # global count; the parameters hold E_local of them
        self.first_expert = 0 if ep is None else ep.rank() * E_local  # global index of local 0
        self.expert_parallel = ep
        self.gate_proj = nn.Parameter(torch.empty(E_local, H, D))  # (E_local, H, D)
        self.up_proj = nn.Parameter(torch.empty(E_local, H, D))    # (E_local, H, D)
        self.down_proj = nn.Parameter(torch.empty(E_local, D, H))  # (E_local, D, H)
        self.use_grouped_mm = None  # None: grouped GEMM for bf16 on CUDA, loop elsewhere
        self.fp8 = False  # grouped GEMMs in FP8 (train.py's fp8_experts; GroupedSwiGLU)
        self.cast_weights = None  # train.keep_experts_local sets it
                                  # when these weights stay outside FSDP
        self.lora_scaling = None  # lora.add_adapters sets it, with the
                                  # adapters {proj}_lora_A / {proj}_lora_B

    def weights(self, stacked=False):
        """(gate_proj, up_proj, down_proj) as the computation uses them: the
        parameters (under FSDP, its unsharded compute-dtype copies), or what
        `cast_weights` makes of them (train.keep_experts_local). stacked: (gate_up,
        down_proj), the gate and up weights as one (E, 2H, D) tensor for GroupedSwiGLU
        (cast_weights writes both into one; FSDP's copies are concatenated)."""
        if not stacked:
            ws = (self.gate_proj, self.up_proj, self.down_proj)
            return ws if self.cast_weights is None else tuple(self.cast_weights(w) for w in ws)
        if self.cast_weights is None:
            return torch.cat([self.gate_proj, self.up_proj], 1), self.down_proj
        return self.cast_weights(self.gate_proj, self.up_proj), self.cast_weights(self.down_proj)

    def lora_weights(self):
        """(scaling, ((A, B) of gate, up, down)) of the LoRA
        adapters as the computation uses them, or None."""
        if self.lora_scaling is None:
            return None
        ws = [getattr(self, f"{p}_lora_{m}") for p in EXPERT_PROJS for m in "AB"]
        ws = ws if self.cast_weights is None else [self.cast_weights(w) for w in ws]
        return self.lora_scaling, tuple(zip(ws[0::2], ws[1::2]))

    def compute(self, x, counts, scale):
        lora = self.lora_weights()
        grouped = self.use_grouped_mm if self.use_grouped_mm is not None else (
            x.is_cuda and x.dtype == torch.bfloat16)
        stacked = grouped and lora is None
        ws = self.weights(stacked)
        if x.shape[0] == 0:  # no rows for this rank's experts (expert parallelism): keep
                             # the weights and the scale in the graph so the weights still
                             # get a (zero) gradient, FSDP's gradient reduce-scatter runs
                             # on every rank, and so does the backward all-to-all of the
                             # routing weights that arrived (empty) from other ranks
            adapters = sum(w.sum() for ab in lora[1] for w in ab) if lora is not None else 0
            return x + 0 * (scale.sum() + sum(w.sum() for w in ws) + adapters)
        if stacked:  # local fp32 experts (cast_weights) get their
                     # gradients added into .grad by GroupedSwiGLU
            own_grads = self.cast_weights is not None and self.gate_proj.requires_grad
            return GroupedSwiGLU.apply(x, torch.cumsum(counts, 0, dtype=torch.int32), scale, *ws,
                                       ((self.gate_proj, self.up_proj), (self.down_proj,))
                                       if own_grads else None, self.fp8)
        return (experts_grouped_mm if grouped else experts_loop)(x, counts, scale, *ws, lora)

    def forward(self, x, topk_ids, topk_weights):
        # x (N, D), topk_ids (N, K) global expert ids, topk_weights (N, K)
        ep = self.expert_parallel
        if ep is None:
            return self.local_experts(x, topk_ids, topk_weights, topk_ids.numel())
        x_recv, ids_recv, weights_recv, pairs, routes = dispatch(x, topk_ids, topk_weights,
                                                                 self.num_experts, ep)
        return combine(self.local_experts(x_recv, ids_recv, weights_recv, pairs), routes, ep)

    def local_experts(self, x, ids, weights, pairs):
        """Each row's weighted sum over its chosen experts among this rank's.

        x (N, D); ids (N, K) local expert index of each choice, or E_local
        for a choice another rank holds; weights (N, K); pairs: how many
        ids are local (a host int: the row count of the grouped GEMMs)."""
        N, K = ids.shape
        E_local = self.gate_proj.shape[0]
        flat = ids.flatten()  # (N*K,) one slot per (row, choice)
        # slots of local choices, grouped by expert; on 16-bit
        # keys the GPU's radix sort makes a quarter of the passes
        slots = flat.to(torch.int16 if E_local < 2 ** 15
                        else flat.dtype).argsort(stable=True)[:pairs]
        counts = count_ids(flat, E_local + 1)[:E_local]  # (E_local,) choices per local expert
        position = slot_positions(slots, N * K)
        # FP8 experts (grouped, no LoRA): the rows and their gradients carry their tokens' e4m3 rows
        fp8 = self.fp8 and self.lora_scaling is None
        x_sorted = GatherRows.apply(x, slots, position, K, fp8)  # (pairs, D) rows by expert
        # weighted outputs
        y_sorted = self.compute(x_sorted, counts, weights.flatten().index_select(0, slots))
        return SumRows.apply(y_sorted, slots, position, K, fp8)  # (N, D)
