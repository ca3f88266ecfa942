"""Online packing: packs made while the samples stream in, from a bounded, resumable buffer.

A *sample stream* hands out this shard's samples in a deterministic order, a chunk at a time,
as ``(sample_id, num_ids, padded length)`` with the empty-sample rule and the overflow policy
already applied by ``rules.select``, the offline plan's own function (the same rules and counters). Two
streams exist:

- ``StoreStream``: a prepared token store; each epoch is a permutation seeded by
  ``(seed, epoch)``, and shard ``s`` of ``S`` reads positions ``s, s+S, s+2S, ...`` of it;
- ``RecordStream``: raw records (``data.input`` files or the synthetic set) tokenized on the fly;
  record ``i`` belongs to shard ``i % S``, in file order (a stream cannot be shuffled globally;
  the buffer mixes it locally).

The shards of a run are disjoint: one per data-parallel rank, so no sample is read twice.

``OnlinePacker`` keeps at most ``buffer_size`` samples and ``buffer_tokens`` padded tokens. When
the buffer is full it runs best-fit decreasing over the buffer (``algorithms.best_fit_decreasing``:
the offline plan's ``bfd``, written once) and emits the fullest packs until
the buffer is down to half of each bound; the samples of the emptier packs wait for partners.
At the end of an epoch the rest is emitted. Worked example, pack size 8, buffer_size 4, padded
lengths arriving ``[5, 4, 3, 2 | 6, 1]``::

    buffer [5, 4, 3, 2] is full -> BFD gives packs {5, 3} (load 8) and {4, 2} (load 6)
    emit the fullest, {5, 3}; [4, 2] wait (2 samples = half the buffer)
    buffer [4, 2, 6, 1], the stream ends -> BFD gives {6, 2} and {4, 1}: emit both

The state (epoch, stream cursor, the ids in the buffer, the epoch's counters) is plain ints and
lists: ``OnlinePackStream.state_dict()`` goes into the loader state and the checkpoint, and a run
resumed from it emits exactly the packs the uninterrupted run would have.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Protocol

import numpy as np

from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.packing.algorithms import best_fit_decreasing, thd_lengths
from megatron_pack.data.packing.order import EpochOrder
from megatron_pack.data.packing.rules import DROP_REASONS, Chosen, select
from megatron_pack.data.store.metadata import PlanSettings

log = logging.getLogger("megatron_pack.train.accounting")
"""Per-epoch accounting lines; the train entry shows them on every rank that announces."""

STATE_VERSION = 1


@dataclass
class Chunk:
    """Samples a stream hands to the packer, and what it read and dropped to get them."""

    ids: np.ndarray
    """int64 [n] sample ids (store index, or record index of the stream)."""
    num_ids: np.ndarray
    """int64 [n] ids to read per sample (fewer than stored when truncated)."""
    lengths: np.ndarray
    """int64 [n] padded THD lengths."""
    num_read: int
    dropped: dict
    num_truncated: int
    end_of_epoch: bool


class SampleStream(Protocol):
    """What ``OnlinePackStream`` needs of a source of samples."""

    cursor: int
    """Positions of this epoch's shard order read so far."""
    settings: PlanSettings

    def start_epoch(self, epoch: int, cursor: int = 0) -> None: ...

    def next_chunk(self, max_samples: int) -> Chunk: ...

    def sample(self, sample_id: int, num_ids: int) -> dict: ...

    def restore(self, sample_ids: list[int]) -> None: ...


def _chunk(ids: np.ndarray, chosen: Chosen, settings: PlanSettings, end_of_epoch: bool) -> Chunk:
    """The chunk of the samples ``select`` kept out of ``ids`` (online packing never splits: validate refuses it)."""
    if settings.on_overflow == "split":
        raise ValueError("online packing has no on_overflow=split (validate() refuses packing.mode=online with it)")
    keep = chosen.keep
    return Chunk(ids[keep], chosen.num_ids[keep], thd_lengths(chosen.num_ids[keep], settings.pad_multiple), len(ids),
                 chosen.dropped, chosen.num_truncated, end_of_epoch)


