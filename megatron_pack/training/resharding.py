"""Layout-independent model and optimizer state: megatron-core sharded state dicts written with DCP.

A checkpoint stores every tensor by its *global* identity, not by the rank that wrote it:
megatron-core's ``sharded_state_dict()`` describes each parameter shard of this rank as a
``ShardedTensor`` (global shape, this rank's offset along the tensor-parallel axis, a replica
id), with ``ShardedTensorFactory`` for the shards that are not a plain slice of the global tensor
(SwiGLU ``linear_fc1``: TP rank r holds ``[gate_r; up_r]``, stored as the global ``gate`` and
``up``). megatron-core converts those to torch ``ShardedTensor`` s and torch distributed
checkpointing (DCP) writes each global piece once (replicas across DP and CP are deduplicated)
and reads back whatever slice another layout asks for. So a run saved at TP2 x CP2 resumes at
TP1, DP2 or any other layout of the same model.

The optimizer's per-parameter state (AdamW ``exp_avg`` / ``exp_avg_sq``, the shape of the
parameter shard) reuses the parameter's sharding under the key prefix ``optimizer.<state>.``
(megatron-core's ``make_sharded_optimizer_tensor``), so it reshards the same way.

This is megatron-core's ``torch_dist`` format driven directly (its save wrapper assumes CUDA and
an async writer process): the same conversion (``mcore_to_pyt_state_dict``) and planners, with
our writer and our allowlisted ``.metadata`` reader (no arbitrary pickle). Checkpoint-format
objects (``ShardedObject``, e.g. Transformer Engine's ``_extra_state``) are not stored here: that FP8
scaling history is each rank's own and travels in its rank file (``trainer_checkpoint.module_extra_states``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_pack.training.chunks import core_model

OPTIM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""Per-parameter AdamW state kept in checkpoints (``step`` is one scalar, stored once)."""


