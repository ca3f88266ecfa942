"""Raw SFT records from local JSONL / Parquet / Arrow files (a file, a directory or a glob), or a Hugging Face
datasets folder (what ``Dataset.save_to_disk`` writes; a ``DatasetDict`` folder with a split), streamed.

Reading is split in two so tokenization can run in worker processes: the main process cuts
each file into small *chunks* (raw JSONL lines, or Parquet rows already turned into dicts) and
``parse_chunk`` (run in a worker) turns a chunk into ``(position, record)`` pairs. A file is
never held in memory whole. Every problem names the file and the line (JSONL, 1-based) or the
row (Parquet and Arrow, 0-based).

A datasets folder is read with pyarrow alone (the ``datasets`` package is not needed): its ``state.json`` lists
its Arrow shards (IPC streams) in order, and a ``DatasetDict`` folder's ``dataset_dict.json`` lists its splits,
each a datasets folder of its own. So ``data.input=folder data.split=train`` and ``data.input=folder/train``
read the same files.
"""

from __future__ import annotations

import glob as globlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow"}


class DataError(ValueError):
    """Bad input data; the message names the file and line (or row) and the fix. ``reason`` is set when the
    error is one bad record (``megatron_pack.data.formats.chat.BAD_RECORD_REASONS``), which
    ``data.on_bad_record=skip`` may skip, counted."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Chunk:
    """A slice of one input, small enough to send to a worker.

    ``kind`` is 'jsonl' (``items`` are raw lines, bytes), 'records' (``items`` are dicts from
    Parquet or Arrow) or 'synthetic' (``items`` is ``(seed, start, stop)``). ``first`` is the 1-based line
    of ``items[0]`` (JSONL) or its 0-based row (Parquet, synthetic).
    """

    kind: str
    file_index: int
    path: str
    first: int
    items: object


def resolve_inputs(spec: str, split: str | None = None) -> list[Path]:
    """Input files for ``data.input``: a file, a datasets folder (its Arrow shards; ``split`` picks a split of a
    ``DatasetDict`` folder), a directory (its .jsonl/.json/.parquet/.arrow files) or a glob."""
    path = Path(spec)
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        return datasets_folder_files(path, split)
    if split is not None:
        raise DataError(f"data.split ({split!r}) is set, but data.input ({spec!r}) is not a DatasetDict folder (no "
                        "dataset_dict.json); set data.split=null, or data.input to the folder DatasetDict.save_to_disk "
                        "wrote.")
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
    else:
        files = sorted(Path(p) for p in globlib.glob(spec, recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"data.input ({spec!r}) matches no .jsonl/.json/.parquet/.arrow file or datasets folder; "
                        "set data.input to a file, a directory, a glob or a folder Dataset.save_to_disk wrote.")
    for f in files:
        if f.suffix not in SUFFIXES:
            raise DataError(f"{f}: unsupported file type {f.suffix!r}; use .jsonl, .parquet or .arrow.")
    return files


def datasets_folder_files(folder: Path, split: str | None = None) -> list[Path]:
    """The Arrow shards of a ``save_to_disk`` folder, in the dataset's order. A ``DatasetDict`` folder needs
    ``split`` unless it holds one split; a ``Dataset`` folder refuses a ``split``."""
    dict_file = folder / "dataset_dict.json"
    if dict_file.is_file():
        splits = json.loads(dict_file.read_text(encoding="utf-8")).get("splits", [])
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            given = "is not set" if split is None else f"({split!r}) is not one of its splits"
            raise DataError(f"data.input ({str(folder)!r}) is a DatasetDict folder and data.split {given}; "
                            f"set data.split to one of {splits}.")
        return datasets_folder_files(folder / split)
    if split is not None:
        raise DataError(f"data.split ({split!r}) is set, but data.input ({str(folder)!r}) is a Dataset folder (one "
                        "split, no dataset_dict.json); set data.split=null.")
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    files = [folder / entry["filename"] for entry in state.get("_data_files", [])]
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise DataError(f"{folder}/state.json: lists {'no Arrow file' if not files else f'missing files {missing}'}; "
                        "write the folder again with Dataset.save_to_disk.")
    return files


def num_rows(path: Path) -> int:
    """Rows of a Parquet file (its footer) or an Arrow file (its batches, memory-mapped, not read)."""
    if SUFFIXES[path.suffix] == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return sum(batch.num_rows for batch in _arrow_batches(path))


def iter_chunks(files: list[Path], chunk_size: int = 512) -> Iterator[Chunk]:
    """Stream every file as chunks of at most ``chunk_size`` records."""
    readers = {"jsonl": _jsonl_chunks, "parquet": _parquet_chunks, "arrow": _arrow_chunks}
    for index, path in enumerate(files):
        yield from readers[SUFFIXES[path.suffix]](index, path, chunk_size)


def _jsonl_chunks(index: int, path: Path, chunk_size: int) -> Iterator[Chunk]:
    lines, first, num_records = [], 1, 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not lines:
                first = line_no
            lines.append(line)
            num_records += bool(line.strip())
            if len(lines) == chunk_size:
                yield Chunk("jsonl", index, str(path), first, lines)
                lines = []
    if lines:
        yield Chunk("jsonl", index, str(path), first, lines)
    if num_records == 0:
        raise DataError(f"{path}: line 1: the file is empty (no JSON records); remove it from data.input.")


def _parquet_chunks(index: int, path: Path, chunk_size: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a broken file
        raise DataError(f"{path}: row 0: not a readable Parquet file ({exc}).") from exc
    if parquet.metadata.num_rows == 0:
        raise DataError(f"{path}: row 0: the file is empty (no rows); remove it from data.input.")
    row = 0
    for batch in parquet.iter_batches(batch_size=chunk_size):
        yield Chunk("records", index, str(path), row, batch.to_pylist())
        row += batch.num_rows


def _arrow_batches(path: Path):
    """The record batches of an Arrow IPC stream (what ``datasets`` writes) or file (Feather v2), memory-mapped."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        try:
            yield from pa.ipc.open_stream(source)
            return
        except pa.ArrowInvalid:
            source.seek(0)
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: row 0: not a readable Arrow file ({exc}).") from exc


