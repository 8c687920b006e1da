"""
Geometry over images: the model sees a diagram drawn here with PIL and answers a question about
it, with the calculator tool (agents/calculator.py's) for the arithmetic. In the spirit of geo3k.

    python train.py --config configs/tiny_vl.py                                     # generated diagrams (default)
    python train.py --config configs/tiny_vl.py --prompts=geometry3k_train.parquet   # geo3k's layout

Each diagram is one of: a right triangle with its legs labelled (the hypotenuse?), a
triangle with two angles labelled (the third?), a rectangle with its sides labelled (area or
perimeter?), a circle with its radius drawn and labelled (the diameter?), a straight line
split by a ray with one angle labelled (the other?), a triangle with its base and height
drawn and labelled (its area?). The numbers are the drawing's: the figure is drawn to scale
from them and the answer is computed from the drawn coordinates, so picture and label agree.

The conversation: the user turn holds the image (an OpenAI `image_url` part, a PNG data URI)
and the question; when the model's reply is a valid calculator call the agent runs it and sends
the result as a `tool` message, up to MAX_TOOL_CALLS times; the first reply without one is the
final answer. Reward 1.0 when the final answer's last number equals the answer exactly (a geo3k
answer that is not a number: the reply's last line equals it, spaces aside), else 0.0;
Result.info["success"] is the same, and "tool_calls" counts the calls (logged, not paid for).

`--prompts=FILE.parquet` reads geo3k's layout (hiyouga/geometry3k):
`images` (a list of {bytes, path} structs, or of bytes), `problem`
(its text, `<image>` where each image goes), `answer` (a string).
"""
import base64
import io
import math
import random
import re
import zlib

from openai import AsyncOpenAI

from agentrl import ChatAgent, Result
from calculator import TOOLS, calculator, expression_of

SIZE = 448  # pixels a side: 28 x 28 patches of 16 (196 image
            # tokens after the 2 x 2 merge) for Qwen3-VL
MAX_TOOL_CALLS = 2
KINDS = ("hypotenuse", "third_angle", "rectangle_area", "rectangle_perimeter", "diameter",
         "supplement", "triangle_area")

# -----------------------------------------------------------------------------
# drawing


def canvas():
    from PIL import Image, ImageDraw
    image = Image.new("RGB", (SIZE, SIZE), "white")
    return image, ImageDraw.Draw(image)


