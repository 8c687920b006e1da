"""
Checkpoints: sharded (torch.distributed.checkpoint: every rank writes its shards, and a run resumes on any number
of ranks or any ep_size) and the consolidated HF export that vLLM and transformers load. train.py calls these at
its checkpoint cadence and for --export_hf_dir; tests call them directly.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard

import lora
from model import copy_hf_extras, is_stacked_experts, ours_to_hf, save_hf_checkpoint


def local_tensor(t):
    return t.to_local() if isinstance(t, DTensor) else t



def global_experts(t, meshes):
    """This rank's piece of an expert tensor as a DTensor of the global (E, ...) tensor on the 2-D experts mesh.
    Shares storage with t, so loading into it loads into t."""
    shape = (t.shape[0] * meshes["ep"].size(), *t.shape[1:])
    return DTensor.from_local(local_tensor(t), meshes["experts"], [Shard(0), t.placements[0]], run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def with_global_experts(state, meshes, experts=False):
    """Copy of a nested FQN-keyed state dict (model, or optimizer: state.FQN.exp_avg) whose expert tensors are
    global DTensors (see above)."""
    out = {}
    for k, v in state.items():
        is_experts = experts or is_stacked_experts(str(k))
        if isinstance(v, dict):
            out[k] = with_global_experts(v, meshes, is_experts)
        elif is_experts and isinstance(v, DTensor) and v.dim() > 0:
            out[k] = global_experts(v, meshes)
        else:
            out[k] = v
    return out


def save_checkpoint(out_dir, model, optimizer, step, cfg, extra=None):
    """Write out_dir/checkpoints/step_NNNNNN (every rank writes its shards) and point `latest` at it."""
    path = os.path.join(out_dir, "checkpoints", f"step_{step:06d}")
    state = lora.checkpoint_state(model, optimizer)
    dcp.save(with_global_experts(state, model.meshes), checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save({"step": step, "config": cfg, "extra": extra or {}}, os.path.join(path, "trainer_state.pt"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        latest = os.path.join(out_dir, "checkpoints", "latest")
        with open(latest + ".tmp", "w") as f:
            f.write(os.path.basename(path))
        os.replace(latest + ".tmp", latest)  # atomic: a crash never leaves `latest` naming a half-written step
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
    """Load a checkpoint written by save_checkpoint, on any world size / ep_size. Returns (step, extra)."""
    if path is None or not os.path.isfile(os.path.join(path, "trainer_state.pt")):
        raise FileNotFoundError(f"no checkpoint at {path!r}: expected a directory written by save_checkpoint "
                                "(out_dir/checkpoints/step_NNNNNN)")
    state = lora.checkpoint_state(model, optimizer)
    dcp.load(with_global_experts(state, model.meshes), checkpoint_id=path)  # fills `state`'s tensors in place
    set_model_state_dict(model, state["model"], options=lora.checkpoint_options(model))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    trainer_state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    return trainer_state["step"], trainer_state["extra"]


@torch.no_grad()
def full_parameters(model):
    """Yield (name, full tensor) for every parameter, gathered from all shards and, for experts, from all EP ranks.
    Collective: every rank must iterate to the end. Costs one or two all-gathers per parameter."""
    for name, p in model.named_parameters():  # a tied lm_head is not repeated
        yield name, gather_full(name, p, model.meshes)


def gather_full(name, t, meshes):
    """The whole tensor (a parameter, its gradient or its Adam state) from the shards on all ranks."""
    if not isinstance(t, DTensor):
        return t.detach()
    if t.device.type != t.device_mesh.device_type:  # cpu_offload_optimizer: host shards, GPU collectives
        t = t.to(t.device_mesh.device_type)
    full = t.full_tensor()  # over its FSDP mesh; experts: (E / ep, ...) this EP rank's experts
    if is_stacked_experts(name) and meshes["ep"].size() > 1:
        full = DTensor.from_local(full, meshes["ep"], [Shard(0)], run_check=False).full_tensor()  # (E, ...)
    return full


def export_hf(model, path, dtype=torch.bfloat16, source_dir=None):
    """Write a consolidated HF safetensors directory (rank 0 writes) that vLLM and transformers load. Tokenizer and
    generation files are copied from source_dir, the HF directory the run started from."""
    rank0 = dist.get_rank() == 0
    state = {}
    for name, t in full_parameters(model):
        if rank0:
            state[name] = t.cpu() if lora.is_adapter(name) else t.to(dtype).cpu()
    if rank0:  # LoRA: the adapters merged into their weights, and alone in path/adapter (PEFT's format)
        state = lora.export_adapters(state, model, os.path.join(path, "adapter"), source_dir or "")
        save_hf_checkpoint(path, ours_to_hf(state, model.config), model.config, dtype=dtype)
        if source_dir is not None:
            copy_hf_extras(source_dir, path)
    dist.barrier()
    return path
