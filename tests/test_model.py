"""Our Qwen3 / Qwen3-MoE against transformers, checkpoints, grouped GEMM, routing replay.

    .venv/bin/python -m pytest tests/test_model.py -q
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import experts
from experts import GroupedSwiGLU, experts_grouped_mm, experts_loop
from model import ModelConfig, Transformer, hf_to_ours, ours_to_hf, read_safetensors, num_params
from tiny import TINY_CONFIG

DENSE = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)
MOE = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, mlp_only_layers=[1])


def random_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = Transformer(cfg)
    m.init_weights(seed, std=0.1)
    with torch.no_grad():  # non-trivial norms so a wrong norm placement would show
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["qwen3", "qwen3_moe"])
def test_logits_match_transformers(cfg, tmp_path):
    from transformers import AutoModelForCausalLM
    ours = random_model(cfg)
    ours.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if cfg.is_moe else "Qwen3ForCausalLM")
    x = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        diff = (hf(x).logits - ours(x)).abs().max().item()
    assert diff <= 1e-4, diff


def test_tiny_model_loads_in_transformers(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert tok.convert_tokens_to_ids("<tool_call>") != tok.unk_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  tokenize=False)
    assert ids.endswith("<|im_start|>assistant\n")
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ours = Transformer.from_pretrained(tiny_model_path)
    x = torch.randint(0, TINY_CONFIG.vocab_size, (1, 16))
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("shard_bytes", [2**40, 50_000], ids=["single", "sharded"])
def test_save_load_round_trip_is_bit_exact(tmp_path, shard_bytes):
    m = random_model(MOE)
    m.save_pretrained(tmp_path, max_shard_bytes=shard_bytes)
    assert os.path.isfile(tmp_path / ("model.safetensors" if shard_bytes > 2**30 else "model.safetensors.index.json"))
    names = read_safetensors(tmp_path).keys()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names  # per-expert HF names on disk
    m2 = Transformer.from_pretrained(tmp_path)
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n


def test_tied_embeddings_round_trip(tmp_path):
    m = random_model(DENSE)
    m.save_pretrained(tmp_path)
    assert "lm_head.weight" not in read_safetensors(tmp_path)
    m2 = Transformer.from_pretrained(tmp_path)
    assert m2.lm_head.weight is m2.model.embed_tokens.weight
    assert torch.equal(m2.lm_head.weight, m.lm_head.weight)


def test_hf_names_conversion_is_inverse():
    m = random_model(MOE)
    sd = m.state_dict()
    back = hf_to_ours(ours_to_hf(sd, MOE), MOE)
    assert sd.keys() == back.keys() and all(torch.equal(sd[k], back[k]) for k in sd)


def test_expert_loop_matches_per_token_reference():
    torch.manual_seed(0)
    E, D, H, N = 4, 16, 24, 30
    g, u, d = torch.randn(E, H, D) * 0.2, torch.randn(E, H, D) * 0.2, torch.randn(E, D, H) * 0.2
    ids = torch.randint(0, E, (N,)).sort().values
    x = torch.randn(N, D)
    w = torch.rand(N)
    out = experts_loop(x, torch.bincount(ids, minlength=E), w, g, u, d)
    ref = torch.stack([w[i] * (F.silu(x[i] @ g[e].T) * (x[i] @ u[e].T)) @ d[e].T for i, e in enumerate(ids.tolist())])
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA"))])
def test_grouped_mm_matches_loop(device):
    torch.manual_seed(0)
    E, D, H, N = 8, 256, 512, 1000
    g, u, d = (torch.randn(E, H, D, device=device, dtype=torch.bfloat16) * 0.05,
               torch.randn(E, H, D, device=device, dtype=torch.bfloat16) * 0.05,
               torch.randn(E, D, H, device=device, dtype=torch.bfloat16) * 0.05)
    counts = torch.bincount(torch.randint(0, E, (N,), device=device), minlength=E)
    counts[3] = 0  # an expert with no tokens
    x = torch.randn(int(counts.sum()), D, device=device, dtype=torch.bfloat16)
    w = torch.rand(x.shape[0], device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    runs = []
    for fn, dtype in ((experts_loop, torch.float64), (experts_loop, torch.bfloat16),
                      (experts_grouped_mm, torch.bfloat16)):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (x, w, g, u, d)]
        y = fn(leaves[0], counts, *leaves[1:])
        y.backward(dy.to(dtype))
        runs.append([y.detach().double()] + [t.grad.double() for t in leaves])
    # the local fp32 experts' path (train.keep_experts_local): GroupedSwiGLU adds the weight gradients into .grad in
    # fp32 itself (grouped_grad); two backwards of the same microbatch, the second adding into the first's
    x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
    ws = [t.float().requires_grad_() for t in (g, u, d)]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    for _ in range(2):
        y = GroupedSwiGLU.apply(x_, offs, w_, torch.cat(ws[:2], 1).bfloat16(), ws[2].bfloat16(), (ws[:2], ws[2:]))
        y.backward(dy)
    assert all(t.grad.dtype == torch.float32 for t in ws)
    runs.append([y.detach().double()] + [t.grad.double() / 2 for t in (x_, w_, *ws)])
    ref, loop, grouped, grouped_into = runs
    assert torch.equal(grouped_into[1], grouped[1]) and torch.equal(grouped_into[2], grouped[2])  # x's, w's: the same
    for name, r, a, b, c in zip(("y", "x", "scale", "gate", "up", "down"), ref, loop, grouped, grouped_into):
        err, loop_err = ((b - r).abs().max() / r.abs().max()).item(), ((a - r).abs().max() / r.abs().max()).item()
        assert err < 1.5 * loop_err + 1e-3, (name, err, loop_err)  # no worse than bf16 itself (measured < 1.0x)
        into_err = ((c - r).abs().max() / r.abs().max()).item()
        assert into_err < 1.5 * loop_err + 1e-3, (name, into_err, loop_err)
        print(f"{device} {name}: loop {loop_err:.2e} grouped {err:.2e} into .grad {into_err:.2e}")
    for grads in grouped[3:] + grouped_into[3:]:  # the weight gradients of the expert without rows: zero
        assert grads[3].abs().max() == 0


# fp8_experts: relative Frobenius error of every output and gradient of the FP8 SwiGLU experts
# against fp64, Gaussian data: 0.053-0.068 measured with the CPU reference (e4m3's 3 mantissa bits
# on both operands of up to three GEMMs in a row); bf16 itself: 0.003-0.004
FP8_EXPERTS_ERROR, BF16_EXPERTS_ERROR = 0.09, 0.01


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="the FP8 grouped GEMM needs CUDA on Hopper"))])
def test_fp8_experts_stay_within_the_measured_error_of_fp64(device):
    torch.manual_seed(0)
    E, D, H, N = 8, 256, 512, 1000
    g, u, d = (torch.randn(E, H, D) * 0.05, torch.randn(E, H, D) * 0.05,
               torch.randn(E, D, H) * 0.05)
    counts = torch.bincount(torch.randint(0, E, (N,)), minlength=E)
    counts[3] = 0  # an expert with no tokens
    x, w = torch.randn(int(counts.sum()), D), torch.rand(int(counts.sum()))
    dy, offs = torch.randn_like(x), torch.cumsum(counts, 0, dtype=torch.int32)
    runs = []
    for fp8 in (None, False, True):  # fp64 loop, bf16 grouped, FP8 grouped
        dtype = torch.float64 if fp8 is None else torch.bfloat16
        leaves = [t.to(device, dtype).requires_grad_() for t in (x, w, g, u, d)]
        if fp8 is None:
            y = experts_loop(leaves[0], counts.to(device), *leaves[1:])
        else:
            y = GroupedSwiGLU.apply(leaves[0], offs.to(device), leaves[1],
                                    torch.cat(leaves[2:4], 1), leaves[4], None, fp8)
        y.backward(dy.to(device, dtype))
        runs.append([y.detach().double().cpu()] + [t.grad.double().cpu() for t in leaves])
    for name, ref, bf16, fp8 in zip(("y", "x", "scale", "gate", "up", "down"), *runs):
        errors = [((a - ref).norm() / ref.norm()).item() for a in (bf16, fp8)]
        print(f"{device} {name}: bf16 {errors[0]:.4f} fp8 {errors[1]:.4f} (relative to fp64)")
        # the FP8 path ran (control: bf16's error is an order of magnitude below)
        assert errors[0] <= BF16_EXPERTS_ERROR < 0.02 <= errors[1] <= FP8_EXPERTS_ERROR, name
    if device == "cuda":  # the kernel against the reference's arithmetic on the same operands
        a, wt = x.to(device, torch.bfloat16), g.to(device, torch.bfloat16)
        kernel = experts.fp8_grouped_mm(a, experts.fp8_weight(wt), offs.to(device)).double().cpu()
        ref = experts.fp8_grouped_mm(a.cpu(), experts.fp8_weight(wt.cpu()), offs).double()
        diff = ((kernel - ref).norm() / ref.norm()).item()
        print(f"fp8_grouped_mm kernel vs reference: {diff:.5f}")
        assert diff <= 0.01  # bf16 outputs of one fp32 accumulation each


def test_fp8_experts_get_each_activation_quantized_where_it_is_made(monkeypatch):
    """The FP8 experts' four GEMMs take their activations' e4m3 rows from where the rows are made (x and dy
    quantized per token and gathered, h and d[gate | up] by their kernels), the same bits as quantizing the
    gathered rows, and x does not keep its e4m3 copy past the forward. Control: with the handover cut, the GEMMs
    quantize for themselves (same bits) and the spy sees no rows handed over."""
    torch.manual_seed(0)
    E, D, H, T, K = 4, 32, 16, 24, 2
    handed = []
    mm = experts.expert_mm
    monkeypatch.setattr(experts, "expert_mm", lambda *a, rows=None, **kw: handed.append(rows is not None) or mm(
        *a, rows=rows, **kw))

    def run(hand_over):
        torch.manual_seed(1)
        ex = experts.Experts(E, D, H).to(torch.bfloat16)
        for p in ex.parameters():
            torch.nn.init.normal_(p, std=0.1)
        ex.use_grouped_mm, ex.fp8 = True, True
        x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
        ids, w = torch.randint(0, E, (T, K)), torch.rand(T, K, dtype=torch.bfloat16)
        with monkeypatch.context() as m:
            if not hand_over:
                m.setattr(experts, "gather_fp8_rows", lambda *a: None)
            handed.clear()
            y = ex(x, ids, w)
            y.backward(torch.randn_like(y))
        return [y, x.grad] + [p.grad for p in ex.parameters()], list(handed)
    (ours, spied), (control, spied_control) = run(True), run(False)
    assert spied == [True] * 4 and spied_control == [False, True, False, True], (spied, spied_control)
    for a, b in zip(ours, control, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
def test_topk_ids_on_cuda_equal_torch_topk():
    g = torch.Generator(device="cuda").manual_seed(0)
    for N, E, k in ((32768, 128, 8), (1000, 256, 8), (7, 60, 4)):
        probs = torch.randn(N, E, device="cuda", generator=g).softmax(-1)
        assert torch.equal(experts.topk_ids(probs, k), torch.topk(probs, k, dim=-1).indices), (N, E, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
def test_adamw_steps_large_tensors_like_torchs_fused_adamw():
    """experts.AdamW: its large tensors in the Triton kernel, the rest in torch's fused step, against torch's fused
    AdamW on copies: same weights (fp32 rounding), same state keys, with clipping's grad_scale."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4, 512, 1024), (2048,), (300, 70)]  # the first has 2^21 elements: Triton
    ours = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    opt, ref_opt = experts.AdamW([{"params": ours[:2]}, {"params": ours[2:]}], **kw), torch.optim.AdamW(ref, **kw)
    for _ in range(3):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, device="cuda", generator=g)
            b.grad = a.grad.clone()
        opt.grad_scale = ref_opt.grad_scale = torch.tensor(2.0, device="cuda")
        opt.step()
        ref_opt.step()
    for a, b, p0 in zip(ours, ref, shapes):
        moved = (b.detach() - a.detach()).abs().max().item()
        assert moved < 1e-5, (p0, moved)
    assert [sorted(opt.state[p]) for p in ours] == [sorted(ref_opt.state[p]) for p in ref]
    assert all(opt.state[p]["step"].item() == 3 for p in ours)


