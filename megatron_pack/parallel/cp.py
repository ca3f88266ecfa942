"""Context parallelism for THD batches: pad multiples and load-balanced slicing.

Every sub-sequence of padded length ``L`` is cut into ``2*CP`` chunks of ``L/(2*CP)`` tokens;
rank ``r`` keeps chunk ``r`` and chunk ``2*CP-1-r`` (one early, one late chunk, so causal
attention work is balanced), sub-sequences in order. These are the indices of Transformer
Engine's ``thd_get_partitioned_indices``::

    cu_seqlens_padded = [0, 8, 16], CP = 2  (chunks of 2 tokens)
    rank 0 keeps [0, 1, 6, 7,  8, 9, 14, 15]
    rank 1 keeps [2, 3, 4, 5, 10, 11, 12, 13]

``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen`` stay global: the attention kernel
divides them itself. To put local results back at their global positions, use
``thd_gather_order`` (the concatenation of every rank's indices) or ``thd_unslice``.

Everything here is pure: tensors and ints in, new tensors out, no process group.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from megatron_pack._deprecated import module_getattr

__getattr__ = module_getattr(__name__)
"""``pad_multiple`` (DESIGN.md's path; it lives in ``megatron_pack.config.layout``), with a DeprecationWarning."""

SLICED_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "token_source")
"""THD batch keys holding one value per token ([1, T]); ``slice_thd_batch`` cuts these
(``token_source``, present for a data.sources plan, feeds the per-source loss)."""


def _as_cu(cu_seqlens_padded: Any) -> torch.Tensor:
    cu = torch.as_tensor(cu_seqlens_padded).to(torch.int64).reshape(-1)
    if cu.numel() < 1 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_padded must start with 0, got {cu.tolist()[:8]}; "
                         "build the batch with megatron_pack.data.batches.thd.collate_thd.")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens_padded must be non-decreasing, got {cu.tolist()[:16]}; "
                         "build the batch with megatron_pack.data.batches.thd.collate_thd.")
    return cu


def _check_divisible(cu: torch.Tensor, cp_size: int) -> None:
    lengths = cu[1:] - cu[:-1]
    bad = torch.nonzero(lengths % (2 * cp_size)).reshape(-1)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"sub-sequence {i} has padded length {int(lengths[i])}, not divisible by 2*CP = {2 * cp_size} "
            f"({bad.numel()} sub-sequence(s) affected); pad every sub-sequence to "
            f"megatron_pack.config.layout.pad_multiple(cp={cp_size}, tp, sequence_parallel) "
            "(packing.pad_seq_to_mult) and re-run `megatron-pack prepare`.")


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size ({cp_size!r}) must be a positive integer.")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank ({cp_rank!r}) must be in [0, cp_size={cp_size}).")


