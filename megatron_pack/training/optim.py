"""The optimizer and the learning-rate schedule: megatron-core's optimizer on every device.

:class:`TrainOptimizer` is ``get_megatron_optimizer`` (Adam with decoupled weight decay; with
``ddp.use_distributed_optimizer`` its ``DistributedOptimizer``, the state and update sharded over DP and a MoE
model's experts over expert-DP; with ``train.bf16`` fp32 main params and grads beside the bf16 weights) over
the DDP-wrapped model chunks. It reads the gradients megatron-core's ``DistributedDataParallel`` leaves in
``main_grad`` (summed over DP x CP and scaled once by ``1 / global target tokens`` in
``finalize_model_grads``), computes the TP/PP/EP-aware gradient norm, clips and steps. A GPU runs its fused
kernels; a CPU runs it under ``model/cpu_compat.py`` (item 9) with torch's AdamW inside.

Weight decay: megatron-core's standard groups (``wd_mult`` 0 on biases and every 1-D parameter: norms);
:meth:`TrainOptimizer.step` sets each group's ``weight_decay`` and ``lr`` from the schedule and the group's
``wd_mult`` / ``lr_mult``, as megatron-core's own ``OptimizerParamScheduler`` does.

A checkpoint stores :meth:`TrainOptimizer.checkpoint_tensors`: per model parameter (keyed by its name in the
core model) ``exp_avg``, ``exp_avg_sq`` and, when the weights are 16-bit, ``fp32_param`` (the main param),
each shaped like this rank's parameter shard, plus the step count. A distributed optimizer's shards of them
are gathered over its data-parallel group first (the ``fully_reshardable`` exchange of megatron-core 0.16.1,
whose ``fully_sharded_model_space`` format needs the ``flattened_range`` it no longer supports), so
``training/resharding.py`` writes them by global identity beside the weights and any layout, with the
distributed optimizer on or off, resumes them (:meth:`TrainOptimizer.load_checkpoint_tensors` slices this
rank's part back out).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_pack.config.schema import Config
from megatron_pack.parallel.comm import all_reduce


def lr_at(step: int, *, lr: float, min_lr: float, warmup_iters: int, train_iters: int,
          decay_style: str = "cosine") -> float:
    """Learning rate for optimizer step ``step`` (1-based: the first step is 1).

    Linear warmup from ``lr / warmup_iters`` to ``lr`` over steps 1..warmup_iters, then decay to
    ``min_lr`` at step ``train_iters``. With lr=1.0, min_lr=0.0, warmup_iters=2, train_iters=4,
    cosine: step 1 -> 0.5, step 2 -> 1.0, step 3 -> 0.5 (cos at half way), step 4 -> 0.0.
    Steps past ``train_iters`` stay at ``min_lr``.
    """
    if step < 1:
        raise ValueError(f"lr_at: step ({step}) must be >= 1 (optimizer steps are 1-based).")
    if warmup_iters > 0 and step <= warmup_iters:
        return lr * step / warmup_iters
    if decay_style == "constant":
        return lr
    num_decay = train_iters - warmup_iters
    progress = 1.0 if num_decay <= 0 else min(1.0, (step - warmup_iters) / num_decay)
    if decay_style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay_style == "linear":
        return lr - (lr - min_lr) * progress
    raise ValueError(f"train.lr_decay_style ({decay_style!r}) must be 'cosine', 'linear' or 'constant'.")


class LRSchedule:
    """Warmup + decay schedule over optimizer steps; its state is the number of steps taken."""

    def __init__(self, cfg: Config, train_iters: Optional[int] = None):
        """``train_iters``: the run's steps when derived from train.num_epochs (default train.train_iters)."""
        t = cfg.train
        self._kwargs = dict(lr=t.lr, min_lr=t.min_lr, warmup_iters=t.lr_warmup_iters,
                            train_iters=train_iters or t.train_iters, decay_style=t.lr_decay_style)
        self.num_steps = 0

    def next_lr(self) -> float:
        """Advance one optimizer step and return its learning rate."""
        self.num_steps += 1
        return lr_at(self.num_steps, **self._kwargs)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **self._kwargs}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])