def test_routing_replay_reproduces_logits_and_choices():
    m = random_model(MOE).eval()
    x = torch.randint(0, MOE.vocab_size, (2, 24))
    with torch.no_grad():
        h, routes = m.hidden_states(x, return_routes=True)  # routes (B, T, L_moe, K)
        assert routes.shape == (2, 24, len(MOE.moe_layers), MOE.num_experts_per_tok)
        assert torch.equal(m(x, routed_experts=routes), m.lm_head(h))
        for layer in MOE.moe_layers:  # perturb the routers: replay still uses the recorded experts
            m.model.layers[layer].mlp.gate.weight.add_(torch.randn_like(m.model.layers[layer].mlp.gate.weight))
        _, own = m.hidden_states(x, return_routes=True)
        assert not torch.equal(own, routes)
        _, replayed = m.hidden_states(x, routed_experts=routes, return_routes=True)
        assert torch.equal(replayed, routes)


def test_replay_gradients_reach_the_router():
    m = random_model(MOE)
    x = torch.randint(0, MOE.vocab_size, (1, 12))
    with torch.no_grad():
        _, routes = m.hidden_states(x, return_routes=True)
    m(x, routed_experts=routes).sum().backward()
    assert m.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_activation_checkpointing_same_gradients():
    torch.manual_seed(0)
    x = torch.randint(0, MOE.vocab_size, (2, 16))
    grads = []
    for ac in (False, True):
        m = random_model(MOE)
        m.activation_checkpointing = ac
        m(x).float().logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_not_a_qwen3_directory_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Transformer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="not a Qwen3, Qwen3-VL or Qwen3.5 model"):
        Transformer.from_pretrained(tmp_path)


