"""
The rollout pool, the router and the experience data path: real Ray, a real vLLM engine actor (shared with
test_loop.py), the real capture server and the OpenAI SDK; the agents are small functions whose tools sleep,
raise or hang on cue.

    .venv/bin/python -m pytest tests/test_rollout.py -q
"""
import asyncio
import itertools
import threading
import time

import numpy as np
import pytest
import ray
from openai import AsyncOpenAI

import capture
import rollout

# -----------------------------------------------------------------------------
# a cue-driven agent: one short model turn through the SDK, then a "tool" that behaves as the prompt's label says


def cued_agent(release=None):
    failed_once = set()

    async def agent(ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, **ctx.sampling)
        cue = ctx.label
        if cue == "slow":  # a tool with a long tail: waits until the test lets it go
            while not release.is_set():
                await asyncio.sleep(0.02)
        if cue == "fail_one" and ctx.group_id not in failed_once:
            failed_once.add(ctx.group_id)
            raise ValueError("the tool exploded")
        if cue == "hang":
            await asyncio.sleep(3600)
        return float(reply.usage.completion_tokens % 2)  # some spread within a group
    return agent


def cued_prompts(cues):
    """The given cues first (one per group), then ordinary prompts forever."""
    for i in itertools.count():
        yield {"prompt": f"Count to {i}.", "label": cues[i] if i < len(cues) else "ok"}


@pytest.fixture(scope="module")
def server(rollout_engine, tiny_model_path):
    s = capture.CaptureServer(rollout.Router([rollout_engine]), tiny_model_path, max_model_len=1024)
    s.start_in_thread()
    yield s
    s.stop_thread()


def make_pool(server, agent, cues, **kw):
    options = dict(group_size=2, groups_per_batch=2, groups_in_flight=3, attempt_timeout_s=60.0,
                   failed_group_rule="drop", sampling=dict(temperature=1.0, max_tokens=4))
    options.update(kw)
    return rollout.RolloutPool(agent, cued_prompts(cues), server, **options).start()


def groups_of(records):
    out = {}
    for r in records:
        out.setdefault(r["group_id"], {}).setdefault(r["attempt_id"], []).append(r)
    return out


def as_result(fn):
    from agentrl import as_run_function
    return as_run_function(fn)


def test_an_engine_must_fit_one_node():
    nodes = [{"Alive": True, "Resources": {"GPU": 8.0, "CPU": 96.0}},
             {"Alive": False, "Resources": {"GPU": 16.0}},  # a dead node does not count
             {"Alive": True, "Resources": {"CPU": 8.0}}]
    rollout.check_engine_fits_a_node(8, nodes)
    with pytest.raises(RuntimeError, match=r"tensor_parallel_size=16 needs that many GPUs on one node, but the "
                                           r"largest node of the Ray cluster has 8"):
        rollout.check_engine_fits_a_node(16, nodes)


# -----------------------------------------------------------------------------
# the pool


def test_batch_holds_complete_groups_with_experiences_in_the_object_store(server):
    pool = make_pool(server, as_result(cued_agent()), [], group_size=3, groups_per_batch=2, groups_in_flight=2)
    try:
        records = pool.next_batch(timeout=120)
    finally:
        pool.stop()
    groups = groups_of(records)
    assert len(groups) == 2 and all(len(attempts) == 3 for attempts in groups.values())
    for r in records:
        assert not r["failed"] and r["error"] is None and r["segment_index"] == 0
        exp = ray.get(r["ref"])
        ids, mask = exp["token_ids"], exp["action_mask"]
        assert ids.dtype == np.int32 and len(ids) == r["num_tokens"] == len(mask) == len(exp["behavior_logprobs"])
        assert int(mask.sum()) == r["action_tokens"] >= 1 and mask[-1] == 1  # the turn ends the segment
        assert (exp["behavior_logprobs"][mask == 1] <= 0).all() and (exp["behavior_logprobs"][mask == 0] == 0).all()
        versions = exp["token_versions"]
        assert (versions[mask == 0] == -1).all() and (versions[mask == 1] == r["min_version"]).all()
        assert r["reward"] == r["action_tokens"] % 2  # the cued agent's reward: its own turn's length, odd or even


def test_a_slow_attempt_delays_only_its_own_group(server):
    release = threading.Event()
    pool = make_pool(server, as_result(cued_agent(release)), ["slow"], group_size=2, groups_per_batch=1,
                     groups_in_flight=3)
    try:
        early = [pool.next_batch(timeout=120) for _ in range(3)]  # while group 0 waits on its tool
        stats = pool.stats(reset=False)
        assert stats["open_groups"] <= 3  # the in-flight budget holds while one group lags
        assert all(0 not in groups_of(batch) for batch in early)
        release.set()
        later = [pool.next_batch(timeout=120) for _ in range(3)]
    finally:
        release.set()
        pool.stop()
    assert any(0 in groups_of(batch) for batch in later)


