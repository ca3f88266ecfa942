"""The loader of ``packing.mode=online``: packs made at run time from this DP rank's shard.

``OnlineSource`` opens what the packs come from (``packing.online_source``): the prepared token
store (``store``, no plan needed), or ``data.input`` / the synthetic set tokenized on the fly
(``stream``). Each DP rank reads its own disjoint shard (all CP/TP ranks of one DP rank read the
same one) and packs it with ``megatron_pack.data.packing.online``. ``OnlineLoader.begin_step()``
takes this rank's packs of the next step: ``global_batch_size / dp`` of them, or, with
``train.global_batch_tokens``, packs until this rank's share ``global_batch_tokens / dp`` is met
(the shards are packed independently, so each rank meets its own share).

The loader's state is the pack stream's state (epoch, cursor, buffer ids, counters): a run
resumed from a checkpoint takes exactly the packs it would have taken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from megatron_pack.config.layout import effective_pad_multiple
from megatron_pack.config.schema import Config
from megatron_pack.data.batches.steps import StepInfo
from megatron_pack.data.formats.sources import DataError, iter_chunks, parse_chunk, resolve_inputs
from megatron_pack.data.packing.online import OnlinePacker, OnlinePackStream, RecordStream, StoreStream
from megatron_pack.data.store.metadata import PlanSettings, read_metadata
from megatron_pack.data.store.token_store import STORE_FORMAT, STORE_FORMAT_VERSION, TokenStore

STATE_VERSION = 1


def online_settings(cfg: Config) -> PlanSettings:
    """The per-sample rules of an online run (the offline plan's, algorithm 'online')."""
    pack_size = cfg.packing.packed_sequence_size
    max_length = min(cfg.packing.max_single_sequence_length or pack_size, pack_size)
    return PlanSettings(pack_size=pack_size, pad_multiple=effective_pad_multiple(cfg), algorithm="online",
                        seed=cfg.train.seed, on_overflow=cfg.packing.on_overflow, max_length=max_length)


class OnlineSource:
    """Where online packs come from, and the metadata the collate and ``validate`` read."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.settings = online_settings(cfg)
        self.plan_dir = None
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
        else:
            from megatron_pack.data.formats.tokenizer import build_tokenizer

            self.store = None
            self.tokenizer = build_tokenizer(cfg.data.tokenizer)
            ids = {"vocab_size": self.tokenizer.vocab_size, "pad_id": self.tokenizer.pad_id,
                   "eos_id": self.tokenizer.eos_id, "bos_id": self.tokenizer.bos_id}
            tokenizer = self.tokenizer.identity()
            if cfg.data.source == "files":
                self.files = resolve_inputs(cfg.data.input)
        self.metadata = {"pack_size": self.settings.pack_size, "pad_seq_to_mult": self.settings.pad_multiple,
                         "dataset_max_seqlen": self.settings.truncate_to, "max_samples_per_bin": None,
                         "tokenizer": tokenizer, "mode": "online", **ids}

    def first_packs(self, num_packs: int) -> OnlinePacks:
        """The first ``num_packs`` packs a single-rank run would train on."""
        return OnlinePacks(self, num_packs)

    def records(self, start: int) -> Iterator[tuple[int, dict, str]]:
        """``(index, record, where)`` of the raw records from ``start`` on (stream source)."""
        d = self.cfg.data
        if d.source == "synthetic":
            from megatron_pack.data.formats.synthetic import synthetic_record

            for i in range(start, d.synthetic_num_samples):
                yield i, synthetic_record(d.synthetic_seed, i, self.settings.truncate_to), f"<synthetic> row {i}"
            return
        index = 0
        for chunk in iter_chunks(self.files):
            unit = "line" if chunk.kind == "jsonl" else "row"
            for position, record in parse_chunk(chunk):
                if index >= start:
                    yield index, record, f"{chunk.path}: {unit} {position}"
                index += 1

    def pack_stream(self, *, shard: int, num_shards: int, announce: bool = False) -> OnlinePackStream:
        p = self.cfg.packing
        if self.store is not None:
            stream = StoreStream(self.store, self.settings, shard=shard, num_shards=num_shards, seed=self.cfg.train.seed)
        else:
            from megatron_pack.data.prepare import _schema

            stream = RecordStream(self.records, self.tokenizer, _schema(self.cfg), self.settings, shard=shard,
                                  num_shards=num_shards, answer_only_loss=self.cfg.data.answer_only_loss)
        packer = OnlinePacker(self.settings.pack_size, buffer_size=p.buffer_size, buffer_tokens=p.buffer_tokens)
        return OnlinePackStream(stream, packer, chunk_size=min(1024, p.buffer_size), announce=announce)


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


class OnlineLoader:
    """This DP rank's THD batches of online packs; ``begin_step()`` before each step's micro-batches."""

    def __init__(self, packs: OnlinePackStream, collate_fn: Callable, *, packs_per_step: int,
                 budget_tokens: Optional[int] = None, budget_kind: str = "target"):
        self.packs, self.collate_fn = packs, collate_fn
        self.packs_per_step, self.budget_tokens, self.budget_kind = packs_per_step, budget_tokens, budget_kind
        self._queue: list[dict] = []

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if not self._queue:
            raise RuntimeError("OnlineLoader: the loop asked for more packs than begin_step() planned")
        return self._queue.pop(0)

    def _batch(self) -> dict:
        pack = self.packs.next_pack()
        return self.collate_fn([self.packs.stream.sample(i, n) for i, n in pack])

    def begin_step(self) -> StepInfo:
        """Read, pack and collate this rank's packs of the next step."""
        if self._queue:
            raise RuntimeError(f"OnlineLoader: {len(self._queue)} packs of the previous step were not consumed")
        key = "num_target_tokens" if self.budget_kind == "target" else "num_real_tokens"
        tokens = 0
        while True:
            batch = self._batch()
            self._queue.append(batch)
            tokens += int(batch[key])
            if self.budget_tokens is None and len(self._queue) >= self.packs_per_step:
                break
            if self.budget_tokens is not None and tokens >= self.budget_tokens:
                break
        return StepInfo(num_microbatches=len(self._queue), tokens=tokens)

    @property
    def epoch(self) -> int:
        return self.packs.epoch

    @property
    def accounting(self) -> list[dict]:
        """Accounting of every finished epoch of this shard (read = packed + dropped)."""
        return self.packs.finished_epochs

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": "online", "packs": self.packs.state_dict(),
                "budget_tokens": self.budget_tokens, "packs_per_step": self.packs_per_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "online":
            raise ValueError("the checkpoint's loader state is not from packing.mode=online; resume with the "
                             "packing.mode it was written with, or start without checkpoint.load.")
        for key in ("budget_tokens", "packs_per_step"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"online loader state has {key}={state.get(key)!r} but this run has "
                                 f"{getattr(self, key)!r}; resume with the same train.global_batch_size / "
                                 "train.global_batch_tokens and data-parallel size.")
        self._queue = []
        self.packs.load_state_dict(state["packs"])
