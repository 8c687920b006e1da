"""The hybrid Qwen3.5-MoE VLM on the real vLLM engine (CPU): a checkpoint written by transformers itself (not our
model code, in a shape the project never chose: conftest.build_hf_hybrid), served with its Gated DeltaNet state in
fp32 and prefix caching in vLLM's hybrid "align" mode; weight sync from our trainer's model into it.

    .venv/bin/python -m pytest tests/test_hybrid_engine.py -q       # one engine (conftest.hybrid_engine)
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, child_env
from model import Transformer
from weights_sync import WeightSender, connect_engines, sync_weights

pytestmark = pytest.mark.stack  # every test here serves a real engine


def fixed_sequence(n=48, seed=0):
    return torch.randint(7, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engine(hybrid_engine):
    return hybrid_engine.engine


@pytest.fixture(scope="module")
def run(hybrid_engine):
    return hybrid_engine.run  # run(coro): on the engine's own loop


def test_engine_runs_the_hybrid_cache_as_configured(engine):
    cache = engine.llm.vllm_config.cache_config
    assert cache.mamba_ssm_cache_dtype == "float32"  # the GDN state: bf16 would drift the rollout logprobs
    assert engine.engine_args["enable_prefix_caching"] and cache.mamba_cache_mode == "align"


def test_a_seeded_request_is_refused_and_the_engine_lives(run, engine):
    """Align mode needs chunked prefill, over which vLLM's CPU runner cannot rewind a seeded generator (the engine
    core died on the first seeded 1500-token prompt): such a request gets one clear error instead."""
    with pytest.raises(ValueError, match="seed"):
        run(engine.generate(fixed_sequence(1500), dict(max_tokens=4, seed=1), "seeded"))
    out = run(engine.generate(fixed_sequence(1500), dict(max_tokens=4), "unseeded"))
    assert len(out["token_ids"]) == 4


def perturbed(model):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.37).add_(0.003)  # every tensor moves, off the bf16 grid: fp32 master weights as after a step
    return model


@torch.no_grad()
def trainer_logprobs(model, ids):
    """Our model's fp32 logprob of each token of ids given the ones before it (text only)."""
    x = torch.tensor([ids])
    return F.log_softmax(model(x[:, :-1]).float(), -1).gather(-1, x[:, 1:, None])[0, :, 0]


def gaps(run, engine, model, name):
    """Engine vs trainer on the weights both hold: |logprob gap| over a fixed text, and mismatch_kl_current's k3
    (exp(d) - 1 - d, d = trainer - engine) over tokens the engine samples (4 x 48, temperature 1)."""
    ids = fixed_sequence()
    gap = (torch.tensor(run(engine.prompt_logprobs(ids))[1:]) - trainer_logprobs(model, ids)).abs()
    k3 = []
    for i in range(4):
        prompt = fixed_sequence(16, seed=10 + i)
        out = run(engine.generate(prompt, dict(max_tokens=48, temperature=1.0, ignore_eos=True), f"{name}{i}"))
        d = trainer_logprobs(model, prompt + out["token_ids"])[-48:] - torch.tensor(out["logprobs"])
        k3.append(d.exp() - 1 - d)
    kl = torch.cat(k3).mean().item()
    print(f"\nhybrid engine vs trainer ({name}): logprob gap max {gap.max():.4f} mean {gap.mean():.4f}, "
          f"mismatch_kl_current {kl:.2e}")
    return gap, kl


# engine (bf16, vLLM's CPU kernels) vs trainer (fp32 weights and compute), measured over 5 x 192 sampled tokens
# each: perturbed weights gap max 0.031 / mean 0.0025 nats, mismatch_kl_current 1.1e-5 to 3.6e-5; the checkpoint's
# weights max 0.044 / mean 0.0034, 1.8e-5 to 5.0e-5. The control (trainer on other weights): mean 0.28, kl 6.9e-2
MAX_GAP, MEAN_GAP, MAX_KL = 0.1, 0.01, 3e-4


