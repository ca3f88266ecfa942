"""Safe writes: build a directory beside its target and rename it into place when complete.

A reader sees either no directory or a complete one, never a half-written one, even when the
writer is killed: a killed writer leaves only a hidden ``.<name>.tmp-<pid>-<token>`` sibling,
which the next writer removes once its process is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Delete ``.<name>.tmp-<pid>-*`` siblings of ``target`` whose writer process is gone."""
    removed = []
    if not target.parent.is_dir():
        return removed
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


@contextmanager
def atomic_directory(target: Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``target`` when the block succeeds.

    On an exception the temporary directory is deleted and ``target`` is untouched. With
    ``replace`` an existing ``target`` is swapped out (renamed away, then deleted) after the new
    one is complete; without it an existing ``target`` is an error.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if target.exists():
            if not replace:
                raise FileExistsError(f"{target} appeared while it was being written; another writer ran at "
                                      "the same time. Re-run the command.")
            old = target.parent / f".{target.name}.tmp-{os.getpid()}-old-{secrets.token_hex(4)}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj) -> None:
    """Write JSON to ``path`` through a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict:
    """The JSON object in ``path`` (a store's or a plan's ``metadata.json``, a prepare record). A file that is not
    one (cut short, edited, not UTF-8, unreadable) raises ``DataError``: ``<path> is damaged (...)``, the one line
    every other damage to a prepared dataset gives; a missing file stays ``FileNotFoundError``."""
    from megatron_pack.data.formats.sources import DataError, json_error_where

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise
    except json.JSONDecodeError as exc:
        why = f"not valid JSON: {json_error_where(exc, line=True)}"
    except UnicodeDecodeError:
        why = "not UTF-8 text"
    except OSError as exc:
        why = f"unreadable: {exc.strerror}"
    else:
        if isinstance(value, dict):
            return value
        why = f"a JSON {type(value).__name__}, not an object"
    raise DataError(f"{path} is damaged ({why}). Delete {Path(path).parent} and re-run `megatron-pack prepare`.")


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
