"""LoRA adapters (lora.py): the adapted model against its merged weights, the FSDP2 + expert-parallel trainer's adapter
gradients against a single-process reference on real gloo ranks, checkpoints, the HF and PEFT exports, and a real
vLLM engine serving the adapter after a weight sync that sends the adapter alone.

    .venv/bin/python -m pytest tests/test_lora.py -q        # ~3 min on 2 cores
"""
import asyncio
import copy
import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import lora
import checkpoint
import train
from experts import experts_grouped_mm, experts_loop
from model import Transformer
from test_train import CFG, GRAD_TOL, PARAM_TOL, STEPS, check_kl_penalty, make_weights, reference_run, run_steps, \
    spawn, trainer_config, windows

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets="all")


@torch.no_grad()
def init_adapters(model, seed):
    """Fill an unsharded model's adapters with their initial values (lora.initial_adapters: each one whole)."""
    for p, full in lora.initial_adapters(model, seed):
        p.copy_(full)


def with_adapters(cfg, seed=1337):
    def prepare(model):
        lora.add_adapters(model, cfg["lora_rank"], cfg["lora_alpha"], lora.parse_targets(cfg["lora_targets"]))
        init_adapters(model, seed)
    return prepare


def test_adapted_model_equals_its_merged_weights_and_trains_the_adapters_alone():
    torch.manual_seed(0)
    base = Transformer(CFG)
    base.init_weights(0, std=0.2)
    model = copy.deepcopy(base)
    lora.add_adapters(model, 4, 8.0, lora.TARGETS)
    init_adapters(model, 0)
    x = torch.randint(0, CFG.vocab_size, (2, 10))
    torch.testing.assert_close(model(x), base(x))  # B = 0: a fresh adapter changes nothing
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    y = model(x)
    assert (y - base(x)).abs().max() > 1e-2
    merged = copy.deepcopy(base)
    merged.load_state_dict(lora.merge(model.state_dict(), 8.0 / 4))
    torch.testing.assert_close(merged(x), y, rtol=1e-5, atol=1e-5)
    y.square().mean().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, _ in model.named_parameters() if lora.is_adapter(n)}
    kinds = {n.rsplit(".", 2)[-2] if ".experts." not in n else "experts" for n in trained}
    assert kinds == set(lora.TARGETS)  # layer 1 is dense: its MLP is adapted, the MoE layers' experts too
    peft = lora.peft_tensors({n: p for n, p in model.named_parameters() if lora.is_adapter(n)})
    assert "base_model.model.model.layers.0.mlp.experts.7.down_proj.lora_B.weight" in peft
    assert "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight" in peft
    assert not any(".mlp.gate.lora" in k for k in peft)  # the router is not a target


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA"))])
def test_grouped_gemm_expert_adapters_match_the_loop_with_gradients(device):
    # the grouped path (experts.LoRAGroupedMM: gate's and up's adapters as one of rank 2r, the frozen base without
    # weight gradients) against the per-expert loop: outputs and the gradients of the adapters, of x, of the routing
    # weights
    torch.manual_seed(0)
    E, D, H, r, s = 6, 64, 96, 8, 2.0
    counts = torch.bincount(torch.randint(0, E, (300,)), minlength=E)
    counts[2] = 0  # an expert with no tokens
    N = int(counts.sum())
    base = [torch.randn(E, H, D) * 0.1, torch.randn(E, H, D) * 0.1, torch.randn(E, D, H) * 0.1]
    adapters = [t * 0.1 for ins, outs in ((D, H), (D, H), (H, D))
                for t in (torch.randn(E, r, ins), torch.randn(E, outs, r))]
    x, w = torch.randn(N, D), torch.rand(N)

    def run(fn):
        leaves = [t.to(device, torch.bfloat16).requires_grad_() for t in [x, w, *adapters]]
        g, u, d = (t.to(device, torch.bfloat16) for t in base)  # the frozen base
        out = fn(leaves[0], counts.to(device), leaves[1], g, u, d, (s, tuple(zip(leaves[2::2], leaves[3::2]))))
        out.float().square().sum().backward()
        return [out.float().cpu()] + [t.grad.float().cpu() for t in leaves]
    for name, got, want in zip(["out", "x", "scale", "A_g", "B_g", "A_u", "B_u", "A_d", "B_d"],
                               run(experts_grouped_mm), run(experts_loop)):
        assert want.abs().max() > 0, name
        torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=3e-2,
                                   msg=lambda m: f"{name}: {m}")


