"""The dataset report: ``report.json`` and ``report.png`` in a plan directory.

Figures: the sample-length histogram (log count axis, bins up to the 99th percentile (or the
pack size, when lower) and one tail bar beyond it, so a few very long samples do not squeeze the bulk into one bar; the pack size
marked; truncated and dropped-too-long samples shown), the pack-fill histogram zoomed to the range
the packs occupy, the padding share, and the number of samples per pack. ``report.json`` holds the
same numbers.
"""

from __future__ import annotations

import os
import threading
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


def write_report(store: TokenStore, plan_dir: Path, painter: "ReportPainter | None" = None) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.png`` into ``plan_dir``; return their paths. ``painter``
    (started earlier) draws the figure in its own process, matplotlib already imported."""
    numbers = report_numbers(store, plan_dir)
    json_path, png_path = Path(plan_dir) / "report.json", Path(plan_dir) / "report.png"
    write_json(json_path, numbers)
    if painter is not None:
        painter.paint(numbers, png_path)
    else:
        _plot(numbers, png_path)
    return json_path, png_path


class ReportPainter:
    """A forked process that imports matplotlib while ``prepare`` loads the tokenizer and tokenizes
    (about 1 s of a 100-record prepare's fixed cost, moved to another core), then draws
    ``report.png`` when asked. ``start()`` returns None where processes cannot be forked; the
    figure is then drawn in-process. ``close()`` always ends the process. ``shared()`` keeps one for the
    process's later prepares."""

    _shared: "ReportPainter | None" = None
    """The painter ``shared()`` keeps for the process that started it."""

    def __init__(self, process, conn):
        self.process, self.conn, self.used = process, conn, False
        self.owner = os.getpid()
        self.lock = threading.Lock()

    @classmethod
    def start(cls) -> "ReportPainter | None":
        import multiprocessing as mp

        if "fork" not in mp.get_all_start_methods():
            return None
        parent, child = mp.get_context("fork").Pipe()
        process = mp.get_context("fork").Process(target=_paint_loop, args=(child,), daemon=True,
                                                 name="report-painter")
        process.start()
        child.close()
        return cls(process, parent)

    @classmethod
    def shared(cls) -> "ReportPainter | None":
        """This process's painter: started by its first prepare and kept, matplotlib imported, for the next ones
        (a process that prepares several datasets, a notebook, a sweep, a test session, imports it once, not once
        a prepare); a new one when it died or belongs to the process this one was forked from. It ends with the
        process (a daemon: an unused painter does not hold the exit up)."""
        painter = cls._shared
        if painter is None or painter.owner != os.getpid() or not painter.process.is_alive():
            painter = cls._shared = cls.start()
        return painter

    def paint(self, numbers: dict, path: Path) -> None:
        self.used = True
        try:
            with self.lock:  # one figure at a time through the pipe; the path absolute (the painter's folder is
                self.conn.send((numbers, os.path.abspath(path)))  # the one it was forked in)
                error = self.conn.recv()
        except (EOFError, OSError):  # the painter died: draw here, the report must exist
            error = None
            _plot(numbers, path)
        if error:
            raise RuntimeError(f"drawing {path} failed: {error}")

    def close(self) -> None:
        """End the process: at once when it drew nothing (a re-run that found its report need not
        wait for matplotlib's import), else after it finished."""
        if not self.used:
            self.process.terminate()
        else:
            try:
                self.conn.send(None)
            except (OSError, ValueError):
                pass
        self.conn.close()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)


def _paint_loop(conn) -> None:
    import signal

    # Ctrl-C reaches the whole process group: the parent says it once and ends this process (close(), or as a
    # daemon at its exit); a KeyboardInterrupt here would only print a second traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the imports are the point: done before the numbers arrive (the figure's, never pyplot's)
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401

    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            _plot(job[0], Path(job[1]))
            conn.send("")
        except Exception as exc:  # reported in the parent, with the path
            conn.send(f"{type(exc).__name__}: {exc}")


