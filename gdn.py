"""
Gated DeltaNet, the linear-attention layer of the Qwen3.5 / Qwen3.6 hybrid
models (`linear_attn` in their checkpoints), with packed-sequence boundaries
respected: the short causal convolution and the delta-rule recurrence restart at
every segment of a packed row, so no state leaks from one segment into the next.

The recurrence is the chunked gated delta rule. `chunk_gated_delta_rule_torch` is the readable
fp32 reference and the CPU path; on CUDA the same call goes, for 16-bit inputs, to fla's Triton
kernel (`fla-core`, installed with the GPU requirements only: it cannot compute on a CPU, so it is
imported only when a CUDA tensor arrives), and the layer takes fla's fused causal conv (varlen)
and gated RMSNorm too, with `causal_conv` and `GatedRMSNorm` below as their reference. Tests
compare the two paths forward and backward on a GPU (`FLA_ON_CUDA = False` runs the reference).

This file imports nothing of ours.

    .venv/bin/python -m pytest tests/test_hybrid.py -q
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

FLA_ON_CUDA = True  # fla's kernels for CUDA tensors (False: the torch reference everywhere)


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def segment_positions(cu_seqlens, N):
    """Each of the N packed tokens' index within its segment,
    and its segment: cu_seqlens (S+1,) int -> (N,), (N,)."""
    segment = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device),
                                      cu_seqlens.diff(), output_size=N)
    return torch.arange(N, device=cu_seqlens.device) - cu_seqlens[segment], segment


def chunk_gated_delta_rule_torch(q, k, v, g, beta, cu_seqlens, chunk=64, incoming=None):
    """The gated delta rule over packed segments, in fp32 (fp64 for fp64 inputs),
    as transformers' and fla's chunked form computes it: per segment S_t = exp(g_t)
    S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t^T q_t, with q, k
    L2-normalized and q scaled by dk^-0.5, the state zero at each segment's start.

    q, k (1, N, Hk, dk), v (1, N, H, dv), g, beta (1, N, H): the N tokens of all
    segments in a row (fla's varlen layout), each key head shared by H / Hk
    consecutive value heads; cu_seqlens (S+1,) the segments' offsets. Returns (1, N,
    H, dv) in v's dtype. The segments are padded to one length (padding at the end of
    a segment cannot reach its tokens: the recurrence is causal) and run as a batch.

    incoming: context parallelism (GatedDeltaNet under a context.ContextParallel), where each
    segment is a piece of a longer sequence whose state arrives from pieces on other ranks. The
    state is affine in the state a segment starts from: state_end = transition @ state_start +
    final, each chunk's step being one such map (the WY form below), and each output adds reads @
    state_start. `incoming(final, transition)` gets (S, H, dk, dv) and (S, H, dk, dk), the segments'
    maps from a zero start, and returns each one's start state (S, H, dk, dv) (incoming_states):
    exact, the same arithmetic as one long scan in another order.
    """
    q, k = (t.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for t in (q, k))
    N, H, dk, dv, dtype = q.shape[1], q.shape[2], q.shape[3], v.shape[3], v.dtype
    acc = torch.promote_types(dtype, torch.float32)  # fp32 (fp64 inputs stay
                                                     # fp64: the exactness test)
    pos, seg = segment_positions(cu_seqlens, N)
    # chunks a segment; NOTE: a host sync
    S, n = len(cu_seqlens) - 1, -(-int(cu_seqlens.diff().max()) // chunk)
    L = n * chunk

    def padded(x):  # (1, N, H, ...) -> (S, H, n, chunk, ...)
                    # in fp32, zeros after each segment's end
        out = x.new_zeros(S, L, *x.shape[2:], dtype=acc).index_put((seg, pos), x[0].to(acc))
        return out.transpose(1, 2).reshape(S, H, n, chunk, *x.shape[3:])
    q, k = l2norm(padded(q)) * dk ** -0.5, l2norm(padded(k))
    v, g, beta = padded(v), padded(g), padded(beta)
    decay = g.cumsum(-1)  # (S, H, n, C): log of the decay from the chunk's start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # (S, H, n, C, C)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # the delta rule within a chunk is a unit lower-triangular
    # system (the WY/UT form): solve it for all chunks at once
    system = (k * beta[..., None]) @ k.transpose(-1, -2) * pair
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                           unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system, k * (beta * decay.exp())[..., None],
                                              upper=False, unitriangular=True)
    within = q @ k.transpose(-1, -2) * pair  # causal, diagonal included
    q_decayed = q * decay.exp()[..., None]
    k_decayed = k * (decay[..., -1:] - decay).exp()[..., None]
    state, out = q.new_zeros(S, H, dk, dv), []  # the state in fp32 (acc)
    transition, reads = torch.eye(dk, dtype=acc, device=q.device).expand(S, H, dk, dk), []
    for i in range(n):  # the scan over chunks: the state carries what earlier chunks wrote
        new = values[:, :, i] - keys_read[:, :, i] @ state
        out.append(q_decayed[:, :, i] @ state + within[:, :, i] @ new)
        if incoming is not None:  # how chunk i's outputs and the next state read the start state
            read = q_decayed[:, :, i] - within[:, :, i] @ keys_read[:, :, i]
            reads.append(read @ transition)  # (S, H, C, dk)
            transition = transition * decay[:, :, i, -1, None, None].exp() - \
                k_decayed[:, :, i].transpose(-1, -2) @ (keys_read[:, :, i] @ transition)
        state = state * decay[:, :, i, -1, None,
                              None].exp() + k_decayed[:, :, i].transpose(-1, -2) @ new
    out = torch.stack(out, 2)  # (S, H, n, C, dv)
    if incoming is not None:  # what each output reads of the segment's start state (a collective)
        out = out + torch.stack(reads, 2) @ incoming(state, transition)[:, :, None]
    out = out.reshape(S, H, L, dv).transpose(1, 2)  # (S, L, H, dv)
    return out[seg, pos][None].to(dtype)


def fla_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, incoming=None):
    """fla's Triton kernel (CUDA only): the same function, fused, in the inputs' dtype with an
    fp32 state. Under context parallelism (`incoming`, as chunk_gated_delta_rule_torch's) fla
    makes each segment's maps itself: the final state from a zero start, and the transition as
    the final state from the identity with zero values (state_end = transition @ state_start +
    final, so a zero final and start I leave the transition); then it runs again from the start
    states `incoming` returns. Three passes of the fused kernel, gradients through all three."""
    # the GPU install's fla-core
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    def rule(v, **kw):
        return fla_rule(q, k, v, g=g, beta=beta, scale=q.shape[-1] ** -0.5,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long(), **kw)
    if incoming is None:
        return rule(v)[0]
    S, H, dk = len(cu_seqlens) - 1, v.shape[2], k.shape[3]
    final = rule(v, output_final_state=True)[1]  # (S, H, dk, dv) fp32
    eye = torch.eye(dk, device=v.device).expand(S, H, dk, dk).contiguous()
    transition = rule(v.new_zeros(*v.shape[:3], dk), initial_state=eye,
                      output_final_state=True)[1]  # (S, H, dk, dk)
    return rule(v, initial_state=incoming(final, transition))[0]


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, incoming=None):
    """fla's kernel for 16-bit CUDA tensors, the torch reference for the rest:
    in fp32, fla-core 0.6.0's backward gets the log decay's gradient wrong
    (its per-token error grows with the decay's strength, its bf16 path's does
    not; tests/test_hybrid.py measures both), so fp32 inputs stay on the
    reference."""
    if q.is_cuda and FLA_ON_CUDA and q.dtype in (torch.bfloat16, torch.float16):
        return fla_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, incoming)
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, cu_seqlens, incoming=incoming)


def incoming_states(final, transition, cp, B):
    """Under context parallelism, each of this rank's pieces' start state: every rank's per-piece
    maps (final (2B, H, dk, dv), transition (2B, H, dk, dk): chunk_gated_delta_rule_torch's
    `incoming`) all-gathered and composed in the row's order, state_p+1 = transition_p @ state_p +
    final_p from zero. Sends (H, dk, dk + dv) fp32 a piece, whatever its length; 2 * cp small
    matmuls, the same on every rank. -> (2B, H, dk, dv)."""
    final, transition = (cp.in_sequence(cp.gather(t.unflatten(0, (B, 2))), 1)
                         for t in (final, transition))
    state, start = torch.zeros_like(final[:, 0]), []  # (B, H, dk, dv)
    for p in range(2 * cp.size):
        start.append(state)
        state = transition[:, p] @ state + final[:, p]
    return torch.stack(start, 1)[:, list(cp.pieces)].flatten(0, 1)


def left_context(x, K, cp, B):
    """Under context parallelism, this rank's pieces (2B, C, conv_dim) each preceded by the K - 1
    inputs before it, the previous piece's last ones (another rank's; zeros before the first piece):
    (2B, C + K - 1, conv_dim). A collective of (K - 1) rows a piece."""
    if x.shape[1] < K - 1:
        raise ValueError(f"a context-parallel piece of {x.shape[1]} tokens is shorter than the "
                         f"conv's context {K - 1}")
    tails = x[:, x.shape[1] - K + 1:].unflatten(0, (B, 2))
    tails = cp.in_sequence(cp.gather(tails), 1)  # (B, 2cp, K-1, conv)
    before = F.pad(tails, (0, 0, 0, 0, 1, 0))[:, list(cp.pieces)]  # piece p's: piece p - 1's tail
    return torch.cat([before.flatten(0, 1), x], 1)


def causal_conv(x, weight, pos):
    """Depthwise causal convolution (no bias) restarted at each segment: x (N,
    C), weight (C, 1, K), pos (N,) each token's index in its segment -> (N, C).
    Tap j reads the token K-1-j back, zero when that is before the segment."""
    K, out = weight.shape[-1], x * weight[:, 0, -1]
    for back in range(1, K):
        # the token `back` steps earlier (zero before the
        # segment's start; any N, even < K), times its tap
        out = out + F.pad(x, (0, 0, back,
                              0))[:len(x)] * (pos >= back)[:, None].to(x.dtype) * weight[
                                  :, 0, K - 1 - back]
    return out


class GatedRMSNorm(nn.Module):
    """w * rmsnorm(x) * silu(z) per head: the GDN output
    norm (weight init ones, not zero-centred)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x, z):
        xf = x.float()  # one cast: its backward rounds as transformers' does
        y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        D, key_dim, value_dim = cfg.hidden_size, self.n_k * self.dk, self.n_v * self.dv
        conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = nn.Linear(D, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(D, value_dim, bias=False)  # the output gate
        self.in_proj_b = nn.Linear(D, self.n_v, bias=False)  # beta: the write strength
        self.in_proj_a = nn.Linear(D, self.n_v, bias=False)  # the decay's input
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim,
                                bias=False,
                                # only its weight is used: causal_conv
                                padding=cfg.linear_conv_kernel_dim - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, D, bias=False)
        self.context_parallel = None  # a context.ContextParallel: this rank's pieces of each row

    def forward(self, x, cu_seqlens):
        """x (B, T, D); cu_seqlens (S+1,) the segments' offsets in the B*T tokens taken row after
        row (a row's padding may be a segment of its own: nothing after it reads it). Under context
        parallelism x holds this rank's two pieces of each row (context.py) and cu_seqlens is not
        read: each piece is a segment whose conv context and recurrent state come from the pieces
        before it."""
        B, T, D = x.shape
        x, N, fla = x.reshape(1, B * T, D), B * T, x.is_cuda and FLA_ON_CUDA
        cp = self.context_parallel
        mixed, K = self.in_proj_qkv(x)[0], self.conv1d.weight.shape[-1]  # (N, conv_dim)
        if cp is not None:  # each piece a segment, led by its left context
            cu_seqlens = torch.arange(2 * B + 1, device=x.device) * (T // 2)
            mixed = left_context(mixed.view(2 * B, T // 2, -1), K, cp, B).flatten(0, 1)
        conv_seqlens = cu_seqlens if cp is None else \
            torch.arange(2 * B + 1, device=x.device) * (T // 2 + K - 1)
        if fla:  # the GPU install's fla-core: conv and SiLU
                 # in one kernel, restarted at each segment
            import fla.modules.causal_conv1d as fla_conv
            import fla.modules.norm.fused_norm_gate as fla_norm
            qkv = fla_conv.causal_conv1d(mixed[None], self.conv1d.weight[:, 0], activation="silu",
                                         cu_seqlens=conv_seqlens.long())[0][0]
        else:
            pos = segment_positions(conv_seqlens, len(mixed))[0]
            qkv = F.silu(causal_conv(mixed, self.conv1d.weight, pos))
        if cp is not None:  # the context's outputs are the previous piece's, computed there
            qkv = qkv.view(2 * B, T // 2 + K - 1, -1)[:, K - 1:].flatten(0, 1)
        # (N, ...)
        q, k, v = qkv.split([self.n_k * self.dk, self.n_k * self.dk, self.n_v * self.dv], dim=-1)
        q, k, v = q.view(1, N, self.n_k, self.dk), k.view(1, N, self.n_k,
                                                          self.dk), v.view(1, N, self.n_v, self.dv)
        beta = self.in_proj_b(x).sigmoid()  # (1, N, Hv)
        # log decay, fp32
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        y = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, incoming=None if cp is None else (
            lambda u, m: incoming_states(u, m, cp, B)))  # (1, N, Hv, dv)
        z = self.in_proj_z(x).view(1, N, self.n_v, self.dv)
        y = fla_norm.rms_norm_gated(y, z, self.norm.weight, None,
                                    eps=self.norm.eps) if fla else self.norm(y, z)
        return self.out_proj(y.reshape(B, T, -1))
