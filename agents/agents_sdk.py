"""
The calculator task (agents/calculator.py) as an OpenAI Agents SDK agent: an `Agent` with a
function tool, run by `Runner` on the SDK's default path (the Responses API), trained unchanged.

    pip install -r requirements-extras.txt      # openai-agents, an optional extra
    python train.py --agent=agents/agents_sdk.py

The SDK talks to the capture server through the AsyncOpenAI client it is given (the attempt's
base URL and key); tracing is off (it would export to OpenAI). `import agents` here is the
SDK: this project's agents/ folder is not a package. The SDK raises on a run it cannot finish
(a turn cut by max_tokens comes back "incomplete": a ModelBehaviorError; too many turns:
MaxTurnsExceeded); such a run scores 0, and its recorded turns train the model towards runs
that finish. Reward: calculator.score of the final output against the expression's value.
"""
from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

from agentrl import ChatAgent, Result
from calculator import calculate, prompts, score  # noqa: F401 (prompts: the same arithmetic questions)
from calculator import calculator as run_calculator

MAX_TURNS = 4
set_tracing_disabled(True)
calculator = function_tool(run_calculator)  # named and described by the function


class SDKCalculator(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            agent = Agent(name="calculator",
                          instructions="Use the calculator, then answer with the number only.",
                          tools=[calculator],
                          model=OpenAIResponsesModel(model=ctx.model, openai_client=client),
                          model_settings=ModelSettings(**ctx.sampling))
            try:
                result = await Runner.run(agent, ctx.prompt, max_turns=MAX_TURNS)
            except AgentsException as e:  # ModelBehaviorError, MaxTurnsExceeded
                return Result(0.0, {"finished": 0.0, "error_" + type(e).__name__: 1.0})
        calls = sum(item.type == "tool_call_item" for item in result.new_items)
        reward = score(str(result.final_output), True, str(calculate(ctx.label)),
                       ctx.sampling.get("max_tokens", 48))
        return Result(reward, {"finished": 1.0, "tool_calls": calls})


agent = SDKCalculator()
