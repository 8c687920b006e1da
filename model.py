"""
Qwen3 (dense), Qwen3-MoE and Qwen3-VL (dense or MoE: a
vision tower, M-RoPE, deepstack) with HuggingFace names.

A real Qwen3-4B, Qwen3-30B-A3B or Qwen3-VL-30B-A3B checkpoint directory loads unchanged
(`Transformer.from_pretrained(dir)`), and `save_pretrained` writes a directory that vLLM and
transformers load. MoE experts are stored stacked (E, ...). Routing replay: pass the engine's
expert ids per token and layer and the router uses them instead of its own top-k (the gate weights
still come from the router, so it trains). Images: pass `pixel_values` and `image_grid_thw` as the
model's image processor makes them; without them a Qwen3-VL model runs the text path unchanged.

The MoE experts and their kernels live in experts.py; this file imports nothing
else of ours. The tiny models the tests and the CPU runs use are built by tiny.py.

    .venv/bin/python -m pytest tests/test_model.py tests/test_model_vl.py -q
"""

import json
import math
import os
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.nn.attention.bias import causal_lower_right

from experts import EXPERT_PROJS, Experts, cuda_compiled, topk_ids as experts_topk_ids
from gdn import GatedDeltaNet

# -----------------------------------------------------------------------------
# config


@dataclass
class VisionConfig:
    # the fields of HF's Qwen3VLVisionConfig, and the top-level token ids of its Qwen3VLConfig
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list = field(default_factory=lambda: [8, 16, 24])
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653


VL_TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass
class ModelConfig:
    # the fields of HF's Qwen3Config / Qwen3MoeConfig (or a Qwen3VL(Moe)Config's
    # text_config) that change the function the model computes
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE (num_experts == 0 means dense Qwen3)
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    # Qwen3-VL: the vision tower (None: a text model) and
    # M-RoPE's frequencies per t/h/w axis (sum rotary_dim / 2)
    vision: VisionConfig = None
    mrope_section: list = field(default_factory=lambda: [24, 20, 20])
    # Qwen3.5 / Qwen3.6 (family "qwen3_5"): each layer's kind (layer_types:
    # "linear_attention", Gated DeltaNet, or "full_attention"; None: all full
    # attention), attention with an output gate and partial rotary, zero-centred
    # norms, a shared expert beside the routed ones, MTP layers kept with the weights
    family: str = "qwen3"
    layer_types: list = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    shared_expert_intermediate_size: int = 0
    partial_rotary_factor: float = 1.0
    mtp_num_hidden_layers: int = 0

    @property
    def rotary_dim(self):
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, i):
        return self.layer_types[i] if self.layer_types else "full_attention"

    @property
    def is_moe(self):
        return self.num_experts > 0

    def is_moe_layer(self, i):
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self):
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_hf(cls, hf):
        """From a config.json dict: qwen3, qwen3_moe, qwen3_vl, qwen3_vl_moe,
        or the Qwen3.5 family's qwen3_5_moe (the VLM), qwen3_5_moe_text (its
        text-only CausalLM) and their dense qwen3_5, qwen3_5_text."""
        mt = hf.get("model_type")
        if mt not in MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} is not a Qwen3, Qwen3-VL or Qwen3.5 model "
                             "(config.json's model_type "
                             f"must be one of {', '.join(MODEL_TYPES)})")
        vl, family = "text_config" in hf, "qwen3_5" if mt.startswith("qwen3_5") else "qwen3"
        text = {**hf["text_config"],
                "tie_word_embeddings": hf.get("tie_word_embeddings", False)} if vl else hf
        # transformers 5 nests rope_theta here
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        names = {f.name for f in fields(cls)} - {"vision", "mrope_section", "family"}
        kw = dict({k: v for k, v in text.items() if k in names and v is not None}, family=family)
        kw.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
        if family == "qwen3_5":
            kw["partial_rotary_factor"] = rope.get("partial_rotary_factor",
                                                   text.get("partial_rotary_factor", 0.25))
            kw.setdefault("layer_types",
                          ["linear_attention" if (i + 1) % text.get("full_attention_interval", 4)
                                          else "full_attention"
                                          for i in range(text["num_hidden_layers"])])
            kw["norm_topk_prob"] = True  # Qwen3.5's router always renormalizes its top-k
        if mt in ("qwen3", "qwen3_vl", "qwen3_5", "qwen3_5_text"):
            kw["num_experts"] = 0
        kw.setdefault("head_dim", text["hidden_size"] // text["num_attention_heads"])
        if vl:
            v = {k: x for k, x in hf["vision_config"].items()
                 if k in {f.name for f in fields(VisionConfig)}}
            v.update({k: hf[k] for k in VL_TOKEN_IDS if k in hf})  # top-level in HF's config
            if family == "qwen3_5":
                v["deepstack_visual_indexes"] = []  # Qwen3.5's tower has no deepstack
            kw["vision"] = VisionConfig(**v)
        if "mrope_section" in rope or vl:
            kw["mrope_section"] = list(
                rope.get("mrope_section", [11, 11, 10] if family == "qwen3_5" else [24, 20, 20]))
        return cls(**kw)

    def to_hf(self):
        if self.family == "qwen3_5":
            return self.to_hf_qwen3_5()
        hf = {f.name: getattr(self, f.name) for f in fields(self) if f.name in QWEN3_FIELDS}
        hf.update(model_type="qwen3_moe" if self.is_moe else "qwen3",
                  architectures=["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
                  hidden_act="silu", torch_dtype="bfloat16", attention_dropout=0.0,
                  use_sliding_window=False, sliding_window=None,
                  max_window_layers=self.num_hidden_layers, rope_scaling=None,
                  initializer_range=0.02, output_router_logits=False, router_aux_loss_coef=0.001,
                  use_cache=True)
        if not self.is_moe:
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                      "output_router_logits", "router_aux_loss_coef"):
                hf.pop(k)
        if self.vision is None:
            return hf
        # Qwen3-VL: the text model nested under text_config with
        # interleaved M-RoPE, the tower under vision_config
        mt = "qwen3_vl_moe" if self.is_moe else "qwen3_vl"
        for k in ("architectures", "rope_scaling", "rope_theta", "use_sliding_window",
                  "sliding_window", "max_window_layers"):
            hf.pop(k)
        hf.update(model_type=mt + "_text", rope_parameters=dict(
            rope_type="default", rope_theta=self.rope_theta, mrope_section=self.mrope_section,
            mrope_interleaved=True))
        return self.nest_vision(hf, mt, "Qwen3VLMoeForConditionalGeneration" if self.is_moe else
                                "Qwen3VLForConditionalGeneration")

    def to_hf_qwen3_5(self):
        """Qwen3_5MoeForConditionalGeneration's config.json
        (Qwen3_5MoeForCausalLM's without a tower)."""
        moe, mt = self.is_moe, "qwen3_5_moe" if self.is_moe else "qwen3_5"
        keep = QWEN3_FIELDS - {"rope_theta", "decoder_sparse_step",
                               "mlp_only_layers"} | QWEN3_5_FIELDS
        keep -= {"intermediate_size"} if moe else {"num_experts", "num_experts_per_tok",
                                                   "moe_intermediate_size", "norm_topk_prob",
                                                   "shared_expert_intermediate_size"}
        text = {k: getattr(self, k) for k in sorted(keep)}
        text.update(model_type=mt + "_text", hidden_act="silu", attention_dropout=0.0,
                    initializer_range=0.02, use_cache=True, torch_dtype="bfloat16",
                    rope_parameters=dict(
                        rope_type="default", rope_theta=self.rope_theta,
                        partial_rotary_factor=self.partial_rotary_factor,
                        mrope_section=self.mrope_section, mrope_interleaved=True))
        if moe:
            text.update(output_router_logits=False, router_aux_loss_coef=0.001)
        if self.vision is None:
            return dict(text, architectures=["Qwen3_5MoeForCausalLM" if moe
                                             else "Qwen3_5ForCausalLM"])
        return self.nest_vision(text, mt, "Qwen3_5MoeForConditionalGeneration" if moe else
                                "Qwen3_5ForConditionalGeneration")

    def nest_vision(self, text, mt, architecture):
        v = {f.name: getattr(self.vision, f.name) for f in fields(self.vision)}
        tokens = {k: v.pop(k) for k in VL_TOKEN_IDS}
        if self.family == "qwen3_5":
            v.pop("deepstack_visual_indexes")
        return dict(model_type=mt, architectures=[architecture], text_config=text,
                    vision_config={**v, "model_type": mt, "initializer_range": 0.02}, **tokens,
                    tie_word_embeddings=self.tie_word_embeddings, torch_dtype="bfloat16")


MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe", "qwen3_5_moe_text",
               "qwen3_5", "qwen3_5_text")
