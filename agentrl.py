"""
The agent interfaces, and loading an agent file by path
(the `agent = "agents/calculator.py"` config key).

Agent files live anywhere (agents/ holds the recipes) and import this module for the interfaces:

    from agentrl import ChatAgent, Env, Result

A ChatAgent is ordinary async Python that talks to the model through an official SDK
(OpenAI or Anthropic) pointed at `ctx.base_url` with `ctx.api_key`, directly or through
a framework built on one (the OpenAI Agents SDK, LangChain, pydantic-ai); the framework
records the exact tokens behind every reply. It returns the attempt's reward:

    class MyAgent(ChatAgent):
        async def run(self, ctx):
            async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
                reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, **ctx.sampling)
            return float(reply.choices[0].message.content.strip() == ctx.label)

An Env is a Gymnasium-style environment; the framework plays the model against it
through the same SDK path (so token identity holds for it too): `reset(ctx)` gives
the first messages, `step(action)` gets the model's reply and returns `(observation,
reward, done, info)`. The attempt's reward is the sum of the step rewards.

An agent module exports `agent`: a ChatAgent instance or subclass, an Env subclass (a fresh
one per attempt), or a plain `async def agent(ctx)`. It may also export `prompts()`, an
iterator of dicts with `prompt` (or `messages`), `label` and optional `tools`: the data
source when the config names no prompt file; and `eval_prompts()`, a list of such dicts held
out from training (evaluated every eval_every steps; an agent's Result.info["success"], when
it gives one, is the success rate evaluation reports, else its reward). And it may export a
plain `setup(cfg)`: called once per run (setup_agent) before the first attempt, in the
process that runs the attempts, to start what the agent needs beside the policy (a judge's or
a teacher's engine, see agents/frozen.py); it may return a clean-up function, called when the
run ends. The file is loaded as Python runs a script: its folder comes first on `sys.path`,
so it imports the files beside it by their names (`from calculator import calculate`), and
`import agents` is the OpenAI Agents SDK, never this project's folder of recipes.

Prompt files (read_prompts, load_prompts): JSONL (one object per line), or Parquet when pyarrow
is installed. A row is an object with `prompt` (a string) or `messages` (a list of chat messages,
each with a `role` and a string or text-parts `content`), and optionally `label` (anything JSON
holds: an answer, test cases, a rubric) and `tools` (OpenAI-format function specs). Other keys
travel along untouched. A malformed row stops the load with one error naming the file and the
line (for Parquet, the row number, counting from 1). A transcript file (`sft_data`,
load_transcripts) holds such rows whose `messages` include the assistant turns to learn.
"""
import importlib.util
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass, field

# -----------------------------------------------------------------------------
# the interfaces


@dataclass
class Context:
    """What one attempt knows. `sampling` holds temperature, top_p and max_tokens (per model turn):
    pass it on as `**ctx.sampling` to keep the engine's sampling what the trainer assumes."""
    base_url: str                # this attempt's base URL on the capture
                                 # server, for the OpenAI and Anthropic SDKs
    api_key: str                 # identifies this attempt to the capture
                                 # server; pass it to the SDK client
    model: str                   # model name to send (the server serves one policy)
    prompt: str | None = None    # the task's prompt text, when the data source gives one
    messages: list = field(default_factory=list)  # the task's opening messages (a
                                                  # user turn holding `prompt`)
    tools: list | None = None    # OpenAI-format tool specs from the data source, if any
    label: object = None         # whatever the data source pairs with
                                 # the prompt (answer, test cases, ...)
    sampling: dict = field(default_factory=dict)  # temperature, top_p, max_tokens
    attempt_id: str = ""
    group_id: int = -1
    info: dict = field(default_factory=dict)  # the agent may leave numbers here;
                                              # they are averaged into metrics


@dataclass
class Result:
    """What `run` may return instead of a bare float:
    the reward and any per-attempt numbers to log."""
    reward: float
    info: dict = field(default_factory=dict)


class ChatAgent:
    """Subclass and implement `run`. One instance serves every attempt, so keep
    per-attempt state in locals. Attempts share one event loop: await I/O, and run
    blocking tool code with `await asyncio.to_thread(...)` (a blocking call stalls
    every attempt; attempt_timeout_s fails an attempt that runs too long)."""

    async def run(self, ctx: Context):
        """Play one attempt through an SDK client on ctx.base_url
        / ctx.api_key; return a float reward or a Result."""
        raise NotImplementedError


