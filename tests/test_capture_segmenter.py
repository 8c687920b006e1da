"""The segmenter against a slow, obviously-correct reference, over many random conversation edit sequences, plus
small unit tests of answers (tool calls, stop strings, lengths). A deterministic fake engine stands in for vLLM.

    .venv/bin/python -m pytest tests/test_capture_segmenter.py -q

The reference decides extension vs rewrite straight from the rule (the new request repeats the previous request's
messages and the reply the client got, maybe adds messages, same tools, and the template renders the old
conversation as a prefix of the new one) and checks each prompt the engine got with full renders only: as text,
the prompt is the template's render of the conversation with each of our replies written exactly as generated;
when every earlier reply re-tokenizes to what the engine produced, the prompt is a full render token for token.
"""
import asyncio
import hashlib
import json
import random

import pytest

import capture
import protocols

WORDS = "alpha beta gamma delta one two three plus minus result answer value tool check".split()
CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the notes.",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLSETS = [[], [CALC], [CALC, SEARCH]]


def sentence(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))).capitalize() + "."


def route(position):
    """A made-up route, (L_moe=2, K=2) expert ids, that names the position it belongs to."""
    return [[position % 8, (position + 1) % 8], [(position + 2) % 8, (position + 3) % 8]]


class FakeBackend:
    """A deterministic engine: the reply depends only on (prompt, seed). Kinds of replies: text, tool calls (with
    or without text before them), ASCII token soup, text ended by <|endoftext|>; cut by max_tokens or a stop
    string as vLLM would (tokens up to the one completing the stop string)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls, self.forced, self.routes = tokenizer, [], None, False
        self.im_end, self.endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
        special = set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(
            ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]))
        self.ascii = [i for i in range(len(tokenizer)) if i not in special
                      and all(32 <= ord(ch) < 127 for ch in tokenizer.decode([i])) and tokenizer.decode([i])]

    def encode(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def generate(self, prompt, sampling, request_id, session_id=None, images=None):
        if self.forced is not None:
            ids = self.encode(self.forced[0]) + self.forced[1]
            return dict(token_ids=ids, logprobs=[-1.0] * len(ids), token_versions=[0] * len(ids),
                        routed_experts=None, finish_reason=self.forced[2], num_prompt_tokens=len(prompt))
        rng = random.Random(hash(tuple(prompt)) ^ (sampling.get("seed") or 0))
        kind = rng.choice(["text", "text", "tools", "tools", "text+tools", "soup", "endoftext"])
        calls = "\n".join('<tool_call>\n{"name": "%s", "arguments": {"expression": "%d + %d"}}\n</tool_call>'
                          % (rng.choice(["calculator", "search"]), rng.randint(0, 9), rng.randint(0, 9))
                          for _ in range(rng.randint(1, 3)))
        if kind == "soup":
            ids = [rng.choice(self.ascii) for _ in range(rng.randint(1, 12))] + [self.im_end]
        else:
            text = {"text": sentence(rng), "tools": calls, "text+tools": sentence(rng) + "\n" + calls,
                    "endoftext": sentence(rng)}[kind]
            ids = self.encode(text) + [self.endoftext if kind == "endoftext" else self.im_end]
        finish = "stop"
        for i in range(1, len(ids) + 1):  # vLLM stops at the token that completes a stop string
            if any(s in self.tokenizer.decode(ids[:i]) for s in sampling.get("stop") or []):
                ids = ids[:i]
                break
        if len(ids) > sampling["max_tokens"]:
            ids, finish = ids[:sampling["max_tokens"]], "length"
        version = rng.randint(0, 3)
        cut = rng.randint(0, len(ids))
        # routes as the engine returns them: from routed_experts_start to the last token it ran (not the final one)
        routes = [route(p) for p in range(sampling["routed_experts_start"], len(prompt) + len(ids) - 1)]
        out = dict(token_ids=ids, logprobs=[-rng.random() for _ in ids], routed_experts=routes if self.routes else None,
                   token_versions=[version] * cut + [version + 1] * (len(ids) - cut), finish_reason=finish,
                   num_prompt_tokens=len(prompt))
        self.calls.append(dict(session_id=session_id, prompt=list(prompt), sampling=sampling, out=out, images=images))
        return out


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = capture.CaptureServer(None, tiny_model_path, max_model_len=4096)
    s.backend = FakeBackend(s.tokenizer)
    yield s
    asyncio.run(s.stop())


# --- converting the client's (OpenAI-format) conversation to what each protocol sends and gets back


def to_anthropic(messages):
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    out = []
    for m in messages[1 if system is not None else 0:]:
        if m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls", [])]
            out.append({"role": "assistant", "content": blocks})
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        else:
            out.append({"role": "user", "content": [{"type": "text", "text": m["content"]}]})
    return system, out


def client_reply(result, protocol):
    """The assistant message exactly as the client received it, in OpenAI format."""
    if protocol == "openai":
        return protocols.openai_completion(result)["choices"][0]["message"]
    blocks = protocols.anthropic_message(result)["content"]
    message = {"role": "assistant", "content": "".join(b["text"] for b in blocks if b["type"] == "text")}
    calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
             for b in blocks if b["type"] == "tool_use"]
    return dict(message, tool_calls=calls) if calls else message


def internal(m):
    """The reference's own normalisation of an OpenAI-format message, for rendering and comparing."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    for key in ("tool_calls", "tool_call_id", "reasoning_content"):
        if m.get(key):
            out[key] = m[key]
    return out


