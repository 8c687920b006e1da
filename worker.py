"""
What vLLM loads by name in its own processes: the worker extension that receives the weights
(`WeightSyncWorker`, the engine end of weights_sync's transfer), the CPU workers and the image
scheduler. engine.Engine names them as engine arguments:

    worker_extension_cls  WeightSyncWorker (receives the weights); LoRAWeightSyncWorker (the same,
                          after serve_lora_beside_cpu_moe) for a LoRA run; DraftingCPUWorker (the
                          same, after verify_drafts_on_cpu) for a drafting engine on CPU
    worker_cls            AMXCPUWorker on a CPU with AMX
    scheduler_cls         ImageScheduler for a vision model (KeepImages)

The trainer never imports this file; vLLM is imported only inside the functions that run in vLLM's
processes.

    .venv/bin/python -m pytest tests/test_weights_sync.py -q   # a real vLLM engine, gloo ranks (CPU)
"""
import contextlib

import torch

import lora
from engine import LORA_ID
from model import checkpoint_reader, is_stacked_experts, weight_files
from weights_sync import FP8, FP8_BLOCK, stateless_process_group, tensor_view

# -----------------------------------------------------------------------------
# the weights' receiving end (weights_sync.WeightSender sends them)


def dequantize_fp8_blocks(q, scale, dtype=torch.bfloat16, block=FP8_BLOCK):
    """quantize_fp8_blocks' inverse, up to its rounding: q (..., M, K) e4m3 times each block's
    scale, in dtype."""
    M, K = q.shape[-2:]
    s = scale.repeat_interleave(block, -2)[..., :M, :].repeat_interleave(block, -1)[..., :K]
    return (q.float() * s).to(dtype)


def dequantized(tensors):
    """(hf_name, tensor) pairs, each fp8 weight and its scales (bucket_layout lists them in turn)
    made one bf16 weight. vLLM's fp8 engine quantizes it again as it loads (the layerwise reload
    runs its online quantization) and gets the sender's e4m3 values back: the block's max is 448
    times a scale within bf16 rounding of the sender's, far inside half an e4m3 step
    (tests/test_weights_sync.py checks it). A copy per weight, on the receiving device."""
    weight = None
    for name, t in tensors:
        if t.dtype == FP8:
            weight = t
        elif weight is not None:
            yield name.removesuffix("_scale_inv"), dequantize_fp8_blocks(weight, t)
            weight = None
        else:
            yield name, t


class BucketReceiver:
    """Iterates (hf_name, tensor) over the buckets broadcast by the sender, receiving bucket k+1
    while the caller loads bucket k. Each bucket gets a fresh buffer: vLLM's layerwise reload keeps
    the tensors of a layer until the whole layer has arrived, and a layer may span two buckets."""

    def __init__(self, group, buckets, device):
        if group is None:  # an engine worker's, before init_weight_group
            raise RuntimeError(
                "weights were sent before init_weight_group: call connect_engines first")
        self.group, self.buckets, self.device = group, buckets, device
        self.posted = []  # (buffer, work) per bucket whose broadcast has been posted

    def _post(self):
        buf = torch.empty(self.buckets[len(self.posted)]["nbytes"], dtype=torch.uint8,
                          device=self.device)
        self.posted.append((buf, self.group.broadcast(buf, 0)))

    def __iter__(self):
        for tensors in self.iter_buckets():
            yield from tensors

    def iter_buckets(self):
        """The same, one list of (hf_name, tensor) per bucket
        (for a caller that copies a bucket at once)."""
        for k, bucket in enumerate(self.buckets):
            while len(self.posted) < min(k + 2, len(self.buckets)):
                self._post()
            buf, work = self.posted[k]
            work.wait()  # NCCL: the stream waits, not the host
            yield [(name, tensor_view(buf, dtype_name, shape, offset))
                   for name, dtype_name, shape, offset in bucket["tensors"]]
            self.posted[k] = None  # drop our reference; the loader holds what it still needs

    def drain(self):
        """Receive every bucket the loader did not get to, so that the sender
        is never left waiting. Returns how many buckets were not consumed."""
        unconsumed = len(self.buckets) - sum(1 for x in self.posted if x is None)
        for posted in self.posted:
            if posted is not None:
                posted[1].wait()
        while len(self.posted) < len(self.buckets):
            self._post()
            self.posted[-1][1].wait()
        return unconsumed


