"""The dataset report: ``report.json`` and ``report.png`` in a plan directory.

Figures: the sample-length histogram with the pack size marked, the pack-fill histogram, the
padding share, and the number of samples per pack. ``report.json`` holds the same numbers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_pack.data.store.atomic import read_json, write_json
from megatron_pack.data.packing.algorithms import thd_lengths
from megatron_pack.data.store.token_store import TokenStore


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
    edges = np.linspace(0, max(int(all_thd.max()), pack_size) + 1, 51)
    length_hist, _ = np.histogram(all_thd, bins=edges)
    fill_hist, fill_edges = np.histogram(fill, bins=20, range=(0.0, 1.0))
    total = len(per_pack) * pack_size
    return {
        "pack_size": pack_size, "pad_seq_to_mult": mult, "num_packs": int(len(per_pack)),
        "num_samples_in_store": int(len(all_thd)), "num_samples_packed": int(len(thd)),
        "sample_length_histogram": {"edges": edges.round(2).tolist(), "counts": length_hist.tolist()},
        "num_samples_longer_than_pack": int((all_thd > pack_size).sum()),
        "pack_fill_histogram": {"edges": fill_edges.round(3).tolist(), "counts": fill_hist.tolist()},
        "mean_pack_fill": float(fill.mean()) if fill.size else 0.0,
        "padding_share": float(1 - thd.sum() / total) if total else 0.0,
        "alignment_padding_share": float((padded - thd).sum() / total) if total else 0.0,
        "samples_per_pack": {"counts": np.bincount(per_pack).tolist(), "mean": float(per_pack.mean()) if
                             per_pack.size else 0.0, "max": int(per_pack.max()) if per_pack.size else 0},
        "packing_efficiency": meta["packing_efficiency"], "accounting": meta["accounting"],
        "algorithm": meta["algorithm"], "on_overflow": meta["on_overflow"],
        **{k: meta[k] for k in ("buckets", "wrapped_attention", "split_overlap", "mixture") if k in meta},
    }


def write_report(store: TokenStore, plan_dir: Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.png`` into ``plan_dir``; return their paths."""
    numbers = report_numbers(store, plan_dir)
    json_path, png_path = Path(plan_dir) / "report.json", Path(plan_dir) / "report.png"
    write_json(json_path, numbers)
    _plot(numbers, png_path)
    return json_path, png_path


def _plot(n: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    h = n["sample_length_histogram"]
    axes[0, 0].stairs(h["counts"], h["edges"], fill=True)
    axes[0, 0].axvline(n["pack_size"], color="red", linestyle="--", label=f"pack size {n['pack_size']}")
    axes[0, 0].set(title="sample length (THD tokens)", xlabel="tokens", ylabel="samples")
    axes[0, 0].legend()
    f = n["pack_fill_histogram"]
    axes[0, 1].stairs(f["counts"], f["edges"], fill=True)
    axes[0, 1].set(title=f"pack fill (mean {n['mean_pack_fill']:.1%})", xlabel="fraction of pack", ylabel="packs")
    real = 1 - n["padding_share"]
    align = n["alignment_padding_share"]
    axes[1, 0].bar(["sample tokens", "alignment pad", "tail pad"], [real, align, n["padding_share"] - align])
    axes[1, 0].set(title=f"padding share {n['padding_share']:.1%}", ylabel="share of pack tokens")
    counts = n["samples_per_pack"]["counts"]
    axes[1, 1].bar(range(len(counts)), counts)
    axes[1, 1].set(title=f"samples per pack (mean {n['samples_per_pack']['mean']:.2f})", xlabel="samples",
                   ylabel="packs")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(path)
