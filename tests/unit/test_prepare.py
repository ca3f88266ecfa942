"""prepare: round trip, overflow policies with the accounting invariant, idempotence, safe writes."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_pack.config import Config, DataConfig, PackingConfig, ParallelConfig
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data import prepare as prepare_module
from megatron_pack.data.prepare import prepare
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.store.token_store import token_dtype_for
from megatron_pack.data.formats.chat import SampleSchema
from megatron_pack.data.formats.tokenizer import ByteTokenizer

BYTE = ByteTokenizer()


def make_cfg(tmp_path, *, data=None, packing=None, parallel=None) -> Config:
    data = {"source": "files", "input": str(tmp_path / "train.jsonl"), "dataset_dir": str(tmp_path / "ds"),
            "tokenize_workers": 1, **(data or {})}
    return Config(data=DataConfig(**data), packing=PackingConfig(**(packing or {})),
                  parallel=ParallelConfig(**(parallel or {})))


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def mixed_records(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, c = "q" * int(rng.integers(1, 40)), "a" * int(rng.integers(1, 30))
        if i % 3 == 0:
            out.append({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]})
        else:
            out.append({"prompt": p + str(i), "completion": c})
    return out


@pytest.mark.parametrize("workers,cp,algorithm", [(1, 1, "bfd"), (2, 2, "first_fit_shuffle"), (1, 4, "sequential")],
                         ids=["inline-cp1-bfd", "pool2-cp2-ffs", "inline-cp4-seq"])
def test_round_trip(tmp_path, monkeypatch, workers, cp, algorithm):
    monkeypatch.setattr(prepare_module, "FILE_CHUNK", 16)  # many chunks, so the pool really reorders work
    records = mixed_records(300)
    write_jsonl(tmp_path / "train.jsonl", records)
    cfg = make_cfg(tmp_path, data={"tokenize_workers": workers},
                   packing={"packed_sequence_size": 128, "algorithm": algorithm},
                   parallel={"context_parallel_size": cp})
    plan_dir = prepare(cfg, progress=False)
    ds = PackedSFTDataset(cfg.data.dataset_dir, plan_dir, expected_tokenizer="byte")
    seen = []
    for i in range(len(ds)):
        pack = ds[i]
        assert sum(-(-(len(s["input_ids"]) - 1) // (2 * cp if cp > 1 else 1)) * (2 * cp if cp > 1 else 1)
                   for s in pack) <= 128
        for s in pack:
            ids, mask = BYTE.encode_sample(records[s["sample_id"]], SampleSchema("auto"))
            assert s["input_ids"].tolist() == ids.tolist() and s["loss_mask"].tolist() == mask.tolist()
            assert s["input_ids"].dtype == np.int64 and s["input_ids"][-1] == ds.metadata["eos_id"]
            seen.append(s["sample_id"])
    assert sorted(seen) == list(range(300))
    assert ds.metadata["pad_seq_to_mult"] == (2 * cp if cp > 1 else 1)
    assert ds.metadata["num_bins"] == len(ds) >= ds.metadata["lower_bound_bins"] > 10


POLICY_CASES = [
    # policy, expected packed, dropped counts, truncated
    ("drop", 5, {"no_answer_tokens": 1, "too_long": 2, "no_answer_tokens_after_truncation": 0}, 0),
    ("truncate", 6, {"no_answer_tokens": 1, "too_long": 0, "no_answer_tokens_after_truncation": 1}, 1),
]


def _overflow_records():
    short = {"prompt": "ab", "completion": "cd"}
    return [short, short, {"prompt": "p" * 10, "completion": "x" * 60},   # line 3: too long, answer survives cut
            short, {"prompt": "p" * 70, "completion": "x"},              # line 5: too long, answer cut away
            {"messages": [{"role": "user", "content": "no answer"}]},    # line 6: nothing to learn
            short, short]


@pytest.mark.parametrize("policy,num_packed,dropped,num_truncated", POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
def test_overflow_policies_and_accounting(tmp_path, policy, num_packed, dropped, num_truncated):
    write_jsonl(tmp_path / "train.jsonl", _overflow_records())
    cfg = make_cfg(tmp_path, packing={"packed_sequence_size": 64, "on_overflow": policy})
    ds = PackedSFTDataset(cfg.data.dataset_dir, prepare(cfg, progress=False))
    acc = ds.metadata["accounting"]
    assert acc["num_samples_read"] == 8 == acc["num_samples_packed"] + sum(acc["num_samples_dropped"].values())
    assert (acc["num_samples_packed"], acc["num_samples_dropped"], acc["num_samples_truncated"]) == (
        num_packed, dropped, num_truncated)
    lengths = [len(s["input_ids"]) for i in range(len(ds)) for s in ds[i]]
    assert len(lengths) == num_packed and max(lengths) <= 65
    if policy == "truncate":
        cut = [s for i in range(len(ds)) for s in ds[i] if s["sample_id"] == 2][0]
        assert len(cut["input_ids"]) == 65 and cut["loss_mask"][1:].sum() > 0


def test_overflow_error_lists_offenders(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", _overflow_records())
    cfg = make_cfg(tmp_path, packing={"packed_sequence_size": 64})
    with pytest.raises(DataError) as err:
        prepare(cfg, progress=False)
    message = str(err.value)
    assert "2 sample(s) are longer" in message
    assert f"{path}: line 3: THD length 71" in message and f"{path}: line 5: THD length 72" in message
    assert "packing.on_overflow=drop" in message and "packing.on_overflow=truncate" in message


OVERFLOW_FIXES = [  # (id, packing settings that overflow, the fix the message must name)
    ("pack-too-small", {"packed_sequence_size": 64}, "packing.packed_sequence_size=72"),
    ("max-length-below-pack", {"packed_sequence_size": 128, "max_single_sequence_length": 64},
     "packing.max_single_sequence_length=128"),
]


@pytest.mark.parametrize("packing,fix", [c[1:] for c in OVERFLOW_FIXES], ids=[c[0] for c in OVERFLOW_FIXES])
def test_overflow_fixes_each_work_as_written(tmp_path, packing, fix):
    """issue 11 item 7: every ``set key=value`` the overflow error names makes prepare succeed
    (raising max_single_sequence_length past the pack size was offered and could not work)."""
    import re

    write_jsonl(tmp_path / "train.jsonl", _overflow_records())
    with pytest.raises(DataError) as err:
        prepare(make_cfg(tmp_path, packing=packing), progress=False)
    fixes = re.findall(r"set (packing\.[a-z_]+)=([a-z0-9]+)", str(err.value))
    assert f"{fix.split('=')[0]}" in dict(fixes) and dict(fixes)[fix.split("=")[0]] == fix.split("=")[1], fixes
    assert len(fixes) >= 2  # truncate, and the way to keep them whole
    for key, value in fixes:
        name = key.split(".")[1]
        changed = {**packing, name: int(value) if value.isdigit() else value}
        if name == "packed_sequence_size":
            changed.pop("max_single_sequence_length", None)
        plan = prepare(make_cfg(tmp_path, packing=changed), progress=False)
        assert (plan / "metadata.json").is_file(), (key, value)


def test_idempotent_and_plans_share_the_store(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", mixed_records(50))
    cfg = make_cfg(tmp_path, packing={"packed_sequence_size": 128})
    plan_a = prepare(cfg, progress=False)
    stamps = {p: p.stat().st_mtime_ns for p in Path(cfg.data.dataset_dir).rglob("*") if p.is_file()}
    assert prepare(cfg, progress=False) == plan_a
    assert {p: p.stat().st_mtime_ns for p in Path(cfg.data.dataset_dir).rglob("*") if p.is_file()} == stamps
    plan_b = prepare(make_cfg(tmp_path, packing={"packed_sequence_size": 256, "seed": 3}), progress=False)
    assert plan_b != plan_a and plan_b.parent == plan_a.parent
    tokens = Path(cfg.data.dataset_dir) / "tokens.npy"
    assert tokens.stat().st_mtime_ns == stamps[tokens]  # re-planning never re-tokenizes
    assert len(PackedSFTDataset(cfg.data.dataset_dir, plan_b)) < len(PackedSFTDataset(cfg.data.dataset_dir, plan_a))


def test_store_arrays_and_metadata(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", mixed_records(20))
    cfg = make_cfg(tmp_path, packing={"packed_sequence_size": 128})
    prepare(cfg, progress=False)
    ds_dir = Path(cfg.data.dataset_dir)
    meta = json.loads((ds_dir / "metadata.json").read_text())
    tokens = np.load(ds_dir / "tokens.npy", mmap_mode="r", allow_pickle=False)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and len(tokens) == meta["num_tokens"]
    assert np.load(ds_dir / "source_line.npy", allow_pickle=False).tolist() == list(range(1, 21))
    assert meta["sources"]["files"][0]["path"] == str(path) and len(meta["sources"]["files"][0]["sha256"]) == 64
    assert set(meta["sample_num_ids_percentiles"]) == {"p50", "p90", "p95", "p99", "max"}
    assert 0 < meta["answer_token_share"] < 1 and meta["tokenizer"]["name"] == "byte"
    assert token_dtype_for(263) == np.uint16 and token_dtype_for(128_256) == np.int32


def test_ranks_other_than_zero_wait_then_verify(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", mixed_records(30))
    cfg = make_cfg(tmp_path, packing={"packed_sequence_size": 128})
    barrier = threading.Barrier(2)
    results = {}

    def run(rank):
        results[rank] = prepare(cfg, rank=rank, world_size=2, barrier=barrier.wait, progress=False)

    threads = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert results[0] == results[1] and (results[1] / "metadata.json").is_file()


def test_waiting_rank_fails_clearly_when_rank0_wrote_nothing(tmp_path):
    cfg = make_cfg(tmp_path, packing={"packed_sequence_size": 128})
    with pytest.raises(DataError, match="rank 0 did not leave a complete, verified dataset"):
        prepare(cfg, rank=1, world_size=2, barrier=lambda: None, verify_timeout_s=0.3)


KILL_SCRIPT = textwrap.dedent("""
    import sys
    from megatron_pack.config import Config, DataConfig, PackingConfig
    from megatron_pack.data.prepare import prepare
    cfg = Config(data=DataConfig(source="synthetic", synthetic_num_samples=int(sys.argv[2]), dataset_dir=sys.argv[1],
                                 tokenize_workers=1), packing=PackingConfig(packed_sequence_size=512))
    print(prepare(cfg, progress=False))
