"""Ready online packs of one DP rank, made in the training process or in DataLoader workers.

With ``data.num_workers = W > 0`` each worker of DP rank ``r`` packs its own disjoint shard,
``r * W + w`` of ``dp * W`` (tokenizing, for the stream source, and collating in the worker);
with ``W = 0`` the training process packs shard ``r`` of ``dp`` itself (the same packs as
``W = 1``). Every pack comes as a ``ReadyPack`` that carries the state of its worker's pack
stream *after* that pack, so the loader can resume exactly after the last pack it trained.

torch's DataLoader hands out the items of an ``IterableDataset`` round-robin over its workers,
always starting at worker 0. A resumed loader must continue with the worker whose pack comes
next, so the shard a worker packs is rotated: DataLoader worker ``w`` packs the shard of
*logical* worker ``(w + next_worker) % W``. Example, W = 2, the loader trained packs
``a0 b0 a1`` (logical worker 0 made ``a*``, 1 made ``b*``) and then checkpointed::

    saved: states [after a1, after b0], next_worker 1
    resume: DataLoader worker 0 restarts logical worker 1 from "after b0" -> b1
            DataLoader worker 1 restarts logical worker 0 from "after a1" -> a2
    order:  b1 a2 b2 a3 ...   (the uninterrupted run: a0 b0 a1 | b1 a2 b2 a3 ...)

Packs a worker made but the loader had not trained (prefetched, or waiting in its queue) are
simply made again after a resume: a pack stream resumed from a state emits exactly the packs
that followed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.packing.balance import pack_cost


@dataclass
class ReadyPack:
    """One collated pack, what the step selection reads of it, and where its stream stood after it."""

    batch: dict
    """The THD batch (``collate_thd``)."""
    pack: list[tuple[int, int]]
    """``(sample id, ids to read)`` of its samples: enough to read it again from a token store."""
    samples: Optional[list[dict]]
    """The tokenized samples (stream source with ``packing.balance=dp``: another DP rank may train it)."""
    target_tokens: int
    real_tokens: int
    cost: float
    """``packing.cost_a * real tokens + packing.cost_b * sum(len^2)`` (``balance.pack_cost``)."""
    worker: int
    """Logical worker (0 .. W-1) that made it."""
    state: dict
    """``OnlinePackStream.state_dict()`` of that worker's shard after this pack."""

    def pin_memory(self) -> "ReadyPack":
        """DataLoader(pin_memory=True) pins the batch's tensors (the rest are plain values)."""
        self.batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in self.batch.items()}
        return self

    def as_numpy(self) -> "ReadyPack":
        """The batch's tensors as numpy arrays: a worker sends them through its pipe in one pickle (torch
        would move each small tensor through its own shared-memory file, which costs more than the copy)."""
        self.batch = {k: v.numpy() if torch.is_tensor(v) else v for k, v in self.batch.items()}
        return self

    def as_torch(self) -> "ReadyPack":
        """The inverse of ``as_numpy`` (no copy)."""
        self.batch = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in self.batch.items()}
        return self

    def tokens(self, kind: str) -> int:
        """Tokens counted against a budget of ``train.token_budget`` kind ('target' or 'real')."""
        return self.target_tokens if kind == "target" else self.real_tokens


class PackMaker:
    """Makes the ``ReadyPack`` s of one shard: ``make_stream(shard=, num_shards=)`` gives its
    ``OnlinePackStream``; ``collate_fn`` turns a pack's samples into a THD batch."""

    def __init__(self, make_stream: Callable, collate_fn: Callable, *, cost_a: float, cost_b: float,
                 keep_samples: bool = False):
        self.make_stream, self.collate_fn = make_stream, collate_fn
        self.cost_a, self.cost_b, self.keep_samples = cost_a, cost_b, keep_samples

    def packs(self, *, shard: int, num_shards: int, worker: int, state: Optional[dict]) -> Iterator[ReadyPack]:
        """Endless packs of ``shard``, from ``state`` (None: its start)."""
        stream = self.make_stream(shard=shard, num_shards=num_shards)
        if state is not None:
            stream.load_state_dict(state)
        while True:
            pack = stream.next_pack()
            samples = [stream.stream.sample(i, n) for i, n in pack]
            batch = self.collate_fn(samples)
            seqlens = [n - 1 for _, n in pack]
            yield ReadyPack(batch=batch, pack=pack, samples=samples if self.keep_samples else None,
                            target_tokens=int(batch["num_target_tokens"]), real_tokens=int(batch["num_real_tokens"]),
                            cost=pack_cost(seqlens, self.cost_a, self.cost_b), worker=worker,
                            state=stream.state_dict())


