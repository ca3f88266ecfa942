"""prepare's tokenize bar (``token_store.Progress``): tqdm's line, written without importing tqdm (issue 43 item 12:
its import reads the installed packages' metadata, ~0.03 CPU-s of a small prepare). Hand-written lines, a fake
clock."""

from __future__ import annotations

import io

import pytest

from megatron_pack.data.store import token_store
from megatron_pack.data.store.token_store import Progress

LINES = [  # (id, total, records counted, seconds elapsed, postfix, the line)
    ("known-total", 1000, 420, 2.0, "9 tokens/s",
     "tokenize:  42%|####      | 420/1000 [00:02<00:02, 210.00records/s, 9 tokens/s]"),
    ("done", 100, 100, 0.05, "", "tokenize: 100%|##########| 100/100 [00:00<00:00, 2000.00records/s]"),
    ("nothing-yet", 100, 0, 0.0, "", "tokenize:   0%|          | 0/100 [00:00<?, ?records/s]"),
    ("unknown-total", None, 420, 2.0, "", "tokenize: 420records [00:02, 210.00records/s]"),
    ("an-hour", 10_000, 5_000, 3725.0, "", "tokenize:  50%|#####     | 5000/10000 [1:02:05<1:02:05, 1.34records/s]"),
]


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(token_store.time, "perf_counter", lambda: now[0])
    return now


@pytest.mark.parametrize("total,count,elapsed,postfix,line", [c[1:] for c in LINES], ids=[c[0] for c in LINES])
def test_progress_line(clock, total, count, elapsed, postfix, line):
    bar = Progress("tokenize", total, "records", stream=io.StringIO())
    bar.count, bar.postfix = count, postfix
    assert bar.line(clock[0] + elapsed) == line


def test_progress_writes_at_most_once_a_second_and_ends_its_line(clock):
    out = io.StringIO()
    with Progress("tokenize", 36, "records", stream=out) as bar:
        for i in range(12):
            clock[0] += 0.25  # 3 s in all: the first line, then one a second, then the closing one
            bar.update(3)
    written = out.getvalue()
    assert written.count("\r") == 1 + 3 + 1 and written.endswith("36/36 [00:03<00:00, 12.00records/s]\n")
    assert written.split("\r")[1:3] == ["tokenize:   0%|          | 0/36 [00:00<?, ?records/s]",
                                        "tokenize:  33%|###       | 12/36 [00:01<00:02, 12.00records/s]"]
    bar.close()  # closed once: a second close writes nothing
    assert out.getvalue() == written
    with Progress("tokenize", 36, "records", enabled=False, stream=out) as quiet:
        quiet.update(30)
    assert out.getvalue() == written
