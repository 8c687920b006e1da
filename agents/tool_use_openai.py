"""
Multi-turn tool use with the official OpenAI SDK: `tools=`, structured `tool_calls`,
and every call of a turn answered by its own `tool` message before the next model turn.

    python train.py --agent=agents/tool_use_openai.py

The task: a small shop. The model is asked what a basket costs ("3 apples and 2
pears") and has two tools, `get_price(item)` and `calculator(expression)`. It may call
several tools in one turn (parallel calls); each result goes back as a `tool` message
with the call's id; it answers when it makes no call (or after MAX_TURNS turns).

Reward in [0, 1]:
    1.0                                 the last number in the final answer is the basket's total
    else 0.3 * looked_up                looked_up: fraction of the basket's items whose price the model looked up
"""
import json
import random
import re

from openai import AsyncOpenAI

from agentrl import ChatAgent, Result
from calculator import calculate

MAX_TURNS = 4
PRICES = {"apple": 3, "pear": 5, "banana": 2, "mango": 7, "lemon": 4}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_price", "description": "The price of one item of the shop, in dollars.",
        "parameters": {"type": "object",
                       "properties": {"item": {"type": "string", "enum": sorted(PRICES)}},
                       "required": ["item"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression with + - * and "
        "parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}]


def prompts(seed=0):
    """Endless baskets of two items; the label holds the basket and its total."""
    rng = random.Random(seed)
    while True:
        items = rng.sample(sorted(PRICES), 2)
        basket = {item: rng.randint(1, 5) for item in items}
        words = " and ".join(f"{n} {item}{'s' if n > 1 else ''}" for item, n in basket.items())
        yield {"prompt": f"What do {words} cost in total? Look up the prices with get_price.",
               "label": {"basket": basket, "total": sum(PRICES[i] * n for i, n in basket.items())}}


def run_tool(name, arguments, looked_up):
    """One tool call -> its result text. A bad call gets
    an error the model can read, never an exception."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        if name == "get_price":
            item = str(args["item"]).lower().rstrip("s")
            if item not in PRICES:
                return f"error: unknown item {args['item']!r}; the shop sells {', '.join(sorted(PRICES))}"
            looked_up.add(item)
            return str(PRICES[item])
        if name == "calculator":
            return str(calculate(str(args["expression"])))
        return f"error: no tool named {name!r}"
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        return f"error: {e}"


def score(answer, label, looked_up):
    numbers = re.findall(r"-?\d+", answer)
    if numbers and int(numbers[-1]) == label["total"]:
        return 1.0
    return 0.3 * len(looked_up & set(label["basket"])) / len(label["basket"])


class ShopAgent(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            messages, looked_up, calls = list(ctx.messages), set(), 0
            for turn in range(1, MAX_TURNS + 1):
                response = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                tools=TOOLS, **ctx.sampling)
                reply = response.choices[0].message
                # the reply goes back exactly as received, so the
                # capture server sees the conversation extend its tokens
                messages.append(reply.model_dump(exclude_none=True))
                if not reply.tool_calls:
                    break
                for call in reply.tool_calls:  # one `tool` message per call,
                                               # in the order of the calls
                    calls += 1
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": run_tool(call.function.name,
                                                         call.function.arguments, looked_up)})
        answer = "" if reply.tool_calls else reply.content or ""
        return Result(score(answer, ctx.label, looked_up), {"tool_calls": calls, "turns": turn})


agent = ShopAgent()
