"""Chunked token logprobs, advantage estimators, the policy loss with importance correction and staleness, metrics,
and window normalization in one process (across real gloo ranks: tests/test_loss_dist.py).

    .venv/bin/python -m pytest tests/test_loss.py -q
"""
import math

import pytest
import torch

from loss import (LossConfig, compute_advantages, count_window_tokens, distill_token_rewards, kept_token_mask,
                  naive_token_logprobs, policy_loss, reduce_metrics, segment_advantages, sft_loss, token_logprobs,
                  _ChunkedTokenLogprobs)

# -----------------------------------------------------------------------------
# token logprobs


@pytest.fixture(params=["inplace", "fused"])
def logprob_path(request, monkeypatch):
    """Both chunk paths on CPU: the eager in-place one, and the fused one that CUDA compiles (run here eagerly)."""
    import loss
    monkeypatch.setattr(loss, "FUSED_DEVICES", ("cuda", "cpu") if request.param == "fused" else ("cuda",))
    return request.param


@pytest.mark.parametrize("chunk_size", [1, 5, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_naive_values_and_grads(chunk_size, temperature, logprob_path):
    torch.manual_seed(0)
    B, T, D, V = 3, 17, 16, 97
    hidden = torch.randn(B, T, D)
    weight = torch.randn(V, D) / D ** 0.5 * 3
    targets = torch.randint(0, V, (B, T))
    up_lp, up_ent = torch.randn(B, T), torch.randn(B, T)  # arbitrary upstream gradients
    results = []
    for fn in (token_logprobs, naive_token_logprobs):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(h, w, targets, temperature=temperature, chunk_size=chunk_size, with_entropy=True)
        ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for got, want in zip(*results):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # without entropy: same logprobs, and gradients of the logprobs alone
    h = hidden.clone().requires_grad_()
    lp, ent = token_logprobs(h, weight, targets, temperature=temperature, chunk_size=chunk_size)
    assert ent is None and lp.dtype == torch.float32
    (lp * up_lp).sum().backward()
    h_ref = hidden.clone().requires_grad_()
    (naive_token_logprobs(h_ref, weight, targets, temperature)[0] * up_lp).sum().backward()
    torch.testing.assert_close(lp.detach(), results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_kept_logits_give_the_same_values_and_grads(with_entropy, logprob_path):
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 9, 8).bfloat16(), (torch.randn(50, 8) / 3).bfloat16()
    targets, up = torch.randint(0, 50, (2, 9)), torch.randn(2, 9)
    results = []
    for keep in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = token_logprobs(h, w, targets, 0.7, chunk_size=4, with_entropy=with_entropy, keep_logits=keep)
        ((lp * up).sum() + (ent.sum() if with_entropy else 0)).backward()
        results.append((lp, h.grad, w.grad))
    for got, want in zip(*results):  # kept logits are bit-identical to recomputed ones
        assert torch.equal(got, want)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_backward_passes_gradcheck(with_entropy, logprob_path):
    torch.manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    for keep in (False, True):
        assert torch.autograd.gradcheck(
            lambda h, w: _ChunkedTokenLogprobs.apply(h, w, targets, 0.7, 3, with_entropy, keep), (hidden, weight))


def test_chunked_bf16_matches_naive_bf16(logprob_path):
    torch.manual_seed(0)
    hidden = torch.randn(40, 32).bfloat16().requires_grad_()
    weight = (torch.randn(300, 32) / 4).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (40,))
    lp, ent = token_logprobs(hidden, weight, targets, 0.8, chunk_size=16, with_entropy=True)
    lp_ref, ent_ref = naive_token_logprobs(hidden, weight, targets, 0.8, with_entropy=True)
    assert lp.dtype == torch.float32  # logits rounded to bf16 like the engine's lm_head, then fp32
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    grad_w = weight.grad.clone()
    weight.grad = None
    lp_ref.sum().backward()
    assert grad_w.dtype == torch.bfloat16
    torch.testing.assert_close(grad_w.float(), weight.grad.float(), rtol=2e-2, atol=2e-2)


def test_chunked_memory_does_not_grow_with_full_logits():
    from bench import _peak_extra_bytes  # the allocation tracker bench.py logprobs uses, on fake tensors
    V, D, C = 32000, 64, 256
    naive = _peak_extra_bytes(naive_token_logprobs, 4096, V, D, C, True, fake=True)[0]
    chunked = _peak_extra_bytes(token_logprobs, 4096, V, D, C, True, fake=True)[0]
    chunked_long = _peak_extra_bytes(token_logprobs, 16384, V, D, C, True, fake=True)[0]
    chunk_bytes = C * V * 4
    assert naive >= 3 * 4096 * V * 4  # full logits, log-softmax and their gradient
    assert chunked <= 3 * chunk_bytes and chunked <= naive / 4
    assert chunked_long - chunked < chunk_bytes / 4  # 4x the tokens adds only O(T * D) bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_peak_memory_on_gpu():
    T, V, D = 8192, 151936, 256  # naive holds several 5 GB (T, V) fp32 tensors at once
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, D, device="cuda", generator=gen) / D ** 0.5
    weight = torch.randn(V, D, device="cuda", generator=gen)
    targets = torch.randint(0, V, (T,), device="cuda", generator=gen)

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp, ent = fn(h, w, targets, 1.0, 1024, True)
        (lp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, (lp.detach(), ent.detach(), h.grad, w.grad)

    naive_bytes, want = run(naive_token_logprobs)
    chunked_bytes, got = run(token_logprobs)
    assert chunked_bytes <= naive_bytes / 4
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_logprob_input_errors():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, t, temperature=0.0)
    with pytest.raises(ValueError, match="lm_head_weight"):
        token_logprobs(h, torch.randn(10, 7), t)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(h, w, t.float())
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(h, w, t, chunk_size=0)

