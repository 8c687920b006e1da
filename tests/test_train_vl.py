"""The trainer on a Qwen3-VL-MoE: VL checkpoints loaded shard by shard, images in the forward, the vision tower as
FSDP2 units of its own (trained or frozen), on real gloo ranks against a single-process reference; the images'
way from a recorded segment to the rank that trains on it.

    .venv/bin/python -m pytest tests/test_train_vl.py -q
"""
import dataclasses

import numpy as np
import pytest
import torch

import checkpoint
import train
import vl
from model import ModelConfig, Transformer, VisionConfig
from test_train import (ADAM_EPS, GRAD_TOL, PARAM_TOL, STEPS, build, record_grads_before_step, reference_run, spawn,
                        trainer_config)

VISION = VisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=4,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 2], image_token_id=90,
                      video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
# the tiny MoE of test_train with a vision tower, M-RoPE and deepstack into the first two layers
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16, mlp_only_layers=[1], vision=VISION, mrope_section=[1, 1, 2])
PATCH = 3 * 2 * 4 * 4


def make_weights(path):
    torch.manual_seed(0)
    m = Transformer(CFG)
    m.init_weights(0, std=0.2)
    m.save_pretrained(path)  # Qwen3-VL-MoE layout: text under model.language_model, experts fused (E, D, 2H)
    return path


def segment(g, grids, n_text):
    """A recorded segment holding images of `grids` (already patched, as vl.with_pixels leaves it), then text."""
    ids, mask = [], []
    for t, h, w in grids:
        ids += torch.randint(0, 88, (2,), generator=g).tolist() + [VISION.vision_start_token_id]
        ids += [VISION.image_token_id] * (t * h * w // 4) + [VISION.vision_end_token_id]
    mask = [0] * len(ids) + [1] * n_text
    ids += torch.randint(0, 88, (n_text,), generator=g).tolist()
    s = dict(token_ids=ids, action_mask=mask, behavior_logprobs=(-torch.rand(len(ids), generator=g) * 4).tolist(),
             token_versions=[-1 if m == 0 else 0 for m in mask], routed_experts=None)
    if grids:
        s.update(pixel_values=torch.randn(sum(t * h * w for t, h, w in grids), PATCH, generator=g),
                 image_grid_thw=torch.tensor(grids))
    return s


def vl_windows():
    """Per step 3 microbatches: the first and third with images (several per row, several sizes), the second text
    only. Split rank::2, rank 1 gets the text microbatch and an empty one: it never sees an image."""
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(200 + step)
        mbs = [[segment(g, [(1, 4, 4), (1, 2, 6)], 5), segment(g, [(1, 6, 4)], 7)],
               [segment(g, [], 9), segment(g, [], 6)],
               [segment(g, [(1, 8, 6)], 4)]]
        out.append([train.collate(segs, torch.randn(len(segs), generator=g).tolist()) for segs in mbs])
    return out


def vl_steps(rank, world, cfg, weights, wins, out):
    model, _ = build(cfg, weights, world)
    assert model.visual.blocks[0].__class__.__name__.startswith("FSDP")  # a unit of its own
    opt = train.build_optimizer(model, cfg)
    for group in opt.param_groups:
        group["eps"] = ADAM_EPS
    recorded = record_grads_before_step(opt, model)
    before = {n: t for n, t in checkpoint.full_parameters(model)}
    lcfg = train.loss_config(cfg)
    metrics = [train.train_step(model, opt, wins[step][rank::world], cfg, lcfg, policy_version=step)
               for step in range(STEPS)]
    params = {n: t for n, t in checkpoint.full_parameters(model)}
    if rank == 0:
        torch.save(dict(metrics=metrics, grads=recorded, params=params, before=before), out)


@pytest.mark.parametrize("train_vision", [True, False], ids=["vision-trained", "vision-frozen"])
@pytest.mark.stack
def test_vl_training_on_2_ranks_matches_single_process(tmp_path, train_vision):
    weights = make_weights(str(tmp_path / "weights"))
    cfg = trainer_config(ep_size=2, train_vision=train_vision)
    wins = vl_windows()
    spawn(2, vl_steps, cfg, weights, wins, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    ref = reference_run(weights, wins, cfg)
    vision = [n for n in ref[-1]["params"] if n.startswith("visual.")]
    for step, (m, r) in enumerate(zip(got["metrics"], ref)):
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-6), step
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), step
        assert set(got["grads"][step]) == set(r["grads"])  # frozen: no tower gradient on either side
        assert any(n.startswith("visual.") for n in r["grads"]) == train_vision
        for name, g in r["grads"].items():
            torch.testing.assert_close(got["grads"][step][name], g, **GRAD_TOL, msg=lambda s: f"step {step} {name}: {s}")
    for name, p in ref[-1]["params"].items():
        torch.testing.assert_close(got["params"][name], p, **PARAM_TOL, msg=lambda s: f"{name}: {s}")
    moved = [n for n in vision if not torch.equal(got["params"][n], got["before"][n])]
    assert (len(moved) == len(vision)) if train_vision else not moved, moved


def test_idle_vision_changes_nothing_and_reaches_every_tower_parameter():
    m = Transformer(CFG)
    m.init_weights(0, std=0.2)
    ids = torch.randint(0, 88, (2, 7))
    plain = m.hidden_states(ids)
    m.vision_in_every_forward = True
    idle = m.hidden_states(ids)
    assert torch.equal(plain, idle)
    idle.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in m.visual.parameters())


