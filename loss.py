"""
The RL objective: token logprobs without full logits, advantage estimators, and
the policy loss with importance correction and window normalization; and the
supervised objective (sft_loss) under the same normalization. Pure functions on
tensors; imports torch (and model.py's compile-on-CUDA wrapper) only.

    .venv/bin/python -m pytest tests/test_loss.py tests/test_loss_dist.py -q   # tests
    .venv/bin/python bench.py logprobs                                       # chunked vs naive peak memory

One optimizer step over a window of microbatches, on every data-parallel rank:

    kept = [kept_token_mask(mb.old_logprobs, mb.behavior_logprobs, mb.mask, mb.token_versions, version, cfg)
            for mb in my_microbatches]
    window_tokens = count_window_tokens(kept, group=dp_group)   # one all-reduce, before the first backward
    for mb in my_microbatches:
        logprobs, entropy = token_logprobs(hidden, lm_head_weight, mb.targets, temperature, with_entropy=True)
        loss, metrics = policy_loss(logprobs, mb.old_logprobs, mb.behavior_logprobs, mb.advantages, mb.mask,
                                    mb.token_versions, version, cfg, window_tokens, entropy=entropy)
        loss.backward()   # the trainer SUMS gradients over ranks; a data-parallel average would pass dp_world_size
    summary = reduce_metrics(all_metrics, group=dp_group)

Names: logprobs (this forward), old_logprobs (the trainer's policy at
the start of the step, no grad), behavior_logprobs (what the engine
sampled with), mask (1 on action tokens: tokens the model generated).
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import cuda_compiled  # torch.compile on CUDA, eager elsewhere: the one such wrapper

# -----------------------------------------------------------------------------
# token logprobs and entropy, chunked over tokens


def _chunk_logits(hidden, weight, temperature):
    # the matmul output is rounded to the weight dtype, as the engine's lm_head rounds it;
    # all after is fp32 (fp64 for fp64 inputs, which lets gradcheck test the backward)
    logits = (hidden @ weight.T).to(_compute_dtype(weight))  # (C, V)
    if temperature != 1.0:
        logits.div_(temperature)  # the engine divides fp32 logits by the temperature the same way
    return logits


def _compute_dtype(weight):
    return torch.promote_types(weight.dtype, torch.float32)


@cuda_compiled
def _fused_chunk_stats(logits, targets, temperature, with_entropy):
    """The forward of one chunk without in-place ops, for torch.compile
    on CUDA: one kernel reads the (C, V) logits in the weight dtype and
    writes (C,) results (eager would write three fp32 (C, V) buffers)."""
    logits = logits.to(_compute_dtype(logits)) / temperature  # (C, V)
    # logsumexp written out: torch.logsumexp asks whether the chunk is empty, which a
    # chunk's rows (unbacked: see compiled_for_tokens) cannot answer at compile time
    top = logits.amax(-1, keepdim=True)
    lse = (logits - top).exp().sum(-1).log() + top.squeeze(1)  # (C,)
    logprobs = logits.gather(1, targets[:, None]).squeeze(1) - lse
    entropy = None
    if with_entropy:
        logp = logits - lse[:, None]
        entropy = -(logp.exp() * logp).sum(-1)
    return lse, logprobs, entropy


@cuda_compiled
def _fused_chunk_grad_logits(logits, targets, lse, g_lp, entropy, g_entropy, temperature):
    """d loss / d logits of one chunk in the weight dtype, without in-place
    ops, for torch.compile on CUDA: one kernel reads the recomputed (C, V)
    logits and writes the (C, V) gradient (eager: six fp32 passes)."""
    logp = logits.to(_compute_dtype(logits)) / temperature - lse[:, None]  # (C, V)
    coef = g_lp[:, None]  # d logp_target / d logits = onehot(target)
                          # - p; d H / d logits = -p * (log p + H)
    if entropy is not None:
        coef = coef + g_entropy[:, None] * (logp + entropy[:, None])
    # (C, V), fused away
    onehot = torch.arange(logits.shape[1], device=logits.device) == targets[:, None]
    grad = (torch.where(onehot, g_lp[:, None], 0.0) - logp.exp() * coef) / temperature
    return grad.to(logits.dtype)


FUSED_DEVICES = ("cuda",)  # device types that take the fused path
                           # (tests add "cpu" to run it eagerly)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Logprob of each target (and the entropy) chunk by chunk; backward recomputes
    each chunk's logits. Memory: two (C, V) fp32 buffers at a time (plus one in the
    weight dtype in backward), never (N, V). On CUDA each chunk's elementwise work
    is one compiled kernel (only (C, V) buffers in the weight dtype)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy,
                keep_logits=False):
        # hidden (N, D), weight (V, D), targets (N,); keep_logits: save each
        # chunk's (C, V) logits in the weight dtype for backward instead of
        # recomputing them (N * V * itemsize bytes for one lm_head GEMM less)
        N, dtype = hidden.shape[0], _compute_dtype(weight)
        logprobs = torch.empty(N, dtype=dtype, device=hidden.device)
        logsumexp = torch.empty(N, dtype=dtype, device=hidden.device)
        entropy = torch.empty(N, dtype=dtype, device=hidden.device) if with_entropy else None
        fused = hidden.device.type in FUSED_DEVICES
        kept = []  # (C, V) logits per chunk, with keep_logits
        for start in range(0, N, chunk_size):
            rows = slice(start, start + chunk_size)
            if fused or keep_logits:
                raw = hidden[rows] @ weight.T  # (C, V) in the weight dtype, as
                                               # the engine's lm_head rounds it
                if keep_logits:
                    kept.append(raw)
            if fused:
                lse, lp, ent = _fused_chunk_stats(raw, targets[rows], temperature, with_entropy)
                logsumexp[rows], logprobs[rows] = lse, lp
                if with_entropy:
                    entropy[rows] = ent
                continue
            logits = _chunk_logits(hidden[rows], weight, temperature) if not keep_logits else \
                raw.to(_compute_dtype(weight), copy=True).div_(temperature)  # (C, V); raw stays as it was
            lse = torch.logsumexp(logits, dim=-1)  # (C,)
            logsumexp[rows] = lse
            logprobs[rows] = logits.gather(1, targets[rows, None]).squeeze(1) - lse
            if with_entropy:
                logp = logits.sub_(lse[:, None])  # (C, V) in place: the chunk's log-softmax
                # H = -sum p log p, one more (C, V) buffer
                entropy[rows] = -(logp.exp().mul_(logp)).sum(-1)
                del logp
            del logits  # free this chunk before the next one is allocated
        ctx.save_for_backward(hidden, weight, targets, logsumexp, entropy)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy, ctx.kept = temperature, chunk_size, with_entropy, kept
        return (logprobs, entropy) if with_entropy else logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        hidden, weight, targets, logsumexp, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # fp32 accumulator over chunks: an O(V * D) copy when the weight is bf16, never O(N * V)
        grad_weight = torch.zeros(weight.shape, dtype=_compute_dtype(weight),
                                  device=weight.device) if need_weight \
            else None
        fused = hidden.device.type in FUSED_DEVICES
        kept, ctx.kept = ctx.kept, None
        for i, start in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]  # (C, D)
            raw = None
            if kept:  # the forward's logits (bit-identical to
                      # recomputing them); dropped as they are used
                raw, kept[i] = kept[i], None
            if fused:
                grad_logits = _fused_chunk_grad_logits(
                    raw if raw is not None else h @ weight.T, targets[rows], logsumexp[rows],
                    grad_logprobs[rows], entropy[rows] if ctx.with_entropy else None,
                    # (C, V) weight dtype
                    grad_entropy[rows] if ctx.with_entropy else None, ctx.temperature)
            else:
                g_lp = grad_logprobs[rows, None]  # (C, 1)
                logp = _chunk_logits(h, weight, ctx.temperature) if raw is None else \
                    raw.to(_compute_dtype(weight)).div_(ctx.temperature)
                logp.sub_(logsumexp[rows, None])  # (C, V) recomputed or kept
                p = logp.exp()  # (C, V)
                # d logp_target / d logits = onehot(target) - p;  d H / d logits = -p * (log p + H)
                if ctx.with_entropy:  # logp becomes the coefficient g_lp
                                      # + g_H * (log p + H), in place
                    p.mul_(logp.add_(entropy[rows, None]).mul_(grad_entropy[rows, None]).add_(g_lp))
                else:
                    p.mul_(g_lp)
                grad_logits = p.neg_()  # (C, V) the same buffer as p
                grad_logits.scatter_add_(1, targets[rows, None], g_lp)
                if ctx.temperature != 1.0:
                    grad_logits.div_(ctx.temperature)
                # (C, V) a copy only when the weight is not fp32
                grad_logits = grad_logits.to(weight.dtype)
                del logp, p
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])  # (C, D) written in place
            if need_weight and weight.dtype == grad_weight.dtype:
                grad_weight.addmm_(grad_logits.T, h)  # (V, D) in place
            elif need_weight and weight.is_cuda:  # bf16 GEMM accumulating into
                                                  # the fp32 (V, D) buffer
                torch.addmm(grad_weight, grad_logits.T, h, out_dtype=grad_weight.dtype,
                            out=grad_weight)
            elif need_weight:
                grad_weight.add_((grad_logits.T @ h).to(grad_weight.dtype))  # (V, D)
            del grad_logits, raw  # free this chunk before the next one is allocated
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _check_logprob_inputs(hidden, lm_head_weight, targets, temperature, chunk_size):
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be (N, D) or (B, T, D), got shape {tuple(hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"lm_head_weight must be (V, D) with D = {hidden.shape[-1]}, "
                         f"got {tuple(lm_head_weight.shape)}")
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and lm_head_weight ({lm_head_weight.dtype}) "
                         "must share a dtype")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]) or targets.dtype not in (
            torch.int64, torch.int32):
        raise ValueError(f"targets must be integer token ids of shape {tuple(hidden.shape[:-1])}, "
                         f"got {targets.dtype} {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError("temperature must be > 0 (the engine's sampling temperature), got "
                         f"{temperature}")
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def token_logprobs(hidden, lm_head_weight, targets, temperature=1.0, chunk_size=1024,
                   with_entropy=False, keep_logits=False):
    """log softmax(hidden @ W.T / temperature)[target] per token, and the entropy of that
    distribution if asked. hidden (N, D) or (B, T, D) final-normed states, lm_head_weight (V, D),
    targets the same leading shape. Returns (logprobs, entropy or None), fp32, shaped like targets.
    Full (N, V) logits never exist: each chunk of chunk_size tokens is computed, reduced and
    dropped, and backward recomputes it. keep_logits=True keeps the logits in the weight dtype
    instead (N * V * 2 bytes in bf16, one lm_head GEMM less; same numbers). Temperature matches the
    engine's processed logprobs (top-p/top-k truncation is not reproduced; train with top_p=1)."""
    _check_logprob_inputs(hidden, lm_head_weight, targets, temperature, chunk_size)
    lead = targets.shape
    out = _ChunkedTokenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), lm_head_weight,
                                      targets.reshape(-1).long(), float(temperature), chunk_size,
                                      with_entropy, keep_logits)
    logprobs, entropy = out if with_entropy else (out, None)
    return logprobs.view(lead), (entropy.view(lead) if with_entropy else None)