class StoreStream:
    """One shard of a token store, epoch after epoch, in an order seeded by ``(seed, epoch)``; ``held_out``
    (bool [samples], optional) marks the samples kept for validation, which the stream never yields."""

    def __init__(self, store, settings: PlanSettings, *, shard: int, num_shards: int, seed: int,
                 held_out: Optional[np.ndarray] = None):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard ({shard}) must be in [0, num_shards={num_shards}).")
        self.store, self.settings, self.held_out = store, settings, held_out
        self.shard, self.num_shards, self.seed = shard, num_shards, seed
        self._num_ids_all = store.num_ids()
        self.epoch, self.cursor = 0, 0
        self._order = self._shard_order(0)

    def _shard_order(self, epoch: int) -> np.ndarray:
        order = EpochOrder(len(self.store), self.seed)(epoch)  # the one epoch order, over samples
        if self.held_out is not None:
            order = order[~self.held_out[order]]
        return order[self.shard::self.num_shards].copy()  # a copy: the view would keep the whole permutation

    def start_epoch(self, epoch: int, cursor: int = 0) -> None:
        if epoch != self.epoch:
            self._order = self._shard_order(epoch)
        self.epoch, self.cursor = epoch, cursor

    def next_chunk(self, max_samples: int) -> Chunk:
        ids = self._order[self.cursor:self.cursor + max_samples].astype(np.int64)
        self.cursor += len(ids)
        num_ids = self._num_ids_all[ids].astype(np.int64)
        targets = np.asarray(self.store.num_targets[ids], dtype=np.int64)

        def answer_after(i: int, take: int) -> bool:
            start = int(self.store.offsets[ids[i]])
            return bool(np.any(self.store.answer_mask[start + 1:start + take]))

        chosen = select(num_ids, targets, self.settings, answer_after_truncation=answer_after,
                        where=lambda i: self.store.where(int(ids[i])))
        return _chunk(ids, chosen, self.settings, self.cursor >= len(self._order))

    def sample(self, sample_id: int, num_ids: int) -> dict:
        return store_sample(self.store, sample_id, num_ids)

    def restore(self, sample_ids: list[int]) -> None:
        """Nothing to do: the store is random access."""


def store_sample(store, sample_id: int, num_ids: int) -> dict:
    """Sample ``sample_id`` of a token store, its first ``num_ids`` ids, as the collate takes it."""
    start = int(store.offsets[sample_id])
    return {"input_ids": store.tokens[start:start + num_ids].astype(np.int64),
            "loss_mask": store.answer_mask[start:start + num_ids].astype(np.int64), "sample_id": int(sample_id)}


