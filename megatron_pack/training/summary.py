"""The lines a training run ends with: first and last loss, totals, where its report, logs and checkpoints are,
and the next step (``next_step_lines``: the export command for its checkpoint)."""

from __future__ import annotations

from pathlib import Path

from megatron_pack.config.schema import Config
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.training.resume import save_dir


def run_summary(cfg: Config, dataset: PackedSFTDataset) -> str:
    """The lines a run ends with: first and last loss, and where its report, logs and checkpoints are."""
    from megatron_pack.training.metrics import read_metrics

    out = Path(cfg.train.output_dir)
    lines = []
    if (out / "metrics.jsonl").is_file():
        records = read_metrics(out / "metrics.jsonl")
        first, last = records[0], records[-1]
        lines.append(f"lm loss: first {first['lm_loss']:.4f} (step {first['step']}) -> "
                     f"last {last['lm_loss']:.4f} (step {last['step']})")
        lines += _summary_totals(records, _online_epoch_samples(cfg, dataset), online=cfg.packing.mode == "online")
    if dataset.plan_dir is not None:  # online packing and in-batch packing have no plan
        plan = Path(dataset.plan_dir)
        lines.append(f"packing report: {plan / 'report.json'} and {plan / 'report.png'}")
    elif cfg.packing.mode == "in_batch":
        lines.append(f"in-batch packing: micro-batches of {cfg.train.micro_batch_size} samples packed at collate "
                     f"(no offline plan, so no packing report)")
    lines += [f"metrics: {out / 'metrics.jsonl'}",
              f"TensorBoard: tensorboard --logdir {out / 'tensorboard'}"]
    if cfg.checkpoint.enabled:
        lines.append(f"checkpoints: {save_dir(cfg)}")
    return "\n".join(lines)


def _online_epoch_samples(cfg: Config, dataset) -> "int | None":
    """Samples an epoch of online packing reads, where known before it ends (the token store's, less the held-out
    ones; the synthetic set's size); None for offline packing (its loader counts fractional epochs itself) and for
    streamed files (their length is known only once the first epoch ends)."""
    if getattr(dataset, "metadata", {}).get("mode") != "online":
        return None
    store = getattr(dataset, "store", None)
    if store is not None:
        held_out = getattr(dataset, "_held_out", None)
        return len(store) - (int(held_out.sum()) if held_out is not None else 0)
    return cfg.data.synthetic_num_samples if cfg.data.source == "synthetic" else None


def _epoch_text(last: dict, online_epoch_samples: "int | None", online: bool) -> str:
    """``, 0.18 epochs (350 of 1,900 samples an epoch)`` online, ``, 1.25 epochs`` offline."""
    if last.get("epoch") is None:
        return ""
    if not online:
        return f", {last['epoch']:.2f} epochs"
    samples = last.get("consumed_samples", 0)
    if online_epoch_samples:  # the loader counts whole epochs only: 350 of 1,900 samples read "0.00 epochs"
        return f", {samples / online_epoch_samples:.2f} epochs ({samples:,} of {online_epoch_samples:,} samples an epoch)"
    return f", {int(last['epoch'])} whole epochs (the length of a streamed epoch is known once the first ends)"


def _summary_totals(records: list[dict], online_epoch_samples: "int | None" = None, online: bool = False) -> list[str]:
    """Total time and tokens, and the best and last validation loss, from the metrics records."""
    from megatron_pack.training.metrics import format_duration

    last = records[-1]
    lines = [f"total: {format_duration(last.get('elapsed_s') or 0.0)} training time, "
             f"{last.get('consumed_target_tokens', 0):,} target tokens, "
             f"{last.get('consumed_samples', 0):,} samples" + _epoch_text(last, online_epoch_samples, online)]
    evals = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if evals:
        best = min(evals, key=lambda e: e[1])
        lines.append(f"validation loss: best {best[1]:.4f} (step {best[0]}), last {evals[-1][1]:.4f} "
                     f"(step {evals[-1][0]})")
    return lines


def next_step_lines(cfg: Config) -> list[str]:
    """The command that exports this run's checkpoint (a finished run started from ``model.pretrained``; a model
    built from ``model.*`` has no Hugging Face folder to export to). Under ``peft=lora``: the adapters in the peft
    format, and the merged model. Example::

        next: megatron-pack export checkpoint=runs/sft/checkpoints output=exports/sft   # a Hugging Face folder
    """
    import shlex

    if not (cfg.checkpoint.enabled and cfg.model.pretrained):
        return []
    run = Path(cfg.train.output_dir).name or "run"
    export = f"megatron-pack export checkpoint={shlex.quote(str(save_dir(cfg)))}"
    if cfg.peft.method == "lora":
        return [f"next: {export} output={shlex.quote(f'exports/{run}-adapter')} export.adapter=true   "
                "# the LoRA adapters for peft",
                f"  or: {export} output={shlex.quote(f'exports/{run}-merged')} export.merge=true   "
                "# merged into the base: a Hugging Face folder"]
    return [f"next: {export} output={shlex.quote(f'exports/{run}')}   # a Hugging Face folder"]
