"""The token store: every sample tokenized once, as flat memory-mapped ``.npy`` arrays.

Files (one directory; ``N`` samples, ``T`` tokens)::

    tokens.npy        uint16 [T] (int32 when the vocabulary has more than 65536 ids)
    answer_mask.npy   uint8  [T]  1 on answer tokens (completion / assistant and their eos)
    offsets.npy       int64  [N+1] sample i is tokens[offsets[i]:offsets[i+1]]
    num_targets.npy   int32  [N]  answer_mask[1:] summed per sample (0: nothing to learn)
    source_file.npy   int32  [N]  index into metadata["sources"]["files"]
    source_line.npy   int64  [N]  1-based JSONL line, or 0-based Parquet / synthetic row
    metadata.json             see docs/data.md

Tokenization streams chunks through a (forked) process pool with a bounded number of chunks in flight,
so memory stays flat whatever the input size; arrays are appended to ``.npy`` files whose
header is written last.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from megatron_pack.data.formats.sources import Chunk, DataError, parse_chunk
from megatron_pack.data.formats.synthetic import synthetic_image_records, synthetic_records
from megatron_pack.data.formats.chat import RecordError, SampleSchema
from megatron_pack.data.formats.tokenizer import build_tokenizer
from megatron_pack.data.store.images import ImageWriter, StoreImages

STORE_FORMAT = "megatron_pack.token_store"
STORE_FORMAT_VERSION = 1
STORE_ARRAYS = ("tokens", "answer_mask", "offsets", "num_targets", "source_file", "source_line")
_HEADER_BYTES = 128


class NpyAppender:
    """Append 1-D arrays to a ``.npy`` file of unknown final length; the header is fixed up on close."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.length = Path(path), np.dtype(dtype), 0
        self.file = open(self.path, "wb")
        self.file.write(b"\0" * _HEADER_BYTES)

    def append(self, array) -> None:
        array = np.ascontiguousarray(array, dtype=self.dtype)
        self.file.write(array.tobytes())
        self.length += array.size

    def close(self) -> None:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.length,)}
        text = repr(header).encode("latin1")
        prefix = b"\x93NUMPY\x01\x00"
        pad = _HEADER_BYTES - len(prefix) - 2 - len(text) - 1
        self.file.seek(0)
        self.file.write(prefix + (_HEADER_BYTES - len(prefix) - 2).to_bytes(2, "little") + text + b" " * pad + b"\n")
        self.file.close()


@dataclass
class ChunkResult:
    ids: np.ndarray
    mask: np.ndarray
    num_ids: np.ndarray
    num_targets: np.ndarray
    file_index: int
    positions: np.ndarray
    num_blank: int
    bad: list = field(default_factory=list)
    """``(where, reason, message)`` of every bad record skipped (``data.on_bad_record=skip``), in file order."""
    images: list = field(default_factory=list)
    """Per stored sample, ``None`` or ``(ImageInfo list, first pad positions)`` (a folder with an image processor)."""


_WORKER: dict = {}


def init_worker(tokenizer: str, schema: SampleSchema | tuple, answer_only_loss: bool,
                chat_template: str | None = None, on_bad_record: str = "error", image_root: str | None = None) -> None:
    """Per-process state: each worker builds its own tokenizer from its name (the object is never sent).
    ``schema`` is one ``SampleSchema``, or a tuple of them indexed by the chunk's file (data.sources).
    A tokenizer folder with an image processor (``formats.images.processor_settings``) turns images on; relative
    image paths start at ``image_root``, or at each data file's folder."""
    from megatron_pack.data.formats.images import image_spec

    tok = build_tokenizer(tokenizer, chat_template)
    _WORKER.update(tokenizer=tok, schema=schema, answer_only_loss=answer_only_loss, on_bad_record=on_bad_record,
                   images=image_spec(tokenizer, tok), image_root=image_root)


