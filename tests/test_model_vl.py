"""Our Qwen3-VL / Qwen3-VL-MoE (vision tower, M-RoPE, deepstack) against transformers, checkpoints, the tiny VLM.

    .venv/bin/python -m pytest tests/test_model_vl.py -q
"""
import hashlib
import json
import os

import pytest
import torch

from model import ModelConfig, Transformer, VisionConfig, hf_to_ours, mrope_positions, num_params, ours_to_hf, read_safetensors
from tiny import TINY_VL_CONFIG, ensure_tiny_model

VISION = VisionConfig(depth=3, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=64, patch_size=4,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 2], image_token_id=500,
                      video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=10000.0, vision=VISION, mrope_section=[2, 3, 3])
DENSE_VL = ModelConfig(**TEXT, tie_word_embeddings=True)  # as the small Qwen3-VL models
# moe_intermediate_size neither hidden_size nor half of it: transformers transposes fused experts by their shape
MOE_VL = ModelConfig(**TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1])
# several images per sequence, of several sizes (in patches): non-square, one merged token, beyond the 8x8 learned grid
GRIDS = [[(1, 4, 6), (1, 10, 8)], [(1, 2, 2), (1, 14, 20), (1, 6, 4)]]


def random_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = Transformer(cfg)
    m.init_weights(seed, std=0.1)
    with torch.no_grad():  # non-trivial norms (and LayerNorm biases) so a wrong norm placement would show
        for n, p in m.named_parameters():
            if "norm" in n.rsplit(".", 2)[-2]:
                p.uniform_(0.5, 1.5) if n.endswith("weight") else p.uniform_(-0.2, 0.2)
    return m