LOWRANK_ADD_CHECK = """
import torch, experts
torch.manual_seed(0)
for E, R, O, sizes in ((5, 8, 130, (70, 0, 64, 1, 200)), (3, 16, 256, (128, 65, 3)), (4, 4, 64, (0, 0, 10, 0))):
    counts = torch.tensor(sizes)  # experts without rows, partial tiles, sizes not multiples of the 64 x 128 tiles
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    y = torch.randn(int(counts.sum()), O).bfloat16()
    z = torch.randn(y.shape[0], 2 * R).bfloat16()[:, R:]  # a strided view, as a split of the stacked rank
    M = torch.randn(E, O, R).bfloat16().transpose(1, 2)  # (E, R, O) of B's strides, as the forward passes B^T
    want = torch.cat([y[a:b].float() + z[a:b].float() @ M[e].float() for e, (a, b) in
                      enumerate(zip([0] + offs[:-1].tolist(), offs.tolist()))])
    got = experts.lowrank_add_triton(y, z, M, offs)
    torch.testing.assert_close(got.float(), want, atol=0.06, rtol=0.02)
"""


def test_lowrank_add_kernel_matches_its_reference():
    """The Triton kernel of the adapters' full-width products runs on CUDA; checked here on CPU by Triton's
    interpreter."""
    import subprocess
    import sys
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", LOWRANK_ADD_CHECK], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=root,
                   check=True, timeout=300)


def test_bad_lora_values_fail_before_any_work(tmp_path):
    from plan import ConfigError, check_config
    weights = make_weights(str(tmp_path / "weights"))
    for overrides, words in [(dict(lora_rank=-1), "lora_rank"), (dict(lora_rank=4, lora_targets="q_proj,mlp"), "mlp"),
                             (dict(lora_rank=4, lora_alpha=0.0), "lora_alpha"), (dict(lora_rank=1024), "512")]:
        with pytest.raises(ConfigError, match=words):
            check_config(trainer_config(model_path=weights, **overrides))


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)], ids=["world2-ep2-experts-local", "world4-ep2-fsdp2"])
@pytest.mark.stack
def test_adapter_gradients_match_single_process(tmp_path, world, ep):
    weights = make_weights(str(tmp_path / "weights"))
    cfg = trainer_config(ep_size=ep, **LORA)
    wins = windows()
    spawn(world, run_steps, cfg, weights, wins, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    ref = reference_run(weights, wins, cfg, prepare=with_adapters(cfg))
    for step, (m, r) in enumerate(zip(got["metrics"], ref)):
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), step
        assert set(got["grads"][step]) == set(r["grads"]) and all(lora.is_adapter(n) for n in r["grads"])
        for name, g in r["grads"].items():
            torch.testing.assert_close(got["grads"][step][name], g, **GRAD_TOL, msg=lambda s: f"step {step} {name}: {s}")
    assert ref[-1]["grad_norm"] > 0 and any(g.abs().max() > 0 for n, g in ref[1]["grads"].items() if "lora_A" in n)
    for name, p in ref[-1]["params"].items():  # adapters trained alike, the base unchanged
        torch.testing.assert_close(got["params"][name], p, **PARAM_TOL, msg=lambda s: f"{name}: {s}")


@pytest.mark.stack
def test_kl_penalty_to_the_frozen_base_matches_single_process(tmp_path):
    """A LoRA run's reference is its own frozen base, adapters off (lora.base_only): no second copy of the weights;
    the single-process reference computes it with a plain model of the initial weights."""
    got = check_kl_penalty(tmp_path, prepare=with_adapters(trainer_config(**LORA)), **LORA)
    assert got["reference_bytes"] is None  # train.build_reference gave the model itself


def test_base_only_turns_every_adapter_off_and_back_on():
    torch.manual_seed(0)
    base = Transformer(CFG)
    base.init_weights(0, std=0.2)
    adapted = copy.deepcopy(base)
    with_adapters(trainer_config(**LORA))(adapted)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # adapters that change the model (a fresh one is zero: no control)
    x = torch.arange(24).view(2, 12) % CFG.vocab_size
    with torch.no_grad():
        want, on = base(x), adapted(x)
        with lora.base_only(adapted):
            off = adapted(x)
        again = adapted(x)
    assert (on - want).abs().max() > 0.1  # the adapters matter
    torch.testing.assert_close(off, want, rtol=0, atol=0)  # exactly the base: scaling 0 adds 0 * finite
    torch.testing.assert_close(again, on, rtol=0, atol=0)


