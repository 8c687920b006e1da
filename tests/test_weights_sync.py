"""Weight sync, trainer -> vLLM engine, on CPU with real components: one real engine (engine.Engine around vLLM's
AsyncLLM, shared by the engine tests), a real gloo weight group, train.py's FSDP2 + expert-parallel model on
spawned gloo ranks, and bench.py's sync benchmark in its CPU form.

    .venv/bin/python -m pytest tests/test_weights_sync.py -q        # ~2 min on 2 cores

Tolerance of engine vs trainer logprobs: both run the model in bf16 but with different CPU kernels (oneDNN GEMMs,
fused MoE, vLLM's attention), so per-token logprobs differ by rounding: we require max |diff| <= 0.05 and mean
<= 0.01 nats over a 48-token sequence (measured ~0.03 / ~0.004 after a sync; the engine and trainer disagree by
~4.5 nats mean before it).
"""
import asyncio
import copy
import dataclasses
import os
import types
from uuid import uuid4

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import end_rank
from model import Transformer, load_config, ours_to_hf
from weights_sync import (FP8_BLOCK, WeightSender, bucket_layout, connect_engines, fp8_on_wire,
                          free_port, quantize_fp8_blocks, stateless_process_group, sync_weights)
from worker import BucketReceiver, dequantize_fp8_blocks, dequantized

BUCKET_BYTES = 256 << 10  # the tiny model (3 MB in bf16) spans a dozen buckets; layers and experts get split
MAX_DIFF, MEAN_DIFF = 0.05, 0.01


def fixed_sequence(n=48, seed=0):
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def trained_model(path, ids, steps=8, seed=0):
    """The tiny model after a few Adam steps on `ids`: its logprobs of `ids` move by several nats."""
    torch.manual_seed(seed)
    model = Transformer.from_pretrained(path)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.tensor([ids])
    for _ in range(steps):
        loss = -sequence_logprobs(model, x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def sequence_logprobs(model, x):
    logits = model(x[:, :-1]).float()  # (1, T-1, V)
    return F.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1)[0]  # (T-1,)


@torch.no_grad()
def trainer_logprobs_bf16(model, ids):
    return sequence_logprobs(copy.deepcopy(model).to(torch.bfloat16), torch.tensor([ids]))

# -----------------------------------------------------------------------------
# the bucket layout (no engine)


def test_layout_covers_every_hf_tensor_once_in_bounded_buckets(tiny_model_path):
    model = Transformer.from_pretrained(tiny_model_path)
    buckets, pieces = bucket_layout(model, BUCKET_BYTES)
    hf = ours_to_hf(model.state_dict(), model.config)
    names = [t[0] for b in buckets for t in b["tensors"]]
    assert sorted(names) == sorted(hf) and len(names) == len(set(names))
    for b in buckets:
        spans = sorted((off, off + torch.Size(shape).numel() * 2) for _, dt, shape, off in b["tensors"])
        assert all(dt == "bfloat16" for _, dt, _, _ in b["tensors"])
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "tensors overlap"
        assert spans[-1][1] == b["nbytes"]
        assert b["nbytes"] <= BUCKET_BYTES or len(b["tensors"]) == 1  # only a tensor larger than a bucket exceeds it
    assert all(off % 256 == 0 for ps in pieces for _, _, _, off, _ in ps)  # each piece starts aligned
    shapes = {t[0]: t[2] for b in buckets for t in b["tensors"]}
    assert all(list(hf[n].shape) == shapes[n] for n in hf)
    split = [name for name in {p[0] for ps in pieces for p in ps} if sum(p[0] == name for ps in pieces for p in ps) > 1]
    assert any(".mlp.experts." in n for n in split), "some stacked experts should span two buckets at this size"
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_layout(model, 0)

# -----------------------------------------------------------------------------
# FP8 on the wire (no engine)


FP8_ROUND_TRIP = 0.03  # relative Frobenius error of dequantize(quantize(w)), per 128x128 block:
                       # measured 0.0256-0.0263 on Gaussian weights (e4m3: 3 mantissa bits)


