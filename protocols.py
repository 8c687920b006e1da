"""
The three wire protocols of the capture server: OpenAI chat completions, the OpenAI Responses
API and Anthropic Messages. Requests become one internal ChatRequest (OpenAI-style messages,
as chat templates expect), with a RequestError (a 4xx in that protocol's error format) for
anything malformed or not honoured; answers and SSE event streams are written back in the
protocol the client spoke. Image parts (inline base64 only) become ImageBytes in the messages;
ImageTokens decodes and checks them and expands each one's placeholder to the tokens the
model's processor counts. Pure functions on JSON (and images); imports nothing of ours.

    .venv/bin/python -m pytest tests/test_capture_fuzz.py tests/test_frameworks.py -q
"""
import base64
import io
import itertools
import json
import math
import re
import os
import time
import uuid
from functools import wraps

from starlette.responses import JSONResponse

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def strict_json(raw):
    """The JSON in `raw`, refusing what JSON over UTF-8 cannot hold and
    nothing could encode back: invalid UTF-8, lone UTF-16 surrogates, NaN
    / Infinity, numbers beyond float range. Raises RequestError(400)."""
    def finite(text):
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"the number {text[:40]} is out of range")
        return value

    def constant(name):
        raise ValueError(f"{name} is not a JSON value")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=constant, parse_float=finite)
        if SURROGATE_ESCAPE.search(raw):  # a \uD8xx escape: paired into one
                                          # character, or a lone surrogate
            json.dumps(body, ensure_ascii=False).encode()
        return body
    except UnicodeError as e:
        raise RequestError(400, "The request body is not valid UTF-8 text (or holds a lone UTF-16 "
                                f"surrogate): {e}.")
    except (ValueError, RecursionError) as e:
        raise RequestError(400, f"The request body is not valid JSON: {str(e)[:200]}.")


# -----------------------------------------------------------------------------
# request parsing: both protocols become one internal
# request (OpenAI-style messages, as chat templates expect)


class RequestError(Exception):
    """A bad request: the HTTP status and one sentence naming what is wrong."""

    def __init__(self, status, message, param=None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def invalid(where, what):
    """A 400 about the field at `where` (its param), the message naming it first: "`where` what"."""
    return RequestError(400, f"`{where}` {what}", where)


class ChatRequest:
    """One turn asked for in any protocol: OpenAI-style messages, function tools
    (`strict`: the names of those marked strict, whose calls are sampled under
    their schema) and sampling; `stream` and `model` read from the body."""

    def __init__(self, protocol, body, messages, tools, strict, sampling):
        self.protocol, self.messages, self.tools, self.strict, self.sampling = protocol, messages, tools, strict, sampling
        self.stream, self.model = field(body, "stream", bool, False), field(body, "model", str, "")
        # chat completions: usage only when stream_options asks
        self.include_usage, self.parse_tools = True, True
        self.key, self.retry = None, False  # the answer's key (Idempotency-Key or
                                            # the raw body); whether a client retry
        self.body_bytes = 0  # the body's size: a large request renders off the event loop
        self.forced = None  # a forced tool call: "" (any tool) or the tool's name
        self.opening = ""  # a forced call's opening from the call tag
                           # on: the text the tool parser reads first
        self.parallel, self.top_logprobs, self.previous_response_id, self.store = True, None, None, True
        self.instructions = 0  # Responses API: 1 when messages[0]
                               # holds this request's `instructions`
        # the turn starts inside <think> (the server sets it
        # from the prompt); the client asked for no reasoning
        self.reasoning, self.close_reasoning = False, False
        # its answer's
        self.id, self.created, self.prompt_tokens = uuid.uuid4().hex[:24], int(time.time()), None


TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
              dict: "an object"}


def field(body, key, types, default=None, required=False, where=""):
    types = types if isinstance(types, tuple) else (types,)
    value = body.get(key)
    if value is None:
        if required:
            raise invalid(where + key, "is required.")
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = ["a number"] if types == (int, float) else [TYPE_NAMES[t] for t in types]
        raise invalid(where + key, f"must be {' or '.join(names)}, got {type(value).__name__}.")
    return value


def objects(body, key):
    """(where, item) for each item of the array body[key]
    (required), refusing one that is no object."""
    for i, item in enumerate(field(body, key, list, required=True)):
        if not isinstance(item, dict):
            raise invalid(f"{key}[{i}]", "must be an object.")
        yield f"{key}[{i}]", item


TEXT_PARTS = ("text", "input_text", "output_text")  # chat completions and
                                                    # Anthropic; the Responses API's
IMAGE_PARTS = ("image_url", "input_image", "image")  # chat completions; the
                                                     # Responses API; Anthropic


