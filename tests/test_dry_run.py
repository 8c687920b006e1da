"""The dry-run planner, the config checks a real run shares with it, and engine options refused by vLLM.

    .venv/bin/python -m pytest tests/test_dry_run.py -q        # CPU, about a minute

Every shipped config is planned with the real sharding code (train.dry_run_main: build_meshes /
meta_sharded_model / shard_model, measured by plan.measure_shards) against a fake process group of
its world size; the printed memory of qwen3_30b_a3b is checked against a hand computation from the
config's numbers, and the activation estimate against what autograd saves.
"""
import ast
import asyncio
import atexit
import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os
import re
import subprocess
import sys

import pytest
import torch

import plan
from conftest import child_env
from plan import ConfigError
from train import configure
from weights_sync import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "configs")) if name.endswith(".py"))
GiB = 2**30


@functools.lru_cache(maxsize=None)
def planner():
    """One process, spawned at the first dry run, that runs every dry run of the suite in turn: torch, the trainer
    and vLLM's config validation are imported once there instead of once per `python train.py` (about 10 s of CPU
    each on 2 cores, for some twenty runs)."""
    return concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))


@atexit.register
def stop_planner():  # before the interpreter tears down (the pool, once unreferenced, ends its process then)
    if planner.cache_info().currsize:
        planner().shutdown()
        planner.cache_clear()


@pytest.fixture(scope="module", autouse=True)
def planner_for_this_module():
    """The planner's memory (torch, vLLM) is not held through the rest of the suite: a later dry run starts another."""
    yield
    stop_planner()


def dry_run_in_this_process(args):
    """What `python train.py ARGS` (a dry run) gives, run in this process: (exit status, stdout, stderr); a
    sys.exit sentence goes to stderr with status 1, as the interpreter writes it, an exception's traceback too."""
    import contextlib
    import io
    import traceback
    import train
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train.main(list(args))
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) or e.code is None else print(e.code, file=sys.stderr) or 1
        except Exception:
            traceback.print_exc()
            status = 1
    return status or 0, out.getvalue(), err.getvalue()


def run_train(*args):
    """`python train.py ARGS --dry_run=True`, in the planner process (the command itself: the torchrun.sh test)."""
    assert "--dry_run=True" in args
    status, out, err = planner().submit(dry_run_in_this_process, args).result(timeout=300)
    return subprocess.CompletedProcess(["train.py", *args], status, out, err)


@functools.lru_cache(maxsize=None)
def dry_run_output(name):
    r = run_train("--config", f"configs/{name}.py", "--dry_run=True")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def gib(out, row):
    """The GiB figure of a row of the printed per-GPU table, e.g. `  parameters   14.22 GiB  ...`."""
    return float(re.search(rf"^  {row}\s+([\d.]+) GiB", out, re.M).group(1)) * GiB


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.stack
def test_dry_run_of_every_config(name):
    out = dry_run_output(name)
    for row in ("parameters", "gradients", "optimizer", "all-gather", "activations", "total"):
        assert re.search(rf"^  {row}\s+[\d.]+ GiB", out, re.M), f"{row} missing from:\n{out}"
    cfg = configure(["--config", os.path.join(ROOT, "configs", f"{name}.py")])
    gpus = cfg["train_world_size"] + cfg["num_engines"] * cfg["tensor_parallel_size"]
    assert f"= {gpus}\n" in out
    assert "engine options: accepted by vLLM" in out
    # the total is the sum of its printed parts (2 decimals each): the state (unless on the CPU), the transient
    # gathers and logprob chunk, and the activations of the run's checkpointing setting
    acts = [float(x) for x in re.findall(r"^  activations\s+([\d.]+) GiB", out, re.M)]
    state = 0 if cfg["cpu_offload_optimizer"] else sum(gib(out, row) for row in ("parameters", "gradients", "optimizer"))
    act = acts[0 if cfg["activation_checkpointing"] else 1] * GiB
    hybrid = "qwen36" in name or "qwen3_6" in name
    if name == "qwen3_6_35b_a3b":  # KV in its 10 attention layers (1 KV head per TP2 rank), a GDN state per sequence
        per_sequence = 32768 * 2 * 10 * 1 * 256 * 2 + 30 * (4 * 16 * 128 * 128 + 2 * 3 * (16 * 128 + 16 * 128))
        weights, budget = map(float, re.search(r"([\d.]+) GiB bf16 weights of ([\d.]+) GiB", out).groups())
        free = budget - weights
        assert f"= {int(free * GiB // per_sequence)} full 32768-token sequences" in out, out
        assert gib(out, "GDN states") == pytest.approx(2 * 2 * 512 * 32 * 128 * 128, abs=0.005 * GiB)  # + gradient
    assert ("  GDN states" in out) == hybrid and ("linear-attention layers 0, " in out) == hybrid
    parts = state + gib(out, "all-gather") + gib(out, "logprob chunk") + act + (gib(out, "GDN states") if hybrid else 0)
    assert len(acts) == 2 and abs(gib(out, "total") - parts) <= 0.03 * GiB, (gib(out, "total") / GiB, parts / GiB)
    if name == "moe_700b":
        billions = float(re.search(r"dry run: ([\d.]+)B parameters", out).group(1))
        assert 650 < billions < 750
    has_tower = plan.planned_model_config(dict(cfg, dry_run=True)).vision is not None
    assert has_tower == ("_vl" in name or "qwen36" in name or "qwen3_6" in name)  # the image models' configs
    assert ("  vision tower " in out) == has_tower  # a model with a tower is planned with it
    one_node = cfg["tensor_parallel_size"] <= cfg["gpus_per_node"]
    assert ("note: an engine's" not in out) == one_node  # moe_700b's TP16 engines need 16-GPU nodes


