"""
The colour of a shape: the model sees a small picture drawn here with PIL, one filled shape
(circle, square or triangle, of a random size, place and shade) on a light background, and
answers which of four colours it is. The question is the same for every picture, so the
answer is only in the pixels: with the picture replaced by a blank one (train.py's
eval/success_blank) a policy can do no better than guess (0.25 on the balanced held-out set).

    python train.py --config configs/tiny_vl.py      # warm start (tiny.py: VL_WARM_START), then RL on this task

Reward 1.0 when the reply is exactly the colour's name (case, spaces and a final full stop
aside), else 0.0; Result.info["success"] is the same. Held out: a picture is drawn from a
seed, and a seed whose CRC-32 is divisible by 8 is never in the training stream (nor in
the warm start's transcripts); eval_prompts() draws 200 of them, 50 of each colour.
"""
import base64
import io
import random
import zlib

from openai import AsyncOpenAI

from agentrl import ChatAgent, Result

SIZE = 128  # pixels a side: 16 image tokens after Qwen3-VL's 2 x 2 merge (4 at 64: too few)
COLOURS = {"red": (210, 40, 40), "green": (40, 160, 50), "blue": (40, 70, 210),
           "yellow": (225, 200, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What colour is the shape? Answer red, green, blue or yellow."


def picture(seed, colour=None, size=SIZE):
    """(PIL image, colour name) of the size x size picture drawn from
    `seed`; `colour` fixes the colour, else the seed picks it."""
    from PIL import Image, ImageDraw
    rng = random.Random(seed)
    colour = colour or rng.choice(list(COLOURS))
    fill = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in COLOURS[colour])
    shade = rng.randint(225, 255)
    image = Image.new("RGB", (size, size), (shade, shade, shade))
    draw = ImageDraw.Draw(image)
    r = rng.randint(size // 5, size * 2 // 5)  # half the shape's width
    cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
    shape = rng.choice(SHAPES)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image, colour


def png_data_uri(image):
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user_turn(image):
    return {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_uri(image)}},
        {"type": "text", "text": QUESTION}]}


def held_out(seed):
    return zlib.crc32(f"colour:{seed}".encode()) % 8 == 0


def seeds(seed, split):
    """Endless picture seeds of one split ("train" or "eval")."""
    rng = random.Random(seed)
    while True:
        s = rng.randrange(2**31)
        if held_out(s) == (split == "eval"):
            yield s


def balanced(stream):
    """A prompt per picture seed of `stream`, the colours in
    turn (the shape, size, place and shades from the seed)."""
    for i, s in enumerate(stream):
        colour = list(COLOURS)[i % len(COLOURS)]
        yield {"messages": [user_turn(picture(s, colour)[0])], "label": colour}


def prompts(seed=0):
    """Endless pictures of the training split, the colours in turn: each batch
    holds about as many of each colour, so a policy that ignores the picture
    gets no net push towards one colour (only the pixels tell them apart)."""
    return balanced(seeds(seed, "train"))


def eval_prompts(n=200):
    """n held-out pictures in a fixed order, the colours in turn (balanced: a guess scores 0.25)."""
    return [p for p, _ in zip(balanced(seeds(10**6, "eval")), range(n))]


def transcripts(n, seed=1, size=SIZE):
    """The warm start's worked examples (train.py --sft_data): training-split pictures, each
    answered with a colour name drawn at random, whatever the picture. The warm-started model
    answers in the task's format (one colour word, then the end of its turn) but has no reason
    to look at the picture: which colour is which is what RL learns from the reward."""
    rng, names = random.Random(seed), list(COLOURS)
    return [{"messages": [user_turn(picture(s, size=size)[0]),
                          {"role": "assistant", "content": rng.choice(names)}]}
            for s, _ in zip(seeds(seed, "train"), range(n))]


def is_correct(reply, colour):
    return reply.strip().rstrip(".").strip().lower() == colour


class Colours(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            reply = (await client.chat.completions.create(model=ctx.model, messages=ctx.messages,
                                                          **ctx.sampling)).choices[0].message
        success = float(is_correct(reply.content or "", ctx.label))
        return Result(success, {"success": success})


agent = Colours()