def model_sharded_tensors(model: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, Any]:
    """``{parameter name: ShardedTensor | ShardedTensorFactory}`` of this rank's parameters.

    Keyed by ``named_parameters()`` names of the core model (the same names on every layout).
    ``trainable_only`` keeps the parameters that train (peft=lora: the adapters; the frozen base is
    re-read from model.pretrained). LoRA adapter weights split across TP ranks are described here
    (megatron-core's parent linear would mark them replicated).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    core = core_model(model)
    by_id = {id(p): n for n, p in core.named_parameters() if p.requires_grad or not trainable_only}
    gated = bool(getattr(getattr(core, "config", None), "gated_linear_unit", False))
    out: dict[str, Any] = {}
    for item in nested_values(core.sharded_state_dict()):
        if isinstance(item, (ShardedTensor, ShardedTensorFactory)) and id(item.data) in by_id:
            out[by_id[id(item.data)]] = _tp_split_adapter(item, gated) if isinstance(item, ShardedTensor) else item
    missing = sorted(set(by_id.values()) - set(out))
    if missing:
        raise AssertionError(f"megatron-core's sharded_state_dict has no entry for parameters {missing[:3]}")
    return out


def _tp_split_adapter(item: Any, gated: bool) -> Any:
    """A LoRA adapter weight split across TP ranks (``tensor_model_parallel``) as the slice it is of
    the TP=1 weight; with a gated MLP, fc1's B (rows ``[gate_r; up_r]`` like the output of its base)
    through megatron-core's SwiGLU factory. Any other item is returned unchanged."""
    data = item.data
    if not getattr(data, "tensor_model_parallel", False) or ".adapter." not in item.key:
        return item
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tp_rank, tp_size = getattr(data, "adapter_tp", None) or (  # an expert's adapter: its expert-TP rank
        parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    prepend = [(i, item.global_offset[i], item.global_shape[i]) for i in range(item.prepend_axis_num)]
    replica_id = (0, 0, item.replica_id[2] if isinstance(item.replica_id, tuple) else 0)
    axis = int(data.partition_dim)
    if gated and ".linear_fc1.adapter.linear_out." in item.key:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        plain = ShardedTensor.from_rank_offsets(item.key, data, *prepend, (axis + len(prepend), tp_rank, tp_size),
                                                replica_id=replica_id, prepend_axis_num=len(prepend))
        return apply_swiglu_sharded_factory(plain, tuple(prepend))
    return ShardedTensor.from_rank_offsets(item.key, data, *prepend, (axis + len(prepend), tp_rank, tp_size),
                                           replica_id=replica_id, prepend_axis_num=len(prepend))


def sharded_state(model, optim_tensors: dict[str, dict[str, torch.Tensor]],
                  step_tensor: Optional[torch.Tensor] = None, *, trainable_only: bool = False) -> dict[str, Any]:
    """The sharded state dict of the model and (optionally) its optimizer state.

    ``model`` is this rank's model chunk or the list of its chunks (virtual pipeline stages: names
    carry ``chunks.chunk_prefix``; the sharded keys, what the files hold, name the layers globally).
    ``optim_tensors`` maps a parameter name to its state tensors (shaped like this rank's
    parameter shard); ``step_tensor`` is the optimizer's step count (a replicated scalar).
    Keys of the result: ``model.<name>``, ``optimizer.<state>.<name>``, ``optimizer.step``.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from megatron_pack.training.chunks import chunk_prefix

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    params = {chunk_prefix(v, len(chunks)) + name: sh for v, chunk in enumerate(chunks)
              for name, sh in model_sharded_tensors(chunk, trainable_only=trainable_only).items()}
    state: dict[str, Any] = {f"model.{name}": sh for name, sh in params.items()}
    for name, tensors in optim_tensors.items():
        for key, tensor in tensors.items():
            state[f"optimizer.{key}.{name}"] = make_sharded_optimizer_tensor(params[name], tensor,
                                                                             prefix=f"optimizer.{key}")
    if step_tensor is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        state["optimizer.step"] = ShardedTensor.from_rank_offsets("optimizer.step", step_tensor, replica_id=rank)
    return state


def save_sharded(state: dict[str, Any], directory: str, writer_factory: Callable[[str], Any]) -> None:
    """Write ``state`` (from :func:`sharded_state`) into ``directory``; collective over the world."""
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner,
                                                                     _replace_state_dict_keys_with_sharded_keys,
                                                                     mcore_to_pyt_state_dict)

    # megatron-core checks that every global piece has exactly one main replica (replica id 0)
    # among all ranks; only main replicas are written (each piece once, whatever the DP/CP size)
    sharded_part, _ = save_preprocess(dict(state), validate_access_integrity=dist.is_initialized())
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_part, keep_only_main_replica=True)
    pyt_state = mcore_to_pyt_state_dict(flat, False)
    dcp.save(pyt_state, storage_writer=writer_factory(directory),
             planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
             no_dist=not dist.is_initialized())


def load_sharded(state: dict[str, Any], reader: Any) -> dict[str, torch.Tensor]:
    """Read the slices ``state`` (this rank's layout) asks for; returns ``{key of state: tensor}``.

    ``reader`` is the allowlisted DCP reader (``checkpoint.checkpoint_reader``). A key the
    checkpoint lacks raises ``KeyError`` naming it.
    """
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreLoadPlanner,
                                                                     _replace_sharded_keys_with_state_dict_keys,
                                                                     _replace_state_dict_keys_with_sharded_keys,
                                                                     _restore_dict_types, _unwrap_pyt_sharded_tensor,
                                                                     mcore_to_pyt_state_dict)

    _check_keys(state, set(reader.read_metadata().state_dict_metadata))
    preprocessed, _, factories = load_preprocess(dict(state))
    flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(preprocessed)
    pyt_state = mcore_to_pyt_state_dict(flat, True)
    dcp.load(pyt_state, storage_reader=reader, planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=[]),
             no_dist=not dist.is_initialized())
    loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state.items()}
    loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
    _restore_dict_types(loaded, preprocessed)
    return apply_factory_merges(loaded, factories)


def _storage_keys(item: Any) -> Iterable[str]:
    """The checkpoint keys one entry reads (a factory's built pieces, e.g. SwiGLU's ``_w`` / ``_v``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(item, ShardedTensorFactory):
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        return [sh.key for sh in nested_values(item.build())]
    return [item.key]


def stored_in(item: Any, stored: set[str]) -> bool:
    """Whether every checkpoint key ``item`` (a ShardedTensor or factory of :func:`sharded_state`) reads is in
    ``stored``."""
    return all(key in stored for key in _storage_keys(item))


def _check_keys(state: dict[str, Any], stored: set[str]) -> None:
    for name, item in state.items():
        for key in _storage_keys(item):
            if key not in stored:
                raise KeyError(f"the checkpoint holds no {key!r} (needed for {name}); it was written for another "
                               "model (check model.* overrides) or by a run without that state.")
