"""
An `Env` example: a short arithmetic quiz, played Gymnasium-style. The framework
drives the model through the capture server (agentrl.run_env): `reset` gives the
opening messages, each model reply goes to `step`, which returns the next observation,
the step's reward and whether the episode is over. The attempt's reward is the sum.

    python train.py --agent=agents/arithmetic_env.py

The label is the list of problems (so a data set can fix them). Each problem answered with exactly
its value earns 1 / len(problems); a bare integer that is wrong earns a tenth of that (the format
is right). After each answer the environment says whether it was right and asks the next problem.
"""
import random
import re

from agentrl import Env
from calculator import calculate


def prompts(seed=0):
    rng = random.Random(seed)
    while True:
        yield {"prompt": "Answer each arithmetic problem with the number only.",
               "label": [f"{rng.randint(1, 20)} {rng.choice('+-*')} {rng.randint(1, 20)}"
                         for _ in range(3)]}


class ArithmeticQuiz(Env):
    max_turns = 10  # the episode normally ends when the problems do

    async def reset(self, ctx):
        self.problems = [str(p) for p in ctx.label]
        # a bad label fails here, before the model runs
        self.answers = [calculate(p) for p in self.problems]
        self.index = 0
        intro = ctx.prompt or "Answer each arithmetic problem with the number only."
        first = f"{intro}\n\nProblem 1: {self.problems[0]} = ?"
        return [{"role": "user", "content": first}]

    async def step(self, action):
        answer, expected = action.strip(), self.answers[self.index]
        share = 1.0 / len(self.problems)
        if re.fullmatch(r"-?\d+", answer):
            reward = share if int(answer) == expected else 0.1 * share
        else:
            reward = 0.0
        verdict = "Correct." if reward == share else f"Not quite: {self.problems[self.index]} = {expected}."
        self.index += 1
        done = self.index == len(self.problems)
        observation = verdict if done else f"{verdict}\nProblem {self.index + 1}: {self.problems[self.index]} = ?"
        return observation, reward, done, {"correct": reward == share}


agent = ArithmeticQuiz
