"""The dataset report: ``report.json`` and ``report.png`` in a plan directory.

Figures: the sample-length histogram (log count axis, bins up to the 99th percentile (or the
pack size, when lower) and one tail bar beyond it, so a few very long samples do not squeeze the bulk into one bar; the pack size
marked; truncated and dropped-too-long samples shown), the pack-fill histogram zoomed to the range
the packs occupy, the padding share, and the number of samples per pack, drawn with Pillow
(``report_figure``). ``report.json`` holds the same numbers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_pack.data.store.atomic import read_json, write_json
from megatron_pack.data.packing.algorithms import thd_lengths
from megatron_pack.data.store.token_store import TokenStore


NUM_LENGTH_BINS = 40
NUM_FILL_BINS = 20
LOST_TARGETS_WARNING = 0.05
"""prepare warns when the overflow policy loses more than this share of the answer targets."""


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "0.0%"


def lost_data_text(lost: dict) -> str:
    """One line: what a plan kept of its tokens and answer targets, and what it lost, and to what.

    ``kept 21 of 52 tokens (40.4%) and 9 of 16 answer targets (56.2%); lost to packing.on_overflow=truncate:
    27 tokens (51.9%), 7 answer targets (43.8%); lost to dropped records: 4 tokens (7.7%), 0 answer targets
    (0.0%); 1 bad record skipped`` (tokens are THD positions, ``n - 1`` per sample of ``n`` ids)."""
    t, a = lost["tokens"], lost["answer_targets"]
    parts = [f"kept {t['kept']} of {t['read']} tokens ({_share(t['kept'], t['read'])}) and {a['kept']} of "
             f"{a['read']} answer targets ({_share(a['kept'], a['read'])})"]
    for key, what in (("lost_to_overflow", f"packing.on_overflow={lost['on_overflow']}"),
                      ("lost_to_dropped_records", "dropped records")):
        if t[key] or a[key] or (key == "lost_to_dropped_records" and lost.get("num_records_skipped")):
            parts.append(f"lost to {what}: {t[key]} tokens ({_share(t[key], t['read'])}), {a[key]} answer targets "
                         f"({_share(a[key], a['read'])})")
    text = "; ".join(parts)
    if lost.get("num_records_skipped"):
        text += f"; {lost['num_records_skipped']} bad record{'s' if lost['num_records_skipped'] > 1 else ''} skipped"
    return text if len(parts) > 1 or lost.get("num_records_skipped") else text + "; nothing lost"


def lost_targets_warning(lost: dict, longest: int, can_split: bool = True) -> str | None:
    """The one-line warning when the overflow policy loses more than 5% of the answer targets, naming the fixes
    (``longest``: the longest sample's padded THD length, the pack size that keeps every sample whole;
    ``can_split``: False for a store with images, whose plans never split)."""
    a = lost["answer_targets"]
    if not a["read"] or a["lost_to_overflow"] <= LOST_TARGETS_WARNING * a["read"]:
        return None
    return (f"packing.on_overflow={lost['on_overflow']} loses {_share(a['lost_to_overflow'], a['read'])} of the answer "
            f"targets ({a['lost_to_overflow']} of {a['read']}); "
            + ("set packing.on_overflow=split to keep every target, or " if can_split else "set ")
            + f"packing.packed_sequence_size={longest} model.seq_length={longest} to keep every sample whole.")


def plan_lost_warning(store_meta: dict, plan_meta: dict) -> str | None:
    """``lost_targets_warning`` of a prepared plan from its and its store's metadata alone (no array is read,
    so a re-run that proves nothing changed warns as the run that wrote the plan did)."""
    lost = plan_meta.get("lost_data")
    longest_ids = int((store_meta.get("sample_num_ids_percentiles") or {}).get("max", 0))  # the longest sample's ids
    longest = int(thd_lengths(np.array([max(longest_ids, 1)]), int(plan_meta.get("pad_seq_to_mult", 1)))[0])
    return lost_targets_warning(lost, longest, can_split="images" not in store_meta) if lost else None


def length_histogram(lengths: np.ndarray, pack_size: int) -> dict:
    """Bins of equal width up to a split, and one tail bin from the split to the longest sample;
    counts sum to ``len(lengths)``. The split is the 99th percentile of the samples that fit the
    pack (what lies beyond the pack is cut or dropped: one bar, counted, is enough), so even a few
    percent of very long samples leave the bulk spread over the bins.

    Example: 99 samples of length 10 and one of 10000, pack 512 -> every fitting sample is 10, so
    40 bins over [0, 10] and a tail bin (10, 10000] holding 1 sample.
    """
    if lengths.size == 0:
        return {"edges": [0.0, 1.0], "counts": [0], "p99": 0, "split": 1, "num_in_tail": 0}
    p99, longest = int(np.ceil(np.percentile(lengths, 99))), int(lengths.max())
    fitting = lengths[lengths <= pack_size]
    split = max(int(np.ceil(np.percentile(fitting, 99))) if fitting.size else pack_size, 1)
    edges = np.linspace(0, split, NUM_LENGTH_BINS + 1)
    counts, _ = np.histogram(np.minimum(lengths, split), bins=edges)
    tail = int((lengths > split).sum())
    counts[-1] -= tail  # np.minimum put the tail into the last bin; it gets its own
    if tail:
        edges, counts = np.append(edges, longest), np.append(counts, tail)
    return {"edges": edges.round(2).tolist(), "counts": counts.tolist(), "p99": p99, "split": split,
            "num_in_tail": tail}


def fill_histogram(fill: np.ndarray) -> dict:
    """Pack-fill histogram over the range the packs occupy (not [0, 1]): from the 1st percentile
    (floored to a percent) to 1; the few packs below it (usually the last, partly filled one) are
    counted in the first bar. Packs of a good plan sit in the top percent, which [0, 1] shows as one bar.
    """
    low = float(np.floor(np.percentile(fill, 1) * 100) / 100) if fill.size else 0.0
    low = min(low, 0.98)  # at least a 2-point window
    counts, edges = np.histogram(np.maximum(fill, low), bins=NUM_FILL_BINS, range=(low, 1.0))
    return {"edges": edges.round(4).tolist(), "counts": counts.tolist(), "range": [low, 1.0],
            "num_below_range": int((fill < low).sum())}


def report_numbers(store: TokenStore, plan_dir: Path) -> dict:
    """Histograms and shares for one plan (all numbers plain ints / floats)."""
    meta = read_json(Path(plan_dir) / "metadata.json")
    pack_size, mult = meta["pack_size"], meta["pad_seq_to_mult"]
    offsets = np.load(Path(plan_dir) / "bin_offsets.npy", allow_pickle=False)
    num_ids = np.load(Path(plan_dir) / "sample_num_ids.npy", allow_pickle=False)
    thd = num_ids.astype(np.int64) - 1
    padded = thd_lengths(num_ids, mult)
    fill = np.add.reduceat(padded, offsets[:-1]) / pack_size if len(offsets) > 1 else np.zeros(0)
    per_pack = np.diff(offsets)
    all_thd = store.num_ids() - 1
    total = len(per_pack) * pack_size
    acc = meta["accounting"]
    return {
        "pack_size": pack_size, "pad_seq_to_mult": mult, "num_packs": int(len(per_pack)),
        "num_samples_in_store": int(len(all_thd)), "num_samples_packed": int(len(thd)),
        "sample_length_histogram": length_histogram(all_thd, pack_size),
        "num_samples_longer_than_pack": int((all_thd > pack_size).sum()),
        "num_samples_truncated": int(acc["num_samples_truncated"]),
        "num_samples_dropped_too_long": int(acc["num_samples_dropped"].get("too_long", 0)
                                            + acc["num_samples_dropped"].get("no_answer_tokens_after_truncation", 0)),
        "pack_fill_histogram": fill_histogram(fill),
        "mean_pack_fill": float(fill.mean()) if fill.size else 0.0,
        "padding_share": float(1 - thd.sum() / total) if total else 0.0,
        "alignment_padding_share": float((padded - thd).sum() / total) if total else 0.0,
        "samples_per_pack": {"counts": np.bincount(per_pack).tolist(), "mean": float(per_pack.mean()) if
                             per_pack.size else 0.0, "max": int(per_pack.max()) if per_pack.size else 0},
        "packing_efficiency": meta["packing_efficiency"], "accounting": acc,
        "algorithm": meta["algorithm"], "on_overflow": meta["on_overflow"],
        **{k: meta[k] for k in ("buckets", "wrapped_attention", "split_overlap", "mixture", "lost_data") if k in meta},
    }


def write_report(store: TokenStore, plan_dir: Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.png`` into ``plan_dir``; return their paths. The figure is drawn here,
    with Pillow (its import and the drawing take a few hundredths of a CPU-second)."""
    numbers = report_numbers(store, plan_dir)
    json_path, png_path = Path(plan_dir) / "report.json", Path(plan_dir) / "report.png"
    write_json(json_path, numbers)
    _plot(numbers, png_path)
    return json_path, png_path


