"""Atomic checkpoints: model and optimizer through torch distributed checkpointing (DCP), the
rest (RNG states, loader position, Transformer Engine's extra state) as one small per-rank file.

Layout under ``checkpoint.save``::

    step_00000003/           one complete checkpoint
        .metadata, *.distcp  DCP shards, every tensor by its global identity (resharding.py):
                             "model.<param>", "optimizer.<exp_avg|exp_avg_sq|fp32_param>.<param>", "optimizer.step"
        rank_00000.pt        per-rank state: RNG, loader, TE extra state (torch.save of plain containers)
        meta.json            step, world size and parallel layout, format, train state, settings
        manifest.json        every file above with its size and sha256, written last (checkpoint_files.py)
    latest                   the name of the newest complete checkpoint ("step_00000003")

Saving is atomic: every rank writes into ``tmp.step_00000003/``; after a barrier rank 0 writes
``meta.json``, every rank hashes the files it wrote, rank 0 gathers the digests and writes
``manifest.json``, renames the folder to ``step_00000003/`` and only then replaces ``latest`` (by
``os.replace`` of a temporary file). A crash at any point leaves ``latest`` naming the previous
complete checkpoint; stale ``tmp.*`` folders are removed by the next save. Resume, ``export`` and
``verify`` check the manifest before they read a checkpoint; a resume passes over a damaged one to
the newest intact one and says so (``collective_verify``). Checkpoints (``meta.json`` ``format``:
``SHARDED_FORMAT``) store each parameter and its optimizer state (megatron-core's optimizer, on every device:
``optim.TrainOptimizer.checkpoint_tensors``) once, by global identity, so any layout reads them back: a run saved
at TP2 x CP2 resumes at TP1, DP2 or any other, with the distributed optimizer on or off
(``model_reader.CheckpointModel.read_slices``). A folder of another format (one written by an
older megatron_pack, per tensor-parallel rank) is refused in one line (``checkpoint_files.check_format``).

Everything is read back with ``torch.load(..., weights_only=True)``, and DCP's ``.metadata`` (which torch
unpickles with plain ``pickle.load``) through an allowlist of its own types: no arbitrary pickle.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_pack.parallel.comm import all_gather_object, barrier, gather_object, group_ranks
from megatron_pack.training.checkpoint_files import (LATEST, MANIFEST, META, SHARDED_FORMAT, check_format,
                                                     checkpoint_problems, digest, owner, read_meta, step_dirname,
                                                     write_manifest)


def rng_state(device: torch.device = torch.device("cpu")) -> dict:
    """RNG states of python, numpy, torch (and CUDA when ``device``, the run's compute device, is a GPU)
    as weights_only-safe containers."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                       "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _rng_tracker()
    if tracker is not None and tracker.is_initialized():  # megatron's named streams (dropout in TP regions)
        state["tracker"] = {name: s.clone() for name, s in tracker.get_states().items()}
    return state


def _rng_tracker():
    """megatron-core's RNG tracker when megatron is imported (a model was built), else None."""
    import sys

    random_module = sys.modules.get("megatron.core.tensor_parallel.random")
    return random_module.get_cuda_rng_tracker() if random_module is not None else None


def set_rng_state(state: dict, device: torch.device = torch.device("cpu")) -> None:
    """Restore what ``rng_state`` saved (the CUDA generators when ``device`` is a GPU and the state has them)."""
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _rng_tracker()
    if "tracker" in state and tracker is not None:
        tracker.set_states(dict(state["tracker"]))


def _as_tuple(value: Any) -> Any:
    """random.setstate needs tuples all the way down (a loader may hand back lists)."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def _barrier(group: Optional[dist.ProcessGroup]) -> None:
    barrier(group)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(root: str | Path, step: int, *, sharded_state: dict, rank_state: dict, meta: dict,
                    keep_last: int = 2, group: Optional[dist.ProcessGroup] = None) -> Path:
    """Collectively write checkpoint ``step``; returns its final folder. Every rank must call it.

    ``sharded_state`` (``resharding.sharded_state`` of this rank's model and optimizer state) is written
    by global identity, so any layout reads it back (``model_reader.CheckpointModel.read_slices``);
    ``rank_state`` is this rank's plain state (RNG, loader, schedule); ``meta`` is recorded in
    ``meta.json`` (the layout a resume compares, the run's state and settings) with ``step`` and
    ``format`` (``SHARDED_FORMAT``).
    """
    from megatron_pack.training.resharding import save_sharded

    root = Path(root)
    final, tmp = root / step_dirname(step), root / f"tmp.{step_dirname(step)}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("tmp.step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier(group)
    save_sharded(sharded_state, str(tmp), dcp.FileSystemWriter)
    torch.save(rank_state, tmp / f"rank_{_rank():05d}.pt")
    _barrier(group)
    if _rank() == 0:
        _write_json(tmp / META, {"step": step, **meta, "format": SHARDED_FORMAT})
    files = _gather_digests(tmp, group)  # every rank hashes the files it wrote; rank 0 the rest
    if _rank() == 0:
        write_manifest(tmp, files)  # last: a folder without it is incomplete
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(root / LATEST, final.name)
        _prune(root, keep_last)
    _barrier(group)
    return final


def _gather_digests(folder: Path, group: Optional[dist.ProcessGroup]) -> dict[str, dict]:
    """The manifest's file table: each rank hashes its own files (``checkpoint_files.owner``), rank 0
    gathers them, hashes whatever nobody claimed, and gets the whole table (others get {})."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    holds = _part_ends(folder)
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(f".{MANIFEST}"))
    mine = {n: digest(folder / n, holds.get(n)) for n in names if owner(n, world) == rank}
    if world > 1:
        gathered = gather_object(mine, dst=group_ranks(group)[0], group=group)
        if rank != 0:
            return {}
        mine = {k: v for part in gathered for k, v in part.items()}
    for name in sorted(p.name for p in folder.iterdir() if p.is_file()):
        if name not in mine and not name.startswith(f".{MANIFEST}"):
            mine[name] = digest(folder / name, holds.get(name))
    return mine


def _part_ends(folder: Path) -> dict[str, dict[str, int]]:
    """``{file: {"model": end, "optimizer": end}}``: where each part's last byte ends in each DCP file
    (from DCP's ``.metadata``), so a truncated file can say which part the cut reached."""
    if not (folder / ".metadata").is_file():
        return {}
    ends: dict[str, dict[str, int]] = {}
    for index, info in checkpoint_reader(folder).read_metadata().storage_data.items():
        part = "optimizer" if index.fqn.startswith("optimizer") else "model"
        file_ends = ends.setdefault(info.relative_path, {})
        file_ends[part] = max(file_ends.get(part, 0), int(info.offset) + int(info.length))
    return ends


def _write_json(path: Path, obj: dict) -> None:
    _write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(root: Path, keep_last: int) -> None:
    done = sorted(p for p in root.glob("step_*") if (p / META).exists())
    for old in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_METADATA_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
                         ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                         ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` admitting only its own types (torch reads it with plain
    ``pickle.load``, which would run any code a tampered checkpoint carries)."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if module in ("torch", _DCP_METADATA_MODULE) else None
        if ((module, name) in _DCP_METADATA_GLOBALS or isinstance(found, torch.dtype)
                or (isinstance(found, type) and found.__module__ == _DCP_METADATA_MODULE)):
            return found if found is not None else super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed in a DCP "
                                     "metadata file; the checkpoint is corrupt or tampered with: do not load it.")


class _SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the allowlist unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _DCPMetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def checkpoint_reader(path: str | Path) -> dcp.FileSystemReader:
    """A DCP reader for ``path`` that reads ``.metadata`` through the allowlist; use it for every
    ``dcp.load(..., storage_reader=...)`` and ``read_metadata()`` (never a plain ``FileSystemReader``)."""
    return _SafeReader(str(path))


def read_rank_state(path: str | Path, rank: Optional[int] = None) -> Optional[dict]:
    """This rank's plain state file of checkpoint ``path``, or None when the checkpoint has none for it."""
    rank_file = Path(path) / f"rank_{_rank() if rank is None else rank:05d}.pt"
    return torch.load(rank_file, weights_only=True) if rank_file.is_file() else None


def read_full_model(path: str | Path) -> dict[str, torch.Tensor]:
    """Every model parameter of a layout-free checkpoint as the TP=1 model holds it, in one process.

    ``{name: tensor}`` keyed by ``named_parameters()`` names of a TP=1 GPTModel: a layout-free
    checkpoint stores each parameter by its global identity, which megatron-core lays out as the
    TP=1 parameter (SwiGLU ``[gate; up]``, fused QKV per query group), with the layers of
    ``decoder.layers.<rest>`` stacked along a leading axis; this splits that axis back into
    ``decoder.layers.<i>.<rest>``. No process group and no model are needed (export, verify).
    """
    path = Path(path)
    check_format(path, read_meta(path))
    reader = checkpoint_reader(path)
    stored = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in stored.items()
             if not key.startswith("optimizer.") and hasattr(md, "size")}
    dcp.load(state, storage_reader=checkpoint_reader(path), no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        rest = key[len("decoder.layers."):]
        if key.startswith("decoder.layers.") and rest.split(".", 1)[0].isdigit():
            out.update(_unstack_experts(key, tensor))  # a hybrid stack's layers are stored one by one
        elif key.startswith("decoder.layers."):
            for i, layer in enumerate(tensor.unbind(0)):
                out.update(_unstack_experts(f"decoder.layers.{i}.{rest}", layer))
        else:
            out[key] = tensor
    return _join_split_parts(out)


_SPLIT_PARTS = ("query", "key", "value", "z", "beta", "alpha")
"""megatron-core's ``GatedDeltaNet.sharded_state_dict`` stores ``in_proj.weight`` as its parts ``<name>.query``,
``.key``, ``.value``, ``.z``, ``.beta``, ``.alpha`` (``conv1d.weight``: the first three), each whole over the heads;
the TP=1 parameter is their concatenation along dim 0, in this order."""


def _join_split_parts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every ``<name>.<part>`` of ``_SPLIT_PARTS`` joined back into ``<name>`` (a linear-attention
    layer's in_proj and conv1d).

    >>> sorted(_join_split_parts({"w.query": torch.zeros(2), "w.key": torch.ones(2), "b": torch.ones(1)}))
    ['b', 'w']
    """
    parts: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for key, tensor in state.items():
        base, _, part = key.rpartition(".")
        if part in _SPLIT_PARTS and base.endswith((".in_proj.weight", ".conv1d.weight", ".conv1d.bias")):
            parts.setdefault(base, {})[part] = tensor
        else:
            out[key] = tensor
    for base, named in parts.items():
        out[base] = torch.cat([named[p] for p in _SPLIT_PARTS if p in named])
    return out


_STACKED_EXPERTS = "mlp.experts.experts."
"""megatron-core's SequentialMLP stores expert e's ``local_experts.<e>.<linear>`` along an expert axis."""


def _unstack_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: tensor}``, a MoE layer's stacked experts split into ``mlp.experts.local_experts.<e>.<rest>``."""
    if _STACKED_EXPERTS not in name:
        return {name: tensor.clone()}
    head, rest = name.split(_STACKED_EXPERTS, 1)
    return {f"{head}mlp.experts.local_experts.{e}.{rest}": t.clone() for e, t in enumerate(tensor.unbind(0))}


def collective_verify(group: Optional[dist.ProcessGroup] = None):
    """A ``verify(folder) -> problems`` for ``checkpoint_files.choose_checkpoint`` that checks every
    file's size on every rank and each file's sha256 on one rank (``files[rank::world]``), then
    gathers the lines, so every rank reaches the same verdict; collective: every rank must call it."""

    def verify(folder: Path) -> list[str]:
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        mine = checkpoint_problems(folder, checksums=True, share=(rank, world))
        if world == 1:
            return mine
        gathered = all_gather_object(mine, group=group)
        return list(dict.fromkeys(line for lines in gathered for line in lines))

    return verify
