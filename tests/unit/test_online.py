"""Online packing (data/packing/online.py, data/batches/online.py): bounded buffer, best fit,
accounting per epoch, deterministic order, resume with identical packs, memory bound on 10M samples."""

from __future__ import annotations

import collections
import dataclasses
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config import Config, DataConfig, PackingConfig, TrainConfig
from megatron_pack.data.packing.algorithms import best_fit_decreasing
from megatron_pack.data.packing.online import LengthStream, OnlinePacker, OnlinePackStream, block_seeded
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.store.metadata import PlanSettings

ROOT = Path(__file__).resolve().parents[2]


def settings_for(pack_size: int, on_overflow: str = "drop", pad: int = 1) -> PlanSettings:
    return PlanSettings(pack_size=pack_size, pad_multiple=pad, algorithm="online", seed=0, on_overflow=on_overflow,
                        max_length=pack_size)


def array_stream(num_ids: list[int], pack_size: int, **kw) -> LengthStream:
    arr = np.asarray(num_ids, dtype=np.int64)
    return LengthStream(len(arr), lambda epoch, a, b: arr[a:b], settings_for(pack_size, **kw))


def drain_epoch(stream: OnlinePackStream) -> list[list[tuple[int, int]]]:
    packs = []
    while not stream.finished_epochs:
        packs.append(stream.next_pack())
        assert stream.pack_epoch == 0
    return packs


# ----- hand-computed cases -----------------------------------------------------------------

BFD_CASES = [
    ("docstring", [5, 4, 3, 2, 2], 8, [[0, 2], [1, 3, 4]]),
    ("one_each", [8, 8], 8, [[0], [1]]),
    ("ties_go_to_older_bin", [4, 4, 4, 4], 8, [[0, 1], [2, 3]]),
    ("best_not_first_fit", [6, 5, 2, 3], 8, [[0, 2], [1, 3]]),
]


@pytest.mark.parametrize("lengths,capacity,expected", [c[1:] for c in BFD_CASES], ids=[c[0] for c in BFD_CASES])
def test_best_fit_decreasing_by_hand(lengths, capacity, expected):
    bins, loads = best_fit_decreasing(np.asarray(lengths), capacity)
    assert [b.tolist() for b in bins] == expected
    assert loads.tolist() == [sum(lengths[i] for i in b) for b in expected]


# (id, lengths, capacity, max items, bins): packing.max_samples_per_pack closes a bin once it holds that many
CAPPED_CASES = [
    ("docstring", [5, 4, 3, 2, 2], 8, 2, [[0, 2], [1, 3], [4]]),
    ("cap_1_is_one_per_bin", [1, 1, 1], 8, 1, [[0], [1], [2]]),
    ("cap_not_reached", [6, 5, 2, 3], 8, 3, [[0, 2], [1, 3]]),
    ("small_items_split_by_cap", [1] * 7, 8, 3, [[0, 1, 2], [3, 4, 5], [6]]),
]


@pytest.mark.parametrize("lengths,capacity,cap,expected", [c[1:] for c in CAPPED_CASES], ids=[c[0] for c in CAPPED_CASES])
def test_best_fit_decreasing_with_a_sample_cap_by_hand(lengths, capacity, cap, expected):
    bins, _ = best_fit_decreasing(np.asarray(lengths), capacity, cap)
    assert [b.tolist() for b in bins] == expected


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 16), min_size=1, max_size=3000), cap=st.integers(1, 9))
def test_capped_bins_hold_every_item_once_within_both_limits(lengths, cap):
    """Also above SMALL_PLAN items, where the rule runs on the vectorised planner."""
    bins, loads = best_fit_decreasing(np.asarray(lengths), 16, cap)
    members = np.concatenate(bins)
    assert sorted(members.tolist()) == list(range(len(lengths)))
    assert max(len(b) for b in bins) <= cap and int(loads.max()) <= 16
    assert loads.tolist() == [sum(lengths[i] for i in b.tolist()) for b in bins]