def test_num_params_counts_the_module():
    for cfg in (DENSE, MOE, TINY_CONFIG):
        assert num_params(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())


SUM_SLOTS_CHECK = """
import torch, experts
torch.manual_seed(0)
for N, K, D in ((50, 8, 2048), (37, 2, 100), (3, 4, 64), (0, 4, 64)):
    slots = torch.randperm(N * K)[: N * K * 5 // 8]  # some slots unused
    position = experts.slot_positions(slots, N * K)
    y = torch.randn(slots.numel(), D)
    expected = torch.zeros(N, D).index_add_(0, slots // K, y)
    torch.testing.assert_close(experts.sum_slots_triton(y, position, K), expected)
    torch.testing.assert_close(experts.sum_slots(y, position, K), expected)
# topk_ids: the Triton kernel against torch.topk (distinct values: no ties), E not a power of two, a ragged last block
for N, E, k in ((37, 128, 8), (5, 60, 4), (0, 16, 2)):
    probs = torch.rand(N, E).softmax(-1)
    out = torch.empty(N, k, dtype=torch.int64)
    if N:
        experts._topk_kernel[(experts.triton.cdiv(N, 16),)](probs, out, N, E, K=k, BR=16, BE=experts.triton.next_power_of_2(E))
    assert torch.equal(out, torch.topk(probs, k, dim=-1).indices)
# experts.AdamW's kernel against torch's AdamW: 3 steps, with and without weight decay and a clipping grad_scale
for wd, scale in ((0.1, torch.tensor(2.5)), (0.0, None)):
    p0 = torch.randn(5000)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, foreach=False)
    p, m, v, step = p0.clone(), torch.zeros(5000), torch.zeros(5000), torch.zeros(())
    for i in range(3):
        g = torch.randn(5000)
        ref.grad = g if scale is None else g / scale
        opt.step()
        step += 1
        experts.adamw_triton(p, g, m, v, step, scale, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd))
        # fp32 rounding of the weights (measured 8e-6 of the moves); a wrong bias correction is off by 1e-1 and more
        assert (p - ref.detach()).abs().max() < 2e-5 * (p0 - ref.detach()).abs().max(), (wd, i)
# swiglu_backward: the Triton kernel against the eager reference (fp32 here: bf16 rounding aside, the same arithmetic)
for N, H in ((37, 48), (5, 768), (0, 16)):
    gu, scale, dh = torch.randn(N, 2 * H), torch.rand(N), torch.randn(N, H)
    for got, want in zip(experts.swiglu_backward_triton(gu, scale, dh)[:2], experts.swiglu_backward(gu, scale, dh)[:2]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # fp8 (bf16 rows, as the FP8 experts run it): the e4m3 rows are exactly fp8_rows of the rows it returns
    dgu, dscale, (q, q_scale) = experts.swiglu_backward_triton(gu.bfloat16(), scale, dh.bfloat16(), True)
    want_q, want_scale = experts.fp8_rows_compiled(dgu)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(q_scale, want_scale), (N, H)
# fp8_rows_triton: bit for bit torch's row scaling (a row of zeros too); fp8_grouped_mm_triton against the reference
# (each expert's fp32 product of the same e4m3 operands): experts without rows, partial tiles, K and the output not
# multiples of the tile, the three accumulations (fp32 products here: the interpreter multiplies in fp32)
x = torch.randn(37, 200).bfloat16() * torch.rand(37, 1).bfloat16()
x[5] = 0
(q, scale), (want_q, want_scale) = experts.fp8_rows_triton(x), experts.fp8_rows_compiled(x)
assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
for E, K, O, sizes, BM, BN, BK in ((5, 64, 96, (70, 0, 64, 1, 33), 32, 32, 32), (3, 96, 64, (16, 65, 3), 16, 64, 64),
                                   (4, 32, 32, (0, 0, 10, 0), 16, 32, 32)):
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    a, w8 = torch.randn(sum(sizes), K).bfloat16(), experts.fp8_weight(torch.randn(E, O, K).bfloat16())
    want = experts.fp8_grouped_mm(a, w8, offs).float()
    for promote in (0, 1, 2):
        got = experts.fp8_grouped_mm_triton(*experts.fp8_rows(a), *w8, offs, promote == 0,
                                            dict(BM=BM, BN=BN, BK=BK, PROMOTE=promote))
        torch.testing.assert_close(got.float(), want, atol=0, rtol=0.01)  # bf16 outputs: 2^-8 apart
    # the rows read through an index (gather_fp8_rows: each of 9 tokens' rows once per slot), as the rows gathered
    tokens = torch.randn(9, K).bfloat16()
    index = torch.randint(0, 9, (sum(sizes),))
    want = experts.fp8_grouped_mm(tokens[index], w8, offs).float()
    assert torch.equal(experts.fp8_grouped_mm(None, w8, offs, rows=experts.gather_fp8_rows(tokens, index)).float(),
                       want)
    got = experts.fp8_grouped_mm_triton(*experts.fp8_rows(tokens), *w8, offs, False, dict(BM=BM, BN=BN, BK=BK),
                                        index=index)
    torch.testing.assert_close(got.float(), want, atol=0, rtol=0.01)
# grouped_grad: each expert's a_e^T b_e in fp32, written (into NaNs: every element must be written, an empty expert's
# as zeros) or added into one or two tensors splitting M; experts with no rows, rows not multiples of the 64-row
# blocks, outputs not multiples of the tiles (fp32 operands here: the interpreter's bf16 dot is not the GPU's). The
# interpreter has no TMA reduce-add: here it is a load, an add and a store of the tile (on CUDA the hardware's, which
# test_train's test_grouped_grad_adds_fp32_weight_gradients_on_cuda checks)
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
def reduce_add(self, kind, desc, value, indices):
    old = self.create_descriptor_load(desc, indices, None, None)
    return self.create_descriptor_store(desc, TensorHandle(old.data + value.data, value.dtype), indices)
InterpreterBuilder.create_descriptor_reduce = reduce_add
for counts, M, K, n in (([5, 0, 70, 64, 1], 64, 96, 2), ([130, 3], 48, 32, 1), ([0, 0, 9], 32, 256, 2)):
    E, offs = len(counts), torch.tensor(counts).cumsum(0).to(torch.int32)
    a, b = torch.randn(sum(counts), M), torch.randn(sum(counts), K)
    want = torch.stack([a[o - c:o].T @ b[o - c:o] for c, o in zip(counts, offs.tolist())])
    got = experts.grouped_grad_triton(a, b, offs, [torch.full((E, M // n, K), float("nan")) for _ in range(n)], False)
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-5, atol=1e-4)
    into = [torch.randn(E, M // n, K) for _ in range(n)]
    base = torch.cat(into, 1)
    assert all(g is i for g, i in zip(experts.grouped_grad_triton(a, b, offs, into, True), into))
    torch.testing.assert_close(torch.cat(into, 1), base + want, rtol=1e-5, atol=1e-4)
"""


