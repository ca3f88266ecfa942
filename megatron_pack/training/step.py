"""The model side of a training step: THD batch -> ``PackedSeqParams``, per-token losses -> loss sum.

``get_packed_seq_params`` is the one place a THD batch becomes megatron-core's
``PackedSeqParams(qkv_format="thd")``. ``loss_func`` follows megatron-core's
``calculate_per_token_loss`` contract: it returns the *sum* of token losses on this CP shard and
the number of target tokens; megatron-core adds the counts over micro-batches, the step
all-reduces them over DP x CP and scales gradients by ``1 / count`` once. Nothing here divides.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator, Mapping, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_pack.model.moe import begin_micro_batch
from megatron_pack.training.chunks import core_model


def _cu_seqlens(batch: Mapping[str, Any], key: str) -> torch.Tensor:
    """``batch[key]`` as int32 [N+1]; a [1, N+1] tensor (a DataLoader's batch dimension) is squeezed.

    Anything else ([B, N+1] with B > 1, a scalar) is refused naming the key: one THD row has one
    cu_seqlens, and flattening several would silently join their sequences.
    """
    value = batch[key]
    cu = value if torch.is_tensor(value) else torch.as_tensor(value)
    if cu.dim() == 2 and cu.shape[0] == 1:
        cu = cu[0]
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"batch['{key}'] has shape {list(cu.shape)}; get_packed_seq_params needs one THD row's "
                         f"cumulative lengths, shape [N+1] (or [1, N+1]) starting at 0. Collate with "
                         "micro_batch_size 1 (one pack per micro-batch), or pack the rows of a [B, S] batch into "
                         "one row with megatron_pack.data.batches.in_batch.pack_batch_sequences.")
    return cu.to(torch.int32)


def _max_seqlen(batch: Mapping[str, Any]) -> int:
    """``batch['max_seqlen']`` as a Python int; a one-element tensor or array is read, more are refused."""
    value = batch["max_seqlen"]
    if torch.is_tensor(value) or hasattr(value, "shape"):
        flat = torch.as_tensor(value).reshape(-1)
        if flat.numel() != 1:
            raise ValueError(f"batch['max_seqlen'] has shape {list(torch.as_tensor(value).shape)} ({flat.tolist()[:8]}); "
                             "it must be one integer per THD row (the longest padded sub-sequence). Collate "
                             "with micro_batch_size 1, or pass int(batch['max_seqlen'].max()) for one packed row.")
        if flat.device.type != "cpu":
            raise ValueError("batch['max_seqlen'] is a device tensor; keep it a Python int (the collate's), "
                             "reading it would sync the device.")
        value = flat[0].item()
    if isinstance(value, bool) or int(value) != value or int(value) < 0:
        raise ValueError(f"batch['max_seqlen'] ({value!r}) must be a non-negative integer.")
    return int(value)


def _has_padding(batch: Mapping[str, Any]) -> bool:
    """True when the pack holds padding tokens: from the collate's count, else from CPU cu_seqlens."""
    if "num_pad_tokens" in batch:
        return int(batch["num_pad_tokens"]) > 0
    real, padded = _cu_seqlens(batch, "cu_seqlens"), _cu_seqlens(batch, "cu_seqlens_padded")
    if real.device.type != "cpu" or padded.device.type != "cpu":
        raise ValueError("get_packed_seq_params needs batch['num_pad_tokens'] or CPU cu_seqlens (reading a "
                         "device tensor would sync the device); call it on the loader's batch before moving it.")
    return not torch.equal(real, padded)


def get_packed_seq_params(batch: Mapping[str, Any], *, force_padded: bool = False,
                          device: Optional[torch.device] = None) -> PackedSeqParams:
    """megatron-core ``PackedSeqParams`` for a THD batch (from ``collate_thd`` or ``pack_batch_sequences``).

    ``cu_seqlens_q/kv`` are the real cumulative lengths; ``cu_seqlens_q/kv_padded`` the physical
    ones, passed only when the pack has padding (an unpadded pack takes the faster kernel path)
    or when ``force_padded`` is set (CUDA graphs: the captured call must see the same arguments
    every step). ``max_seqlen_q/kv`` are Python ints. A DataLoader's leading batch dimension of 1
    is squeezed (cu_seqlens [1, N+1], max_seqlen tensor([8])); several rows are refused naming the
    key (pack them into one row first). The tensors are the batch's own int32 CPU
    tensors, copied to ``device`` when it is an accelerator (asynchronously: no device tensor is read).

    Example: ``cu_seqlens=[0,2,4]``, ``cu_seqlens_padded=[0,4,8]``, ``max_seqlen=4`` ->
    ``PackedSeqParams(qkv_format="thd", cu_seqlens_q=[0,2,4], cu_seqlens_q_padded=[0,4,8],
    max_seqlen_q=4, ...)`` (kv the same).
    """
    cu_seqlens = _cu_seqlens(batch, "cu_seqlens")
    padded = _cu_seqlens(batch, "cu_seqlens_padded") if force_padded or _has_padding(batch) else None
    if padded is not None and padded.numel() != cu_seqlens.numel():
        raise ValueError(f"batch['cu_seqlens'] has {cu_seqlens.numel()} entries but batch['cu_seqlens_padded'] has "
                         f"{padded.numel()}; both list the same N sub-sequences (N+1 entries each).")
    max_seqlen = _max_seqlen(batch)
    if device is not None and torch.device(device).type != "cpu":
        cu_seqlens = cu_seqlens.to(device, non_blocking=True)
        padded = padded.to(device, non_blocking=True) if padded is not None else None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def step_packed_seq_params(config, batch: Mapping[str, Any], device=None) -> PackedSeqParams:
    """The step's ``PackedSeqParams``: fixed-shape whenever a CUDA graph impl is set (``config.cuda_graph_impl``,
    megatron-core's ``TransformerConfig``): ``cu_seqlens_q/kv_padded`` always passed, so a captured graph sees the
    same fields, shapes (``packing.pad_cu_seqlens``: N+1 fixed), dtypes and ``max_seqlen`` (dataset-wide with
    ``data.pad_to_max_length``) every step, whatever the pack holds; otherwise the padded arrays only for a pack
    with padding (``get_packed_seq_params``)."""
    graphs = getattr(config, "cuda_graph_impl", "none") not in ("none", None)
    return get_packed_seq_params(batch, force_padded=graphs, device=device)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """``(loss_sum, num_tokens, {"lm loss": tensor([loss_sum, num_tokens])})`` for this CP shard.

    ``output_tensor`` holds per-token losses [1, T_local] (GPTModel's output when labels are
    given); ``loss_mask`` is [1, T_local], a target counts where it is non-zero (the collate
    writes 0/1). ``loss_sum`` is a float32 scalar with the graph attached; ``num_tokens`` is an
    int32 scalar tensor (megatron-core's schedules add it into an int tensor); the report is
    detached float32. Masked positions are dropped with ``torch.where`` before anything is
    multiplied or summed, so a shard whose tokens are all masked returns exactly 0 even when the
    output there is inf or NaN, and its gradient is 0, not NaN.

    Example: losses ``[[1.0, 2.0, inf, 4.0]]``, mask ``[[1, 1, 0, 0]]`` -> ``(3.0, 2, {"lm loss": [3.0, 2.0]})``.
    """
    losses = output_tensor.float().reshape(-1)
    keep = loss_mask.reshape(-1) != 0
    if losses.shape != keep.shape:
        raise ValueError(f"loss_func: output_tensor has {losses.numel()} tokens but loss_mask has {keep.numel()}; "
                         "slice loss_mask with the same CP slice as the tokens (slice_thd_batch).")
    loss_sum = torch.where(keep, losses, torch.zeros((), dtype=losses.dtype, device=losses.device)).sum()
    num_tokens = keep.sum(dtype=torch.int32)
    report = torch.stack([loss_sum.detach(), num_tokens.to(torch.float32)])
    return loss_sum, num_tokens, {"lm loss": report}


def loss_func_with_sources(loss_mask: torch.Tensor, token_source: torch.Tensor, num_sources: int,
                           output_tensor: torch.Tensor):
    """``training.step.loss_func`` plus ``report["source loss"]`` (``per_source_loss``, flattened)."""
    from megatron_pack.training.breakdown import per_source_loss

    loss_sum, num_tokens, report = loss_func(loss_mask, output_tensor)
    report["source loss"] = per_source_loss(output_tensor, loss_mask, token_source.to(output_tensor.device),
                                            num_sources).reshape(-1).float()
    return loss_sum, num_tokens, report


def check_finite(loss_sum: torch.Tensor, batch: Mapping[str, Any]) -> None:
    """Raise ``FloatingPointError`` naming the pack's sample ids when ``loss_sum`` is not finite.

    ``loss_func`` never lets masked positions through, so a non-finite sum means a real target
    token produced inf/NaN. This reads ``loss_sum`` (a device sync): the caller chooses when.
    """
    value = float(loss_sum.detach().float().cpu())
    if torch.isfinite(torch.tensor(value)):
        return
    sample_ids = batch.get("sample_ids")
    ids = sample_ids.tolist() if torch.is_tensor(sample_ids) else sample_ids
    raise FloatingPointError(
        f"non-finite loss sum ({value}) on unmasked tokens of the pack with sample_ids {ids} "
        f"({batch.get('num_target_tokens', '?')} target tokens); replay those samples alone to find the one "
        "that diverges, lower train.lr, or drop them from data.input.")


def _check_stage_input(core: torch.nn.Module, num_local_tokens: int) -> None:
    """A later pipeline stage's received activation covers the tokens of the pack its own loader gave."""
    received = core.decoder.input_tensor
    expected = num_local_tokens
    if core.config.sequence_parallel:
        expected //= core.config.tensor_model_parallel_size
    if received is None or received.shape[0] != expected:
        got = None if received is None else list(received.shape)
        raise ValueError(f"pipeline stage received an activation of shape {got} for a pack of {expected} local tokens; "
                         "the stages' loaders drew different packs (every stage of one DP rank must read the same "
                         "data: same dataset, plan, seed and DP rank).")


def model_inputs(core: torch.nn.Module, batch: Mapping[str, Any], local: Mapping[str, Any], cp_size: int,
                 cp_rank: int, device) -> tuple[Optional[torch.Tensor], torch.Tensor, dict]:
    """``(tokens, position_ids, keyword arguments)`` of the model's forward for this rank's slice ``local`` of
    ``batch`` (training's step and verify's): the tokens where they enter (the first stage); a MoE model's
    ``padding_mask``, the pack's routing index (``model.moe.routing_index``: its routers read the pack's boundaries
    from it; padding is never routed); a vision-language
    model's ``decoder_input`` (the images in the whole pack's embeddings, then the CP slice: ``model/vlm.py``)
    with the whole pack's M-RoPE positions instead of tokens."""
    padding_mask = begin_micro_batch(core, batch, cp_size, cp_rank, device)
    extra = {} if padding_mask is None else {"padding_mask": padding_mask}
    if getattr(core, "vision_language", False):
        from megatron_pack.model.vlm import mrope_positions, vlm_decoder_input

        if core.pre_process:
            extra["decoder_input"] = vlm_decoder_input(core, batch, cp_size, cp_rank, device)
        return None, mrope_positions(batch, device), extra
    tokens = local["tokens"].to(device, non_blocking=True) if core.pre_process else None
    return tokens, local["position_ids"].to(device, non_blocking=True), extra


def forward_step(data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module):
    """megatron-core's ``forward_step_func``: next pack, this CP rank's slice, per-token losses.

    Reads the next full THD batch (a pack), keeps this CP rank's chunks (``slice_thd_batch``;
    cu_seqlens stay global), builds ``PackedSeqParams`` and calls
    ``model(tokens, position_ids, None, labels=labels, packed_seq_params=...)``, which returns
    per-token losses [1, T/CP]. Returns ``(losses, partial(loss_func, loss_mask))``: the loss
    function gives the shard's loss SUM and target count, which the schedule backpropagates as is.
    The CP group comes from the model (``pg_collection.cp``), not from global state.
    """
    from megatron_pack.parallel.cp import slice_thd_batch

    batch = next(data_iterator)
    core = core_model(model)
    cp_group = core.pg_collection.cp
    local = slice_thd_batch(batch, cp_group.size(), cp_group.rank())
    device = next(core.parameters()).device
    params = step_packed_seq_params(core.config, batch, device)
    # a pipeline stage uses the tokens only where they enter (first stage), labels and the loss
    # mask where the loss is (last stage); every stage uses the boundaries in ``params``
    labels = local["labels"].to(device, non_blocking=True) if core.post_process else None
    loss_mask = local["loss_mask"].to(device, non_blocking=True)
    if not core.pre_process:
        _check_stage_input(core, local["tokens"].shape[-1])
    tokens, position_ids, extra = model_inputs(core, batch, local, cp_group.size(), cp_group.rank(), device)
    output = model(tokens, position_ids, None, labels=labels, packed_seq_params=params, **extra)
    if "token_source" in local:  # data.sources: the report also carries the per-source loss
        loss = partial(loss_func_with_sources, loss_mask, local["token_source"], int(batch["num_sources"]))
    else:
        loss = partial(loss_func, loss_mask)
    return output, loss

