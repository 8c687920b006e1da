"""
A long-horizon agent that compacts its context: it has the model summarise the
conversation so far, then replaces the old turns with that summary and carries on.

    python train.py --agent=agents/compaction.py

The game: the user reads out NUMBERS numbers, one per turn, and the model keeps a running total.
Every COMPACT_EVERY numbers the agent asks for a one-line summary (one more turn on the same
conversation), then starts over from the task plus the summary. The capture server sees a request
that no longer extends the recorded tokens, seals the segment and opens a new one: with 6 numbers
compacted every 2, an attempt has 3 segments. They share the attempt's id and its reward, and the
group estimators count the attempt once however many segments it has (loss.segment_advantages).

Reward in [0, 1] on the final answer ("What is the total?"):
    1.0                                the last number in it is the total
    else 0.4 * close + 0.2 * concise   close: 1 - |number - total| / total (0 without a number);
                                       concise: 1 - len(answer) / (4 * max_tokens), 0 when empty
"""
import random
import re

from openai import AsyncOpenAI

from agentrl import ChatAgent, Result

NUMBERS, COMPACT_EVERY = 6, 2
SUMMARISE = "Summarise the game so far in one line: the numbers you were told and the running total."


def prompts(seed=0):
    rng = random.Random(seed)
    while True:
        yield {"prompt": f"Let's play a counting game. I will tell you {NUMBERS} numbers, one at a "
                         "time. Keep a running total; at the end I will ask for it.",
               "label": [rng.randint(1, 20) for _ in range(NUMBERS)]}


def score(answer, total, max_tokens):
    answer = answer.strip()
    numbers = re.findall(r"-?\d+", answer)
    if numbers and int(numbers[-1]) == total:
        return 1.0
    close = max(0.0, 1.0 - abs(int(numbers[-1]) - total) / total) if numbers else 0.0
    concise = max(0.0, 1.0 - len(answer) / (4 * max_tokens)) if answer else 0.0
    return 0.4 * close + 0.2 * concise


class CompactingAgent(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:

            async def turn(messages):
                response = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                **ctx.sampling)
                # sent back exactly as received
                return response.choices[0].message.model_dump(exclude_none=True)

            task = list(ctx.messages)
            messages, compactions = list(task), 0
            for i, number in enumerate(ctx.label, 1):
                messages.append({"role": "user", "content": f"Number {i}: {number}"})
                messages.append(await turn(messages))
                if i % COMPACT_EVERY == 0 and i < len(ctx.label):
                    messages.append({"role": "user", "content": SUMMARISE})
                    summary = (await turn(messages)).get("content") or ""
                    # the rewrite: old turns out, the summary
                    # in. The next request opens a new segment.
                    messages = task + [
                        {"role": "user",
                         "content": f"Your notes from earlier turns: {summary.strip()}"}]
                    compactions += 1
            messages.append({"role": "user",
                             "content": "What is the total? Answer with the number only."})
            answer = (await turn(messages)).get("content") or ""
        reward = score(answer, sum(ctx.label), ctx.sampling.get("max_tokens") or 48)
        return Result(reward, {"compactions": compactions})


agent = CompactingAgent()