def _init_pool_worker(*args) -> None:
    """``init_worker`` in a pool worker, which leaves Ctrl-C to the parent: the parent stops reading, cancels the
    chunks not started and waits for the running ones; a worker that took the signal too printed its own
    traceback from wherever it waited (the issue-43 Ctrl-C test caught one waiting for its next chunk)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # forked with it blocked: see _sigint_held
    init_worker(*args)


@contextlib.contextmanager
def _sigint_held():
    """Ctrl-C held back (blocked, delivered on leaving) while the pool forks its workers: a Ctrl-C sent to the
    process group between a worker's fork and its ``SIG_IGN`` killed that worker, and one that interrupted the
    parent inside the executor's start left a worker waiting for work it never got, which the interpreter's exit
    then joined forever (the issue-43 Ctrl-C test hung 1 time in 8 on a loaded machine). Blocked here, the signal
    waits in each new worker until ``_init_pool_worker`` ignores it, and reaches the parent after the submit."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _records(chunk: Chunk) -> Iterator[tuple[int, dict | DataError]]:
    if chunk.kind == "synthetic":  # with a vision-language folder, the set with generated images
        seed, start, stop, max_length = chunk.items
        generate = synthetic_image_records if _WORKER.get("images") is not None else synthetic_records
        yield from zip(range(start, stop), generate(seed, start, stop, max_length))
    else:
        yield from parse_chunk(chunk, keep_errors=True)


def bad_record(error: Exception, where: str) -> tuple[str, str, bool]:
    """``(reason, message, fatal)`` of the record at ``where`` (``file: line N``): the one line ``prepare`` prints."""
    if isinstance(error, DataError):  # read, not parsed: the message already names the file and line
        return error.reason or "malformed_json", str(error), False
    if isinstance(error, UnicodeEncodeError):  # JSON "\ud800" escapes decode to text that is not valid Unicode
        return "invalid_unicode", (f"{where}: the text holds an unpaired surrogate ({error.object[error.start]!r}), "
                                   "which is not valid Unicode; fix the \\uXXXX escapes (surrogates must come in "
                                   "pairs) or drop the record."), False
    return error.reason, f"{where}: {error}.", error.fatal


def _encode_one(tok, record: dict, schema: SampleSchema, answer_only: bool):
    """``(ids, mask)``, or the ``RecordError`` / ``UnicodeEncodeError`` the record raised."""
    try:
        return tok.encode_sample(record, schema, answer_only_loss=answer_only)
    except (RecordError, UnicodeEncodeError) as exc:
        return exc


def _encode_records(tok, records: list[dict], schema: SampleSchema, answer_only: bool) -> list:
    if hasattr(tok, "encode_samples"):  # a batch at once (HF chat: one render + one encode per chunk)
        return tok.encode_samples(records, schema, answer_only_loss=answer_only)
    return [_encode_one(tok, record, schema, answer_only) for record in records]


def _encode_with_images(tok, records: list[dict], schema: SampleSchema, answer_only: bool, chunk: Chunk) -> list:
    """One ``(ids, mask, images)`` or error per record: images staged and inspected (header, checksum, grid;
    ``formats.images``), the record rendered, its image placeholders expanded to their token counts."""
    from megatron_pack.data.formats.images import expand_images, inspect_image, stage_images

    spec = _WORKER.get("images")
    if spec is None:
        return [r if isinstance(r, Exception) else (*r, None)
                for r in _encode_records(tok, records, schema, answer_only)]
    base_dir = Path(_WORKER["image_root"] or Path(chunk.path).parent)
    staged: list = []
    for record in records:
        try:
            record, refs = stage_images(record, schema, base_dir)
            staged.append((record, [inspect_image(ref, spec, f"images[{k}]") for k, ref in enumerate(refs)]))
        except RecordError as exc:
            staged.append(exc)
    fine = [k for k, s in enumerate(staged) if not isinstance(s, Exception)]
    out = list(staged)
    for k, result in zip(fine, _encode_records(tok, [staged[k][0] for k in fine], schema, answer_only)):
        infos = staged[k][1]
        try:
            if isinstance(result, Exception):
                out[k] = result
                continue
            ids, mask, starts = expand_images(result[0], result[1], infos, spec)  # refuses stray pad tokens too
            out[k] = (ids, mask, (infos, starts)) if infos else (*result, None)
        except RecordError as exc:
            out[k] = exc
    return out


