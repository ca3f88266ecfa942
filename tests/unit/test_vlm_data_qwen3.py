"""Qwen3-VL and Qwen3.5 image data at prepare (issue 44 item 5): image token counts from stored sizes equal to the
families' image processor, every image format through ``megatron-pack prepare`` for each of ``qwen3_vl``,
``qwen3_vl_moe``, ``qwen3_5`` and ``qwen3_5_moe``, bad images and video as one line or a counted skip, and M-RoPE
positions per sample equal to transformers' ``Qwen3VLModel.get_rope_index`` / ``Qwen3_5Model.get_rope_index``.

The folders are tests/_vlm3_data.py's (config.json as the family's config class saves it, patch 16, merge 2,
``size`` 32*32 .. 128*128 pixels); two keep the image processor in ``preprocessor_config.json``, two inside
``processor_config.json`` as transformers 5's processor ``save_pretrained`` writes it. The prepare here names the
folder as ``data.tokenizer`` only: ``model.pretrained=<folder>`` reads config.json through config/hf_config, whose
families these model types join with the model side.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _user_path import ok, refused  # noqa: E402
from _vlm3_data import FAMILIES, image_processor, make_qwen3_data_folder  # noqa: E402
from _vlm_data import make_image, write_jsonl  # noqa: E402

NESTED = {"qwen3_vl": False, "qwen3_vl_moe": True, "qwen3_5": True, "qwen3_5_moe": False}
"""Which folders keep the image processor inside processor_config.json (transformers 5's processor layout)."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One folder per family; the tokenizer is trained once and copied."""
    root = tmp_path_factory.mktemp("qwen3_data")
    first = make_qwen3_data_folder(root, FAMILIES[0], nested=NESTED[FAMILIES[0]])
    out = {FAMILIES[0]: first}
    for model_type in FAMILIES[1:]:
        path = root / model_type
        path.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(first / name, path / name)
        from _vlm3_data import family_config
        from transformers import AutoTokenizer

        family_config(model_type, AutoTokenizer.from_pretrained(first)).save_pretrained(path)
        processor = image_processor()
        if NESTED[model_type]:
            (path / "processor_config.json").write_text(json.dumps(
                {"image_processor": processor.to_dict(), "processor_class": "Qwen3VLProcessor"}))
        else:
            processor.save_pretrained(path)
        out[model_type] = path
    return out


def _spec(folder):
    from megatron_pack.data.formats.images import image_spec
    from megatron_pack.data.formats.tokenizer import build_tokenizer

    return image_spec(str(folder), build_tokenizer(str(folder)))


def test_the_folders_are_the_families_and_the_processor_layouts_both_occur(folders):
    from transformers import AutoConfig

    for model_type, folder in folders.items():
        assert AutoConfig.from_pretrained(folder).model_type == model_type
        assert (folder / "processor_config.json").is_file() == NESTED[model_type]
        assert (folder / "preprocessor_config.json").is_file() != NESTED[model_type]
    assert set(NESTED.values()) == {True, False}


# ---------------------------------------------------------------- image token counts without pixel work

SIZES = [  # (id, width, height): inside the range, below min_pixels, above max_pixels, odd aspect ratios
    ("32x32", 32, 32), ("100x60", 100, 60), ("1x1-tiny", 1, 1), ("5x3-tiny", 5, 3), ("47x33-rounds-down", 47, 33),
    ("50x50-rounds-up", 50, 50), ("128x128-at-max", 128, 128), ("145x120-above-max", 145, 120),
    ("300x200-above-max", 300, 200), ("4000x3000-huge", 4000, 3000), ("7x900-tall", 7, 900),
    ("1500x17-wide", 1500, 17), ("33x95", 33, 95), ("600x3-aspect-200", 600, 3),
]


def _png(width, height, seed=0) -> bytes:
    from PIL import Image

    if width * height > 1 << 20:  # a huge image: one colour (random pixels would take seconds to encode)
        image = Image.new("RGB", (width, height), (seed * 40 % 256, 120, 200))
    else:
        image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_5"])
def test_image_tokens_from_the_stored_size_equal_the_family_processor(folders, model_type):
    """What prepare computes from the file's header (``inspect_image``) equals the grid transformers' image
    processor, loaded from the same folder, returns on the real pixels, and the token count Qwen3VLProcessor
    writes for it (``grid.prod() // merge_size**2``)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from megatron_pack.data.formats.images import ImageRef, inspect_image

    folder = folders[model_type]
    spec = _spec(folder)
    assert (spec.patch_size, spec.merge_size, spec.min_pixels, spec.max_pixels) == (16, 2, 32 * 32, 128 * 128)
    reference = AutoImageProcessor.from_pretrained(folder)
    assert (reference.patch_size, reference.merge_size) == (16, 2)  # guard: the folder's settings, not defaults
    bounds = {"min": 0, "max": 0}
    for name, width, height in SIZES:
        data = _png(width, height)
        out = reference(images=[Image.open(io.BytesIO(data))], return_tensors="np")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        assert out["pixel_values"].shape == (int(np.prod(grid)), 3 * 2 * 16 * 16), name
        info = inspect_image(ImageRef(data=data), spec, name)
        assert info.grid == grid, name
        assert info.num_tokens == int(np.prod(grid)) // 4 >= 1, name
        resized = grid[1] * grid[2] * 16 * 16
        bounds["min"] += round(height / 32) * round(width / 32) * 32 * 32 < 32 * 32
        bounds["max"] += round(height / 32) * round(width / 32) * 32 * 32 > 128 * 128 >= resized
    assert bounds["min"] >= 3 and bounds["max"] >= 3, bounds  # the table makes both bounds bind
    assert len(SIZES) == 14  # docs/data.md: "on 14 sizes"


def test_hand_computed_counts():
    """patch 16, merge 2 (factor 32), 1024 .. 16384 pixels: 100 x 60 rounds to 96 x 64, grid (1, 4, 6), 6 tokens
    (docs/data.md's example); 1 x 1 grows to 32 x 32, 1 token; 4000 x 3000 shrinks to 128 x 96, 12 tokens."""
    from megatron_pack.data.formats.images import ImageSpec, smart_resize

    assert smart_resize(60, 100, 32, 1024, 16384) == (64, 96)
    assert smart_resize(1, 1, 32, 1024, 16384) == (32, 32)
    assert smart_resize(3000, 4000, 32, 1024, 16384) == (96, 128)
    spec = ImageSpec(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=1024, max_pixels=16384,
                     do_convert_rgb=True, image_token_id=5, vision_start_id=3, vision_end_id=4)
    grids = [spec.grid(60, 100), spec.grid(1, 1), spec.grid(3000, 4000)]
    assert grids == [(1, 4, 6), (1, 2, 2), (1, 6, 8)] and [spec.num_tokens(g) for g in grids] == [6, 1, 12]


def test_an_aspect_ratio_above_200_is_refused_as_by_the_processor(folders):
    from PIL import Image
    from transformers import AutoImageProcessor

    from megatron_pack.data.formats.chat import RecordError
    from megatron_pack.data.formats.images import ImageRef, inspect_image

    data = _png(700, 3)
    with pytest.raises(ValueError, match="aspect ratio"):
        AutoImageProcessor.from_pretrained(folders["qwen3_5"])(images=[Image.open(io.BytesIO(data))])
    with pytest.raises(RecordError, match="cannot be resized by the processor"):
        inspect_image(ImageRef(data=data), _spec(folders["qwen3_5"]), "images[0]")


def test_processor_config_wins_over_preprocessor_config_as_in_transformers(tmp_path, folders):
    """A folder with both files: transformers reads processor_config.json's ``image_processor`` first."""
    from PIL import Image
    from transformers import AutoImageProcessor

    folder = Path(shutil.copytree(folders["qwen3_vl"], tmp_path / "both"))
    nested = image_processor(max_pixels=64 * 64).to_dict()
    (folder / "processor_config.json").write_text(json.dumps({"image_processor": nested}))
    data = _png(100, 60)
    grid = AutoImageProcessor.from_pretrained(folder)(images=[Image.open(io.BytesIO(data))],
                                                      return_tensors="np")["image_grid_thw"][0]
    assert _spec(folder).grid(60, 100) == tuple(int(x) for x in grid) == (1, 2, 4)  # 64 x 32, not 96 x 64
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    assert _spec(folder).grid(60, 100) == (1, 4, 6)  # no image_processor entry: preprocessor_config.json


# ---------------------------------------------------------------- every format, end to end on the CLI

ANSWER = {"role": "assistant", "content": "a red square"}
PAD = "<|image_pad|>"


def _prepare_args(folder, *extra, data="t.jsonl"):
    return ["prepare", "data=files", *([f"data.input={data}"] if data else []), f"data.tokenizer={folder}",
            "data.dataset_dir=ds", "packing.packed_sequence_size=128", "model.seq_length=128",
            "data.tokenize_workers=1", *extra]


def _every_format(root: Path) -> str:
    """One file per format, each holding the same two-image question; returns the data.sources override."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    make_image(root / "img" / "a.png", 100, 60, seed=1)  # 6 tokens
    make_image(root / "img" / "b.png", 70, 33, seed=2)  # 64 x 32: 2 tokens
    write_jsonl(root / "trl.jsonl", [{"messages": [{"role": "user", "content": [
        {"type": "image", "image": "img/a.png"}, {"type": "text", "text": "and "},
        {"type": "image", "image": "img/b.png"}, {"type": "text", "text": "what?"}]}, ANSWER]}])
    write_jsonl(root / "column.jsonl", [{"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and "}, {"type": "image"}, {"type": "text", "text": "what?"}]},
        ANSWER], "images": ["img/a.png", "img/b.png"]}])
    write_jsonl(root / "sharegpt.jsonl", [{"conversations": [{"from": "human", "value": "<image>and <image>what?"},
                                                             {"from": "gpt", "value": "a red square"}],
                                           "images": ["img/a.png", "img/b.png"]}])
    blobs = [(root / "img" / n).read_bytes() for n in ("a.png", "b.png")]
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "<image>and <image>what?"}, ANSWER]],
                             "images": [[{"bytes": b, "path": None} for b in blobs]]}), root / "bytes.parquet")
    return ("data.sources=[{name: trl, input: trl.jsonl, weight: 0.25}, {name: column, input: column.jsonl, "
            "weight: 0.25}, {name: sharegpt, input: sharegpt.jsonl, weight: 0.25, format: sharegpt}, "
            "{name: parquet, input: bytes.parquet, weight: 0.25}]")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_format_stores_the_same_sample(tmp_path, folders, model_type):
    """TRL image parts, an images column, ShareGPT ``<image>`` placeholders and Parquet bytes, as four sources of
    one ``megatron-pack prepare``: four equal samples, each image's grid, start, sha256 and reference stored, and
    the loader's image processor (``batches.vlm.pack_pixels``) cuts the same grids from the pixels."""
    from megatron_pack.data.batches.vlm import image_processor as loader_processor, pack_pixels
    from megatron_pack.data.formats.tokenizer import build_tokenizer
    from megatron_pack.data.store.token_store import TokenStore

    folder = folders[model_type]
    ok(tmp_path, *_prepare_args(folder, _every_format(tmp_path), data=None))
    meta = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    store = TokenStore(tmp_path / "ds", meta)
    assert meta["num_samples"] == 4 and meta["images"]["num_images"] == 8 and meta["images"]["num_image_tokens"] == 32
    assert (meta["images"]["patch_size"], meta["images"]["min_pixels"], meta["images"]["max_pixels"]) == (
        16, 32 * 32, 128 * 128)
    tok = build_tokenizer(str(folder))
    expected = ("<|im_start|>user\n<|vision_start|>" + PAD * 6 + "<|vision_end|>and <|vision_start|>" + PAD * 2
                + "<|vision_end|>what?<|im_end|>\n<|im_start|>assistant\na red square<|im_end|>")
    files = [tmp_path / "img" / n for n in ("a.png", "b.png")]
    samples = []
    for i in range(4):
        ids, mask = store.sample(i)
        assert tok.decode(ids) == expected, i
        assert tok.decode(np.asarray(ids)[np.asarray(mask) == 1]) == "a red square<|im_end|>"
        images = store.images.sample(i)
        assert [im["grid"] for im in images] == [(1, 4, 6), (1, 2, 4)] and [im["start"] for im in images] == [4, 15]
        assert [im["sha256"] for im in images] == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
        refs = [im.get("data") for im in images] if i == 3 else [im.get("path") for im in images]
        assert refs == ([f.read_bytes() for f in files] if i == 3 else [str(f.resolve()) for f in files])
        samples.append({"images": images, "sample_id": i})
    pixels, grid = pack_pixels(samples, loader_processor(str(folder)))
    assert grid.tolist() == [[1, 4, 6], [1, 2, 4]] * 4 and tuple(pixels.shape) == (4 * (24 + 8), 3 * 2 * 16 * 16)


# ---------------------------------------------------------------- bad images and video: one line, or a counted skip

GOOD = {"messages": [{"role": "user", "content": "<image>what?"}, ANSWER], "images": ["img/ok.png"]}


def _user(content):
    return [{"role": "user", "content": content}, ANSWER]


def _bad_cases(root: Path):
    make_image(root / "img" / "ok.png", 40, 40)
    make_image(root / "img" / "deep.png", 40, 40, mode="I;16")
    (root / "img" / "text.png").write_text("not an image")
    return [  # (reason, record, fragment of the one line)
        ("image_missing", {"messages": _user("<image>what?"), "images": ["img/gone.png"]}, "does not exist"),
        ("image_unreadable", {"messages": _user("<image>what?"), "images": ["img/text.png"]},
         "is not a readable image"),
        ("image_mode", {"messages": _user("<image>what?"), "images": ["img/deep.png"]}, "has mode 'I;16'"),
        ("image_count_mismatch", {"messages": _user("<image><image>what?"), "images": ["img/ok.png"]},
         "2 image placeholder(s)"),
        ("image_count_mismatch", {"messages": _user("what <|image_pad|>?")},
         "rendered 1 <|image_pad|> token(s) for 0 image(s)"),
        ("non_text_part", {"messages": _user([{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "q"}])},
         "t.jsonl: line 2: messages[0].content[0] is a video part; video is not supported (images only): remove "
         "the part or the record."),  # docs/data.md quotes this line
        ("non_text_part", {"messages": _user([{"type": "image", "image": "img/ok.png"},
                                              {"type": "video", "video": ["f0.png", "f1.png"]}])},
         "messages[0].content[1] is a video part"),
        ("non_text_part", {"messages": _user("<video>what?"), "videos": ["clip.mp4"]},
         "the record lists videos (['clip.mp4']); video is not supported"),
        ("non_text_part", {"messages": _user("<image>what <|video_pad|>?"), "images": ["img/ok.png"]},
         "rendered <|video_pad|>"),
        ("non_text_part", {"messages": _user("what <|video_pad|>?")}, "rendered <|video_pad|>"),
    ]


def test_each_bad_image_or_video_is_one_line_naming_the_record(tmp_path, folders):
    from megatron_pack.data.formats.chat import BAD_RECORD_REASONS

    cases = _bad_cases(tmp_path)
    for reason, record, fragment in cases:
        write_jsonl(tmp_path / "t.jsonl", [GOOD, record, GOOD])
        out = refused(tmp_path, *_prepare_args(folders["qwen3_5"]))
        lines = [line for line in out.splitlines() if "line 2:" in line]
        assert len(lines) == 1 and "t.jsonl: line 2:" in lines[0] and fragment in lines[0], (reason, out)
        assert not (tmp_path / "ds").exists()
    assert {r for r, _, _ in cases} <= set(BAD_RECORD_REASONS) and len(cases) == 10


def test_bad_images_and_videos_are_counted_skips(tmp_path, folders):
    cases = _bad_cases(tmp_path)
    write_jsonl(tmp_path / "t.jsonl", [GOOD] + [record for _, record, _ in cases] + [GOOD])
    ok(tmp_path, *_prepare_args(folders["qwen3_vl_moe"], "data.on_bad_record=skip"))
    meta = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    assert meta["num_samples"] == 2 and meta["images"]["num_images"] == 2
    assert meta["bad_records"]["by_reason"] == {"image_count_mismatch": 2, "image_missing": 1, "image_mode": 1,
                                                "image_unreadable": 1, "non_text_part": 5}


# ---------------------------------------------------------------- M-RoPE per sample against transformers

MODELS = {"qwen3_vl": "Qwen3VLModel", "qwen3_vl_moe": "Qwen3VLMoeModel", "qwen3_5": "Qwen3_5Model",
          "qwen3_5_moe": "Qwen3_5MoeModel"}
SAMPLES = [  # (id, layout): ints are runs of text tokens, tuples (t, h, w) are images (grids in patches)
    ("no-image", [9]),
    ("one-image-first", [(1, 4, 6), 5]),
    ("one-image-tall", [3, (1, 8, 2), 4]),
    ("two-images", [2, (1, 4, 4), 3, (1, 2, 6), 2]),
    ("two-images-adjacent", [1, (1, 6, 2), (1, 2, 2), 4]),
]


def _tokens(layout, spec, rng):
    """``(ids, images)``: text tokens drawn from the tokenizer's ordinary ids, each image as vision start, its
    pad tokens and vision end; ``images`` as the token store gives them (``start``, ``grid``)."""
    ids, images = [], []
    for part in layout:
        if isinstance(part, int):
            ids += rng.integers(20, 290, part).tolist()
            continue
        ids.append(spec.vision_start_id)
        images.append({"start": len(ids), "grid": part})
        ids += [spec.image_token_id] * (int(np.prod(part)) // spec.merge_size ** 2)
        ids.append(spec.vision_end_id)
    return np.asarray(ids), images


@pytest.mark.parametrize("model_type", FAMILIES)
def test_mrope_positions_equal_get_rope_index_per_sample(folders, model_type):
    """Each sample's positions, alone and inside a padded pack (``mrope_position_ids``), equal transformers'
    ``get_rope_index`` of the family's model (built tiny from the folder's config.json) on that sample alone."""
    import torch
    import transformers
    from transformers import AutoConfig

    from megatron_pack.data.batches.vlm import mrope_position_ids, sample_mrope_positions

    folder = folders[model_type]
    spec = _spec(folder)
    model = getattr(transformers, MODELS[model_type])(AutoConfig.from_pretrained(folder))
    assert model.config.vision_config.spatial_merge_size == spec.merge_size == 2
    rng = np.random.default_rng(0)
    built = [_tokens(layout, spec, rng) for _, layout in SAMPLES]
    references = []
    for (name, _), (ids, images) in zip(SAMPLES, built):
        input_ids = torch.from_numpy(ids)[None]
        grids = torch.tensor([im["grid"] for im in images]) if images else None
        reference, _ = model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == spec.image_token_id).int(),
                                            image_grid_thw=grids)
        reference = reference[:, 0].numpy()
        assert np.array_equal(sample_mrope_positions(len(ids), images, spec.merge_size), reference), name
        if images:  # guard: the image rows differ from plain text positions
            assert not np.array_equal(reference[1], reference[2]) or not np.array_equal(reference[0], reference[1])
        references.append(reference)
    lengths = [len(ids) for ids, _ in built]
    padded = [n + (-n) % 8 for n in lengths]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    cu_padded = torch.tensor(np.concatenate([[0], np.cumsum(padded)]))
    pack = mrope_position_ids([{"images": images} for _, images in built], cu, cu_padded, int(cu_padded[-1]),
                              spec.merge_size).numpy()
    for k, reference in enumerate(references):
        lo = int(cu_padded[k])
        assert np.array_equal(pack[:, lo:lo + lengths[k]], reference), SAMPLES[k][0]
    assert sum(bool(images) for _, images in built) == 4 and max(len(images) for _, images in built) == 2
