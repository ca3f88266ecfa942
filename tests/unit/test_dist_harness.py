"""tests/_dist.py: a hung spawned world fails its test with a clear message instead of blocking CI.

One world of 2 gloo ranks where rank 1 never reaches the barrier rank 0 waits in (as a rank
that skips a collective would): ``spawn_world`` kills both ranks at the deadline and raises
``WorldTimeout`` naming the worker, the ranks still running and where each one was.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _dist import WorldTimeout, spawn_world  # noqa: E402

DEADLINE_S = 4.0
"""Counted from the moment both ranks joined the process group (their start-up is not counted)."""


def _rank1_never_arrives(rank: int, world_size: int) -> dict:
    if rank == 1:
        time.sleep(10 * DEADLINE_S)
    return {"rank": rank}


def _every_rank_arrives(rank: int, world_size: int) -> dict:
    return {"rank": rank}


def test_hung_world_is_killed_and_fails_with_each_rank_stack(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        spawn_world(_rank1_never_arrives, 2, tmp_path, timeout_s=DEADLINE_S)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed >= DEADLINE_S
    assert "running _rank1_never_arrives did not finish within 4 s" in message
    assert "ranks [0, 1] still running" in message
    rank0, rank1 = message.split("--- rank 1 at the deadline ---")
    assert "_entry" in rank0 and "barrier" in rank0  # rank 0 waits in the barrier after its worker
    assert "_rank1_never_arrives" in rank1  # rank 1 is still inside its worker
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]  # every rank was killed


def test_world_that_finishes_returns_each_rank_result(tmp_path):
    results = spawn_world(_every_rank_arrives, 2, tmp_path)  # the default deadline
    assert [int(r["rank"]) for r in results] == [0, 1]