def image_batch(vc, grids, seed=0):
    """Rows of text with images in them (vision_start, the image's tokens, vision_end), right-padded; the patches
    of all images in order, as the image processor lays them out."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in grids:
        ids = []
        for t, h, w in row:
            ids += torch.randint(0, 400, (3,), generator=g).tolist() + [vc.vision_start_token_id]
            ids += [vc.image_token_id] * (t * h * w // vc.spatial_merge_size ** 2) + [vc.vision_end_token_id]
        rows.append(ids + torch.randint(0, 400, (5,), generator=g).tolist())
    T = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    flat = [thw for row in grids for thw in row]
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    pixel_values = torch.randn(sum(t * h * w for t, h, w in flat), patch, generator=g)
    return input_ids, pixel_values, torch.tensor(flat)


def hf_logits(hf, input_ids, pixel_values=None, image_grid_thw=None, image_token_id=None):
    if pixel_values is None:
        return hf(input_ids=input_ids).logits
    return hf(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
              mm_token_type_ids=(input_ids == image_token_id).int()).logits


@pytest.mark.parametrize("cfg", [DENSE_VL, MOE_VL], ids=["qwen3_vl", "qwen3_vl_moe"])
def test_logits_match_transformers(cfg, tmp_path):
    from transformers import AutoModelForImageTextToText
    ours = random_model(cfg).eval()
    ours.save_pretrained(tmp_path)
    hf, info = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    hf.eval()
    assert type(hf).__name__ == ("Qwen3VLMoeForConditionalGeneration" if cfg.is_moe else
                                 "Qwen3VLForConditionalGeneration")
    assert not any(info.values()), info  # every tensor of the file read, none missing
    input_ids, pixel_values, grid = image_batch(cfg.vision, GRIDS)
    with torch.no_grad():
        ref = hf_logits(hf, input_ids, pixel_values, grid, cfg.vision.image_token_id)
        diff = (ours(input_ids, pixel_values=pixel_values, image_grid_thw=grid) - ref).abs().max().item()
        text_diff = (ours(input_ids) - hf_logits(hf, input_ids)).abs().max().item()  # no images: the text path
    print(f"{type(hf).__name__}: max |logit diff| with images {diff:.2e}, text only {text_diff:.2e}")
    assert diff <= 1e-4, diff
    assert text_diff <= 1e-4, text_diff


def test_gradients_match_transformers(tmp_path):
    """Training through the images: the tower's, the mergers' and the text model's gradients agree with transformers'."""
    from transformers import AutoModelForImageTextToText
    ours = random_model(DENSE_VL)
    ours.save_pretrained(tmp_path)
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    input_ids, pixel_values, grid = image_batch(DENSE_VL.vision, GRIDS)
    probe = torch.randn(*input_ids.shape, DENSE_VL.vocab_size, generator=torch.Generator().manual_seed(1))
    (ours(input_ids, pixel_values=pixel_values, image_grid_thw=grid) * probe).sum().backward()
    (hf_logits(hf, input_ids, pixel_values, grid, DENSE_VL.vision.image_token_id) * probe).sum().backward()
    theirs = dict(hf.named_parameters())
    names = ours_to_hf({n: p.grad for n, p in ours.named_parameters()}, DENSE_VL)
    assert {n for n, p in theirs.items() if p.grad is not None} == set(names)
    for name, g in names.items():  # fp32 sums over ~200 tokens x 512 logits: relative to the tensor's largest entry
        ref = theirs[name].grad
        assert (g - ref).abs().max() <= 1e-5 * ref.abs().max(), name


def test_checkpoint_layout_and_round_trip(tmp_path):
    m = random_model(MOE_VL)
    m.save_pretrained(tmp_path)
    sd = read_safetensors(tmp_path)
    E, D, H = MOE_VL.num_experts, MOE_VL.hidden_size, MOE_VL.moe_intermediate_size
    # the published Qwen3-VL-MoE layout (vLLM's loader transposes these): experts stacked as (E, in, out)
    assert sd["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (E, D, 2 * H)
    assert sd["model.language_model.layers.0.mlp.experts.down_proj"].shape == (E, H, D)
    assert "model.language_model.layers.1.mlp.gate_proj.weight" in sd  # mlp_only_layers: dense
    for name in ("model.visual.patch_embed.proj.weight", "model.visual.pos_embed.weight",
                 "model.visual.blocks.2.attn.qkv.bias", "model.visual.merger.linear_fc2.weight",
                 "model.visual.deepstack_merger_list.1.norm.weight", "model.language_model.embed_tokens.weight",
                 "lm_head.weight"):
        assert name in sd, name
    assert sd["model.visual.patch_embed.proj.weight"].shape == (64, 3, 2, 4, 4)
    m2 = Transformer.from_pretrained(tmp_path)
    assert m2.config == MOE_VL
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    # the weight sync's names: per-expert, under the same prefixes (vLLM's loader reads both)
    names = ours_to_hf(m.state_dict(), MOE_VL)
    assert names["model.language_model.layers.2.mlp.experts.7.down_proj.weight"].shape == (D, H)
    back = hf_to_ours(names, MOE_VL)
    assert all(torch.equal(back[n], t) for n, t in m.state_dict().items())


def test_activation_checkpointing_keeps_the_gradients():
    """With activation checkpointing the tower's blocks are recomputed in backward too: the same gradients."""
    input_ids, pixel_values, grid = image_batch(MOE_VL.vision, GRIDS)
    grads = []
    for checkpointing in (False, True):
        m = random_model(MOE_VL).train()
        m.activation_checkpointing = checkpointing
        m(input_ids, pixel_values=pixel_values, image_grid_thw=grid).square().mean().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and any(n.startswith("visual.blocks.") for n in grads[0])
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_routing_replay_with_images():
    """Routes recorded on a sequence with images, replayed after the routers moved: the recorded
    experts are used, not the ones the moved routers pick (which differ: the control)."""
    m = random_model(MOE_VL).eval()
    input_ids, pixel_values, grid = image_batch(MOE_VL.vision, GRIDS)
    kw = dict(pixel_values=pixel_values, image_grid_thw=grid)
    with torch.no_grad():
        h, routes = m.hidden_states(input_ids, return_routes=True, **kw)
        assert routes.shape == (*input_ids.shape, 2, 2)
        assert torch.equal(m.hidden_states(input_ids, routes, **kw), h)
        for layer in MOE_VL.moe_layers:
            gate = m.model.layers[layer].mlp.gate.weight
            gate.add_(torch.randn_like(gate))
        _, own = m.hidden_states(input_ids, return_routes=True, **kw)
        _, replayed = m.hidden_states(input_ids, routes, return_routes=True, **kw)
    assert not torch.equal(own, routes)
    assert torch.equal(replayed, routes)


def test_mrope_positions():
    vc = VisionConfig(image_token_id=9, spatial_merge_size=2)
    ids = torch.tensor([[1, 2, 9, 9, 9, 9, 9, 9, 3, 9, 9, 4]])  # text, an image of 2x3 tokens, text, 1x2, text
    pos = mrope_positions(ids, torch.tensor([[1, 4, 6], [1, 2, 4]]), vc)
    assert pos.tolist() == [[[0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 6, 8]],   # t
                            [[0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 6, 8]],   # h
                            [[0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8]]]   # w
    text = torch.tensor([[5, 6, 7]])
    assert torch.equal(mrope_positions(text, torch.zeros(0, 3, dtype=torch.long), vc), torch.arange(3).expand(3, 1, 3))


