"""
Model and trainer speed benchmarks, run through bench.py (`python bench.py NAME`):
the whole trainer step (train), the MoE decoder layer alone (layer; --fp8: with FP8 experts), the
experts with LoRA adapters (lora), the VLM (vl), vLLM's FP8 engine against its bf16 one (fp8).
Each measures ours and a baseline (transformers', torchtitan's; bf16 for the FP8 ones) in the same
run on the same GPUs and returns one dict with `ratio`.
"""
import sys

PEAK_FLOPS = 989e12  # dense bf16 of an H100 / H200 (SXM), the MFU denominator
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768,
                     max_position_embeddings=40960)
SMOKE_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, max_position_embeddings=512)


def qwen36_text_config(layers, smoke=False):
    """Qwen3.6-35B-A3B's text model (configs/qwen3_6_35b_a3b.py: hidden 2048,
    Gated DeltaNet of 16 key + 32 value heads of 128, gated attention of 16
    heads / 2 KV of 256, 256 experts top-8 of 512 plus a shared expert, vocab
    248320) with `layers` layers, every 4th full attention, no
            MTP layer; --smoke: the tiny hybrid's shape."""
    import dataclasses
    import os
    import runpy
    from model import ModelConfig
    kinds = ["linear_attention" if (i + 1) % (2 if smoke else 4) else "full_attention"
             for i in range(layers)]
    if smoke:
        from tiny import TINY_QWEN36_CONFIG
        return dataclasses.replace(TINY_QWEN36_CONFIG, vision=None, mtp_num_hidden_layers=0,
                                   num_hidden_layers=layers, layer_types=kinds)
    text = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                                       "qwen3_6_35b_a3b.py"))
    text = text["model_config"]["text_config"]
    return ModelConfig.from_hf(
        {**text, "model_type": "qwen3_5_moe_text", "num_hidden_layers": layers,
         "layer_types": kinds, "mtp_num_hidden_layers": 0})

# -----------------------------------------------------------------------------
# the trainers side by side: each builder returns
# step(i), one optimizer step over `accum` microbatches


def _trainer_config(ep, cuda, ac=0, chunk=2048, keep_logits=1, lora=0):
    import train
    return train.configure([f"--ep_size={ep}", f"--param_dtype={'bfloat16' if cuda else 'float32'}",
                            f"--activation_checkpointing={bool(ac)}",
                            f"--logprob_chunk_size={chunk}",
                            f"--logprob_keep_logits={bool(keep_logits)}", f"--lora_rank={lora}",
                            "--learning_rate=1e-5", "--min_lr=1e-6", "--warmup_steps=1",
                            "--max_steps=1000"])


def _random_microbatch(vocab, B, T, device, seed):
    """B random sequences of T tokens, every token an
    action with advantage ~N(0, 1) per sequence."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T + 1), device=device, generator=g)
    return dict(input_ids=ids[:, :-1], targets=ids[:, 1:],
                action_mask=torch.ones(B, T, device=device),
                behavior_logprobs=torch.full((B, T), -12.0, device=device),
                token_versions=torch.zeros(B, T, dtype=torch.long, device=device),
                advantages=torch.randn(B, device=device, generator=g), routed_experts=None)


def _ours_trainer(mcfg, cfg, world, ep, device, microbatch, accum, compile_modules=False,
                  last=None):
    """Ours: train.py's sharded model and optimizer,
    and its real train_step (metrics into `last`)."""
    import train
    model = train.build_model(cfg, train.build_meshes(world, ep, device.type), device,
                              model_config=mcfg)
    if compile_modules:
        _compile_attention_and_norms(model)
    optimizer = train.build_optimizer(model, cfg)
    lcfg = train.loss_config(cfg)

    def step(i):
        metrics = train.train_step(model, optimizer, [microbatch] * accum, cfg, lcfg,
                                   policy_version=0, step=i)
        if last is not None:
            last.update(metrics)
    return step


def _policy_gradient_step(params, optimizer, microbatch, accum, cfg, logprobs_fn):
    """The baselines' optimizer step: `accum` forward + backward passes of
    the advantage-weighted token logprob (logprobs_fn(input_ids, targets)
    -> (B, T)), clipping, AdamW at the trainer's learning-rate schedule."""
    import torch
    import train
    params = list(params)

    def step(i):
        for _ in range(accum):  # gradient accumulation over the window, like ours
            logprobs = logprobs_fn(microbatch["input_ids"], microbatch["targets"])  # (B, T)
            (-(microbatch["advantages"][:, None] * logprobs).mean() / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
        for group in optimizer.param_groups:
            group["lr"] = train.learning_rate_at(i, cfg)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _full_logits_logprobs(logits_fn):
    import torch

    def logprobs(ids, targets):  # full logits, fp32 log_softmax: what a plain HF training loop does
        return torch.log_softmax(logits_fn(ids).float(),
                                 dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return logprobs


def _chunked_logprobs(model, hidden_fn, lm_head, chunk):
    """Token logprobs through loss.token_logprobs (ours) on a baseline's final
    hidden states: the layer bench gives every model the same head, which
    cancels out of its layer-count difference, in memory that fits 8 x 4096."""
    from torch.distributed.fsdp import register_fsdp_forward_method
    import loss
    model.hidden_for_bench = hidden_fn
    # the root unit's all-gather runs as in forward
    register_fsdp_forward_method(model, "hidden_for_bench")

    def logprobs(ids, targets):
        return loss.token_logprobs(model.hidden_for_bench(ids), lm_head(), targets, 1.0, chunk)[0]
    return logprobs


def _hf_trainer(mcfg, cfg, device, microbatch, accum, compile_modules=False, ac=False,
                chunked=False, info=None):
    """transformers' Qwen3MoeForCausalLM under FSDP2
    (_hf_fsdp_model); full logits, or chunked (see above)."""
    hf, optimizer, hf_info = _hf_fsdp_model(mcfg, cfg, device, compile_modules, ac)
    if info is not None:
        info.update(hf_info)
    logprobs = (_chunked_logprobs(
        hf, lambda ids: hf.model(input_ids=ids, use_cache=False).last_hidden_state,
        lambda: hf.lm_head.weight, cfg["logprob_chunk_size"]) if chunked else
                _full_logits_logprobs(lambda ids: hf(input_ids=ids, use_cache=False).logits))
    return _policy_gradient_step(hf.parameters(), optimizer, microbatch, accum, cfg, logprobs)


def _titan_trainer(mcfg, cfg, device, microbatch, accum, info=None):
    """torchtitan's Qwen3 MoE (its 30B-A3B flavour with our layer count) under
    its own apply_fsdp (bf16 compute, fp32 reductions), its init, grouped-GEMM
    experts, SDPA; the head as in _chunked_logprobs; AdamW like ours."""
    import copy
    import torch
    from torchtitan.models.llama4.infra.parallelize import apply_fsdp
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args
    args = copy.deepcopy(qwen3_args["30B-A3B"])
    args.n_layers, args.max_seq_len = mcfg.num_hidden_layers, microbatch["input_ids"].shape[1]
    with torch.device("meta"):
        titan = Qwen3Model(args)
    apply_fsdp(titan, train_mesh(device), param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
               pp_enabled=False)
    titan.to_empty(device=device)
    with torch.no_grad():
        titan.init_weights(buffer_device=device)
    titan.train()

    def hidden(ids):
        h = titan.tok_embeddings(ids)
        for layer in titan.layers.values():
            h = layer(h, titan.rope_cache, None, None)
        return titan.norm(h)
    if info is not None:
        import importlib.metadata
        info.update(version=importlib.metadata.version("torchtitan"),
                    params=sum(p.numel() for p in titan.parameters()),
                    experts_grouped_mm=args.moe_args.use_grouped_mm, attn_type=args.attn_type)
    optimizer = torch.optim.AdamW(titan.parameters(), lr=cfg["learning_rate"],
                                  betas=(cfg["beta1"], cfg["beta2"]),
                                  weight_decay=cfg["weight_decay"], fused=True)
    logprobs = _chunked_logprobs(titan, hidden, lambda: titan.output.weight,
                                 cfg["logprob_chunk_size"])
    return _policy_gradient_step(titan.parameters(), optimizer, microbatch, accum, cfg, logprobs)


def train_mesh(device):
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed as dist
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))


