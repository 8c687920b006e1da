"""
The capture server. Agents are unchanged programs using the official OpenAI or Anthropic
SDK (or a framework on one: the OpenAI Agents SDK, LangChain, pydantic-ai, ...); only
their base URL points here. It speaks chat completions, the Responses API and Anthropic
Messages. The server renders each request to token ids with the model's own tokenizer
and chat template, asks a vLLM engine for tokens (ids in, ids + sampling logprobs out),
answers in the protocol the client spoke (tool calls parsed by the vLLM parser of the
model's call format: Hermes JSON for Qwen3, XML for Qwen3.5 / 3.6; reasoning as each
protocol gives it), and records the trajectory token-exactly (README, invariant 1).

    python capture.py                          # serve the tiny model on CPU; prints the address
    python capture.py --model DIR --port 8000  # any local HuggingFace model directory
    python capture.py --view out/tiny          # the trajectory viewer over a run's out_dir (viewer.py), no engine
    curl -X POST http://127.0.0.1:8000/sessions               # -> {"id", "base_url", "api_key"}
    OpenAI(base_url=base_url, api_key=api_key)  /  Anthropic(base_url=base_url, api_key=api_key)
    curl -H "x-api-key: KEY" http://127.0.0.1:8000/sessions/ID  # the recorded segments
    curl -H "x-api-key: KEY" -d '{"reward": 1}' http://127.0.0.1:8000/sessions/ID/finish

From Python (the rollout side): `server = CaptureServer(backend, model_dir,
max_model_len=...)`, then `server.start_in_thread()` (or `await server.start()` in your loop);
per attempt `session = server.new_session(attempt_id)` hands the agent `session.base_url` and
`session.api_key`, and `server.finish_session(session.id, reward)` returns its segments
(dicts: attempt_id, segment_index, token_ids, action_mask, behavior_logprobs, token_versions,
routed_experts, reward, finished, images, opened, parent, started);
`write_trajectories(path, segments, tokenizer)` appends them as JSONL.

The segment rule (the Segmenter class, no HTTP in it). A session may hold several open segments,
one per conversation (a lead agent and its sub-agents): a request that extends an open segment's
conversation generates on that segment's exact recorded ids + the template's separator after our
end-of-turn token + the tokens of every new message (all with action mask 0), so generated tokens
are never re-tokenized. Any other request (a new conversation, compaction, an edited or dropped
turn, changed tools, a template that rewrites earlier turns) opens a new segment from a full
render; each segment records the segment open when it began (`parent`) and when (`started`), so an
attempt is a tree. Turns on different segments run at once, turns on one segment in order; at most
max_open_segments stay open (the least recently extended closes first).

Streaming requests get text and tool-call deltas as the engine samples them (with a backend
that has `stream`; the calls read by vLLM's streaming parser). A turn that begins inside
`<think>` (the generation prompt of a reasoning template opens it) is split at `</think>`:
the reasoning goes to the client as its protocol expects and is recorded as the generated
tokens it is; a template that drops earlier turns' reasoning at a new user query rewrites
them, and a new segment opens there (a tool loop keeps its reasoning shown: one segment).

Images (OpenAI image_url and Responses input_image data URIs, Anthropic base64 image
blocks, in user messages and tool results) are part of their message: the same text with
another image is a rewrite. Each image's placeholder is expanded to the tokens the model's
processor gives it (context, mask 0), and the segment keeps the image files (`images`: the
bytes the client sent, in the order of their tokens) for the trainer's forward.

Forced tool calls put the template's call opening in the context (mask 0), and the rest of the
one call is sampled under the tool's JSON schema (protocols.call_grammar: a vLLM structural
tag in the tool parser's own call format), as are calls to `strict` tools and structured
output; tool_choice "none" bans the call opening. What is sampled under a mask has the masked
distribution's behavior logprob (constrained_tokens: "train" records it as generated tokens,
"mask" as context). A stop string ends the answer's text; the recorded turn keeps the tokens
the engine sampled up to the one that completed it, so a policy learns to stop.
"""
import asyncio
import base64
import contextlib
import dataclasses
import gc
import hashlib
import itertools
import json
import logging
import os
import re
import secrets
import signal
import sys
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine import OPTIONS, Engine
from http_server import GuardedHttp, bind_socket, new_event_loop, serve_app
from protocols import (ANSWERS, EVENTS, PARSERS, THINK_TAGS, XML_TOOL_PARSERS, ImageTokens,
                       RequestError, argument_mapping, call_grammar, call_id, call_tags,
                       error_response, field, json_handler, parse_anthropic, read_calls, same_json,
                       same_message, split_reasoning, stream_deltas, strict_json, tool_call,
                       tool_parser_of)

# -----------------------------------------------------------------------------
# sessions and segments: the recorded trajectory


@dataclasses.dataclass(eq=False)
class Segment:
    """One conversation's tokens (README, invariant 1) and what extending it needs: the conversation
    it renders (our last reply included; None once closed) and its tools. `parent`: the index of the
    segment that was open when this one began (a lead's segment waiting on a tool call, for a
    sub-agent's); `started`: when (time.time())."""
    attempt_id: str
    index: int
    parent: int | None = None
    started: float = 0.0
    opened: str | None = None  # why its first request extended no open segment (Segmenter.opening)
    token_ids: list = dataclasses.field(default_factory=list)
    action_mask: list = dataclasses.field(default_factory=list)
    behavior_logprobs: list = dataclasses.field(default_factory=list)
    token_versions: list = dataclasses.field(default_factory=list)
    images: list = dataclasses.field(default_factory=list)  # the images in token_ids (ImageBytes)
    image_tokens: list = dataclasses.field(default_factory=list)  # how many tokens each image takes
    routed_experts: list | None = None
    conversation: list | None = None
    tools: list | None = None
    last_generated: list = dataclasses.field(default_factory=list)
    last_used: float = 0.0  # time.monotonic() of its last turn: the cap closes the least recent
    closed: bool = False
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)  # one turn at a time

    def append(self, token_ids, generated=None):
        """Context tokens (mask 0), or, given the engine's
        output dict, generated tokens (mask 1)."""
        n = len(token_ids)
        self.token_ids += token_ids
        self.action_mask += [1 if generated else 0] * n
        self.behavior_logprobs += generated["logprobs"] if generated else [0.0] * n
        self.token_versions += generated["token_versions"] if generated else [-1] * n

    def to_dict(self, reward, finished):
        routes, n = self.routed_experts, len(self.token_ids)
        if routes is not None and len(routes) < n:  # the last token never ran through the model:
            routes = routes + [routes[-1]] * (n - len(routes))  # its route steers nothing
        return dict(attempt_id=self.attempt_id, segment_index=self.index, token_ids=list(self.token_ids),
                    action_mask=list(self.action_mask), behavior_logprobs=list(self.behavior_logprobs),
                    token_versions=list(self.token_versions), routed_experts=routes, reward=reward,
                    finished=finished, images=[bytes(b) for b in self.images], opened=self.opened,
                    parent=self.parent, started=self.started)