class Env:
    """Subclass and implement `reset` and `step`. A fresh
    instance serves each attempt, so state lives on self.

    `step` receives the assistant's reply text, or the whole assistant
    message dict (with `tool_calls`) when the class sets `action_is_message =
    True`. An observation is a string (sent as the next user turn), a message
    dict, or a list of message dicts (e.g. several `tool` results)."""
    action_is_message = False
    max_turns = 8  # the attempt ends after this many model turns even when `done` never comes

    async def reset(self, ctx: Context):
        """Start an episode; return the opening messages (a list of dicts) or a user-turn string."""
        raise NotImplementedError

    async def step(self, action):
        """Apply the model's action; return (observation, reward, done, info)."""
        raise NotImplementedError

    async def close(self):
        """Release what the episode holds (processes, files);
        called once per attempt, also after an error."""


def as_messages(observation):
    """An Env observation as a list of chat messages."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        return [observation]
    if isinstance(observation, list) and all(isinstance(m, dict) for m in observation):
        return observation
    raise TypeError("an Env observation must be a string, a message dict or a list of message "
                    "dicts, "
                    f"got {type(observation).__name__}")


async def run_env(env: Env, ctx: Context):
    """Drive `env` with the model through the OpenAI SDK on the capture server. Returns a
    Result whose reward is the sum of step rewards; `info` holds the number of turns."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    total, turns = 0.0, 0
    try:
        messages = as_messages(await env.reset(ctx))
        tools = {"tools": ctx.tools} if ctx.tools else {}
        for turns in range(1, env.max_turns + 1):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                         **tools, **ctx.sampling)
            # send the reply back exactly as received, so
            # the next request extends the recorded tokens
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            observation, reward, done, _ = await env.step(message if env.action_is_message
                                                          else message.get("content") or "")
            total += float(reward)
            if done:
                break
            messages.extend(as_messages(observation))
    finally:
        await client.close()
        await env.close()
    return Result(total, {"turns": turns})

# -----------------------------------------------------------------------------
# loading an agent file


def load_agent(path):
    """Import the agent module at `path`. Returns (run, prompts): `run(ctx)` is a coroutine
    function returning a Result, `prompts` the module's prompt iterator function or None."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"agent module {path!r} does not exist; set `agent` to a .py file exporting `agent`")
    # as `python path` does: the files beside it import by name
    if (folder := os.path.dirname(os.path.abspath(path))) not in sys.path:
        sys.path.insert(0, folder)
    name = "agent_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so dataclasses and pickling inside the module can find it
    spec.loader.exec_module(module)
    if not hasattr(module, "agent"):
        raise AttributeError(f"agent module {path!r} exports no `agent` (a ChatAgent, an Env "
                             "subclass or an async function)")
    run = as_run_function(module.agent, path)
    # setup: for setup_agent, the same module object the agent lives
    # in; prompt_from_row: a data file's own layout -> a prompt row
    for name in ("setup", "eval_prompts", "prompt_from_row"):
        setattr(run, name, getattr(module, name, None))
    return run, getattr(module, "prompts", None)


def setup_agent(run, cfg):
    """Call the agent module's `setup(cfg)`, if it has one, with the resolved config.
    Returns the clean-up to call when the run ends (a no-op when there is none)."""
    setup = getattr(run, "setup", None)
    if inspect.iscoroutinefunction(setup):
        raise TypeError("an agent module's `setup(cfg)` must be a plain function: what it starts "
                        "has to outlive any "
                        "one event loop, so serve it from its own thread (agents/frozen.py does)")
    cleanup = setup(cfg) if setup is not None else None
    if cleanup is not None and not callable(cleanup):
        raise TypeError("an agent module's `setup(cfg)` must return None or a clean-up function, "
                        "got "
                        f"{type(cleanup).__name__}")
    return cleanup or (lambda: None)


def as_run_function(agent, where="agent"):
    """One calling convention for every agent shape: `await run(ctx) -> Result`."""
    if inspect.isclass(agent) and issubclass(agent, Env):
        play = lambda ctx: run_env(agent(), ctx)  # noqa: E731  (a fresh Env per attempt)
    elif inspect.isclass(agent) and issubclass(agent, ChatAgent):
        return as_run_function(agent(), where)
    elif isinstance(agent, ChatAgent) or inspect.iscoroutinefunction(agent):
        play = agent.run if isinstance(agent, ChatAgent) else agent
    else:
        raise TypeError(f"{where}: `agent` must be a ChatAgent, an Env subclass or an async "
                        "function of ctx, "
                        f"got {type(agent).__name__}")

    async def run(ctx):
        return as_result(await play(ctx))
    return run


def as_result(value):
    """A float, a Result, a dict with "reward", or any object
    with `.reward`, as a Result with a finite float."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        reward, info = value, {}
    elif isinstance(value, dict) and "reward" in value:
        reward, info = value["reward"], {k: v for k, v in value.items() if k != "reward"}
    elif hasattr(value, "reward"):  # a Result too
        reward, info = value.reward, dict(getattr(value, "info", {}) or {})
    else:
        raise TypeError("an agent must return a reward (float) or a result with a reward, got "
                        f"{type(value).__name__}")
    if not math.isfinite(float(reward)):
        raise ValueError(f"the agent returned a non-finite reward {reward}")
    return Result(float(reward), info)