@pytest.mark.stack
def test_lora_checkpoint_holds_the_adapters_resumes_and_exports_merged_and_peft(tmp_path):
    from transformers import AutoModelForCausalLM
    weights = make_weights(str(tmp_path / "weights"))
    wins = windows()
    ckpt, export = str(tmp_path / "run"), str(tmp_path / "hf")
    spawn(4, run_steps, trainer_config(ep_size=2, **LORA), weights, wins, str(tmp_path / "out4.pt"), 0, 2, ckpt, None,
          export)
    got4 = torch.load(tmp_path / "out4.pt", weights_only=False)
    saved = dcp.FileSystemReader(checkpoint.latest_checkpoint(ckpt)).read_metadata().state_dict_metadata
    tensors = [k for k in saved if not k.startswith("optimizer.param_groups.")]
    assert tensors and all(lora.is_adapter(k) for k in tensors)  # the adapters and their Adam state, not the base
    cfg2 = trainer_config(ep_size=1, **LORA)
    spawn(2, run_steps, cfg2, weights, wins, str(tmp_path / "out2.pt"), 0, STEPS, None, checkpoint.latest_checkpoint(ckpt))
    got2 = torch.load(tmp_path / "out2.pt", weights_only=False)
    for name, p in got4["params"].items():
        assert torch.equal(got2["resumed"]["params"][name], p), name
    ref = reference_run(weights, wins, cfg2, prepare=with_adapters(cfg2))
    for name, p in ref[2]["params"].items():
        torch.testing.assert_close(got2["params"][name], p, **PARAM_TOL, msg=lambda s: f"{name}: {s}")
    # the merged export is a plain HF model computing what the adapted trainer computed
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    x = torch.arange(2 * 10).view(2, 10) % CFG.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, got4["logits"], rtol=1e-5, atol=1e-5)
    # and the adapter alone, in PEFT's format, computes it on the base too: merged here from its two files alone
    # (adapter_config.json's r and lora_alpha, W + alpha / r * B @ A on the base checkpoint's tensors), not by lora.py
    adapter = load_file(os.path.join(export, "adapter", "adapter_model.safetensors"))
    with open(os.path.join(export, "adapter", "adapter_config.json")) as f:
        peft = json.load(f)
    ours = {n: got4["params"][n] for n in got4["params"] if lora.is_adapter(n)}
    assert adapter.keys() == lora.peft_tensors(ours).keys()
    base = load_file(os.path.join(weights, "model.safetensors"))
    merged = dict(base)
    for a in (k for k in adapter if ".lora_A." in k):
        w = a.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        merged[w] = base[w] + peft["lora_alpha"] / peft["r"] * adapter[a.replace(".lora_A.", ".lora_B.")] @ adapter[a]
    assert sum(not torch.equal(merged[k], base[k]) for k in base) == len(adapter) // 2  # every adapted weight moved
    by_hand = str(tmp_path / "by_hand")
    shutil.copytree(weights, by_hand)
    save_file(merged, os.path.join(by_hand, "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        peft_logits = AutoModelForCausalLM.from_pretrained(by_hand, dtype=torch.float32).eval()(x).logits
        base_logits = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()(x).logits
    torch.testing.assert_close(peft_logits, got4["logits"], rtol=1e-5, atol=1e-5)
    assert (base_logits - got4["logits"]).abs().max() > 1e-2  # the control: without the adapter it differs

# -----------------------------------------------------------------------------
# a real engine serving the adapter


MAX_DIFF, MEAN_DIFF = 0.05, 0.01  # as tests/test_weights_sync.py: bf16 on two sets of CPU kernels
# vLLM's GPU kernels (bf16, the adapters applied by its punica LoRA kernels) against ours: on an
# H100, max 0.053 and mean 0.0065 over the 47 predicted tokens; the mean bound stays the CPU's
MAX_DIFF_CUDA = 0.08


@pytest.mark.stack
@pytest.mark.gpu
def test_engine_serves_the_synced_adapter_and_matches_the_trainer(tmp_path, tiny_model_path):
    from engine import Engine
    from model import load_config
    from test_weights_sync import fixed_sequence, sequence_logprobs
    from weights_sync import ALIGN, WeightSender, connect_engines, sync_weights
    cfg = trainer_config(model_path=tiny_model_path, out_dir=str(tmp_path), lora_rank=8, lora_alpha=16.0)
    options = train.plan.engine_options(cfg)
    lora.write_zero_adapter(options["lora_path"], load_config(tiny_model_path), cfg)
    assert options["lora_target_modules"] == ["o_proj", "qkv_proj"]  # the tiny model is all MoE: no dense MLP
    ids = fixed_sequence()
    torch.manual_seed(0)  # the trainer: adapters on every target, a few Adam steps on `ids`
    model = Transformer.from_pretrained(tiny_model_path)
    with_adapters(cfg)(model)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(8):
        opt.zero_grad()
        (-sequence_logprobs(model, torch.tensor([ids])).mean()).backward()
        opt.step()
    with torch.no_grad():
        want = sequence_logprobs(copy.deepcopy(model).to(torch.bfloat16), torch.tensor([ids]))
    loop = asyncio.new_event_loop()
    engine = Engine(tiny_model_path, **{**options, "max_model_len": 1024})
    # on the host, over gloo: a GPU engine's worker shares this GPU (NCCL cannot join two processes)
    sender = WeightSender(bucket_bytes=64 << 10, adapter=lora.peft_config(8, 16.0, lora.TARGETS),
                          device="cpu")
    try:
        loop.run_until_complete(engine.start())
        before = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:])
        assert (before - want).abs().mean() > 1.0
        loop.run_until_complete(connect_engines([engine], sender))
        stats = loop.run_until_complete(sync_weights([engine], sender, model, 1))
        after = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:])
        full = sum(2 * p.numel() for n, p in model.named_parameters() if not lora.is_adapter(n))
        adapters = sum(4 * p.numel() for n, p in model.named_parameters() if lora.is_adapter(n))
        # the adapters alone travel: every adapter tensor in PEFT names (experts split one per expert), nothing of
        # the base, in fp32, plus at most the alignment padding of each tensor in its bucket
        sent = [t for bucket in sender.layout(model)[0] for t in bucket["tensors"]]
        peft = lora.peft_tensors({n: p for n, p in model.named_parameters() if lora.is_adapter(n)})
        assert sorted(t[0] for t in sent) == sorted(peft) and {t[1] for t in sent} == {"float32"}
        assert adapters <= stats["bytes"] < adapters + ALIGN * len(sent) < full
        d = want - after
        print(f"\nLoRA sync: {stats['bytes']} bytes (full weights {full}), engine vs trainer max |d| "
              f"{d.abs().max():.4f} mean {d.abs().mean():.4f}, KL estimate {(d.exp() - 1 - d).mean():.2e}")
        bound = MAX_DIFF_CUDA if torch.cuda.is_available() else MAX_DIFF
        assert d.abs().max() <= bound and d.abs().mean() <= MEAN_DIFF, (d.abs().max(), d.abs().mean())
        # a second sync of new adapters replaces the first (no stale adapter, no double merge of the experts)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.5)
            want2 = sequence_logprobs(copy.deepcopy(model).to(torch.bfloat16), torch.tensor([ids]))
        loop.run_until_complete(sync_weights([engine], sender, model, 2))
        after2 = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:])
        assert (after2 - want2).abs().mean() <= MEAN_DIFF and (after2 - after).abs().mean() > 10 * MEAN_DIFF
        out = loop.run_until_complete(engine.generate(ids[:8], dict(max_tokens=4, temperature=1.0), "r1"))
        assert out["token_versions"] == [2] * len(out["token_ids"])
    finally:
        sender.close()
        loop.run_until_complete(engine.shutdown())
        loop.close()


