"""
Checkpoints: sharded (torch.distributed.checkpoint: every rank writes its shards, and a run resumes
on any number of ranks or any ep_size), the consolidated HF export that vLLM and transformers load,
and the HF weights a run starts from, each rank reading only its own shards (load_hf_weights).
train.py calls these at its checkpoint cadence, for --export_hf_dir and when it builds the model;
tests call them directly.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard

import lora
from experts import local as local_tensor  # a DTensor's local shard, or the tensor
                                           # itself (train.py imports it here)
from model import (checkpoint_reader, copy_hf_extras, hf_name, is_stacked_experts, ours_to_hf,
                   read_experts, save_hf_checkpoint)
from weights_sync import gather, global_shape


def with_global_experts(state, model, experts=None):
    """Copy of a nested FQN-keyed state dict (model, or optimizer: state.FQN.exp_avg) whose expert
    tensors are DTensors of the global (E, ...) tensor on the 2-D experts mesh (sharing storage
    with this rank's piece, so that loading into them loads into the model and the optimizer)."""
    out = {}
    for k, v in state.items():
        # the expert parameter v belongs to, if any
        name = str(k) if is_stacked_experts(str(k)) else experts
        if isinstance(v, dict):
            out[k] = with_global_experts(v, model, name)
        elif name and isinstance(v, DTensor) and v.dim() > 0:
            shape = torch.Size(global_shape(model, name, v))
            out[k] = DTensor.from_local(local_tensor(v), model.meshes["experts"],
                                        [Shard(0), v.placements[0]], run_check=False, shape=shape,
                                        stride=torch.empty(shape, device="meta").stride())
        else:
            out[k] = v
    return out


def save_checkpoint(out_dir, model, optimizer, step, cfg, extra=None):
    """Write out_dir/checkpoints/step_NNNNNN (every rank
    writes its shards) and point `latest` at it."""
    path = os.path.join(out_dir, "checkpoints", f"step_{step:06d}")
    dcp.save(with_global_experts(lora.checkpoint_state(model, optimizer), model),
             checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save({"step": step, "config": cfg, "extra": extra or {}},
                   os.path.join(path, "trainer_state.pt"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        latest = os.path.join(out_dir, "checkpoints", "latest")
        with open(latest + ".tmp", "w") as f:
            f.write(os.path.basename(path))
        os.replace(latest + ".tmp", latest)  # atomic: a crash never leaves
                                             # `latest` naming a half-written step
    dist.barrier()
    return path


def latest_checkpoint(out_dir):
    """Path of the newest complete checkpoint in out_dir, or None."""
    latest = os.path.join(out_dir, "checkpoints", "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return os.path.join(out_dir, "checkpoints", f.read().strip())


def load_checkpoint(path, model, optimizer):
    """Load a checkpoint written by save_checkpoint, on
    any world size / ep_size. Returns (step, extra)."""
    if path is None or not os.path.isfile(os.path.join(path, "trainer_state.pt")):
        raise FileNotFoundError(
            f"no checkpoint at {path!r}: expected a directory written by save_checkpoint "
            "(out_dir/checkpoints/step_NNNNNN)")
    state = lora.checkpoint_state(model, optimizer)
    # fills `state`'s tensors in place
    dcp.load(with_global_experts(state, model), checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=lora.checkpoint_options(model))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    trainer_state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    return trainer_state["step"], trainer_state["extra"]


def full_parameters(model):
    """Yield (name, full tensor on rank 0, None elsewhere) for every
    parameter, gathered from all shards and, for experts, from all EP ranks
    (weights_sync.gather). Collective: every rank must iterate to the end."""
    for name, p in model.named_parameters():  # a tied lm_head is not repeated
        yield name, gather(model, name, p)


def export_hf(model, path, dtype=torch.bfloat16, source_dir=None):
    """Write a consolidated HF safetensors directory (rank 0 writes)
    that vLLM and transformers load. Tokenizer and generation files are
    copied from source_dir, the HF directory the run started from."""
    rank0 = dist.get_rank() == 0  # every rank iterates full_parameters to
                                  # the end: its gathers are collectives
    state = {name: t.cpu() if lora.is_adapter(name) else t.to(dtype).cpu() for name,
             t in full_parameters(model)
             if rank0}
    if rank0:  # LoRA: the adapters merged into their weights,
               # and alone in path/adapter (PEFT's format)
        state = lora.export_adapters(state, model, os.path.join(path, "adapter"), source_dir or "")
        save_hf_checkpoint(path, ours_to_hf(state, model.config), model.config, dtype=dtype)
        if source_dir is not None:
            copy_hf_extras(source_dir, path)
    dist.barrier()
    return path


@torch.no_grad()
def load_hf_weights(model, path):
    """Fill each rank's shards from an HF safetensors directory; files are memory-mapped and each
    rank copies only its rows (for experts, only its own experts), so no rank ever holds the whole
    model."""
    read, cfg = checkpoint_reader(path), model.config
    for name, p in model.named_parameters():
        # adapters are not in the checkpoint (train.build_model initializes them); a tied lm_head is
        # embed_tokens itself
        if lora.is_adapter(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if is_stacked_experts(name):
            first = model.get_submodule(name.rsplit(".", 1)[0]).first_expert
            mine = range(first, first + p.shape[0])  # p.shape[0]: this rank's experts
            full = read_experts(read, name, mine, cfg)
        else:
            full = read(hf_name(name, cfg))
        copy_shard(p, full)


@torch.no_grad()
def copy_shard(p, full):
    """Copy this rank's FSDP shard of `full` into parameter p (chunks on its shard dim, as FSDP and
    torch.chunk cut them)."""
    if tuple(full.shape) != tuple(p.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(full.shape)} does not fit parameter "
                         f"of shape {tuple(p.shape)}")
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        chunks, r = full.chunk(mesh.size(), dim=p.placements[0].dim), mesh.get_local_rank()
        full = chunks[r] if r < len(chunks) else full[:0]
    local_tensor(p).copy_(full.to(p.dtype))
