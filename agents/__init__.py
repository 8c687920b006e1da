"""Agent interfaces and loading an agent module by file path (the `agent = "agents/calculator.py"` config key).

An agent module exports `agent`: a ChatAgent instance or subclass, an Env subclass (a fresh one per attempt), or a
plain `async def agent(ctx)`. It may also export `prompts()`, an iterator of dicts with `prompt` (or `messages`),
`label` and optional `tools`: the data source when the config names no prompt file. And it may export a plain
`setup(cfg)`: called once per run (setup_agent) before the first attempt, in the process that runs the attempts, to
start what the agent needs beside the policy (a judge's or a teacher's engine, see agents/frozen.py); it may return
a clean-up function, called when the run ends.
"""
import importlib.util
import inspect
import math
import os
import sys

from agents.base import ChatAgent, Context, Env, Result, as_messages, run_env  # noqa: F401


def load_agent(path):
    """Import the agent module at `path`. Returns (run, prompts): `run(ctx)` is a coroutine function returning a
    Result, `prompts` the module's prompt iterator function or None."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"agent module {path!r} does not exist; set `agent` to a .py file exporting `agent`")
    name = "agent_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so dataclasses and pickling inside the module can find it
    spec.loader.exec_module(module)
    if not hasattr(module, "agent"):
        raise AttributeError(f"agent module {path!r} exports no `agent` (a ChatAgent, an Env subclass or an async function)")
    run = as_run_function(module.agent, path)
    run.setup = getattr(module, "setup", None)  # for setup_agent: the same module object the agent lives in
    return run, getattr(module, "prompts", None)


def setup_agent(run, cfg):
    """Call the agent module's `setup(cfg)`, if it has one, with the resolved config. Returns the clean-up to call
    when the run ends (a no-op when there is none)."""
    setup = getattr(run, "setup", None)
    if setup is None:
        return lambda: None
    if inspect.iscoroutinefunction(setup):
        raise TypeError("an agent module's `setup(cfg)` must be a plain function: what it starts has to outlive any "
                        "one event loop, so serve it from its own thread (agents/frozen.py does)")
    cleanup = setup(cfg)
    if cleanup is not None and not callable(cleanup):
        raise TypeError(f"an agent module's `setup(cfg)` must return None or a clean-up function, got "
                        f"{type(cleanup).__name__}")
    return cleanup or (lambda: None)


def as_run_function(agent, where="agent"):
    """One calling convention for every agent shape: `await run(ctx) -> Result`."""
    if inspect.isclass(agent) and issubclass(agent, Env):
        async def run(ctx):
            return as_result(await run_env(agent(), ctx))
    elif inspect.isclass(agent) and issubclass(agent, ChatAgent):
        return as_run_function(agent(), where)
    elif isinstance(agent, ChatAgent):
        async def run(ctx):
            return as_result(await agent.run(ctx))
    elif inspect.iscoroutinefunction(agent):
        async def run(ctx):
            return as_result(await agent(ctx))
    else:
        raise TypeError(f"{where}: `agent` must be a ChatAgent, an Env subclass or an async function of ctx, "
                        f"got {type(agent).__name__}")
    return run


def as_result(value):
    """A float, a Result, a dict with "reward", or any object with `.reward`, as a Result with a finite float."""
    if isinstance(value, Result):
        result = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = Result(float(value))
    elif isinstance(value, dict) and "reward" in value:
        result = Result(value["reward"], {k: v for k, v in value.items() if k != "reward"})
    elif hasattr(value, "reward"):
        result = Result(value.reward, dict(getattr(value, "info", {}) or {}))
    else:
        raise TypeError(f"an agent must return a reward (float) or a result with a reward, got {type(value).__name__}")
    reward = float(result.reward)
    if not math.isfinite(reward):
        raise ValueError(f"the agent returned a non-finite reward {reward}")
    return Result(reward, result.info)


def read_prompts(path, seed=0):
    """Endless prompts from a data file (agents/data.py: JSONL, or Parquet with pyarrow; every row is checked now,
    so a bad row stops the run before it starts): every row once per epoch, in a new seeded order each epoch."""
    import random

    from agents.data import load_prompts
    rows = list(load_prompts(path))

    def epochs():
        rng = random.Random(seed)
        while True:
            order = list(rows)
            rng.shuffle(order)
            yield from order
    return epochs()
