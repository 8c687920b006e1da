"""Agents as people write them, against the real capture server and the shared vLLM engine actor: the Responses API,
forced tool calls, structured output, logprobs, token counting, retries, and the agent frameworks (the OpenAI Agents
SDK, LangChain, pydantic-ai, smolagents) as installed from requirements-extras.txt (their tests skip without them).

    .venv/bin/python -m pytest tests/test_frameworks.py -q      # ~1-2 minutes on 2 cores (one engine, shared)

Every test checks the recorded trajectory: each mask-1 run is exactly what the engine returned (token identity),
and a conversation that extends the recorded one stays one segment. The random tiny model almost never writes a
valid tool call, so where a test needs one the wrapper forces the text of that turn (scored by the engine's own
prompt logprobs); with a forced tool_choice the server has already put the call's opening in the context, and the
forced text is the rest of the call.
"""
import asyncio
import importlib.util
import json
import math
import os
import time

from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
import ray

import capture
import protocols
import rollout
from agentrl import Context, load_agent
from conftest import RecordingBackend
from test_capture import TOOLS, check_token_identity

MAX_MODEL_LEN = 1024


class ActorEngine:
    """The shared engine actor with the in-process Engine's interface that RecordingBackend wraps."""

    def __init__(self, actor):
        self.router, self.actor = rollout.Router([actor]), actor
        self.policy_version = ray.get(actor.__ray_call__.remote(lambda engine: engine.policy_version))

    async def generate(self, prompt, sampling, request_id, session_id=None, images=None):
        return await self.router.generate(prompt, sampling, request_id, session_id=session_id, images=images)

    async def stream(self, prompt, sampling, request_id, session_id=None, images=None):
        async for out in self.router.stream(prompt, sampling, request_id, session_id=session_id, images=images):
            yield out

    async def prompt_logprobs(self, token_ids, images=None):
        return await self.actor.prompt_logprobs.remote(token_ids, images)


@pytest.fixture(scope="module")
def stack(rollout_engine, tiny_model_path):
    server = capture.CaptureServer(None, tiny_model_path, max_model_len=MAX_MODEL_LEN)
    server.backend = recorder = RecordingBackend(ActorEngine(rollout_engine), server.tokenizer)
    server.start_in_thread()
    yield server, recorder
    server.stop_thread()


def finish(server, recorder, session, segments=1):
    """End the attempt; check token identity and the number of segments; return the segments."""
    recorded = server.finish_session(session.id, 1.0)
    check_token_identity(recorded, recorder.of(session.id))
    assert len(recorded) == segments, [s["segment_index"] for s in recorded]
    return recorded


def call_text(name, arguments, opened=None):
    """The Hermes text of one call; `opened`: the part after the opening the server forced ("name" or "arguments")."""
    text = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, json.dumps(arguments))
    return {None: text, "name": text.split('"name": "', 1)[1], "arguments": text.split('"arguments": ', 1)[1]}[opened]


def installed(name):
    return pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} is an optional extra "
                                                                            "(pip install -r requirements-extras.txt)")


# --- the protocols: forced calls, structured output, logprobs, counting, retries


def test_forced_tool_calls_put_the_opening_in_context(stack):
    server, recorder = stack
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    recorder.forced[session.id] = [call_text("calculator", {"expression": "2 + 3"}, "arguments")]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=16,
                                           tool_choice={"type": "function", "function": {"name": "calculator"}},
                                           parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {"expression": "2 + 3"}
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    # "required": the model itself names the tool after the opening (sampled here: any text it writes comes back)
    client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8, tool_choice="required")
    (segment,) = finish(server, recorder, session)
    tok = server.tokenizer
    first, second = recorder.of(session.id)
    assert tok.decode(first["prompt"]).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": ')
    assert tok.decode(second["prompt"]).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')
    opening = len(tok('<tool_call>\n{"name": "', add_special_tokens=False)["input_ids"])
    assert segment["action_mask"][len(second["prompt"]) - opening:len(second["prompt"])] == [0] * opening
    # Anthropic: {"type": "any"} and {"type": "tool"}, the same way
    session = server.new_session()
    client = anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    recorder.forced[session.id] = [call_text("calculator", {"expression": "4 * 5"}, "name")]
    tools = [{"name": "calculator", "input_schema": TOOLS[0]["function"]["parameters"]}]
    reply = client.messages.create(model="tiny", max_tokens=16, tools=tools, tool_choice={"type": "any"},
                                   messages=[{"role": "user", "content": "4 * 5?"}])
    assert reply.stop_reason == "tool_use" and reply.content[-1].input == {"expression": "4 * 5"}
    follow = [{"role": "user", "content": "4 * 5?"}, {"role": "assistant", "content": reply.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": reply.content[-1].id, "content": "oops",
                                            "is_error": True}]}]
    client.messages.create(model="tiny", max_tokens=6, tools=tools, messages=follow,
                           tool_choice={"type": "tool", "name": "calculator"})
    (segment,) = finish(server, recorder, session)
    assert "<tool_response>\nError: oops\n</tool_response>" in tok.decode(segment["token_ids"])


