"""The one epoch order: which item comes when in an epoch, the same on every rank.

Offline, the items are the packs of a plan (every step rule of ``data/batches/steps.py`` takes its
steps from this order, so the seed and the length buckets hold for a fixed global batch, a token
budget and a balanced deal alike); online, the samples of a token store (``online.StoreStream``
cuts each epoch's order into its shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True, eq=False)
class EpochOrder:
    """All item indices in the order of an epoch, the same on every rank; ``order(epoch)``.

    A permutation seeded by ``(seed, epoch)``; with ``groups`` (each pack's length bucket,
    ``packing.bucket_order=sequential``) bucket after bucket, smallest bucket first, shuffled
    inside each. Unshuffled (tests), index order rotated by ``epoch * rotate`` packs: a fixed-batch
    epoch leaves out its last ``num_packs % dp`` packs, and the rotation leaves out others next time.

    >>> EpochOrder(5, seed=0, shuffle=False, rotate=1)(1).tolist()
    [4, 0, 1, 2, 3]
    >>> EpochOrder(4, seed=0, groups=np.array([1, 0, 1, 0]))(0).tolist()[:2] in ([1, 3], [3, 1])
    True
    """

    num_packs: int
    seed: int
    groups: Optional[np.ndarray] = None
    shuffle: bool = True
    rotate: int = 0

    def __call__(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.roll(np.arange(self.num_packs, dtype=np.int64), (epoch * self.rotate) % self.num_packs)
        rng = np.random.default_rng([self.seed, epoch])
        if self.groups is not None:  # bucket_order=sequential: bucket after bucket, shuffled inside each
            return np.concatenate([rng.permutation(np.flatnonzero(self.groups == g))
                                   for g in np.unique(self.groups)]).astype(np.int64)
        return rng.permutation(self.num_packs).astype(np.int64)

    @property
    def bucket_order(self) -> str:
        """``packing.bucket_order`` this order follows."""
        return "interleave" if self.groups is None else "sequential"
