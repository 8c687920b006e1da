"""The Qwen3.5 / Qwen3.6 hybrid (Gated DeltaNet, gated attention, shared expert, vision without deepstack, MTP
weights) against transformers' qwen3_5_moe in fp32 on random weights; packed rows against each sequence alone;
checkpoints; fla's kernel against the torch reference (CUDA only).

    .venv/bin/python -m pytest tests/test_hybrid.py -q
"""
import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from gdn import GatedDeltaNet, chunk_gated_delta_rule_torch, fla_chunk_gated_delta_rule
from model import ModelConfig, Transformer, VisionConfig, hf_to_ours
from tiny import TINY_QWEN36_CONFIG

# a shape the tiny model does not have: 6 layers in an irregular pattern, 3 value heads per key head, rotary 8 of 32
VISION = VisionConfig(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=96, patch_size=4,
                      num_position_embeddings=64, deepstack_visual_indexes=[], image_token_id=500, video_token_id=501,
                      vision_start_token_id=502, vision_end_token_id=503)
LINEAR, FULL = "linear_attention", "full_attention"
HYBRID = ModelConfig(
    family="qwen3_5", vocab_size=512, hidden_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
    layer_types=[LINEAR, FULL, LINEAR, LINEAR, LINEAR, FULL], linear_num_key_heads=2, linear_num_value_heads=6,
    linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
    moe_intermediate_size=40, shared_expert_intermediate_size=56, mtp_num_hidden_layers=1, vision=VISION)
TEXT_ONLY = ModelConfig(**{**HYBRID.__dict__, "vision": None, "mrope_section": [2, 1, 1]})
GRIDS = [[(1, 4, 6), (1, 10, 8)], [(1, 2, 2), (1, 14, 20), (1, 6, 4)]]  # in patches: several sizes, one merged token


def random_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = Transformer(cfg)
    m.init_weights(seed, std=0.1)
    with torch.no_grad():  # non-trivial norms so that a wrong norm placement or a missing (1 + w) would show
        for n, p in m.named_parameters():
            if "norm" in n.rsplit(".", 2)[-2]:
                p.uniform_(-0.5, 0.5) if n.endswith("weight") else p.uniform_(-0.2, 0.2)
    return m


def image_rows(vc, grids, seed=0):
    """Per row: token ids with images in them (vision_start, the image's tokens, vision_end), and the images' grids."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in grids:
        ids = []
        for t, h, w in row:
            ids += torch.randint(0, 400, (3,), generator=g).tolist() + [vc.vision_start_token_id]
            ids += [vc.image_token_id] * (t * h * w // vc.spatial_merge_size ** 2) + [vc.vision_end_token_id]
        rows.append(ids + torch.randint(0, 400, (5,), generator=g).tolist())
    return rows


def pixels(vc, grids, seed=0):
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    return torch.randn(sum(t * h * w for t, h, w in grids), patch, generator=torch.Generator().manual_seed(seed))


def padded(rows):
    T = max(map(len, rows))
    return torch.tensor([r + [0] * (T - len(r)) for r in rows])


def hf_model(cfg, path):
    import transformers
    cls = transformers.Qwen3_5MoeForConditionalGeneration if cfg.vision else transformers.Qwen3_5MoeForCausalLM
    hf, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return hf


def assert_close_rel(got, want, what, rel=1e-5):
    """Within rel of the tensor's largest entry: fp32 sums over a few hundred tokens and logits."""
    assert want.abs().max() > 0, what
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"{what}: max |diff| {err:.2e}, max |want| {want.abs().max():.2e}"


def fp64_transformers_rule(monkeypatch):
    """transformers' torch Gated DeltaNet with its fp32 casts made fp64 (its own fp32 steps elsewhere follow x)."""
    import inspect
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M
    namespace = dict(M.__dict__)
    exec(inspect.getsource(M.torch_chunk_gated_delta_rule).replace("torch.float32", "torch.float64"), namespace)
    monkeypatch.setattr(M, "torch_chunk_gated_delta_rule", namespace["torch_chunk_gated_delta_rule"])


