"""
The tiny models that the tests and the CPU runs use, built locally and deterministically
(no model hub on the machines we test on): a byte-level BPE tokenizer trained on generated
text, a Qwen3-style chat template with Hermes `<tool_call>` tool calls, and a random-init
Qwen3-MoE; the tiny VLM adds Qwen3-VL's vision tokens, image parts in the template, a
3-layer vision tower and its image processor. A directory is built once, then reused.

    python tiny.py                            # builds .cache/tiny-qwen3-moe if missing and prints it
    python tiny.py .cache/tiny-qwen3-vl-moe   # the tiny Qwen3-VL-MoE
    python tiny.py .cache/tiny-qwen36-moe     # the tiny Qwen3.6-style hybrid MoE VLM (Gated DeltaNet, MTP)
"""
import json
import os
import shutil
import sys
from dataclasses import replace

import torch

from model import ModelConfig, Transformer, VisionConfig, write_json

TINY_MODEL_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache",
                               "tiny-qwen3-moe")


TINY_CONFIG = ModelConfig(
    vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
    rope_theta=10000.0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    norm_topk_prob=True)

# The tiny VLM: the same text model with Qwen3-VL's M-RoPE, and a 3-layer
# vision tower. moe_intermediate_size is neither hidden_size nor half of it:
# transformers decides whether to transpose fused experts by their shape.
TINY_VL_CONFIG = replace(TINY_CONFIG, moe_intermediate_size=192, mrope_section=[12, 10, 10],
                         vision=VisionConfig(
    depth=3, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
    deepstack_visual_indexes=[0, 1],
    # VISION_TOKENS' ids
    vision_start_token_id=3, vision_end_token_id=4, image_token_id=5, video_token_id=6))
# The tiny Qwen3.6-style hybrid VLM (Qwen3_5MoeForConditionalGeneration): Gated DeltaNet
# and gated full attention in an irregular pattern, a shared expert, partial rotary (16
# of 64 dims) with interleaved M-RoPE, the tiny VLM's tower with 2 layers and without
# deepstack, one MTP layer. Head dims 64: vLLM's CPU attention has no kernel for 32.
TINY_QWEN36_CONFIG = ModelConfig(
    family="qwen3_5", vocab_size=2048, hidden_size=128, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rope_theta=10000.0,
    partial_rotary_factor=0.25, mrope_section=[3, 3, 2],
    layer_types=["linear_attention", "full_attention", "linear_attention",
                                          "linear_attention", "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
    shared_expert_intermediate_size=192, mtp_num_hidden_layers=1,
    vision=replace(TINY_VL_CONFIG.vision, depth=2,
                                            deepstack_visual_indexes=[]))
# The default model_path: the tiny Qwen3-MoE after a short supervised warm start on
# worked examples of the calculator task, which train.py builds with its own trainer
# and loss (ensure_warm_start) and rebuilds when WARM_START changes. It teaches the
# protocol (call the tool, copy the numbers in and the result out), not which operation
# a word names (agents/calculator.py: transcripts): that is what RL has to learn.
TINY_SFT = "tiny-qwen3-moe-sft"
WARM_START = dict(transcripts=8192, with_tools=0.25, from_memory=0.6, max_steps=200,
                  learning_rate=3e-3, min_lr=3e-4,
                  # train.py config keys, but the transcripts' options
                  warmup_steps=2, groups_per_batch=10, group_size=4, seed=0)
# The tiny VLM's warm start, the same way: worked examples of agents/colours.py (a
# picture, "What colour is the shape?", a colour word), answered at random. It
# teaches the format (one colour word, then the end of the turn), not which colour
# is which: reading the picture is what RL has to learn (configs/tiny_vl.py).
TINY_VL_SFT = "tiny-qwen3-vl-moe-sft"
VL_WARM_START = dict(transcripts=1600, size=128, max_steps=40, learning_rate=3e-3, min_lr=3e-4,
                     warmup_steps=2, groups_per_batch=10, group_size=4, seed=0)
# name: base model, agent file, recipe
WARM_STARTS = {TINY_SFT: ("tiny-qwen3-moe", "calculator.py", WARM_START),
               TINY_VL_SFT: ("tiny-qwen3-vl-moe", "colours.py", VL_WARM_START),
               # the hybrid's, the same way
               "tiny-qwen36-moe-sft": ("tiny-qwen36-moe", "colours.py", VL_WARM_START)}
# a recipe's options of its transcripts(); the other keys are train.py's
TRANSCRIPT_KEYS = ("transcripts", "with_tools", "from_memory", "size")
TINY_MODELS = {"tiny-qwen3-moe": TINY_CONFIG, "tiny-qwen3-vl-moe": TINY_VL_CONFIG,
               "tiny-qwen36-moe": TINY_QWEN36_CONFIG,
               TINY_SFT: TINY_CONFIG, TINY_VL_SFT: TINY_VL_CONFIG,
               "tiny-qwen36-moe-sft": TINY_QWEN36_CONFIG}


def tiny_model_config(path):
    """The config of the tiny model whose directory `path` names, however it is written
    (relative, absolute, trailing /), or None: the run builds it there when it is missing."""
    head, name = os.path.split(os.path.abspath(path))
    return TINY_MODELS.get(name) if os.path.basename(head) == ".cache" else None


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# special, as in Qwen3-VL
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# like Qwen3, tool-call and reasoning tags are single added (non-special) tokens: decode keeps them
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                "</think>"]