def naive_token_logprobs(hidden, lm_head_weight, targets, temperature=1.0, chunk_size=1024,
                         with_entropy=False):
    """The readable reference for token_logprobs: materializes
    the full (N, V) fp32 logits. chunk_size is unused."""
    _check_logprob_inputs(hidden, lm_head_weight, targets, temperature, chunk_size)
    # (..., V)
    logits = (hidden @ lm_head_weight.T).to(_compute_dtype(lm_head_weight)) / temperature
    logp = F.log_softmax(logits, dim=-1)  # (..., V)
    logprobs = logp.gather(-1, targets.long()[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return logprobs, entropy

# -----------------------------------------------------------------------------
# advantages


ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce")


def compute_advantages(rewards, group_ids, estimator, eps=1e-6):
    """One advantage per attempt. rewards (A,) float, group_ids (A,) int (any values, any order).
    grpo: (r - mean_g) / (std_g + eps), std with Bessel's correction as torch.std; drgrpo: r -
    mean_g; rloo: r_i - mean_{j != i in g} r_j; reinforce: r - mean over the whole batch
    (group_ids unused). A group of size 1, or whose rewards are all equal, gets exactly 0."""
    if estimator not in ESTIMATORS:
        hint = " (distillation is per token: use distill_token_rewards)" if estimator == "distill" else ""
        raise ValueError(f"unknown advantage estimator {estimator!r}, expected one of "
                         f"{ESTIMATORS}{hint}")
    rewards, group_ids = torch.as_tensor(rewards), torch.as_tensor(group_ids)
    if rewards.dim() != 1 or tuple(group_ids.shape) != tuple(rewards.shape) or group_ids.is_floating_point():
        raise ValueError("rewards and group_ids must be 1-D of one length with integer group ids, "
                         "got "
                         f"{tuple(rewards.shape)} and {group_ids.dtype} {tuple(group_ids.shape)}")
    if not torch.isfinite(rewards).all():  # one NaN reward would poison its whole group
        raise ValueError("rewards must be finite; give failed attempts a number or drop their group")
    r = rewards.double()  # (A,) fp64: an all-equal group must come out exactly zero
    if estimator == "reinforce":
        return torch.where(r.max() == r.min(), torch.zeros_like(r), r - r.mean()).float()
    _, g = torch.unique(group_ids, return_inverse=True)  # (A,) group index 0..G-1
    G = int(g.max()) + 1 if g.numel() else 0
    n = torch.bincount(g, minlength=G).double()  # (G,)
    total = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, g, r)
    mean = (total / n)[g]  # (A,)
    if estimator == "drgrpo":
        adv = r - mean
    elif estimator == "grpo":
        var = torch.zeros_like(total).index_add_(0, g, (r - mean) ** 2) / (n - 1).clamp(min=1)
        adv = (r - mean) / (var.sqrt()[g] + eps)
    else:  # rloo
        adv = r - (total[g] - r) / (n[g] - 1).clamp(min=1)
    hi = torch.full_like(total, -math.inf).scatter_reduce_(0, g, r, "amax")
    lo = torch.full_like(total, math.inf).scatter_reduce_(0, g, r, "amin")
    trivial = (n[g] < 2) | (hi[g] == lo[g])  # (A,) size-1 or all-equal groups
    return torch.where(trivial, torch.zeros_like(adv), adv).float()


def segment_advantages(segment_attempt_ids, segment_group_ids, segment_rewards, estimator,
                       eps=1e-6):
    """Advantages per segment: an attempt split into several segments counts
    once in its group, and all its segments get its advantage. Arguments are
    sequences of length S (ids may be any hashable). Returns (S,)."""
    if not len(segment_attempt_ids) == len(segment_group_ids) == len(segment_rewards):
        raise ValueError("segment_attempt_ids, segment_group_ids and segment_rewards must have one "
                         "length")
    attempt_index, group_index = {}, {}
    attempt_group, attempt_reward = [], []
    for attempt, group, reward in zip(segment_attempt_ids, segment_group_ids,
                                      map(float, segment_rewards)):
        if attempt not in attempt_index:
            attempt_index[attempt] = len(attempt_index)
            attempt_group.append(group_index.setdefault(group, len(group_index)))
            attempt_reward.append(reward)
        else:
            a = attempt_index[attempt]
            if attempt_group[a] != group_index.get(group) or attempt_reward[a] != reward:
                raise ValueError(
                    f"segments of attempt {attempt!r} disagree on group or reward; they must share "
                    "both")
    adv = compute_advantages(torch.tensor(attempt_reward, dtype=torch.float64),
                             torch.tensor(attempt_group),
                             estimator, eps)  # (A,)
    return adv[torch.tensor([attempt_index[a] for a in segment_attempt_ids], dtype=torch.long)]


def distill_token_rewards(student_logprobs, teacher_logprobs):
    """On-policy distillation: per-token advantage log pi_teacher(x_t) - log
    pi_student(x_t) on tokens the student sampled; its expectation is minus the
    reverse KL(student || teacher). Pass student_logprobs = behavior logprobs.
    Returns the same shape (B, T), detached; use it as policy_loss's advantages."""
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"student_logprobs {tuple(student_logprobs.shape)} and teacher_logprobs "
                         f"{tuple(teacher_logprobs.shape)} must have one shape")
    return (teacher_logprobs.float() - student_logprobs.float()).detach()

