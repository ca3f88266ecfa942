"""The epoch order of offline packs, and which pack each data-parallel rank trains on.

``EpochOrder`` (``data/packing/order.py``) is the one order of an epoch's packs every offline
loader reads (the step planner, ``steps.py``, takes its steps from it): a permutation seeded by
``(train.seed, epoch)``, bucket after bucket with ``packing.bucket_order=sequential``. ``PackSampler`` is one DP rank's view of
the fixed-batch rule over it, pack after pack: it deals each epoch's order round-robin over
data-parallel ranks: in every *round* each DP rank takes one pack, rank ``r`` the ``r``-th of the
round. All CP and TP ranks of one DP rank build the sampler
with the same ``dp_rank`` and therefore read the same packs. Example, 5 packs, 2 DP ranks,
``shuffle=False``::

    epoch order [0, 1, 2, 3, 4]
    drop_last=True:  rank 0 -> [0, 2], rank 1 -> [1, 3]           (pack 4 waits for the next epoch, whose
                                                                  order is rotated: [4, 0, 1, 2, 3])
    drop_last=False: rank 0 -> [0, 2, 4], rank 1 -> [1, 3, 0]     (wraps around to give rank 1 a pack)

With ``groups`` (each pack's length bucket; ``packing.bucket_order=sequential``) an epoch's
order is bucket after bucket, shortest first, packs shuffled inside each bucket: the DP ranks
of one round read packs of the same bucket, so one step never mixes long and short packs
except where one bucket ends.

The resume point is ``(epoch, consumed)``: ``consumed`` packs of the epoch's order have been
trained on by the DP ranks together. Since rounds deal the order front to back, those are
exactly ``order[:consumed]``, so a run can even resume with another DP size.

Iterating the sampler never moves the resume point; ``advance(n)`` does. The training loop
reads packs through ``steps.StepLoader``, whose fixed-batch rule deals exactly as this sampler
(tests/unit/test_loader_protocol.py) and whose resume point moves with ``begin_step()``.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import numpy as np
from torch.utils.data import Sampler

from megatron_pack.data.packing.order import EpochOrder

STATE_VERSION = 1
__all__ = ["EpochOrder", "PackSampler"]


class PackSampler(Sampler[int]):
    """Seeded per-epoch shuffle of pack indices, sharded over DP ranks, endless across epochs.

    ``iter(sampler)`` yields this rank's pack indices from the resume point on, epoch after
    epoch, without moving the resume point; ``advance(n)`` moves it (``PackLoader`` calls it per
    consumed batch).
    """

    def __init__(self, num_packs: int, *, dp_rank: int, dp_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True, groups: Optional[np.ndarray] = None):
        if num_packs < 1:
            raise ValueError(f"PackSampler: num_packs ({num_packs}) must be >= 1; the packed dataset is empty: "
                             "re-run `megatron-pack prepare` on a non-empty data.input.")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"PackSampler: dp_rank ({dp_rank}) must be in [0, dp_size={dp_size}).")
        if drop_last and num_packs < dp_size:
            raise ValueError(f"PackSampler: {num_packs} pack(s) for {dp_size} data-parallel ranks with drop_last=True "
                             "gives every rank nothing; prepare more data, use fewer data-parallel ranks, or set "
                             "drop_last=False.")
        self.num_packs, self.dp_rank, self.dp_size = num_packs, dp_rank, dp_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        if groups is not None and len(groups) != num_packs:
            raise ValueError(f"PackSampler: groups has {len(groups)} entries for {num_packs} packs.")
        self.groups = None if groups is None else np.asarray(groups)
        """Length bucket of every pack for packing.bucket_order=sequential (None: one shuffle over all)."""
        self.order = EpochOrder(num_packs, seed, self.groups, shuffle,
                                rotate=num_packs % dp_size if drop_last else 0)
        self.epoch = 0
        """Epoch of the next pack to consume."""
        self.consumed = 0
        """Packs of this epoch's order consumed by all DP ranks together (a multiple of dp_size)."""

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All pack indices in the order of ``epoch`` (the same on every rank: ``EpochOrder``)."""
        return self.order(epoch)

    def _num_rounds(self, consumed: int) -> int:
        """Rounds left in an epoch after ``consumed`` packs of its order."""
        rest = self.num_packs - consumed
        return rest // self.dp_size if self.drop_last else -(-rest // self.dp_size)

    def _rounds(self, epoch: int, consumed: int) -> np.ndarray:
        """The rest of ``epoch`` from ``consumed`` on, as [num_rounds, dp_size] pack indices."""
        order = self.epoch_order(epoch)
        rest = order[consumed:]
        num_rounds = self._num_rounds(consumed)
        fill = num_rounds * self.dp_size - len(rest)
        if fill > 0:  # drop_last=False: wrap around to the start of the order
            rest = np.concatenate([rest, np.resize(order, fill)])
        return rest[: num_rounds * self.dp_size].reshape(num_rounds, self.dp_size)

    @property
    def num_packs_per_epoch(self) -> int:
        """Packs this rank reads in one whole epoch."""
        return self._num_rounds(0)

    def __iter__(self) -> Iterator[int]:
        return self._iterate(self.epoch, self.consumed)

    def _iterate(self, epoch: int, consumed: int) -> Iterator[int]:
        while True:
            for pack in self._rounds(epoch, consumed)[:, self.dp_rank]:
                yield int(pack)
            epoch, consumed = epoch + 1, 0

    def advance(self, num_consumed: int = 1) -> None:
        """Move the resume point past ``num_consumed`` more packs of this rank (one round each)."""
        while num_consumed > 0:
            left = self._num_rounds(self.consumed)
            if num_consumed < left:
                self.consumed += num_consumed * self.dp_size
                return
            num_consumed -= left
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict:
        """Plain ints and bools (checkpoint-safe): the resume point and what it depends on."""
        state = {"version": STATE_VERSION, "epoch": self.epoch, "consumed": self.consumed,
                 "num_packs": self.num_packs, "seed": self.seed, "shuffle": self.shuffle,
                 "drop_last": self.drop_last, "dp_size": self.dp_size}
        if self.groups is not None:
            state["bucket_order"] = "sequential"
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s next pack; refuses a state from another dataset, seed or order."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} is not {STATE_VERSION}; this "
                             "checkpoint was written by another megatron_pack version: start without checkpoint.load.")
        if state.get("bucket_order", "interleave") != ("sequential" if self.groups is not None else "interleave"):
            raise ValueError(f"sampler state from the checkpoint has packing.bucket_order="
                             f"{state.get('bucket_order', 'interleave')} but this run has the other order; resume with the "
                             "same packing.bucket_order, or start without checkpoint.load to begin a new run.")
        for key in ("num_packs", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler state from the checkpoint has {key}={state.get(key)!r} but this run has "
                    f"{getattr(self, key)!r}; resume with the same packed dataset and train.seed, or start without "
                    "checkpoint.load to begin a new run.")
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.num_packs:
            raise ValueError(f"sampler state consumed={consumed} is outside [0, num_packs={self.num_packs}].")
        self.epoch, self.consumed = int(state["epoch"]), consumed