WIDTH, HEIGHT = 880, 560
"""``report.png``'s size in pixels."""
WHITE, INK, GREY = (255, 255, 255), (0, 0, 0), (110, 110, 110)
BLUE, ORANGE, RED = (31, 119, 180), (255, 127, 14), (214, 39, 40)
"""The bars (samples, packs, shares), the length histogram's tail bar, the pack-size line."""


@dataclass
class Panel:
    """One panel of ``report.png``: what it shows, in data units, and where its plot area lies in pixels
    (``box``: left, top, right, bottom, the frame's pixels included). ``bars``: ``(x0, x1, height, colour)``;
    ``vlines``: ``(x, colour)``, dashed; ``legend``: the legend's lines; ticks: ``(value, label)``."""

    title: str
    xlabel: str
    ylabel: str
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    yscale: str = "linear"
    box: tuple[int, int, int, int] = (0, 0, 1, 1)
    bars: list = field(default_factory=list)
    vlines: list = field(default_factory=list)
    legend: list = field(default_factory=list)
    xticks: list = field(default_factory=list)
    yticks: list = field(default_factory=list)

    def px(self, x: float, y: float) -> tuple[int, int]:
        """The pixel of data point ``(x, y)`` (inside ``box`` when inside the limits)."""
        left, top, right, bottom = self.box
        fx = (x - self.xlim[0]) / (self.xlim[1] - self.xlim[0])
        if self.yscale == "log":
            low, high = math.log10(self.ylim[0]), math.log10(self.ylim[1])
            fy = (math.log10(max(y, 1e-300)) - low) / (high - low)
        else:
            fy = (y - self.ylim[0]) / (self.ylim[1] - self.ylim[0])
        return round(left + fx * (right - left)), round(bottom - fy * (bottom - top))


