"""Corrupt or mismatched prepared datasets are refused by the train entry before training starts.

Each case damages a copy of one prepared dataset (or prepares a mismatched one), then calls the
real entry ``megatron_pack.cli.train.main`` in-process with a world size of 2. It must exit with
status 2, print ``megatron-pack train: <reason and fix>``, leave torch.distributed uninitialised
and create no run directory: nothing was built, no step ran. (Damage found by the dataset
reader itself is also unit-tested in tests/unit/test_dataset.py::test_detects_damage.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

BASE = ["experiment=quickstart", "data.synthetic_num_samples=120"]


def _prepare(dataset_dir: Path, *overrides: str) -> Path:
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    return prepare(load_config(BASE + [f"data.dataset_dir={dataset_dir}", *overrides]), progress=False)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One good dataset, a second plan in its store, and a second store with the same settings."""
    root = tmp_path_factory.mktemp("reliability_datasets")
    plan = _prepare(root / "good")
    other_plan = _prepare(root / "good", "packing.seed=3")  # same store (synthetic records depend on the pack size)
    foreign_plan = _prepare(root / "foreign", "data.synthetic_seed=7")
    return root, plan, other_plan, foreign_plan


def _flip_byte(path: Path, offset_from_end: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_json(path: Path, **changes) -> None:
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def _edit_manifest(path: Path, **changes) -> None:
    meta = json.loads(path.read_text())
    meta["manifest"].update(changes)
    path.write_text(json.dumps(meta))


def _truncate(ds: Path, plan: Path, **_) -> None:
    tokens = ds / "tokens.npy"
    tokens.write_bytes(tokens.read_bytes()[: tokens.stat().st_size // 2])


def _plan_from_another_store(ds: Path, plan: Path, foreign_plan: Path, **_) -> None:
    shutil.rmtree(plan)
    shutil.copytree(foreign_plan, plan)  # the foreign plan, under the name this store's config expects


def _metadata_from_another_plan(ds: Path, plan: Path, other_plan: Path, **_) -> None:
    shutil.copy(ds / "plans" / other_plan.name / "metadata.json", plan / "metadata.json")


def _plan_renamed(ds: Path, plan: Path, other_plan: Path, **_) -> None:
    shutil.rmtree(plan)
    shutil.copytree(ds / "plans" / other_plan.name, plan)  # a whole, self-consistent plan of another seed


def _hf_tokenizer(directory: Path) -> Path:
    """A tiny local Hugging Face tokenizer (word level), so no download is needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "copy", "sort", "add", "reverse"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(directory)
    return directory


# id, damage(ds, plan, ...) or None, extra overrides, world size, fragments of the refusal. The store holds two
# plans (seeds 0 and 3): the damage cases name theirs with data.plan; the others (no damage) are picked by keys.
CASES = [
    ("truncated-token-file", _truncate, [], "2", ["is damaged", "tokens.npy has", "metadata says",
                                                  "Delete it and re-run `megatron-pack prepare`"]),
    ("flipped-bytes-tokens", lambda ds, plan, **_: _flip_byte(ds / "tokens.npy"), [], "2",
     ["is damaged", "tokens.npy sha256", "differs from metadata"]),
    ("flipped-bytes-plan", lambda ds, plan, **_: _flip_byte(plan / "sample_order.npy"), [], "2",
     ["is damaged", "sample_order.npy sha256", "differs from metadata"]),
    ("metadata-from-another-plan", _metadata_from_another_plan, [], "2",
     ["is damaged", "differs from metadata", "re-run `megatron-pack prepare`"]),
    ("plan-of-other-settings-renamed", _plan_renamed, [], "2",
     ["is damaged", "is not the one its folder name ends with (the folder was renamed, or another plan copied "
      "into it)", "Delete it and re-run `megatron-pack prepare"]),
    ("plan-from-another-store", _plan_from_another_store, [], "2",
     ["was made for another token store", "re-run `megatron-pack prepare`"]),
    ("future-store-version", lambda ds, plan, **_: _edit_json(ds / "metadata.json", format_version=99), [], "2",
     ["version 99", "reads 'megatron_pack.token_store' version 1", "re-run `megatron-pack prepare`"]),
    ("future-plan-version", lambda ds, plan, **_: _edit_json(plan / "metadata.json", format_version=99), [], "2",
     ["version 99", "reads 'megatron_pack.packing_plan' version 2", "re-run `megatron-pack prepare`"]),
    ("edited-plan-pack-size", lambda ds, plan, **_: _edit_json(plan / "metadata.json", pack_size=1024), [], "2",
     ["is damaged", "metadata field pack_size (1024) differs from its manifest (512)",
      "Delete it and re-run `megatron-pack prepare"]),
    ("edited-plan-manifest", lambda ds, plan, **_: _edit_manifest(plan / "metadata.json", **{"packing.seed": 3}),
     [], "2", ["is damaged", "its manifest hashes to fingerprint", "(the manifest was edited)"]),
    ("tokenizer-differs", None, ["data.tokenizer={hf}"], "2",
     ["was tokenized with tokenizer 'byte'", "but training uses", "set data.tokenizer (and data.chat_template) to what the dataset was prepared with"]),
    ("pack-size-not-seq-length", None, ["model.seq_length=256"], "2",
     ["no plan in", "was made with model.seq_length=256 (plans there: pack512_",
      "packing.packed_sequence_size=512", "drop those keys"]),
    ("pack-size-not-prepared", None, ["packing.packed_sequence_size=1024", "model.seq_length=1024"], "2",
     ["was made with packing.packed_sequence_size=1024", "megatron-pack prepare data.dataset_dir="]),
    ("pad-multiple-changed", None, ["parallel=cp4"], "4",
     ["pad each sample to 4 tokens", "(cp=4, tp=1) needs a multiple of 8",
      "`megatron-pack prepare data.dataset_dir="]),
]


@pytest.mark.parametrize("damage,overrides,world_size,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_training_starts(prepared, tmp_path, monkeypatch, capsys, damage, overrides, world_size,
                                        fragments):
    from megatron_pack.cli.train import main

    root, plan, other_plan, foreign_plan = prepared
    ds = tmp_path / "ds"
    shutil.copytree(root / "good", ds)
    if damage is not None:
        damage(ds, ds / "plans" / plan.name, other_plan=other_plan, foreign_plan=foreign_plan)
    hf = _hf_tokenizer(tmp_path / "hf") if any("{hf}" in o for o in overrides) else None
    monkeypatch.setenv("WORLD_SIZE", world_size)
    monkeypatch.setenv("RANK", "0")
    named = [f"data.plan={plan.name}"] if damage is not None or hf is not None else []
    argv = (BASE + [f"data.dataset_dir={ds}", f"train.output_dir={tmp_path}/run"] + named
            + [o.format(hf=hf) for o in overrides])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-pack train:"), err
    for fragment in fragments:
        assert fragment in err, err
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_the_undamaged_copy_is_accepted(prepared, tmp_path, monkeypatch, capsys):
    """Guard: the refusals above come from the damage, not from the setup (the same entry, the same plan)."""
    from megatron_pack.cli.train import main
    from megatron_pack.config import load_config, validate
    from megatron_pack.data.batches.opening import open_dataset

    root, plan, *_ = prepared
    shutil.copytree(root / "good", tmp_path / "ds")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["--check", *BASE, f"data.dataset_dir={tmp_path / 'ds'}", f"data.plan={plan.name}",
                 f"train.output_dir={tmp_path / 'run'}"]) == 0  # never the working folder's runs/quickstart
    assert "config ok for 2 rank(s)" in capsys.readouterr().out
    cfg = load_config(BASE + [f"data.dataset_dir={tmp_path / 'ds'}"], world_size=2)
    dataset = open_dataset(cfg)
    validate(cfg, world_size=2, dataset_meta=dict(dataset.metadata))
    assert dataset.plan_dir.name == plan.name and len(dataset) > 5