""")


@pytest.mark.slow
def test_killed_prepare_leaves_no_dataset(tmp_path):
    target = tmp_path / "ds"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(target), "400000"])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".ds.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert proc.poll() is None, "prepare finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not target.exists() and list(tmp_path.glob(".ds.tmp-*"))  # only the hidden temporary is left
    cfg = Config(data=DataConfig(source="synthetic", synthetic_num_samples=2000, dataset_dir=str(target),
                                 tokenize_workers=1), packing=PackingConfig(packed_sequence_size=512))
    assert len(PackedSFTDataset(target, prepare(cfg, progress=False))) > 0
    assert not list(tmp_path.glob(".ds.tmp-*"))  # the re-run removed the killed writer's temporary


def test_nothing_left_to_pack_is_an_error(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"messages": [{"role": "user", "content": "no answer"}]}] * 3)
    with pytest.raises(DataError, match=r"no sample .* is left to pack \(dropped: \{'no_answer_tokens': 3"):
        prepare(make_cfg(tmp_path, packing={"packed_sequence_size": 64}), progress=False)


def test_waiting_rank_reports_rank0_error_at_once(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a"}])
    cfg = make_cfg(tmp_path, packing={"packed_sequence_size": 64})
    barrier = threading.Barrier(2)
    errors = {}

    def run(rank):
        try:
            prepare(cfg, rank=rank, world_size=2, barrier=barrier.wait, verify_timeout_s=60, progress=False)
        except DataError as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
    start = time.monotonic()
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert time.monotonic() - start < 20  # not the 60 s verify timeout
    assert "missing key 'completion'" in errors[0]
    assert errors[1].startswith("rank 0 failed to prepare") and "missing key 'completion'" in errors[1]
    prepare(make_cfg(tmp_path, data={"input": str(write_jsonl(tmp_path / "ok.jsonl", mixed_records(5)))},
                     packing={"packed_sequence_size": 64}), progress=False)
    assert not list(tmp_path.glob(".ds.prepare-error.json"))  # a new rank-0 run clears the marker
