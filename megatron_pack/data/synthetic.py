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
GENERATOR_VERSION = 1
_LETTERS = string.ascii_lowercase


def _word(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(_LETTERS, k=n))


def _task(rng: random.Random, task: str, size: int) -> tuple[str, str]:
    """(prompt, completion) of about ``size`` payload bytes."""
    if task == "copy":
        s = _word(rng, max(1, size // 2))
        return f"copy: {s}\n", s
    if task == "reverse":
        s = _word(rng, max(1, size // 2))
        return f"reverse: {s}\n", s[::-1]
    if task == "sort":
        xs = [rng.randrange(10) for _ in range(max(2, size // 4))]
        return f"sort: {' '.join(map(str, xs))}\n", " ".join(map(str, sorted(xs)))
    if task == "add":
        digits = max(1, min(size // 6, 12))
        a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
        return f"add: {a}+{b}=", str(a + b)
    num_pairs = max(1, size // 9)
    keys = rng.sample(range(10 * num_pairs + 10), num_pairs)
    values = [_word(rng, 3) for _ in keys]
    pick = rng.randrange(num_pairs)
    table = "; ".join(f"k{k}={v}" for k, v in zip(keys, values))
    return f"recall: {table}\nk{keys[pick]}?", values[pick]


def _byte_thd_length(record: dict) -> int:
    """THD length under the byte tokenizer: ids minus one (bos, role markers and eos included)."""
    if "messages" in record:
        return sum(len(m["content"].encode()) + 2 for m in record["messages"])
    return len(record["prompt"].encode()) + len(record["completion"].encode()) + 1


def _record(rng: random.Random, size: int, chat: bool) -> dict:
    task = rng.choice(TASKS)
    state = rng.getstate()
    prompt, completion = _task(rng, task, size)
    if not chat:
        return {"prompt": prompt, "completion": completion, "task": task}
    rng.setstate(state)
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "Answer exactly."})
    prompt, completion = _task(rng, task, size)
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
    chat = rng.random() < 0.5
    start = rng.getstate()
    while True:
        rng.setstate(start)
        record = _record(rng, max(size, 4), chat)
        if _byte_thd_length(record) <= max_length:
            return record
        size = size * 3 // 4


def synthetic_records(seed: int, start: int, stop: int, max_length: int = 4096):
    """Records ``start .. stop-1``."""
    return [synthetic_record(seed, i, max_length) for i in range(start, stop)]