def tokenize_chunk(chunk: Chunk) -> ChunkResult:
    """Tokenize one chunk in a worker. A bad record (unreadable or refused, in file order) raises
    ``DataError`` naming file and line; with ``data.on_bad_record=skip`` it is left out and listed."""
    tok, schema, answer_only = _WORKER["tokenizer"], _WORKER["schema"], _WORKER["answer_only_loss"]
    skip = _WORKER.get("on_bad_record", "error") == "skip"
    if isinstance(schema, (tuple, list)):  # data.sources: one schema per input file
        schema = schema[chunk.file_index]
    ids, masks, positions, bad, images = [], [], [], [], []
    where = "line" if chunk.kind == "jsonl" else "row"
    records = list(_records(chunk))
    readable = [r for _, r in records if not isinstance(r, DataError)]
    encoded = iter(_encode_with_images(tok, readable, schema, answer_only, chunk))
    for position, record in records:
        result = record if isinstance(record, DataError) else next(encoded)
        if isinstance(result, (DataError, RecordError, UnicodeEncodeError)):  # the first bad one in file order
            place = f"{chunk.path}: {where} {position}"
            reason, message, fatal = bad_record(result, place)
            if not skip or fatal:
                raise DataError(message, reason) from None
            bad.append((place, reason, message))
            continue
        sample_ids, mask, sample_images = result
        ids.append(sample_ids)
        masks.append(mask)
        positions.append(position)
        images.append(sample_images)
    num_ids = np.array([len(x) for x in ids], dtype=np.int64)  # >= 1: every sample ends with eos
    flat_mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
    starts = np.cumsum(num_ids) - num_ids
    num_targets = np.zeros(0, np.int64)
    if ids:  # loss_mask = answer_mask[1:]: the first id of a sample is never a target
        num_targets = np.add.reduceat(flat_mask, starts, dtype=np.int64) - flat_mask[starts]
    num_blank = len(chunk.items) - len(positions) - len(bad) if chunk.kind == "jsonl" else 0
    return ChunkResult(np.concatenate(ids) if ids else np.zeros(0, np.int32), flat_mask, num_ids, num_targets,
                       chunk.file_index, np.array(positions, dtype=np.int64), num_blank, bad, images)


