"""
Our side of vLLM: the engine wrapper (`Engine`: one AsyncLLM; token ids in, token
ids, sampling logprobs, policy versions and routes out; rollout.EngineActor runs it
as a Ray actor, the capture server and agents/frozen.py run it in their own process)
which names, as engine arguments, the classes that vLLM's own processes load by name (worker.py:
the worker extension that receives the weights, the CPU workers, the image scheduler).

Engine's keyword defaults are the one home of each engine option's default (OPTIONS): train.py's
config block and the standalone users (capture.py's command line, agents/frozen.py) read them
there. Nothing here imports vLLM at module level: the trainer imports this file's names without it.

Supported vLLM: 0.26 (the release built for torch 2.11) through 0.32. Where an API of the range's
newer end is missing, the feature is detected (never the version string) and the wrapper keeps the
same guarantee itself: per-token policy versions without vLLM's weight-version spans
(`version_starts`); without `per_request_spec_decode_metrics` a turn's `drafts` is None and
take_drafts reads the engine's own counters (vLLM's Prometheus metrics, in this process).
"""
import dataclasses
import importlib.util
import io
import json
import os
import uuid

WORKER_EXTENSION = "worker.WeightSyncWorker"
LORA_ID = 1  # the one LoRA adapter an engine serves; Engine's requests name it


class EngineNotStarted(RuntimeError):
    """A request reached an engine whose actor Ray restarted
    but nobody started yet (the router then starts it)."""


