"""Optimizer, learning-rate schedule and gradient clipping.

On CPU the optimizer is ``torch.optim.AdamW`` over the gradients megatron-core's
``DistributedDataParallel`` leaves in ``param.main_grad`` (already summed over DP x CP and
scaled once by ``1 / global target tokens`` in ``finalize_model_grads``): :class:`TrainOptimizer`,
or with ``ddp.use_distributed_optimizer`` :class:`ShardedTrainOptimizer` (the same AdamW, its state
and update sharded over DP; a MoE model's experts over expert-DP). On GPU it is megatron-core's optimizer (``get_megatron_optimizer``),
which reads ``main_grad`` itself: :class:`MegatronTrainOptimizer`.

All three answer ``step(lr) -> grad_norm`` (clip, step at ``lr``, clear the gradients). A
checkpoint stores ``checkpoint_tensors()``: on CPU the AdamW moments shaped like this rank's
parameter shards (gathered over DP when sharded), keyed by parameter name, which
``training/resharding.py`` writes by global identity with the parameters (any layout resumes
them); and ``rank_state()``: on GPU megatron-core's whole per-rank state (its
``checkpoint_tensors()`` is empty; the same layout resumes it), None on CPU.

The gradient norm counts every parameter once across tensor-parallel ranks: a TP-sharded weight
contributes each rank's shard, a replicated one (a norm, a bias of a row-parallel layer) only
from TP rank 0; the squared sums are then all-reduced over the TP group. That matches
megatron-core's ``get_grad_norm_fp32``, without its CUDA-only kernels.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from megatron_pack.config.schema import Config
from megatron_pack.parallel.comm import all_gather_into_tensor, all_reduce


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


def _no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norm weights (every 1-D parameter) are not decayed."""
    return param.dim() <= 1 or name.endswith(".bias")


def param_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices and non-decayed 1-D parameters (names kept for checkpoints)."""
    decay, no_decay = ([], []), ([], [])
    for name, param in named_params:
        if not param.requires_grad:
            continue
        names, params = no_decay if _no_weight_decay(name, param) else decay
        names.append(name)
        params.append(param)
    groups = [{"params": decay[1], "names": decay[0], "weight_decay": weight_decay},
              {"params": no_decay[1], "names": no_decay[0], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _counts_for_norm(param: torch.nn.Parameter, tp_group: Optional[dist.ProcessGroup]) -> bool:
    """True when this rank's copy of ``param`` belongs in the global norm (once per TP group)."""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    return tp_group is None or dist.get_rank(tp_group) == 0