def block_errors(w, d, block=FP8_BLOCK):
    """Relative Frobenius error of d against w in each block x block tile."""
    M, K = w.shape[-2:]
    tiles = [(w[..., i:i + block, j:j + block].float(), d[..., i:i + block, j:j + block].float())
             for i in range(0, M, block) for j in range(0, K, block)]
    return torch.stack([(b - a).norm() / a.norm() for a, b in tiles])


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 160, 256)])
def test_fp8_block_round_trip_is_within_the_measured_error_and_vllm_requantizes_it_exactly(shape):
    torch.manual_seed(0)
    w = torch.randn(shape).to(torch.bfloat16) * 0.02
    w[..., :FP8_BLOCK, :FP8_BLOCK] *= 1e6  # one block far larger than the rest
    q, scale = quantize_fp8_blocks(w)
    M, K = shape[-2:]
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.shape == (*shape[:-2], -(-M // FP8_BLOCK), -(-K // FP8_BLOCK))
    d = dequantize_fp8_blocks(q, scale)
    errors = block_errors(w, d)
    assert errors.max() <= FP8_ROUND_TRIP, errors
    # the worker hands the engine d in bf16 and vLLM quantizes it again: the same e4m3 values
    q2, scale2 = quantize_fp8_blocks(d)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.allclose(scale2, scale, rtol=2 ** -8)
    # negative control: one scale for the whole tensor flushes the small blocks to zero
    whole = quantize_fp8_blocks(w, block=max(M, K))
    assert block_errors(w, dequantize_fp8_blocks(*whole, block=max(M, K))).max() > 0.5


def test_fp8_layout_sends_the_projections_quantized_and_the_receiver_rebuilds_them(tiny_model_path):
    model = Transformer.from_pretrained(tiny_model_path)
    plain, _ = bucket_layout(model, BUCKET_BYTES)
    buckets, pieces = bucket_layout(model, BUCKET_BYTES, fp8=True)
    entries = [t for b in buckets for t in b["tensors"]]
    weights = [t for t in entries if not t[0].endswith("_scale_inv")]
    assert [t[0] for t in weights] == [t[0] for b in plain for t in b["tensors"]]
    quantized = {t[0] for t in weights if t[1] == "float8_e4m3fn"}
    assert quantized == {t[0] for t in weights if fp8_on_wire(t[0], t[2])}
    assert any(".mlp.experts." in n for n in quantized) and any(".q_proj." in n for n in quantized)
    assert not any("embed_tokens" in n or "lm_head" in n or n.endswith("mlp.gate.weight")
                   for n in quantized)
    for b in buckets:  # every weight's scales come next, in its bucket; nothing overlaps
        names = [t[0] for t in b["tensors"]]
        for i, (name, dtype, _, _) in enumerate(b["tensors"]):
            if dtype == "float8_e4m3fn":
                assert names[i + 1] == name.removesuffix("weight") + "weight_scale_inv"
        spans = sorted((off, off + torch.Size(shape).numel() * getattr(torch, dt).itemsize)
                       for _, dt, shape, off in b["tensors"])
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] <= b["nbytes"]
        assert b["nbytes"] <= BUCKET_BYTES or len(b["tensors"]) == 1  # a tensor larger than one
    ratio = sum(b["nbytes"] for b in buckets) / sum(b["nbytes"] for b in plain)
    assert 0.6 < ratio < 0.7, ratio  # the tiny model: a third of its bytes are embeddings + lm_head

    # the sender packs the buckets; the receiver's pairs, dequantized, are the sender's weights
    # through quantize_fp8_blocks (a loopback group in place of the broadcast)
    sent, done = [], types.SimpleNamespace(wait=lambda: None)
    sender = WeightSender(bucket_bytes=BUCKET_BYTES, device="cpu", fp8=True)
    sender.group = types.SimpleNamespace(
        broadcast=lambda buf, root: sent.append(buf.clone()) or done)
    assert sender.send(model, (buckets, pieces)) == sum(b["nbytes"] for b in buckets)
    received = iter(sent)
    group = types.SimpleNamespace(broadcast=lambda buf, root: (buf.copy_(next(received)), done)[1])
    got = dict(dequantized(BucketReceiver(group, buckets, torch.device("cpu"))))
    want = ours_to_hf({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
                      model.config)
    assert got.keys() == want.keys()
    for name, w in want.items():
        if name in quantized:
            assert torch.equal(got[name], dequantize_fp8_blocks(*quantize_fp8_blocks(w))), name
            assert not torch.equal(got[name], w), name  # control: it went through fp8
        else:
            assert torch.equal(got[name], w), name

# -----------------------------------------------------------------------------
# one real engine shared by the engine tests


@pytest.fixture(scope="module")
def loop(tiny_engine):
    """loop.run_until_complete(coro) runs coro on the shared engine's loop (tests/conftest.py)."""
    return types.SimpleNamespace(run_until_complete=tiny_engine.run)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine.engine


@pytest.fixture(scope="module")
def sender(loop, engine, tiny_model_path):
    # the sender on the host, over gloo: on a GPU machine the engine's worker shares this process's
    # GPU, where NCCL cannot join two processes (the worker receives into host buffers, then loads)
    s = WeightSender(bucket_bytes=BUCKET_BYTES, device="cpu")
    assert loop.run_until_complete(connect_engines([engine], s)) == 2  # the sender and the engine's one worker
    yield s
    # the shared engine goes back to the checkpoint's weights at version 0, for the tests that use it next
    loop.run_until_complete(sync_weights([engine], s, Transformer.from_pretrained(tiny_model_path), 0))
    s.close()


@pytest.fixture(scope="module")
def version():
    return {"now": 0}  # the engines' current policy version, advanced by each test that syncs


@pytest.mark.gpu
def test_engine_logprobs_equal_trainer_after_sync(loop, engine, sender, version, tiny_model_path):
    ids = fixed_sequence()
    model = trained_model(tiny_model_path, ids)
    want = trainer_logprobs_bf16(model, ids)
    before = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:])
    assert (before - want).abs().mean() > 1.0  # the trained weights are far from the engine's
    digest0 = loop.run_until_complete(engine.collective_rpc("weights_digest"))[0]

    version["now"] += 1
    stats = loop.run_until_complete(sync_weights([engine], sender, model, version["now"]))
    after = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:])
    diff = (after - want).abs()
    assert diff.max() <= MAX_DIFF and diff.mean() <= MEAN_DIFF, (diff.max().item(), diff.mean().item())
    assert stats["bytes"] == sum(b["nbytes"] for b in sender.layout(model)[0]) > 3_000_000

    # every one of the engine's own tensors changed (a CPU-repacked Linear read back through its GEMM kernel)
    digest1 = loop.run_until_complete(engine.collective_rpc("weights_digest"))[0]
    assert digest1.keys() == digest0.keys() and [n for n in digest0 if digest0[n] == digest1[n]] == []
    for key in ("embed_tokens", "lm_head", "w13_weight", "w2_weight", "norm", "qkv_proj", "o_proj", "gate"):
        assert any(key in n for n in digest0), key

    # sending the same weights again changes nothing (a reload must not re-process already processed weights)
    version["now"] += 1
    loop.run_until_complete(sync_weights([engine], sender, model, version["now"]))
    again = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:])
    assert torch.equal(again, after)