def test_tool_choice_none_and_parallel_false_reach_the_engine(tiny_model_path):
    from test_capture_segmenter import CALC, FakeBackend
    server = capture.CaptureServer(None, tiny_model_path)
    server.backend = FakeBackend(server.tokenizer)
    start, end = server.tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [CALC]}
    for extra, bias, stops in [({}, None, False), ({"tool_choice": "none"}, {start: -100}, False),
                               ({"parallel_tool_calls": False}, None, True)]:
        asyncio.run(server.respond(server.new_session(), protocols.parse_openai(dict(body, **extra), server)))
        sampling = server.backend.calls[-1]["sampling"]
        assert sampling.get("logit_bias") == bias and (end in sampling["stop_token_ids"]) == stops
    asyncio.run(server.stop())


def test_call_grammars_take_over_where_the_prompt_ends(tiny_model_path):
    """What each kind of turn is sampled under, run by xgrammar's matcher on the tiny tokenizer as the engine runs it:
    a forced call (named, or any tool) from the end of its opening to the end of one call, then only the end of the
    turn; under "auto" free text, and a call to a strict tool fitting its schema (a non-strict tool's: any JSON); with
    a response format, the answer or a call; numbers without bounds get JSON's exact range. The grammar follows the
    tool parser's format: the same schema serves Qwen3.5's XML calls. With constrained_tokens "mask" only what the
    grammar constrained leaves the loss."""
    import xgrammar
    from test_capture_segmenter import CALC, FakeBackend
    server = capture.CaptureServer(None, tiny_model_path)
    server.backend, tok = FakeBackend(server.tokenizer), server.tokenizer
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, stop_token_ids=server.end_ids))
    record = {"type": "function", "function": READING}
    args = '{"count": 3, "share": 0.5, "unit": "km", "exact": true}'

    def grammar(tools=(CALC, record), **body):
        body = dict(messages=[{"role": "user", "content": "x"}], tools=list(tools), **body)
        asyncio.run(server.respond(server.new_session(), protocols.parse_openai(body, server)))
        return server.backend.calls[-1]["sampling"]

    def accepts(sampling, *texts):  # each text in turn, the last then ending the turn
        m = xgrammar.GrammarMatcher(compiler.compile_structural_tag(sampling["structured"]["structural_tag"]))
        return all(m.accept_token(t) for text in texts for t in tok(text, add_special_tokens=False)["input_ids"]) \
            and m.accept_token(server.end_ids[0])
    named = grammar(tool_choice={"type": "function", "function": {"name": "record"}})
    assert accepts(named, args + "}\n</tool_call>") and not accepts(named, args.replace("km", "mi") + "}\n</tool_call>")
    assert not accepts(named, '{"count": 3}}\n</tool_call>')  # required fields
    assert not accepts(named, args.replace("3", "12345678901234567") + "}\n</tool_call>")  # beyond 2**53 - 1
    assert not accepts(named, args + "}\n</tool_call>", "<tool_call>")  # one call, then the turn ends
    any_tool = grammar(tool_choice="required")
    assert accepts(any_tool, 'record", "arguments": ' + args + "}\n</tool_call>")
    assert accepts(any_tool, 'calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>')
    assert not accepts(any_tool, 'search", "arguments": {}}\n</tool_call>')
    strict = grammar(tools=[CALC, dict(record, function=dict(READING, strict=True))], parallel_tool_calls=False)
    assert tok.convert_tokens_to_ids("</tool_call>") not in strict["stop_token_ids"]  # the grammar ends the turn
    call = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
    assert accepts(strict, "Some text. ", call % ("record", args)) and accepts(strict, "Just text.")
    assert accepts(strict, call % ("calculator", '{"x": [1]}'))  # not strict: any JSON
    assert not accepts(strict, call % ("record", args.replace("true", '"yes"')))
    assert not accepts(strict, call % ("record", args), call % ("record", args))  # parallel_tool_calls false
    assert "structured" not in grammar() or grammar()["structured"] is None  # no strict tool, nothing forced: free
    answer = grammar(tools=[dict(record, function=dict(READING, strict=True))],
                     response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": READING["parameters"]}})
    assert accepts(answer, args) and accepts(answer, call % ("record", args)) and not accepts(answer, "text")
    # Qwen3.5's XML calls: the template opens "<tool_call>\n<function=", the parameters fit the same schema
    request = protocols.parse_openai(dict(messages=[{"role": "user", "content": "x"}], tools=[record],
                                          tool_choice="required"), server)
    request.opening = "<tool_call>\n<function="
    xml = {"structured": {"structural_tag": protocols.call_grammar("qwen_3_coder", request)[0]}}
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in json.loads(args).items())
    assert accepts(xml, "record>\n" + parameters.replace("True", "true") + "</function>\n</tool_call>")
    assert not accepts(xml, "record>\n" + parameters.replace("km", "mi") + "</function>\n</tool_call>")
    # constrained_tokens "mask": an auto turn's text and the call's tag stay trained, what the grammar wrote does not
    masked = capture.CaptureServer(server.backend, tok, constrained_tokens="mask")
    text = "Some text. " + call % ("record", args)
    server.backend.forced = (text, [server.end_ids[0]], "stop")
    session = masked.new_session()
    body = dict(messages=[{"role": "user", "content": "x"}], tools=[dict(record, function=dict(READING, strict=True))])
    asyncio.run(masked.respond(session, protocols.parse_openai(body, masked)))
    (segment,) = session.segment_dicts()
    generated = [t for t, m in zip(segment["token_ids"], segment["action_mask"]) if m]
    assert tok.decode(generated) == "Some text. <tool_call>" and segment["token_ids"][-1] == server.end_ids[0]
    server.backend.forced = None
    asyncio.run(server.stop())
    asyncio.run(masked.stop())