@pytest.mark.stack
def test_dry_run_plans_a_lora_run():
    from test_dry_run import dry_run_output, gib, run_train
    full = dry_run_output("qwen3_30b_a3b")
    r = run_train("--config", "configs/qwen3_30b_a3b.py", "--dry_run=True", "--lora_rank=8")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "LoRA rank 8" in out and "engine options: accepted by vLLM" in out
    sync = lambda text: float(re.search(r"weight sync per step: ([\d.]+) GB", text).group(1))  # noqa: E731
    # rank-8 adapters on every target of Qwen3-30B-A3B: (r * (in + out)) per adapted matrix, in fp32
    cfg = train.configure(["--config", "configs/qwen3_30b_a3b.py", "--lora_rank=8", "--dry_run=True"])
    mcfg = train.plan.planned_model_config(cfg)
    D, H, hd = mcfg.hidden_size, mcfg.moe_intermediate_size, mcfg.head_dim
    attn = 8 * ((D + mcfg.num_attention_heads * hd) * 2 + 2 * (D + mcfg.num_key_value_heads * hd))
    experts = mcfg.num_experts * 3 * 8 * (D + H)
    assert sync(out) == pytest.approx(4 * mcfg.num_hidden_layers * (attn + experts) / 1e9, abs=0.01)
    assert sync(out) < sync(full) / 30
    assert gib(out, "optimizer") < gib(full, "optimizer") / 20 and gib(out, "parameters") < gib(full, "parameters")