@pytest.mark.gpu
def test_fp8_sync_reaches_the_engine_as_the_senders_fp8_weights(loop, engine, sender, version,
                                                                tiny_model_path):
    """An fp8 sync into a bf16 engine (the CPU's; vLLM's FP8 engine is CUDA's): the worker rebuilds
    each projection from its e4m3 values and block scales, so the engine computes with
    dequantize(quantize(w)); its logprobs match the trainer's of that model as a bf16 sync's match
    the trainer's (MAX_DIFF, MEAN_DIFF), with about two thirds of the bytes (the tiny model's
    embeddings stay bf16). Control: the same model unquantized is further off."""
    ids = fixed_sequence()
    model = trained_model(tiny_model_path, ids)
    quantized = copy.deepcopy(model)
    with torch.no_grad():  # what an fp8 sync delivers: the projections through e4m3
        for name, p in quantized.named_parameters():
            if "_proj" in name:
                p.copy_(dequantize_fp8_blocks(*quantize_fp8_blocks(p.to(torch.bfloat16))))
    version["now"] += 1
    sender.fp8 = True
    try:
        stats = loop.run_until_complete(sync_weights([engine], sender, model, version["now"]))
    finally:
        sender.fp8 = False
    after = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:])
    diff = (after - trainer_logprobs_bf16(quantized, ids)).abs()
    unquantized = (after - trainer_logprobs_bf16(model, ids)).abs()
    print(f"fp8 sync: engine vs trainer's fp8 weights max {diff.max():.4f} mean {diff.mean():.4f}; "
          f"vs its bf16 weights max {unquantized.max():.4f} mean {unquantized.mean():.4f}")
    assert diff.max() <= MAX_DIFF and diff.mean() <= MEAN_DIFF, (diff.max(), diff.mean())
    assert unquantized.mean() > diff.mean()
    assert 0.6 < stats["bytes"] / sum(b["nbytes"] for b in sender.layout(model)[0]) < 0.7