class RecordStream:
    """One shard of raw records tokenized on the fly; record ``i`` belongs to shard ``i % num_shards``.

    ``records(start, stride)`` yields ``(record_index, record, where)`` of records ``start,
    start + stride, ...`` (a fresh pass per epoch, the same order every epoch; a source may yield
    the others too, they are skipped). Tokenized samples are held only while their id is
    in the buffer; ``restore`` re-reads (without tokenizing the others) the buffered records of
    a resumed state.
    """

    def __init__(self, records, tokenizer, schema, settings: PlanSettings, *, shard: int, num_shards: int,
                 answer_only_loss: bool = True, on_bad_record: str = "error"):
        self.records, self.tokenizer, self.schema, self.settings = records, tokenizer, schema, settings
        self.shard, self.num_shards, self.answer_only_loss = shard, num_shards, answer_only_loss
        self.skip_bad = on_bad_record == "skip"  # data.on_bad_record: counted as dropped "bad_record"
        self.epoch, self.cursor = 0, 0
        self._held: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._it: Optional[Iterator] = None

    def start_epoch(self, epoch: int, cursor: int = 0) -> None:
        self.epoch, self.cursor = epoch, cursor
        self._it = self.records(cursor * self.num_shards + self.shard, self.num_shards)

    def _next_mine(self):
        for index, record, where in self._it:
            if index % self.num_shards == self.shard:
                return index, record, where
        return None

    def next_chunk(self, max_samples: int) -> Chunk:
        if self._it is None:
            self.start_epoch(self.epoch, self.cursor)
        got, end = [], False
        while len(got) < max_samples:
            item = self._next_mine()
            if item is None:
                end = True
                break
            got.append(item)
        self.cursor += len(got)
        encoded, good = [], []
        for item in got:
            try:
                encoded.append(self._encode(item[1], item[2]))
                good.append(item)
            except DataError as exc:
                if not (self.skip_bad and exc.reason):
                    raise
        num_bad, got = len(got) - len(good), good
        ids = np.array([i for i, _, _ in got], dtype=np.int64)
        num_ids = np.array([len(x) for x, _ in encoded], dtype=np.int64)
        targets = np.array([int(m[1:].sum()) for _, m in encoded], dtype=np.int64)
        chosen = select(num_ids, targets, self.settings,
                        answer_after_truncation=lambda i, t: bool(encoded[i][1][1:t].any()), where=lambda i: got[i][2])
        for j in np.flatnonzero(chosen.keep):
            self._held[int(ids[j])] = encoded[j]
        chunk = _chunk(ids, chosen, self.settings, end)
        if self.skip_bad:  # data.on_bad_record=skip: the bad records were read, and dropped as "bad_record"
            chunk.num_read += num_bad
            chunk.dropped["bad_record"] = num_bad
        return chunk

    def _encode(self, record, where: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of one record; a bad one raises ``DataError`` with its reason (None: not skippable)."""
        if isinstance(record, DataError):  # a line that did not parse
            raise record
        try:
            ids, mask = self.tokenizer.encode_sample(record, self.schema, answer_only_loss=self.answer_only_loss)
        except ValueError as exc:
            reason = getattr(exc, "reason", None) if not getattr(exc, "fatal", False) else None
            raise DataError(f"{where}: {exc}", reason) from None
        except UnicodeEncodeError:
            raise DataError(f"{where}: the text holds an unpaired surrogate, which is not valid Unicode; fix the "
                            "\\uXXXX escapes or drop the record.", "invalid_unicode") from None
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64)

    def sample(self, sample_id: int, num_ids: int) -> dict:
        ids, mask = self._held.pop(int(sample_id))
        return {"input_ids": ids[:num_ids], "loss_mask": mask[:num_ids], "sample_id": int(sample_id)}

    def restore(self, sample_ids: list[int]) -> None:
        wanted = set(int(i) for i in sample_ids)
        for index, record, where in self.records(self.shard, self.num_shards):
            if not wanted:
                break
            if index in wanted:
                self._held[index] = self._encode(record, where)
                wanted.discard(index)
        if wanted:
            raise DataError(f"the checkpoint's online-packing buffer names records {sorted(wanted)[:5]} that the "
                            "stream no longer has; resume with the same data.input, or start without checkpoint.load.")


def block_seeded(draw, seed: int, block: int = 4096):
    """``num_ids(epoch, start, stop)`` for ``LengthStream`` from ``draw(rng, n) -> lengths``: sample ``i``'s
    length depends on ``(seed, epoch, i)`` only (drawn in blocks of ``block``), never on how it is read."""

    def num_ids(epoch: int, start: int, stop: int) -> np.ndarray:
        first, last = start // block, -(-stop // block)
        drawn = np.concatenate([np.asarray(draw(np.random.default_rng([seed, epoch, b]), block), np.int64)
                                for b in range(first, max(last, first + 1))])
        return drawn[start - first * block:stop - first * block]

    return num_ids


class LengthStream:
    """Samples that are only lengths (``num_ids``), for simulations, benchmarks and memory tests:
    ``num_ids(epoch, start, stop)`` gives the ids count of samples ``start .. stop-1`` of this
    shard's epoch order (computed on demand, so a 10M-sample stream holds one chunk at a time)."""

    def __init__(self, num_samples: int, num_ids, settings: PlanSettings, *, shard: int = 0, num_shards: int = 1):
        self.num_samples, self.num_ids_of, self.settings = num_samples, num_ids, settings
        self.shard, self.num_shards = shard, num_shards
        self.epoch, self.cursor = 0, 0
        self._size = len(range(shard, num_samples, num_shards))

    def start_epoch(self, epoch: int, cursor: int = 0) -> None:
        self.epoch, self.cursor = epoch, cursor

    def next_chunk(self, max_samples: int) -> Chunk:
        start, stop = self.cursor, min(self.cursor + max_samples, self._size)
        self.cursor = stop
        ids = np.arange(start, stop, dtype=np.int64) * self.num_shards + self.shard
        num_ids = np.asarray(self.num_ids_of(self.epoch, start, stop), dtype=np.int64)
        chosen = select(num_ids, (num_ids > 1).astype(np.int64), self.settings,
                        answer_after_truncation=lambda i, t: True, where=lambda i: f"sample {int(ids[i])}")
        return _chunk(ids, chosen, self.settings, stop >= self._size)

    def sample(self, sample_id: int, num_ids: int) -> dict:
        raise TypeError("LengthStream holds lengths only, not tokens; use StoreStream or RecordStream to train.")

    def restore(self, sample_ids: list[int]) -> None:
        """Nothing to do: lengths are recomputed on demand."""


class OnlinePacker:
    """A buffer bounded by ``buffer_size`` samples and ``buffer_tokens`` padded tokens; packs by best fit
    (at most ``max_samples`` samples a pack when given)."""

    def __init__(self, capacity: int, *, buffer_size: int, buffer_tokens: Optional[int] = None,
                 max_samples: Optional[int] = None):
        self.max_samples = max_samples
        """Most samples in one pack (``packing.max_samples_per_pack``); None: no cap."""
        if buffer_size < 1:
            raise ValueError(f"packing.buffer_size ({buffer_size}) must be >= 1.")
        self.capacity, self.buffer_size = capacity, buffer_size
        self.buffer_tokens = buffer_tokens or buffer_size * capacity
        if self.buffer_tokens < capacity:
            raise ValueError(f"packing.buffer_tokens ({self.buffer_tokens}) must be >= the pack size ({capacity}).")
        self.ids = np.zeros(0, np.int64)
        self.num_ids = np.zeros(0, np.int64)
        self.lengths = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def push(self, ids: np.ndarray, num_ids: np.ndarray, lengths: np.ndarray) -> None:
        self.ids = np.concatenate([self.ids, ids])
        self.num_ids = np.concatenate([self.num_ids, num_ids])
        self.lengths = np.concatenate([self.lengths, lengths])

    def emit(self, final: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """Packs as ``(sample ids, ids to read)``: the fullest down to half the buffer, or all when ``final``."""
        if not len(self):
            return []
        bins, loads = best_fit_decreasing(self.lengths, self.capacity, self.max_samples)
        # fullest first; among equal loads the bin holding the oldest sample first (FIFO-like)
        rank = sorted(range(len(bins)), key=lambda b: (-int(loads[b]), int(bins[b].min())))
        take, left, tokens = [], len(self), self.num_tokens
        for b in rank:
            if not final and take and left <= self.buffer_size // 2 and tokens <= self.buffer_tokens // 2:
                break
            take.append(b)
            left -= len(bins[b])
            tokens -= int(loads[b])
        out = [(self.ids[bins[b]], self.num_ids[bins[b]]) for b in take]
        gone = np.concatenate([bins[b] for b in take])
        keep = np.ones(len(self), bool)
        keep[gone] = False
        self.ids, self.num_ids, self.lengths = self.ids[keep], self.num_ids[keep], self.lengths[keep]
        return out


@dataclass
class EpochAccounting:
    """Counters of one epoch of this shard: read = packed + dropped + still buffered."""

    num_read: int = 0
    num_packed: int = 0
    num_truncated: int = 0
    num_packs: int = 0
    num_pack_tokens: int = 0
    dropped: dict = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))

    def as_dict(self) -> dict:
        return {"num_samples_read": self.num_read, "num_samples_packed": self.num_packed,
                "num_samples_dropped": dict(self.dropped), "num_samples_truncated": self.num_truncated,
                "num_packs": self.num_packs, "num_pack_tokens": self.num_pack_tokens}


