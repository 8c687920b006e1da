"""The Qwen3.5 / Qwen3.6 conversation format without an engine: XML tool calls (vLLM's qwen3_coder parser, picked from
the chat template), `<think>` reasoning on by default and dropped from turns before the last user query, through the
real HTTP server and the official SDKs, streamed and not, in all three protocols. A scripted engine writes given
turns a token per step; the real engine's side is in tests/test_hybrid_engine.py.

    .venv/bin/python -m pytest tests/test_qwen35_format.py -q      # seconds: the tokenizer only

Each answer must put the reasoning where its protocol expects it (chat completions `reasoning_content`, Responses
reasoning items, Anthropic thinking blocks), the call's XML parameters typed by the tool's schema, and record the
turn's tokens as generated; a tool loop stays one segment, a new user query (which drops earlier reasoning) opens one.
"""
import asyncio

import anthropic
import openai
import pytest

import capture
import protocols
import tiny

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}, "digits": {"type": "integer"}},
    "required": ["expression"]}}}
CALL = ("<tool_call>\n<function=calculator>\n<parameter=expression>\n2 + 3\n</parameter>\n<parameter=digits>\n2\n"
        "</parameter>\n</function>\n</tool_call>")
TURNS = ["Add them.\n</think>\n\nI will call it.\n\n" + CALL, "It is five.\n</think>\n\nThe answer is 5.",
         "Same again.\n</think>\n\n6."]
ARGS = '{"expression": "2 + 3", "digits": 2}'  # digits typed by the schema (XML parameters are text)


class ScriptedEngine:
    """Writes the next scripted turn (then <|im_end|>): generate at once, stream a token per step; records prompts."""

    def __init__(self, tokenizer):
        self.tokenizer, self.turns, self.prompts = tokenizer, [], []
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt, sampling, request_id, session_id=None):
        self.prompts.append(list(prompt))
        ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"] + [self.end]
        return dict(token_ids=ids, logprobs=[-0.01 * (i + 1) for i in range(len(ids))], token_versions=[0] * len(ids),
                    routed_experts=None, finish_reason="stop", num_prompt_tokens=len(prompt))

    async def stream(self, prompt, sampling, request_id, session_id=None):
        out = await self.generate(prompt, sampling, request_id, session_id)
        for n in range(1, len(out["token_ids"])):
            yield {"token_ids": out["token_ids"][:n]}
            await asyncio.sleep(0.001)
        yield out


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen35-tokenizer"))
    tiny.build_tokenizer(path, 2048, chat_template=tiny.QWEN35_CHAT_TEMPLATE)
    server = capture.CaptureServer(None, path, max_model_len=4096)
    server.backend = engine = ScriptedEngine(server.tokenizer)
    server.start_in_thread()
    yield server, engine
    server.stop_thread()


def test_the_tool_parser_follows_the_chat_template(scripted, tiny_model_path):
    server, _ = scripted
    assert server.tool_parser_name == "qwen3_coder" and server.closed_reasoning == "\n</think>\n\n"
    qwen3 = capture.CaptureServer(None, tiny_model_path)  # Hermes JSON calls, no reasoning in its generation prompt
    assert qwen3.tool_parser_name == "hermes" and qwen3.closed_reasoning == ""
    qwen3.socket.close()


def test_split_reasoning():
    assert protocols.split_reasoning("a\nb\n</think>\n\nc", "<tool_call>") == ("a\nb", "c")
    assert protocols.split_reasoning("a <tool_call>x", "<tool_call>") == ("a", "<tool_call>x")  # a call ends it too
    assert protocols.split_reasoning("still thinking\n", "<tool_call>") == ("still thinking", "")


def chat(client, messages, stream):
    """One chat completion as the assistant message the agent keeps (streamed deltas added up)."""
    if not stream:
        return client.chat.completions.create(model="m", messages=messages, tools=[CALC]).choices[0].message.model_dump(
            exclude_none=True)
    m, calls = {"role": "assistant", "content": "", "reasoning_content": ""}, {}
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=[CALC], stream=True):
        d = chunk.choices[0].delta.model_dump(exclude_none=True) if chunk.choices else {}
        m["content"] += d.get("content") or ""
        m["reasoning_content"] += d.get("reasoning_content") or ""
        for c in d.get("tool_calls") or []:
            call = calls.setdefault(c["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] += c.get("id") or ""
            for k in ("name", "arguments"):
                call["function"][k] += (c.get("function") or {}).get(k) or ""
    return dict(m, **({"tool_calls": [calls[i] for i in sorted(calls)]} if calls else {}))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_tool_loop_reasoning_and_segments(scripted, stream):
    server, engine = scripted
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    engine.turns[:] = list(TURNS)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = chat(client, messages, stream)
    assert (first["reasoning_content"], first["content"]) == ("Add them.", "I will call it.")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in first["tool_calls"]] == [("calculator", ARGS)]
    messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "5"}]
    second = chat(client, messages, stream)
    assert (second["reasoning_content"], second["content"]) == ("It is five.", "The answer is 5.")
    messages += [second, {"role": "user", "content": "And 3 + 3?"}]
    third = chat(client, messages, stream)
    assert (third["reasoning_content"], third["content"]) == ("Same again.", "6.")
    segments = server.finish_session(session.id, 1.0)
    # the tool loop extends one segment (its reasoning stays shown); the new query drops it: a rewrite, a new segment
    assert len(segments) == 2
    decode = server.tokenizer.decode
    for segment, turns in zip(segments, (TURNS[:2], TURNS[2:])):
        runs, ids = [], segment["token_ids"]
        for i, m in enumerate(segment["action_mask"]):
            if m and (i == 0 or not segment["action_mask"][i - 1]):
                runs.append([])
            if m:
                runs[-1].append(ids[i])
        assert [decode(r) for r in runs] == [t + "<|im_end|>" for t in turns]  # reasoning recorded as generated
    assert "Add them." in decode(segments[0]["token_ids"]) and "Add them." not in decode(segments[1]["token_ids"])
    # the second segment is the template's own full render of the conversation (earlier reasoning dropped)
    full = server.render(messages, [CALC], True)
    assert segments[1]["token_ids"][:len(full)] == full


