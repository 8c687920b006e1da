"""
The tiny default task: a calculator agent written with the official OpenAI SDK.

    python train.py            # trains the tiny model on this agent (agent = "agents/calculator.py")

The model gets an arithmetic question in words ("What is 7 times 8?", single-digit
numbers) and a `calculator` tool. When its reply is a valid calculator call, the
agent runs the tool on the model's own expression and sends the result back as a
`tool` message, and the model answers (two model turns); any other reply is taken as
the final answer (one turn). The tool never runs on anything the model did not write.

Reward: 1.0 when the final answer states the question's result ("56", or "The
answer is 56."), else 0.0; Result.info["success"] is the same number, the
task's success that evaluation reports. Nothing else is rewarded: whether the
model made a valid call is logged (info "tool_called"), never paid for.

A random-init model never gets an answer right by sampling. The tiny model's warm start (tiny.py)
is a short SFT on `transcripts`: worked examples of a teacher who answers most questions from
memory and takes the calculator for the rest. The warm-started model prefers answering from memory,
which on questions it has not seen is almost always wrong; it can use the calculator (copy the
numbers and the operation into the call, the result into the answer), but greedily it does not. RL
has to find that the calculator pays; held-out success shows whether it did (docs/learning.md).

Prompts come in two splits that never share an expression: `prompts()` (training, endless) and
`eval_prompts()` (held out, fixed): an expression is held out when its CRC-32 is divisible by 8.

`score` is a shaped reward (answer briefly, stop, share digits) that the
framework recipes use (agents_sdk.py, langchain_tools.py); this agent does not.
"""
import ast
import itertools
import json
import operator
import random
import re
import zlib
from collections import Counter

from openai import AsyncOpenAI

from agentrl import ChatAgent, Result

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
MAX_OPERAND = 9  # single digits: the tiny model learns to copy them within its warm start
WORDS = {"plus": "+", "minus": "-", "times": "*"}  # the question names its operation in words


def held_out(expression):
    return zlib.crc32(expression.encode()) % 8 == 0


def prompts(seed=0, split="train"):
    """Endless arithmetic questions of one split ("train" or "eval"),
    "What is 7 times 8?"; the label is the expression, "7 * 8"."""
    rng = random.Random(seed)
    while True:
        a, word, b = rng.randint(0, MAX_OPERAND), rng.choice(list(WORDS)), rng.randint(
            0, MAX_OPERAND)
        expression = f"{a} {WORDS[word]} {b}"
        if held_out(expression) == (split == "eval"):
            yield {"prompt": f"What is {a} {word} {b}?", "label": expression}


def eval_prompts():
    """The held-out questions evaluation runs: every
    expression of the eval split once, in a fixed order."""
    return [{"prompt": f"What is {a} {word} {b}?", "label": f"{a} {op} {b}"}
            for a in range(MAX_OPERAND + 1)
            for word, op in WORDS.items() for b in range(MAX_OPERAND + 1)
            if held_out(f"{a} {op} {b}")]


def transcripts(n, seed=0, with_tools=0.25, from_memory=0.6):
    """n worked examples from the training split, as chat rows for supervised fine-tuning
    (the tiny model's warm start), in the way of a teacher who answers a `from_memory`
    fraction of the questions at once ("The answer is 56.", right: it knows its tables)
    and takes the calculator for the others (call, tool result, the result as the answer).
    The tiny model learns both routes, and to prefer the first; from memory it is right on
    few questions it has not seen, with the calculator on most: which route pays is what
    RL has to find. Only a `with_tools` fraction carries the tool list (rendered into the
    system turn: ~290 of a transcript's ~350 tokens); the others are five times cheaper to
    train on, and the tiny model learns to copy within ~120 steps instead of ~300."""
    rows, rng = [], random.Random(seed)
    for p in itertools.islice(prompts(seed=seed), n):
        result = str(calculate(p["label"]))
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculator",
                             "arguments": json.dumps({"expression": p["label"]})}}
        turns = [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_0", "content": result},
                 {"role": "assistant", "content": result}]
        if rng.random() < from_memory:
            turns = [{"role": "assistant", "content": f"The answer is {result}."}]
        rows.append({"tools": TOOLS if rng.random() < with_tools else None,
                     "messages": [{"role": "user", "content": p["prompt"]}] + turns})
    return rows


def answer_of(text):
    """The number a final answer states: "56" or "The answer is
    56." (the two forms of the worked examples), else None."""
    match = re.fullmatch(r"(?:The answer is )?(-?\d+)\.?", text.strip())
    return match and match.group(1)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.USub: operator.neg}


def calculate(expression):
    """Integer arithmetic on + - * and parentheses,
    without eval: the model writes the expression."""
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value,
                                                         int) and abs(node.value) < 10**9:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not an arithmetic expression: {expression!r}")
    try:
        return walk(ast.parse(expression, mode="eval").body)
    except (SyntaxError, RecursionError):
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * and parentheses."""
    try:
        return str(calculate(expression))
    except ValueError as e:  # the model wrote a bad expression: it reads why, as the tool's result
        return f"error: {e}"


def expression_of(message):
    """The expression of the model's first valid calculator
    call and that call's id, or (None, None)."""
    for call in message.tool_calls or []:
        try:
            expression = json.loads(call.function.arguments)["expression"]
            calculate(expression)
            return expression, call.id
        except (ValueError, KeyError, TypeError):
            continue
    return None, None


def score(answer, stopped, result, max_tokens):
    """A shaped reward: 1.0 for exactly `result`, else 0.4 * concise + 0.3 *
    stopped + 0.3 * shared digits, where concise = 1 - len(answer) / (4 *
    max_tokens) (0 for an empty answer) and shared digits = the multiset overlap
    of the answer's and the result's digits over the longer digit count."""
    answer = answer.strip()
    if answer == result:
        return 1.0
    concise = max(0.0, 1.0 - len(answer) / (4 * max_tokens)) if answer else 0.0
    answer_digits, result_digits = Counter(c for c in answer
                                           if c.isdigit()), Counter(result.lstrip("-"))
    shared = sum((answer_digits & result_digits).values())
    digits = shared / max(sum(answer_digits.values()), sum(result_digits.values()))
    return 0.4 * concise + 0.3 * float(stopped) + 0.3 * digits


class Calculator(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": ctx.prompt}]
            reply = (await client.chat.completions.create(model=ctx.model, messages=messages,
                                                          tools=TOOLS,
                                                          **ctx.sampling)).choices[0].message
            expression, call_id = expression_of(reply)
            if expression is not None:
                # the reply goes back exactly as received, so the
                # capture server sees the conversation extend its tokens
                messages += [reply.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call_id,
                              "content": calculator(expression)}]
                reply = (await client.chat.completions.create(model=ctx.model, messages=messages,
                                                              tools=TOOLS,
                                                              **ctx.sampling)).choices[0].message
        answer = (reply.content or "").strip()
        success = float(answer_of(answer) == str(calculate(ctx.label)))  # the exact result
        return Result(success, {"success": success, "tool_called": float(expression is not None),
                                "answer_chars": len(answer)})


agent = Calculator()
