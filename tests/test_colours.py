"""agents/colours.py on its own (configs/tiny_vl.py's task): the colour is in the pixels and only there, the training
stream and the held-out set never share a picture, both are balanced, and the blank ablation keeps each picture's
size (so its tokens) with nothing to read. The trainer's images lining up with their tokens is
tests/test_capture_vl.py's test_trainer_images_line_up_with_their_tokens.

    .venv/bin/python -m pytest tests/test_colours.py -q
"""
import base64
import io
import os
import sys
from itertools import islice

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "agents"))
import colours  # noqa: E402
import vl  # noqa: E402


def image_of(prompt):
    uri = prompt["messages"][0]["content"][0]["image_url"]["url"]
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")


def read_colour(image):
    """The nearest colour name to the mean of the pixels that are not the light grey background."""
    pixels = np.asarray(image, dtype=float).reshape(-1, 3)
    shape = pixels[pixels.max(1) - pixels.min(1) > 40]  # the background is grey: its channels agree
    mean = shape.mean(0)
    return min(colours.COLOURS, key=lambda name: np.abs(np.array(colours.COLOURS[name]) - mean).sum())


def test_the_answer_is_in_the_pixels_and_only_there():
    train = list(islice(colours.prompts(seed=5), 80))
    assert all(read_colour(image_of(p)) == p["label"] for p in train)
    assert all(p["messages"][0]["content"][1]["text"] == colours.QUESTION for p in train)  # no hint in the words
    # negative controls: the reader is not a constant that a run of one label would satisfy (it
    # names all four colours), and with the pictures blanked (the words kept) no coloured pixel is
    # left to read
    assert {read_colour(image_of(p)) for p in train} == set(colours.COLOURS)
    coloured = [(np.ptp(np.asarray(image_of(p), dtype=int), -1) > 40).sum()
                for p in (train[0], vl.blank_images(train[0]))]
    assert coloured[0] > 100 and coloured[1] == 0


def test_train_and_held_out_are_balanced_and_disjoint():
    train = list(islice(colours.prompts(seed=0), 2000))
    held = colours.eval_prompts()
    for rows in (train, held):
        labels = [p["label"] for p in rows]
        assert all(sorted(labels[i:i + 4]) == sorted(colours.COLOURS) for i in range(0, len(labels) - 3, 4))
    assert held == colours.eval_prompts() and len(held) == 200
    uri = lambda p: p["messages"][0]["content"][0]["image_url"]["url"]  # noqa: E731
    assert not {uri(p) for p in train} & {uri(p) for p in held}
    assert len({uri(p) for p in train}) == len(train)  # new drawings, not repeats
    picks = list(islice(colours.seeds(0, "train"), 2000)) + list(islice(colours.seeds(0, "eval"), 200))
    assert [colours.held_out(s) for s in picks] == [False] * 2000 + [True] * 200


def test_blank_ablation_keeps_the_size_and_the_words_and_drops_the_pixels():
    prompt = colours.eval_prompts(4)[2]
    blank = vl.blank_images(prompt)
    assert image_of(blank).size == image_of(prompt).size == (colours.SIZE, colours.SIZE)
    assert np.asarray(image_of(blank)).min() == 255 and np.asarray(image_of(prompt)).min() < 200
    assert blank["label"] == prompt["label"] and blank["messages"][0]["content"][1] == prompt["messages"][0]["content"][1]


def test_the_warm_start_is_given_the_format_not_the_answers():
    rows = colours.transcripts(400)
    answers = [r["messages"][1]["content"] for r in rows]
    assert set(answers) == set(colours.COLOURS)
    right = np.mean([read_colour(image_of(r)) == a for r, a in zip(rows, answers)])
    assert 0.18 < right < 0.32  # chance is 0.25


def test_exact_answer():
    assert colours.is_correct(" Red.", "red") and colours.is_correct("yellow", "yellow")
    assert not colours.is_correct("red or blue", "red") and not colours.is_correct("green", "blue")
