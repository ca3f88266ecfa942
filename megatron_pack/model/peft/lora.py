"""LoRA adapters on megatron-core's tensor-parallel linears (``peft=lora``).

Each target linear ``W`` (a ``ColumnParallelLinear`` or ``RowParallelLinear`` of every layer)
gets an adapter ``adapter.linear_in`` (A, [r, in]) and ``adapter.linear_out`` (B, [out, r]); the
layer's output becomes ``W x + (alpha / r) * B A dropout(x)``, peft's formula. The base linear
keeps its own parameter names (the adapter runs from a forward hook), so the HF tables, the
loader and the exporter see the same model as in full fine-tuning. Every base parameter is
frozen: megatron-core's DDP allocates no gradient buffer for it, the optimizer never sees it.

Tensor parallelism, shapes for H=64, r=8 at TP=2:

``column`` (linear_qkv, linear_fc1)  A [8, 64] replicated on every TP rank; B [out/TP, 8] split
    like the base weight (rows), so B's rows follow the base layout: per query group [q; k; v]
    for linear_qkv, [gate_r; up_r] for linear_fc1. The [tokens, r] product A x is made whole on
    every TP rank: a ``copy_to`` (backward all-reduce) or, with sequence parallelism, a gather
    of the sequence shards (backward reduce-scatter).
``row`` (linear_proj, linear_fc2)  A [8, in/TP] split like the base weight (columns); B [64, 8]
    replicated. The partial products A_r x_r are summed over TP (all-reduce, or reduce-scatter to
    the sequence shards with sequence parallelism) before B.

With sequence parallelism the replicated A (column) and B (row) see only this rank's sequence
shard, so their gradients are partial sums: they carry ``sequence_parallel = True`` and
megatron-core's ``finalize_model_grads`` all-reduces them over TP, as it does for norm weights.

A and B start as peft starts them (A Kaiming-uniform, B zero, so the adapted model equals the
base at step 0). A is drawn whole from ``torch.Generator().manual_seed(seed + layer)`` and then
sliced, so every TP size starts from the same adapters.

Experts of a MoE layer (``mlp.experts.local_experts.<e>.linear_fc1 / linear_fc2``, megatron-core's
``SequentialMLP``): each expert gets its own A and B, as peft's ``ParamWrapper`` gives each expert of a
3D ``gate_up_proj`` / ``down_proj`` its own rank-r block (``model/peft/export.py``). An expert-parallel
rank holds the adapters of its own experts: they carry the base weight's ``allreduce = False``, so
megatron-core's DDP reduces their gradients over the expert-data-parallel group, as the experts'. Their
seed is the global expert's (``_seed_of``), so every EP size starts from the same adapters. Under expert
tensor parallelism they split like the dense ones (B of linear_fc1, A of linear_fc2) over the expert-TP
group, with no communication of activations (``LoRAAdapter._expert_forward``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", "in_proj")  # in_proj / out_proj: a Gated DeltaNet layer's
ROW_PARALLEL = ("linear_proj", "linear_fc2", "out_proj")


class LoRAAdapter(nn.Module):
    """``(alpha / r) * B A dropout(x)`` for one TP-sharded linear; see the module docstring."""

    def __init__(self, *, in_features: int, out_features: int, dim: int, alpha: float, dropout: float,
                 parallel: str, tp_group, tp_size: int, sequence_parallel: bool, dtype: torch.dtype,
                 partition_stride: int = 1):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"LoRAAdapter: parallel ({parallel!r}) must be 'column' or 'row'.")
        self.parallel, self.tp_group, self.tp_size = parallel, tp_group, tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.scale = alpha / dim
        self.linear_in = nn.Linear(in_features, dim, bias=False, dtype=dtype)
        self.linear_out = nn.Linear(dim, out_features, bias=False, dtype=dtype)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        split = self.linear_out.weight if parallel == "column" else self.linear_in.weight
        whole = self.linear_in.weight if parallel == "column" else self.linear_out.weight
        # B of linear_fc1 is split like its base, [gate_r; up_r] (stride 2), so TP shards merge alike
        split.tensor_model_parallel, split.partition_dim = True, (0 if parallel == "column" else 1)
        split.partition_stride = partition_stride
        whole.tensor_model_parallel = False
        whole.sequence_parallel = self.sequence_parallel  # a partial sum over the sequence shard

    expert_comm: bool = False
    """An expert's adapter under expert TP (``_as_expert_adapter``): the MoE dispatcher moves the activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.expert_comm:
            return self._expert_forward(x)
        h = self.linear_in(self._dropout(x))  # [s, b, r]: whole (column) or a partial sum (row)
        if self.tp_size > 1:
            if self.parallel == "column":
                h = (mappings.gather_from_sequence_parallel_region(h, True, self.tp_group) if self.sequence_parallel
                     else mappings.copy_to_tensor_model_parallel_region(h, self.tp_group))
            else:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h, self.tp_group) if self.sequence_parallel
                     else mappings.reduce_from_tensor_model_parallel_region(h, self.tp_group))
        return self.linear_out(h) * self.scale

    def _expert_forward(self, x: torch.Tensor) -> torch.Tensor:
        """An expert's linear under expert TP takes its input whole on every expert-TP rank and leaves its
        output to the dispatcher (megatron-core's ``explicit_expert_comm``: column outputs stay split, row
        outputs are partial sums it reduce-scatters, and it sums the input gradients over the ranks). So the
        activations need nothing; the replicated weight (A of a column linear, B of a row one) sees only this
        rank's part of its gradient, which ``copy_to`` (backward all-reduce over expert TP) makes whole."""
        from megatron.core.tensor_parallel import mappings

        a, b = self.linear_in.weight, self.linear_out.weight
        if self.parallel == "column":
            a = mappings.copy_to_tensor_model_parallel_region(a, self.tp_group)
        else:
            b = mappings.copy_to_tensor_model_parallel_region(b, self.tp_group)
        return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * self.scale

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout masks differ across TP ranks where x does (a sequence or feature shard), as megatron's do."""
        if isinstance(self.dropout, nn.Identity) or not self.training:
            return x
        if self.sequence_parallel or self.parallel == "row":
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    def delta_weight(self) -> torch.Tensor:
        """``scale * B A``: this rank's shard of the update the adapter adds to the base weight."""
        return (self.linear_out.weight.float() @ self.linear_in.weight.float()) * self.scale


