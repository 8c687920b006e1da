"""The rollout half on one GPU: vLLM's GPU engine (engine.Engine) on a MoE at a real expert count,
routing replay end to end (engine -> capture server -> trainer), and a weight sync into that engine.

    make test-gpu                                      # every CUDA test, these among them
    python -m pytest tests/test_gpu_engine.py -q -s    # these alone; -s prints the figures

The model: a random Qwen3-MoE with 64 experts, top-8 (Qwen3-30B-A3B's routing: 128 experts,
top-8), hidden 512, 4 layers, ~0.2 GB in bf16 (tiny.py's tokenizer). The trainer is model.py in
bf16 on the same GPU (train.py's compute dtype there). With random weights the router's logits lie
close together: bf16 rounding that differs between vLLM's kernels and ours flips experts, which is
what routing replay exists for.
"""
import dataclasses
import os
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import EngineThread, starts_stack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="starts vLLM's GPU engine: needs CUDA")]


@pytest.fixture(scope="module")
def moe64_path():
    from tiny import TINY_CONFIG, TINY_MODEL_PATH, ensure_tiny_model
    cfg = dataclasses.replace(TINY_CONFIG, hidden_size=512, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=4, num_experts=64,
                              num_experts_per_tok=8, moe_intermediate_size=256)
    path = os.path.join(os.path.dirname(TINY_MODEL_PATH), "tiny-qwen3-moe-e64")
    return ensure_tiny_model(path, cfg)


@pytest.fixture(scope="module")
@starts_stack
def gpu_engine(moe64_path):
    from engine import Engine
    # eager: no compile or graph capture (the shared tiny engine of test_weights_sync.py runs those)
    on = EngineThread(Engine(moe64_path, max_model_len=2048, memory_fraction=0.25, seed=0,
                             enable_return_routed_experts=True, enforce_eager=True))
    on.run(on.engine.start())
    yield on
    on.close()


@pytest.fixture(scope="module")
def trainer(moe64_path):
    from model import Transformer
    return Transformer.from_pretrained(moe64_path).to("cuda", torch.bfloat16).eval()


def rollouts(gpu_engine, path, sessions=8, turns=2, max_tokens=96):
    """Agent-shaped traffic through the capture server over the GPU engine: each session a few turns
    of the openai SDK; returns the recorded segments (each with its routes)."""
    import openai

    import capture
    server = capture.CaptureServer(None, path, max_model_len=2048)
    server.backend = gpu_engine.engine
    gpu_engine.serve(server)
    segments = []
    try:
        for s in range(sessions):
            session = server.new_session()
            client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key,
                                   max_retries=0)
            messages = [{"role": "user", "content": f"Question {s}: tell me about experts."}]
            for t in range(turns):
                reply = client.chat.completions.create(model="tiny", messages=messages,
                                                       max_tokens=max_tokens, temperature=1.0,
                                                       seed=100 * s + t)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"And {t}?"}]
            segments += server.finish_session(session.id, 1.0)
    finally:
        gpu_engine.stop_serving(server)
    return segments


@torch.no_grad()
def compare(model, segments):
    """Engine vs trainer on the engine's own tokens, routing replay off and on: mismatch KL (k3, the
    estimator loss.py logs, mean over generated tokens), the fraction of (token, MoE layer) routes
    and of tokens (any layer) whose top-k expert sets differ from the engine's."""
    out = {"off": [], "on": []}
    for s in segments:
        ids = torch.tensor([s["token_ids"]], device="cuda")  # (1, T)
        engine_routes = torch.tensor([s["routed_experts"]], device="cuda")  # (1, T, L, K)
        mask = torch.tensor(s["action_mask"][1:], device="cuda").bool()
        behavior = torch.tensor(s["behavior_logprobs"][1:], device="cuda")
        for mode, replay in (("off", None), ("on", engine_routes)):
            hidden, routes = model.hidden_states(ids, routed_experts=replay, return_routes=True)
            logp = F.log_softmax(model.lm_head(hidden[:, :-1]).float(), -1)
            logp = logp.gather(-1, ids[:, 1:, None])[0, :, 0]  # (T-1,)
            d = (logp - behavior)[mask]
            # the last token's route is padding (it never ran through the engine's model)
            mine, theirs = routes[0, :-1].sort(-1).values, engine_routes[0, :-1].sort(-1).values
            same = (mine == theirs).all(-1)  # (T-1, L)
            out[mode].append(((d.exp() - 1 - d), same, routes[0, :-1], engine_routes[0, :-1]))
    figures = {}
    for mode, rows in out.items():
        k3 = torch.cat([r[0] for r in rows])
        same = torch.cat([r[1] for r in rows])  # (N, L)
        figures[mode] = dict(mismatch_kl=k3.mean().item(),
                             routes_differ=1 - same.float().mean().item(),
                             tokens_differ=1 - same.all(-1).float().mean().item(),
                             tokens=k3.numel())
    figures["replayed_routes_equal"] = all(torch.equal(r[2], r[3]) for r in out["on"])
    return figures