@pytest.mark.gpu
@pytest.mark.parametrize("versions_by", ["vllm", "wrapper"])
def test_request_in_flight_resumes_and_carries_policy_versions(loop, engine, sender, version,
                                                               tiny_model_path, versions_by):
    """Each token's policy version, from vLLM's weight-version spans or, where a vLLM has none (or
    with them switched off here), from the wrapper's own record (engine.Engine.version_starts)."""
    if versions_by == "vllm" and not hasattr(engine.llm, "update_weight_version"):
        pytest.skip("this vLLM has no per-token weight versions: the wrapper keeps them")
    seed = 1 if versions_by == "vllm" else 6  # each case syncs other weights than the engine holds
    model = trained_model(tiny_model_path, fixed_sequence(seed=seed), steps=3)
    old, new, max_tokens = version["now"], version["now"] + 1, 200
    sampling = dict(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    seen, started = [], asyncio.Event()
    kept = engine.version_starts
    if versions_by == "wrapper":
        engine.version_starts = kept if kept is not None else {}

    async def stream():
        out = None
        async for out in engine.stream(fixed_sequence(16), sampling, "in-flight"):
            seen.append(len(out["token_ids"]))
            if seen[-1] >= 4:
                started.set()
        return out

    class RecordsPause:  # the engine, noting how many tokens the client had seen once the pause took hold
        def __getattr__(self, name):
            return getattr(engine, name)

        async def pause(self):
            await engine.pause()
            self.tokens_at_pause = seen[-1]

    async def scenario():
        request = asyncio.ensure_future(stream())
        await started.wait()
        probe = RecordsPause()
        await sync_weights([probe], sender, model, new)  # pauses while the request is generating
        return probe.tokens_at_pause, await request

    try:
        tokens_at_pause, out = loop.run_until_complete(scenario())
    finally:
        engine.version_starts = kept
    version["now"] = new
    assert len(out["token_ids"]) == max_tokens and out["finish_reason"] == "length"
    boundary = out["token_versions"].index(new)
    assert out["token_versions"] == [old] * boundary + [new] * (max_tokens - boundary)
    # the tokens streamed before the pause are the old policy's; the request went on after the sync
    assert 4 <= tokens_at_pause <= boundary < max_tokens
    # recompute_kv_on_sync (the default): after the sync the request recomputed its KV with the new weights, so each
    # later token's sampling logprob is the new policy's given everything before it, prompt and old tokens alike
    sampled = torch.tensor(out["logprobs"])
    full = fixed_sequence(16) + out["token_ids"]
    now = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(full))[16:])
    diff = (sampled - now).abs()
    assert diff[boundary:].max() <= MAX_DIFF and diff[boundary:].mean() <= MEAN_DIFF, diff[boundary:].max().item()
    assert diff[:boundary].mean() > 10 * MEAN_DIFF  # the old policy's tokens: another model


