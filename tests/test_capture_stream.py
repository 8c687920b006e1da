"""Streaming without an engine: the event writers of all three APIs, vLLM's streaming tool parser and an engine that
fails mid-stream, through the real HTTP server and the official SDKs' stream helpers. A scripted engine writes a
given text a token per step.

    .venv/bin/python -m pytest tests/test_capture_stream.py -q      # seconds: the tokenizer only

A streamed answer must add up to the non-streamed one exactly (text, call names, arguments as the model wrote
them) and record the same trajectory; the real engine's side of this is in tests/test_frameworks.py.
"""
import asyncio
import json

import anthropic
import openai
import pytest

import capture
import protocols
from test_capture_segmenter import CALC, SEARCH

TEXT = "Let me work it out.\n"
CALLS = [("calculator", '{"expression": "(12 + 30) * 7 - 5 / 2 + 1000 * 3"}'),
         ("search", '{"query":"a long query,  with odd   spacing and \\u00fcnicode",  "limit": 10}')]  # as written
SCRIPT = TEXT + "".join('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>\n' % c for c in CALLS)
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (CALC, SEARCH)]
RESPONSES_TOOLS = [dict(type="function", **t["function"]) for t in (CALC, SEARCH)]


class ScriptedEngine:
    """Writes `script` (then <|im_end|>): generate gives the turn at once, stream a token per step; `fail_after`
    tokens into a streamed turn it raises, as an engine whose process died."""

    def __init__(self, tokenizer):
        self.tokenizer, self.script, self.fail_after = tokenizer, SCRIPT, None
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt, sampling, request_id, session_id=None):
        ids = self.tokenizer(self.script, add_special_tokens=False)["input_ids"] + [self.end]
        return dict(token_ids=ids, logprobs=[-0.01 * (i + 1) for i in range(len(ids))], token_versions=[0] * len(ids),
                    routed_experts=None, finish_reason="stop", num_prompt_tokens=len(prompt))

    async def stream(self, prompt, sampling, request_id, session_id=None):
        out = await self.generate(prompt, sampling, request_id)
        for n in range(1, len(out["token_ids"])):
            if n == self.fail_after:
                raise RuntimeError("the engine process died (simulated)")
            yield {"token_ids": out["token_ids"][:n]}
            await asyncio.sleep(0.001)
        yield out


@pytest.fixture(scope="module")
def scripted(tiny_model_path):
    server = capture.CaptureServer(None, tiny_model_path, max_model_len=4096)
    server.backend = engine = ScriptedEngine(server.tokenizer)
    server.start_in_thread()
    yield server, engine
    server.stop_thread()


def clients(server):
    session = server.new_session()
    return session, openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0), \
        anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0)


ASK = [{"role": "user", "content": "Compute, then search."}]


def chat_turn(oa, an, stream, **kw):
    """One turn in chat completions: (text, [(id, name, arguments)], {call index: argument deltas})."""
    if not stream:
        m = oa.chat.completions.create(model="tiny", messages=ASK, tools=[CALC, SEARCH], **kw).choices[0].message
        return m.content or "", [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []], {}
    deltas = {}
    with oa.chat.completions.stream(model="tiny", messages=ASK, tools=[CALC, SEARCH], **kw) as s:
        for event in s:
            if event.type == "tool_calls.function.arguments.delta" and event.arguments_delta:  # not the call's head
                deltas.setdefault(event.index, []).append(event.arguments_delta)
        m = s.get_final_completion().choices[0].message
    return m.content or "", [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []], deltas


def messages_turn(oa, an, stream, **kw):
    kw = dict(model="tiny", max_tokens=256, messages=ASK, tools=ANTHROPIC_TOOLS, **kw)
    deltas = {}
    if not stream:
        content = an.messages.create(**kw).content
    else:
        with an.messages.stream(**kw) as s:
            for event in s:
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    deltas.setdefault(event.index - 1, []).append(event.delta.partial_json)  # block 0 is the text
            content = s.get_final_message().content
    calls = [(b.id, b.name, "".join(deltas.get(i, [])) if stream else json.dumps(b.input))
             for i, b in enumerate(b for b in content if b.type == "tool_use")]
    return "".join(b.text for b in content if b.type == "text"), calls, deltas


