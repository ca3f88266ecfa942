"""The loader of ``packing.mode=online``: packs made at run time from this DP rank's shards.

``OnlineSource`` opens what the packs come from (``packing.online_source``): the prepared token
store (``store``, no plan needed), or ``data.input`` / the synthetic set tokenized on the fly
(``stream``). Each DP rank packs its own disjoint shards (one per DataLoader worker, see
``online_feed.py``; all CP/TP ranks of one DP rank make the same packs) with
``megatron_pack.data.packing.online``.

``OnlineLoader.begin_step()`` decides the next step's packs over the whole DP group, the same on
every rank. Each rank queues its ready packs; then

1. selection: ``global_batch_size / dp`` packs from each rank's queue, or, with
   ``train.global_batch_tokens``, packs taken round-robin over the ranks' queues (rank 0's next,
   rank 1's next, ...) until the global budget is met, at least one per rank
   (``select_round_robin``, on token counts every rank shares by one small all-gather; it looks
   further ahead when the queues run out first). The step overshoots by less than its last pack;
2. deal: each rank trains the packs selected from its own queue, or, with ``packing.balance=dp``,
   the selected packs are dealt by ``assign_balanced`` on their cost, as offline; a pack that
   changes rank travels as its sample ids (store source: every rank reads the store) or as its
   tokenized samples (stream source), in one all-gather of only the moved packs.

Packs not selected stay queued. The loader's state is, per worker, its pack stream's state after
the last pack this rank has selected, and which worker comes next: a resumed run takes exactly
the packs it would have taken (queued and prefetched packs are made again).
"""

from __future__ import annotations

import itertools
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from megatron_pack.config.layout import effective_pack_multiple, effective_pad_multiple
from megatron_pack.config.schema import Config
from megatron_pack.data.batches.protocol import LoaderInfo, StepInfo
from megatron_pack.data.formats.sources import DataError, iter_chunks, parse_chunk, parse_line, resolve_inputs
from megatron_pack.data.batches.online_feed import PackFeed, ReadyPack, shard_of
from megatron_pack.data.packing.balance import assign_balanced, imbalance
from megatron_pack.data.packing.online import (OnlinePacker, OnlinePackStream, RecordStream, StoreStream,
                                               announce_epoch, store_sample)
from megatron_pack.data.store.metadata import PlanSettings, read_metadata
from megatron_pack.data.store.token_store import STORE_FORMAT, STORE_FORMAT_VERSION, TokenStore

STATE_VERSION = 2


def online_settings(cfg: Config) -> PlanSettings:
    """The per-sample rules of an online run (the offline plan's, algorithm 'online')."""
    pack_size = cfg.packing.packed_sequence_size
    max_length = min(cfg.packing.max_single_sequence_length or pack_size, pack_size)
    return PlanSettings(pack_size=pack_size, pad_multiple=effective_pad_multiple(cfg), algorithm="online",
                        seed=cfg.train.seed, on_overflow=cfg.packing.on_overflow, max_length=max_length)


def online_packing_record(cfg: Config) -> dict:
    """What decides the packs of an online run beyond the DP size and workers: the per-sample rules,
    the buffer and the cap. Saved with the loader state; a resume with other values is refused
    (its restored buffer and ready packs were made under the saved ones)."""
    s, p = online_settings(cfg), cfg.packing
    return {"pack_size": s.pack_size, "pad_multiple": s.pad_multiple, "seed": s.seed, "on_overflow": s.on_overflow,
            "max_length": s.max_length, "online_source": p.online_source, "buffer_size": p.buffer_size,
            "buffer_tokens": p.buffer_tokens, "max_samples_per_pack": p.max_samples_per_pack}


_RECORD_KEYS = {"pack_size": "packing.packed_sequence_size", "seed": "train.seed",
                "max_length": "packing.max_single_sequence_length",
                "pad_multiple": "the pad multiple (packing.pad_seq_to_mult and the CP / TP rule)"}
"""The config key behind each ``online_packing_record`` entry that is not ``packing.<entry>``."""


def max_samples_per_pack(cfg: Config) -> int:
    """Most samples an online pack can hold: ``packing.max_samples_per_pack``, else the bound every
    pack obeys anyway (a kept sample has at least one THD token, padded to the pad multiple).
    ``packing.pad_cu_seqlens`` gives cu_seqlens this + 2 entries (one shape for CUDA graphs).

    >>> from megatron_pack.config.schema import PackingConfig
    >>> max_samples_per_pack(Config(packing=PackingConfig(packed_sequence_size=64, pad_seq_to_mult=8, mode="online")))
    8
    """
    if cfg.packing.max_samples_per_pack is not None:
        return int(cfg.packing.max_samples_per_pack)
    return cfg.packing.packed_sequence_size // effective_pad_multiple(cfg)


