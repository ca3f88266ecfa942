"""Per-step training metrics: one reduction, one log line, TensorBoard scalars, a JSONL record.

Every number is global (summed over the DP x CP group) and token-weighted:

- ``lm_loss``: sum of every target token's loss / number of target tokens in the global batch
  (not a mean of per-pack means);
- ``target_tokens`` (tokens that carry loss) and ``real_tokens`` (tokens of real samples,
  prompt included, padding excluded) per optimizer step, and both per second;
- ``padding_share``: padded slots / all slots the model processed;
- ``samples``: samples packed into the step's packs; ``grad_norm``, ``lr``, ``step_time_s``;
- ``target_tokens_spread``: std / mean of ``target_tokens`` over the steps so far (this process):
  how much the effective batch varies (near 0 with ``train.global_batch_tokens``);
- ``imbalance_before`` / ``imbalance_after`` (planned steps only): max over mean of the per-DP-rank
  pack cost with the round-robin deal and with the deal trained on (``packing.balance=dp``).

Worked example: two packs of 8 slots, the first with samples of real lengths 3 and 4 (target
tokens 2 and 3, token-loss sums 1.0 and 2.0), the second with one sample of 5 (target 4, sum 6.0):
lm_loss = (1+2+6)/(2+3+4) = 1.0, real_tokens = 12, padding_share = 1 - 12/16 = 0.25, samples = 3.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_pack.parallel.comm import all_reduce

log = logging.getLogger("megatron_pack.train")


@dataclass(kw_only=True)
class StepMetrics:
    """Global metrics of one optimizer step."""

    step: int
    lm_loss: float
    target_tokens: int
    real_tokens: int
    slots: int
    samples: int
    grad_norm: float
    lr: float
    step_time_s: float
    imbalance_before: Optional[float] = None
    """Max/mean per-DP-rank pack cost of the round-robin deal (when the loader plans steps)."""
    imbalance_after: Optional[float] = None
    """The same for the deal trained on (packing.balance=dp); equal to before without balancing."""
    bucket_real_tokens: Optional[list[int]] = None
    """Real tokens per length bucket this step (packing.buckets), else None."""
    source_loss: Optional[dict] = None
    """Token-weighted loss per data.sources name (None for a source with no target this step)."""
    source_target_share: Optional[dict] = None
    """Share of the step's target tokens per data.sources name."""
    epoch: Optional[float] = None
    """Epochs completed (fractional) after this step; None when the loader has no pack sampler."""
    consumed_samples: int = 0
    """Samples trained on since step 0."""
    consumed_target_tokens: int = 0
    """Target tokens trained on since step 0."""
    elapsed_s: float = 0.0
    """Training time since step 0 (summed over resumed processes)."""
    eta_s: Optional[float] = None
    """Estimated time to the last step, from this process's mean step time."""
    val_loss: Optional[float] = None
    """Token-weighted validation loss, on steps that evaluate."""
    val_source_loss: Optional[dict] = None
    """Token-weighted validation loss per data.sources name (None for a source without a validation target)."""
    val_source_target_tokens: Optional[dict] = None
    """Validation target tokens per data.sources name."""
    val_source_target_share: Optional[dict] = None
    """Share of the validation target tokens per data.sources name."""
    moe: Optional[dict] = None
    """A MoE model's routing numbers (``model.moe.step_moe_metrics``): the auxiliary losses, tokens per
    expert per layer and each layer's max/mean load; None for a dense model."""
    model_tflops_per_device: Optional[float] = None
    """Model TFLOP/s per device: the step's model FLOPs (``training.flops``: real tokens, attention over each
    sub-sequence, forward and backward) over the step time and the world size."""
    mfu: Optional[float] = None
    """Model FLOPs utilisation: ``model_tflops_per_device`` over the device's peak (None without a peak)."""

    def add_validation(self, result) -> None:
        """Take an evaluation's numbers (``eval.EvalResult``): the loss, and per source when it has sources."""
        self.val_loss = result.loss
        if result.source_loss:
            self.val_source_loss = dict(result.source_loss)
            self.val_source_target_tokens = dict(result.source_target_tokens)
            self.val_source_target_share = result.source_target_share


    @property
    def padding_share(self) -> float:
        return 0.0 if self.slots == 0 else 1.0 - self.real_tokens / self.slots

    @property
    def target_tokens_per_s(self) -> float:
        return self.target_tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def real_tokens_per_s(self) -> float:
        return self.real_tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    def record(self) -> dict:
        """All fields and derived rates, JSON-ready (breakdowns only when the run has them)."""
        record = {k: v for k, v in asdict(self).items() if v is not None or k not in _BREAKDOWNS}
        return {**record, "padding_share": self.padding_share,
                "target_tokens_per_s": self.target_tokens_per_s, "real_tokens_per_s": self.real_tokens_per_s}

    def breakdown_scalars(self) -> dict[str, float]:
        """TensorBoard tags of the breakdowns: ``bucket_<i>/real_tokens``, ``source_<name>/loss``, ``.../target_share``."""
        out = {f"bucket_{i}/real_tokens": float(v) for i, v in enumerate(self.bucket_real_tokens or [])}
        for name, value in (self.source_loss or {}).items():
            if value is not None:
                out[f"source_{name}/loss"] = value
        for name, value in (self.source_target_share or {}).items():
            out[f"source_{name}/target_share"] = value
        if self.moe:
            out["moe/load_balancing_loss"], out["moe/z_loss"] = self.moe["load_balancing_loss"], self.moe["z_loss"]
            for layer, ratio in enumerate(self.moe["max_over_mean_load"]):
                out[f"moe/layer_{layer}/max_over_mean_load"] = ratio
                for expert, count in enumerate(self.moe["tokens_per_expert"][layer]):
                    out[f"moe/layer_{layer}/expert_{expert}_tokens"] = float(count)
        return out

    def validation_scalars(self) -> dict[str, float]:
        """TensorBoard tags under ``validation/``: ``lm_loss``, ``source_<name>/loss``, ``source_<name>/target_share``."""
        if self.val_loss is None:
            return {}
        out = {"lm_loss": self.val_loss}
        for name, value in (self.val_source_loss or {}).items():
            if value is not None:
                out[f"source_{name}/loss"] = value
        for name, value in (self.val_source_target_share or {}).items():
            out[f"source_{name}/target_share"] = value
        return out

    def line(self, train_iters: int) -> str:
        """The console line of a step, about 160 characters at most: loss (and validation loss when it was
        evaluated), lr, real tokens/s, padding, step time and ETA. Everything else (target tokens, samples,
        epoch, consumed counts, grad norm, elapsed time, DP imbalance, per-bucket and per-source numbers) is
        in metrics.jsonl and TensorBoard (``record``, ``breakdown_scalars``)."""
        val = f" | val loss {self.val_loss:.6f}" if self.val_loss is not None else ""
        if self.moe:  # the load-balancing loss and the worst layer's max/mean expert load
            val += (f" | lb {self.moe['load_balancing_loss']:.4f} load max/mean "
                    f"{max(self.moe['max_over_mean_load']):.2f}")
        eta = format_duration(self.eta_s) if self.eta_s is not None else "?"
        flops = ""
        if self.model_tflops_per_device is not None:  # per device; MFU where the device's peak is known
            flops = f" | {self.model_tflops_per_device:.3g} TFLOP/s/dev"
            flops += f" (MFU {100 * self.mfu:.1f}%)" if self.mfu is not None else ""
        return (f"step {self.step}/{train_iters} | loss {self.lm_loss:.6f}{val} | lr {self.lr:.2e} | "
                f"{self.real_tokens_per_s:,.0f} tok/s{flops} | padding {100 * self.padding_share:.1f}% | "
                f"{1000 * self.step_time_s:.0f} ms | ETA {eta}")