SCHEMA = {"type": "object", "properties": {"odd": {"type": "boolean"}}, "required": ["odd"], "additionalProperties": False}
VERDICTS = ('{"odd":true}', '{"odd":false}')  # every text the schema admits, white space aside


def check_verdict(text, finished):
    """The grammar held: a finished reply is a whole verdict, one cut short (max_tokens) the start of one."""
    compact = "".join(text.split())
    assert (compact in VERDICTS) if finished else any(v.startswith(compact) and v != compact for v in VERDICTS), text


def test_structured_output_records_the_masked_distributions_logprobs(stack, rollout_engine):
    server, recorder = stack
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Is 5 odd?"}], max_tokens=48, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}})
    check_verdict(reply.choices[0].message.content, reply.choices[0].finish_reason == "stop")
    (segment,) = finish(server, recorder, session)
    (call,) = recorder.of(session.id)
    # at temperature 1 the grammar only removes mass: log q(x) = log p(x) - log Z >= log p(x), the engine's own
    # unmasked logprob of the same token
    unmasked = ray.get(rollout_engine.prompt_logprobs.remote(call["prompt"] + call["out"]["token_ids"]))
    gaps = [q - p for q, p in zip(call["out"]["logprobs"], unmasked[len(call["prompt"]):])]
    assert min(gaps) > -0.02 and max(gaps) > 0.1, gaps
    k3 = [math.exp(-g) - 1 + g for g in gaps]  # the trainer's mismatch_kl estimator (log rho = log p - log q)
    print(f"structured output, {len(gaps)} tokens: mismatch_kl {sum(k3) / len(k3):.3f}, "
          f"mismatch_k1 {sum(gaps) / len(gaps):.3f}")
    # constrained_tokens="mask": the same kind of turn is recorded as context, out of the loss
    masked = capture.CaptureServer(recorder, server.tokenizer, max_model_len=MAX_MODEL_LEN, constrained_tokens="mask")
    session = masked.new_session()
    body = {"messages": [{"role": "user", "content": "Is 7 odd?"}], "max_tokens": 8,
            "response_format": {"type": "json_object"}}
    asyncio.run(masked.respond(session, protocols.parse_openai(body, masked)))
    (segment,) = session.segment_dicts()
    assert sum(segment["action_mask"]) == 0 and len(segment["token_ids"]) > len(recorder.of(session.id)[0]["prompt"])
    asyncio.run(masked.stop())


def test_logprobs_count_tokens_and_retries(stack):
    server, recorder = stack
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, logprobs=True, top_logprobs=3)
    (call,) = recorder.of(session.id)
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(call["out"]["logprobs"][:len(content)])
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
        assert [t.logprob for t in c.top_logprobs] == sorted([t.logprob for t in c.top_logprobs], reverse=True)
    # a client retry (marked by the SDKs) gets the stored answer; an unmarked repeat samples again (a new segment)
    url, auth = session.base_url + "/chat/completions", {"authorization": f"Bearer {session.api_key}"}
    body = {"model": "tiny", "messages": messages, "max_tokens": 6}  # unseeded: a repeat is a fresh sample
    first = httpx.post(url, json=body, headers={**auth, "x-stainless-retry-count": "0"}).json()
    assert httpx.post(url, json=body, headers={**auth, "x-stainless-retry-count": "1"}).json() == first
    repeat = httpx.post(url, json=body, headers=auth).json()
    assert repeat["id"] != first["id"] and len(recorder.of(session.id)) == 3
    keyed = {**auth, "idempotency-key": "k1"}
    assert httpx.post(url, json=body, headers=keyed).json() == httpx.post(url, json=body, headers=keyed).json()
    finish(server, recorder, session, segments=4)
    # Anthropic token counting: the prompt the same request generates on
    session = server.new_session()
    client = anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    kw = dict(model="tiny", system="Be brief.", messages=[{"role": "user", "content": "Count me."}],
              tools=[{"name": "calculator", "input_schema": TOOLS[0]["function"]["parameters"]}])
    counted = client.messages.count_tokens(**kw).input_tokens
    with client.messages.stream(max_tokens=4, **kw) as stream:
        final = stream.get_final_message()
    assert counted == len(recorder.of(session.id)[0]["prompt"]) == final.usage.input_tokens