class OnlineSource:
    """Where online packs come from, and the metadata the collate and ``validate`` read."""

    def __init__(self, cfg: Config, *, recorded_plan=None):
        """``recorded_plan``: the prepared plan whose manifest completed ``cfg`` (store source); with
        ``data.validation_fraction`` its held-out samples are left out of the stream and its ``validation``
        sub-plan is the run's validation set (``held_out_plan``)."""
        self.cfg = cfg
        self.settings = online_settings(cfg)
        self.plan_dir = None
        self.held_out_plan = None
        self._held_out = None
        if cfg.packing.online_source == "store":
            dataset_dir = Path(cfg.data.dataset_dir)
            if not (dataset_dir / "metadata.json").is_file():
                raise DataError(f"data.dataset_dir ({dataset_dir}) holds no token store for packing.mode=online; run "
                                f"`megatron-pack prepare data.dataset_dir={dataset_dir}` first, or set "
                                "packing.online_source=stream to tokenize data.input on the fly.")
            meta = read_metadata(dataset_dir, STORE_FORMAT, STORE_FORMAT_VERSION)
            self.store = TokenStore(dataset_dir, meta)
            ids = {k: meta[k] for k in ("vocab_size", "pad_id", "eos_id", "bos_id")}
            tokenizer = meta["tokenizer"]
            if cfg.data.validation_fraction:
                self._hold_out(recorded_plan)
        else:
            from megatron_pack.data.formats.tokenizer import build_tokenizer

            self.store = None
            self.tokenizer = build_tokenizer(cfg.data.tokenizer)
            ids = {"vocab_size": self.tokenizer.vocab_size, "pad_id": self.tokenizer.pad_id,
                   "eos_id": self.tokenizer.eos_id, "bos_id": self.tokenizer.bos_id}
            tokenizer = self.tokenizer.identity()
            if cfg.data.source == "files":
                self.files = resolve_inputs(cfg.data.input, cfg.data.split)
        self.metadata = {"pack_size": self.settings.pack_size, "pad_seq_to_mult": self.settings.pad_multiple,
                         "pack_multiple": effective_pack_multiple(cfg),
                         "dataset_max_seqlen": self.settings.truncate_to, "max_samples_per_bin": max_samples_per_pack(cfg),
                         "tokenizer": tokenizer, "mode": "online", **ids}

    def _hold_out(self, recorded_plan) -> None:
        """The samples ``data.validation_fraction`` holds out (prepare's rule, ``held_out_mask``: the same ones
        every plan of this store with that fraction and seed holds out), never trained on here."""
        from megatron_pack.data.store.metadata import VALIDATION_DIRNAME, held_out_mask

        d = self.cfg.data
        if recorded_plan is not None:
            self.held_out_plan = Path(recorded_plan) / VALIDATION_DIRNAME
        self._held_out = held_out_mask(len(self.store), float(d.validation_fraction), int(d.validation_seed))

    def first_packs(self, num_packs: int) -> OnlinePacks:
        """The first ``num_packs`` packs a single-rank run would train on."""
        return OnlinePacks(self, num_packs)

    def records(self, start: int, stride: int = 1) -> Iterator[tuple[int, dict, str]]:
        """``(index, record, where)`` of the raw records ``start, start + stride, ...`` (stream source;
        each DataLoader worker reads every ``stride``-th: of a JSONL file it splits every line but
        parses only its own, the synthetic set makes only those). Blank lines are not records."""
        d = self.cfg.data
        if d.source == "synthetic":
            from megatron_pack.data.formats.synthetic import synthetic_record

            for i in range(start, d.synthetic_num_samples, stride):
                yield i, synthetic_record(d.synthetic_seed, i, self.settings.truncate_to), f"<synthetic> row {i}"
            return
        index = 0
        for chunk in iter_chunks(self.files):
            if chunk.kind == "jsonl":
                for offset, raw in enumerate(chunk.items):
                    if not raw.strip():
                        continue
                    if index >= start and (index - start) % stride == 0:  # JSON of other shards is never parsed
                        line = chunk.first + offset
                        try:
                            record = parse_line(raw, chunk.path, line)
                        except DataError as exc:  # the stream decides (data.on_bad_record)
                            record = exc
                        yield index, record, f"{chunk.path}: line {line}"
                    index += 1
                continue
            for position, record in parse_chunk(chunk):
                if index >= start and (index - start) % stride == 0:
                    yield index, record, f"{chunk.path}: row {position}"
                index += 1

    def pack_stream(self, *, shard: int, num_shards: int, announce: bool = False) -> OnlinePackStream:
        p = self.cfg.packing
        if self.store is not None:
            stream = StoreStream(self.store, self.settings, shard=shard, num_shards=num_shards, seed=self.cfg.train.seed,
                                 held_out=self._held_out)
        else:
            from megatron_pack.data.prepare import _schema

            stream = RecordStream(self.records, self.tokenizer, _schema(self.cfg), self.settings, shard=shard,
                                  num_shards=num_shards, answer_only_loss=self.cfg.data.answer_only_loss,
                                  on_bad_record=self.cfg.data.on_bad_record)
        packer = OnlinePacker(self.settings.pack_size, buffer_size=p.buffer_size, buffer_tokens=p.buffer_tokens,
                              max_samples=p.max_samples_per_pack)
        return OnlinePackStream(stream, packer, chunk_size=min(1024, p.buffer_size), announce=announce)

    def samples_of(self, moved: list) -> list[dict]:
        """The samples of a pack another DP rank made, from what it sent (``OnlineLoader``): read
        from the store by ``(sample id, ids to read)``, or the tokenized samples themselves (stream)."""
        if self.store is not None:
            return [store_sample(self.store, int(i), int(n)) for i, n in moved]
        return list(moved)