class Segmenter:
    """The segment rule, with no HTTP in it. A session holds several open segments (a lead agent's
    conversation and its sub-agents'). A request extends the open segment whose conversation its
    messages start with (the longest; same tools) when the template renders that conversation as
    a prefix of the request's: it generates on the segment's exact ids + the template's separator
    after our end-of-turn token + the tokens of every new message (all mask 0), so generated tokens
    are never re-tokenized. Any other request (a new conversation, compaction, an edited or
    dropped turn, changed tools, a template that rewrites earlier turns) opens a new segment from
    a full render.
    At most max_open_segments stay open: opening one more closes the least recently extended (one
    with a turn in flight last); a closed segment keeps its tokens, drops its conversation, and is
    never extended again (a request that would extend it opens a new segment)."""

    def __init__(self, render_text, tokenize, end_texts, added_texts, max_open_segments=16):
        self.render_text, self.tokenize = render_text, tokenize
        self.max_open_segments = max_open_segments
        self.end_texts, self.added_texts = end_texts, added_texts

    @staticmethod
    def common(segment, messages):
        """How many leading messages of `messages` the segment's conversation has."""
        pairs = zip(segment.conversation, messages)
        return next((i for i, (a, b) in enumerate(pairs) if not same_message(a, b)),
                    min(len(segment.conversation), len(messages)))

    def candidate(self, segments, messages, tools):
        """The open segment whose whole conversation `messages` start with (the longest), or
        None."""
        found = [s for s in segments if not s.closed and s.tools == tools
                 and self.common(s, messages) == len(s.conversation)]
        return max(found, key=lambda s: (len(s.conversation), s.last_used), default=None)

    def extension(self, segment, messages, tools):
        """(tokens to append, new conversation) if `messages` extend `segment` as the template
        renders them, else None (it renders the earlier turns differently: a new segment)."""
        conv = segment.conversation
        # our own record of the prefix: the client's echo may differ in formatting only (JSON
        # whitespace, tool-call ids)
        conversation = conv + messages[len(conv):]
        before = self.render_text(conv, tools, False)
        after = self.render_text(conversation, tools, True)
        new_text, end = after[len(before):], max(before.rfind(t) for t in self.end_texts)
        # The template must render the old conversation as a prefix of the new one (else it rewrote
        # an earlier turn), and the new text must start at an added token, which tokenizers split on
        # before anything else: so its tokens alone are the full render's. Costs two renders but
        # tokenizes only the new text.
        if not after.startswith(before) or end < 0 or not new_text.startswith(self.added_texts):
            return None
        closing = self.tokenize(before[end:])  # after our reply: end-of-turn token, separator
        if segment.last_generated[-1:] == closing[:1]:
            closing = closing[1:]  # the engine stopped on that very token
        return closing + self.tokenize(new_text), conversation

    def parent(self, segments):
        """The likely parent of a segment opening now: the open segment that last recorded a turn,
        preferring one whose last turn called tools not yet answered (a lead waiting on its
        sub-agents)."""
        open_ = [s for s in segments if not s.closed and s.conversation]
        waiting = lambda s: bool(s.conversation[-1].get("tool_calls"))  # noqa: E731
        return max(open_, key=lambda s: (waiting(s), s.last_used), default=None)

    def opening(self, segments, messages, tools):
        """Why a request that extends no open segment opens a new one (the viewer shows it), told
        against the open segment that shares the most leading messages with it."""
        open_ = [s for s in segments if not s.closed]
        near = max(open_, key=lambda s: (self.common(s, messages), s.last_used), default=None)
        shared = self.common(near, messages) if near else 0
        if not segments:
            return "the attempt's first request"
        if not shared:
            return f"a new conversation (none of the {len(open_)} open segments begins with it)"
        conv = near.conversation
        return ("changed tools" if tools != near.tools else
                f"compaction: {len(messages)} messages, the segment had {len(conv)}"
                if len(messages) < len(conv) else
                f"a rewrite of message {shared} ({conv[shared]['role']})" if shared < len(conv) else
                "a chat template that renders the earlier turns differently")

    def open(self, segments, attempt_id, parent, started, opened):
        """Append a new segment to `segments`, closing the least recently extended open one when
        max_open_segments are open (a segment with a turn in flight last)."""
        open_ = [s for s in segments if not s.closed]
        if len(open_) >= self.max_open_segments:
            oldest = min(open_, key=lambda s: (s.lock.locked(), s.last_used))
            oldest.closed, oldest.conversation = True, None
        segments.append(Segment(attempt_id, len(segments), parent, started, opened))
        return segments[-1]


class Session:
    """One agent attempt: its own base URL and key and its segments."""

    def __init__(self, url, attempt_id=None):
        self.id = uuid.uuid4().hex[:16]
        self.api_key = "sk-capture-" + secrets.token_urlsafe(24)
        self.base_url = f"{url}/s/{self.id}/v1"
        self.attempt_id = attempt_id or self.id
        self.segments, self.finished, self.reward = [], False, None
        self.answers = OrderedDict()  # request key -> result, for client retries
        self.pending = {}  # request key -> the task answering it (a retry meanwhile waits for it)
        self.responses = {}  # Responses API: response id -> the conversation
                             # it ended, for previous_response_id
        self.turns = self.in_flight = 0
        self.quiet = asyncio.Event()  # set while no request is in flight
        self.quiet.set()
        self.last_used = time.monotonic()  # a session made over HTTP expires when idle
        self.record_lock = threading.Lock()  # finish_session may run on another thread

    def segment_dicts(self):
        with self.record_lock:
            return [s.to_dict(self.reward, self.finished) for s in self.segments]

    @contextlib.asynccontextmanager
    async def request(self):
        """A request in flight (finish waits for none; an idle session is not dropped under one)."""
        self.in_flight += 1
        self.quiet.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.quiet.set()


def failure(e, session_id):
    """(status, message, param) of a failed request: a
    RequestError's own, else the engine's failure (logged)."""
    if isinstance(e, RequestError):
        return e.status, e.message, e.param
    print(f"capture: request on session {session_id} failed: {e!r}", file=sys.stderr)
    return 500, f"The engine failed on this request: {type(e).__name__}: {e}", None


DROPPED_RECORDS = 8192  # dropped sessions remembered (~0.3 KB each); older ones answer 404


def key_digest(api_key):
    return hashlib.blake2b(api_key.encode(), digest_size=16).digest()


