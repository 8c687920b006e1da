"""
Trainer -> engine weight transfer: pause the engines (in-flight requests kept), broadcast the
new weights in buckets, load them in every engine worker, bump the weight version, resume.

    .venv/bin/python -m pytest tests/test_weights_sync.py -q         # real vLLM engine + real gloo ranks (CPU)
    torchrun --nproc_per_node=2 bench.py sync                        # bucketed vs raw NCCL broadcast (2 GPUs)

One process group joins the trainer's sender (rank 0 of the trainer, group rank 0)
and every worker of every engine (group ranks 1..N; tensor-parallel workers each
receive the full tensors and load their own shard). NCCL on GPU, gloo on CPU. The
trainer side needs torch alone; vLLM is only imported inside engine workers.

    sender = WeightSender(bucket_bytes=512 << 20)                    # every trainer rank
    await connect_engines(engines, sender)                           # rank 0; again after an engine restart
    await sync_weights(engines, sender, model, policy_version)       # every trainer rank (engines=None off rank 0)

How the weights travel. Every trainer rank walks the parameters in the same order. A parameter
sharded by FSDP2 (a DTensor) is gathered to the sender only (a `gather`, not an all-gather: no
rank but the sender ever holds a full tensor). Under expert parallelism each EP rank holds a
different block of experts: the block is first gathered within its owner's FSDP group to the
owner rank that shares rank 0's EP group, then those owners gather their blocks to rank 0 over
the EP group. The sender casts to the engine dtype, packs tensors into flat byte buckets (stacked
experts are split into HF's per-expert names, `model.ours_to_hf`), and broadcasts bucket k while
it packs bucket k+1 (two buffers). Workers receive bucket k+1 while they load bucket k.

A LoRA run (`WeightSender(adapter=lora.sync_config(cfg))`) sends its adapters alone, fp32, in PEFT
names, through the same gathers and buckets; the workers' `receive_adapter` serves them with vLLM's
LoRA support (attention and dense MLPs) and merges the routed-expert ones into the expert weights.

The engine end of the transfer (the worker extension `WeightSyncWorker`, which engine.Engine names)
lives in worker.py with the other classes vLLM's processes load by name.

Why not vLLM's weight-transfer engine API (`weight_transfer_config`,
`WeightTransferEngineFactory`, `init_weight_transfer_engine` -> `start_weight_update` ->
`update_weights` -> `finish_weight_update`)? Its worker half is `initialize_layerwise_reload` ->
`model.load_weights` -> `finalize_layerwise_reload`, which is exactly what the worker's own
`reload_weights(weights_iterator=..., is_checkpoint_format=True)` runs, so we call that with a
streaming iterator over the received buckets: one rpc per sync, one code path on CPU and GPU (the
layerwise reload re-runs vLLM's weight processing, so CPU's repacked Linears and GPU's
fused/quantized layers all update; a bare `model.load_weights` silently misses repacked layers on
CPU). Taking the factory route would add an engine argument every engine must be started with, a
registry entry that has to exist in the worker process before the model loads, a trainer-side
import of vLLM (our GPU trainer image has none), and its trainer half (`WeightSource`)
materializes every parameter with `full_tensor()` on every rank and knows nothing of EP owners or
stacked experts, which is the part that matters at scale. The version bump is the same call the
factory's `finish_weight_update(weight_version=...)` makes (`update_weight_version`).
"""
import asyncio
import math
import random
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import lora
from model import is_stacked_experts, ours_to_hf

ALIGN = 256  # byte alignment of each tensor in a bucket: keeps copies and NCCL on aligned addresses
BUCKET_BYTES = 512 << 20  # WeightSender's default bucket size (the dry run plans with it)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_BLOCK = 128  # vLLM's fp8 weight blocks (weight_block_size [128, 128]): one scale per block

# -----------------------------------------------------------------------------
# the process group between the sender and the engine workers