# -----------------------------------------------------------------------------
# policy loss


@dataclass
class LossConfig:
    """The loss's options; each field is also a config
    key of train.py, of the same name and default."""
    advantage_estimator: str = "grpo"  # grpo | drgrpo | rloo | reinforce | distill
                                       # (per token: distill_token_rewards)
    loss_type: str = "ppo"     # ppo (token ratio) | gspo (sequence ratio exp(mean log r))
    eps_low: float = 0.2       # ratio clipped to [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.28
    # 0 = off, else c > 1: for A < 0 the token loss is capped at -c * A importance
    # correction engine -> trainer: token | sequence | geometric | none
    dual_clip: float = 0.0
    is_level: str = "token"
    is_mode: str = "truncate"  # truncate min(u, is_high) | clip clamp(u,
                               # is_low, is_high) | mask u * 1[lo <= u <= hi]
    is_low: float = 0.5
    is_high: float = 2.0
    max_staleness: int = 1     # tokens sampled more than this many policy versions ago are dropped
    kl_coef: float = 0.0       # k3 KL to the reference policy (needs ref_logprobs)
    mtp_loss_coef: float = 0.0  # the MTP head's cross-entropy of token
                                # t + 2 (train.mtp_loss; trunk detached)
    entropy_coef: float = 0.0  # entropy bonus (needs entropy)

    def __post_init__(self):
        choices = dict(advantage_estimator=ESTIMATORS + ("distill",), loss_type=("ppo", "gspo"),
                       is_level=("token", "sequence", "geometric", "none"),
                       is_mode=("truncate", "clip", "mask"))
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"eps_low={self.eps_low}, eps_high={self.eps_high}: need 0 <= eps_low "
                             "< 1 and eps_high >= 0")
        if self.dual_clip != 0 and not self.dual_clip > 1:
            raise ValueError(f"dual_clip={self.dual_clip}: must be 0 (off) or > 1")
        if not (0 <= self.is_low <= self.is_high and self.is_high > 0):
            raise ValueError(f"is_low={self.is_low}, is_high={self.is_high}: need 0 <= is_low <= "
                             "is_high and is_high > 0")
        if not (isinstance(self.max_staleness, int) and self.max_staleness >= 0):
            raise ValueError(f"max_staleness={self.max_staleness!r}: must be an int >= 0")
        if min(self.kl_coef, self.entropy_coef, self.mtp_loss_coef) < 0:
            raise ValueError(f"kl_coef={self.kl_coef}, entropy_coef={self.entropy_coef}, "
                             "mtp_loss_coef="
                             f"{self.mtp_loss_coef}: must be >= 0")


