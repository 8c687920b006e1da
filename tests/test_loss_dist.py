"""Window normalization across real gloo ranks: one optimizer window split as 1 rank x 4 microbatches, 2 x 2 and
4 x 1 (microbatches of unequal shapes) gives the same loss and gradients under DDP/FSDP-style gradient averaging;
a per-microbatch mean, or a per-rank denominator, does not.

    .venv/bin/python -m pytest tests/test_loss_dist.py -q
"""

import pytest
import torch
import torch.distributed as dist

from conftest import end_rank, spawn_ranks
from weights_sync import free_port
from loss import LossConfig, count_window_tokens, kept_token_mask, policy_loss, reduce_metrics, token_logprobs

pytestmark = pytest.mark.stack  # four rank processes
D, V = 8, 32
POLICY_VERSION = 5
MICROBATCH_SHAPES = [(2, 5), (3, 9), (1, 13), (2, 6)]  # (B, T): the window's 4 microbatches
CFG = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, is_level="token", is_mode="mask", is_low=0.6,
                 is_high=1.6, max_staleness=1, kl_coef=0.05, entropy_coef=0.01)


def build_model():
    torch.manual_seed(0)
    trunk = torch.nn.Linear(D, D)  # stands in for the transformer body
    lm_head = torch.nn.Linear(D, V, bias=False)
    return trunk, lm_head


def forward(trunk, lm_head, mb):
    hidden = torch.tanh(trunk(mb["x"]))  # (B, T, D)
    return token_logprobs(hidden, lm_head.weight, mb["targets"], temperature=0.9, chunk_size=7, with_entropy=True)


def make_window(trunk, lm_head):
    """The whole window, the same on every rank: old logprobs from a no-grad pass (as the trainer does before
    counting), behavior = old + engine mismatch noise, reference = old + drift, some tokens stale."""
    g = torch.Generator().manual_seed(1)
    window = []
    for B, T in MICROBATCH_SHAPES:
        pos = torch.arange(T)
        prompt_len = torch.randint(1, 3, (B, 1), generator=g)
        length = torch.randint(T // 2 + 1, T + 1, (B, 1), generator=g)  # right padding after length
        mb = dict(x=torch.randn(B, T, D, generator=g), targets=torch.randint(0, V, (B, T), generator=g),
                  mask=((pos >= prompt_len) & (pos < length)).float(), advantages=torch.randn(B, generator=g),
                  token_versions=torch.randint(POLICY_VERSION - 2, POLICY_VERSION + 1, (B, T), generator=g))
        with torch.no_grad():
            current = forward(trunk, lm_head, mb)[0]
        mb["old"] = current + 0.2 * torch.randn(B, T, generator=g)  # the step's policy differs from this forward
        mb["behavior"] = mb["old"] + 0.4 * torch.randn(B, T, generator=g)  # some beyond [is_low, is_high]
        mb["ref"] = mb["old"] + 0.3 * torch.randn(B, T, generator=g)
        window.append(mb)
    return window


def microbatch_loss(trunk, lm_head, mb, window_tokens, dp_world_size):
    logprobs, entropy = forward(trunk, lm_head, mb)
    return policy_loss(logprobs, mb["old"], mb["behavior"], mb["advantages"], mb["mask"], mb["token_versions"],
                       POLICY_VERSION, CFG, window_tokens, dp_world_size, ref_logprobs=mb["ref"], entropy=entropy)


def train_window(rank, world, group):
    """What each rank of a `world`-rank split does for one optimizer window: count, then backward per microbatch,
    then average gradients over ranks the way FSDP/DDP do (all_reduce SUM / world)."""
    trunk, lm_head = build_model()
    window = make_window(trunk, lm_head)
    per_rank = len(window) // world
    mine = window[rank * per_rank:(rank + 1) * per_rank]
    kept = [kept_token_mask(mb["old"], mb["behavior"], mb["mask"], mb["token_versions"], POLICY_VERSION, CFG)
            for mb in mine]
    window_tokens = count_window_tokens(kept, group=group)  # before the first backward
    loss, metrics = torch.zeros(()), []
    for mb in mine:
        mb_loss, mb_metrics = microbatch_loss(trunk, lm_head, mb, window_tokens, dp_world_size=world)
        mb_loss.backward()
        loss += mb_loss.detach()
        metrics.append(mb_metrics)
    grads = torch.cat([p.grad.flatten() for p in (*trunk.parameters(), *lm_head.parameters())])
    dist.all_reduce(grads, group=group)
    dist.all_reduce(loss, group=group)
    return dict(loss=loss / world, grads=grads / world, window_tokens=int(window_tokens),
                metrics=reduce_metrics(metrics, group=group))


def worker(rank, port, out_prefix):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    results = {}
    for world in (1, 2, 4):
        group = dist.new_group(list(range(world)))  # every rank takes part in creating every group
        if rank < world:
            results[world] = train_window(rank, world, group)
    dist.barrier()
    torch.save(results, f"{out_prefix}.{rank}")
    dist.destroy_process_group()
    end_rank()


def test_window_split_over_ranks_and_microbatches_gives_same_loss_and_grads(tmp_path):
    spawn_ranks(worker, (free_port(), str(tmp_path / "result")), 4)
    results = [torch.load(tmp_path / f"result.{rank}") for rank in range(4)]
    reference = results[0][1]  # 1 rank x 4 microbatches
    for world in (1, 2, 4):
        for rank in range(world):
            got = results[rank][world]
            assert abs(got["loss"].item() - reference["loss"].item()) <= 1e-6, (world, rank)
            assert (got["grads"] - reference["grads"]).abs().max().item() <= 1e-6, (world, rank)
            assert got["window_tokens"] == reference["window_tokens"]
            assert got["metrics"] == reference["metrics"] if world == 1 else \
                all(abs(got["metrics"][k] - v) <= 1e-6 * max(1, abs(v)) for k, v in reference["metrics"].items())
    summary = reference["metrics"]
    # the window exercises every path: stale drops, importance-mask rejections, clipping
    assert summary["stale_frac"] > 0 and summary["is_masked_frac"] > 0 and summary["clip_frac"] > 0
    assert summary["kept_tokens"] == reference["window_tokens"]
    assert abs(summary["loss"] - reference["loss"].item()) <= 1e-6  # the metric is the window loss

    # what goes wrong without window normalization (one process is enough to show it)
    trunk, lm_head = build_model()
    window = make_window(trunk, lm_head)
    kept = [kept_token_mask(mb["old"], mb["behavior"], mb["mask"], mb["token_versions"], POLICY_VERSION, CFG)
            for mb in window]
    per_microbatch_mean = sum(microbatch_loss(trunk, lm_head, mb, k.sum(), 1)[0] for mb, k in zip(window, kept)) / 4
    assert abs(per_microbatch_mean.item() - reference["loss"].item()) > 1e-3
    per_microbatch_mean.backward()
    naive_grads = torch.cat([p.grad.flatten() for p in (*trunk.parameters(), *lm_head.parameters())])
    assert (naive_grads - reference["grads"]).abs().max().item() > 1e-3
    # a 2-rank split where each rank divides by its own kept tokens (no all-reduce of the count)
    rank_denominators = [kept[0].sum() + kept[1].sum(), kept[2].sum() + kept[3].sum()]
    per_rank_mean = sum(microbatch_loss(trunk, lm_head, mb, rank_denominators[i // 2], 1)[0].item()
                        for i, mb in enumerate(window)) / 2
    assert abs(per_rank_mean - reference["loss"].item()) > 1e-3