def _time_steps(step, warmup, steps, device, first=0):
    """Seconds per step (mean over `steps` after `warmup`),
    all ranks in step, and the peak memory of any rank."""
    import time
    import torch
    import torch.distributed as dist
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup):
        step(first + i)
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(first + warmup + i)
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = (time.perf_counter() - t0) / steps
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) if cuda else 0, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return seconds, peak.item()


def _profiled(step, device, i):
    """One more step under torch.profiler (GPU kernels only when on CUDA)."""
    import torch
    cuda = device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CUDA] if cuda else [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        step(i)
        if cuda:
            torch.cuda.synchronize(device)
    return prof


def _version(package):
    """An installed package's version, or None."""
    import importlib.metadata
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _free_memory():
    import gc
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

# -----------------------------------------------------------------------------
# train: our FSDP2 + expert-parallel trainer vs transformers'
# Qwen3MoeForCausalLM under FSDP2, same GPUs, same run


def bench_train(layers=4, seq=4096, batch=4, accum=1, steps=6, warmup=3, ep=0, compile=0, ac=0,
                baseline=1, smoke=0, profile=0, keep_logits=1, chunk=2048, lora=0, hybrid=0):
    """Training throughput on a Qwen3-30B-A3B-shaped MoE with few layers (hidden 2048, 32
    heads, 4 kv heads, head_dim 128, 128 experts top-8, expert hidden 768, vocab 151936), bf16
    compute, fp32 master weights, AdamW, `accum` microbatches of `batch` sequences of `seq`
    tokens per GPU per optimizer step. Ours: train.py's model, fully_shard, expert parallel
    over `ep` GPUs (default: all), grouped-GEMM experts, the real train_step (chunked logprobs,
    PPO loss, clipping, AdamW). Baseline, same run and GPUs: transformers' Qwen3MoeForCausalLM
    (its default experts implementation) with each decoder layer and the root under fully_shard
    (same mixed precision), full logits + log_softmax, the same optimizer. Prints tokens/s,
    MFU, peak memory of both and ratio = ours / transformers tokens/s.

        torchrun --nproc_per_node=1 bench.py train               # 1 GPU
        torchrun --nproc_per_node=2 bench.py train               # 2 GPUs, ep=2
        torchrun --nproc_per_node=2 bench.py train --layers=8 --batch=2 --compile=1
        python bench.py train --smoke                            # CPU, tiny shape: exercises both code paths

    Options: --batch (sequences per microbatch) --accum (microbatches per optimizer step, both
    trainers: the optimizer step and gradient clipping are per-step costs that a real RL
    window, many microbatches long, spreads out) --ep (0 = all ranks) --compile (1: compile
    attention and norms of both models) --ac (activation checkpointing, both) --chunk (ours:
    tokens per logprob chunk) --keep_logits (ours keeps the bf16 logits for backward, 5 GB at
    16K tokens, instead of recomputing them; the baseline holds full logits anyway) --lora
    (ours trains LoRA adapters of this rank on every target, experts included, on the frozen
    bf16 base; the baseline stays full) --profile=N (one more step of each under
    torch.profiler: its N costliest kernels). --hybrid=1: the Qwen3.6-35B-A3B hybrid instead
    (qwen36_text_config: at 4 layers 3 Gated DeltaNet + 1 gated full attention, all MoE with
    the shared expert) against transformers' Qwen3_5MoeForCausalLM (fla's kernels in both when
    installed); there the baseline gets our chunked logprobs over its hidden states: full fp32
    logits of 16K tokens x 248K vocab beside AdamW over 4.4B parameters do not fit one H200.
    MFU = 6 * N * tokens/s / (989e12 * GPUs), N = active matmul weights per token
    (attention projections, router, the top-8 experts, dense MLPs, lm_head; not the
    embedding lookup); attention scores are not in `mfu`, and `mfu_with_attention` adds
    6 * L * T * heads * head_dim per token (causal QK^T and AV, forward + backward).
    """
    import os
    if smoke:
        seq, batch, steps, warmup = 64, 2, 2, 1
    import torch
    import train
    from model import ModelConfig, num_params
    if "TORCHELASTIC_RUN_ID" not in os.environ and torch.cuda.device_count() > 1:
        print("bench.py train: running on 1 GPU; use torchrun --nproc_per_node=N for N GPUs",
              flush=True)
    rank, world, device = train.init_distributed()
    cuda = device.type == "cuda"
    if not cuda and not smoke:
        sys.exit("bench.py train needs CUDA GPUs (run it under torchrun); on CPU use --smoke")
    ep = ep or world
    mcfg = (qwen36_text_config(2 if smoke else layers, smoke) if hybrid else
            ModelConfig(**(SMOKE_MOE if smoke else QWEN3_30B_A3B), num_hidden_layers=2 if smoke
                        else layers))
    cfg = _trainer_config(ep, cuda, ac, chunk, keep_logits, lora)
    B, T, A = batch, seq, accum
    # each rank its own data
    microbatch = _random_microbatch(mcfg.vocab_size, B, T, device, seed=1000 + rank)
    # minus the embedding lookup
    n_active = num_params(mcfg, active=True) - mcfg.vocab_size * mcfg.hidden_size
    full = sum(mcfg.layer_type(i) == "full_attention" for i in range(mcfg.num_hidden_layers))
    attn_per_token = 6 * full * T * mcfg.num_attention_heads * mcfg.head_dim

    def measure(name, step):
        seconds, peak = _time_steps(step, warmup, steps, device)
        tokens_per_s = world * B * T * A / seconds
        out = dict(tokens_per_s=round(tokens_per_s), step_s=round(seconds, 4),
                   peak_gb=round(peak / 1e9, 2),
                   mfu=round(6 * n_active * tokens_per_s / (PEAK_FLOPS * world), 4),
                   mfu_with_attention=round(
                       (6 * n_active + attn_per_token) * tokens_per_s / (PEAK_FLOPS * world), 4))
        train.print0(f"{name}: {out}")
        if profile:  # one more step under the profiler: where the time goes, per kernel
            prof = _profiled(step, device, warmup + steps)
            train.print0(prof.key_averages().table(sort_by="cuda_time_total" if cuda
                                                   else "cpu_time_total",
                                                   row_limit=profile))
        return out

    last = {}
    result = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", gpus=world if cuda
                  else 0, ep=ep,
                  layers=mcfg.num_hidden_layers, seq=T, batch_per_gpu=B, microbatches_per_step=A,
                  tokens_per_step=world * B * T * A, active_params=n_active, compile=bool(compile),
                  activation_checkpointing=bool(ac), keep_logits=bool(keep_logits), lora_rank=lora,
                  layer_types=mcfg.layer_types, fla=_version("fla-core"))
    result["ours"] = measure("ours", _ours_trainer(mcfg, cfg, world, ep, device, microbatch, A,
                                                   bool(compile), last))
    result["ours"]["loss"], result["ours"]["skipped_steps"] = last["loss"], int(last["skipped"])
    _free_memory()  # the step closure and its model are gone: the baseline gets the whole GPU
    result["ratio"] = None
    if baseline:
        try:
            info = result["transformers"] = {}
            step = _hf_trainer(mcfg, cfg, device, microbatch, A, bool(compile), bool(ac),
                               chunked=bool(hybrid), info=info)
            info.update(measure("transformers", step))
            result["ratio"] = round(result["ours"]["tokens_per_s"] / info["tokens_per_s"], 3)
        except Exception as e:  # report ours even when the baseline cannot run here
            result["transformers_error"] = f"{type(e).__name__}: {e}"
            train.print0(f"transformers baseline failed: {result['transformers_error']}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if rank != 0:
        sys.exit(0)  # rank 0 prints the result
    return result

# -----------------------------------------------------------------------------
# layer: the MoE decoder layer alone, from the step-time difference between two layer counts


# Where a GPU kernel's time goes: the first row whose words occur in
# its (lowercased) name. Inductor names its fused kernels by their
# ops (triton_red_fused__to_copy_mean_mul_pow_rsqrt_0 is an RMSNorm).
KERNEL_ROWS = (
    ("expert_gemms", ("grouped", "groupproblem", "ptrarray")),
    ("attention", ("flash", "fmha", "sdpa", "cudnn", "attention", "attn")),
    ("dense_gemms", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "matmul")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("communication", ("nccl",)),
    ("norms_rope", ("rsqrt", "rms_norm", "rmsnorm")),
    ("swiglu", ("silu", "swiglu")),
    ("router_permutation", ("sort", "topk", "scatter", "gather", "index", "sum_slots", "cumsum",
                            "softmax", "radix", "histogram", "bincount")),
    ("casts_copies", ("copy", "contiguous", "cat", "fill", "memcpy", "memset", "convert")),
    ("other_elementwise", ("elementwise", "triton", "reduce", "vectorized")),
)


def _kernel_ms(prof):
    """{kernel name: total GPU ms} of a profiled step."""
    import torch
    out = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            out[evt.key] = out.get(evt.key, 0.0) + evt.self_device_time_total / 1e3
    return out


def _kernel_row(name):
    low = name.lower()
    return next((row for row, words in KERNEL_ROWS if any(w in low for w in words)), "other")


def bench_layer(low=2, high=4, seq=4096, batch=8, accum=1, steps=4, warmup=2, transformers=1,
                torchtitan=1, profile=1, compile=0, smoke=0, fp8=0):
    """The MoE decoder layer's training time on one GPU at Qwen3-30B-A3B shapes (bench.py train's
    model): the optimizer-step time with `high` layers minus the time with `low` layers, over high -
    low. That is what each of a 48-layer model's layers costs (forward, backward, its share of
    clipping and AdamW, casts between microbatches), with the embedding, the final norm, the lm_head
    and the logprobs cancelled out. `accum` microbatches of `batch` x `seq` tokens per step. Ours:
    train.py's model and train_step, as bench.py train. Baselines in the same run: transformers'
    Qwen3MoeForCausalLM under FSDP2 (bench.py train's) and torchtitan's Qwen3 MoE under its
    apply_fsdp, when importable; both train the same advantage-weighted logprob loss with AdamW, on
    our chunked logprobs over their hidden states (the head cancels out; full fp32 logits of 8 x
    4096 tokens would not fit). With --profile, one more step of each at both layer counts under
    torch.profiler: each GPU kernel's time goes to a row (KERNEL_ROWS: expert GEMMs, dense GEMMs,
    attention, router and permutation, norms, SwiGLU, casts and copies, optimizer, ...) and each
    row's per-layer ms is again the difference over high - low; the costliest kernels' per-layer ms
    too, and gpu_busy: the profiled step's kernel time over the step time at each layer count (well
    below 1: the host's launches, not the GPU, set the pace). ratio = transformers' layer ms / ours
    (ratio_torchtitan likewise). MFU per layer: 6 * N * tokens / layer time / 989e12, N = one
    layer's active matmul weights (attention projections, router, top-8 experts: 56.9M);
    mfu_with_attention adds 6 * seq * heads * head_dim per token.
    --fp8: ours with fp8_experts (the experts' GEMMs in FP8, experts.GroupedSwiGLU) beside ours in
    bf16 instead of the baselines; ratio = bf16 layer ms / FP8 layer ms.

        python bench.py layer                       # 1 x (8 x 4096) tokens per step
        python bench.py layer --accum=4             # 4 microbatches of 8 x 4096 per step
        python bench.py layer --smoke               # CPU, tiny shapes: exercises every code path
        python bench.py layer --fp8                 # bf16 vs FP8 experts (an H100: ~3 minutes)
    """
    import torch
    import train
    from model import ModelConfig, num_params
    if smoke:
        low, high, seq, batch, steps, warmup = 1, 2, 64, 2, 1, 1
    rank, world, device = train.init_distributed()
    cuda = device.type == "cuda"
    if not cuda and not smoke:
        sys.exit("bench.py layer needs a CUDA GPU; on CPU use --smoke")
    if world != 1 or high <= low:
        sys.exit("bench.py layer runs on one rank, with --high greater than --low")
    shape = SMOKE_MOE if smoke else QWEN3_30B_A3B
    mcfg = {L: ModelConfig(**shape, num_hidden_layers=L) for L in (0, 1, low, high)}
    cfg = _trainer_config(1, cuda)
    microbatch = _random_microbatch(shape["vocab_size"], batch, seq, device, seed=1000)
    tokens = batch * seq * accum
    n_layer = num_params(mcfg[1], active=True) - num_params(mcfg[0], active=True)
    attn_per_token = 6 * seq * shape["num_attention_heads"] * shape["head_dim"]
    builders = dict(ours=lambda c,
                    info: _ours_trainer(c, cfg, 1, 1, device, microbatch, accum, bool(compile)),
                    transformers=lambda c,
                    info: _hf_trainer(c, cfg, device, microbatch, accum, bool(compile),
                                                             chunked=True, info=info),
                    torchtitan=lambda c,
                    info: _titan_trainer(c, cfg, device, microbatch, accum, info=info),
                    fp8=lambda c, info: _ours_trainer(c, dict(cfg, fp8_experts=True), 1, 1, device,
                                                      microbatch, accum, bool(compile)))
    wanted = dict(ours=True, transformers=bool(transformers) and not fp8,
                  torchtitan=bool(torchtitan) and cuda and not fp8, fp8=bool(fp8))
    result = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu",
                  torch=torch.__version__, layers=[low, high], seq=seq, batch=batch,
                  microbatches_per_step=accum, tokens_per_step=tokens, layer_active_params=n_layer,
                  compile=bool(compile))
    for name, build in builders.items():
        if not wanted[name]:
            continue
        info, seconds, peaks, kernels = {}, {}, {}, {}
        try:
            for L in (low, high):
                step = build(mcfg[L], info)
                seconds[L], peaks[L] = _time_steps(step, warmup, steps, device)
                if profile:
                    kernels[L] = _kernel_ms(_profiled(step, device, warmup + steps))
                step = None
                _free_memory()
        except Exception as e:  # a baseline that cannot run here (not
                                # installed, out of memory) is reported
            if name in ("ours", "fp8"):
                raise
            step = None
            _free_memory()
            result[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            train.print0(f"{name} failed: {result[name + '_error']}")
            continue
        layer_s = (seconds[high] - seconds[low]) / (high - low)
        out = dict(info, layer_ms=round(layer_s * 1e3, 2),
                   step_s={L: round(s, 4) for L, s in seconds.items()},
                   peak_gb={L: round(p / 1e9, 2) for L, p in peaks.items()},
                   mfu=round(6 * n_layer * tokens / layer_s / PEAK_FLOPS, 4),
                   mfu_with_attention=round(
                       (6 * n_layer + attn_per_token) * tokens / layer_s / PEAK_FLOPS, 4))
        if profile:
            per_kernel = {k: (kernels[high].get(k, 0.0) - kernels[low].get(k, 0.0)) / (high - low)
                          for k in set(kernels[high]) | set(kernels[low])}
            rows = {}
            for k, ms in per_kernel.items():
                rows[_kernel_row(k)] = rows.get(_kernel_row(k), 0.0) + ms
            out["profile_layer_ms"] = {r: round(ms, 2) for r,
                                       ms in sorted(rows.items(), key=lambda kv: -kv[1])}
            out["profile_total_layer_ms"] = round(sum(rows.values()), 2)
            # the profiled step's kernel time over the timed steps' mean: well below 1, the GPU
            # waits on the host (launches), and the layer time measures the host
            out["gpu_busy"] = {L: round(sum(kernels[L].values()) / 1e3 / seconds[L], 3)
                               for L in (low, high)}
            top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
            out["top_kernels_layer_ms"] = [[k[:120], _kernel_row(k), round(ms, 3)] for k, ms in top]
        result[name] = out
        train.print0(f"{name}: {out}")
    for name in ("transformers", "torchtitan"):
        if name in result:
            key = "ratio" if name == "transformers" else "ratio_torchtitan"
            result[key] = round(result[name]["layer_ms"] / result["ours"]["layer_ms"], 3)
    if fp8:
        result["ratio"] = round(result["ours"]["layer_ms"] / result["fp8"]["layer_ms"], 3)
    result.setdefault("ratio", None)
    torch.distributed.destroy_process_group()
    return result


# -----------------------------------------------------------------------------
# gdn: the hybrid's Gated DeltaNet layer alone, ours against fla's and transformers'


def bench_gdn(seq=4096, batch=4, iters=20, warmup=3, profile=12, smoke=0):
    """The Gated DeltaNet layer alone at Qwen3.6-35B-A3B's shape (qwen36_text_config: hidden 2048,
    16 key + 32 value heads of 128, conv 4), bf16, forward + backward of `batch` x `seq` tokens
    (gradients of the input and every weight against a fixed random output gradient). Ours:
    gdn.GatedDeltaNet (on CUDA fla's fused varlen conv, delta rule and gated norm). Baselines in
    the same run: fla's own layer (flash-linear-attention's fla.layers. GatedDeltaNet at the same
    heads: separate q/k/v projections and convs) and transformers' Qwen3_5MoeGatedDeltaNet (fla's
    delta rule and gated norm where fla is installed), the latter with our weights: its output is
    compared with ours (max |diff| over max |output|). ms per step from CUDA events over `iters`
    steps after `warmup`; ratio = fla's ms / ours. --profile=N: ours' N costliest kernels per step.

        python bench.py gdn
        python bench.py gdn --smoke      # CPU, tiny shape, fp32: ours and transformers' (fla computes on CUDA only)
    """
    import time
    import torch
    import transformers
    from gdn import GatedDeltaNet
    from model import init_parameters
    if smoke:
        seq, batch, iters, warmup, profile = 64, 2, 1, 1, 0
    elif not torch.cuda.is_available():
        sys.exit("bench.py gdn needs a CUDA GPU; on CPU use --smoke")
    device, dtype = (torch.device("cpu"), torch.float32) if smoke else (torch.device("cuda"),
                                                                        torch.bfloat16)
    cfg = qwen36_text_config(1, smoke)
    ours = GatedDeltaNet(cfg).to(device)
    with torch.no_grad():
        init_parameters((("linear_attn." + n, p) for n, p in ours.named_parameters()), 0.02,
                        torch.Generator(device).manual_seed(0))
    ours.to(dtype)
    hf_cfg = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.to_hf().items()
                                                  if k not in ("model_type", "architectures",
                                                               "torch_dtype")})
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    theirs = modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet(hf_cfg, layer_idx=0).to(device, dtype)
    theirs.load_state_dict(ours.state_dict())
    layers = dict(ours=(ours, lambda x: ours(x, cu)), transformers=(theirs, lambda x: theirs(x)))
    if not smoke:
        from fla.layers import GatedDeltaNet as FlaGatedDeltaNet
        fla = FlaGatedDeltaNet(hidden_size=cfg.hidden_size, head_dim=cfg.linear_key_head_dim,
                               expand_v=cfg.linear_value_head_dim / cfg.linear_key_head_dim,
                               num_heads=cfg.linear_num_key_heads,
                               num_v_heads=cfg.linear_num_value_heads, mode="chunk", use_gate=True,
                               use_short_conv=True, conv_size=cfg.linear_conv_kernel_dim,
                               norm_eps=cfg.rms_norm_eps).to(device, dtype)
        layers["fla"] = (fla, lambda x: fla(x)[0])
    g = torch.Generator(device).manual_seed(1)
    x = torch.randn(batch, seq, cfg.hidden_size, device=device,
                    generator=g).to(dtype).requires_grad_()
    probe = torch.randn(x.shape, device=device, generator=g).to(dtype)
    cu = torch.arange(batch + 1, device=device) * seq  # one segment a row

    def step(module, fn):
        out = fn(x)
        torch.autograd.grad(out, [x, *module.parameters()], probe)
        return out

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, transformers_version=transformers.__version__,
                  fla_version=_version("fla-core"),
                  tilelang=_version("tilelang"), tokens=batch * seq, batch=batch, seq=seq,
                  dtype=str(dtype))
    with torch.no_grad():
        want, got = theirs(x), ours(x, cu)
        want = want[0] if isinstance(want, tuple) else want
        result["ours_vs_transformers_max_rel_diff"] = round(
            ((got - want).abs().max() / want.abs().max()).item(), 5)
    for name, (module, fn) in layers.items():
        for _ in range(warmup):
            step(module, fn)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            step(module, fn)
        sync()
        result[name] = dict(ms=round((time.perf_counter() - t0) / iters * 1e3, 3),
                            params=sum(p.numel() for p in module.parameters()))
        print(f"{name}: {result[name]}", flush=True)
    if profile:
        prof = _profiled(lambda i: step(*layers["ours"]), device, 0)
        top = sorted(_kernel_ms(prof).items(), key=lambda kv: -kv[1])[:profile]
        result["ours_top_kernels_ms"] = [[k[:100], round(ms, 3)] for k, ms in top]
    result["ratio"] = round(result["fla"]["ms"] / result["ours"]["ms"],
                            3) if "fla" in layers else None
    result["ratio_transformers"] = round(result["transformers"]["ms"] / result["ours"]["ms"], 3)
    return result