QWEN3_FIELDS = {f.name for f in fields(ModelConfig)[
    :list(f.name for f in fields(ModelConfig)).index("vision")]}
QWEN3_5_FIELDS = {"layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  "shared_expert_intermediate_size", "mtp_num_hidden_layers"}

# -----------------------------------------------------------------------------
# layers


@cuda_compiled
def rms_norm(x, weight, eps, zero_centred=False):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:  # Qwen3.5: the weight is an offset from 1 (init 0), applied in fp32
        return (x * (1.0 + weight.float())).to(dtype)
    return weight * x.to(dtype)


@cuda_compiled
def add_rms_norm(x, r, weight, eps, zero_centred=False):
    """The residual stream x + r, and its RMSNorm: on CUDA one kernel
    forward and one backward (the add no pass of its own in either)."""
    x = x + r
    return x, rms_norm.__wrapped__(x, weight, eps, zero_centred)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, zero_centred=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.eps, self.zero_centred = eps, zero_centred

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, self.zero_centred)


def rope_inv_freq(dim, theta, device):
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device).float() / dim))  # (dim/2,)


def rope_cos_sin(freqs, dtype):
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., rd): the "rotate half" layout
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x (B, nh, T, hd); the "rotate half" convention of HF Qwen3 checkpoints, over the
    # first rd = cos.shape[-1] dims of each head (partial rotary: the rest pass unrotated)
    rd = cos.shape[-1]
    x, rest = x[..., :rd], x[..., rd:]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


@cuda_compiled
def norm_rope(x, weight, eps, zero_centred, cos, sin):
    """Qwen3's per-head RMSNorm of q or k, then RoPE: x (B, T, nh, hd) -> (B, T, nh, hd), a
    new tensor; cos and sin as for (B, nh, T, hd): (T, rd) or (B, 1, T, rd). The caller's
    transpose to (B, nh, T, hd) is a view, so SDPA gets q and k in the token-major layout its
    output takes, and neither the output nor its gradient is copied into another layout."""
    cos, sin = (t.transpose(-3, -2) if t.dim() == 4 else t.unsqueeze(-2) for t in (cos, sin))
    return apply_rope(rms_norm.__wrapped__(x, weight, eps, zero_centred), cos, sin)


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k norms (Qwen3). Qwen3.5's adds
    an output gate: q_proj makes each head's query and its gate side by side,
    and the heads' outputs are scaled by sigmoid(gate) before o_proj."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.gated = cfg.family == "qwen3_5"
        D, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(D, self.n_head * self.hd * (2 if self.gated else 1), bias=b)
        self.k_proj = nn.Linear(D, self.n_kv * self.hd, bias=b)
        self.v_proj = nn.Linear(D, self.n_kv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.n_head * self.hd, D, bias=b)
        # per-head norm of q and k before RoPE
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, self.gated)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, self.gated)
        self.context_parallel = None  # a context.ContextParallel: this rank's pieces of each row

    def forward(self, x, cos, sin, mask=None):
        """mask (B, 1, T, T) bool, True where a query may
        attend (packed rows); None: causal within each row."""
        B, T, _ = x.shape
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if all(type(p) is nn.Linear and p.bias is None for p in projs):  # not LoRA's adapted ones
            q, k, v = ProjectQKV.apply(x, *(p.weight for p in projs))
        else:
            q, k, v = (p(x) for p in projs)
        q = q.view(B, T, self.n_head, -1)  # (B, T, nh, hd), or (B, T, nh, 2 hd) with the gate
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        k = k.view(B, T, self.n_kv, self.hd)    # (B, T, nkv, hd)
        # (B, nh, T, hd)
        q = norm_rope(q, self.q_norm.weight, self.q_norm.eps, self.gated, cos, sin).transpose(1, 2)
        # (B, nkv, T, hd)
        k = norm_rope(k, self.k_norm.weight, self.k_norm.eps, self.gated, cos, sin).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        if self.context_parallel is not None:
            y = context_attention(q, k, v, self.context_parallel, self.n_kv != self.n_head)
        else:  # right-padded batches need no mask beyond causal: padding only follows real tokens
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=self.n_kv != self.n_head)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.hd)
        if self.gated:
            y = y * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(y)


