"""
The shop agent of agents/tool_use_openai.py with the official Anthropic SDK:
tools with `input_schema`, `tool_use` blocks in the reply, and all results
of a turn sent back together as `tool_result` blocks of one user message.

    python train.py --agent=agents/tool_use_anthropic.py

The capture server speaks the Messages API on the same base URL and key as
the OpenAI one. The Messages API needs max_tokens on every request and caps
temperature at 1.0. Task, tools and reward: see agents/tool_use_openai.py.
"""
from anthropic import AsyncAnthropic

from agentrl import ChatAgent, Result
from tool_use_openai import MAX_TURNS, prompts, run_tool, score  # noqa: F401 (prompts: the same shop task)
from tool_use_openai import TOOLS as OPENAI_TOOLS

TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
          "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS]


class ShopAgent(ChatAgent):
    async def run(self, ctx):
        async with AsyncAnthropic(base_url=ctx.base_url, api_key=ctx.api_key,
                                  max_retries=0) as client:
            # the Messages API takes the system prompt apart from the turns
            system = "\n".join(m["content"] for m in ctx.messages if m["role"] == "system")
            messages = [m for m in ctx.messages if m["role"] != "system"]
            # this SDK has no sampling arguments but max_tokens;
            # the server reads temperature and top_p from the body
            kwargs = dict(max_tokens=ctx.sampling.get("max_tokens") or 256,
                          extra_body={k: ctx.sampling[k] for k in ("temperature", "top_p")
                                      if k in ctx.sampling})
            if system:
                kwargs["system"] = system
            looked_up, calls = set(), 0
            for turn in range(1, MAX_TURNS + 1):
                reply = await client.messages.create(model=ctx.model, messages=messages,
                                                     tools=TOOLS, **kwargs)
                # the SDK's blocks, as received
                messages.append({"role": "assistant", "content": reply.content})
                uses = [block for block in reply.content if block.type == "tool_use"]
                if not uses:
                    break
                calls += len(uses)
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use.id,
                     "content": run_tool(use.name, use.input, looked_up)}
                    for use in uses]})
        answer = "" if uses else "".join(block.text for block in reply.content
                                         if block.type == "text")
        return Result(score(answer, ctx.label, looked_up), {"tool_calls": calls, "turns": turn})


agent = ShopAgent()