# Qwen3-style chat template (tiny_qwen3.jinja): tools in the system turn, Hermes
# <tool_call> JSON in assistant turns, tool results as <tool_response> inside a user
# turn, and (as Qwen3 does) reasoning dropped from turns before the last query.
CHAT_TEMPLATE = open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                  "tiny_qwen3.jinja")).read().strip()


# The VLM's template: the same, with each message's content rendered as Qwen3-VL does
# (text parts, and an image part as <|vision_start|><|image_pad|><|vision_end|>,
# which the processor expands to the image's tokens).
VL_CHAT_TEMPLATE = (
    "{%- macro render(content) %}{%- if content is string %}{{- content }}{%- elif content %}{%- "
    "for part in content %}{%- if 'image' in part or 'image_url' in part or part.type == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif 'text' in part %}{{- part.text "
    "}}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}\n") + CHAT_TEMPLATE.replace(
    "messages[0].content", "render(messages[0].content)").replace(
    "message.content is string and not(message.content.startswith(",
    "not(render(message.content).startswith(").replace(
    "message.content if message.content is string else ''", "render(message.content)")


# The Qwen3.5 / Qwen3.6 conversation format (the tiny hybrid's template, tiny_qwen35.jinja), written
# from the published checkpoints' template behaviour: tools as JSON lines in the system turn; tool
# calls in XML, `<tool_call>\n<function=
# NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>` (arguments a mapping: a
# string value as it is, others as JSON); reasoning on by default (the generation prompt opens
# `<think>\n`; `enable_thinking=False` closes it empty); an assistant turn after the last user query
# shows its reasoning, earlier ones drop it (a rewrite of earlier turns: the capture server seals
# the segment there); tool results in a user turn as <tool_response>; image parts as in Qwen3-VL.
QWEN35_CHAT_TEMPLATE = open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "tiny_qwen35.jinja")).read().strip()


def tiny_corpus(n=4000, seed=0):
    """Deterministic text for the tokenizer: digits, arithmetic, JSON tool calls, chat markup."""
    import random
    rng = random.Random(seed)
    words = ("the of and to in is you that it he was for on are as with his they at be this have "
             "from or one had by word but not what all were we when your can said there use an "
             "each which she do how their if will up other about out many then them these so some "
             "her would make like him into time has look two more write go see number no way could "
             "people my than first water been call who oil its now find answer add sum result tool "
             "function name arguments calculator compute question user assistant system "
             "think final please what is plus minus times equals value expression").split()
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        lines.append(f"{sentence.capitalize()}. What is {a} {op} {b}? The answer is "
                     f"{eval(f'{a}{op}{b}')}.")
        lines.append('{"name": "calculator", "arguments": {"expression": "%d %s %d"}}' % (a, op, b))
        lines.append(f"Final answer: {rng.randint(0, 99999)}")
    return lines