def _fresh_action_mask(mask, token_versions, policy_version, cfg):
    action = mask.bool()  # (B, T)
    return action, action & ((policy_version - token_versions) <= cfg.max_staleness)


def _importance_weight(old_logprobs, behavior_logprobs, fresh, cfg):
    """Detached weight (B, T) and acceptance (B, T) bool. u is rho_t = exp(old - behavior)
    at level token, exp(sum_t log rho_t) over the row's fresh action tokens at level
    sequence, exp(mean_t log rho_t) at geometric. One row is one sequence (segment)."""
    if cfg.is_level == "none":
        return torch.ones_like(fresh, dtype=torch.float32), torch.ones_like(fresh)
    log_rho = torch.where(fresh, old_logprobs.float() - behavior_logprobs.float(), 0.0)  # (B, T)
    if cfg.is_level == "token":
        log_u = log_rho
    else:
        log_u = log_rho.sum(-1, keepdim=True)  # (B, 1)
        if cfg.is_level == "geometric":
            log_u = log_u / fresh.sum(-1, keepdim=True).clamp(min=1)
        log_u = log_u.expand_as(log_rho)
    u = log_u.exp()  # may be inf for a long sequence; each mode below stays finite
    if cfg.is_mode != "mask":  # truncate: min(u, is_high); clip: clamp(u, is_low, is_high)
        return u.clamp(cfg.is_low if cfg.is_mode == "clip" else None,
                       cfg.is_high), torch.ones_like(fresh)
    # mask: compare in log space so an overflowing u is rejected, not inf * 0
    log_low = math.log(cfg.is_low) if cfg.is_low > 0 else -math.inf
    accepted = (log_u >= log_low) & (log_u <= math.log(cfg.is_high))
    return torch.where(accepted, u, 0.0), accepted


