"""
Rollout: vLLM engines as Ray actors, a router in front of them, the capture
server in front of the router, and the streaming pool of agent attempts that
turns finished groups into batches of experiences in the Ray object store.

    .venv/bin/python -m pytest tests/test_rollout.py -q     # pool logic, router, failures, timeouts, restarts
    .venv/bin/python bench.py async                         # streaming pool vs synchronous generate-then-train

    agent code --SDK--> capture server --router--> engine actors (AsyncLLM)
    pool: groups_in_flight prompt groups at once; a finished group waits in `ready`; next_batch() takes
          groups_per_batch of them (never waiting for attempts of other groups) and frees their slots.

An attempt's segments are put in the object store by this process (the one
that recorded them, on the rollout node); a batch is a list of light records
(ref + attempt_id, group_id, reward, token counts, versions) that the driver
splits across trainer ranks by tokens; each rank `ray.get`s its own refs.
"""
import asyncio
import contextlib
import itertools
import json
import math
import os
import threading
import time
import traceback
from collections import Counter, OrderedDict

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine import OPTIONS, Engine, EngineNotStarted
from agentrl import Context

ROOT = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# engines: Ray actors of engine.Engine, each on its own placement-group bundle


class EngineActor(Engine):
    """engine.Engine as a Ray actor; started() tells a restarted
    actor (a fresh, unstarted Engine) from a live one."""

    async def started(self):
        return self.llm is not None


def trainer_gpus(ray, world):
    """{ray node id: GPUs used by trainer ranks there},
    gathered from every rank (a collective); {} on CPU."""
    if not torch.cuda.is_available():
        return {}
    nodes = [None] * world
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    return {n: nodes.count(n) for n in set(nodes)}


def reserve_trainer_gpus(gpus_per_node):
    """Reserve the GPUs that torchrun's trainer ranks use, {ray node id: n}, so
    that no engine lands on them (the ranks are not Ray workers, so Ray does
    not know they hold GPUs). Returns the placement group (keep it alive)."""
    if not gpus_per_node:
        return None
    pg = placement_group([{"GPU": n} for n in gpus_per_node.values()], strategy="PACK",
                         bundle_label_selector=[{"ray.io/node-id": node} for node in gpus_per_node])
    ray.get(pg.ready(), timeout=120)
    return pg


def check_engine_gpus(engines, gpus_per_node):
    """Fail if an engine got a GPU that a trainer rank uses: trainer rank i of a
    node drives GPU i there (LOCAL_RANK, CUDA_VISIBLE_DEVICES unset), which Ray
    cannot see; reserve_trainer_gpus makes this unlikely, this makes it loud."""
    if not gpus_per_node:
        return
    placed = ray.get([e.__ray_call__.remote(
        lambda _: (ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()))
                      for e in engines])
    for i, (node, gpu_ids) in enumerate(placed):
        if clash := {int(g) for g in gpu_ids} & set(range(gpus_per_node.get(node, 0))):
            raise RuntimeError(
                f"rollout engine {i} was given GPU(s) {sorted(clash)} of node {node}, which "
                "trainer ranks use: start the trainer on the lowest GPUs of its nodes, or keep "
                "engines on "
                "nodes of their own (torchrun.sh ROLLOUT_NODE=1)")


def check_engine_fits_a_node(tensor_parallel_size, nodes):
    """An engine's tensor-parallel GPUs are one placement bundle, so one node must have
    that many; else Ray would wait forever to place it. `nodes` is ray.nodes()."""
    most = max((n["Resources"].get("GPU", 0) for n in nodes if n.get("Alive")), default=0)
    if tensor_parallel_size > most:
        raise RuntimeError(f"tensor_parallel_size={tensor_parallel_size} needs that many GPUs on "
                           f"one node, but the largest node of the Ray cluster has {int(most)}: "
                           "engines spanning nodes are not "
                           "supported; lower tensor_parallel_size")


