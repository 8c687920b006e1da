"""
LLM-as-judge reward: the policy answers a question; a second, frozen
model on its own engine reads the question, the reference answer and the
reply, and writes "Score: N" (0-10), parsed into the reward in [0, 1].

    python train.py --agent=agents/judge.py

The judge is a FrozenModel (agents/frozen.py): its own vLLM engine behind its own capture server,
started by this module's `setup(cfg)`, which the framework calls once before the first attempt.
JUDGE_MODEL names its weights; left empty it is a frozen copy of the policy's starting weights
(cfg["model_path"]), which is what the tests use. The judge samples greedily, so one answer always
gets one score. Its sessions are dropped after each verdict: nothing the judge writes is trained on.

Parsing: the number after "score" if there is one, else the first number;
"N/D" is read as a fraction of D, a bare number as a fraction of 10; clamped
to [0, 1]. A verdict without a number scores 0 (and counts in `judge_parsed`).
"""
import random
import re

from openai import AsyncOpenAI

from agentrl import ChatAgent, Result
from frozen import FrozenModel

JUDGE_MODEL = ""  # an HF model directory; "" = the policy's starting weights
JUDGE_MAX_TOKENS = 16
JUDGE_PROMPT = """Grade the answer to the question against the reference answer.
Question: {question}
Reference answer: {reference}
Answer: {answer}
Reply with "Score: N", where N goes from 0 (wrong) to 10 (correct and complete)."""

QUESTIONS = [("What is the capital of France?", "Paris"),
             ("How many legs does a spider have?", "8"),
             ("Who wrote Hamlet?", "William Shakespeare"),
             ("What is the largest planet?", "Jupiter"),
             ("What gas do plants take in to make sugar?", "carbon dioxide"),
             ("How many days are in a week?", "7"),
             ("At what temperature in Celsius does water boil at sea level?", "100"),
             ("What colour do you get by mixing blue and yellow?", "green")]

judge = None  # the FrozenModel, once setup() has run


def setup(cfg):
    """Start the judge's engine (once per run); the
    framework calls the returned function at the end."""
    global judge
    judge = FrozenModel(JUDGE_MODEL or cfg["model_path"], max_model_len=cfg["engine_max_model_len"],
                        memory_fraction=cfg["engine_memory_fraction"], name="judge").start()
    return judge.close


def prompts(seed=0):
    rng = random.Random(seed)
    while True:
        question, reference = rng.choice(QUESTIONS)
        yield {"prompt": question + " Answer in a few words.", "label": reference}


NUMBER = r"(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?"


def parse_score(verdict):
    """The judge's text -> (score in [0, 1], whether a number was found)."""
    match = re.search(r"score\s*[:=]?\s*" + NUMBER, verdict,
                      re.IGNORECASE) or re.search(NUMBER, verdict)
    if match is None:
        return 0.0, False
    value, scale = float(match.group(1)), float(match.group(2) or 10)
    return (min(1.0, max(0.0, value / scale)) if scale > 0 else 0.0), True


class JudgedAnswer(ChatAgent):
    async def run(self, ctx):
        if judge is None:
            raise RuntimeError(
                "the judge is not running: the framework calls this module's setup(cfg) before the "
                "first attempt (agentrl.setup_agent)")
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            response = await client.chat.completions.create(model=ctx.model, messages=ctx.messages,
                                                            **ctx.sampling)
        answer = response.choices[0].message.content or ""
        question = ctx.prompt or ctx.messages[-1]["content"]
        async with judge.client() as judge_client:
            verdict = await judge_client.chat.completions.create(
                model="judge", temperature=0.0, max_tokens=JUDGE_MAX_TOKENS,
                messages=[{"role": "user", "content": (
                    JUDGE_PROMPT.format(question=question, reference=ctx.label,
                                        answer=answer.strip()))}])
        score, parsed = parse_score(verdict.choices[0].message.content or "")
        return Result(score, {"judge_parsed": float(parsed)})


agent = JudgedAnswer()
