"""tests/_dist.py: a hung spawned world fails its test with a clear message instead of blocking CI,
and the pooled ranks run case after case as new processes would.

One world of 2 gloo ranks where rank 1 never reaches the barrier rank 0 waits in (as a rank
that skips a collective would): ``spawn_world`` kills both ranks at the deadline and raises
``WorldTimeout`` naming the worker, the ranks still running and where each one was.

The pool: a case that leaves megatron-core's groups, an environment variable, a seed and a default
dtype behind is followed, on the same processes, by a case that sees what a new process sees (the
same case run with ``fresh=True`` is the reference); a rank that raises fails its case with its
traceback and the next case runs on a new pool; a 1-rank world after a 2-rank one runs on the
pool's first process. Pooled ranks are forks of the pool's fork server (``tests/_pool_server.py``
imported there).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

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


def _leave_state_behind(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size, create_gloo_process_groups=False)
    os.environ["LEFT_BEHIND"] = "1"
    os.environ["RANK"] = "99"
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    return {"pid": os.getpid()}


def _observe_state(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    return {"pid": os.getpid(), "model_parallel": parallel_state.model_parallel_is_initialized(),
            "left_behind": "LEFT_BEHIND" in os.environ, "rank_env": int(os.environ["RANK"]),
            "world_size_env": int(os.environ["WORLD_SIZE"]), "seed": torch.initial_seed(),
            "float64": torch.get_default_dtype() == torch.float64, "dist_world": torch.distributed.get_world_size(),
            "forked_from_server": "_pool_server" in sys.modules}


def _raise_on_rank1(rank: int, world_size: int) -> dict:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    torch.distributed.barrier()  # rank 0 waits for a peer that never comes: the pool must be killed
    return {}


def test_pooled_case_sees_what_a_new_process_sees(tmp_path):
    first = spawn_world(_leave_state_behind, 2, tmp_path / "first")
    pooled = spawn_world(_observe_state, 2, tmp_path / "pooled")
    fresh = spawn_world(_observe_state, 2, tmp_path / "fresh", fresh=True)
    assert [int(r["pid"]) for r in pooled] == [int(r["pid"]) for r in first]  # the same processes ran both
    assert {int(r["pid"]) for r in fresh}.isdisjoint(int(r["pid"]) for r in first)  # fresh=True: new ones
    # pooled ranks are forks of the fork server that imported everything once; fresh ones new interpreters
    assert [bool(r["forked_from_server"]) for r in pooled + fresh] == [True, True, False, False]
    for rank, (got, want) in enumerate(zip(pooled, fresh)):
        assert int(got["rank_env"]) == rank and int(got["dist_world"]) == 2
        assert int(got["seed"]) != 1234  # a new process's seed is not fixed (the fresh one differs), only not left behind
        for key in want:
            if key not in ("pid", "seed", "forked_from_server"):
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"rank {rank}: {key}")


def test_failing_rank_fails_its_case_and_the_next_case_runs(tmp_path):
    with pytest.raises(AssertionError) as info:
        spawn_world(_raise_on_rank1, 2, tmp_path / "fails", timeout_s=60)
    assert "rank 1 of the world of 2 running _raise_on_rank1 failed" in str(info.value)
    assert "ValueError: rank 1 refuses" in str(info.value)
    two = spawn_world(_every_rank_arrives, 2, tmp_path / "after")
    one = spawn_world(_observe_state, 1, tmp_path / "one")
    assert [int(r["rank"]) for r in two] == [0, 1]
    assert int(one[0]["dist_world"]) == 1 and int(one[0]["world_size_env"]) == 1


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
    # every rank was killed
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_world_that_finishes_returns_each_rank_result(tmp_path):
    results = spawn_world(_every_rank_arrives, 2, tmp_path)  # the default deadline
    assert [int(r["rank"]) for r in results] == [0, 1]


# ----- tests/_train_world.py: the session's torchrun world of 2 ranks ----------------------------------------------

QUICK = ["experiment=quickstart", "data.synthetic_num_samples=40", "data.dataset_dir=ds", "train.train_iters=1",
         "train.global_batch_size=2", "checkpoint.enabled=false", "logging.tensorboard=false"]


def test_train_world_serves_command_after_command_on_the_same_ranks(tmp_path):
    """Two calls, three commands: each command's output is its own (both ranks' lines), a non-zero exit is reported
    as it was, and the same torchrun agent served them all."""
    import _train_world
    from _hf import prepare_in

    prepare_in(tmp_path, QUICK)
    first = _train_world.run_in_world(tmp_path, {
        "cp2": ["train", *QUICK, "train.output_dir=runs/a"],
        "dp2": ["train", *QUICK, "parallel=cp1", "train.output_dir=runs/b"]})
    agent = _train_world.pids()[0]
    assert list(first) == ["cp2", "dp2"]
    assert "run runs/a:" in first["cp2"] and "runs/b" not in first["cp2"] and "run runs/b:" in first["dp2"]
    assert "world 2 = dp 1 x cp 2 " in first["cp2"] and "world 2 = dp 2 x cp 1 " in first["dp2"], first
    refused = _train_world.run_in_world(tmp_path, {"bad": ["export", "checkpoint=nope", "output=x"]}, expect=2)
    assert refused["bad"].count("holds no complete checkpoint") == 2  # both ranks said it, each in its own log
    with pytest.raises(AssertionError, match=r"exited \[2, 2\]"):
        _train_world.run_in_world(tmp_path, {"bad": ["export", "checkpoint=nope", "output=x"]})
    assert _train_world.pids()[0] == agent and len(_train_world.pids()) == 3  # the agent and its 2 ranks


def test_train_world_that_does_not_answer_is_killed_with_each_rank_stack(tmp_path):
    """A world past its deadline (here: still starting) fails the call with each rank's Python stack and is killed;
    the session's world is untouched."""
    import _train_world
    from _hf import prepare_in

    prepare_in(tmp_path, QUICK)
    world = _train_world._World()
    try:
        with pytest.raises(AssertionError) as failed:
            world.run(tmp_path, {"slow": ["train", *QUICK]}, {}, timeout=3.0)
    finally:
        world.stop(kill=True)
    text = str(failed.value)
    assert "the train world hung in job 0 (['slow'])" in text
    assert "rank 0's stack ---\n" in text and "rank 1's stack ---\n" in text and 'File "' in text, text[-3000:]
    assert world.proc.returncode is not None