def start_engines(model_path, num_engines=1, tensor_parallel_size=OPTIONS["tensor_parallel_size"],
                  *, max_restarts=3, ready_timeout_s=600, seed=0, **engine_kwargs):
    """Start `num_engines` engine.Engine actors (one vLLM AsyncLLM each, sampling seed seed + i)
    and wait until they serve, at weight version 0. On GPU each engine gets tensor_parallel_size
    GPUs of one node; on CPU one logical CPU. Ray restarts a killed engine up to max_restarts
    times (the Router starts it again). Returns (engines, placement group)."""
    on_gpu = ray.cluster_resources().get("GPU", 0) > 0
    if on_gpu:
        check_engine_fits_a_node(tensor_parallel_size, ray.nodes())
    bundle = {"CPU": 1, "GPU": tensor_parallel_size} if on_gpu else {"CPU": 1}
    pg = placement_group([bundle] * num_engines, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the cluster cannot place {num_engines} engine(s) of {bundle} next to "
                           f"the trainer: free resources {ray.available_resources()}; lower "
                           "num_engines or "
                           "tensor_parallel_size")
    # vLLM's processes import engine and weights_sync (the classes
    # named in the engine arguments): give them this directory
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.update({k: v for k, v in os.environ.items() if k.startswith("VLLM_")
                or k == "TOKENIZERS_PARALLELISM"})
    actor = ray.remote(EngineActor)
    engines = [actor.options(num_cpus=1, num_gpus=bundle.get("GPU", 0), max_restarts=max_restarts,
                             max_task_retries=0, max_concurrency=100_000,
                             runtime_env={"env_vars": env},
                             scheduling_strategy=PlacementGroupSchedulingStrategy(
                                 pg, placement_group_bundle_index=i))
               .remote(model_path, tensor_parallel_size=tensor_parallel_size, seed=seed + i,
                       **engine_kwargs)
               for i in range(num_engines)]
    # each starts at weight version 0
    ray.get([e.start.remote() for e in engines], timeout=ready_timeout_s)
    return engines, pg


def images_kwarg(images):
    """A prompt's images as the engine's keyword argument,
    only when there are some (text-only backends lack it)."""
    return {"images": images} if images else {}