def _expert_parallel(param: torch.nn.Parameter) -> bool:
    """megatron-core marks the experts' weights of an expert-parallel MoE layer ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def grad_norm(params: Iterable[torch.nn.Parameter], tp_group: Optional[dist.ProcessGroup] = None,
              pp_group: Optional[dist.ProcessGroup] = None, *,
              expert_group: Optional[dist.ProcessGroup] = None) -> float:
    """Global L2 norm of ``param.grad`` over the model, counting each parameter once across TP and
    summing the stages of ``pp_group`` (a tied embedding's last-stage copy, ``shared``, is left out).

    With expert parallelism the experts' weights differ from rank to rank of ``expert_group``
    (megatron-core's ``tp_ep``: the EP x expert-TP ranks, each holding its own experts or shards of them),
    so their squares are summed over that group instead (every rank enters every all-reduce)."""
    dense, experts = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for param in params:
        if param.grad is None:
            continue
        if expert_group is not None and _expert_parallel(param):
            experts += param.grad.detach().double().pow(2).sum().cpu()
        elif _counts_for_norm(param, tp_group):
            dense += param.grad.detach().double().pow(2).sum().cpu()
    if tp_group is not None:
        all_reduce(dense, group=tp_group)
    if expert_group is not None:
        all_reduce(experts, group=expert_group)
    total = dense + experts
    if pp_group is not None:
        all_reduce(total, group=pp_group)
    return float(total.sqrt())


def clip_grads_(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float) -> float:
    """Scale gradients in place so their global norm is at most ``max_norm``; returns the factor."""
    if max_norm <= 0 or not math.isfinite(total_norm) or total_norm <= max_norm:
        return 1.0
    factor = max_norm / (total_norm + 1e-6)
    for param in params:
        if param.grad is not None:
            param.grad.mul_(factor)
    return factor


class TrainOptimizer:
    """torch AdamW over ``main_grad`` (CPU path); see the module docstring."""

    def __init__(self, cfg: Config, named_params: list[tuple[str, torch.nn.Parameter]],
                 tp_group: Optional[dist.ProcessGroup] = None, pp_group: Optional[dist.ProcessGroup] = None,
                 expert_group: Optional[dist.ProcessGroup] = None):
        t = cfg.train
        self.clip_grad = t.clip_grad
        self.tp_group, self.pp_group, self.expert_group = tp_group, pp_group, expert_group
        self.params = [p for _, p in named_params if p.requires_grad]
        self.names = {p: n for n, p in named_params}
        self.optimizer = torch.optim.AdamW(param_groups(named_params, t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                           foreach=False)

    def step(self, lr: float) -> float:
        """Move ``main_grad`` into ``grad``, clip, step at ``lr``, clear; returns the pre-clip norm."""
        for param in self.params:
            main_grad = getattr(param, "main_grad", None)
            param.grad = main_grad if main_grad is not None else param.grad
        norm = grad_norm(self.params, self.tp_group, self.pp_group, expert_group=self.expert_group)
        clip_grads_(self.params, self.clip_grad, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        # Drop the alias to main_grad: autograd would otherwise accumulate into it a second time.
        for param in self.params:
            param.grad = None
        return norm

    def named_state(self, *, materialize: bool = False) -> dict[str, torch.Tensor]:
        """AdamW state as ``{"<param name>.<exp_avg|exp_avg_sq|step>": tensor}``.

        ``materialize`` creates zero state for parameters that have not stepped yet, so a
        checkpoint can be loaded in place into it.
        """
        out = {}
        for param in self.params:
            state = self.optimizer.state[param]
            if materialize and not state:
                state.update(step=torch.zeros((), dtype=torch.float32),
                             exp_avg=torch.zeros_like(param, memory_format=torch.preserve_format),
                             exp_avg_sq=torch.zeros_like(param, memory_format=torch.preserve_format))
            for key, value in state.items():
                out[f"{self.names[param]}.{key}"] = value
        return out

    def rank_state(self) -> Optional[dict]:
        """Per-rank optimizer state outside ``named_state`` (none: AdamW's state is all in it)."""
        return None

    def load_rank_state(self, state: Optional[dict]) -> None:
        return None

    def checkpoint_tensors(self) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
        """``({param name: {"exp_avg": t, "exp_avg_sq": t}}, step)`` shaped like this rank's parameter
        shards (zeros before the first step): what a checkpoint stores, resharded by parameter."""
        self.named_state(materialize=True)
        tensors = {self.names[p]: {k: self.optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq")}
                   for p in self.params}
        return tensors, _step_of(self.optimizer.state[self.params[0]]["step"])

    def load_checkpoint_tensors(self, tensors: dict[str, dict[str, torch.Tensor]], step: torch.Tensor) -> None:
        """Copy state read from a checkpoint (same shapes as :meth:`checkpoint_tensors`)."""
        self.named_state(materialize=True)
        for param in self.params:
            state = self.optimizer.state[param]
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(tensors[self.names[param]][key])
            state["step"].fill_(float(step))

    @property
    def num_state_elements(self) -> int:
        """Optimizer-state elements held by this rank (for memory reports)."""
        return sum(t.numel() for t in self.named_state().values() if t.dim() > 0)

    def load_named_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy tensors produced by ``named_state`` back into the optimizer state."""
        current = self.named_state(materialize=True)
        missing = sorted(set(current) - set(state))
        if missing:
            raise KeyError(f"optimizer state is missing {len(missing)} entries, e.g. {missing[:3]}; "
                           "the checkpoint was written for another model (check model.* overrides).")
        for key, tensor in current.items():
            tensor.copy_(state[key])


def _step_of(step: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(step), dtype=torch.float32)


class _FlatShard:
    """Parameters replicated over ``group``, flattened into one virtual buffer of N elements and cut into
    ``size`` contiguous shards of ``ceil(N / size)``: rank r owns shard r (``pieces``).

    Example: parameters of 3 and 4 elements, size 2 -> N=7, shards of 4: rank 0 owns param 0
    [0:3] and param 1 [0:1]; rank 1 owns param 1 [1:4] (and one padding slot).
    """

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], group: Optional[dist.ProcessGroup]):
        self.group, self.params = group, [p for _, p in named]
        self.size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        total = sum(p.numel() for p in self.params)
        self.shard_size = -(-total // self.size)
        lo, hi = rank * self.shard_size, min(total, (rank + 1) * self.shard_size)
        self.pieces: list[tuple[torch.nn.Parameter, int, int, torch.Tensor]] = []
        """(param, start, stop, fp32 copy of param.flatten()[start:stop]) for this rank's shard."""
        self.no_decay: list[bool] = []
        offset = 0
        for name, param in named:
            start, stop = max(lo, offset) - offset, min(hi, offset + param.numel()) - offset
            if start < stop:
                self.pieces.append((param, start, stop, param.detach().reshape(-1)[start:stop].clone()))
                self.no_decay.append(_no_weight_decay(name, param))
            offset += param.numel()

    def gather(self, local_of) -> torch.Tensor:
        """The whole flat buffer: every rank's shard, ``local_of(piece)`` for each of its pieces (one all-gather)."""
        local = torch.zeros(self.shard_size, dtype=torch.float32)
        at = 0
        for _, start, stop, piece in self.pieces:
            value = local_of(piece)
            if value is not None:
                local[at:at + stop - start] = value
            at += stop - start
        if self.size == 1:
            return local
        return all_gather_into_tensor(local, group=self.group)

    def per_param(self, full: torch.Tensor):
        """(param, its view of the flat buffer ``full``) for every parameter, in order."""
        offset = 0
        for param in self.params:
            yield param, full[offset:offset + param.numel()].view_as(param)
            offset += param.numel()


class ShardedTrainOptimizer:
    """CPU distributed optimizer: AdamW state and update sharded over the ranks holding each parameter.

    A dense parameter is replicated over the data-parallel group and sharded over it; an expert of an
    expert-parallel MoE layer (megatron-core marks it ``allreduce=False``) is replicated only over the
    expert-data-parallel group (``pg_collection.expt_dp``: the ranks holding the same experts), so the
    experts form a second flat buffer sharded over that group (:class:`_FlatShard` each). DP rank r keeps
    AdamW state for its shards only (about 1/dp of the plain optimizer's; the experts' 1/expert-DP). A step:
    the global gradient norm and clipping factor from the full (already reduced) ``main_grad`` exactly as
    :class:`TrainOptimizer` (experts' squares summed over ``expert_group``), AdamW on this rank's pieces,
    then one all-gather per buffer of the updated pieces into every parameter. AdamW is element-wise, so
    the trajectory is the plain optimizer's, bit for bit.

    Gradients are still all-reduced by DDP (gloo has no reduce-scatter for megatron-core's grad
    buffers on CPU); what is sharded is the optimizer state, its update and its memory.
    """

    def __init__(self, cfg: Config, named_params: list[tuple[str, torch.nn.Parameter]],
                 tp_group: Optional[dist.ProcessGroup], dp_group: Optional[dist.ProcessGroup],
                 pp_group: Optional[dist.ProcessGroup] = None, *, expert_group: Optional[dist.ProcessGroup] = None,
                 expert_dp_group: Optional[dist.ProcessGroup] = None):
        t = cfg.train
        self.clip_grad, self.tp_group, self.dp_group, self.pp_group = t.clip_grad, tp_group, dp_group, pp_group
        self.expert_group = expert_group
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in named]
        self.names = {p: n for n, p in named}
        experts = [(n, p) for n, p in named if _expert_parallel(p)]
        if experts and expert_dp_group is None:
            raise ValueError("ShardedTrainOptimizer: expert-parallel parameters need expert_dp_group "
                             "(pg_collection.expt_dp, the ranks holding the same experts)")
        self.shards = [_FlatShard([(n, p) for n, p in named if not _expert_parallel(p)], dp_group)]
        if experts:
            self.shards.append(_FlatShard(experts, expert_dp_group))
        groups = {True: [], False: []}
        for shard in self.shards:
            for (*_, piece), no_decay in zip(shard.pieces, shard.no_decay):
                groups[no_decay].append(piece)
        param_groups = [{"params": groups[False], "weight_decay": t.weight_decay},
                        {"params": groups[True], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in param_groups if g["params"]] or [{"params": []}], lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=False)

    @property
    def pieces(self) -> list[tuple[torch.nn.Parameter, int, int, torch.Tensor]]:
        """This rank's pieces of every buffer."""
        return [piece for shard in self.shards for piece in shard.pieces]

    def step(self, lr: float) -> float:
        grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                 for p in self.params]
        for param, grad in zip(self.params, grads):
            param.grad = grad
        norm = grad_norm(self.params, self.tp_group, self.pp_group, expert_group=self.expert_group)
        factor = clip_grads_([], self.clip_grad, norm)  # the factor only: gradients stay untouched
        for param, start, stop, piece in self.pieces:
            # the parameter is the source of truth (a checkpoint load or weights-only start writes it)
            piece.copy_(param.detach().reshape(-1)[start:stop])
            grad = param.grad.detach().reshape(-1)[start:stop].clone()
            piece.grad = grad.mul_(factor) if factor != 1.0 else grad
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for param in self.params:
            param.grad = None
        for _, _, _, piece in self.pieces:
            piece.grad = None
        self._all_gather_params()
        return norm

    def _all_gather_params(self) -> None:
        """Every rank's updated shards into every parameter (one all-gather of flat buffers per buffer)."""
        with torch.no_grad():
            for shard in self.shards:
                for param, value in shard.per_param(shard.gather(lambda piece: piece)):
                    param.copy_(value)

    def checkpoint_tensors(self) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
        """The whole per-parameter state (gathered over each buffer's group: a checkpoint is layout-free), and step."""
        out: dict[str, dict[str, torch.Tensor]] = {self.names[p]: {} for p in self.params}
        for key in ("exp_avg", "exp_avg_sq"):
            for shard in self.shards:
                full = shard.gather(lambda piece: self.optimizer.state[piece][key] if self.optimizer.state.get(piece)
                                    else None)
                for param, value in shard.per_param(full):
                    out[self.names[param]][key] = value.clone()
        steps = [self.optimizer.state[piece]["step"] for *_, piece in self.pieces if self.optimizer.state.get(piece)]
        step = torch.tensor(float(steps[0]) if steps else 0.0)
        if self.dp_group is not None:  # a rank without pieces learns it
            all_reduce(step, group=self.dp_group, op="max")
        return out, step

    def load_checkpoint_tensors(self, tensors: dict[str, dict[str, torch.Tensor]], step: torch.Tensor) -> None:
        for param, start, stop, piece in self.pieces:
            state = self.optimizer.state[piece]
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = tensors[self.names[param]][key].detach().reshape(-1)[start:stop].clone().float()

    @property
    def num_state_elements(self) -> int:
        return sum(t.numel() for state in self.optimizer.state.values() for t in state.values() if t.dim() > 0)

    def rank_state(self) -> Optional[dict]:
        return None

    def load_rank_state(self, state: Optional[dict]) -> None:
        return None


class MegatronTrainOptimizer:
    """GPU: megatron-core's optimizer (``get_megatron_optimizer``: Adam, fp32 master weights with
    bf16, its own TP-aware clipping) behind the :class:`TrainOptimizer` interface. Its state is
    checkpointed whole per rank (``rank_state``), not through DCP names."""

    def __init__(self, cfg: Config, model_chunks: list[torch.nn.Module]):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = cfg.train
        config = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=t.bf16,
            params_dtype=torch.bfloat16 if t.bf16 else torch.float32,
            use_distributed_optimizer=cfg.ddp.use_distributed_optimizer)
        # the model's own groups (``initialize_parallel``'s collection: megatron-core's gloo groups are not
        # created, create_gloo_process_groups=False), and no gloo copies of them: megatron-core's default
        # use_gloo_process_groups=True reads parallel_state's gloo groups and stops at "Intra partial data
        # parallel group is not initialized"
        from megatron_pack.training.chunks import core_model

        self.optimizer = get_megatron_optimizer(config, model_chunks, use_gloo_process_groups=False,
                                                pg_collection=core_model(model_chunks[0]).pg_collection)

    def step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _, norm, _ = self.optimizer.step()
        self.optimizer.zero_grad()  # drop grad aliases of main_grad before the next backward
        return float(norm) if norm is not None else 0.0

    def named_state(self, *, materialize: bool = False) -> dict[str, torch.Tensor]:
        return {}

    def load_named_state(self, state: dict[str, torch.Tensor]) -> None:
        return None

    def rank_state(self) -> Optional[dict]:
        """The whole megatron-core optimizer state of this rank: it resumes at the same layout only."""
        return self.optimizer.state_dict()

    def checkpoint_tensors(self) -> tuple[dict, None]:
        return {}, None

    def load_checkpoint_tensors(self, tensors: dict, step) -> None:
        return None

    def load_rank_state(self, state: Optional[dict]) -> None:
        if state is None:
            raise ValueError("the checkpoint holds no megatron-core optimizer state (it was written by a CPU run); "
                             "resume on the device it was written on, or start without checkpoint.load.")
        self.optimizer.load_state_dict(state)


def megatron_optimizer_on(device: str) -> bool:
    """Whether a run on ``device`` (``ParallelState.device.type``) steps megatron-core's optimizer: on CUDA,
    where its fused step runs; elsewhere ours (``TrainOptimizer`` / ``ShardedTrainOptimizer``). DDP's buffers
    follow the same choice (``chunks.wrap_ddp``): megatron-core's distributed optimizer shards them."""
    return device == "cuda"


def build_optimizer(cfg: Config, named_params: list[tuple[str, torch.nn.Parameter]],
                    tp_group: Optional[dist.ProcessGroup] = None, *, ddp_model=None,
                    device: str = "cpu", dp_group: Optional[dist.ProcessGroup] = None,
                    pp_group: Optional[dist.ProcessGroup] = None, expert_group: Optional[dist.ProcessGroup] = None,
                    expert_dp_group: Optional[dist.ProcessGroup] = None):
    """torch AdamW over DDP's ``main_grad`` with TP-aware clipping on CPU (state sharded over
    ``dp_group`` with ``ddp.use_distributed_optimizer``; the norm summed over the stages of
    ``pp_group``); megatron-core's optimizer (its distributed optimizer when asked) over ``ddp_model`` (one
    DDP-wrapped chunk or the list of this rank's chunks) on CUDA. ``expert_group`` (megatron-core's ``tp_ep``)
    makes the norm count every expert-parallel rank's experts (``grad_norm``); the sharded optimizer shards
    the experts over ``expert_dp_group`` (``pg_collection.expt_dp``)."""
    if megatron_optimizer_on(device):
        if ddp_model is None:
            raise ValueError("build_optimizer(device='cuda') needs ddp_model (the megatron-core DDP-wrapped model).")
        return MegatronTrainOptimizer(cfg, ddp_model if isinstance(ddp_model, list) else [ddp_model])
    if cfg.ddp.use_distributed_optimizer:
        return ShardedTrainOptimizer(cfg, named_params, tp_group, dp_group, pp_group, expert_group=expert_group,
                                     expert_dp_group=expert_dp_group)
    return TrainOptimizer(cfg, named_params, tp_group, pp_group, expert_group)