def context_attention(q, k, v, cp, enable_gqa):
    """Causal attention of this rank's two pieces of each row (context.py's layout) over the row's
    keys before them. q (B, nh, 2C, hd), k and v (B, nkv, 2C, hd) -> (B, nh, 2C, hd).

    K and V are all-gathered, not passed around a ring: with grouped-query heads they are a small
    part of the activations (Qwen3.6: 2 KV heads of 16, 1/8 of q's size), so one all-gather per
    layer moves what a ring moves over cp - 1 steps, the fused kernel runs unchanged (a lower-right
    causal mask: piece p's C queries against the (p + 1) C keys up to its end) where a ring needs a
    kernel call per step and a log-sum-exp merge of partial results in forward and backward, and the
    gather of the next layer can overlap this one's compute. Its backward is a reduce-scatter of dK
    and dV. The cost is the gathered K and V of one layer, T * nkv * hd * 2 elements."""
    C = q.shape[2] // 2
    kv = cp.gather(torch.stack([k, v]).unflatten(3, (2, C)))  # (cp, 2, B, nkv, 2, C, hd)
    k, v = cp.in_sequence(kv, 3).flatten(3, 4)  # (B, nkv, T, hd) each, the row's order
    return torch.cat([F.scaled_dot_product_attention(
        qp, k[:, :, :(p + 1) * C], v[:, :, :(p + 1) * C],
        attn_mask=causal_lower_right(C, (p + 1) * C),
        enable_gqa=enable_gqa) for qp, p in zip(q.split(C, 2), cp.pieces)], 2)


class ProjectQKV(torch.autograd.Function):
    """x @ Wq^T, x @ Wk^T, x @ Wv^T as one GEMM over the weights stacked (a copy of the
    three, made again in backward rather than kept), and their input's gradient as one
    GEMM where autograd would run three and add them twice; the weights' gradients are
    one GEMM too, split. q and k are column views of the one output; v is copied out of
    it, so that what SDPA keeps of v for backward does not keep q and k alive."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)
        q, k, v = F.linear(x, torch.cat(weights)).split([w.shape[0] for w in weights], -1)
        return q, k, v.contiguous()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, *weights = ctx.saved_tensors
        dy = torch.cat([dq, dk, dv], -1)
        dw = dy.flatten(0, -2).T @ x.flatten(0, -2)
        return dy @ torch.cat(weights), *dw.split([w.shape[0] for w in weights])


class MLP(nn.Module):
    def __init__(self, D, H):
        super().__init__()
        self.gate_proj = nn.Linear(D, H, bias=False)
        self.up_proj = nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Softmax router, top-k experts; Qwen3.5 adds a shared expert that
    every token passes through, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg, expert_parallel=None):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               expert_parallel)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x, replay_ids=None):
        # x (B, T, D); replay_ids (B, T, K) expert ids
        # chosen by the engine, or None to route ourselves
        B, T, D = x.shape
        x = x.reshape(B * T, D)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        topk_ids = experts_topk_ids(probs.detach(), self.top_k) if replay_ids is None else \
            replay_ids.reshape(B * T, -1).long()  # (N, K)
        topk_probs = probs.gather(1, topk_ids)  # (N, K); gradients reach the router through it
        if self.norm_topk_prob:
            topk_probs = topk_probs / topk_probs.sum(-1, keepdim=True)
        y = self.experts(x, topk_ids, topk_probs.to(x.dtype))
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.view(B, T, D), topk_ids.view(B, T, -1)


class Block(nn.Module):
    """One decoder layer: token mixing by attention (`self_attn`) or, for a
    Qwen3.5 "linear_attention" layer, by Gated DeltaNet (`linear_attn`), then the
    MLP or MoE. layer_type overrides cfg's (the MTP layer is full attention)."""

    def __init__(self, cfg, i, expert_parallel=None, layer_type=None):
        super().__init__()
        zc = cfg.family == "qwen3_5"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc)
        self.is_linear = (layer_type or cfg.layer_type(i)) == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc)
        self.is_moe = cfg.is_moe_layer(i)
        self.mlp = MoE(cfg, expert_parallel) if self.is_moe else MLP(cfg.hidden_size,
                                                                     cfg.intermediate_size)

    def forward(self, x, cos, sin, replay_ids=None, mask=None, cu_seqlens=None):
        """mask: the attention mask of packed rows (None: causal per row); cu_seqlens (S+1,):
        the segments' offsets in the B*T tokens, where Gated DeltaNet restarts its state."""
        h = self.input_layernorm(x)
        h = self.linear_attn(h, cu_seqlens) if self.is_linear else self.self_attn(h, cos, sin, mask)
        norm = self.post_attention_layernorm
        x, h = add_rms_norm(x, h, norm.weight, norm.eps, norm.zero_centred)
        h, ids = self.mlp(h, replay_ids) if self.is_moe else (self.mlp(h), None)
        return x + h, ids


class Decoder(nn.Module):
    def __init__(self, cfg, expert_parallel=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, expert_parallel)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.family == "qwen3_5")


