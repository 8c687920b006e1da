"""
The two shapes an agent can take, and the context every attempt gets.

A ChatAgent is ordinary async Python that talks to the model through an official SDK (OpenAI or Anthropic) pointed
at `ctx.base_url` with `ctx.api_key`; the framework records the exact tokens behind every reply. It returns the
attempt's reward:

    class MyAgent(ChatAgent):
        async def run(self, ctx):
            async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
                reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, **ctx.sampling)
            return float(reply.choices[0].message.content.strip() == ctx.label)

An Env is a Gymnasium-style environment; the framework plays the model against it through the same SDK path (so
token identity holds for it too): `reset(ctx)` gives the first messages, `step(action)` gets the model's reply and
returns `(observation, reward, done, info)`. The attempt's reward is the sum of the step rewards.
"""
from dataclasses import dataclass, field


@dataclass
class Context:
    """What one attempt knows. `sampling` holds temperature, top_p and max_tokens (per model turn): pass it on as
    `**ctx.sampling` to keep the engine's sampling what the trainer assumes."""
    base_url: str                # this attempt's base URL on the capture server, for the OpenAI and Anthropic SDKs
    api_key: str                 # identifies this attempt to the capture server; pass it to the SDK client
    model: str                   # model name to send (the server serves one policy)
    prompt: str | None = None    # the task's prompt text, when the data source gives one
    messages: list = field(default_factory=list)  # the task's opening messages (a user turn holding `prompt`)
    tools: list | None = None    # OpenAI-format tool specs from the data source, if any
    label: object = None         # whatever the data source pairs with the prompt (answer, test cases, ...)
    sampling: dict = field(default_factory=dict)  # temperature, top_p, max_tokens
    attempt_id: str = ""
    group_id: int = -1
    info: dict = field(default_factory=dict)  # the agent may leave numbers here; they are averaged into metrics


@dataclass
class Result:
    """What `run` may return instead of a bare float: the reward and any per-attempt numbers to log."""
    reward: float
    info: dict = field(default_factory=dict)


class ChatAgent:
    """Subclass and implement `run`. One instance serves every attempt, so keep per-attempt state in locals.
    Attempts share one event loop: await I/O, and run blocking tool code with `await asyncio.to_thread(...)` (a
    blocking call stalls every attempt; attempt_timeout_s fails an attempt that runs too long)."""

    async def run(self, ctx: Context):
        """Play one attempt through an SDK client on ctx.base_url / ctx.api_key; return a float reward or a Result."""
        raise NotImplementedError


class Env:
    """Subclass and implement `reset` and `step`. A fresh instance serves each attempt, so state lives on self.

    `step` receives the assistant's reply text, or the whole assistant message dict (with `tool_calls`) when the
    class sets `action_is_message = True`. An observation is a string (sent as the next user turn), a message dict,
    or a list of message dicts (e.g. several `tool` results)."""
    action_is_message = False
    max_turns = 8  # the attempt ends after this many model turns even when `done` never comes

    async def reset(self, ctx: Context):
        """Start an episode; return the opening messages (a list of dicts) or a user-turn string."""
        raise NotImplementedError

    async def step(self, action):
        """Apply the model's action; return (observation, reward, done, info)."""
        raise NotImplementedError

    async def close(self):
        """Release what the episode holds (processes, files); called once per attempt, also after an error."""


def as_messages(observation):
    """An Env observation as a list of chat messages."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        return [observation]
    if isinstance(observation, list) and all(isinstance(m, dict) for m in observation):
        return observation
    raise TypeError(f"an Env observation must be a string, a message dict or a list of message dicts, "
                    f"got {type(observation).__name__}")


async def run_env(env: Env, ctx: Context):
    """Drive `env` with the model through the OpenAI SDK on the capture server. Returns a Result whose reward is the
    sum of step rewards; `info` holds the number of turns."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    total, turns = 0.0, 0
    try:
        messages = as_messages(await env.reset(ctx))
        tools = {"tools": ctx.tools} if ctx.tools else {}
        for turns in range(1, env.max_turns + 1):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, **tools, **ctx.sampling)
            # send the reply back exactly as received, so the next request extends the recorded tokens
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            observation, reward, done, _ = await env.step(message if env.action_is_message else message.get("content") or "")
            total += float(reward)
            if done:
                break
            messages.extend(as_messages(observation))
    finally:
        await client.close()
        await env.close()
    return Result(total, {"turns": turns})
