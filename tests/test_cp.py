"""Context parallelism (context.py, model.context_attention, gdn.py's incoming_states and
left_context) against one process, on gloo CPU ranks in fp32: the model's hidden states and every
gradient, and the trainer's loss, gradients and weights over steps, for CP 2 and 4 on a dense, a MoE
and the hybrid tiny model; negative controls (a Gated DeltaNet state not passed, a piece put in the
wrong place) must fail.

    .venv/bin/python -m pytest tests/test_cp.py -q
"""

import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import checkpoint
import context
import gdn
import plan
import train
from model import Transformer
from test_model_vl import GRIDS, MOE_VL, image_batch, random_model
from test_train import (
    ADAM_EPS,
    CFG,
    HYBRID,
    check_matches_single_process,
    make_weights,
    record_grads_before_step,
    reference_run,
    spawn,
    trainer_config,
    windows,
)

DENSE = dataclasses.replace(CFG, num_experts=0)
# the Qwen3-VL MoE with deepstack: 5 images of 4 to 280 patches in 2 rows; at CP 4 one rank holds
# none of them
MODELS = dict(dense=DENSE, moe=CFG, hybrid=HYBRID, vl=MOE_VL)
# fp32, the summation order alone differs (each rank's tokens summed, then the ranks'); measured on
# 2 cores: hidden states 4.3e-6 at most, gradients 5.1e-6 of their tensor's largest element (A_log,
# hybrid, CP 4); the negative controls are off by 0.36 to 4.6
TOL = dict(rtol=1e-5, atol=2e-5)
GRAD_REL = 5e-5


def model_batch(mcfg, seed=0, B=2, T=29):
    """Rows of different real lengths (right padding), with routed experts for a MoE model;
    a VLM's: images."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, mcfg.vocab_size, (B, T + 1), generator=g)
    real = (torch.arange(T)[None] < torch.tensor([T, T - 7])[:, None]).float()
    images = {}
    if mcfg.vision is not None:
        ids, pixel_values, grid = image_batch(mcfg.vision, GRIDS)
        ids, T = torch.cat([ids, ids[:, :1]], 1), ids.shape[1]
        real = (ids[:, :-1] != 0).float()
        images = dict(pixel_values=pixel_values, image_grid_thw=grid)
    routes = None
    if mcfg.is_moe:
        E, L = mcfg.num_experts, len(mcfg.moe_layers) + mcfg.mtp_num_hidden_layers
        routes = torch.rand(B, T, L, E, generator=g).argsort(-1)[..., : mcfg.num_experts_per_tok]
    return dict(
        input_ids=ids[:, :-1] * real.long(),
        targets=ids[:, 1:] * real.long(),
        real=real,
        routed_experts=routes,
        **images,
    )


def model_loss(model, mb, weights):
    """A loss that reads every hidden state (and the MTP head's): sum(h * w)."""
    routes = mb["routed_experts"]
    trunk = routes[:, :, : len(model.config.moe_layers)] if routes is not None else None
    h = model.hidden_states(
        mb["input_ids"],
        routed_experts=trunk,
        positions=mb.get("positions"),
        pixel_values=mb.get("pixel_values"),
        image_grid_thw=mb.get("image_grid_thw"),
    )
    out = (h * weights[0]).sum()
    if model.mtp is not None:
        out = out + (model.mtp_hidden(h, mb["targets"]) * weights[1]).sum()
    return h, out


def cp_forward_backward(rank, world, mcfg, weights, batch, out):
    """Each rank: the whole model (no FSDP), its pieces of the batch, the loss over them; gradients
    summed over the group. Rank 0 saves the row's hidden states put together and the gradients: as
    built, with the GDN state not passed, and with two pieces swapped in the gathers' order."""
    meshes = train.build_meshes(world, 1, "cpu", world)
    cp = context.ContextParallel(meshes["cp"])
    model = Transformer.from_pretrained(weights)
    for m in model.modules():
        if hasattr(m, "context_parallel"):
            m.context_parallel = cp
    mb = context.split_microbatch(batch, cp)
    Tp = mb["input_ids"].shape[1]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, *batch["input_ids"].shape, mcfg.hidden_size, generator=g)
    w = torch.cat([w, w.new_zeros(2, w.shape[1], Tp - w.shape[2], w.shape[3])], 2)[
        :, :, mb["positions"]
    ]
    results = {}
    swapped = list(cp.order)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    controls = dict(
        built={},
        no_state=dict(incoming_states=lambda final, m, cp, B: torch.zeros_like(final)),
        misordered=dict(order=swapped),
    )
    for name, control in controls.items():
        model.zero_grad()
        with (
            mock.patch.object(
                gdn, "incoming_states", control.get("incoming_states", gdn.incoming_states)
            ),
            mock.patch.object(cp, "order", control.get("order", cp.order)),
        ):
            h, total = model_loss(model, dict(mb, routed_experts=mb["routed_experts"]), w)
            total.backward()
        full = h.new_zeros(h.shape[0], Tp, h.shape[2])
        full[:, mb["positions"]] = h.detach()
        dist.all_reduce(full)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for grad in grads.values():
            dist.all_reduce(grad)
        dist.all_reduce(total := total.detach())
        results[name] = dict(
            hidden=full[:, : batch["input_ids"].shape[1]], loss=total, grads=grads, Tp=Tp
        )
    if rank == 0:
        torch.save(results, out)


