"""``model.cuda_graph_impl`` in the training loop: megatron-core's CUDA graphs, captured, or a refusal.

* ``transformer_engine``: megatron-core's ``TECudaGraphHelper`` (TE's ``make_graphed_callables``) is made for the
  trainer's model chunks and captures every graphable layer before step ``cuda_graph_warmup_steps + 1`` of this
  process (megatron-core's ``TransformerConfig.cuda_graph_warmup_steps``, 3: the steps before run eagerly, as in
  megatron-core's own training loop); the layers replay their graphs from then on. ``validate()`` admits it only for
  ``model.cuda_graph_scope=[mlp]`` with ``train.bf16`` (``config/validate.py``: megatron-core 0.16.1 captures TE
  graphs without ``packed_seq_params`` and with bf16 inputs).
* ``local``: megatron-core's ``CudaGraphManager`` on every layer (made with the model) records the layers during
  the first step and megatron-core's schedule creates the graphs at its end; the step's ``PackedSeqParams`` are
  fixed-shape (``training.step.step_packed_seq_params``), so every later step replays them.

Either way, a step after which the graphs should exist and do not stops the run (``after_step``): a graph impl
that validated never runs eagerly unnoticed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


def compute_with_graphs(trainer) -> tuple:
    """``trainer.compute_gradients()`` with ``model.cuda_graph_impl``'s capture around it (made at the first step
    and kept on ``trainer.cuda_graphs``); without a graph impl, the step alone."""
    if trainer.cfg.model.cuda_graph_impl == "none":
        return trainer.compute_gradients()
    if trainer.cuda_graphs is None:
        trainer.cuda_graphs = CudaGraphs.for_trainer(trainer.cfg, trainer.model_chunks, trainer.state.dp_size)
    trainer.cuda_graphs.before_step()
    result = trainer.compute_gradients()
    trainer.cuda_graphs.after_step()
    return result


class CudaGraphs:
    """The capture of one trainer's model chunks (one per process: graphs belong to the process that made them)."""

    def __init__(self, impl: str, chunks: list, config: Any, *, seq_length: int, dp_size: int,
                 make_helper: Optional[Callable[..., Any]] = None):
        self.impl = impl
        self.chunks = chunks
        self.config = config
        self.seq_length = seq_length
        self.dp_size = dp_size
        self.warmup_steps = int(getattr(config, "cuda_graph_warmup_steps", 3)) if impl == "transformer_engine" else 0
        """Eager steps of this process before the capture (TE: megatron-core's default 3; local: records in step 1)."""
        self.steps_run = 0
        self.helper = None
        if impl == "transformer_engine":
            if make_helper is None:
                from megatron.core.transformer.cuda_graphs import TECudaGraphHelper as make_helper
            # micro_batch_size 1: one THD row per micro-batch; the helper's capture inputs are [T/CP(/TP), 1, H]
            self.helper = make_helper(model=chunks, config=config, seq_length=seq_length, micro_batch_size=1,
                                      optimizers=[])

    @classmethod
    def for_trainer(cls, cfg, chunks: list, dp_size: int) -> Optional["CudaGraphs"]:
        """The capture ``model.cuda_graph_impl`` asks for (None for ``none``)."""
        if cfg.model.cuda_graph_impl == "none":
            return None
        from megatron_pack.training.chunks import core_model

        return cls(cfg.model.cuda_graph_impl, chunks, core_model(chunks[0]).config,
                   seq_length=cfg.packing.packed_sequence_size, dp_size=dp_size)

    @property
    def captured(self) -> bool:
        """The graphs exist (TE: the helper's; local: megatron-core's global record of created graphs)."""
        if self.helper is not None:
            return bool(self.helper.graphs_created())
        from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

        return bool(_CudagraphGlobalRecord.cudagraph_created)

    def before_step(self) -> None:
        """TE: capture once this process has run its eager warm-up steps."""
        if self.helper is None or self.captured or self.steps_run < self.warmup_steps:
            return
        with _num_microbatches_known(self.dp_size):
            self.helper.create_cudagraphs()
        if any(getattr(chunk, "use_forward_hook", False) for chunk in self.chunks):
            # DDP's parameter all-gather hooks are not captured: the layers call them before each replay
            self.helper.cuda_graph_set_manual_hooks()

    def after_step(self) -> None:
        """Count the step; a step after which the graphs should exist and do not stops the run."""
        self.steps_run += 1
        if self.steps_run > self.warmup_steps and not self.captured:
            raise RuntimeError(f"model.cuda_graph_impl ({self.impl}) captured no CUDA graph by step {self.steps_run} "
                               "of this process (no graphable layer in model.cuda_graph_scope?); set "
                               "model.cuda_graph_impl=none, or report this with the model config.")


class _num_microbatches_known:
    """megatron-core's TE capture reads its global micro-batch count (only to size its warm-up): set one for the
    capture when nothing else has (each THD row is one micro-batch; the count itself does not reach the graphs)."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self.set_here = False

    def __enter__(self):
        from megatron.core import num_microbatches_calculator as calc

        if calc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
            calc.init_num_microbatches_calculator(0, None, self.dp_size, 1, self.dp_size)
            self.set_here = True
        return self

    def __exit__(self, *exc):
        if self.set_here:
            from megatron.core import num_microbatches_calculator as calc

            calc.unset_num_microbatches_calculator()
        return False
