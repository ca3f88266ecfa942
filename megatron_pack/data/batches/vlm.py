"""The vision-language THD batch: a text THD batch plus the pack's images and M-RoPE positions.

``with_images(collate, samples, ...)`` runs the text collate (offline ``collate_thd`` or in-batch
``collate_in_batch``), then adds, for the samples' ``images`` (``store.images.sample_images``):

| key | shape | meaning |
|---|---|---|
| pixel_values | float32 [num_patches, 3 * temporal_patch_size * patch_size**2] | the images in order of appearance, as the folder's image processor returns them (its own resize and normalization), concatenated; [0, D] without images |
| image_grid_thw | int64 [num_images, 3] | (t, h, w) per image, as the processor returns it; [0, 3] without images |
| mrope_position_ids | int64 [3, T] | per sub-sequence what transformers' ``get_rope_index`` gives for that sample alone |

Images are decoded here, so in the loader's worker processes when ``data.num_workers > 0``; each file's
sha256 is checked against the one prepare recorded, and the processor's grid against the stored one.

M-RoPE per sample (boundaries from ``cu_seqlens_padded``, never from token ids): text positions count up by 1
on all three rows; an image of grid (t, h, w) with merge m starting at text position p takes
``(p + i, p + j, p + k)`` for its (t, h/m, w/m) cells in row-major order, and the text after it continues at
``p + max(h, w) / m``. Padding continues the sample's last position +1, +2, ... on all rows (a zero-length
tail sub-sequence counts from 0). Example, tokens ``[a, S, P, P, P, P, E, b]`` with one 1x4x4 image (merge
2, 4 pads) at 2::

    t: [0, 1, 2, 2, 2, 2, 4, 5]
    h: [0, 1, 2, 2, 3, 3, 4, 5]
    w: [0, 1, 2, 3, 2, 3, 4, 5]
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from megatron_pack.data.formats.sources import DataError

_PROCESSORS: dict[str, Any] = {}


def image_processor(folder: str):
    """The folder's image processor (``AutoImageProcessor``: the torchvision backend where installed, else
    Pillow's), built once per process."""
    if folder not in _PROCESSORS:
        from transformers import AutoImageProcessor

        _PROCESSORS[folder] = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    return _PROCESSORS[folder]


def sample_mrope_positions(num_tokens: int, images: Sequence[Mapping[str, Any]], merge_size: int) -> np.ndarray:
    """int64 [3, num_tokens]: one sample's M-RoPE positions (see the module docstring); ``images`` give
    ``start`` (first pad token) and ``grid`` (t, h, w), in order, each wholly inside the sample."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    at, position = 0, 0
    for image in images:
        start = int(image["start"])
        t, h, w = (int(x) for x in image["grid"])
        h, w = h // merge_size, w // merge_size
        out[:, at:start] = position + np.arange(start - at)
        position += start - at
        cells = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        out[:, start:start + t * h * w] = position + cells
        at, position = start + t * h * w, position + max(h, w)
    out[:, at:] = position + np.arange(num_tokens - at)
    return out


def mrope_position_ids(samples: Sequence[Mapping[str, Any]], cu_seqlens: torch.Tensor,
                       cu_seqlens_padded: torch.Tensor, num_tokens: int, merge_size: int) -> torch.Tensor:
    """int64 [3, T] for a collated pack: sub-sequence ``k`` (``samples[k]``, or a zero-length tail) gets its own
    positions on its real tokens and continues them through its padding."""
    cu, cu_padded = cu_seqlens.tolist(), cu_seqlens_padded.tolist()
    out = np.zeros((3, num_tokens), dtype=np.int64)
    for k in range(len(cu) - 1):
        lo, hi, real = cu_padded[k], cu_padded[k + 1], cu[k + 1] - cu[k]
        if hi == lo:
            continue
        images = samples[k].get("images", []) if k < len(samples) else []
        own = sample_mrope_positions(real, images, merge_size)
        out[:, lo:lo + real] = own
        after = int(own[:, -1].max()) + 1 if real else 0
        out[:, lo + real:hi] = after + np.arange(hi - lo - real)
    return torch.from_numpy(out)


def _decode(image: Mapping[str, Any], sample_id, k: int):
    from PIL import Image

    name = image.get("path") or f"stored image {k}"
    try:
        data = image["data"] if "data" in image else Path(image["path"]).read_bytes()
    except OSError as exc:
        raise DataError(f"sample {sample_id}: image {k} ({name}) cannot be read ({exc.strerror}); restore the file "
                        "or re-run `megatron-pack prepare` with data.overwrite=true.") from None
    if hashlib.sha256(data).hexdigest() != image["sha256"]:
        raise DataError(f"sample {sample_id}: image {k} ({name}) changed since prepare (its sha256 differs); restore "
                        "it or re-run `megatron-pack prepare` with data.overwrite=true.")
    try:
        decoded = Image.open(io.BytesIO(data))
        decoded.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"sample {sample_id}: image {k} ({name}) cannot be decoded ({exc}); replace it and re-run "
                        "`megatron-pack prepare` with data.overwrite=true.") from None
    return decoded


def _stand_in(image: Mapping[str, Any], processor):
    """A black image the processor cuts into ``image``'s stored grid (its pixel size is that grid's): the pixels of an
    image that changed since prepare, so the pack keeps its shapes while its sample's loss is masked."""
    from PIL import Image

    _, h, w = (int(x) for x in image["grid"])
    return Image.new("RGB", (w * int(processor.patch_size), h * int(processor.patch_size)))


