"""The training loop: micro-batches -> per-token loss sums -> one normalisation -> optimizer step.

One optimizer step on every rank:

1. ``ddp.zero_grad_buffer()``;
2. ``num_microbatches = train.global_batch_size / (dp * micro_batch_size)`` forward/backward passes,
   each on one THD row: a pack, offline or online (micro_batch_size 1), or with
   ``packing.mode=in_batch`` micro_batch_size samples packed at collate (or as many as the
   loader's ``begin_step()`` plans: a token budget, a balanced deal, online packs)
   (``forward_step``: next row, this CP rank's slice, ``PackedSeqParams``), backward on the
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
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_pack.config.schema import Config
from megatron_pack.data.batches import loader as loader_lib
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.batches.loader import open_dataset  # noqa: F401  (its path before data/batches/loader.py)
from megatron_pack.data.batches.online import single_rank
from megatron_pack.data.batches.protocol import BatchLoader, StepInfo
from megatron_pack.model.moe import step_moe_metrics
from megatron_pack.parallel.groups import ParallelState, gather_objects
from megatron_pack.training import checkpoint as ckpt
from megatron_pack.training.metrics import MetricsWriter, StepCounts, StepMetrics
from megatron_pack.training.optim import LRSchedule, build_optimizer
from megatron_pack.training.resume import (DATA_SETTINGS, _check_resume_peft, changed_settings,  # noqa: F401
                                           check_resume, check_resume_settings, checkpoint_dirs, layout_meta,
                                           planned_train_iters, resolve_train_iters, resume_choice, run_settings,
                                           save_dir)
from megatron_pack.training.signals import StopRequest

log = logging.getLogger("megatron_pack.train")
sample_log = logging.getLogger("megatron_pack.train.samples")
"""logging.log_sample_ids lines; INFO on every rank (each DP rank reads other packs), see cli/train.py."""


@dataclass
class PackInfo:
    """What the loop records about each pack it hands to ``forward_step``."""

    sample_ids: list[int]
    real_tokens: int
    slots: int
    bucket: int = 0


def pack_info(batch: dict) -> PackInfo:
    """Sample ids (real samples only), real tokens (``cu_seqlens[-1]``), slots (T) and length bucket of a THD batch."""
    ids = batch["sample_ids"]
    ids = [int(i) for i in (ids.tolist() if torch.is_tensor(ids) else ids) if int(i) >= 0]
    return PackInfo(sample_ids=ids, real_tokens=int(batch["cu_seqlens"][-1]), slots=int(batch["tokens"].shape[-1]),
                    bucket=int(batch.get("bucket", 0)))


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
    # On CPU the distributed optimizer is ours (optim.ShardedTrainOptimizer): it shards the AdamW
    # state over its own flat layout and needs the whole all-reduced gradient, so DDP all-reduces.
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32, overlap_grad_reduce=d.overlap_grad_reduce,
        use_distributed_optimizer=d.use_distributed_optimizer and state.device.type == "cuda", check_for_nan_in_grad=d.check_for_nan_in_grad,
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
    optimizer: Any
    schedule: LRSchedule
    loader: BatchLoader
    forward_step_func: Callable
    train_iters: int = 0
    """Optimizer steps of the run (train.train_iters, or derived from train.num_epochs)."""
    validation: Optional[BatchLoader] = None
    """This DP rank's validation loader (``eval.ValidationLoader``) or None."""
    plan_fingerprint: Optional[str] = None
    step: int = 0
    data_iterator: Optional[RecordingIterator] = None
    pack_log: list[list[list[int]]] = field(default_factory=list)
    """Sample ids of every pack this rank consumed, per step (in this process)."""
    history: list[StepMetrics] = field(default_factory=list)
    """Metrics of every step run in this process."""
    step_info: StepInfo = field(default_factory=StepInfo)
    """The loader's plan of the current step (``begin_step()``)."""
    num_buckets: int = 0
    """Length buckets of the dataset (packing.buckets; 0: no per-bucket metrics)."""
    source_names: list[str] = field(default_factory=list)
    """data.sources names (empty: no per-source metrics)."""
    consumed_samples: int = 0
    """Samples trained on since step 0 (over all DP ranks, carried by checkpoints)."""
    consumed_target_tokens: int = 0
    """Target tokens trained on since step 0 (over all DP ranks, carried by checkpoints)."""
    elapsed_before_s: float = 0.0
    """Training time of the processes before this one (from the checkpoint)."""
    val_history: list[list[float]] = field(default_factory=list)
    """``[step, validation loss]`` of every evaluation since step 0."""
    stopped_by: Optional[str] = None
    """The signal that stopped the run after a step (``training.signals``), or None."""
    stop_checkpoint: Optional[Path] = None
    """The checkpoint saved at that stop (None: checkpoint.enabled=false)."""
    moe_metrics: Optional[dict] = None
    """The last step's MoE routing numbers (``model.moe.step_moe_metrics``), None for a dense model."""
    _start: float = field(default_factory=time.perf_counter)
    _first_step: int = 0


    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on this DP rank: global_batch_size / (dp * micro_batch_size). Each is one
        THD row: a pack (offline, micro_batch_size 1) or micro_batch_size samples packed at collate."""
        return self.cfg.train.global_batch_size // (self.state.dp_size * self.cfg.train.micro_batch_size)

    def compute_gradients(self) -> tuple[StepCounts, list[PackInfo]]:
        """Forward/backward over this step's micro-batches, the loss check, and
        ``finalize_model_grads``: afterwards ``param.main_grad`` holds the gradient of the
        token-weighted mean loss of the global batch. Returns the global counts and this rank's packs."""
        if self.data_iterator is None:
            self.data_iterator = RecordingIterator(self.loader)
        self.step_info = self.loader.begin_step()
        num_microbatches = self.step_info.num_microbatches
        if num_microbatches is None:  # a loader that plans nothing (BatchList): the config's fixed count
            num_microbatches = self.num_microbatches
        self.model.zero_grad_buffer()
        reports = forward_backward(forward_step_func=self.forward_step_func, data_iterator=self.data_iterator,
                                   model=self.model, num_microbatches=num_microbatches, state=self.state,
                                   seq_length=self.cfg.model.seq_length)
        packs, batches = self.data_iterator.take()
        counts, local_tokens = self._count(reports, packs)
        total = counts.reduce(self.state.dp_cp_group)
        self.moe_metrics = step_moe_metrics(reports, self.state.dp_cp_group, total.target_tokens)
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
        if not self.history:
            self._start, self._first_step = start, self.step
        total, packs = self.compute_gradients()
        lr = self.schedule.next_lr()
        norm = self.optimizer.step(lr)
        self.step += 1
        self.pack_log.append([p.sample_ids for p in packs])
        source_loss = source_share = None
        if self.source_names:
            from megatron_pack.training.breakdown import source_metrics

            source_loss, source_share = source_metrics(total.source_loss, self.source_names)
        target_tokens = int(round(total.target_tokens))
        self.consumed_samples += total.samples
        self.consumed_target_tokens += target_tokens
        now = time.perf_counter()
        done = self.step - self._first_step
        metrics = StepMetrics(step=self.step, lm_loss=total.lm_loss(), target_tokens=target_tokens,
                              real_tokens=total.real_tokens, slots=total.slots, samples=total.samples,
                              grad_norm=norm, lr=lr, step_time_s=now - start, epoch=self.epoch(),
                              consumed_samples=self.consumed_samples,
                              consumed_target_tokens=self.consumed_target_tokens,
                              elapsed_s=self.elapsed_before_s + now - self._start,
                              eta_s=(now - self._start) / done * max(0, self.train_iters - self.step),
                              imbalance_before=self.step_info.imbalance_before,
                              imbalance_after=self.step_info.imbalance_after,
                              bucket_real_tokens=total.bucket_real_tokens or None, source_loss=source_loss,
                              source_target_share=source_share, moe=self.moe_metrics)
        self.history.append(metrics)
        return metrics

    def epoch(self) -> float:
        """Epochs completed, fractional (the loader's position)."""
        return self.loader.epoch

    def evaluate(self):
        """Validation loss over the validation packs (``eval.evaluate``); None without a validation set."""
        if self.validation is None:
            return None
        from megatron_pack.training.eval import evaluate

        result = evaluate(self.model, self.validation, forward_step_func=self.forward_step_func,
                          group=self.state.dp_cp_group, num_packs=self.validation.packs_per_epoch,
                          source_names=self.validation.info.source_names)
        self.val_history.append([self.step, result.loss])
        return result

    def _count(self, reports: list[dict], packs: list[PackInfo]) -> tuple[StepCounts, torch.Tensor]:
        counts = StepCounts(bucket_real_tokens=[0] * self.num_buckets, source_loss=[0.0] * (2 * len(self.source_names)))
        # The DP x CP group holds one TP rank, so every TP rank reduces the same global numbers;
        # pack-level counts come from CP rank 0 alone (all CP ranks see slices of the same pack).
        owns_pack = self.state.cp_rank == 0
        local_tokens = torch.zeros((), dtype=torch.int32)
        for report, pack in zip(reports, packs):
            loss_sum, num_tokens = report["lm loss"].double().cpu().tolist()
            source_loss = report["source loss"].double().cpu().tolist() if "source loss" in report else None
            counts.add_pack(loss_sum=loss_sum, target_tokens=num_tokens, real_tokens=pack.real_tokens,
                            slots=pack.slots, samples=len(pack.sample_ids), owns_pack=owns_pack, bucket=pack.bucket,
                            source_loss=source_loss)
            local_tokens += int(round(num_tokens))
        return counts, local_tokens.to(self.state.device)

    def _check_finite(self, step: int, reports: list[dict], batches: list[dict], total: StepCounts) -> None:
        from megatron_pack.training.step import check_finite

        if math.isfinite(total.loss_sum):
            return
        from megatron_pack.training.finite import check_weights

        where = f"step {step}, rank {self.state.rank}"
        check_weights(self.model, where=where, device=self.state.device,
                      source=f"the model after step {step - 1}" if step > 1 else "the model the run started from",
                      fix=("the optimizer step before diverged: resume from the last checkpoint with a lower train.lr "
                           "(or a train.clip_grad)") if step > 1 else
                          ("no step ran yet: check model.pretrained's safetensors or the checkpoint this run started "
                           "from (megatron-pack train --check names the tensor)"))
        for report, batch in zip(reports, batches):
            try:
                check_finite(report["lm loss"][0], batch)
            except FloatingPointError as exc:
                raise FloatingPointError(f"{where}: data (the weights are finite): {exc}") from None
        raise FloatingPointError(f"{where}: data (the weights are finite): the global lm loss is not finite; the "
                                 "pack that produced it is named in the error of another rank.")

    # ----- checkpoints -----------------------------------------------------------------------

    def _layout(self) -> dict:
        s = self.state
        return layout_meta(s.world_size, s.tp_size, s.cp_size, s.dp_size, s.dims.ep)

    def _meta(self) -> dict:
        """The layout plus the peft settings and base model (None for full fine-tuning)."""
        from megatron_pack.model.peft import peft_meta

        return {**self._layout(), "peft": peft_meta(self.cfg)}

    @property
    def _lora(self) -> bool:
        """peft=lora: checkpoints hold the trainable adapters only (the frozen base is re-read from
        model.pretrained, whose path ``_meta`` records)."""
        return self.cfg.peft.method != "none"

    def settings(self) -> dict[str, Any]:
        return run_settings(self.cfg, self.train_iters, self.plan_fingerprint)

    def _train_state(self) -> dict:
        """The run's position, the same on every rank: written once, in meta.json."""
        elapsed = self.history[-1].elapsed_s if self.history else self.elapsed_before_s
        return {"step": self.step, "schedule": self.schedule.state_dict(), "loader": self.loader.state_dict(),
                "consumed_samples": self.consumed_samples, "consumed_target_tokens": self.consumed_target_tokens,
                "elapsed_s": elapsed, "val_history": self.val_history}

    def _sharded_state(self, *, with_optimizer: bool) -> dict:
        from megatron_pack.training.resharding import sharded_state

        if not with_optimizer:
            return sharded_state(self.model, {}, trainable_only=self._lora)
        tensors, step = self.optimizer.checkpoint_tensors()
        return sharded_state(self.model, tensors, step, trainable_only=self._lora)

    def save(self, root: str | Path) -> Path:
        """Collectively write a checkpoint any layout can resume (see docs/training.md)."""
        sharded = self._sharded_state(with_optimizer=True)
        meta = {**self._meta(), "format": ckpt.SHARDED_FORMAT, "train_state": self._train_state(),
                "settings": self.settings()}
        # each DP rank's own loader position too (online buffers and planned steps differ per rank);
        # meta.json's copy (rank 0's) is the layout-free position used when the layout changes
        rank_state = {"rng": ckpt.rng_state(), "optimizer": self.optimizer.rank_state(),
                      "loader": self.loader.state_dict()}
        return ckpt.save_checkpoint(root, self.step, model_state={}, optim_state={}, rank_state=rank_state,
                                    meta=meta, keep_last=self.cfg.checkpoint.keep_last, sharded_state=sharded)

    def _copy_model(self, loaded: dict[str, torch.Tensor]) -> None:
        from megatron_pack.training.resharding import core_model

        with torch.no_grad():
            for name, param in core_model(self.model).named_parameters():
                if param.requires_grad or not self._lora:
                    param.copy_(loaded[f"model.{name}"])

    def load_weights(self, path: str | Path) -> None:
        """Model weights of checkpoint ``path`` (any layout); optimizer, schedule, data and step stay fresh."""
        self._copy_model(ckpt.load_sharded_checkpoint(path, self._sharded_state(with_optimizer=False)))

    def load(self, path: str | Path) -> list[str]:
        """Resume from checkpoint ``path`` written at any layout; returns the settings that changed
        (refused unless ``checkpoint.allow_changed``)."""
        meta = ckpt.read_meta(path)
        _check_resume_peft(self.cfg, Path(path), meta)
        changes = check_resume_settings(self.cfg, Path(path), self.settings())
        same_layout = all(meta.get(k) == v for k, v in self._layout().items())
        if self.optimizer.rank_state() is not None and not same_layout:
            raise ValueError(f"checkpoint {path} was written at layout {({k: meta.get(k) for k in self._layout()})} "
                             f"and megatron-core's GPU optimizer state resumes only at the same layout "
                             f"({self._layout()}); resume with that layout, or set checkpoint.load_weights_only=true.")
        sharded = self._sharded_state(with_optimizer=True)
        loaded = ckpt.load_sharded_checkpoint(path, sharded)
        self._copy_model(loaded)
        tensors, _ = self.optimizer.checkpoint_tensors()
        self.optimizer.load_checkpoint_tensors(
            {name: {key: loaded[f"optimizer.{key}.{name}"] for key in state} for name, state in tensors.items()},
            loaded.get("optimizer.step", torch.zeros(())))
        rank_state = ckpt.read_rank_state(path) if same_layout else None
        if rank_state is not None:
            self.optimizer.load_rank_state(rank_state.get("optimizer"))
            ckpt.set_rng_state(rank_state["rng"])
        train_state = dict(meta["train_state"])
        loader_state = self._rank_loader_state(path, meta, rank_state)
        if loader_state is not None:
            train_state["loader"] = loader_state
        self._load_train_state(train_state, changes)
        return changes

    def _rank_loader_state(self, path: str | Path, meta: dict, rank_state: Optional[dict]) -> Optional[dict]:
        """This DP rank's own loader state: from its rank file at the same layout; at another TP/CP
        layout with the same DP size, from the file of the old rank with this DP rank (TP and CP rank
        0; megatron-core's rank order tp-cp-ep-dp-pp). None: meta.json's (rank 0's, layout-free) is used."""
        if rank_state is not None:
            return rank_state.get("loader")
        if meta.get("data_parallel_size") != self.state.dp_size:
            return None
        old_rank = self.state.dp_rank * int(meta["tensor_model_parallel_size"]) * int(meta["context_parallel_size"])
        old = ckpt.read_rank_state(path, old_rank)
        return old.get("loader") if old is not None else None

    def _load_train_state(self, state: dict, changes: list[str]) -> None:
        self.step = int(state["step"])
        self.schedule.load_state_dict(state["schedule"])
        if any(change.split(":")[0] in DATA_SETTINGS for change in changes):
            log.warning("the data plan or train.seed changed: the data order starts over at its first pack")
        else:
            self.loader.load_state_dict(state["loader"])
        self.consumed_samples = int(state["consumed_samples"])
        self.consumed_target_tokens = int(state["consumed_target_tokens"])
        self.elapsed_before_s = float(state["elapsed_s"])
        self.val_history = [list(v) for v in state.get("val_history", [])]
        self.data_iterator = None


