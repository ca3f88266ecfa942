"""A checkpoint's files: its manifest, how it is verified, and which checkpoint a run may use (torch-free).

Every checkpoint folder ends with ``manifest.json``, written after every other file (by rank 0,
before the folder is renamed into place)::

    {"format": "megatron_pack.checkpoint_manifest/1", "algorithm": "sha256",
     "files": {"__0_0.distcp": {"size": 1048576, "sha256": "9f2c...", "holds": {"model": 524288, "optimizer": 1048576}},
               "rank_00000.pt": {"size": 4399, "sha256": "..."}, ".metadata": {...}, "meta.json": {...}}}

``holds`` maps each part a DCP file stores to the end of its last byte there, so a truncated file
says which part the cut reached ("its optimizer tensors are cut; its model tensors are intact").
A folder without a readable manifest is incomplete and never resumed from.

Verifying: :func:`checkpoint_problems` checks that every listed file is there with its size
(``checksums=False``: a stat per file, what ``train --check`` does before launch) and its sha256
(``checksums=True``: what resume, ``load_weights_only``, ``export`` and ``verify`` do before they read
it; a resume spreads the files over its ranks, each hashing ``files[rank::world]``). Each problem is
one line naming the file. :func:`choose_checkpoint` walks a ``checkpoint.save`` folder newest first
(the ``latest`` pointer's target before the others) and returns the first intact checkpoint with a
line for every newer one it passed over.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Optional

from megatron_pack.data.store.atomic import sha256_file

LATEST = "latest"
META = "meta.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatron_pack.checkpoint_manifest/1"
SHARDED_FORMAT = "megatron_pack.sharded/1"
"""``meta.json`` ``format`` of checkpoints written by global identity, the only one written and read
(``check_format`` refuses a folder of another or no format)."""
_OWNER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")
"""Files a rank writes itself: DCP's ``__<rank>_<n>.distcp`` and our ``rank_<rank>.pt``."""


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / META).read_text(encoding="utf-8"))


def owner(name: str, world_size: int) -> int:
    """The rank that hashes file ``name`` when it is saved: the rank that wrote it, else rank 0."""
    match = _OWNER.match(name)
    rank = int(next(g for g in match.groups() if g is not None)) if match else 0
    return rank if rank < world_size else 0


def digest(path: Path, holds: Optional[dict[str, int]] = None) -> dict:
    """``{"size", "sha256"}`` of one file (``holds``: the parts it stores, see the module docstring)."""
    entry = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    if holds:
        entry["holds"] = dict(holds)
    return entry


