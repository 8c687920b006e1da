"""
The whole loop on the tiny default: the calculator agent through the OpenAI SDK -> capture server -> router -> a
real vLLM engine actor -> experiences in the Ray object store -> the FSDP2 trainer (gloo, one rank) -> weight sync.
Then resuming from the checkpoint, an off-policy run that drops stale tokens, held-out evaluation in the loop (never
trained on), a run that survives a failing agent, a hanging tool and a killed engine, and one
whose steps are all skipped (with TensorBoard scalars). The engine is shared with test_rollout.py
(tests/conftest.py).

    .venv/bin/python -m pytest tests/test_loop.py -q
"""
import itertools
import json
import os
import sys
import threading
import time

import pytest
import ray

import runlog
import checkpoint
import train

METRIC_KEYS = {"step", "reward_mean", "policy_version", "mismatch_kl", "mismatch_kl_current", "stale_dropped",
               "failed_attempts", "tokens_per_s", "step_time_s", "is_masked_frac", "dual_clip_frac", "advantage_mean",
               "advantage_std", "advantage_min", "advantage_max", "grad_norm", "skipped"}


class RecordingEngine:
    """An engine actor handle that also keeps what each generate() call sent and got back, per session (the
    capture server's request id is "<session id>-<turn>"). Every other method goes to the actor as is."""

    def __init__(self, actor):
        self.actor, self.calls = actor, {}

    def __getattr__(self, name):
        return getattr(self.actor, name)

    @property
    def generate(self):
        recorder = self

        class Method:
            @staticmethod
            async def remote(prompt_token_ids, sampling, request_id):
                out = await recorder.actor.generate.remote(prompt_token_ids, sampling, request_id)
                session = request_id.rsplit("-", 1)[0]
                recorder.calls.setdefault(session, []).append((list(prompt_token_ids), list(out["token_ids"])))
                return out
        return Method


@pytest.fixture(scope="module")
def device():
    return train.init_distributed()[2]  # a gloo group of one rank, for the whole module


def loop_config(out_dir, model_path, **overrides):
    cfg = train.configure([])
    cfg.update(model_path=model_path, out_dir=str(out_dir), max_steps=2, group_size=2, groups_per_batch=2,
               groups_in_flight=3, engine_max_model_len=1024, checkpoint_every=100, warmup_steps=0, eval_every=0)
    cfg.update(overrides)
    return cfg