# -----------------------------------------------------------------------------
# lora: the routed experts' forward + backward with adapters on a frozen base vs full fine-tuning


def bench_lora(experts=16, dim=2048, hidden=768, rows=32768, rank=8, iters=20, seed=0):
    """The grouped-GEMM experts (experts.experts_grouped_mm) forward + backward on `rows` routed
    rows, bf16: with rank-`rank` adapters on gate, up and down over a frozen base (gradients of the
    adapters, the rows and the routing weights) against full fine-tuning (gradients of the base
    weights too), and the frozen base without adapters (the floor: no weight gradient GEMMs at
    all). Default shape: Qwen3-30B-A3B's experts (D 2048, H 768), 16 local experts (128 over expert
    parallelism 8). Prints ms of each and ratio = LoRA / full fine-tuning (target: <= 1.0). Each
    step is timed as the trainer runs it, launches from Python included: at a few thousand rows per
    expert the LoRA step launches more kernels than the GPU needs time for on a slow host CPU.

        python bench.py lora --experts=128 --rows=32768 --rank=8
    """
    opt = dict(locals())  # the options, as bench.py's command line set them
    import torch
    from experts import experts_grouped_mm
    if not torch.cuda.is_available():
        sys.exit("bench.py lora needs a GPU (the grouped GEMMs are the CUDA path)")
    E, D, H, N, r = opt["experts"], opt["dim"], opt["hidden"], opt["rows"], opt["rank"]
    g = torch.Generator(device="cuda").manual_seed(opt["seed"])
    randn = lambda *shape, std=0.02: (torch.randn(*shape, device="cuda", generator=g) * std).bfloat16()  # noqa: E731
    # uniform routing
    counts = torch.bincount(torch.randint(0, E, (N,), device="cuda", generator=g), minlength=E)
    x, scale = randn(N, D, std=1.0), torch.rand(N, device="cuda", generator=g).bfloat16()
    base = [randn(E, H, D), randn(E, H, D), randn(E, D, H)]
    adapters = [randn(E, r, D), randn(E, H, r), randn(E, r, D), randn(E, H, r), randn(E, r, H),
                randn(E, D, r)]
    grad = randn(N, D, std=1.0)

    def step(train_base, with_lora):
        leaves = [t.detach().requires_grad_() for t in [x, scale]]
        ws = [t.detach().requires_grad_(train_base) for t in base]
        lo = [t.detach().requires_grad_() for t in adapters]
        lora = (2.0, tuple(zip(lo[0::2], lo[1::2]))) if with_lora else None
        experts_grouped_mm(leaves[0], counts, leaves[1], *ws, lora).backward(grad)

    def ms(*variant):  # CUDA events around `iters` steps after
                       # warm-up (the first calls compile silu_mul)
        for _ in range(5):
            step(*variant)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(opt["iters"]):
            step(*variant)
        end.record()
        torch.cuda.synchronize()
        return round(start.elapsed_time(end) / opt["iters"], 3)
    full, lora, floor = ms(True, False), ms(False, True), ms(False, False)
    result = dict(opt, full_ms=full, lora_ms=lora, frozen_base_ms=floor,
                  ratio=round(lora / full, 3), over_frozen_base=round(lora / floor, 3))
    print(f"experts {E} x D {D} x H {H}, {N} rows, rank {r}: LoRA {lora} ms, full fine-tuning "
          f"{full} ms, "
          f"frozen base without adapters {floor} ms (fwd + bwd)")
    return result


