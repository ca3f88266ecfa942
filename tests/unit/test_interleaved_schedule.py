"""The interleaved 1F1B order on CPU is megatron-core 0.16.1's: the schedule table and the warm-up counts.

Our ``interleaved_schedule.schedule_table`` / ``warmup_count`` against megatron-core's own
``get_schedule_table`` / ``get_pp_rank_microbatches`` (called with a stand-in for its point-to-point
communicator, which only has to say the pipeline size, rank and virtual size), plus hand-computed
cases. The end-to-end numerics (loss and gradients against the float64 reference) are in
``tests/functional/test_pipeline_parallel.py``.
"""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.training.interleaved_schedule import chunk_iterators, schedule_table, warmup_count


def test_schedule_table_by_hand():
    assert schedule_table(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    # the chunk of virtual micro-batch k is (k // PP) % VP when M is a multiple of PP
    table = schedule_table(8, 3, 4)
    assert [c for _, c in table] == [(k // 4) % 3 for k in range(24)]


def test_warmup_by_hand():
    assert [warmup_count(2, r, 2, 4) for r in (0, 1)] == [4, 2]  # (PP - r - 1) * 2 + (VP - 1) * PP
    assert warmup_count(4, 0, 2, 2) == 4  # capped at M * VP


def _communicator(pp: int, rank: int, vp: int):
    group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)


@settings(max_examples=50, deadline=None)  # the first example imports megatron-core
@given(pp=st.integers(2, 6), vp=st.integers(2, 4), groups=st.integers(1, 4), data=st.data())
def test_order_is_megatron_cores(pp, vp, groups, data):
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    num_microbatches = pp * groups
    assert schedule_table(num_microbatches, vp, pp) == get_schedule_table(num_microbatches, vp, pp)
    rank = data.draw(st.integers(0, pp - 1))
    _, _, warmup, _ = get_pp_rank_microbatches(num_microbatches, vp, pp, p2p_communicator=_communicator(pp, rank, vp))
    assert warmup_count(pp, rank, vp, num_microbatches) == warmup


def test_chunk_iterators_replay_each_pack_to_every_chunk():
    source = iter(["a", "b", "c"])
    first, second = chunk_iterators(source, 2)
    assert [next(first), next(first), next(second), next(first), next(second), next(second)] == list("abacbc")
    with pytest.raises(RuntimeError, match="before chunk 0 read it"):
        next(second)