def text_of(content, where, images=False):
    """A string, or a list of text parts/blocks joined; with images=True image
    parts/blocks too, and then a content with an image is the list of parts chat
    templates read ({"type": "text", "text"}, {"type": "image", "image"})."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(where, "must be a string or an array of text parts.")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind in IMAGE_PARTS:
            parts.append({"type": "image", "image": image_of(part, f"{where}[{i}]")})
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            allowed = "a text or image part" if images else "a text part {\"type\": \"text\", \"text\": ...}"
            raise invalid(f"{where}[{i}]",
                          f"must be {allowed}; only {'text and image' if images else 'text'} content "
                                           "is supported here.")
    return joined(parts)


def joined(parts):
    """Content parts as a message's content: their text when
    all are text (what every template reads), else them."""
    return parts if any(p["type"] == "image" for p in parts) else "".join(p["text"] for p in parts)


class ImageBytes(bytes):
    """An image file as the client sent it (base64-decoded). Equal to the
    same bytes from any request: an image is part of its message's identity,
    where it sat in a request (`where`, for error messages) is not."""
    where = ""


def image_of(part, where):
    """The image of an image part (chat completions' image_url, the Responses
    API's input_image, an Anthropic image block): inline base64 only, since
    this server fetches nothing. Decoded and checked when rendered."""
    if part["type"] == "image":  # Anthropic: {"source": {"type": "base64",
                                 # "media_type": ..., "data": ...}}
        source = field(part, "source", dict, required=True, where=where + ".")
        if source.get("type") != "base64":
            raise invalid(where + ".source.type", f"is {source.get('type')!r}: this server fetches nothing; send "
                                                  "the image inline ({\"type\": \"base64\", \"media_type\": ..., "
                                                  "\"data\": ...}).")
        at = where + ".source.data"
        data = field(source, "data", str, required=True, where=where + ".source.")
    else:  # a data URI; chat completions nest it in {"url": ...}
        url, at = part.get("image_url"), where + ".image_url"
        if part["type"] == "image_url":
            url, at = url.get("url") if isinstance(url, dict) else None, at + ".url"
        if not isinstance(url, str) or not url.startswith("data:"):
            what = "a URL" if isinstance(url, str) and url.startswith(("http:", "https:")) else "not a data URI"
            raise invalid(at, f"is {what}: this server does not fetch images; send each image inline as a data URI "
                              "(data:image/png;base64,...).")
        head, _, data = url.partition(",")
        if not head.endswith(";base64"):
            raise invalid(at, "must be a base64 data URI (data:image/png;base64,...).")
    try:
        image = ImageBytes(base64.b64decode(data, validate=True))
    except ValueError:  # binascii.Error
        raise invalid(at, "is not valid base64.")
    image.where = where
    return image


def tool_choice_of(request, kind, name, parallel=True):
    """Honour a tool choice: "auto", "none" (calls not parsed; the template's call
    opening is banned), "required" or "function" (`name`): the call is forced, see
    CaptureServer.call_opening. parallel=False stops after one call."""
    names = {t["function"]["name"] for t in request.tools}
    if kind == "function" and (not isinstance(name, str) or name not in names):
        raise invalid("tool_choice", f"names the tool {name!r}, which is not among `tools`.")
    if kind in ("required", "function") and not names:
        raise invalid("tool_choice", "forces a tool call but `tools` is empty.")
    request.parse_tools, request.parallel = kind != "none", parallel
    request.forced = None if kind in ("auto", "none") else name or ""
    return request


MAX_JSON_WHITESPACE = 1  # consecutive whitespace characters in
                         # constrained JSON (a random model loops on them)
SAFE_NUMBERS = {"integer": 2**53 - 1, "number": 1e15}  # the bounds constrained JSON numbers
                                                       # get where a schema has none


def bounded(schema):
    """A copy of a JSON schema whose integers and numbers without bounds get them
    (+-(2**53 - 1), +-1e15: the range JSON readers keep exactly): xgrammar then allows
    finitely many digits, where a random model writes digits until max_tokens."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("const", "enum", "default", "examples") else bounded(v) for k, v in schema.items()}
    limit = SAFE_NUMBERS.get(schema["type"]) if isinstance(schema.get("type"), str) else None
    if limit is not None:
        for side, sign in (("minimum", -1), ("maximum", 1)):
            if side not in out and "exclusiveM" + side[1:] not in out:
                out[side] = sign * limit
    return out


def call_grammar(format_name, request):
    """The structural tag (vLLM structured outputs over xgrammar) that this turn is sampled
    under, as (JSON, trigger), or None. A forced call's arguments fit its tool's schema (the
    prompt already holds the call's opening: the grammar takes over from there); under "auto"
    so do the arguments of a call to a `strict` tool (other tools': any JSON); an answer in a
    response format fits its schema. `trigger` is the text after which an "auto" turn samples
    under the grammar (None: from its start). `format_name` is the tool parser's call format
    (vLLM's `structural_tag_model`: "hermes" for <tool_call> JSON, "qwen_3_coder" for
    Qwen3.5's XML, ...): the schema constrains the arguments whatever wraps them. JSON
    whitespace runs are capped (a random model can loop on them: the turn never ends)."""
    structured = request.sampling.get("structured")
    calls = format_name and request.tools and request.parse_tools and (
        request.strict or request.forced is not None)
    if not (calls or structured):
        return None
    from pydantic import BaseModel
    from xgrammar import Grammar, StructuralTag
    from xgrammar.structural_tag import (ConstStringFormat, GrammarFormat, JSONSchemaFormat,
                                         OrFormat, SequenceFormat, TagFormat,
                                         TagsWithSeparatorFormat, TriggeredTagsFormat)

    def json_format(schema):  # xgrammar's, less the raw control characters it lets into a string
                              # with a length bound: no JSON (the tool parser drops such a call)
        try:
            ebnf = str(Grammar.from_json_schema(json.dumps(schema),
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE))
        except RuntimeError as e:
            raise RequestError(400, f"xgrammar cannot compile the JSON schema: {str(e)[:200]}")
        return GrammarFormat(grammar=ebnf.replace(r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]'))
    answer = structured and json_format(bounded(structured.get("json", {"type": "object"})))
    if not calls:
        return StructuralTag(format=answer).model_dump_json(), None
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag

    def nodes(node):
        if isinstance(node, BaseModel):
            yield node
            for name in type(node).model_fields:
                yield from nodes(getattr(node, name))
        elif isinstance(node, (list, tuple)):
            for item in node:
                yield from nodes(item)

    def grammar(choice):  # the format's own: (the whole, its parts, the list of calls in it)
        tag = get_model_structural_tag(format_name, tools, choice, False)
        found = list(nodes(tag.format))
        for n in found:
            if isinstance(n, JSONSchemaFormat):
                n.max_whitespace_cnt = MAX_JSON_WHITESPACE
            if isinstance(n, TagFormat) and getattr(n.content, "style", None) == "json":
                n.content = json_format(n.content.json_schema)
            if isinstance(n, (TriggeredTagsFormat, TagsWithSeparatorFormat)):
                n.stop_after_first = not request.parallel
        return tag.format, found, next(
            n for n in found if isinstance(n, (TriggeredTagsFormat, TagsWithSeparatorFormat)))
    def readable(schema):  # one xgrammar cannot compile keeps its
                           # object's shape: property names, required ones
        try:
            Grammar.from_json_schema(json.dumps(schema))
            return schema
        except RuntimeError:
            names = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            required = [k for k in schema.get("required") or [] if k in names]
            return {"type": "object", "properties": {k: {} for k in names}, "required": required}
    tools = [ChatCompletionToolsParam(type="function", function=dict(
        t["function"], parameters=readable(bounded(t["function"]["parameters"])),
        strict=request.forced is not None or t["function"]["name"] in request.strict)) for t in request.tools]
    trigger = None
    if request.forced is not None:  # one of the calls the opening begins, and the turn ends
        _, found, _ = grammar("required")
        first = [SequenceFormat(elements=[e for e in (ConstStringFormat(value=n.begin[len(request.opening):]) if
                                                      n.begin != request.opening else None, n.content,
                                                      ConstStringFormat(value=n.end)) if e is not None])
                 for n in found if isinstance(n, TagFormat) and isinstance(n.begin, str) and isinstance(n.end, str)
                 and n.begin.startswith(request.opening)]
        if not first:
            raise RequestError(
                400, f"The chat template opens a forced call as {request.opening!r}, which no call of the "
                     f"tool parser's format ({format_name}) begins with.", "tool_choice")
        fmt = first[0] if len(first) == 1 else OrFormat(elements=first)
    elif structured:  # an answer in the response format, or calls
        fmt = OrFormat(elements=[answer, grammar("required")[2]])
    else:
        fmt, _, calls = grammar("auto")
        trigger = getattr(calls, "triggers", [None])[0]
    return StructuralTag(format=fmt).model_dump_json(), trigger


def structured_of(fmt, where):
    """A response format (json_schema / json_object /
    text) as vLLM's structured-output fields, or None."""
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = fmt.get("json_schema", fmt)  # chat completions nest it; the Responses API does not
        return {"json": field(schema if isinstance(schema, dict) else {}, "schema", dict, required=True,
                              where=where + ".json_schema.")}
    if kind in ("json_object", "text"):
        return {"json_object": True} if kind == "json_object" else None
    raise RequestError(400, f"`{where}.type` must be text, json_object or json_schema, got {kind!r}.", where)


def tool_call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def call_id(protocol, answer_id, index):
    """A generated call's id, from its answer's: a
    stream names each call before the answer exists."""
    return ("toolu_" if protocol == "anthropic" else "call_") + f"{answer_id}_{index}"


def sampling_of(server, body, max_tokens, stop, seed, max_temperature):
    temperature, top_p = field(body, "temperature", (int, float)), field(body, "top_p", (int, float))
    if temperature is not None and not 0 <= temperature <= max_temperature:
        raise invalid("temperature", f"must be between 0 and {max_temperature}, got {temperature}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid("top_p", f"must be in (0, 1], got {top_p}.")
    if top_p is not None and top_p < 1 and server.importance_correction:
        raise invalid("top_p", "< 1 is refused: importance correction is on and the trainer's "
                               "logprobs cover the full vocabulary, not the nucleus.")
    if max_tokens is not None and max_tokens < 1:
        raise invalid("max_tokens", f"must be at least 1, got {max_tokens}.")
    if seed is not None and not 0 <= seed < 2**63:
        raise invalid("seed", f"must be in [0, 2**63), got {seed}.")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if len(stop) > 16 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop sequences must be at most 16 non-empty strings.", "stop")
    return dict(temperature=1.0 if temperature is None else float(temperature),
                top_p=1.0 if top_p is None else float(top_p), max_tokens=max_tokens, stop=stop, seed=seed)


def body_fields(body, known):
    """Refuse a body that is no JSON object, or holds a field
    this server does not know (it cannot honour it)."""
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    if unknown := sorted(set(body) - known):
        raise RequestError(400, f"Unsupported field `{unknown[0]}`: this server cannot honour it.", unknown[0])


def top_logprobs_of(body, wanted):
    """The `top_logprobs` asked for (0 by default) when logprobs are `wanted`, else None."""
    top_logprobs = field(body, "top_logprobs", int, 0) if wanted else None
    if top_logprobs is not None and not 0 <= top_logprobs <= 20:
        raise invalid("top_logprobs", f"must be between 0 and 20, got {top_logprobs}.")
    return top_logprobs


def tools_of(body, types=None, refusal="", schema="parameters"):
    """A request's function tools as chat templates read them, and the names of the
    `strict` ones. types: the tool `type`s accepted, the function's fields beside it
    (refusal: the message for another type, {} standing for it); None: chat completions',
    the function's fields nested under "function". The `schema` field holds the parameters
    (required, unless it is "parameters": then an empty object schema by default)."""
    tools, strict = [], set()
    for i, tool in enumerate(field(body, "tools", list, [])):
        fn, where = tool if isinstance(tool, dict) else {}, f"tools[{i}]."
        if types is None:
            fn, where = field(fn, "function", dict, required=True, where=where), where + "function."
        elif fn.get("type") not in types:
            raise invalid(where + "type", refusal.format(fn.get("type")))
        spec = {"name": field(fn, "name", str, required=True, where=where)}
        if field(fn, "description", str, where=where):
            spec["description"] = fn["description"]
        default = {"type": "object", "properties": {}} if schema == "parameters" else None
        spec["parameters"] = field(fn, schema, dict, default, required=default is None, where=where)
        tools.append({"type": "function", "function": spec})
        strict |= {spec["name"]} if field(fn, "strict", bool, where=where) else set()
    return tools, strict


OPENAI_FIELDS = {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
                 "max_completion_tokens", "stop", "seed", "stream", "stream_options", "n",
                 "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty",
                 "parallel_tool_calls", "response_format", "user", "metadata",
                 "store", "service_tier"}  # the last four do not change generation
OPENAI_MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}


def parse_openai(body, server):
    body_fields(body, OPENAI_FIELDS)
    if field(body, "n", int, 1) != 1:
        raise invalid("n", "must be 1: each request records one turn of one trajectory.")
    top_logprobs = top_logprobs_of(body, field(body, "logprobs", bool, False))
    for key in ("frequency_penalty", "presence_penalty"):
        if field(body, key, (int, float), 0) != 0:
            raise invalid(key, "is not supported: the trainer could not reproduce the penalized distribution.")
    messages = []
    for w, m in objects(body, "messages"):
        if extra := [k for k, v in m.items() if k not in OPENAI_MESSAGE_FIELDS and v not in (None, [], {}, "")]:
            raise invalid(f"{w}.{extra[0]}", "is not supported.")
        role = m.get("role")
        content = text_of(m.get("content"), f"{w}.content", images=role == "user")
        # for templates that show it
        name = {"name": m["name"]} if field(m, "name", str, where=w + ".") else {}
        if role in ("system", "developer", "user"):
            messages.append({"role": "user" if role == "user" else "system", "content": content, **name})
        elif role == "assistant":
            calls = field(m, "tool_calls", list, [], where=w + ".")
            for j, c in enumerate(calls):
                wc = f"{w}.tool_calls[{j}]."
                fn = field(c if isinstance(c, dict) else {}, "function", dict, required=True, where=wc)
                calls[j] = tool_call(field(c, "id", str, "", where=wc),
                                     field(fn, "name", str, required=True, where=wc),
                                     field(fn, "arguments", str, "{}", where=wc))
            reasoning = field(m, "reasoning_content", str, where=w + ".")
            messages.append({"role": "assistant", "content": content, **name,
                             **({"tool_calls": calls} if calls else {}),
                             **({"reasoning_content": reasoning} if reasoning else {})})
        elif role == "tool":
            messages.append({"role": "tool", "content": content,
                             "tool_call_id": field(m, "tool_call_id", str, required=True, where=w + ".")})
        else:
            raise invalid(f"{w}.role", f"must be one of system, developer, user, assistant, tool; got {role!r}.")
    if not messages:
        raise invalid("messages", "must not be empty.")
    tools, strict = tools_of(body)
    max_tokens = field(body, "max_completion_tokens", int, field(body, "max_tokens", int))
    sampling = sampling_of(server, body, max_tokens, field(body, "stop", (str, list)),
                           field(body, "seed", int), 2.0)
    sampling["structured"] = structured_of(field(body, "response_format", dict, {"type": "text"}),
                                           "response_format")
    options = field(body, "stream_options", dict, {})
    request = ChatRequest("openai", body, messages, tools, strict, sampling)
    request.top_logprobs, request.include_usage = top_logprobs, bool(options.get("include_usage"))
    return tool_choice_of(request, *openai_choice(field(body, "tool_choice", (str, dict), "auto"), "function"),
                          field(body, "parallel_tool_calls", bool, True))


def openai_choice(choice, nested):
    """An OpenAI tool_choice as (kind, name); chat completions
    nest the name under "function", Responses do not."""
    if isinstance(choice, dict):
        fn = choice.get("function") if nested == "function" else choice
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid("tool_choice", "must be \"auto\", \"none\", \"required\" or {\"type\": "
                                         f"\"function\", ...}} naming a function, got {choice!r}.")
        return "function", fn["name"]
    if choice not in ("auto", "none", "required"):
        raise invalid("tool_choice", f"must be \"auto\", \"none\", \"required\" or a function, got {choice!r}.")
    return choice, None


ANTHROPIC_FIELDS = {"model", "messages", "max_tokens", "system", "tools", "tool_choice",
                    "temperature", "top_p", "top_k", "stop_sequences", "stream", "metadata",
                    "thinking", "service_tier"}


def parse_anthropic(body, server, counting=False):
    body_fields(body, ANTHROPIC_FIELDS)
    if field(body, "top_k", int) is not None:
        raise invalid("top_k", "is not supported: the trainer's logprobs cover the full vocabulary.")
    config = field(body, "thinking", dict)  # a reasoning model thinks unless it is "disabled"
    thinking = None if config is None else config.get("type")
    if config is not None and thinking not in ("enabled", "adaptive", "disabled"):
        raise RequestError(400, "`thinking.type` must be enabled, adaptive or disabled, got "
                                f"{thinking!r}.", "thinking")
    budget = field(config or {}, "budget_tokens", int, required=thinking == "enabled", where="thinking.")
    system = body.get("system")
    messages = [] if system is None else [{"role": "system", "content": text_of(system, "system")}]
    for w, m in objects(body, "messages"):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise invalid(f"{w}.role", f"must be \"user\" or \"assistant\", got {role!r}.")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise invalid(f"{w}.content", "must be a string or an array of content blocks.")
        text, calls, reasoning = [], [], []  # text: the text (and image) parts in order
        for j, b in enumerate(blocks):
            wb = f"{w}.content[{j}]."
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append({"type": "text", "text": field(b, "text", str, required=True, where=wb)})
            elif kind == "image" and role == "user":
                text.append({"type": "image", "image": image_of(b, wb[:-1])})
            # our own reasoning, sent back (its signature unread)
            elif kind == "thinking" and role == "assistant":
                reasoning.append(field(b, "thinking", str, required=True, where=wb))
            elif kind == "tool_use" and role == "assistant":
                calls.append(tool_call(field(b, "id", str, required=True, where=wb),
                                       field(b, "name", str, required=True, where=wb),
                                       json.dumps(field(b, "input", dict, {}, where=wb), ensure_ascii=False)))
            elif kind == "tool_result" and role == "user":
                if text:  # text before a tool result stays in its own user turn, in order
                    messages.append({"role": "user", "content": joined(text)})
                    text = []
                # an error result reads as one to the model: chat templates have no field for it
                error = "Error: " if field(b, "is_error", bool, False, where=wb) else ""
                result = text_of(b.get("content"), wb + "content", images=True)
                messages.append({"role": "tool", "tool_call_id": field(b, "tool_use_id", str,
                                                                       required=True, where=wb),
                                 "content": error + result if isinstance(result, str) else
                                 [{"type": "text", "text": error}] * bool(error) + result})
            else:
                allowed = "text, thinking and tool_use" if role == "assistant" else "text, image and tool_result"
                raise invalid(wb + "type", f"{kind!r} is not supported in {role} messages ({allowed} are).")
        if role == "assistant":
            messages.append({"role": "assistant", "content": joined(text),
                             **({"tool_calls": calls} if calls else {}),
                             **({"reasoning_content": "".join(reasoning)} if reasoning else {})})
        elif text or not blocks:
            messages.append({"role": "user", "content": joined(text)})
    if len(messages) == (system is not None):
        raise invalid("messages", "must not be empty.")
    tools, strict = tools_of(body, (None, "custom"), "{!r} is not supported (client tools only).", "input_schema")
    choice = field(body, "tool_choice", dict, {"type": "auto"})
    kind = choice.get("type")
    kind = {"any": "required", "tool": "function"}.get(kind, kind) if isinstance(kind, str) else kind
    if kind not in ("auto", "none", "required", "function"):
        raise RequestError(400, f"`tool_choice.type` must be auto, any, tool or none, got {choice.get('type')!r}.",
                           "tool_choice")
    sampling = sampling_of(server, body, field(body, "max_tokens", int, required=not counting),
                           field(body, "stop_sequences", list), None, 1.0)
    # not enforced: docs/capture.md
    if budget is not None and not 1024 <= budget < (sampling["max_tokens"] or budget + 1):
        raise invalid("thinking.budget_tokens", f"must be at least 1024 and less than `max_tokens`, got {budget}.")
    request = ChatRequest("anthropic", body, messages, tools, strict, sampling)
    request.close_reasoning = thinking == "disabled"
    return tool_choice_of(request, kind, choice.get("name"),
                          not field(choice, "disable_parallel_tool_use", bool, False, where="tool_choice."))


RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                    "max_output_tokens", "temperature", "top_p", "stream", "previous_response_id",
                    "store", "text", "include", "top_logprobs", "truncation", "reasoning",
                    "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier",
                    "stream_options", "seed"}  # seed: as in chat completions (an extension)
RESPONSES_ITEMS = "message, reasoning, function_call, function_call_output"


def parse_responses(body, server):
    """The Responses API: `input` (a string or items), `instructions`, function tools, text.format;
    the conversation of `previous_response_id` is put in front by CaptureServer.respond."""
    body_fields(body, RESPONSES_FIELDS)
    if field(body, "truncation", str,
             "disabled") != "disabled" or field(body, "reasoning", dict, {}).get("effort"):
        raise RequestError(400, "`truncation` and `reasoning` are not supported by this server.", "truncation")
    instructions = field(body, "instructions", str)
    messages = [{"role": "system", "content": instructions}] if instructions else []
    items = field(body, "input", (str, list), required=True)
    reasoning = ""  # reasoning items' text (ours, sent back): a
                    # turn's first item, the next assistant message's
    for i, item in enumerate([{"role": "user", "content": items}] if isinstance(items, str) else items):
        w = f"input[{i}]."
        item = item if isinstance(item, dict) else {"type": None}
        kind = item.get("type", "message")
        if kind == "reasoning":
            for j, part in enumerate(field(item, "content", list, [], where=w)):
                if not (isinstance(part, dict) and part.get("type") == "reasoning_text"):
                    raise invalid(f"{w}content[{j}]", "must be a reasoning_text part.")
                reasoning += field(part, "text", str, "", where=f"{w}content[{j}].")
            continue
        if kind == "message" and item.get("role") in ("system", "developer", "user", "assistant"):
            role = {"developer": "system"}.get(item["role"], item["role"])
            messages.append({"role": role, "content": text_of(item.get("content"), w + "content",
                                                              images=role == "user")})
        elif kind == "function_call":
            call = tool_call(field(item, "call_id", str, required=True, where=w),
                             field(item, "name", str, required=True, where=w),
                             field(item, "arguments", str, required=True, where=w))
            if not (messages and messages[-1]["role"] == "assistant") or reasoning:
                # calls without text before them
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = field(item, "output", (str, list), required=True, where=w)
            messages.append({"role": "tool", "tool_call_id": field(item, "call_id", str, required=True, where=w),
                             "content": text_of(output, w + "output", images=True)})
        else:
            raise invalid(w + "type", f"{kind!r} is not supported (items: {RESPONSES_ITEMS}; "
                                      "message roles system, developer, user, assistant).")
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], reasoning = reasoning, ""
    tools, strict = tools_of(body, ("function",), "must be \"function\" (function tools only).")
    top_logprobs = top_logprobs_of(body, "message.output_text.logprobs" in field(body, "include", list, []))
    sampling = sampling_of(server, body, field(body, "max_output_tokens", int), None,
                           field(body, "seed", int), 2.0)
    sampling["structured"] = structured_of(field(field(body, "text", dict, {}), "format", dict, {"type": "text"},
                                                 where="text."), "text.format")
    request = ChatRequest("responses", body, messages, tools, strict, sampling)
    request.top_logprobs, request.instructions = top_logprobs, int(bool(instructions))
    request.previous_response_id = field(body, "previous_response_id", str)
    request.store = field(body, "store", bool, True)
    if not items:
        raise invalid("input", "must not be empty.")
    return tool_choice_of(request, *openai_choice(field(body, "tool_choice", (str, dict), "auto"), "flat"),
                          field(body, "parallel_tool_calls", bool, True))


