"""The vision-language THD batch (issue 35 items 3 and 4, the data side): pixel values from the folder's image
processor, image grids, and M-RoPE position ids per sample equal to transformers' ``get_rope_index`` for that
sample alone, for offline packs and in-batch packing, with padding (pad multiple, pad_to_max_length,
pad_cu_seqlens), images decoded in the loader's workers, and the validate() rule for image datasets.

The reference is transformers' own ``Qwen2_5_VLModel.get_rope_index`` (it finds images by token id; ours reads the
recorded image positions and grids), run on each sample's tokens alone.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _vlm_data import make_image, make_vlm_data_folder, write_jsonl  # noqa: E402

ANSWER = {"role": "assistant", "content": "a red square"}
PACK = 256


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A store mixing a two-image sample, one-image samples (one RGBA) and text-only samples (one pack of 256)."""
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    root = tmp_path_factory.mktemp("vlm_batch")
    folder = make_vlm_data_folder(root)
    make_image(root / "img" / "a.png", 100, 60, seed=1)
    make_image(root / "img" / "b.png", 30, 30, seed=2)
    make_image(root / "img" / "c.png", 40, 40, seed=3, mode="RGBA")
    make_image(root / "img" / "d.png", 112, 56, seed=4)
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    write_jsonl(root / "t.jsonl", [
        {"messages": [user("<image>and <image>compare"), ANSWER], "images": ["img/a.png", "img/b.png"]},
        {"messages": [user("what color is it"), ANSWER]},
        {"messages": [user("<image>what?"), ANSWER], "images": ["img/c.png"]},
        {"messages": [user("two pictures"), {"role": "assistant", "content": "yes"}]},
        {"messages": [user("describe <image>"), ANSWER, user("<image>again"), ANSWER],
         "images": ["img/d.png", "img/b.png"]},
    ])
    common = ["data=files", f"data.input={root / 't.jsonl'}", f"data.tokenizer={folder}",
              f"data.dataset_dir={root / 'ds'}", f"packing.packed_sequence_size={PACK}", f"model.seq_length={PACK}",
              "data.tokenize_workers=1", "parallel.context_parallel_size=2"]
    prepare(load_config(common), progress=False)
    return root, folder, common


