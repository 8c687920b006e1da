"""
Code execution: the model writes Python, a sandboxed subprocess
runs it, and the output goes back as the tool result.

    python train.py --agent=agents/code_exec.py

The model gets a small computation ("the sum of the squares of 1..7") and a `python` tool.
Each call runs in its own subprocess (agents/sandbox.py): a time limit, an address-space
limit, no network, a fresh temporary directory, output cut to a few hundred tokens. A program
that loops forever, allocates too much or reaches for the network is stopped, and the model
reads why in the tool result; the attempt goes on. The model answers when it makes no call.

Reward in [0, 1]:
    1.0    the last number in the final answer is the label
    0.3    not that, but one of its programs printed the label (it computed the answer and did not say it)
    0.0    otherwise
"""
import json
import math
import random
import re

from openai import AsyncOpenAI

from agentrl import ChatAgent, Result
from sandbox import run_python

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run a Python 3 program and return what it prints (stdout and "
    "stderr).",
    "parameters": {"type": "object",
                   "properties": {"code": {"type": "string", "description": "the program"}},
                   "required": ["code"]}}}]


def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


TASKS = [  # (question, answer of n)
    ("What is the sum of the squares of the integers from 1 to {n}?",
     lambda n: sum(i * i for i in range(1, n + 1))),
    ("What is the {n}th Fibonacci number (F(1) = F(2) = 1)?", fibonacci),
    ("How many primes are there below {n}?",
     lambda n: sum(all(p % d for d in range(2, p)) for p in range(2, n))),
    ("What is the sum of the digits of {n} factorial?",
     lambda n: sum(int(c) for c in str(math.factorial(n)))),
]


def prompts(seed=0):
    rng = random.Random(seed)
    while True:
        question, answer = rng.choice(TASKS)
        n = rng.randint(5, 40)
        yield {"prompt": question.format(n=n)
               + " Compute it with the python tool, then give the number.",
               "label": str(answer(n))}


class CodeExec(ChatAgent):
    def __init__(self, max_turns=4, time_limit_s=5.0, memory_mb=256, max_output_chars=800):
        self.max_turns, self.time_limit_s, self.memory_mb = max_turns, time_limit_s, memory_mb
        self.max_output_chars = max_output_chars

    async def execute(self, arguments, stats):
        try:
            code = json.loads(arguments)["code"]
            if not isinstance(code, str):
                raise TypeError("`code` must be a string")
        except (ValueError, KeyError, TypeError) as e:
            return f"error: the arguments must be JSON with a `code` string ({e})", ""
        result = await run_python(code, time_limit_s=self.time_limit_s, memory_mb=self.memory_mb,
                                  max_output_chars=self.max_output_chars)
        stats["programs"] += 1
        stats["timeouts"] += result.timed_out
        stats["out_of_memory"] += result.out_of_memory
        stats["failed_programs"] += not result.ok
        return result.report(), result.output

    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            messages, printed = list(ctx.messages), []
            stats = dict(programs=0, timeouts=0, out_of_memory=0, failed_programs=0)
            for turn in range(1, self.max_turns + 1):
                response = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                tools=TOOLS, **ctx.sampling)
                reply = response.choices[0].message
                messages.append(reply.model_dump(exclude_none=True))  # back exactly as received
                if not reply.tool_calls:
                    break
                for call in reply.tool_calls:
                    report, output = await self.execute(call.function.arguments, stats)
                    printed.append(output)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": report})
        answer = "" if reply.tool_calls else reply.content or ""
        numbers = re.findall(r"-?\d+", answer)
        if numbers and numbers[-1] == ctx.label:
            reward = 1.0
        else:
            reward = 0.3 if any(ctx.label in re.findall(r"-?\d+", out) for out in printed) else 0.0
        return Result(reward, dict(stats, turns=turn))


agent = CodeExec()