def responses_turn(oa, an, stream, **kw):
    kw = dict(model="tiny", input=ASK, tools=RESPONSES_TOOLS, **kw)
    deltas = {}
    if not stream:
        response = oa.responses.create(**kw)
    else:
        with oa.responses.stream(**kw) as s:
            for event in s:
                if event.type == "response.function_call_arguments.delta":
                    deltas.setdefault(event.output_index - 1, []).append(event.delta)  # output 0 is the message
            response = s.get_final_response()
    calls = [(c.call_id, c.name, c.arguments) for c in response.output if c.type == "function_call"]
    return response.output_text, calls, deltas


TURNS = {"chat": chat_turn, "messages": messages_turn, "responses": responses_turn}


@pytest.mark.parametrize("api", TURNS)
def test_streamed_tool_calls_add_up_to_the_answer(scripted, api):
    """Text, then each call's name and its arguments in many pieces, exactly the non-streamed answer's: the
    arguments as the model wrote them (odd spacing and escapes kept); the same trajectory either way."""
    server, _ = scripted
    (plain, oa, an), (streamed, oa_s, an_s) = clients(server), clients(server)
    text, calls, _ = TURNS[api](oa, an, False)
    s_text, s_calls, deltas = TURNS[api](oa_s, an_s, True)
    assert text == s_text == TEXT
    if api == "messages":  # Anthropic gives `input` objects: the streamed pieces are the text they were parsed from
        assert [json.loads(c[2]) for c in s_calls] == [json.loads(c[2]) for c in calls]
        assert [c[2] for c in s_calls] == [c[1] for c in CALLS]
    else:
        assert [c[1:] for c in s_calls] == [c[1:] for c in calls] == CALLS
    assert all(len(deltas[i]) > 3 and "".join(deltas[i]) == CALLS[i][1] for i in range(len(CALLS)))
    # what the next request must echo
    stored = server.sessions[streamed.id].segments[-1].conversation[-1]["tool_calls"]
    assert [c[0] for c in s_calls] == [c["id"] for c in stored]
    a, b = (server.finish_session(s.id, 1.0) for s in (plain, streamed))
    assert [{k: s[k] for k in ("token_ids", "action_mask", "behavior_logprobs", "token_versions")} for s in a] == \
        [{k: s[k] for k in ("token_ids", "action_mask", "behavior_logprobs", "token_versions")} for s in b]


def test_a_forced_call_streams_its_name_first(scripted):
    """tool_choice names the tool: its opening is context, so the name comes in the first delta, the arguments
    after it in pieces (chat completions, raw chunks)."""
    server, engine = scripted
    session, oa, _ = clients(server)
    engine.script = '{"expression": "1 + 2 + 3 + 4 + 5 + 6"}}\n</tool_call>'  # the rest after the forced opening
    try:
        chunks = [c.choices[0].delta for c in oa.chat.completions.create(
            model="tiny", messages=ASK, tools=[CALC, SEARCH], stream=True,
            tool_choice={"type": "function", "function": {"name": "calculator"}}) if c.choices]
    finally:
        engine.script = SCRIPT
    calls = [d.tool_calls[0] for d in chunks if d.tool_calls]
    assert calls[0].id and calls[0].function.name == "calculator" and calls[0].function.arguments == ""
    assert all(c.id is None and c.function.name is None for c in calls[1:]) and len(calls) > 4
    assert "".join(c.function.arguments for c in calls) == '{"expression": "1 + 2 + 3 + 4 + 5 + 6"}'
    assert not any(d.content for d in chunks)
    server.finish_session(session.id, 0.0)


