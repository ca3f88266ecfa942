"""The training loop: micro-batches -> per-token loss sums -> one normalisation -> optimizer step.

One optimizer step on every rank:

1. ``zero_grad_buffer()`` on each of this rank's model chunks (``chunks.py``: one per pipeline
   stage the rank runs; ``parallel.virtual_pipeline_model_parallel_size`` of them with virtual stages);
2. ``num_microbatches = train.global_batch_size / (dp * micro_batch_size)`` forward/backward passes,
   each on one THD row: a pack, offline or online (micro_batch_size 1), or with
   ``packing.mode=in_batch`` micro_batch_size samples packed at collate (or as many as the
   loader's ``begin_step()`` plans: a token budget, a balanced deal, online packs)
   (``forward_step``: next row, this CP rank's slice, ``PackedSeqParams``), backward on the
   pack's loss SUM. Nothing divides by the number of micro-batches, CP or DP size. On every device
   this is megatron-core's ``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved) with
   its ``P2PCommunicator`` (``schedule.forward_backward``);
3. the step outcome (``outcome.py``): on the ranks that hold the loss, one float64 all-reduce over
   DP x CP of the loss sums and token counts; then broadcast to the rest of the pipeline group,
   so every rank takes the same branch in the non-finite check that stops the run at this step;
4. ``finalize_model_grads(chunks, num_tokens=<local target tokens>)``: megatron-core sums the
   gradients over DP x CP (``average_in_collective=False``), all-reduces the token count over
   the same group and scales the gradients by ``1 / count`` exactly once (per-token loss, which
   ``validate()`` requires with packing; without it ``num_tokens`` is not passed, as in
   megatron-core's schedules);
5. clip, AdamW step at the scheduled learning rate, metrics, maybe a checkpoint
   (``trainer_checkpoint.py``: saving, resuming and the resume policy live there).

A rank whose tokens are all masked contributes a zero loss sum and zero gradients, never NaN.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_pack.config.schema import Config
from megatron_pack.data.batches import loader as loader_lib
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.batches.online import single_rank
from megatron_pack.data.batches.protocol import BatchLoader, StepInfo
from megatron_pack.model.moe import pack_routing, set_step_tokens, stage_moe_reports, step_moe_metrics
from megatron_pack.parallel.groups import ParallelState, gather_objects
from megatron_pack.training import trainer_checkpoint
from megatron_pack.training.cuda_graphs import compute_with_graphs
from megatron_pack.training.flops import device_peak_tflops, sum_sq_seqlens, throughput
from megatron_pack.training.metrics import MetricsWriter, StepCounts, StepMetrics
from megatron_pack.training.optim import LRSchedule, build_optimizer
from megatron_pack.training.outcome import StepOutcome, check_step_finite, step_outcome
from megatron_pack.training.resume import resolve_train_iters, save_dir
from megatron_pack.training.schedule import PackInfo, RecordingIterator, forward_backward
from megatron_pack.training.signals import StopRequest
from megatron_pack.training.trainer_checkpoint import start_or_resume

HISTORY_WINDOW = 1000
"""Steps ``Trainer.history`` and ``Trainer.pack_log`` keep (the newest): a long run's memory stays flat.
Every step's metrics are in ``<train.output_dir>/metrics.jsonl`` (``read_metrics``), and every pack's sample
ids in the ``logging.log_sample_ids`` lines."""


log = logging.getLogger("megatron_pack.train")
sample_log = logging.getLogger("megatron_pack.train.samples")
"""logging.log_sample_ids lines; INFO on every rank (each DP rank reads other packs), see cli/train.py."""


@dataclass
class Trainer:
    """Everything one run holds; built by :func:`build_trainer`, advanced by :meth:`train_step`."""

    cfg: Config
    state: ParallelState
    model_chunks: list[torch.nn.Module]
    """The DDP-wrapped model chunks this rank runs, in stage order (one per pipeline stage it holds: one, or
    ``parallel.virtual_pipeline_model_parallel_size`` with virtual stages)."""
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
    pack_log: deque[list[list[int]]] = field(default_factory=lambda: deque(maxlen=HISTORY_WINDOW))
    """Sample ids of the packs this rank consumed, per step: the last ``HISTORY_WINDOW`` steps of this process
    (all of them: ``logging.log_sample_ids``)."""
    history: deque[StepMetrics] = field(default_factory=lambda: deque(maxlen=HISTORY_WINDOW))
    """Metrics of the last ``HISTORY_WINDOW`` steps run in this process (every step: metrics.jsonl)."""
    outcome: Optional[StepOutcome] = None
    """The last step's outcome, the same on every rank (its ``reports`` carry any extra loss reports)."""
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
    peak_tflops: Optional[float] = None
    """The device's peak for MFU (``flops.device_peak_tflops``: train.peak_tflops or the GPU's); None: no MFU."""
    cuda_graphs: Optional[Any] = None  # model.cuda_graph_impl's capture (training/cuda_graphs.py), made at step 1
    _start: float = field(default_factory=time.perf_counter)
    _first_step: int = 0

    @property
    def model(self) -> torch.nn.Module:
        """The (first) DDP-wrapped model chunk this rank runs."""
        return self.model_chunks[0]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on this DP rank: global_batch_size / (dp * micro_batch_size). Each is one
        THD row: a pack (offline, micro_batch_size 1) or micro_batch_size samples packed at collate."""
        return self.cfg.train.global_batch_size // (self.state.dp_size * self.cfg.train.micro_batch_size)

    @property
    def seq_length(self) -> int:
        """Tokens of a pack, which the pipeline stages exchange without a shape header when every pack has
        that length (``model.builder.fixed_pack_shapes``; otherwise the shapes travel with the activations)."""
        return self.cfg.packing.packed_sequence_size

    def compute_gradients(self) -> tuple[StepCounts, list[PackInfo]]:
        """Forward/backward over this step's micro-batches, the step outcome every rank agrees on, the
        loss check, and ``finalize_model_grads``: afterwards ``param.main_grad`` holds the gradient of
        the token-weighted mean loss of the global batch. Returns the global counts and this rank's packs."""
        if self.data_iterator is None:
            self.data_iterator = RecordingIterator(self.loader)
        self.step_info = self.loader.begin_step()
        num_microbatches = self.step_info.num_microbatches
        if num_microbatches is None:  # a loader that plans nothing (BatchList): the config's fixed count
            num_microbatches = self.num_microbatches
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        # a MoE model's auxiliary losses are per real token of the global batch: counted before the forward
        if pack_routing(self.model) is not None:
            set_step_tokens(self.model_chunks, self.data_iterator.peek(num_microbatches), self.state.dp_group)
        reports = forward_backward(forward_step_func=self.forward_step_func, data_iterator=self.data_iterator,
                                   model_chunks=self.model_chunks, num_microbatches=num_microbatches,
                                   state=self.state, seq_length=self.seq_length)
        packs, batches = self.data_iterator.take()
        self.outcome = step_outcome(reports, packs, self.state, num_buckets=self.num_buckets,
                                    num_sources=len(self.source_names),
                                    sum_sq=[sum_sq_seqlens(b["cu_seqlens"]) for b in batches],
                                    stage_reports=stage_moe_reports(self.model_chunks))
        # each stage's MoE layers rode its one all-reduce and the exchange between the stages
        self.moe_metrics = step_moe_metrics(self.outcome.reports, self.outcome.counts.real_tokens,
                                            self.cfg.model.num_experts)
        check_step_finite(self.outcome, step=self.step + 1, model_chunks=self.model_chunks, reports=reports,
                          batches=batches, state=self.state)
        from megatron.core.distributed import finalize_model_grads

        # as megatron-core's schedules: the 1/global-token scaling belongs to per-token loss only
        # (without it DDP already averages over DP x CP and each micro-batch loss is a mean)
        per_token = self.model.config.calculate_per_token_loss
        finalize_model_grads(self.model_chunks, num_tokens=self.outcome.num_tokens(self.state.device) if per_token
                             else None, pg_collection=self.state.pg_collection)
        return self.outcome.counts, packs

    def train_step(self) -> StepMetrics:
        """One optimizer step (see the module docstring); returns its global metrics."""
        start = time.perf_counter()
        if not self.history:
            self._start, self._first_step = start, self.step
        total, packs = compute_with_graphs(self)  # self.compute_gradients(), CUDA graphs captured around it
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
        tflops, mfu = throughput(self.cfg.model, real_tokens=total.real_tokens, sum_sq=total.sum_sq_seqlens,
                                 step_time_s=now - start, world_size=self.state.world_size,
                                 peak_tflops=self.peak_tflops)
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
                              source_target_share=source_share, moe=self.moe_metrics,
                              model_tflops_per_device=tflops, mfu=mfu)
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

        if self.state.rank == 0:  # a few seconds to minutes without output otherwise: say what runs
            log.info("validation at step %d: %d pack(s) over %d data-parallel rank(s)", self.step,
                     self.validation.packs_per_epoch, self.state.dp_size)
        schedule = partial(forward_backward, state=self.state, seq_length=self.seq_length)
        result = evaluate(self.model_chunks, self.validation, forward_step_func=self.forward_step_func,
                          group=self.state.dp_cp_group, num_packs=self.validation.packs_per_epoch,
                          source_names=self.validation.info.source_names, schedule=schedule,
                          pp_group=self.state.pp_group, progress=self.state.rank == 0)
        self.val_history.append([self.step, result.loss])
        return result


    # ----- checkpoints (trainer_checkpoint.py) --------------------------------------------------

    def save(self, root: str | Path) -> Path:
        """Collectively write a checkpoint any layout can resume (see docs/training.md)."""
        return trainer_checkpoint.save_trainer(self, root)

    def load_weights(self, path: str | Path) -> None:
        """Model weights of checkpoint ``path`` (any layout); optimizer, schedule, data and step stay fresh."""
        trainer_checkpoint.load_trainer_weights(self, path)

    def load(self, path: str | Path) -> list[str]:
        """Resume from checkpoint ``path`` written at any layout; returns the settings that changed
        (refused unless ``checkpoint.allow_changed``)."""
        return trainer_checkpoint.load_trainer(self, path)


