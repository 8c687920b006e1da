"""
The calculator task (agents/calculator.py) with LangChain: `ChatOpenAI.bind_tools` and LangChain's
tool loop (the AIMessage's `tool_calls` run, each answered by a ToolMessage), trained unchanged.

    pip install -r requirements-extras.txt      # langchain-openai, an optional extra
    python train.py --agent=agents/langchain_tools.py

ChatOpenAI speaks chat completions to the attempt's base URL; the messages go back as
LangChain keeps them, which the capture server sees as the recorded conversation
extended (one segment). A malformed call is LangChain's `invalid_tool_calls` and is
not run. Reward: calculator.score of the final answer (when the model stopped itself).
"""
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from agentrl import ChatAgent, Result
from calculator import calculate, prompts, score  # noqa: F401 (prompts: the same arithmetic questions)
from calculator import calculator as run_calculator

MAX_TURNS = 4
calculator = tool(run_calculator)  # named and described by the function


class LangChainCalculator(ChatAgent):
    async def run(self, ctx):
        llm = ChatOpenAI(model=ctx.model, base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                         **ctx.sampling)
        model = llm.bind_tools([calculator])
        messages, calls = [HumanMessage(ctx.prompt)], 0
        for _ in range(MAX_TURNS):
            reply = await model.ainvoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                break
            calls += len(reply.tool_calls)
            # ToolMessages, by call id
            messages += [await calculator.ainvoke(call) for call in reply.tool_calls]
        stopped = reply.response_metadata.get("finish_reason") == "stop" and not reply.tool_calls
        reward = score(reply.text if stopped else "", stopped, str(calculate(ctx.label)),
                       ctx.sampling.get("max_tokens", 48))
        return Result(reward, {"tool_calls": calls})


agent = LangChainCalculator()