def reference_forward_backward(weights, batch, Tp):
    model = Transformer.from_pretrained(weights)
    B, T = batch["input_ids"].shape
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, B, T, model.config.hidden_size, generator=g)
    padded = {
        k: torch.cat([v, v.new_zeros(B, Tp - T, *v.shape[2:])], 1)
        if k not in context.IMAGES and v is not None
        else v
        for k, v in batch.items()
    }
    h, total = model_loss(model, padded, torch.cat([w, w.new_zeros(2, B, Tp - T, w.shape[3])], 2))
    total.backward()
    return dict(
        hidden=h.detach()[:, :T],
        loss=total.detach(),
        grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None},
    )


@pytest.mark.parametrize(
    "name,cp",
    [
        ("dense", 2),
        ("moe", 2),
        ("hybrid", 2),
        ("vl", 2),
        # four pieces (middle ranks, state passed on twice): the hybrid has full attention, Gated
        # DeltaNet and MoE layers, so dense and MoE at 4 would repeat it
        ("hybrid", 4),
        ("vl", 4),
    ],
)
@pytest.mark.stack
def test_model_under_cp_matches_one_process(tmp_path, name, cp):
    mcfg = MODELS[name]
    weights = str(tmp_path / "weights")
    random_model(mcfg).save_pretrained(weights) if mcfg.vision else make_weights(weights, mcfg)
    batch = model_batch(mcfg)
    spawn(cp, cp_forward_backward, mcfg, weights, batch, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    ref = reference_forward_backward(weights, batch, got["built"]["Tp"])
    built = got["built"]
    torch.testing.assert_close(built["hidden"], ref["hidden"], **TOL)
    torch.testing.assert_close(built["loss"], ref["loss"], **TOL)
    assert built["grads"].keys() == ref["grads"].keys()
    for n, g in ref["grads"].items():
        assert (built["grads"][n] - g).abs().max() <= GRAD_REL * g.abs().max(), n
    # negative controls: a piece in the wrong place breaks every model; a state not passed breaks
    # the hybrid
    for control in ("misordered",) + (("no_state",) if name == "hybrid" else ()):
        err = (got[control]["hidden"] - ref["hidden"]).abs().max().item()
        assert err > 1e-2, (control, err)


def cut_first(mb, cp):
    """Negative control: MTP's target taken after the cut, from this rank's next token."""
    out = context.split_microbatch(mb, cp)
    return dict(out, mtp_targets=torch.cat([out["targets"][:, 1:], out["targets"][:, :1]], 1))


def cp_run(rank, world, cfg, weights, wins, out, split=context.split_microbatch):
    """train.py's step on every rank: each context-parallel group takes its share of the window's
    microbatches (uneven over data groups on purpose) and train_step cuts each row."""
    train.split_microbatch = split
    cp = cfg["cp_size"]
    model = train.build_model(
        cfg,
        train.build_meshes(world, cfg["ep_size"], "cpu", cp),
        torch.device("cpu"),
        weights_path=weights,
    )
    opt = train.build_optimizer(model, cfg)
    for group in opt.param_groups:
        group["eps"] = ADAM_EPS
    recorded = record_grads_before_step(opt, model)
    metrics, params_at = [], {}  # params_at: the full parameters before each step
    for step, win in enumerate(wins):
        params_at[step] = {n: t for n, t in checkpoint.full_parameters(model)}
        metrics.append(train.train_step(model, opt, win[rank // cp :: world // cp], cfg,
                                        train.loss_config(cfg), policy_version=step))
    params = {n: t for n, t in checkpoint.full_parameters(model)}
    if rank == 0:
        torch.save(dict(metrics=metrics, grads=recorded, params=params, params_at=params_at), out)


@pytest.mark.parametrize(
    "world,cp,ep,name,extra",
    [
        (2, 2, 1, "dense", {}),
        (2, 2, 2, "moe", {}),  # routing replay on step 1's window
        (4, 4, 2, "hybrid", {"activation_checkpointing": True}),
        (4, 2, 2, "hybrid", {}),  # 2 data groups of 2
    ],
    ids=["cp2-dense", "cp2-ep2-moe", "cp4-ep2-ac-hybrid", "dp2-cp2-ep2-hybrid"],
)
@pytest.mark.stack
def test_train_step_under_cp_matches_single_process(tmp_path, world, cp, ep, name, extra):
    mcfg = MODELS[name]
    weights = make_weights(str(tmp_path / "weights"), mcfg)
    cfg = trainer_config(ep_size=ep, cp_size=cp, train_world_size=world, **extra)
    wins = windows(num_experts=mcfg.num_experts)
    spawn(world, cp_run, cfg, weights, wins, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    # each reference step starts from the ranks' parameters before it (as test_train does): one
    # step's summation order is compared, not the drift of free-running steps through Adam
    ref = reference_run(weights, wins, cfg, params_at=got["params_at"])
    check_matches_single_process(got, ref)


@pytest.mark.stack
def test_mtp_loss_under_cp_matches_one_rank(tmp_path):
    """MTP's target is the token after next, on another rank at a piece's end: CP 2 against one
    rank, with mtp_loss_coef on (the plain reference of the other tests has no MTP term)."""
    weights = make_weights(str(tmp_path / "weights"), HYBRID)
    wins = [
        [
            dict(mb, real=(mb["input_ids"] != 0).float()) for mb in win
        ]  # collate's real tokens: padding 0
        for win in windows(num_experts=HYBRID.num_experts)
    ]
    runs = {}
    for cp, split in (
        (1, context.split_microbatch),
        (2, context.split_microbatch),
        ("cut_first", cut_first),
    ):
        cfg = trainer_config(
            cp_size=cp if cp == 1 else 2, train_world_size=1 if cp == 1 else 2, mtp_loss_coef=0.5
        )
        spawn(cfg["cp_size"], cp_run, cfg, weights, wins, str(tmp_path / f"out{cp}.pt"), split)
        runs[cp] = torch.load(tmp_path / f"out{cp}.pt", weights_only=False)
    wrong = runs["cut_first"]["metrics"][0]["mtp_loss"]
    assert abs(wrong - runs[1]["metrics"][0]["mtp_loss"]) > 1e-3, wrong
    for step, (m, r) in enumerate(zip(runs[2]["metrics"], runs[1]["metrics"], strict=True)):
        assert r["mtp_loss"] > 0.1, step
        assert m["mtp_loss"] == pytest.approx(r["mtp_loss"], rel=1e-5), step
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-6), step
        for n, g in runs[1]["grads"][step].items():  # 4.3e-6 measured (embed_tokens, step 1)
            torch.testing.assert_close(runs[2]["grads"][step][n], g, rtol=1e-4, atol=1e-5)


def test_split_layout_and_config_checks():
    """Rank r holds pieces r and 2cp-1-r; the MTP target is made before the cut; config keys
    checked."""

    class Mesh:
        def __init__(self, rank):
            self.rank = rank

        def get_group(self):
            return None

        def size(self):
            return 4

        def get_local_rank(self):
            return self.rank

    T = 37
    ids = torch.arange(1, T + 1)[None]
    mb = dict(
        input_ids=ids,
        targets=ids + 100,
        real=torch.ones(1, T),
        token_versions=torch.zeros(1, T).long(),
    )
    pieces = [context.split_microbatch(mb, context.ContextParallel(Mesh(r))) for r in range(4)]
    Tp = 40  # 37 padded to 8 pieces of 5
    assert [p["positions"].tolist()[::5] for p in pieces] == [[0, 35], [5, 30], [10, 25], [15, 20]]
    together = torch.cat([p["positions"] for p in pieces]).sort().values
    assert together.tolist() == list(range(Tp))
    assert pieces[0]["input_ids"].shape == (1, Tp)  # whole: the model cuts it
    assert pieces[1]["targets"][0, :5].tolist() == [106, 107, 108, 109, 110]
    assert pieces[1]["mtp_targets"][0, 4].item() == 111  # the next piece's first target, on rank 2
    assert pieces[0]["token_versions"][0, -3:].tolist() == [-1, -1, -1]  # padding
    assert pieces[0]["mtp_real"][0, -4:].tolist() == [0, 0, 0, 0]
    cfg = trainer_config(cp_size=3, train_world_size=4)
    with pytest.raises(plan.ConfigError, match="not divisible by cp_size"):
        plan.check_config(cfg)
    cfg = trainer_config(cp_size=2, train_world_size=2, is_level="sequence")
    with pytest.raises(plan.ConfigError, match="is_level"):
        plan.check_config(cfg)


@pytest.mark.stack
def test_dry_run_plans_256k_on_80gb_gpus_with_cp():
    """Qwen3.6-35B-A3B at 262,144 tokens fits 80 GB GPUs at CP 8 and not at CP 4; the 700B config at
    131,072 at CP 8 (docs/context_parallel.md has the figures)."""
    from test_dry_run import gib, run_train

    long = ["--engine_max_model_len=262144", "--microbatch_tokens=262144"]
    r = run_train("--config", "configs/qwen3_6_35b_a3b.py", "--dry_run=True", "--cp_size=8", *long)
    assert r.returncode == 0, r.stderr[-2000:]
    assert gib(r.stdout, "total") < 79.6 * 2**30
    assert "32,768 of each row on this rank (cp_size 8)" in r.stdout
    assert "context-parallel traffic per rank and microbatch" in r.stdout
    r = run_train("--config", "configs/qwen3_6_35b_a3b.py", "--dry_run=True", "--cp_size=4", *long)
    assert r.returncode != 0 and "more than the 79.6 GiB" in r.stdout + r.stderr
    r = run_train("--config", "configs/moe_700b.py", "--dry_run=True", "--cp_size=8",
                  "--engine_max_model_len=131072", "--microbatch_tokens=131072")
    assert r.returncode == 0, r.stderr[-2000:]


def test_plan_counts_what_the_cp_delta_rule_saves():
    """plan.GDN_TORCH_BYTES against what autograd saves in gdn.chunk_gated_delta_rule_torch with
    `incoming`, per token and value head (the slope between two lengths), at Qwen3.6's heads in
    bf16: 13,085 bytes measured, 13,312 planned."""

    def saved(T, H=32, Hk=16, dk=128, dv=128):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(1, T, Hk, dk, generator=g).bfloat16().requires_grad_() for _ in "qk")
        v = torch.randn(1, T, H, dv, generator=g).bfloat16().requires_grad_()
        decay = -torch.rand(1, T, H, generator=g).requires_grad_()  # fp32, as GatedDeltaNet has it
        beta = torch.rand(1, T, H, generator=g).bfloat16().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gdn.chunk_gated_delta_rule_torch(q, k, v, decay, beta, torch.tensor([0, T // 2, T]),
                                             incoming=lambda u, m: torch.zeros_like(u))
        return sum(seen.values())

    per_token_head = (saved(1024) - saved(512)) / 512 / 32
    planned = plan.GDN_TORCH_BYTES[0] * 128 + plan.GDN_TORCH_BYTES[1] * 128
    assert per_token_head == pytest.approx(planned, rel=0.05)
