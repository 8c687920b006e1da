"""The geometry recipe end to end on the random-init tiny Qwen3-VL-MoE: `python train.py --config configs/tiny_vl.py
--agent=agents/geometry.py` as a process (real Ray, a real vLLM engine serving images, the capture server, the FSDP2
trainer, weight sync), then its checkpoint exported: the diagrams reached the model (image tokens recorded as context) and the trainer (the
vision tower's weights moved: only images give it gradients); held-out evaluation with its
blank-picture ablation.

    .venv/bin/python -m pytest tests/test_loop_vl.py -q     # several minutes on 2 cores
"""
import base64
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import child_env
from model import read_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.stack
def test_geometry_recipe_trains_the_tiny_vlm_end_to_end(tmp_path, tiny_vl_model_path):
    out, export = tmp_path / "run", tmp_path / "hf"
    args = [sys.executable, "train.py", "--config", "configs/tiny_vl.py", f"--out_dir={out}", "--max_steps=2",
            "--agent=agents/geometry.py", f"--model_path={tiny_vl_model_path}", "--max_tokens=24",
            "--eval_every=0", "--group_size=2", "--groups_per_batch=2", "--groups_in_flight=2",
            "--save_trajectories=True", "--warmup_steps=0", "--attempt_timeout_s=600",  # a loaded 2-core machine
            "--entropy_coef=0.01"]  # a random-init model never answers right: the entropy bonus gives gradients
    sys.path.insert(0, os.path.join(ROOT, "agents"))
    import geometry
    held_out = geometry.eval_prompts(2)
    held_file = tmp_path / "held_out.jsonl"
    held_file.write_text("".join(json.dumps(p) + "\n" for p in held_out))
    r = subprocess.run(args + ["--eval_every=2", f"--eval_prompts={held_file}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800, env=child_env())
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [0, 1, 2] and rows[-1]["policy_version"] == 2
    # engine and trainer agree on the first batch's segments with images (the same weights): 1.4e-6
    # measured on an AMD EPYC; the second batch, partly sampled before the first sync, gave 2.5e-2
    assert rows[1]["mismatch_kl"] < 1e-4
    # held-out evaluation at versions 0 and 2, and its ablation: the same prompts with each picture
    # blank (its size kept, no pixels), logged as eval/success_blank and kept per prompt
    assert [row["step"] for row in rows if "eval/success_blank" in row] == [0, 2]
    assert all(0 <= row["eval/success_blank"] <= 1 for row in rows if row["step"] != 1)
    for tail, blank in (("", False), ("_blank", True)):
        results = [json.loads(line) for line in open(out / f"eval_results{tail}.jsonl")]
        assert [r["policy_version"] for r in results] == [0, 0, 2, 2]
        for result, prompt in zip(results, held_out * 2):
            (got_image, got_text), (image, text) = (m[0]["content"] for m in (result["prompt"],
                                                                               prompt["messages"]))
            assert got_text == text and not result["failed"] and result["generated_tokens"] > 0
            pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(
                got_image["image_url"]["url"].split(",", 1)[1]))).convert("L"))
            assert pixels.shape == (448, 448) and (pixels.min() == 255) == blank
    segments = [json.loads(line) for line in open(out / "trajectories.jsonl")]
    with open(os.path.join(tiny_vl_model_path, "config.json")) as f:
        image_token = json.load(f)["image_token_id"]
    for seg in segments:  # each attempt's diagram went to the model; its tokens are context, never trained on
        assert len(seg["images"]) >= 1
        assert Image.open(io.BytesIO(base64.b64decode(seg["images"][0]))).size == (448, 448)
        image_positions = [i for i, t in enumerate(seg["token_ids"]) if t == image_token]
        assert image_positions and not any(seg["action_mask"][i] for i in image_positions)
    r = subprocess.run(args + [f"--export_hf_dir={export}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=child_env())
    assert r.returncode == 0, r.stderr[-4000:]
    before, after = read_safetensors(tiny_vl_model_path), read_safetensors(str(export))
    tower = [n for n in before if n.startswith("model.visual.")]
    assert tower and all(n in after for n in tower)
    moved = [n for n in tower if not torch.allclose(before[n].float(), after[n].float())]
    assert len(moved) > len(tower) // 2, f"the vision tower barely moved: {len(moved)} of {len(tower)} tensors"
