"""The embedded SFT set (``data.source=synthetic``): deterministic, long-tailed, learnable on a CPU.

Record ``i`` depends only on ``(seed, i, max_length)``, so any worker can generate any range.
Tasks: copy, reverse, sort, arithmetic and key-value recall, each as a prompt/completion
record or a chat record (one in two). The payload size is drawn from a log-normal (median
~70 tokens), and 2% of records are long documents of 30-120% of ``max_length``; every record
is shrunk until its THD length, in byte-tokenizer tokens, is at most ``max_length``. So most
samples are tens to a couple of hundred tokens and a thin tail reaches the cap (several
thousand bytes when the pack is large).

Example (seed 0): ``{"prompt": "reverse: kqzt\\n", "completion": "tzqk"}`` or
``{"messages": [{"role": "user", "content": "sort: 7 2 9\\n"}, {"role": "assistant", "content": "2 7 9"}]}``.
"""

from __future__ import annotations

import math
import random
import string

TASKS = ("copy", "reverse", "sort", "add", "recall")
GENERATOR_VERSION = 2
_LETTERS = string.ascii_lowercase


_TO_LETTER = bytes(ord(_LETTERS[b % 26]) for b in range(256))
_TO_DIGIT = bytes(ord(str(b % 10)) for b in range(256))


def _random_text(rng: random.Random, n: int, table: bytes) -> str:
    """``n`` random characters through a byte table (one getrandbits call, not n)."""
    return rng.getrandbits(8 * n).to_bytes(n, "little").translate(table).decode("ascii") if n else ""


def _task(rng: random.Random, task: str, size: int) -> tuple[str, str]:
    """(prompt, completion) of about ``size`` payload bytes."""
    if task == "copy":
        s = _random_text(rng, max(1, size // 2), _TO_LETTER)
        return f"copy: {s}\n", s
    if task == "reverse":
        s = _random_text(rng, max(1, size // 2), _TO_LETTER)
        return f"reverse: {s}\n", s[::-1]
    if task == "sort":
        xs = _random_text(rng, max(2, size // 4), _TO_DIGIT)
        return f"sort: {' '.join(xs)}\n", " ".join(sorted(xs))
    if task == "add":
        digits = max(1, min(size // 6, 12))
        a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
        return f"add: {a}+{b}=", str(a + b)
    num_pairs = max(1, size // 9)
    keys = rng.sample(range(10 * num_pairs + 10), num_pairs)
    letters = _random_text(rng, 3 * num_pairs, _TO_LETTER)
    values = [letters[3 * i:3 * i + 3] for i in range(num_pairs)]
    pick = rng.randrange(num_pairs)
    table = "; ".join(f"k{k}={v}" for k, v in zip(keys, values))
    return f"recall: {table}\nk{keys[pick]}?", values[pick]


def _byte_thd_length(record: dict) -> int:
    """THD length under the byte tokenizer: ids minus one (bos, role markers and eos included)."""
    if "messages" in record:
        return sum(len(m["content"].encode()) + 2 for m in record["messages"])
    return len(record["prompt"].encode()) + len(record["completion"].encode()) + 1


def _record(task: str, prompt: str, completion: str, chat: bool, system: bool) -> dict:
    if not chat:
        return {"prompt": prompt, "completion": completion, "task": task}
    messages = [{"role": "system", "content": "Answer exactly."}] if system else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    return {"messages": messages, "task": task}


def synthetic_record(seed: int, index: int, max_length: int = 4096) -> dict:
    """Record ``index`` of the synthetic set; its byte-tokenizer THD length is <= ``max_length``."""
    if max_length < 64:
        raise ValueError(f"synthetic samples need a max length >= 64 tokens, got {max_length}; "
                         "raise packing.packed_sequence_size or packing.max_single_sequence_length.")
    rng = random.Random(seed * 1_000_003 + index)
    size = int(min(math.exp(rng.gauss(math.log(70), 1.1)), 2 * max_length))
    if rng.random() < 0.02:  # long documents: the tail reaches the cap whatever the cap
        size = int(max_length * rng.uniform(0.3, 1.2))
    chat, system, task = rng.random() < 0.5, rng.random() < 0.3, rng.choice(TASKS)
    overhead = 2 + (19 if system else 0) + (2 if chat else 0) + 12  # markers, eos, task prefix
    size = max(4, min(size, max_length - overhead))
    while True:
        record = _record(task, *_task(rng, task, size), chat, system)
        if _byte_thd_length(record) <= max_length:
            return record
        size = max(4, size * 3 // 4)  # recall tables can overshoot the estimate: shrink and redraw


def synthetic_records(seed: int, start: int, stop: int, max_length: int = 4096):
    """Records ``start .. stop-1``."""
    return [synthetic_record(seed, i, max_length) for i in range(start, stop)]


COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
          "black": (20, 20, 20), "white": (235, 235, 235)}
"""The colours of the synthetic images (``synthetic_image_record``) and the answers naming them."""


def _color_png(rng: random.Random, color: tuple[int, int, int]) -> bytes:
    """A PNG of one colour with a little noise, 28 to 112 pixels a side (the tiny processor's range)."""
    import io

    import numpy as np
    from PIL import Image

    width, height = rng.randrange(28, 113), rng.randrange(28, 113)
    noise = np.random.default_rng(rng.getrandbits(32)).integers(-12, 13, (height, width, 3))
    pixels = np.clip(np.asarray(color)[None, None, :] + noise, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def synthetic_image_record(seed: int, index: int, max_length: int = 4096) -> dict:
    """Record ``index`` of the synthetic vision-language set: one in four a text chat of ``synthetic_record``,
    the others ask for the colour of one or two generated images (stored as PNG bytes in the record), e.g.
    ``{"messages": [{"role": "user", "content": "<image>what color is this?"}, {"role": "assistant",
    "content": "blue"}], "images": [{"bytes": b"\\x89PNG..."}]}``."""
    rng = random.Random(seed * 1_000_033 + index)
    if rng.random() < 0.25:
        record = synthetic_record(seed, index, max_length)
        if "messages" in record:
            return record
        return {"messages": [{"role": "user", "content": record["prompt"]},
                             {"role": "assistant", "content": record["completion"]}], "task": record["task"]}
    names = [rng.choice(list(COLORS)) for _ in range(1 + (rng.random() < 0.3))]
    question = "<image>what color is this?" if len(names) == 1 else "<image><image>which colors are these?"
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": " and ".join(names)}],
            "images": [{"bytes": _color_png(rng, COLORS[n])} for n in names], "task": "color"}


def synthetic_image_records(seed: int, start: int, stop: int, max_length: int = 4096):
    """Records ``start .. stop-1`` of the synthetic vision-language set."""
    return [synthetic_image_record(seed, i, max_length) for i in range(start, stop)]
