"""`megatron-pack inspect DIR` (or `data.dataset_dir=DIR`, `data.plan=NAME`): a prepared dataset's summary.

Prints the token store's counts and length percentiles, one row per packing plan (pack size,
pad multiple, algorithm, packs, efficiency, accounting with the samples held out for validation), each
plan's validation set, what each plan kept and lost, the settings that tell the plans apart (from their manifests), and the paths of every plan's ``report.json`` /
``report.png`` (written now when missing). ``data.plan=NAME``, or manifest keys given on the command
line (``packing.seed=3``), show only the plans they pick, a single one with its whole manifest.
``sample=I`` prints sample I decoded, its loss-carrying ids marked, and the pack it is in
(``megatron_pack.cli.inspect_sample``).
"""

from __future__ import annotations

import sys
from pathlib import Path


def _dataset_dir(argv: list[str], config_dirs: list[str]) -> tuple[Path, str | None, object]:
    """The dataset folder (``DIR`` or ``data.dataset_dir=DIR``), ``data.plan`` if given, and which plans the
    manifest keys given pick (a predicate on a plan's manifest; None: every plan)."""
    from megatron_pack.data.store.manifest import disagreements, given_entries
    from megatron_pack.data.store.recorded import given_keys

    plan = next((a.partition("=")[2] for a in argv if a.startswith("data.plan=")), None)
    overrides = [f"data.dataset_dir={a}" if "=" not in a else a for a in argv]
    given = given_keys(overrides)
    if "data.dataset_dir" in given and not given_entries(given):  # the usual case: no config to compose
        return Path(next(a for a in reversed(overrides) if a.startswith("data.dataset_dir=")).partition("=")[2]), plan, None
    from megatron_pack.config.loader import compose_config

    cfg = compose_config(overrides, config_dirs=config_dirs)
    keep = (lambda manifest: not disagreements(cfg, manifest, given)) if given_entries(given) else None
    return Path(cfg.data.dataset_dir), plan, keep


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _plan_row(plan_dir: Path, m: dict) -> list[str]:
    acc = m["accounting"]
    algorithm = m["algorithm"] + (f" ({m['wrapped_attention']})" if "wrapped_attention" in m else "")
    return [plan_dir.name, str(m["pack_size"]), str(m["pad_seq_to_mult"]), algorithm, str(m["seed"]),
            m["on_overflow"], str(m["num_bins"]), str(m["lower_bound_bins"]), f"{m['packing_efficiency']:.2f}",
            str(acc["num_samples_read"]), str(acc["num_samples_packed"]), str(acc.get("num_samples_held_out", 0)),
            str(sum(acc["num_samples_dropped"].values())), str(acc["num_samples_truncated"]),
            str(acc.get("num_samples_split", 0))]


def validation_text(plan_dir: Path, m: dict) -> str | None:
    """A plan's validation set, or None when it has none: the samples ``data.validation_fraction`` held out and
    the packs of its ``validation`` sub-plan, or the plan ``data.validation=FILE`` was prepared into. Example:
    ``13 samples held out (data.validation_fraction=0.2), 4 packs in <plan>/validation``."""
    from megatron_pack.data.store.atomic import read_json
    from megatron_pack.data.store.metadata import VALIDATION_DIRNAME

    manifest = m.get("manifest") or {}
    held_out = int(m.get("accounting", {}).get("num_samples_held_out", 0))
    if held_out and (plan_dir / VALIDATION_DIRNAME / "metadata.json").is_file():
        packs = read_json(plan_dir / VALIDATION_DIRNAME / "metadata.json")["num_bins"]
        return (f"{held_out} samples held out (data.validation_fraction={manifest.get('data.validation_fraction')}), "
                f"{packs} packs in {plan_dir / VALIDATION_DIRNAME}")
    recorded = manifest.get("data.validation")
    if recorded and recorded.get("plan"):
        where = plan_dir.parent.parent / recorded["plan"]
        packs = read_json(where / "metadata.json")["num_bins"] if (where / "metadata.json").is_file() else "no"
        return f"data.validation={recorded['input']}, {packs} packs in {where}"
    return None