def report_figure(n: dict):
    """The four-panel matplotlib figure of ``report.png`` (returned, for tests and notebooks).

    A ``matplotlib.figure.Figure`` drawn on the non-interactive Agg canvas: no ``pyplot`` (its import
    and its global backend choice are not needed to write a PNG, and a notebook's backend is left
    alone), and matplotlib is imported only here, when a report is written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    _plot_lengths(axes[0, 0], n)
    f = n["pack_fill_histogram"]
    axes[0, 1].stairs(f["counts"], f["edges"], fill=True)
    axes[0, 1].set_xlim(*f["range"])
    below = f"; {f['num_below_range']} below {f['range'][0]:.0%} in the first bar" if f["num_below_range"] else ""
    _title(axes[0, 1], f"pack fill (mean {n['mean_pack_fill']:.1%}; zoomed{below})")
    axes[0, 1].set(xlabel="fraction of pack", ylabel="packs")
    real = 1 - n["padding_share"]
    align = n["alignment_padding_share"]
    axes[1, 0].bar(["sample tokens", "alignment pad", "tail pad"], [real, align, n["padding_share"] - align])
    _title(axes[1, 0], f"padding share {n['padding_share']:.1%}")
    axes[1, 0].set(ylabel="share of pack tokens")
    counts = n["samples_per_pack"]["counts"]
    axes[1, 1].bar(range(len(counts)), counts)
    _title(axes[1, 1], f"samples per pack (mean {n['samples_per_pack']['mean']:.2f})")
    axes[1, 1].set(xlabel="samples", ylabel="packs")
    if "lost_data" in n:  # what the plan kept and lost, over the panels
        import textwrap

        fig.suptitle("\n".join(textwrap.wrap(lost_data_text(n["lost_data"]), 150)), fontsize=9)
    # fixed margins (tight_layout measured every tick label: 0.6 s of a 1.2 s report on 2 cores)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.88, hspace=0.38, wspace=0.22)
    return fig


def _plot_lengths(ax, n: dict) -> None:
    h = n["sample_length_histogram"]
    edges, counts = np.asarray(h["edges"]), np.asarray(h["counts"])
    bulk = len(edges) - 1 - (1 if h["num_in_tail"] else 0)
    ax.stairs(counts[:bulk], edges[:bulk + 1], fill=True, label="samples")
    if h["num_in_tail"]:  # drawn one bin wide at the right edge, labelled with its true range
        width = edges[1] - edges[0]
        ax.bar(edges[bulk] + width / 2, h["num_in_tail"], width=width, color="tab:orange",
               label=f"> {h['split']} ({h['num_in_tail']} samples, up to {int(edges[-1])})")
    right = edges[bulk] + 2 * (edges[1] - edges[0])
    if n["pack_size"] <= right:
        ax.axvline(n["pack_size"], color="red", linestyle="--", label=f"pack size {n['pack_size']}")
    else:  # the axis shows the samples, not the empty room up to the pack
        ax.plot([], [], color="red", linestyle="--", label=f"pack size {n['pack_size']} (right of the axis)")
    over = n["num_samples_longer_than_pack"]
    if over:
        ax.plot([], [], " ", label=f"longer than pack: {over} ({n['num_samples_truncated']} truncated, "
                                   f"{n['num_samples_dropped_too_long']} dropped)")
    ax.set_xlim(0, max(right, n["pack_size"] * 1.02 if n["pack_size"] <= right else right))
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.7)
    _title(ax, f"sample length (THD tokens; P99 {h['p99']})")
    ax.set(xlabel="tokens", ylabel="samples (log)")
    ax.legend(fontsize=8)


def _title(ax, text: str) -> None:
    # at the top edge, where matplotlib's automatic placement puts it on these axes (no tick labels or x label
    # at the top: the same pixels); that placement measures every tick label of the axes at each draw (0.62 ->
    # 0.52 CPU-s a report without it)
    ax.set_title(text, y=1.0)


def _plot(n: dict, path: Path) -> None:
    fig = report_figure(n)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=80)
    tmp.replace(path)
