"""Random SFT samples and packs for the distributed tests (one generator, so the worlds draw alike).

A sample is ``n`` random ids in ``[3, 380)`` ending with eos (2), its answer mask on a random tail
(from a position in ``[1, n - 1)`` on); a pack is a list of such samples, ready for ``collate_thd``.
The draws go in a fixed order (per pack: its sample count; per sample: length, ids, mask start), so
a seed gives the same packs in every world.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

EOS = 2


def random_sample(rng: np.random.Generator, n: int, sample_id: int, *, targets: bool = True) -> dict:
    """One sample of ``n`` ids; ``targets=False``: no answer token (and no mask draw)."""
    ids = rng.integers(3, 380, size=n)
    ids[-1] = EOS
    mask = np.zeros(n, dtype=np.int64)
    if targets:
        mask[int(rng.integers(1, n - 1)):] = 1
    return {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "sample_id": sample_id}


def random_packs(seed: int, num_packs: int, *, samples: tuple[int, int] = (2, 4), length: tuple[int, int] = (5, 20),
                 no_target: Iterable[int] = ()) -> list[list[dict]]:
    """``num_packs`` packs of ``rng.integers(*samples)`` samples of ``rng.integers(*length)`` ids each
    (half-open ranges); the packs listed in ``no_target`` hold no target token. Sample ids count up."""
    rng = np.random.default_rng(seed)
    empty = set(no_target)
    packs, sample_id = [], 0
    for p in range(num_packs):
        pack = []
        for _ in range(int(rng.integers(*samples))):
            pack.append(random_sample(rng, int(rng.integers(*length)), sample_id, targets=p not in empty))
            sample_id += 1
        packs.append(pack)
    return packs