def build_loader(cfg: Config, state: ParallelState, dataset: PackedSFTDataset) -> BatchLoader:
    """This DP rank's loader (``megatron_pack.data.batches.loader.build_loader``) for ``state``'s ranks.
    Online packing reports each DP rank's shard accounting once (its TP/CP rank 0); the rest, rank 0.
    Online steps are decided over ``state.dp_group`` (every CP/TP rank's DP group decides the same)."""
    announce = state.rank == 0
    if cfg.packing.mode == "online":
        announce = state.tp_rank == 0 and state.cp_rank == 0
    return loader_lib.build_loader(cfg, dataset, dp_rank=state.dp_rank, dp_size=state.dp_size,
                                   pin_memory=state.device.type == "cuda", announce=announce,
                                   gather=gather_objects(state.dp_group) if state.dp_size > 1 else single_rank)


def build_trainer(cfg: Config, state: ParallelState, loader: BatchLoader, *,
                  forward_step_func: Optional[Callable] = None, validation=None) -> Trainer:
    """Model (seeded by ``train.seed``), DDP, optimizer, schedule; ``loader`` is this DP rank's
    ``protocol.BatchLoader`` of full THD packs (``begin_step()`` plans each step, ``state_dict()`` /
    ``load_state_dict()`` resume at the next one); ``validation`` is this DP rank's
    ``eval.ValidationLoader`` (or None)."""
    from megatron_pack.model.builder import build_model
    from megatron_pack.training.step import forward_step

    train_iters = resolve_train_iters(cfg, loader)
    model = build_model(cfg, state)
    if cfg.train.bf16:  # megatron-core's bf16 wrapper: casts inputs, keeps fp32 main grads
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    _log_parameter_counts(model, state)
    ddp = wrap_ddp(cfg, model, state)
    optimizer = build_optimizer(cfg, list(model.named_parameters()), state.tp_group, ddp_model=ddp,
                                device=state.device.type, dp_group=state.dp_group,
                                expert_group=state.pg_collection.tp_ep)
    info = loader.info  # the breakdowns need the same sizes on every rank
    return Trainer(cfg=cfg, state=state, model=ddp, optimizer=optimizer, schedule=LRSchedule(cfg, train_iters),
                   loader=loader, forward_step_func=forward_step_func or forward_step, train_iters=train_iters,
                   validation=validation, plan_fingerprint=info.fingerprint, num_buckets=info.num_buckets,
                   source_names=list(info.source_names))