class OnlinePacks:
    """The first packs of one shard as a small list-like dataset (``megatron-pack verify`` reads it)."""

    def __init__(self, source: "OnlineSource", num_packs: int, *, shard: int = 0, num_shards: int = 1):
        stream = source.pack_stream(shard=shard, num_shards=num_shards)
        self.metadata = source.metadata
        self.plan_dir = f"online packs of shard {shard}/{num_shards} (packing.buffer_size={source.cfg.packing.buffer_size})"
        self._packs = [[stream.stream.sample(i, n) for i, n in stream.next_pack()] for _ in range(num_packs)]

    def __len__(self) -> int:
        return len(self._packs)

    def __getitem__(self, i: int) -> list[dict]:
        return self._packs[i]


Gather = Callable[[Any], list]
"""``gather(obj)``: every DP rank's ``obj``, by DP rank (an all-gather over the data-parallel group)."""


def single_rank(obj: Any) -> list:
    """The ``Gather`` of a data-parallel group of one rank."""
    return [obj]


def select_round_robin(tokens: Sequence[Sequence[int]], budget: int) -> Optional[list[int]]:
    """Packs each DP rank takes for a step of ``budget`` tokens, or None when the look-ahead runs out first.

    ``tokens[r]`` holds the token counts of rank ``r``'s next ready packs (the same look-ahead depth
    on every rank). Packs are taken round-robin, rank 0's next, rank 1's next, ..., round after
    round, until the taken tokens reach ``budget`` and every rank has at least one. So the step
    overshoots the budget by less than its last pack (unless the first round alone overshoots).
    Every rank runs this on the same all-gathered table, so every rank takes the same decision.

    >>> select_round_robin([[5, 4, 9], [1, 3, 9]], 12)   # 5 + 1 + 4 = 10 < 12, + 3 = 13 >= 12
    [2, 2]
    >>> select_round_robin([[5, 4, 9], [1, 3, 9]], 10)   # 5 + 1 + 4 = 10: rank 0 takes one more
    [2, 1]
    >>> select_round_robin([[5, 4], [1, 3]], 20) is None  # 13 tokens in sight: look further ahead
    True
    """
    counts, total = [0] * len(tokens), 0
    depth = min(len(t) for t in tokens)
    for k in range(depth):
        for r, row in enumerate(tokens):
            total += int(row[k])
            counts[r] += 1
            if total >= budget and (k > 0 or r == len(tokens) - 1):
                return counts
    return None