def test_weight_sync_reaches_every_engine_parameter(run, engine, hf_hybrid_path, monkeypatch):
    """Every engine parameter, read back (weights_digest: sha256 of its bytes; a Linear repacked into vLLM's CPU GEMM
    through that kernel), against the engine's own load of the checkpoint: a sync of perturbed weights moves each,
    a sync of the checkpoint's weights (our model loaded from it, sent through weights_sync) gives back each one's
    bytes exactly. Negative control: that sync without layer 0's in_proj_z (a quarter of vLLM's stacked
    in_proj_qkvz) leaves that parameter stale. Then the engine computes the trainer's function on both (logprobs,
    mismatch_kl_current), and the check tells other weights apart."""
    def digest():
        return run(engine.collective_rpc("weights_digest"))[0]
    loaded = digest()
    ours = Transformer.from_pretrained(hf_hybrid_path)
    moved = perturbed(ours)
    sender = WeightSender(bucket_bytes=1 << 20)
    layout, left_out = sender.layout, "model.language_model.layers.0.linear_attn.in_proj_z.weight"

    def without_z(model):
        buckets, pieces = layout(model)
        for b in buckets:
            b["tensors"] = [t for t in b["tensors"] if t[0] != left_out]
        assert sum(len(b["tensors"]) for b in buckets) == sum(len(b["tensors"]) for b in layout(model)[0]) - 1
        return buckets, pieces
    try:
        assert run(connect_engines([engine], sender)) == 2
        run(sync_weights([engine], sender, moved, 1))
        after_moved = digest()
        assert sorted(after_moved) == sorted(loaded) and any("in_proj_qkvz" in n for n in loaded)
        assert [n for n in loaded if after_moved[n] == loaded[n]] == []  # every engine parameter moved
        gap, kl = gaps(run, engine, moved, "perturbed fp32")
        assert gap.max() <= MAX_GAP and gap.mean() <= MEAN_GAP and kl <= MAX_KL, (gap.max(), gap.mean(), kl)
        other, _ = gaps(run, engine, ours, "control: the trainer on the checkpoint's weights")
        assert other.mean() > 10 * MEAN_GAP, other.mean()  # the check tells the two apart

        monkeypatch.setattr(sender, "layout", without_z)
        run(sync_weights([engine], sender, ours, 2))
        partial = digest()
        assert [n for n in loaded if partial[n] != loaded[n]] == ["language_model.model.layers.0.linear_attn.in_proj_qkvz"
                                                                   ".weight"]
        monkeypatch.setattr(sender, "layout", layout)

        run(sync_weights([engine], sender, ours, 3))
        back = digest()
        assert [n for n in loaded if back[n] != loaded[n]] == []  # bit for bit what vLLM's own loader made
        gap, kl = gaps(run, engine, ours, "checkpoint")
        assert gap.max() <= MAX_GAP and gap.mean() <= MEAN_GAP and kl <= MAX_KL, (gap.max(), gap.mean(), kl)
    finally:
        monkeypatch.setattr(sender, "layout", layout)
        run(sync_weights([engine], sender, ours, 0))
        sender.close()


def test_the_transformers_checkpoint_trains_with_the_engine_agreeing(hf_hybrid_path, tmp_path):
    """`python train.py --config configs/tiny_vl.py --model_path=DIR` on the transformers-written hybrid, as a
    process (real Ray, a vLLM engine, the capture server with images, the trainer, weight sync): each step's
    mismatch_kl_current (tokens sampled with the weights the trainer holds) below 1e-3 (measured 8.0e-6 to
    1.3e-4 over three runs of 3 steps; a step whose batch holds only tokens of the previous version has none), while
    the weights move (the entropy bonus: a random model earns no reward)."""
    args = [sys.executable, "train.py", "--config", "configs/tiny_vl.py", f"--model_path={hf_hybrid_path}",
            f"--out_dir={tmp_path}", "--max_steps=2", "--eval_every=0", "--entropy_coef=0.01",
            "--save_trajectories=True", "--attempt_timeout_s=600"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=child_env())
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [1, 2] and rows[-1]["policy_version"] == 2
    assert all(row["grad_norm"] > 0 for row in rows)
    kl = [row["mismatch_kl_current"] for row in rows]
    print("\nmismatch_kl_current per step:", kl)
    assert kl[0] is not None and all(k is None or k < 1e-3 for k in kl), kl
    image_token = json.load(open(os.path.join(hf_hybrid_path, "config.json")))["image_token_id"]
    segments = [json.loads(line) for line in open(tmp_path / "trajectories.jsonl")]
    assert segments and all(seg["images"] and image_token in seg["token_ids"] for seg in segments)