@pytest.mark.gpu
def test_sync_empties_the_prefix_cache(loop, engine, sender, version, tiny_model_path):
    """A prompt cached under the old weights is not reused under the new ones (recompute_kv_on_sync); the control, a
    sync that keeps the cache, shows the check can fail: the stale prompt KV moves the sampled tokens' logprobs."""
    assert engine.engine_args["enable_prefix_caching"] and engine.recompute_kv_on_sync
    prompt = fixed_sequence(600, seed=5)  # several KV blocks: a prefix-cache hit reuses them

    def gap_after_a_sync(seed, clear_cache):
        """Cache the prompt, sync new weights, sample 8 tokens after the prompt: |sampled - fresh| logprobs, where
        fresh is a prompt-logprobs pass (which reads no cache) under the new weights."""
        sampling = dict(max_tokens=8, seed=0, ignore_eos=True)
        loop.run_until_complete(engine.generate(prompt, sampling, uuid4().hex))  # cached under the current weights
        model = trained_model(tiny_model_path, fixed_sequence(seed=seed), steps=3)
        version["now"] += 1
        engine.recompute_kv_on_sync = clear_cache
        try:
            loop.run_until_complete(sync_weights([engine], sender, model, version["now"]))
        finally:
            engine.recompute_kv_on_sync = True
        out = loop.run_until_complete(engine.generate(prompt, sampling, uuid4().hex))
        fresh = loop.run_until_complete(engine.prompt_logprobs(prompt + out["token_ids"]))[len(prompt):]
        return (torch.tensor(out["logprobs"]) - torch.tensor(fresh)).abs()

    stale = gap_after_a_sync(2, clear_cache=False)
    emptied = gap_after_a_sync(3, clear_cache=True)
    print(f"\nafter a sync, sampled vs fresh logprobs: cache emptied max {emptied.max():.4f} mean {emptied.mean():.4f}; "
          f"cache kept (stale) max {stale.max():.4f} mean {stale.mean():.4f}")
    assert emptied.max() <= MAX_DIFF and emptied.mean() <= MEAN_DIFF, emptied
    assert stale.mean() > 10 * MEAN_DIFF, stale


@pytest.mark.gpu
def test_failed_load_resumes_engines_and_reconnect_recovers(loop, engine, sender, version, tiny_model_path,
                                                            monkeypatch):
    ids = fixed_sequence(seed=2)
    model = trained_model(tiny_model_path, ids, steps=4)
    good_layout = sender.layout

    def bad_layout(m):  # the first tensor the engine loads is a name its model does not have
        buckets, pieces = good_layout(m)
        buckets[0]["tensors"].insert(0, ["no_such_module.weight", "bfloat16", [4], 0])
        return buckets, pieces

    monkeypatch.setattr(sender, "layout", bad_layout)
    before = loop.run_until_complete(engine.prompt_logprobs(ids))
    with pytest.raises(Exception, match="no_such_module"):
        loop.run_until_complete(sync_weights([engine], sender, model, version["now"] + 1))
    monkeypatch.setattr(sender, "layout", good_layout)
    # resumed on the weights it held, version unchanged
    out = loop.run_until_complete(engine.generate(fixed_sequence(8), {"max_tokens": 3, "seed": 0}, "after-failure"))
    assert out["token_versions"] == [version["now"]] * len(out["token_ids"]) and len(out["token_ids"]) >= 1
    assert loop.run_until_complete(engine.prompt_logprobs(ids)) == before
    # the group was closed; a new one forms and the next sync lands
    loop.run_until_complete(connect_engines([engine], sender))
    version["now"] += 1
    loop.run_until_complete(sync_weights([engine], sender, model, version["now"]))
    diff = (torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:]) - trainer_logprobs_bf16(model, ids))
    assert diff.abs().max() <= MAX_DIFF and diff.abs().mean() <= MEAN_DIFF


@pytest.mark.gpu
def test_in_place_sync_hands_the_senders_buffers_to_the_engine(loop, engine, sender, version,
                                                                tiny_model_path):
    # an engine on the trainer's GPU (placement="colocated") reads each bucket from the sender's own
    # buffer: CUDA IPC handles on a GPU, shared memory here; a gloo barrier per bucket says when
    in_place = WeightSender(bucket_bytes=BUCKET_BYTES, in_place=True,
                            device=None if torch.cuda.is_available() else "cpu")  # None: this GPU
    ids = fixed_sequence(seed=3)
    model = trained_model(tiny_model_path, ids, steps=6)
    want = trainer_logprobs_bf16(model, ids)
    model.to(in_place.device)
    before = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:])
    assert (before - want).abs().mean() > 1.0  # the trained weights are far from the engine's
    try:
        assert loop.run_until_complete(connect_engines([engine], in_place)) == 2
        version["now"] += 1
        stats = loop.run_until_complete(sync_weights([engine], in_place, model, version["now"]))
        after = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids))[1:])
        diff = (after - want).abs()
        assert diff.max() <= MAX_DIFF and diff.mean() <= MEAN_DIFF, (diff.max().item(),
                                                                     diff.mean().item())
        buckets = in_place.layout(model)[0]
        assert stats["bytes"] == sum(b["nbytes"] for b in buckets) and len(buckets) > 2
    finally:
        in_place.close()
        loop.run_until_complete(connect_engines([engine], sender))  # the module's sender again