def build_tokenizer(path, vocab_size, vision=False, chat_template=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, AddedToken
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = SPECIAL_TOKENS + (VISION_TOKENS if vision else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(ADDED_TOKENS), special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok.save(os.path.join(path, "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
               "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
               "chat_template": chat_template or (VL_CHAT_TEMPLATE if vision else CHAT_TEMPLATE)}
    write_json(os.path.join(path, "tokenizer_config.json"), tok_cfg)
    write_json(os.path.join(path, "special_tokens_map.json"),
               {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    return tok


def ensure_tiny_model(path=TINY_MODEL_PATH, cfg=None, seed=0):
    """Build the tiny model directory once (a few seconds); later calls
    return at once. Returns the path. cfg None: the tiny model the
    directory's name says (TINY_MODELS), else the tiny Qwen3-MoE."""
    if os.path.basename(os.path.abspath(path)) in WARM_STARTS:
        return ensure_warm_start(path)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    cfg = cfg or tiny_model_config(path) or TINY_CONFIG
    tmp = f"{path}.tmp{os.getpid()}"  # build aside, then rename: concurrent
                                      # builders never see a half model
    os.makedirs(tmp, exist_ok=True)
    # the hybrid: the Qwen3.5 format
    tok = build_tokenizer(tmp, cfg.vocab_size, vision=cfg.vision is not None,
                          chat_template=QWEN35_CHAT_TEMPLATE
                          if getattr(cfg, "family", None) == "qwen3_5" else None)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    if cfg.vision is not None:
        save_image_processor(tmp, cfg.vision)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights(seed)
    model.save_pretrained(tmp, dtype=torch.bfloat16)  # what the engine runs; the trainer upcasts
    config = os.path.join(tmp, "config.json")
    write_json(config, dict(json.load(open(config)), eos_token_id=eos, pad_token_id=pad,
                            bos_token_id=None))
    write_json(os.path.join(tmp, "generation_config.json"),
               {"eos_token_id": [eos, pad], "pad_token_id": pad})
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_warm_start(path):
    """A warm-started tiny model (WARM_STARTS: the default TINY_SFT, the VLM's
    TINY_VL_SFT), built once and again when its recipe changes: the random-init
    tiny model after `python train.py --sft_data=FILE`, a supervised run on worked
    examples of its task (the agent file's transcripts()). Returns the path."""
    import runpy
    import subprocess
    path, root = os.path.abspath(path), os.path.dirname(os.path.abspath(__file__))
    base_name, agent_file, warm_start = WARM_STARTS[os.path.basename(path)]
    if os.path.isfile(recipe := os.path.join(path, "warm_start.json")) and json.load(open(recipe)) == warm_start:
        return path
    base, work = ensure_tiny_model(os.path.join(os.path.dirname(path), base_name)), path + ".build"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    data = os.path.join(work, "transcripts.jsonl")
    options = {k: v for k, v in warm_start.items() if k in TRANSCRIPT_KEYS and k != "transcripts"}
    rows = runpy.run_path(os.path.join(root, "agents", agent_file))["transcripts"](
        warm_start["transcripts"], seed=1, **options)
    with open(data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"building {path}: the tiny model's warm start, {warm_start}", flush=True)
    keys = [f"--{k}={v}" for k, v in warm_start.items() if k not in TRANSCRIPT_KEYS]
    # a run of its own, one rank, before any engine starts:
    # every core (make train's one thread is for RL's sharing)
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")
    subprocess.run([sys.executable, os.path.join(root, "train.py"), f"--model_path={base}",
                    f"--sft_data={data}", f"--out_dir={work}", "--checkpoint_every=1000000", *keys],
                    check=True,
                   env={k: v for k, v in os.environ.items() if k not in rendezvous})
    # read back with json.load: any indent
    write_json(os.path.join(work, "hf", "warm_start.json"), warm_start)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(os.path.join(work, "hf"), path)
    return path


def save_image_processor(path, vc, min_pixels=32 * 32, max_pixels=448 * 448):
    """Qwen3-VL's image processor settings for the tower vc, in the files vLLM and transformers
    read. The PIL processor needs no torchvision; it resizes each image to a multiple of
    patch_size * merge_size within [min_pixels, max_pixels] and normalizes to [-1, 1]."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    Qwen2VLImageProcessorPil(patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
                             merge_size=vc.spatial_merge_size, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3, min_pixels=min_pixels,
                             max_pixels=max_pixels).save_pretrained(path)
    write_json(os.path.join(path, "processor_config.json"), {"processor_class": "Qwen3VLProcessor"})


if __name__ == "__main__":
    p = ensure_tiny_model(sys.argv[1] if len(sys.argv) > 1 else TINY_MODEL_PATH)
    m = Transformer.from_pretrained(p)
    print(f"{p}: {sum(t.numel() for t in m.parameters()) / 1e6:.2f}M parameters, {m.config}")
