"""Vision-language data at prepare (issue 35 items 2 and 7): image token counts from stored sizes, the record
formats users have, image references with checksums in the token store, truncation that never cuts an image,
and one line (or a counted skip) for every bad input.

The folder is tests/_vlm_data.py's tiny one (patch 14, merge 2, 28x28 .. 112x112 pixels); images are made with
Pillow here. Every prepare runs ``megatron-pack prepare`` as typed (tests/_user_path.py).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _user_path import ok, refused  # noqa: E402
from _vlm_data import make_image, make_vlm_data_folder, write_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_vlm_data_folder(tmp_path_factory.mktemp("vlm"))


def _prepare_args(folder, data="t.jsonl", pack=128, *extra):
    return ["prepare", "data=files", f"data.input={data}", f"data.tokenizer={folder}", "data.dataset_dir=ds",
            f"packing.packed_sequence_size={pack}", f"model.seq_length={pack}", "data.tokenize_workers=1", *extra]


def _store(tmp_path):
    from megatron_pack.data.store.token_store import TokenStore

    return TokenStore(tmp_path / "ds", json.loads((tmp_path / "ds" / "metadata.json").read_text()))


# ---------------------------------------------------------------- image token counts without pixel work

SIZES = [  # (id, width, height): inside the range, below min_pixels, above max_pixels, odd aspect ratios
    ("28x28", 28, 28), ("100x60", 100, 60), ("30x30-rounds-up", 30, 30), ("10x10-below-min", 10, 10),
    ("112x112-at-max", 112, 112), ("300x200-above-max", 300, 200), ("57x29", 57, 29), ("13x300-tall", 13, 300),
    ("500x20-wide", 500, 20), ("41x97", 41, 97),
]


@pytest.mark.parametrize("width,height", [c[1:] for c in SIZES], ids=[c[0] for c in SIZES])
def test_image_tokens_from_the_stored_size_equal_the_processor(tmp_path, folder, width, height):
    """The grid from the header equals what transformers' image processor returns on the real pixels."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from megatron_pack.data.formats.images import image_spec
    from megatron_pack.data.formats.tokenizer import build_tokenizer

    spec = image_spec(str(folder), build_tokenizer(str(folder)))
    path = make_image(tmp_path / "x.png", width, height)
    reference = AutoImageProcessor.from_pretrained(folder)(images=[Image.open(path)], return_tensors="np")
    grid = tuple(int(x) for x in reference["image_grid_thw"][0])
    with Image.open(path) as header:  # what prepare reads: the size only
        assert spec.grid(header.height, header.width) == grid
    assert reference["pixel_values"].shape[0] == int(np.prod(grid))  # guard: the processor made those patches
    assert spec.num_tokens(grid) == int(np.prod(grid)) // 4 >= 1


def test_top_level_max_pixels_wins_over_size_as_in_the_processor(tmp_path, folder):
    """Published Qwen2.5-VL folders carry both ``size`` and ``min_pixels`` / ``max_pixels``; the processor
    takes the latter."""
    import json as _json
    import shutil

    from PIL import Image
    from transformers import AutoImageProcessor

    from megatron_pack.data.formats.images import image_spec
    from megatron_pack.data.formats.tokenizer import build_tokenizer

    other = Path(shutil.copytree(folder, tmp_path / "other"))
    config = _json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(_json.dumps({**config, "max_pixels": 56 * 56}))
    path = make_image(tmp_path / "x.png", 100, 60)
    reference = AutoImageProcessor.from_pretrained(other)(images=[Image.open(path)], return_tensors="np")
    grid = tuple(int(x) for x in reference["image_grid_thw"][0])
    assert image_spec(str(other), build_tokenizer(str(other))).grid(60, 100) == grid == (1, 2, 4)


def test_the_size_table_covers_resizing_both_ways():
    from megatron_pack.data.formats.images import smart_resize

    rounded = [round(h / 28) * round(w / 28) * 28 * 28 for _, w, h in SIZES]
    resized = [int(np.prod(smart_resize(h, w, 28, 28 * 28, 112 * 112))) for _, w, h in SIZES]
    assert any(r < 28 * 28 and s >= 28 * 28 for r, s in zip(rounded, resized))  # guard: min_pixels binds
    assert any(r > 112 * 112 and s < r for r, s in zip(rounded, resized))  # and max_pixels