def test_triton_kernels_match_their_references():
    """The Triton kernels (sum_slots, grouped_grad, ...) run on CUDA; checked here on CPU by Triton's interpreter."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", SUM_SLOTS_CHECK], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=root,
                   check=True, timeout=300)


def test_compiled_functions_compile_once_over_varying_microbatches():
    """compiled_for_tokens (cuda_compiled's compile) on CPU Inductor: every compiled function (the
    norms, the loss's chunk statistics and gradient, the experts' silu_mul and FP8 row scaling) over
    microbatches whose rows and lengths vary as the loop's do (2 x 120, 3 x 80, 1 x 200, a single
    token, ...), some of them views at a storage offset, compiles once each without a graph break
    and gives eager's values and gradients. Negative control over the same shapes: token dims
    marked dynamic (backed: sizes 0, 1 and storage offsets specialized) compile rms_norm 5 times
    (torch.compile left to itself, a dim made dynamic only once it changes: 7)."""
    import loss
    import model
    from torch._dynamo.utils import counters
    shapes = [(2, 120), (2, 100), (3, 80), (1, 200), (1, 150), (4, 60), (2, 70), (1, 1), (3, 1)]
    D, H, V = 64, 96, 512
    w, wh = torch.rand(D) + 0.5, torch.rand(16) + 0.5
    freqs = lambda T: torch.outer(torch.arange(T).float(), model.rope_inv_freq(16, 1e6, "cpu"))  # noqa: E731

    def offset(t, k):  # t as a view k elements into a larger buffer (a slice of a fused projection's output)
        buf = torch.empty(t.numel() + k)
        buf[k:].copy_(t.flatten())
        return buf[k:].view(t.shape)
    row = lambda n, k=0: offset(torch.randn(n), k)  # noqa: E731
    cases = {
        "rms_norm": lambda B, T, k: (model.rms_norm, (offset(torch.randn(B, T, D), k), w, 1e-6)),
        "add_rms_norm": lambda B, T, k: (model.add_rms_norm, (offset(torch.randn(B, T, D), k),
                                                              torch.randn(B, T, D), w, 1e-6)),
        "norm_rope": lambda B, T, k: (model.norm_rope, (offset(torch.randn(B, T, 4, 16), k), wh, 1e-6, False,
                                                        *model.rope_cos_sin(freqs(T), torch.float32))),
        "chunk_stats": lambda B, T, k: (loss._fused_chunk_stats, (offset(torch.randn(B * T, V), k),
                                                                  torch.randint(0, V, (B * T,)), 1.0, True)),
        "chunk_grad": lambda B, T, k: (loss._fused_chunk_grad_logits, (
            offset(torch.randn(B * T, V), k), torch.randint(0, V, (B * T,)), row(B * T, k) + 6, row(B * T),
            row(B * T).abs(), row(B * T), 0.7)),
        "silu_mul": lambda B, T, k: (experts.silu_mul, (offset(torch.randn(B * T, H), k), torch.randn(B * T, H),
                                                        torch.rand(B * T))),
        "fp8_rows": lambda B, T, k: (experts.fp8_rows_compiled, (offset(torch.randn(B * T, H), k),)),
        "silu_mul_fp8": lambda B, T, k: (experts.silu_mul_fp8, (offset(torch.randn(B * T, H), k),
                                                                torch.randn(B * T, H), torch.rand(B * T))),
    }
    with_grad = ("rms_norm", "add_rms_norm", "norm_rope", "silu_mul")  # called under autograd (the others
                                                                        # inside autograd Functions)

    def outputs(fn, args, name):
        if name not in with_grad:
            return [o.float() if o.dtype == experts.FP8 else o for o in fn(*args) if o is not None]
        x = args[0].detach().requires_grad_()  # a leaf at the same storage offset
        outs = fn(x, *args[1:])
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        return outs + list(torch.autograd.grad(sum(o.sin().sum() for o in outs), x))

    def graphs(name, compile_fn):
        torch._dynamo.reset()
        counters.clear()
        compiled = None
        for i, (B, T) in enumerate(shapes):
            fn, args = cases[name](B, T, 3 * (i % 2))
            compiled = compiled or compile_fn(fn.__wrapped__)
            for a, b in zip(outputs(compiled, args, name), outputs(fn.__wrapped__, args, name), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    counts = {name: graphs(name, lambda f: experts.compiled_for_tokens(f, mode=None)) for name in cases}
    control = graphs("rms_norm", lambda f: experts.compiled_for_tokens(  # token dims marked dynamic
        f, mode=None, mark=torch._dynamo.maybe_mark_dynamic))[0]
    print(counts, "control (backed)", control)
    assert all(c == (1, 0) for c in counts.values()) and control >= 2, (counts, control)


COMPILED_REL = 1.6e-2  # compiled against eager, bf16: measured 4.8e-3 to 8.7e-3 on an H200, the control 2.8e-2 and up


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_compiled compiles on CUDA only")
@pytest.mark.parametrize("zero_centred", [False, True], ids=["qwen3", "qwen3_5"])
def test_compiled_norms_match_eager_on_cuda(zero_centred, monkeypatch):
    """rms_norm, add_rms_norm and norm_rope through cuda_compiled (Inductor, max-autotune: one fp32 kernel each way)
    against the same functions eager (bf16 rounding after each op), forward and backward, at 4 x 512 tokens of
    Qwen3-30B-A3B's widths in bf16. Negative control: eager with eps 0.1, a ~5% change of scale, is outside."""
    import model
    g = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    cos, sin = model.rope_cos_sin(torch.outer(torch.arange(512, device="cuda").float(),
                                              model.rope_inv_freq(128, 1e6, "cuda")), torch.bfloat16)
    w, wh = 1 + randn(2048) / 4, 1 + randn(128) / 4
    cases = {"rms_norm": (model.rms_norm, (randn(4, 512, 2048), w)), "add_rms_norm": (
        model.add_rms_norm, (randn(4, 512, 2048), randn(4, 512, 2048), w)), "norm_rope": (
        lambda x, w, eps, z: model.norm_rope(x, w, eps, z, cos, sin), (randn(4, 512, 32, 128), wh))}

    def run(fn, args, eps):
        leaves = [t.clone().requires_grad_() for t in args]
        outs = fn(*leaves, eps, zero_centred)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [torch.ones_like(o) * torch.linspace(-1, 1, o.shape[-1], device="cuda").to(
            o.dtype) for o in outs])
        return [*outs, *(t.grad for t in leaves)]

    errs, rel = {}, lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()  # noqa: E731
    for name, (fn, args) in cases.items():
        compiled = run(fn, args, 1e-6)
        monkeypatch.setattr(experts, "COMPILE_ON_CUDA", False)
        eager, control = run(fn, args, 1e-6), run(fn, args, 0.1)
        monkeypatch.setattr(experts, "COMPILE_ON_CUDA", True)
        errs[name] = (max(map(rel, compiled, eager)), max(map(rel, control, eager)))
    print(zero_centred, {k: (f"{a:.1e}", f"{b:.1e}") for k, (a, b) in errs.items()})
    assert all(a < COMPILED_REL < b for a, b in errs.values()), errs