def tokenize_stream(chunks: Iterable[Chunk], *, tokenizer: str, schema: SampleSchema, answer_only_loss: bool,
                    num_workers: int, chat_template: str | None = None,
                    on_bad_record: str = "error", image_root: str | None = None) -> Iterator[ChunkResult]:
    """Results in input order, from ``num_workers`` processes (inline when it is 1).

    Workers are forked where the platform can (Linux): each starts in milliseconds with the
    tokenizer the parent already built (``build_tokenizer``'s cache), instead of importing
    transformers and loading the tokenizer again (seconds, per worker, with ``spawn``). A chunk
    (``FILE_CHUNK`` records, ~10^5 tokens) is ~0.1-0.3 s of work against ~1 ms of pickling each
    way, so the parent, which only reads lines and appends arrays, keeps 64 workers busy; at
    most ``2 * num_workers`` chunks are in flight, so memory is flat in the input size.
    """
    init_worker(tokenizer, schema, answer_only_loss, chat_template, on_bad_record, image_root)  # built once, forked
    if num_workers <= 1:
        yield from map(tokenize_chunk, chunks)
        return
    import multiprocessing as mp

    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one encoding thread per worker: the workers use the cores
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    from concurrent.futures import ProcessPoolExecutor

    # not multiprocessing.Pool: its terminate(), run when a bad record's error leaves the block, could
    # hang joining its task-handler thread; the executor cancels what has not started and waits for the rest
    pending: deque = deque()
    try:
        with ProcessPoolExecutor(num_workers, mp_context=mp.get_context(method), initializer=_init_pool_worker,
                                 initargs=(tokenizer, schema, answer_only_loss, chat_template, on_bad_record,
                                           image_root)) as pool:
            try:
                for chunk in chunks:
                    with _sigint_held():  # a submit may fork workers (all of them at the first, with fork)
                        pending.append(pool.submit(tokenize_chunk, chunk))
                    if len(pending) >= 2 * num_workers:  # bounded memory: never read far ahead
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity: a SLURM or cgroup allotment), not the node's count."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def write_store(out_dir: Path, results: Iterable[ChunkResult], *, token_dtype, total: int | None = None,
                progress: bool = True, images: bool = False) -> dict:
    """Append tokenized chunks to the store arrays in ``out_dir``; return counts for the metadata.

    The bar counts records read (samples, blank lines and bad records) against ``total``, the input's
    record count where known; it is closed before an error leaves, so the error prints on a line of its own.
    """
    files = {name: NpyAppender(out_dir / f"{name}.npy", dtype) for name, dtype in (
        ("tokens", token_dtype), ("answer_mask", np.uint8), ("offsets", np.int64), ("num_targets", np.int32),
        ("source_file", np.int32), ("source_line", np.int64))}
    files["offsets"].append([0])
    image_writer = ImageWriter(out_dir, NpyAppender) if images else None
    num_tokens, num_blank, num_samples = 0, 0, 0
    bad = BadRecords()
    start = time.perf_counter()
    with Progress("tokenize", total, "records", enabled=progress) as bar:
        for result in results:
            files["tokens"].append(result.ids)
            files["answer_mask"].append(result.mask)
            files["offsets"].append(num_tokens + np.cumsum(result.num_ids))
            files["num_targets"].append(result.num_targets)
            files["source_file"].append(np.full(len(result.num_ids), result.file_index))
            files["source_line"].append(result.positions)
            if image_writer is not None:
                image_writer.append(result.images)
            num_tokens += int(result.num_ids.sum())
            num_samples += len(result.num_ids)
            num_blank += result.num_blank
            bad.add(result.bad)
            bar.update(len(result.num_ids) + result.num_blank + len(result.bad))
            bar.postfix = f"{num_tokens / max(time.perf_counter() - start, 1e-9):,.0f} tokens/s"
    for f in files.values():
        f.close()
    image_counts = image_writer.close() if image_writer is not None else {}
    return {"num_samples": num_samples, "num_tokens": num_tokens, "num_blank_lines_skipped": num_blank,
            "bad_records": bad.record(), **({"image_counts": image_counts} if image_counts else {})}