def same(a, b):
    def key(m):
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls", [])]
        return json.dumps([m["role"], m.get("content") or "", calls, m.get("tool_call_id"),
                           m.get("reasoning_content") or ""], sort_keys=True)
    return key(a) == key(b)


# --- the property test


class ReferenceSegment:
    def __init__(self, prompt):
        self.token_ids, self.mask, self.logprobs, self.versions = list(prompt), [0] * len(prompt), [0.0] * len(prompt), \
            [-1] * len(prompt)
        self.conversation, self.raw, self.canonical = [], [], True  # raw: our replies as generated text, or None

    def extend(self, prompt, out):
        new = prompt[len(self.token_ids):]
        self.token_ids += new + out["token_ids"]
        self.mask += [0] * len(new) + [1] * len(out["token_ids"])
        self.logprobs += [0.0] * len(new) + out["logprobs"]
        self.versions += [-1] * len(new) + out["token_versions"]


def next_request(rng, messages, reply, tools, last, protocol):
    """One random client move: returns (messages, tools, body-or-None to resend verbatim)."""
    moves = ["user", "tools", "tools", "several", "same", "retry", "resample", "drop", "edit", "compact",
             "edit_reply", "change_tools"] + ["reasoning"] * (protocol == "openai")  # Anthropic: no reasoning field
    move = rng.choice(moves)
    user = {"role": "user", "content": sentence(rng)}
    with_reply = messages + [reply]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": str(rng.randint(0, 99))}
               for c in reply.get("tool_calls", [])]
    if move == "retry":
        return messages, tools, last
    if move == "resample":
        return messages, tools, None
    if move == "tools" and results:
        return with_reply + results, tools, None
    if move == "several":
        return with_reply + results + [user, {"role": "user", "content": sentence(rng)}], tools, None
    if move == "same":
        return with_reply, tools, None
    if move == "drop":
        keep = rng.randint(1, len(messages))
        return messages[:keep] + [user], tools, None
    if move == "edit":
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        edited = list(messages)
        edited[users[0]] = {"role": "user", "content": sentence(rng) + " (edited)"}
        return edited + [user], tools, None
    if move == "compact":
        return [messages[0]] * (messages[0]["role"] == "system") + [
            {"role": "user", "content": "Summary: " + sentence(rng)}], tools, None
    if move == "edit_reply":
        return messages + [dict(reply, content=(reply.get("content") or "") + " (edited)"), user], tools, None
    if move == "change_tools":
        return with_reply + [user], rng.choice([t for t in TOOLSETS if t != tools]), None
    if move == "reasoning":  # an assistant turn with reasoning after the last query: the template keeps the
        # reasoning now and drops it once a new query arrives, rewriting an earlier turn
        mine = {"role": "assistant", "content": sentence(rng), "reasoning_content": sentence(rng)}
        return with_reply + [mine, {"role": "tool", "tool_call_id": "t", "content": "ok"}], tools, None
    return with_reply + [user], tools, None