def test_with_pixels_patches_the_encoded_images_with_the_models_processor(tiny_vl_model_path):
    from PIL import Image
    import io
    proc = vl.image_processor(tiny_vl_model_path)
    files = []
    for size, color in (((64, 48), "red"), ((32, 32), "blue")):
        buf = io.BytesIO()
        Image.new("RGB", size, color).save(buf, format="PNG")
        files.append(buf.getvalue())
    ref = proc(images=[Image.open(io.BytesIO(b)) for b in files], return_tensors="pt")
    seg = vl.with_pixels(dict(token_ids=np.zeros(3), images=files, image_grid_thw=ref["image_grid_thw"].numpy()),
                         tiny_vl_model_path)
    assert "images" not in seg and torch.equal(seg["pixel_values"], ref["pixel_values"].float())
    assert seg["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist()
    text = vl.with_pixels(dict(token_ids=np.zeros(3), images=[], image_grid_thw=np.zeros((0, 3))), tiny_vl_model_path)
    assert "pixel_values" not in text and vl.collate_images([text])["pixel_values"] is None
    with pytest.raises(ValueError, match="same processor"):
        vl.with_pixels(dict(token_ids=np.zeros(3), images=files, image_grid_thw=[[1, 2, 2], [1, 2, 2]]),
                       tiny_vl_model_path)


def test_train_vision_false_on_a_text_model_is_a_config_error():
    from plan import ConfigError, check_config
    cfg = trainer_config(train_vision=False)
    with pytest.raises(ConfigError, match="train_vision"):
        check_config(cfg, mcfg=dataclasses.replace(CFG, vision=None))
    assert check_config(cfg, mcfg=CFG) is CFG


def png(seed, size):
    from PIL import Image
    import io
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def fetch_own(rank, world, blob, ray_env, model_path, out):
    """A trainer rank: joins the test's Ray cluster and takes its share of the batch through train.share_batch."""
    import os
    import torch.distributed as dist
    os.environ.update(ray_env[1])
    import ray
    ray.init(address=ray_env[0])
    sent = []
    if rank == 0:  # what the driver broadcasts to the other ranks
        broadcast = dist.broadcast_object_list
        dist.broadcast_object_list = lambda box, src: (sent.append(box[0]), broadcast(box, src))[1]
    records = ray.cloudpickle.loads(blob) if rank == 0 else None
    segments, _ = train.share_batch(records, trainer_config(model_path=model_path), rank, world)
    torch.save(dict(sent=sent, segments=[{k: s.get(k) for k in ("token_ids", "pixel_values", "image_grid_thw")}
                                         for s in segments]), f"{out}.{rank}")
    ray.shutdown()


@pytest.mark.stack
def test_images_travel_by_ref_and_each_rank_patches_only_its_own(tmp_path, ray_cluster, tiny_vl_model_path):
    import io
    import os
    from PIL import Image
    from rollout import put_experience
    proc = vl.image_processor(tiny_vl_model_path)
    files, records = {}, []
    for i in range(6):  # attempts of 1 or 2 images of several sizes, in 3 groups
        imgs = [png(10 * i + j, (48 + 16 * j, 64)) for j in range(1 + i % 2)]
        grid = proc(images=[Image.open(io.BytesIO(b)) for b in imgs], return_tensors="np")["image_grid_thw"]
        n = 20 + 7 * i  # a distinct length: the segment's identity on the rank that gets it
        seg = dict(attempt_id=f"a{i}", segment_index=0, token_ids=list(range(n)), action_mask=[0] * 10 + [1] * (n - 10),
                   behavior_logprobs=[0.0] * n, token_versions=[-1] * 10 + [0] * (n - 10), images=imgs,
                   image_grid_thw=grid.tolist())
        files[n] = imgs
        records.append(put_experience(seg, reward=float(i % 3), group_id=i // 2))
    blob = ray_cluster.cloudpickle.dumps(records)
    for imgs in files.values():  # the queue's records hold refs and light fields, not one byte of any image
        assert all(b[100:164] not in blob for b in imgs)
    assert len(blob) < sum(len(b) for imgs in files.values() for b in imgs) / 10
    env = (ray_cluster.get_runtime_context().gcs_address,
           {k: v for k, v in os.environ.items() if k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")})
    spawn(2, fetch_own, blob, env, tiny_vl_model_path, str(tmp_path / "got"))
    got = [torch.load(f"{tmp_path}/got.{r}", weights_only=False) for r in range(2)]
    assert all(b[100:164] not in got[0]["sent"][0] for imgs in files.values() for b in imgs)
    seen = [len(s["token_ids"]) for g in got for s in g["segments"]]
    assert sorted(seen) == sorted(files) and all(g["segments"] for g in got)  # each segment on exactly one rank
    for g in got:
        for s in g["segments"]:  # patched on that rank, as the engine's processor patches them
            ref = proc(images=[Image.open(io.BytesIO(b)) for b in files[len(s["token_ids"])]], return_tensors="pt")
            assert torch.equal(s["pixel_values"], ref["pixel_values"].float())
            assert s["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist()