def read_prompts(path, seed=0, row_map=None):
    """Endless prompts from a data file (JSONL, or Parquet with pyarrow;
    every row is checked now, so a bad row stops the run before it starts):
    every row once per epoch, in a new seeded order each epoch."""
    import random
    rows = list(load_prompts(path, row_map))

    def epochs():
        rng = random.Random(seed)
        while True:
            order = list(rows)
            rng.shuffle(order)
            yield from order
    return epochs()

# -----------------------------------------------------------------------------
# prompt files


ROLES = ("system", "developer", "user", "assistant", "tool")


def load_prompts(path, row_map=None):
    """Yield the rows of a .jsonl (or .parquet) file, in file order, once each, after
    checking every row: a data set with a bad row fails before the first attempt, not
    hours into a run. row_map: the agent module's `prompt_from_row`, which turns a row
    of another layout (e.g. geo3k's images, problem, answer) into a prompt row."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist")
    rows = list(parquet_rows(path) if path.endswith(".parquet") else jsonl_rows(path))
    if row_map is not None:
        try:
            rows = [(line, row_map(row)) for line, row in rows]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: a row does not fit the agent's layout: {type(e).__name__}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: the file holds no rows")
    for line, row in rows:
        if problem := row_problem(row):
            raise ValueError(f"{path}:{line}: {problem}")
    yield from (row for _, row in rows)


def jsonl_rows(path):
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except ValueError as e:
                raise ValueError(f"{path}:{line}: not valid JSON ({e})") from None


def parquet_rows(path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow); or "
                          "convert the file to "
                          "JSONL") from None
    for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
        # Parquet has no missing-key notion: a column absent from a row reads as None
        yield i, {k: v for k, v in row.items() if v is not None}


def row_problem(row):
    """What is wrong with one row, as a phrase, or None."""
    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is None and messages is None:
        return "the row has neither `prompt` nor `messages`"
    if prompt is not None and not isinstance(prompt, str):
        return f"`prompt` must be a string, got {type(prompt).__name__}"
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            return "`messages` must be a non-empty list of chat messages"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                return f"`messages[{i}]` must be an object with a `role` among {', '.join(ROLES)}"
            if not isinstance(m.get("content"), (str, list, type(None))):
                return f"`messages[{i}].content` must be a string or a list of text parts"
    if (tools := row.get("tools")) is not None:
        if not isinstance(tools, list):
            return "`tools` must be a list of OpenAI-format function specs"
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                return f"`tools[{i}]` must look like {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
    return None


def load_transcripts(path):
    """Chat transcripts for supervised fine-tuning (the `sft_data` config key):
    rows as load_prompts checks them, each with `messages` holding at least one
    assistant turn (the tokens to learn). Returns the list of rows."""
    rows = list(load_prompts(path))
    for i, row in enumerate(rows, 1):
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in row.get("messages")
                   or []):
            raise ValueError(f"{path}: transcript {i} has no assistant message in `messages`, "
                             "nothing to learn from")
    return rows


def transcript_tokens(row, tokenizer):
    """A transcript rendered with the tokenizer's chat template turn by turn, as the capture server
    records a conversation the model extends: (token_ids, mask), mask 1 on each assistant turn's
    tokens through its end-of-turn token (what the model would generate), 0 on everything else."""
    messages, tools = row["messages"], row.get("tools") or None

    def render(n, add_generation_prompt):
        return tokenizer.apply_chat_template(messages[:n], tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    ids, mask, done, eos = [], [], "", tokenizer.eos_token
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt, full = render(i, True), render(i + 1, False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ValueError("the chat template renders an earlier turn differently once later "
                             "turns follow (it rewrites history), so the transcript's turns cannot "
                             "be cut apart: split it into one "
                             "transcript per assistant turn")
        reply = full[len(prompt):]
        end = reply.find(eos) + len(eos) if eos in reply else len(reply)
        for text, learn in ((prompt[len(done):], 0), (reply[:end], 1), (reply[end:], 0)):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids += piece
            mask += [learn] * len(piece)
        done = full
    return ids, mask