# -----------------------------------------------------------------------------
# fp8: rollouts from vLLM's FP8 engine vs its bf16 engine, and the mismatch each leaves


def bench_fp8(layers=4, prompts=256, tokens=256, scored=64, inv_temperature=4, seed=0, profile=0):
    """FP8 rollouts on one GPU: vLLM's engine in bf16 and in FP8 (rollout_dtype="fp8": vLLM's
    online block-wise fp8_per_block) on a Qwen3-30B-A3B-shaped MoE cut to `layers` layers (random
    weights, tiny.py's tokenizer; built once under .cache), one after the other on the same
    `prompts` prompts of 64 random tokens, `tokens` sampled each (ignore_eos; temperature 1 /
    inv_temperature, peaked like a trained model's: random weights give near-uniform logits).
    Generated tokens/s of each. The mismatch: model.py in bf16 (the trainer's compute dtype), with
    routing replay of each engine's experts, scores the sampled tokens of `scored` prompts;
    log rho = trainer - engine logprob per token: mismatch KL (k3, as loss.py logs it), and what
    TIS (truncate at is_high, loss.py's default) leaves of the correction: the weight it cuts,
    mean max(rho - C, 0), the bias it keeps, and the share of tokens it truncates.
    ratio = FP8 tokens/s / bf16 tokens/s (the issue's bar: >= 1.4). --profile=N: after the timed
    runs, the same batch again on a fresh engine of each dtype with vLLM's torch profiler in its
    worker over N steps from the 20th: the share of the span the GPU was busy (kernels), ms per
    step, the costliest kernels. The timed engines are not configured to profile.

        python bench.py fp8                # one H100: 3-4 minutes (the model is built once)
        python bench.py fp8 --profile=20   # where a decode step's time goes
    """
    opt = dict(locals())
    import asyncio
    import os
    import tempfile
    import time
    import torch
    import torch.nn.functional as F
    import loss
    import tiny
    from engine import Engine
    from model import ModelConfig, Transformer
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        sys.exit("bench.py fp8 needs a GPU with FP8 matrix multiplies (Ada, Hopper or newer)")
    path = tiny.ensure_tiny_model(os.path.join(os.path.dirname(tiny.TINY_MODEL_PATH),
                                               f"bench-qwen3-30b-a3b-{layers}l"),
                                  ModelConfig(**QWEN3_30B_A3B, num_hidden_layers=layers))
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(1000, 30000, (64,), generator=g).tolist() for _ in range(prompts)]
    sampling = dict(max_tokens=tokens, temperature=1 / inv_temperature, ignore_eos=True)

    async def serve(rollout_dtype, profiler=None):
        engine = Engine(path, max_model_len=1024, memory_fraction=0.5, seed=seed,
                        enable_prefix_caching=False, enable_return_routed_experts=True,
                        rollout_dtype=rollout_dtype, **(profiler or {}))
        await engine.start()
        await asyncio.gather(*(engine.generate(p, sampling, f"w{i}")
                               for i, p in enumerate(heads[:8])))
        if profiler:
            await engine.llm.start_profile()
        t0 = time.perf_counter()
        # no per-request seed (the engine's own, as rollouts sample): vLLM draws a seeded
        # request's noise with its own generator, one kernel per request and step
        outs = await asyncio.gather(*(engine.generate(p, sampling, f"b{i}")
                                      for i, p in enumerate(heads)))
        seconds = time.perf_counter() - t0
        if profiler:
            await engine.llm.stop_profile()
        await engine.shutdown()
        return outs, seconds

    def profiled(rollout_dtype):
        """The same batch on an engine of its own with vLLM's torch profiler in the worker (an
        engine configured to profile is not the one timed): N steps from the 20th."""
        trace_dir = tempfile.mkdtemp(prefix=f"fp8-profile-{rollout_dtype}-")
        asyncio.run(serve(rollout_dtype, dict(profiler_config=dict(
            profiler="torch", torch_profiler_dir=trace_dir, torch_profiler_with_stack=False,
            torch_profiler_use_gzip=False, ignore_frontend=True, delay_iterations=20,
            max_iterations=profile))))
        summary = _engine_trace_summary(trace_dir, profile)
        print(rollout_dtype, summary, flush=True)
        return summary

    result = dict(opt, device=torch.cuda.get_device_name(), vllm=_version("vllm"))
    runs = {d: asyncio.run(serve(d)) for d in ("bfloat16", "fp8")}
    for d in ("bfloat16", "fp8") if profile else ():
        result[f"{d}_profile"] = profiled(d)
    for d, (outs, seconds) in runs.items():
        result[f"{d}_tokens_per_s"] = round(sum(len(o["token_ids"]) for o in outs) / seconds, 1)
    _free_memory()
    model = Transformer.from_pretrained(path, torch.bfloat16, "cuda").eval()
    C = loss.LossConfig().is_high
    for d, (outs, _) in runs.items():
        log_rho = []
        for head, out in zip(heads, outs[:scored]):
            ids = torch.tensor([head + out["token_ids"]], device="cuda")  # (1, T)
            routes = torch.tensor(out["routed_experts"], device="cuda")  # (R, L, K)
            pad = routes[-1:].expand(max(0, ids.shape[1] - len(routes)), -1, -1)
            with torch.no_grad():  # the last token's route (it never ran) may be missing: padding
                hidden = model.hidden_states(
                    ids, routed_experts=torch.cat([routes, pad])[None, :ids.shape[1]])
                logp = F.log_softmax(model.lm_head(hidden[0, len(head) - 1:-1]).float()
                                     * inv_temperature, -1)
            mine = logp.gather(-1, ids[0, len(head):, None])[:, 0]  # (tokens,)
            log_rho.append(mine - torch.tensor(out["logprobs"], device="cuda"))
        log_rho = torch.cat(log_rho).double()
        rho = log_rho.exp()
        result[d] = dict(mismatch_kl=(rho - 1 - log_rho).mean().item(),
                         mean_abs_log_rho=log_rho.abs().mean().item(),
                         tis_cut_weight=(rho - C).clamp(min=0).mean().item(),
                         tis_truncated_share=(rho > C).double().mean().item(),
                         sampled_nll=-torch.cat([torch.tensor(o["logprobs"]) for o in
                                                 outs[:scored]]).mean().item())
        print(f"{d}: {result[f'{d}_tokens_per_s']} generated tokens/s, {result[d]}", flush=True)
    result["ratio"] = round(result["fp8_tokens_per_s"] / result["bfloat16_tokens_per_s"], 3)
    result["mismatch_kl_ratio"] = round(result["fp8"]["mismatch_kl"]
                                        / max(result["bfloat16"]["mismatch_kl"], 1e-12), 2)
    return result


