"""Shared fixtures and the `stack` marker. Run the suite with `make test` (or `.venv/bin/python -m pytest tests -q`);
the unit tests alone (in-process: no vLLM engine, no Ray, no rank processes) with
`.venv/bin/python -m pytest tests -q -m "not stack"`."""
import asyncio
import contextlib
import functools
import os
import re
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "agents"))  # as agentrl.load_agent does: the recipes import each other by name
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's CPU engine: its worker inside the engine-core process (vLLM's one-process executor, what one GPU gets),
# not in a process of its own, which the CPU platform otherwise spawns for its OpenMP thread binding: ~17 s less
# per engine start on 2 cores, for every engine the suite starts (in-process, Ray actors, train.py children)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# torchrun's rendezvous variables. train.init_distributed sets them when a test makes a 1-rank process group in this
# process; a later test's child process (train.py, bench.py) must not inherit them, or it joins a dead rendezvous.
RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
SESSION_RENDEZVOUS = {k: os.environ[k] for k in RENDEZVOUS if k in os.environ}


def reset_rendezvous():
    for k in RENDEZVOUS:
        os.environ.pop(k, None)
    os.environ.update(SESSION_RENDEZVOUS)


def child_env(**extra):
    """os.environ for a child that a test starts after making a process group in this process, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS}, **extra}


def kill_tree(proc, tree):
    """SIGKILL what is left of a process a test started: it and the descendants recorded for it (`tree`, psutil)."""
    import psutil
    for p in [proc] + tree:
        try:
            p.kill()
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass


def end_rank():
    """The last call of a spawned rank that finished its work and destroyed its process group: exit at once,
    without interpreter finalization, where gloo's worker threads can still drop tensors after the interpreter is
    gone (a rare SIGABRT, "terminate called without an active exception", seen once in CI). A rank that failed
    raised before this and is reported as usual."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn, args, nprocs):
    """torch.multiprocessing.spawn(fn, args, nprocs), each rank forked from one forkserver (per test process) that
    imported torch and the trainer once (test_train and what it imports): a spawned rank imported them itself, ~5 s
    of CPU, for some 80 ranks in the suite. The ranks run gloo on the CPU with CUDA hidden, also on a machine with
    GPUs (fewer of them than ranks, or their NCCL and kernels, would change what the tests compare); each gets this
    process's environment as it is now (the forkserver keeps the one of its start)."""
    import unittest.mock
    import torch.multiprocessing as mp
    env, stdio = child_env(CUDA_VISIBLE_DEVICES=""), (ParentFd(1), ParentFd(2))
    mp.set_forkserver_preload(["test_train"])
    # the forkserver starts at the first call, with this environment; Python 3.11's ignores our sys.path
    path = os.pathsep.join(p for p in (os.path.join(ROOT, "tests"), ROOT, os.environ.get("PYTHONPATH")) if p)
    with unittest.mock.patch.dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=path):  # restored after
        mp.start_processes(_rank_in, args=(env, stdio, fn, args), nprocs=nprocs, join=True,
                           start_method="forkserver")


