"""`megatron-pack inspect DIR sample=I`: sample I of the token store as the model sees it.

Prints where the sample came from, the pack it is in (per plan), and its ids decoded with the ids that carry
loss marked: a run of ids whose answer mask is 1 (the ids that are labels with loss: the response and its eos)
is written ``[[...]]``, and an image's placeholder ids as ``<image k: N tokens>``. So a chat template's loss
mask is checked in one command, e.g. for the byte tokenizer::

    sample 0 of data/synthetic (synthetic: line 1): 23 ids, 6 carry loss (marked [[...]]), 0 images
      plan pack512_mult4_bfd_seed0_error_3f2a9c0d1e2b: pack 17, sample 3 of 9, THD positions 204..226 of 512
    <bos><|user|>copy: abc<|assistant|>[[abc<eos>]]

Inside a pack a sample of n ids gives n-1 positions: tokens ``ids[:-1]``, labels ``ids[1:]``, loss mask
``answer_mask[1:]`` (docs/thd.md); the marks sit on the label ids, so the first id never carries loss. With a
plan that cuts the sample (``on_overflow=truncate`` or ``split``) the pack's own loss mask is shown for the ids
it holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OPEN, CLOSE = "[[", "]]"


def parse_sample(argv: list[str]) -> tuple[list[str], int | None]:
    """``(argv without sample=I, I)``; ``sample=x`` that is not a whole number >= 0 raises ``DataError``."""
    from megatron_pack.data.formats.sources import DataError

    given = [a for a in argv if a.startswith("sample=")]
    if not given:
        return argv, None
    value = given[-1].partition("=")[2]
    if not value.isdigit():
        raise DataError(f"sample ({value}) must be a sample index, a whole number from 0; write "
                        "`megatron-pack inspect DIR sample=0`.")
    return [a for a in argv if not a.startswith("sample=")], int(value)


def marked_text(ids, mask, decode, image_token_id: int | None = None) -> str:
    """``ids`` decoded run by run: the runs with ``mask`` 1 inside ``[[ ]]``, each run of ``image_token_id`` as
    ``<image k: N tokens>``. Example (byte ids of ``"ab"`` then ``"c"`` with mask ``[0, 0, 1]``): ``ab[[c]]``."""
    ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask) > 0
    is_image = ids == image_token_id if image_token_id is not None else np.zeros(len(ids), dtype=bool)
    out, start, images = [], 0, 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and mask[end] == mask[start] and is_image[end] == is_image[start]:
            continue
        text = (f"<image {images}: {end - start} tokens>" if is_image[start]
                else decode(ids[start:end].tolist()))
        images += int(is_image[start])
        out.append(f"{OPEN}{text}{CLOSE}" if mask[start] else text)
        start = end
    return "".join(out)


def _packs_of(plan_dir: Path, dataset, sample: int) -> list[tuple[int, int, dict]]:
    """``[(pack, position in the pack, the pack's sample dict)]`` for every pack of the plan holding ``sample``."""
    positions = np.flatnonzero(np.asarray(dataset.sample_order) == sample)
    out = []
    for at in positions.tolist():
        pack = int(np.searchsorted(np.asarray(dataset.bin_offsets), at, side="right")) - 1
        k = at - int(dataset.bin_offsets[pack])
        out.append((pack, k, dataset[pack]))
    return out


def _pack_line(plan_dir: Path, dataset, sample: int) -> tuple[str, dict | None]:
    """One line naming where ``sample`` sits in this plan, and its first pack's sample dict (None: in no pack)."""
    found = _packs_of(plan_dir, dataset, sample)
    if not found:
        held = (plan_dir / "validation").is_dir()
        why = "held out for validation, or dropped by the plan's overflow policy" if held else \
            "dropped by the plan's overflow policy (its accounting counts it)"
        return f"  plan {plan_dir.name}: in no pack ({why})", None
    parts = []
    for pack, k, samples in found[:3]:
        lengths = [len(s["input_ids"]) - 1 for s in samples]
        start = sum(lengths[:k])
        parts.append(f"pack {pack}, sample {k + 1} of {len(samples)}, THD positions {start}..{start + lengths[k] - 1}"
                     f" of {dataset.metadata['pack_size']}")
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return f"  plan {plan_dir.name}: " + "; ".join(parts) + more, found[0][2][found[0][1]]


def sample_text(dataset_dir: Path, index: int, plan: str | None = None) -> str:
    """What ``inspect DIR sample=I`` prints (module docstring); ``plan`` keeps one plan's pack line."""
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.formats.sources import DataError
    from megatron_pack.data.formats.tokenizer import build_tokenizer
    from megatron_pack.data.store.metadata import list_plans, read_metadata
    from megatron_pack.data.store.token_store import STORE_FORMAT, STORE_FORMAT_VERSION, TokenStore

    meta = read_metadata(dataset_dir, STORE_FORMAT, STORE_FORMAT_VERSION)
    store = TokenStore(dataset_dir, meta)
    if index >= len(store):
        raise DataError(f"sample ({index}) is not in {dataset_dir}: its token store holds {len(store)} samples "
                        f"(sample=0 .. sample={len(store) - 1}).")
    tokenizer = build_tokenizer(meta.get("tokenizer_path") or meta["tokenizer"]["name"])
    ids, mask = store.sample(index)
    images = store.images.sample(index) if store.images is not None else []
    lines, shown = [], (ids, mask)
    for plan_dir in [p for p in list_plans(dataset_dir) if plan is None or p.name == plan]:
        line, in_pack = _pack_line(plan_dir, PackedSFTDataset(dataset_dir, plan_dir), index)
        lines.append(line)
        if in_pack is not None and shown[0] is ids:  # the first plan's own view (a cut sample: the ids it holds)
            shown = (in_pack["input_ids"], in_pack["loss_mask"])
    num_loss = int((np.asarray(shown[1])[1:] > 0).sum())
    head = (f"sample {index} of {dataset_dir} ({store.where(index)}): {len(ids)} ids, {num_loss} carry loss "
            f"(marked {OPEN}...{CLOSE}: the labels with loss), {len(images)} image{'s' * (len(images) != 1)}")
    if len(shown[0]) != len(ids):
        head += f"; the pack holds {len(shown[0])} of its ids"
    image_id = (meta.get("images") or {}).get("image_token_id")
    body = marked_text(shown[0], np.concatenate([[0], np.asarray(shown[1])[1:]]), tokenizer.decode, image_id)
    return "\n".join([head] + (lines or ["  no packing plan yet"]) + [body])