def kept_token_mask(old_logprobs, behavior_logprobs, mask, token_versions, policy_version, cfg):
    """(B, T) bool: action tokens that enter the loss, i.e. not stale and not
    rejected by is_mode='mask'. The trainer counts these over the whole window
    (count_window_tokens) before the first backward; policy_loss uses this same
    definition. old_logprobs may be None unless is_mode='mask' rejects by it."""
    action, fresh = _fresh_action_mask(mask, token_versions, policy_version, cfg)
    if cfg.is_level == "none" or cfg.is_mode != "mask":
        return fresh
    if old_logprobs is None:
        raise ValueError("is_mode='mask' rejects tokens by old_logprobs vs behavior_logprobs, so "
                         "old_logprobs is "
                         "needed before the window is counted: run a no-grad forward over the "
                         "window first")
    return fresh & _importance_weight(old_logprobs, behavior_logprobs, fresh, cfg)[1]


def count_window_tokens(kept_masks, group=None):
    """Kept action tokens in the whole optimizer window: the sum over this rank's
    microbatches, all-reduced (SUM) over `group` (the ranks that hold different data
    of the window; default: all). One collective. Returns an int64 0-dim tensor on
    the masks' device; pass it to every policy_loss call of the window."""
    if len(kept_masks) == 0:
        raise ValueError("count_window_tokens needs the kept masks of this rank's microbatches, "
                         "got none")
    total = sum(m.sum(dtype=torch.int64) for m in kept_masks)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def policy_loss(logprobs, old_logprobs, behavior_logprobs, advantages, mask, token_versions,
                policy_version, cfg, window_tokens, dp_world_size=1, ref_logprobs=None,
                entropy=None):
    """Window-normalized policy loss of one microbatch and its metrics.

    Per-token tensors are (B, T), one row per sequence; advantages (B,) or (B, T). old_logprobs=None
    means one optimizer step per batch (old = logprobs.detach(), r = 1). The per-token loss is
        l_t = w_t * pg_t + kl_coef * k3(ref_t, logp_t) - entropy_coef * H_t
    with w_t the detached importance weight (engine ->
    trainer) and pg_t the PPO / GSPO clipped surrogate, and
        loss = dp_world_size * sum_{kept t} l_t / window_tokens.
    window_tokens counts kept tokens over all microbatches and ranks (count_window_tokens), so
    summing loss over this rank's microbatches and summing over ranks gives sum_W l / |W| exactly,
    however the window is split. train.py sums gradients over ranks (dp_world_size=1); a wrapper
    that averages them (DDP's default) passes its world size here to cancel the 1/world it applies.
    Metrics: a dict of detached 0-dim sums, counts, mins
    and maxes; combine them with reduce_metrics."""
    per_token_inputs = [t for t in (logprobs, old_logprobs, behavior_logprobs, mask, token_versions,
                                    ref_logprobs, entropy) if t is not None]
    if logprobs.dim() != 2 or any(t.shape != logprobs.shape for t in per_token_inputs):
        raise ValueError("logprobs, old_logprobs, behavior_logprobs, mask, token_versions (and "
                         "ref_logprobs, entropy) "
                         f"must all be (B, T), got {[tuple(t.shape) for t in per_token_inputs]}")
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # (B, 1) one advantage per sequence
    B, T = logprobs.shape
    if advantages.dim() != 2 or advantages.shape[0] != B or advantages.shape[1] not in (1, T):
        raise ValueError(f"advantages must be (B,) or (B, T) for logprobs {(B, T)}, got "
                         f"{tuple(advantages.shape)}")
    if cfg.kl_coef and ref_logprobs is None:
        raise ValueError("LossConfig.kl_coef > 0 needs ref_logprobs (the reference policy's token "
                         "logprobs)")
    if cfg.entropy_coef and entropy is None:
        raise ValueError("LossConfig.entropy_coef > 0 needs entropy (token_logprobs(..., "
                         "with_entropy=True))")

    logprobs = logprobs.float()
    old = logprobs.detach() if old_logprobs is None else old_logprobs.detach().float()
    behavior = behavior_logprobs.detach().float()
    adv = advantages.detach().float().expand_as(logprobs)  # (B, T)
    action, fresh = _fresh_action_mask(mask, token_versions, policy_version, cfg)
    is_weight, accepted = _importance_weight(old, behavior, fresh, cfg)
    kept = fresh & accepted  # (B, T) the same set as kept_token_mask

    # where(), not multiplication, everywhere a masked
    # value could be inf or NaN (padding, huge ratios)
    log_ratio = torch.where(kept, logprobs - old, 0.0)  # (B, T)
    if cfg.loss_type == "gspo":  # sequence ratio: exp of the mean log
                                 # ratio over the row's kept tokens
        log_ratio = log_ratio.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(kept, log_ratio.expand_as(kept), 0.0)
    ratio = log_ratio.exp()
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = kept & (pg_clipped > pg_unclipped)
    dual_clipped = torch.zeros_like(kept)
    if cfg.dual_clip:
        pg_dual = -adv * cfg.dual_clip
        dual_clipped = kept & (adv < 0) & (pg > pg_dual)
        pg = torch.where(adv < 0, torch.minimum(pg, pg_dual), pg)
    per_token = is_weight * pg
    if ref_logprobs is not None:  # k3 estimator of KL(pi || pi_ref):
                                  # exp(d) - d - 1 with d = ref - logp
        d = torch.where(kept, ref_logprobs.detach().float() - logprobs, 0.0)
        kl_ref = d.exp() - d - 1
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl_ref
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy.float()
    loss_sum = torch.where(kept, per_token, 0.0).sum()
    # clamp: window_tokens is 0 when every token was rejected
    loss = loss_sum * (dp_world_size / torch.as_tensor(window_tokens,
                                                       device=loss_sum.device).float().clamp(min=1))

    with torch.no_grad():
        def total(x, where):
            return torch.where(where, x, 0.0).sum(dtype=torch.float64)
        d_mis = torch.where(fresh, old - behavior, 0.0)  # log rho
        # sampled with the weights the trainer holds now
        current = fresh & (token_versions == policy_version)
        k3 = d_mis.exp() - 1 - d_mis  # per-token KL(engine || trainer) estimate, >= 0
        metrics = dict(
            action_tokens=action.sum(dtype=torch.float64),
            kept_tokens=kept.sum(dtype=torch.float64), fresh_tokens=fresh.sum(dtype=torch.float64),
            stale_tokens=(action & ~fresh).sum(dtype=torch.float64),
            current_tokens=current.sum(dtype=torch.float64),
            is_masked_tokens=(fresh & ~accepted).sum(dtype=torch.float64),
            clipped_tokens=clipped.sum(dtype=torch.float64),
            dual_clipped_tokens=dual_clipped.sum(dtype=torch.float64),
            # KL(engine || trainer) over fresh action tokens
            # sampled by the engine: k3 = rho - 1 - log rho >= 0
            mismatch_kl_sum=total(k3, fresh),
            # the same over tokens the engine sampled with the
            # trainer's current weights: numerics alone, no policy lag
            mismatch_kl_current_sum=total(k3, current),
            mismatch_k1_sum=total(-d_mis, fresh),  # mean(behavior - old), the plain estimator
            is_weight_sum=total(is_weight, kept), ratio_sum=total(ratio, kept),
            loss_sum=loss_sum.detach().double(),
            advantage_sum=total(adv, kept), advantage_sq_sum=total(adv.double() ** 2, kept),
            # inf when nothing is kept
            advantage_min=torch.where(kept, adv, math.inf).min().double(),
            advantage_max=torch.where(kept, adv, -math.inf).max().double(),
        )
        if entropy is not None:
            metrics["entropy_sum"] = total(entropy.float(), kept)
        if ref_logprobs is not None:
            metrics["kl_ref_sum"] = total(kl_ref, kept)
    return loss, metrics