def test_streams_deliver_text_as_the_engine_samples(stack):
    """Many deltas (one per engine step, not one at the end) in all three APIs; together they are the answer, which
    ends where the recorded tokens end (held back from the end as far as a stop string could reach)."""
    server, recorder = stack
    session = server.new_session()
    oa = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    an = anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    ask = [{"role": "user", "content": "Tell me a story."}]
    streams = {
        "chat": [c.choices[0].delta.content for c in oa.chat.completions.create(
            model="tiny", messages=ask, max_tokens=32, stream=True, stop=["zq"])
            if c.choices and c.choices[0].delta.content],
        "messages": [e.delta.text for e in an.messages.create(model="tiny", max_tokens=32, messages=ask, stream=True)
                     if e.type == "content_block_delta"],
        "responses": [e.delta for e in oa.responses.create(model="tiny", input=ask, max_output_tokens=32, stream=True)
                      if e.type == "response.output_text.delta" and e.delta]}
    segments = finish(server, recorder, session, segments=3)
    for (api, deltas), segment, call in zip(streams.items(), segments, recorder.of(session.id)):
        ids = call["out"]["token_ids"]
        assert len(deltas) >= 4 and segment["token_ids"][-len(ids):] == ids, (api, deltas)
        # as the answer is decoded without tools: special tokens the random model samples mid-text are not shown
        assert "".join(deltas) == server.tokenizer.decode(ids[:-1] if ids[-1] in server.end_ids else ids,
                                                          skip_special_tokens=True)