def plan_details(plan_dir: Path, m: dict) -> list[str]:
    """Lines for a plan's strategy: wrapped attention, split overlap, buckets, source mixture, validation set."""
    lines = []
    validation = validation_text(plan_dir, m)
    if validation is not None:
        lines.append(f"  {plan_dir.name}: validation: {validation}")
    if m.get("wrapped_attention") == "cross":
        lines.append(f"  {plan_dir.name}: wrapped_attention=cross: attention crosses documents inside a row BY "
                     "DESIGN (pretraining style); verify reports it as leaking")
    elif m.get("wrapped_attention") == "document":
        lines.append(f"  {plan_dir.name}: wrapped_attention=document: documents cut at row ends, no attention "
                     "across documents")
    if m.get("on_overflow") == "split":
        lines.append(f"  {plan_dir.name}: split with overlap {m.get('split_overlap', 0)}: "
                     f"{m['accounting'].get('num_samples_split', 0)} samples cut into pieces, "
                     f"{m['accounting'].get('num_pieces_without_answer', 0)} pieces without answer left out")
    for b in m.get("buckets", {}).get("per_bucket", []):
        upper = "inf" if b["max_length"] is None else b["max_length"]
        lines.append(f"  {plan_dir.name}: bucket {b['bucket']} ({b['min_length_exclusive']}, {upper}]: "
                     f"{b['num_samples']} samples, {b['num_packs']} packs, {b['num_tokens']} tokens, "
                     f"efficiency {b['packing_efficiency']:.2f}%")
    for s in m.get("mixture", {}).get("per_source", []):
        lines.append(f"  {plan_dir.name}: source {s['name']}: target {s['target_share']:.1%} "
                     f"({s['target_tokens']} tokens), achieved {s['achieved_share']:.1%} ({s['achieved_tokens']} "
                     f"tokens), {s['num_samples_selected']}/{s['num_samples_available']} samples, "
                     f"{s['num_repeats']} repeats")
    return lines


def _manifest_lines(plans: list[Path], metas: list[dict], named: bool) -> list[str]:
    """Every recorded setting of a named plan; else, with several plans, the settings that tell them apart."""
    from megatron_pack.data.store.manifest import ENTRIES, distinguishing

    manifests = [m.get("manifest") or {} for m in metas]
    rows = ([e for e in ENTRIES if manifests[0].get(e.key) is not None] if named
            else distinguishing(manifests) if len(plans) > 1 else [])
    return [f"  {p.name}: " + ", ".join(e.text(m.get(e.key)) for e in rows) for p, m in zip(plans, manifests)] \
        if rows else []