def label(draw, xy, text):
    from PIL import ImageFont
    font = ImageFont.load_default(size=SIZE // 18)
    draw.text(xy, text, fill="black", font=font, anchor="mm")


def fit(points, margin=0.15):
    """Scale and shift points (any units) into the canvas,
    keeping proportions; returns pixel points and the scale."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    scale = SIZE * (1 - 2 * margin) / max(max(xs) - min(xs), max(ys) - min(ys))
    ox = (SIZE - scale * (max(xs) - min(xs))) / 2 - scale * min(xs)
    # y up in the figure, down in the image
    oy = (SIZE + scale * (max(ys) - min(ys))) / 2 + scale * min(ys)
    return [(ox + scale * x, oy - scale * y) for x, y in points], scale


def midpoint_out(a, b, centre, by=SIZE / 20):
    """The midpoint of segment ab pushed away from `centre`: where a side's label goes."""
    mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
    dx, dy = mx - centre[0], my - centre[1]
    n = math.hypot(dx, dy) or 1.0
    return mx + by * dx / n, my + by * dy / n


def angle_at(p, q, r):
    """The angle pqr in degrees, from the drawn coordinates."""
    a = math.atan2(p[1] - q[1], p[0] - q[0]) - math.atan2(r[1] - q[1], r[0] - q[0])
    a = abs(math.degrees(a)) % 360
    return min(a, 360 - a)


def polygon(draw, pts):
    draw.polygon(pts, outline="black", width=3)


def scene(kind, rng):
    """(PIL image, question, answer as an int) for one diagram of `kind`."""
    image, draw = canvas()
    if kind == "hypotenuse":
        a, b, c = rng.choice([(3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29)])
        k = rng.randint(1, 3)
        pts, s = fit([(0, 0), (k * a, 0), (0, k * b)])
        polygon(draw, pts)
        draw.rectangle([pts[0][0], pts[0][1] - 16, pts[0][0] + 16, pts[0][1]], outline="black",
                       width=2)
        centre = tuple(sum(p[i] for p in pts) / 3 for i in range(2))
        label(draw, midpoint_out(pts[0], pts[1], centre), str(k * a))
        label(draw, midpoint_out(pts[0], pts[2], centre), str(k * b))
        label(draw, midpoint_out(pts[1], pts[2], centre), "x")
        answer = round(math.dist(pts[1], pts[2]) / s)
        return image, "The triangle has a right angle. Find x, the length of the side opposite it.", answer
    if kind in ("third_angle", "triangle_area"):
        A, B = rng.randint(30, 80), rng.randint(30, 80)
        base = rng.randint(4, 12) * 2
        apex_x = base * math.tan(math.radians(B)) / (math.tan(math.radians(A))
                                                     + math.tan(math.radians(B)))
        apex = (apex_x, apex_x * math.tan(math.radians(A)))
        if kind == "triangle_area":  # a whole-number height, drawn with its foot
            apex = (apex[0], float(max(2, round(apex[1]))))
        pts, s = fit([(0, 0), (base, 0), apex])
        polygon(draw, pts)
        centre = tuple(sum(p[i] for p in pts) / 3 for i in range(2))
        if kind == "third_angle":
            a, b = round(angle_at(pts[2], pts[0], pts[1])), round(angle_at(pts[2], pts[1], pts[0]))
            label(draw, (pts[0][0] + 40, pts[0][1] - 18), f"{a}°")
            label(draw, (pts[1][0] - 40, pts[1][1] - 18), f"{b}°")
            label(draw, (pts[2][0], pts[2][1] + 34), "x")
            return image, "Two angles of the triangle are marked. Find x, the third angle, in degrees.", 180 - a - b
        foot = (pts[2][0], pts[0][1])
        draw.line([pts[2], foot], fill="black", width=2)
        label(draw, ((pts[0][0] + pts[1][0]) / 2, pts[0][1] + 22),
              str(round(math.dist(pts[0], pts[1]) / s)))
        label(draw, (foot[0] + 22, (foot[1] + pts[2][1]) / 2),
              str(round(math.dist(foot, pts[2]) / s)))
        area = round(math.dist(pts[0], pts[1]) / s) * round(math.dist(foot, pts[2]) / s) // 2
        return image, "The base of the triangle and its height are marked. Find its area.", area
    if kind.startswith("rectangle"):
        w, h = rng.randint(2, 15), rng.randint(2, 15)
        pts, s = fit([(0, 0), (w, 0), (w, h), (0, h)])
        polygon(draw, pts)
        centre = tuple(sum(p[i] for p in pts) / 4 for i in range(2))
        W, H = round(math.dist(pts[0], pts[1]) / s), round(math.dist(pts[1], pts[2]) / s)
        label(draw, midpoint_out(pts[0], pts[1], centre), str(W))
        label(draw, midpoint_out(pts[1], pts[2], centre), str(H))
        if kind == "rectangle_area":
            return image, "Find the area of the rectangle.", W * H
        return image, "Find the perimeter of the rectangle.", 2 * (W + H)
    if kind == "diameter":
        r = rng.randint(2, 30)
        (c, e), s = fit([(-r, -r), (r, r)])  # the circle's bounding box
        draw.ellipse([c[0], e[1], e[0], c[1]], outline="black", width=3)
        centre = ((c[0] + e[0]) / 2, (c[1] + e[1]) / 2)
        theta = rng.uniform(0, 2 * math.pi)
        rim = (centre[0] + (e[0] - centre[0]) * math.cos(theta), centre[1]
               + (e[0] - centre[0]) * math.sin(theta))
        draw.line([centre, rim], fill="black", width=2)
        draw.ellipse([centre[0] - 4, centre[1] - 4, centre[0] + 4, centre[1] + 4], fill="black")
        # beside the radius, not on it
        mid, side = ((centre[0] + rim[0]) / 2, (centre[1] + rim[1]) / 2), SIZE / 24
        label(draw, (mid[0] - side * math.sin(theta), mid[1] + side * math.cos(theta)), str(r))
        return image, "The circle's radius is marked. Find its diameter.", round(
            2 * math.dist(centre, rim) / s)
    if kind == "supplement":
        a = rng.randint(20, 160)
        left, right = (SIZE * 0.1, SIZE * 0.6), (SIZE * 0.9, SIZE * 0.6)
        o = (SIZE / 2, SIZE * 0.6)
        ray = (o[0] + SIZE * 0.35 * math.cos(math.radians(a)),
               o[1] - SIZE * 0.35 * math.sin(math.radians(a)))
        draw.line([left, right], fill="black", width=3)
        draw.line([o, ray], fill="black", width=3)
        drawn = round(angle_at(ray, o, right))
        label(draw, (o[0] + 60 * math.cos(math.radians(drawn / 2)),
                     o[1] - 60 * math.sin(math.radians(drawn / 2))),
              f"{drawn}°")
        mid = math.radians((180 + drawn) / 2)
        label(draw, (o[0] + 60 * math.cos(mid), o[1] - 60 * math.sin(mid)), "x")
        return image, "A ray stands on a straight line. Find x in degrees.", 180 - drawn
    raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


def png_data_uri(image):
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user_turn(text, images):
    """An OpenAI user message: the images (data URIs), then the question."""
    parts = [{"type": "image_url", "image_url": {"url": uri}} for uri in images]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}

