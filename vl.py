"""
Images on the trainer's side (Qwen3-VL): a segment's encoded images -> the pixel_values
and image_grid_thw the model takes, per microbatch; and the vision tower's FSDP units.

A recorded segment carries `images` (the encoded files as the agent sent them, in the
order of their image-token runs in token_ids; optionally `image_grid_thw`, each image's
t, h, w in patches, checked here). They travel inside the segment's object in the Ray
object store, never on the queue (rollout.put_experience); each trainer rank fetches its
own segments and patches their images here with the model directory's image processor,
the one the engine uses, so the pixels exist only on the rank that trains on them.

    .venv/bin/python -m pytest tests/test_train_vl.py -q
"""
import functools
import io

import numpy as np
import torch

IMAGE_FIELDS = ("pixel_values", "image_grid_thw")  # a microbatch's image tensors
                                                   # (None for text alone)


@functools.lru_cache(maxsize=4)
def image_processor(model_path):
    """The model directory's image processor, the one
    vLLM's engine instantiates (AutoProcessor's)."""
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(model_path).image_processor


def with_pixels(segment, model_path):
    """The fetched segment with its images decoded and patched:
    pixel_values (N, C*T*P*P) float32 and image_grid_thw (I, 3) int64 in
    place of the encoded bytes. A text segment is returned as it is."""
    images = segment.pop("images", None)
    if images is None or len(images) == 0:
        segment.pop("image_grid_thw", None)
        return segment
    from PIL import Image, ImageOps
    # upright, as vLLM hands images to its processor (and the
    # capture server counts their tokens): EXIF orientation
    out = image_processor(model_path)(
        images=[ImageOps.exif_transpose(Image.open(io.BytesIO(bytes(b))))
                for b in images], return_tensors="pt")
    grid = out["image_grid_thw"].long()
    recorded = segment.pop("image_grid_thw", None)  # when the recorder gave the grids: a check
    if recorded is not None and len(recorded) and np.asarray(recorded).tolist() != grid.tolist():
        raise ValueError(f"segment {segment.get('attempt_id')}/{segment.get('segment_index')}: the "
                         f"image processor of {model_path} patches its images to grids "
                         f"{grid.tolist()}, but the engine recorded "
                         f"{np.asarray(recorded).tolist()}: the trainer and the engine must use "
                         "the same processor")
    return dict(segment, pixel_values=out["pixel_values"].float(), image_grid_thw=grid)


def collate_images(segments):
    """The microbatch's images in row order (the model matches them to
    image-token runs row by row): {pixel_values: (sum N, C*T*P*P),
    image_grid_thw: (I, 3)}, both None when no segment has an image."""
    rows = [s for s in segments if s.get("pixel_values") is not None]
    if not rows:
        return dict(pixel_values=None, image_grid_thw=None)
    return dict(pixel_values=torch.cat([torch.as_tensor(s["pixel_values"]) for s in rows]),
                image_grid_thw=torch.cat(
                    [torch.as_tensor(s["image_grid_thw"]).long().view(-1, 3) for s in rows]))


def shard_vision(model, mesh, train_vision, **fsdp_kwargs):
    """The vision tower under FSDP2 as units of its own (each block, then the
    patch embedding, position table and mergers), before the root's fully_shard
    so that the root does not take its weights; train_vision=False freezes it
    (no gradients, no optimizer state; its forward still gathers the shards)."""
    from torch.distributed.fsdp import fully_shard
    if model.visual is None:
        return
    model.visual.requires_grad_(train_vision)
    for block in model.visual.blocks:
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model.visual, mesh=mesh, **fsdp_kwargs)


@functools.lru_cache(maxsize=4)
def placeholders(model_path):
    """The model's image placeholders and its processor's token
    counts (the capture server's protocols.ImageTokens)."""
    import protocols
    from transformers import AutoTokenizer
    return protocols.ImageTokens(AutoTokenizer.from_pretrained(model_path))


def transcript_images(ids, mask, messages, model_path):
    """A supervised transcript's tokens (agentrl.transcript_tokens: one placeholder per image,
    as the template renders it) made what the capture server records for the same conversation:
    each image's placeholder repeated as many times as the model's processor gives the image
    tokens (context, mask 0). Returns (ids, mask, images), the images as encoded files in order
    (with_pixels patches them); a transcript without images comes back as it is."""
    import protocols
    images = [protocols.image_of(part, f"messages[{i}].content[{j}]") for i,
              m in enumerate(messages)
              if isinstance(m.get("content"), list) for j, part in enumerate(m["content"])
              if isinstance(part, dict) and part.get("type") in protocols.IMAGE_PARTS]
    if not images:
        return ids, mask, []
    vision = placeholders(model_path)
    at = [i for i, t in enumerate(ids) if t == vision.token_id]
    if len(at) != len(images):
        raise ValueError(f"the chat template of {model_path} rendered {len(at)} image placeholders "
                         "for a transcript "
                         f"holding {len(images)} images")
    ids, counts = vision.expand(list(ids), images)  # as the capture server expands them
    mask = list(mask)
    for i, n in zip(reversed(at), reversed(counts)):  # an image's tokens are context
        mask[i:i + 1] = [0] * n
    return ids, mask, [bytes(b) for b in images]


def blank_images(prompt):
    """The prompt row with every inline image (a data URI, an Anthropic
    base64 block) replaced by a blank white PNG of the same size: the
    same tokens, no pixels to read (train.py's eval/success_blank)."""
    import base64
    from PIL import Image

    def blank(data):
        with Image.open(io.BytesIO(base64.b64decode(data))) as img:
            size = img.size
        buf = io.BytesIO()
        Image.new("RGB", size, "white").save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    def walk(x):
        if isinstance(x, str) and x.startswith("data:image/") and ";base64," in x:
            return "data:image/png;base64," + blank(x.split(",", 1)[1])
        if isinstance(x, dict) and x.get("type") == "base64" and isinstance(x.get("data"), str):
            return dict(x, media_type="image/png", data=blank(x["data"]))
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return [walk(v) for v in x] if isinstance(x, list) else x
    return walk(prompt)