def summarize(dataset_dir: Path, plan: str | None = None, keep=None) -> str:
    """The text ``inspect`` prints (``plan``: only that one; ``keep``: only the plans whose manifest it
    accepts); every plan's report files are written when missing."""
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.store.metadata import list_plans, read_metadata
    from megatron_pack.data.packing.report import write_report
    from megatron_pack.data.store.token_store import STORE_FORMAT, STORE_FORMAT_VERSION

    store = read_metadata(dataset_dir, STORE_FORMAT, STORE_FORMAT_VERSION)
    pct = store["sample_num_ids_percentiles"]
    positions = store['num_tokens'] - store['num_samples']  # the plans count THD positions: n - 1 of n ids
    lines = [f"token store {dataset_dir}: {store['num_samples']} samples, {store['num_tokens']} tokens "
             f"({store['token_dtype']}; {positions} THD positions, the tokens the plans count: a sample of n ids "
             f"gives n - 1), tokenizer {store['tokenizer']['name']} (vocab {store['vocab_size']})",
             f"  sample ids P50/P90/P95/P99/max: {pct['p50']}/{pct['p90']}/{pct['p95']}/{pct['p99']}/{pct['max']}; "
             f"answer tokens {store['answer_token_share']:.1%}; blank lines skipped {store['num_blank_lines_skipped']}"]
    images = store.get("images")
    if images:  # the image tokens are counted in every length above
        lines.append(f"  images: {images['num_images']} in {images['num_samples_with_images']} samples, "
                     f"{images['num_image_tokens']} image tokens ({images['num_image_tokens'] / store['num_tokens']:.1%} "
                     f"of the tokens; patch {images['patch_size']}, merge {images['merge_size']}, "
                     f"{images['min_pixels']}..{images['max_pixels']} pixels)")
    plans = list_plans(dataset_dir)
    if plan is not None:
        plans = [p for p in plans if p.name == plan]
        if not plans:
            from megatron_pack.data.formats.sources import DataError

            have = ", ".join(p.name for p in list_plans(dataset_dir)) or "none"
            raise DataError(f"data.plan ({plan}) is not a plan in {dataset_dir}/plans; plans there: {have}.")
    if keep is not None:
        from megatron_pack.data.formats.sources import DataError
        from megatron_pack.data.store.atomic import read_json

        picked = [p for p in plans if keep(read_json(p / "metadata.json").get("manifest") or {})]
        if plans and not picked:
            raise DataError(f"no plan in {dataset_dir} was made with the keys given (plans there: "
                            f"{', '.join(p.name for p in plans)}); `megatron-pack inspect {dataset_dir}` compares them.")
        plans = picked
    if not plans:
        return "\n".join(lines + ["no packing plans yet: run `megatron-pack prepare` with a pack size."])
    rows = [["plan", "pack", "mult", "algorithm", "seed", "overflow", "packs", "lower bd", "eff %", "read",
             "packed", "held out", "dropped", "truncated", "split"]]
    reports, details, metas = [], [], []
    for plan_dir in plans:
        ds = PackedSFTDataset(dataset_dir, plan_dir)
        rows.append(_plan_row(plan_dir, ds.metadata))
        details += plan_details(plan_dir, ds.metadata)
        metas.append(ds.metadata)
        if not (plan_dir / "report.json").is_file() or not (plan_dir / "report.png").is_file():
            write_report(ds.store, plan_dir)
        reports += [f"  {plan_dir / 'report.json'}", f"  {plan_dir / 'report.png'}"]
    from megatron_pack.data.packing.report import lost_data_text

    lost = [f"  {p.name}: {lost_data_text(m['lost_data'])}" for p, m in zip(plans, metas) if "lost_data" in m]
    named = len(plans) == 1 and (plan is not None or keep is not None)
    settings = _manifest_lines(plans, metas, named=named)
    title = "settings (manifest):" if named else "settings that tell the plans apart (data.plan=<name> picks one):"
    return "\n".join(lines + ["", _table(rows)] + ["", "kept and lost (tokens = THD positions):"] + lost
                     + (["", title] + settings if settings else [])
                     + (["", _details_title(plans, metas)] + details if details else []) + ["", "reports:"] + reports)


def _details_title(plans: list[Path], metas: list[dict]) -> str:
    """The heading of ``plan_details``' lines, naming what they show (``source mixture:``)."""
    kinds = [("validation sets", lambda p, m: validation_text(p, m) is not None),
             ("wrapped rows", lambda p, m: m.get("wrapped_attention") in ("cross", "document")),
             ("split samples", lambda p, m: m.get("on_overflow") == "split"),
             ("length buckets", lambda p, m: bool(m.get("buckets", {}).get("per_bucket"))),
             ("source mixture", lambda p, m: bool(m.get("mixture", {}).get("per_source")))]
    return ", ".join(name for name, shown in kinds if any(shown(p, m) for p, m in zip(plans, metas))) + ":"


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
        from megatron_pack.cli.inspect_sample import parse_sample, sample_text

        overrides, sample = parse_sample(line.overrides)
        if sample is not None:  # one sample as the model sees it (inspect_sample)
            dataset_dir, plan, _ = _dataset_dir(overrides, line.config_dirs)
            print(sample_text(dataset_dir, sample, plan))
            return 0
        print(summarize(*_dataset_dir(overrides, line.config_dirs)))
    except (ConfigError, DataError, FileNotFoundError) as exc:
        print(f"megatron-pack inspect: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