# ---------------------------------------------------------------- record formats

ANSWER = {"role": "assistant", "content": "a red square"}


def _records_by_format(tmp_path):
    make_image(tmp_path / "img" / "a.png", 100, 60, seed=1)
    make_image(tmp_path / "img" / "b.png", 30, 30, seed=2)
    trl_inline = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": "img/a.png"}, {"type": "text", "text": "and "},
        {"type": "image", "image": "img/b.png"}, {"type": "text", "text": "what?"}]}, ANSWER]}
    trl_listed = {"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and "}, {"type": "image"}, {"type": "text", "text": "what?"}]},
        ANSWER], "images": ["img/a.png", "img/b.png"]}
    sharegpt = {"conversations": [{"from": "human", "value": "<image>and <image>what?"},
                                  {"from": "gpt", "value": "a red square"}], "images": ["img/a.png", "img/b.png"]}
    return {"trl-inline": (trl_inline, []), "trl-images-column": (trl_listed, []),
            "sharegpt-placeholders": (sharegpt, ["data.format=sharegpt"])}


@pytest.mark.parametrize("name", ["trl-inline", "trl-images-column", "sharegpt-placeholders", "parquet-bytes"])
def test_every_format_stores_the_same_sample(tmp_path, folder, name):
    from megatron_pack.data.formats.tokenizer import build_tokenizer

    records = _records_by_format(tmp_path)
    if name == "parquet-bytes":
        import pyarrow as pa
        import pyarrow.parquet as pq

        messages = [{"role": "user", "content": "<image>and <image>what?"}, ANSWER]  # LLaMA-Factory's columns
        blobs = [(tmp_path / "img" / n).read_bytes() for n in ("a.png", "b.png")]
        table = pa.table({"messages": [messages],
                          "images": [[{"bytes": b, "path": None} for b in blobs]]})
        pq.write_table(table, tmp_path / "t.parquet")
        ok(tmp_path, *_prepare_args(folder, "t.parquet"))
    else:
        record, extra = records[name]
        write_jsonl(tmp_path / "t.jsonl", [record])
        ok(tmp_path, *_prepare_args(folder, "t.jsonl", 128, *extra))
    store = _store(tmp_path)
    tok = build_tokenizer(str(folder))
    ids, mask = store.sample(0)
    pad = "<|image_pad|>"
    assert tok.decode(ids) == ("<|im_start|>user\n<|vision_start|>" + pad * 8 + "<|vision_end|>and <|vision_start|>"
                               + pad + "<|vision_end|>what?<|im_end|>\n<|im_start|>assistant\na red square<|im_end|>")
    assert tok.decode(np.asarray(ids)[np.asarray(mask) == 1]) == "a red square<|im_end|>"
    images = store.images.sample(0)
    files = [tmp_path / "img" / n for n in ("a.png", "b.png")]
    assert [i["grid"] for i in images] == [(1, 4, 8), (1, 2, 2)] and [i["start"] for i in images] == [4, 17]
    assert [i["sha256"] for i in images] == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    if name == "parquet-bytes":
        assert [i["data"] for i in images] == [f.read_bytes() for f in files]
    else:
        assert [i["path"] for i in images] == [str(f.resolve()) for f in files]
    meta = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    assert meta["images"]["num_images"] == 2 and meta["images"]["num_image_tokens"] == 9
    assert meta["num_tokens"] == len(ids)  # the image tokens count in the sample's length


def test_image_root_resolves_relative_paths(tmp_path, folder):
    make_image(tmp_path / "pictures" / "a.png", 28, 28)
    write_jsonl(tmp_path / "data" / "t.jsonl", [{"messages": [
        {"role": "user", "content": "<image>what?"}, ANSWER], "images": ["a.png"]}])
    ok(tmp_path, *_prepare_args(folder, "data/t.jsonl"), f"data.image_root={tmp_path / 'pictures'}")
    assert _store(tmp_path).images.sample(0)[0]["path"] == str((tmp_path / "pictures" / "a.png").resolve())