def test_routing_replay_makes_the_trainers_routing_the_engines(gpu_engine, moe64_path, trainer):
    segments = rollouts(gpu_engine, moe64_path)
    assert segments and all(s["routed_experts"] is not None for s in segments)
    for s in segments:  # every token has a route: (T, L_moe, K) with the model's 4 layers and top-8
        assert len(s["routed_experts"]) == len(s["token_ids"])
        assert {(len(r), len(r[0])) for r in s["routed_experts"]} == {(4, 8)}
        layers = [layer for r in s["routed_experts"] for layer in r]
        assert all(0 <= e < 64 and len(set(layer)) == 8 for layer in layers for e in layer)
    f = compare(trainer, segments)
    print(f"\nrouting replay, {f['off']['tokens']} generated tokens in {len(segments)} segments: "
          f"off {f['off']}, on {f['on']}")
    assert f["replayed_routes_equal"]  # the trainer's router used the engine's experts everywhere
    assert f["on"]["routes_differ"] == 0.0 < f["off"]["routes_differ"]
    # the engine's routes are this model's: two random top-8 sets of 64 experts almost never agree
    assert f["off"]["routes_differ"] < 0.9
    assert f["on"]["mismatch_kl"] < f["off"]["mismatch_kl"]
    # negative control: routes shifted by one token are another routing; replaying them is far worse
    shifted = [dict(s, routed_experts=s["routed_experts"][1:] + s["routed_experts"][-1:])
               for s in segments]
    assert compare(trainer, shifted)["on"]["mismatch_kl"] > 2 * f["off"]["mismatch_kl"]


def test_weight_sync_into_the_gpu_engine(gpu_engine, moe64_path, trainer):
    """The trainer's new weights reach the engine on the same GPU (a host sender over gloo: NCCL
    cannot join two processes on one GPU): the engine's sampling logprobs then match the trainer's
    with replay, and the figures give the sync's GB/s."""
    from weights_sync import WeightSender, connect_engines, sync_weights
    from model import Transformer
    loop, engine = gpu_engine.run, gpu_engine.engine
    changed = Transformer.from_pretrained(moe64_path)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.37).add_(0.003)
    new = changed.to("cuda", torch.bfloat16).eval()
    before = compare(trainer, rollouts(gpu_engine, moe64_path, sessions=4, turns=1))["on"]
    stale = compare(new, rollouts(gpu_engine, moe64_path, sessions=4, turns=1))["on"]
    sender = WeightSender(bucket_bytes=64 << 20, device="cpu")
    try:
        assert loop(connect_engines([engine], sender)) == 2
        stats = [loop(sync_weights([engine], sender, m, v)) for v, m in ((1, new), (2, new))]
        after = compare(new, rollouts(gpu_engine, moe64_path, sessions=4, turns=1))["on"]
        t0 = time.perf_counter()
        loop(sync_weights([engine], sender, trainer, 3))  # back to the checkpoint's weights
        back_s = time.perf_counter() - t0
    finally:
        sender.close()
    gbps = [s["bytes"] / s["transfer_s"] / 1e9 for s in stats]
    print(f"\nsync into the GPU engine: {stats[0]['bytes'] / 1e9:.3f} GB, transfer {gbps[0]:.2f} / "
          f"{gbps[1]:.2f} GB/s (first / second), pause-to-resume {stats[1]['pause_s']:.3f} s, "
          f"back {back_s:.3f} s; mismatch KL with replay: before {before['mismatch_kl']:.2e}, "
          f"new trainer vs old engine {stale['mismatch_kl']:.2e}, after {after['mismatch_kl']:.2e}")
    assert stale["mismatch_kl"] > 100 * before["mismatch_kl"]  # the change is visible to the check
    assert after["mismatch_kl"] < stale["mismatch_kl"] / 20
    assert stats[0]["bytes"] > 150e6


@pytest.mark.stack
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="vLLM's FP8 engine needs CUDA with FP8 matrix multiplies")
def test_fp8_engine_loads_the_fp8_sync_bit_exactly(moe64_path):
    """rollout_dtype="fp8": vLLM's online block-wise FP8 engine, synced with the projections sent
    pre-quantized (weights_sync's fp8 layout, dequantized in the worker, quantized again by vLLM's
    layerwise reload) or in bf16 (quantized by the reload alone), holds bit for bit the e4m3
    weights and scales it made from the checkpoint at start; the fp8 sync sends ~0.5x the bytes.
    Control: a changed model's sync changes every quantized weight."""
    from engine import Engine
    from model import Transformer
    from weights_sync import WeightSender, connect_engines, sync_weights
    on = EngineThread(Engine(moe64_path, max_model_len=1024, memory_fraction=0.2, seed=0,
                             rollout_dtype="fp8", enforce_eager=True))
    loop, engine = on.run, on.engine
    model = Transformer.from_pretrained(moe64_path)
    changed = Transformer.from_pretrained(moe64_path)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.37).add_(0.003)
    senders = {fp8: WeightSender(bucket_bytes=64 << 20, device="cpu", fp8=fp8)
               for fp8 in (True, False)}
    try:
        loop(engine.start())
        digest = lambda: loop(engine.collective_rpc("weights_digest"))[0]  # noqa: E731
        start = digest()
        quantized = [n for n in start if "scale" in n]
        assert any("w13" in n for n in quantized) and any("qkv" in n for n in quantized)
        stats = {}
        for v, fp8 in ((1, True), (2, False)):
            loop(connect_engines([engine], senders[fp8]))
            stats[fp8] = loop(sync_weights([engine], senders[fp8], model, v))
            after = digest()
            differ = [n for n in start if after[n] != start[n]]
            assert differ == [], f"fp8={fp8}: {len(differ)} of {len(start)} tensors differ: {differ}"
        loop(sync_weights([engine], senders[False], changed, 3))
        moved = digest()
        assert all(moved[n] != start[n] for n in quantized)
    finally:
        for s in senders.values():
            s.close()
        on.close()
    ratio = stats[True]["bytes"] / stats[False]["bytes"]
    print(f"\nfp8 sync {stats[True]['bytes'] / 1e6:.1f} MB, bf16 sync "
          f"{stats[False]['bytes'] / 1e6:.1f} MB ({ratio:.3f}x); {len(quantized)} scale tensors")
    assert ratio < 0.6
