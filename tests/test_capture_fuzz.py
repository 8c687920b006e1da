"""Hostile and malformed requests over real HTTP (loopback): every reply is a clear 4xx in the protocol's own error
format, nothing crashes, and no trajectory (the attacker's or anyone else's) changes. The deterministic fake engine
of test_capture_segmenter.py stands in for vLLM; test_capture.py runs an error smoke against the real engine.

    .venv/bin/python -m pytest tests/test_capture_fuzz.py -q
"""
import asyncio
import json
import random

import httpx
import pytest

import capture
from test_capture_segmenter import CALC, FakeBackend

MAX_BODY = 1 << 20


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
                [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
                [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
                [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}],
                [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [5]}],
                [{"role": "user", "content": "word " * 2000}]],
    "max_tokens": [None, "8", 0, -1, 2.5],
    "system": [5, [{"type": "image"}], {"text": "x"}],
    "tools": [5, [{"name": "f"}], [{"input_schema": {}}], [{"type": "web_search_20250305", "name": "web_search"}]],
    "tool_choice": ["auto", {"type": "tool", "name": "nope"}, {"type": "sometimes"}, {"type": "tool"},
                   {"type": "auto", "disable_parallel_tool_use": "yes"}],
    "temperature": [1.5, "x", -0.5],
    "top_p": [0, 2],
    "top_k": [5],
    "stop_sequences": ["x", [5], [""]],
    "thinking": [{"type": "enabled", "budget_tokens": 1024}],
    "stream": ["yes"],
    "n": [2],
}
BAD_RESPONSES = {
    "input": [None, 5, [5], [{"type": "image", "image_url": "x"}], [{"role": "bot", "content": "x"}],
              [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
              [{"type": "function_call", "name": "f", "arguments": "{}"}], [{"type": "function_call_output", "output": "x"}],
              [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}], [{"type": "reasoning"}],
              "word " * 2000, []],
    "instructions": [5, ["x"]],
    "tools": [5, [{"type": "web_search"}], [{"type": "function"}], [{"type": "function", "name": "f", "parameters": 5}],
              [{"type": "function", "function": {"name": "f"}}]],
    "tool_choice": ["sometimes", {"type": "function"}, {"type": "function", "name": "nope"}, {"type": "mcp"}],
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
