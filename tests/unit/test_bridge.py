"""export=bridge: Megatron-Bridge's packed parquet holds exactly our packs, read by Bridge as we train them.

Facts from Megatron-Bridge's source (src/megatron/bridge/data/packing/{algorithms,offline,gpt_sft}.py):
its packer pre-pads a sample (with pad_seq_to_mult > 1) with the tokenizer's eos id and loss mask 0,
then rolls the sample's answer mask by one (``x[1:] + [False]``, "to align with labels") before
writing it. Its packed collate cuts every sample at ``seq_start_id`` into ``tokens = ids[a:b-1]``,
``labels = ids[a+1:b]``, ``loss_mask = loss_mask[a:b-1]``: the stored mask is read as a mask over
labels. Its THD length is ``b - a - 1`` (CP-aligned: the export pre-pads to the plan's multiple);
with pad_seq_to_mult > 1 its real length ends after the last token that is not eos.
"""

import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_pack.config import Config, DataConfig, ModelConfig, PackingConfig, ParallelConfig, validate
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.packing.bridge import export_bridge
from megatron_pack.data.prepare import prepare
from megatron_pack.data.batches.thd import collate_thd

SIX_FIELDS = ("pack_size", "max_samples_per_bin", "dataset_max_seqlen", "min_packed_seqlen", "packing_factor",
              "packing_efficiency")
SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
                    ("seq_start_id", pa.list_(pa.int32()))])


def _export(tmp_path, cp: int):
    cfg = Config(data=DataConfig(source="synthetic", synthetic_num_samples=200, dataset_dir=str(tmp_path / f"ds{cp}"),
                                 tokenize_workers=1),
                 packing=PackingConfig(packed_sequence_size=256, export="bridge"),
                 parallel=ParallelConfig(context_parallel_size=cp))
    plan_dir = prepare(cfg, progress=False)
    return PackedSFTDataset(cfg.data.dataset_dir, plan_dir), plan_dir


