"""The hybrid Qwen3.5-MoE VLM on the real vLLM engine (CPU): a checkpoint written by transformers itself (not our
model code, in a shape the project never chose), served with its Gated DeltaNet state in fp32 and prefix caching in
vLLM's hybrid "align" mode.

    .venv/bin/python -m pytest tests/test_hybrid_engine.py -q       # one engine, ~3-4 min on 2 loaded cores
"""
import asyncio
import json
import os

import pytest
import torch

pytestmark = pytest.mark.stack  # every test here serves a real engine

import tiny

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]


def build_hf_hybrid(path, seed=0):
    """A tiny Qwen3_5MoeForConditionalGeneration saved by transformers 5.19 with the Qwen3.5 tokenizer and template
    (tiny.py) and Qwen3-VL's image processor: 5 layers in an irregular GDN / full pattern, 6 experts top-2, a shared
    expert, partial rotary 0.25 with interleaved M-RoPE, a 2-block tower. Head dims 64 (vLLM's CPU attention has
    no kernel for 32). Built once."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    tmp = f"{path}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    tok = tiny.build_tokenizer(tmp, 2048, vision=True, chat_template=tiny.QWEN35_CHAT_TEMPLATE)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    text = dict(vocab_size=2048, hidden_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
                moe_intermediate_size=96, shared_expert_intermediate_size=160, max_position_embeddings=4096,
                layer_types=LAYER_TYPES, eos_token_id=eos, pad_token_id=pad,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, image_token_id=5, video_token_id=6, vision_start_token_id=3,
        vision_end_token_id=4))  # tiny.VISION_TOKENS' ids
    model.to(torch.bfloat16).save_pretrained(tmp)
    tiny.save_image_processor(tmp, model.config.vision_config)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos, pad], "pad_token_id": pad}, f)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def fixed_sequence(n=48, seed=0):
    return torch.randint(7, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf_hybrid_path():
    return build_hf_hybrid(os.path.join(os.path.dirname(tiny.TINY_MODEL_PATH), "hf-qwen3_5-moe-tiny"))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop, hf_hybrid_path):
    from engine import Engine
    eng = Engine(hf_hybrid_path, max_model_len=2048, memory_fraction=0.3, seed=0)
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.shutdown())


def test_engine_runs_the_hybrid_cache_as_configured(engine):
    cache = engine.llm.vllm_config.cache_config
    assert cache.mamba_ssm_cache_dtype == "float32"  # the GDN state: bf16 would drift the rollout logprobs
    assert engine.engine_args["enable_prefix_caching"] and cache.mamba_cache_mode == "align"


def test_a_seeded_request_is_refused_and_the_engine_lives(loop, engine):
    """Align mode needs chunked prefill, over which vLLM's CPU runner cannot rewind a seeded generator (the engine
    core died on the first seeded 1500-token prompt): such a request gets one clear error instead."""
    with pytest.raises(ValueError, match="seed"):
        loop.run_until_complete(engine.generate(fixed_sequence(1500), dict(max_tokens=4, seed=1), "seeded"))
    out = loop.run_until_complete(engine.generate(fixed_sequence(1500), dict(max_tokens=4), "unseeded"))
    assert len(out["token_ids"]) == 4