async def run_sequence(server, seed):
    rng = random.Random(seed)
    tok, backend = server.tokenizer, server.backend
    protocol = rng.choice(["openai", "anthropic"])
    session = server.new_session(attempt_id=f"sequence-{seed}")

    def render_text(messages, tools, gen):
        return tok.apply_chat_template([internal(m) for m in messages], tools=tools or None, tokenize=False,
                                       add_generation_prompt=gen)

    def tokens(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    tools = rng.choice(TOOLSETS)
    messages = [{"role": "system", "content": sentence(rng)}] * (rng.random() < 0.7) + [
        {"role": "user", "content": sentence(rng)}]
    reference, answers, last_body, resend, reply = [], {}, None, None, None
    for step in range(rng.randint(2, 12)):
        if step:
            messages, tools, resend = next_request(rng, messages, reply, tools, last_body, protocol)
        if resend is not None:
            body = resend
        elif protocol == "openai":
            body = {"model": "tiny", "messages": messages, "tools": tools, "seed": rng.randint(0, 9999),
                    "max_tokens": rng.choice([None, None, 6, 60]), "stop": rng.choice([None, None, ["gamma"]])}
        else:
            system, turns = to_anthropic(messages)
            body = {"model": "tiny", "messages": turns, "max_tokens": rng.choice([6, 60, 200]),
                    "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                               "input_schema": t["function"]["parameters"]} for t in tools],
                    "stop_sequences": rng.choice([[], ["gamma"]]), **({"system": system} if system else {})}
        raw = json.dumps(body).encode()
        request = (protocols.parse_openai if protocol == "openai" else protocols.parse_anthropic)(json.loads(raw), server)
        request.key, request.retry = hashlib.sha256(raw).hexdigest(), True  # a resend stands for a client retry
        if protocol == "anthropic":  # both protocols normalise the same conversation the same way
            assert request.messages == [internal(m) for m in messages]
        n_calls, before = len(backend.calls), session.segment_dicts()
        result = await server.respond(session, request)
        if request.key in answers:  # a retry: the same answer, nothing recorded, no engine call
            assert result == answers[request.key] and len(backend.calls) == n_calls
            assert session.segment_dicts() == before
            last_body = body
            continue
        assert len(backend.calls) == n_calls + 1
        call = backend.calls[-1]
        prompt, out = call["prompt"], call["out"]
        def common(r):  # leading messages the request shares with a segment's conversation
            pairs = enumerate(zip(r.conversation, messages))
            return next((i for i, (a, b) in pairs if not same(a, b)),
                        min(len(r.conversation), len(messages)))
        # the open segment (every one: fewer than 16 per sequence) that the request's messages start
        # with, the longest; it extends it if the template renders it as a prefix
        seg = max([r for r in reference if tools == r.tools and common(r) == len(r.conversation)],
                  key=lambda r: (len(r.conversation), r.step), default=None)
        extends = seg is not None and render_text(messages, tools, True).startswith(
            render_text(seg.conversation, tools, False))
        if extends:
            assert prompt[:len(seg.token_ids)] == seg.token_ids
            # as text: the full render, with each of our replies exactly as generated
            model_view = [m if raw_text is None else {"role": "assistant", "content": raw_text}
                          for m, raw_text in zip(seg.conversation, seg.raw)] + messages[len(seg.conversation):]
            assert tok.decode(prompt, skip_special_tokens=False) == render_text(model_view, tools, True)
            if seg.canonical:
                assert prompt == tokens(render_text(messages, tools, True))
            conversation, raw_replies = seg.conversation + messages[len(seg.conversation):], seg.raw + [None] * (
                len(messages) - len(seg.conversation))
        else:
            assert prompt == tokens(render_text(messages, tools, True))  # a new segment: a full render
            near = max(reference, key=lambda r: (common(r), r.step), default=None)  # told against
            why = ("the attempt's first request" if near is None else
                   "a new conversation" if not common(near) else
                   "changed tools" if tools != near.tools else
                   "compaction" if len(messages) < len(near.conversation) else
                   "a rewrite of message" if common(near) < len(near.conversation) else
                   "a chat template")
            seg = ReferenceSegment(prompt)
            seg.tools = tools
            reference.append(seg)
            conversation, raw_replies = list(messages), [None] * len(messages)
        seg.extend(prompt, out)
        seg.step = step
        reply = client_reply(result, protocol)
        generated = out["token_ids"]
        seg.raw = raw_replies + [tok.decode(generated[:-1] if generated[-1:] == [backend.im_end] else generated,
                                            skip_special_tokens=False)]
        seg.conversation = conversation + [reply]
        # a reply is canonical when the full render of the conversation holds exactly the engine's tokens
        seg.canonical &= generated[-1:] == [backend.im_end] and tokens(render_text(seg.conversation, tools, False)) \
            == prompt + generated + tokens("\n")
        answers[request.key], last_body = result, body
        # the server's record equals the reference's: token ids, masks, logprobs, versions, segment by segment
        recorded = session.segment_dicts()
        assert [(s["token_ids"], s["action_mask"], s["behavior_logprobs"], s["token_versions"]) for s in recorded] \
            == [(r.token_ids, r.mask, r.logprobs, r.versions) for r in reference]
        assert [s["segment_index"] for s in recorded] == list(range(len(reference)))
        assert extends or recorded[-1]["opened"].startswith(why)
    segments = server.finish_session(session.id, reward=0.25)
    assert all(s["attempt_id"] == f"sequence-{seed}" and s["reward"] == 0.25 and s["finished"] for s in segments)
    return len(reference)


def test_random_edit_sequences_match_the_reference(server):
    counts = [asyncio.run(run_sequence(server, seed)) for seed in range(150)]
    assert sum(counts) > len(counts)  # rewrites happened: some attempts have several segments
    assert max(counts) >= 3


def test_routed_experts_line_up_with_tokens(server):
    # the engine returns routes only for tokens it has not reported before; the segment holds one per token
    server.backend.routes = True
    try:
        session = server.new_session()
        messages = [{"role": "user", "content": "route me"}]
        for turn in range(4):
            body = {"messages": messages, "max_tokens": 20, "seed": turn}
            result = asyncio.run(server.respond(session, protocols.parse_openai(body, server)))
            messages = messages + [client_reply(result, "openai"), {"role": "user", "content": f"next {turn}"}]
    finally:
        server.backend.routes = False
    (segment,) = session.segment_dicts()
    n = len(segment["token_ids"])
    assert segment["routed_experts"][:n - 1] == [route(p) for p in range(n - 1)]
    assert len(segment["routed_experts"]) == n  # the final token (never run through the model) is padded


# --- answers


async def answer(server, body, protocol="openai", forced=None):
    """One request on a new session; `forced` = (text, extra ids, finish reason) replaces the fake's reply."""
    session = server.new_session()
    server.backend.forced = forced
    try:
        request = (protocols.parse_openai if protocol == "openai" else protocols.parse_anthropic)(body, server)
        return await server.respond(session, request), session
    finally:
        server.backend.forced = None


def test_tool_calls_are_parsed_by_vllms_hermes_parser(server):
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
    body = {"messages": [{"role": "user", "content": "1 + 1?"}], "tools": [CALC]}
    result, _ = asyncio.run(answer(server, body, forced=(text, [server.backend.im_end], "stop")))
    message = protocols.openai_completion(result)["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] == "Let me compute.\n"
    assert message["message"]["tool_calls"][0]["function"] == {"name": "calculator",
                                                              "arguments": '{"expression": "1 + 1"}'}
    anthropic_body = {"max_tokens": 50, "messages": [{"role": "user", "content": "1 + 1?"}],
                      "tools": [{"name": "calculator", "input_schema": CALC["function"]["parameters"]}]}
    result, _ = asyncio.run(answer(server, anthropic_body, "anthropic", forced=(text, [server.backend.im_end], "stop")))
    message = protocols.anthropic_message(result)
    assert message["stop_reason"] == "tool_use" and message["content"][1]["input"] == {"expression": "1 + 1"}
    assert message["content"][1]["id"].startswith("toolu_")
    # tool_choice "none": the model's text comes back as it is
    result, _ = asyncio.run(answer(server, dict(body, tool_choice="none"),
                                   forced=(text, [server.backend.im_end], "stop")))
    assert result["message"]["content"] == text and "tool_calls" not in result["message"]


def test_stop_string_cuts_the_text_and_records_every_sampled_token(server):
    tok = server.tokenizer
    body = {"messages": [{"role": "user", "content": "go"}], "stop": ["STOP"]}
    result, session = asyncio.run(answer(server, body, forced=("one two STOP", [], "stop")))
    assert result["message"]["content"] == "one two " and result["finish_reason"] == "stop"
    assert protocols.anthropic_message(result)["stop_reason"] == "stop_sequence"
    # the client sees the text before the stop string; the trajectory holds every token the
    # engine sampled, the stop string's included (mask 1), and the next turn closes ours with the
    # template's end-of-turn token and separator (context, mask 0)
    segment = session.segments[0]
    generated = [t for t, m in zip(segment.token_ids, segment.action_mask) if m]
    assert generated == tok("one two STOP")["input_ids"]
    follow = {"messages": body["messages"] + [{"role": "assistant", "content": "one two "},
                                              {"role": "user", "content": "more"}]}
    asyncio.run(server.respond(session, protocols.parse_openai(follow, server)))
    text = tok.decode(session.segments[0].token_ids)
    assert len(session.segments) == 1
    assert "one two STOP<|im_end|>\n<|im_start|>user\nmore<|im_end|>" in text
    # a stop string inside a token: the text ends where the stop string begins, the token recorded
    forced = ("one two", [], "stop")
    result, session = asyncio.run(answer(server, dict(body, stop=["wo"]), forced=forced))
    ids = tok("one two")["input_ids"]
    assert result["message"]["content"] == "one t"
    assert session.segments[0].token_ids[-len(ids):] == ids
    assert session.segments[0].action_mask[-len(ids):] == [1] * len(ids)
    # a turn whose first token holds the stop string: that token is recorded, the text is empty
    forced = (" hello", [], "stop")
    result, session = asyncio.run(answer(server, dict(body, stop=[" "]), forced=forced))
    assert result["message"]["content"] == "" and result["stop_sequence"] == " "
    first = tok(" hello")["input_ids"][:1]
    assert " " in tok.decode(first)  # vLLM stops on it
    segment = session.segments[0]
    assert [t for t, m in zip(segment.token_ids, segment.action_mask) if m] == first
    # tokens a backend sampled past the token that completed the stop string are not recorded
    result, session = asyncio.run(answer(server, body, forced=("one STOP two three", [], "stop")))
    assert result["message"]["content"] == "one "
    segment = session.segments[0]
    generated = [t for t, m in zip(segment.token_ids, segment.action_mask) if m]
    assert tok.decode(generated) == "one STOP"
    result, _ = asyncio.run(answer(server, {"messages": body["messages"]}, forced=("cut short", [], "length")))
    assert result["finish_reason"] == "length"
    assert protocols.anthropic_message(result)["stop_reason"] == "max_tokens"


def test_top_p_is_refused_only_under_importance_correction(tiny_model_path):
    strict = capture.CaptureServer(None, tiny_model_path, importance_correction=True)
    body = {"messages": [{"role": "user", "content": "x"}], "top_p": 0.9}
    with pytest.raises(protocols.RequestError, match="importance correction") as e:
        protocols.parse_openai(body, strict)
    assert e.value.status == 400
    with pytest.raises(protocols.RequestError, match="importance correction"):
        protocols.parse_anthropic(dict(body, max_tokens=5), strict)
    assert protocols.parse_openai(dict(body, top_p=1.0), strict).sampling["top_p"] == 1.0
    lenient = capture.CaptureServer(None, tiny_model_path)
    assert protocols.parse_openai(body, lenient).sampling["top_p"] == 0.9
    asyncio.run(strict.stop())
    asyncio.run(lenient.stop())
