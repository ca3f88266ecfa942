"""`megatron-pack inspect DIR` (or `data.dataset_dir=DIR`): a prepared dataset's summary and report.

Prints the token store's counts and length percentiles, one row per packing plan (pack size,
pad multiple, algorithm, packs, efficiency, accounting), and the paths of every plan's
``report.json`` / ``report.png`` (written now when missing).
"""

from __future__ import annotations

import sys
from pathlib import Path


def _dataset_dir(argv: list[str], config_dirs: list[str]) -> Path:
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            return Path(arg)
        if key == "data.dataset_dir":
            return Path(value)
    from megatron_pack.config import load_config

    return Path(load_config(argv, config_dirs=config_dirs).data.dataset_dir)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _plan_row(plan_dir: Path, m: dict) -> list[str]:
    acc = m["accounting"]
    return [plan_dir.name, str(m["pack_size"]), str(m["pad_seq_to_mult"]), m["algorithm"], str(m["seed"]),
            m["on_overflow"], str(m["num_bins"]), str(m["lower_bound_bins"]), f"{m['packing_efficiency']:.2f}",
            str(acc["num_samples_read"]), str(acc["num_samples_packed"]),
            str(sum(acc["num_samples_dropped"].values())), str(acc["num_samples_truncated"])]


def summarize(dataset_dir: Path) -> str:
    """The text ``inspect`` prints; every plan's report files are written when missing."""
    from megatron_pack.data.batches.dataset import PackedSFTDataset, list_plans, read_metadata
    from megatron_pack.data.packing.report import write_report
    from megatron_pack.data.store.token_store import STORE_FORMAT, STORE_FORMAT_VERSION

    store = read_metadata(dataset_dir, STORE_FORMAT, STORE_FORMAT_VERSION)
    pct = store["sample_num_ids_percentiles"]
    lines = [f"token store {dataset_dir}: {store['num_samples']} samples, {store['num_tokens']} tokens "
             f"({store['token_dtype']}), tokenizer {store['tokenizer']['name']} (vocab {store['vocab_size']})",
             f"  sample ids P50/P90/P95/P99/max: {pct['p50']}/{pct['p90']}/{pct['p95']}/{pct['p99']}/{pct['max']}; "
             f"answer tokens {store['answer_token_share']:.1%}; blank lines skipped {store['num_blank_lines_skipped']}"]
    plans = list_plans(dataset_dir)
    if not plans:
        return "\n".join(lines + ["no packing plans yet: run `megatron-pack prepare` with a pack size."])
    rows = [["plan", "pack", "mult", "algorithm", "seed", "overflow", "packs", "lower bd", "eff %", "read",
             "packed", "dropped", "truncated"]]
    reports = []
    for plan_dir in plans:
        ds = PackedSFTDataset(dataset_dir, plan_dir)
        rows.append(_plan_row(plan_dir, ds.metadata))
        if not (plan_dir / "report.json").is_file() or not (plan_dir / "report.png").is_file():
            write_report(ds.store, plan_dir)
        reports += [f"  {plan_dir / 'report.json'}", f"  {plan_dir / 'report.png'}"]
    return "\n".join(lines + ["", _table(rows), "", "reports:"] + reports)


def main(argv: list[str]) -> int:
    from megatron_pack.cli.args import parse_command_line, print_resolved
    from megatron_pack.config.schema import ConfigError
    from megatron_pack.data.formats.sources import DataError

    line = parse_command_line("inspect", argv)
    if isinstance(line, int):
        return line
    try:
        if line.print_config:
            from megatron_pack.config import load_config

            return print_resolved(load_config([a for a in line.overrides if "=" in a], config_dirs=line.config_dirs))
        print(summarize(_dataset_dir(line.overrides, line.config_dirs)))
    except (ConfigError, DataError, FileNotFoundError) as exc:
        print(f"megatron-pack inspect: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