@dataclass
class ReportFigure:
    """``report.png`` before it is written: the image (a ``PIL.Image.Image``), its four panels (lengths, pack
    fill, padding share, samples per pack) and the kept-and-lost line over them (``suptitle``, "" without one)."""

    image: object
    panels: list
    suptitle: str

    def save(self, path) -> None:
        """Write the PNG to ``path`` (a file name ending ``.png``: Pillow then imports its PNG writer alone, not
        the five common ones) or a binary file object."""
        if isinstance(path, (str, Path)) and str(path).lower().endswith(".png"):
            self.image.save(path)
        else:
            self.image.save(path, format="PNG")

    def _repr_png_(self) -> bytes:  # shown in a notebook
        import io

        buffer = io.BytesIO()
        self.save(buffer)
        return buffer.getvalue()


def report_figure(n: dict) -> ReportFigure:
    """The four panels of ``report.png`` drawn from ``report.json``'s numbers ``n``, with Pillow (no plotting
    library: matplotlib's import alone cost about half of a small ``prepare``'s CPU)."""
    from PIL import Image, ImageDraw

    text = lost_data_text(n["lost_data"]) if "lost_data" in n else ""
    lines = _wrap(text, _font(12), WIDTH - 40) if text else []
    panels = [_length_panel(n), _fill_panel(n), _padding_panel(n), _per_pack_panel(n)]
    image = Image.new("RGB", (WIDTH, HEIGHT), WHITE)
    draw = ImageDraw.Draw(image)
    top = 8
    for line in lines:  # what the plan kept and lost, over the panels
        _text(draw, (WIDTH / 2, top), line, _font(12), "center")
        top += 15
    row_height = (HEIGHT - top - 4) / 2
    for i, panel in enumerate(panels):
        x0, y0 = (i % 2) * WIDTH / 2, top + 4 + (i // 2) * row_height
        panel.box = (round(x0 + 66), round(y0 + 24), round(x0 + WIDTH / 2 - 16), round(y0 + row_height - 40))
        _draw_panel(image, draw, panel)
    return ReportFigure(image, panels, " ".join(lines))


def _length_panel(n: dict) -> Panel:
    h = n["sample_length_histogram"]
    edges, counts = h["edges"], h["counts"]
    bulk = len(edges) - 1 - (1 if h["num_in_tail"] else 0)
    width = edges[1] - edges[0]
    bars = [(edges[i], edges[i + 1], counts[i], BLUE) for i in range(bulk)]
    legend = [("patch", BLUE, "samples")]
    if h["num_in_tail"]:  # drawn one bin wide at the right edge, labelled with its true range
        bars.append((edges[bulk], edges[bulk] + width, h["num_in_tail"], ORANGE))
        legend.append(("patch", ORANGE, f"> {h['split']} ({h['num_in_tail']} samples, up to {int(edges[-1])})"))
    right = edges[bulk] + 2 * width
    pack = n["pack_size"]
    vlines = []
    if pack <= right:
        vlines.append((pack, RED))
        legend.append(("dash", RED, f"pack size {pack}"))
    else:  # the axis shows the samples, not the empty room up to the pack
        legend.append(("dash", RED, f"pack size {pack} (right of the axis)"))
    over = n["num_samples_longer_than_pack"]
    if over:
        legend.append(("none", INK, f"longer than pack: {over} ({n['num_samples_truncated']} truncated, "
                                    f"{n['num_samples_dropped_too_long']} dropped)"))
    highest = max([b[2] for b in bars] + [1])
    room = (14 * len(legend) + 18) / 190  # the legend's share of the plot's ~190 pixels: the bars stay below it
    panel = Panel(f"sample length (THD tokens; P99 {h['p99']})", "tokens", "samples (log)",
                  (0.0, float(max(right, pack * 1.02) if pack <= right else right)),
                  (0.7, 0.7 * (highest / 0.7) ** (1 / (1 - room))), "log", bars=bars, vlines=vlines, legend=legend)
    panel.xticks = _linear_ticks(*panel.xlim)
    panel.yticks = _log_ticks(*panel.ylim)
    return panel


def _fill_panel(n: dict) -> Panel:
    f = n["pack_fill_histogram"]
    edges, counts = f["edges"], f["counts"]
    below = f"; {f['num_below_range']} below {f['range'][0]:.0%} in the first bar" if f["num_below_range"] else ""
    panel = Panel(f"pack fill (mean {n['mean_pack_fill']:.1%}; zoomed{below})", "fraction of pack", "packs",
                  (float(f["range"][0]), float(f["range"][1])), (0.0, max(counts + [0]) * 1.05 or 1.0),
                  bars=[(edges[i], edges[i + 1], c, BLUE) for i, c in enumerate(counts)])
    panel.xticks, panel.yticks = _linear_ticks(*panel.xlim), _linear_ticks(*panel.ylim, integer=True)
    return panel


def _padding_panel(n: dict) -> Panel:
    align = n["alignment_padding_share"]
    shares = [1 - n["padding_share"], align, n["padding_share"] - align]
    panel = Panel(f"padding share {n['padding_share']:.1%}", "", "share of pack tokens", (-0.5, 2.5),
                  (0.0, max(shares) * 1.05 or 1.0), bars=[(i - 0.4, i + 0.4, s, BLUE) for i, s in enumerate(shares)])
    panel.xticks = list(enumerate(["sample tokens", "alignment pad", "tail pad"]))
    panel.yticks = _linear_ticks(*panel.ylim)
    return panel


def _per_pack_panel(n: dict) -> Panel:
    counts = n["samples_per_pack"]["counts"]
    panel = Panel(f"samples per pack (mean {n['samples_per_pack']['mean']:.2f})", "samples", "packs",
                  (-1.0, float(max(len(counts), 1))), (0.0, max(counts + [0]) * 1.05 or 1.0),
                  bars=[(i - 0.4, i + 0.4, c, BLUE) for i, c in enumerate(counts)])
    panel.xticks = _linear_ticks(*panel.xlim, integer=True)
    panel.yticks = _linear_ticks(*panel.ylim, integer=True)
    return panel


def _draw_panel(image, draw, p: Panel) -> None:
    left, top, right, bottom = p.box
    small, label = _font(11), _font(12)
    for x0, x1, height, colour in p.bars:
        if height <= p.ylim[0] or x1 <= p.xlim[0] or x0 >= p.xlim[1]:
            continue
        a, b = p.px(max(x0, p.xlim[0]), min(height, p.ylim[1])), p.px(min(x1, p.xlim[1]), p.ylim[0])
        draw.rectangle((a[0], a[1], max(b[0] - 1, a[0]), bottom), fill=colour)
    for x, colour in p.vlines:
        column = p.px(x, p.ylim[0])[0]
        for y in range(top, bottom, 10):  # dashed
            draw.line((column, y, column, min(y + 5, bottom)), fill=colour, width=2)
    draw.rectangle(p.box, outline=INK)
    for value, text in p.xticks:
        column = p.px(value, p.ylim[0])[0]
        if left <= column <= right:
            draw.line((column, bottom, column, bottom + 4), fill=INK)
            _text(draw, (column, bottom + 6), text, small, "center")
    for value, text in p.yticks:
        row = p.px(p.xlim[0], value)[1]
        if top <= row <= bottom:
            draw.line((left - 4, row, left, row), fill=INK)
            _text(draw, (left - 6, row), text, small, "right", middle=True)
    _text(draw, ((left + right) / 2, top - 18), p.title, _font(13), "center")
    if p.xlabel:
        _text(draw, ((left + right) / 2, bottom + 20), p.xlabel, label, "center")
    widest = max([_size(draw, text, small)[0] for _, text in p.yticks] + [0])
    _vertical_text(image, (left - 10 - widest, (top + bottom) / 2), p.ylabel, label)
    if p.legend:
        _draw_legend(draw, p, small)


def _draw_legend(draw, p: Panel, font) -> None:
    widths = [_size(draw, text, font)[0] for _, _, text in p.legend]
    box_right, box_top = p.box[2] - 6, p.box[1] + 6
    box_left = box_right - max(widths) - 34
    draw.rectangle((box_left, box_top, box_right, box_top + 14 * len(p.legend) + 6), fill=WHITE, outline=GREY)
    for i, (kind, colour, text) in enumerate(p.legend):
        y = box_top + 4 + 14 * i
        if kind == "patch":
            draw.rectangle((box_left + 6, y + 2, box_left + 24, y + 10), fill=colour)
        elif kind == "dash":
            for x in (box_left + 6, box_left + 16):
                draw.line((x, y + 6, x + 6, y + 6), fill=colour, width=2)
        _text(draw, (box_left + 30, y), text, font, "left")


def _linear_ticks(low: float, high: float, integer: bool = False) -> list:
    """Ticks at 1, 2 or 5 times a power of ten, about six over ``[low, high]``, with their labels."""
    if high <= low:
        return [(low, _tick_label(low, 1.0))]
    raw = (high - low) / 6
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    step = max(step, 1.0) if integer else step
    k = math.ceil(low / step - 1e-9)
    ticks = []
    while k * step <= high + step * 1e-9:
        ticks.append((k * step, _tick_label(k * step, step)))
        k += 1
    return ticks


def _tick_label(value: float, step: float) -> str:
    digits = max(0, -math.floor(math.log10(step)))
    return f"{value:.{digits}f}"


def _log_ticks(low: float, high: float) -> list:
    """A tick at each power of ten in ``[low, high]``."""
    return [(10.0 ** k, f"{10.0 ** k:g}") for k in range(math.ceil(math.log10(low)), math.floor(math.log10(high)) + 1)]


@functools.lru_cache(maxsize=None)
def _font(size: int):
    """Pillow's own font at ``size`` pixels (its bitmap font, one size, where Pillow lacks FreeType)."""
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _size(draw, text: str, font) -> tuple[int, int]:
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    return x1 - x0, y1 - y0


def _text(draw, xy, text: str, font, align: str, middle: bool = False) -> None:
    """``text`` with its top (or its middle) at ``xy[1]``, its left, centre or right at ``xy[0]``."""
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    x = xy[0] - {"left": 0, "center": (x1 - x0) / 2, "right": x1 - x0}[align] - x0
    y = xy[1] - ((y1 - y0) / 2 if middle else 0) - y0
    draw.text((round(x), round(y)), text, fill=INK, font=font)


def _vertical_text(image, centre, text: str, font) -> None:
    """``text`` turned a quarter left (an axis label), its right edge at ``centre[0]``, centred on ``centre[1]``."""
    from PIL import Image, ImageDraw

    x0, y0, x1, y1 = ImageDraw.Draw(image).textbbox((0, 0), text, font=font)
    mask = Image.new("L", (x1 - x0, y1 - y0), 0)
    ImageDraw.Draw(mask).text((-x0, -y0), text, fill=255, font=font)
    mask = mask.rotate(90, expand=True)
    left, top = round(centre[0] - mask.size[0]), round(centre[1] - mask.size[1] / 2)
    image.paste(INK, (left, top, left + mask.size[0], top + mask.size[1]), mask)


def _wrap(text: str, font, width: int) -> list[str]:
    """``text``'s words in lines no wider than ``width`` pixels."""
    lines, line = [], ""
    for word in text.split(" "):
        candidate = f"{line} {word}" if line else word
        if line and font.getlength(candidate) > width:
            lines.append(line)
            candidate = word
        line = candidate
    return lines + [line]


def _plot(n: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp.png")
    report_figure(n).save(tmp)
    tmp.replace(path)
