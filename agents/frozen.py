"""
A second model that never trains (a judge, a teacher, a user simulator): its own vLLM engine behind its own capture
server, served from a background thread so that agent code on any event loop can use it.

    judge = FrozenModel(".cache/tiny-qwen3-moe").start()     # ~20 s on CPU
    async with judge.client() as client:                      # an AsyncOpenAI on a fresh session, dropped after
        reply = await client.chat.completions.create(model="judge", messages=[...], max_tokens=16)
    logprobs = await judge.prompt_logprobs(token_ids)         # log p(token_i | tokens before it), for distillation
    judge.close()

Weight sync reaches only the rollout engines, so this one keeps the weights it loaded. A recipe starts it in its
`setup(cfg)` (called once per run in the process that runs the attempts; see agents/__init__.py) and returns
`close` as the clean-up. On GPU the engine takes memory_fraction of the GPU the process sees: give a large judge a
GPU of its own (CUDA_VISIBLE_DEVICES of the rollout process) rather than sharing one with a trainer rank.
"""
import asyncio
import contextlib

from openai import AsyncOpenAI

import capture


class FrozenModel:
    def __init__(self, model_path, *, max_model_len=2048, memory_fraction=0.2, name="frozen", **engine_kwargs):
        self.model_path, self.max_model_len, self.name = model_path, max_model_len, name
        self.engine = capture.Engine(model_path, max_model_len=max_model_len, memory_fraction=memory_fraction,
                                     worker_extension_cls=None, **engine_kwargs)
        self.server = None

    def start(self):
        """Start the engine and the server on their own thread; blocks until both serve. Returns self."""
        self.server = capture.CaptureServer(self.engine, self.model_path, max_model_len=self.max_model_len,
                                            model_name=self.name)
        self.server.start_in_thread()
        try:
            self.server.run_in_loop(self.engine.start())
        except BaseException:
            self.server.stop_thread()
            self.server = None
            raise
        return self

    def _check_started(self):
        if self.server is None:
            raise RuntimeError(f"the frozen model {self.model_path!r} is not running: call start() first (a recipe "
                               "does it in setup(cfg), which the framework calls once before the first attempt)")

    @contextlib.asynccontextmanager
    async def client(self):
        """An AsyncOpenAI client on a new session of this model's server; the session is dropped afterwards, so
        nothing it generated is kept (or trained on)."""
        self._check_started()
        session = self.server.new_session()
        try:
            async with AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
                yield client
        finally:
            self.server.drop_session(session.id)

    async def prompt_logprobs(self, token_ids):
        """This model's logprob (temperature 1) of each token given the ones before it; None for the first."""
        self._check_started()
        # the engine lives on the server's loop; hop there and await the answer from this loop
        future = asyncio.run_coroutine_threadsafe(self.engine.prompt_logprobs(list(token_ids)), self.server.loop)
        return await asyncio.wrap_future(future)

    def close(self):
        if self.server is not None:
            self.server.run_in_loop(self.engine.shutdown())
            self.server.stop_thread()
            self.server = None
