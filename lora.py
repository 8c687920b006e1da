"""
LoRA adapters on the model: the adapter layers, their
init, their names (ours, PEFT's, vLLM's) and the merge.

A target is an attention projection (q_proj, k_proj, v_proj, o_proj), a dense MLP
projection (gate_proj, up_proj, down_proj; not the MoE router `mlp.gate`), a Gated DeltaNet
projection (GDN_TARGETS, named explicitly: "all" leaves them out), or `experts`: every
routed expert's three projections, with A and B stacked (E, ...) like the base experts, so
expert parallelism partitions them with their experts and the grouped-GEMM path computes
them beside the frozen base's GEMMs (experts.LoRAGroupedMM). The forward of an adapted
weight W is x W^T + scaling * (x A^T) B^T, scaling = lora_alpha /
lora_rank; A (r, in) starts uniform in +-1/sqrt(in) and B (out, r) at
zero, as PEFT does, so a fresh adapter leaves the model unchanged.

    .venv/bin/python -m pytest tests/test_lora.py -q

Imports nothing of ours but model.py.
"""

import contextlib
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from experts import EXPERT_PROJS
from model import Transformer, write_json

LINEAR_TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                  "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
TARGETS = (*LINEAR_TARGETS, "experts")  # "all"
# Gated DeltaNet's projections (Qwen3.5's linear-attention
# layers): named explicitly, not part of "all"
GDN_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LINEAR_TARGETS.update({t: "linear_attn" for t in GDN_TARGETS})
# our target -> the module vLLM wraps with LoRA (it packs q/k/v and gate/up into one layer each)
VLLM_MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                "o_proj": "o_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                "down_proj": "down_proj", "in_proj_qkv": "in_proj_qkvz",
                "in_proj_z": "in_proj_qkvz", "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba",
                "out_proj": "out_proj"}
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values
PEFT_PREFIX = "base_model.model."