# -----------------------------------------------------------------------------
# a sharded trainer sends: FSDP2 over gloo ranks, with and without expert parallelism (train.py's model code)


def perturb_(t):
    return t.mul_(1.37).add_(0.003)  # elementwise, so it commutes with sharding; off the bf16 grid of the checkpoint


def _trainer_rank(rank, world, ep, ports, path, expert_dim):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import train
    from torch.distributed.tensor import DTensor
    train.init_distributed()
    cfg = train.configure([])
    model = train.build_model(cfg, train.build_meshes(world, ep, "cpu"), torch.device("cpu"), weights_path=path)
    with torch.no_grad():
        for p in model.parameters():
            perturb_(p.to_local() if isinstance(p, DTensor) else p)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert {p.placements[0].dim for n, p in model.named_parameters() if ".mlp.experts." in n} == {expert_dim}
    sender = WeightSender(bucket_bytes=BUCKET_BYTES)
    if rank == 0:
        sender.connect("127.0.0.1", ports[1], 2, "gloo")
    sent = sender.send(model, sender.layout(model))
    assert (sent > 0) == (rank == 0)
    sender.close()
    torch.distributed.destroy_process_group()
    end_rank()


def _receiver(ports, path, out_file):
    """Receives like an engine worker; it lays out the buckets from the unsharded model: the layout depends on global
    shapes only."""
    buckets, _ = bucket_layout(Transformer.from_pretrained(path), BUCKET_BYTES)
    group = stateless_process_group("127.0.0.1", ports[1], 1, 2, "gloo")
    got = {name: t.clone() for name, t in BucketReceiver(group, buckets, torch.device("cpu"))}
    save_file(got, out_file)
    group.shutdown()


# 3 ranks: most shards are uneven (2048 / 3, 128 / 3), the padded gather; 4 ranks with ep=2: experts come from two
# EP owners, each gathering its block from its own FSDP pair first; with 6 experts each EP rank's 3 experts do not
# split over its 2 FSDP ranks, so FSDP cuts them on dim 1 and the gather joins them on dim 1
@pytest.mark.parametrize("world,ep,num_experts", [(3, 1, 8), (4, 2, 8), (4, 2, 6)],
                         ids=["fsdp3-uneven", "fsdp4-ep2", "fsdp4-ep2-experts-cut-on-dim1"])
@pytest.mark.stack
def test_sharded_trainer_sends_the_unsharded_weights(world, ep, num_experts, tiny_model_path, tmp_path):
    path, tiny = tiny_model_path, load_config(tiny_model_path)
    if num_experts != tiny.num_experts:
        path = str(tmp_path / "model")
        torch.manual_seed(0)
        other = Transformer(dataclasses.replace(tiny, num_experts=num_experts))
        other.init_weights(0)
        other.save_pretrained(path)
    ctx = mp.get_context("spawn")
    ports = (free_port(), free_port())
    out_file = str(tmp_path / "received.safetensors")
    expert_dim = 1 if num_experts == 6 else 0
    procs = [ctx.Process(target=_trainer_rank, args=(r, world, ep, ports, path, expert_dim)) for r in range(world)]
    procs.append(ctx.Process(target=_receiver, args=(ports, path, out_file)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    model = Transformer.from_pretrained(path)
    with torch.no_grad():
        for p in model.parameters():
            perturb_(p)
    want = {k: v.to(torch.bfloat16) for k, v in ours_to_hf(model.state_dict(), model.config).items()}
    got = load_file(out_file)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]

# -----------------------------------------------------------------------------
# bench.py sync, CPU form (gloo, tiny model): the same code the GPU run uses, checked for correctness only


@pytest.mark.stack
def test_bench_sync_cpu_smoke():
    import bench
    result = bench.bench_sync("--iters=1")
    assert result["match"] is True and result["buckets"] >= 2 and result["ratio"] > 0
    assert result["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")


def test_free_port_gives_distinct_ports_below_the_ephemeral_range():
    """free_port's ports are never the kernel's own picks for outgoing connections (the ephemeral
    range), nothing is bound to them, and one process never gets the same one twice (the kernel's
    port-0 picks repeated 142 times in 2000 binds here: two servers of one test could collide)."""
    import socket
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200 and all(10000 <= p < ephemeral for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: the caller can bind it