class MTP(nn.Module):
    """Qwen3.5's multi-token-prediction layers (`mtp.*`): fc over
    [pre_fc_norm_embedding(embedding of token t+1), pre_fc_norm_hidden(trunk's hidden
    state at t)], full-attention MoE layers, a norm; the embeddings and lm_head are the
    trunk's. vLLM drafts with them; here they are kept through load, train and save."""

    def __init__(self, cfg, expert_parallel=None):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(D, eps, True)
        self.pre_fc_norm_hidden = RMSNorm(D, eps, True)
        self.layers = nn.ModuleList(
            Block(cfg, cfg.num_hidden_layers + j, expert_parallel, "full_attention")
            for j in range(cfg.mtp_num_hidden_layers))
        self.norm = RMSNorm(D, eps, True)

# -----------------------------------------------------------------------------
# vision (Qwen3-VL): the vision tower, and the image
# tokens' place in the text model (M-RoPE, deepstack)


class VisionMLP(nn.Module):
    """linear_fc1 -> GELU -> linear_fc2, with biases: the
    tower's MLP, and the patch mergers' projection."""

    def __init__(self, D_in, H, D_out, approximate="none"):
        super().__init__()
        self.linear_fc1 = nn.Linear(D_in, H)
        self.linear_fc2 = nn.Linear(H, D_out)
        self.approximate = approximate

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class PatchMerger(VisionMLP):
    """Each merge x merge block of neighbouring patches (adjacent rows of x) ->
    one token of the text model's width. The deepstack mergers normalize the
    concatenated block (postshuffle), the final merger each patch before."""

    def __init__(self, vc, postshuffle):
        H = vc.hidden_size * vc.spatial_merge_size ** 2
        super().__init__(H, H, vc.out_hidden_size)
        self.norm = nn.LayerNorm(H if postshuffle else vc.hidden_size, eps=1e-6)
        self.postshuffle = postshuffle

    def forward(self, x):
        H = self.linear_fc1.in_features
        return super().forward(self.norm(x.view(-1, H) if self.postshuffle else x).view(-1, H))


class VisionAttention(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.n_head = vc.num_heads
        self.qkv = nn.Linear(vc.hidden_size, 3 * vc.hidden_size)
        self.proj = nn.Linear(vc.hidden_size, vc.hidden_size)

    def forward(self, x, cos, sin, lengths):
        N, D = x.shape
        # each (nh, N, hd)
        q, k, v = self.qkv(x).view(N, 3, self.n_head, -1).permute(1, 2, 0, 3).unbind(0)
        # 2-D RoPE in fp32, as HF does
        q, k = (apply_rope(t.float(), cos, sin).to(v.dtype) for t in (q, k))
        # full (not causal) attention within each image: one call per image keeps memory at one
        # image's scores; 4-D inputs, since on CUDA 3-D ones fall back to the unfused math kernel
        y = torch.cat([F.scaled_dot_product_attention(*(t[None] for t in qkv))[0] for qkv in
                       # (nh, N, hd)
                       zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))], dim=1)
        return self.proj(y.transpose(0, 1).reshape(N, D))


class VisionBlock(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.norm1 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        self.attn = VisionAttention(vc)
        self.norm2 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        approximate = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}[vc.hidden_act]
        self.mlp = VisionMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_size, approximate)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


def run_block(block, checkpointing, *args):
    """block(*args); with checkpointing the block keeps only its inputs and is recomputed
    in backward: the activations of one block at a time instead of all of them."""
    return torch.utils.checkpoint.checkpoint(block, *args,
                                             use_reentrant=False) if checkpointing else block(*args)


def merge_order(x, m):
    """(h, w, ...) -> (h * w, ...) in the processor's patch
    order: the m x m patches of one merged token adjacent."""
    h, w = x.shape[:2]
    return x.reshape(h // m, m, w // m, m,
                     *x.shape[2:]).transpose(1, 2).reshape(h * w, *x.shape[2:])