def parse_targets(spec):
    """"q_proj,v_proj,experts" -> ("q_proj", "v_proj", "experts");
    "all" is every target. ValueError names a bad one."""
    names = TARGETS if spec.strip() == "all" else tuple(t.strip() for t in spec.split(",")
                                                        if t.strip())
    if (bad := [t for t in names if t not in TARGETS + GDN_TARGETS]) or not names:
        raise ValueError(f"lora_targets={spec!r}: "
                         f"{'unknown ' + ', '.join(bad) if bad else 'empty'}; "
                         "use 'all' or a comma-separated list of "
                         f"{', '.join(TARGETS + GDN_TARGETS)}")
    return names


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update: y = x W^T (+ b) + scaling * (x A^T) B^T.
    Same parameter names as the Linear it replaces (weight, bias), so HF
    checkpoints load unchanged; the adapter is lora_A (r, in), lora_B (out, r)."""

    def __init__(self, in_features, out_features, rank, scaling, bias=False):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank))
        self.lora_scaling = scaling  # named as experts.Experts names it:
                                     # base_only and export_adapters read both

    def forward(self, x):
        return super().forward(x) + self.lora_scaling * F.linear(F.linear(x, self.lora_A),
                                                                 self.lora_B)


def add_adapters(model, rank, alpha, targets):
    """Give `model` (a model.Transformer, on any device, before sharding)
    adapters on `targets` and freeze everything else. The adapters are
    uninitialized: fill them with initial_adapter (or a checkpoint)."""
    scaling = alpha / rank
    for block in model.model.layers:
        for name, where in LINEAR_TARGETS.items():
            parent = getattr(block, where, None)  # a block has self_attn or linear_attn
            old = getattr(parent, name, None)
            if name not in targets or not isinstance(old, nn.Linear) or block.is_moe and where == "mlp":
                continue
            new = LoRALinear(old.in_features, old.out_features, rank, scaling,
                             bias=old.bias is not None)
            new.to(old.weight.device)
            new.weight, new.bias = old.weight, old.bias
            setattr(parent, name, new)
        if block.is_moe and "experts" in targets:
            experts = block.mlp.experts
            for proj in EXPERT_PROJS:
                E, out_f, in_f = getattr(experts, proj).shape  # (E_local, out, in)
                dev = getattr(experts, proj).device
                experts.register_parameter(f"{proj}_lora_A",
                                           nn.Parameter(torch.empty(E, rank, in_f, device=dev)))
                experts.register_parameter(f"{proj}_lora_B",
                                           nn.Parameter(torch.empty(E, out_f, rank, device=dev)))
            experts.lora_scaling = scaling
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def apply(model, cfg, frozen=False):
    """The trainer's model (on the meta device, before sharding) for cfg: with lora_rank
    > 0, adapters on lora_targets and the frozen base in param_dtype (adapters stay
    fp32, so do their gradients and AdamW state). frozen: no adapters, every weight
    frozen in param_dtype (the KL penalty's reference, train.build_reference)."""
    if frozen:
        model.requires_grad_(False)
    elif cfg["lora_rank"]:
        add_adapters(model, cfg["lora_rank"], cfg["lora_alpha"], parse_targets(cfg["lora_targets"]))
    else:
        return model
    for p in model.parameters():
        p.data = p.data if p.requires_grad else p.data.to(getattr(torch, cfg["param_dtype"]))
    return model


@contextlib.contextmanager
def base_only(model):
    """Inside, `model` computes its frozen base alone, every adapter's scaling 0 (a LoRA run's
    reference policy for the KL penalty, at no memory); a model without adapters is unchanged."""
    saved = {m: m.lora_scaling for m in model.modules()
             if getattr(m, "lora_scaling", None) is not None}
    for m in saved:
        m.lora_scaling = 0.0
    try:
        yield model
    finally:
        for m, value in saved.items():
            m.lora_scaling = value


def initial_adapters(model, seed):
    """(adapter parameter, its initial value) for every adapter: the full value of the parameter as
    it stands on this rank before FSDP cuts it, so that a sharded trainer copies its shard
    (checkpoint.copy_shard) and an unsharded model the whole. Expert adapters: this rank's experts
    of the global (E, ...) value."""
    for name, p in model.named_parameters():
        if is_adapter(name):
            experts = model.get_submodule(name.rsplit(".", 1)[0]) if ".mlp.experts." in name else None
            full = initial_adapter(name, [experts.num_experts, *p.shape[1:]] if experts
                                   else p.shape, seed)
            yield p, full[experts.first_expert:experts.first_expert
                          + p.shape[0]] if experts else full


def is_adapter(name):
    return "lora_A" in name or "lora_B" in name


def initial_adapter(name, shape, seed):
    """The initial value of adapter `name`, of its global shape (all experts):
    the same on every rank and world size, so that each rank can cut its own
    shard from it. lora_A uniform in +-1/sqrt(in), lora_B zero."""
    if "lora_B" in name:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(seed + sum(map(ord, name)) * 1009)
    return (torch.rand(shape, generator=g) * 2 - 1) / math.sqrt(shape[-1])


def adapted_weight(name):
    """Our adapter name -> (the weight it adapts, "A" or "B"): q_proj.lora_A -> (q_proj.weight, A),
    experts.gate_proj_lora_B -> (experts.gate_proj, B)."""
    base, ab = name.rsplit("lora_", 1)
    return (base + "weight" if base.endswith(".") else base[:-1]), ab


@torch.no_grad()
def merge(state, scaling):
    """A full state dict (our names, adapters included) -> the same without adapters,
    each adapted weight W + scaling * B @ A (batched over experts), for an HF export."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for name in state:
        if is_adapter(name) and name.endswith("A"):
            weight, _ = adapted_weight(name)
            A, B = state[name].float(), state[name[:-1] + "B"].float()
            out[weight] = (out[weight].float() + scaling * (B @ A)).to(out[weight].dtype)
    return out


def export_adapters(state, model, path, base_model=""):
    """A full state dict of `model` (our names) -> the same with every
    adapter merged into its weight; the adapters alone go to `path` as a
    PEFT directory. Without adapters the state comes back as it is."""
    adapters = {k: v for k, v in state.items() if is_adapter(k)}
    scaling = next((m.lora_scaling for m in model.modules() if getattr(m, "lora_scaling", None)),
                   None)
    if not adapters:
        return state
    rank = next(v.shape[-2] for k, v in adapters.items() if k.endswith("A"))
    targets = {"experts" if ".mlp.experts." in k else k.rsplit(".", 2)[-2] for k in adapters}
    save_peft(path, peft_tensors(adapters), peft_config(rank, scaling * rank, targets, base_model))
    return merge(state, scaling)


def peft_names(name, shape):
    """Our adapter name and global shape -> its PEFT
    tensor names (one per expert for stacked experts)."""
    weight, ab = adapted_weight(name)
    if ".mlp.experts." not in name:
        return [f"{PEFT_PREFIX}{weight[:-len('.weight')]}.lora_{ab}.weight"]
    prefix, proj = weight.split(".mlp.experts.")
    return [f"{PEFT_PREFIX}{prefix}.mlp.experts.{e}.{proj}.lora_{ab}.weight"
            for e in range(shape[0])]


def peft_config(rank, alpha, targets, base_model=""):
    """adapter_config.json of a PEFT LoRA adapter (what PEFT and vLLM read)."""
    return dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, lora_dropout=0.0,
                bias="none", target_modules=sorted(t for t in targets if t != "experts") + (
                    ["gate_proj", "up_proj", "down_proj"] if "experts" in targets else []),
                base_model_name_or_path=base_model, fan_in_fan_out=False, use_rslora=False,
                use_dora=False)


def checkpoint_options(model):
    """A LoRA run's checkpoints hold the adapters and their
    optimizer state; the frozen base comes from model_path."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def checkpoint_state(model, optimizer):
    """{"model", "optimizer"} state dicts for torch.distributed.checkpoint
    (checkpoint.save_checkpoint, load_checkpoint)."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    return {"model": get_model_state_dict(model, options=checkpoint_options(model)),
            "optimizer": get_optimizer_state_dict(model, optimizer)}


def learning_rate_key(cfg):
    """The config key of a run's peak learning rate:
    lora_learning_rate when it trains adapters, else learning_rate."""
    return "lora_learning_rate" if cfg["lora_rank"] else "learning_rate"


def sync_config(cfg):
    """What a LoRA run's weight sync sends with the adapters
    (their PEFT config); None for full fine-tuning."""
    return peft_config(cfg["lora_rank"], cfg["lora_alpha"],
                       parse_targets(cfg["lora_targets"])) if cfg["lora_rank"] else None


def save_peft(path, tensors, config):
    """Write a PEFT adapter directory: adapter_config.json (`config`:
    peft_config's) + adapter_model.safetensors of `tensors` (PEFT names)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(path, "adapter_config.json"), config)
    return path


def peft_tensors(state):
    """Our full adapter tensors {name: tensor} -> {PEFT
    name: tensor}, experts split one per expert."""
    out = {}
    for name, t in state.items():
        names = peft_names(name, t.shape)
        out.update(zip(names, t.unbind(0)) if ".mlp.experts." in name else [(names[0], t)])
    return out


def adapter_shapes(mcfg, cfg, served_only=False):
    """{adapter name: global shape} of a run (served_only:
    those vLLM serves, the expert adapters left out)."""
    targets = [t for t in parse_targets(cfg["lora_targets"])
               if not (served_only and t == "experts")]
    with torch.device("meta"):
        model = add_adapters(Transformer(mcfg), cfg["lora_rank"], cfg["lora_alpha"], targets)
    return {n: p.shape for n, p in model.named_parameters() if is_adapter(n)}


def engine_options(cfg, mcfg):
    """engine.Engine keyword arguments of a LoRA run
    (plan.engine_options adds them when lora_rank > 0)."""
    options = dict(worker_extension_cls="worker.LoRAWeightSyncWorker")
    # the modules vLLM serves LoRA on, in vLLM's names (it packs q/k/v
    # and gate/up); the routed experts are merged into the engines'
    # weights instead (worker.WeightSyncWorker.receive_adapter)
    if targets := sorted({VLLM_MODULES[n.rsplit(".", 2)[-2]]
                          for n in adapter_shapes(mcfg, cfg, served_only=True)}):
        options.update(enable_lora=True, max_loras=1, lora_target_modules=targets,
                       # the smallest max_lora_rank vLLM accepts that holds lora_rank
                       max_lora_rank=next(r for r in VLLM_RANKS if r >= cfg["lora_rank"]),
                       lora_path=os.path.join(cfg["out_dir"], "engine_adapter"))
    return options


def write_zero_adapter(path, mcfg, cfg):
    """The served adapters at zero (the model unchanged) as a PEFT
    directory: what a fresh engine serves until its first sync."""
    zeros = {n: torch.zeros(shape) for n,
             shape in adapter_shapes(mcfg, cfg, served_only=True).items()}
    return save_peft(path, peft_tensors(zeros), sync_config(cfg))