# -----------------------------------------------------------------------------
# prompts


def held_out(kind, seed):
    return zlib.crc32(f"{kind}:{seed}".encode()) % 8 == 0


def generated(seed, split):
    rng = random.Random(seed)
    while True:
        kind, scene_seed = rng.choice(KINDS), rng.randrange(2**31)
        if held_out(kind, scene_seed) == (split == "eval"):
            image, question, answer = scene(kind, random.Random(scene_seed))
            yield {"messages": [user_turn(question, [png_data_uri(image)])], "label": str(answer),
                   "kind": kind}


def prompts(seed=0):
    """Endless generated diagrams of the training split."""
    return generated(seed, "train")


def eval_prompts(n=64):
    """The held-out diagrams evaluation runs: n of them,
    in a fixed order (no scene of the training split)."""
    return [p for p, _ in zip(generated(10**6, "eval"), range(n))]


def prompt_from_row(row):
    """A geo3k row (images, problem with <image> marks, answer) -> a prompt
    row; rows in our own layout (messages or prompt) pass through."""
    if "messages" in row or "prompt" in row:
        return row
    images = [im["bytes"] if isinstance(im, dict) else im for im in row.get("images") or []]
    if not images or not all(isinstance(b, bytes) for b in images):
        raise ValueError("a geo3k row needs `images`: a list of image files (bytes, or {bytes, "
                         "path} structs)")
    uris = ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]
    return {"messages": [user_turn(row["problem"].replace("<image>", "").strip(), uris)],
            "label": str(row["answer"])}

# -----------------------------------------------------------------------------
# the agent


def is_correct(reply, answer):
    """Exact final answer: a numeric answer is the reply's last
    number; another (3\\sqrt{3}) the reply's last line."""
    answer = answer.strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", reply)
        return bool(numbers) and float(numbers[-1]) == float(answer)
    lines = [line for line in reply.strip().splitlines() if line.strip()]
    return bool(lines) and re.sub(r"\s", "", lines[-1]) == re.sub(r"\s", "", answer)


class Geometry(ChatAgent):
    async def run(self, ctx):
        messages = [dict(m) for m in ctx.messages]
        calls = 0
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            while True:
                reply = (await client.chat.completions.create(model=ctx.model, messages=messages,
                                                              tools=TOOLS,
                                                              **ctx.sampling)).choices[0].message
                expression, call_id = expression_of(reply)
                if expression is None or calls == MAX_TOOL_CALLS:
                    break
                calls += 1
                # the reply goes back exactly as received, so the
                # capture server sees the conversation extend
                messages += [reply.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call_id,
                              "content": calculator(expression)}]
        success = float(is_correct(reply.content or "", str(ctx.label)))
        return Result(success, {"success": success, "tool_calls": float(calls)})


agent = Geometry()