def end_token_ids(tokenizer):
    ids = {tokenizer.eos_token_id}
    # the engine also stops at generation_config's eos ids
    # (Qwen: <|im_end|> and <|endoftext|>), where it has one
    with contextlib.suppress(OSError, ValueError):
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(tokenizer.name_or_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


# -----------------------------------------------------------------------------
# the server

# A private-use character and the one after it (its index) stand for an
# escaped piece of message text while the template renders; client text
# holding PLACEHOLDER itself is escaped too, so every placeholder is ours.
PLACEHOLDER, PLACEHOLDER_BASE = "\ue000", 0xE100
PLACEHOLDERS = re.compile(PLACEHOLDER + "(.)", re.S)
INLINE_RENDER_BYTES = 64 << 10  # larger request bodies render on the render thread
MAX_DEPTH = 64  # JSON nesting in tool schemas and arguments (real schemas stay under ~15)
PROBE = [{"role": "user", "content": "x"}]  # a conversation rendered to see
                                            # what the template adds after it


def plain_token_ids(tokenizer, text):
    """Token ids of `text` as plain text: its added-token
    strings (special or not) are not recognised."""
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
    return [t.id for piece, _ in pieces for t in backend.model.tokenize(piece)]


class CaptureServer:
    """HTTP front of one backend (an Engine, or rollout's
    router): sessions, rendering, the segmenter.

    Limits (docs/capture.md, "Limits"): request bodies up to max_body_bytes, arriving
    within body_timeout_s; headers within header_timeout_s and under 64 KiB; an idle keep-alive
    connection closed after keep_alive_s; at most max_connections
    connections (more get 503); sessions made over HTTP expire after http_session_idle_s without a
    request, at most max_http_sessions live at once (finished ones make room first, else POST
    /sessions gets 429); a session keeps at most max_open_segments segments open (Segmenter)."""

    def __init__(self, backend, tokenizer, *, max_model_len=OPTIONS["max_model_len"], importance_correction=False,
                 host="127.0.0.1", port=0, model_name=None, max_body_bytes=16 << 20, max_cached_answers=16,
                 header_timeout_s=10.0, body_timeout_s=60.0, max_connections=4096, http_session_idle_s=1800.0,
                 max_http_sessions=1024, constrained_tokens="train",
                 max_images_per_prompt=OPTIONS["max_images_per_prompt"], tool_parser=None,
                 max_open_segments=16, keep_alive_s=20.0, **image_limits):
        from transformers import AutoTokenizer
        from vllm.tool_parsers import ToolParserManager
        self.backend = backend
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer) if isinstance(tokenizer, str) else tokenizer
        # the model's tool-call format, as its chat template writes calls: Qwen3.5
        # / 3.6's XML (vLLM's qwen3_coder parser, arguments rendered from mappings)
        # or Qwen3's Hermes JSON; `tool_parser` names another vLLM parser
        self.tool_parser_name = tool_parser or tool_parser_of(self.tokenizer)
        self.tool_parser_cls = ToolParserManager.get_tool_parser(self.tool_parser_name)
        self.arguments_as_mapping = self.tool_parser_name in XML_TOOL_PARSERS
        # vLLM's grammar-engine parsers
        self.strips_content = hasattr(self.tool_parser_cls, "_parser_engine_cls")
        # its calls' grammar (protocols.call_grammar)
        self.call_format = self.tool_parser_cls.structural_tag_model
        # a malformed tool call is the policy's output, not our
        # error (its text goes back as content): no traceback
        logging.getLogger("vllm.tool_parsers.hermes_tool_parser").setLevel(logging.CRITICAL)
        self.end_ids = end_token_ids(self.tokenizer)
        self.vision = ImageTokens(self.tokenizer, max_images_per_prompt, **image_limits)
        vocab = self.tokenizer.get_added_vocab()  # the call's tags as single tokens:
                                                  # None where the tokenizer lacks them
        self.call_tags = call_tags(self.tool_parser_cls(self.tokenizer))
        self.call_ids = [vocab.get(t) for t in self.call_tags]
        # None where the model has no reasoning tags
        self.think_ids = [vocab.get(t) for t in THINK_TAGS]
        self.constrained_tokens = constrained_tokens  # "train" or "mask" (plan.check_config
                                                      # checks the run's)
        self.end_texts = [self.tokenizer.decode([i]) for i in self.end_ids]
        self.added_texts = tuple(self.tokenizer.get_added_vocab())
        self.segmenter = Segmenter(self.render_text, self.tokenize, self.end_texts,
                                   self.added_texts, max_open_segments)
        # Message text is tokenized as text: added-token strings in it (a web page
        # holding "<|im_end|>") become placeholders before rendering and tokenize()
        # puts their plain tokens back, so only the template's own markup becomes
        # control tokens. Assistant text escapes only special tokens: <think> /
        # <tool_call> there are the model's own output (and templates parse them).
        self.escapes = sorted(self.added_texts, key=len, reverse=True) + [PLACEHOLDER]
        self.escape_index = {t: PLACEHOLDER + chr(PLACEHOLDER_BASE + i) for i, t in enumerate(self.escapes)}
        special = set(self.tokenizer.all_special_tokens) | {PLACEHOLDER}
        self.escape_any = re.compile("|".join(map(re.escape, self.escapes)))
        self.escape_special = re.compile("|".join(re.escape(t) for t in self.escapes if t in special))
        self.escaped_ids = [plain_token_ids(self.tokenizer, t) for t in self.escapes]
        # one token covers at most this many characters: a
        # longer render cannot fit, whatever it tokenizes to
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()))
        # large requests, off the loop
        self.render_pool = ThreadPoolExecutor(1, thread_name_prefix="capture-render")
        self.header_timeout_s, self.body_timeout_s, self.max_connections = header_timeout_s, body_timeout_s, max_connections
        self.keep_alive_s = keep_alive_s
        self.http_session_idle_s, self.max_http_sessions = http_session_idle_s, max_http_sessions
        self.http_sessions = OrderedDict()  # id -> Session made over HTTP,
                                            # least recently used first
        self.max_model_len, self.importance_correction = max_model_len, importance_correction
        self.model_name = model_name or os.path.basename(os.path.normpath(self.tokenizer.name_or_path)) or "model"
        self.max_body_bytes, self.max_cached_answers = max_body_bytes, max_cached_answers
        self.socket = bind_socket(host, port)  # bound now so that url (and sessions'
                                               # base URLs) exist before serving
        self.url = f"http://{host}:{self.socket.getsockname()[1]}"
        self.sessions = {}
        # sessions dropped lately (finished, expired, or dropped by the pool): id
        # -> (key digest, why), so that a late request hears that its session is
        # gone rather than that its key is wrong; the oldest are forgotten first
        self.dropped = OrderedDict()
        self.uvicorn = self.loop = self.thread = None
        # what the template's generation prompt adds to close reasoning
        # (enable_thinking=False): the context that structured output and Anthropic's
        # thinking "disabled" sample after ("" for a template without reasoning)
        thinking, closed = (self.render_text(PROBE, None, True, **kw) for kw in ({}, {"enable_thinking": False}))
        self.closed_reasoning = closed[len(thinking):] if closed.startswith(thinking) else ""
        routes = [Route("/sessions", self.http_new_session, methods=["POST"]),
                  Route("/sessions/{sid}", self.http_get_session, methods=["GET"]),
                  Route("/sessions/{sid}/finish", self.http_finish_session, methods=["POST"]),
                  Route("/s/{sid}/v1/models", self.http_models, methods=["GET"]),
                  Route("/s/{sid}/v1/chat/completions", self.http_chat, methods=["POST"]),
                  Route("/s/{sid}/v1/responses", self.http_chat, methods=["POST"])]
        # Anthropic Messages and its token count, also under
        # the /v1 the Anthropic SDK adds to the same base_url
        routes += [Route(f"/s/{{sid}}/v1{v}/messages{tail}", handler, methods=["POST"]) for v in ("", "/v1")
                   for tail, handler in (("", self.http_chat), ("/count_tokens", self.http_count_tokens))]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self.http_error})

    # --- the Python API of the rollout side

    def new_session(self, attempt_id=None):
        session = Session(self.url, attempt_id)
        self.sessions[session.id] = session
        return session

    def finish_session(self, session_id, reward):
        """End an attempt: later requests for turns get 410; every segment gets the reward
        (the first finish's: a later one changes nothing). Returns the segment dicts."""
        session = self.sessions[session_id]
        with session.record_lock:
            if not session.finished:
                session.finished, session.reward = True, None if reward is None else float(reward)
        return session.segment_dicts()

    def drop_session(self, session_id, why=None):
        session = self.sessions.pop(session_id, None)
        self.http_sessions.pop(session_id, None)
        # the router's engine affinity, if it keeps one
        getattr(self.backend, "forget", lambda _: None)(session_id)
        if session is not None:
            why = why or ("it finished and was dropped" if session.finished else "it was dropped unfinished")
            self.dropped[session_id] = key_digest(session.api_key), why
            if len(self.dropped) > DROPPED_RECORDS:
                self.dropped.popitem(last=False)

    def make_room_for_http_session(self):
        """Drop HTTP sessions idle past their lifetime, and finished ones
        (least recently used first) while their count is at
        max_http_sessions. False if it still is: every one left is live."""
        now = time.monotonic()
        for s in list(self.http_sessions.values()):  # least recently used first
            idle, full = now - s.last_used > self.http_session_idle_s, len(self.http_sessions) >= self.max_http_sessions
            if not (idle or full):
                break
            if (idle or s.finished) and not s.in_flight:  # a request in flight keeps its session
                self.drop_session(s.id, None if s.finished else self.expiry())
        return len(self.http_sessions) < self.max_http_sessions

    # --- rendering and the segmenter

    def escape(self, value, pattern, depth=0):
        """`value` (a JSON value) with every match of `pattern`
        in its strings (keys too) replaced by a placeholder."""
        if isinstance(value, str):
            # cannot fit: refused before any work
            if len(value) > self.max_model_len * self.max_token_chars:
                raise RequestError(400, f"A text of {len(value)} characters is more than the model's context of "
                                        f"{self.max_model_len} tokens can hold.", "messages")
            return pattern.sub(lambda m: self.escape_index[m.group()], value)
        if depth > MAX_DEPTH:
            raise RequestError(400, f"The request nests JSON deeper than {MAX_DEPTH} levels.")
        if isinstance(value, dict):
            return {self.escape(k, pattern): self.escape(v, pattern, depth + 1) for k, v in value.items()}
        return [self.escape(v, pattern, depth + 1) for v in value] if isinstance(value, list) else value

    def render_text(self, messages, tools, add_generation_prompt, **template_kwargs):
        if self.arguments_as_mapping:  # XML templates write each argument: they
                                       # read a mapping, as vLLM gives them
            messages = [dict(m, tool_calls=[argument_mapping(c) for c in m["tool_calls"]]) if m.get("tool_calls")
                        else m for m in messages]
        messages = [{k: self.escape(v, self.escape_special if m.get("role") == "assistant" and k in (
            "content", "reasoning_content") else self.escape_any) for k, v in m.items()} for m in messages]
        tools = self.escape(tools, self.escape_any)
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **template_kwargs)
        except Exception as e:  # jinja raise_exception(...) and friends:
                                # the template refused this conversation
            raise RequestError(400, f"The chat template rejected the conversation: {e}.", "messages")

    def tokenize(self, text):
        """Token ids of rendered text: markup as control
        tokens, each placeholder as its text's plain tokens."""
        if len(text) > self.max_model_len * self.max_token_chars:  # before the costly part
            raise RequestError(400, f"The prompt is {len(text)} characters, more than the model's context of "
                                    f"{self.max_model_len} tokens can hold.", "messages")
        pieces = PLACEHOLDERS.split(text)  # text, placeholder index, text, ...
        # one batch call: the tokenizer releases the GIL for it (a single encode would hold it)
        texts = self.tokenizer(pieces[::2], add_special_tokens=False)["input_ids"]
        ids = texts[0]
        for index, tail in zip(pieces[1::2], texts[1:]):
            ids += self.escaped_ids[ord(index) - PLACEHOLDER_BASE] + tail
        return ids

    def render(self, messages, tools, add_generation_prompt):
        return self.tokenize(self.render_text(messages, tools, add_generation_prompt))

    async def respond(self, session, request, on_tokens=None):
        """Generate and record one turn (or, to a client's retry, return the answer already given).
        With on_tokens and a backend that streams, on_tokens(the turn's token ids so far) is called
        as the engine samples. Turns on different segments of a session run at once; turns on one
        segment, one after another."""
        async with session.request(), contextlib.AsyncExitStack() as hold:
            if session.finished:
                raise RequestError(410, f"Session {session.id} has finished; its attempt is over.")
            if request.retry and (first := session.pending.get(request.key)) is not None:
                await asyncio.wait([first])  # the first try is still generating: its answer is ours
            if request.retry and request.key in session.answers:
                return session.answers[request.key]
            session.pending[request.key] = this = asyncio.current_task()
            hold.callback(lambda: session.pending.get(request.key) is this
                          and session.pending.pop(request.key))
            if request.previous_response_id is not None:  # Responses API: the stored
                                                          # conversation goes first
                if request.previous_response_id not in session.responses:
                    raise RequestError(400, f"No stored response {request.previous_response_id!r} in this session "
                                            "(unknown id, or answered with store: false).", "previous_response_id")
                # its instructions are not carried over
                prior, had = session.responses[request.previous_response_id]
                k = request.instructions
                request.messages = request.messages[:k] + prior[had:] + request.messages[k:]
            started, segmenter, messages = time.time(), self.segmenter, request.messages
            while (segment := segmenter.candidate(session.segments, messages, request.tools)) \
                    is not None and segment.lock.locked():
                async with segment.lock:  # a turn on it is in flight: choose again once it landed
                    pass
            parent = segmenter.parent(session.segments)  # should this request open a segment
            if segment is not None:  # held until the turn is recorded
                await hold.enter_async_context(segment.lock)
            images = self.vision.check(request.messages)  # the prompt's images, in order

            def prepare():  # images are decoded here: those of the new messages
                ext = segment and segmenter.extension(segment, request.messages, request.tools)
                if ext:
                    appended, counts = self.vision.expand(ext[0], images[len(segment.images):])
                    return (ext, appended, segment.token_ids + appended, ext[1],
                            segment.image_tokens + counts)
                appended, counts = self.vision.expand(self.render(request.messages, request.tools, True), images)
                return None, appended, appended, request.messages, counts
            # rendering and tokenizing cost ~1 us per character
            ext, appended, prompt, conversation, counts = await self.off_loop(request.body_bytes, prepare)
            opening = "" if request.forced is None else self.call_opening(request)
            if opening:  # context (mask 0): the model writes the rest of the call itself
                request.opening = opening[opening.find(self.call_tags[0]):]
            elif (request.close_reasoning or request.sampling.get("structured")) and self.opens_reasoning(prompt):
                opening = self.closed_reasoning  # context too: the template's empty reasoning
            if opening:
                appended, prompt = appended + self.tokenize(opening), prompt + self.tokenize(opening)
            # the turn starts inside <think>: answer() splits it off
            request.reasoning = self.opens_reasoning(prompt)
            if len(prompt) >= self.max_model_len:
                raise RequestError(400, f"The prompt is {len(prompt)} tokens; the model's context is "
                                        f"{self.max_model_len} tokens.", "messages")
            room = self.max_model_len - len(prompt)  # a longer max_tokens is cut to
                                                     # it (finish_reason "length")
            routes = (segment.routed_experts or []) if ext else []
            # forced and strict calls: their arguments sampled under the schema;
            # the grammar also ends the turn after the first call when calls are
            # not parallel (a stop token would be one the grammar could not write)
            grammar, trigger = call_grammar(self.call_format, request) or (None, None)
            stop_at_call = not request.parallel and grammar is None
            sampling = dict(request.sampling, stop_token_ids=self.end_ids + [self.call_ids[1]] * stop_at_call,
                            routed_experts_start=len(routes), max_tokens=min(request.sampling["max_tokens"] or room, room),
                            top_logprobs=request.top_logprobs)
            if grammar:
                sampling["structured"] = {"structural_tag": grammar}
            refuse_calls = bool(request.tools) and not request.parse_tools  # tool_choice "none"
            if None in self.call_ids and (refuse_calls or stop_at_call):
                raise RequestError(400, "This tokenizer has no single tokens that open and close a tool call, so "
                                        "tool_choice \"none\" and parallel_tool_calls false cannot be honoured.")
            # the model never writes an image placeholder
            # (one in its text would read as an image slot)
            sampling["logit_bias"] = {**self.vision.banned, **({self.call_ids[0]: -100} if refuse_calls else {})} or None
            # sampled under a mask: recorded as context when
            # the config keeps such tokens out of the loss
            masked = self.constrained_tokens == "mask" and bool(sampling.get("structured") or refuse_calls)
            session.turns += 1
            request.prompt_tokens, request_id = len(prompt), f"{session.id}-{session.turns}"
            ids, more = prompt, {}
            if images:  # the engine gets each image's one placeholder
                        # and the images: vLLM expands them
                ids, more = self.vision.collapse(prompt, counts), {"images": list(map(bytes, images))}
            try:
                if on_tokens is None or not hasattr(self.backend, "stream"):
                    out = await self.backend.generate(ids, sampling, request_id, session_id=session.id, **more)
                else:
                    async for out in self.backend.stream(ids, sampling, request_id, session_id=session.id, **more):
                        if "finish_reason" not in out:
                            on_tokens(out["token_ids"])
            except ValueError as e:  # vLLM's input validation
                raise RequestError(400, f"The engine refused the request: {e}")
            result = self.answer(out, request, len(prompt))
            try:  # the reply must be deliverable before it is recorded
                json.dumps(result, ensure_ascii=False).encode()
            except (TypeError, ValueError) as e:
                raise RequestError(400, f"The reply cannot be encoded as JSON: {e}.")
            with session.record_lock:  # recorded only now: a failed generation
                                       # leaves the trajectory as it was
                if session.finished:
                    raise RequestError(410, f"Session {session.id} finished while this request was generating.")
                if not ext:
                    opened = segmenter.opening(session.segments, request.messages, request.tools)
                    segment = segmenter.open(session.segments, session.attempt_id,
                                             parent and parent.index, started, opened)
                segment.append(appended)
                segment.images, segment.image_tokens = images, counts
                free = self.free_tokens(out["token_ids"], trigger) if masked else len(out["token_ids"])
                segment.append(out["token_ids"][:free], {k: out[k][:free] for k in ("logprobs", "token_versions")})
                segment.append(out["token_ids"][free:])
                # routes of the tokens the engine computed this turn
                if out.get("routed_experts") is not None:
                    segment.routed_experts = routes + out["routed_experts"]
                conversation = conversation + [result["message"]]
                segment.conversation = None if segment.closed else conversation
                segment.tools, segment.last_generated = request.tools, out["token_ids"]
                segment.last_used = time.monotonic()
                if request.protocol == "responses" and request.store:
                    session.responses["resp_" + result["id"]] = conversation, request.instructions
            if request.key is not None:
                session.answers[request.key] = result
                if len(session.answers) > self.max_cached_answers:
                    session.answers.popitem(last=False)
            return result

    async def off_loop(self, size, work, *args):
        """work(*args), for a request of `size` bytes: a large one's on
        the render thread (one at a time), so that the loop keeps serving
        other sessions meanwhile; a small one's here (~0.1 ms less)."""
        if size > INLINE_RENDER_BYTES:
            return await asyncio.get_running_loop().run_in_executor(self.render_pool, work, *args)
        return work(*args)

    def opens_reasoning(self, ids):
        """Whether the prompt leaves the model inside <think>
        (a reasoning template's generation prompt opens it)."""
        for t in reversed(ids):
            if t == self.think_ids[0] or t == self.think_ids[1] or t in self.end_ids:
                return t == self.think_ids[0] is not None
        return False

    def free_tokens(self, ids, trigger):
        """How many of a turn's tokens came before its grammar constrained
        any: those up to the end of the trigger's text ("auto" calls to strict
        tools), none without a trigger (the whole turn constrained)."""
        lo, hi = 0, len(ids) if trigger else 0  # the shortest prefix whose text holds the trigger
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if trigger in self.tokenizer.decode(ids[:mid]) else (mid + 1, hi)
        return lo

    def call_opening(self, request):
        """The template's text that opens a tool call, up to the name (tool_choice
        "required") or up to the arguments (a named tool; in XML, up to the line of
        the first parameter): what the template renders for such a call after the
        generation prompt (after empty reasoning, for a reasoning template)."""
        arguments = {"\1": "\1"} if self.arguments_as_mapping else "\1"
        call = {"role": "assistant", "content": "", "tool_calls": [tool_call("call_0", request.forced or "\0", arguments)]}
        prompt = self.render_text(PROBE, request.tools, True)
        full = self.render_text(PROBE + [call], request.tools, False)
        cut = full.find("\1" if request.forced else "\0")
        if request.forced and self.arguments_as_mapping:
            cut = full.rfind("\n", 0, cut) + 1
        if not full.startswith(prompt) or cut < 0 or self.call_tags[0] not in full[len(prompt):cut]:
            raise RequestError(400, "This model's chat template does not show where a tool call opens, so the call "
                                    "cannot be forced; use tool_choice \"auto\".", "tool_choice")
        return full[len(prompt):cut]

    def answer(self, out, request, num_prompt_tokens):
        """The engine's tokens as an assistant message: decoded after the forced call opening, tool
        calls parsed. At a stop string the text ends where the stop string begins; `out` keeps
        every token up to the one that completed it (vLLM stops there): the trajectory holds what
        the policy sampled, the stop string's tokens included, so a policy can learn to stop."""
        ids, parse = out["token_ids"], request.parse_tools and bool(request.tools)
        n = len(ids) - (bool(ids) and ids[-1] in self.end_ids)
        text = self.decode_turn(ids, n, request)
        hits = [(text.find(s), s) for s in request.sampling["stop"] if s in text]
        stop_sequence = min(hits)[1] if hits else None
        if hits:
            text, last = text[:min(hits)[0]], n
            stops = request.sampling["stop"]
            while last and any(s in self.decode_turn(ids, last - 1, request) for s in stops):
                last -= 1  # a backend that sampled past the stop string: not the policy's tokens
            kept = ("token_ids", "logprobs", "token_versions", "top_logprobs")
            routes = out.get("routed_experts")
            out.update({k: out[k][:last] for k in kept if k in out})
            if routes is not None:
                out["routed_experts"] = routes[:len(routes) - (len(ids) - last)]
            while n and len(self.decode_turn(ids, n, request)) > len(text):
                n -= 1  # the tokens the text shows whole: the client's logprobs
        text, calls = request.opening + text, []
        reasoning, text = split_reasoning(text, self.call_tags[0]) if request.reasoning else ("", text)
        if parse:
            # the arguments as the model wrote them (as a stream sends them) where they parse
            if (info := self.tool_parser(request.tools).extract_tool_calls(text, None)).tools_called:
                text, written = info.content or "", read_calls(self.tool_parser(request.tools), "", text)[1]
                calls = [tool_call(call_id(request.protocol, request.id, i), c.function.name, written[i][1]
                                   if i < len(written) and same_json(written[i][1], c.function.arguments)
                                   else c.function.arguments) for i, c in enumerate(info.tool_calls)]
        message = {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {}),
                   **({"tool_calls": calls} if calls else {})}
        finish = "tool_calls" if calls else "length" if out["finish_reason"] == "length" and not hits else "stop"
        logprobs = None if request.top_logprobs is None else [
            dict(self.token_logprob(t, lp), top_logprobs=[self.token_logprob(*x) for x in top])
            for t, lp, top in zip(ids[:n], out["logprobs"], out.get("top_logprobs") or [[]] * n)]
        ends = [i for i, t in enumerate(ids[:n]) if t in (self.think_ids[1], self.call_ids[0])] if reasoning else []
        return dict(id=request.id, created=request.created, message=message, finish_reason=finish,
                    reasoning_tokens=(ends[0] if ends else n) if reasoning else 0,
                    stop_sequence=stop_sequence, prompt_tokens=num_prompt_tokens, completion_tokens=len(out["token_ids"]),
                    model=request.model or self.model_name, logprobs=logprobs)

    def decode_turn(self, ids, n, request):
        """The text of a turn's first n tokens; tool tags (which
        may be special tokens) kept where calls are parsed."""
        return self.tokenizer.decode(ids[:n], skip_special_tokens=not (request.parse_tools and request.tools))

    def tool_parser(self, tools):
        """A fresh parser of the model's call format for one turn (a streaming
        parser holds its turn's state); the tools' schemas type XML arguments
        (a parameter's text becomes a number where its schema says so)."""
        if not self.strips_content:  # the older parsers (Hermes) read no schemas
            return self.tool_parser_cls(self.tokenizer)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
        return self.tool_parser_cls(self.tokenizer, [ChatCompletionToolsParam.model_validate(t) for t in tools] or None)

    def token_logprob(self, token_id, logprob):
        text = self.tokenizer.decode([token_id])
        # -inf: masked
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}

    def stream_text(self, ids, request):
        """The text of a turn's tokens so far that is sure to begin the text answer()
        parses: the forced call's opening, then with stop strings only up to a token
        boundary at least the longest stop string away from the end (a stop string
        completing later cannot start before it; answer cuts there); no half characters."""
        n, hold = len(ids) - (bool(ids) and ids[-1] in self.end_ids), max(map(len, request.sampling["stop"]), default=0)
        text = self.decode_turn(ids, n, request)
        limit = len(text) - hold
        while hold and n and len(text) > limit:
            n -= 1
            text = self.decode_turn(ids, n, request)
        return request.opening + text.rstrip("\ufffd")

    async def live(self, request, tokens, first, task, session_id):
        """A streamed turn for the protocols' event writers (protocols.py): the head; text, call
        and argument deltas as the engine samples (`tokens`: a queue of the token ids so far,
        `first` its first get; reasoning first, the calls read by vLLM's streaming parser); what
        the answer holds beyond what was sent; then the answer, or the error that ended the turn.
        `task` is the request's respond(); http_chat waited for it or `first` to be done."""
        done = task.done() and not task.exception()  # answered at once (a retry)
                                                     # or before any token came
        head = task.result() if done else {"id": request.id, "created": request.created, "prompt_tokens": None}
        yield ("head", head["id"], head["created"], request.model or self.model_name,
               head["prompt_tokens"] or request.prompt_tokens)
        parser = self.tool_parser(request.tools) if request.parse_tools and request.tools else None
        # a streaming parser holds one turn's state
        sent, text, content, pending = ["", [], ""], "", "", first
        try:
            while not task.done() or pending.done():
                if pending.done():
                    ids = pending.result()
                    while not tokens.empty():  # only the latest count: the ids are cumulative
                        ids = tokens.get_nowait()
                    previous, pending = text, asyncio.ensure_future(tokens.get())
                    text = self.stream_text(ids, request)
                    reasoning, text = split_reasoning(text, self.call_tags[0]) if request.reasoning else ("", text)
                    # the parser gives each piece of text once (and none of a call's)
                    new, calls = read_calls(parser, previous, text) if parser else (text[len(content):], [])
                    content += new  # the grammar-engine parsers' answers end
                                    # stripped: trailing spaces wait for more
                    for item in stream_deltas(sent, content.rstrip() if self.strips_content else content, [
                            (call_id(request.protocol, request.id, i), *c) for i, c in enumerate(calls)], reasoning):
                        yield item
                await asyncio.wait([pending, task], return_when=asyncio.FIRST_COMPLETED)
        finally:  # the client may have gone mid-stream: the
                  # engine aborts the turn, and it is not recorded
            pending.cancel()
            task.cancel()
        try:
            result = task.result()
        except Exception as e:  # after the first token: the protocol's error event ends the stream
            yield ("error", *failure(e, session_id)[:2])
            return
        m = result["message"]
        for item in stream_deltas(sent, m["content"], [(c["id"], c["function"]["name"], c["function"]["arguments"])
                                                       for c in m.get("tool_calls", [])], m.get("reasoning_content", "")):
            yield item
        yield "done", result

    # --- HTTP

    def expiry(self):
        return f"it expired after {self.http_session_idle_s:g} s without a request (http_session_idle_s)"

    def authorize(self, request):
        sid = request.path_params["sid"]
        session, gone = self.sessions.get(sid), self.dropped.get(sid)
        key = (request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer "))
        if session is None and gone is None:
            raise RequestError(404, f"No session {sid} on this server: it never existed, or it ended and was dropped "
                                    f"long ago (the server keeps at most {self.max_http_sessions} sessions made over "
                                    "HTTP, finished ones dropped first).")
        expected = key_digest(session.api_key) if session else gone[0]
        if not secrets.compare_digest(key_digest(key.strip()), expected):
            raise RequestError(401, "Wrong API key for this session: use the base_url and api_key issued for this "
                                    "attempt.")
        if session is None:
            raise RequestError(410, f"Session {sid} is gone: {gone[1]}. The server keeps at most "
                                    f"{self.max_http_sessions} sessions made over HTTP and drops finished ones first "
                                    "(max_http_sessions): read a session's segments from its finish reply.")
        if session.id in self.http_sessions:
            idle = time.monotonic() - session.last_used > self.http_session_idle_s
            if idle and not session.in_flight:
                self.drop_session(session.id, self.expiry())
                raise RequestError(410, f"Session {session.id} is gone: {self.expiry()}.")
            self.http_sessions.move_to_end(session.id)
        session.last_used = time.monotonic()
        return session

    async def read_json(self, request):
        """The raw body and its JSON (None when empty), read within body_timeout_s."""
        if (declared := request.headers.get("content-length", "")).isdigit() and int(declared) > self.max_body_bytes:
            raise RequestError(413, f"The request body is larger than {self.max_body_bytes} bytes.")
        chunks, size = [], 0
        try:
            # a client that stalls mid-body holds nothing for long
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise RequestError(413, f"The request body is larger than {self.max_body_bytes} bytes.")
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestError(408, f"The request body did not arrive within {self.body_timeout_s:g} s.")
        except ClientDisconnect:
            raise RequestError(400, "The client disconnected while sending the request body.")

        def parse():
            raw = b"".join(chunks)
            return raw, strict_json(raw) if raw else None
        return await self.off_loop(size, parse)  # ~10 ms per MiB

    async def until_disconnected(self, request, coro):
        """Await `coro`, cancelling it if the client disconnects first: the engine
        aborts a cancelled generation (vLLM's AsyncLLM does on cancellation) and
        nothing is recorded (respond records only a finished turn)."""
        async def gone():
            # the body was read: only the end comes
            while (await request.receive())["type"] != "http.disconnect":
                pass
        work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(gone())
        done = set()
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if work not in done:
                work.cancel()
        if work not in done:
            raise RequestError(400, "The client disconnected before the reply; the turn was aborted, not recorded.")
        return work.result()

    async def http_chat(self, request):
        protocol = {"messages": "anthropic", "responses": "responses"}.get(request.url.path.rsplit("/", 1)[1], "openai")
        try:
            session = self.authorize(request)  # a finished session's turn: respond answers 410
            raw, body = await self.read_json(request)
            messages = body.get("input" if protocol == "responses" else "messages") if isinstance(body, dict) else None
            # before reading each of them
            if isinstance(messages, list) and len(messages) > self.max_model_len:
                raise RequestError(400, f"The request holds {len(messages)} messages, more than the model's context "
                                        f"of {self.max_model_len} tokens can hold (each takes a token at least).",
                                   "input" if protocol == "responses" else "messages")
            try:
                chat = PARSERS[protocol](body, self)
            # a shape no check named
            except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
                raise RequestError(400, f"The request is malformed: {type(e).__name__}: {str(e)[:200]}.")
            idempotency = request.headers.get("idempotency-key")
            key = hashlib.sha256(request.url.path.encode() + b"\0")
            if idempotency:
                key.update(b"key:" + idempotency.encode())
            else:
                await self.off_loop(len(raw), key.update, raw)  # ~3 ms per MiB
            chat.key, chat.body_bytes = key.hexdigest(), len(raw)
            # the SDKs mark their retries; an unmarked repeat is
            # a new sample (an agent may sample twice on purpose)
            chat.retry = bool(idempotency) or request.headers.get("x-stainless-retry-count", "0") not in ("", "0")
            if chat.stream:  # a refusal before the first token is still a plain error response
                tokens = asyncio.Queue()
                task = asyncio.ensure_future(self.respond(session, chat, tokens.put_nowait))
                first = asyncio.ensure_future(tokens.get())
                await asyncio.wait([first, task], return_when=asyncio.FIRST_COMPLETED)
                if task.done() and task.exception():
                    first.cancel()
                    raise task.exception()
            else:
                result = await self.until_disconnected(request, self.respond(session, chat))
                session.last_used = time.monotonic()  # idle time counts from the end of a request
        except Exception as e:  # a RequestError, or the engine failed: this request only
            return error_response(protocol, *failure(e, request.path_params["sid"]))
        if chat.stream:
            return StreamingResponse(EVENTS[protocol](self.live(chat, tokens, first, task, session.id), chat),
                                     media_type="text/event-stream")
        return JSONResponse(ANSWERS[protocol](result))

    @json_handler("anthropic")
    async def http_count_tokens(self, request):
        """Anthropic's token count: the prompt as this server would render it for the request
        (the turn's own checks: a bad image, a template that refuses, a text too long)."""
        self.authorize(request)
        chat = parse_anthropic((await self.read_json(request))[1], self, counting=True)
        ids = self.vision.expand(self.render(chat.messages, chat.tools, True), self.vision.check(chat.messages))[0]
        return {"input_tokens": len(ids)}

    @json_handler("openai")
    async def http_models(self, request):
        self.authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "capture"}]}

    @json_handler("openai")
    async def http_new_session(self, request):
        body = (await self.read_json(request))[1]  # none: {}
        if body is not None and not isinstance(body, dict):
            raise RequestError(400, "The request body must be a JSON object.")
        attempt_id = field(body or {}, "attempt_id", str)
        if not self.make_room_for_http_session():
            raise RequestError(429, f"{len(self.http_sessions)} sessions made over HTTP are live, the limit: "
                                    "finish some (or wait for idle ones to expire).")
        session = self.new_session(attempt_id)
        self.http_sessions[session.id] = session
        return {"id": session.id, "base_url": session.base_url, "api_key": session.api_key,
                "attempt_id": session.attempt_id}

    @json_handler("openai")
    async def http_get_session(self, request):
        return [trajectory_record(s, self.tokenizer) for s in self.authorize(request).segment_dicts()]

    @json_handler("openai")
    async def http_finish_session(self, request):
        session = self.authorize(request)
        _, body = await self.read_json(request)
        reward = field(body if isinstance(body, dict) else {}, "reward", (int, float))
        # NaN, infinities, ints beyond float
        if reward is not None and not abs(reward) <= sys.float_info.max:
            raise RequestError(400, f"`reward` must be a finite number, got {reward}.", "reward")
        while session.in_flight:  # let the turns in flight land first
            await session.quiet.wait()
        if session.finished:
            raise RequestError(409, f"Session {session.id} has already finished with reward "
                                    f"{session.reward}; the first finish stands.")
        segments = self.finish_session(session.id, reward)
        return [trajectory_record(s, self.tokenizer) for s in segments]

    async def http_error(self, request, exc):
        protocol = "anthropic" if "/messages" in request.url.path else "openai"
        return error_response(protocol, exc.status_code, f"{request.method} {request.url.path}: {exc.detail}.")

    async def start(self):
        # as vLLM's API server does: the millions of objects that imports left
        # behind (torch, transformers, vLLM) move out of the cyclic GC's reach,
        # so a full collection during a request stops costing tens of ms
        gc.collect()
        gc.freeze()
        limits = dict(http=partial(GuardedHttp, header_timeout_s=self.header_timeout_s),
                      # connections + requests in flight; more get 503
                      limit_concurrency=self.max_connections,
                      # idle keep-alive connections: 20 s is longer than clients keep theirs (5-15 s)
                      timeout_keep_alive=self.keep_alive_s)
        self.uvicorn, self.serving = await serve_app(self.app, self.socket, **limits)
        return self.url

    async def stop(self):
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True
            await self.serving
            self.uvicorn = None
        self.socket.close()

    def start_in_thread(self):
        """Serve from a daemon thread with its own event
        loop (`self.loop`); returns the base URL."""
        started = threading.Event()

        def run():
            self.loop = new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.start())
            started.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=run, name="capture-server", daemon=True)
        self.thread.start()
        started.wait()
        return self.url

    def run_in_loop(self, coro):
        """Run a coroutine on the server's loop from another
        thread (e.g. an Engine's start or shutdown)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop_thread(self):
        self.run_in_loop(self.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

# -----------------------------------------------------------------------------
# inspection


def trajectory_record(segment, tokenizer):
    """A segment dict as JSON (images in base64) plus decoded text for humans:
    the whole segment, each run of generated tokens, and each token."""
    runs = [tokenizer.decode([t for t, _ in run], skip_special_tokens=False) for generated, run in
            itertools.groupby(zip(segment["token_ids"], segment["action_mask"]), key=lambda pair: pair[1]) if generated]
    return dict(segment, text=tokenizer.decode(segment["token_ids"], skip_special_tokens=False), generated=runs,
                # each token's text (viewer.py)
                tokens=tokenizer.batch_decode([[t] for t in segment["token_ids"]]),
                images=[base64.b64encode(b).decode() for b in segment.get("images", [])])


def write_trajectories(path, segments, tokenizer):
    """Append one JSON line per segment (token ids,
    mask, logprobs, versions, reward, decoded text)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.writelines(json.dumps(trajectory_record(segment, tokenizer)) + "\n" for segment in segments)

