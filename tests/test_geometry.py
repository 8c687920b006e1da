"""agents/geometry.py on its own: the diagrams, the geo3k file layout, the exact-answer reward, the multi-turn loop
with the calculator (a scripted OpenAI client stands in for the server; the real one runs in the end-to-end test).

    .venv/bin/python -m pytest tests/test_geometry.py -q
"""
import asyncio
import base64
import io
import os
import random
import sys

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agents"))
import geometry  # noqa: E402
from agentrl import Context, read_prompts  # noqa: E402


def decode(uri):
    assert uri.startswith("data:image/png;base64,")
    return base64.b64decode(uri.split(",", 1)[1])


@pytest.mark.parametrize("kind", geometry.KINDS)
def test_every_kind_draws_a_deterministic_diagram_with_a_consistent_answer(kind):
    answers = []
    for seed in range(40):
        image, question, answer = geometry.scene(kind, random.Random(seed))
        again = geometry.scene(kind, random.Random(seed))
        assert geometry.png_data_uri(image) == geometry.png_data_uri(again[0]) and answer == again[2]
        pixels = np.asarray(image.convert("L"))
        assert image.size == (geometry.SIZE, geometry.SIZE) and (pixels < 128).mean() > 0.002  # something drawn
        assert isinstance(answer, int) and answer > 0 and question.endswith(".")
        answers.append(answer)
    assert len(set(answers)) > 5  # the scenes vary
    if kind == "hypotenuse":  # k * (3,4,5), (5,12,13), ...: the hypotenuse of a drawn right triangle
        assert all(any(a % c == 0 and a // c <= 3 for c in (5, 13, 17, 25, 29)) for a in answers)
    if kind in ("third_angle", "supplement"):
        assert all(0 < a < 180 for a in answers)
    if kind in ("diameter", "rectangle_perimeter"):
        assert all(a % 2 == 0 for a in answers)


@pytest.mark.parametrize("seed", range(12))
def test_drawn_angles_match_the_labels(monkeypatch, seed):
    """third_angle: each label is the angle drawn at its vertex to the degree, and the answer is the
    angle drawn at the third vertex (within the two labels' rounding), measured here from the drawn
    corners by the law of cosines."""
    drawn, labels = [], []
    monkeypatch.setattr(geometry, "polygon", lambda draw, pts: drawn.append(pts))
    monkeypatch.setattr(geometry, "label", lambda draw, xy, text: labels.append(text))
    _, _, answer = geometry.scene("third_angle", random.Random(seed))
    (pts,) = drawn
    a, b, c = (np.hypot(*np.subtract(pts[(i + 1) % 3], pts[(i + 2) % 3])) for i in range(3))
    cosines = [(b * b + c * c - a * a) / (2 * b * c), (a * a + c * c - b * b) / (2 * a * c),
               (a * a + b * b - c * c) / (2 * a * b)]  # at each vertex
    angles = np.degrees(np.arccos(cosines))
    assert labels == [f"{round(angles[0])}°", f"{round(angles[1])}°", "x"]
    assert abs(answer - angles[2]) <= 1.0


def test_prompts_hold_the_image_and_split_train_from_eval():
    first = next(geometry.prompts(seed=3))
    (msg,) = first["messages"]
    image_part, text_part = msg["content"]
    assert image_part["type"] == "image_url" and text_part["type"] == "text"
    assert Image.open(io.BytesIO(decode(image_part["image_url"]["url"]))).size == (geometry.SIZE, geometry.SIZE)
    held = geometry.eval_prompts(n=8)
    assert len(held) == 8 and held == geometry.eval_prompts(n=8)
    train_uris = {p["messages"][0]["content"][0]["image_url"]["url"] for _, p in zip(range(60), geometry.prompts(0))}
    assert not train_uris & {p["messages"][0]["content"][0]["image_url"]["url"] for p in held}


def test_geo3k_parquet_layout_reads_into_prompts(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")  # Parquet's reader is an extra (requirements-extras.txt)
    import pyarrow as pa
    files = []
    for color in ("red", "green"):
        buf = io.BytesIO()
        Image.new("RGB", (40, 30), color).save(buf, format="PNG")
        files.append(buf.getvalue())
    table = pa.table({"images": [[{"bytes": files[0], "path": "0.png"}], [{"bytes": files[1], "path": "1.png"}]],
                      "problem": ["<image>Find x.", "<image>Find the area of the figure."],
                      "answer": ["3", "12\\sqrt{3}"]})
    path = str(tmp_path / "geometry3k.parquet")
    pq.write_table(table, path)
    rows = read_prompts(path, row_map=geometry.prompt_from_row)
    got = {r["label"]: r for r in (next(rows), next(rows))}
    assert set(got) == {"3", "12\\sqrt{3}"}
    content = got["3"]["messages"][0]["content"]
    assert decode(content[0]["image_url"]["url"]) == files[0] and content[1] == {"type": "text", "text": "Find x."}
    bad = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"images": [[]], "problem": ["Find x."], "answer": ["1"]}), bad)
    with pytest.raises(ValueError, match="geo3k row needs `images`"):
        read_prompts(bad, row_map=geometry.prompt_from_row)


def test_exact_final_answer():
    assert geometry.is_correct("The hypotenuse is 3 * 5 = 15", "15")
    assert not geometry.is_correct("15 or 16", "15")
    assert not geometry.is_correct("about 15.5", "15")
    assert geometry.is_correct("so\nx = 12 \\sqrt{3}", "x=12\\sqrt{3}")
    assert not geometry.is_correct("", "15")


class ScriptedClient:
    """Stands in for AsyncOpenAI in this unit test: replies from a script, records what it was sent."""

    def __init__(self, replies, sent):
        from openai.types.chat import ChatCompletionMessage
        self.replies = [ChatCompletionMessage(role="assistant", **r) for r in replies]
        self.sent = sent
        self.chat = self
        self.completions = self

    async def create(self, messages, **kwargs):
        from types import SimpleNamespace
        self.sent.append([dict(m) for m in messages])
        return SimpleNamespace(choices=[SimpleNamespace(message=self.replies.pop(0))])

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


@pytest.mark.parametrize("replies,reward,calls", [
    ([dict(content=None, tool_calls=[dict(id="c1", type="function",
                                         function=dict(name="calculator", arguments='{"expression": "2 * (7 + 5)"}'))]),
      dict(content="The perimeter is 24")], 1.0, 1),
    ([dict(content="It is 25")], 0.0, 0),
])
def test_agent_calls_the_calculator_then_answers(monkeypatch, replies, reward, calls):
    sent = []
    monkeypatch.setattr(geometry, "AsyncOpenAI", lambda **kw: ScriptedClient(replies, sent))
    item = {"messages": [geometry.user_turn("Find the perimeter of the rectangle.", ["data:image/png;base64,AAAA"])],
            "label": "24"}
    ctx = Context(base_url="http://x/v1", api_key="k", model="policy", messages=item["messages"], label=item["label"],
                  sampling=dict(temperature=1.0, max_tokens=32))
    result = asyncio.run(geometry.agent.run(ctx))
    assert result.reward == reward and result.info["tool_calls"] == calls
    assert sent[0][0]["content"][0]["image_url"]["url"] == "data:image/png;base64,AAAA"  # the image goes to the model
    if calls:
        assert sent[1][-1] == {"role": "tool", "tool_call_id": "c1", "content": "24"}