# -----------------------------------------------------------------------------
# images: checked, decoded and counted in tokens by the model's own processor


class ImageTokens:
    """A model's image placeholders: a request's images checked against the limits, each
    decoded and counted in tokens by the model's processor (its patches after the merge),
    and the template's one placeholder token per image expanded to that many and back. A
    model without an image processor takes no images. max_per_prompt: the engine's limit,
    which the capture server passes (None: no limit, for counting alone)."""

    def __init__(self, tokenizer, max_per_prompt=None, max_pixels=4096 * 4096, max_bytes=8 << 20):
        self.processor, self.token_id, self.banned = None, None, {}
        if os.path.isfile(os.path.join(tokenizer.name_or_path, "preprocessor_config.json")):
            from transformers import AutoProcessor
            self.processor = AutoProcessor.from_pretrained(tokenizer.name_or_path)
            self.token_id = tokenizer.convert_tokens_to_ids(self.processor.image_token)
            # logit biases that keep placeholders unsampled
            video = getattr(self.processor, "video_token", None)
            self.banned = {t: -100 for t in (self.token_id, video and tokenizer.convert_tokens_to_ids(video)) if t}
        self.max_per_prompt, self.max_pixels, self.max_bytes = max_per_prompt, max_pixels, max_bytes
        # the most tokens an image may take: a huge square's, resized to the
        # processor's pixel budget, as vLLM sizes its encoder cache (a very
        # long image can resize to a little more: the engine would refuse it)
        self.max_tokens = self.processor and self.processor._get_num_multimodal_tokens(
            image_sizes=[(1 << 20, 1 << 20)]).num_image_tokens[0]

    def check(self, messages):
        """The images of internal messages, in the order
        templates render them, within the limits."""
        images = [p["image"] for m in messages if isinstance(m.get("content"), list)
                  for p in m["content"] if "image" in p]
        if images and self.processor is None:
            raise RequestError(400, f"`{images[0].where}`: this model takes no images.", images[0].where)
        if self.max_per_prompt is not None and len(images) > self.max_per_prompt:
            where = images[self.max_per_prompt].where
            raise RequestError(400, f"`{where}`: the conversation holds {len(images)} images, more than the "
                                    f"{self.max_per_prompt} one prompt may hold.", where)
        return images

    def count(self, image):
        """How many tokens an image takes; the whole file is decoded (a corrupt
        one fails here, not in the engine) and the processor's rules are checked
        on the image vLLM will hand it (EXIF orientation applied, in RGB)."""
        from PIL import Image
        from vllm.multimodal.image import convert_image_mode, normalize_image
        where = image.where
        if len(image) > self.max_bytes:
            raise RequestError(
                400, f"`{where}`: the image is {len(image)} bytes, more than {self.max_bytes}.", where)
        try:
            with Image.open(io.BytesIO(image)) as img:
                w, h = img.size
                if w * h > self.max_pixels:
                    raise RequestError(400, f"`{where}`: the image is {w}x{h} pixels, more than "
                                            f"{self.max_pixels}.", where)
                img.load()
                # a photo turned on its side swaps them
                w, h = convert_image_mode(normalize_image(img), "RGB").size
        except RequestError:
            raise
        except Exception as e:  # PIL raises many kinds (UnidentifiedImageError,
                                # OSError, DecompressionBombError...)
            raise invalid(where, f"is not an image this server can decode: {e}.")
        try:
            n = self.processor._get_num_multimodal_tokens(image_sizes=[(h, w)]).num_image_tokens[0]
        except ValueError as e:  # the processor's own rules (Qwen-VL:
                                 # an aspect ratio of at most 200)
            raise RequestError(
                400, f"`{where}`: this model's image processor refuses a {w}x{h} image: {e}.", where)
        if n > self.max_tokens:
            raise RequestError(
                400, f"`{where}`: resized by this model's processor, the {w}x{h} image takes {n} tokens, "
                     f"more than the {self.max_tokens} of its pixel budget (the engine's limit for one "
                     "image); crop or pad it closer to square.", where)
        return n

    def expand(self, ids, images):
        """Rendered ids with each image's placeholder token repeated
        as many times as the image takes tokens, and those counts."""
        at = [i for i, t in enumerate(ids) if t == self.token_id] if images else []
        if len(at) != len(images):
            raise RequestError(400, f"The chat template rendered {len(at)} image placeholders for {len(images)} "
                                    "images.", "messages")
        counts = [self.count(image) for image in images]
        for i, n in zip(reversed(at), reversed(counts)):
            ids[i:i + 1] = [self.token_id] * n
        return ids, counts

    def collapse(self, ids, counts):
        """Expanded ids with each image's tokens back to one placeholder,
        as vLLM takes them: its processor expands them itself (and, given
        expanded ids, would expand the first token of each image again)."""
        out, i = [], 0
        for n in counts:
            j = ids.index(self.token_id, i)
            out += ids[i:j + 1]
            i = j + n
        return out + ids[i:]


