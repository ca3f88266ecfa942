"""The training loop: micro-batches -> per-token loss sums -> one normalisation -> optimizer step.

One optimizer step on every rank:

1. ``ddp.zero_grad_buffer()``;
2. ``num_microbatches = train.global_batch_size / dp`` forward/backward passes, each on one pack
   (or as many as the loader's ``begin_step()`` plans: a token budget, a balanced deal, online packs)
   (``forward_step``: next pack, this CP rank's slice, ``PackedSeqParams``), backward on the
   pack's loss SUM. Nothing divides by the number of micro-batches, CP or DP size. On GPU this
   is megatron-core's ``get_forward_backward_func()``; on CPU :func:`forward_backward_cpu` runs
   the same logic without its CUDA-only pieces;
3. one float64 all-reduce over DP x CP of the loss sums and token counts (metrics, and the
   non-finite check that stops every rank at the same step);
4. ``finalize_model_grads([ddp], num_tokens=<local target tokens>)``: megatron-core sums the
   gradients over DP x CP (``average_in_collective=False``), all-reduces the token count over
   the same group and scales the gradients by ``1 / count`` exactly once (per-token loss, which
   ``validate()`` requires with packing; without it ``num_tokens`` is not passed, as in
   megatron-core's schedules);
5. clip, AdamW step at the scheduled learning rate, metrics, maybe a checkpoint.

A rank whose tokens are all masked contributes a zero loss sum and zero gradients, never NaN.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol

import torch
import torch.distributed as dist

from megatron_pack.config.schema import Config, ConfigError
from megatron_pack.config.validate import distributed_optimizer_problems
from megatron_pack.data.batches import loader as loader_lib
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.batches.loader import open_dataset  # noqa: F401  (its path before data/batches/loader.py)
from megatron_pack.data.batches.sampler import PackLoader
from megatron_pack.parallel.groups import ParallelState
from megatron_pack.training import checkpoint as ckpt
from megatron_pack.training.metrics import MetricsWriter, StepCounts, StepMetrics
from megatron_pack.training.optim import LRSchedule, MegatronTrainOptimizer, TrainOptimizer, build_optimizer

log = logging.getLogger("megatron_pack.train")
sample_log = logging.getLogger("megatron_pack.train.samples")
"""logging.log_sample_ids lines; INFO on every rank (each DP rank reads other packs), see cli/train.py."""


class ResumableLoader(Protocol):
    """What the loop needs of a loader (``PackLoader``, or a test's list of batches): THD batches
    in order, and a state that resumes at the next one."""

    def __iter__(self) -> Iterator[dict]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class PackInfo:
    """What the loop records about each pack it hands to ``forward_step``."""

    sample_ids: list[int]
    real_tokens: int
    slots: int


def pack_info(batch: dict) -> PackInfo:
    """Sample ids (real samples only), real tokens (``cu_seqlens[-1]``) and slots (T) of a THD batch."""
    ids = batch["sample_ids"]
    ids = [int(i) for i in (ids.tolist() if torch.is_tensor(ids) else ids) if int(i) >= 0]
    return PackInfo(sample_ids=ids, real_tokens=int(batch["cu_seqlens"][-1]), slots=int(batch["tokens"].shape[-1]))


class RecordingIterator:
    """Wraps the loader's iterator; remembers every pack handed out since the last ``take()``."""

    def __init__(self, iterable: Iterable[dict]):
        self._it = iter(iterable)
        self.packs: list[PackInfo] = []
        self.batches: list[dict] = []

    def __iter__(self) -> "RecordingIterator":
        return self

    def __next__(self) -> dict:
        batch = next(self._it)
        self.packs.append(pack_info(batch))
        self.batches.append(batch)
        return batch

    def take(self) -> tuple[list[PackInfo], list[dict]]:
        packs, batches = self.packs, self.batches
        self.packs, self.batches = [], []
        return packs, batches


def wrap_ddp(cfg: Config, model: torch.nn.Module, state: ParallelState) -> torch.nn.Module:
    """megatron-core ``DistributedDataParallel`` with ``average_in_collective`` from ``cfg.ddp``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    d = cfg.ddp
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32, overlap_grad_reduce=d.overlap_grad_reduce,
        use_distributed_optimizer=d.use_distributed_optimizer, check_for_nan_in_grad=d.check_for_nan_in_grad,
        bucket_size=d.bucket_size, average_in_collective=d.average_in_collective)
    # the expert groups DDP asks for are in state.pg_collection (initialize_parallel), not megatron's globals
    ddp = DistributedDataParallel(model.config, ddp_config, model, pg_collection=state.pg_collection)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = None  # the loop calls it itself, after the loss check
    return ddp


def forward_backward_cpu(*, forward_step_func: Callable, data_iterator: Iterator, model: torch.nn.Module,
                         num_microbatches: int, per_token_loss: bool = True) -> list[dict]:
    """megatron-core's ``forward_backward_no_pipelining``, without CUDA pieces.

    With ``per_token_loss`` (``model.calculate_per_token_loss``, always with packing) backward runs
    on each micro-batch's loss sum as returned; without it, as megatron-core's schedule does, on
    the sum divided by the micro-batch's target count and by ``num_microbatches``. Gradient sync
    is deferred to the last micro-batch (``no_sync``). Returns the per-micro-batch loss reports.
    """
    reports = []
    for i in range(num_microbatches):
        sync = contextlib.nullcontext() if i == num_microbatches - 1 else model.no_sync()
        with sync:
            output, loss_fn = forward_step_func(data_iterator, model)
            loss_sum, num_tokens, report = loss_fn(output)
            if not per_token_loss:
                loss_sum = loss_sum / torch.clamp(num_tokens, min=1) / num_microbatches
            loss_sum.backward()
        reports.append(report)
    return reports


def forward_backward(*, forward_step_func: Callable, data_iterator: Iterator, model: torch.nn.Module,
                     num_microbatches: int, state: ParallelState, seq_length: int) -> list[dict]:
    """Run one step's micro-batches: megatron-core's schedule on GPU, the CPU loop otherwise."""
    if state.device.type != "cuda":
        return forward_backward_cpu(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                    model=model, num_microbatches=num_microbatches,
                                    per_token_loss=model.config.calculate_per_token_loss)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=[model],
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=1, forward_only=False,
        pg_collection=state.pg_collection)


@dataclass
class Trainer:
    """Everything one run holds; built by :func:`build_trainer`, advanced by :meth:`train_step`."""

    cfg: Config
    state: ParallelState
    model: torch.nn.Module
    optimizer: TrainOptimizer | MegatronTrainOptimizer
    schedule: LRSchedule
    loader: ResumableLoader
    forward_step_func: Callable
    step: int = 0
    data_iterator: Optional[RecordingIterator] = None
    pack_log: list[list[list[int]]] = field(default_factory=list)
    """Sample ids of every pack this rank consumed, per step (in this process)."""
    history: list[StepMetrics] = field(default_factory=list)
    """Metrics of every step run in this process."""
    step_info: Optional[Any] = None
    """The loader's plan of the current step (``begin_step()``), when it plans steps."""

    @property
    def num_microbatches(self) -> int:
        return self.cfg.train.global_batch_size // self.state.dp_size

    def compute_gradients(self) -> tuple[StepCounts, list[PackInfo]]:
        """Forward/backward over this step's micro-batches, the loss check, and
        ``finalize_model_grads``: afterwards ``param.main_grad`` holds the gradient of the
        token-weighted mean loss of the global batch. Returns the global counts and this rank's packs."""
        if self.data_iterator is None:
            self.data_iterator = RecordingIterator(self.loader)
        begin_step = getattr(self.loader, "begin_step", None)  # planned steps (steps.py, online.py)
        self.step_info = begin_step() if begin_step is not None else None
        num_microbatches = self.step_info.num_microbatches if self.step_info else self.num_microbatches
        self.model.zero_grad_buffer()
        reports = forward_backward(forward_step_func=self.forward_step_func, data_iterator=self.data_iterator,
                                   model=self.model, num_microbatches=num_microbatches, state=self.state,
                                   seq_length=self.cfg.model.seq_length)
        packs, batches = self.data_iterator.take()
        counts, local_tokens = self._count(reports, packs)
        total = counts.reduce(self.state.dp_cp_group)
        self._check_finite(self.step + 1, reports, batches, total)
        from megatron.core.distributed import finalize_model_grads

        # as megatron-core's schedules: the 1/global-token scaling belongs to per-token loss only
        # (without it DDP already averages over DP x CP and each micro-batch loss is a mean)
        per_token = self.model.config.calculate_per_token_loss
        finalize_model_grads([self.model], num_tokens=local_tokens if per_token else None,
                             pg_collection=self.state.pg_collection)
        return total, packs

    def train_step(self) -> StepMetrics:
        """One optimizer step (see the module docstring); returns its global metrics."""
        start = time.perf_counter()
        total, packs = self.compute_gradients()
        lr = self.schedule.next_lr()
        norm = self.optimizer.step(lr)
        self.step += 1
        self.pack_log.append([p.sample_ids for p in packs])
        metrics = StepMetrics(step=self.step, lm_loss=total.lm_loss(), target_tokens=int(round(total.target_tokens)),
                              real_tokens=total.real_tokens, slots=total.slots, samples=total.samples,
                              grad_norm=norm, lr=lr, step_time_s=time.perf_counter() - start,
                              imbalance_before=getattr(self.step_info, "imbalance_before", None),
                              imbalance_after=getattr(self.step_info, "imbalance_after", None))
        self.history.append(metrics)
        return metrics

    def _count(self, reports: list[dict], packs: list[PackInfo]) -> tuple[StepCounts, torch.Tensor]:
        counts = StepCounts()
        # The DP x CP group holds one TP rank, so every TP rank reduces the same global numbers;
        # pack-level counts come from CP rank 0 alone (all CP ranks see slices of the same pack).
        owns_pack = self.state.cp_rank == 0
        local_tokens = torch.zeros((), dtype=torch.int32)
        for report, pack in zip(reports, packs):
            loss_sum, num_tokens = report["lm loss"].double().cpu().tolist()
            counts.add_pack(loss_sum=loss_sum, target_tokens=num_tokens, real_tokens=pack.real_tokens,
                            slots=pack.slots, samples=len(pack.sample_ids), owns_pack=owns_pack)
            local_tokens += int(round(num_tokens))
        return counts, local_tokens.to(self.state.device)

    def _check_finite(self, step: int, reports: list[dict], batches: list[dict], total: StepCounts) -> None:
        from megatron_pack.training.step import check_finite

        if math.isfinite(total.loss_sum):
            return
        for report, batch in zip(reports, batches):
            try:
                check_finite(report["lm loss"][0], batch)
            except FloatingPointError as exc:
                raise FloatingPointError(f"step {step}, rank {self.state.rank}: {exc}") from None
        raise FloatingPointError(f"step {step}, rank {self.state.rank}: the global lm loss is not finite; the "
                                 "pack that produced it is named in the error of another rank.")

    # ----- checkpoints -----------------------------------------------------------------------

    def _named_params(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of the model: every parameter, or with peft=lora the adapters only
        (the frozen base is re-read from model.pretrained, whose path ``_meta`` records)."""
        lora = self.cfg.peft.method != "none"
        return {name: p.detach() for name, p in self.model.module.named_parameters() if p.requires_grad or not lora}

    def _meta(self) -> dict:
        from megatron_pack.model.peft import peft_meta

        s = self.state
        return {**layout_meta(s.world_size, s.tp_size, s.cp_size, s.dp_size), "peft": peft_meta(self.cfg)}

    def save(self, root: str | Path) -> Path:
        rank_state = {"rng": ckpt.rng_state(), "loader": self.loader.state_dict(),
                      "schedule": self.schedule.state_dict(), "step": self.step,
                      "optimizer": self.optimizer.rank_state()}
        return ckpt.save_checkpoint(root, self.step, model_state=self._named_params(),
                                    optim_state=self.optimizer.named_state(materialize=True),
                                    rank_state=rank_state, meta=self._meta(), tp_rank=self.state.tp_rank,
                                    keep_last=self.cfg.checkpoint.keep_last)

    def load(self, path: str | Path) -> None:
        rank_state = ckpt.load_checkpoint(path, model_state=self._named_params(),
                                          optim_state=self.optimizer.named_state(materialize=True),
                                          meta=self._meta(), tp_rank=self.state.tp_rank)
        self.optimizer.load_rank_state(rank_state.get("optimizer"))
        self.loader.load_state_dict(rank_state["loader"])
        self.schedule.load_state_dict(rank_state["schedule"])
        ckpt.set_rng_state(rank_state["rng"])
        self.step = int(rank_state["step"])
        self.data_iterator = None


def checkpoint_dirs(cfg: Config) -> tuple[Path, Optional[Path]]:
    """(where to save, what to resume from or None)."""
    save = Path(cfg.checkpoint.save or Path(cfg.train.output_dir) / "checkpoints")
    if cfg.checkpoint.load is not None:
        found = ckpt.find_latest(cfg.checkpoint.load)
        if found is None:
            raise FileNotFoundError(f"checkpoint.load ({cfg.checkpoint.load}) holds no complete checkpoint "
                                    "(no 'latest' or step_*/meta.json); fix the path or unset checkpoint.load.")
        return save, found
    return save, ckpt.find_latest(save)


def layout_meta(world_size: int, tp: int, cp: int, dp: int) -> dict:
    """The parallel layout a checkpoint records in ``meta.json`` and a resume must match."""
    return {"world_size": world_size, "tensor_model_parallel_size": tp, "context_parallel_size": cp,
            "data_parallel_size": dp}


def check_resume(cfg: Config, world_size: int) -> Optional[Path]:
    """The checkpoint this run will resume from (None: a fresh start), checked before any
    process group exists: a ``checkpoint.load`` that holds no checkpoint, or one written with
    another world size or layout, raises ``ConfigError`` (printed once by the entry, exit 2)
    instead of failing on every rank inside ``Trainer.load``."""
    from megatron_pack.parallel.dims import ParallelDims

    try:
        _, resume = checkpoint_dirs(cfg)
    except FileNotFoundError as exc:
        raise ConfigError([str(exc)]) from None
    if resume is None:
        return None
    dims = ParallelDims.from_config(cfg, world_size)
    saved = ckpt.read_meta(resume)
    mismatch = [f"{k} {saved.get(k)!r} there, {v!r} here"
                for k, v in layout_meta(world_size, dims.tp, dims.cp, dims.dp).items() if saved.get(k) != v]
    if mismatch:
        key = "checkpoint.load" if cfg.checkpoint.load is not None else "checkpoint.save (or train.output_dir)"
        raise ConfigError([f"cannot resume from {resume}: it was written with another parallel layout "
                           f"({'; '.join(mismatch)}). Resume it on {saved.get('world_size')} ranks with "
                           f"parallel.tensor_model_parallel_size={saved.get('tensor_model_parallel_size')} "
                           f"parallel.context_parallel_size={saved.get('context_parallel_size')}, or set {key} "
                           "to another directory to start fresh."])
    _check_resume_peft(cfg, resume, saved)
    return resume


def _check_resume_peft(cfg: Config, resume: Path, saved: dict) -> None:
    """A LoRA checkpoint resumes only as the same LoRA run (adapters only, on the recorded base)."""
    from megatron_pack.model.peft import peft_meta

    want, have = peft_meta(cfg), saved.get("peft")
    if want != have:
        key = "checkpoint.load" if cfg.checkpoint.load is not None else "checkpoint.save (or train.output_dir)"
        raise ConfigError([f"cannot resume from {resume}: it was written with peft {have!r}, this run has peft "
                           f"{want!r}; resume with the same peft.* and model.pretrained, or set {key} to another "
                           "directory to start fresh."])


def build_loader(cfg: Config, state: ParallelState, dataset: PackedSFTDataset) -> PackLoader:
    """This DP rank's loader (``megatron_pack.data.batches.loader.build_loader``) for ``state``'s ranks.
    Online packing reports each DP rank's shard accounting once (its TP/CP rank 0); the rest, rank 0."""
    announce = state.rank == 0
    if cfg.packing.mode == "online":
        announce = state.tp_rank == 0 and state.cp_rank == 0
    return loader_lib.build_loader(cfg, dataset, dp_rank=state.dp_rank, dp_size=state.dp_size,
                                   pin_memory=state.device.type == "cuda", announce=announce)


def build_trainer(cfg: Config, state: ParallelState, loader: ResumableLoader, *,
                  forward_step_func: Optional[Callable] = None) -> Trainer:
    """Model (seeded by ``train.seed``), DDP, optimizer, schedule; ``loader`` yields full THD packs
    for this DP rank and has ``state_dict()`` / ``load_state_dict()`` (resume at the next pack)."""
    from megatron_pack.model.builder import build_model
    from megatron_pack.training.step import forward_step

    refused = distributed_optimizer_problems(cfg)  # validate()'s rule, for a Config built without load_config
    if refused:
        raise ConfigError(refused)
    model = build_model(cfg, state)
    if cfg.train.bf16:  # megatron-core's bf16 wrapper: casts inputs, keeps fp32 main grads
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    _log_parameter_counts(model, state)
    ddp = wrap_ddp(cfg, model, state)
    optimizer = build_optimizer(cfg, list(model.named_parameters()), state.tp_group, ddp_model=ddp,
                                device=state.device.type)
    return Trainer(cfg=cfg, state=state, model=ddp, optimizer=optimizer, schedule=LRSchedule(cfg),
                   loader=loader, forward_step_func=forward_step_func or forward_step)


def _log_parameter_counts(model: torch.nn.Module, state) -> None:
    """'trainable parameters: X of Y (Z%)' on rank 0 (every TP rank enters the count's all-reduce)."""
    from megatron_pack.model.peft.lora import count_parameters, describe

    trainable, total = count_parameters(model, state.tp_group)
    if state.rank == 0:
        log.info(describe(trainable, total, getattr(getattr(model, "module", model), "num_adapters", None)))


def _should_save(cfg: Config, step: int) -> bool:
    c = cfg.checkpoint
    return c.enabled and (step == cfg.train.train_iters or (c.save_interval > 0 and step % c.save_interval == 0))


def run_training(cfg: Config, state: ParallelState, loader: ResumableLoader, *,
                 forward_step_func: Optional[Callable] = None) -> Trainer:
    """Train to ``train.train_iters`` (or ``train.exit_after_iters`` steps in this process),
    resuming from the newest checkpoint when there is one. Returns the trainer (its
    ``pack_log`` holds the sample ids of every pack this rank consumed in this process)."""
    trainer = build_trainer(cfg, state, loader, forward_step_func=forward_step_func)
    save_dir, resume = checkpoint_dirs(cfg)
    if cfg.model.pretrained and cfg.checkpoint.enabled and state.rank == 0:  # lets `export` read a checkpoint alone
        from megatron_pack.model.hf.export import save_hf_source

        save_hf_source(cfg.model.pretrained, save_dir)
    if resume is not None:
        trainer.load(resume)
        log.info("resumed from %s at step %d", resume, trainer.step)
    writer = MetricsWriter(cfg.train.output_dir, enabled=state.rank == 0, log_interval=cfg.logging.log_interval,
                           tensorboard=cfg.logging.tensorboard, train_iters=cfg.train.train_iters)
    num_run = 0
    try:
        while trainer.step < cfg.train.train_iters:
            metrics = trainer.train_step()
            writer.write(metrics)
            if cfg.logging.log_sample_ids and state.tp_rank == 0 and state.cp_rank == 0:
                sample_log.info("step %d rank %d dp_rank %d packs %s", trainer.step, state.rank, state.dp_rank,
                                trainer.pack_log[-1])
            if _should_save(cfg, trainer.step):
                path = trainer.save(save_dir)
                if state.rank == 0:
                    log.info("saved checkpoint %s", path)
            num_run += 1
            if cfg.train.exit_after_iters is not None and num_run >= cfg.train.exit_after_iters:
                log.info("train.exit_after_iters=%d reached at step %d; stopping", num_run, trainer.step)
                break
    finally:
        writer.close()
    return trainer


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
    if getattr(dataset, "plan_dir", None) is not None:  # online packing has no plan
        plan = Path(dataset.plan_dir)
        lines.append(f"packing report: {plan / 'report.json'} and {plan / 'report.png'}")
    lines += [f"metrics: {out / 'metrics.jsonl'}",
              f"TensorBoard: tensorboard --logdir {out / 'tensorboard'}"]
    if cfg.checkpoint.enabled:
        lines.append(f"checkpoints: {checkpoint_dirs(cfg)[0]}")
    return "\n".join(lines)