class TrainOptimizer:
    """megatron-core's optimizer (``get_megatron_optimizer``) over this rank's DDP-wrapped model chunks, with the
    checkpoint view of its state by parameter name (see the module docstring)."""

    def __init__(self, cfg: Config, model_chunks: list[torch.nn.Module]):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from megatron_pack.training.chunks import chunk_prefix, core_model

        t = cfg.train
        # 16-bit weights (train.bf16, or bfloat16 parameters without the bf16 wrapper) step through fp32 main params
        bf16 = t.bf16 or cfg.model.params_dtype == "bfloat16"
        config = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, bf16=bf16,
            # clip_grad <= 0 clips nothing, yet the norm is still reported (megatron-core skips it at 0)
            clip_grad=t.clip_grad if t.clip_grad > 0 else math.inf,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=cfg.ddp.use_distributed_optimizer)
        # the model's own groups (``initialize_parallel``'s collection: megatron-core's gloo groups are not
        # created, create_gloo_process_groups=False), and no gloo copies of them: megatron-core's default
        # use_gloo_process_groups=True reads parallel_state's gloo groups and stops at "Intra partial data
        # parallel group is not initialized"
        pg = core_model(model_chunks[0]).pg_collection
        self.optimizer = get_megatron_optimizer(config, model_chunks, use_gloo_process_groups=False,
                                                pg_collection=pg)
        for part in self.parts:
            if part.param_groups and all(g.get("is_expert_parallel") for g in part.param_groups):
                # megatron-core 0.16.1 gives every part the dense TP group for the norm's "duplicate across TP"
                # test; an expert's copies are across expert TP. With TP 2 and expert TP 1 the second TP rank's
                # experts (and their LoRA adapters) left the clipping norm (measured 5.4e-4 low)
                part.tp_group = pg.expt_tp
        self.weight_decay = t.weight_decay
        self.names = {p: chunk_prefix(v, len(model_chunks)) + n for v, chunk in enumerate(model_chunks)
                      for n, p in core_model(chunk).named_parameters()}
        self.num_steps = 0

    @property
    def parts(self) -> list:
        """megatron-core's optimizers under the chain (dense and experts: one each)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def step(self, lr: float) -> float:
        """Clip (TP/PP/EP-aware norm of ``main_grad``), step at ``lr``, clear; returns the pre-clip norm."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)
        _, norm, _ = self.optimizer.step()
        self.optimizer.zero_grad()  # drop grad aliases of main_grad before the next backward
        self.num_steps += 1
        return float(norm) if norm is not None else 0.0

    def _main_params(self, part) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model param, the main param the inner optimizer steps for it) of a plain (not distributed) part."""
        if hasattr(part, "float16_groups"):  # bf16: fp32 copies of the 16-bit params, fp32 params as they are
            pairs = [pair for model, main in zip(part.float16_groups, part.fp32_from_float16_groups)
                     for pair in zip(model, main)]
            return pairs + [(p, p) for group in part.fp32_from_fp32_groups for p in group]
        return [(p, p) for group in part.optimizer.param_groups for p in group["params"]]

    def _keys(self, param: torch.nn.Parameter) -> tuple[str, ...]:
        """The state a checkpoint keeps for ``param``: the moments, and the fp32 main param of a 16-bit one."""
        return OPTIM_KEYS + (("fp32_param",) if param.dtype != torch.float32 else ())

    def checkpoint_tensors(self) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
        """``({param name: {"exp_avg": t, "exp_avg_sq": t[, "fp32_param": t]}}, step)``, each tensor fp32 and
        shaped like this rank's parameter shard (zeros before the first step). A distributed part's shards are
        gathered over its data-parallel group: every rank of it enters the collective."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for part in self.parts:
            if _distributed(part):
                out.update(self._gathered(part))
                continue
            for model, main in self._main_params(part):
                state = part.optimizer.state.get(main) or {}
                values = {k: state[k] if k in state else torch.zeros_like(main, dtype=torch.float32)
                          for k in OPTIM_KEYS}
                if "fp32_param" in self._keys(model):
                    values["fp32_param"] = main
                out[self.names[model]] = {k: v.detach().float().view(model.shape) for k, v in values.items()}
        return out, torch.tensor(float(self.num_steps))

    def _gathered(self, part) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter of a distributed part, whole (as this TP rank holds it): this DP rank fills the
        ranges it owns of one flat buffer per state, zeros elsewhere, and a sum over the part's data-parallel
        group (each element owned by exactly one rank, so the sum is exact) completes it."""
        params = [p for buffer in part.buffers for p in buffer.param_index_map]
        keys = self._keys(params[0]) if params else OPTIM_KEYS
        offsets, total = [], 0
        for param in params:
            offsets.append(total)
            total += param.numel()
        flat = {k: torch.zeros(total, dtype=torch.float32, device=params[0].device if params else "cpu")
                for k in keys}
        for param, offset in zip(params, offsets):
            if param not in part.model_param_group_index_map:
                continue  # no range of it on this rank
            rng = part._get_model_param_range_map(param)["param"]
            mine = part._get_main_param_and_optimizer_states(param)
            for key in keys:
                value = mine.get("param" if key == "fp32_param" else key)
                if value is not None:
                    flat[key][offset + rng.start:offset + rng.end] = value.detach().reshape(-1)
        for key in keys:
            all_reduce(flat[key], group=part.data_parallel_group)
        return {self.names[p]: {k: flat[k][o:o + p.numel()].view(p.shape) for k in keys}
                for p, o in zip(params, offsets)}

    def load_checkpoint_tensors(self, tensors: dict[str, dict[str, torch.Tensor]], step: torch.Tensor) -> None:
        """Restore state read from a checkpoint (whole per parameter, as :meth:`checkpoint_tensors` gives it;
        ``fp32_param`` may be absent: the main params then start from the model's weights)."""
        self.num_steps = int(float(step))
        self._materialize()
        with torch.no_grad():  # a main param may be a view of the model's parameter
            self._load(tensors)

    def _load(self, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        for part in self.parts:
            if _distributed(part):
                for param in part.model_param_group_index_map:
                    rng = part._get_model_param_range_map(param)["param"]
                    saved = tensors[self.names[param]]
                    main = saved.get("fp32_param", param.detach().float())
                    src = {k: saved[k].reshape(-1)[rng.start:rng.end] for k in OPTIM_KEYS}
                    src["param"] = main.reshape(-1)[rng.start:rng.end]
                    src["step"] = torch.tensor(float(self.num_steps))
                    part._set_main_param_and_optimizer_states(param, src)
                continue
            for model, main in self._main_params(part):
                saved = tensors[self.names[model]]
                state = part.optimizer.state[main]
                for key in OPTIM_KEYS:
                    state[key].copy_(saved[key].view_as(state[key]))
                if main is not model:
                    main.copy_(saved.get("fp32_param", model.detach().float()).view_as(main))

    def _materialize(self) -> None:
        """State for every main param (zero moments where none yet) at step ``num_steps``."""
        for part in self.parts:
            inner = part.optimizer
            if _fused(inner):  # Transformer Engine's / apex's fused Adam: its own init, steps counted per group
                part.init_state_fn(inner, part.config)
                for group in inner.param_groups:
                    group["step"] = self.num_steps
                continue
            for group in inner.param_groups:
                for param in group["params"]:
                    state = inner.state[param]
                    for key in OPTIM_KEYS:
                        if key not in state:
                            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["step"] = torch.tensor(float(self.num_steps))

    @property
    def states(self) -> list[dict]:
        """The inner optimizers' per-main-param state dicts (Adam's moments and step), every part's."""
        return [state for part in self.parts for state in part.optimizer.state.values()]

    @property
    def num_state_elements(self) -> int:
        """Adam-moment elements held by this rank (its shard of them with the distributed optimizer; for memory
        reports: fp32 main copies of 16-bit weights are not counted)."""
        return sum(t.numel() for state in self.states for t in state.values() if torch.is_tensor(t) and t.dim() > 0)


OPTIM_KEYS = ("exp_avg", "exp_avg_sq")
"""Adam's per-parameter moments (the step count is one scalar, kept once)."""


def _distributed(part) -> bool:
    return hasattr(part, "model_param_group_index_map")


def _fused(inner) -> bool:
    """Transformer Engine's or apex's fused Adam (a GPU): step counts live in the param groups."""
    return not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def build_optimizer(cfg: Config, model_chunks: list[torch.nn.Module]) -> TrainOptimizer:
    """megatron-core's optimizer (its distributed optimizer with ``ddp.use_distributed_optimizer``) over this
    rank's DDP-wrapped model chunks, on every device."""
    return TrainOptimizer(cfg, list(model_chunks))