class OnlineLoader:
    """This DP rank's THD batches of online packs (a ``protocol.BatchLoader``); ``begin_step()`` before
    each step's micro-batches.

    ``gather`` all-gathers over the data-parallel group (every rank calls it in the same order:
    only when the whole group needs it, never on one rank's data alone); ``samples_of`` turns
    what another rank sent for a moved pack into its samples (``OnlineSource.samples_of``).
    """

    def __init__(self, feed: PackFeed, collate_fn: Callable, *, packs_per_step: int,
                 budget_tokens: Optional[int] = None, budget_kind: str = "target", balance: str = "none",
                 gather: Gather = single_rank, samples_of: Optional[Callable] = None, announce: bool = False,
                 num_workers: int = 0, packing: Optional[dict] = None, pp_size: int = 1):
        if feed.dp_size > 1 and gather is single_rank and (budget_tokens is not None or balance == "dp"):
            raise ValueError("OnlineLoader: a token budget or packing.balance=dp over several DP ranks needs the "
                             "DP group's gather (megatron_pack.training.loop.build_loader passes it)")
        self.feed, self.collate_fn, self.gather, self.samples_of = feed, collate_fn, gather, samples_of
        self.dp_rank, self.dp_size, self.num_workers = feed.dp_rank, feed.dp_size, num_workers
        self.packs_per_step, self.budget_tokens, self.budget_kind = packs_per_step, budget_tokens, budget_kind
        self.balance, self.announce, self.pp_size = balance, announce, pp_size
        self.info = LoaderInfo()
        """No plan: no buckets, sources or fingerprint."""
        self.packing = dict(packing or {})
        """``online_packing_record(cfg)``: checked against a checkpoint's on resume."""
        self.states: list[Optional[dict]] = [None] * feed.num_shards
        """Per logical worker: its pack stream's state after the last pack this rank selected."""
        self.next_worker = 0
        """The logical worker whose pack comes next."""
        self._reset()

    def _reset(self) -> None:
        if getattr(self, "_items", None) is not None:
            self._items.close()  # a DataLoader's workers stop with it
        self._items: Optional[Iterator[ReadyPack]] = None
        self._pending: deque[ReadyPack] = deque()
        self._queue: list[dict] = []
        self._depth = 1

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if not self._queue:
            raise RuntimeError("OnlineLoader: the loop asked for more packs than begin_step() planned")
        return self._queue.pop(0)

    def begin_step(self) -> StepInfo:
        """Select, and with balancing deal, the packs of the next step (module docstring)."""
        if self._queue:
            raise RuntimeError(f"OnlineLoader: {len(self._queue)} packs of the previous step were not consumed")
        if self._items is None:
            self._items = self.feed.start(self.states, self.next_worker)
        counts, table = self._select()
        mine = [self._pending.popleft() for _ in range(counts[self.dp_rank])]
        for ready in mine:
            self._consume(ready)
        if table is None:  # fixed pack counts, no balancing: no rank needs another's numbers
            self._queue = [ready.batch for ready in mine]
            return StepInfo(num_microbatches=len(mine))
        slots = [(r, k) for k in range(max(counts)) for r in range(self.dp_size) if k < counts[r]]
        costs = np.array([table[r][k][1] for r, k in slots], dtype=np.float64)
        owned = [np.array([i for i, (r, _) in enumerate(slots) if r == rank], dtype=np.int64)
                 for rank in range(self.dp_size)]
        pp = self.pp_size
        deal = assign_balanced(costs, self.dp_size, pp) if self.balance == "dp" else owned
        self._queue = self._deal(mine, slots, deal)
        return StepInfo(num_microbatches=len(self._queue), tokens=int(sum(table[r][k][0] for r, k in slots)),
                        imbalance_before=imbalance(costs, owned, pp), imbalance_after=imbalance(costs, deal, pp))

    def _select(self) -> tuple[list[int], Optional[list]]:
        """(packs each rank takes, the gathered ``(tokens, cost)`` of every rank's next packs or None)."""
        if self.budget_tokens is None:
            self._fill(self.packs_per_step)
            table = self._gather_heads(self.packs_per_step) if self.balance == "dp" else None
            return [self.packs_per_step] * self.dp_size, table
        depth = self._depth
        while True:  # the same tables on every rank, so every rank loops the same number of times
            self._fill(depth)
            table = self._gather_heads(depth)
            counts = select_round_robin([[t for t, _ in row] for row in table], self.budget_tokens)
            if counts is not None:
                self._depth = max(counts)
                return counts, table
            depth *= 2

    def _fill(self, depth: int) -> None:
        while len(self._pending) < depth:
            self._pending.append(next(self._items))

    def _gather_heads(self, depth: int) -> list:
        heads = [(ready.tokens(self.budget_kind), ready.cost) for ready in itertools.islice(self._pending, depth)]
        return self.gather(heads)

    def _consume(self, ready: ReadyPack) -> None:
        """``ready`` is trained in this step: its worker resumes after it; announce epochs it finished."""
        before = self.states[ready.worker]
        done = len(before["finished_epochs"]) if before is not None else 0
        self.states[ready.worker] = ready.state
        self.next_worker = (ready.worker + 1) % self.feed.num_shards
        if self.announce:
            for record in ready.state["finished_epochs"][done:]:
                announce_epoch(record, shard_of(self.dp_rank, ready.worker, self.num_workers))

    def _deal(self, mine: list[ReadyPack], slots: list[tuple[int, int]], deal: list[np.ndarray]) -> list[dict]:
        """This rank's batches of the deal, in slot order; moved packs come in one all-gather."""
        rank_of = np.empty(len(slots), dtype=np.int64)
        for rank, members in enumerate(deal):
            rank_of[members] = rank
        moved = [i for i, (owner, _) in enumerate(slots) if rank_of[i] != owner]
        received: list = []
        if moved:  # every rank knows the whole deal, so all of them enter this gather or none does
            sent = {i: (mine[slots[i][1]].pack if mine[slots[i][1]].samples is None else mine[slots[i][1]].samples)
                    for i in moved if slots[i][0] == self.dp_rank}
            received = self.gather(sent)
        batches = []
        for i in deal[self.dp_rank].tolist():
            owner, k = slots[i]
            batches.append(mine[k].batch if owner == self.dp_rank
                           else self.collate_fn(self.samples_of(received[owner][i])))
        return batches

    @property
    def epoch(self) -> float:
        """Whole epochs every shard of this rank has finished (the earliest epoch any of them is in)."""
        return float(min(0 if s is None else int(s["epoch"]) for s in self.states))

    @property
    def packs_per_epoch(self) -> None:
        """Unknown: packs are made at run time (validate() refuses train.num_epochs online)."""
        return None

    def num_steps(self, num_epochs: int) -> None:
        return None

    @property
    def accounting(self) -> list[dict]:
        """Accounting of every finished epoch of this rank's shards (read = packed + dropped), with its shard."""
        records = [{**record, "shard": shard_of(self.dp_rank, w, self.num_workers)}
                   for w, s in enumerate(self.states) if s is not None for record in s["finished_epochs"]]
        return sorted(records, key=lambda r: (r["epoch"], r["shard"]))

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": "online", "dp_size": self.dp_size, "num_workers": self.num_workers,
                "states": list(self.states), "next_worker": self.next_worker, "packing": dict(self.packing),
                "budget_tokens": self.budget_tokens, "packs_per_step": self.packs_per_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "online":
            raise ValueError("the checkpoint's loader state is not from packing.mode=online; resume with the "
                             "packing.mode it was written with, or start without checkpoint.load.")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"the checkpoint's online loader state has version {state.get('version')!r}, this "
                             f"version reads {STATE_VERSION}; start without checkpoint.load.")
        problem = online_resume_problem(state, dp_size=self.dp_size, num_workers=self.num_workers,
                                        packing=self.packing or None)
        if problem:
            raise ValueError(problem)
        for key in ("budget_tokens", "packs_per_step"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"online loader state has {key}={state.get(key)!r} but this run has "
                                 f"{getattr(self, key)!r}; resume with the same train.global_batch_size / "
                                 "train.global_batch_tokens.")
        self._reset()
        self.states = [None if s is None else dict(s) for s in state["states"]]
        self.next_worker = int(state["next_worker"])