class Router:
    """The capture server's backend over engine actors: a session (one attempt) stays on one
    engine while that engine lives, so its growing prompt hits the prefix cache; a new session
    goes to the engine with the fewest requests in flight. A request on an engine that dies fails
    (its attempt fails); the engine is started again when Ray has restarted the actor, at weight
    version 0 (the base weights: its tokens count as stale until the next weight sync reaches it).
    With no engine up, requests wait for one (wait_for_engine_s) instead of failing at once."""
    wait_for_engine_s = 600.0

    def __init__(self, engines, max_sessions=100_000):
        self.engines = list(engines)
        self.up = [True] * len(self.engines)
        # False after a restart until the driver reconnects it
        self.in_weight_group = [True] * len(self.engines)
        self.in_flight = [0] * len(self.engines)
        self.sessions = OrderedDict()  # session id -> engine index, least recently used first
        self.max_sessions = max_sessions
        self.restarts = self.failed_requests = 0
        self._reviving = set()
        self._lock = threading.Lock()  # the driver thread reads what the
                                       # capture server's loop writes
        self.reset_idle_clock()  # busy_s: time with >= 1 request in flight, per engine

    def pick(self, session_id=None):
        with self._lock:
            i = self.sessions.get(session_id) if session_id is not None else None
            if i is None or not self.up[i]:
                up = [j for j in range(len(self.engines)) if self.up[j]]
                if not up:
                    return None
                i = min(up, key=lambda j: self.in_flight[j])
            if session_id is not None:
                self.sessions[session_id] = i
                self.sessions.move_to_end(session_id)
                while len(self.sessions) > self.max_sessions:
                    self.sessions.popitem(last=False)
            return i

    async def generate(self, prompt_token_ids, sampling, request_id, session_id=None, images=None):
        async with self.serving(session_id) as engine:
            ref = engine.generate.remote(prompt_token_ids, sampling, request_id,
                                         **images_kwarg(images))
            try:
                return await ref
            except asyncio.CancelledError:  # the client went away: the actor's
                                            # coroutine is cancelled, vLLM aborts
                ray.cancel(ref)
                raise

    async def stream(self, prompt_token_ids, sampling, request_id, session_id=None, images=None):
        """generate's turn while it is sampled
        (engine.Engine.stream), through a Ray streaming generator."""
        async with self.serving(session_id) as engine:
            turn = engine.stream.options(num_returns="streaming").remote(
                prompt_token_ids, sampling, request_id,
                **images_kwarg(images))
            try:
                async for ref in turn:
                    yield await ref
            # the client went away: the engine aborts the turn
            except (asyncio.CancelledError, GeneratorExit):
                ray.cancel(turn)
                raise

    @contextlib.asynccontextmanager
    async def serving(self, session_id):
        """The session's engine for one request, once one
        is up; a request on an engine that dies fails."""
        deadline = time.monotonic() + self.wait_for_engine_s
        while (i := self.pick(session_id)) is None:  # every engine is restarting
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no rollout engine came back within {self.wait_for_engine_s:.0f}s")
            await asyncio.sleep(0.5)
        with self._lock:  # busy from the first request in flight to the last (idle_fraction)
            if self.in_flight[i] == 0:
                self._busy_since[i] = time.monotonic()
            self.in_flight[i] += 1
        try:
            yield self.engines[i]
        except (RayActorError, EngineNotStarted):  # dead, or restarted unstarted
            with self._lock:
                self.failed_requests += 1
            self.revive(i)
            raise
        finally:
            with self._lock:
                self.in_flight[i] -= 1
                if self.in_flight[i] == 0 and self._busy_since[i] is not None:
                    self.busy_s[i] += time.monotonic() - self._busy_since[i]
                    self._busy_since[i] = None

    def forget(self, session_id):
        with self._lock:
            self.sessions.pop(session_id, None)

    def revive(self, i):
        """Start engine i again once Ray has restarted its actor (a task on the running loop)."""
        with self._lock:
            if i in self._reviving:
                return
            self._reviving.add(i)
            self.up[i] = False  # the weight group still holds its
                                # dead workers: live_engines() says so
        asyncio.get_running_loop().create_task(self._revive(i))

    async def _revive(self, i, give_up_after_s=900.0):
        deadline = time.monotonic() + give_up_after_s
        try:
            while time.monotonic() < deadline:
                try:
                    # Ray queues this until the actor is back; a restarted actor is
                    # a fresh Engine, not started. start() loads the base weights
                    # at version 0 (an actor that only lost contact keeps its own)
                    if not await self.engines[i].started.remote():
                        await self.engines[i].start.remote()
                    with self._lock:
                        # a fresh process: not in the group
                        self.up[i], self.in_weight_group[i] = True, False
                        self.restarts += 1
                    return
                except RayActorError:  # not restarted yet, or died again
                    await asyncio.sleep(1.0)
            print(f"rollout engine {i} did not come back within {give_up_after_s:.0f}s "
                  "(max_restarts spent?)")
        finally:
            with self._lock:
                self._reviving.discard(i)

    def engines_down(self):
        """Whether an engine is dead or restarting now (attempts
        that fail meanwhile are the engine's failures)."""
        with self._lock:
            return not all(self.up)

    def live_engines(self):
        """Engines up now, and whether that set differs from
        the one in the weight group (reconnect first)."""
        with self._lock:
            live = [e for e, up in zip(self.engines, self.up) if up]
            return live, any(up != joined for up, joined in zip(self.up, self.in_weight_group))

    def mark_connected(self, live):
        with self._lock:
            self.in_weight_group = [e in live for e in self.engines]

    def idle_fraction(self):
        """Fraction of wall time since creation (or the last
        reset) that engines had no request in flight."""
        with self._lock:
            now = time.monotonic()
            busy = [b + (now - s if s is not None else 0.0) for b,
                    s in zip(self.busy_s, self._busy_since)]
            return 1.0 - sum(busy) / (len(busy) * max(now - self._created, 1e-9))

    def reset_idle_clock(self):
        with self._lock:
            now = time.monotonic()
            self._created, self.busy_s = now, [0.0] * len(self.engines)
            self._busy_since = [now if n else None for n in self.in_flight]

# -----------------------------------------------------------------------------
# experiences: one per segment, in this process's (the rollout node's) object store


# a segment's arrays in the object store and their types: (T,) each but routed_experts (T, L_moe, K)
# and image_grid_thw (I, 3); the last three only some segments have (None where a segment has not)
SEGMENT_ARRAYS = {"token_ids": np.int32, "action_mask": np.int8, "behavior_logprobs": np.float32,
                  "token_versions": np.int32, "routed_experts": np.int16,
                  "teacher_logprobs": np.float32, "image_grid_thw": np.int64}