_BREAKDOWNS = ("bucket_real_tokens", "source_loss", "source_target_share", "val_source_loss",
               "val_source_target_tokens", "val_source_target_share", "moe")
"""Keys a record leaves out when they are None (the run has no buckets, sources, MoE or validation); every
other key is in every record, null where it has no value (``mfu`` without a device peak)."""


def format_duration(seconds: float) -> str:
    """``3725.0 -> '1h02m05s'``, ``65.2 -> '1m05s'``, ``4.3 -> '4s'``."""
    total = int(round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass
class StepCounts:
    """What one rank accumulates over its micro-batches before the step's single reduction."""

    loss_sum: float = 0.0
    target_tokens: float = 0.0
    real_tokens: int = 0
    slots: int = 0
    samples: int = 0
    bucket_real_tokens: list = field(default_factory=list)
    """Real tokens per length bucket (sized by the dataset's bucket count on every rank; [] without buckets)."""
    source_loss: list = field(default_factory=list)
    """Per data.sources: loss sums then target counts (2 * num sources; [] without sources)."""
    sum_sq_seqlens: float = 0.0
    """Sum over the packs' sub-sequences of their squared real lengths (the attention term of the model FLOPs)."""

    def add_pack(self, *, loss_sum: float, target_tokens: float, real_tokens: int, slots: int,
                 samples: int, owns_pack: bool, bucket: int = 0, source_loss: Optional[list] = None,
                 sum_sq_seqlens: float = 0.0) -> None:
        """Add one micro-batch; ``owns_pack`` is True on one rank per pack (CP rank 0), so the
        pack-level counts are not repeated by every CP rank that sees a slice of the pack.
        ``source_loss`` (this rank's shard, like ``loss_sum``) is added on every rank."""
        self.loss_sum += loss_sum
        self.target_tokens += target_tokens
        if source_loss is not None and self.source_loss:
            self.source_loss = [a + b for a, b in zip(self.source_loss, source_loss)]
        if owns_pack:
            self.real_tokens += real_tokens
            self.sum_sq_seqlens += sum_sq_seqlens
            self.slots += slots
            self.samples += samples
            if self.bucket_real_tokens:
                self.bucket_real_tokens[bucket] += real_tokens

    def to_vector(self) -> list[float]:
        """``[loss sum, target tokens, real tokens, slots, samples, sum of squared sub-sequence lengths,
        *bucket real tokens, *source loss]``."""
        return [self.loss_sum, self.target_tokens, self.real_tokens, self.slots, self.samples, self.sum_sq_seqlens,
                *self.bucket_real_tokens, *self.source_loss]

    @classmethod
    def from_vector(cls, values: list[float], num_buckets: int) -> "StepCounts":
        """The inverse of :meth:`to_vector` (``num_buckets``: the length of ``bucket_real_tokens``)."""
        loss_sum, target, real, slots, samples, sum_sq = values[:6]
        return cls(loss_sum, target, int(real), int(slots), int(samples),
                   [int(v) for v in values[6:6 + num_buckets]], list(values[6 + num_buckets:]), sum_sq)

    def reduce(self, group: Optional[dist.ProcessGroup]) -> "StepCounts":
        """Sum over ``group`` (the DP x CP group) in one float64 all-reduce (breakdowns included:
        every rank holds lists of the same sizes, so every rank enters the same collective)."""
        vec = torch.tensor(self.to_vector(), dtype=torch.float64)
        if group is not None:
            all_reduce(vec, group=group)
        return StepCounts.from_vector(vec.tolist(), len(self.bucket_real_tokens))

    def lm_loss(self) -> float:
        """Token-weighted mean loss; 0.0 when no token in the global batch carries loss."""
        return self.loss_sum / self.target_tokens if self.target_tokens > 0 else 0.0


class MetricsWriter:
    """Writes each step's metrics: a log line, ``metrics.jsonl``, and the same scalars to TensorBoard and any
    ``trackers`` (``training.trackers``: Weights & Biases, MLflow).

    Only the writer with ``enabled=True`` (global rank 0) touches files. ``resume_step`` is the step the run
    starts after (the checkpoint's, 0 for a fresh start; None keeps every record): records of later steps, which a killed or stopped
    run logged before this one replays them, move to ``metrics.replaced.jsonl`` so ``metrics.jsonl`` holds each
    step once, and TensorBoard purges its events after ``resume_step`` so its plots never go back in time.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, log_interval: int = 1,
                 tensorboard: bool = True, train_iters: int = 0, resume_step: Optional[int] = None, trackers: tuple = ()):
        self.enabled = enabled
        self.log_interval = log_interval
        self.train_iters = train_iters
        self.output_dir = Path(output_dir)
        self.tensorboard_dir = self.output_dir / "tensorboard"
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self.trackers = list(trackers)
        self._tb = None
        self._num_steps, self._mean, self._m2 = 0, 0.0, 0.0
        if enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            _drop_torn_record(self.jsonl_path)
            if resume_step is not None:
                _move_aside_after(self.jsonl_path, resume_step)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard's readers drop the earlier event files' steps >= it
                self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir),
                                         purge_step=None if resume_step is None else resume_step + 1)

    def write(self, metrics: StepMetrics) -> None:
        if not self.enabled:
            return
        record = metrics.record()
        record["target_tokens_spread"] = self._spread(metrics.target_tokens)
        with self.jsonl_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        scalars = step_scalars(metrics, record)
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, metrics.step)
            self._tb.flush()
        for tracker in self.trackers:
            tracker.log(scalars, metrics.step)
        if metrics.step % self.log_interval == 0 or metrics.step == self.train_iters or metrics.val_loss is not None:
            log.info(metrics.line(self.train_iters))

    def _spread(self, target_tokens: int) -> float:
        """Coefficient of variation (std / mean) of the target tokens per step over the steps of this process."""
        self._num_steps += 1
        delta = target_tokens - self._mean
        self._mean += delta / self._num_steps
        self._m2 += delta * (target_tokens - self._mean)
        return math.sqrt(self._m2 / self._num_steps) / self._mean if self._mean > 0 else 0.0

    def write_hparams(self, cfg, trainer) -> None:
        """TensorBoard hparams: every config key (flattened) with the run's last and best losses."""
        if self._tb is None:
            return
        from megatron_pack.training.record import flat_config

        last = trainer.history[-1]
        results = {"hparam/lm_loss": last.lm_loss}
        if trainer.val_history:
            results["hparam/val_loss_last"] = trainer.val_history[-1][1]
            results["hparam/val_loss_best"] = min(v for _, v in trainer.val_history)
        self._tb.add_hparams(flat_config(cfg), results, run_name="hparams")
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


_SCALARS = ("lm_loss", "target_tokens_per_s", "real_tokens_per_s", "padding_share", "samples", "target_tokens",
            "target_tokens_spread", "grad_norm", "lr", "step_time_s", "imbalance_before", "imbalance_after", "epoch",
            "consumed_samples", "consumed_target_tokens", "elapsed_s", "model_tflops_per_device", "mfu")


def step_scalars(metrics: StepMetrics, record: dict) -> dict[str, float]:
    """The step's scalars by tag, as TensorBoard, W&B and MLflow get them: ``train/<name>`` for the record's numbers
    and breakdowns, ``validation/<name>`` on steps that evaluate; null and non-finite values are left out."""
    out = {f"train/{key}": record[key] for key in _SCALARS if record.get(key) is not None}
    out |= {f"train/{key}": value for key, value in metrics.breakdown_scalars().items()}
    out |= {f"validation/{key}": value for key, value in metrics.validation_scalars().items()}
    return {tag: float(value) for tag, value in out.items() if math.isfinite(value)}


def _drop_torn_record(path: Path) -> None:
    """Cut a last record that a kill left half-written (no closing newline) so the resumed run
    appends whole lines; that step is replayed from the checkpoint and logged again."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        log.warning("metrics: %s ended in a torn record (%d bytes, from a killed run); cut it, the step "
                    "is logged again when it is replayed", path, len(data) - keep)
        with path.open("r+b") as f:
            f.truncate(keep)


def _move_aside_after(path: Path, resume_step: int) -> None:
    """Move the records of steps after ``resume_step`` to ``metrics.replaced.jsonl`` (appended, in file order):
    the run replays those steps from its checkpoint and logs them again. ``metrics.jsonl`` is rewritten
    atomically (a new file renamed over it)."""
    if not path.exists():
        return
    keep, moved = [], []
    for line in path.read_bytes().splitlines(keepends=True):
        if line.strip():
            (keep if json.loads(line)["step"] <= resume_step else moved).append(line)
    if not moved:
        return
    aside = path.with_name("metrics.replaced.jsonl")
    with aside.open("ab") as f:
        f.writelines(moved)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(keep))
    os.replace(tmp, path)
    log.warning("metrics: moved %d records of steps after %d (logged before the run went back to step %d) from %s "
                "to %s; those steps are logged again", len(moved), resume_step, resume_step, path.name, aside.name)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file in step order; a step logged twice (a run resumed
    from a checkpoint older than its last logged step) keeps its latest record."""
    by_step = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line:
            record = json.loads(line)
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]
