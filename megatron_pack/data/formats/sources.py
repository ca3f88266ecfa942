"""Raw SFT records from local JSONL / Parquet files (a file, a directory or a glob), streamed.

Reading is split in two so tokenization can run in worker processes: the main process cuts
each file into small *chunks* (raw JSONL lines, or Parquet rows already turned into dicts) and
``parse_chunk`` (run in a worker) turns a chunk into ``(position, record)`` pairs. A file is
never held in memory whole. Every problem names the file and the line (JSONL, 1-based) or the
row (Parquet, 0-based).
"""

from __future__ import annotations

import glob as globlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


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
    Parquet) or 'synthetic' (``items`` is ``(seed, start, stop)``). ``first`` is the 1-based line
    of ``items[0]`` (JSONL) or its 0-based row (Parquet, synthetic).
    """

    kind: str
    file_index: int
    path: str
    first: int
    items: object


def resolve_inputs(spec: str) -> list[Path]:
    """Input files for ``data.input``: a file, a directory (its .jsonl/.json/.parquet files) or a glob."""
    path = Path(spec)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
    else:
        files = sorted(Path(p) for p in globlib.glob(spec, recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"data.input ({spec!r}) matches no .jsonl/.json/.parquet file; "
                        "set data.input to a file, a directory or a glob.")
    for f in files:
        if f.suffix not in SUFFIXES:
            raise DataError(f"{f}: unsupported file type {f.suffix!r}; use .jsonl or .parquet.")
    return files


def iter_chunks(files: list[Path], chunk_size: int = 512) -> Iterator[Chunk]:
    """Stream every file as chunks of at most ``chunk_size`` records."""
    for index, path in enumerate(files):
        if SUFFIXES[path.suffix] == "jsonl":
            yield from _jsonl_chunks(index, path, chunk_size)
        else:
            yield from _parquet_chunks(index, path, chunk_size)


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
        raise DataError(f"{path}: line {line_no}: malformed JSON ({exc.msg} at column {exc.colno}); "
                        "each line must be one JSON object.", "malformed_json") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}: line {line_no}: expected a JSON object, got {type(record).__name__}; write one "
                        "record object per line (JSONL), not a JSON array or a bare value.", "not_an_object")
    return record