class ParentFd:
    """A file descriptor of this process that a starting rank gets a copy of (multiprocessing hands it to the
    forkserver's child, as it hands over a pipe): the rank writes to this process's stdout and stderr as they are at
    the spawn, which the tests' output capture (capfd) redirects; the forkserver's are those of its start."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):  # while the rank's process starts
        from multiprocessing.reduction import DupFd
        return _detach, (DupFd(self.fd),)


def _detach(dup):
    return dup.detach()


def _rank_in(rank, env, stdio, fn, args):
    os.environ.clear()
    os.environ.update(env)
    for fd, parent in enumerate(stdio, 1):
        os.dup2(parent, fd)
        os.close(parent)
    fn(rank, *args)


class RecordingBackend:
    """The capture server's backend for tests: the real engine behind a thin wrapper that records every call
    (session, prompt ids, output, start and end times), and can force the text of a session's next turns (the
    engine scores the forced tokens, so their logprobs are real; out["forced"] marks them) or fail one call."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.calls, self.forced, self.fail = [], {}, set()

    async def generate(self, prompt, sampling, request_id, session_id=None, images=None):
        start = time.monotonic()
        if session_id in self.fail:
            self.fail.discard(session_id)
            raise RuntimeError("the engine process died (simulated)")
        if self.forced.get(session_id):
            ids = self.tokenizer(self.forced[session_id].pop(0), add_special_tokens=False)["input_ids"]
            ids += [self.tokenizer.eos_token_id]
            logprobs = await self.engine.prompt_logprobs(prompt + ids, images)  # images: the prompt expands
            out = dict(token_ids=ids, logprobs=logprobs[-len(ids):], token_versions=[self.engine.policy_version] *
                       len(ids), routed_experts=None, finish_reason="stop", num_prompt_tokens=len(logprobs) - len(ids),
                       forced=True)
        else:
            out = await self.engine.generate(prompt, sampling, request_id, session_id=session_id, images=images)
        self.calls.append(dict(session_id=session_id, prompt=list(prompt), out=out, start=start, end=time.monotonic(),
                               images=images))
        return out

    async def stream(self, prompt, sampling, request_id, session_id=None, images=None):
        """generate's turn as the engine streams it; a forced turn streams a token per step (scored first), as the
        engine would sample it; a failing one fails before its first token."""
        if self.forced.get(session_id) or session_id in self.fail:
            out = await self.generate(prompt, sampling, request_id, session_id, images)
            for n in range(1, len(out["token_ids"])):
                yield {"token_ids": out["token_ids"][:n]}
                await asyncio.sleep(0.002)  # an engine step: the server sends what it has
            yield out
            return
        start = time.monotonic()
        async for out in self.engine.stream(prompt, sampling, request_id, session_id=session_id, images=images):
            yield out
        self.calls.append(dict(session_id=session_id, prompt=list(prompt), out=out, start=start, end=time.monotonic(),
                               images=images))

    def of(self, session_id):
        return [c for c in self.calls if c["session_id"] == session_id]


# -----------------------------------------------------------------------------
# the `stack` marker: a test is `stack` when it (or a fixture it uses, directly or through another fixture) starts a
# vLLM engine, Ray, rank processes or one of our entry scripts as a process. `-m "not stack"` is then the in-process
# unit tier, and the guard below makes that true: a test not marked `stack` that starts any of these fails, naming
# what it started.

def starts_stack(fixture_function):
    """Mark a fixture as one that starts an engine, Ray or processes: every test using it is marked `stack`."""
    fixture_function.starts_stack = True
    return fixture_function


def uses_stack_fixture(item):
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ()):
            if getattr(fixturedef.func, "starts_stack", False):
                return True
    return False


def pytest_configure(config):
    config.addinivalue_line("markers", "stack: runs a vLLM engine, Ray, rank processes (gloo) or train.py / bench.py as a "
                                       "process (deselect with -m 'not stack')")
    config.addinivalue_line("markers", "gpu: runs on CUDA where there is one (`make test-gpu` "
                            "runs these on one GPU); a test skipped without CUDA (its skipif "
                            "reason names CUDA) is marked too")


