"""Checkpoint manifests and the choice of checkpoint, on plain files (no torch, no DCP).

A checkpoint folder here is a few files and the manifest written over them; the real trainer's
folders are checked the same way in tests/functional/test_reliability_signals.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_pack.training.checkpoint_files import (SHARDED_FORMAT, DamagedCheckpoint, checkpoint_problems,
                                                     choose_checkpoint, digest, find_latest, verified_checkpoint,
                                                     write_manifest)


def _checkpoint(root: Path, step: int, *, latest: bool = True) -> Path:
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": step, "format": SHARDED_FORMAT}))
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)  # model bytes 0-599, optimizer 600-1023
    (folder / "rank_00000.pt").write_bytes(b"rank state")
    files = {n: digest(folder / n) for n in ("meta.json", "rank_00000.pt")}
    files["__0_0.distcp"] = digest(folder / "__0_0.distcp", {"model": 600, "optimizer": 1024})
    write_manifest(folder, files)
    if latest:
        (root / "latest").write_text(folder.name)
    return folder


def _cut(at: int):
    def damage(folder: Path) -> None:
        os.truncate(folder / "__0_0.distcp", at)
    return damage


def _flip(folder: Path) -> None:
    raw = bytearray((folder / "__0_0.distcp").read_bytes())
    raw[10] ^= 0xFF
    (folder / "__0_0.distcp").write_bytes(bytes(raw))


# (id, damage, fragment of the one problem; None: intact)
CASES = [
    ("intact", lambda f: None, None),
    ("optimizer-cut", _cut(800), "has 800 bytes, its manifest records 1,024 (truncated; its optimizer tensors are cut "
                                 "(model intact))"),
    ("model-cut", _cut(100), "(truncated; its model and optimizer tensors are cut)"),
    ("flipped", _flip, "__0_0.distcp (model and optimizer tensors) does not match the sha256"),
    ("missing-file", lambda f: (f / "rank_00000.pt").unlink(), "rank_00000.pt is missing (its manifest lists it)"),
    ("no-manifest", lambda f: (f / "manifest.json").unlink(), "has no manifest.json: it is incomplete"),
    ("bad-manifest", lambda f: (f / "manifest.json").write_text("{"), "manifest.json is damaged"),
]


@pytest.mark.parametrize("damage,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_checkpoint_problems(tmp_path, damage, fragment):
    folder = _checkpoint(tmp_path, 1)
    damage(folder)
    problems = checkpoint_problems(folder)
    assert (problems == []) == (fragment is None), problems
    if fragment:
        assert len(problems) == 1 and fragment in problems[0] and problems[0].startswith(f"checkpoint {folder}")


def test_sizes_only_misses_a_flip_and_shares_split_the_hashing(tmp_path):
    folder = _checkpoint(tmp_path, 1)
    _flip(folder)
    assert checkpoint_problems(folder, checksums=False) == []
    names = sorted(json.loads((folder / "manifest.json").read_text())["files"])
    shares = [checkpoint_problems(folder, share=(r, 2)) for r in range(2)]
    owner = names[0::2] if "__0_0.distcp" in names[0::2] else names[1::2]
    assert sum(bool(s) for s in shares) == 1 and "__0_0.distcp" in owner  # exactly one rank hashed the file


def test_choose_passes_over_damaged_newer_checkpoints(tmp_path):
    older, newer = _checkpoint(tmp_path, 1), _checkpoint(tmp_path, 2)
    assert find_latest(tmp_path) == newer
    _cut(5)(newer)
    chosen, skipped = choose_checkpoint(tmp_path)
    assert chosen == older and len(skipped) == 1 and str(newer) in skipped[0]
    _cut(5)(older)
    assert choose_checkpoint(tmp_path)[0] is None and len(choose_checkpoint(tmp_path)[1]) == 2


def test_latest_pointer_goes_first(tmp_path):
    first = _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2, latest=False)  # a save killed before the pointer moved
    assert find_latest(tmp_path) == first


def test_verified_checkpoint_names_the_file_and_the_intact_one(tmp_path):
    older, newer = _checkpoint(tmp_path, 1), _checkpoint(tmp_path, 2)
    assert verified_checkpoint(tmp_path, "export.checkpoint") == newer
    _flip(newer)
    for given in (tmp_path, newer):
        with pytest.raises(DamagedCheckpoint) as info:
            verified_checkpoint(given, "export.checkpoint")
        message = str(info.value)
        assert "__0_0.distcp" in message and f"step_00000001 beside it is intact: export.checkpoint={older}" in message
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        verified_checkpoint(tmp_path / "nothing", "export.checkpoint")