def test_a_stream_the_client_leaves_is_aborted_and_not_recorded(stack, rollout_engine):
    stack_engine = rollout_engine
    server, recorder = stack
    session = server.new_session()
    url, auth = session.base_url + "/chat/completions", {"authorization": f"Bearer {session.api_key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go on and on."}], "max_tokens": 600,
            "stream": True, "temperature": 1.0}
    from test_capture_fuzz import engine_counts
    _, generated = engine_counts(stack_engine)
    with httpx.stream("POST", url, json=body, headers=auth) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the stream has begun: then the client goes
    deadline = time.monotonic() + 30
    while session.in_flight and time.monotonic() < deadline:  # the aborted turn lets go of it
        time.sleep(0.05)
    assert not session.in_flight and session.segment_dicts() == [] and recorder.of(session.id) == []
    while engine_counts(stack_engine)[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    unfinished, now = engine_counts(stack_engine)
    assert unfinished == 0 and 0 < now - generated < body["max_tokens"]  # the engine stopped it, mid-turn
    reply = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Still there?"}], max_tokens=4)
    assert reply.usage.completion_tokens >= 1
    finish(server, recorder, session)


LONG = {"expression": "(12 + 30) * 7 - 5 / 2 + 1000 * 3"}


def forced_call(server, recorder, api, stream):
    """One forced calculator call (chat: the named tool; Messages: any; Responses: required), streamed through the
    SDK's stream helper or not: ((name, arguments), the argument pieces streamed, the recorded segments)."""
    session, ask = server.new_session(), [{"role": "user", "content": "Compute it."}]
    oa = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    an = anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    recorder.forced[session.id] = [call_text("calculator", LONG, "arguments" if api == "chat" else "name")]
    pieces = []
    if api == "chat":
        kw = dict(model="tiny", messages=ask, tools=TOOLS, max_tokens=64,
                  tool_choice={"type": "function", "function": {"name": "calculator"}})
        if stream:
            with oa.chat.completions.stream(**kw) as s:
                pieces = [e.arguments_delta for e in s
                          if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
                (c,) = s.get_final_completion().choices[0].message.tool_calls
        else:
            (c,) = oa.chat.completions.create(**kw).choices[0].message.tool_calls
        call = c.function.name, c.function.arguments
    elif api == "messages":
        kw = dict(model="tiny", max_tokens=64, messages=ask, tool_choice={"type": "any"},
                  tools=[{"name": "calculator", "input_schema": TOOLS[0]["function"]["parameters"]}])
        if stream:
            with an.messages.stream(**kw) as s:
                pieces = [e.partial_json for e in s if e.type == "input_json"]
                (b,) = s.get_final_message().content
        else:
            (b,) = an.messages.create(**kw).content
        call = b.name, json.dumps(b.input)
    else:
        kw = dict(model="tiny", input=ask, tools=[dict(type="function", **TOOLS[0]["function"])], tool_choice="required",
                  max_output_tokens=64)
        if stream:
            with oa.responses.stream(**kw) as s:
                pieces = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
                (c,) = s.get_final_response().output
        else:
            (c,) = oa.responses.create(**kw).output
        call = c.name, c.arguments
    return call, pieces, finish(server, recorder, session)


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_forced_tool_calls_stream_as_sampled_and_match_the_unstreamed_turn(stack, api):
    """The engine's tokens a step at a time: the call's arguments arrive in many pieces that add up to the
    non-streamed answer's exactly, and the recorded trajectory is the non-streamed turn's, token for token."""
    server, recorder = stack
    (call, _, plain), (streamed_call, pieces, streamed) = (forced_call(server, recorder, api, s) for s in (False, True))
    assert call == streamed_call == ("calculator", json.dumps(LONG))
    assert len(pieces) > 3 and "".join(pieces) == json.dumps(LONG)
    keys = "token_ids", "action_mask", "behavior_logprobs", "token_versions"
    assert [{k: s[k] for k in keys} for s in plain] == [{k: s[k] for k in keys} for s in streamed]


# --- forced and strict calls: the arguments sampled under the tool's schema, by the random model itself


class Reading(pydantic.BaseModel):  # numbers, enums and booleans: no free text (unbounded: the server bounds digits)
    count: int
    share: float
    unit: Literal["m", "km"]
    exact: bool


READING = {"name": "record", "description": "Record a reading.", "parameters": Reading.model_json_schema()}
EXPRESSION = {"name": "calculator", "parameters": TOOLS[0]["function"]["parameters"]}  # free text


def sampled_call(server, api, stream, tool, max_tokens):
    """One call to `tool` forced in `api` (chat: "required", Messages: the named tool, Responses: the named strict
    function) and sampled by the engine, streamed or not: (the calls' arguments as text, the argument pieces streamed,
    the session)."""
    session, ask = server.new_session(), [{"role": "user", "content": "Read the meter."}]
    oa = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    pieces = []
    if api == "chat":
        kw = dict(model="tiny", messages=ask, max_tokens=max_tokens, tools=[{"type": "function", "function": tool}],
                  tool_choice="required")
        if stream:  # the raw chunks (the SDK's stream helper raises on a call cut at max_tokens)
            chunks = [c.choices[0] for c in oa.chat.completions.create(stream=True, **kw) if c.choices]
            pieces = [d.function.arguments for c in chunks for d in c.delta.tool_calls or [] if d.function.arguments]
            calls = ["".join(pieces)] if chunks[-1].finish_reason == "tool_calls" else []
        else:
            message = oa.chat.completions.create(**kw).choices[0].message
            calls = [c.function.arguments for c in message.tool_calls or []]
    elif api == "messages":
        an = anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        kw = dict(model="tiny", max_tokens=max_tokens, messages=ask, tool_choice={"type": "tool", "name": tool["name"]},
                  tools=[{"name": tool["name"], "input_schema": tool["parameters"]}])
        if stream:
            with an.messages.stream(**kw) as s:
                pieces = [e.partial_json for e in s if e.type == "input_json"]
                content = s.get_final_message().content
        else:
            content = an.messages.create(**kw).content
        calls = [json.dumps(b.input) if not pieces else "".join(pieces) for b in content if b.type == "tool_use"]
    else:
        kw = dict(model="tiny", input=ask, tools=[dict(type="function", strict=True, **tool)], max_output_tokens=max_tokens,
                  tool_choice={"type": "function", "name": tool["name"]})
        if stream:  # the raw events: the SDK's stream helper raises on an incomplete response
            events = list(oa.responses.create(stream=True, **kw))
            pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
            output = events[-1].response.output
        else:
            output = oa.responses.create(**kw).output
        calls = [c.arguments for c in output if c.type == "function_call"]
    return calls, pieces, session


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_forced_calls_without_free_text_always_parse_and_validate(stack, rollout_engine, api):
    """The random model writes every forced call to a tool of numbers, enums and booleans as one complete call whose
    arguments fit the schema; the recorded logprobs are the masked distribution's (never below the model's own); the
    same prompt sampled without the grammar does not give a valid call (the check can fail)."""
    server, recorder = stack
    for stream in (False, True):
        for _ in range(2):
            calls, pieces, session = sampled_call(server, api, stream, READING, 160)
            (arguments,) = calls
            jsonschema.validate(json.loads(arguments), READING["parameters"])
            Reading.model_validate_json(arguments)
            assert not stream or "".join(pieces) == arguments or api == "messages"
            finish(server, recorder, session)
    call = recorder.calls[-1]
    unmasked = ray.get(rollout_engine.prompt_logprobs.remote(call["prompt"] + call["out"]["token_ids"]))
    gaps = [q - p for q, p in zip(call["out"]["logprobs"], unmasked[len(call["prompt"]):])]
    assert min(gaps) > -0.02 and max(gaps) > 0.1, gaps
    free = ray.get(rollout_engine.generate.remote(call["prompt"], dict(max_tokens=64, seed=0), "free-" + api))
    opening = "<tool_call>" + server.tokenizer.decode(call["prompt"]).rsplit("<tool_call>", 1)[1]
    info = server.tool_parser([]).extract_tool_calls(opening + server.tokenizer.decode(free["token_ids"]), None)
    with pytest.raises((AssertionError, ValueError, jsonschema.ValidationError)):
        (c,) = info.tool_calls
        jsonschema.validate(json.loads(c.function.arguments), READING["parameters"])


SHORT = {"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 2}},
                                        "required": ["text"]}}  # free text the random model closes at once
CLOSING = "}\n</tool_call>"  # what follows a Hermes call's arguments


def test_forced_calls_with_free_text_sample_a_valid_prefix(stack, rollout_engine):
    """A free-text argument runs on (the random model rarely closes a string): what is sampled, cut at max_tokens, is
    still a prefix of schema-conforming JSON arguments then the call's closing text, in every API; a call that closes
    ends with exactly that text and the end token, and every cut of it (one in the closing text too: the token
    '"}}' closes the string, the object and opens the closing) is such a prefix; without the grammar it is not."""
    import xgrammar
    server, recorder = stack
    tokenizer = xgrammar.TokenizerInfo.from_huggingface(server.tokenizer, stop_token_ids=server.end_ids)
    compiler = xgrammar.GrammarCompiler(tokenizer)

    def complete(arguments, schema):
        try:
            return jsonschema.validate(json.loads(arguments), schema) is None
        except (ValueError, jsonschema.ValidationError):
            return False

    def valid_prefix(text, schema=EXPRESSION["parameters"]):  # after the name: "required" opens the call up to it
        arguments = text.split('", "arguments": ', 1)[-1]
        ends = [CLOSING[:k] for k in range(1, len(CLOSING))] + [CLOSING + t for t in ["", *server.end_texts]]
        if any(arguments.endswith(e) and complete(arguments[:-len(e)], schema) for e in ends):
            return True  # complete arguments, then the closing text as far as it went
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema))).accept_string(arguments)
    # the check itself: a cut anywhere in the closing text after complete arguments passes; anything else fails
    assert all(valid_prefix('{"expression": "1"}' + CLOSING[:k]) for k in range(len(CLOSING) + 1))
    assert not any(valid_prefix(t) for t in ('{"expression": "1"}}}', '{"expression": "1"}\n</tool_call>',
                                             '{"expression": 1}' + CLOSING, '{"expression": "1"}' + CLOSING + "x"))
    for api in ("chat", "messages", "responses"):
        for stream in (False, True):
            calls, _, session = sampled_call(server, api, stream, EXPRESSION, 24)
            (call,) = recorder.of(session.id)
            assert valid_prefix(server.tokenizer.decode(call["out"]["token_ids"]))
            # a call that closed comes back whole and fits the schema, a cut one does not come back
            # (a stream sent a cut call's pieces as they came: it cannot take them back)
            closed = CLOSING in server.tokenizer.decode(call["out"]["token_ids"])
            fits = [complete(c, EXPRESSION["parameters"]) for c in calls]
            assert stream or fits == [True] * closed, (calls, closed)
            finish(server, recorder, session)
    calls, _, session = sampled_call(server, "messages", False, SHORT, 48)
    (call,) = recorder.of(session.id)
    ids = call["out"]["token_ids"]
    assert server.tokenizer.decode(ids).endswith(CLOSING + server.tokenizer.decode(ids[-1:])), ids
    assert ids[-1] in server.end_ids and complete(calls[0], SHORT["parameters"])
    assert all(valid_prefix(server.tokenizer.decode(ids[:k]), SHORT["parameters"]) for k in range(len(ids) + 1))
    finish(server, recorder, session)
    free = ray.get(rollout_engine.generate.remote(call["prompt"], dict(max_tokens=24, seed=0), "free-prefix"))
    assert not valid_prefix(server.tokenizer.decode(free["token_ids"]), SHORT["parameters"])