@pytest.mark.parametrize("rule", ["drop", "complete"])
def test_failed_attempt_follows_the_group_rule(server, rule):
    pool = make_pool(server, as_result(cued_agent()), ["fail_one"], failed_group_rule=rule)
    try:
        batches = []
        while len(batches) < 20:  # groups finish in any order: read until group 0 is settled
            batches.append(pool.next_batch(timeout=120))
            stats = pool.stats(reset=False)
            if stats["dropped_groups"] or any(0 in groups_of(b) for b in batches):
                break
    finally:
        pool.stop()
    records = [r for b in batches for r in b]
    groups = groups_of(records)
    assert stats["failed_attempts"] == 1
    if rule == "drop":
        assert 0 not in groups and stats["dropped_groups"] == 1 and not any(r["failed"] for r in records)
    else:
        failed = [r for r in records if r["failed"]]
        assert 0 in groups and len(groups[0]) == 2 and stats["dropped_groups"] == 0
        assert len(failed) == 1 and failed[0]["group_id"] == 0 and failed[0]["reward"] == 0.0
        assert "ValueError: the tool exploded" in failed[0]["error"]
        assert failed[0]["action_tokens"] > 0  # its turn before the failure is kept, with reward 0


@pytest.mark.parametrize("rule", ["drop", "complete"])
def test_attempts_failing_in_a_row_stop_the_pool_with_the_error(server, rule):
    async def broken(ctx):  # an agent bug: every attempt fails before its first model call
        raise KeyError("tool_registry")
    pool = make_pool(server, as_result(broken), [], failed_group_rule=rule, max_failed_in_a_row=5)
    try:
        with pytest.raises(RuntimeError, match=r"attempts in a row failed .*KeyError: 'tool_registry'"):
            for _ in range(20):  # "complete" fills a few batches with failures before the streak is long enough
                pool.next_batch(timeout=120)
        stats = pool.stats()
    finally:
        pool.stop()
    assert stats["failed_attempts"] >= 5 and stats["attempts"] == stats["failed_attempts"]


def test_failures_while_an_engine_is_down_do_not_stop_the_pool(server):
    async def broken(ctx):
        raise KeyError("tool_registry")
    router = server.backend
    router.up[0] = False  # as when a request found the engine dead: the router is restarting it
    pool = make_pool(server, as_result(broken), [], failed_group_rule="drop", max_failed_in_a_row=5)
    try:
        deadline = time.monotonic() + 60
        while pool.stats(reset=False)["failed_attempts"] < 15 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.stats(reset=False)["failed_attempts"] >= 15 and pool._crash is None
        router.up[0] = True  # the engine is back: the same failures now count
        with pytest.raises(RuntimeError, match="5 attempts in a row failed"):
            pool.next_batch(timeout=120)
    finally:
        router.up[0] = True
        pool.stop()


def test_hanging_tool_times_out_and_the_pool_goes_on(server):
    # 5 s: an ordinary attempt (one 4-token turn) takes well under it, also on a loaded machine
    pool = make_pool(server, as_result(cued_agent()), ["hang"], attempt_timeout_s=5.0,
                     failed_group_rule="complete")
    try:
        batches, deadline = [pool.next_batch(timeout=120)], time.monotonic() + 120
        while 0 not in groups_of(batches[-1]) and time.monotonic() < deadline:  # others go past
            batches.append(pool.next_batch(timeout=120))
        stats = pool.stats()
    finally:
        pool.stop()
    hung = [r for r in batches[-1] if r["group_id"] == 0]
    assert len(groups_of(hung)[0]) == 2 and all(r["failed"] and r["reward"] == 0.0 for r in hung)
    assert all("timed out after 5.0s" in r["error"] for r in hung)
    # every failure was a time-out; the hung two at least (an ordinary attempt slowed past 5 s by a
    # loaded machine would be one more, which an exact count made a flaky failure)
    assert stats["timed_out_attempts"] == stats["failed_attempts"] >= 2


def test_agent_without_model_calls_still_counts_in_its_group(server):
    async def no_model(ctx):
        return 1.0 if ctx.label == "ok" else 0.0
    pool = make_pool(server, as_result(no_model), [], groups_in_flight=2)
    try:
        records = pool.next_batch(timeout=60)
    finally:
        pool.stop()
    assert len(records) == 4 and all(r["ref"] is None and r["num_tokens"] == 0 and r["reward"] == 1.0 for r in records)


# -----------------------------------------------------------------------------
# the router (fake engines: this is the routing logic alone) and batch sharding