# -----------------------------------------------------------------------------
# advantages


REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0]
GROUPS = [7, 7, 7, 7, 3, 3, 9]  # a group of 4, an all-equal group of 2, a group of 1


@pytest.mark.parametrize("estimator,expected", [
    ("grpo", [0.5 / (math.sqrt(1 / 3) + 1e-6), -0.5 / (math.sqrt(1 / 3) + 1e-6),
              -0.5 / (math.sqrt(1 / 3) + 1e-6), 0.5 / (math.sqrt(1 / 3) + 1e-6), 0, 0, 0]),
    ("drgrpo", [0.5, -0.5, -0.5, 0.5, 0, 0, 0]),
    ("rloo", [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0, 0, 0]),
    ("reinforce", [r - 11 / 7 for r in REWARDS]),
])
def test_advantage_estimators_by_hand(estimator, expected):
    adv = compute_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), estimator)
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce"])
def test_all_equal_and_single_attempt_groups_give_exact_zero(estimator):
    adv = compute_advantages(torch.tensor([0.1, 0.1, 0.1, 0.7]), torch.tensor([0, 0, 0, 1]), estimator)
    if estimator == "reinforce":  # batch baseline: the groups do not matter, the batch is not all equal
        torch.testing.assert_close(adv, torch.tensor([-0.15, -0.15, -0.15, 0.45]))
    else:
        assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert compute_advantages(torch.tensor([0.3]), torch.tensor([0]), estimator).tolist() == [0.0]


def test_split_attempt_counts_once_in_its_group():
    # attempt "a" was split into 3 segments (a compaction rewrote its history twice); "b" is one segment
    seg_attempts, seg_groups, seg_rewards = ["a", "a", "b", "a"], ["g", "g", "g", "g"], [1.0, 1.0, 0.0, 1.0]
    adv = segment_advantages(seg_attempts, seg_groups, seg_rewards, "grpo")
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # attempts (1, 0): mean 0.5, std sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([a, a, -a, a]))
    per_segment = compute_advantages(torch.tensor(seg_rewards), torch.zeros(4, dtype=torch.long), "grpo")
    assert not torch.allclose(per_segment, adv)  # counting segments would weigh "a" three times
    with pytest.raises(ValueError, match="disagree"):
        segment_advantages(["a", "a"], ["g", "g"], [1.0, 0.0], "grpo")


def test_advantage_errors():
    with pytest.raises(ValueError, match="distill_token_rewards"):
        compute_advantages(torch.tensor([1.0]), torch.tensor([0]), "distill")
    with pytest.raises(ValueError, match="finite"):
        compute_advantages(torch.tensor([1.0, math.nan]), torch.tensor([0, 0]), "grpo")
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0]), "grpo")


def test_distill_token_rewards_are_teacher_minus_student():
    student = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    teacher = torch.tensor([[-0.2, -0.5, -3.0]])
    adv = distill_token_rewards(student, teacher)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.0, -1.0]]))
    assert not adv.requires_grad