def test_anthropic_thinking_blocks_streamed_and_not(scripted):
    server, engine = scripted
    session = server.new_session()
    client = anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    tools = [{"name": "calculator", "input_schema": CALC["function"]["parameters"]}]
    engine.turns[:] = [TURNS[0], TURNS[0], TURNS[1]]
    ask = dict(model="m", max_tokens=200, tools=tools, messages=[{"role": "user", "content": "What is 2 + 3?"}])
    answer = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        kinds = {e.type for e in stream}
        streamed = stream.get_final_message()
    assert "thinking" in kinds  # thinking deltas as they came
    for message in (answer, streamed):
        blocks = message.content
        assert [b.type for b in blocks] == ["thinking", "text", "tool_use"]
        assert (blocks[0].thinking, blocks[1].text, blocks[2].input) == ("Add them.", "I will call it.",
                                                                          {"expression": "2 + 3", "digits": 2})
    # the thinking block sent back extends the recorded turn: one segment holds both turns
    followup = client.messages.create(**dict(ask, messages=ask["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in streamed.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": streamed.content[2].id, "content": "5"}]}]))
    assert [b.type for b in followup.content] == ["thinking", "text"]
    assert len(server.finish_session(session.id, 0.0)) == 2  # the first question's own segment, then the extended one


def test_responses_reasoning_items_streamed_and_not(scripted):
    server, engine = scripted
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    tools = [dict(type="function", **CALC["function"])]
    engine.turns[:] = [TURNS[0], TURNS[0], TURNS[1]]
    answer = client.responses.create(model="m", input="What is 2 + 3?", tools=tools)
    with client.responses.stream(model="m", input="What is 2 + 3?", tools=tools) as stream:
        kinds = {e.type for e in stream}
        streamed = stream.get_final_response()
    assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= kinds
    for response in (answer, streamed):
        out = response.output
        assert [o.type for o in out] == ["reasoning", "message", "function_call"]
        assert (out[0].content[0].text, out[1].content[0].text, out[2].arguments) == ("Add them.", "I will call it.",
                                                                                       ARGS)
        assert response.usage.output_tokens_details.reasoning_tokens == len(
            server.tokenizer("Add them.\n", add_special_tokens=False)["input_ids"])
    # its items sent back (the reasoning item first) extend the recorded turn
    again = client.responses.create(model="m", tools=tools, input=[{"role": "user", "content": "What is 2 + 3?"}] + [
        o.model_dump(exclude_none=True) for o in streamed.output] + [
        {"type": "function_call_output", "call_id": streamed.output[2].call_id, "output": "5"}])
    assert [o.type for o in again.output] == ["reasoning", "message"]
    assert len(server.finish_session(session.id, 0.0)) == 2


def test_forced_calls_and_structured_output_in_this_format(scripted):
    server, engine = scripted
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    decode = server.tokenizer.decode
    user = [{"role": "user", "content": "hi"}]
    # a named call: the template's empty reasoning and the call up to its first parameter are context
    engine.turns[:] = [CALL[CALL.index("<parameter="):]]
    named = client.chat.completions.create(model="m", messages=user, tools=[CALC], tool_choice={
        "type": "function", "function": {"name": "calculator"}}).choices[0].message
    assert decode(engine.prompts[-1]).endswith("<think>\n\n</think>\n\n<tool_call>\n<function=calculator>\n")
    assert (named.tool_calls[0].function.name, named.tool_calls[0].function.arguments) == ("calculator", ARGS)
    engine.turns[:] = [CALL[CALL.index("calculator>"):]]  # "required": the model names the tool
    required = client.chat.completions.create(model="m", messages=user, tools=[CALC], tool_choice="required")
    assert required.choices[0].message.tool_calls[0].function.arguments == ARGS
    # structured output samples after the template's empty reasoning: the JSON is the content
    engine.turns[:] = ['{"a": 1}']
    structured = client.chat.completions.create(model="m", messages=user, response_format={"type": "json_object"})
    assert decode(engine.prompts[-1]).endswith("<think>\n\n</think>\n\n")
    assert structured.choices[0].message.content == '{"a": 1}'
    # Anthropic's thinking "disabled" closes reasoning the same way; no thinking block comes back
    engine.turns[:] = ["Plain."]
    plain = anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0).messages.create(
        model="m", max_tokens=20, messages=user, thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"] and decode(engine.prompts[-1]).endswith("</think>\n\n")


def test_arguments_that_are_no_json_object_are_refused(scripted):
    server, _ = scripted
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    bad = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "calculator", "arguments": "[1, 2]"}}]}
    with pytest.raises(openai.BadRequestError, match="not a JSON object"):
        client.chat.completions.create(model="m", tools=[CALC], messages=[
            {"role": "user", "content": "hi"}, bad, {"role": "tool", "tool_call_id": "c1", "content": "3"}])
