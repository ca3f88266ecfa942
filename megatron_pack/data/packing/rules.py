"""The per-sample packing rules, written once for the offline plan and the online packer.

``select`` decides, for each sample of a store (``plan.select_samples``) or of a chunk of an
online stream (``online.StoreStream`` / ``RecordStream`` / ``LengthStream``):

- **empty**: a sample without an answer token is dropped, counted ``no_answer_tokens``;
- **overflow**: a sample whose THD length exceeds ``max_length``, or whose padded length exceeds
  the pack, follows ``on_overflow``: ``error`` raises naming the offenders, ``drop`` drops and counts
  it (``too_long``), ``truncate`` keeps its first ``truncate_to + 1`` ids (dropped, counted
  ``no_answer_tokens_after_truncation``, when no answer token is left), ``split`` leaves it to the
  caller to cut into pieces (``split.split_entries``, offline only);
- ``wrapped`` plans cut documents at row ends by construction: nothing overflows there.

Example, pack size 8, pad multiple 4, max length 8, ``num_ids [5, 12, 3]`` (THD lengths 4, 11, 2),
targets ``[2, 3, 0]``, ``truncate``: sample 0 is kept whole, sample 1 (padded 12 > 8) is cut to
9 ids (8 THD tokens) and kept if an answer token survives, sample 2 is dropped as empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.packing.algorithms import thd_lengths
from megatron_pack.data.store.metadata import PlanSettings

DROP_REASONS = ("no_answer_tokens", "too_long", "no_answer_tokens_after_truncation")
IMAGE_CUT = "image_cut_by_truncation"
"""The drop reason of a sample truncation would cut through an image (only counted in a store with images)."""
NUM_OFFENDERS_SHOWN = 5


@dataclass
class Chosen:
    """What ``select`` decided for each of ``n`` samples."""

    keep: np.ndarray
    """bool [n]: packed whole (truncated ones included); with ``split`` the over-long ones are not."""
    num_ids: np.ndarray
    """int64 [n]: ids each sample reads (``truncate_to + 1`` for a truncated one)."""
    over: np.ndarray
    """bool [n]: longer than the pack allows (not empty, included): what ``split`` cuts into pieces."""
    dropped: dict
    """Count per reason in ``DROP_REASONS``."""
    num_truncated: int


def select(num_ids: np.ndarray, num_targets: np.ndarray, settings: PlanSettings, *,
           answer_after_truncation: Callable[[int, int], bool], where: Callable[[int], str],
           include: Optional[np.ndarray] = None, cuts_image: Optional[Callable[[int, int], bool]] = None) -> Chosen:
    """Apply the empty-sample rule and the overflow policy to samples of ``num_ids`` ids and
    ``num_targets`` answer tokens (see the module docstring).

    ``answer_after_truncation(i, take)`` says whether sample ``i`` still holds an answer token among
    its first ``take`` ids' targets; ``where(i)`` names it (file and line) for the ``error`` policy;
    ``include`` (bool, default all) limits the choice to those samples: the others are neither kept
    nor counted (the held-out validation share). ``cuts_image(i, take)`` (a store with images) says whether
    keeping ``take`` ids of sample ``i`` would cut through an image: such a sample is dropped, counted
    ``image_cut_by_truncation``, never cut.

    >>> s = PlanSettings(pack_size=8, pad_multiple=4, algorithm="bfd", seed=0, on_overflow="truncate", max_length=8)
    >>> c = select(np.array([5, 12, 3]), np.array([2, 3, 0]), s, answer_after_truncation=lambda i, t: True,
    ...            where=str)
    >>> c.keep.tolist(), c.num_ids.tolist(), c.dropped["no_answer_tokens"], c.num_truncated
    ([True, True, False], [5, 9, 3], 1, 1)
    """
    if settings.truncate_to < 1:
        raise DataError(f"packing.packed_sequence_size ({settings.pack_size}) is smaller than the pad multiple "
                        f"({settings.pad_multiple}); raise it to a multiple of {settings.pad_multiple}.")
    num_ids = np.asarray(num_ids, dtype=np.int64)
    include = np.ones(len(num_ids), dtype=bool) if include is None else np.asarray(include, dtype=bool)
    empty = (np.asarray(num_targets) == 0) & include
    padded = thd_lengths(num_ids, settings.pad_multiple)
    over = ((num_ids - 1 > settings.max_length) | (padded > settings.pack_size)) & ~empty & include
    if settings.algorithm == "wrapped":
        over[:] = False
    dropped = dict.fromkeys(DROP_REASONS, 0)
    dropped["no_answer_tokens"] = int(empty.sum())
    if cuts_image is not None:
        dropped[IMAGE_CUT] = 0
    take = num_ids.copy()
    if over.any() and settings.on_overflow == "error":
        raise DataError(overflow_message(settings, np.flatnonzero(over), num_ids, padded, where))
    keep = ~empty & include
    num_truncated = 0
    if settings.on_overflow in ("drop", "split"):
        dropped["too_long"] = int(over.sum()) if settings.on_overflow == "drop" else 0
        keep &= ~over
    else:
        for i in np.flatnonzero(over).tolist():
            take[i] = settings.truncate_to + 1
            if cuts_image is not None and cuts_image(i, int(take[i])):
                keep[i] = False
                dropped[IMAGE_CUT] += 1
            elif answer_after_truncation(i, int(take[i])):
                num_truncated += 1
            else:
                keep[i] = False
                dropped["no_answer_tokens_after_truncation"] += 1
    return Chosen(keep, take, over, dropped, num_truncated)


def overflow_message(settings: PlanSettings, offenders: np.ndarray, num_ids: np.ndarray, padded: np.ndarray,
                     where: Callable[[int], str]) -> str:
    """Every offender (the first few by file and line) and fixes that each work as written.

    ``packing.max_single_sequence_length`` is capped at the pack size, so raising it is offered
    only when it (not the pack) is what the offenders exceed; ``split`` only where the plan is made
    offline (online packing truncates or drops).
    """
    lines = [f"  {where(int(i))}: THD length {int(num_ids[i]) - 1} (padded {int(padded[i])})"
             for i in offenders[:NUM_OFFENDERS_SHOWN]]
    more = f"\n  ... and {len(offenders) - NUM_OFFENDERS_SHOWN} more" if len(offenders) > NUM_OFFENDERS_SHOWN else ""
    longest = int(np.max(np.asarray(padded)[offenders]))
    if longest <= settings.pack_size:  # only max_single_sequence_length is in the way
        whole = (f"set packing.max_single_sequence_length={settings.pack_size} (or leave it unset) to keep them whole")
    else:
        whole = (f"set packing.packed_sequence_size={longest} model.seq_length={longest} (a multiple of the pad "
                 f"multiple {settings.pad_multiple}; a pack is one sequence) to keep them whole")
    split = ", or packing.on_overflow=split to cut them into pieces" if settings.algorithm != "online" else ""
    return (f"{len(offenders)} sample(s) are longer than the pack allows (pack size {settings.pack_size}, "
            f"pad multiple {settings.pad_multiple}, max length {settings.max_length}):\n" + "\n".join(lines) + more +
            f"\nFix: set packing.on_overflow=truncate to cut them to {settings.truncate_to} tokens (or "
            f"packing.on_overflow=drop to skip them, counted{split}), or {whole}.")