# -----------------------------------------------------------------------------
# standalone: one engine and the server on loopback, for trying an agent by hand


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description="Serve a model through the capture server (loopback only).")
    parser.add_argument("--model", help="HuggingFace model directory (default: the tiny model, built on first use)")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--max-model-len", type=int, default=OPTIONS["max_model_len"])
    parser.add_argument("--view", metavar="OUT_DIR", help="serve the trajectory viewer over a run's out_dir instead")
    args = parser.parse_args(argv)
    if args.view:  # no engine: the page over the run's files (viewer.py)
        import viewer
        return viewer.main(args.view, args.port)
    from tiny import ensure_tiny_model
    model = args.model if args.model is not None else ensure_tiny_model()
    if not os.path.isfile(os.path.join(model, "config.json")):
        sys.exit(f"--model {model}: no config.json there; pass a local HuggingFace model directory.")

    async def serve():
        # SIGTERM and SIGINT (also when the shell started us with SIGINT ignored:
        # `python capture.py &`) stop the server and then the engine, whose
        # process would outlive us otherwise; one during start-up acts after it
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        engine, server = Engine(model, max_model_len=args.max_model_len), None
        try:
            await engine.start()
            server = CaptureServer(engine, model, max_model_len=args.max_model_len, port=args.port)
            await server.start()
            print(f"capture server for {model} at {server.url}\n  new session: curl -X POST {server.url}/sessions",
                  flush=True)
            await stop.wait()
        finally:
            if server is not None:
                await server.stop()
            await engine.shutdown()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop, as in training
        runner.run(serve())


if __name__ == "__main__":
    main()