class HandedBuckets:
    """The receiving end of an in-place sync (WeightSender(in_place=True), on the same GPU): the
    sender's two bucket buffers, opened from their handles; bucket k is in buffer k % 2 once
    barrier k passed. Each bucket is copied out (a device-to-device copy) before the next barrier,
    which frees its buffer for bucket k + 2; the loader holds the copies as long as it needs (a
    layer may span two buckets). Iterates (hf_name, tensor) as BucketReceiver does."""

    def __init__(self, group, buckets, handles, device):
        import pickle
        if group is None:
            raise RuntimeError(
                "weights were sent before init_weight_group: call connect_engines first")
        self.group, self.buckets, self.device = group, buckets, device
        self.buffers = [pickle.loads(h) for h in handles]  # CUDA: opens the IPC handle
        self.passed = self.consumed = 0  # barriers passed, buckets handed to the loader

    def barrier(self):
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # our copy of the last bucket is done
        self.group.allreduce(torch.zeros(1)).wait()
        self.passed += 1

    def __iter__(self):
        for k, bucket in enumerate(self.buckets):
            self.barrier()
            buf = self.buffers[k % 2][:bucket["nbytes"]].to(self.device, copy=True)
            self.consumed += 1
            yield from [(name, tensor_view(buf, dtype_name, shape, offset))
                        for name, dtype_name, shape, offset in bucket["tensors"]]

    def drain(self):
        """Pass the barriers the loader did not get to (the sender waits in them), then drop the
        sender's buffers. Returns how many buckets were not consumed."""
        while self.passed < len(self.buckets) + 1:
            self.barrier()
        self.buffers = []
        return len(self.buckets) - self.consumed


class WeightSyncWorker:
    """vLLM worker extension (engine arg
    `worker_extension_cls="worker.WeightSyncWorker"`); its methods run in every
    worker through `collective_rpc`. vLLM forbids names that the worker already has."""

    def weight_worker_rank(self):
        return self.rank  # this worker's rank inside its engine (tensor/pipeline parallel)

    def init_weight_group(self, host, port, rank_offset, world_size, backend, timeout_s=600.0):
        self.close_weight_group()
        self.weight_group = stateless_process_group(host, port, rank_offset + self.rank, world_size,
                                                    backend, timeout_s)
        # gloo moves host tensors: a GPU worker reached over gloo (a sender on the same GPU, where
        # NCCL cannot join two processes) receives into host buffers; the reload copies them over
        self.weight_device = self.device if backend == "nccl" else torch.device("cpu")

    def close_weight_group(self):
        if getattr(self, "weight_group", None) is not None:
            self.weight_group.shutdown()
        self.weight_group, self.weight_device = None, self.device

    def receive_weights(self, buckets, handles=None):
        """Receive the buckets and load them. `reload_weights` runs vLLM's layerwise reload (the
        checkpoint-format loader, then each layer's weight processing, then a copy into the kernel
        tensors), so every layer updates on CPU and GPU alike. handles: an in-place sync's (the
        sender's buffers, HandedBuckets). Returns the bytes received."""
        from vllm.config import set_current_vllm_config
        group = getattr(self, "weight_group", None)
        receiver = (HandedBuckets(group, buckets, handles, self.device) if handles else
                    BucketReceiver(group, buckets, getattr(self, "weight_device", self.device)))
        drafter, mtp = getattr(getattr(self.model_runner, "drafter", None), "model", None), []
        # the target's load_weights drops mtp.*: they are set
        # aside (views into their buckets) for the MTP drafter
        target = (x for x in dequantized(receiver)
                  if not (x[0].startswith("mtp.") and mtp.append(x) is None))
        try:
            self.reload_weights(weights_iterator=target, is_checkpoint_format=True)
            if mtp and drafter is not None:  # the drafter's embed_tokens and lm_head
                                             # are the target's: its own layers
                with set_current_vllm_config(self.vllm_config):
                    reload_drafter(self, drafter, mtp)
        except BaseException:
            # an interrupted layerwise reload leaves the layers that had not
            # arrived on the meta device: put their old tensors back so the engine
            # can still serve, then free the sender if the group still works
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)
            with contextlib.suppress(Exception):
                receiver.drain()
            raise
        if unconsumed := receiver.drain():
            raise RuntimeError(
                f"the model loader stopped with {unconsumed} of {len(buckets)} weight buckets "
                "unread")
        if self.device.type == "cpu":
            for model in (self.model_runner.get_model(),
                          *([drafter] if mtp and drafter is not None else [])):
                repack_cpu_moe_experts(model)
        elif handles:  # an in-place sync: the bucket copies go back to the driver before the
            torch.cuda.empty_cache()  # KV cache wakes (outside vLLM's sleep pool, they stay)
        return sum(b["nbytes"] for b in buckets)

    def receive_adapter(self, buckets, config):
        """Receive a LoRA adapter (PEFT names, lora.peft_config `config`) and serve it.
        Attention and dense-MLP adapters replace vLLM's LoRA adapter 1 in place (requests
        name it, engine.Engine's lora_request), so held requests go on with the new adapter
        after resume. Routed-expert adapters are merged into the expert weights here, base +
        scaling * B @ A per expert (vLLM's MoE LoRA needs a LoRA-aware fused-experts kernel:
        Triton on GPU, none on CPU), from a host copy of the base experts read once from the
        model directory; only adapters travel either way. Returns the bytes received."""
        device = getattr(self, "weight_device", self.device)
        receiver = BucketReceiver(getattr(self, "weight_group", None), buckets, device)
        try:
            tensors = dict(receiver)
        finally:
            receiver.drain()
        scaling = config["lora_alpha"] / config["r"]  # expert adapters (PEFT's per-expert
                                                      # names hold .mlp.experts.)
        # the reload empties vLLM's LoRA slots: the adapter is set again below
        if merged := merged_experts(
                self, {k: v for k, v in tensors.items() if is_stacked_experts(k)}, scaling):
            self.reload_weights(weights_iterator=iter(merged), is_checkpoint_format=True)
            if self.device.type == "cpu":
                repack_cpu_moe_experts(self.model_runner.get_model())
        if served := {k: v for k, v in tensors.items() if not is_stacked_experts(k)}:
            from vllm.lora.lora_model import LoRAModel
            from vllm.lora.peft_helper import PEFTHelper
            manager = self.model_runner.lora_manager
            adapter = LoRAModel.from_lora_tensors(LORA_ID, served, PEFTHelper.from_dict(config),
                                                  device="cpu",
                                                  dtype=manager.lora_config.lora_dtype,
                                                  model_vocab_size=manager.vocab_size)
            models = manager._adapter_manager  # vLLM's own in-place reload
                                               # (LoRARequest.load_inplace) does the same
            models.remove_adapter(LORA_ID)
            models.add_adapter(adapter)
            models.activate_adapter(LORA_ID)
        return sum(b["nbytes"] for b in buckets)

    def weights_digest(self):
        """{parameter name: sha256 of its bytes} of the engine's weights. A Linear whose
        weight vLLM's CPU GEMM moved into its kernel (the parameter left empty) is read back
        through that kernel: its output on the identity, the weight it computes with."""
        import hashlib
        out, drafter = {}, getattr(getattr(self.model_runner, "drafter", None), "model", None)
        for prefix, m in [*self.model_runner.get_model().named_modules(),
                          *(drafter.named_modules(prefix="drafter") if drafter is not None
                            else [])]:
            for name, p in m.named_parameters(prefix, recurse=False):
                if p.numel() == 0 and hasattr(m, "cpu_linear"):
                    p = m.cpu_linear(torch.eye(getattr(m, "input_size_per_partition", m.input_size),
                                               dtype=p.dtype),
                                     p, None)
                data = p.detach().contiguous().reshape(-1).view(torch.uint8).cpu()  # GPU: a sync
                out[name] = hashlib.sha256(data.numpy()).hexdigest()
        return out