def thd_partition_indices(cu_seqlens_padded: Any, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token indices that CP rank ``cp_rank`` keeps, as an int64 tensor of ``T / cp_size``.

    Vectorised over the ``2 * N`` kept blocks (``repeat_interleave`` of one shift per block), no
    per-token Python loop. Identical to Transformer Engine's ``thd_get_partitioned_indices``.
    Call it on CPU cu_seqlens (the loader's): the checks read values. Zero-length sub-sequences (the repeated tail of padded cu_seqlens) contribute nothing.

    Example, ``cu_seqlens_padded=[0, 4, 12]``, CP=2 (chunk sizes 1 and 2)::

        rank 0: [0, 3,  4, 5, 10, 11]
        rank 1: [1, 2,  6, 7,  8,  9]
    """
    _check_rank(cp_size, cp_rank)
    cu = _as_cu(cu_seqlens_padded)
    if cp_size == 1:
        return torch.arange(int(cu[-1]), dtype=torch.int64)
    _check_divisible(cu, cp_size)
    chunk = (cu[1:] - cu[:-1]) // (2 * cp_size)
    # rank r keeps two contiguous blocks per sub-sequence, [early, late]; inside a block the global
    # index is local index + (global block start - local block start)
    block_start = cu[:-1].unsqueeze(1) + torch.stack([chunk * cp_rank, chunk * (2 * cp_size - 1 - cp_rank)], 1)
    block_len = chunk.repeat_interleave(2)
    num_local = int(block_len.sum())
    local_start = torch.cumsum(block_len, 0) - block_len
    shift = torch.repeat_interleave(block_start.reshape(-1) - local_start, block_len, output_size=num_local)
    return torch.arange(num_local, dtype=torch.int64) + shift


def thd_gather_order(cu_seqlens_padded: Any, cp_size: int) -> torch.Tensor:
    """Global index of every position in the rank-order concatenation of all local shards.

    ``torch.cat([shard_0, ..., shard_{CP-1}], dim)[..., j]`` sits at global position
    ``thd_gather_order(...)[j]``. For ``[0, 8, 16]`` and CP=2 this is
    ``[0,1,6,7,8,9,14,15, 2,3,4,5,10,11,12,13]``. It is a permutation of ``range(T)``.
    """
    return torch.cat([thd_partition_indices(cu_seqlens_padded, cp_size, r) for r in range(cp_size)])


def thd_unslice(shards: Sequence[torch.Tensor], cu_seqlens_padded: Any, dim: int = -1) -> torch.Tensor:
    """Reassemble the global tensor from every CP rank's local shard (rank order) along ``dim``.

    The inverse of slicing with ``thd_partition_indices``: for a [1, T] tensor ``x``,
    ``thd_unslice([x[:, thd_partition_indices(cu, C, r)] for r in range(C)], cu) == x``.
    """
    cp_size = len(shards)
    order = thd_gather_order(cu_seqlens_padded, cp_size)
    gathered = torch.cat(list(shards), dim=dim)
    out = torch.empty_like(gathered)
    out.index_copy_(dim % gathered.dim(), order.to(gathered.device), gathered)
    return out


def slice_thd_batch(batch: Mapping[str, Any], cp_size: int, cp_rank: int) -> dict:
    """This CP rank's part of a THD batch, as a new dict (``batch`` is not modified).

    ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` go from [1, T] to [1, T/CP];
    ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``, ``sample_ids`` and the ``num_*``
    counts stay global (they describe the whole pack). Example with CP=2 on
    ``tokens=[[10..17]]``, ``cu_seqlens_padded=[0, 8]``: rank 0 gets ``[[10, 11, 16, 17]]``,
    rank 1 gets ``[[12, 13, 14, 15]]``.
    """
    _check_rank(cp_size, cp_rank)
    tokens = batch["tokens"]
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(
            f"Packed THD batches expect micro-batch size 1 for context-parallel slicing, got tokens of shape "
            f"{tuple(tokens.shape)}; set train.micro_batch_size=1 (offline packs), or pack a right-padded "
            "[B, S] batch into one row first with megatron_pack.data.batches.in_batch.pack_batch_sequences "
            "(packing.mode=in_batch).")
    num_tokens = tokens.shape[1]
    cu = _as_cu(batch["cu_seqlens_padded"])
    if int(cu[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens_padded[-1] ({int(cu[-1])}) != number of tokens T ({num_tokens}); the batch's "
            "cu_seqlens_padded must describe every physical token: build it with "
            "megatron_pack.data.batches.thd.collate_thd (with pad_to_max_length the tail is its own sub-sequence).")
    out = dict(batch)
    if cp_size == 1:
        return out
    index = thd_partition_indices(cu, cp_size, cp_rank).to(tokens.device)
    for key in SLICED_KEYS:
        if key in batch:
            value = batch[key]
            if value.shape[-1] != num_tokens:
                raise ValueError(f"batch[{key!r}] has {value.shape[-1]} tokens but tokens has {num_tokens}; "
                                 "every per-token key of a THD batch must be [1, T].")
            out[key] = value.index_select(-1, index)
    return out


def thd_real_token_mask(cu_seqlens: torch.Tensor, cu_seqlens_padded, num_local: int, cp_size: int,
                        cp_rank: int) -> torch.Tensor:
    """Bool [num_local]: which of CP rank ``cp_rank``'s local rows hold a real token (False on padding).

    Device tensor ops only (``searchsorted``, no ``.item()``, no host copy), so it runs inside a
    captured CUDA graph on the cu_seqlens the attention kernel reads. Local rows are the rank's
    chunks in ``thd_partition_indices`` order: sub-sequence ``i`` (padded length ``L_i``, chunk
    ``c_i = L_i / (2*CP)``) owns local rows ``[cu_padded[i]/CP, cu_padded[i+1]/CP)``, the first
    ``c_i`` at in-sequence offset ``r*c_i`` and the next at ``(2*CP-1-r)*c_i``; a row is real when
    its offset is below the sub-sequence's real length. ``cu_seqlens_padded`` None means no padding.

    Example, ``cu_seqlens=[0, 3, 5]``, ``cu_seqlens_padded=[0, 4, 8]``: CP=1 ->
    ``[T, T, T, F, T, T, F, F]``; CP=2 rank 0 (global rows [0, 3, 4, 7]) -> ``[T, F, T, F]``,
    rank 1 (rows [1, 2, 5, 6]) -> ``[T, T, T, F]``.
    """
    if cu_seqlens_padded is None:
        return torch.ones(num_local, dtype=torch.bool, device=cu_seqlens.device)
    return thd_local_segments(cu_seqlens, cu_seqlens_padded, num_local, cp_size, cp_rank)[1]


def thd_local_segments(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, num_local: int, cp_size: int,
                       cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sub-sequence index [num_local], real-token mask [num_local]) of CP rank ``cp_rank``'s local rows.

    The rule of ``thd_real_token_mask`` (which returns the mask); the index of a padding row is the
    sub-sequence whose padding it is. Example, ``cu_seqlens=[0, 3, 5]``, ``cu_seqlens_padded=[0, 4, 8]``,
    CP=1 -> ``([0, 0, 0, 0, 1, 1, 1, 1], [T, T, T, F, T, T, F, F])``.
    """
    cu = cu_seqlens.to(torch.int64).reshape(-1)
    cu_pad = cu_seqlens_padded.to(device=cu.device, dtype=torch.int64).reshape(-1)
    row = torch.arange(num_local, device=cu.device)
    local_start = cu_pad // cp_size
    # the sub-sequence holding each local row; zero-length ones (a fixed cu_seqlens tail) hold none
    seq = torch.searchsorted(local_start[1:].contiguous(), row, right=True).clamp(max=cu.numel() - 2)
    offset = row - local_start[seq]
    if cp_size > 1:
        chunk = (cu_pad[seq + 1] - cu_pad[seq]) // (2 * cp_size)
        offset = torch.where(offset < chunk, offset + cp_rank * chunk, offset - chunk + (2 * cp_size - 1 - cp_rank) * chunk)
    return seq, offset < (cu[seq + 1] - cu[seq])