def build_loader(cfg: Config, state: ParallelState, dataset: PackedSFTDataset) -> BatchLoader:
    """This DP rank's loader (``megatron_pack.data.batches.loader.build_loader``) for ``state``'s ranks.
    Online packing reports each DP rank's shard accounting once (its TP/CP rank 0); the rest, rank 0.
    Online steps are decided over ``state.dp_group`` (every CP/TP rank's DP group decides the same)."""
    announce = state.rank == 0
    if cfg.packing.mode == "online":
        announce = state.tp_rank == 0 and state.cp_rank == 0 and state.pp_rank == 0  # every stage reads the same packs
    return loader_lib.build_loader(cfg, dataset, dp_rank=state.dp_rank, dp_size=state.dp_size,
                                   pin_memory=state.device.type == "cuda", announce=announce,
                                   gather=gather_objects(state.dp_group) if state.dp_size > 1 else single_rank)


def build_trainer(cfg: Config, state: ParallelState, loader: BatchLoader, *,
                  forward_step_func: Optional[Callable] = None, validation=None) -> Trainer:
    """Model chunks (seeded by ``train.seed``, wrapped in DDP: ``chunks.build_model_chunks``), optimizer,
    schedule; ``loader`` is this DP rank's ``protocol.BatchLoader`` of full THD packs (``begin_step()``
    plans each step, ``state_dict()`` / ``load_state_dict()`` resume at the next one); ``validation``
    is this DP rank's ``eval.ValidationLoader`` (or None)."""
    from megatron_pack.training.chunks import build_model_chunks
    from megatron_pack.training.determinism import apply_determinism
    from megatron_pack.training.step import forward_step

    train_iters = resolve_train_iters(cfg, loader)
    apply_determinism(cfg.train.deterministic, cfg.train.seed, state.device)  # before the model is built
    chunks = build_model_chunks(cfg, state)
    # one optimizer over every chunk's parameters: one gradient norm, clipped once, one AdamW step
    optimizer = build_optimizer(cfg, chunks)
    info = loader.info  # the breakdowns need the same sizes on every rank
    return Trainer(cfg=cfg, state=state, model_chunks=chunks, optimizer=optimizer,
                   schedule=LRSchedule(cfg, train_iters), loader=loader,
                   forward_step_func=forward_step_func or forward_step, train_iters=train_iters,
                   validation=validation, plan_fingerprint=info.fingerprint, num_buckets=info.num_buckets,
                   source_names=list(info.source_names),
                   peak_tflops=device_peak_tflops(state.device, cfg.train.peak_tflops))