@pytest.mark.parametrize("on_overflow", ["drop", "truncate"])
def test_online_stream_keeps_truncates_and_drops_what_the_offline_plan_does(prepared, on_overflow):
    """One ``rules.select`` (issue 23 item 2): a store read online keeps the offline plan's samples, ids and counts."""
    from megatron_pack.data.packing.online import StoreStream
    from megatron_pack.data.packing.plan import select_samples
    from megatron_pack.data.store.metadata import read_metadata
    from megatron_pack.data.store.token_store import STORE_FORMAT, STORE_FORMAT_VERSION, TokenStore

    folder = prepared.data.dataset_dir
    store = TokenStore(folder, read_metadata(folder, STORE_FORMAT, STORE_FORMAT_VERSION))
    settings = PlanSettings(pack_size=64, pad_multiple=4, algorithm="online", seed=0, on_overflow=on_overflow,
                            max_length=48)
    offline = select_samples(store, settings)
    chunk = StoreStream(store, settings, shard=0, num_shards=1, seed=3).next_chunk(len(store))
    assert chunk.end_of_epoch and chunk.num_read == len(store)
    assert dict(zip(chunk.ids.tolist(), chunk.num_ids.tolist())) == dict(zip(offline.kept.tolist(),
                                                                             offline.num_ids.tolist()))
    assert chunk.dropped == offline.dropped and chunk.num_truncated == offline.num_truncated
    assert sum(offline.dropped.values()) + offline.num_truncated > 10  # guard: the rules really acted


@pytest.mark.parametrize("cap", [None, 3], ids=["bound", "cap3"])
def test_online_pad_cu_seqlens_gives_every_batch_one_cu_seqlens_shape(prepared, cap):
    """CUDA graphs online: cu_seqlens has max_samples_per_pack + 2 entries in every batch (without a cap,
    the bound pack_size // pad multiple: 256 // 8 = 32 here)."""
    cfg = _with(prepared, pad_cu_seqlens=True, max_samples_per_pack=cap, pad_seq_to_mult=8)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pad_to_max_length=True))
    expected = (cap or 256 // 8) + 2
    loader = _loader(cfg)
    counts = []
    for _ in range(6):
        info = loader.begin_step()
        for _ in range(info.num_microbatches):
            batch = next(loader)
            assert batch["cu_seqlens"].numel() == batch["cu_seqlens_padded"].numel() == expected
            assert batch["tokens"].numel() == 256
            counts.append(int((batch["sample_ids"] >= 0).sum()))
    assert max(counts) <= (cap or 32) and max(counts) > 1  # guard: packs really hold several samples
    if cap:
        assert max(counts) == cap  # the cap binds on these short samples


def test_module_docstring_example_emits_fullest_first_then_flushes():
    # padded lengths [5, 4, 3, 2 | 6, 1] are num_ids [6, 5, 4, 3 | 7, 2] (THD length = num_ids - 1)
    stream = OnlinePackStream(array_stream([6, 5, 4, 3, 7, 2], 8), OnlinePacker(8, buffer_size=4), chunk_size=4)
    packs = drain_epoch(stream)
    lengths = [[n - 1 for _, n in p] for p in packs]
    assert lengths == [[5, 3], [6, 2], [4, 1]]
    assert [[i for i, _ in p] for p in packs] == [[0, 2], [4, 3], [1, 5]]


def test_each_epoch_logs_read_equals_packed_plus_dropped(caplog):
    # ids [6, 1, 40, 5]: one without a target (1 id), one longer than the 16-token pack (40)
    stream = OnlinePackStream(array_stream([6, 1, 40, 5], 16), OnlinePacker(16, buffer_size=4), announce=True)
    with caplog.at_level("INFO", logger="megatron_pack.train.accounting"):
        drain_epoch(stream)
    assert "online packing epoch 0 (shard 0): read 4 = packed 2 + dropped" in caplog.text
    assert stream.finished_epochs[0]["num_samples_dropped"] == {
        "no_answer_tokens": 1, "too_long": 1, "no_answer_tokens_after_truncation": 0}


# ----- properties --------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(num_ids=st.lists(st.integers(1, 40), min_size=1, max_size=120), buffer_size=st.integers(1, 24),
       pack_size=st.sampled_from([16, 24, 32]), buffer_packs=st.integers(1, 4), pad=st.sampled_from([1, 4]))