def _engine_trace_summary(trace_dir, steps, top=10):
    """From the worker's torch profiler trace (chrome JSON) of `steps` engine steps: the span
    from the first kernel's start to the last one's end, the share of it some kernel ran (the
    union of the kernels' intervals), ms per step of each, and the `top` costliest kernels."""
    import glob
    import json
    import os
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.json"), recursive=True),
                   key=os.path.getsize)
    if not files:
        return dict(error=f"no trace under {trace_dir}")
    events = json.load(open(files[-1]))["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                     if e.get("cat") == "kernel")
    if not kernels:
        return dict(error="the trace has no kernels")
    busy, end, per_name = 0.0, kernels[0][0], {}
    for a, b, name in kernels:  # the union of the intervals, in order of start
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
        per_name[name] = per_name.get(name, 0.0) + (b - a)
    span = end - kernels[0][0]
    costliest = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return dict(steps=steps, span_ms_per_step=round(span / 1e3 / steps, 3),
                gpu_busy_share=round(busy / span, 3),
                kernel_ms_per_step=round(sum(per_name.values()) / 1e3 / steps, 3),
                top_kernels_ms_per_step={n[:90]: round(t / 1e3 / steps, 3) for n, t in costliest})


# -----------------------------------------------------------------------------
# vl: our Qwen3-VL-MoE (vision tower, M-RoPE, deepstack) vs
# transformers' Qwen3VLMoeForConditionalGeneration, 1 GPU


def _vl_batch(vc, rows, T, vocab, generator, device):
    """Rows of T tokens with images in them (random text, then per image
    vision_start, its t*h*w/m^2 image tokens, vision_end, a few text
    tokens), the patches of all images in order, and image_grid_thw."""
    m2 = vc.spatial_merge_size ** 2
    special = min(vc.image_token_id, vc.video_token_id, vc.vision_start_token_id,
                  vc.vision_end_token_id)
    import torch
    ids = torch.randint(0, min(vocab, special), (len(rows), T), generator=generator, device=device)
    for r, grids in enumerate(rows):
        at = 8
        for t, h, w in grids:
            n = t * h * w // m2
            if at + n + 10 > T:
                raise ValueError(f"images {grids} do not fit in {T} tokens")
            ids[r, at], ids[r, at + 1:at + 1
                            + n], ids[r, at + 1 + n] = (vc.vision_start_token_id, vc.image_token_id,
                                                                         vc.vision_end_token_id)
            at += n + 10
    flat = [thw for grids in rows for thw in grids]
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    pixel_values = torch.randn(sum(t * h * w for t, h, w in flat), patch, generator=generator,
                               device=device)
    return ids, pixel_values, torch.tensor(flat, device=device)


def bench_vl(layers=4, depth=27, seq=4096, batch=2, images=4, steps=6, warmup=3, smoke=0,
             profile=0):
    """The VLM's training forward + backward on one GPU at Qwen3-VL-30B-A3B shapes
    (configs/qwen3_vl_30b_a3b.py: hidden 2048, 128 experts top-8, vocab 151936, the
    27-layer 1152-wide vision tower with deepstack into the first 3 layers) with
    `layers` text layers and random weights, ours (model.py) against transformers'
    Qwen3VLMoeForConditionalGeneration loaded from the checkpoint ours writes.
    1. Parity, fp32 (TF32 off): logits on sequences holding several images of several
       sizes (one beyond the 48x48 learned position grid), and every parameter's
       gradient of a token-logprob loss, each relative to the reference tensor's
       largest entry. Then both models in bf16 against the fp32 reference logits.
    2. Speed, bf16 weights: `batch` sequences of `seq` tokens with `images` 448x448
       images each (784 patches, 196 image tokens), forward + backward of the mean
       token logprob (ours: hidden_states + chunked logprobs; transformers: full
       logits + log_softmax). ratio = ours / transformers tokens/s.

        python bench.py vl                      # GPU
        python bench.py vl --smoke              # CPU, tiny shapes: exercises both code paths
    Options: --depth (vision blocks), --profile=N (after each measurement, one step under torch.profiler, its N
    costliest ops).
    """
    opt = dict(locals())  # the options, as bench.py's command line set them
    import dataclasses
    import runpy
    import tempfile
    import time
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForImageTextToText
    from loss import token_logprobs
    from model import ModelConfig, Transformer, init_parameters, ours_to_hf
    cuda = torch.cuda.is_available() and not opt["smoke"]
    if not cuda and not opt["smoke"]:
        sys.exit("bench.py vl needs a CUDA GPU; on CPU use --smoke")
    device = torch.device("cuda" if cuda else "cpu")
    # fp32 parity means fp32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    hf_cfg = runpy.run_path("configs/qwen3_vl_30b_a3b.py")["model_config"]
    cfg = ModelConfig.from_hf(hf_cfg)
    vision = dataclasses.replace(cfg.vision, depth=opt["depth"],
                                 deepstack_visual_indexes=[
                                     i for i in cfg.vision.deepstack_visual_indexes
                                     if i < opt["depth"]])
    cfg = dataclasses.replace(cfg, num_hidden_layers=opt["layers"], vision=vision)
    grids_448 = [(1, 28, 28)] * opt["images"]
    # 60x52: beyond the 48x48 learned grid
    parity_rows = [[(1, 28, 28), (1, 16, 40)], [(1, 60, 52), (1, 4, 6)]]
    parity_T = 1024
    if opt["smoke"]:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=48, mrope_section=[2, 3, 3],
                                  vision=dataclasses.replace(
                                      vision, depth=3, hidden_size=64, intermediate_size=96,
                                      num_heads=2, out_hidden_size=64, patch_size=4,
                                      num_position_embeddings=64, deepstack_visual_indexes=[0, 2],
                                      image_token_id=500, video_token_id=501,
                                      vision_start_token_id=502, vision_end_token_id=503))
        opt.update(seq=128, steps=1, warmup=1)
        grids_448 = [(1, 8, 8)] * opt["images"]
        parity_rows, parity_T = [[(1, 4, 6), (1, 10, 8)], [(1, 2, 2), (1, 14, 20)]], 160
    vc = cfg.vision
    g = torch.Generator(device).manual_seed(0)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    with torch.device(device):
        ours = Transformer(cfg)
    init_parameters(ours.named_parameters(), 0.02, g)
    with torch.no_grad():  # non-trivial norms and LayerNorm biases, so a misplaced norm would show
        for n, p in ours.named_parameters():
            if "norm" in n.rsplit(".", 2)[-2]:
                p.uniform_(0.5, 1.5, generator=g) if n.endswith("weight") else p.uniform_(
                    -0.2, 0.2, generator=g)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ours.save_pretrained(tmp)
        hf = AutoModelForImageTextToText.from_pretrained(tmp, dtype=torch.float32).to(device)
    print(f"checkpoint written and loaded by transformers in {time.perf_counter() - t0:.0f} s",
          flush=True)

    def hf_logits(ids, pv, grid):
        return hf(input_ids=ids, pixel_values=pv, image_grid_thw=grid,
                  mm_token_type_ids=(ids == vc.image_token_id).int(), use_cache=False).logits

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    # 1. parity
    ids, pv, grid = _vl_batch(vc, parity_rows, parity_T, cfg.vocab_size, g, device)
    targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=g, device=device)
    result = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu",
                  transformers_version=transformers.__version__,
                  torch=torch.__version__, text_layers=cfg.num_hidden_layers, vision_depth=vc.depth,
                  experts=cfg.num_experts, params=sum(p.numel() for p in ours.parameters()),
                  experts_implementation=getattr(hf.config, "_experts_implementation", None),
                  attn_implementation=hf.config._attn_implementation)
    parity = result["parity"] = dict(tokens=ids.numel(), images=len(grid), patches=len(pv))
    ref = hf_logits(ids, pv, grid)
    logits = ours(ids, pixel_values=pv, image_grid_thw=grid)
    parity["fp32_logits_max_abs"] = (logits - ref).abs().max().item()
    parity["fp32_logits_rel"] = rel(logits, ref)
    for model, out in ((ours, logits), (hf, ref)):
        (-F.log_softmax(out, -1).gather(-1, targets[..., None]).mean()).backward()
    logits = ref = None
    theirs = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    mine = ours_to_hf({n: p.grad for n, p in ours.named_parameters()}, cfg)
    worst = {}
    for name, ref_g in theirs.items():
        if name in mine:
            g_ = mine[name]
        else:  # transformers' fused experts (E, 2H, D) / (E,
               # D, H) in memory; ours stacked per projection
            stem = name.rsplit(".", 1)[0].replace("model.language_model.", "model.") + "."
            w = {k: p.grad for k, p in ours.named_parameters() if k.startswith(stem)}
            g_ = torch.cat([w[stem + "gate_proj"], w[stem + "up_proj"]],
                           1) if name.endswith("gate_up_proj") else w[stem + "down_proj"]
            g_ = g_ if g_.shape == ref_g.shape else g_.transpose(1, 2)
        part = "vision" if ".visual." in name else "experts" if ".experts" in name else "text"
        worst[part] = max(worst.get(part, 0.0), rel(g_, ref_g))
    parity["fp32_grad_rel_max"] = worst
    parity["grads_compared"] = len(theirs)
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    with torch.no_grad():
        ref = hf_logits(ids, pv, grid)
        ours.to(torch.bfloat16)
        hf.to(torch.bfloat16)
        pv16 = pv.to(torch.bfloat16)
        parity["bf16_ours_vs_fp32_rel"] = rel(ours(ids, pixel_values=pv16, image_grid_thw=grid),
                                              ref)
        parity["bf16_transformers_vs_fp32_rel"] = rel(hf_logits(ids, pv16, grid), ref)
    ref = None
    print(f"parity: {parity}", flush=True)

    # 2. speed, bf16
    B, T = opt["batch"], opt["seq"]
    ids, pv, grid = _vl_batch(vc, [grids_448] * B, T, cfg.vocab_size, g, device)
    pv = pv.to(torch.bfloat16)
    targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=g, device=device)
    ours.train()
    hf.train()

    def ours_step():
        h = ours.hidden_states(ids, pixel_values=pv, image_grid_thw=grid)
        lp, _ = token_logprobs(h, ours.lm_head.weight, targets, chunk_size=2048)
        (-lp.mean()).backward()
        ours.zero_grad(set_to_none=True)

    def hf_step():
        lp = F.log_softmax(hf_logits(ids, pv, grid).float(), -1).gather(-1, targets[..., None])
        (-lp.mean()).backward()
        hf.zero_grad(set_to_none=True)

    def measure(name, step):
        for _ in range(opt["warmup"]):
            step()
        sync()
        base = torch.cuda.memory_allocated(device) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(opt["steps"]):
            step()
        sync()
        s = (time.perf_counter() - t0) / opt["steps"]
        out = dict(step_s=round(s, 4), tokens_per_s=round(B * T / s),
                   images_per_s=round(len(grid) / s, 1), peak_extra_gb=round(
                       ((torch.cuda.max_memory_allocated(device) if cuda else 0) - base) / 1e9, 2))
        print(f"{name}: {out}", flush=True)
        if opt["profile"]:  # one more step under the profiler: where the time goes, per kernel
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] +
                                        ([torch.profiler.ProfilerActivity.CUDA] if cuda
                                         else [])) as prof:
                step()
                sync()
            print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                            row_limit=opt["profile"]), flush=True)
        return out
    result.update(seq=T, batch=B, images_per_sequence=opt["images"], image_tokens_per_sequence=int(
        (ids[0] == vc.image_token_id).sum()), ours=measure("ours", ours_step),
        transformers=measure("transformers", hf_step))
    result["ratio"] = round(result["ours"]["tokens_per_s"] / result["transformers"]["tokens_per_s"],
                            3)
    return result


