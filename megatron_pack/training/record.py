"""The run record: what a run was, written to ``train.output_dir`` when it starts.

``run.json`` holds the resolved config (every key), the resolved number of steps, the parallel
layout, the package versions (python, torch, megatron-core, numpy, transformer-engine and apex
when present, megatron_pack) and the git commit of the megatron_pack checkout when there is
one (with a ``dirty`` flag); ``config.yaml`` is the same config as YAML, loadable with
``load_config``-style overrides. A resumed run rewrites both (its config may carry allowed
changes) and keeps the earlier ones as ``run.<start time>.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import megatron_pack

_PACKAGES = ("torch", "megatron-core", "numpy", "transformer-engine", "apex", "hydra-core", "omegaconf",
             "megatron-pack")


def package_versions() -> dict[str, Optional[str]]:
    """Installed version of each package that shapes a run (None when not installed)."""
    out: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(path: Optional[Path] = None) -> Optional[dict[str, Any]]:
    """``{"commit": sha, "dirty": bool}`` of the git checkout holding ``path`` (the package), or None."""
    root = Path(path or Path(megatron_pack.__file__).resolve().parent)
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(dirty)} if sha else None


def flat_config(cfg) -> dict[str, Any]:
    """``{"train.lr": 0.003, ...}``: every key, lists and None as strings (TensorBoard hparams take scalars)."""
    out = {}
    for group in dataclasses.fields(cfg):
        for key, value in dataclasses.asdict(getattr(cfg, group.name)).items():
            out[f"{group.name}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def write_run_record(cfg, state, train_iters: int) -> Path:
    """Write ``run.json`` and ``config.yaml`` into ``train.output_dir`` (rank 0 calls it); returns run.json."""
    from megatron_pack.config.loader import config_to_yaml

    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    path = out / "run.json"
    if path.exists():  # the record of the process this one resumes
        path.rename(out / f"run.{now.strftime('%Y%m%dT%H%M%S%f')}.json")
    record = {"started": now.isoformat(timespec="seconds"), "argv": sys.argv,
              "train_iters": train_iters,
              "layout": {"world_size": state.world_size, "tensor_model_parallel_size": state.tp_size,
                         "context_parallel_size": state.cp_size, "data_parallel_size": state.dp_size},
              "versions": package_versions(), "git": git_commit(), "config": dataclasses.asdict(cfg)}
    path.write_text(json.dumps(record, indent=2, default=str), encoding="utf-8")
    (out / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")
    return path