def test_image_token_count_mismatch_is_one_clear_error():
    m = random_model(DENSE_VL)
    input_ids, pixel_values, grid = image_batch(DENSE_VL.vision, [[(1, 4, 6)]])
    with pytest.raises(ValueError, match="input_ids hold 5 image tokens but the images .* make 6"):
        m(input_ids[:, :-7], pixel_values=pixel_values, image_grid_thw=grid)  # cut off the last image token


def test_config_round_trip_and_num_params():
    for cfg in (DENSE_VL, MOE_VL, TINY_VL_CONFIG):
        hf = json.loads(json.dumps(cfg.to_hf()))
        assert ModelConfig.from_hf(hf) == cfg
        assert num_params(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())
    # a published config.json's spelling: rope_theta and rope_scaling (not rope_parameters), vision model_type qwen3_vl
    hf = DENSE_VL.to_hf()
    rope = hf["text_config"].pop("rope_parameters")
    hf["text_config"].update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    assert ModelConfig.from_hf(hf) == DENSE_VL


def test_real_model_config():
    """configs/qwen3_vl_30b_a3b.py: Qwen3-VL-30B-A3B-Instruct's config.json fields."""
    cfg = {}
    exec(open(os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3_vl_30b_a3b.py")).read(), {}, cfg)
    mcfg = ModelConfig.from_hf(cfg["model_config"])
    assert mcfg.vision.depth == 27 and mcfg.num_experts == 128 and sum(mcfg.mrope_section) == mcfg.head_dim // 2
    # 30.5B text (3.3B active) + the 0.54B tower, which every image runs through
    assert 31.0e9 < num_params(mcfg) < 31.2e9 and 3.8e9 < num_params(mcfg, active=True) < 4.0e9


@pytest.fixture(scope="module")
def tiny_vl_path():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache")
    return ensure_tiny_model(os.path.join(root, "tiny-qwen3-vl-moe"))


def test_tiny_vlm_renders_processes_and_matches_transformers(tiny_vl_path):
    from PIL import Image, ImageDraw
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_vl_path)
    vc = TINY_VL_CONFIG.vision
    assert [tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")] == \
        [vc.vision_start_token_id, vc.vision_end_token_id, vc.image_token_id]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    messages = [  # OpenAI image_url and Anthropic-style image parts, in a user turn and in a tool result
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": [{"type": "text", "text": "Angle?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "zoom", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": [{"type": "image", "source": {"type": "base64", "data": "AAAA"}},
                                     {"type": "text", "text": "zoomed"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert f"<|im_start|>user\nAngle?{image}<|im_end|>" in text
    assert f"<tool_response>\n{image}zoomed\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_vl_path)  # needs no torchvision
    with open(os.path.join(tiny_vl_path, "processor_config.json")) as f:
        assert json.load(f)["processor_class"] == "Qwen3VLProcessor"
    images = [Image.new("RGB", (96, 64), (200, 30, 30)), Image.new("RGB", (301, 170), (30, 200, 30))]
    ImageDraw.Draw(images[1]).line([(0, 0), (300, 169)], fill="black", width=5)
    out = processor(images=images, return_tensors="pt")
    # the processor transformers picks: this one without torchvision, its torchvision twin beside it (what vLLM runs)
    auto = AutoImageProcessor.from_pretrained(tiny_vl_path)(images=images, return_tensors="pt")
    # resizing may round a pixel to the next 8-bit level: 2/255 after the [-1, 1] normalization
    torch.testing.assert_close(auto["pixel_values"], out["pixel_values"], atol=2 / 255 + 1e-6, rtol=0)
    assert out["image_grid_thw"].tolist() == [[1, 4, 6], [1, 10, 18]]
    n = (out["image_grid_thw"].prod(-1) // vc.spatial_merge_size ** 2).tolist()
    parts = text.split("<|image_pad|>")  # the image tokens expanded, as the capture server does
    ids = torch.tensor([tok("".join(p + "<|image_pad|>" * k for p, k in zip(parts, n + [0])))["input_ids"]])
    assert (ids == vc.image_token_id).sum() == sum(n)
    ours = Transformer.from_pretrained(tiny_vl_path).eval()
    assert ours.config == TINY_VL_CONFIG
    hf = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32).eval()
    with torch.no_grad():
        a = ours(ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        b = hf_logits(hf, ids, out["pixel_values"], out["image_grid_thw"], vc.image_token_id)
    assert (a - b).abs().max().item() <= 1e-4


def test_tiny_vlm_build_is_deterministic(tiny_vl_path, tmp_path):
    again = ensure_tiny_model(str(tmp_path / "tiny-qwen3-vl-moe"), TINY_VL_CONFIG)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
                 "preprocessor_config.json"):
        digest = [hashlib.sha256(open(os.path.join(p, name), "rb").read()).hexdigest() for p in (tiny_vl_path, again)]
        assert digest[0] == digest[1], name