class FakeEngine:
    """Stands in for an engine actor handle: `.generate.remote(...)` awaits a gate; `.started.remote()`."""

    class Method:
        def __init__(self, fn):
            self.remote = fn

    def __init__(self, name):
        self.name, self.gate, self.dead, self.is_started, self.starts = name, None, False, True, 0
        self.generate = self.Method(self._generate)
        self.started = self.Method(self._started)
        self.start = self.Method(self._start)

    async def _generate(self, prompt, sampling, request_id):
        if self.dead:
            raise ray.exceptions.ActorDiedError()
        if self.gate is not None:
            await self.gate.wait()
        return {"engine": self.name}

    async def _started(self):
        if self.dead:
            raise ray.exceptions.ActorDiedError()
        return self.is_started

    async def _start(self):
        self.is_started, self.starts = True, self.starts + 1


async def until(predicate):
    """Let the event loop run until predicate() holds (the requests it waits for are in flight)."""
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def test_router_keeps_sessions_sticky_and_balances_new_ones():
    async def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        router = rollout.Router([a, b])
        a.gate = asyncio.Event()  # requests on a stay in flight until the gate opens
        turn1 = asyncio.ensure_future(router.generate([1], {}, "r0", session_id="s0"))
        await until(lambda: sum(router.in_flight) == 1)
        held_from, loads = time.monotonic(), [router.in_flight[:]]
        other = await router.generate([1], {}, "r1", session_id="s1")  # a new session: the idle engine
        turn2 = asyncio.ensure_future(router.generate([1, 2], {}, "r2", session_id="s0"))  # sticky, though busier
        await until(lambda: sum(router.in_flight) == 2)
        loads.append(router.in_flight[:])
        held = time.monotonic() - held_from
        a.gate.set()
        return loads, other["engine"], (await turn1)["engine"], (await turn2)["engine"], router, held
    loads, other, turn1, turn2, router, held = asyncio.run(scenario())
    assert loads == [[1, 0], [2, 0]] and other == "b" and turn1 == turn2 == "a"
    # the idle clock: engine a was busy at least while the test held its gate, b for one quick request
    assert router.in_flight == [0, 0] and router.busy_s[0] >= held > router.busy_s[1] > 0
    assert router.idle_fraction() < 1.0


def test_router_revives_a_dead_engine_and_routes_around_it_meanwhile():
    async def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        router = rollout.Router([a, b])
        router.sessions["s"] = 0
        a.dead = True
        with pytest.raises(ray.exceptions.RayActorError):
            await router.generate([1], {}, "r0", session_id="s")
        assert router.up == [False, True] and router.failed_requests == 1
        moved = await router.generate([1], {}, "r1", session_id="s")  # the session moves on
        live, changed = router.live_engines()
        router.mark_connected(live)  # the driver re-forms the weight group without the dead engine
        a.dead, a.is_started = False, False  # Ray restarted the actor: a fresh, unstarted engine
        for _ in range(300):
            if router.up[0]:
                break
            await asyncio.sleep(0.01)
        live_after, changed_after = router.live_engines()
        return moved["engine"], live, changed, router, a.starts, live_after, changed_after
    moved, live, changed, router, starts, live_after, changed_after = asyncio.run(scenario())
    assert moved == "b" and len(live) == 1 and changed
    assert router.up == [True, True] and router.restarts == 1 and starts == 1
    assert len(live_after) == 2 and changed_after  # it must rejoin the weight group before the next sync


def test_balance_by_tokens_assigns_every_record_once_and_evenly():
    records = [dict(num_tokens=n, attempt_id=str(i)) for i, n in enumerate([900, 50, 400, 400, 300, 120, 80, 10])]
    shards = rollout.balance_by_tokens(records, 3)
    assert sorted(r["attempt_id"] for s in shards for r in s) == sorted(r["attempt_id"] for r in records)
    # largest first onto the lightest rank: 900 | 400 + 300 | 400 + 120 + 80 + 50 + 10; the largest record alone
    # outweighs a third of the total (2260 / 3), so 900 is the best any split can do
    assert [[r["attempt_id"] for r in s] for s in shards] == [["0"], ["2", "4"], ["3", "5", "6", "1", "7"]]
    assert [sum(r["num_tokens"] for r in s) for s in shards] == [900, 700, 660]
    assert rollout.balance_by_tokens(records[:1], 2)[1] == []


def test_a_finite_prompt_source_ends_in_an_error_not_a_hang(server):
    async def no_model(ctx):
        return 0.0
    pool = rollout.RolloutPool(as_result(no_model), iter([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]), server,
                               group_size=2, groups_per_batch=2, groups_in_flight=2, sampling={},
                               attempt_timeout_s=60.0, failed_group_rule="drop").start()
    try:
        assert len(groups_of(pool.next_batch(timeout=60))) == 2
        with pytest.raises(EOFError, match="prompt source ran out with 1 complete group"):
            pool.next_batch(timeout=60)
    finally:
        pool.stop()