def put_experience(segment, reward, group_id, failed=False, error=None):
    """ray.put a recorded segment's per-token arrays;
    return the light record that travels on the queue."""
    arrays = {k: None if segment.get(k) is None else np.asarray(segment[k], dtype=dtype)
              for k, dtype in SEGMENT_ARRAYS.items()}
    if arrays["image_grid_thw"] is not None:
        arrays["image_grid_thw"] = arrays["image_grid_thw"].reshape(-1, 3)
    # the encoded image files and their grids stay with the tokens: only the trainer
    # rank that gets this segment fetches and patches them (vl.with_pixels);
    # `opened`: why this segment began (capture.CaptureServer.opening)
    arrays.update(attempt_id=segment["attempt_id"], segment_index=segment["segment_index"],
                  opened=segment.get("opened"), images=list(segment.get("images") or []),
                  parent=segment.get("parent"), started=segment.get("started"))  # its tree
    mask, versions = arrays["action_mask"], arrays["token_versions"]
    generated = versions[mask == 1]
    return dict(ref=ray.put(arrays), attempt_id=segment["attempt_id"],
                segment_index=segment["segment_index"],
                group_id=group_id, reward=float(reward), num_tokens=len(mask),
                action_tokens=int(mask.sum()), num_images=len(arrays["images"]),
                min_version=int(generated.min()) if generated.size else -1,
                max_version=int(generated.max()) if generated.size else -1, failed=failed,
                error=error)


def balance_by_tokens(records, world):
    """Split records over `world` ranks, greedily by token
    count (largest first onto the lightest rank)."""
    shards, loads = [[] for _ in range(world)], [0] * world
    for r in sorted(records, key=lambda r: -r["num_tokens"]):
        i = loads.index(min(loads))
        shards[i].append(r)
        loads[i] += r["num_tokens"]
    return shards

# -----------------------------------------------------------------------------
# the streaming pool