def run_loop(cfg, device, engines):
    """main() without its Ray and engine start-up: the trainer, the rollout side on the given engines, the loop."""
    model, optimizer, step, _ = train.build_trainer(cfg, 1, device)
    run = train.start_rollout(cfg, engines=engines)
    try:
        train.train(cfg, model, optimizer, run, step, 0, 1)
    finally:
        train.stop_rollout(run)
    with open(os.path.join(cfg["out_dir"], "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], run


def engine_version(engine):
    return ray.get(engine.__ray_call__.remote(lambda e: e.policy_version))


def digest(engine):
    return ray.get(engine.collective_rpc.remote("weights_digest"))[0]


def test_tiny_default_end_to_end_then_resume(tmp_path, tiny_model_path, rollout_engine, device, monkeypatch):
    recorder = RecordingEngine(rollout_engine)
    batches = []  # the records of each step's batch, as the driver logs them
    real_info_means = runlog.info_means
    monkeypatch.setattr(runlog, "info_means", lambda records: batches.append(records) or real_info_means(records))
    before = digest(rollout_engine)
    # the random-init model never states the exact result: every reward, so every advantage, is 0, and the entropy
    # bonus is what moves the weights that the engine must then hold
    cfg = loop_config(tmp_path, tiny_model_path, save_trajectories=True, entropy_coef=0.01)
    rows, run = run_loop(cfg, device, [recorder])

    # the log, the curve, the checkpoint
    assert [r["step"] for r in rows] == [1, 2] and [r["policy_version"] for r in rows] == [1, 2]
    assert all(METRIC_KEYS <= set(r) for r in rows) and not any(r["skipped"] for r in rows)
    assert all(r["entropy"] > 0 for r in rows)  # entropy_coef > 0: the loss's entropy reaches the row
    # the numbers the agent returns in Result.info, averaged over the step's attempts (each once): tool_called is
    # whether the attempt made the second engine call that follows a valid calculator call; the reward is the
    # agent's success
    assert len(batches) == 2
    for row, records in zip(rows, batches):
        attempts = {r["attempt_id"]: r for r in records}
        assert row["attempts"] == len(attempts) == cfg["group_size"] * cfg["groups_per_batch"]
        calls = [len(recorder.calls[a]) for a in attempts]
        assert row["info/tool_called"] == pytest.approx(sum(n == 2 for n in calls) / len(calls))
        assert row["reward_mean"] == pytest.approx(sum(r["info"]["success"] for r in attempts.values()) / len(attempts))
        assert row["info/answer_chars"] == pytest.approx(
            sum(r["info"]["answer_chars"] for r in attempts.values()) / len(attempts))
    assert all(r["tokens_per_s"] > 0 and r["kept_tokens"] > 0 for r in rows)
    assert rows[0]["mismatch_kl"] < 1e-3  # the first batch: engine and trainer hold the same weights
    # tokens sampled with the weights the trainer holds (KV recomputed at each sync): rounding alone
    assert all(r["mismatch_kl_current"] is None or r["mismatch_kl_current"] < 1e-3 for r in rows)
    assert os.path.getsize(tmp_path / "curves.png") > 0
    assert checkpoint.latest_checkpoint(str(tmp_path)).endswith("step_000002")

    # the engine now runs the trained weights, at the policy version of the last step
    after = digest(rollout_engine)
    assert after.keys() == before.keys() and any(after[k] != before[k] for k in before)
    assert engine_version(rollout_engine) == 2

    # token identity: every generated token in the saved trajectories is exactly what the engine returned, and
    # every prompt the engine saw is the recorded prefix of its segment
    with open(tmp_path / "trajectories.jsonl") as f:
        segments = [json.loads(line) for line in f]
    assert len(segments) >= 2 * cfg["group_size"] * cfg["groups_per_batch"]
    for seg in segments:
        calls = recorder.calls[seg["attempt_id"]]
        # the calculator: one segment of one model turn, or two after a valid calculator call
        assert len(calls) in (1, 2) and seg["segment_index"] == 0
        generated = set()
        for prompt, out in calls:
            n = len(prompt)
            assert seg["token_ids"][:n] == prompt and seg["token_ids"][n:n + len(out)] == out
            generated.update(range(n, n + len(out)))
        assert {i for i, m in enumerate(seg["action_mask"]) if m} == generated
        assert len(seg["generated"]) == len(calls)  # the turns, decoded

    # resume: a fresh trainer loads step 2 and goes on to step 4, off-policy (4 groups in flight for batches of
    # 2) with max_staleness 0, so that tokens sampled one version back are dropped from the loss
    cfg = dict(cfg, resume=True, max_steps=4, groups_in_flight=4, max_staleness=0, save_trajectories=False)
    rows, _ = run_loop(cfg, device, [rollout_engine])
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["policy_version"] == 4
    assert engine_version(rollout_engine) == 4
    assert sum(r["stale_dropped"] for r in rows[2:]) > 0
    assert checkpoint.latest_checkpoint(str(tmp_path)).endswith("step_000004")


def test_held_out_evaluation_runs_through_the_pool_and_never_reaches_the_trainer(tmp_path, tiny_model_path,
                                                                              rollout_engine, device, monkeypatch):
    """eval_every=1 on three of the calculator's held-out questions: evaluated greedily at versions 0, 1 and 2 through
    the real agent, capture server and engine (the engine saw them), logged, kept per prompt, and absent from every
    sequence the trainer trained on; the training stream never yields a held-out question."""
    from agentrl import load_agent
    from transformers import AutoTokenizer
    _, prompts = load_agent("agents/calculator.py")
    held_out = sys.modules["agent_calculator"].eval_prompts()
    assert len(held_out) == 40 and not {p["label"] for p in held_out} & {
        p["label"] for p in itertools.islice(prompts(seed=1337), 20_000)}
    eval_file = tmp_path / "held_out.jsonl"
    eval_file.write_text("".join(json.dumps(p) + "\n" for p in held_out[:3]))
    trained = []  # every token sequence train_step gets
    real_train_step = train.train_step
    def recording_train_step(model, optimizer, microbatches, *args, **kwargs):
        trained.extend(row.tolist() for mb in microbatches for row in mb["input_ids"])
        return real_train_step(model, optimizer, microbatches, *args, **kwargs)
    monkeypatch.setattr(train, "train_step", recording_train_step)
    recorder = RecordingEngine(rollout_engine)
    cfg = loop_config(tmp_path, tiny_model_path, eval_every=1, eval_prompts=str(eval_file))
    rows, _ = run_loop(cfg, device, [recorder])

    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["eval/generated_tokens"] > 0 and r["eval_s"] > 0 for r in rows)
    with open(tmp_path / "eval_results.jsonl") as f:
        results = [json.loads(line) for line in f]
    for row in rows:  # the logged success: the mean of the kept per-prompt results of that policy version
        mine = [r["success"] for r in results if r["policy_version"] == row["policy_version"]]
        assert len(mine) == 3 and row["eval/success"] == pytest.approx(sum(mine) / 3)
    assert [(r["policy_version"], r["prompt"]) for r in results] == [
        (v, p["prompt"]) for v in (0, 1, 2) for p in held_out[:3]]
    assert all(r["policy_versions"] == [r["policy_version"]] and not r["failed"] for r in results)
    assert all(r["success"] == r["reward"] and p["prompt"] in r["text"][0] for r, p in zip(results, held_out[:3] * 3))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    seen = [tokenizer.decode(prompt) for calls in recorder.calls.values() for prompt, _ in calls]
    texts = [tokenizer.decode(ids) for ids in trained]
    assert len(texts) >= 2 * cfg["groups_per_batch"] * cfg["group_size"]
    for p in held_out[:3]:
        assert sum(p["prompt"] in t for t in seen) >= 3  # each evaluation asked the engine
        assert not any(p["prompt"] in t for t in texts)


FLAKY_AGENT = '''
import asyncio
from openai import AsyncOpenAI

async def agent(ctx):
    async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, **ctx.sampling)
    if ctx.label == "raise":
        raise RuntimeError("the tool crashed")
    if ctx.label == "hang":
        await asyncio.sleep(3600)  # a tool that never answers
    return float(reply.choices[0].finish_reason == "stop")

def prompts():
    i = 0
    while True:
        i += 1
        yield {"prompt": f"Say {i}.", "label": {1: "raise", 2: "hang"}.get(i % 4, "ok")}
'''


def test_failing_agent_hanging_tool_and_killed_engine_leave_the_run_going(tmp_path, tiny_model_path, rollout_engine,
                                                                          device):
    """The engine this test kills is the shared one (conftest.rollout_engine, max_restarts=4): Ray restarts its
    actor and the router starts its engine again, so it serves the tests after this one as before."""
    engine = rollout_engine
    agent = tmp_path / "flaky.py"
    agent.write_text(FLAKY_AGENT)
    # attempt_timeout_s: the hanging tool's attempts time out, the others' turns do not, even on a loaded machine
    # (at 3 s and load 15 the restarted engine's first turns timed out too: 18 failures in a row stopped the run)
    cfg = loop_config(tmp_path, tiny_model_path, agent=str(agent), max_steps=4, attempt_timeout_s=10.0,
                      max_tokens=8)
    metrics = tmp_path / "metrics.jsonl"

    def kill_after_first_step():
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            time.sleep(0.1)
        ray.kill(engine, no_restart=False)  # Ray restarts it; the router starts its engine again
    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    try:
        rows, run = run_loop(cfg, device, [engine])
        killer.join(timeout=1)
        restarted, version = ray.get(engine.started.remote()), engine_version(engine)
    finally:  # whatever happened, the shared engine serves the next test
        if not ray.get(engine.started.remote(), timeout=300):
            ray.get(engine.start.remote())

    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r["failed_attempts"] for r in rows) > sum(r["timed_out_attempts"] for r in rows) > 0
    assert sum(r["dropped_groups"] for r in rows) > 0
    # the router notices a dead engine by a request that failed on it, and starts it again
    assert rows[-1]["engine_restarts"] == 1 and run.router.failed_requests >= 1
    assert restarted
    assert version == 4  # the restarted engine rejoined the weight group and got step 4


def test_skipped_steps_sync_nothing_and_tensorboard_gets_the_rows(
        tmp_path, tiny_model_path, rollout_engine, device, monkeypatch):
    """Every step's advantages poisoned (NaN) on their way to the train step: each step is skipped
    (non-finite gradients), so no policy version is made and no weights go to the engine, which
    still serves version 0 after the run; the log says so. tensorboard_dir: the run's TensorBoard
    scalars are its metrics rows' numbers at their steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    real_share_batch = train.share_batch
    def poisoned(*args):
        segments, advantages = real_share_batch(*args)
        return segments, [float("nan")] * len(advantages)
    monkeypatch.setattr(train, "share_batch", poisoned)
    cfg = loop_config(tmp_path, tiny_model_path, tensorboard_dir=str(tmp_path / "tb"))
    rows, _ = run_loop(cfg, device, [rollout_engine])
    assert [(r["step"], r["skipped"], r["policy_version"], r["sync_s"]) for r in rows] == [
        (1, True, 0, None), (2, True, 0, None)]
    assert engine_version(rollout_engine) == 0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for key in ("reward_mean", "tokens_per_s", "kept_tokens", "policy_version"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows], key
    assert "skipped" not in events.Tags()["scalars"]  # a bool is the log's, not a curve
