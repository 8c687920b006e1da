"""
A lead agent with two sub-agents as its tools (the OpenAI Agents SDK's `Agent.as_tool`, unchanged),
on the calculator task's questions (agents/calculator.py): the lead asks a `solver` (which has the
calculator tool) and a `checker` (which works the question out alone), then answers with the
number. The SDK runs the two sub-agents at once when the lead calls both in one turn.

    pip install -r requirements-extras.txt      # openai-agents, an optional extra
    python train.py --agent=agents/subagents.py

One attempt, three conversations on one session: the capture server records one segment per
conversation (each holding all of that conversation's turns), each sub-agent's under the lead's
segment (its `parent`), so an attempt is a tree (the viewer shows it); every segment shares the
attempt's reward. Reward: calculator.score of the lead's final output against the expression's
value (as agents/agents_sdk.py); a run the SDK cannot finish scores 0 and its recorded turns still
train.
"""
from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

from agentrl import ChatAgent, Result
from calculator import calculate, prompts, score  # noqa: F401 (prompts: the same questions)
from calculator import calculator as run_calculator

MAX_TURNS, SUB_TURNS = 4, 3
LEAD = "Ask the solver and the checker, then answer with the number only."
SOLVER = "Compute the expression with the calculator; reply with the number."
CHECKER = "Work the expression out yourself; reply with the number only."
set_tracing_disabled(True)
calculator = function_tool(run_calculator)


class LeadWithSubAgents(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            def agent(name, instructions, tools=()):
                return Agent(name=name, instructions=instructions, tools=list(tools),
                             model=OpenAIResponsesModel(model=ctx.model, openai_client=client),
                             model_settings=ModelSettings(**ctx.sampling))
            solver, checker = agent("solver", SOLVER, [calculator]), agent("checker", CHECKER)
            lead = agent("lead", LEAD, [
                solver.as_tool("solver", "Computes an arithmetic expression.", max_turns=SUB_TURNS),
                checker.as_tool("checker", "Checks an arithmetic expression.", max_turns=SUB_TURNS),
            ])
            try:
                result = await Runner.run(lead, ctx.prompt, max_turns=MAX_TURNS)
            except AgentsException as e:  # ModelBehaviorError, MaxTurnsExceeded
                return Result(0.0, {"finished": 0.0, "error_" + type(e).__name__: 1.0})
        asked = sum(item.type == "tool_call_item" for item in result.new_items)
        reward = score(str(result.final_output), True, str(calculate(ctx.label)),
                       ctx.sampling.get("max_tokens", 48))
        return Result(reward, {"finished": 1.0, "sub_agent_calls": asked})


agent = LeadWithSubAgents()