def _arrow_chunks(index: int, path: Path, chunk_size: int) -> Iterator[Chunk]:
    row = 0
    for batch in _arrow_batches(path):
        for start in range(0, batch.num_rows, chunk_size):
            part = batch.slice(start, chunk_size)
            yield Chunk("records", index, str(path), row, part.to_pylist())
            row += part.num_rows
    if row == 0:
        raise DataError(f"{path}: row 0: the file is empty (no rows); remove it from data.input.")


def parse_chunk(chunk: Chunk, *, keep_errors: bool = False) -> Iterator[tuple[int, dict | DataError]]:
    """``(line or row, record)`` for every record of a JSONL or Parquet chunk; blank lines are skipped.
    A line that is not a record raises its ``DataError``, or with ``keep_errors`` takes the record's place
    (so a later check can report the first bad line in file order, or skip it)."""
    if chunk.kind == "records":
        for offset, record in enumerate(chunk.items):
            yield chunk.first + offset, record
        return
    for offset, raw in enumerate(chunk.items):
        line_no = chunk.first + offset
        if not raw.strip():
            continue
        try:
            yield line_no, parse_line(raw, chunk.path, line_no)
        except DataError as exc:
            if not keep_errors:
                raise
            yield line_no, exc


def json_error_where(exc: json.JSONDecodeError, *, line: bool = False) -> str:
    """``Expecting ',' delimiter at column 16`` (``at line 2 column 16`` with ``line``); json's own messages that
    end in "at" (``Unterminated string starting at``) take the place without a second one."""
    place = f"line {exc.lineno} column {exc.colno}" if line else f"column {exc.colno}"
    return f"{exc.msg} {place}" if exc.msg.endswith(" at") else f"{exc.msg} at {place}"


def parse_line(raw: bytes, path: str, line_no: int) -> dict:
    """One JSONL line as a record, or a one-line ``DataError`` naming ``path`` and ``line_no``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: line {line_no}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                        f"{exc.start + 1}); re-encode the file as UTF-8.", "not_utf8") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: line {line_no}: malformed JSON ({json_error_where(exc)}); "
                        "each line must be one JSON object.", "malformed_json") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}: line {line_no}: expected a JSON object, got {type(record).__name__}; write one "
                        "record object per line (JSONL), not a JSON array or a bare value.", "not_an_object")
    return record