def online_resume_problem(state: Mapping[str, Any], *, dp_size: int, num_workers: int,
                          packing: Optional[Mapping[str, Any]] = None,
                          fresh: str = "start without checkpoint.load") -> Optional[str]:
    """Why an online loader state cannot resume at ``dp_size`` ranks with ``num_workers`` workers and the
    ``packing`` record (``online_packing_record``; None: not checked) (None: it can); ``fresh`` says how
    to start over instead. Its shards are ``dp_rank * W + w`` of ``dp * W`` (``W = max(num_workers, 1)``),
    so both must match, and its buffer holds samples chosen under the saved packing rules."""
    saved_packing = state.get("packing") or {}
    for key in sorted(packing or {}):
        if key in saved_packing and saved_packing[key] != packing[key]:
            name = _RECORD_KEYS.get(key, f"packing.{key}")
            return (f"{name} ({packing[key]}) differs from the checkpoint's online packing ({saved_packing[key]}): its "
                    f"buffer and ready packs were made under the saved rules; set it back to {saved_packing[key]} to "
                    f"resume, or {fresh}.")
    if state.get("dp_size") != dp_size:
        return (f"the checkpoint's online packing state was written at data-parallel size {state.get('dp_size')} "
                f"and each DP rank's shards depend on it, this run has {dp_size}; resume with "
                f"{state.get('dp_size')} data-parallel ranks, or {fresh}.")
    saved = int(state.get("num_workers", 0))
    if max(saved, 1) != max(num_workers, 1):
        return (f"data.num_workers ({num_workers}) differs from the checkpoint's ({saved}): each worker packs its own "
                f"shard of the online stream; set data.num_workers={saved} to resume, or {fresh}.")
    return None