def _log_parameter_counts(model: torch.nn.Module, state) -> None:
    """'trainable parameters: X of Y (Z%)' on rank 0 (every TP rank enters the count's all-reduce)."""
    from megatron_pack.model.peft.lora import count_parameters, describe

    trainable, total = count_parameters(model, state.tp_group)
    if state.rank == 0:
        log.info(describe(trainable, total, getattr(getattr(model, "module", model), "num_adapters", None)))


def _should_save(cfg: Config, step: int, train_iters: int) -> bool:
    c = cfg.checkpoint
    return c.enabled and (step == train_iters or (c.save_interval > 0 and step % c.save_interval == 0))


def _should_evaluate(cfg: Config, trainer: Trainer) -> bool:
    interval = cfg.train.eval_interval
    return trainer.validation is not None and (trainer.step == trainer.train_iters
                                               or (interval > 0 and trainer.step % interval == 0))


def start_or_resume(cfg: Config, trainer: Trainer) -> Optional[Path]:
    """Resume from the newest intact checkpoint (any layout; its files' checksums verified over the
    ranks, a damaged newer one passed over with a warning), or start from checkpoint.load's weights;
    returns the checkpoint read (None: a fresh start)."""
    choice = resume_choice(cfg, verify=ckpt.collective_verify())
    for line in choice.skipped:
        log.warning("%s", line)
    resume, kind = choice.path, choice.kind
    if kind == "fresh":
        return None
    if kind == "weights":
        trainer.load_weights(resume)
        log.info("started a new run from the weights of %s (fresh optimizer, schedule and data order)", resume)
        return resume
    changes = trainer.load(resume)
    for change in changes:
        log.warning("resumed with a changed setting (checkpoint.allow_changed=true): %s", change)
    # samples, not step * global_batch_size packs: token budgets and online steps vary their pack count
    log.info("resumed from %s at step %d (%d samples consumed)", resume, trainer.step, trainer.consumed_samples)
    return resume