def test_a_text_store_is_unchanged_by_an_image_folder(tmp_path, folder):
    write_jsonl(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": "what color"}, ANSWER]}])
    ok(tmp_path, *_prepare_args(folder))
    meta = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    assert "images" not in meta and not list((tmp_path / "ds").glob("image_*.npy"))
    assert _store(tmp_path).images is None


# ---------------------------------------------------------------- bad inputs: one line, or a counted skip

GOOD = {"messages": [{"role": "user", "content": "<image>what?"}, ANSWER], "images": ["img/ok.png"]}


def _bad_cases(tmp_path):
    make_image(tmp_path / "img" / "ok.png", 40, 40)
    (tmp_path / "img" / "corrupt.png").write_bytes(make_image(tmp_path / "img" / "full.png", 40, 40).read_bytes()[:60])
    (tmp_path / "img" / "text.png").write_text("not an image")
    make_image(tmp_path / "img" / "deep.png", 40, 40, mode="I;16")
    user = lambda text: [{"role": "user", "content": text}, ANSWER]  # noqa: E731
    return [
        ("image_missing", {"messages": user("<image>what?"), "images": ["img/gone.png"]}, "does not exist"),
        ("image_unreadable", {"messages": user("<image>what?"), "images": ["img/corrupt.png"]},
         "is not a readable image"),
        ("image_unreadable", {"messages": user("<image>what?"), "images": ["img/text.png"]},
         "is not a readable image"),
        ("image_count_mismatch", {"messages": user("<image><image>what?"), "images": ["img/ok.png"]},
         "2 image placeholder(s)"),
        ("image_count_mismatch", {"messages": user("what?"), "images": ["img/ok.png"]}, "0 image placeholder(s)"),
        ("image_mode", {"messages": user("<image>what?"), "images": ["img/deep.png"]}, "has mode 'I;16'"),
    ]


def test_each_bad_image_is_one_line_naming_the_record(tmp_path, folder):
    cases = _bad_cases(tmp_path)
    for reason, record, fragment in cases:
        write_jsonl(tmp_path / "t.jsonl", [GOOD, record, GOOD])
        out = refused(tmp_path, *_prepare_args(folder))
        assert "t.jsonl: line 2:" in out and fragment in out, (reason, out)
        assert not (tmp_path / "ds").exists()
    from megatron_pack.data.formats.chat import BAD_RECORD_REASONS

    assert {r for r, _, _ in cases} <= set(BAD_RECORD_REASONS) and len(cases) == 6


def test_bad_images_are_counted_skips(tmp_path, folder):
    cases = _bad_cases(tmp_path)
    write_jsonl(tmp_path / "t.jsonl", [GOOD] + [record for _, record, _ in cases] + [GOOD])
    ok(tmp_path, *_prepare_args(folder), "data.on_bad_record=skip")
    meta = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    assert meta["num_samples"] == 2 and meta["bad_records"]["by_reason"] == {
        "image_count_mismatch": 2, "image_missing": 1, "image_mode": 1, "image_unreadable": 2}


def test_an_rgba_image_is_kept_for_the_processor_to_convert(tmp_path, folder):
    make_image(tmp_path / "img" / "ok.png", 40, 40, mode="RGBA")
    write_jsonl(tmp_path / "t.jsonl", [GOOD])
    ok(tmp_path, *_prepare_args(folder))
    assert _store(tmp_path).images.sample(0)[0]["grid"] == (1, 2, 2)


# ---------------------------------------------------------------- packing: images never cut

def _long_records(tmp_path):
    make_image(tmp_path / "img" / "big.png", 112, 112)  # 16 tokens
    make_image(tmp_path / "img" / "ok.png", 40, 40)  # 4 tokens
    words = " ".join(["red"] * 30)
    early = {"messages": [{"role": "user", "content": "<image>" + words}, ANSWER], "images": ["img/ok.png"]}
    late = {"messages": [{"role": "user", "content": " ".join(["red"] * 8) + "<image>"}, ANSWER],
            "images": ["img/big.png"]}
    return early, late


def test_truncation_drops_a_sample_it_would_cut_through_an_image(tmp_path, folder):
    from megatron_pack.data.batches.dataset import PackedSFTDataset

    early, late = _long_records(tmp_path)
    write_jsonl(tmp_path / "t.jsonl", [early, late, GOOD])
    out = ok(tmp_path, "prepare", "data=files", "data.input=t.jsonl", f"data.tokenizer={folder}",
             "data.dataset_dir=ds", "packing.packed_sequence_size=32", "model.seq_length=32",
             "data.tokenize_workers=2", "packing.on_overflow=truncate", "data.answer_only_loss=false")
    assert "loses" in out and "on_overflow=split" not in out  # the warning offers only what image stores allow
    store = _store(tmp_path)
    start, size = store.images.sample(1)[0]["start"], 16
    assert start < 32 < start + size  # guard: the cut at 32 tokens falls inside sample 1's image
    ds = PackedSFTDataset(tmp_path / "ds")
    acc = ds.metadata["accounting"]
    assert acc["num_samples_dropped"]["image_cut_by_truncation"] == 1 and acc["num_samples_truncated"] == 1
    kept = {s["sample_id"]: s for i in range(len(ds)) for s in ds[i]}
    assert sorted(kept) == [0, 2] and len(kept[0]["input_ids"]) == 33 and kept[0]["images"][0]["start"] == 4


@pytest.mark.parametrize("setting,fragment", [("packing.on_overflow=split", "packing.on_overflow=split cuts"),
                                              ("packing.algorithm=wrapped", "packing.algorithm=wrapped cuts"),
                                              ("packing.export=bridge", "has no place for the 1 images")],
                         ids=["split", "wrapped", "bridge-export"])
def test_plans_that_cut_or_lose_images_are_refused(tmp_path, folder, setting, fragment):
    write_jsonl(tmp_path / "t.jsonl", [GOOD])
    make_image(tmp_path / "img" / "ok.png", 40, 40)
    out = refused(tmp_path, *_prepare_args(folder, "t.jsonl", 64, setting))
    assert fragment in out


def test_an_image_larger_than_the_pack_is_named_or_dropped(tmp_path, folder):
    _long_records(tmp_path)
    big = {"messages": [{"role": "user", "content": "<image>x"}, ANSWER], "images": ["img/big.png"]}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    write_jsonl(tmp_path / "t.jsonl", [short, big])
    out = refused(tmp_path, *_prepare_args(folder, "t.jsonl", 16))
    assert "t.jsonl: line 2: image 0 takes 16 tokens (grid 1x8x8)" in out
    assert "packing.packed_sequence_size=18" in out and "max_pixels" in out and "processor_config.json" in out
    ok(tmp_path, *_prepare_args(folder, "t.jsonl", 16, "packing.on_overflow=drop"))
    plans = list((tmp_path / "ds" / "plans").iterdir())
    acc = json.loads((plans[0] / "metadata.json").read_text())["accounting"]
    assert acc["num_samples_dropped"]["too_long"] == 1 and acc["num_samples_packed"] == 1


def test_images_count_in_the_plan_lengths(tmp_path, folder):
    make_image(tmp_path / "img" / "ok.png", 112, 112)
    write_jsonl(tmp_path / "t.jsonl", [GOOD, {"messages": [{"role": "user", "content": "what?"}, ANSWER]}])
    ok(tmp_path, *_prepare_args(folder, "t.jsonl", 64))
    assert "images: 1 in 1 samples, 16 image tokens" in ok(tmp_path, "inspect", "data.dataset_dir=ds")
    store = _store(tmp_path)
    num_ids = store.num_ids()
    assert num_ids[0] - num_ids[1] == 16 + 2  # 16 pads and the vision start / end; the texts are equal
    plans = list((tmp_path / "ds" / "plans").iterdir())
    meta = json.loads((plans[0] / "metadata.json").read_text())
    assert meta["accounting"]["num_samples_packed"] == 2
    lengths = np.load(plans[0] / "sample_num_ids.npy")
    assert sorted(lengths.tolist()) == sorted(num_ids.tolist())
