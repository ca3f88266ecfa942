"""report.json / report.png: the length histogram shows the bulk, the tail, truncation; pack fill is zoomed
(issue 11 item 12)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_pack.cli.main import main
from megatron_pack.data.packing.report import BLUE, ORANGE, RED, fill_histogram, length_histogram, report_figure

LENGTHS = [  # (id, lengths, pack size, expected split edge, expected tail count)
    ("one-huge-outlier", [10] * 99 + [10000], 512, 10.0, 1),  # P99 of the fitting samples: 10
    ("no-tail", list(range(1, 101)), 512, 100.0, 0),  # P99 of 1..100 is 99.01
    ("p99-above-pack", list(range(100, 1100, 10)), 512, 506.0, 59),  # P99 of 100..510 is 505.9; 510.. in the tail
    ("empty", [], 512, 1.0, 0),
]


@pytest.mark.parametrize("lengths,pack,split,tail", [c[1:] for c in LENGTHS], ids=[c[0] for c in LENGTHS])
def test_length_histogram_splits_at_p99(lengths, pack, split, tail):
    h = length_histogram(np.asarray(lengths, dtype=np.int64), pack)
    assert sum(h["counts"]) == len(lengths) and h["num_in_tail"] == tail
    bulk_end = h["edges"][-2] if tail else h["edges"][-1]
    assert bulk_end == pytest.approx(split)
    if tail:
        assert h["edges"][-1] == max(lengths) and h["counts"][-1] == tail


def test_fill_histogram_zooms_to_the_packs():
    fill = np.array([0.991, 0.995, 1.0, 0.998])
    f = fill_histogram(fill)
    assert f["range"] == [0.98, 1.0] and sum(f["counts"]) == 4
    assert fill_histogram(np.array([0.2, 1.0]))["range"] == [0.2, 1.0]
    last_pack_partial = fill_histogram(np.array([0.995] * 200 + [0.18]))  # one partly filled last pack
    assert last_pack_partial["range"] == [0.98, 1.0] and last_pack_partial["num_below_range"] == 1
    assert sum(last_pack_partial["counts"]) == 201 and last_pack_partial["counts"][0] == 1


@pytest.fixture(scope="module")
def skewed_plan(tmp_path_factory):
    """Mostly short samples, a few far longer than the pack (truncated)."""
    root = tmp_path_factory.mktemp("report")
    rng = np.random.default_rng(0)
    records = [{"prompt": "q" * int(n), "completion": "a" * 8} for n in rng.integers(5, 60, size=300)]
    records += [{"prompt": "q" * 5, "completion": "a" * 5000}] * 3  # cut to the pack, answer kept
    records += [{"prompt": "q" * 4000, "completion": "a" * 8}]  # cut to the pack, no answer left: dropped
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["prepare", f"input={root / 'train.jsonl'}", f"output={root / 'ds'}", "data.tokenize_workers=1",
                 "packing.packed_sequence_size=256", "packing.on_overflow=truncate"]) == 0
    return next((root / "ds" / "plans").iterdir())


def test_report_shows_the_bulk_the_tail_and_truncation(skewed_plan):
    n = json.loads((skewed_plan / "report.json").read_text())
    h = n["sample_length_histogram"]
    assert sum(h["counts"]) == 304 and 4 <= h["num_in_tail"] <= 8 and n["num_samples_truncated"] == 3
    assert n["num_samples_dropped_too_long"] == 1 and n["num_samples_longer_than_pack"] == 4
    # a plain 0..max histogram puts nearly every sample in its first bar: the check below would be vacuous
    plain, _ = np.histogram(np.concatenate([np.full(300, 40), np.full(3, 5000)]), bins=40)
    assert plain.max() / plain.sum() > 0.95
    assert max(h["counts"]) / 304 < 0.25 and sum(c > 0 for c in h["counts"]) >= 10  # the bulk is spread out
    fig = report_figure(n)
    lengths, fill, padding, per_pack = fig.panels
    assert lengths.yscale == "log" and lengths.ylim[0] == 0.7 and f"P99 {h['p99']}" in lengths.title
    legend = " ".join(text for _, _, text in lengths.legend)
    assert "longer than pack: 4 (3 truncated, 1 dropped)" in legend and f"({h['num_in_tail']} samples, up to " in legend
    assert "pack size 256 (right of the axis)" in legend and lengths.vlines == []  # the axis ends near the P99
    assert lengths.bars[-1][2:] == (h["num_in_tail"], ORANGE)  # the tail bar
    assert fill.xlim == tuple(n["pack_fill_histogram"]["range"]) and fill.xlim[0] > 0.0 and fill.xlim[1] == 1.0
    assert f"mean {n['mean_pack_fill']:.1%}" in fill.title
    assert padding.title == f"padding share {n['padding_share']:.1%}"
    assert f"mean {n['samples_per_pack']['mean']:.2f}" in per_pack.title
    assert [label for _, label in padding.xticks] == ["sample tokens", "alignment pad", "tail pad"]
    assert [label for _, label in lengths.yticks][:2] == ["1", "10"]  # a tick a decade, labelled
    assert (skewed_plan / "report.png").stat().st_size > 10_000


def _colour_pixels(image, box, colour) -> int:
    """How many pixels of ``box`` (left, top, right, bottom, inclusive) are ``colour``."""
    left, top, right, bottom = box
    region = np.asarray(image.crop((left, top, right + 1, bottom + 1)))
    return int((region == np.array(colour)).all(axis=-1).sum())


def test_report_png_is_the_figure_and_its_bars_are_where_the_numbers_say(skewed_plan):
    """The PNG prepare wrote is the figure of report.json's numbers, pixel for pixel; in it each panel's bars stand
    where the numbers put them (each bar's middle pixel its colour, the padding bars' heights in pixels as
    computed by hand from the shares), the titles and tick labels are inked, nothing else is blue."""
    from PIL import Image, ImageChops

    n = json.loads((skewed_plan / "report.json").read_text())
    fig = report_figure(n)
    written = Image.open(skewed_plan / "report.png")
    assert written.size == (880, 560) and written.mode == "RGB"
    assert ImageChops.difference(written, fig.image).getbbox() is None  # identical
    image = fig.image
    num_drawn = 0
    for panel in fig.panels:
        left, top, right, bottom = panel.box
        assert right - left > 300 and bottom - top > 150  # four panels, two a row
        assert _colour_pixels(image, (left + 1, top + 1, right - 1, bottom - 1), BLUE) > 200, panel.title  # not blank
        for x0, x1, height, colour in panel.bars:
            if height > panel.ylim[0]:
                (a, y_top), (b, y_base) = panel.px(x0, height), panel.px(x1, panel.ylim[0])
                assert image.getpixel(((a + b) // 2, (y_top + y_base) // 2)) == colour, (panel.title, x0, height)
                num_drawn += 1
        dark = np.asarray(image.convert("L").crop((left, top - 20, right, top - 2))) < 128
        assert dark.sum() > 50, panel.title  # the title is written above the plot
        tick_labels = np.asarray(image.convert("L").crop((left - 40, top, left - 5, bottom))) < 128
        assert tick_labels.sum() > 20, panel.title  # the y tick labels
    assert num_drawn >= 25
    assert _colour_pixels(image, (0, 0, 879, 559), BLUE) == sum(  # every blue pixel is in a panel's plot area
        _colour_pixels(image, (p.box[0] + 1, p.box[1] + 1, p.box[2] - 1, p.box[3] - 1), BLUE) for p in fig.panels)
    padding = fig.panels[2]
    height = padding.box[3] - padding.box[1]  # the plot's pixels from the axis at 0 to the top at ylim[1]
    shares = [1 - n["padding_share"], n["alignment_padding_share"], n["padding_share"] - n["alignment_padding_share"]]
    assert shares[0] > 0.5 and shares[2] > 0.015  # guard: two bars tall enough to see
    for i, share in enumerate(shares):
        column = padding.px(i, 0)[0]
        bar = np.asarray(image.crop((column, padding.box[1] + 1, column + 1, padding.box[3])))[:, 0]
        assert abs((bar == np.array(BLUE)).all(axis=-1).sum() - share / padding.ylim[1] * height) <= 2, i


DEGENERATE = {  # report.json's numbers of an empty store: nothing to draw but the frames, titles and ticks
    "pack_size": 64, "pad_seq_to_mult": 1, "num_packs": 0, "num_samples_in_store": 0, "num_samples_packed": 0,
    "sample_length_histogram": length_histogram(np.zeros(0, dtype=np.int64), 64), "num_samples_longer_than_pack": 0,
    "num_samples_truncated": 0, "num_samples_dropped_too_long": 0, "pack_fill_histogram": fill_histogram(np.zeros(0)),
    "mean_pack_fill": 0.0, "padding_share": 0.0, "alignment_padding_share": 0.0,
    "samples_per_pack": {"counts": [], "mean": 0.0, "max": 0},
}


def test_an_empty_report_draws_its_frames():
    fig = report_figure(DEGENERATE)
    assert fig.image.size == (880, 560) and fig.suptitle == ""
    assert _colour_pixels(fig.image, (0, 0, 879, 559), BLUE) > 0  # only the padding panel's sample-tokens bar (1.0)
    for panel in fig.panels:
        assert fig.image.getpixel(panel.box[:2]) == (0, 0, 0) and panel.yticks, panel.title  # framed, ticked


def test_a_pack_size_on_the_axis_is_a_dashed_red_line():
    lengths = np.arange(10, 71, dtype=np.int64)  # P99 of the samples that fit the pack 64: 64, the axis to 67.2
    n = {**DEGENERATE, "sample_length_histogram": length_histogram(lengths, 64), "num_samples_longer_than_pack": 6,
         "num_samples_truncated": 6}
    fig = report_figure(n)
    lengths_panel = fig.panels[0]
    assert lengths_panel.vlines == [(64, RED)] and lengths_panel.xlim[1] > 64
    assert "longer than pack: 6 (6 truncated, 0 dropped)" in [text for _, _, text in lengths_panel.legend]
    column = lengths_panel.px(64, 1)[0]
    left, top, right, bottom = lengths_panel.box
    red = _colour_pixels(fig.image, (column - 1, top + 1, column + 1, bottom - 1), RED)
    assert 0.4 * (bottom - top) < red / 2 < 0.7 * (bottom - top)  # two pixels wide, dashed: about half the height