def test_every_kept_sample_is_packed_once_per_epoch_within_bounds(num_ids, buffer_size, pack_size, buffer_packs, pad):
    # num_ids 1 (no target) and > pack size are dropped; the rest packed exactly once per epoch
    stream = array_stream(num_ids, pack_size, pad=pad)
    packer = OnlinePacker(pack_size, buffer_size=buffer_size, buffer_tokens=buffer_packs * pack_size)
    online = OnlinePackStream(stream, packer, chunk_size=7)
    peak_samples = peak_tokens = 0
    packs = []
    kept = [i for i, n in enumerate(num_ids) if 1 < n and (n - 1 + pad - 1) // pad * pad <= pack_size]
    if not kept:  # an epoch with nothing to pack is an error naming the fix, never an endless loop
        with pytest.raises(DataError, match="no sample of this shard was packed"):
            online.next_pack()
        return
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    while len(online.finished_epochs) < 2:
        pack = online.next_pack()
        packs.append(pack)
        by_epoch[online.pack_epoch] += [i for i, _ in pack]
        assert sum((n - 1 + pad - 1) // pad * pad for _, n in pack) <= pack_size
        peak_samples, peak_tokens = max(peak_samples, len(packer)), max(peak_tokens, packer.num_tokens)
    for epoch in (0, 1):
        seen = by_epoch[epoch]
        assert sorted(seen) == kept
        acc = online.finished_epochs[epoch]
        assert acc["num_samples_read"] == len(num_ids) == acc["num_samples_packed"] + sum(
            acc["num_samples_dropped"].values())
    assert peak_samples <= buffer_size and peak_tokens <= buffer_packs * pack_size


def test_the_buffer_bound_is_reached_not_vacuous():
    lengths = block_seeded(lambda rng, n: rng.integers(2, 60, n), seed=1)
    packer = OnlinePacker(64, buffer_size=32, buffer_tokens=16 * 64)
    online = OnlinePackStream(LengthStream(2000, lengths, settings_for(64)), packer, chunk_size=8)
    peak = 0
    while not online.finished_epochs:
        online.next_pack()
        peak = max(peak, len(packer))
    assert 16 <= peak <= 32  # filled up to (about) the bound, never over it


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), cut=st.integers(0, 60), buffer_size=st.integers(2, 40))
def test_resume_from_state_continues_with_identical_packs(seed, cut, buffer_size):
    lengths = block_seeded(lambda rng, n: rng.integers(1, 50, n), seed=seed, block=16)

    def fresh():
        return OnlinePackStream(LengthStream(300, lengths, settings_for(48)), OnlinePacker(48, buffer_size=buffer_size),
                                chunk_size=5)

    whole = fresh()
    expected = [whole.next_pack() for _ in range(cut + 40)]  # crosses into the next epoch
    first = fresh()
    got = [first.next_pack() for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoint-safe: plain JSON values
    second = fresh()
    second.load_state_dict(state)
    got += [second.next_pack() for _ in range(40)]
    assert got == expected
    assert second.finished_epochs[:1] == whole.finished_epochs[:1]


# ----- the token store and the on-the-fly stream ----------------------------------------------

def _cfg(tmp_path, **packing) -> Config:
    return Config(data=DataConfig(source="synthetic", synthetic_num_samples=150, dataset_dir=str(tmp_path / "ds"),
                                  tokenize_workers=1),
                  packing=PackingConfig(packed_sequence_size=256, mode="online", buffer_size=32, **packing),
                  train=TrainConfig(global_batch_size=4, seed=3))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from megatron_pack.data.prepare import prepare

    cfg = _cfg(tmp_path_factory.mktemp("online"))
    prepare(dataclasses.replace(cfg, packing=dataclasses.replace(cfg.packing, mode="offline")), progress=False)
    return cfg


def _loader(cfg, dp_rank=0, dp_size=1):
    from megatron_pack.data.batches.loader import build_loader
    from megatron_pack.data.batches.opening import open_dataset

    return build_loader(cfg, open_dataset(cfg), dp_rank=dp_rank, dp_size=dp_size)


def _steps(loader, num_steps):
    out = []
    for _ in range(num_steps):
        info = loader.begin_step()
        out.append([next(loader)["sample_ids"].tolist() for _ in range(info.num_microbatches)])
    return out


SOURCES = {"store": {}, "stream": {"online_source": "stream"}}


def _with(cfg, *, workers: int = 0, gbs: int = 4, **packing):
    return dataclasses.replace(cfg, packing=dataclasses.replace(cfg.packing, **packing),
                               data=dataclasses.replace(cfg.data, num_workers=workers),
                               train=dataclasses.replace(cfg.train, global_batch_size=gbs))


# (id, source, workers before the kill, workers after); 1 worker packs the same single shard as none
RESUME_CASES = [("store-w0", "store", 0, 0), ("stream-w0", "stream", 0, 0), ("store-w2", "store", 2, 2),
                ("stream-w2", "stream", 2, 2), ("store-w0-then-w1", "store", 0, 1)]


@pytest.mark.parametrize("source,before,after", [c[1:] for c in RESUME_CASES], ids=[c[0] for c in RESUME_CASES])
def test_kill_and_resume_mid_epoch_gives_identical_packs(prepared, source, before, after):
    cfg = _with(prepared, workers=before, gbs=3, **SOURCES[source])  # 3 packs a step: the resume point is mid-turn
    whole = _steps(_loader(cfg), 9)
    first = _loader(cfg)
    got = _steps(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoint-safe: plain JSON values
    assert all(s["buffer_ids"] for s in state["states"]), "an empty buffer: restoring it would not be exercised"
    assert state["next_worker"] == (15 % before if before else 0)  # with 2 workers: worker 1 comes next (rotated)
    resumed = _loader(_with(cfg, workers=after, gbs=3, **SOURCES[source]))
    resumed.load_state_dict(state)
    got += _steps(resumed, 4)
    assert got == whole
    assert len({i for step in whole for pack in step for i in pack}) > 40


def test_workers_take_turns_over_their_disjoint_shards(prepared):
    """W=2 workers of DP rank 1 of 2 pack shards 2 and 3 of 4, handed out alternately (shard 2 first)."""
    from megatron_pack.data.batches.online import OnlineSource

    loader = _loader(_with(prepared, workers=2), 1, 2)
    got = [pack for step in _steps(loader, 4) for pack in step]
    source = OnlineSource(prepared)
    shards = [source.pack_stream(shard=s, num_shards=4) for s in (2, 3)]
    expected = [[i for i, _ in shards[k % 2].next_pack()] for k in range(8)]
    assert got == expected


@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
def test_ranks_and_workers_read_disjoint_shards_and_account_for_every_sample(prepared, workers):
    """Epoch 0 of every shard (2 DP ranks x max(W, 1)): no sample twice, every sample of the store read once."""
    from megatron_pack.data.batches.online import OnlineSource

    num_shards = 2 * max(workers, 1)
    packed, read = [], 0
    for rank in range(2):
        loader = _loader(_with(prepared, workers=workers), rank, 2)
        items = loader.feed.start(loader.states, 0)
        open_shards = set(range(max(workers, 1)))
        while open_shards:
            ready = next(items)
            if ready.worker in open_shards:
                packed += [i for i, _ in ready.pack]
                if ready.state["finished_epochs"]:
                    acc = ready.state["finished_epochs"][0]
                    assert acc["num_samples_read"] == acc["num_samples_packed"] + sum(acc["num_samples_dropped"].values())
                    read += acc["num_samples_read"]
                    open_shards.discard(ready.worker)
        items.close()
    assert len(packed) == len(set(packed)) > len(OnlineSource(prepared).store) // 2
    assert read == len(OnlineSource(prepared).store) and num_shards in (2, 4)


def test_resume_with_other_workers_or_dp_size_is_refused_in_one_line(prepared):
    state = _loader(_with(prepared, workers=2)).state_dict()
    with pytest.raises(ValueError, match=r"^data.num_workers \(0\) differs from the checkpoint's \(2\).*"
                                         r"set data.num_workers=2 to resume") as info:
        _loader(prepared).load_state_dict(state)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="written at data-parallel size 1 .* this run has 2; resume with 1 data-"):
        _loader(prepared, 0, 2).load_state_dict(_loader(prepared).state_dict())


def test_sample_order_is_deterministic_for_a_seed(prepared):
    a, b = _steps(_loader(prepared), 4), _steps(_loader(prepared), 4)
    other = dataclasses.replace(prepared, train=dataclasses.replace(prepared.train, seed=4))
    assert a == b
    assert _steps(_loader(other), 4) != a


# ----- global token budget and balance over DP ranks (threads stand in for the ranks) -------

class ThreadGather:
    """``gather`` of an in-process DP group: each rank's loader runs in its own thread."""

    def __init__(self, dp_size: int):
        self.barrier, self.slots = threading.Barrier(dp_size), [None] * dp_size

    def for_rank(self, rank: int):
        def gather(obj):
            self.barrier.wait()
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return gather


def _dp_steps(cfg, dp_size: int, num_steps: int) -> list[list]:
    """Per rank, per step: (StepInfo, the batches), every rank in its own thread."""
    from megatron_pack.data.batches.loader import build_loader
    from megatron_pack.data.batches.opening import open_dataset

    group, dataset = ThreadGather(dp_size), open_dataset(cfg)
    loaders = [build_loader(cfg, dataset, dp_rank=r, dp_size=dp_size, gather=group.for_rank(r)) for r in range(dp_size)]
    out: list = [None] * dp_size

    def run(r):
        steps = []
        for _ in range(num_steps):
            info = loaders[r].begin_step()
            steps.append((info, [next(loaders[r]) for _ in range(info.num_microbatches)]))
        out[r] = steps

    threads = [threading.Thread(target=run, args=(r,)) for r in range(dp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(o is not None for o in out), "a rank did not finish (a gather its peers never entered)"
    return out


@pytest.mark.parametrize("source", ["store", "stream"])
def test_global_budget_is_met_within_one_pack_and_balanced_steps_train_the_same_packs(prepared, source):
    budget = 1500
    cfg = dataclasses.replace(_with(prepared, **SOURCES[source]),
                              train=dataclasses.replace(prepared.train, global_batch_tokens=budget))
    plain = _dp_steps(cfg, 2, 5)
    balanced = _dp_steps(_with(cfg, gbs=cfg.train.global_batch_size, balance="dp", **SOURCES[source]), 2, 5)
    unequal = moved = 0
    for step in range(5):
        per_rank = [[int(b["num_target_tokens"]) for b in plain[r][step][1]] for r in range(2)]
        counts = [len(t) for t in per_rank]
        last = per_rank[0][-1] if counts[0] > counts[1] else per_rank[1][-1]  # round-robin: the last one taken
        assert budget <= sum(map(sum, per_rank)) < budget + last
        assert counts[0] - counts[1] in (0, 1) and plain[0][step][0].tokens == sum(map(sum, per_rank))
        unequal += counts[0] != counts[1]
        packs = [{tuple(b["sample_ids"].tolist()) for b in plain[r][step][1]} for r in range(2)]
        dealt = [{tuple(b["sample_ids"].tolist()) for b in balanced[r][step][1]} for r in range(2)]
        assert packs[0] | packs[1] == dealt[0] | dealt[1] and not dealt[0] & dealt[1]  # the same global batch
        moved += dealt[0] != packs[0]
        info = balanced[0][step][0]
        assert info.imbalance_after <= info.imbalance_before + 1e-12
    assert unequal and moved, (unequal, moved)  # guards: unequal micro-batch counts and moved packs happened


@settings(max_examples=200, deadline=None)
@given(table=st.integers(1, 6).flatmap(lambda dp: st.integers(0, 6).flatmap(
    lambda depth: st.lists(st.lists(st.integers(1, 60), min_size=depth, max_size=depth), min_size=dp, max_size=dp))),
       budget=st.integers(1, 400))
def test_round_robin_selection_meets_the_budget_within_its_last_pack(table, budget):
    from megatron_pack.data.batches.online import select_round_robin

    counts = select_round_robin(table, budget)
    dp, depth = len(table), len(table[0])
    if counts is None:  # only when what is in sight cannot meet the budget: look further ahead
        assert depth == 0 or sum(map(sum, table)) < budget
        return
    taken = [t for r in range(dp) for t in table[r][:counts[r]]]
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    last_rank = max(r for r in range(dp) if counts[r] == max(counts))
    last = table[last_rank][counts[last_rank] - 1]
    assert sum(taken) >= budget
    assert sum(taken) - last < budget or sum(counts) == dp  # over by less than its last pack, or the first round


# ----- memory: a 10M-sample stream -----------------------------------------------------------

RSS_SCRIPT = textwrap.dedent("""
    import resource, sys, numpy as np
    from megatron_pack.data.packing.online import LengthStream, OnlinePacker, OnlinePackStream, block_seeded
    from megatron_pack.data.store.metadata import PlanSettings
    settings = PlanSettings(pack_size=8192, pad_multiple=1, algorithm="online", seed=0, on_overflow="drop",
                            max_length=8192)
    lengths = block_seeded(lambda rng, n: rng.integers(2, 10, n), seed=0, block=65536)
    online = OnlinePackStream(LengthStream(int(sys.argv[1]), lengths, settings),
                              OnlinePacker(8192, buffer_size=65536), chunk_size=65536)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    packs = 0
    while not online.finished_epochs:
        online.next_pack()
        packs += 1
    acc = online.finished_epochs[0]
    print(acc["num_samples_read"], acc["num_samples_packed"], packs,
          (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
""")


@pytest.mark.timeout(180)
def test_memory_stays_bounded_on_a_10m_sample_stream():
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, "10000000"], capture_output=True, text=True, check=True,
                         cwd=ROOT, timeout=170, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    read, packed, packs, grown_mib = map(int, out.stdout.split())
    assert read == packed == 10_000_000 and packs > 1000
    # a held stream would need >= 80 MB for the ids alone; the buffer (65536 samples) needs ~2 MB
    assert grown_mib < 48, f"peak RSS grew by {grown_mib} MiB while streaming 10M samples"


def test_resume_with_other_online_packing_rules_is_refused_in_one_line(prepared):
    """The restored buffer and ready packs were made under the saved rules (buffer, cap, overflow, ...)."""
    from megatron_pack.data.batches.online import online_packing_record, online_resume_problem

    loader = _loader(prepared)
    _steps(loader, 2)
    state = loader.state_dict()
    assert state["packing"] == online_packing_record(prepared)  # guard: the record is saved
    other = _with(prepared, buffer_size=64)
    with pytest.raises(ValueError, match=r"^packing.buffer_size \(64\) differs from the checkpoint's online packing "
                                         r"\(32\).*set it back to 32 to resume"):
        _loader(other).load_state_dict(state)
    assert online_resume_problem(state, dp_size=1, num_workers=0, packing=online_packing_record(prepared)) is None
    capped = online_packing_record(_with(prepared, max_samples_per_pack=4))
    assert "packing.max_samples_per_pack (4)" in online_resume_problem(state, dp_size=1, num_workers=0, packing=capped)
    seeded = online_packing_record(dataclasses.replace(prepared, train=dataclasses.replace(prepared.train, seed=4)))
    assert online_resume_problem(state, dp_size=1, num_workers=0, packing=seeded).startswith("train.seed (4)")


def test_more_shards_than_store_samples_is_refused_on_every_rank_alike(prepared):
    with pytest.raises(DataError, match=r"into 200 shards .* holds only 150 samples.*set data.num_workers=1 or fewer"):
        _loader(_with(prepared, workers=2), dp_rank=0, dp_size=100)


def test_a_workers_data_error_reaches_the_loop_as_its_one_line():
    from megatron_pack.data.batches.online_feed import PackFeed

    def items():
        raise DataError("Caught DataError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
                        '  File "online.py", line 470, in _finish_epoch\n    raise DataError(...)\n'
                        "megatron_pack.data.formats.sources.DataError: online packing epoch 0: no sample of this shard "
                        "was packed.\n")
        yield  # pragma: no cover

    feed = PackFeed(None, dp_rank=0, dp_size=1, num_workers=2)
    with pytest.raises(DataError) as info:
        next(feed._in_turn(items(), 0))
    assert str(info.value) == "online packing epoch 0: no sample of this shard was packed."


def test_stream_workers_parse_only_their_own_lines_of_a_file(tmp_path):
    """Record ``i`` (blank lines are not records) belongs to worker ``i % stride``; a worker never parses
    another's JSON, so a malformed line reaches only the worker that owns it (as its DataError, in the
    record's place: the stream stops on it or, with data.on_bad_record=skip, counts it), naming file and line."""
    from megatron_pack.data.batches.online import OnlineSource

    lines = [json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) for i in range(7)]
    lines.insert(3, "")          # blank: line 4 is not a record
    lines.insert(6, "{broken")   # line 7 is record 5
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = Config(data=DataConfig(source="files", input=str(path), tokenizer="byte"),
                 packing=PackingConfig(packed_sequence_size=64, mode="online", online_source="stream"))
    source = OnlineSource(cfg)
    even = list(source.records(0, 2))
    assert [(i, r["prompt"], where.rsplit(": ", 1)[1]) for i, r, where in even] == [
        (0, "q0", "line 1"), (2, "q2", "line 3"), (4, "q4", "line 6"), (6, "q5", "line 8")]
    odd = [(i, r) for i, r, _ in source.records(1, 2)]
    assert [i for i, r in odd if isinstance(r, DataError)] == [5]
    assert "in.jsonl: line 7: malformed JSON" in str(odd[2][1])
    assert [i for i, _, _ in source.records(3, 4)] == [3, 7]  # resume-style start: every 4th from record 3


def test_fewer_store_samples_than_dp_ranks_names_the_dp_size_not_workers(prepared):
    with pytest.raises(DataError, match=r"into 200 shards .* holds only 150 samples.*run on at most 150 data-parallel"):
        _loader(prepared, dp_rank=0, dp_size=200)


def test_samples_held_out_for_validation_are_never_streamed(prepared):
    """data.validation_fraction online: the stream of epoch 0 reads exactly the samples prepare's rule keeps for
    training (``held_out_mask``, the same ones every plan of the store holds out), none of the held-out ones."""
    from megatron_pack.data.batches.online import OnlineSource
    from megatron_pack.data.store.metadata import held_out_mask

    cfg = dataclasses.replace(prepared, data=dataclasses.replace(prepared.data, validation_fraction=0.25))
    source = OnlineSource(cfg)
    held = held_out_mask(len(source.store), 0.25, cfg.data.validation_seed)
    stream = source.pack_stream(shard=0, num_shards=1)
    seen = set()
    while not seen or stream.stream.epoch == 0 and stream.stream.cursor < len(stream.stream._order):
        seen.update(i for i, _ in stream.next_pack())
    kept = {int(i) for i in np.flatnonzero(~held)}
    assert held.sum() > 0 and not seen & {int(i) for i in np.flatnonzero(held)}
    assert seen <= kept and len(seen) > len(kept) // 2