def _should_evaluate(cfg: Config, trainer: Trainer) -> bool:
    interval = cfg.train.eval_interval
    return trainer.validation is not None and (trainer.step == trainer.train_iters
                                               or (interval > 0 and trainer.step % interval == 0))


def run_training(cfg: Config, state: ParallelState, loader: BatchLoader, *,
                 forward_step_func: Optional[Callable] = None, validation=None) -> Trainer:
    """Train to the run's last step (``train.train_iters`` or ``train.num_epochs``; or
    ``train.exit_after_iters`` steps in this process), resuming from the newest checkpoint when
    there is one, evaluating ``validation`` every ``train.eval_interval`` steps and at the end.
    Returns the trainer (its ``pack_log`` holds the sample ids of the packs this rank consumed in the
    last ``HISTORY_WINDOW`` steps of this process)."""
    from megatron_pack.training.record import write_run_record

    trainer = build_trainer(cfg, state, loader, forward_step_func=forward_step_func, validation=validation)
    save_root = save_dir(cfg)
    if cfg.model.pretrained and cfg.checkpoint.enabled and state.rank == 0:  # lets `export` read a checkpoint alone
        from megatron_pack.model.hf.export import save_hf_source

        info = loader.info  # the tokenizer and template the data was made with travel to the export
        save_hf_source(cfg.model.pretrained, save_root, tokenizer=info.tokenizer, chat_template=info.chat_template,
                       vocab_size=cfg.model.vocab_size if cfg.model.resize_vocab else None)
    loaded = start_or_resume(cfg, trainer)
    if loaded is not None or cfg.model.pretrained:  # weights read from files: every rank checks its shard
        from megatron_pack.training.finite import check_weights

        check_weights(trainer.model_chunks, where=f"rank {state.rank}", device=state.device,
                      source=f"checkpoint {loaded}" if loaded else f"model.pretrained ({cfg.model.pretrained})",
                      fix="re-download the folder" if loaded is None else "resume from an older checkpoint "
                          "(checkpoint.load=...) or start from model.pretrained")
    if state.rank == 0:
        write_run_record(cfg, state, trainer.train_iters)
    from megatron_pack.training.trackers import open_trackers

    writer = MetricsWriter(cfg.train.output_dir, enabled=state.rank == 0, log_interval=cfg.logging.log_interval,
                           tensorboard=cfg.logging.tensorboard, train_iters=trainer.train_iters,
                           resume_step=trainer.step,  # the steps after it are replayed: their old records move aside
                           trackers=open_trackers(cfg, enabled=state.rank == 0, start_step=trainer.step))
    num_run = 0
    stop = StopRequest(cfg.checkpoint.save_on_signal, state.device)
    try:
        while trainer.step < trainer.train_iters:
            metrics = trainer.train_step()
            if _should_evaluate(cfg, trainer):
                metrics.add_validation(trainer.evaluate())
            writer.write(metrics)
            if cfg.logging.log_sample_ids and state.tp_rank == 0 and state.cp_rank == 0 and state.pp_rank == 0:
                sample_log.info("step %d rank %d dp_rank %d packs %s", trainer.step, state.rank, state.dp_rank,
                                trainer.pack_log[-1])
            path = None
            if trainer_checkpoint.should_save(cfg, trainer.step, trainer.train_iters):
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