def test_length_bounded_strings_hold_no_raw_control_characters(tiny_model_path):
    """JSON strings hold control characters (U+0000 to U+001F) only escaped, and xgrammar's grammar
    of a string with a length bound lets them in raw: the tiny model sampled this forced call to
    SHORT (about 1 in 8 did), which the tool parser reads as no call. The grammars of forced calls
    and of response formats refuse them."""
    import xgrammar
    from test_capture_segmenter import FakeBackend
    server = capture.CaptureServer(None, tiny_model_path)
    server.backend, tok = FakeBackend(server.tokenizer), server.tokenizer
    info = xgrammar.TokenizerInfo.from_huggingface(tok, stop_token_ids=server.end_ids)
    compiler = xgrammar.GrammarCompiler(info)
    sampled = [272, 349, 90, 86, 259, 305, 193, 4, 95, 95,  # '{"text":"}\x02"}}'
               201, 30, 17, 86, 81, 81, 78, 65, 283, 78, 32, 0]
    assert tok.decode(sampled) == '{"text":"}\x02"}}\n</tool_call><|endoftext|>'
    opening = '<tool_call>\n{"name": "note", "arguments": '
    for char, called in (("\x02", False), ("a", True)):
        text = opening + tok.decode(sampled[:-1]).replace("\x02", char)
        assert server.tool_parser([]).extract_tool_calls(text, None).tools_called == called
    ask = [{"role": "user", "content": "Read the meter."}]
    body = dict(model="tiny", max_tokens=48, messages=ask,
                tool_choice={"type": "tool", "name": "note"},
                tools=[{"name": "note", "input_schema": SHORT["parameters"]}])
    asyncio.run(server.respond(server.new_session(), protocols.parse_anthropic(body, server)))
    assert tok.decode(server.backend.calls[-1]["prompt"]).endswith(opening)

    def accepted(prefix_ids):  # how many of the ids the turn's grammar takes, in order
        m = xgrammar.GrammarMatcher(compiler.compile_structural_tag(
            server.backend.calls[-1]["sampling"]["structured"]["structural_tag"]))
        return next((i for i, t in enumerate(prefix_ids) if not m.accept_token(t)), len(prefix_ids))
    assert accepted(sampled) == sampled.index(193)  # the raw U+0002
    valid = sampled[:6] + tok("a", add_special_tokens=False)["input_ids"] + sampled[7:]
    assert accepted(valid) == len(valid)
    controls = [i for i in range(len(tok)) if len(c := tok.decode([i])) == 1 and c < " "
                and c not in "\r\n"]
    assert len(controls) == 30 and not any(accepted(sampled[:6] + [i]) == 7 for i in controls)
    answer = {"type": "json_schema", "json_schema": {"name": "r", "schema": SHORT["parameters"]}}
    body = dict(model="tiny", messages=ask, response_format=answer)
    asyncio.run(server.respond(server.new_session(), protocols.parse_openai(body, server)))
    assert accepted(sampled[:9]) == 6 and accepted(valid[:9]) == 9  # '{"text":"}a"}': the answer