def write_manifest(folder: Path, files: dict[str, dict]) -> None:
    """Write ``manifest.json`` (atomically, fsynced) listing ``files``; call it after every other file exists."""
    text = json.dumps({"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": dict(sorted(files.items()))},
                      indent=1, sort_keys=True)
    tmp = folder / f".{MANIFEST}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the manifest's file table, None) or (None, why the folder has no usable manifest)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None, (f"checkpoint {folder} has no {MANIFEST}: it is incomplete (a save that did not finish, or "
                      "written before checkpoints carried manifests)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return None, f"checkpoint {folder}: {MANIFEST} is damaged ({exc}); the checkpoint cannot be verified"
    return files, None


def _truncated(folder: Path, name: str, entry: dict, size: int) -> str:
    holds = entry.get("holds") or {}
    cut = sorted(part for part, end in holds.items() if end > size)
    kept = sorted(part for part, end in holds.items() if end <= size)
    what = ""
    if cut:
        what = f"; its {' and '.join(cut)} tensors are cut" + (f" ({' and '.join(kept)} intact)" if kept else "")
    return (f"checkpoint {folder}: {name} has {size:,} bytes, its manifest records {entry['size']:,} (truncated"
            f"{what}); the checkpoint is damaged")


def checkpoint_problems(folder: str | Path, *, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> list[str]:
    """One line per damaged or missing file of the checkpoint ``folder`` (empty: intact).

    Sizes are checked for every file; with ``checksums`` the sha256 of the files in this rank's
    ``share`` ``(rank, world_size)``: ``sorted(files)[rank::world_size]``."""
    folder = Path(folder)
    files, why = read_manifest(folder)
    if files is None:
        return [why]
    problems = []
    names = sorted(files)
    mine = set(names[share[0]::share[1]])
    for name in names:
        entry, path = files[name], folder / name
        if not path.is_file():
            problems.append(f"checkpoint {folder}: {name} is missing (its manifest lists it); the checkpoint is damaged")
            continue
        size = path.stat().st_size
        if size != entry.get("size"):
            problems.append(_truncated(folder, name, entry, size) if size < entry.get("size", 0) else
                            f"checkpoint {folder}: {name} has {size:,} bytes, its manifest records {entry.get('size')}; "
                            "the checkpoint is damaged")
        elif checksums and name in mine and sha256_file(path) != entry.get("sha256"):
            holds = " and ".join(sorted(entry.get("holds") or {})) or "its"
            problems.append(f"checkpoint {folder}: {name} ({holds} tensors) does not match the sha256 its manifest "
                            "records (the bytes changed after the save); the checkpoint is damaged")
    return problems


def candidates(root: str | Path) -> list[Path]:
    """The checkpoint folders under ``root``, newest first, the ``latest`` pointer's target first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = sorted((p for p in root.glob("step_*") if p.is_dir() and (p / META).is_file()), reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text(encoding="utf-8").strip()
        if target in found:
            found.remove(target)
            found.insert(0, target)
    return found


def sizes_only(folder: Path) -> list[str]:
    return checkpoint_problems(folder, checksums=False)


def choose_checkpoint(root: str | Path, verify: Callable[[Path], list[str]] = sizes_only
                      ) -> tuple[Optional[Path], list[str]]:
    """(the newest checkpoint under ``root`` that ``verify`` finds intact or None, one line per newer
    checkpoint passed over)."""
    skipped = []
    for folder in candidates(root):
        problems = verify(folder)
        if not problems:
            return folder, skipped
        skipped.append(problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    return None, skipped


def find_latest(root: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (manifest present, every file its size), or None."""
    return choose_checkpoint(root)[0]


class OlderCheckpoint(ValueError):
    """A checkpoint folder whose ``meta.json`` is not in the trainer's format; the message is one line."""


def check_format(folder: str | Path, meta: dict, key: str = "checkpoint") -> None:
    """Refuse checkpoint ``folder`` (``meta``: its meta.json; ``key``: the setting that named it) unless it
    is in ``SHARDED_FORMAT``, the only format this version writes and reads."""
    if meta.get("format") == SHARDED_FORMAT:
        return
    raise OlderCheckpoint(f"{key} ({folder}): its meta.json has format {meta.get('format')!r}, not "
                          f"{SHARDED_FORMAT!r}: it was written by an older megatron_pack (tensors stored per "
                          "tensor-parallel rank), which this version does not read; export it with the version that "
                          "wrote it and start from that export (model=pretrained model.pretrained=DIR), or point "
                          f"{key} at another checkpoint.")


class DamagedCheckpoint(ValueError):
    """A checkpoint whose manifest its files do not match; the message (one line) names the file."""


def verified_checkpoint(path: str | Path, key: str) -> Path:
    """The checkpoint ``path`` names (a ``step_*`` folder, or the newest under a ``checkpoint.save``
    root), in the trainer's format and every file's size and sha256 checked: what ``export`` and ``verify``
    read. Raises ``OlderCheckpoint`` (another format, ``check_format``), ``DamagedCheckpoint`` naming the
    file (and an intact older one when there is one), or ``FileNotFoundError`` when there is no checkpoint."""
    p = Path(path)
    if (p / META).is_file():
        folder, others = p, [c for c in candidates(p.parent) if c != p]
    else:
        found = candidates(p)
        if not found:
            raise FileNotFoundError(f"{key} ({path}) holds no complete checkpoint (no meta.json, no 'latest'); point "
                                    "it at a step_* folder or at checkpoint.save of a training run.")
        folder, others = found[0], found[1:]
    check_format(folder, read_meta(folder), key)
    problems = checkpoint_problems(folder)
    if not problems:
        return folder
    intact = next((f for f in others if not checkpoint_problems(f)), None)
    instead = f"; {intact.name} beside it is intact: {key}={intact}" if intact else ""
    problem = problems[0].removeprefix(f"checkpoint {folder}: ") if folder == p else problems[0]
    raise DamagedCheckpoint(f"{key} ({path}): {problem}, so it is refused{instead}.")