def _bridge_read(row: dict, *, eos_id: int, multiple: int) -> list[dict]:
    """One parquet row as Megatron-Bridge's GPTSFTPackedDataset.collate_fn reads it (answer_only_loss), per sample.

    Written here from Bridge's source, sharing no code with the export: with boundaries
    ``b = seq_start_id + [len(input_ids)]``, sample ``j`` gives ``tokens = input_ids[b[j]:b[j+1]-1]``,
    ``labels = input_ids[b[j]+1:b[j+1]]``, ``loss_mask = loss_mask[b[j]:b[j+1]-1]``; its THD length is
    ``b[j+1] - b[j] - 1`` and, with ``pad_seq_to_mult > 1``, its real length ends after the last
    token that is not eos.
    """
    ids, mask = list(row["input_ids"]), list(row["loss_mask"])
    bounds = list(row["seq_start_id"]) + [len(ids)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        tokens = ids[a:b - 1]
        real = b - a - 1
        if multiple > 1:
            not_eos = [i for i, t in enumerate(tokens) if t != eos_id]
            real = not_eos[-1] + 1 if not_eos else 0
        out.append({"tokens": tokens, "labels": ids[a + 1:b], "loss_mask": mask[a:b - 1], "real": real})
    return out


# Hand-computed: bos 1, eos 2, end-of-turn 3, pad 0. Sample 0 is two assistant turns, sample 1 one.
HAND_IDS = ([1, 10, 20, 3, 11, 21, 2], [1, 12, 22, 2])
HAND_MASK = ([0, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1])  # the answer mask, aligned with ids
HAND_ROWS = {  # what Bridge's own packer writes for these samples: mask rolled by one, eos pre-padding
    1: {"input_ids": [1, 10, 20, 3, 11, 21, 2, 1, 12, 22, 2],
        "loss_mask": [0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0], "seq_start_id": [0, 7]},
    4: {"input_ids": [1, 10, 20, 3, 11, 21, 2, 2, 2, 1, 12, 22, 2, 2],
        "loss_mask": [0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0], "seq_start_id": [0, 9]},
}
HAND_READ = {  # what Bridge's collate then trains on: every answer target (20 3 21 2, 22 2), and nothing else
    1: [{"tokens": [1, 10, 20, 3, 11, 21], "labels": [10, 20, 3, 11, 21, 2], "loss_mask": [0, 1, 1, 0, 1, 1], "real": 6},
        {"tokens": [1, 12, 22], "labels": [12, 22, 2], "loss_mask": [0, 1, 1], "real": 3}],
    4: [{"tokens": [1, 10, 20, 3, 11, 21, 2, 2], "labels": [10, 20, 3, 11, 21, 2, 2, 2],
         "loss_mask": [0, 1, 1, 0, 1, 1, 0, 0], "real": 6},
        {"tokens": [1, 12, 22, 2], "labels": [12, 22, 2, 2], "loss_mask": [0, 1, 1, 0], "real": 3}],
}


def _hand_export(tmp_path, multiple: int):
    ids, mask = np.concatenate(HAND_IDS), np.concatenate(HAND_MASK).astype(np.uint8)
    store = SimpleNamespace(tokens=ids, answer_mask=mask, offsets=np.array([0, 7, 11]))
    np.save(tmp_path / "sample_order.npy", np.array([0, 1]))
    np.save(tmp_path / "sample_num_ids.npy", np.array([7, 4]))
    np.save(tmp_path / "bin_offsets.npy", np.array([0, 2]))
    meta = {"pack_size": 16, "max_samples_per_bin": 2, "dataset_max_seqlen": 6, "min_packed_seqlen": 9,
            "packing_factor": 2.0, "packing_efficiency": 56.25, "pad_seq_to_mult": multiple, "pad_id": 0, "eos_id": 2}
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    parquet_path, _ = export_bridge(store, tmp_path)
    return pq.read_table(parquet_path).to_pylist()


@pytest.mark.parametrize("multiple", [1, 4], ids=["cp1", "cp2"])
def test_hand_computed_two_samples_are_written_and_read_as_bridge_does(tmp_path, multiple):
    rows = _hand_export(tmp_path, multiple)
    assert rows == [HAND_ROWS[multiple]]
    assert _bridge_read(rows[0], eos_id=2, multiple=multiple) == HAND_READ[multiple]


def _compare_every_sample(ds, plan_dir, pack_size: int) -> dict:
    """Bridge's reading of every stored sample against our THD batch of the same pack: counts of
    answer targets lost and gained, real lengths misread, and what was checked (for the guards)."""
    multiple, eos_id = ds.metadata["pad_seq_to_mult"], ds.metadata["eos_id"]
    rows = pq.read_table(plan_dir / f"training_{pack_size}.idx.parquet").to_pylist()
    assert len(rows) == len(ds) > 10
    n = dict.fromkeys(("samples", "targets", "late_answers", "lost", "wrong", "bad_length", "pieces"), 0)
    for i, row in enumerate(rows):
        batch = collate_thd(ds[i], pack_size=pack_size, pad_multiple=multiple, pad_id=ds.metadata["pad_id"])
        cu_real, cu_padded = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
        read = _bridge_read(row, eos_id=eos_id, multiple=multiple)
        assert len(read) == len(cu_padded) - 1 == len(ds[i])
        for j, theirs in enumerate(read):
            lo, hi, real = cu_padded[j], cu_padded[j + 1], cu_real[j + 1] - cu_real[j]
            ours_mask = batch["loss_mask"][0, lo:hi].to(int).tolist()
            assert len(theirs["tokens"]) == hi - lo
            n["lost"] += sum(o == 1 and t == 0 for o, t in zip(ours_mask, theirs["loss_mask"]))
            n["wrong"] += sum(o == 0 and t == 1 for o, t in zip(ours_mask, theirs["loss_mask"]))
            n["bad_length"] += theirs["real"] != real
            assert theirs["tokens"][:real] == batch["tokens"][0, lo:lo + real].tolist()
            assert theirs["labels"][:real] == batch["labels"][0, lo:lo + real].tolist()
            n["samples"] += 1
            n["targets"] += sum(ours_mask)
            n["late_answers"] += any(ours_mask[1:]) and ours_mask[0] == 0  # a prompt: a roll would show
            n["pieces"] += ds[i][j].get("piece", 0) > 0
    return n


@pytest.mark.parametrize("cp", [1, 2, 4], ids=["cp1", "cp2", "cp4"])
def test_bridge_reader_gives_our_thd_batch_for_every_sample(tmp_path, cp):
    ds, plan_dir = _export(tmp_path, cp=cp)
    n = _compare_every_sample(ds, plan_dir, 256)
    assert n["samples"] > 50 and n["targets"] > 1000 and n["late_answers"] > n["samples"] // 2  # guards
    assert (n["lost"], n["wrong"], n["bad_length"]) == (0, 0, 0), (
        f"Bridge drops {n['lost']} of our {n['targets']} answer targets, trains {n['wrong']} targets we mask, "
        f"and reads {n['bad_length']} of {n['samples']} real lengths wrong")


def test_cp1_export_is_the_rolled_mask_samples_byte_for_byte(tmp_path):
    ds, plan_dir = _export(tmp_path, cp=1)
    assert ds.metadata["pad_seq_to_mult"] == 1
    rows = [{"input_ids": np.concatenate([s["input_ids"] for s in pack]).astype(np.int32),
             "loss_mask": np.concatenate([np.append(s["loss_mask"][1:], 0) for s in pack]).astype(np.uint8),
             "seq_start_id": np.cumsum([0] + [len(s["input_ids"]) for s in pack[:-1]]).astype(np.int32)}
            for pack in (ds[i] for i in range(len(ds)))]
    assert len(rows) > 10 and sum(len(r["seq_start_id"]) > 1 for r in rows) > 5
    expected = tmp_path / "expected.parquet"
    with pq.ParquetWriter(expected, SCHEMA, compression="zstd") as writer:
        writer.write_table(pa.table([pa.array([r[k] for r in rows], type=f.type) for k, f in zip(
            ("input_ids", "loss_mask", "seq_start_id"), SCHEMA)], schema=SCHEMA))
    assert (plan_dir / "training_256.idx.parquet").read_bytes() == expected.read_bytes()
    meta_text = (plan_dir / "256_metadata.jsonl").read_text()
    assert meta_text == json.dumps([{k: ds.metadata[k] for k in SIX_FIELDS}]) + "\n"


@pytest.mark.parametrize("cp", [2, 4], ids=["cp2", "cp4"])
def test_cp_export_stores_samples_prepadded_to_the_plan_multiple(tmp_path, cp):
    ds, plan_dir = _export(tmp_path, cp=cp)
    multiple, eos_id = ds.metadata["pad_seq_to_mult"], ds.metadata["eos_id"]
    assert multiple == 2 * cp
    rows = pq.read_table(plan_dir / "training_256.idx.parquet").to_pylist()
    assert len(rows) == len(ds) > 10
    num_samples = num_padded = 0
    for i, row in enumerate(rows):
        pack = ds[i]
        bounds = row["seq_start_id"] + [len(row["input_ids"])]
        assert len(bounds) == len(pack) + 1 and len(row["loss_mask"]) == len(row["input_ids"]) <= 256 + len(pack)
        for j, sample in enumerate(pack):
            stored_ids = row["input_ids"][bounds[j]:bounds[j + 1]]
            stored_mask = row["loss_mask"][bounds[j]:bounds[j + 1]]
            n = len(sample["input_ids"])
            assert (len(stored_ids) - 1) % multiple == 0, f"pack {i} sample {j}: length {len(stored_ids)}"
            assert len(stored_ids) - 1 - (n - 1) < multiple  # no more padding than needed
            assert stored_ids[:n] == sample["input_ids"].tolist()
            assert stored_mask[:n - 1] == sample["loss_mask"][1:].tolist()  # rolled by one, as Bridge's packer
            assert set(stored_ids[n:]) <= {eos_id} and set(stored_mask[n - 1:]) == {0}
            num_samples += 1
            num_padded += len(stored_ids) > n
        # Bridge's THD lengths (stored length - 1) are our THD batch's padded boundaries
        ours = collate_thd(pack, pack_size=256, pad_multiple=multiple)["cu_seqlens_padded"].tolist()
        assert np.cumsum([0] + (np.diff(bounds) - 1).tolist()).tolist() == ours
    assert num_padded >= num_samples // 4 > 0  # guard: many samples really needed padding
    meta = json.loads((plan_dir / "256_metadata.jsonl").read_text())
    assert isinstance(meta, list) and len(meta) == 1
    assert meta[0]["pad_seq_to_mult"] == multiple and meta[0]["dataset_max_seqlen"] % multiple == 0
    longest = max(len(r["input_ids"][a:b]) - 1 for r in rows
                  for a, b in zip(r["seq_start_id"], r["seq_start_id"][1:] + [len(r["input_ids"])]))
    assert meta[0]["dataset_max_seqlen"] == longest
    assert {k: meta[0][k] for k in SIX_FIELDS if k != "dataset_max_seqlen"} == {
        k: ds.metadata[k] for k in SIX_FIELDS if k != "dataset_max_seqlen"}


# --- split pieces and wrapped rows ---------------------------------------------------------------

# Hand-computed: one sample of 7 ids split at 4 positions with overlap 1 (split.split_spans(7, 4, 1) =
# [(0, 5), (3, 4)]): piece 1 repeats id 12 and 13 as context, and its repeated target 13 is masked.
PIECE_IDS = [1, 10, 11, 12, 13, 14, 2]
PIECE_MASK = [0, 0, 1, 1, 1, 1, 1]
PIECE_ROWS = {
    1: {"input_ids": [1, 10, 11, 12, 13, 12, 13, 14, 2], "loss_mask": [0, 1, 1, 1, 0, 0, 1, 1, 0],
        "seq_start_id": [0, 5]},
    4: {"input_ids": [1, 10, 11, 12, 13, 12, 13, 14, 2, 2], "loss_mask": [0, 1, 1, 1, 0, 0, 1, 1, 0, 0],
        "seq_start_id": [0, 5]},
}
PIECE_READ = {  # every answer target (11 12 13 14 2) once: 13 in piece 0, not again in piece 1
    1: [{"tokens": [1, 10, 11, 12], "labels": [10, 11, 12, 13], "loss_mask": [0, 1, 1, 1], "real": 4},
        {"tokens": [12, 13, 14], "labels": [13, 14, 2], "loss_mask": [0, 1, 1], "real": 3}],
    4: [{"tokens": [1, 10, 11, 12], "labels": [10, 11, 12, 13], "loss_mask": [0, 1, 1, 1], "real": 4},
        {"tokens": [12, 13, 14, 2], "labels": [13, 14, 2, 2], "loss_mask": [0, 1, 1, 0], "real": 3}],
}


def _piece_export(tmp_path, ids, mask, spans, multiple: int, overlap: int, **meta):
    """Export one pack holding the pieces ``spans`` ((start, num_ids) of sample 0) as a split plan does."""
    store = SimpleNamespace(tokens=np.array(ids), answer_mask=np.array(mask, dtype=np.uint8),
                            offsets=np.array([0, len(ids)]))
    arrays = {"sample_order": np.zeros(len(spans), np.int64), "sample_num_ids": np.array([n for _, n in spans]),
              "bin_offsets": np.array([0, len(spans)]), "sample_start": np.array([s for s, _ in spans]),
              "sample_piece": np.arange(len(spans), dtype=np.int32)}
    for name, array in arrays.items():
        np.save(tmp_path / f"{name}.npy", array)
    (tmp_path / "metadata.json").write_text(json.dumps({
        "pack_size": 16, "max_samples_per_bin": len(spans), "dataset_max_seqlen": 4, "min_packed_seqlen": 7,
        "packing_factor": 2.0, "packing_efficiency": 50.0, "pad_seq_to_mult": multiple, "pad_id": 0, "eos_id": 2,
        "split_overlap": overlap, "files": {f"{name}.npy": {} for name in arrays}, **meta}))
    return export_bridge(store, tmp_path)


@pytest.mark.parametrize("multiple", [1, 4], ids=["cp1", "cp2"])
def test_hand_computed_split_pieces_are_written_and_read_as_our_thd_batch(tmp_path, multiple):
    from megatron_pack.data.packing.split import split_spans

    spans = split_spans(len(PIECE_IDS), 4, 1)
    assert spans == [(0, 5), (3, 4)]
    parquet_path, _ = _piece_export(tmp_path, PIECE_IDS, PIECE_MASK, spans, multiple, overlap=1)
    rows = pq.read_table(parquet_path).to_pylist()
    assert rows == [PIECE_ROWS[multiple]]
    read = _bridge_read(rows[0], eos_id=2, multiple=multiple)
    assert read == PIECE_READ[multiple]
    trained = [t for r in read for t, m in zip(r["labels"], r["loss_mask"]) if m]
    assert trained == [11, 12, 13, 14, 2]  # each answer target once


def test_piece_ending_in_eos_is_refused_only_with_a_pad_multiple(tmp_path):
    """A piece cut right after an eos inside its sample: with pad_seq_to_mult > 1 Bridge ends the
    real length at the last input that is not eos, so it would read that piece one token short."""
    ids, mask, spans = [1, 10, 2, 11, 12, 2], [0, 1, 1, 1, 1, 1], [(0, 4), (3, 3)]  # piece 0 inputs [1, 10, 2]
    (tmp_path / "m4").mkdir()
    with pytest.raises(DataError, match=r"1 packed piece\(s\) end with eos \(id 2\).*pack 0, entry 0, store sample "
                                        r"0, piece 0.*set packing.export=none"):
        _piece_export(tmp_path / "m4", ids, mask, spans, 4, overlap=0)
    assert not list((tmp_path / "m4").glob("*parquet*"))  # nothing half-written
    (tmp_path / "m1").mkdir()
    parquet_path, _ = _piece_export(tmp_path / "m1", ids, mask, spans, 1, overlap=0)
    read = _bridge_read(pq.read_table(parquet_path).to_pylist()[0], eos_id=2, multiple=1)
    assert [r["real"] for r in read] == [3, 2] and read[0]["tokens"] == [1, 10, 2]


def test_cross_rows_are_refused(tmp_path):
    with pytest.raises(DataError, match="cannot carry packing.wrapped_attention=cross"):
        _piece_export(tmp_path, PIECE_IDS, PIECE_MASK, [(0, 5), (3, 4)], 1, overlap=0, wrapped_attention="cross")


def _strategy_export(tmp_path, strategy: str, cp: int):
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    records = [{"prompt": "".join(rng.choice(letters, int(rng.integers(1, 30)))),
                "completion": "".join(rng.choice(letters, int(rng.integers(1, 140))))} for _ in range(120)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    packing = (dict(on_overflow="split", split_overlap=8) if strategy == "split"
               else dict(algorithm="wrapped", wrapped_attention="document"))
    cfg = Config(data=DataConfig(source="files", input=str(tmp_path / "t.jsonl"), dataset_dir=str(tmp_path / "ds"),
                                 tokenize_workers=1),
                 packing=PackingConfig(packed_sequence_size=64, export="bridge", **packing),
                 model=ModelConfig(seq_length=64), parallel=ParallelConfig(context_parallel_size=cp))
    validate(cfg)
    plan_dir = prepare(cfg, progress=False)
    return PackedSFTDataset(cfg.data.dataset_dir, plan_dir), plan_dir


@pytest.mark.parametrize("strategy,cp", [(s, cp) for s in ("split", "wrapped") for cp in (1, 2, 4)],
                         ids=[f"{s}-cp{cp}" for s in ("split", "wrapped") for cp in (1, 2, 4)])
def test_bridge_reader_gives_our_thd_batch_for_every_piece(tmp_path, strategy, cp):
    ds, plan_dir = _strategy_export(tmp_path, strategy, cp)
    assert ds.metadata["pad_seq_to_mult"] == (2 * cp if cp > 1 else 1)
    n = _compare_every_sample(ds, plan_dir, 64)
    # guards: many pieces after the first (with split, their overlap targets are masked), many prompts
    assert n["pieces"] > 40 and n["targets"] > 2000 and n["late_answers"] > n["samples"] // 3
    assert (n["lost"], n["wrong"], n["bad_length"]) == (0, 0, 0), (
        f"Bridge drops {n['lost']} of our {n['targets']} answer targets, trains {n['wrong']} targets we mask, "
        f"and reads {n['bad_length']} of {n['samples']} real lengths wrong")
    meta = json.loads((plan_dir / "64_metadata.jsonl").read_text())[0]
    rows = pq.read_table(plan_dir / "training_64.idx.parquet").to_pylist()
    longest = max(b - a - 1 for r in rows
                  for a, b in zip(r["seq_start_id"], r["seq_start_id"][1:] + [len(r["input_ids"])]))
    assert meta["dataset_max_seqlen"] == longest and meta["max_samples_per_bin"] == max(len(ds[i]) for i in range(len(ds)))
