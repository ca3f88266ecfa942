"""Packing rules for a token store with images: a plan never cuts through an image.

An image is ``n`` ``<|image_pad|>`` ids from ``start`` (``store.images``); a sample cut to ``take`` ids keeps the
tokens ``ids[:take - 1]``, so the image survives whole when ``start + n <= take - 1`` and is left out whole when
``start >= take - 1``; anything between cuts it, and such a sample is dropped (counted
``image_cut_by_truncation``). Strategies that cut samples by construction (``on_overflow=split``,
``algorithm=wrapped``) are refused for such a store, and under ``on_overflow=error`` an image larger than the
pack is named with its record and the fixes.

Example, pack 16 (truncate to 16 tokens, 17 ids): a sample with a 6-token image at 12 keeps ids[:16] (pads 12..17
cut): dropped; with the image at 3 it is kept, truncated after the image.
"""

from __future__ import annotations

import numpy as np

from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.store.metadata import PlanSettings

NUM_SHOWN = 5


def image_tokens(store) -> np.ndarray:
    """int64 [M]: the ``<|image_pad|>`` ids of every image (t*h*w / merge_size**2)."""
    grid = np.asarray(store.images.grid, dtype=np.int64).reshape(-1, 3)
    return grid.prod(axis=1) // int(store.metadata["images"]["merge_size"]) ** 2


def image_cut_rule(store):
    """``cuts(i, take)``: whether keeping ``take`` ids of sample ``i`` cuts one of its images."""
    offsets, starts, sizes = store.images.offsets, store.images.token_start, image_tokens(store)

    def cuts(i: int, take: int) -> bool:
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        start, end = np.asarray(starts[lo:hi]), np.asarray(starts[lo:hi]) + sizes[lo:hi]
        return bool(np.any((start < take - 1) & (end > take - 1)))
    return cuts


def check_image_plan(store, settings: PlanSettings, include=None) -> None:
    """Refuse, in one message, the plans that would cut images (see the module docstring)."""
    num_images = len(store.images.token_start)
    if settings.algorithm == "wrapped":
        raise DataError(f"packing.algorithm=wrapped cuts samples at row ends, which would cut the images of this "
                        f"dataset ({num_images} images); use packing.algorithm=bfd (or another whole-sample algorithm).")
    if settings.on_overflow == "split":
        raise DataError(f"packing.on_overflow=split cuts long samples into pieces, which would cut the images of this "
                        f"dataset ({num_images} images); use packing.on_overflow=truncate (a cut that would go through "
                        "an image drops the sample, counted) or packing.on_overflow=drop.")
    if settings.on_overflow == "error":
        _refuse_images_over_the_pack(store, settings, include)


def _refuse_images_over_the_pack(store, settings: PlanSettings, include) -> None:
    sizes = image_tokens(store)
    too_big = np.flatnonzero(sizes + 2 > settings.truncate_to)  # with <|vision_start|> and <|vision_end|>
    sample_of = np.searchsorted(np.asarray(store.images.offsets), too_big, side="right") - 1
    if include is not None:
        keep = np.asarray(include, dtype=bool)[sample_of]
        too_big, sample_of = too_big[keep], sample_of[keep]
    if not len(too_big):
        return
    needed = int(sizes[too_big].max()) + 2
    multiple = settings.pad_multiple
    needed = -(-needed // multiple) * multiple
    lines = []
    for j, i in zip(too_big[:NUM_SHOWN].tolist(), sample_of[:NUM_SHOWN].tolist()):
        k = j - int(store.images.offsets[i])
        t, h, w = (int(x) for x in store.images.grid[3 * j:3 * j + 3])
        lines.append(f"  {store.where(i)}: image {k} takes {int(sizes[j])} tokens (grid {t}x{h}x{w})")
    more = f"\n  ... and {len(too_big) - NUM_SHOWN} more" if len(too_big) > NUM_SHOWN else ""
    raise DataError(f"{len(too_big)} image(s) take more tokens than the pack holds ({settings.truncate_to}):\n"
                    + "\n".join(lines) + more + f"\nFix: set packing.packed_sequence_size={needed} "
                    f"model.seq_length={needed} (or more), lower max_pixels (size.longest_edge) in the folder's "
                    "image processor settings (processor_config.json's image_processor, else preprocessor_config.json) "
                    "and re-run prepare, or set packing.on_overflow=drop to leave those "
                    "samples out (counted).")