def logits_and_grads(model, input_ids, probe, hf=False, **kw):
    if hf:
        kw["mm_token_type_ids"] = (input_ids == VISION.image_token_id).int()
    out = model(input_ids=input_ids, **kw).logits if hf else model(input_ids, **kw)
    (out * probe.to(out.dtype)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), (hf_to_ours(grads, HYBRID) if hf else grads)


def max_rel(got, want):
    return max(((got[n].double() - want[n].double()).abs().max() / want[n].abs().max()).item() for n in want)


@pytest.mark.parametrize("images", [False, True], ids=["text", "images"])
def test_logits_and_every_gradient_match_transformers(images, tmp_path, monkeypatch):
    """fp32 on both sides: logits within 1e-5 of their largest (measured 4.4e-6 text, 6.3e-6 images), gradients
    within 1e-4 of each tensor's largest (measured 4.3e-5 text, 8.3e-5 images; median 8e-6). 1e-5 cannot be asked of
    fp32 gradients here: each side's fp32 gradients lie that far from its own fp64 ones (the exact function: the two
    agree to 5e-14 in fp64, test_fp64_logits_and_every_gradient_equal_transformers), transformers' up to 4.6e-5 (text)
    and ours no farther (6.3e-5 text, measured): the A_log / in_proj_a gradients sum many cancelling terms. So the
    test also asserts that our fp32 rounds no more than transformers' own, within 1.5x of its largest error."""
    ours = random_model(HYBRID)
    ours.save_pretrained(tmp_path)
    hf = hf_model(HYBRID, tmp_path)
    flat = [thw for row in GRIDS for thw in row]
    input_ids = padded(image_rows(VISION, GRIDS) if images else [list(range(7, 90)), list(range(200, 260))])
    kw = dict(pixel_values=pixels(VISION, flat), image_grid_thw=torch.tensor(flat)) if images else {}
    probe = torch.randn(*input_ids.shape, HYBRID.vocab_size, generator=torch.Generator().manual_seed(1))
    logits, mine = logits_and_grads(ours, input_ids, probe, **kw)
    ref, theirs = logits_and_grads(hf, input_ids, probe, hf=True, **kw)
    assert_close_rel(logits, ref, "logits")
    expected = {n for n, _ in ours.named_parameters() if not n.startswith("mtp.") and (images or "visual." not in n)}
    assert set(mine) == set(theirs) == expected
    for name in mine:
        assert_close_rel(mine[name], theirs[name], name, rel=1e-4)
    # each side's fp32 rounding, against its own fp64 run
    kw64 = {k: v.double() if v.is_floating_point() else v for k, v in kw.items()}
    fp64_transformers_rule(monkeypatch)
    hf64 = type(hf).from_pretrained(tmp_path, dtype=torch.float32, experts_implementation="eager").double()
    theirs_exact = logits_and_grads(hf64, input_ids, probe, hf=True, **kw64)[1]
    fp64_throughout(monkeypatch)
    ours.zero_grad()
    mine_exact = logits_and_grads(ours.double(), input_ids, probe, **kw64)[1]
    ours_error, theirs_error = max_rel(mine, mine_exact), max_rel(theirs, theirs_exact)
    print(f"fp32 gradients from fp64: ours {ours_error:.1e}, transformers {theirs_error:.1e}")
    assert 1e-6 < ours_error <= 1.5 * theirs_error, (ours_error, theirs_error)


