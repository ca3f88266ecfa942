"""A Hugging Face datasets folder as ``data.input`` (issue 43 item 10): ``megatron-pack prepare`` reads what
``Dataset.save_to_disk`` wrote (Arrow shards, with pyarrow alone) into the same token store as the same records in
JSONL, a ``DatasetDict`` folder with ``data.split=`` (or its split's folder), and refuses a wrong split in one line.

The folders in tests/fixtures/hf_datasets were written by the ``datasets`` package (``make.py`` there), so the reader
is held to what ``datasets`` writes, not to our idea of it (``datasets`` is not a test dependency: it pulls pandas).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _user_path import run_cli  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_datasets"
PREPARE = ["data=files", "data.tokenizer=byte", "packing.packed_sequence_size=256", "data.validation_fraction=0"]
STORE = ("tokens.npy", "answer_mask.npy", "offsets.npy", "num_targets.npy")

# data.input (and data.split) -> the JSONL holding the same records, in the same order
READS = {
    "dataset-2-shards": (["data.input=chat"], "chat.jsonl", 5),
    "dict-split-train": (["data.input=pc_dict", "data.split=train"], "pc_train.jsonl", 6),
    "dict-split-test": (["data.input=pc_dict", "data.split=test"], "pc_test.jsonl", 1),
    "dict-split-folder": (["data.input=pc_dict/train"], "pc_train.jsonl", 6),
}
# data.input (and data.split) -> the one line prepare prints (exit status 2)
REFUSALS = {
    "dict-without-split": (["data.input=pc_dict"], "is a DatasetDict folder and data.split is not set; set data.split "
                                                   "to one of ['train', 'test']."),
    "unknown-split": (["data.input=pc_dict", "data.split=validation"],
                      "data.split ('validation') is not one of its splits; set data.split to one of ['train', 'test']."),
    "split-of-a-dataset-folder": (["data.input=chat", "data.split=train"],
                                  "is a Dataset folder (one split, no dataset_dict.json); set data.split=null."),
    "split-of-a-jsonl-file": (["data.input=chat.jsonl", "data.split=train"],
                              "is not a DatasetDict folder (no dataset_dict.json); set data.split=null"),
}


@pytest.fixture
def root(tmp_path):
    shutil.copytree(FIXTURES, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _prepare(root: Path, name: str, *overrides: str) -> dict[str, np.ndarray]:
    status, out = run_cli(root, "prepare", *PREPARE, f"data.dataset_dir={name}", *overrides)
    assert status == 0, out
    return {f: np.load(root / name / f) for f in STORE}


@pytest.mark.parametrize("overrides,jsonl,num_records", READS.values(), ids=list(READS))
def test_prepare_reads_a_datasets_folder_like_its_jsonl(root, overrides, jsonl, num_records):
    store = _prepare(root, "from_folder", *overrides)
    expected = _prepare(root, "from_jsonl", f"data.input={jsonl}")
    assert len(store["offsets.npy"]) == num_records + 1  # every record
    for name in STORE:
        assert np.array_equal(store[name], expected[name]), name


@pytest.mark.parametrize("overrides,message", REFUSALS.values(), ids=list(REFUSALS))
def test_a_wrong_split_is_one_line(root, overrides, message):
    status, out = run_cli(root, "prepare", *PREPARE, "data.dataset_dir=ds", *overrides)
    lines = [line for line in out.splitlines() if "data.split" in line]
    assert status == 2 and "Traceback" not in out, out
    assert len(lines) == 1 and message in lines[0], out

