"""Hostile and malformed requests over real HTTP (loopback): every reply is a clear 4xx in the protocol's own error
format (or, for odd but valid input, a valid answer), nothing crashes, and no trajectory (the attacker's or anyone
else's) changes. The first test drives hundreds of malformed requests through a server over the deterministic fake
engine of test_capture_segmenter.py; the others run against the real engine (the shared engine actor, through
rollout's Router): odd unicode, deep nesting and non-finite numbers in every field, special-token text in every
field, repeated and non-finite finishes, client disconnects (the engine aborts), slow and malformed HTTP, the
connection cap and the lifetime of sessions made over HTTP. Load and latency: test_capture_load.py.

    .venv/bin/python -m pytest tests/test_capture_fuzz.py -q
"""
import asyncio
import base64
import copy
import json
import logging
import random
import select
import socket
import time

import httpx
import pytest
import ray

import capture
import http_server
import protocols
import rollout
from conftest import RecordingBackend
from test_capture_segmenter import CALC, FakeBackend
from test_capture_vl import png, vl_model_path

MAX_BODY = 1 << 20
PNG_B64 = base64.b64encode(png(32, 32, 0)).decode()
PNG_URI = "data:image/png;base64," + PNG_B64


@pytest.fixture(scope="module")
def served(tiny_model_path):
    server = capture.CaptureServer(None, tiny_model_path, max_model_len=512, max_body_bytes=MAX_BODY)
    server.backend = FakeBackend(server.tokenizer)
    server.start_in_thread()
    yield server
    server.stop_thread()


def valid_openai(rng):
    return {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "hello " + str(rng.randint(0, 9))}],
            "tools": [CALC], "max_tokens": 8, "temperature": 0.7}


def valid_responses(rng):
    return {"model": "tiny", "instructions": "Be brief.", "input": "hello " + str(rng.randint(0, 9)),
            "tools": [dict(type="function", **CALC["function"])], "max_output_tokens": 8}


def valid_anthropic(rng):
    return {"model": "tiny", "max_tokens": 8, "system": "Be brief.", "tools": [
        {"name": "calculator", "input_schema": CALC["function"]["parameters"]}],
        "messages": [{"role": "user", "content": "hello " + str(rng.randint(0, 9))}]}