class Engine:
    """One vLLM AsyncLLM: token ids in; token ids, sampling
    logprobs, policy versions (and routes) out."""

    def __init__(self, model_path, *, max_model_len=2048, memory_fraction=0.5,
                 tensor_parallel_size=1, enable_prefix_caching=True, speculative_config=None,
                 seed=0, enable_return_routed_experts=False,
                 worker_extension_cls=WORKER_EXTENSION, recompute_kv_on_sync=True,
                 max_images_per_prompt=8, lora_path=None, rollout_dtype="bfloat16",
                 **engine_kwargs):
        import torch
        # GiB of KV cache of a CPU engine (else half the RAM)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.model_path, self.max_model_len = model_path, max_model_len
        self.recompute_kv_on_sync = recompute_kv_on_sync
        self.engine_args = dict(
            model=model_path, dtype="bfloat16", max_model_len=max_model_len,
            gpu_memory_utilization=memory_fraction, tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching, speculative_config=speculative_config,
            seed=seed, enable_return_routed_experts=enable_return_routed_experts,
            # vLLM ignores it for a text model
            limit_mm_per_prompt={"image": max_images_per_prompt, "video": 0},
            # the behavior logprob is the sampling distribution's
            # (after temperature), not the raw model's
            logprobs_mode="processed_logprobs")
        if rollout_dtype == "fp8":  # vLLM's online block-wise FP8: it quantizes every Linear and
            # expert weight as it loads them (at start and at each weight sync), e4m3 per 128x128
            # block (weights_sync.quantize_fp8_blocks); activations per token group of 128
            self.engine_args["quantization"] = "fp8_per_block"
        # spec_counts: vLLM's (accepted, drafted) draft counters at the last take_drafts, kept
        # where requests report no acceptance of their own
        self.spec_counts = None
        if vllm_takes("per_request_spec_decode_metrics"):  # each request reports its acceptance
            self.engine_args["per_request_spec_decode_metrics"] = (
                "summary" if speculative_config else "none")
        elif speculative_config:  # requests don't: vLLM's counters (kept when stats are logged)
            self.spec_counts = [0, 0]
        if speculative_config and not torch.cuda.is_available() and worker_extension_cls == WORKER_EXTENSION:
            worker_extension_cls = "worker.DraftingCPUWorker"  # see worker.verify_drafts_on_cpu
        if worker_extension_cls:
            self.engine_args["worker_extension_cls"] = worker_extension_cls
        config = os.path.join(model_path, "config.json")
        hf = json.load(open(config)) if os.path.isfile(config) else {}
        if "vision_config" in hf:
            self.engine_args["scheduler_cls"] = "worker.ImageScheduler"  # see worker.KeepImages
        # a hybrid (Qwen3.5 / 3.6: Gated DeltaNet layers) keeps its recurrent state
        # in fp32 (a bf16 state drifts the rollout logprobs); its prefix caching is
        # vLLM's "align" mode, which caches the state at block boundaries
        hybrid = "linear_attention" in (hf.get("text_config", hf).get("layer_types") or [])
        if hybrid:
            self.engine_args["mamba_ssm_cache_dtype"] = "float32"
            # on Hopper vLLM's "auto" picks FlashInfer's Gated DeltaNet prefill, and the engine
            # dies at its first prefill where FlashInfer is not installed: its Triton kernel then
            if (torch.cuda.is_available() and vllm_takes("gdn_prefill_backend")
                    and importlib.util.find_spec("flashinfer") is None):
                self.engine_args["gdn_prefill_backend"] = "triton"
        if not torch.cuda.is_available():
            self.engine_args["enforce_eager"] = True
            # vLLM's CPU runner rewinds a seeded request's generator when it discards the
            # sample of a partial prefill, which CPU generators cannot do: the engine dies.
            # Whole-prompt prefills never discard. A hybrid's align mode needs chunked
            # prefill (it splits prompts at block boundaries): there seeds are refused.
            self.engine_args["enable_chunked_prefill"] = hybrid and enable_prefix_caching
            if torch.cpu._is_amx_tile_supported():
                self.engine_args["worker_cls"] = "worker.AMXCPUWorker"
        self.engine_args.update(engine_kwargs)
        self.seeds_refused = not torch.cuda.is_available() and bool(
            self.engine_args.get("enable_chunked_prefill"))
        self.llm = None
        self.policy_version, self.drafts = 0, [0, 0]  # drafts: (accepted,
                                                      # drafted) since take_drafts
        # where vLLM keeps no per-token weight version:
        # request id -> [(policy_version, output tokens it had when that version began)]
        self.version_starts = None
        # lora_path: a PEFT adapter directory; every request runs with that
        # adapter (vLLM's LoRA id 1), which each weight sync then replaces
        # in place (worker.WeightSyncWorker.receive_adapter)
        self.lora_request = None
        if lora_path:
            from vllm.lora.request import LoRARequest
            self.lora_request = LoRARequest("policy", LORA_ID, lora_path)

    async def start(self):  # answers None: under Ray the result travels
                            # back, and an Engine cannot be pickled
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))
        if self.spec_counts is not None:
            self.spec_counts = spec_counters()
        self.version_starts = None if hasattr(self.llm, "update_weight_version") else {}
        await self.set_version(0)

    async def generate(self, prompt_token_ids, sampling, request_id, session_id=None, images=None):
        """One turn, as the last item of stream()."""
        async for out in self.stream(prompt_token_ids, sampling, request_id, final_only=True,
                                     images=images):
            pass
        return out

    async def stream(self, prompt_token_ids, sampling, request_id, session_id=None,
                     final_only=False, images=None):
        """Sample one turn: {"token_ids": the tokens so far} per engine step, then the
        turn. `sampling` keys: temperature, top_p, max_tokens, stop, stop_token_ids, seed,
        routed_experts_start (routes are returned for the tokens from there on: the caller
        has the earlier ones), ignore_eos (benchmarks), structured (StructuredOutputsParams
        fields: json, json_object, ...), logit_bias, top_logprobs (k: also return the k
        likeliest tokens per position). session_id is for routers that keep a session on
        one engine; one engine ignores it. `images`: the encoded files of the prompt's
        images, in order; prompt_token_ids holds one placeholder token for each, which
        vLLM's processor expands to the image's tokens. The turn's `drafts`: (draft tokens
        accepted, tokens drafted) with speculative decoding on, else None."""
        if self.llm is None:  # a Ray actor restarted after its process
                              # died is a fresh Engine, not started
            raise EngineNotStarted(
                "this engine's process was restarted and has not started its engine yet")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        if self.seeds_refused and sampling.get("seed") is not None:  # the caller answers 400
            raise ValueError("`seed` is not supported by this engine: vLLM's CPU runner cannot "
                             "rewind a seeded "
                             "generator over the chunked prefills a hybrid model's prefix cache "
                             "needs.")
        stop, structured, top = sampling.get("stop") or None, sampling.get("structured"), sampling.get("top_logprobs")
        params = SamplingParams(
            n=1, temperature=sampling.get("temperature", 1.0), top_p=sampling.get("top_p", 1.0),
            max_tokens=sampling.get("max_tokens"), stop=stop,
            stop_token_ids=sampling.get("stop_token_ids"),
            seed=sampling.get("seed"), ignore_eos=sampling.get("ignore_eos", False), logprobs=top
            or 0,
            routed_experts_prompt_start=sampling.get("routed_experts_start", 0),
            logit_bias=sampling.get("logit_bias"),
            # grammar masks and biases act before sampling: processed
            # logprobs are those of the masked distribution
            structured_outputs=StructuredOutputsParams(**structured) if structured else None,
            detokenize=stop is not None,  # text only for stop strings
            output_kind=RequestOutputKind.FINAL_ONLY if final_only
            else RequestOutputKind.CUMULATIVE)
        # refused with drafts: our biases are bans
        if self.engine_args["speculative_config"] and params.logit_bias:
            # (-100)
            params.logit_bias, params._bad_words_token_ids = None, [[t] for t in params.logit_bias]
        starts = [(self.policy_version, 0)]  # where vLLM keeps none (see set_version)
        if self.version_starts is not None:
            self.version_starts[request_id] = starts
        try:
            prompt = self.prompt(prompt_token_ids, images)
            lora = self.lora_request
            async for out in self.llm.generate(prompt, params, request_id, lora_request=lora):
                if not out.finished:
                    yield {"token_ids": list(out.outputs[0].token_ids)}
        finally:
            if self.version_starts is not None:
                self.version_starts.pop(request_id, None)
        c = out.outputs[0]
        ids = list(c.token_ids)
        versions = [self.policy_version] * len(ids)
        spans = [(0 if s.version == "default" else int(s.version), s.start, s.end)
                 for s in getattr(c, "weight_versions", None) or []]
        if self.version_starts is not None:
            spans = [(v, a, b) for (v, a), (_, b) in zip(starts, [*starts[1:], (None, len(ids))])]
        for v, a, b in spans:
            versions[a:b] = [v] * (b - a)
        # routes: (T - routed_experts_start, L_moe, K) when enabled
        routes, m = c.routed_experts, getattr(c, "spec_decode_metrics", None)
        result = dict(token_ids=ids, logprobs=[c.logprobs[i][t].logprob for i, t in enumerate(ids)],
                      token_versions=versions, routed_experts=None if routes is None
                      else routes.tolist(),
                      finish_reason=c.finish_reason, num_prompt_tokens=len(out.prompt_token_ids),
                      drafts=m and (sum(j * n for j, n in enumerate(m.histogram)),
                                    m.num_draft_tokens))
        self.drafts = [a + b for a, b in zip(self.drafts, result["drafts"] or (0, 0))]
        if top:  # per position, (token id, logprob) by rank; the
                 # sampled token's entry comes too when ranked lower
            result["top_logprobs"] = [
                [(t, p.logprob) for t, p in sorted(d.items(), key=lambda x: x[1].rank)
                 if p.rank <= top] for d in c.logprobs]
        yield result

    async def prompt_logprobs(self, token_ids, images=None):
        """The engine's logprob of each token given the ones before it
        (None for the first), at temperature 1; with images (as for
        stream), of the prompt with each image's tokens expanded."""
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        async for out in self.llm.generate(self.prompt(token_ids, images), params, uuid.uuid4().hex,
                                           lora_request=self.lora_request):
            pass
        return [None if d is None else d[t].logprob for t,
                d in zip(out.prompt_token_ids, out.prompt_logprobs)]

    @staticmethod
    def prompt(token_ids, images):
        from vllm.inputs import TokensPrompt
        prompt = TokensPrompt(prompt_token_ids=list(token_ids))
        if images:  # vLLM's processor decodes (PIL opens lazily) and patches them
            from PIL import Image
            prompt["multi_modal_data"] = {"image": [Image.open(io.BytesIO(b)) for b in images]}
        return prompt

    async def pause(self):
        """Freeze in-flight requests for a weight update (they finish after resume). With
        recompute_kv_on_sync the prefix cache is emptied and the frozen requests are
        preempted: after resume they recompute their KV (prompt and tokens so far) with the
        new weights, so every later token is the new policy's alone. Without it they continue
        on KV the old weights computed, and a new request can hit an old-weight prefix."""
        await self.llm.pause_generation(mode="keep", clear_cache=self.recompute_kv_on_sync)

    async def resume(self):
        await self.llm.resume_generation()

    async def sleep(self, level=2):
        """Give the GPU to the trainer (placement="colocated"; the engine was started with
        enable_sleep_mode, vLLM's sleep mode, CUDA only). Level 1 keeps the weights in host memory,
        level 2 drops them (the next weight sync rewrites every one); the KV cache is dropped
        either way. In-flight requests are kept: frozen, and preempted, so that after wake() they
        recompute their KV; new requests wait."""
        await self.llm.sleep(level, mode="keep")

    async def wake(self, tags=None):
        """Map the memory back: tags ["weights"] (then a weight sync, while requests still wait),
        ["kv_cache"] (requests run again), or None for both."""
        await self.llm.wake_up(tags)

    async def is_sleeping(self):
        return await self.llm.is_sleeping()

    async def take_drafts(self):  # the draft tokens accepted and drafted since the last call
        if self.spec_counts is not None:
            now = spec_counters()
            drafts, self.spec_counts = [a - b for a, b in zip(now, self.spec_counts)], now
            return drafts
        drafts, self.drafts = self.drafts, [0, 0]
        return drafts

    async def set_version(self, policy_version):
        """Every token sampled from now on carries `policy_version` (called while paused, after the
        new weights loaded). Where vLLM cannot tag tokens itself, each held request's token count is
        noted: the engine is paused and its outputs so far are processed, so the count is where the
        new version's tokens begin."""
        self.policy_version = int(policy_version)
        if self.version_starts is None:
            await self.llm.update_weight_version(str(self.policy_version))
            return
        for state in self.llm.output_processor.request_states.values():
            if (starts := self.version_starts.get(state.external_req_id)) is not None:
                starts.append((self.policy_version, state.detokenizer.num_output_tokens()))

    async def collective_rpc(self, method, args=(), kwargs=None):
        return await self.llm.collective_rpc(method, args=tuple(args), kwargs=kwargs)

    async def shutdown(self):
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


OPTIONS = Engine.__init__.__kwdefaults__  # each keyword option's default, as declared above


def vllm_takes(engine_arg):
    """Whether the installed vLLM has engine argument `engine_arg` (the supported range differs)."""
    from vllm import AsyncEngineArgs
    return engine_arg in {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def spec_counters():
    """(accepted, drafted) draft tokens of every engine in this process since it started: vLLM's
    Prometheus counters, for a vLLM without per-request acceptance."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot
    names = ("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens")
    got = [m for m in get_metrics_snapshot() if isinstance(m, Counter)]
    return [sum(m.value for m in got if m.name == n) for n in names]
