"""
On-policy distillation: the student (the policy) writes; a frozen teacher scores every
token the student sampled, and each token's reward is log p_teacher(x_t) - log
p_student(x_t) (loss.distill_token_rewards; its expectation over the student's samples is
minus the reverse KL, so the student moves toward what the teacher would have written).

    python train.py --agent=agents/distill.py --advantage_estimator=distill   # dense: an advantage per token
    python train.py --agent=agents/distill.py                                 # GRPO on the mean log-ratio

After its turns, the agent reads back its own recorded segments from the capture
server (GET /sessions/ID with the attempt's key: the exact token ids, masks and
sampling logprobs) and has the teacher (a FrozenModel, started by `setup(cfg)`)
compute prompt logprobs over each segment's token ids in one prefill.

What it returns:
    Result.info["teacher_logprobs"]  one list per recorded segment, in segment_index order, aligned with that
                                     segment's token_ids: entry t is log p_teacher(token_ids[t] | token_ids[:t])
                                     (0.0 at t = 0). With advantage_estimator="distill" the trainer's per-token
                                     advantage on mask-1 tokens is teacher_logprobs[t] - behavior_logprobs[t].
    Result.reward                    the mean of that log-ratio over the student's tokens (a sequence-level reward
                                     the other estimators can use), and info["reverse_kl"] its negative.

The teacher must share the student's tokenizer (token-level distillation), and the student must
sample at temperature 1: the behavior logprobs are those of the sampling distribution, the
teacher's of its plain softmax. TEACHER_MODEL names the teacher; left empty it is the policy's
starting weights, as in the tests (where the log-ratio starts near 0, up to bf16 noise).
"""
import random

import httpx
from openai import AsyncOpenAI

from agentrl import ChatAgent, Result
from frozen import FrozenModel

TEACHER_MODEL = ""  # an HF model directory with the student's
                    # tokenizer; "" = the policy's starting weights
TOPICS = ["the sea", "a lighthouse", "autumn leaves", "a train at night", "bread", "an old map",
          "snow", "a violin"]

teacher = None  # the FrozenModel, once setup() has run


def setup(cfg):
    global teacher
    if cfg.get("temperature", 1.0) != 1.0:
        raise ValueError("on-policy distillation compares the student's sampling logprobs with "
                         "the teacher's "
                         "temperature-1 logprobs: run it at temperature=1.0, not "
                         f"{cfg['temperature']}")
    teacher = FrozenModel(TEACHER_MODEL or cfg["model_path"],
                          max_model_len=cfg["engine_max_model_len"],
                          memory_fraction=cfg["engine_memory_fraction"], name="teacher").start()
    return teacher.close


def prompts(seed=0):
    rng = random.Random(seed)
    while True:
        yield {"prompt": f"Write one sentence about {rng.choice(TOPICS)}."}


async def recorded_segments(ctx):
    """This attempt's segments as the capture server recorded them so far (token_ids, action_mask,
    behavior_logprobs, ...). The attempt's base URL is <server>/s/<session id>/v1."""
    server, rest = ctx.base_url.rsplit("/s/", 1)
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{server}/sessions/{rest.split('/')[0]}",
                                  headers={"x-api-key": ctx.api_key})
        response.raise_for_status()
        return response.json()


class Distill(ChatAgent):
    async def run(self, ctx):
        if teacher is None:
            raise RuntimeError(
                "the teacher is not running: the framework calls this module's setup(cfg) before "
                "the "
                "first attempt (agentrl.setup_agent)")
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=ctx.messages,
                                                 **ctx.sampling)
        teacher_logprobs, log_ratio = [], []
        for segment in await recorded_segments(ctx):  # in segment_index order
            # one prefill over the whole segment
            scored = await teacher.prompt_logprobs(segment["token_ids"])
            teacher_logprobs.append([0.0 if lp is None else lp for lp in scored])
            log_ratio += [t - s for t, s,
                          m in zip(teacher_logprobs[-1], segment["behavior_logprobs"],
                                                   segment["action_mask"]) if m]
        reward = sum(log_ratio) / max(1, len(log_ratio))
        return Result(reward, {"teacher_logprobs": teacher_logprobs, "reverse_kl": -reward})


agent = Distill()
