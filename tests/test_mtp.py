"""MTP speculative decoding on the real vLLM engine (CPU): the tiny hybrid (tiny.TINY_QWEN36_CONFIG, one mtp.* layer)
served with `speculative_tokens=2` (vLLM's "mtp" method; prefix caching off, as plan.check_config forces on CPU), the
drafter kept current by the weight sync, the engine's recorded logprobs the target's.

    .venv/bin/python -m pytest tests/test_mtp.py -q       # one drafting engine
"""
import os

import pytest
import torch

import tiny
from conftest import EngineThread, starts_stack
from model import Transformer
from test_hybrid_engine import MAX_GAP, MAX_KL, MEAN_GAP, gaps, perturbed
from weights_sync import WeightSender, connect_engines, sync_weights

pytestmark = pytest.mark.stack
PATH = os.path.join(os.path.dirname(tiny.TINY_MODEL_PATH), "tiny-qwen36-moe")


@pytest.fixture(scope="module")
@starts_stack
def drafting():
    from engine import Engine
    tiny.ensure_tiny_model(PATH)
    on = EngineThread(Engine(PATH, max_model_len=1024, memory_fraction=0.3, enable_prefix_caching=False, seed=0,
                             speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    on.run(on.engine.start())
    yield on
    on.close()


def drafter_own(digest):  # the drafter's own parameters (its embed_tokens and lm_head are the target's)
    return {n: h for n, h in digest.items() if n.startswith("drafter.") and not n.endswith(("embed_tokens.weight",
                                                                                               "lm_head.weight"))}


def test_a_sync_reaches_the_drafter(drafting, tmp_path):
    """The drafter's weights read back from the engine (weights_digest) after a sync of perturbed weights: each of
    its parameters moved; after a sync of the checkpoint's weights (our model loaded from it): each is bit for bit
    what vLLM's own loader made of them at start. Negative control: vLLM's own reload of the perturbed checkpoint
    (the target's load_weights, which drops mtp.*) moves the target and leaves every drafter parameter stale."""
    run, engine = drafting.run, drafting.engine
    digest = lambda: run(engine.collective_rpc("weights_digest"))[0]
    loaded = digest()
    own = drafter_own(loaded)
    assert len(own) >= 10 and any(".experts" in n or "w13" in n for n in own), sorted(own)
    ours = Transformer.from_pretrained(PATH)
    moved = perturbed(ours)
    sender = WeightSender(bucket_bytes=1 << 20)
    try:
        assert run(connect_engines([engine], sender)) == 2
        run(sync_weights([engine], sender, moved, 1))
        after = digest()
        assert [n for n in loaded if after[n] == loaded[n]] == []  # target and drafter: every parameter moved
        gap, kl = gaps(run, engine, moved, "drafting, perturbed")
        assert gap.max() <= MAX_GAP and gap.mean() <= MEAN_GAP and kl <= MAX_KL, (gap.max(), gap.mean(), kl)

        run(sync_weights([engine], sender, ours, 2))
        assert [n for n in loaded if digest()[n] != loaded[n]] == []  # the drafter holds the trainer's weights

        moved.save_pretrained(str(tmp_path), dtype=torch.bfloat16)  # control: a sync that misses the drafter
        run(engine.collective_rpc("reload_weights", kwargs=dict(weights_path=str(tmp_path))))
        control = digest()
        assert [n for n in own if control[n] != loaded[n]] == []  # every drafter parameter stale ...
        assert any(control[n] != loaded[n] for n in loaded if not n.startswith("drafter."))  # ... the target moved
    finally:
        run(sync_weights([engine], sender, ours, 0))
        sender.close()


def test_drafted_turns_record_the_targets_logprobs_and_honour_bans(drafting):
    """With drafts at temperature 1: each recorded logprob is the target's (the engine's own prompt_logprobs of the
    same tokens, no drafting in a prefill), the turn reports its drafts, and a ban (capture's logit_bias -100, which
    vLLM refuses with drafts: engine.Engine passes it as one-token bad words) holds. Measured: gap max 0.018 nats
    here, 0.082 on another 48-token sample (bf16: a batch of 3 positions against a prefill of 64). Control: at temperature 0.7 the processed logprobs are
    not the temperature-1 ones."""
    run, engine = drafting.run, drafting.engine
    prompt = torch.randint(7, 2000, (16,), generator=torch.Generator().manual_seed(10)).tolist()
    out = run(engine.generate(prompt, dict(max_tokens=48, temperature=1.0, ignore_eos=True), "drafted"))
    target = torch.tensor(run(engine.prompt_logprobs(prompt + out["token_ids"]))[-48:])
    gap = (torch.tensor(out["logprobs"]) - target).abs()
    print(f"\ndrafted turn vs the target's prompt logprobs: max {gap.max():.4f} mean {gap.mean():.4f}, drafts {out['drafts']}")
    assert gap.max() < 0.15 and out["drafts"][1] > 0, (gap, out["drafts"])
    cool = run(engine.generate(prompt, dict(max_tokens=48, temperature=0.7, ignore_eos=True), "cool"))
    target = torch.tensor(run(engine.prompt_logprobs(prompt + cool["token_ids"]))[-48:])
    assert (torch.tensor(cool["logprobs"]) - target).abs().max() > 0.15
    greedy = run(engine.generate(prompt, dict(max_tokens=24, temperature=0.0, ignore_eos=True), "greedy"))
    ban = {t: -100 for t in greedy["token_ids"][::2]}
    for temperature in (0.0, 1.0):
        out = run(engine.generate(prompt, dict(max_tokens=24, temperature=temperature, ignore_eos=True,
                                               logit_bias=ban), f"banned{temperature}"))
        assert not set(out["token_ids"]) & set(ban)