class ShardPacks(IterableDataset):
    """The packs of DP rank ``dp_rank``'s ``num_workers`` shards, one per DataLoader worker (rotated
    by ``next_worker``, see the module docstring), each resumed from ``states[logical worker]``."""

    def __init__(self, maker: PackMaker, *, dp_rank: int, dp_size: int, num_workers: int,
                 states: Sequence[Optional[dict]], next_worker: int):
        self.maker, self.dp_rank, self.dp_size, self.num_workers = maker, dp_rank, dp_size, num_workers
        self.states, self.next_worker = list(states), next_worker

    def __iter__(self) -> Iterator[ReadyPack]:
        info = get_worker_info()
        logical = ((0 if info is None else info.id) + self.next_worker) % self.num_workers
        packs = self.maker.packs(shard=shard_of(self.dp_rank, logical, self.num_workers),
                                 num_shards=self.dp_size * self.num_workers, worker=logical,
                                 state=self.states[logical])
        return packs if info is None else (ready.as_numpy() for ready in packs)


def _as_is(item: ReadyPack) -> ReadyPack:
    """The DataLoader's per-item conversion: none (a module-level function, so spawned workers can pickle it)."""
    return item


class PackFeed:
    """This DP rank's ready packs in the order its shards take turns: logical workers
    ``next_worker, next_worker + 1, ...`` (mod W), one pack each."""

    def __init__(self, maker: PackMaker, *, dp_rank: int, dp_size: int, num_workers: int, pin_memory: bool = False):
        self.maker, self.dp_rank, self.dp_size = maker, dp_rank, dp_size
        self.num_workers, self.pin_memory = num_workers, pin_memory

    @property
    def num_shards(self) -> int:
        """Shards of this DP rank (logical workers): ``max(data.num_workers, 1)``."""
        return max(self.num_workers, 1)

    def start(self, states: Sequence[Optional[dict]], next_worker: int) -> Iterator[ReadyPack]:
        """Packs from the given per-worker states on; the first comes from logical worker ``next_worker``."""
        dataset = ShardPacks(self.maker, dp_rank=self.dp_rank, dp_size=self.dp_size, num_workers=self.num_shards,
                             states=states, next_worker=next_worker)
        if self.num_workers == 0:
            items: Iterator[ReadyPack] = iter(dataset)
        else:
            # its own generator: making the iterator draws nothing from the global torch RNG (dropout masks)
            # no pin_memory here: a worker's batch crosses the pipe as numpy, which torch's pin thread
            # skips; it is pinned below, once it is torch again
            items = iter(DataLoader(dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is,
                                    prefetch_factor=2, generator=torch.Generator().manual_seed(0)))
        return self._in_turn(items, next_worker)

    def _in_turn(self, items: Iterator[ReadyPack], next_worker: int) -> Iterator[ReadyPack]:
        expect = next_worker
        pin = self.pin_memory  # the caller passes the run's device: True only on a GPU
        try:
            for item in items:
                if item.worker != expect:  # the rotation rests on the DataLoader's strict round-robin
                    raise RuntimeError(f"online packs arrived from worker {item.worker}, expected worker {expect}")
                expect = (expect + 1) % self.num_shards
                item = item.as_torch() if self.num_workers else item
                yield item.pin_memory() if pin else item
        except DataError as exc:  # a worker's DataError comes back wrapped with its traceback: one line again
            raise DataError(worker_error_line(str(exc))) from None


def worker_error_line(message: str) -> str:
    """The original one-line message of a ``DataError`` that torch re-raised from a DataLoader worker
    (``"Caught DataError in DataLoader worker process 1.\\nOriginal Traceback ... DataError: <line>"``).

    >>> worker_error_line("Caught DataError in DataLoader worker process 1.\\nTraceback:\\n  x\\nDataError: no sample.\\n")
    'no sample.'
    """
    marker = "DataError: "
    if message.startswith("Caught DataError") and marker in message:
        return message.rsplit(marker, 1)[1].strip()
    return message


def shard_of(dp_rank: int, worker: int, num_workers: int) -> int:
    """The shard logical ``worker`` of DP rank ``dp_rank`` packs: ``dp_rank * W + worker`` of ``dp * W``.

    >>> [shard_of(r, w, 2) for r in range(2) for w in range(2)]
    [0, 1, 2, 3]
    """
    return dp_rank * max(num_workers, 1) + worker
