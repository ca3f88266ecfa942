"""Where presets are found: the shipped presets (``configs/``), then the user's config folders.

The shipped presets live in ``configs/`` at the top of the repository (``config.yaml`` and
``<group>/<name>.yaml``, apart from library code). A wheel carries them as package data of
``megatron_pack.config`` (``presets/``, copied there by setup.py's ``build_py``), so every command
works from any folder and any install; a source checkout (or an editable install) reads
``configs/`` in place. Users add folders laid out the same way, searched after the shipped ones::

    MEGATRON_PACK_CONFIG_DIR=/team/configs:/home/me/configs   (os.pathsep-separated)
    megatron-pack train --config-dir ./configs experiment=my_run     # ./configs/experiment/my_run.yaml

and a single experiment file can be named by its path, without a folder around it::

    megatron-pack train experiment=./my_run.yaml

``config.yaml`` (the defaults list) always comes from the shipped presets. A user preset may not
reuse the name of a shipped one with other content: Hydra would silently read the shipped file first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence, Union

from megatron_pack.config.schema import ConfigError

def shipped_presets_dir() -> Path:
    """The shipped presets: a wheel's package data (``megatron_pack/config/presets``), else ``configs/``
    of the source tree this package is in."""
    installed = Path(__file__).resolve().parent / "presets"
    if (installed / "config.yaml").is_file():
        return installed
    return Path(__file__).resolve().parents[2] / "configs"


PRESETS_DIR = shipped_presets_dir()
CONFIG_DIR_ENV = "MEGATRON_PACK_CONFIG_DIR"
PathLike = Union[str, Path]


def user_config_dirs(extra: Sequence[PathLike] = ()) -> list[Path]:
    """``$MEGATRON_PACK_CONFIG_DIR`` entries, then ``extra`` (``--config-dir``), each an existing folder."""
    named = [(CONFIG_DIR_ENV, p) for p in os.environ.get(CONFIG_DIR_ENV, "").split(os.pathsep) if p]
    named += [("--config-dir", str(p)) for p in extra]
    problems, dirs = [], []
    for source, text in named:
        path = Path(text).expanduser().resolve()
        if not path.is_dir():
            problems.append(f"{source} {text}: no such folder; point it at a folder holding <group>/<name>.yaml "
                            "presets (e.g. experiment/my_run.yaml), or unset it.")
        elif path != PRESETS_DIR and path not in dirs:
            dirs.append(path)
    if problems:
        raise ConfigError(problems)
    return dirs


def presets(roots: Union[PathLike, Sequence[PathLike]]) -> dict[str, list[str]]:
    """YAML options per config group over every root: ``{"model": ["llama3_8b", "tiny"], ...}``."""
    roots = [roots] if isinstance(roots, (str, Path)) else roots
    found: dict[str, set[str]] = {}
    for root in map(Path, roots):
        for group in sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))):
            found.setdefault(group.name, set()).update(p.stem for p in group.glob("*.yaml"))
    return {group: sorted(names) for group, names in sorted(found.items())}


def shadow_problems(dirs: Sequence[Path]) -> list[str]:
    """A user preset (or config.yaml) that repeats a shipped name with other content."""
    problems = []
    for root in dirs:
        own = root / "config.yaml"
        if own.is_file() and own.read_bytes() != (PRESETS_DIR / "config.yaml").read_bytes():
            problems.append(f"{own}: a user config folder's config.yaml is not read (the defaults list comes from "
                            "the package); delete it and select presets with group=name overrides.")
        for path in sorted(root.glob("*/*.yaml")):
            shipped = PRESETS_DIR / path.parent.name / path.name
            if shipped.is_file() and shipped.read_bytes() != path.read_bytes():
                problems.append(f"{path} has the name of the shipped preset {path.parent.name}={path.stem}, which "
                                f"would be read instead; rename it (e.g. {path.parent.name}={path.stem}_mine).")
    return problems


def _is_file_choice(value: str) -> bool:
    return value.endswith((".yaml", ".yml")) or os.sep in value


@contextlib.contextmanager
def experiment_files(overrides: Sequence[str]) -> Iterator[tuple[list[str], list[Path]]]:
    """``experiment=path/to/run.yaml`` -> ``experiment=run`` plus a scratch folder holding it.

    The file is copied as ``experiment/<stem>.yaml`` with ``# @package _global_`` added when it
    names no package (an experiment sets keys of every group). Yields the rewritten overrides and
    the scratch folders to search; they are removed when the block ends.
    """
    rewritten, scratch = [], []
    try:
        for text in overrides:
            key, sep, value = text.partition("=")
            if key.lstrip("+") != "experiment" or not sep or not _is_file_choice(value):
                rewritten.append(text)
                continue
            path = Path(value).expanduser()
            if not path.is_file():
                raise ConfigError([f"{text}: no such file {path.resolve()}; name an experiment YAML file, or a "
                                   "preset (experiment=quickstart)."])
            folder = Path(tempfile.mkdtemp(prefix="megatron_pack_experiment_"))
            scratch.append(folder)
            body = path.read_text(encoding="utf-8")
            if "@package" not in body.split("\n", 1)[0]:
                body = "# @package _global_\n" + body
            name = path.stem if not (PRESETS_DIR / "experiment" / f"{path.stem}.yaml").is_file() else f"{path.stem}_file"
            (folder / "experiment").mkdir()
            (folder / "experiment" / f"{name}.yaml").write_text(body, encoding="utf-8")
            rewritten.append(f"experiment={name}")
        yield rewritten, scratch
    finally:
        for folder in scratch:
            shutil.rmtree(folder, ignore_errors=True)