def stateless_process_group(host, port, rank, world_size, backend, timeout_s=600.0):
    """A process group outside torch's global state, the construction of vLLM's
    `stateless_init_torch_distributed_process_group` in torch alone, so that the trainer
    needs no vLLM and both ends run one function. Rank 0 hosts the rendezvous store at
    host:port; every rank blocks here until all world_size have joined. Collectives are
    called on the group object (`pg.broadcast(t, root)`), group ranks."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")
    from torch.distributed import PrefixStore, ProcessGroup, TCPStore
    timeout = timedelta(seconds=timeout_s)
    # a TCPStore of our own, not torch.distributed.rendezvous: under torchrun that one only ever
    # connects to the launcher's store (TORCHELASTIC_USE_AGENT_STORE) and never serves ours
    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    # prefixed: our keys never collide with another user of the store
    prefix_store = PrefixStore(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}",
                               store)
    pg = ProcessGroup(prefix_store, rank, world_size)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo
        impl = ProcessGroupGloo(prefix_store, rank, world_size, timeout=timeout)
        backend_type, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        from torch.distributed import ProcessGroupNCCL
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        # NCCL's kernels on a high-priority stream: the bucket packing and loading copies
        # running beside them would otherwise take the SMs that the broadcast waits for
        options.is_high_priority_stream = True
        impl = ProcessGroupNCCL(prefix_store, rank, world_size, options)
        backend_type, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
    pg._set_default_backend(backend_type)
    impl._set_sequence_number_for_group()
    pg._register_backend(device, backend_type, impl)
    return pg


HANDED_OUT = set()  # the ports free_port gave this process


def free_port(host="127.0.0.1"):
    """A port nothing is bound to now, for a server the caller starts. Picked at random below the
    kernel's ephemeral range, from which the kernel takes the local ports of outgoing connections (a
    port it gave for binding could be taken so before the server binds it); never twice in one
    process."""
    try:  # Linux; elsewhere the range starts at 32768 or above
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except OSError:
        ephemeral = 32768
    rng = random.Random()  # its own seed: tests seed the global generator alike in every process
    while True:
        port = rng.randrange(10000, ephemeral)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if port not in HANDED_OUT:
            HANDED_OUT.add(port)
            return port

# -----------------------------------------------------------------------------
# the bucket layout: which tensor goes where, computed from global shapes alone (no communication)


def bucket_layout(model, bucket_bytes, dtype=torch.bfloat16, adapters_only=False, fp8=False):
    """Lay the model's weights, in HF names, into flat byte buckets of at most
    `bucket_bytes` (a tensor larger than that gets a bucket of its own). Stacked
    experts are split at expert boundaries. adapters_only: the LoRA adapters
    alone, in PEFT names (lora.peft_names), the frozen base stays where it is.
    fp8: the weights that vLLM's fp8 engine quantizes (fp8_on_wire) travel as e4m3
    with a float32 `*.weight_scale_inv` per 128x128 block (quantize_fp8_blocks), each
    right after its weight in the list: about half the bytes.

    Returns (buckets, pieces). `buckets` is what the engines get: [{"nbytes": int, "tensors":
    [[hf_name, dtype_name, shape, byte_offset], ...]}, ...] (plain lists: it travels as an
    rpc argument). `pieces` is what the sender packs: per bucket, [(param_name, expert_start,
    expert_stop, byte_offset, scale_offset)], expert_* None for tensors that are not stacked
    experts, scale_offset None for tensors that are not quantized (else where the pieces'
    scales start: after their weights).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets, pieces = [], []

    def room():  # bytes left in the last bucket after its next aligned offset
        return bucket_bytes - align(buckets[-1]["nbytes"]) if buckets else 0

    def place(nbytes):  # byte offset for nbytes, opening a new
                        # bucket when they do not fit in the last one
        if not buckets or (nbytes > room() and buckets[-1]["nbytes"] > 0):
            buckets.append({"nbytes": 0, "tensors": []})
            pieces.append([])
        offset = align(buckets[-1]["nbytes"])
        buckets[-1]["nbytes"] = offset + nbytes
        return offset

    for name, p in model.named_parameters():
        if adapters_only != lora.is_adapter(name):
            continue
        shape = global_shape(model, name, p)
        hf = (dict.fromkeys(lora.peft_names(name, shape)) if adapters_only else  # per-expert names
              ours_to_hf({name: torch.empty(shape, device="meta")}, model.config))
        if not hf:  # a tied lm_head: the engine ties it to embed_tokens itself
            continue
        stacked = is_stacked_experts(name)
        names, one = list(hf), list(shape[1:] if stacked else shape)  # one: each HF tensor's shape
        quantized = fp8 and fp8_on_wire(names[0], one)
        blocks = [-(-n // FP8_BLOCK) for n in one[-2:]]  # its scales' shape
        w_bytes = math.prod(one) * (1 if quantized else dtype.itemsize)
        s_bytes = 4 * math.prod(blocks) if quantized else 0
        e, count = 0, shape[0] if stacked else 1
        while e < count:  # as many experts as fit in the last bucket, or else in a new one
            per, pad = w_bytes + s_bytes, ALIGN if quantized else 0  # (at least one)
            n = min(count - e, max(0, room() - pad) // per or max(1, (bucket_bytes - pad) // per))
            offset = place(align(n * w_bytes) + n * s_bytes if quantized else n * w_bytes)
            scales = offset + align(n * w_bytes) if quantized else None
            for i in range(n):
                buckets[-1]["tensors"].append([names[e + i], "float8_e4m3fn" if quantized
                                               else str(dtype).removeprefix("torch."), one,
                                               offset + i * w_bytes])
                if quantized:
                    buckets[-1]["tensors"].append([scale_name(names[e + i]), "float32", blocks,
                                                   scales + i * s_bytes])
            pieces[-1].append((name, e, e + n, offset, scales) if stacked
                              else (name, None, None, offset, scales))
            e += n
    return buckets, pieces


def fp8_on_wire(hf_name, shape):
    """Whether an fp8 sync sends this weight quantized: the projections of attention and of the
    MLPs and experts, every one a Linear (or expert) that vLLM's fp8 engine quantizes block-wise
    itself. Embeddings, lm_head, norms, the router, the vision tower and the MTP drafter's layers
    travel in the engine dtype: a lossy copy of a weight the engine keeps in bf16 would be a
    mismatch of our making."""
    return (len(shape) == 2 and hf_name.endswith("_proj.weight")
            and not hf_name.startswith(("visual.", "mtp.")))


def scale_name(hf_name):
    return hf_name.removesuffix("weight") + "weight_scale_inv"  # vLLM's checkpoint fp8 name


def quantize_fp8_blocks(w, block=FP8_BLOCK):
    """w (..., M, K) -> (e4m3 (..., M, K), float32 scales (..., ceil(M/block), ceil(K/block))):
    vLLM's per_block_cast_to_fp8 (what its fp8 engine does to a bf16 weight): each block's
    absolute max (at least 1e-4) maps to 448, w = q * scale per block. Costs an fp32 copy of w."""
    M, K = w.shape[-2:]
    x = torch.nn.functional.pad(w.float(), (0, -K % block, 0, -M % block))
    x = x.unflatten(-1, (-1, block)).unflatten(-3, (-1, block))  # (..., M/b, b, K/b, b)
    scale = x.abs().amax((-3, -1), keepdim=True).clamp(min=1e-4) / FP8_MAX
    q = (x * (1.0 / scale)).to(FP8).flatten(-2).flatten(-3, -2)[..., :M, :K]
    return q, scale.squeeze(-1).squeeze(-2)


def align(nbytes):
    return -(-nbytes // ALIGN) * ALIGN


def tensor_view(buf, dtype_name, shape, offset):
    dtype = getattr(torch, dtype_name)
    return buf[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def global_shape(model, name, p):
    """The full shape of parameter `name` (p: it, its gradient or its Adam state): a DTensor's
    global shape; stacked experts count all experts, not the E/ep this rank's EP shard holds."""
    shape = list(p.shape)
    if is_stacked_experts(name):
        shape[0] = model.get_submodule(name.rsplit(".", 1)[0]).num_experts
    return tuple(shape)

# -----------------------------------------------------------------------------
# gathering a parameter to rank 0 (the weight sync, the HF export, checkpoint.full_parameters)


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def gather_to(p, dst, dtype, device):
    """The full tensor of `p` (cast to dtype, on device) on global rank dst, None on every other
    rank. A DTensor sharded on one mesh dimension (FSDP2, or HSDP with replicas) is gathered
    over that dimension's group, padded to equal chunks (FSDP2 shards with torch.chunk: the last
    shards may be short or empty). Costs one `gather`; only dst allocates the full tensor."""
    placements = p.placements if isinstance(p, DTensor) else ()
    sharded = [(i, pl.dim) for i, pl in enumerate(placements) if pl.is_shard()]
    if len(sharded) > 1 or any(not (pl.is_shard() or pl.is_replicate()) for pl in placements):
        raise ValueError(f"cannot gather a DTensor with placements {p.placements}: weight sync "
                         "supports one "
                         "sharded mesh dimension (FSDP2 or HSDP)")
    if not sharded:  # a plain tensor, or a replicated DTensor
        return (p.to_local() if placements
                else p).detach().to(device=device, dtype=dtype) if rank() == dst else None
    mesh_dim, dim = sharded[0]
    group = p.device_mesh.get_group(mesh_dim)
    ranks = dist.get_process_group_ranks(group)
    if dst not in ranks:  # another replica's shard group: dst gathers from its own
        return None
    # a copy: the sharded params may be offloaded
    local = p.to_local().detach().to(device=device, dtype=dtype)
    n, world = p.shape[dim], len(ranks)
    chunk = -(-n // world)
    if local.shape[dim] < chunk:  # zeros after a short (or empty) shard, on dim `dim`
        local = torch.nn.functional.pad(local, (0, 0) * (local.dim() - 1 - dim)
                                        + (0, chunk - local.shape[dim]))
    if rank() != dst:
        dist.gather(local.contiguous(), None, dst=dst, group=group)
        return None
    if dim == 0:  # contiguous views of the full tensor: the gather writes in place
        full = local.new_empty((chunk * world, *local.shape[1:]))
        dist.gather(local.contiguous(), list(full.chunk(world)), dst=dst, group=group)
    else:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.gather(local.contiguous(), parts, dst=dst, group=group)
        full = torch.cat(parts, dim)
    return full.narrow(dim, 0, n)


@torch.no_grad()
def gather(model, name, t, dtype=None, device=None):
    """The whole of parameter `name` of the (sharded) model, or of t (its gradient or Adam
    state: its layout), on rank 0, cast to dtype (None: as it is) on device; None on every
    other rank. Every rank calls it. Stacked experts under expert parallelism: each EP
    rank's FSDP group gathers its block of experts to its member in rank 0's EP group (the
    ranks 0..ep-1: train.build_meshes), which then gather their blocks to rank 0 in expert
    order (EP rank i holds the experts [i*E/ep, (i+1)*E/ep): Experts.first_expert)."""
    device = device if device is not None else (t.device_mesh.device_type if isinstance(t, DTensor)
                                                else t.device)
    experts = model.get_submodule(name.rsplit(".", 1)[0]) if is_stacked_experts(name) else None
    ep = experts.expert_parallel if experts is not None else None  # its process group, or None
    if ep is None:
        return gather_to(t, 0, dtype, device)
    block = gather_to(t, ep.rank(), dtype, device)  # (E/ep, ...) on its member of rank 0's group
    if block is None:
        return None
    full = block.new_empty(global_shape(model, name, t)) if rank() == 0 else None  # (E, ...)
    blocks = list(full.chunk(ep.size())) if full is not None else None
    dist.gather(block.contiguous(), blocks, dst=0, group=ep)
    return full

# -----------------------------------------------------------------------------
# trainer side


class WeightSender:
    """Sends the trainer's weights to the engines. Construct it on every
    trainer rank; rank 0 is the sender and joins the engine group
    (`connect_engines`), the others only take part in the gathers of `send`."""

    def __init__(self, bucket_bytes=BUCKET_BYTES, dtype=torch.bfloat16, device=None, adapter=None,
                 fp8=False, in_place=False):
        # adapter: a LoRA run's lora.peft_config: only the adapters travel, in fp32 (megabytes),
        # and the engines serve them through vLLM's LoRA support (WeightSyncWorker.receive_adapter)
        # fp8: the projections travel block-quantized (bucket_layout), for engines serving fp8
        self.fp8 = fp8 and adapter is None
        self.bucket_bytes, self.dtype, self.adapter = bucket_bytes, torch.float32 if adapter else dtype, adapter
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))
        self.group = None  # the engine process group, on the sender only
        # in_place: an engine on the sender's GPU reads each bucket from the sender's own buffer
        # (CUDA IPC: no NCCL between two processes on one GPU); the gloo group only says when
        self.in_place = in_place

    @property
    def is_sender(self):
        return rank() == 0

    def connect(self, host, port, world_size, backend, timeout_s=600.0):
        """Join the engine group as group rank 0 (blocks until every engine worker has joined)."""
        self.close()
        self.group = stateless_process_group(host, port, 0, world_size, backend, timeout_s)

    def close(self):
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    def layout(self, model):
        return bucket_layout(model, self.bucket_bytes, self.dtype,
                             adapters_only=self.adapter is not None, fp8=self.fp8)

    def buffers(self, layout):
        """The sender's two bucket buffers for `layout`, and (in_place) their handles for the
        engine workers: bytes each, which pickle.loads opens in another process (a CUDA IPC
        handle on GPU; a shared-memory file descriptor on CPU, between processes of one family)."""
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 (registers torch's reducers with ForkingPickler)
        buckets = layout[0]
        if not (self.is_sender and buckets):
            return [], []
        size = max(b["nbytes"] for b in buckets)
        buffers = [torch.empty(size, dtype=torch.uint8, device=self.device)
                   for _ in range(min(2, len(buckets)))]
        if not self.in_place:
            return buffers, []
        if self.device.type == "cpu":
            buffers = [b.share_memory_() for b in buffers]
        return buffers, [bytes(ForkingPickler.dumps(b)) for b in buffers]

    @torch.no_grad()
    def send(self, model, layout, buffers=None):
        """Gather, cast, pack and broadcast every bucket of `layout`
        (from `layout(model)`). Every trainer rank calls it (in the same
        parameter order); returns the bytes sent (0 off the sender).
        in_place: bucket k is packed into buffers[k % 2] (from buffers(layout), whose handles the
        workers hold), then one gloo barrier says so; the workers pass barrier k once they copied
        bucket k - 1 out, so after it the sender packs k + 1 into that bucket's buffer. A last
        barrier: every bucket copied."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # we may run in a helper thread,
                                                # which starts on device 0
        buckets, pieces = layout
        if self.is_sender and self.group is None:
            raise RuntimeError(
                "WeightSender.send before connect: call connect_engines(engines, sender) first")
        by_param = {}
        for k, bucket_pieces in enumerate(pieces):
            for name, *piece in bucket_pieces:
                by_param.setdefault(name, []).append((k, *piece))
        left = [len(ps) for ps in pieces]  # pieces still to pack, per bucket
        if buffers is None:
            buffers = self.buffers(layout)[0]
        works, current = [], -1
        # in place, bucket k's buffer is free once barrier k - 1 passed; a broadcast's once sent
        lag = 1 if self.in_place else 2
        for name, p in model.named_parameters():
            if name not in by_param:  # every rank knows the layout: a frozen base is not gathered
                continue
            # an unsharded tensor is not cast here: the copy into the bucket casts,
            # reading fp32 once (on GPU this memory traffic competes with NCCL's)
            full = gather(model, name, p, self.dtype if isinstance(p, DTensor) else None,
                          self.device)
            if full is None:
                continue
            for k, e0, e1, offset, scales in by_param.get(name, ()):
                if k != current:  # first piece of bucket k: its buffer
                                  # must be free (bucket k-2 sent)
                    current = k
                    if k >= 2:
                        works[k - lag].wait()  # NCCL: the stream waits, not
                                               # the host; gloo: the host waits
                src = full if e0 is None else full[e0:e1]
                buf = buffers[k % 2]
                dtype = self.dtype
                if scales is not None:  # quantized from the bf16 weights, as vLLM's engine would
                    src, scale = quantize_fp8_blocks(src.to(dtype))
                    tensor_view(buf, "float32", scale.shape, scales).copy_(scale)
                    dtype = FP8
                tensor_view(buf, str(dtype).removeprefix("torch."), src.shape, offset).copy_(src)
                left[k] -= 1
                if left[k] == 0:
                    works.append(self.barrier() if self.in_place
                                 else self.group.broadcast(buf[:buckets[k]["nbytes"]], 0))
        if self.in_place and self.is_sender:
            works.append(self.barrier())  # the workers copied the last bucket
        for work in works:
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        if self.is_sender and len(works) != len(buckets) + self.in_place:
            raise RuntimeError(
                f"sent {len(works)} of {len(buckets)} buckets: the model changed since layout()")
        return sum(b["nbytes"] for b in buckets) if self.is_sender else 0

    def barrier(self):
        """In place: the packed bucket is written (a host wait for the GPU's copies), then a gloo
        barrier with the workers (a one-element all-reduce on the host). Returns its work."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return self.group.allreduce(torch.zeros(1))

# -----------------------------------------------------------------------------
# the flow around a sync, against the engine interface
# (an engine.Engine, or a Ray actor handle of one)


def _call(engine, method, *args, **kwargs):
    """An awaitable for engine.method(...): a coroutine
    of a local Engine, or an ObjectRef of a Ray actor."""
    fn = getattr(engine, method)
    return fn.remote(*args, **kwargs) if hasattr(fn, "remote") else fn(*args, **kwargs)


async def connect_engines(engines, sender, host="127.0.0.1", port=0, backend=None, timeout_s=600.0):
    """Form the weight group: sender = group rank 0, then every worker of every
    engine. `host` must be an address of the sender that the engines can reach.
    Call it again (all engines) after an engine restarts: a group's members are
    fixed, so the group is re-formed. Returns the group's world size."""
    backend = backend or ("nccl" if sender.device.type == "cuda" and not sender.in_place
                          else "gloo")
    port = port or free_port(host)
    workers = [len(await _call(e, "collective_rpc", "weight_worker_rank")) for e in engines]
    world_size = 1 + sum(workers)
    await asyncio.gather(*(_call(e, "collective_rpc", "close_weight_group") for e in engines))
    offsets = [1 + sum(workers[:i]) for i in range(len(engines))]
    joins = [asyncio.ensure_future(_call(e, "collective_rpc", "init_weight_group",
                                         args=(host, port, off, world_size, backend, timeout_s)))
             for e, off in zip(engines, offsets)]
    connect = asyncio.ensure_future(
        asyncio.to_thread(sender.connect, host, port, world_size, backend, timeout_s))
    # all have joined
    done, _ = await asyncio.wait([*joins, connect], return_when=asyncio.FIRST_EXCEPTION)
    for f in [*joins, connect]:
        if f in done and f.exception() is not None:
            raise f.exception()  # an engine that cannot join fails here;
                                 # the sender's wait then times out
    return world_size


async def sync_weights(engines, sender, model, policy_version, asleep=False):
    """After an optimizer step, on every trainer rank: pause the engines (in-flight
    requests kept), send the weights, load them, set the engines' weight version to
    `policy_version`, resume. Off rank 0 `engines` is ignored (pass None) and the rank
    only joins the gathers. Returns {"bytes", "pause_s", "transfer_s", "drafts"}.

    If a load or the transfer fails, the weight group is closed (workers still waiting in
    a broadcast get an error instead of waiting for the timeout), the engines resume on
    the weights they hold (layers that had not arrived keep their old values; the version
    is not bumped), and the error is raised, an engine's own first (e.g. Ray's
    RayActorError for a dead engine). Call connect_engines again before the next sync.
    asleep: the engines sleep (placement="colocated", sleep_engines): instead of pause and
    resume, their weights wake for the transfer and their KV cache after it (the trainer's cached
    GPU blocks go back to the driver first); "wake_s" is then the time the waking took."""
    layout = sender.layout(model)
    if not sender.is_sender:
        await asyncio.to_thread(sender.send, model, layout)
        return {"bytes": 0, "pause_s": 0.0, "transfer_s": 0.0}
    t0 = time.perf_counter()
    if asleep and torch.cuda.is_available():
        torch.cuda.empty_cache()  # what the trainer's step cached, for the engine
    await asyncio.gather(*(_call(e, *(("wake", ["weights"]) if asleep else ("pause",)))
                           for e in engines))
    t1 = time.perf_counter()
    try:
        # the workers block in the broadcasts (in place: the barriers) of receive_weights
        # while the sender (in a thread) feeds them
        buffers, handles = sender.buffers(layout)
        rpc = ("receive_adapter", (layout[0], sender.adapter)) if sender.adapter else (
            "receive_weights", (layout[0], handles or None))
        loads = [asyncio.ensure_future(_call(e, "collective_rpc", *rpc)) for e in engines]
        send = asyncio.ensure_future(asyncio.to_thread(sender.send, model, layout, buffers))
        done, _ = await asyncio.wait([*loads, send], return_when=asyncio.FIRST_EXCEPTION)
        if any(f in done and f.exception() is not None for f in [*loads, send]):
            sender.close()
            # let the others fail fast on the closed group
            await asyncio.wait([*loads, send], timeout=60)
            errors = [f.exception() for f in [*loads, send] if f.done()
                      and f.exception() is not None]
            raise errors[0]  # an engine's error (the cause) before the sender's broken-pipe
        await asyncio.gather(*(_call(e, "set_version", policy_version) for e in engines))
        drafts = [sum(d) for d in zip(
            *await asyncio.gather(*(_call(e, "take_drafts") for e in engines)))]
    finally:
        t2 = time.perf_counter()
        if asleep and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the sender's buckets
        await asyncio.gather(*(_call(e, *(("wake", ["kv_cache"]) if asleep else ("resume",)))
                               for e in engines), return_exceptions=True)
    return {"bytes": send.result(), "pause_s": time.perf_counter() - t0,
            "transfer_s": t2 - t1, "wake_s": (t1 - t0 + time.perf_counter() - t2) * asleep,
            "drafts": drafts}  # the engines' draft tokens (accepted, drafted) since the last sync


async def sleep_engines(engines, level=2):
    """placement="colocated", before the trainer steps: every engine sleeps (engine.Engine.sleep;
    level 2 drops the weights, which the next sync_weights(asleep=True) rewrites). Returns
    seconds."""
    t0 = time.perf_counter()
    await asyncio.gather(*(_call(e, "sleep", level) for e in engines))
    return time.perf_counter() - t0