def needs_cuda(item):
    reasons = [str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")]
    return any("cuda" in r.lower() for r in reasons)


# make test runs the suite on two pytest-xdist workers (`-n 2`): each test file runs whole on one worker (its module
# fixtures start once), and the files that use the session's tiny engines (in-process or the Ray actor) share one
# worker, as do those of the hybrid engine, so no engine starts twice
SHARED_ENGINES = {"tiny_engine": "tiny-engines", "ray_cluster": "tiny-engines", "rollout_engine": "tiny-engines",
                  "hybrid_engine": "hybrid-engine"}


@functools.cache
def worker_group(path):
    """The xdist worker group of a test file: the shared engine its source names (directly, or through a module
    fixture of its own), else the file itself."""
    with open(os.path.join(ROOT, path)) as f:
        words = set(re.findall(r"\w+", f.read()))
    return min((g for name, g in SHARED_ENGINES.items() if name in words), default=path)


# seconds each worker group took under `make test` (two workers, the 2-core machine; the groups of a second or two
# left out): the scheduler below hands out the longest first, so no long group starts when the other worker is
# nearly done. Only the order depends on these: a stale figure costs time, never a test
# (test_cp, test_train, test_lora, test_loss_dist: scaled by what their ranks forked from a forkserver saved when run
# alone, until the next make test measures them)
GROUP_SECONDS = {"tiny-engines": 873, "tests/test_shutdown.py": 328, "tests/test_resume.py": 146, "hybrid-engine": 144,
                 "tests/test_mtp.py": 115, "tests/test_capture_load.py": 114, "tests/test_dry_run.py": 107,
                 "tests/test_loop_vl.py": 92, "tests/test_train.py": 83, "tests/test_cp.py": 77,
                 "tests/test_capture_vl.py": 57, "tests/test_lora.py": 55, "tests/test_model.py": 31,
                 "tests/test_config.py": 15, "tests/test_loss_dist.py": 5}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with worker_group as the scope (its own loadgroup marks change node ids, which
    pytest 9 no longer allows): a scope's tests run on one worker, in order. The scopes go out longest first
    (GROUP_SECONDS; a group not listed counts a second a test), where xdist would order them by test count and
    leave a group of one long test for last."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return worker_group(nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node):
            if not getattr(self, "ordered", False):
                longest_first = sorted(self.workqueue.items(),
                                       key=lambda kv: -GROUP_SECONDS.get(kv[0], len(kv[1])))
                self.workqueue.clear()
                self.workqueue.update(longest_first)
                self.ordered = True
            super()._assign_work_unit(node)
    return ByGroup(config, log)


def pytest_collection_modifyitems(items):
    for item in items:
        if uses_stack_fixture(item):
            item.add_marker(pytest.mark.stack)
        if needs_cuda(item):
            item.add_marker(pytest.mark.gpu)


ENTRY_SCRIPTS = {"train.py", "bench.py", "capture.py", "torchrun.sh", "torchrun"}
RAY_BINARIES = {"gcs_server", "raylet"}  # what ray.init starts first (subprocess.Popen of Ray's own binaries)


class StartsStack(Exception):
    pass


@contextlib.contextmanager
def unit_tier_guard(item):
    """For a test not marked `stack`: refuse to start a process (multiprocessing: rank processes, vLLM's engine core),
    one of our entry scripts, or Ray. Other subprocesses (the sandbox's programs, Triton's interpreter checks) run."""
    import multiprocessing.process
    import subprocess
    if item.get_closest_marker("stack"):
        yield
        return

    def refuse(what):
        raise StartsStack(f"{item.nodeid} starts {what} but is not marked `stack`: mark the test "
                          "(@pytest.mark.stack) or the fixture that starts it (@conftest.starts_stack)")
    real_start, real_popen = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def start(process):
        refuse(f"a process ({process.name}: rank processes or a vLLM engine)")

    def popen(self, args, *a, **kw):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        names = {os.path.basename(str(x)) for x in argv}
        if names & (ENTRY_SCRIPTS | RAY_BINARIES):
            refuse(f"{' '.join(map(str, argv))[:200]}")
        real_popen(self, args, *a, **kw)
    multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__ = start, popen
    try:
        yield
    finally:
        multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__ = real_start, real_popen


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with unit_tier_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with unit_tier_guard(item):
        return (yield)


PHASE_SECONDS = pytest.StashKey[dict]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed `gpu` test's traceback as it fails, not only in pytest's summary: a GPU run
    (make test-gpu: tens of minutes, engines compiling) may be stopped before the summary. Under
    `-m gpu` each test's seconds (set-up, which starts the module's engines, call, teardown) follow
    its name too, so a stopped run still says where its time went."""
    report = yield
    terminal = item.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None or not item.get_closest_marker("gpu"):
        return report
    if report.failed:
        terminal.write_line(f"\n{report.nodeid} failed ({report.when}):\n{report.longreprtext}")
    seconds = item.stash.setdefault(PHASE_SECONDS, {})
    seconds[report.when] = report.duration
    if report.when == "teardown" and "gpu" in (item.config.option.markexpr or ""):
        terminal.write_line(f"  {item.nodeid}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return report


@pytest.fixture(autouse=True)
def no_leaked_rendezvous():
    """Each test starts (after any module fixture that made a process group) with the rendezvous variables the
    session started with; the process group itself stays."""
    reset_rendezvous()
    yield
    reset_rendezvous()


@pytest.fixture(scope="session")
def tiny_model_path():
    """The tiny Qwen3-MoE directory, built once (deterministically) the first time any test needs it."""
    from tiny import ensure_tiny_model
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_vl_model_path():
    """The tiny Qwen3-VL-MoE directory (its tokenizer, chat template and image processor), built once."""
    from tiny import ensure_tiny_model
    return ensure_tiny_model(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache",
                                          "tiny-qwen3-vl-moe"))


class EngineThread:
    """An engine.Engine on an event loop of its own thread (an engine is used from the loop it was started on):
    `run(coro)` runs a coroutine there and returns its result; `serve(server)` starts a CaptureServer on the same
    loop, `stop_serving(server)` stops it."""

    def __init__(self, engine):
        self.engine, self.loop = engine, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tiny-engine", daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def serve(self, server):
        server.loop = self.loop  # what CaptureServer.start_in_thread sets for a loop of its own
        self.run(server.start())
        return server

    def stop_serving(self, server):
        self.run(server.stop())

    def close(self):
        self.run(self.engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture(scope="session")
@starts_stack
def tiny_engine(tiny_model_path):
    """One in-process vLLM engine (engine.Engine, with the weight-sync worker extension) on the tiny model, shared by
    the capture, agent and weight-sync tests. A test that changes its weights or policy version puts them back."""
    from engine import Engine
    on = EngineThread(Engine(tiny_model_path, max_model_len=2048, seed=0))
    on.run(on.engine.start())
    yield on
    on.close()


@pytest.fixture(scope="session")
@starts_stack
def ray_cluster():
    """A local Ray cluster (2 logical CPUs, a small object store), shared by every test that needs Ray."""
    import ray
    import train
    started = not ray.is_initialized()
    if started:
        train.start_local_ray(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def rollout_engine(ray_cluster, tiny_model_path):
    """One vLLM engine actor on the tiny model (rollout.start_engines), shared by the rollout and loop tests.
    Ray restarts it when a test kills it."""
    import rollout
    engines, _ = rollout.start_engines(tiny_model_path, num_engines=1, max_model_len=1024, memory_fraction=0.3,
                                       max_restarts=4)
    return engines[0]


LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]


def build_hf_hybrid(path, seed=0):
    """A tiny Qwen3_5MoeForConditionalGeneration saved by transformers 5.19 with the Qwen3.5 tokenizer and template
    (tiny.py) and Qwen3-VL's image processor: 5 layers in an irregular GDN / full pattern, 6 experts top-2, a shared
    expert, partial rotary 0.25 with interleaved M-RoPE, a 2-block tower. Head dims 64 (vLLM's CPU attention has
    no kernel for 32). Built once."""
    import json
    import torch
    import tiny
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    tmp = f"{path}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    tok = tiny.build_tokenizer(tmp, 2048, vision=True, chat_template=tiny.QWEN35_CHAT_TEMPLATE)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    text = dict(vocab_size=2048, hidden_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
                moe_intermediate_size=96, shared_expert_intermediate_size=160, max_position_embeddings=4096,
                layer_types=LAYER_TYPES, eos_token_id=eos, pad_token_id=pad,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, image_token_id=5, video_token_id=6, vision_start_token_id=3,
        vision_end_token_id=4))  # tiny.VISION_TOKENS' ids
    model.to(torch.bfloat16).save_pretrained(tmp)
    tiny.save_image_processor(tmp, model.config.vision_config)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos, pad], "pad_token_id": pad}, f)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return path


@pytest.fixture(scope="session")
def hf_hybrid_path():
    from tiny import TINY_MODEL_PATH
    return build_hf_hybrid(os.path.join(os.path.dirname(TINY_MODEL_PATH), "hf-qwen3_5-moe-tiny"))


@pytest.fixture(scope="session")
@starts_stack
def hybrid_engine(hf_hybrid_path):
    """One in-process vLLM engine (engine.Engine) on the transformers-written hybrid, shared by the hybrid's engine
    tests. A test that changes its weights puts the checkpoint's back."""
    from engine import Engine
    on = EngineThread(Engine(hf_hybrid_path, max_model_len=2048, memory_fraction=0.3, seed=0))
    on.run(on.engine.start())
    yield on
    on.close()