# --- the Responses API


def test_responses_api_with_tools_previous_response_id_and_stream(stack):
    server, recorder = stack
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    tools = [dict(type="function", **TOOLS[0]["function"], strict=True)]
    recorder.forced[session.id] = [call_text("calculator", {"expression": "2 + 3"})]
    first = client.responses.create(model="tiny", instructions="You are a calculator.", input="What is 2 + 3?",
                                    tools=tools, max_output_tokens=24)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "2 + 3"}
    # the stateless way: the whole history, the model's items as received
    history = [{"role": "user", "content": "What is 2 + 3?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
    second = client.responses.create(model="tiny", instructions="You are a calculator.", input=history, tools=tools,
                                     max_output_tokens=8)
    # the stateful way: previous_response_id, streamed (the last event holds the response, completed or incomplete)
    events = list(client.responses.create(model="tiny", instructions="You are a calculator.", tools=tools, stream=True,
                                          max_output_tokens=8, previous_response_id=second.id,
                                          input=[{"role": "user", "content": "And 6 - 1?"}]))
    kinds, third = [event.type for event in events], events[-1].response
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[0] == "response.created" and kinds[-1] == "response." + third.status
    assert "response.output_text.delta" in kinds
    assert third.usage.output_tokens == len(recorder.of(session.id)[-1]["out"]["token_ids"])
    assert third.output_text == "".join(p.text for item in third.output if item.type == "message" for p in item.content)
    finish(server, recorder, session)
    # store=False: nothing to continue from
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.BadRequestError, match="store: false"):
        client.responses.create(model="tiny", input="again", max_output_tokens=4, previous_response_id=unstored.id)


# --- the frameworks


@installed("agents")
@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_sdk_runner_with_a_function_tool(stack, streamed):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    server, recorder = stack
    session = server.new_session()

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async def run():
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            agent = Agent(name="adder", instructions="Add with the tool.", tools=[add],
                          model=OpenAIResponsesModel(model="tiny", openai_client=client),
                          model_settings=ModelSettings(max_tokens=12))
            if not streamed:
                return await Runner.run(agent, "What is 2 + 3?", max_turns=3)
            result = Runner.run_streamed(agent, "What is 2 + 3?", max_turns=3)
            async for _ in result.stream_events():
                pass
            return result
    # both turns forced: the SDK fails a run whose turn ends at max_tokens ("incomplete"), as the random model's do
    recorder.forced[session.id] = [call_text("add", {"a": 2, "b": 3}), "It is 5."]
    result = asyncio.run(run())
    assert any(getattr(item, "output", None) == 5 for item in result.new_items)  # the tool ran on the model's call
    assert result.final_output == "It is 5."
    segment, = finish(server, recorder, session)
    assert len(recorder.of(session.id)) == 2 and "<tool_response>\n5\n</tool_response>" in server.tokenizer.decode(
        segment["token_ids"])


class Verdict(pydantic.BaseModel):
    odd: bool


@installed("langchain_openai")
def test_langchain_bind_tools_and_structured_output(stack):
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI
    server, recorder = stack
    session = server.new_session()
    llm = ChatOpenAI(model="tiny", base_url=session.base_url, api_key=session.api_key, max_retries=0, max_tokens=48)

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expression))
    recorder.forced[session.id] = [call_text("calculator", {"expression": "2 + 3"})]
    bound = llm.bind_tools([calculator])
    messages = [("user", "What is 2 + 3?")]
    ai = bound.invoke(messages)
    assert ai.tool_calls[0]["name"] == "calculator" and ai.tool_calls[0]["args"] == {"expression": "2 + 3"}
    messages += [ai, ToolMessage(content="5", tool_call_id=ai.tool_calls[0]["id"])]
    bound.invoke(messages)
    verdict = llm.with_structured_output(Verdict, include_raw=True).invoke("Is 5 odd?")  # json_schema, constrained
    finished = verdict["raw"].response_metadata["finish_reason"] == "stop"
    check_verdict(verdict["raw"].content, finished)
    assert (verdict["parsed"] is not None) == finished
    finish(server, recorder, session, segments=2)  # the tool conversation, then the structured question