# -----------------------------------------------------------------------------
# policy loss: importance correction, staleness, surrogates


L3, L025, L15, L08 = math.log(3), math.log(0.25), math.log(1.5), math.log(0.8)
G0, G1 = 0.75 ** (1 / 3), 1.2 ** 0.5  # geometric means of rho per row
# (level, mode, is_low, is_high, expected weight per token with None = rejected); A = (+1, -2), rho = exp(LOG_RHO)
IS_CASES = [
    ("token", "truncate", 0.5, 2.0, [[2, 0.25, 1], [1.5, 0.8]]),
    ("token", "clip", 0.5, 2.0, [[2, 0.5, 1], [1.5, 0.8]]),
    ("token", "mask", 0.5, 2.0, [[None, None, 1], [1.5, 0.8]]),
    ("sequence", "truncate", 0.8, 2.0, [[0.75] * 3, [1.2] * 2]),
    ("sequence", "clip", 0.8, 2.0, [[0.8] * 3, [1.2] * 2]),
    ("sequence", "mask", 0.8, 2.0, [[None] * 3, [1.2] * 2]),
    ("geometric", "truncate", 0.8, 1.05, [[G0] * 3, [1.05] * 2]),
    ("geometric", "clip", 0.95, 1.05, [[0.95] * 3, [1.05] * 2]),
    ("geometric", "mask", 0.8, 1.05, [[G0] * 3, [None] * 2]),
    ("none", "mask", 0.8, 1.05, [[1] * 3, [1] * 2]),
]