class Progress:
    """tqdm's bar for the tokenize loop (``tokenize:  42%|####      | 420/1000 [00:02<00:03, 180.1records/s,
    45,000 tokens/s]``, without a known total ``tokenize: 420records [00:02, 180.1records/s, ...]``) on stderr, at
    most once a second and when closed. Written here: importing tqdm reads its version from the installed
    packages' metadata (``importlib.metadata``), about 0.03 CPU-s of a small ``prepare``'s fixed cost."""

    WIDTH = 10
    """Characters of the bar."""

    def __init__(self, desc: str, total: int | None, unit: str, *, enabled: bool = True, interval: float = 1.0,
                 stream=None):
        import sys

        self.desc, self.total, self.unit, self.enabled, self.interval = desc, total, unit, enabled, interval
        self.stream, self.count, self.postfix = stream or sys.stderr, 0, ""
        self.start = self.shown = time.perf_counter()
        self.width = 0  # of the last line written: a shorter one is padded over it
        if enabled:
            self._show(self.start)

    def update(self, n: int) -> None:
        self.count += n
        now = time.perf_counter()
        if self.enabled and now - self.shown >= self.interval:
            self._show(now)

    def line(self, now: float) -> str:
        elapsed = now - self.start
        rate = f"{self.count / elapsed:.2f}{self.unit}/s" if elapsed > 0 and self.count else f"?{self.unit}/s"
        rest = f", {self.postfix}" if self.postfix else ""
        if not self.total:
            return f"{self.desc}: {self.count}{self.unit} [{_clock(elapsed)}, {rate}{rest}]"
        share = min(self.count / self.total, 1.0)
        filled = int(share * self.WIDTH)
        left = _clock((self.total - self.count) * elapsed / self.count) if self.count else "?"
        return (f"{self.desc}: {share:4.0%}|{'#' * filled}{' ' * (self.WIDTH - filled)}| {self.count}/{self.total} "
                f"[{_clock(elapsed)}<{left}, {rate}{rest}]")

    def _show(self, now: float) -> None:
        text = self.line(now)
        self.stream.write("\r" + text + " " * max(self.width - len(text), 0))
        self.stream.flush()
        self.width, self.shown = len(text), now

    def close(self) -> None:
        if self.enabled:
            self._show(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
            self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clock(seconds: float) -> str:
    """``MM:SS``, ``H:MM:SS`` from an hour on."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


NUM_BAD_RECORDS_LISTED = 10


class BadRecords:
    """The bad records ``data.on_bad_record=skip`` left out: counts by reason, the first few in file order."""

    def __init__(self):
        self.by_reason: dict[str, int] = {}
        self.first: list[dict] = []

    def add(self, bad: Iterable[tuple[str, str, str]]) -> None:
        for where, reason, message in bad:
            self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
            if len(self.first) < NUM_BAD_RECORDS_LISTED:
                self.first.append({"where": where, "reason": reason, "message": message})

    def record(self) -> dict:
        return {"num_skipped": sum(self.by_reason.values()), "by_reason": dict(sorted(self.by_reason.items())),
                "first": self.first}


def token_dtype_for(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.int32


def store_statistics(out_dir: Path) -> dict:
    """Length percentiles and prompt vs answer token counts, read back from the written arrays."""
    offsets = np.load(out_dir / "offsets.npy", mmap_mode="r", allow_pickle=False)
    mask = np.load(out_dir / "answer_mask.npy", mmap_mode="r", allow_pickle=False)
    num_ids = np.diff(offsets)
    num_answer = int(np.count_nonzero(mask))
    num_tokens = int(offsets[-1])
    pct = {f"p{q}": int(np.percentile(num_ids, q, method="higher")) if num_ids.size else 0 for q in (50, 90, 95, 99)}
    pct["max"] = int(num_ids.max()) if num_ids.size else 0
    return {"num_answer_tokens": num_answer, "num_prompt_tokens": num_tokens - num_answer,
            "answer_token_share": num_answer / num_tokens if num_tokens else 0.0,
            "prompt_to_answer_ratio": (num_tokens - num_answer) / num_answer if num_answer else None,
            "sample_num_ids_percentiles": pct}


class TokenStore:
    """Read-only, memory-mapped view of a token store directory."""

    def __init__(self, path: Path, metadata: dict):
        self.path = Path(path)
        self.metadata = metadata
        arrays = {name: np.load(self.path / f"{name}.npy", mmap_mode="r", allow_pickle=False)
                  for name in STORE_ARRAYS}
        self.tokens, self.answer_mask, self.offsets = arrays["tokens"], arrays["answer_mask"], arrays["offsets"]
        self.num_targets, self.source_file, self.source_line = (arrays["num_targets"], arrays["source_file"],
                                                                 arrays["source_line"])
        self.images = StoreImages(self.path, int(metadata["images"]["merge_size"])) if "images" in metadata else None
        """The image columns (``store.images``), or None for a text store."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def num_ids(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[start:stop], self.answer_mask[start:stop]

    def where(self, i: int) -> str:
        """``file: line N`` (or ``row N``) of sample ``i``."""
        files = self.metadata["sources"]["files"]
        name = files[int(self.source_file[i])]["path"]
        unit = "line" if name.endswith((".jsonl", ".json")) else "row"
        return f"{name}: {unit} {int(self.source_line[i])}"


def default_num_workers(requested: int, tokenizer=None) -> int:
    """Tokenize processes: ``requested`` when > 0, else (auto) one per usable CPU (the affinity,
    so a SLURM or cgroup allotment), whatever the tokenizer."""
    if requested > 0:
        return requested
    return usable_cpus()