def _compile_attention_and_norms(model):
    """torch.compile the attention and RMSNorm modules
    (elementwise fusion); experts and all-to-alls stay eager."""
    for module in model.modules():
        if type(module).__name__.endswith(("Attention", "RMSNorm")):
            module.compile()


def _hf_fsdp_model(mcfg, cfg, device, compile_modules, checkpointing):
    """transformers' Qwen3MoeForCausalLM (Qwen3_5MoeForCausalLM for the hybrid)
    built on the meta device, each decoder layer and the root under fully_shard
    with our mixed precision, shards initialized like ours, AdamW like ours."""
    import torch
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import train
    hybrid = mcfg.family == "qwen3_5"
    names = ("Qwen3_5MoeTextConfig",
             "Qwen3_5MoeForCausalLM") if hybrid else ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")
    Config, CausalLM = (getattr(transformers, n) for n in names)
    hf_cfg = Config(**{k: v for k, v in mcfg.to_hf().items()
                       if k not in ("model_type", "architectures", "torch_dtype")})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = CausalLM(hf_cfg)
    if checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg["param_dtype"]),
                              reduce_dtype=torch.float32)
    for layer in hf.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(hf, mp_policy=mp)
    hf.to_empty(device=device)
    from model import init_parameters
    generator = torch.Generator(device).manual_seed(cfg["seed"] + torch.distributed.get_rank())
    init_parameters(((n, train.local_tensor(p)) for n, p in hf.named_parameters()), 0.02, generator,
                    hybrid)
    # to_empty left the rotary inv_freq buffers uninitialized: build the rotary embedding again
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg).to(device)
    if compile_modules:
        _compile_attention_and_norms(hf)
    hf.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(hf.parameters(), lr=cfg["learning_rate"],
                                  betas=(cfg["beta1"], cfg["beta2"]),
                                  weight_decay=cfg["weight_decay"], fused=fused)
    info = dict(version=transformers.__version__,
                attn_implementation=hf.config._attn_implementation,
                experts_implementation=getattr(hf.config, "_experts_implementation", None),
                params=sum(p.numel() for p in hf.parameters()))
    return hf, optimizer, info
