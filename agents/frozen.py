"""
A second model that never trains (a judge, a teacher, a user simulator):
its own vLLM engine behind its own capture server, served from a
background thread so that agent code on any event loop can use it.

    judge = FrozenModel(".cache/tiny-qwen3-moe").start()     # ~20 s on CPU
    async with judge.client() as client:                      # an AsyncOpenAI on a fresh session, dropped after
        reply = await client.chat.completions.create(model="judge", messages=[...], max_tokens=16)
    logprobs = await judge.prompt_logprobs(token_ids)         # log p(token_i | tokens before it), for distillation
    judge.close()

Weight sync reaches only the rollout engines, so this one keeps the weights it loaded. A recipe
starts it in its `setup(cfg)` (called once per run in the process that runs the attempts; see
agentrl.py) and returns `close` as the clean-up. Where the engine runs (`placement`):
    "local"  an engine.Engine in this process (vLLM's engine core in a child process): the CPU default
    "ray"    an engine actor on a placement-group bundle of its own (rollout.start_engines): with GPUs, this keeps
             the frozen model off the GPUs of the trainer ranks (the driver has reserved those) and of the engines
    "auto"   "ray" when Ray is up and the cluster has GPUs, else "local"
"""
import asyncio
import contextlib

from openai import AsyncOpenAI

import capture
from engine import OPTIONS, Engine


class FrozenModel:
    def __init__(self, model_path, *, max_model_len=OPTIONS["max_model_len"], memory_fraction=0.2,
                 tensor_parallel_size=OPTIONS["tensor_parallel_size"], placement="auto",
                 name="frozen"):
        if placement not in ("auto", "local", "ray"):
            raise ValueError(f"placement must be 'auto', 'local' or 'ray', got {placement!r}")
        self.model_path, self.max_model_len, self.name = model_path, max_model_len, name
        self.memory_fraction, self.tensor_parallel_size, self.placement = memory_fraction, tensor_parallel_size, placement
        self.server = self.engine = self.actor = self.placement_group = None

    def start(self):
        """Start the engine and the server; blocks until both serve. Returns self."""
        import ray
        if self.placement == "auto":
            on_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
            self.placement = "ray" if on_gpu else "local"
        if self.placement == "ray":
            import rollout
            engines, self.placement_group = rollout.start_engines(
                self.model_path, 1, self.tensor_parallel_size, max_restarts=0,
                max_model_len=self.max_model_len, memory_fraction=self.memory_fraction)
            self.actor, backend = engines[0], rollout.Router(engines)
        else:
            self.engine = backend = Engine(
                self.model_path, max_model_len=self.max_model_len,
                memory_fraction=self.memory_fraction,
                tensor_parallel_size=self.tensor_parallel_size, worker_extension_cls=None)
        self.server = capture.CaptureServer(backend, self.model_path,
                                            max_model_len=self.max_model_len, model_name=self.name)
        self.server.start_in_thread()
        if self.engine is not None:
            try:
                # the engine's output loop is the server's
                self.server.run_in_loop(self.engine.start())
            except BaseException:
                self.close()
                raise
        return self

    def _check_started(self):
        if self.server is None:
            raise RuntimeError(
                f"the frozen model {self.model_path!r} is not running: call start() first (a "
                "recipe "
                "does it in setup(cfg), which the framework calls once before the first attempt)")

    @contextlib.asynccontextmanager
    async def client(self):
        """An AsyncOpenAI client on a new session of this model's server; the session
        is dropped afterwards, so nothing it generated is kept (or trained on)."""
        self._check_started()
        session = self.server.new_session()
        try:
            async with AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                   max_retries=0) as client:
                yield client
        finally:
            self.server.drop_session(session.id)

    async def prompt_logprobs(self, token_ids):
        """This model's logprob (temperature 1) of each token
        given the ones before it; None for the first."""
        self._check_started()
        if self.actor is not None:
            # a Ray call: awaitable on any loop
            return await self.actor.prompt_logprobs.remote(list(token_ids))
        # the local engine answers on the server's loop;
        # hop there and await the answer from this loop
        future = asyncio.run_coroutine_threadsafe(self.engine.prompt_logprobs(list(token_ids)),
                                                  self.server.loop)
        return await asyncio.wrap_future(future)

    def close(self):
        if self.server is not None:
            if self.engine is not None:
                self.server.run_in_loop(self.engine.shutdown())
            self.server.stop_thread()
            self.server = None
        if self.actor is not None:
            import ray
            from ray.util.placement_group import remove_placement_group
            ray.kill(self.actor)  # its engine core and workers go with it
            remove_placement_group(self.placement_group)
            self.actor = self.placement_group = None