def reload_drafter(worker, drafter, weights):
    """vLLM's layerwise reload of the MTP drafter's own layers from (hf_name, tensor) pairs: vLLM's
    function for a model other than the target where it has one, else (older vLLM) its steps."""
    from vllm.model_executor.model_loader import reload
    try:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
    except ImportError:
        reload.initialize_layerwise_reload(drafter)
        drafter.load_weights(iter(weights))
        reload.finalize_layerwise_reload(drafter, worker.model_config)
        return
    reload_weights(worker.vllm_config, drafter, iter(weights), None, True)


def merged_experts(worker, adapters, scaling):
    """[(HF expert weight name, base + scaling * B @ A in
    the engine dtype)] for expert adapters in PEFT names."""
    if not adapters:
        return []
    if not hasattr(worker, "base_experts"):  # read once: the engine's weights
                                             # will hold merged values
        path = worker.model_config.model
        read = checkpoint_reader(path)
        worker.base_experts = {name: read(name) for name in weight_files(path)
                               if is_stacked_experts(name)}
    out = []
    for a_name in (k for k in adapters if ".lora_A." in k):
        weight = a_name.removeprefix(lora.PEFT_PREFIX).replace(".lora_A.", ".")
        base = worker.base_experts[weight]
        delta = adapters[a_name.replace(".lora_A.", ".lora_B.")].float() @ adapters[a_name].float()
        out.append((weight, (base.float() + scaling * delta).to(base.dtype)))
    return out