class VisionModel(nn.Module):
    """Qwen3-VL's vision tower. pixel_values (N, C*T*P*P): the patches of all images,
    as the image processor flattens them; grid_thw (I, 3): each image's (t, h, w) in
    patches. Returns the image tokens (N / m^2, D), one per m x m block, and the
    deepstack features (same shape) of the layers in deepstack_visual_indexes."""

    def __init__(self, vc):
        super().__init__()
        self.config = vc
        k = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.patch_embed = nn.ModuleDict(
            dict(proj=nn.Conv3d(vc.in_channels, vc.hidden_size, k, stride=k)))
        # a square grid, interpolated
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(vc, True)
                                                   for _ in vc.deepstack_visual_indexes)

    def forward(self, pixel_values, grid_thw, checkpointing=False):
        vc, m, dev = self.config, self.config.spatial_merge_size, pixel_values.device
        proj = self.patch_embed.proj
        # a convolution with stride = kernel over one patch is a linear map of the flattened patch
        # (N, Dv)
        x = F.linear(pixel_values.to(proj.weight.dtype), proj.weight.flatten(1), proj.bias)
        S = math.isqrt(vc.num_position_embeddings)
        table = self.pos_embed.weight.view(S, S, -1).permute(2, 0, 1)[None]  # (1, Dv, S, S)
        grids = grid_thw.tolist()  # NOTE: a device-to-host sync when grid_thw is on the GPU
        pos, rows_cols, per_size = [], [], {}
        for t, h, w in grids:
            if (h, w) not in per_size:  # once per image size: the interpolation's backward costs
                pe = F.interpolate(table, size=(h, w), mode="bilinear",
                                   align_corners=True)[0].permute(1, 2, 0)
                rc = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"),
                                 -1).to(dev)
                per_size[h, w] = merge_order(pe, m), merge_order(rc, m)
            pos.append(per_size[h, w][0].repeat(t, 1))
            rows_cols.append(per_size[h, w][1].repeat(t, 1))
        x = x + torch.cat(pos)
        # 2-D RoPE: a quarter of each head's frequencies turn
        # with the patch's row, a quarter with its column
        inv_freq = rope_inv_freq(vc.hidden_size // vc.num_heads // 2, 10000.0, dev)
        # (N, hd)
        cos, sin = rope_cos_sin((torch.cat(rows_cols)[..., None] * inv_freq).flatten(1),
                                torch.float32)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            # checkpointed as the text blocks are
            x = run_block(block, checkpointing, x, cos, sin, lengths)
            if i in vc.deepstack_visual_indexes:
                deepstack.append(
                    self.deepstack_merger_list[vc.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack


def mrope_positions(input_ids, image_grid_thw, vc, segment_start=None):
    """(3, B, T) t/h/w positions of Qwen3-VL's M-RoPE. Text tokens count up on all
    three axes; the tokens of an image (its t x h x w merged grid, in order) sit at
    start + (t, h, w) index, and the text after it resumes at start + max(h, w). Images
    are matched to runs of image tokens in order, row by row. segment_start (B, T): the
    index of each token's segment start in a packed row (None: one segment a row)."""
    m = vc.spatial_merge_size
    # (I, 3)
    grid = image_grid_thw.to(input_ids.device).long() // torch.tensor([1, m, m],
                                                                      device=input_ids.device)
    n = grid.prod(-1)  # tokens per image
    # the image of each image token
    img = torch.repeat_interleave(torch.arange(len(n), device=n.device), n)
    # its index within the image
    k = torch.arange(len(img), device=n.device) - (n.cumsum(0) - n)[img]
    t, h, w = grid[img].unbind(-1)
    mask = input_ids == vc.image_token_id
    step = (~mask).long()  # how far each token moves the next position:
                           # text 1, an image max(h, w) at its end
    step[mask] = torch.where(k == n[img] - 1, torch.maximum(h, w), 0)
    pos = (step.cumsum(-1) - step).expand(3, -1, -1).clone()
    pos[:, mask] += torch.stack([k // (h * w), k // w % h, k % w])
    if segment_start is not None:  # packed rows: each segment counts from
                                   # 0 (its first token is at base + 0)
        pos = pos - pos.gather(2, segment_start.expand(3, -1, -1))
    return pos


def mrope_cos_sin(pos, cfg, dtype):
    """Interleaved M-RoPE: frequency j of the head rotates with the t, h or
    w position (t, h, w, t, h, w, ... as mrope_section allots them, the rest
    t). pos (3, B, T) -> cos, sin (B, 1, T, rd), rd = cfg.rotary_dim."""
    rd, (_, s_h, s_w) = cfg.rotary_dim, cfg.mrope_section
    axis = torch.zeros(rd // 2, dtype=torch.long, device=pos.device)
    axis[1:3 * s_h:3], axis[2:3 * s_w:3] = 1, 2
    # (B, T, rd/2)
    freqs = pos[axis].permute(1, 2, 0).float() * rope_inv_freq(rd, cfg.rope_theta, pos.device)
    return rope_cos_sin(freqs[:, None], dtype)


def embed_images(model, input_ids, x, pixel_values, image_grid_thw, segment_start=None,
                 positions=None):
    """The text embeddings x (B, T, D) with the image tokens replaced by the tower's
    output; M-RoPE's cos and sin; the image tokens' (row, column) indices, and the
    deepstack features the first decoder layers add there. positions: context parallelism
    (hidden_states): x holds those tokens of the rows input_ids (B, T_row)."""
    if positions is None:
        checkpointing = model.activation_checkpointing and model.training
        image_tokens, deepstack = model.visual(pixel_values, image_grid_thw,
                                               checkpointing=checkpointing)
    else:
        x, image_tokens, deepstack = context_vision(model, x, pixel_values, image_grid_thw)
    is_image = input_ids == model.config.vision.image_token_id
    where = is_image.nonzero(as_tuple=True)  # NOTE: a device-to-host sync
    if where[0].numel() != image_tokens.shape[0]:
        raise ValueError(f"input_ids hold {where[0].numel()} image tokens but the images "
                         f"(image_grid_thw {image_grid_thw.tolist()}) make "
                         f"{image_tokens.shape[0]}: expand each "
                         "image to its "
                         "t*h*w/merge_size^2 tokens, as this model's processor does")
    if positions is not None:  # this rank's image tokens, and which of the tower's outputs they are
        # (B, T) each token's index among the image tokens
        mine = is_image.flatten().cumsum(0).view(is_image.shape)[:, positions] - 1
        where = is_image[:, positions].nonzero(as_tuple=True)
        image_tokens, deepstack = image_tokens[mine[where]], [d[mine[where]] for d in deepstack]
    x = x.index_put(where, image_tokens.to(x.dtype))
    pos = mrope_positions(input_ids, image_grid_thw, model.config.vision, segment_start)
    pos = pos if positions is None else pos[..., positions]
    cos, sin = mrope_cos_sin(pos, model.config, x.dtype)
    return x, cos, sin, where, [d.to(x.dtype) for d in deepstack]


def context_vision(model, x, pixel_values, grid_thw):
    """Under context parallelism, the tower on this rank's share of the images (consecutive ones,
    about 1 / cp of the patches; a rank with none runs idle_vision), its outputs all-gathered (a
    collective; backward: each rank's rows get their gradient): every rank gets every image token,
    no rank the activations of more than its share. Returns (x, image tokens, deepstack features) in
    the images' order."""
    cp, m2 = model.context_parallel, model.config.vision.spatial_merge_size ** 2
    patches = [t * h * w for t, h, w in grid_thw.tolist()]  # NOTE: a device-to-host sync on the GPU
    starts = [sum(patches[:i]) for i in range(len(patches))]
    owner = [start * cp.size // sum(patches) for start in starts]
    counts = [sum(n for n, o in zip(patches, owner) if o == r) // m2 for r in range(cp.size)]
    mine = [i for i, o in enumerate(owner) if o == cp.rank]
    if mine:
        lo, hi = starts[mine[0]], starts[mine[-1]] + patches[mine[-1]]
        outs = model.visual(pixel_values[lo:hi], grid_thw[mine[0]:mine[-1] + 1],
                            checkpointing=model.activation_checkpointing and model.training)
        outs = [outs[0], *outs[1]]
    else:
        x = idle_vision(model.visual, x)
        # in autograd's graph as the other ranks' outputs are, so that backward's reduce-scatters
        # match
        trains = torch.is_grad_enabled() and any(p.requires_grad for p in model.visual.parameters())
        none = x.new_zeros(0, x.shape[-1]).requires_grad_(trains)
        outs = [none] * (1 + len(model.config.vision.deepstack_visual_indexes))
    # (cp, max count, D) each
    outs = [cp.gather(F.pad(t, (0, 0, 0, max(counts) - len(t)))) for t in outs]
    outs = [torch.cat([t[r, :n] for r, n in enumerate(counts)]) for t in outs]
    return x, outs[0], outs[1:]


def idle_vision(visual, x):
    """x + 0 x the tower's output on one blank image of one merged token. A tower sharded
    over ranks gathers its weights in forward and reduces its gradients in backward,
    collectives every rank must join: a rank whose microbatch holds no image runs this
    instead, so that all ranks run the tower once per forward (every output, deepstack
    too, in the graph: each parameter gets a gradient, zero here, on every rank)."""
    vc, m = visual.config, visual.config.spatial_merge_size
    blank = x.new_zeros(m * m, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2)
    tokens, deepstack = visual(blank, torch.tensor([[1, m, m]]))  # the grid on the host: no sync
    return x + 0 * sum(t.sum() for t in [tokens, *deepstack]).to(x.dtype)


def packing(segment_ids, B, T, device):
    """What packed rows change: (mask (B, 1, T, T) bool: causal within each
    segment, cu_seqlens (S+1,) the segments' offsets in the B*T tokens taken
    row after row, start (B, T) the index of each token's segment start).
    Without segment_ids: (None, one segment a row, None), no host sync."""
    if segment_ids is None:
        return None, torch.arange(B + 1, device=device) * T, None
    idx = torch.arange(T, device=device).expand(B, T)
    new = torch.ones(B, T, dtype=torch.bool, device=device)
    new[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start = torch.where(new, idx, 0).cummax(-1).values
    # NOTE: a device-to-host sync (nonzero)
    cu_seqlens = torch.cat([new.flatten().nonzero()[:, 0], torch.tensor([B * T], device=device)])
    # NOTE: a (T, T) mask a row, which attention kernels
    # read instead of skipping the blocks it masks
    mask = (idx[:, :, None] >= idx[:, None, :]) & (
        segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask[:, None], cu_seqlens, start


# -----------------------------------------------------------------------------
# the model


class Transformer(nn.Module):
    """expert_parallel: how the MoE layers' experts are split over ranks (see Experts); None holds
    them all. context_parallel: a context.ContextParallel when each row is split over ranks
    (hidden_states' positions)."""

    def __init__(self, cfg: ModelConfig, expert_parallel=None, context_parallel=None):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg, expert_parallel)  # attribute names follow HF:
                                                    # model.layers.0.self_attn.q_proj.weight, ...
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Qwen3-VL's vision tower
        self.visual = VisionModel(cfg.vision) if cfg.vision is not None else None
        # Qwen3.5's mtp.*
        self.mtp = MTP(cfg, expert_parallel) if cfg.mtp_num_hidden_layers else None
        self.vision_in_every_forward = False  # True under FSDP over several ranks: see idle_vision
        self.activation_checkpointing = False
        self.context_parallel = context_parallel
        for m in self.modules():  # the token mixers that read across the split
            if isinstance(m, (Attention, GatedDeltaNet)):
                m.context_parallel = context_parallel

    def hidden_states(self, input_ids, routed_experts=None, return_routes=False, pixel_values=None,
                      image_grid_thw=None, segment_ids=None, positions=None):
        """input_ids (B, T) -> final-normed hidden states (B, T, D).

        routed_experts (B, T, L_moe, K): expert ids per token and MoE layer (routing replay),
        or None. return_routes: also return the expert ids used, (B, T, L_moe, K), for
        recording and replay. pixel_values, image_grid_thw: a Qwen3-VL model's images, as its
        image processor makes them, for the image tokens of input_ids in order (each image's
        tokens in one row); None for text alone. segment_ids (B, T): packed rows, each
        token's segment number within its row (non-decreasing along it): positions restart,
        attention stays within a segment, Gated DeltaNet restarts its state. None: a row is
        one segment (right padding needs no segment of its own: nothing real follows it).
        positions (T,): context parallelism (context.split_microbatch): this rank's tokens of each
        row of input_ids (B, T_row), in the order every per-token input and output takes
        (routed_experts and the result: (B, T, ...)).
        """
        if positions is not None and segment_ids is not None:
            raise ValueError("packed rows (segment_ids) are not supported under context "
                             "parallelism: one row a sequence (train.pack_microbatches' rows are)")
        ids = input_ids if positions is None else input_ids[:, positions]
        B, T = ids.shape
        x = self.model.embed_tokens(ids)  # (B, T, D)
        mask, cu_seqlens, start = packing(segment_ids, B, T, x.device)
        deepstack = []
        if pixel_values is None:  # text: M-RoPE with t = h = w is plain RoPE
            inv_freq = rope_inv_freq(self.config.rotary_dim, self.config.rope_theta, x.device)
            t = torch.arange(T, device=x.device) if positions is None else positions
            t = t - (0 if start is None else start)  # (T,) or (B, T)
            # (T, rd) or (B, T, rd)
            cos, sin = rope_cos_sin(t[..., None].float() * inv_freq, x.dtype)
            # (B, 1, T, rd)
            cos, sin = (cos, sin) if start is None else (cos[:, None], sin[:, None])
            if self.visual is not None and self.vision_in_every_forward:
                x = idle_vision(self.visual, x)
        else:
            x, cos, sin, image_tokens, deepstack = embed_images(
                self, input_ids, x, pixel_values, image_grid_thw, start, positions)
        # mtp_hidden runs the MTP layers at these positions
        routes, m, self.positions = [], 0, (cos, sin, mask)
        for i, block in enumerate(self.model.layers):
            replay = routed_experts[:, :, m] if block.is_moe and routed_experts is not None else None
            x, ids = run_block(block, self.activation_checkpointing and self.training, x, cos, sin,
                               replay, mask, cu_seqlens)
            if block.is_moe:
                routes.append(ids)
                m += 1
            if i < len(deepstack):  # Qwen3-VL's deepstack: the tower's
                                    # early features join the first layers
                x = x.index_put(image_tokens, deepstack[i], accumulate=True)
        x = self.model.norm(x)
        if return_routes:
            return x, (torch.stack(routes, dim=2) if routes else None)
        return x

    def mtp_hidden(self, hidden, next_ids):
        """Qwen3.5's MTP head as vLLM drafts with it: from the trunk's hidden states
        (B, T, D) of the last hidden_states call and the token after each position (B,
        T), the final-normed MTP hidden states whose logits at t predict the token
        after next_ids[t]. The trunk's states and the embeddings come in detached."""
        mtp, (cos, sin, mask) = self.mtp, self.positions
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(self.model.embed_tokens(next_ids).detach()),
                              mtp.pre_fc_norm_hidden(hidden.detach())], -1))
        for block in mtp.layers:
            x, _ = block(x, cos, sin, None, mask)
        return mtp.norm(x)

    def forward(self, input_ids, routed_experts=None, pixel_values=None, image_grid_thw=None,
                segment_ids=None):
        """input_ids (B, T) -> logits (B, T, V). The trainer
        uses hidden_states + chunked logprobs instead."""
        return self.lm_head(self.hidden_states(input_ids, routed_experts, pixel_values=pixel_values,
                                               image_grid_thw=image_grid_thw,
                                               segment_ids=segment_ids))

    def init_weights(self, seed=0, std=0.02):
        init_parameters(self.named_parameters(), std, torch.Generator().manual_seed(seed),
                        self.config.family == "qwen3_5")

    # -------------------------------------------------------------------------
    # HF checkpoints

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu"):
        cfg = load_config(path)
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        if cfg.tie_word_embeddings:  # to_empty gives each name its own storage: tie again
            model.lm_head.weight = model.model.embed_tokens.weight
        model.load_state_dict(hf_to_ours(read_safetensors(path), cfg), strict=True, assign=False)
        return model.to(dtype)

    def save_pretrained(self, path, max_shard_bytes=5 * 2**30, dtype=None):
        save_hf_checkpoint(path, ours_to_hf(self.state_dict(), self.config), self.config,
                           max_shard_bytes, dtype)


@torch.no_grad()
def init_parameters(named_tensors, std, generator, zero_centred_norms=False):
    """The init rule: norm weights 1 (0 for Qwen3.5's zero-centred norms; its GDN output norm is
    not one), Gated DeltaNet's dt_bias 1 and A_log log(U(1, 16)), every other weight N(0, std^2),
    drawn from `generator` on the tensor's device (the trainer calls it on each rank's shards)."""
    for name, t in named_tensors:
        if "norm" in name.rsplit(".", 2)[-2]:  # RMSNorm and LayerNorm: identity
            zc = zero_centred_norms and "linear_attn.norm" not in name and "visual." not in name
            t.fill_(0.0 if zc or not name.endswith("weight") else 1.0)
        elif name.endswith(("dt_bias", "A_log")):
            u = torch.rand(t.shape, generator=generator, device=t.device, dtype=torch.float32)
            t.copy_(torch.ones_like(t) if name.endswith("dt_bias") else torch.log(1 + 15 * u))
        else:
            t.copy_(torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype) * std)


def load_config(path):
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path} is not a model directory: it has no config.json")
    with open(cfg_file) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    has_weights = any(os.path.isfile(os.path.join(path, f))
                      for f in ("model.safetensors", "model.safetensors.index.json"))
    if cfg.mtp_num_hidden_layers and has_weights and not any(k.startswith("mtp.")
                                                             for k in weight_files(path)):
        cfg = replace(cfg, mtp_num_hidden_layers=0)  # transformers writes Qwen3.5
                                                     # without its mtp.* weights
    return cfg


def weight_files(path):
    """HF tensor name -> file name, for a single-file or
    sharded (model.safetensors.index.json) directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def checkpoint_reader(path):
    """read(name, rows=None): one tensor of an HF directory (rows: a slice of its first dim),
    the files opened memory-mapped once each, so that a rank reads only what it copies."""
    files, handles = weight_files(path), {}
    def read(name, rows=None):
        if name not in files:
            raise KeyError(f"{path} has no tensor {name!r}")
        if files[name] not in handles:
            handles[files[name]] = safe_open(os.path.join(path, files[name]), framework="pt")
        f = handles[files[name]]
        return f.get_tensor(name) if rows is None else f.get_slice(name)[rows]
    return read


def read_safetensors(path):
    """All tensors of a checkpoint directory, single file or sharded."""
    return {k: v for fname in sorted(set(weight_files(path).values()))
            for k, v in load_file(os.path.join(path, fname)).items()}


def is_stacked_experts(name):
    """True for our stacked (E, ...) expert tensors, e.g. model.layers.0.mlp.experts.gate_proj."""
    return ".mlp.experts." in name


def hf_to_ours(sd, cfg):
    """HF names -> our state dict: per-expert `experts.{e}.P.weight`
    are stacked into `experts.P` (E, ...)."""
    out, experts = {}, {}
    # Qwen3-VL, Qwen3.5 (text-only too): model.language_model.* and model.visual.*
    # are our model.* and visual.*; Qwen3.5's mtp.* keep their names
    if cfg.vision is not None or cfg.family == "qwen3_5":
        sd = {k.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.",
                                                                      1): v
              for k, v in sd.items()}
    for name, t in sd.items():
        if is_stacked_experts(name):
            prefix, rest = name.split(".mlp.experts.")
            if cfg.vision is not None and cfg.family == "qwen3" and rest in (
                    "gate_up_proj", "down_proj"):
                t = t.transpose(1, 2)  # Qwen3-VL-MoE checkpoints stack experts as (E, in, out)
            if rest.startswith("gate_up_proj"):  # transformers 5's fused layout (E, 2H, D)
                out[f"{prefix}.mlp.experts.gate_proj"], out[f"{prefix}.mlp.experts.up_proj"] = t.chunk(2, dim=1)
            elif rest in EXPERT_PROJS:  # already stacked (E, ...)
                out[name] = t
            else:
                e, proj, _ = rest.split(".")
                experts.setdefault((prefix, proj), {})[int(e)] = t
        else:
            out[name] = t
    for (prefix, proj), per_e in experts.items():
        if sorted(per_e) != list(range(cfg.num_experts)):
            raise ValueError(f"{prefix}.mlp.experts.*.{proj} has experts {sorted(per_e)[:4]}..., "
                             f"expected 0..{cfg.num_experts - 1}")
        out[f"{prefix}.mlp.experts.{proj}"] = torch.stack(
            [per_e[e] for e in range(cfg.num_experts)])
    if cfg.tie_word_embeddings:
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def ours_to_hf(sd, cfg):
    """Our state dict -> HF checkpoint names (per-expert,
    as published checkpoints and vLLM expect)."""
    out = {}
    for name, t in sd.items():
        if is_stacked_experts(name):
            prefix, proj = name.split(".mlp.experts.")
            out.update({f"{prefix}.mlp.experts.{e}.{proj}.weight": t[e] for e in range(t.shape[0])})
        elif not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            out[name] = t
    return {hf_name(k, cfg): v for k, v in out.items()}


def hf_name(name, cfg):
    """Our parameter name -> its HF checkpoint name (Qwen3-VL
    nests the text model and the tower under model.)."""
    if cfg.vision is None:
        return name
    return ("model.language_model." + name[6:] if name.startswith("model.") else
            "model." + name if name.startswith("visual.") else name)


def read_experts(read, name, experts, cfg):
    """Our stacked tensor `name` (model.layers.L.mlp.experts.P) for the experts in range
    `experts`, through read(hf_name, rows=None): per-expert tensors, or Qwen3-VL-MoE's
    fused (E, D, 2H) / (E, H, D), of which only those experts' rows are read."""
    prefix, proj = name.split(".mlp.experts.")
    fused = hf_name(prefix, cfg) + ".mlp.experts." + ("down_proj" if proj == "down_proj"
                                                      else "gate_up_proj")
    if cfg.vision is None or cfg.family == "qwen3_5":  # per-expert, or transformers'
                                                       # fused (E, 2H, D) / (E, D, H)
        try:
            t = read(fused, rows=slice(experts.start, experts.stop))
        except KeyError:
            return torch.stack(
                [read(f"{hf_name(prefix, cfg)}.mlp.experts.{e}.{proj}.weight") for e in experts])
    else:
        t = read(fused, rows=slice(experts.start, experts.stop)).transpose(1, 2)
    return t if proj == "down_proj" else t.chunk(2, dim=1)[proj == "up_proj"]


def fuse_vl_experts(hf_sd, cfg):
    """Per-expert HF names -> the layout of published Qwen3-VL-MoE
    checkpoints, the one vLLM's and transformers' loaders read: per layer
    `experts.gate_up_proj` (E, D, 2H) and `experts.down_proj` (E, H, D)."""
    out = {k: v for k, v in hf_sd.items() if not is_stacked_experts(k)}
    for layer in {k.split(".mlp.experts.")[0] + ".mlp.experts." for k in hf_sd
                  if is_stacked_experts(k)}:
        w = [[hf_sd[f"{layer}{e}.{p}.weight"].T for p in EXPERT_PROJS]
             for e in range(cfg.num_experts)]
        out[layer + "gate_up_proj"] = torch.stack([torch.cat([g, u], dim=1) for g, u, _ in w])
        out[layer + "down_proj"] = torch.stack([d for _, _, d in w])
    return out


def save_hf_checkpoint(path, hf_sd, cfg, max_shard_bytes=5 * 2**30, dtype=None):
    """Write config.json + model.safetensors (or shards + index) from HF-named tensors."""
    os.makedirs(path, exist_ok=True)
    if cfg.vision is not None and cfg.is_moe and cfg.family == "qwen3":
        hf_sd = fuse_vl_experts(hf_sd, cfg)
    hf_sd = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu() for k,
             v in hf_sd.items()}
    hf = cfg.to_hf()
    if dtype is not None:
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_json(os.path.join(path, "config.json"), hf)
    shards, cur, size = [], {}, 0
    for k in sorted(hf_sd):
        nbytes = hf_sd[k].numel() * hf_sd[k].element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = hf_sd[k], size + nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in hf_sd.values())
    write_json(os.path.join(path, "model.safetensors.index.json"),
               dict(metadata={"total_size": total}, weight_map=weight_map))


def copy_hf_extras(source_dir, path):
    """Tokenizer, chat template and generation config
    from source_dir; token ids from its config.json."""
    import shutil
    for fname in os.listdir(source_dir):  # weights and config.json are written, not copied
        if os.path.isfile(os.path.join(source_dir, fname)) and not (
                fname.endswith((".safetensors", ".index.json", ".bin")) or fname == "config.json"):
            shutil.copy(os.path.join(source_dir, fname), os.path.join(path, fname))
    src_cfg, config = os.path.join(source_dir, "config.json"), os.path.join(path, "config.json")
    if os.path.isfile(src_cfg):
        src = json.load(open(src_cfg))
        write_json(config, dict(json.load(open(config)),
                                **{k: src[k] for k in ("bos_token_id", "eos_token_id",
                                                       "pad_token_id") if k in src}))


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def num_params(cfg, active=False):
    """Parameter count from the config alone (active=True counts top-k experts
    only), for FLOPs and plans: the model built on the meta device (no memory)."""
    with torch.device("meta"):
        total = sum(p.numel() for p in Transformer(cfg).parameters())
    if active:
        moe = len(cfg.moe_layers) + cfg.mtp_num_hidden_layers
        total -= moe * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total