def announce_epoch(record: Mapping[str, Any], shard: int) -> None:
    """Log one finished epoch's accounting (a record of ``OnlinePackStream.finished_epochs``)."""
    log.info("online packing epoch %d (shard %d): read %d = packed %d + dropped %s; %d packs, %d truncated",
             record["epoch"], shard, record["num_samples_read"], record["num_samples_packed"],
             record["num_samples_dropped"], record["num_packs"], record["num_samples_truncated"])


class OnlinePackStream:
    """Packs of one shard, epoch after epoch: ``next_pack()`` returns ``[(sample_id, num_ids), ...]``.

    ``chunk_size`` samples are read at a time (never more than the buffer has room for).
    ``state_dict()`` / ``load_state_dict()`` resume at the next pack exactly.
    """

    def __init__(self, stream: SampleStream, packer: OnlinePacker, *, chunk_size: int = 1024,
                 announce: bool = False):
        self.stream, self.packer, self.chunk_size, self.announce = stream, packer, chunk_size, announce
        self.epoch = 0
        self.accounting = EpochAccounting()
        self.finished_epochs: list[dict] = []
        """Accounting of every epoch finished in this run (and before, when resumed)."""
        self._ready: list[tuple[np.ndarray, np.ndarray]] = []
        self._epoch_done = False
        self.pack_epoch = 0
        """Epoch of the pack ``next_pack`` returned last."""
        self.stream.start_epoch(0, 0)

    def next_pack(self) -> list[tuple[int, int]]:
        """The next pack; ``pack_epoch`` is then its epoch (``epoch`` may already name the next one)."""
        while not self._ready:
            self._fill()
        self.pack_epoch = self.epoch
        ids, num_ids = self._ready.pop(0)
        self.accounting.num_packs += 1
        self.accounting.num_packed += len(ids)
        self.accounting.num_pack_tokens += int(thd_lengths(num_ids, self.packer_pad).sum())
        if self._epoch_done and not self._ready and not len(self.packer):
            self._finish_epoch()
        return list(zip(ids.tolist(), num_ids.tolist()))

    @property
    def packer_pad(self) -> int:
        return self.stream.settings.pad_multiple

    def _fill(self) -> None:
        """Read until the buffer is full or the epoch ends, then emit packs."""
        while not self._epoch_done:
            # a padded sample is at most one pack long, so n samples always fit both bounds
            free_tokens = (self.packer.buffer_tokens - self.packer.num_tokens) // self.packer.capacity
            n = min(self.chunk_size, self.packer.buffer_size - len(self.packer), free_tokens)
            if n <= 0:
                break
            chunk = self.stream.next_chunk(n)
            self._count(chunk)
            self.packer.push(chunk.ids, chunk.num_ids, chunk.lengths)
            self._epoch_done = chunk.end_of_epoch
        self._ready = self.packer.emit(final=self._epoch_done)
        if not self._ready and self._epoch_done:
            self._finish_epoch()

    def _count(self, chunk: Chunk) -> None:
        a = self.accounting
        a.num_read += chunk.num_read
        a.num_truncated += chunk.num_truncated
        for key, value in chunk.dropped.items():
            a.dropped[key] = a.dropped.get(key, 0) + value

    def _finish_epoch(self) -> None:
        a = self.accounting
        if a.num_read != a.num_packed + sum(a.dropped.values()):
            raise AssertionError(f"online accounting broken: read {a.num_read} != packed {a.num_packed} + dropped "
                                 f"{sum(a.dropped.values())}")
        record = {"epoch": self.epoch, **a.as_dict()}
        self.finished_epochs.append(record)
        if self.announce:
            announce_epoch(record, getattr(self.stream, "shard", 0))
        if a.num_packed == 0:
            raise DataError(f"online packing epoch {self.epoch}: no sample of this shard was packed (dropped "
                            f"{a.dropped}); check data.answer_only_loss, packing.on_overflow and the shard size.")
        self.epoch += 1
        self.accounting = EpochAccounting()
        self._epoch_done = False
        self.stream.start_epoch(self.epoch, 0)

    def state_dict(self) -> dict:
        """Plain ints and lists: the epoch, the stream cursor, the buffer and the packs ready to hand out."""
        ready = [[ids.tolist(), n.tolist()] for ids, n in self._ready]
        return {"version": STATE_VERSION, "epoch": self.epoch, "cursor": int(self.stream.cursor),
                "epoch_done": self._epoch_done, "buffer_ids": self.packer.ids.tolist(),
                "buffer_num_ids": self.packer.num_ids.tolist(), "ready": ready,
                "accounting": self.accounting.as_dict(), "finished_epochs": list(self.finished_epochs)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"online packing state version {state.get('version')!r} is not {STATE_VERSION}; start "
                             "without checkpoint.load.")
        pad = self.packer_pad
        self.epoch = int(state["epoch"])
        self.stream.start_epoch(self.epoch, int(state["cursor"]))
        self._epoch_done = bool(state["epoch_done"])
        ids = np.asarray(state["buffer_ids"], np.int64)
        num_ids = np.asarray(state["buffer_num_ids"], np.int64)
        self.packer.ids, self.packer.num_ids, self.packer.lengths = ids, num_ids, thd_lengths(num_ids, pad)
        self._ready = [(np.asarray(i, np.int64), np.asarray(n, np.int64)) for i, n in state["ready"]]
        self.stream.restore(ids.tolist() + [int(i) for r, _ in state["ready"] for i in r])
        acc = state["accounting"]
        self.accounting = EpochAccounting(acc["num_samples_read"], acc["num_samples_packed"],
                                          acc["num_samples_truncated"], acc["num_packs"], acc["num_pack_tokens"],
                                          dict(acc["num_samples_dropped"]))
        self.finished_epochs = [dict(e) for e in state["finished_epochs"]]