# values that are wrong for each field whatever else the request holds
BAD_OPENAI = {
    "messages": ["hi", 5, {}, [], [5], [{"role": "bot", "content": "x"}], [{"content": "x"}],
                [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                [{"role": "tool", "content": "x"}], [{"role": "user", "content": "x", "function_call": {"name": "f"}}],
                [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
                [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"arguments": "{}"}}]}],
                [{"role": "assistant", "tool_calls": "call"}], [{"role": "user", "content": "word " * 2000}]],
    "tools": ["calculator", 5, [5], [{"type": "function"}], [{"function": {"name": 5}}],
              [{"function": {"name": "f", "parameters": "schema"}}]],
    "tool_choice": ["sometimes", 5, [], {"type": "function", "function": {"name": "nope"}}, {"type": "function"},
                    {"type": "function", "name": "calculator"}],
    "temperature": ["hot", -1, 2.5, [], True, float("inf")],
    "top_p": ["all", 0, 1.5, -0.1, {}],
    "max_tokens": ["8", 0, -5, 1.5, True],
    "max_completion_tokens": [0, "x"],
    "stop": [5, [5], [""], ["x"] * 17, {"a": 1}],
    "seed": ["x", -1, 2**70, 1.5],
    "stream": ["yes", 1, []],
    "n": [2, 0, "1"],
    "logprobs": ["yes", 1],
    "frequency_penalty": [0.5, "x"],
    "presence_penalty": [-1],
    "parallel_tool_calls": ["no", 0],
    "response_format": [{"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 5}},
                        "json"],
    "functions": [[{"name": "f"}]],
    "stream_options": ["x", 5],
}
BAD_ANTHROPIC = {
    "messages": ["hi", 5, [], [{"role": "system", "content": "x"}], [{"role": "user", "content": 5}],
                [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": PNG_B64}}]}],
                [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://a.b"}}]}],
                [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
                [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
                [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}],
                [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [5]}],
                [{"role": "user", "content": "word " * 2000}]],
    "max_tokens": [None, "8", 0, -1, 2.5],
    "system": [5, [{"type": "image"}], {"text": "x"}],
    "tools": [5, [{"name": "f"}], [{"input_schema": {}}], [{"type": "web_search_20250305", "name": "web_search"}]],
    "tool_choice": ["auto", {"type": "tool", "name": "nope"}, {"type": "sometimes"}, {"type": "tool"},
                   {"type": "tool", "name": ["calculator"]}, {"type": "any", "disable_parallel_tool_use": 1},
                   {"type": ["any"]},
                   {"type": "auto", "disable_parallel_tool_use": "yes"}],
    "temperature": [1.5, "x", -0.5],
    "top_p": [0, 2],
    "top_k": [5],
    "stop_sequences": ["x", [5], [""]],
    "thinking": [{"type": "enabled", "budget_tokens": 1024}, {"type": "enabled"}, {"type": "enabled", "budget_tokens": 512},
                 {"type": "enabled", "budget_tokens": "all"}, {"budget_tokens": 2048}, {"type": "sometimes"}, "yes"],
    "stream": ["yes"],
    "n": [2],
}
BAD_RESPONSES = {
    "input": [None, 5, [5], [{"type": "image", "image_url": "x"}], [{"role": "bot", "content": "x"}],
              [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
              [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": PNG_URI}]}],
              [{"type": "message", "role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
              [{"type": "function_call", "name": "f", "arguments": "{}"}], [{"type": "function_call_output", "output": "x"}],
              [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}], [{"type": "reasoning"}],
              "word " * 2000, []],
    "instructions": [5, ["x"]],
    "tools": [5, [{"type": "web_search"}], [{"type": "function"}], [{"type": "function", "name": "f", "parameters": 5}],
              [{"type": "function", "function": {"name": "f"}}]],
    "tool_choice": ["sometimes", {"type": "function"}, {"type": "function", "name": "nope"}, {"type": "mcp"},
                    {"type": "function", "name": ["calculator"]}, {"type": ["function"]}, ["auto"]],
    "max_output_tokens": [0, "8", 1.5],
    "temperature": [3, "x"],
    "text": [5, {"format": {"type": "xml"}}, {"format": {"type": "json_schema"}}, {"format": "json"}],
    "previous_response_id": ["resp_nope", 5],
    "include": ["x"],
    "truncation": ["auto"],
    "reasoning": [{"effort": "high"}],
    "store": ["yes"],
    "conversation": ["conv_1"],
    "background": [True],
}


def hostile_requests(rng, url, good, other, finished):
    """(method, url, headers, content) tuples, each certain to be refused."""
    oa, an, rs = good.base_url + "/chat/completions", good.base_url + "/v1/messages", good.base_url + "/responses"
    auth_oa, auth_an = {"authorization": f"Bearer {good.api_key}"}, {"x-api-key": good.api_key}
    protocols = {"openai": (BAD_OPENAI, valid_openai, oa, auth_oa),
                 "anthropic": (BAD_ANTHROPIC, valid_anthropic, an, auth_an),
                 "responses": (BAD_RESPONSES, valid_responses, rs, auth_oa)}
    out = []
    for _ in range(270):  # one wrong field in an otherwise valid request
        bad, valid, target, auth = protocols[rng.choice(sorted(protocols))]
        body = valid(rng)
        key = rng.choice(sorted(bad))
        body[key] = rng.choice(bad[key])
        if body[key] is None:
            del body[key]
        out.append(("POST", target, auth, json.dumps(body).encode()))
    for _ in range(80):  # broken bytes
        target, headers = rng.choice([(oa, auth_oa), (an, auth_an), (rs, auth_oa)])
        valid = json.dumps(valid_openai(rng)).encode()
        content = rng.choice([valid[:rng.randint(0, len(valid) - 1)], bytes(rng.getrandbits(8) for _ in range(64)),
                              b"\xff\xfe" + valid, b"[" * 100000, b"null", b"[]", b"42", b'"text"',
                              b'{"messages": NaN}', b"{}"])
        out.append(("POST", target, headers, content))
    for _ in range(60):  # authentication: nobody may write to (or read) a session that is not theirs
        base, key = rng.choice([(good.base_url, other.api_key), (other.base_url, good.api_key),
                                (finished.base_url, finished.api_key), (good.base_url, ""),
                                (f"{url}/s/nosuchsession/v1", good.api_key), (good.base_url, good.api_key + "x"),
                                (good.base_url, "é" * 10)])
        path, header = rng.choice([("/chat/completions", "authorization"), ("/v1/messages", "x-api-key"),
                                   ("/responses", "authorization")])
        value = f"Bearer {key}".strip() if header == "authorization" else key
        out.append(("POST", base + path, {header: value.encode()}, json.dumps(valid_openai(rng)).encode()))
        sid = base.split("/s/")[1].split("/")[0]
        if key != finished.api_key:  # a finished session stays readable with its own key
            out.append(("GET", f"{url}/sessions/{sid}", {"x-api-key": key.encode()}, b""))
    for _ in range(30):  # token counting gets the Messages API's checks (max_tokens aside)
        body, key = valid_anthropic(rng), rng.choice(sorted(set(BAD_ANTHROPIC) - {"max_tokens"}))
        body[key] = rng.choice([v for v in BAD_ANTHROPIC[key] if "word " * 2000 not in json.dumps(v)])  # long is fine
        out.append(("POST", an + "/count_tokens", auth_an, json.dumps(body).encode()))
    for _ in range(20):  # too large, declared or real
        target, headers = rng.choice([(oa, auth_oa), (an, auth_an)])
        out.append(("POST", target, headers, b'{"messages": "' + b"x" * (MAX_BODY + 10) + b'"}'))
    for _ in range(20):  # wrong paths and methods
        out.append(rng.choice([("GET", oa, auth_oa, b""), ("PUT", an, auth_an, b"{}"),
                               ("POST", good.base_url + "/completions", auth_oa, b"{}"),
                               ("POST", good.base_url + "/embeddings", auth_oa, b"{}"),
                               ("DELETE", f"{url}/sessions/{good.id}", auth_an, b""),
                               ("POST", f"{url}/sessions", {}, b"[1, 2]"),
                               ("POST", f"{url}/sessions", {}, b'{"attempt_id": 5}')]))
    rng.shuffle(out)
    return out


def check_error(response, url):
    assert 400 <= response.status_code < 500, (url, response.status_code, response.text[:300])
    body = response.json()
    if "/messages" in url:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    message = body["error"]["message"]
    assert isinstance(message, str) and 10 < len(message) < 600


def test_hostile_requests_get_4xx_and_change_no_trajectory(served):
    rng = random.Random(0)
    url = served.url
    good, other, finished = served.new_session(), served.new_session(), served.new_session()
    with httpx.Client(timeout=60) as client:
        for s in (good, other, finished):  # everyone has a recorded turn to protect
            r = client.post(s.base_url + "/chat/completions", json=valid_openai(rng),
                            headers={"authorization": f"Bearer {s.api_key}"})
            assert r.status_code == 200
        served.finish_session(finished.id, 1.0)
        before = {s.id: s.segment_dicts() for s in (good, other, finished)}
        calls = len(served.backend.calls)
        requests = hostile_requests(rng, url, good, other, finished)
        assert len(requests) >= 400
        for method, target, headers, content in requests:
            check_error(client.request(method, target, headers=headers, content=content), target)

        async def burst():  # the same, all at once
            async with httpx.AsyncClient(timeout=60) as aclient:
                return await asyncio.gather(*[aclient.request(m, t, headers=h, content=c)
                                              for m, t, h, c in requests[:150]])
        for response, (_, target, _, _) in zip(asyncio.run(burst()), requests):
            check_error(response, target)
        assert len(served.backend.calls) == calls  # no hostile request reached the engine
        assert {s.id: s.segment_dicts() for s in (good, other, finished)} == before
        # and the server still serves everyone
        for s in (good, other):
            r = client.post(s.base_url + "/chat/completions", json=valid_openai(rng),
                            headers={"authorization": f"Bearer {s.api_key}"})
            assert r.status_code == 200 and len(s.segment_dicts()) >= 1
        # a budget within Anthropic's rule (at least 1024, below max_tokens) is served and counted, without max_tokens too
        thinking = dict(valid_anthropic(rng), max_tokens=1025, thinking={"type": "enabled", "budget_tokens": 1024})
        an, auth = good.base_url + "/v1/messages", {"x-api-key": good.api_key}
        assert client.post(an, json=thinking, headers=auth).status_code == 200
        for body in (thinking, {k: v for k, v in thinking.items() if k != "max_tokens"}):
            assert client.post(an + "/count_tokens", json=body, headers=auth).json()["input_tokens"] > 0


def test_bad_images_get_a_400_naming_the_part_and_change_nothing():
    """On a vision model (the tiny VLM's tokenizer and processor, the fake engine): every bad image is refused with
    a 400 in the protocol's format that names its part; nothing reaches the engine or any trajectory."""
    server = capture.CaptureServer(None, vl_model_path(), max_model_len=2048, max_body_bytes=MAX_BODY,
                                   max_images_per_prompt=3, max_pixels=256 * 256, max_bytes=64 << 10)
    server.backend = FakeBackend(server.tokenizer)
    server.start_in_thread()
    good = png(64, 64, 1)
    noise = bytes(random.Random(0).getrandbits(8) for _ in range(96 << 10))
    big = png(320, 240, 2)
    cases = [  # (the image part's data URI or bytes, where the 400 must point)
        ("https://example.com/a.png", "does not fetch"), ("ftp://x", "not a data URI"), ("data:image/png,abc", "base64"),
        ("data:image/png;base64,%%%", "not valid base64"), (b"GIF89a not a gif", "not an image"),
        (good[:len(good) // 2], "not an image"), (big, "320x240 pixels"), (noise, f"{96 << 10} bytes"),
        ([good] * 4, "more than the 3"), (png(4000, 16, 3), "aspect ratio must be smaller than 200")]
    try:
        session = server.new_session()
        oa = session.base_url + "/chat/completions"
        an, rs = session.base_url + "/v1/messages", session.base_url + "/responses"
        auth = {"authorization": f"Bearer {session.api_key}", "x-api-key": session.api_key}
        with httpx.Client(timeout=60) as client:
            r = client.post(oa, headers=auth, json={"messages": [{"role": "user", "content": [
                {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": PNG_URI}}]}], "max_tokens": 4})
            assert r.status_code == 200
            before, calls = session.segment_dicts(), len(server.backend.calls)
            assert before[0]["images"] == [base64.b64decode(PNG_B64)]
            for value, needle in cases:
                images = value if isinstance(value, list) else [value]
                uris = [v if isinstance(v, str) else "data:image/png;base64," + base64.b64encode(v).decode()
                        for v in images]
                data = [u.partition(",")[2] for u in uris]
                bodies = [
                    (oa, {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] + [
                        {"type": "image_url", "image_url": {"url": u}} for u in uris]}]}, "messages[0].content[1"),
                    (rs, {"max_output_tokens": 4, "input": [{"role": "user", "content": [
                        {"type": "input_image", "image_url": u} for u in uris]}]}, "input[0].content[0"),
                    (an, {"max_tokens": 4, "messages": [{"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": d}}
                            for d in data]}]}]}, "messages[0].content[0].content[0")]
                bodies.append((an + "/count_tokens", bodies[-1][1], bodies[-1][2]))  # counted as the turn is checked
                for target, body, where in bodies:
                    if target.startswith(an) and not uris[0].startswith("data:image/png;base64,"):
                        continue  # an Anthropic block has no URI to get wrong
                    r = client.post(target, headers=auth, json=body)
                    check_error(r, target)
                    message = r.json()["error"]["message"]
                    assert r.status_code == 400 and needle in message, (target, needle, message)
                    assert where in message or len(images) > 1, (where, message)
            assert len(server.backend.calls) == calls and session.segment_dicts() == before
            r = client.post(an, headers=auth, json={"max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}]}]})
            assert r.status_code == 200 and len(server.backend.calls) == calls + 1  # and it carries on
    finally:
        server.stop_thread()


# -----------------------------------------------------------------------------
# against the real engine


@pytest.fixture(scope="module")
def real(tiny_model_path, rollout_engine):
    """A capture server over the shared engine actor, with short HTTP timeouts and small session limits."""
    server = capture.CaptureServer(None, tiny_model_path, max_model_len=1024, header_timeout_s=1.0,
                                   body_timeout_s=1.0, max_connections=64)
    server.backend = RecordingBackend(rollout.Router([rollout_engine]), server.tokenizer)
    server.start_in_thread()
    yield server
    server.stop_thread()


def request_for(server, protocol):
    """(url, headers) of a fresh session's chat endpoint for `protocol`, and the session."""
    s = server.new_session()
    if protocol == "openai":
        return s, s.base_url + "/chat/completions", {"authorization": f"Bearer {s.api_key}"}
    return s, s.base_url + "/v1/messages", {"x-api-key": s.api_key}


def check_reply(response, protocol):
    """A valid answer of the protocol, or a 4xx in its error format; never a 5xx."""
    if response.status_code == 200:
        body = response.json()
        assert ("choices" in body) if protocol == "openai" else (body["type"] == "message"), body
    else:
        check_error(response, "/messages" if protocol == "anthropic" else "/chat/completions")


def deep(depth, leaf="x"):
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


ODD_TEXT = ["\ud800", "\udfff", "a\ud83d", "\ude00b", "\ud83d\ude00", "\u0000\ufeff\u202e\u2028\r\n", "e\u0301" * 50,
            "\uffff\U0010ffff", "\ue000\ue105"]
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 400, "1e-999"]


def hostile_values(rng):
    """(protocol, body as JSON text) pairs: odd unicode in every text field, deep nesting in every JSON field,
    non-finite and huge numbers in every numeric field, wrong-typed names. `@@` marks where raw JSON goes."""
    out = []

    def fresh(protocol):  # the valid bodies share CALC: copy before changing; one token is answer enough
        return dict(copy.deepcopy((valid_openai if protocol == "openai" else valid_anthropic)(rng)), max_tokens=1)

    def add(protocol, body, raw=None):
        text = json.dumps(body, ensure_ascii=True)  # lone surrogates travel as \\u escapes, as clients send them
        out.append((protocol, text.replace('"@@"', raw) if raw is not None else text))
    for text in ODD_TEXT:
        for protocol in ("openai", "anthropic"):
            for where in range(7):
                body = fresh(protocol)
                tools = body["tools"][0]["function"] if protocol == "openai" else body["tools"][0]
                if where == 0:
                    body["messages"][-1]["content"] = "hi " + text
                elif where == 1:
                    tools["name"] = text
                elif where == 2:
                    tools["description"] = text
                elif where == 3:
                    body["model"] = text
                elif where == 4:
                    body["stop" if protocol == "openai" else "stop_sequences"] = [text]
                elif where == 5 and protocol == "openai":
                    body["messages"][1:1] = [{"role": "assistant", "content": "", "tool_calls": [
                        {"id": text, "type": "function", "function": {"name": text, "arguments": json.dumps({"a": text})}}]},
                        {"role": "tool", "tool_call_id": text, "content": text}]
                elif where == 5:
                    body["messages"][0:0] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
                        {"type": "tool_use", "id": text, "name": text, "input": {text: text}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": text, "content": text}]}]
                else:
                    body["system" if protocol == "anthropic" else "messages"] = (
                        text if protocol == "anthropic" else [{"role": "system", "content": text}] + body["messages"][1:])
                add(protocol, body)
    for depth in (70, 900):  # deep nesting in every JSON field that holds one
        for protocol in ("openai", "anthropic"):
            body = fresh(protocol)
            params = body["tools"][0]["function"] if protocol == "openai" else body["tools"][0]
            params["parameters" if protocol == "openai" else "input_schema"] = {"type": "object", "properties": deep(depth)}
            add(protocol, body)
            body = fresh(protocol)
            body["metadata"] = deep(depth)
            add(protocol, body)
            body = fresh(protocol)
            body["messages"][-1]["content"] = deep(depth)
            add(protocol, body)
        body = fresh("anthropic")
        body["messages"][0:0] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "calculator", "input": deep(depth)}]}]
        add("anthropic", body)
        body = fresh("openai")
        body["stream_options"] = deep(depth)
        add("openai", body)
    body = fresh("openai")  # tool-call arguments: a string of JSON nested 5,000 deep, echoed back
    body["messages"][1:1] = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "[" * 5000 + "]" * 5000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    add("openai", body)
    for raw in NON_FINITE:  # every number the server reads
        for key in ("temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "n", "top_logprobs",
                    "frequency_penalty", "presence_penalty"):
            add("openai", dict(fresh("openai"), **{key: "@@"}), raw)
        for key in ("temperature", "top_p", "max_tokens", "top_k"):
            add("anthropic", dict(fresh("anthropic"), **{key: "@@"}), raw)
    for name in ([1], {"a": 1}, ["calculator"], None, 5):  # names that are not strings
        add("openai", dict(fresh("openai"), tool_choice={"type": "function", "function": {"name": name}}))
        add("anthropic", dict(fresh("anthropic"), tool_choice={"type": "tool", "name": name}))
    pool = [None, True, 0, -1, 1.5, "", "x", [], [1], {}, {"a": 1}, deep(8)]
    for _ in range(40):  # any field, any wrong type
        protocol = rng.choice(["openai", "anthropic"])
        body = fresh(protocol)
        path = rng.choice([(k,) for k in body] + [("messages", -1, "content"), ("messages", -1, "role"),
                                                  ("tools", 0, "function" if protocol == "openai" else "name")])
        target = body
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = copy.deepcopy(rng.choice(pool))
        add(protocol, body)
    return out


def test_hostile_values_get_a_4xx_or_an_answer_never_a_5xx(real):
    rng = random.Random(1)
    bystander = real.new_session()
    cases = hostile_values(rng)
    assert len(cases) >= 250
    with httpx.Client(timeout=120) as client:
        r = client.post(bystander.base_url + "/chat/completions", json=valid_openai(rng),
                        headers={"authorization": f"Bearer {bystander.api_key}"})
        assert r.status_code == 200
        before = bystander.segment_dicts()
        statuses = []
        for protocol, text in cases:
            session, url, headers = request_for(real, protocol)
            calls = len(real.backend.of(session.id))
            r = client.post(url, headers={**headers, "content-type": "application/json"}, content=text.encode())
            check_reply(r, protocol)
            statuses.append(r.status_code)
            if r.status_code == 200:  # exactly the turn it answered was recorded
                assert len(session.segment_dicts()) == 1 and len(real.backend.of(session.id)) == calls + 1
            else:
                assert session.segment_dicts() == []
            real.drop_session(session.id)
        assert bystander.segment_dicts() == before
        assert statuses.count(200) > 20 and len(statuses) - statuses.count(200) > 150  # both kinds were exercised
        # a session made over HTTP with a lone surrogate as its attempt id: refused, and no session is left
        sessions = len(real.sessions)
        r = client.post(real.url + "/sessions", content=b'{"attempt_id": "\\udfff"}')
        check_error(r, "/sessions")
        assert len(real.sessions) == sessions


OPENAI_FIELDS = ["tool name", "tool description", "parameter name", "parameter description", "system", "user",
                 "assistant", "reasoning", "call name", "call arguments", "call id", "tool result", "user part"]
ANTHROPIC_FIELDS = ["tool name", "tool description", "parameter name", "system", "user", "assistant", "call name",
                    "call arguments", "call id", "tool result", "user part"]
NOT_RENDERED = {"call id", "reasoning"}  # by this template (reasoning only after the last user turn)


def openai_body(v):
    """A request with every text field, field f holding v[f] (or "plain")."""
    f = lambda name: v.get(name, "plain")  # noqa: E731
    return {"max_tokens": 2, "tools": [{"type": "function", "function": {
        "name": f("tool name"), "description": f("tool description"), "parameters": {"type": "object", "properties": {
            f("parameter name"): {"type": "string", "description": f("parameter description")}}}}}],
        "messages": [{"role": "system", "content": f("system")}, {"role": "user", "content": f("user")},
                     {"role": "assistant", "content": f("assistant"), "reasoning_content": f("reasoning"),
                      "tool_calls": [{"id": f("call id"), "type": "function", "function": {
                          "name": f("call name"), "arguments": json.dumps({"x": f("call arguments")},
                                                                          ensure_ascii=False)}}]},
                     {"role": "tool", "tool_call_id": f("call id"), "content": f("tool result")},
                     {"role": "user", "content": [{"type": "text", "text": f("user part")}]}]}


def anthropic_body(v):
    f = lambda name: v.get(name, "plain")  # noqa: E731
    return {"max_tokens": 2, "system": f("system"), "tools": [{
        "name": f("tool name"), "description": f("tool description"),
        "input_schema": {"type": "object", "properties": {f("parameter name"): {"type": "string"}}}}],
        "messages": [{"role": "user", "content": f("user")},
                     {"role": "assistant", "content": [{"type": "text", "text": f("assistant")}, {
                         "type": "tool_use", "id": f("call id"), "name": f("call name"),
                         "input": {"x": f("call arguments")}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f("call id"),
                                                   "content": f("tool result")},
                                                  {"type": "text", "text": f("user part")}]}]}


def test_special_token_text_in_every_field_is_tokenized_as_text(real):
    """Each text field in turn carries the text of every added token (and of the server's own placeholder): the
    recorded prompt holds exactly the control tokens of the same request with a plain word there (the template's
    markup), and its text reads back the injected string. In assistant text only special tokens are escaped:
    <think> / <tool_call> there are the model's own output."""
    tok = real.tokenizer
    added_ids = set(tok.get_added_vocab().values())
    inject = "[" + "".join(tok.get_added_vocab()) + "\ue000\ue105]"
    inject_special = "[" + "".join(tok.all_special_tokens) + "]"
    with httpx.Client(timeout=120) as client:
        for protocol, make, fields in (("openai", openai_body, OPENAI_FIELDS),
                                       ("anthropic", anthropic_body, ANTHROPIC_FIELDS)):
            plain = (protocols.parse_openai if protocol == "openai" else protocols.parse_anthropic)(make({}), real)
            markup = [t for t in real.render(plain.messages, plain.tools, True) if t in added_ids]
            for name in fields:
                text = inject_special if name in ("assistant", "reasoning") else inject
                session, url, headers = request_for(real, protocol)
                r = client.post(url, headers=headers, json=make({name: text}))
                assert r.status_code == 200, (name, r.text)
                prompt = real.backend.of(session.id)[0]["prompt"]
                assert [t for t in prompt if t in added_ids] == markup, (protocol, name)
                assert (text in tok.decode(prompt)) == (name not in NOT_RENDERED), (protocol, name)
                real.drop_session(session.id)
        # the extension path escapes appended messages the same way: a user turn that tries to close itself
        session, url, headers = request_for(real, "openai")
        messages = [{"role": "user", "content": "hi"}]
        r = client.post(url, headers=headers, json={"messages": messages, "max_tokens": 2})
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": inject}]
        r = client.post(url, headers=headers, json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200 and len(session.segment_dicts()) == 1  # extended, not re-rendered
        (first, second), out = (c["prompt"] for c in real.backend.of(session.id)), real.backend.of(session.id)[0]["out"]
        appended = second[len(first) + len(out["token_ids"]):]
        # <|im_end|> closing our reply (unless the engine stopped on it), then <|im_start|>, <|im_end|>, <|im_start|>
        assert sum(t in added_ids for t in appended) == 3 + (out["token_ids"][-1] not in real.end_ids)
        assert inject in tok.decode(appended)


def test_finish_once_with_a_finite_reward(real):
    with httpx.Client(timeout=60) as client:
        made = client.post(real.url + "/sessions").json()
        auth = {"x-api-key": made["api_key"]}
        finish = f"{real.url}/sessions/{made['id']}/finish"
        r = client.post(made["base_url"] + "/chat/completions", headers={"authorization": f"Bearer {made['api_key']}"},
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
        for raw in NON_FINITE[:-1] + ['"1"', "true", "[1]"]:  # refused, and nothing changes
            r = client.post(finish, headers=auth, content=b'{"reward": %s}' % raw.encode())
            check_error(r, finish)
            assert client.get(f"{real.url}/sessions/{made['id']}", headers=auth).json()[0]["finished"] is False
        r = client.post(finish, headers=auth, json={"reward": 1.0})
        assert r.status_code == 200 and r.json()[0]["reward"] == 1.0
        for reward in (-5.0, 1.0):  # the first finish stands
            r = client.post(finish, headers=auth, json={"reward": reward})
            assert r.status_code == 409 and "first finish" in r.json()["error"]["message"]
        real.finish_session(made["id"], 7.0)
        got = client.get(f"{real.url}/sessions/{made['id']}", headers=auth)
        assert got.status_code == 200 and [s["reward"] for s in got.json()] == [1.0]


class LongTurns:
    """The real router, asked never to stop before max_tokens (ignore_eos, no stop ids): a turn the server did not
    abort generates exactly max_tokens tokens."""

    def __init__(self, backend):
        self.backend = backend

    async def generate(self, prompt, sampling, request_id, session_id=None):
        sampling = dict(sampling, ignore_eos=True, stop_token_ids=None)
        return await self.backend.generate(prompt, sampling, request_id, session_id=session_id)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def engine_counts(engine):
    """(requests unfinished, tokens generated so far) in the engine actor's AsyncLLM (its Prometheus counter)."""
    def read(self):
        from prometheus_client import REGISTRY
        generated = sum(s.value for m in REGISTRY.collect() for s in m.samples
                        if s.name == "vllm:generation_tokens_total")
        return self.llm.get_num_unfinished_requests(), generated
    return ray.get(engine.__ray_call__.remote(read))


def test_client_disconnect_aborts_the_engine_request_and_records_nothing(real, rollout_engine):
    recorder = real.backend
    real.backend = LongTurns(recorder)
    try:
        session, url, headers = request_for(real, "openai")
        body = {"messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": 900}
        with httpx.Client(timeout=120) as client:
            assert client.post(url, headers=headers, json=dict(body, max_tokens=8)).status_code == 200  # warm
            real.drop_session(session.id)
            session, url, headers = request_for(real, "openai")
            _, generated = engine_counts(rollout_engine)
            # the client gives up mid-generation: it sends the request on a socket of its own and closes it once the
            # engine has the turn running and has sampled some of it (not after a fixed time: a fast engine would
            # finish a turn first, a slow one might not have started it)
            path = url.removeprefix(real.url).encode()
            data = json.dumps(body).encode()
            head = b"POST %s HTTP/1.1\r\nhost: x\r\nauthorization: %s\r\ncontent-type: application/json\r\n" \
                b"content-length: %d\r\n\r\n" % (path, headers["authorization"].encode(), len(data))
            host, port = real.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(head + data)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    unfinished, now = engine_counts(rollout_engine)
                    if unfinished and now - generated >= 8:
                        break
                    time.sleep(0.02)
                assert unfinished and now - generated >= 8, "the turn never started"
            deadline = time.monotonic() + 120
            while engine_counts(rollout_engine)[0] and time.monotonic() < deadline:
                time.sleep(0.05)
            unfinished, now = engine_counts(rollout_engine)
            assert unfinished == 0 and 8 <= now - generated < body["max_tokens"]  # aborted, not run to the end
            assert session.segment_dicts() == []  # the agent never saw that turn
            # its retry (the same JSON, keys in another order) is the session's first turn
            r = client.post(url, headers=headers, content=json.dumps(dict(reversed(list(dict(body, max_tokens=5).items())))))
            assert r.status_code == 200 and len(session.segment_dicts()) == 1
            messages = body["messages"] + [r.json()["choices"][0]["message"], {"role": "user", "content": "More."}]
            r = client.post(url, headers=headers, json={"messages": messages, "max_tokens": 5})
            assert r.status_code == 200 and len(session.segment_dicts()) == 1  # extended: no extra segment
    finally:
        real.backend = recorder


# --- HTTP-level limits: slow, oversized and malformed requests, the connection cap, session lifetime


def raw(server, data, read=True, pause_s=0.0):
    """Send bytes on a fresh connection, 16 KiB at a time, stopping early if the server answers (bytes sent after
    it closed would reset the connection and lose its answer); return everything it sends until it closes."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for i in range(0, len(data), 16 << 10):
            if select.select([sock], [], [], 0.1 if i else 0)[0]:
                break
            sock.sendall(data[i:i + (16 << 10)])
        time.sleep(pause_s)
        chunks = []
        while read and (chunk := sock.recv(65536)):
            chunks.append(chunk)
        return b"".join(chunks)


def until_idle(server, timeout_s=30):
    """Wait until the server has seen every connection close and has finished every request it was handling."""
    state, deadline = server.uvicorn.server_state, time.monotonic() + timeout_s
    while state.connections or state.tasks:
        assert time.monotonic() < deadline, f"{len(state.connections)} connections, {len(state.tasks)} requests left"
        time.sleep(0.01)


def json_error(reply, status, protocol="openai"):
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status) and b"application/json" in head, reply[:300]
    body = json.loads(body)
    assert (body["type"] == "error" and body["error"]["message"]) if protocol == "anthropic" else body["error"]["message"]


def test_slow_oversized_and_malformed_http_get_json_errors(real):
    session = real.new_session()
    chat = f"/s/{session.id}/v1/chat/completions".encode()
    errors = []
    handler = logging.Handler()
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        json_error(raw(real, b"POST /sessions HTTP/1.1\r\nhost: x\r\nx-slow: "), 408)  # headers never end
        json_error(raw(real, b""), 408)  # a connection that sends nothing
        json_error(raw(real, b"POST /sessions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"), 408)  # stalled body
        json_error(raw(real, b"GET /sessions HTTP/1.1\r\nx-big: " + b"a" * (200 << 10) + b"\r\n\r\n"), 431)
        json_error(raw(real, b"POST /sessions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n{}"), 400)
        json_error(raw(real, b"POST " + chat + b" HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}GARBAGE\r\n\r\n"), 400)
        json_error(raw(real, b"POST /s/x/v1/messages HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"), 400,
                   "anthropic")
        json_error(raw(real, b"\x16\x03\x01\x02\x00\x01\x00"), 400)  # a TLS hello on the plain port
        # a client that drops /finish mid-body: nothing logged, the session not finished
        raw(real, f"POST /sessions/{session.id}/finish HTTP/1.1\r\nx-api-key: {session.api_key}\r\n"
                  "content-length: 50\r\n\r\n{\"rew".encode(), read=False, pause_s=0.3)
        until_idle(real)
        assert not session.finished and not [e for e in errors if e.levelno >= logging.ERROR], errors
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    with httpx.Client(timeout=30) as client:  # and it serves as before
        r = client.post(real.url + "/sessions")
        assert r.status_code == 200


@pytest.mark.parametrize("linger", [True, False], ids=["lingering", "control"])
def test_a_refused_client_that_still_sends_reads_its_answer(real, monkeypatch, linger):
    """A client whose headers time out while it is still sending (a byte every 20 ms, reading nothing until 0.6 s
    past the 1 s timeout) then reads its 408 and a clean end: the server's lingering close reads and drops what
    follows the refusal. Control: the connection closed at once (linger_s 0, as before): the client's next bytes
    meet a reset, and under load (the event loop reading late) so did a slow-header client's reply."""
    if not linger:
        monkeypatch.setattr(http_server.GuardedHttp, "linger_s", 0.0)
    host, port = real.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            sock.sendall(b"POST /sessions HTTP/1.1\r\nhost: x\r\nx-slow: ")
            deadline = time.monotonic() + real.header_timeout_s + 0.6
            while time.monotonic() < deadline:
                sock.sendall(b"a")
                time.sleep(0.02)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionError as e:
            reply = e
    if not linger:
        assert isinstance(reply, ConnectionError), reply
        return
    json_error(reply, 408)
    until_idle(real)


def test_connection_cap(real):
    host, port = real.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(real.max_connections)]
    try:
        r = httpx.post(real.url + "/sessions", timeout=30)
        assert r.status_code == 503  # uvicorn's limit_concurrency answers over the cap
    finally:
        for sock in idle:
            sock.close()
    until_idle(real)
    assert httpx.post(real.url + "/sessions", timeout=30).status_code == 200


def test_an_idle_keep_alive_connection_is_closed(tiny_model_path):
    """A client that keeps its connection after a reply and goes quiet has it closed by the server
    after the keep-alive time (keep_alive_s: 20 s by default, longer than clients keep theirs; 3 s
    here), so idle connections cannot fill the connection cap; a connection used again within it
    stays open (the control)."""
    served = capture.CaptureServer(None, tiny_model_path, max_model_len=512, keep_alive_s=3.0)
    served.backend = FakeBackend(served.tokenizer)
    served.start_in_thread()
    host, port = served.url.removeprefix("http://").split(":")
    request = b"POST /sessions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        def reply():
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(65536)
            head, _, body = head.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            while len(body) < length:
                body += sock.recv(65536)
            return head
        sock.sendall(request)
        assert reply().startswith(b"HTTP/1.1 200")
        time.sleep(1.5)
        sock.sendall(request)  # within the keep-alive time: the same connection serves it
        assert reply().startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert sock.recv(1) == b""  # closed by the server
        idle = time.monotonic() - t0
    served.stop_thread()
    assert 2.5 < idle < 6, idle


def test_sessions_made_over_http_have_a_lifetime(tiny_model_path, monkeypatch):
    monkeypatch.setattr(capture, "DROPPED_RECORDS", 2)  # the last 2 dropped remembered: older ones get 404
    server = capture.CaptureServer(None, tiny_model_path, http_session_idle_s=3.0, max_http_sessions=4)
    server.backend = FakeBackend(server.tokenizer)  # sessions only: no turn is taken
    server.start_in_thread()
    try:
        with httpx.Client(timeout=30) as client:
            def get(made):
                return client.get(f"{server.url}/sessions/{made['id']}", headers={"x-api-key": made["api_key"]})
            made = [client.post(server.url + "/sessions").json() for _ in range(4)]
            r = client.post(server.url + "/sessions")
            assert r.status_code == 429 and "limit" in r.json()["error"]["message"]  # all live: refused
            finish = f"{server.url}/sessions/{made[0]['id']}/finish"
            assert client.post(finish, headers={"x-api-key": made[0]["api_key"]}, json={"reward": 0}).status_code == 200
            made.append(client.post(server.url + "/sessions").json())  # the finished one made room
            r = get(made[0])  # dropped: it says so (a wrong key still gets 401, an id never issued 404)
            assert r.status_code == 410 and "finished and was dropped" in r.json()["error"]["message"]
            assert len(server.sessions) == 4 and client.get(f"{server.url}/sessions/{made[0]['id']}").status_code == 401
            assert client.get(f"{server.url}/sessions/0123456789abcdef").status_code == 404

            def age(seconds):  # as if `seconds` went by without a request (rather than waiting them out)
                for s in list(server.sessions.values()):
                    s.last_used -= seconds
            for _ in range(2):  # one stays in use; the others go idle past their lifetime (3 s)
                age(2.0)
                assert get(made[1]).status_code == 200
            r = get(made[2])
            assert r.status_code == 410 and "expired" in r.json()["error"]["message"]
            assert client.post(server.url + "/sessions").status_code == 200  # room again: idle ones dropped
            assert made[1]["id"] in server.sessions and len(server.sessions) == 2
            assert [get(m).status_code for m in made] == [404, 200, 404, 410, 410]  # 3 and 4 the last 2 dropped
            assert "ended and was dropped long ago" in get(made[0]).json()["error"]["message"]
    finally:
        server.stop_thread()
