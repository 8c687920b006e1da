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