def run_training(cfg: Config, state: ParallelState, loader: BatchLoader, *,
                 forward_step_func: Optional[Callable] = None, validation=None) -> Trainer:
    """Train to the run's last step (``train.train_iters`` or ``train.num_epochs``; or
    ``train.exit_after_iters`` steps in this process), resuming from the newest checkpoint when
    there is one, evaluating ``validation`` every ``train.eval_interval`` steps and at the end.
    Returns the trainer (its ``pack_log`` holds the sample ids of every pack this rank consumed
    in this process)."""
    from megatron_pack.training.record import write_run_record

    trainer = build_trainer(cfg, state, loader, forward_step_func=forward_step_func, validation=validation)
    save_root = save_dir(cfg)
    if cfg.model.pretrained and cfg.checkpoint.enabled and state.rank == 0:  # lets `export` read a checkpoint alone
        from megatron_pack.model.hf.export import save_hf_source

        info = loader.info  # the tokenizer and template the data was made with travel to the export
        save_hf_source(cfg.model.pretrained, save_root, tokenizer=info.tokenizer, chat_template=info.chat_template)
    loaded = start_or_resume(cfg, trainer)
    if loaded is not None or cfg.model.pretrained:  # weights read from files: every rank checks its shard
        from megatron_pack.training.finite import check_weights

        check_weights(trainer.model, where=f"rank {state.rank}", device=state.device,
                      source=f"checkpoint {loaded}" if loaded else f"model.pretrained ({cfg.model.pretrained})",
                      fix="re-download the folder" if loaded is None else "resume from an older checkpoint "
                          "(checkpoint.load=...) or start from model.pretrained")
    if state.rank == 0:
        write_run_record(cfg, state, trainer.train_iters)
    writer = MetricsWriter(cfg.train.output_dir, enabled=state.rank == 0, log_interval=cfg.logging.log_interval,
                           tensorboard=cfg.logging.tensorboard, train_iters=trainer.train_iters)
    num_run = 0
    stop = StopRequest(cfg.checkpoint.save_on_signal, state.device)
    try:
        while trainer.step < trainer.train_iters:
            metrics = trainer.train_step()
            if _should_evaluate(cfg, trainer):
                metrics.add_validation(trainer.evaluate())
            writer.write(metrics)
            if cfg.logging.log_sample_ids and state.tp_rank == 0 and state.cp_rank == 0:
                sample_log.info("step %d rank %d dp_rank %d packs %s", trainer.step, state.rank, state.dp_rank,
                                trainer.pack_log[-1])
            path = None
            if _should_save(cfg, trainer.step, trainer.train_iters):
                path = trainer.save(save_root)
                if state.rank == 0:
                    log.info("saved checkpoint %s", path)
            trainer.stopped_by = stop.agreed()  # every rank, every step: the same answer everywhere
            if trainer.stopped_by:
                if path is None and cfg.checkpoint.enabled:
                    path = trainer.save(save_root)
                trainer.stop_checkpoint = path
                break
            num_run += 1
            if cfg.train.exit_after_iters is not None and num_run >= cfg.train.exit_after_iters:
                log.info("train.exit_after_iters=%d reached at step %d; stopping", num_run, trainer.step)
                break
        if trainer.step >= trainer.train_iters and trainer.history:
            writer.write_hparams(cfg, trainer)
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
        lines += _summary_totals(records)
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


def _summary_totals(records: list[dict]) -> list[str]:
    """Total time and tokens, and the best and last validation loss, from the metrics records."""
    from megatron_pack.training.metrics import format_duration

    last = records[-1]
    lines = [f"total: {format_duration(last.get('elapsed_s') or 0.0)} training time, "
             f"{last.get('consumed_target_tokens', 0):,} target tokens, "
             f"{last.get('consumed_samples', 0):,} samples"
             + (f", {last['epoch']:.2f} epochs" if last.get("epoch") is not None else "")]
    evals = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if evals:
        best = min(evals, key=lambda e: e[1])
        lines.append(f"validation loss: best {best[1]:.4f} (step {best[0]}), last {evals[-1][1]:.4f} "
                     f"(step {evals[-1][0]})")
    return lines