# -----------------------------------------------------------------------------
# wire formats of the answers


def error_body(protocol, status, message, param=None):
    if protocol == "anthropic":
        kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}.get(
            status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    code = {401: "invalid_api_key", 413: "request_too_large"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(protocol, status, message, param=None):
    # a client stalled mid-body may never finish it: close
    # its connection (uvicorn discards the rest of a 413's)
    headers = {"connection": "close"} if status == 408 else None
    return JSONResponse(error_body(protocol, status, message, param), status_code=status, headers=headers)


def json_handler(protocol):
    """An HTTP handler returning JSON; a RequestError it raises is answered in `protocol`'s error
    format."""
    def wrap(handler):
        @wraps(handler)
        async def handle(self, request):
            try:
                reply = await handler(self, request)
            except RequestError as e:
                return error_response(protocol, e.status, e.message, e.param)
            return JSONResponse(reply)
        return handle
    return wrap


def openai_completion(result):
    m = result["message"]
    # reasoning_content as vLLM's reasoning parsers and DeepSeek's API give it
    message = {"role": "assistant", "content": m["content"] if m["content"] or "tool_calls" not in m else None,
               **{k: m[k] for k in ("reasoning_content", "tool_calls") if m.get(k)}}
    usage = result["prompt_tokens"], result["completion_tokens"]
    return {"id": "chatcmpl-" + result["id"], "object": "chat.completion", "created": result["created"],
            "model": result["model"], "choices": [{"index": 0, "message": message,
                                                   "logprobs": result["logprobs"]
                                                   and {"content": result["logprobs"]},
                                                   "finish_reason": result["finish_reason"]}],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}}


def sse(name, data):
    return (f"event: {name}\n" if name
            else "") + f"data: {json.dumps(dict(type=name, **data) if name else data)}\n\n"


def read_calls(parser, previous, text):
    """A streaming tool parser of vLLM's (a fresh one per turn: it holds the turn's
    state) reads the turn's text so far (`previous`: the text it read last): the new
    text before any call opens, and the calls begun, as (name, the arguments as streamed
    so far), gathered from the parser's deltas (kept on the parser: `calls_read`)."""
    delta = parser.extract_tool_calls_streaming(previous, text, text[len(previous):], [], [], [], None)
    calls = parser.__dict__.setdefault("calls_read", [])
    for d in (delta and delta.tool_calls) or []:
        calls += [["", ""] for _ in range(d.index + 1 - len(calls))]
        if d.function is not None:
            calls[d.index][0] += d.function.name or ""
            calls[d.index][1] += d.function.arguments or ""
    return (delta and delta.content) or "", [tuple(c) for c in calls if c[0]]


# the call formats: the XML ones (Qwen3.5 / 3.6, Qwen3-Coder)
# render arguments from mappings; reasoning tags (Qwen)
XML_TOOL_PARSERS = ("qwen3_coder", "qwen3_xml")
THINK_TAGS = ("<think>", "</think>")


def tool_parser_of(tokenizer):
    """vLLM's tool parser for the call format the model's chat template writes."""
    return "qwen3_coder" if "<function=" in (tokenizer.chat_template or "") else "hermes"


def call_tags(parser):
    """The texts that open and close a tool call in a vLLM
    tool parser's format (None where it has none)."""
    engine = getattr(parser, "_parser_engine", None)  # the grammar-engine parsers
                                                      # (qwen3_coder, ...)
    terminals = engine.parser_engine_config.terminals if engine is not None else {}
    return (getattr(parser, "tool_call_start_token", terminals.get("TOOL_START")),
            getattr(parser, "tool_call_end_token", terminals.get("TOOL_END")))


def argument_mapping(call):
    """A tool call with its JSON arguments as a mapping (for XML templates); arguments
    that are no JSON object are refused: such a template could not show them."""
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        arguments = json_or(arguments or "{}", None)
        if not isinstance(arguments, dict):
            raise RequestError(
                400, f"The arguments of tool call {call.get('id')!r} are not a JSON object, which this "
                     "model's call format (XML parameters) cannot show.", "messages")
    return dict(call, function=dict(call["function"], arguments=arguments))


def split_reasoning(text, call_start=None):
    """(reasoning, the rest) of a turn that began inside <think>: the reasoning
    ends at </think> (the newlines the template trims off it dropped), or where
    a tool call opens without it (as vLLM's qwen3 parser reads it)."""
    end, call = text.find(THINK_TAGS[1]), text.find(call_start) if call_start else -1
    if end >= 0 and (call < 0 or end < call):
        return text[:end].strip(), text[end + len(THINK_TAGS[1]):].lstrip("\n")
    return (text[:call].strip(), text[call:]) if call >= 0 else (text.strip(), "")


def json_or(text, default):
    """The JSON value of `text`, or `default` where it is no JSON (or nests too deep to read)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return default


def same_json(a, b):
    """Whether both are JSON, of the same value."""
    return json_or(a, object()) == json_or(b, object())  # two texts that are no JSON:
                                                         # two objects, never equal


def same_message(a, b):
    """Equal as the model sees them: tool-call ids ignored, tool-call arguments compared as JSON;
    an echo `b` without the reasoning of our own message `a` matches it (SDKs that drop reasoning
    from the messages they send back)."""
    def canonical(m):
        # arguments that are no JSON (or nest too deep to read) compared as text
        calls = [(c["function"]["name"], json_or(args := c["function"]["arguments"], args))
                 for c in m.get("tool_calls") or []]
        return (m["role"], m.get("content") or "", calls, m.get("tool_call_id"),
                m.get("reasoning_content") or "")
    reasoning = b.get("reasoning_content") or a.get("reasoning_content")
    return canonical(a) == canonical(dict(b, reasoning_content=reasoning))


def stream_deltas(sent, content, calls, reasoning=""):
    """The stream items that extend what was sent (sent: [text, [[id, name, arguments], ...],
    reasoning], updated) to `reasoning`, `content` and `calls` ([(id, name, arguments), ...]):
    ("reasoning", delta), ("text", delta), ("call", index, id, name), ("args", index, delta).
    Only where they extend it, as a stream cannot take anything back: no reasoning once text
    or a call began, no text once a call began (an answer's reasoning comes first, then its
    text, then its calls), arguments only for the latest call (the earlier ones ended)."""
    if reasoning and reasoning.startswith(sent[2]) and len(reasoning) > len(sent[2]) and not sent[0] and not sent[1]:
        yield "reasoning", reasoning[len(sent[2]):]
        sent[2] = reasoning
    if content.startswith(sent[0]) and len(content) > len(sent[0]) and not sent[1]:
        yield "text", content[len(sent[0]):]
        sent[0] = content
    for i, (cid, name, arguments) in enumerate(calls):
        if i == len(sent[1]):
            sent[1].append([cid, name, ""])
            yield "call", i, cid, name
        old = sent[1][i][2]
        if i == len(sent[1]) - 1 and arguments.startswith(old) and len(arguments) > len(old):
            sent[1][i][2] = arguments
            yield "args", i, arguments[len(old):]


# The event writers read CaptureServer.live's items: ("head", id, created,
# model, prompt tokens), then text, call and argument deltas (stream_deltas)
# as the engine samples, then ("done", answer), or ("error", status, message)
# when the turn failed mid-stream: the protocol's error event ends the stream.


async def openai_events(items, request):
    async for item in items:
        kind = item[0]
        if kind in ("done", "error"):
            break
        if kind == "head":
            base = {"id": "chatcmpl-" + item[1], "object": "chat.completion.chunk",
                    "created": item[2], "model": item[3]}
        delta = {"role": "assistant", "content": ""} if kind == "head" else {"content": item[1]} \
            if kind == "text" else {"reasoning_content": item[1]} if kind == "reasoning" else \
            {"tool_calls": [{"index": item[1], "function": {"arguments": item[2]}} if kind == "args"
                            else dict(tool_call(item[2], item[3], ""), index=item[1])]}
        yield sse(None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    if kind == "error":  # as vLLM's OpenAI server does: an error
                         # chunk (the SDKs raise it), then the end
        yield sse(None, error_body("openai", item[1], item[2])) + "data: [DONE]\n\n"
        return
    answer = openai_completion(item[1])  # the last chunk: its choice's finish
                                         # reason and logprobs, then its usage
    finish = {k: answer["choices"][0][k] for k in ("finish_reason", "logprobs")}
    yield sse(None, {**base, "choices": [{"index": 0, "delta": {}, **finish}]})
    if request.include_usage:
        yield sse(None, {**base, "choices": [], "usage": answer["usage"]})
    yield "data: [DONE]\n\n"


def anthropic_message(result):
    m = result["message"]
    # no signature: nothing here signs reasoning; a thinking block sent back is read by its text
    content = [{"type": "thinking", "thinking": m["reasoning_content"], "signature": ""}] \
        if m.get("reasoning_content") else []
    content += [{"type": "text", "text": m["content"]}] if m["content"] else []
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls", [])]
    stop_reason = {"tool_calls": "tool_use", "length": "max_tokens"}.get(
        result["finish_reason"], "stop_sequence" if result["stop_sequence"] else "end_turn")
    return {"id": "msg_" + result["id"], "type": "message", "role": "assistant", "model": result["model"],
            "content": content, "stop_reason": stop_reason, "stop_sequence": result["stop_sequence"],
            "usage": {"input_tokens": result["prompt_tokens"], "output_tokens": result["completion_tokens"]}}


async def anthropic_events(items, request=None):
    index, block = -1, None  # the open content block: its index and kind
    async for item in items:
        kind = item[0]
        if kind in ("done", "error"):
            break
        if kind == "head":
            yield sse("message_start", {"message": {
                "id": "msg_" + item[1], "type": "message", "role": "assistant", "model": item[3], "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": item[4], "output_tokens": 0}}})
            continue
        # a block begins (a
        if kind == "call" or block is None or (block == "reasoning" and kind == "text"):
            index, block = index + 1, kind  # tool_use block per call): the open one ends
            start = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                     "signature": ""} if kind == "reasoning" else {"type": "tool_use",
                                                                   "id": item[2], "name": item[3], "input": {}}
            yield (sse("content_block_stop", {"index": index - 1}) if index else "") + sse(
                "content_block_start", {"index": index, "content_block": start})
        if kind != "call":
            delta = {"type": "text_delta",
                     "text": item[1]} if kind == "text" else {"type": "thinking_delta", "thinking":
                     item[1]} if kind == "reasoning" else {"type": "input_json_delta", "partial_json": item[2]}
            yield sse("content_block_delta", {"index": index, "delta": delta})
    if kind == "error":
        yield sse("error", {"error": error_body("anthropic", item[1], item[2])["error"]})
        return
    message = anthropic_message(item[1])
    yield sse("content_block_stop", {"index": index}) if block else ""
    yield sse("message_delta", {"delta": {k: message[k] for k in ("stop_reason", "stop_sequence")},
                                "usage": message["usage"]})
    yield sse("message_stop", {})


def message_item(answer_id, text, logprobs):
    return {"type": "message", "id": "msg_" + answer_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def reasoning_item(answer_id, text):
    return {"type": "reasoning", "id": "rs_" + answer_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call):
    return {"type": "function_call", "id": "fc_" + call["id"], "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def responses_object(result):
    m = result["message"]
    output = [reasoning_item(result["id"], m["reasoning_content"])] if m.get("reasoning_content") else []
    output += [message_item(result["id"], m["content"], result["logprobs"] or [])] if m["content"] or \
        "tool_calls" not in m else []
    output += [call_item(c) for c in m.get("tool_calls", [])]
    cut = result["finish_reason"] == "length"
    usage = result["prompt_tokens"], result["completion_tokens"]
    return {"id": "resp_" + result["id"], "object": "response", "created_at": result["created"],
            "model": result["model"], "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": dict(input_tokens=usage[0], input_tokens_details={"cached_tokens": 0},
                          output_tokens=usage[1], total_tokens=sum(usage), output_tokens_details={
                              "reasoning_tokens": result.get("reasoning_tokens", 0)})}


async def responses_events(items, request=None):
    """The Responses API's typed events, each with its sequence number: an output
    item per message and per call, each closed when the next one begins."""
    number, output = itertools.count(), []  # the output items begun, holding
                                            # what was streamed into them

    def event(kind, **data):
        return sse(kind, {"sequence_number": next(number), **data})

    def add(out):  # a message's text part begins with it
        output.append(out)
        begun = {"arguments": ""} if out["type"] == "function_call" else {"content": []}
        added = event("response.output_item.added", output_index=len(output) - 1,
                      item=dict(out, status="in_progress", **begun))
        return added if out["type"] != "message" else added + event(
            "response.content_part.added", output_index=len(output) - 1, item_id=out["id"], content_index=0,
            part=dict(out["content"][0], text="", logprobs=[]))

    def close(i):
        out, at = output[i], {"output_index": i, "item_id": output[i]["id"]}
        if out["type"] == "function_call":
            done = event("response.function_call_arguments.done", **at, arguments=out["arguments"],
                         name=out["name"])
        elif out["type"] == "reasoning":
            done = event("response.reasoning_text.done", **at, content_index=0, text=out["content"][0]["text"])
        else:
            part = out["content"][0]
            done = event("response.output_text.done", **at, content_index=0, text=part["text"],
                         logprobs=part["logprobs"]) + event("response.content_part.done", **at,
                                                            content_index=0, part=part)
        return done + event("response.output_item.done", output_index=i, item=out)
    async for item in items:
        kind = item[0]
        if kind in ("done", "error"):
            break
        if kind == "head":
            answer_id = item[1]
            head = {"id": "resp_" + item[1], "object": "response", "created_at": item[2], "model": item[3],
                    "status": "in_progress", "output": [], "error": None,
                    "incomplete_details": None, "usage": None, "parallel_tool_calls": True,
                    "tool_choice": "auto", "tools": []}
            yield event("response.created", response=head) + event("response.in_progress", response=head)
            continue
        # reasoning first,
        if kind == "call" or not output or (kind == "text" and output[-1]["type"] == "reasoning"):
            # then text (the message), then the calls
            yield (close(len(output) - 1) if output else "") + add(
                message_item(answer_id, "", []) if kind == "text" else reasoning_item(answer_id, "") if
                kind == "reasoning" else call_item(tool_call(item[2], item[3], "")))
        at = {"output_index": len(output) - 1, "item_id": output[-1]["id"]}
        if kind == "reasoning":
            output[-1]["content"][0]["text"] += item[1]
            yield event("response.reasoning_text.delta", **at, content_index=0, delta=item[1])
        elif kind == "text":
            output[-1]["content"][0]["text"] += item[1]
            yield event("response.output_text.delta", **at, content_index=0, delta=item[1], logprobs=[])
        elif kind == "args":
            output[-1]["arguments"] += item[2]
            yield event("response.function_call_arguments.delta", **at, delta=item[2])
    if kind == "error":
        error = {"code": "server_error" if item[1] >= 500 else "invalid_prompt", "message": item[2]}
        yield event("response.failed", response=dict(head, status="failed", error=error))
        return
    response = responses_object(item[1])
    streamed = [out["id"] for out in output]
    for out in response["output"]:  # as the answer holds them (with the logprobs)
        if out["id"] in streamed:
            output[streamed.index(out["id"])] = out
    yield close(len(output) - 1) if output else ""
    for out in response["output"]:  # not streamed: an empty answer's
                                    # message (or a malformed call's text)
        if out["id"] not in streamed:
            yield add(out) + close(len(output) - 1)
    yield event(f"response.{response['status']}", response=response)


PARSERS = {"openai": parse_openai, "anthropic": parse_anthropic, "responses": parse_responses}
ANSWERS = {"openai": openai_completion, "anthropic": anthropic_message, "responses": responses_object}
EVENTS = {"openai": openai_events, "anthropic": anthropic_events, "responses": responses_events}