@installed("langchain_anthropic")
def test_langchain_anthropic_structured_output_and_token_count(stack):
    from langchain_anthropic import ChatAnthropic
    server, recorder = stack
    session = server.new_session()
    llm = ChatAnthropic(model="tiny", base_url=session.base_url, api_key=session.api_key, max_retries=0, max_tokens=24)
    question = [("user", "Is 5 odd?")]
    counted = llm.get_num_tokens_from_messages(llm._convert_input(question).to_messages())  # /v1/messages/count_tokens
    recorder.forced[session.id] = [call_text("Verdict", {"odd": True}, "arguments")]  # its tool, named and forced
    assert llm.with_structured_output(Verdict).invoke(question) == Verdict(odd=True)
    (call,) = recorder.of(session.id)
    opening = len(server.tokenizer('<tool_call>\n{"name": "Verdict", "arguments": ', add_special_tokens=False)["input_ids"])
    assert counted > 0 and len(call["prompt"]) - opening > counted  # the forcing tool is in the prompt, not in the count
    finish(server, recorder, session)


# The frameworks' structured results from the random model itself: their forced or strict calls (and the Agents SDK's
# response format) are sampled under the schema, so each run completes with a parsed result.


@installed("pydantic_ai")
def test_pydantic_ai_output_type_from_the_random_model(stack):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    server, recorder = stack
    session = server.new_session()
    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=session.base_url, api_key=session.api_key))
    result = Agent(model, output_type=Reading).run_sync("Read the meter.", model_settings={"max_tokens": 160})
    assert isinstance(result.output, Reading)
    (call,) = recorder.of(session.id)  # its output tool, forced ("required"): one turn
    assert server.tokenizer.decode(call["prompt"]).endswith('<tool_call>\n{"name": "')
    finish(server, recorder, session)


@installed("smolagents")
def test_smolagents_tool_calling_agent_from_the_random_model(stack):
    from smolagents import OpenAIServerModel, Tool, ToolCallingAgent
    server, recorder = stack

    class FinalAnswer(Tool):  # the agent's final answer as a reading: numbers, an enum, a boolean
        name, description, output_type = "final_answer", "The reading.", "object"
        inputs = {"count": {"type": "integer", "description": "how many"},
                  "share": {"type": "number", "description": "which share"},
                  "unit": {"type": "string", "enum": ["m", "km"], "description": "the unit"},
                  "exact": {"type": "boolean", "description": "exact or not"}}

        def forward(self, count, share, unit, exact):
            return Reading(count=count, share=share, unit=unit, exact=exact)
    session = server.new_session()
    model = OpenAIServerModel(model_id="tiny", api_base=session.base_url, api_key=session.api_key, max_tokens=160)
    agent = ToolCallingAgent(tools=[FinalAnswer()], model=model, max_steps=2, verbosity_level=0)
    agent.prompt_templates["system_prompt"] = "Call final_answer with the reading."  # the default fills 2,000 tokens
    assert isinstance(agent.run("Read the meter."), Reading)  # it sends tool_choice "required"
    finish(server, recorder, session)


@installed("agents")
def test_openai_agents_sdk_output_type_from_the_random_model(stack):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    set_tracing_disabled(True)
    server, recorder = stack
    session = server.new_session()

    async def run():
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            agent = Agent(name="reader", instructions="Report the reading.", output_type=Reading,
                          model=OpenAIResponsesModel(model="tiny", openai_client=client),
                          model_settings=ModelSettings(max_tokens=160))
            return await Runner.run(agent, "Read the meter.", max_turns=2)
    assert isinstance(asyncio.run(run()).final_output, Reading)  # text.format json_schema, strict
    finish(server, recorder, session)


@pytest.mark.parametrize("name,package", [("agents_sdk", "agents"), ("langchain_tools", "langchain_openai")])
def test_framework_recipes_play_an_attempt(stack, name, package):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is an optional extra")
    server, recorder = stack
    run, prompts = load_agent(os.path.join(os.path.dirname(os.path.dirname(__file__)), "agents", name + ".py"))
    item = next(prompts())
    session = server.new_session()
    answer = str(eval(item["label"]))
    recorder.forced[session.id] = [call_text("calculator", {"expression": item["label"]}), answer]
    result = asyncio.run(run(Context(base_url=session.base_url, api_key=session.api_key, model="tiny",
                                     prompt=item["prompt"], label=item["label"],
                                     sampling=dict(temperature=1.0, top_p=1.0, max_tokens=24))))
    assert result.reward == 1.0 and result.info["tool_calls"] == 1
    (segment,) = finish(server, recorder, session)
    assert f"<tool_response>\n{answer}\n</tool_response>" in server.tokenizer.decode(segment["token_ids"])