def repack_cpu_moe_experts(model):
    """Works around vLLM 0.32 on CPU: on a weight update the MoE method skips its experts'
    prepack (`UnquantizedFusedMoEMethod._setup_kernel` runs
    `fused_experts.process_weights_after_loading` on the first load only), so the reload leaves
    plain-layout expert weights in the prepacked tensors and the experts compute garbage.
    Packing them again here makes the engine match the trainer (tests/test_weights_sync.py
    checks it). GPU backends need no repack: their layout conversion runs on every load."""
    for layer in model.modules():
        if (kernel := getattr(getattr(layer, "quant_method", None), "moe_kernel",
                              None)) is not None:
            kernel.fused_experts.process_weights_after_loading(layer)

# -----------------------------------------------------------------------------
# the classes vLLM's processes load by name (beside WeightSyncWorker)


def serve_lora_beside_cpu_moe():
    """Works around vLLM 0.32 on CPU: with enable_lora every FusedMoE layer is marked LoRA-enabled
    (fused_moe/layer.py: `is_lora_enabled=vllm_config.lora_config is not None`), whatever
    lora_target_modules says, and the MoE kernel oracle then picks TritonExperts
    (oracle/unquantized.py), which CPU lacks: the first forward fails with "module
    'triton.language' has no attribute 'bfloat16'". Our engines never give the experts to vLLM's
    LoRA (receive_adapter merges them), so on CPU the MoE layers keep their CPU kernel. Runs in the
    worker process before the model is built (lora.engine_options names LoRAWeightSyncWorker)."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.platforms import current_platform
    if not current_platform.is_cpu() or getattr(FusedMoEConfig, "lora_experts_off", False):
        return
    post_init = FusedMoEConfig.__post_init__

    def without_expert_lora(self):
        post_init(self)
        self.is_lora_enabled = False
    FusedMoEConfig.__post_init__, FusedMoEConfig.lora_experts_off = without_expert_lora, True


def verify_drafts_on_cpu():
    """Works around vLLM 0.32 on CPU: the rejection sampler spreads each request's
    temperature, top_k and top_p over its draft tokens with the C++ stand-in of a Triton
    kernel (`expand_kernel_impl`), which writes into int64 copies of its tensors: the float32
    output stays uninitialized memory, by which the target's logits are then divided. Drafts
    were verified against that garbage distribution and the processed logprobs came out 0.0
    or nan (greedy is untouched). Runs in the worker process; the same expansion in torch."""
    from vllm.v1.sample import rejection_sampler

    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        return x.masked_fill(x == replace_from,
                             replace_to).repeat_interleave(counts, output_size=num_tokens)
    rejection_sampler.expand_batch_to_tokens = expand


class KeepImages:
    """Mixed into vLLM's scheduler (async or not, as the engine decided) for a vision model's
    engine: a request's images always reach the worker. vLLM drops the pixels of an image that a
    prefix-cache hit covers when it hands a request to the worker; the worker keeps the request's
    state across a preemption, so a request preempted when a weight sync empties the prefix cache
    (recompute_kv_on_sync), or by memory pressure after its cached prefix was evicted, must encode
    the image again and finds no pixels: the engine dies. Costs a copy per covered image."""

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        for new in out.scheduled_new_reqs:  # the scheduler's own request holds every image's pixels
            new.mm_features = self.requests[new.req_id].mm_features
        return out


def __getattr__(name):
    # vLLM resolves these names in its own processes (worker_extension_cls
    # and worker_cls in the worker, scheduler_cls in the engine core);
    # each is built there on first use, as it imports vLLM
    # before the worker builds the model: the moment to patch
    if name in ("LoRAWeightSyncWorker", "DraftingCPUWorker"):
        (serve_lora_beside_cpu_moe if name.startswith("LoRA") else verify_drafts_on_cpu)()
        return WeightSyncWorker
    if name == "AMXCPUWorker":
        # Linux grants AMX tile state only to processes that ask (arch_prctl);
        # vLLM's CPU kernels use AMX whenever the CPU has it without asking, and
        # die with SIGILL unless something (oneDNN, on some paths) asked first
        from vllm.v1.worker.cpu_worker import CPUWorker

        class AMXCPUWorker(CPUWorker):
            def __init__(self, *args, **kwargs):
                torch.cpu._init_amx()
                super().__init__(*args, **kwargs)
        globals()[name] = AMXCPUWorker
        return AMXCPUWorker
    if name == "ImageScheduler":
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        pick = {a: type("ImageScheduler", (KeepImages, base), {}) for a,
                base in ((False, Scheduler),
                                                                                  (True, AsyncScheduler))}
        globals()[name] = lambda vllm_config, **kw: pick[
            bool(vllm_config.scheduler_config.async_scheduling)](
            vllm_config=vllm_config, **kw)
        return globals()[name]
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