@pytest.mark.stack
def test_scale_doc_table_holds_the_dry_run_figures():
    with open(os.path.join(ROOT, "docs", "scale.md")) as f:
        rows = {line.split("|")[1].strip(" `"): line for line in f if line.startswith("| `")}
    for name in CONFIGS:
        out = dry_run_output(name)
        for row in ("parameters", "total"):
            assert f"{gib(out, row) / GiB:.2f} GiB" in rows[name], (name, row)


@pytest.mark.stack
def test_qwen3_30b_a3b_memory_matches_hand_computation():
    out = dry_run_output("qwen3_30b_a3b")
    cfg = configure(["--config", os.path.join(ROOT, "configs", "qwen3_30b_a3b.py")])
    m = cfg["model_config"]
    D, L, V, hd = m["hidden_size"], m["num_hidden_layers"], m["vocab_size"], m["head_dim"]
    nh, nkv, E, H = m["num_attention_heads"], m["num_key_value_heads"], m["num_experts"], m["moe_intermediate_size"]
    W, ep = cfg["train_world_size"], cfg["ep_size"]
    # non-expert weights per layer: q, k, v, o projections, q/k norms, two RMSNorms, the router; sharded over all ranks
    layer = D * nh * hd + 2 * D * nkv * hd + nh * hd * D + 2 * hd + 2 * D + D * E
    dense = L * layer + 2 * V * D + D  # embeddings, lm_head (untied), final norm
    # experts: E / ep per EP rank, each 3 matrices of D x H, FSDP-sharded over the W / ep ranks holding the same ones
    expert = (E // ep) * 3 * D * H * L / (W // ep)
    per_rank = dense / W + expert
    assert dense / W == pytest.approx(float(re.search(r"([\d.,]+)M dense", out).group(1).replace(",", "")) * 1e6, rel=0.01)
    assert expert == pytest.approx(float(re.search(r"([\d.,]+)B expert", out).group(1)) * 1e9, rel=0.01)
    assert gib(out, "parameters") == pytest.approx(4 * per_rank, rel=0.05)  # fp32 master weights
    assert gib(out, "gradients") == pytest.approx(4 * per_rank, rel=0.05)   # fp32 sharded gradients
    assert gib(out, "optimizer") == pytest.approx(8 * per_rank, rel=0.05)   # AdamW m and v, fp32
    # all-gather in bf16: the root unit (embeddings + lm_head) held with its gradient, two blocks (one prefetched)
    # of attention + router + the 16 local experts, and one block's gradient in bf16 and fp32
    block = layer + (E // ep) * 3 * D * H
    assert gib(out, "all-gather") == pytest.approx(4 * (2 * V * D) + 4 * block + 6 * block, rel=0.05)


@pytest.mark.stack
def test_mtp_drafting_plans_the_drafters_weights_kv_and_sync_share():
    """qwen3_6_35b_a3b with speculative_tokens=2 against a hand count of its MTP layer (fc over two widths, three
    norms, one gated-attention MoE block with a shared expert): the engine holds the drafter's own bf16 weights / TP
    (without drafting vLLM drops mtp.*), KV for 11 attention layers and 1 + 2 GDN states per sequence (one per draft
    position); the bf16 sync carries mtp.* either way."""
    off = dry_run_output("qwen3_6_35b_a3b")
    r = run_train("--config", "configs/qwen3_6_35b_a3b.py", "--dry_run=True", "--speculative_tokens=2")
    assert r.returncode == 0, r.stderr[-3000:]
    D, nh, nkv, hd, E, H = 2048, 16, 2, 256, 256, 512  # the config's text_config (shared expert also 512 wide)
    block = 2 * D + D * 2 * nh * hd + 2 * D * nkv * hd + nh * hd * D + 2 * hd + D * E + E * 3 * D * H + 3 * D * H + D
    mtp = 2 * D * D + 3 * D + block  # 844,640,768
    weights = lambda out: float(re.search(r"([\d.]+) GiB bf16 weights", out).group(1))  # noqa: E731
    assert weights(r.stdout) - weights(off) == pytest.approx(2 * mtp / 2 / GiB, abs=0.01)  # TP 2
    assert f"{2 * mtp / 2 / GiB:.2f} GiB of the weights are the drafter's" in r.stdout
    state = 4 * 16 * 128 * 128 + 2 * 3 * (16 * 128 + 16 * 128)  # per GDN layer and TP rank, as in the test above
    per_sequence = 32768 * 2 * (10 + 1) * 1 * 256 * 2 + 30 * (1 + 2) * state
    free = float(re.search(r"GiB bf16 weights of ([\d.]+) GiB", r.stdout).group(1)) - weights(r.stdout)
    assert f"= {int(free * GiB // per_sequence)} full 32768-token sequences" in r.stdout
    sync = lambda out: float(re.search(r"weight sync per step: ([\d.]+) GB", out).group(1))  # noqa: E731
    assert sync(r.stdout) == sync(off) and f"; {2 * mtp / 1e9:.2f} GB of it the MTP layers" in off


@pytest.mark.stack
def test_fp8_rollouts_and_experts_plan_half_the_sync_and_engine_weights():
    """qwen3_30b_a3b with rollout_dtype=fp8 and fp8_experts against a hand count: the sync and the
    engine's weights hold every attention and expert projection in e4m3 plus a float32 scale per
    128x128 block, the embeddings, lm_head, norms and router in bf16 (about 0.51x of bf16); the
    trainer holds one MoE layer's experts of its rank (E / ep) in e4m3 beside the rest, and without
    checkpointing every layer's two e4m3 copies for the window."""
    off = dry_run_output("qwen3_30b_a3b")
    r = run_train("--config", "configs/qwen3_30b_a3b.py", "--dry_run=True", "--rollout_dtype=fp8",
                  "--fp8_experts=True")
    assert r.returncode == 0, r.stderr[-3000:]
    D, L, nh, nkv, hd, E, H, V, ep = 2048, 48, 32, 4, 128, 128, 768, 151936, 8
    projections = 2 * D * nh * hd + 2 * D * nkv * hd + E * 3 * H * D  # per layer, a byte each
    scales = 4 * (2 * nh * hd * D + 2 * nkv * hd * D + E * 3 * H * D) // 128 ** 2
    rest = 2 * (2 * V * D + D + L * (2 * D + 2 * hd + E * D))  # bf16
    fp8 = L * (projections + scales) + rest
    def sync(out):
        return float(re.search(r"weight sync per step: ([\d.]+) GB", out).group(1))
    assert sync(r.stdout) == pytest.approx(fp8 / 1e9, abs=0.01)
    assert 0.5 < sync(r.stdout) / sync(off) < 0.52
    assert "(the projections in e4m3 with 128x128 block scales, the rest bf16)" in r.stdout
    engine = float(re.search(r"per GPU: ([\d.]+) GiB fp8 \(projections; the rest bf16\) weights",
                             r.stdout).group(1))
    assert engine == pytest.approx(fp8 / GiB, abs=0.01)  # tensor_parallel_size 1
    assert gib(r.stdout, "fp8 experts") == pytest.approx(E // ep * 3 * H * D, abs=0.01 * GiB)
    assert gib(r.stdout, "total") == pytest.approx(gib(off, "total") + E // ep * 3 * H * D,
                                                   abs=0.02 * GiB)
    # without checkpointing the casts of the experts (kept outside FSDP: one expert FSDP rank) are reused
    # over the window, and each keeps its two e4m3 copies (a byte each) with it
    def unckpt(out):
        return float(re.search(r"activation checkpointing on; off: ([\d.]+) GiB", out).group(1)) * GiB
    assert unckpt(r.stdout) == pytest.approx(unckpt(off) + (2 * L + 1) * E // ep * 3 * H * D, abs=0.02 * GiB)
    assert "fp8 experts" not in off


@pytest.mark.stack
def test_cpu_offload_takes_the_sharded_state_off_the_gpu():
    on_gpu = dry_run_output("qwen3_30b_a3b")
    r = run_train("--config", "configs/qwen3_30b_a3b.py", "--dry_run=True", "--cpu_offload_optimizer=True")
    assert r.returncode == 0, r.stderr[-3000:]
    state = sum(gib(on_gpu, row) for row in ("parameters", "gradients", "optimizer"))
    assert "[host memory (cpu_offload_optimizer)]" in r.stdout
    assert gib(r.stdout, "total") == pytest.approx(gib(on_gpu, "total") - state, abs=0.02 * GiB)


@pytest.mark.stack
def test_colocated_plan_is_the_larger_phase_with_what_stays_resident():
    # one GPU: the trainer's state stays while the engine generates; the engine sleeps while the
    # trainer steps
    args = ("--config", "configs/qwen3_4b.py", "--dry_run=True", "--train_world_size=1",
            "--num_engines=1", "--gpu_memory_gib=79.0", "--engine_memory_fraction=0.3")
    r = run_train(*args, "--placement=colocated")
    assert r.returncode == 0, r.stderr[-3000:]
    def figure(name):
        return float(re.search(rf"{name} ([\d.]+) GiB", r.stdout).group(1)) * GiB
    state = sum(gib(r.stdout, row) for row in ("parameters", "gradients", "optimizer"))
    resident = state - gib(r.stdout, "gradients")
    assert figure("resident") == pytest.approx(resident, abs=0.02 * GiB)
    assert figure("training") == pytest.approx(gib(r.stdout, "total") + plan.ENGINE_ASLEEP_BYTES,
                                               abs=0.02 * GiB)
    assert figure("generating") == pytest.approx(0.3 * 79 * GiB + resident, abs=0.02 * GiB)
    assert figure("peak") == max(figure(p) for p in ("training", "generating", "syncing"))
    separate = run_train(*args)
    assert "colocated" not in separate.stdout and "GPUs: 1 training + 1 rollout" in separate.stdout
    # the engine's share no longer fits beside the trainer's resident state (negative control)
    r = run_train(*args, "--placement=colocated", "--engine_memory_fraction=0.5")
    assert r.returncode == 1
    assert re.search(r"placement='colocated' needs about .* GiB at its peak, more than the 79 GiB",
                     r.stderr), r.stderr[-2000:]


@pytest.mark.stack
def test_kl_penalty_plans_a_reference_copy_except_under_lora():
    """kl_coef > 0 plans the reference policy: a copy of the parameter shards in param_dtype (bf16: half the fp32
    parameters row), in the total; a LoRA run's reference is its frozen base, no row (test_train checks the figure
    against the shards a real 2-rank run builds)."""
    base = dry_run_output("qwen3_30b_a3b")
    runs = [run_train("--config", "configs/qwen3_30b_a3b.py", "--dry_run=True", "--kl_coef=0.05", *lora)
            for lora in ([], ["--lora_rank=8"])]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    with_ref, lora = (r.stdout for r in runs)
    assert gib(with_ref, "reference") == pytest.approx(gib(base, "parameters") / 2, abs=0.01 * GiB)
    assert gib(with_ref, "total") == pytest.approx(gib(base, "total") + gib(with_ref, "reference"), abs=0.02 * GiB)
    assert "  reference " not in base and "  reference " not in lora


def saved_bytes(module, forward):
    """Bytes of the distinct storages autograd saves for backward while forward() runs, the module's parameters
    excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())


def test_activation_estimate_matches_what_autograd_saves():
    """Sum the bytes of every tensor autograd saves in a bf16 forward (parameters excluded) of a small MoE, a dense
    model and a wider MoE; the planner's formula must agree within 5%."""
    from model import ModelConfig, Transformer
    for kw in [dict(num_experts=8, num_experts_per_tok=2), dict(num_experts=0),
               dict(num_experts=16, num_experts_per_tok=4, intermediate_size=768)]:
        mcfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=kw.pop("intermediate_size", 512),
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                           moe_intermediate_size=128, **kw)
        torch.manual_seed(0)
        model = Transformer(mcfg)
        model.init_weights()
        model = model.to(torch.bfloat16).train()
        B, T = 2, 512
        estimate = plan.activation_bytes(mcfg, B * T, checkpointing=False, dtype_bytes=2)
        assert saved_bytes(model, lambda: model.hidden_states(torch.randint(0, 512, (B, T)))) == pytest.approx(
            estimate, rel=0.05), kw
        assert plan.activation_bytes(mcfg, B * T, checkpointing=True, dtype_bytes=2) < estimate


def test_all_to_all_projection_counts_the_rows_ep_dispatch_sends():
    """The dry run's EP all-to-all volume: remote rows per token from C(E - E/ep, k) / C(E, k), against the rows
    experts.dispatch's rule sends (each token once to every other rank holding one of its top-k
    experts), counted on random top-k choices at Qwen3-30B-A3B's routing (128 experts, top-8) over 8 ranks."""
    from model import ModelConfig
    mcfg = ModelConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8)
    g = torch.Generator().manual_seed(0)
    topk = torch.rand(20000, 128, generator=g).topk(8, dim=-1).indices  # (N, K) distinct experts per token
    for ep in (2, 8):
        on_rank = torch.zeros(len(topk), ep, dtype=torch.bool).scatter_(1, topk // (128 // ep), True)
        sent = on_rank[:, 1:].sum(1).float().mean().item()  # from rank 0, to the others
        rows, nbytes, seconds = plan.ep_all_to_all(mcfg, 16384, ep, checkpointing=False)
        assert rows == pytest.approx(sent, rel=0.01), ep
        assert rows < (ep - 1) / ep * 8  # the deduplication: fewer rows than one per remote choice
        row_bytes = 2 * 2048 + 8 * 10 + 2 * 2048  # dispatched row with weights and ids, combined row back
        assert nbytes == pytest.approx(16384 * rows * row_bytes * 2)  # forward and backward
        assert plan.ep_all_to_all(mcfg, 16384, ep, checkpointing=True)[1] == pytest.approx(1.5 * nbytes)


def test_vision_activation_estimate_matches_what_autograd_saves():
    """The bytes autograd saves in a bf16 forward of a vision tower (parameters excluded) on 448x448 images, against
    the planner's per-image formula (within 5%); checkpointing keeps less."""
    from model import VisionConfig, VisionModel
    vc = VisionConfig(depth=2, hidden_size=128, intermediate_size=320, num_heads=2, out_hidden_size=64,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
    torch.manual_seed(0)
    tower = VisionModel(vc).to(torch.bfloat16).train()
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    saved = saved_bytes(tower, lambda: tower(torch.randn(2 * 784, patch, dtype=torch.bfloat16),  # two 448x448
                                             torch.tensor([[1, 28, 28]] * 2)))  # images: 28 x 28 patches each
    estimate = plan.vision_activation_bytes(vc, checkpointing=False, dtype_bytes=2)
    assert saved == pytest.approx(2 * estimate, rel=0.05)
    assert plan.vision_activation_bytes(vc, checkpointing=True, dtype_bytes=2) < estimate


class FlaSaves(torch.autograd.Function):
    """For the count alone (fla computes on CUDA only): saves for backward what fla's ChunkGatedDeltaRuleFunction
    saves, in its dtypes: q and k L2-normalized (new tensors) and their fp32 rstd, per key head (it shares each among
    its value heads), the inputs made contiguous (its input_guard: v is a view of silu(qkv)), g's fp32 chunk cumsum,
    beta, the WY matrix A (64 per value head: beta is per value head)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens):
        def rstd(t):
            return torch.rsqrt((t.float() ** 2).sum(-1) + 1e-6)
        A = k.new_zeros(*v.shape[:3], 64)
        ctx.save_for_backward(q * rstd(q)[..., None].to(q.dtype), rstd(q), k * rstd(k)[..., None].to(k.dtype), rstd(k),
                              v.contiguous(), g.float().cumsum(1), beta.contiguous(), A)
        return torch.zeros_like(v)


def test_hybrid_activation_estimate_matches_what_autograd_saves(monkeypatch):
    """The bytes autograd saves in a bf16 forward of Qwen3.5 hybrids (zero-centred norms, gated attention, partial
    rotary, Gated DeltaNet, a shared expert; irregular layer patterns, MoE and dense), parameters excluded, with the
    delta rule saving what fla's kernel saves (FlaSaves), against the planner's formula: within 5% (measured
    0.04-0.06%). Control: CPU's torch reference rule saves far more (1.6x at the same shapes) and fails the bound."""
    import gdn
    from model import ModelConfig, Transformer
    LIN, FULL = "linear_attention", "full_attention"
    shapes = [dict(layer_types=[LIN, FULL, LIN], shared_expert_intermediate_size=160),
              dict(layer_types=[LIN, LIN, FULL], num_experts=0, intermediate_size=384),
              dict(layer_types=[FULL, LIN, LIN], linear_num_value_heads=8, linear_value_head_dim=32)]
    for kw in shapes:
        mcfg = ModelConfig(**{**dict(family="qwen3_5", vocab_size=512, hidden_size=256, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
                                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                                     linear_value_head_dim=48), **kw})
        torch.manual_seed(0)
        model = Transformer(mcfg)
        model.init_weights()
        model = model.to(torch.bfloat16).train()
        ids = torch.randint(0, 512, (2, 512))
        estimate = plan.activation_bytes(mcfg, ids.numel(), checkpointing=False, dtype_bytes=2)
        with monkeypatch.context() as m:
            m.setattr(gdn, "chunk_gated_delta_rule", lambda *a, incoming: FlaSaves.apply(*a))
            assert saved_bytes(model, lambda: model.hidden_states(ids)) == pytest.approx(estimate, rel=0.05), kw
        assert saved_bytes(model, lambda: model.hidden_states(ids)) > 1.2 * estimate  # the torch reference rule
        assert plan.activation_bytes(mcfg, ids.numel(), checkpointing=True, dtype_bytes=2) < estimate


@pytest.mark.parametrize("args,msg", [
    (["--config", "configs/moe_700b.py", "--ep_size=512"], r"ep_size \(512\) does not divide the number of experts \(256\)"),
    (["--config", "configs/moe_700b.py", "--activation_checkpointing=False"],
     "training needs about .* GiB per GPU, more than the 140 GiB of one GPU"),
    (["--config", "configs/moe_700b.py", "--tensor_parallel_size=4"],
     "a rollout engine cannot hold the model: .* GiB of bf16 weights per GPU"),
    (["--speculative_config={'method': 'mtp', 'num_speculative_tokens': 1}"],
     r"vLLM refuses engine option speculative_config=\{'method': 'mtp', 'num_speculative_tokens': 1\}"),
])
@pytest.mark.stack
def test_impossible_or_inconsistent_config_fails_with_one_sentence(args, msg):
    r = run_train(*args, "--dry_run=True")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert re.match(rf"dry run: .*{msg}", last), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "per-GPU memory" not in r.stdout


def tiny_cfg(**overrides):
    cfg = configure([])
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("overrides,msg", [
    (dict(ep_size=2, train_world_size=2, num_experts=0), "ep_size=2 needs a MoE model, but the model is dense"),
    (dict(ep_size=3, train_world_size=3), r"ep_size \(3\) does not divide the number of experts \(8\)"),
    (dict(groups_in_flight=2, groups_per_batch=4), r"groups_in_flight \(2\) is below groups_per_batch \(4\)"),
    (dict(max_tokens=2048, engine_max_model_len=2048), r"max_tokens \(2048\) leaves no room for the prompt"),
    (dict(engine_max_model_len=8192), r"engine_max_model_len \(8192\) is above the model's max_position_embeddings"),
    (dict(num_engines=0), r"num_engines=0 is not accepted: it must be >= 1"),
    (dict(max_failed_rounds=-1), r"max_failed_rounds=-1 is not accepted: it must be >= 0 \(0 never stops\)"),
    (dict(speculative_tokens=2), r"speculative_tokens=2 drafts with the model's MTP layers, but .* has none"),
    (dict(speculative_tokens=-1), r"speculative_tokens=-1 is not accepted: it must be >= 0"),
    (dict(mtp_loss_coef=0.1), r"mtp_loss_coef=0.1 trains the model's MTP layers, but it has none"),
    (dict(placement="shared"), r"placement='shared' is not one of separate, colocated"),
    (dict(placement="colocated", num_engines=2), r"placement='colocated' runs the trainer and one "
     "engine on one GPU: set train_world_size=1, num_engines=1"),
    (dict(placement="colocated", lora_rank=8), r"placement='colocated' .* use lora_rank=0"),
] + ([] if torch.cuda.is_available() else [
    (dict(placement="colocated"), r"placement='colocated' needs a GPU: .* sleep mode"),
]))
def test_check_config(overrides, msg):
    from tiny import TINY_CONFIG
    mcfg = dataclasses.replace(TINY_CONFIG, num_experts=overrides.pop("num_experts", TINY_CONFIG.num_experts))
    with pytest.raises(ConfigError, match=msg):
        plan.check_config(tiny_cfg(**overrides), mcfg)
    plan.check_config(tiny_cfg(), TINY_CONFIG)  # the defaults are consistent
    with pytest.raises(ConfigError, match=r"torchrun started 2 ranks"):
        plan.check_config(tiny_cfg(), TINY_CONFIG, world_size=2)


def test_fp8_keys_need_fp8_matmuls_and_fit_the_run():
    """rollout_dtype='fp8' and fp8_experts stop a run on a machine without FP8 matrix multiplies
    (a CPU) with one sentence naming the key; a dry run plans them anywhere; fp8_experts needs bf16
    compute on a MoE model without LoRA, FP8 engines a run without LoRA."""
    from tiny import TINY_CONFIG
    fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    for key, value in (("rollout_dtype", "fp8"), ("fp8_experts", True)):
        cfg = tiny_cfg(**{key: value, "param_dtype": "bfloat16"})
        if fp8_gpu:
            plan.check_config(cfg, TINY_CONFIG)
        else:
            with pytest.raises(ConfigError, match=rf"^{key}={value!r} needs FP8 matrix multiplies "
                                                  rf".* use {key}="):
                plan.check_config(cfg, TINY_CONFIG)
        plan.check_config(dict(cfg, dry_run=True), TINY_CONFIG)
    with pytest.raises(ConfigError, match=r"fp8_experts=True .* param_dtype='bfloat16'"):
        plan.check_config(tiny_cfg(fp8_experts=True, dry_run=True), TINY_CONFIG)
    with pytest.raises(ConfigError, match=r"fp8_experts=True .* needs a MoE model"):
        plan.check_config(tiny_cfg(fp8_experts=True, dry_run=True, param_dtype="bfloat16"),
                          dataclasses.replace(TINY_CONFIG, num_experts=0))
    with pytest.raises(ConfigError, match=r"rollout_dtype='fp8' with lora_rank > 0"):
        plan.check_config(tiny_cfg(rollout_dtype="fp8", dry_run=True, lora_rank=8), TINY_CONFIG)
    with pytest.raises(ConfigError, match=r"rollout_dtype='fp16' is not one of bfloat16, fp8"):
        plan.check_config(tiny_cfg(rollout_dtype="fp16"), TINY_CONFIG)


def test_speculative_tokens_turns_mtp_drafting_on_and_prefix_caching_off_on_cpu(capsys):
    from tiny import TINY_QWEN36_CONFIG
    cfg = tiny_cfg(speculative_tokens=2, model_path=".cache/tiny-qwen36-moe")
    plan.check_config(cfg, TINY_QWEN36_CONFIG)
    assert "enable_prefix_caching set to False" in capsys.readouterr().err
    options = plan.engine_options(cfg)
    assert options["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert options["enable_prefix_caching"] is False
    off = tiny_cfg(model_path=".cache/tiny-qwen36-moe")  # drafting off: prefix caching stays, no drafter
    plan.check_config(off, TINY_QWEN36_CONFIG)
    assert plan.engine_options(off)["enable_prefix_caching"] and plan.engine_options(off)["speculative_config"] is None
    with pytest.raises(ConfigError, match="speculative_tokens and speculative_config both"):
        plan.check_config(tiny_cfg(speculative_tokens=1, speculative_config={"method": "ngram"}), TINY_QWEN36_CONFIG)
    from test_train import HYBRID  # a text-only hybrid with an MTP layer: LoRA may draft, but not train the head
    if torch.cuda.is_available():  # LoRA with drafting: nothing to sync to the drafter (test_mtp_loss); not run on GPU
        plan.check_config(tiny_cfg(speculative_tokens=2, lora_rank=8), HYBRID)
    else:
        with pytest.raises(ConfigError, match=r"speculative_tokens=2 with lora_rank=8: on CPU, vLLM's LoRA engine loses"):
            plan.check_config(tiny_cfg(speculative_tokens=2, lora_rank=8), HYBRID)
    plan.check_config(tiny_cfg(lora_rank=8), HYBRID)
    plan.check_config(tiny_cfg(mtp_loss_coef=0.5), HYBRID)
    with pytest.raises(ConfigError, match=r"mtp_loss_coef=0.5 trains the model's MTP layers, but a LoRA run freezes"):
        plan.check_config(tiny_cfg(mtp_loss_coef=0.5, lora_rank=8), HYBRID)


def test_engine_receives_the_config_options(tiny_model_path):
    from engine import Engine
    cfg = tiny_cfg(engine_max_model_len=1024, engine_memory_fraction=0.3, tensor_parallel_size=2,
                   enable_prefix_caching=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    args = Engine(tiny_model_path, **plan.engine_options(cfg)).engine_args
    assert (args["max_model_len"], args["gpu_memory_utilization"], args["tensor_parallel_size"]) == (1024, 0.3, 2)
    assert args["enable_prefix_caching"] is False
    assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert Engine(tiny_model_path, **plan.engine_options(tiny_cfg())).engine_args["speculative_config"] is None


@pytest.mark.parametrize("overrides,key", [
    (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1}), "speculative_config"),  # no MTP layers
    (dict(speculative_config={"method": "no-such-method"}), "speculative_config"),
    (dict(engine_max_model_len=99999), "engine_max_model_len"),  # above the model's 4096 positions
    (dict(tensor_parallel_size=3), "tensor_parallel_size"),      # 4 attention heads
    (dict(engine_memory_fraction=1.5), "engine_memory_fraction"),
])
def test_vllm_refusal_names_the_option(tiny_model_path, overrides, key):
    with pytest.raises(ConfigError, match=rf"^vLLM refuses engine option {key}=.+: .+"):
        plan.check_engine_options(tiny_cfg(**overrides), tiny_model_path)
    plan.check_engine_options(tiny_cfg(enable_prefix_caching=False, tensor_parallel_size=2,
                                        speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                            "prompt_lookup_max": 3}), tiny_model_path)


@pytest.mark.stack
def test_real_engine_start_refuses_the_same_option(tiny_model_path):
    """check_engine_options asks the validation a real start runs: a real engine.Engine start with the refused
    option fails at once (before any worker process starts) with the same message."""
    from engine import Engine
    bad = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ConfigError) as checked:
        plan.check_engine_options(tiny_cfg(speculative_config=bad), tiny_model_path)
    engine = Engine(tiny_model_path, **plan.engine_options(tiny_cfg(speculative_config=bad)))
    with pytest.raises(Exception) as started:
        asyncio.run(engine.start())
    assert engine.llm is None
    assert str(started.value).splitlines()[0] in str(checked.value)


@pytest.mark.stack
def test_torchrun_sh_launches_and_the_world_size_check_sees_torchrun():
    env = {"NPROC_PER_NODE": "1", "MASTER_PORT": str(free_port())}
    r = subprocess.run(["./torchrun.sh", "--dry_run=True"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=child_env(**env))
    assert r.returncode == 0 and "per-GPU memory" in r.stdout, r.stderr[-3000:]
    r = subprocess.run(["./torchrun.sh", "--dry_run=True", "--train_world_size=2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=child_env(**env))
    assert r.returncode != 0
    assert "dry run: torchrun started 1 ranks (WORLD_SIZE) but train_world_size is 2" in r.stderr


def our_imports(path, ours):
    """Our top-level modules that a file imports, anywhere in it (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & ours


def import_cycle(graph):
    """A cycle of the import graph {module: the modules it imports}, as [a, b, ..., a]; None when there is none."""
    done = set()

    def visit(path):
        for n in sorted(graph[path[-1]]):
            if n in path:
                return path[path.index(n):] + [n]
            if n not in done and (found := visit(path + [n])):
                return found
        done.add(path[-1])

    return next((c for m in sorted(graph) if m not in done and (c := visit([m]))), None)


def test_imports_run_one_way():
    """No import cycle among our modules, counting imports inside functions, and plan.py reads without the trainer:
    `python train.py --dry_run=True` loads train.py once (as __main__). Control: the old plan.py's import of train
    is a cycle the check finds."""
    ours = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    graph = {m: our_imports(os.path.join(ROOT, m + ".py"), ours) - {m} for m in ours}
    assert import_cycle(graph) is None, import_cycle(graph)
    reached, todo = set(), ["plan"]
    while todo:
        m = todo.pop()
        todo += sorted(graph[m] - reached)
        reached.add(m)
    assert "train" not in reached and "train" in graph["bench"], sorted(reached)
    assert set(import_cycle(dict(graph, plan=graph["plan"] | {"train"}))) == {"plan", "train"}


def test_lora_on_a_vision_language_model_is_refused():
    """LoRA is for text models: a Qwen3-VL model with lora_rank > 0 is refused before any work, with
    the way out named; the same config on the text model, and full fine-tuning of the VLM, pass."""
    from tiny import TINY_CONFIG, TINY_VL_CONFIG
    refused = r"lora_rank > 0 is not supported for Qwen3-VL .* lora_rank=0"
    with pytest.raises(ConfigError, match=refused):
        plan.check_config(tiny_cfg(lora_rank=8), TINY_VL_CONFIG)
    plan.check_config(tiny_cfg(lora_rank=8), TINY_CONFIG)
    plan.check_config(tiny_cfg(), TINY_VL_CONFIG)