def sft_loss(logprobs, mask, window_tokens, dp_world_size=1):
    """Supervised next-token loss of one microbatch, window-normalized like policy_loss:
        loss = dp_world_size * sum_t m_t * (-logp_t) / window_tokens
    logprobs (B, T) the trainer's logprob of each target, mask (B, T) 1 on the
    tokens to learn (a transcript's assistant turns), window_tokens the mask's
    sum over the whole window (count_window_tokens). Summed over the window's
    microbatches and ranks it is the mean NLL of the window's assistant tokens.
    Metrics as policy_loss's, for reduce_metrics (loss: that mean NLL)."""
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs and mask must both be (B, T), got {tuple(logprobs.shape)} and "
                         f"{tuple(mask.shape)}")
    kept = mask.bool()
    # where(): padding may hold any logprob
    loss_sum = torch.where(kept, -logprobs.float(), 0.0).sum()
    loss = loss_sum * (dp_world_size / torch.as_tensor(window_tokens,
                                                       device=loss_sum.device).float().clamp(min=1))
    tokens = kept.sum(dtype=torch.float64)
    return loss, dict(action_tokens=tokens, kept_tokens=tokens, loss_sum=loss_sum.detach().double())


def reduce_metrics(metrics_list, group=None):
    """Combine policy_loss metrics of this rank's microbatches and all-reduce them over
    `group` (three collectives, one host sync). Returns floats: token counts, fractions of
    action tokens, and means over kept tokens (over fresh ones for mismatch_kl, which
    includes the policy lag of off-policy tokens; over those sampled with the current weights
    for mismatch_kl_current, the engine-vs-trainer numerical gap: None without any)."""
    keys = sorted(metrics_list[0])
    mins = [k for k in keys if k.endswith("_min")]
    maxes = [k for k in keys if k.endswith("_max")]
    sums = [k for k in keys if k not in mins and k not in maxes]
    stacked = {k: torch.stack([m[k] for m in metrics_list]) for k in keys}
    like = stacked[keys[0]]
    # sft_loss's metrics have no mins or maxes
    reduced = [torch.stack(xs) if xs else like.new_zeros(0) for xs in
               ([stacked[k].sum() for k in sums], [stacked[k].min() for k in mins],
                [stacked[k].max() for k in maxes])]
    if dist.is_available() and dist.is_initialized():
        for tensor, op in zip(reduced, (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX)):
            if tensor.numel():
                dist.all_reduce(tensor, op=op, group=group)
    # the one device-to-host sync
    values = dict(zip(sums + mins + maxes, torch.cat(reduced).tolist()))
    kept = max(values["kept_tokens"], 1.0)
    out = dict(action_tokens=values["action_tokens"], kept_tokens=values["kept_tokens"],
               loss=values["loss_sum"] / kept)  # equals the window loss: window_tokens
                                                # = kept tokens of the window
    if "fresh_tokens" not in values:  # sft_loss's: token counts and the mean NLL
        return out
    action, fresh = (max(values[k], 1.0) for k in ("action_tokens", "fresh_tokens"))
    adv_mean = values["advantage_sum"] / kept
    out.update(stale_frac=values["stale_tokens"] / action,
               is_masked_frac=values["is_masked_tokens"] / action,
               clip_frac=values["clipped_tokens"] / kept,
               dual_clip_frac=values["dual_clipped_tokens"] / kept,
               mismatch_kl=values["mismatch_kl_sum"] / fresh,
               mismatch_k1=values["mismatch_k1_sum"] / fresh,
               mismatch_kl_current=(values["mismatch_kl_current_sum"] / values["current_tokens"]
                                    if values["current_tokens"] else None),
               is_weight_mean=values["is_weight_sum"] / kept, ratio_mean=values["ratio_sum"] / kept,
               advantage_mean=adv_mean,
               advantage_std=max(values["advantage_sq_sum"] / kept - adv_mean ** 2, 0.0) ** 0.5,
               advantage_min=values["advantage_min"], advantage_max=values["advantage_max"])
    out.update({k.removesuffix("_sum"): values[k] / kept for k in ("entropy_sum", "kl_ref_sum")
                if k in values})
    if "mtp_loss_sum" in values:  # each microbatch's share is already divided
                                  # by the window's count (train.mtp_loss)
        out["mtp_loss"] = values["mtp_loss_sum"]
    return out