def _reference_positions(tokens: torch.Tensor, grids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """transformers' get_rope_index on one sample alone: [3, n]."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    model = types.SimpleNamespace(config=Qwen2_5_VLConfig(vision_config={"spatial_merge_size": 2}))
    model.get_vision_position_ids = lambda *a, **k: Qwen2_5_VLModel.get_vision_position_ids(model, *a, **k)
    ids = tokens.reshape(1, -1)
    positions, _ = Qwen2_5_VLModel.get_rope_index(model, ids, mm_token_type_ids=(ids == image_token_id).int(),
                                                  image_grid_thw=grids if len(grids) else None)
    return positions[:, 0, :]


def _check_batch(batch: dict, samples: list[dict], image_token_id: int, pad_multiple: int) -> dict:
    """Every sub-sequence's M-RoPE rows equal the reference and continue through its padding; the pixels and
    grids are the processor's for the pack's images in order. Returns what was seen (for the guards)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    cu, cu_padded = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    mrope, tokens = batch["mrope_position_ids"], batch["tokens"][0]
    assert mrope.shape == (3, tokens.numel()) and mrope.dtype == torch.int64
    assert all(c % pad_multiple == 0 for c in cu_padded)
    seen = {"images": 0, "text_only": 0, "multi_image": 0}
    grid_at = 0
    for k, sample in enumerate(samples):
        lo, real, hi = cu_padded[k], cu[k + 1] - cu[k], cu_padded[k + 1]
        n = len(sample["images"])
        grids = batch["image_grid_thw"][grid_at:grid_at + n]
        grid_at += n
        assert [tuple(g) for g in grids.tolist()] == [img["grid"] for img in sample["images"]]
        reference = _reference_positions(tokens[lo:lo + real], grids, image_token_id)
        assert torch.equal(mrope[:, lo:lo + real], reference), (k, sample["sample_id"])
        pad = mrope[:, lo + real:hi]
        assert torch.equal(pad, (reference.max() + 1 + torch.arange(hi - lo - real)).expand(3, -1))
        seen["images"] += n
        seen["text_only"] += n == 0
        seen["multi_image"] += n > 1
    assert grid_at == len(batch["image_grid_thw"])
    pictures = [Image.open(img["path"]) for s in samples for img in s["images"]]
    if pictures:
        processor = AutoImageProcessor.from_pretrained(batch["_folder"])
        want = processor(images=pictures, return_tensors="np")
        assert torch.equal(batch["pixel_values"], torch.from_numpy(want["pixel_values"]).float())
    else:
        assert batch["pixel_values"].shape == (0, 3 * 2 * 14 * 14) and batch["image_grid_thw"].shape == (0, 3)
    return seen


LAYOUTS = [  # (id, extra overrides, pad multiple)
    ("cp2", [], 4),
    ("cp2-pad-to-max-length", ["data.pad_to_max_length=true"], 4),
    ("cp2-pad-cu-seqlens", ["data.pad_to_max_length=true", "packing.pad_cu_seqlens=true"], 4),
]


@pytest.mark.parametrize("extra,pad_multiple", [c[1:] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS])
def test_offline_packs_match_transformers_per_sample(prepared, extra, pad_multiple):
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.batches.loader import dataset_collate

    root, folder, common = prepared
    cfg = load_config(common + extra)
    ds = PackedSFTDataset.from_config(cfg)
    collate = dataset_collate(cfg, ds)
    image_token_id = ds.store_metadata["images"]["image_token_id"]
    seen = {"images": 0, "text_only": 0, "multi_image": 0, "mixed_packs": 0}
    for i in range(len(ds)):
        samples = ds[i]
        batch = collate(samples)
        batch["_folder"] = str(folder)
        if "data.pad_to_max_length=true" in extra:
            assert batch["tokens"].shape[-1] == PACK
        if "packing.pad_cu_seqlens=true" in extra:
            assert batch["cu_seqlens"].numel() == ds.metadata["max_samples_per_bin"] + 2
        got = _check_batch(batch, samples, image_token_id, pad_multiple)
        seen["mixed_packs"] += got["multi_image"] > 0 and got["text_only"] > 0
        for key in ("images", "text_only", "multi_image"):
            seen[key] += got[key]
    assert seen["images"] == 5 and seen["text_only"] == 2 and seen["mixed_packs"] >= 1  # guards


def test_in_batch_packing_matches_transformers_per_sample(prepared):
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.loader import dataset_collate
    from megatron_pack.data.batches.opening import open_dataset

    root, folder, common = prepared
    cfg = load_config(common + ["packing.mode=in_batch", "train.micro_batch_size=4", "train.global_batch_size=4"])
    ds = open_dataset(cfg)
    collate = dataset_collate(cfg, ds)
    image_token_id = ds.store_metadata["images"]["image_token_id"]
    num_images = 0
    for i in range(len(ds)):
        samples = ds[i]
        batch = collate(samples)
        batch["_folder"] = str(folder)
        assert batch["sample_ids"].tolist() == [s["sample_id"] for s in samples]
        num_images += _check_batch(batch, samples, image_token_id, 4)["images"]
    assert len(ds) == 2 and num_images == 5


def test_images_are_decoded_in_the_loader_workers(prepared):
    from torch.utils.data import DataLoader

    from megatron_pack.config import load_config
    from megatron_pack.data.batches import vlm
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.batches.loader import dataset_collate

    root, folder, common = prepared
    cfg = load_config(common)
    ds = PackedSFTDataset.from_config(cfg)
    vlm._PROCESSORS.clear()
    loader = DataLoader(ds, batch_size=None, collate_fn=dataset_collate(cfg, ds), num_workers=1)
    batches = list(loader)
    assert sum(len(b["image_grid_thw"]) for b in batches) == 5
    assert not vlm._PROCESSORS  # the processor was built, and the images decoded, in the worker only


def test_an_image_changed_after_prepare_is_one_line(prepared, tmp_path):
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.batches.loader import dataset_collate
    from megatron_pack.data.formats.sources import DataError

    root, folder, common = prepared
    cfg = load_config(common)
    ds = PackedSFTDataset.from_config(cfg)
    samples = [dict(s) for s in ds[0]]
    with_image = next(s for s in samples if s["images"])
    copy = make_image(tmp_path / "changed.png", 100, 60, seed=99)
    with_image["images"] = [{**with_image["images"][0], "path": str(copy)}] + with_image["images"][1:]
    with pytest.raises(DataError, match=rf"sample {with_image['sample_id']} \(.*t.jsonl: line \d+\): image 0 \(.*changed.png\) changed "
                                        r"since prepare .*data.overwrite=true"):
        dataset_collate(cfg, ds)(samples)


def test_mrope_worked_example_of_the_docstring():
    from megatron_pack.data.batches.vlm import sample_mrope_positions

    got = sample_mrope_positions(8, [{"start": 2, "grid": (1, 4, 4)}], merge_size=2)
    assert got.tolist() == [[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]]


@pytest.mark.parametrize("mode,refused", [("online", True), ("in_batch", False), ("offline", False)],
                         ids=["online-refused", "in-batch", "offline"])
def test_validate_names_the_packing_modes_an_image_dataset_trains_with(mode, refused):
    from megatron_pack.config import ConfigError, load_config
    from megatron_pack.config.validate import validate

    mbs = ["train.micro_batch_size=2", "train.global_batch_size=2"] if mode == "in_batch" else []
    cfg = load_config([f"packing.mode={mode}", *mbs])
    meta = {"images": {"num_images": 6}}
    if refused:
        with pytest.raises(ConfigError, match=r"packing.mode \(online\) packs token streams without their images.*"
                                              r"packing.mode=in_batch \(train.micro_batch_size >= 2\)"):
            validate(cfg, dataset_meta=meta)
    else:
        validate(cfg, dataset_meta=meta)
        validate(cfg, dataset_meta={})  # guard: the same config without images is valid too


def test_synthetic_images_are_generated_on_the_fly(tmp_path):
    """data=synthetic with a vision-language folder: colour questions about generated PNGs (stored as bytes)."""
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.batches.loader import dataset_collate
    from megatron_pack.data.formats.synthetic import COLORS
    from megatron_pack.data.formats.tokenizer import build_tokenizer
    from megatron_pack.data.prepare import prepare

    folder = make_vlm_data_folder(tmp_path)
    cfg = load_config(["data=synthetic", "data.synthetic_num_samples=12", f"data.tokenizer={folder}",
                       f"data.dataset_dir={tmp_path / 'ds'}", "packing.packed_sequence_size=256",
                       "model.seq_length=256", "packing.on_overflow=truncate", "data.tokenize_workers=1"])
    prepare(cfg, progress=False)
    ds = PackedSFTDataset.from_config(cfg)
    tok = build_tokenizer(str(folder))
    num_images, answers = 0, set()
    for i in range(len(ds)):
        samples = ds[i]
        batch = dataset_collate(cfg, ds)(samples)
        for s in samples:
            num_images += len(s["images"])
            assert all("data" in image for image in s["images"])  # stored bytes, no files
            if s["images"]:
                answers.add(tok.decode(np.asarray(s["input_ids"])[np.asarray(s["loss_mask"]) == 1]))
        assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(dim=1).sum())
    names = [name for a in answers for name in a.removesuffix("<|im_end|>").split(" and ")]
    assert num_images >= 6 and len(answers) >= 2 and set(names) <= set(COLORS)


def test_the_vlm_tiny_recipe_prepares_generated_images(tmp_path):
    """experiment=vlm_tiny's data: the synthetic colour-image set tokenized with the folder's tokenizer (the
    model folder itself comes with the qwen2_5_vl family; here its tokenizer and processor stand in)."""
    import json

    from _user_path import ok

    folder = make_vlm_data_folder(tmp_path)
    ok(tmp_path, "prepare", "experiment=vlm_tiny", "model.pretrained=null", "model=tiny", f"data.tokenizer={folder}",
       "data.tokenize_workers=1")
    meta = json.loads((tmp_path / "data" / "vlm_tiny" / "metadata.json").read_text())
    assert meta["num_samples"] == 64 and meta["images"]["num_images"] >= 32
    assert meta["sources"]["kind"] == "synthetic" and meta["images"]["num_image_tokens"] > 0