def test_fp64_logits_and_every_gradient_equal_transformers(tmp_path, monkeypatch):
    """In fp64 (transformers' Gated DeltaNet with its fp32 casts made fp64, its experts in their eager form, which
    runs fp64) our text model is transformers' function op for op: logits and every gradient within 1e-10 of their
    largest (measured: logits equal, gradients 5e-14). The fp32 run's 4e-5 would fail this bound. With images the
    fp64 towers differ by 2e-8 (some fp32 step of a position table on one side), which the gradients carry to 1e-5."""
    import transformers
    fp64_transformers_rule(monkeypatch)
    ours = random_model(HYBRID)
    ours.save_pretrained(tmp_path)
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32,
                                                                          experts_implementation="eager")
    ours.double(), hf.double()
    input_ids = padded([list(range(7, 90)), list(range(200, 260))])
    probe = torch.randn(*input_ids.shape, HYBRID.vocab_size, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64)
    logits, ref = ours(input_ids), hf(input_ids=input_ids).logits
    assert logits.dtype == ref.dtype == torch.float64
    assert_close_rel(logits, ref, "fp64 logits", rel=1e-10)
    (logits * probe).sum().backward()
    (ref * probe).sum().backward()
    theirs = hf_to_ours({n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, HYBRID)
    mine = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert set(mine) == set(theirs) and any("linear_attn.A_log" in n for n in mine)
    for name in mine:
        # q_norm and k_norm: both sides cast the zero-centred weight with .float() (transformers' Qwen3_5RMSNorm too),
        # so its gradient is an fp32 sum over tokens and heads, whose order follows each side's memory layout (ours
        # is token-major for SDPA): measured 1.6e-7 of the largest
        fp32_sum = name.endswith(("q_norm.weight", "k_norm.weight"))
        assert_close_rel(mine[name], theirs[name], name, rel=1e-6 if fp32_sum else 1e-10)


def fp64_throughout(monkeypatch):
    """Make the model's deliberate fp32 steps (norms, router softmax, rotary tables: `.float()`, `.to(float32)`,
    softmax's dtype) keep fp64 tensors fp64, so that an fp64 run rounds nowhere at fp32."""
    import model
    to, to_float, softmax, cos_sin = torch.Tensor.to, torch.Tensor.float, F.softmax, model.rope_cos_sin
    def wide(x):
        return x.dtype == torch.float64
    monkeypatch.setattr(torch.Tensor, "float", lambda x, *a, **k: x if wide(x) else to_float(x, *a, **k))
    monkeypatch.setattr(torch.Tensor, "to", lambda x, *a, **k: x if wide(x) and (torch.float32 in a or k.get(
        "dtype") == torch.float32) else to(x, *a, **k))
    monkeypatch.setattr(model.F, "softmax", lambda x, dim=None, dtype=None: softmax(x, dim, dtype=None if wide(x)
                                                                                      else dtype))
    monkeypatch.setattr(model, "rope_cos_sin", lambda freqs, dtype: cos_sin(freqs, torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_packed_rows_match_each_sequence_alone(dtype, monkeypatch):
    """Three sequences (two with images) packed into one row with segment_ids: logits and gradients equal those of
    each sequence run alone. Without the segments the conv and the delta rule would carry state across. fp32:
    logits within 1e-5, gradients within 1e-4 of each tensor's largest (the same sums in another order, rounded in
    fp32: measured 5.5e-6 and 3.8e-5); in fp64 throughout both within 1e-10 (measured 2.2e-15 and 6.2e-14: the
    same function; with the model's fp32 steps left in, fp64 gives 4.6e-8 and 1.1e-6, their rounding)."""
    if dtype == torch.float64:
        fp64_throughout(monkeypatch)
    model = random_model(HYBRID).to(dtype)
    tol = dict(logits=1e-5, grads=1e-4) if dtype == torch.float32 else dict(logits=1e-10, grads=1e-10)
    grids = [[(1, 4, 6)], [], [(1, 2, 2), (1, 6, 4)]]
    seqs = [image_rows(VISION, [g], seed=i)[0] for i, g in enumerate(grids)]
    seqs[1] = seqs[1][:40] + list(range(10, 80))  # a text segment longer than a chunk of the delta rule (64)
    probes = [torch.randn(len(s), HYBRID.vocab_size, generator=torch.Generator().manual_seed(i), dtype=dtype)
              for i, s in enumerate(seqs)]
    alone, grads_alone = [], {}
    for s, g, probe in zip(seqs, grids, probes):
        kw = dict(pixel_values=pixels(VISION, g).to(dtype), image_grid_thw=torch.tensor(g)) if g else {}
        out = model(torch.tensor([s]), **kw)[0]
        (out * probe).sum().backward()
        alone.append(out.detach())
    grads_alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    flat = [thw for g in grids for thw in g]
    ids = torch.tensor([sum(seqs, [])])
    segment_ids = torch.tensor([[i for i, s in enumerate(seqs) for _ in s]])
    pv = torch.cat([pixels(VISION, g) for g in grids if g]).to(dtype)
    out = model(ids, pixel_values=pv, image_grid_thw=torch.tensor(flat), segment_ids=segment_ids)[0]
    (out * torch.cat(probes)).sum().backward()
    assert_close_rel(out, torch.cat(alone), "packed logits", rel=tol["logits"])
    for n, p in model.named_parameters():
        if n in grads_alone:
            assert_close_rel(p.grad, grads_alone[n], n, rel=tol["grads"])
    # negative control: the same row without its segments is a different function
    leaky = model(ids, pixel_values=pv, image_grid_thw=torch.tensor(flat))
    assert (leaky[0, len(seqs[0]):] - torch.cat(alone[1:])).abs().max() > 1e-2


def recurrence(q, k, v, g, beta):
    """The gated delta rule token by token (one segment, (T, H, d) each, fp64): the definition."""
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # fla's l2norm, eps 1e-6
    q = q * q.shape[-1] ** -0.5
    state, out = q.new_zeros(q.shape[1], q.shape[2], v.shape[2]), []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out)


def test_chunked_rule_is_the_recurrence():
    """In fp64 the chunked form over packed segments equals the token-by-token recurrence run on each segment from
    a zero state (to 1e-10): the algorithm and the segment restarts are exact, whatever fp32 rounds."""
    gen = torch.Generator().manual_seed(0)
    lengths, H, dk, dv = [70, 1, 5, 130], 3, 8, 6
    N = sum(lengths)
    q, k = torch.randn(2, 1, N, H, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(1, N, H, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, N, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, N, H, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got = chunk_gated_delta_rule_torch(q, k, v, g, beta, cu)[0]
    want = torch.cat([recurrence(*(t[0, a:b] for t in (q, k, v, g, beta))) for a, b in zip(cu[:-1], cu[1:])])
    assert (got - want).abs().max() < 1e-10
    run_on = torch.cat([recurrence(*(t[0] for t in (q, k, v, g, beta)))])  # negative control: no restarts
    assert (run_on[70:] - want[70:]).abs().max() > 1e-3


def test_gdn_layer_restarts_at_segment_boundaries():
    """The GDN layer alone against transformers' on each segment (its torch fallback runs one sequence at a time)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
    from transformers import Qwen3_5MoeTextConfig
    hc = Qwen3_5MoeTextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                              linear_value_head_dim=16, num_hidden_layers=1, layer_types=[LINEAR])
    torch.manual_seed(0)
    ref = Qwen3_5MoeGatedDeltaNet(hc, 0)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ours = GatedDeltaNet(ModelConfig(**{k: getattr(hc, k) for k in ("hidden_size", "linear_num_key_heads",
                                       "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")}))
    ours.load_state_dict(ref.state_dict())
    lengths = [100, 1, 3, 70]  # across chunk boundaries, shorter than the conv kernel
    x = torch.randn(1, sum(lengths), 64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    want = torch.cat([ref(s) for s in x.split(lengths, 1)], 1)
    assert_close_rel(ours(x, cu), want, "packed GDN")


def test_checkpoint_layout_sharded_round_trip_and_mtp(tmp_path):
    m = random_model(HYBRID)
    m.save_pretrained(tmp_path, max_shard_bytes=200_000)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]
    assert len(set(index.values())) > 1  # sharded
    hf = json.load(open(tmp_path / "config.json"))
    assert hf["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert hf["text_config"]["layer_types"] == HYBRID.layer_types
    for name in ("model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
                 "model.language_model.layers.0.linear_attn.A_log", "model.language_model.layers.0.linear_attn.conv1d.weight",
                 "model.language_model.layers.1.self_attn.q_proj.weight",
                 "model.language_model.layers.1.mlp.shared_expert_gate.weight",
                 "model.language_model.layers.1.mlp.experts.5.down_proj.weight", "model.visual.merger.linear_fc2.weight",
                 "mtp.fc.weight", "mtp.layers.0.mlp.experts.0.gate_proj.weight", "mtp.norm.weight", "lm_head.weight"):
        assert name in index, name
    assert not any("deepstack" in k for k in index)
    m2 = Transformer.from_pretrained(tmp_path)
    assert m2.config == HYBRID
    sd2 = m2.state_dict()
    for n, t in m.state_dict().items():
        assert torch.equal(t, sd2[n]), n


def test_text_only_causal_lm_checkpoint_loads(tmp_path):
    """A Qwen3_5MoeForCausalLM directory written by transformers (its own layout: fused experts) loads and computes
    transformers' logits; our save of it loads back in transformers."""
    import transformers
    ours = random_model(TEXT_ONLY)
    ours.save_pretrained(tmp_path / "ours")
    hf = hf_model(TEXT_ONLY, tmp_path / "ours")
    hf.save_pretrained(tmp_path / "theirs")
    theirs = Transformer.from_pretrained(tmp_path / "theirs")
    assert theirs.config.layer_types == TEXT_ONLY.layer_types and theirs.config.vision is None
    ids = torch.randint(0, 500, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close_rel(theirs(ids), hf(input_ids=ids).logits, "text-only logits")
    assert isinstance(hf, transformers.Qwen3_5MoeForCausalLM)


def test_tiny_hybrid_config_round_trips():
    hf = TINY_QWEN36_CONFIG.to_hf()
    assert ModelConfig.from_hf(json.loads(json.dumps(hf))) == TINY_QWEN36_CONFIG
    assert TINY_QWEN36_CONFIG.head_dim == TINY_QWEN36_CONFIG.linear_key_head_dim == 64  # vLLM's CPU kernels
    kinds = TINY_QWEN36_CONFIG.layer_types
    assert set(kinds) == {LINEAR, FULL} and kinds != [LINEAR, LINEAR, LINEAR, FULL] * (len(kinds) // 4)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels compute on CUDA only")
# fla-core: a GPU install's (docs/gpu.md); Hopper with Triton < 3.7.1 needs tilelang too
FLA = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="no fla-core here")
SEGMENTS = [1000, 1, 63, 65, 2967]  # packed: a segment of one token, chunk edges, a long one
# max |diff| over the reference's max |value|, of the output and of every gradient, and of the sum a decay parameter's
# gradient takes (sum_t dg_t g_t per head: A_log's). Measured on an H200 (torch 2.11, Triton 3.6, fla-core 0.6.0 with
# tilelang 0.1.15), fla against the fp64 reference: bf16 7.1e-3 (mild decay) and 7.5e-3 (strong), A_log's sum
# 4.6e-3 / 3.8e-3; the layer (bf16) 1.4e-2 (dx).
FLA_RULE_REL = {torch.float32: 5e-3, torch.bfloat16: 2e-2}
FLA_LAYER_REL = {torch.float32: 5e-3, torch.bfloat16: 2e-2}
# fla's fp32 backward, which gdn.py does not use: output and every gradient within 2.1e-3, but A_log's sum 8.0e-3 off
# at mild decay and 0.63 at strong. dg's error is small against its largest value yet does not shrink with a token's
# own (median per-token error 43x the value at the layer test's 4 heads) and adds up over the tokens; fla's bf16 path
# does not do it (above), nor the reference in fp32 with TF32 matmuls (3.2e-4): not rounding, not cancellation.
FLA_FP32 = pytest.mark.xfail(strict=True, reason="fla-core 0.6.0's fp32 backward: the log decay's gradient is wrong")


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def rule_inputs(dtype, g, strong, Hk=16, H=32, dk=128, dv=128):
    """The delta rule's inputs at 35B-A3B's head counts (16 key heads, each shared by 2 of the 32 value heads); the
    log decay <= 0 in fp32 as the layer makes it, mild (-softplus(a) / 2) or strong (-A softplus(a + 1), A in [1, 16]
    as exp(A_log) of the layer test and of trained checkpoints' fast heads)."""
    N = sum(SEGMENTS)
    q, k = (torch.randn(1, N, Hk, dk, device="cuda", generator=g).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, N, H, dv, device="cuda", generator=g).to(dtype).requires_grad_()
    a = torch.randn(1, N, H, device="cuda", generator=g)
    A = 1 + 15 * torch.rand(H, device="cuda", generator=g)
    gate = (-A * F.softplus(a + 1) if strong else -F.softplus(a) * 0.5).requires_grad_()
    beta = torch.rand(1, N, H, device="cuda", generator=g).to(dtype).requires_grad_()
    return q, k, v, gate, beta


@CUDA
@FLA
@pytest.mark.parametrize("dtype,strong", [pytest.param(torch.float32, False, marks=FLA_FP32),
                                          pytest.param(torch.float32, True, marks=FLA_FP32),
                                          (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32", "fp32-strong", "bf16", "bf16-strong"])
def test_fla_matches_the_torch_reference(dtype, strong):
    """fla's chunk_gated_delta_rule (varlen, key heads shared by value heads) against the fp64 reference on the same
    (rounded) inputs, forward and backward, on packed segments of several lengths. Negative control (mild decay):
    the reference run with the segments merged (state leaking across their boundaries) is far outside the
    tolerance."""
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(SEGMENTS).cumsum(0).tolist()], device="cuda")
    inputs = rule_inputs(dtype, g, strong)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    probe = torch.randn(*inputs[2].shape, device="cuda", generator=g)
    outs, grads = [], []
    for fn, args, c in ((fla_chunk_gated_delta_rule, inputs, cu), (chunk_gated_delta_rule_torch, exact, cu),
                        (chunk_gated_delta_rule_torch, exact, cu[[0, -1]])):
        out = fn(*args, c)
        grads.append(torch.autograd.grad((out.double() * probe).sum(), args))
        outs.append(out.double())
    rel = FLA_RULE_REL[dtype]
    errs = {"out": rel_err(outs[0], outs[1])} | {"d" + n: rel_err(a, b) for n, a, b in
                                                  zip(["q", "k", "v", "g", "beta"], *grads[:2])}
    gate = exact[3].detach()
    errs["dA_log"] = rel_err((grads[0][3].double() * gate).sum((0, 1)), (grads[1][3] * gate).sum((0, 1)))
    print(dtype, strong, {k: f"{e:.1e}" for k, e in errs.items()})
    assert max(errs.values()) <= rel, errs
    if not strong:  # the control: merged segments (a strong decay forgets the previous segment within a few tokens)
        assert rel_err(outs[2], outs[1]) > 10 * FLA_RULE_REL[torch.bfloat16]


@CUDA
@FLA
def test_fla_under_context_parallelism_matches_the_reference():
    """Context parallelism's delta rule on fla (gdn.fla_chunk_gated_delta_rule with `incoming`:
    each segment's final state and transition made by fla, then a pass from the start states)
    against the fp64 reference with the same `incoming`, bf16, forward and backward. `incoming`
    here chains the segments as pieces of one sequence from a random start state, as
    gdn.incoming_states chains the ranks' pieces. Negative control: fla from zero start states."""
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(SEGMENTS).cumsum(0).tolist()], device="cuda")
    inputs = rule_inputs(torch.bfloat16, g, False)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    start = torch.randn(32, 128, 128, device="cuda", generator=g) * 0.1
    probe = torch.randn(*inputs[2].shape, device="cuda", generator=g)

    def chained(final, transition):  # (S, H, dk, dv), (S, H, dk, dk) -> each segment's start
        state, starts = start.to(final.dtype), []
        for p in range(final.shape[0]):
            starts.append(state)
            state = transition[p] @ state + final[p]
        return torch.stack(starts)
    outs, grads = [], []
    for fn, args in ((fla_chunk_gated_delta_rule, inputs),
                     (chunk_gated_delta_rule_torch, exact)):
        out = fn(*args, cu, incoming=chained)
        grads.append(torch.autograd.grad((out.double() * probe).sum(), args))
        outs.append(out.double())
    errs = {"out": rel_err(outs[0], outs[1])} | {"d" + n: rel_err(a, b) for n, a, b in
                                                  zip(["q", "k", "v", "g", "beta"], *grads)}
    zero = fla_chunk_gated_delta_rule(*inputs, cu).double()
    print("fla under CP vs fp64:", {k: f"{e:.1e}" for k, e in errs.items()},
          f"control (zero start) {rel_err(zero, outs[1]):.1e}")
    assert max(errs.values()) <= FLA_RULE_REL[torch.bfloat16], errs
    assert rel_err(zero, outs[1]) > 10 * FLA_RULE_REL[torch.bfloat16]


@CUDA
@FLA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_layer_matches_the_reference_path(dtype, monkeypatch):
    """The whole GatedDeltaNet layer on CUDA through fla (fused varlen conv + SiLU, delta rule in bf16, gated RMSNorm)
    against the same layer and weights through the torch reference (gdn.FLA_ON_CUDA off): output, the input's and
    every parameter's gradient (in fp32 the rule's decay gradients included: gdn.py keeps fp32 off fla's rule), packed
    segments. Negative control: the reference with the segments merged."""
    import gdn
    cfg = ModelConfig(family="qwen3_5", hidden_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg).cuda().to(dtype)
    with torch.no_grad():
        layer.A_log.copy_(torch.log(1 + 15 * torch.rand(4)))
        layer.norm.weight.uniform_(0.5, 1.5)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, sum(SEGMENTS), 512, device="cuda", generator=g).to(dtype).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(SEGMENTS).cumsum(0).tolist()], device="cuda")
    probe = torch.randn(x.shape, device="cuda", generator=g)
    params = [x, *layer.parameters()]
    names = ["x", *(n for n, _ in layer.named_parameters())]
    runs = []
    for fla, c in ((True, cu), (False, cu), (False, cu[[0, -1]])):
        monkeypatch.setattr(gdn, "FLA_ON_CUDA", fla)
        out = layer(x, c)
        runs.append((out.float(), torch.autograd.grad((out.float() * probe).sum(), params)))
    rel = FLA_LAYER_REL[dtype]
    errs = {"out": rel_err(runs[0][0], runs[1][0])} | {"d" + n: rel_err(a, b) for n, a, b in
                                                      zip(names, runs[0][1], runs[1][1])}
    print(dtype, {k: f"{e:.1e}" for k, e in errs.items()})
    assert max(errs.values()) <= rel, errs
    assert rel_err(runs[2][0], runs[1][0]) > 10 * rel  # the control: merged segments


def test_lora_targets_the_gdn_projections():
    """LoRA on Gated DeltaNet's five projections beside attention and the experts; a fresh adapter leaves the
    function unchanged and the adapters train."""
    import lora
    model = random_model(TEXT_ONLY)
    ids = torch.randint(0, 500, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids)
    lora.add_adapters(model, 4, 8, lora.TARGETS + lora.GDN_TARGETS)
    for n, p in model.named_parameters():
        if n.endswith("lora_A"):
            torch.nn.init.uniform_(p, -0.1, 0.1)
        elif n.endswith("lora_B"):
            torch.nn.init.zeros_(p)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        assert f"model.layers.0.linear_attn.{proj}.lora_A" in names, proj
    assert "model.layers.1.self_attn.q_proj.lora_B" in names
    out = model(ids)
    assert_close_rel(out, before, "fresh adapters")
    out.square().mean().backward()
    assert model.model.layers[0].linear_attn.in_proj_qkv.lora_B.grad.abs().max() > 0


def test_bench_gdn_smoke_runs_ours_and_transformers():
    """bench.py gdn's code path on CPU (fp32, the tiny hybrid's GDN shape): our layer and transformers' with our
    weights compute the same function (the parity tests' 1e-5 bound, with room for the bench's 128 tokens)."""
    import bench_model
    result = bench_model.bench_gdn(smoke=1)
    assert result["ours"]["ms"] > 0 and result["transformers"]["ms"] > 0 and result["ratio"] is None
    assert result["ours"]["params"] == result["transformers"]["params"]
    assert result["ours_vs_transformers_max_rel_diff"] <= 1e-4