def _adapter_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input the base weight multiplies. Transformer Engine's ``LayerNormColumnParallelLinear``
    (the TE spec's linear_qkv / linear_fc1) applies its norm inside; the adapter applies the same norm."""
    weight = getattr(module, "layer_norm_weight", None)
    if weight is None:
        return x
    eps = float(getattr(module, "eps", 1e-5))
    gamma = weight + 1 if getattr(module, "zero_centered_gamma", False) else weight
    xf = x.float()
    if getattr(module, "normalization", "LayerNorm") == "RMSNorm":
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()
    else:
        bias = getattr(module, "layer_norm_bias", None)
        out = torch.nn.functional.layer_norm(xf, (xf.shape[-1],), gamma.float(), None if bias is None else bias.float(), eps)
    return out.to(x.dtype)


def _adapter_hook(module: nn.Module, args: tuple, output):
    out, bias = output
    return out + module.adapter(_adapter_input(module, args[0])).to(out.dtype), bias


def _init_adapter(adapter: LoRAAdapter, *, seed: int, tp_rank: int) -> None:
    """A as peft draws it (Kaiming-uniform, a=sqrt(5)) on the whole [r, in], sliced for row-parallel; B = 0."""
    a = adapter.linear_in.weight
    in_whole = a.shape[1] * (adapter.tp_size if adapter.parallel == "row" else 1)
    whole = torch.empty(a.shape[0], in_whole, dtype=torch.float32)
    nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    if adapter.parallel == "row":
        whole = whole[:, tp_rank * a.shape[1]:(tp_rank + 1) * a.shape[1]]
    with torch.no_grad():
        a.copy_(whole)
        adapter.linear_out.weight.zero_()


EXPERT = ".local_experts."
"""In the name of an expert's linear: ``decoder.layers.<i>.mlp.experts.local_experts.<e>.linear_fc1``."""
EXPERT_SEED_OFFSET = 1_000_003
"""Expert adapters draw their A from seeds past every dense adapter's (``_seed_of``)."""


def target_linears(model: nn.Module, targets) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear named in ``targets`` inside the decoder layers, in model order."""
    return [(name, module) for name, module in model.named_modules()
            if ".layers." in name and name.rsplit(".", 1)[-1] in targets]


def _local_layer(name: str) -> int:
    """The layer index of a linear's name within its model chunk (``decoder.layers.{i}.``)."""
    return int(name.split(".layers.", 1)[1].split(".", 1)[0])


def _seed_of(name: str, modules: dict[str, nn.Module], seed: int, dense_index: int, layer_offset: int = 0) -> int:
    """The seed of a linear's A: ``seed + i`` for the i-th dense target (in model order, as without experts);
    for expert e (global) of layer l's linear_fc1 / linear_fc2, ``seed + EXPERT_SEED_OFFSET + 2 (l E + e) + j``
    (j = 0 / 1), the same whichever EP rank holds it. Example: 4 experts, EP=2, rank 1's local expert 0 of
    layer 1's linear_fc2 is global expert 2: ``seed + EXPERT_SEED_OFFSET + 2 * (4 + 2) + 1``."""
    if EXPERT not in name:
        return seed + dense_index
    head, tail = name.split(EXPERT)
    experts = modules[head]  # megatron-core's SequentialMLP
    local = int(tail.split(".", 1)[0])
    num_global = experts.ep_group.size() * experts.num_local_experts
    global_expert = experts.ep_group.rank() * experts.num_local_experts + local
    layer = layer_offset + _local_layer(name)  # the global layer (a pipeline stage's first is layer_offset)
    return seed + EXPERT_SEED_OFFSET + 2 * (layer * num_global + global_expert) + int(name.endswith("linear_fc2"))


def _expert_tp(base: nn.Module) -> tuple[object, int, int]:
    """(group, rank, size) of an expert linear's expert tensor parallelism."""
    group = getattr(base, "tp_group", None)
    return (group, group.rank(), group.size()) if group is not None and group.size() > 1 else (None, 0, 1)


def _as_expert_adapter(adapter: "LoRAAdapter", base: nn.Module) -> None:
    """An expert's adapter is reduced like the expert's weight; whole on its rank at expert TP 1, else split
    like the expert's weight over expert TP (``adapter_tp``: the checkpoint's split axis, ``resharding.py``)."""
    _, rank, size = _expert_tp(base)
    adapter.expert_comm = size > 1
    for weight in (adapter.linear_in.weight, adapter.linear_out.weight):
        if size == 1:
            weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = False, -1, 1
        weight.adapter_tp = (rank, size)
        weight.allreduce = getattr(base.weight, "allreduce", True)


def apply_lora(model: nn.Module, peft_cfg, *, seed: int, tp_group, tp_size: int, tp_rank: int,
               sequence_parallel: bool, layer_offset: int = 0) -> int:
    """Freeze every parameter of ``model`` and attach an adapter to each target linear; returns
    the number of adapters. The model's own parameter names do not change.

    Adapter ``k`` of the whole model is drawn with seed ``seed + k``; a pipeline stage whose first
    layer is global layer ``layer_offset`` numbers its adapters from ``layer_offset`` times the
    adapters per layer, so every layout draws the same adapters (PP=2's stage 1 those of PP=1's
    second half)."""
    for param in model.parameters():
        param.requires_grad_(False)
    found = target_linears(model, peft_cfg.target_modules)
    if not found:
        raise ValueError(f"peft.target_modules ({list(peft_cfg.target_modules)}) match no linear of the model.")
    modules = dict(model.named_modules())
    num_local_layers = len({_local_layer(name) for name, _ in found})
    dense_index = layer_offset * (sum(EXPERT not in name for name, _ in found) // num_local_layers)
    for name, module in found:
        leaf, expert = name.rsplit(".", 1)[-1], EXPERT in name
        out_local, in_local = module.weight.shape
        adapter = LoRAAdapter(in_features=in_local, out_features=out_local, dim=peft_cfg.dim, alpha=peft_cfg.alpha,
                              dropout=peft_cfg.dropout, parallel="column" if leaf in COLUMN_PARALLEL else "row",
                              tp_group=_expert_tp(module)[0] if expert else tp_group,
                              tp_size=_expert_tp(module)[2] if expert else tp_size,
                              sequence_parallel=sequence_parallel and not expert, dtype=module.weight.dtype,
                              partition_stride=getattr(module.weight, "partition_stride", 1)).to(module.weight.device)
        if expert:
            _as_expert_adapter(adapter, module)
        _init_adapter(adapter, seed=_seed_of(name, modules, seed, dense_index, layer_offset),
                      tp_rank=_expert_tp(module)[1] if expert else tp_rank)
        dense_index += not expert
        module.add_module("adapter", adapter)
        module.register_forward_hook(_adapter_hook)
    return len(found)


def is_adapter_param(name: str) -> bool:
    return ".adapter.linear_in." in name or ".adapter.linear_out." in name


VOCAB_PARAMS = {"embedding.word_embeddings.weight": "embed_tokens", "output_layer.weight": "lm_head"}
"""The vocabulary layers (megatron-core name -> peft module name) a ``model.resize_vocab`` LoRA run trains whole."""


def is_vocab_param(name: str) -> bool:
    return name.removeprefix("module.") in VOCAB_PARAMS


def train_vocab_layers(model: nn.Module) -> int:
    """Unfreeze the embedding and output layer after ``apply_lora`` (peft's ``modules_to_save``): rows grown by
    ``model.resize_vocab`` start at the old rows' mean and must train. Returns how many were unfrozen (0 on a
    pipeline stage holding neither; one when tied)."""
    params = dict(model.named_parameters())  # a tied output layer is the embedding: named once
    found = [params[name] for name in VOCAB_PARAMS if name in params]
    for param in found:
        param.requires_grad_(True)
    return len(found)


def count_parameters(model: nn.Module, tp_group=None, expert_group=None, ep_group=None) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model, each counted once across TP ranks
    (a TP-split tensor contributes every rank's shard, a replicated one its size once). Every TP rank
    must call it (one all-reduce). Expert tensors (megatron-core's ``allreduce=False``: each
    expert-parallel rank holds its own experts) are summed over ``expert_group`` (``pg_collection.tp_ep``:
    every EP x expert-TP rank holds another shard) when split over expert TP, else over ``ep_group``
    (``pg_collection.ep``; an expert adapter's half that is whole on every expert-TP rank); every rank of
    those groups must call it too."""
    from megatron_pack.parallel.comm import all_reduce

    split = torch.zeros(2, dtype=torch.float64)  # [trainable, total] of TP-split tensors on this rank
    experts = {True: torch.zeros(2, dtype=torch.float64), False: torch.zeros(2, dtype=torch.float64)}
    whole = [0, 0]
    for param in model.parameters():
        n = param.numel()
        pair = torch.tensor([n if param.requires_grad else 0, n], dtype=torch.float64)
        if not getattr(param, "allreduce", True):
            experts[bool(getattr(param, "tensor_model_parallel", False))] += pair
        elif getattr(param, "tensor_model_parallel", False):
            split += pair
        else:
            whole[0] += n if param.requires_grad else 0
            whole[1] += n
    for tensor, group in ((split, tp_group), (experts[True], expert_group), (experts[False], ep_group)):
        if group is not None:
            all_reduce(tensor, group=group)
    total = split + experts[True] + experts[False]
    return int(total[0]) + whole[0], int(total[1]) + whole[1]


def merged_shards(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float
                  ) -> dict[str, torch.Tensor]:
    """One TP rank's base tensors with ``scale * B A`` added to each adapted weight (megatron layout,
    so the column/row shards need no communication: W_r + s B_r A, or W_r + s B A_r)."""
    out = dict(base)
    for name in sorted(n for n in adapters if n.endswith(".adapter.linear_in.weight")):
        prefix = name[: -len(".adapter.linear_in.weight")]
        a, b = adapters[name].double(), adapters[prefix + ".adapter.linear_out.weight"].double()
        weight = base[prefix + ".weight"]
        out[prefix + ".weight"] = (weight.double() + scale * (b @ a)).to(weight.dtype)
    return out


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's adapter tensors by name (no DDP / Float16Module prefix)."""
    return {name.removeprefix("module."): p for name, p in model.named_parameters() if is_adapter_param(name)}


def describe(trainable: int, total: int, num_adapters: Optional[int] = None) -> str:
    where = f" in {num_adapters} adapters" if num_adapters is not None else ""
    return (f"trainable parameters: {trainable:,} of {total:,} ({100.0 * trainable / max(total, 1):.3f}%){where}")