def pack_pixels(samples: Sequence[Mapping[str, Any]], processor,
                problems: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values, image_grid_thw)`` of the pack's images, checked against the grids prepare stored. An image
    that cannot be read or changed since prepare raises its ``DataError``; with ``problems`` (a list) it is appended
    there as ``(index of its sample in samples, message)`` and a black stand-in takes its place."""
    decoded, grids, owners = [], [], []
    for index, sample in enumerate(samples):
        for k, image in enumerate(sample.get("images", [])):
            try:
                where = f" ({sample['where']})" if sample.get("where") else ""  # the record: file and line
                decoded.append(_decode(image, f"{int(sample.get('sample_id', -1))}{where}", k))
            except DataError as exc:
                if problems is None:
                    raise
                problems.append((index, str(exc)))
                decoded.append(_stand_in(image, processor))
            grids.append(tuple(image["grid"]))
            owners.append((int(sample.get("sample_id", -1)), k))
    width = 3 * int(processor.temporal_patch_size) * int(processor.patch_size) ** 2
    if not decoded:
        return torch.zeros((0, width), dtype=torch.float32), torch.zeros((0, 3), dtype=torch.int64)
    out = processor(images=decoded, return_tensors="np")
    grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
    for (sample_id, k), stored, got in zip(owners, grids, grid.tolist()):
        if tuple(got) != tuple(stored):
            raise DataError(f"sample {sample_id}: image {k} has grid {tuple(got)} from the image processor but "
                            f"{tuple(stored)} in the token store (preprocessor_config.json changed since prepare); "
                            "re-run `megatron-pack prepare` with data.overwrite=true.")
    return torch.from_numpy(np.asarray(out["pixel_values"], dtype=np.float32)), torch.from_numpy(grid)


DATA_PROBLEM = "data_problem"
"""Batch key of the first image problem of a pack collated with ``stop_on_problem`` (a message naming the sample,
the image and the fix); the training loop stops the run after the step, as a stop signal does (``training.signals``)."""


def with_images(collate: Callable, samples: Sequence[Mapping[str, Any]], *, processor_dir: str, merge_size: int,
                skip_empty: bool = False, stop_on_problem: bool = False) -> dict:
    """``collate(samples)`` plus ``pixel_values``, ``image_grid_thw`` and ``mrope_position_ids`` (module
    docstring). ``skip_empty``: the collate leaves out samples without a token (in-batch packing does).
    ``stop_on_problem`` (training): an image that changed since prepare (or went missing) does not raise in the
    loader; its sample's loss mask is zeroed, a black stand-in takes its pixels and ``batch[DATA_PROBLEM]`` names
    it, so the run stops after this step with a checkpoint instead of a traceback that loses the steps since the
    last save."""
    batch = collate(samples)
    kept = [s for s in samples if len(s["input_ids"]) > 1] if skip_empty else list(samples)
    problems: list | None = [] if stop_on_problem else None
    pixels, grid = pack_pixels(kept, image_processor(processor_dir), problems)
    if problems:
        cu = batch["cu_seqlens_padded"].tolist()
        loss_mask = batch["loss_mask"].clone()
        for index, _ in problems:  # sub-sequence ``index`` is the sample: nothing of it is trained on
            loss_mask[..., cu[index]:cu[index + 1]] = 0
        batch["loss_mask"] = loss_mask
        batch[DATA_PROBLEM] = problems[0][1]
    batch["pixel_values"], batch["image_grid_thw"] = pixels, grid
    batch["mrope_position_ids"] = mrope_position_ids(kept, batch["cu_seqlens"], batch["cu_seqlens_padded"],
                                                     batch["tokens"].shape[-1], merge_size)
    return batch


def image_collate(collate: Callable, store_metadata: Mapping[str, Any], *, in_batch: bool = False,
                  stop_on_problem: bool = False) -> Callable:
    """``collate`` itself for a text store; for a store with images, ``with_images`` around it."""
    import functools

    images = store_metadata.get("images")
    if not images:
        return collate
    return functools.partial(with_images, collate, processor_dir=str(store_metadata["tokenizer_path"]),
                             merge_size=int(images["merge_size"]), skip_empty=in_batch, stop_on_problem=stop_on_problem)