class RolloutPool:
    """Keeps `groups_in_flight` prompt groups going (a group: `group_size` attempts of
    one prompt). A group is in flight from its start until the trainer takes it in a
    batch, so groups_in_flight bounds how far the rollouts run ahead of the trainer
    (the staleness budget). `next_batch()` returns as soon as `groups_per_batch` groups
    are complete, in completion order: a slow attempt delays only its own group.

    An attempt that raises or runs past attempt_timeout_s is failed, with its error;
    failed_group_rule "drop" drops its group (a fresh group takes the slot), "complete"
    keeps the group with reward 0 for the failed attempt (and its partial segments). When
    max_failed_in_a_row attempts fail one after another (a bug in the agent, a dead tool;
    failures while an engine restarts do not count) the pool stops and next_batch raises
    with the last error, rather than dropping groups forever or training on failures (0:
    never). `run_agent(ctx) -> Result` is the loaded agent; `prompts` an iterator of dicts
    (prompt / messages, label, tools); `server` the running capture server. The options
    are the config keys of the same names, which plan.check_config has checked."""

    def __init__(self, run_agent, prompts, server, *, group_size, groups_per_batch,
                 groups_in_flight, sampling, attempt_timeout_s, failed_group_rule,
                 model_name="policy", trajectory_writer=None, first_prompt=0,
                 max_failed_in_a_row=0):
        # a resumed run skips the prompts its earlier life
        # drew (those in flight at the stop are not retried)
        self.run_agent, self.server = run_agent, server
        self.prompts = itertools.islice(iter(prompts), first_prompt, None)
        self.group_size, self.groups_per_batch, self.groups_in_flight = group_size, groups_per_batch, groups_in_flight
        self.sampling, self.attempt_timeout_s, self.failed_group_rule = dict(sampling), attempt_timeout_s, failed_group_rule
        self.model_name, self.trajectory_writer = model_name, trajectory_writer
        self.ready = []  # complete groups waiting for the trainer: lists of attempt dicts
        self.open_groups = 0  # started and not yet taken by the trainer
        self.held = False  # next_batch(hold=True) until resume(): no new groups
        self.prompts_drawn = first_prompt  # the data position a checkpoint
                                           # records; also the next group id
        self.counters = Counter(attempts=0, failed_attempts=0, timed_out_attempts=0,
                                dropped_groups=0, generated_tokens=0, reward_sum=0.0)
        self.errors = []  # the last few failures, for the log
        self.max_failed_in_a_row, self.failed_in_a_row = max_failed_in_a_row, 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-pool",
                                        daemon=True)
        # _changed: an asyncio.Event on the pool loop (a group
        # finished or a batch was taken); _crash: why it stopped
        self._changed = self._main_task = self._crash = None
        self._exhausted = False

    # the pool runs on its own event loop in a background thread: agent code (which may block)
    # never stalls the capture server's loop, and the driver thread blocks only in next_batch()
    def start(self):
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self

    async def _start(self):
        self._changed = asyncio.Event()
        self._main_task = asyncio.get_running_loop().create_task(self._main())

    def stop(self):
        if not self._thread.is_alive():
            return
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def next_batch(self, timeout=None, hold=False):
        """Block until groups_per_batch complete groups exist; return them as a
        flat list of segment records (each attempt's segments share its attempt_id,
        group_id and reward). hold=True starts no new group until resume(): a
        synchronous generate-then-train loop (the baseline of `bench.py async`)."""
        return asyncio.run_coroutine_threadsafe(self._take_batch(hold), self._loop).result(timeout)

    def resume(self):
        async def go():
            self.held = False
            self._changed.set()
        asyncio.run_coroutine_threadsafe(go(), self._loop).result()

    def stats(self, reset=True):
        """Counters since the last reset: attempts, failures,
        timeouts, dropped groups, generated tokens, reward."""
        async def read():
            out = dict(self.counters, open_groups=self.open_groups, ready_groups=len(self.ready))
            if reset:
                self.counters = Counter(
                    {k: 0 if isinstance(v, int) else 0.0 for k, v in self.counters.items()})
            return out
        return asyncio.run_coroutine_threadsafe(read(), self._loop).result()

    async def _take_batch(self, hold=False):
        while self._crash is not None or len(self.ready) < self.groups_per_batch:
            if self._crash is not None:
                raise RuntimeError(f"the rollout pool stopped: {self._crash}") from self._crash
            # nothing running, nothing to come
            if self._exhausted and self.open_groups == len(self.ready):
                raise EOFError(
                    f"the prompt source ran out with {len(self.ready)} complete group(s) left, "
                    f"fewer than groups_per_batch={self.groups_per_batch}: let prompts() yield "
                    "forever, or use a "
                    "prompts file (read in epochs)")
            self._changed.clear()
            await self._changed.wait()
        groups, self.ready = self.ready[:self.groups_per_batch], self.ready[self.groups_per_batch:]
        self.open_groups -= len(groups)
        self.held = hold
        self._changed.set()  # slots are free: start new groups
        return [seg for group in groups for attempt in group for seg in attempt["segments"]]

    async def _main(self):
        try:
            while True:
                while self.open_groups < self.groups_in_flight and not self.held:
                    item = next(self.prompts)
                    self.open_groups += 1
                    asyncio.get_running_loop().create_task(
                        self._run_group(self.prompts_drawn, item))
                    self.prompts_drawn += 1
                self._changed.clear()
                await self._changed.wait()
        except StopIteration:  # the data source is exhausted: the groups in flight still finish
            self._exhausted = True
            self._changed.set()
        except BaseException as e:
            self._crash = e
            self._changed.set()
            raise

    async def _run_group(self, group_id, item):
        attempts = await asyncio.gather(
            *(self._run_attempt(group_id, item) for _ in range(self.group_size)))
        if any(a["failed"] for a in attempts) and self.failed_group_rule == "drop":
            self.counters["dropped_groups"] += 1
            self.open_groups -= 1
        else:
            self.ready.append(attempts)
        self._changed.set()

    async def _run_attempt(self, group_id, item):
        played = await self._play(group_id, item, self.sampling)
        reward, failed, error, segments = played["reward"], played["failed"], played["error"], played["segments"]
        teacher = played["info"].get("teacher_logprobs")  # on-policy distillation:
                                                          # one list per segment
        # the numbers the agent reports (Result.info) are logged per step, averaged over attempts
        info = {k: float(v) for k, v in played["info"].items() if isinstance(v, (int, float))
                and math.isfinite(v)}
        if teacher is not None:
            if len(teacher) != len(segments):
                failed, error = True, f"the agent gave teacher_logprobs for {len(teacher)} of {len(segments)} segments"
            for s in segments:
                s["teacher_logprobs"] = None if failed else teacher[s["segment_index"]]
        self.counters.update(attempts=1, failed_attempts=failed,
                             timed_out_attempts=played["timed_out"],
                             reward_sum=reward)  # Counter.update adds
        if failed:
            self.errors = (self.errors + [error])[-20:]
        # a failure while an engine is down is the engine's (the
        # router restarts it), not a sign of a broken agent
        engine_down = getattr(self.server.backend, "engines_down", lambda: False)()
        self.failed_in_a_row = 0 if not failed else self.failed_in_a_row + (not engine_down)
        if self.max_failed_in_a_row and self.failed_in_a_row >= self.max_failed_in_a_row and self._crash is None:
            self._crash = RuntimeError(
                f"{self.failed_in_a_row} attempts in a row failed (max_failed_in_a_row); "
                f"the last: {error}")
            self.held = True  # start nothing more
            self._changed.set()
        if self.trajectory_writer is not None and segments:
            self.trajectory_writer(segments)
        records = [dict(put_experience(seg, reward, group_id, failed, error), info=info)
                   for seg in segments]
        if not records:  # an attempt that never reached the model
                         # still counts in its group's statistics
            records = [dict(ref=None, attempt_id=played["attempt_id"], segment_index=-1,
                            group_id=group_id, reward=reward, num_tokens=0, action_tokens=0,
                            min_version=-1, max_version=-1, failed=failed, error=error, info=info)]
        self.counters["generated_tokens"] += sum(r["action_tokens"] for r in records)
        return dict(attempt_id=played["attempt_id"], reward=reward, failed=failed, error=error,
                    segments=records)

    async def _play(self, group_id, item, sampling):
        """One attempt of the agent on `item` with `sampling`, on its own
        capture session (sealed and dropped at the end). Returns its attempt_id,
        reward, info, failed, timed_out, error and recorded segments."""
        session = self.server.new_session()  # its id is the attempt id
        prompt = item.get("prompt")
        messages = item.get("messages") or ([{"role": "user", "content": prompt}]
                                            if prompt is not None else [])
        ctx = Context(base_url=session.base_url, api_key=session.api_key, model=self.model_name,
                      prompt=prompt, messages=[dict(m) for m in messages], tools=item.get("tools"),
                      label=item.get("label"), sampling=dict(sampling),
                      attempt_id=session.attempt_id, group_id=group_id)
        reward, info, failed, timed_out, error = 0.0, {}, False, False, None
        try:
            result = await asyncio.wait_for(self.run_agent(ctx), self.attempt_timeout_s)
            reward, info = result.reward, result.info
        except asyncio.TimeoutError:
            failed, timed_out, error = True, True, f"attempt timed out after {self.attempt_timeout_s}s"
        except Exception as e:  # the agent's own error, or an engine's: recorded, the run goes on
            failed, error = True, f"{type(e).__name__}: {e}"
            traceback.clear_frames(e.__traceback__)
        # sealed: a request of this attempt still generating is refused when it lands
        segments = [dict(s, group_id=group_id, failed=failed, error=error)
                    for s in self.server.finish_session(session.id, reward)]
        self.server.drop_session(session.id)  # and the router forgets its engine
        return dict(attempt_id=session.attempt_id, reward=reward, info=info, failed=failed,
                    timed_out=timed_out, error=error, segments=segments)

    def evaluate(self, items, sampling, results_path=None, policy_version=None, timeout=None):
        """One attempt per item with `sampling` (evaluation: greedy), through the same agent,
        capture server and engines as training, beside the training attempts (which go on
        meanwhile). Nothing of these attempts is put in the object store or counted: they never
        reach the trainer. Each item's result is appended to results_path as a JSON line: reward,
        success (the agent's Result.info["success"], else its reward), failed, error, generated
        tokens, the policy versions that generated them and the decoded segments. Returns the means:
        eval/success, eval/reward, eval/generated_tokens, and the seconds it took (eval_s)."""
        t0 = time.perf_counter()

        async def one(item):
            played = await self._play(-1, item, sampling)
            versions = [v for s in played["segments"] for m,
                        v in zip(s["action_mask"], s["token_versions"]) if m]
            return dict(policy_version=policy_version,
                        prompt=item.get("prompt", item.get("messages")), label=item.get("label"),
                        reward=played["reward"],
                        success=float(played["info"].get("success", played["reward"])),
                        failed=played["failed"], error=played["error"],
                        generated_tokens=len(versions), policy_versions=sorted(set(versions)),
                        text=[self.server.tokenizer.decode(s["token_ids"])
                              for s in played["segments"]])

        async def run():
            return await asyncio.gather(*(one(item) for item in items))
        results = asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)
        if results_path is not None:
            with open(results_path, "a") as f:
                f.writelines(json.dumps(r, default=str) + "\n" for r in results)
        return {**{f"eval/{k}": sum(r[k] for r in results) / max(len(results), 1)
                   for k in ("success", "reward", "generated_tokens")},
                   "eval_s": time.perf_counter() - t0}
