"""report.json / report.png: the length histogram shows the bulk, the tail, truncation; pack fill is zoomed
(issue 11 item 12)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_pack.cli.main import main
from megatron_pack.data.packing.report import fill_histogram, length_histogram, report_figure

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
    lengths_ax, fill_ax = fig.axes[0], fig.axes[1]
    assert lengths_ax.get_yscale() == "log"
    legend = " ".join(t.get_text() for t in lengths_ax.get_legend().get_texts())
    assert "longer than pack: 4 (3 truncated, 1 dropped)" in legend and "samples, up to" in legend and h["num_in_tail"] >= 4
    low, high = fill_ax.get_xlim()
    assert low == n["pack_fill_histogram"]["range"][0] > 0.0 and high == 1.0
    assert (skewed_plan / "report.png").stat().st_size > 10_000


def test_report_painter_draws_in_its_own_process(skewed_plan, tmp_path):
    """The prepare command's painter (matplotlib imported in a forked process) writes the same
    figure as drawing here, names a failure, and ends at once when it has nothing to draw."""
    import time

    from megatron_pack.data.packing.report import ReportPainter, _plot

    numbers = json.loads((skewed_plan / "report.json").read_text())
    painter = ReportPainter.start()
    assert painter is not None  # guard: Linux forks, the process path is under test
    try:
        painter.paint(numbers, tmp_path / "painted.png")
        with pytest.raises(RuntimeError, match="bad.png"):
            painter.paint({"nonsense": 1}, tmp_path / "bad.png")
    finally:
        painter.close()
    assert not painter.process.is_alive()
    _plot(numbers, tmp_path / "here.png")
    assert (tmp_path / "painted.png").stat().st_size > 10_000
    assert abs((tmp_path / "painted.png").stat().st_size - (tmp_path / "here.png").stat().st_size) < 2_000
    idle = ReportPainter.start()
    start = time.perf_counter()
    idle.close()
    assert not idle.process.is_alive() and time.perf_counter() - start < 3


_ONE_PAINTER = """
import json, os, sys
from pathlib import Path
from megatron_pack.cli.prepare import main as prepare_main
from megatron_pack.data.packing.report import ReportPainter
started = []
real_start = ReportPainter.start.__func__
ReportPainter.start = classmethod(lambda cls: started.append(1) or real_start(cls))
root = Path(sys.argv[1])
for name in ("one", "two", "three"):
    folder = root / name
    folder.mkdir()
    (folder / "t.jsonl").write_text("".join(json.dumps({"prompt": f"q{i} {name}", "completion": f"a{i}"}) + "\\n"
                                            for i in range(20)))
    os.chdir(folder)
    assert prepare_main(["input=t.jsonl", "tokenizer=byte", "output=ds", "packing.packed_sequence_size=128",
                         "data.tokenize_workers=1"]) == 0
    assert next((folder / "ds" / "plans").glob("*/report.png")).stat().st_size > 10_000, name
painter = ReportPainter._shared
assert "matplotlib" not in sys.modules  # drawn in the painter, never here
assert len(started) == 1 and painter.process.is_alive() and painter.owner == os.getpid(), started
painter.owner = -1  # as in a process forked from the one that started it: that one's pipe is not ours
replaced = ReportPainter.shared()
assert replaced is not painter and len(started) == 2
replaced.close()
assert ReportPainter.shared() is not replaced and len(started) == 3  # a dead one is replaced
print("ok")
"""


def test_one_painter_serves_every_prepare_of_a_process(tmp_path):
    """The prepare command keeps its painter (matplotlib imported once, in it) for the process's later prepares,
    each drawing into its own folder whatever the process's working folder is; a dead painter, or one another
    process forked, is replaced. In a fresh interpreter: this one has drawn in-process already."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ONE_PAINTER, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