def is_example():
    """Two sequences, the second padded; logprobs = old so r = 1 and each token's loss is -A * w."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, math.nan]])  # NaN in padding must not leak
    log_rho = torch.tensor([[L3, L025, 0.0], [L15, L08, 0.0]])
    behavior = old - log_rho
    logprobs = torch.where(mask.bool(), old, 0.0).requires_grad_()
    return logprobs, old, behavior, torch.tensor([1.0, -2.0]), mask, torch.full((2, 3), 5)


@pytest.mark.parametrize("level,mode,low,high,weights", IS_CASES, ids=[f"{c[0]}-{c[1]}" for c in IS_CASES])
def test_importance_correction_by_hand(level, mode, low, high, weights):
    cfg = LossConfig(is_level=level, is_mode=mode, is_low=low, is_high=high)
    logprobs, old, behavior, adv, mask, versions = is_example()
    kept = kept_token_mask(old, behavior, mask, versions, 5, cfg)
    window_tokens = count_window_tokens([kept])
    n_kept = sum(w is not None for row in weights for w in row)
    assert int(window_tokens) == n_kept
    loss, metrics = policy_loss(logprobs, old, behavior, adv, mask, versions, 5, cfg, window_tokens)
    expected = sum(-a * w for a, row in zip([1.0, -2.0], weights) for w in row if w is not None) / n_kept
    assert abs(loss.item() - expected) < 1e-6
    loss.backward()
    expected_grad = torch.zeros(2, 3)
    for b, (a, row) in enumerate(zip([1.0, -2.0], weights)):
        for t, w in enumerate(row):
            expected_grad[b, t] = 0.0 if w is None else -a * w / n_kept  # d r / d logp = r = 1
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=0, atol=1e-6)
    assert metrics["is_masked_tokens"].item() == 5 - n_kept and metrics["kept_tokens"].item() == n_kept


def test_stale_tokens_leave_numerator_and_denominator():
    logprobs, old, behavior, adv, mask, _ = is_example()
    versions = torch.tensor([[5, 4, 3], [5, 5, 0]])  # (0, 2) is 2 versions old; (1, 2) is padding
    cfg = LossConfig(is_level="none", max_staleness=1)
    window_tokens = count_window_tokens([kept_token_mask(old, behavior, mask, versions, 5, cfg)])
    loss, metrics = policy_loss(logprobs, old, behavior, adv, mask, versions, 5, cfg, window_tokens)
    assert abs(loss.item() - (-1 - 1 + 2 + 2) / 4) < 1e-6
    assert metrics["stale_tokens"].item() == 1 and metrics["action_tokens"].item() == 5
    cfg = LossConfig(is_level="none", max_staleness=2)
    loss, _ = policy_loss(logprobs, old, behavior, adv, mask, versions, 5, cfg, 5)
    assert abs(loss.item() - (-3 + 4) / 5) < 1e-6


@pytest.mark.parametrize("dual_clip", [0.0, 3.0])
def test_ppo_clip_and_dual_clip_by_hand(dual_clip):
    r = torch.tensor([1.5, 0.5, 1.1, 4.0])
    old = torch.tensor([[-1.0, -2.0, -0.7, -3.0], [-0.5, -1.5, -2.5, -1.0]])
    logprobs = (old + r.log()).requires_grad_()  # r = exp(logp - old) for both rows
    adv, mask, versions = torch.tensor([1.0, -1.0]), torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.long)
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=dual_clip)
    loss, metrics = policy_loss(logprobs, old, old, adv, mask, versions, 0, cfg, window_tokens=8)
    # A = +1: -min(r, clip(r)) = [-1.28, -0.5, -1.1, -1.28];  A = -1: max(r, clip(r)) = [1.5, 0.8, 1.1, 4.0]
    # dual clip c = 3 caps A < 0 tokens at -c * A = 3
    row1 = [1.5, 0.8, 1.1, 3.0 if dual_clip else 4.0]
    assert abs(loss.item() - (-1.28 - 0.5 - 1.1 - 1.28 + sum(row1)) / 8) < 1e-6
    loss.backward()  # unclipped tokens: d(-A r)/d logp = -A r; clipped ones: 0
    expected = torch.tensor([[0, -0.5, -1.1, 0], [1.5, 0, 1.1, 0 if dual_clip else 4.0]]) / 8
    torch.testing.assert_close(logprobs.grad, expected, rtol=0, atol=1e-6)
    assert metrics["clipped_tokens"].item() == 3
    assert metrics["dual_clipped_tokens"].item() == (1 if dual_clip else 0)


def test_gspo_sequence_ratio_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]])
    log_r = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(2.0), math.log(1.2), 5.0]])
    logprobs = (old + log_r).requires_grad_()  # the 5.0 is padding and must not count
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    cfg = LossConfig(loss_type="gspo", eps_low=0.05, eps_high=0.05)
    loss, metrics = policy_loss(logprobs, old, old, torch.tensor([1.0, 1.0]), mask, torch.zeros(2, 3), 0, cfg, 5)
    s0 = 0.75 ** (1 / 3)  # exp(mean log r) = 0.9086, inside [0.95, 1.05]'s unclipped side for A > 0
    # row 1: s = sqrt(2.4) = 1.549 > 1.05, clipped to 1.05
    assert abs(loss.item() - (3 * -s0 + 2 * -1.05) / 5) < 1e-6
    loss.backward()  # d s0 / d logp_t = s0 / 3 for each of the 3 tokens, summed over 3 tokens, / 5
    expected = torch.tensor([[-s0 / 5] * 3, [0.0, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected, rtol=0, atol=1e-6)
    assert metrics["clipped_tokens"].item() == 2


def test_kl_to_reference_and_entropy_terms_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logprobs = old.clone().requires_grad_()
    d = torch.tensor([[math.log(2), 0.0, -math.log(2)]])  # ref - logp
    entropy = torch.tensor([[1.0, 2.0, 0.5]], requires_grad=True)
    cfg = LossConfig(is_level="none", kl_coef=0.1, entropy_coef=0.01)
    loss, metrics = policy_loss(logprobs, old, old, torch.tensor([0.5]), torch.ones(1, 3), torch.zeros(1, 3), 0,
                                cfg, 3, ref_logprobs=old + d, entropy=entropy)
    k3 = [2 - math.log(2) - 1, 0.0, 0.5 + math.log(2) - 1]
    expected = sum(-0.5 + 0.1 * k - 0.01 * h for k, h in zip(k3, [1.0, 2.0, 0.5])) / 3
    assert abs(loss.item() - expected) < 1e-6
    loss.backward()  # d k3 / d logp = 1 - exp(d)
    torch.testing.assert_close(logprobs.grad, ((-0.5 + 0.1 * (1 - d.exp())) / 3), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy.grad, torch.full((1, 3), -0.01 / 3), rtol=0, atol=1e-7)
    assert abs(metrics["kl_ref_sum"].item() - sum(k3)) < 1e-6


def test_metrics_by_hand_and_across_microbatches():
    logprobs, old, behavior, adv, mask, versions = is_example()
    cfg = LossConfig(is_level="token", is_mode="mask", is_low=0.5, is_high=2.0)
    _, whole = policy_loss(logprobs, old, behavior, adv, mask, versions, 5, cfg, 3)
    parts = [policy_loss(logprobs[i:i + 1], old[i:i + 1], behavior[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                         versions[i:i + 1], 5, cfg, 3)[1] for i in range(2)]
    summary = reduce_metrics([whole])
    assert summary == pytest.approx(reduce_metrics(parts))
    rho = [3, 0.25, 1, 1.5, 0.8]
    assert summary["mismatch_kl"] == pytest.approx(sum(p - 1 - math.log(p) for p in rho) / 5)  # k3 ~ 0.3311
    assert summary["mismatch_k1"] == pytest.approx(-math.log(0.9) / 5)
    assert summary["is_masked_frac"] == pytest.approx(2 / 5) and summary["stale_frac"] == 0
    assert summary["kept_tokens"] == 3 and summary["action_tokens"] == 5
    assert summary["loss"] == pytest.approx((-1 + 2 * 1.5 + 2 * 0.8) / 3)
    assert summary["mismatch_kl_current"] == pytest.approx(summary["mismatch_kl"])  # all sampled by version 5
    # tokens of version 4 (fresh at max_staleness=1) leave mismatch_kl_current: rho 3, 1 and 0.8 remain
    lagged = torch.tensor([[5, 4, 5], [4, 5, -1]])
    summary = reduce_metrics([policy_loss(logprobs, old, behavior, adv, mask, lagged, 5, cfg, 3)[1]])
    assert summary["mismatch_kl"] == pytest.approx(sum(p - 1 - math.log(p) for p in rho) / 5)
    assert summary["mismatch_kl_current"] == pytest.approx(sum(p - 1 - math.log(p) for p in (3, 1, 0.8)) / 3)
    older = torch.full((2, 3), 4)
    assert reduce_metrics([policy_loss(logprobs, old, behavior, adv, mask, older, 5, cfg, 3)[1]])[
        "mismatch_kl_current"] is None
    kept_adv = [1.0, -2.0, -2.0]  # advantage stats over kept tokens
    assert summary["advantage_mean"] == pytest.approx(-1.0)
    assert summary["advantage_std"] == pytest.approx(math.sqrt(sum(a * a for a in kept_adv) / 3 - 1.0))
    assert (summary["advantage_min"], summary["advantage_max"]) == (-2.0, 1.0)
    assert summary["is_weight_mean"] == pytest.approx((1 + 1.5 + 0.8) / 3)


def test_window_normalization_in_one_process():
    """Microbatches of unequal length give the loss and gradients of one batch holding the whole window."""
    torch.manual_seed(0)
    lengths = [3, 7, 2, 5, 6]
    weight = torch.randn(5, 4)
    rows = [dict(h=torch.randn(n, 4), t=torch.randint(0, 5, (n,)), adv=torch.randn(()), noise=0.3 * torch.randn(n))
            for n in lengths]
    cfg = LossConfig(is_level="token", is_mode="mask", is_low=0.8, is_high=1.25)

    def run(groups):  # groups: lists of row indices, each one microbatch padded to its longest row
        w = weight.clone().requires_grad_()
        batches = []
        for idx in groups:
            T = max(lengths[i] for i in idx)
            h, t = torch.zeros(len(idx), T, 4), torch.zeros(len(idx), T, dtype=torch.long)
            behavior_noise, mask = torch.zeros(len(idx), T), torch.zeros(len(idx), T)
            for b, i in enumerate(idx):
                n = lengths[i]
                h[b, :n], t[b, :n], behavior_noise[b, :n], mask[b, :n] = rows[i]["h"], rows[i]["t"], rows[i]["noise"], 1
            with torch.no_grad():
                old = token_logprobs(h, w, t)[0]
            batches.append((h, t, old, old + behavior_noise, torch.stack([rows[i]["adv"] for i in idx]), mask))
        versions = lambda m: torch.zeros_like(m, dtype=torch.long)  # noqa: E731
        kept = [kept_token_mask(old, beh, m, versions(m), 0, cfg) for _, _, old, beh, _, m in batches]
        window_tokens = count_window_tokens(kept)
        total, naive = 0.0, 0.0
        for (h, t, old, beh, adv, m), k in zip(batches, kept):
            lp = token_logprobs(h, w, t, chunk_size=4)[0]
            loss, _ = policy_loss(lp * 1.01, old, beh, adv, m, versions(m), 0, cfg, window_tokens)  # r != 1
            loss.backward()
            total += loss.item()
            mean_loss, _ = policy_loss(lp.detach() * 1.01, old, beh, adv, m, versions(m), 0, cfg, k.sum())
            naive += mean_loss.item() / len(groups)
        return total, w.grad, naive

    loss_one, grad_one, _ = run([[0, 1, 2, 3, 4]])
    loss_split, grad_split, naive_split = run([[0], [1, 2], [3, 4]])
    assert abs(loss_one - loss_split) <= 1e-6
    torch.testing.assert_close(grad_one, grad_split, rtol=0, atol=1e-6)
    assert abs(naive_split - loss_one) > 1e-3  # a mean per microbatch weighs tokens unequally


def test_nothing_kept_gives_zero_loss_not_nan():
    logprobs, old, behavior, adv, mask, versions = is_example()
    cfg = LossConfig(is_level="sequence", is_mode="mask", is_low=1.9, is_high=2.0)  # rejects both rows
    kept = kept_token_mask(old, behavior, mask, versions, 5, cfg)
    loss, metrics = policy_loss(logprobs, old, behavior, adv, mask, versions, 5, cfg, count_window_tokens([kept]))
    loss.backward()
    assert loss.item() == 0 and torch.all(logprobs.grad == 0) and not kept.any()
    assert math.isinf(reduce_metrics([metrics])["advantage_min"])


def test_policy_loss_input_errors():
    logprobs, old, behavior, adv, mask, versions = is_example()
    with pytest.raises(ValueError, match="is_mode"):
        LossConfig(is_mode="reject")
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="old_logprobs"):
        kept_token_mask(None, behavior, mask, versions, 5, LossConfig(is_mode="mask"))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        policy_loss(logprobs, old[:, :2], behavior, adv, mask, versions, 5, LossConfig(), 5)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logprobs, old, behavior, torch.ones(3), mask, versions, 5, LossConfig(), 5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, behavior, adv, mask, versions, 5, LossConfig(kl_coef=0.1), 5)


# -----------------------------------------------------------------------------
# the supervised objective


def test_sft_loss_is_the_mean_next_token_nll_of_assistant_tokens_over_the_window():
    """Two microbatches of different shapes (padding, prompt tokens, several assistant turns): the window-normalized
    losses and their gradients add up to cross-entropy averaged over the window's assistant tokens alone."""
    torch.manual_seed(0)
    D, V = 8, 31
    weight = torch.randn(V, D, requires_grad=True)
    hidden = [torch.randn(2, 7, D), torch.randn(3, 4, D)]
    targets = [torch.randint(0, V, (2, 7)), torch.randint(0, V, (3, 4))]
    masks = [torch.tensor([[0, 0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 0, 0, 0]]),  # row 2: padding after 3 tokens
             torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]])]     # a row with nothing to learn
    window_tokens = count_window_tokens([m.bool() for m in masks])
    assert window_tokens == 11
    total, metrics = 0.0, []
    for h, t, m in zip(hidden, targets, masks):
        logprobs, _ = token_logprobs(h, weight, t, chunk_size=3)
        mb_loss, mb_metrics = sft_loss(logprobs, m, window_tokens)
        mb_loss.backward()
        total += mb_loss.item()
        metrics.append(mb_metrics)
    grad = weight.grad.clone()
    weight.grad = None
    picked_hidden = torch.cat([h[m.bool()] for h, m in zip(hidden, masks)])  # (11, D)
    picked_targets = torch.cat([t[m.bool()] for t, m in zip(targets, masks)])
    reference = torch.nn.functional.cross_entropy(picked_hidden @ weight.T, picked_targets)
    reference.backward()
    assert total == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(grad, weight.grad, rtol=1e-5, atol=1e-6)
    summary = reduce_metrics(metrics)
    assert summary["loss"] == pytest.approx(reference.item(), rel=1e-6) and summary["kept_tokens"] == 11
    # padding may hold any logprob, even -inf: it neither enters the loss nor poisons the gradient
    logprobs = torch.tensor([[-1.0, -float("inf")]], requires_grad=True)
    loss, _ = sft_loss(logprobs, torch.tensor([[1, 0]]), 1)
    loss.backward()
    assert loss.item() == 1.0 and logprobs.grad.tolist() == [[-1.0, 0.0]]
    with pytest.raises(ValueError, match="must both be"):
        sft_loss(torch.zeros(2, 3), torch.zeros(2, 4), 1)
