"""
The tiny default task: a two-turn calculator agent written with the official OpenAI SDK.

    python train.py            # trains the tiny model on this agent (agent = "agents/calculator.py")

Turn 1: the model gets an arithmetic question and a `calculator` tool. Turn 2: the agent runs the tool and sends
its result back as a `tool` message; the model answers. The tool runs on the model's own tool call when it made a
valid one, else on the question's expression: a random-init model almost never writes a valid call, and this keeps
the conversation shape (model turn, tool result, model turn) the same from the first step on.

Reward in [0, 1], on the final answer only:
    1.0                                   the answer is exactly the tool's result
    else 0.4 * concise + 0.3 * stopped + 0.3 * digits
  concise  1 - len(answer) / (4 * max_tokens), 0 for an empty answer (4 characters is about the longest token)
  stopped  1 if the model ended its turn itself (finish_reason "stop"), 0 if max_tokens cut it off
  digits   how many of the result's digits the answer holds (multiset overlap / the longer digit count)
A random-init model earns ~0.1 (long noise cut off by max_tokens); it learns within a few dozen steps to answer
briefly and stop (~0.5-0.7). Getting the number right, the last 0.3, takes a model that can copy from context.
"""
import ast
import operator
import random
from collections import Counter

from openai import AsyncOpenAI

from agentrl import ChatAgent, Result

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def prompts(seed=0):
    """Endless arithmetic questions; the label is the expression (the tool computes the answer)."""
    rng = random.Random(seed)
    while True:
        expression = f"{rng.randint(0, 99)} {rng.choice('+-*')} {rng.randint(0, 99)}"
        yield {"prompt": f"What is {expression}? Use the calculator.", "label": expression}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression):
    """Integer arithmetic on + - * and parentheses, without eval: the model writes the expression."""
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10**9:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not an arithmetic expression: {expression!r}")
    try:
        return walk(ast.parse(expression, mode="eval").body)
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * and parentheses."""
    try:
        return str(calculate(expression))
    except ValueError as e:  # the model wrote a bad expression: it reads why, as the tool's result
        return f"error: {e}"


def expression_of(message, fallback):
    """The expression of the model's first calculator call, if it made a valid one; else `fallback`."""
    import json
    for call in message.tool_calls or []:
        try:
            expression = json.loads(call.function.arguments)["expression"]
            calculate(expression)
            return expression, True
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
    return fallback, False


def score(answer, stopped, result, max_tokens):
    """The reward of a final answer (see the module docstring)."""
    answer = answer.strip()
    if answer == result:
        return 1.0
    concise = max(0.0, 1.0 - len(answer) / (4 * max_tokens)) if answer else 0.0
    answer_digits, result_digits = Counter(c for c in answer if c.isdigit()), Counter(result.lstrip("-"))
    shared = sum((answer_digits & result_digits).values())
    digits = shared / max(sum(answer_digits.values()), sum(result_digits.values()))
    return 0.4 * concise + 0.3 * float(stopped) + 0.3 * digits


class Calculator(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": ctx.prompt}]
            first = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS,
                                                         **ctx.sampling)
            reply = first.choices[0].message
            expression, called = expression_of(reply, ctx.label)
            result = str(calculate(expression))
            # the reply goes back exactly as received, so the capture server sees the conversation extend its tokens
            messages.append(reply.model_dump(exclude_none=True))
            call_id = reply.tool_calls[0].id if called else "call_0"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
            second = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS,
                                                          **ctx.sampling)
        choice = second.choices[0]
        reward = score(choice.message.content or "", choice.finish_reason == "stop", result,
                       ctx.sampling.get("max_tokens", 48))
        return Result(reward, {"tool_called": float(called), "answer_chars": len((choice.message.content or "").strip())})


agent = Calculator()