def test_an_engine_failure_mid_stream_ends_each_stream_with_its_error_event(scripted):
    """The text so far has gone out; then chat completions sends an error chunk (the SDK raises it), Messages an
    `error` event (the SDK raises it), Responses `response.failed`; nothing is recorded and the session goes on."""
    server, engine = scripted
    session, oa, an = clients(server)
    engine.fail_after = 6
    try:
        got = []
        with pytest.raises(openai.APIError, match="engine failed on this request"):
            for c in oa.chat.completions.create(model="tiny", messages=ASK, stream=True):
                got += [c.choices[0].delta.content] if c.choices and c.choices[0].delta.content else []
        assert "".join(got) and TEXT.startswith("".join(got))
        with pytest.raises(anthropic.APIStatusError, match="engine failed on this request"):
            with an.messages.stream(model="tiny", max_tokens=64, messages=ASK) as s:
                for _ in s:
                    pass
        events = list(oa.responses.create(model="tiny", input=ASK, stream=True))
        assert events[-1].type == "response.failed" and "engine failed" in events[-1].response.error.message
        assert "response.output_text.delta" in [e.type for e in events]
    finally:
        engine.fail_after = None
    assert session.segment_dicts() == [] and not session.in_flight
    assert oa.chat.completions.create(model="tiny", messages=ASK, tools=[CALC]).choices[0].finish_reason == "tool_calls"
    assert len(server.finish_session(session.id, 1.0)) == 1


def test_stream_deltas_never_take_back_what_was_sent():
    sent = ["", []]
    assert list(protocols.stream_deltas(sent, "Hi", [])) == [("text", "Hi")]
    assert list(protocols.stream_deltas(sent, "Hi there", [("c0", "f", '{"a"')])) == [
        ("text", " there"), ("call", 0, "c0", "f"), ("args", 0, '{"a"')]
    # text after a call began, arguments that do not extend what was sent, and an earlier call's: nothing
    assert list(protocols.stream_deltas(sent, "Hi there!", [("c0", "f", '{"b": 1}')])) == []
    assert list(protocols.stream_deltas(sent, "Hi there", [("c0", "f", '{"a": 1}'), ("c1", "g", "{}")])) == [
        ("args", 0, ': 1}'), ("call", 1, "c1", "g"), ("args", 1, "{}")]
    assert list(protocols.stream_deltas(sent, "Hi there", [("c0", "f", '{"a": 12}'), ("c1", "g", "{}")])) == []
    assert sent == ["Hi there", [["c0", "f", '{"a": 1}'], ["c1", "g", "{}"]]]


def test_a_call_that_turns_out_malformed_was_streamed_as_far_as_it_went(scripted):
    """A stream cannot take back a call it began: the client got the call and its arguments so far, the answer (what
    the session records, and a non-streamed answer) holds the text; the events stay well-formed in each API."""
    server, engine = scripted
    session, oa, an = clients(server)
    engine.script = bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 2 + 3}}\n</tool_call>'
    try:
        chunks = [c.choices[0].delta for c in oa.chat.completions.create(
            model="tiny", messages=ASK, tools=[CALC], stream=True) if c.choices]
        with an.messages.stream(model="tiny", max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS[:1]) as s:
            blocks = [e.content_block.type for e in s if e.type == "content_block_start"]
        events = list(oa.responses.create(model="tiny", input=ASK, tools=RESPONSES_TOOLS[:1], stream=True))
    finally:
        engine.script = SCRIPT
    streamed = "".join(d.tool_calls[0].function.arguments for d in chunks if d.tool_calls)
    assert streamed.startswith('{"expression": 2 + 3}') and not any(d.content for d in chunks)
    assert blocks == ["tool_use"]
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["function_call", "message"]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == bad
    recorded = server.sessions[session.id].segments[-1].conversation[-1]
    assert recorded == {"role": "assistant", "content": bad}
    server.finish_session(session.id, 0.0)


def test_a_streamed_retry_gets_the_stored_answer_whole(scripted):
    """A client's retry (x-stainless-retry-count) of a streamed turn: the stored answer, the same calls and ids, in
    the same events; nothing more is recorded."""
    server, _ = scripted
    session, oa, an = clients(server)
    first = chat_turn(oa, an, True)
    again = chat_turn(oa, an, True, extra_headers={"x-stainless-retry-count": "1"})
    assert first[:2] == again[:2] and [c[1:] for c in first[1]] == CALLS
    assert [len(d) for d in again[2].values()] == [1, 1]  # each call's arguments in one piece: nothing to sample
    assert len(server.finish_session(session.id, 1.0)) == 1
