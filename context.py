"""
Context parallelism: each row of a microbatch split over the `cp` ranks of a group (cp_size), and
the collectives the model's token mixers call across that split (model.context_attention,
gdn.incoming_states and the conv's left context in gdn.GatedDeltaNet). docs/context_parallel.md says
what a user needs for a given length.

The layout, load-balanced for causal attention: a row of T tokens (padded to a multiple of 2 * cp)
is cut into 2 * cp pieces of C = T / (2 * cp) tokens, and rank r holds pieces r and 2 * cp - 1 - r,
side by side. Under causal attention an early piece's queries see few keys and its mirror's many, so
every rank does the same work. Every per-token tensor the loss reads is split the same way
(split_microbatch); the window's token count is then a sum over ranks of disjoint slices, as it is
over microbatches and data ranks, so window normalization needs nothing new.

This file imports nothing of ours.

    .venv/bin/python -m pytest tests/test_cp.py -q
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torch 2.13's names for the flat collectives; torch 2.11 has only the older ones (the same calls)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# tokens a piece holds at least: the causal conv's left context (kernel 4: 3 tokens) is one piece's
MIN_PIECE = 4


class Gather(torch.autograd.Function):
    """x (...) on every rank of `group` -> (size, ...), rank i's x at [i]; backward: the
    reduce-scatter of the gradient (each rank's x gets the sum of what every rank's use of it
    contributed)."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        out = x.new_empty(size * x.shape[0], *x.shape[1:])
        ALL_GATHER(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        REDUCE_SCATTER(out, grad.contiguous().flatten(0, 1), group=ctx.group)
        return out, None, None


class ContextParallel:
    """The `cp` mesh's group, and this rank's two pieces of every row."""

    def __init__(self, cp_mesh):
        self.group, self.size = cp_mesh.get_group(), cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.pieces = (self.rank, 2 * self.size - 1 - self.rank)
        # piece p of a row sits on rank p (first slot) or rank 2 * size - 1 - p (second slot): its
        # index in the gathered (rank, slot) order
        self.order = [2 * p if p < self.size else 2 * (2 * self.size - 1 - p) + 1
                      for p in range(2 * self.size)]

    def gather(self, x):
        """x (N, ...) -> (size, N, ...), autograd: a collective (all-gather forward, reduce-scatter
        backward)."""
        return Gather.apply(x, self.group, self.size)

    def in_sequence(self, gathered, dim):
        """gathered (size, ...) with every rank's two pieces on `dim` (of the shape after size) ->
        the 2 * size pieces on `dim` in the row's order (a copy)."""
        return gathered.movedim(0, dim).flatten(dim, dim + 1).index_select(
            dim, torch.tensor(self.order, device=gathered.device))

    def positions(self, T, device=None):
        """This rank's token positions in a row of T tokens (a multiple of 2 * size): (2 * C,)."""
        C = T // (2 * self.size)
        return torch.cat([torch.arange(p * C, (p + 1) * C, device=device) for p in self.pieces])

    def padded_length(self, T):
        return max(-(-T // (2 * self.size)), MIN_PIECE) * 2 * self.size


PAD = dict(token_versions=-1)  # the fill of padding per field (0 for the rest), as collate pads
IMAGES = ("pixel_values", "image_grid_thw")  # not per token: model.context_vision splits the images


def split_microbatch(mb, cp):
    """This rank's share of a microbatch (train.collate's dict of (B, T, ...) tensors): every
    per-token field cut to this rank's positions (B, 2 * C, ...), the row first padded to
    cp.padded_length(T); input_ids stay whole (model.hidden_states embeds this rank's tokens and
    reads the image layout of the whole row from them), and `positions` says which tokens are this
    rank's. MTP's shifted target (the token t + 2 is targets[t + 1], on another rank at a piece's
    end) and whether it counts are made before the cut: mtp_targets, mtp_real."""
    B, T = mb["input_ids"].shape
    Tp = cp.padded_length(T)
    pos = cp.positions(Tp, mb["input_ids"].device)
    out = dict(mb, positions=pos)
    out["mtp_targets"] = F.pad(mb["targets"][:, 1:], (0, 1))
    if "real" in mb:
        out["mtp_real"] = F.pad(mb["real"][:, 1:], (0, 1))
    for k, v in list(out.items()):
        if torch.is_tensor(v) and v.dim() >= 2 and v.shape[:2] == (B, T) and k not in IMAGES:
            v = torch.cat([v, v.new_full((B, Tp - T, *v.shape[2:]), PAD.get(k, 0))], 1)
            out[k] = v if k == "input_ids" else v[:, pos]
    return out
