"""Vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5): the vision tower beside megatron-core's ``GPTModel``,
and the embeddings of a VLM THD batch.

The language model is megatron-core's ``GPTModel`` with multimodal RoPE (``position_embedding_type="mrope"``,
``model.mrope_section``). The vision tower and merger are transformers' own modules, built from the folder's
``vision_config`` and held by the first pipeline stage's chunk as ``vision_model`` (so checkpoints, DDP and
the optimizer see them as parameters of that chunk), replicated on every TP and CP rank: each rank runs the
whole pack's images, so the tower has no collective of its own and a rank whose slice holds no image token
enters exactly the collectives the others do.

A pack's embeddings (``vlm_decoder_input``), in this order:

1. the word embeddings of the whole pack [T, H] (TP: the vocabulary-parallel lookup, all-reduced);
2. the vision tower on the pack's ``pixel_values`` / ``image_grid_thw`` -> one feature row per image token;
3. the features written at ``tokens == image_token_id`` (the count must match, else one line naming the
   pack's sample_ids);
4. this CP rank's zigzag chunks (``parallel.cp.thd_partition_indices``), then the sequence-parallel scatter;
5. DeepStack (Qwen3-VL): each level of the tower's ``deepstack_features`` written at the image tokens of a zero
   [T, H], sliced as in 4 (every rank, with or without image tokens in its slice), and added by a forward hook to
   the output of decoder layer ``level`` (layers 0 .. ``model.deepstack_layers`` - 1, on the first stage).

Worked example: a pack of 12 tokens with one 4x4-patch image (merge 2: 4 image tokens at rows 3..6), CP=2,
``cu_seqlens_padded=[0, 12]``: the tower gives 4 rows, written into rows 3..6 of the [12, H] embeddings;
rank 0 keeps rows [0, 1, 2, 9, 10, 11], rank 1 rows [3..8]: every image row is on rank 1, and rank 0's
gradient for the merger is zero, summed with rank 1's by DDP over DP x CP.

RoPE: ``PackMropeEmbedding`` returns the whole pack's [T, 1, 1, D] table (no CP slice); megatron-core's
THD RoPE reads a table of ``cu_seqlens[-1]`` rows as per-token positions and takes this CP rank's chunks itself.
Qwen3-VL and Qwen3.5 interleave the three rows over the frequencies (``interleaved_mrope``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron_pack.config.hf_config import family_of, read_hf_config


def vision_tower_of(folder: str):
    """The family record's ``VisionTower`` of the folder's config.json (None for a text model)."""
    return family_of(read_hf_config(folder)["model_type"]).vision


def build_vision_tower(folder: str, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' vision tower + merger from the folder's ``vision_config`` (weights: ``load_pretrained``)."""
    import transformers

    hf = read_hf_config(folder)
    tower = family_of(hf["model_type"]).vision
    config = getattr(transformers, tower.config_class)(**hf["vision_config"])
    config._attn_implementation = "sdpa"  # what from_pretrained picks on this torch (the verify reference)
    return getattr(transformers, tower.module_class)(config).to(dtype)


def pack_mrope_class() -> type:
    """megatron-core's ``MultimodalRotaryEmbedding`` returning the whole pack's table (see the module docstring)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    class PackMropeEmbedding(MultimodalRotaryEmbedding):
        """M-RoPE frequencies [T, 1, 1, D] for every token of the pack; THD RoPE picks the CP rank's chunks.
        ``mrope_interleaved`` (set by ``attach_vision``): the rows' frequencies interleaved (``interleaved_mrope``)."""

        mrope_interleaved = False

        def forward(self, position_ids, mrope_section, cp_group=None):
            if self.mrope_interleaved:
                return interleaved_mrope(position_ids, self.inv_freq, mrope_section)
            group, self.cp_group = self.cp_group, None
            try:  # the BSHD slice of get_pos_emb_on_this_cp_rank is wrong for a THD pack: none here
                return super().forward(position_ids, mrope_section, cp_group=None)
            finally:
                self.cp_group = group

    return PackMropeEmbedding


def interleaved_mrope(position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section) -> torch.Tensor:
    """Interleaved M-RoPE (Qwen3-VL, Qwen3.5): the angles [T, b, 1, 2F] of the pack's rows ``position_ids`` [3, b, T]
    for the ``F = len(inv_freq)`` rotary frequencies (F = kv_channels x rotary_percent / 2). Frequency j turns with
    the height row where ``j % 3 == 1 and j < 3 * section[1]``, the width row where ``j % 3 == 2 and
    j < 3 * section[2]``, else the temporal row; the F angles are repeated for the two rotated halves (transformers'
    ``recomposition_frequencies``). Example, section [2, 1, 1] (F = 4): rows t, h, w, t for j = 0, 1, 2, 3."""
    freqs = position_ids.to(inv_freq.device).float()[..., None] * inv_freq.float()  # [3, b, T, F]
    rows = torch.zeros(inv_freq.numel(), dtype=torch.long, device=inv_freq.device)
    for row in (1, 2):
        rows[row:3 * int(mrope_section[row]):3] = row
    chosen = freqs.gather(0, rows.expand(1, *freqs.shape[1:-1], -1))[0]  # [b, T, F]
    emb = torch.cat((chosen, chosen), dim=-1)
    return emb[..., None, :].transpose(0, 1).contiguous()  # [T, b, 1, 2F]


_MROPE_CLASS: Optional[type] = None


def attach_vision(model, folder: str, image_token_id: int, dtype: torch.dtype, *, interleaved: bool = False,
                  deepstack_layers: int = 0) -> None:
    """Make a ``GPTModel`` built with ``position_embedding_type="mrope"`` a vision-language chunk: the pack's
    M-RoPE table (``interleaved``: Qwen3-VL's and Qwen3.5's layout), and on the first stage the vision tower
    (``vision_model``), the whole-pack word lookup and the DeepStack additions after its first ``deepstack_layers``
    decoder layers (``validate()`` keeps those layers on the first stage)."""
    global _MROPE_CLASS
    if _MROPE_CLASS is None:
        _MROPE_CLASS = pack_mrope_class()
    model.rotary_pos_emb.__class__ = _MROPE_CLASS
    model.rotary_pos_emb.mrope_interleaved = interleaved
    model.image_token_id = image_token_id
    model.vision_language = True
    model.deepstack_inputs = None
    if model.pre_process:
        model.vision_model = build_vision_tower(folder, dtype)
        # the pack is embedded whole and sliced after the image features are in (sequence parallel included)
        model.embedding.word_embeddings.reduce_scatter_embeddings = False
        for layer in model.decoder.layers:
            if layer.layer_number - 1 < deepstack_layers:  # global numbers, from 1
                layer.register_forward_hook(_deepstack_hook(model, layer.layer_number - 1))


def _deepstack_hook(core, level: int):
    """Forward hook of decoder layer ``level``: its output plus this rank's rows of DeepStack level ``level``
    (``core.deepstack_inputs``, set for the pack by ``vlm_decoder_input``; None: a pack without images)."""

    def hook(module, args, output):
        rows = core.deepstack_inputs
        if rows is None:
            return output
        hidden, context = output if isinstance(output, tuple) else (output, None)
        hidden = hidden + rows[level].to(hidden.dtype)
        return (hidden, context) if isinstance(output, tuple) else hidden

    return hook


def freeze_vision(model, folder: str, frozen: bool) -> int:
    """``model.freeze_vision``: the tower's parameters outside its merger stop training. Returns how many."""
    tower = getattr(model, "vision_model", None)
    if tower is None or not frozen:
        return 0
    keep = vision_tower_of(folder).trainable_when_frozen
    count = 0
    for name, param in tower.named_parameters():
        if not name.startswith(keep):
            param.requires_grad_(False)
            count += 1
    return count


def _pixels(batch: Mapping[str, Any], dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
    if pixels.dim() == 3 and pixels.shape[0] == 1:  # a DataLoader's batch dimension
        pixels, grid = pixels[0], grid[0]
    return pixels.to(device=device, dtype=dtype), grid.to(device=device, dtype=torch.int64)


def image_features(tower: torch.nn.Module, batch: Mapping[str, Any], device) -> tuple[Optional[torch.Tensor], list]:
    """The merged features [num_image_tokens, H] of the pack's images (None when it has none) and the DeepStack
    features (Qwen3-VL: one [num_image_tokens, H] per ``deepstack_visual_indexes`` block; [] for other towers)."""
    dtype = next(tower.parameters()).dtype
    pixels, grid = _pixels(batch, dtype, device)
    if grid.shape[0] == 0:
        return None, []
    out = tower(pixels, grid_thw=grid)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def _zero_anchor(tower: torch.nn.Module) -> torch.Tensor:
    """0 * (sum of the tower's trainable parameters): added to a pack without images, it gives those
    parameters a zero gradient (not None), so every rank's DDP buckets hold the same parameters."""
    trainable = [p.sum() for p in tower.parameters() if p.requires_grad]
    return torch.stack(trainable).sum() * 0.0 if trainable else torch.zeros(())


def scatter_features(embeds: torch.Tensor, tokens: torch.Tensor, features: Optional[torch.Tensor],
                     image_token_id: int, batch: Mapping[str, Any]) -> torch.Tensor:
    """``embeds`` [T, H] with row ``t`` replaced by the next feature row wherever ``tokens[t]`` is the image
    token. Example: tokens [7, 5, 5, 9] (image token 5), features [f0, f1] -> [e0, f0, f1, e3]."""
    is_image = tokens == image_token_id
    num_tokens, num_features = int(is_image.sum()), 0 if features is None else features.shape[0]
    if num_tokens != num_features:
        ids = batch.get("sample_ids")
        ids = ids.tolist() if torch.is_tensor(ids) else ids
        raise ValueError(f"the pack with sample_ids {ids} holds {num_tokens} image tokens (image_token_id "
                         f"{image_token_id}) but its images give {num_features} vision features; every image needs "
                         "exactly t*h*w/merge_size**2 placeholders: prepare the data again with this model's processor.")
    if features is None:
        return embeds
    return embeds.masked_scatter(is_image[:, None].expand_as(embeds), features.to(embeds.dtype))


def vlm_decoder_input(core, batch: Mapping[str, Any], cp_size: int, cp_rank: int, device) -> torch.Tensor:
    """This rank's decoder input [T/CP (/TP with sequence parallel), 1, H] of a VLM THD batch (module docstring)."""
    from megatron.core import tensor_parallel

    from megatron_pack.parallel.cp import thd_partition_indices

    tokens = batch["tokens"].to(device, non_blocking=True).reshape(-1)
    embeds = core.embedding.word_embeddings(tokens[None])[0]  # [T, H]
    features, deepstack = image_features(core.vision_model, batch, device)
    embeds = scatter_features(embeds, tokens, features, core.image_token_id, batch)
    if features is None:
        embeds = embeds + _zero_anchor(core.vision_model).to(embeds.dtype)
    index = thd_partition_indices(batch["cu_seqlens_padded"], cp_size, cp_rank).to(device) if cp_size > 1 else None

    def local_rows(rows: torch.Tensor) -> torch.Tensor:  # this rank's [s, 1, h]: CP chunks, then the SP scatter
        rows = (rows if index is None else rows.index_select(0, index))[:, None, :]
        if core.config.sequence_parallel:
            rows = tensor_parallel.scatter_to_sequence_parallel_region(rows, group=core.pg_collection.tp)
        return rows

    # DeepStack: each level's features at the image tokens of the whole pack (zeros elsewhere), then this rank's rows
    core.deepstack_inputs = [local_rows(scatter_features(torch.zeros_like(embeds), tokens, level, core.image_token_id,
                                                         batch)) for level in deepstack] or None
    embeds = local_rows(embeds)
    if core.config.sequence_parallel:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return core.embedding.embedding_dropout(embeds)
    return core.embedding.embedding_dropout(embeds)


def mrope_positions(batch: Mapping[str, Any], device) -> torch.Tensor:
    """The pack's M-RoPE rows [3, 1, T] (whole pack, every CP rank: the RoPE picks the chunks)."""
    rows = batch["mrope_position_ids"]
    if rows.dim() == 3 and rows.shape[0] == 1:  # a DataLoader's batch dimension
        rows = rows[0]
    if rows.dim() != 2 or rows.shape[0] != 3 or rows.shape[1] != batch["tokens"].shape[-1]:
        raise ValueError(f"batch['mrope_position_ids'] has shape {list(rows.shape)}; a VLM THD batch needs [3, T] "
                         f"with T = {batch['tokens'].shape[-1]} tokens (the collate's M-RoPE rows).")
    return rows[:, None, :].to(device, non_blocking=True)


def sample_alone(batch: Mapping[str, Any], index: int, image_token_id: int, merge_size: int) -> dict:
    """Sub-sequence ``index`` of a VLM THD batch as a batch of its own (no padding): its tokens, labels, mask,
    positions 0..n-1, its M-RoPE rows (per sample by the batch contract), and its images, taken in order by
    counting the image tokens of the sub-sequences before it. Example: sub-sequences with 6, 0 and 4 image
    tokens and grids [(1, 4, 6), (1, 4, 4)] (merge 2: 6 and 4 tokens) -> sample 2 gets the second image."""
    cu, cu_pad = (torch.as_tensor(batch[k]).reshape(-1).tolist() for k in ("cu_seqlens", "cu_seqlens_padded"))
    tokens = batch["tokens"].reshape(-1)
    grids = batch["image_grid_thw"].reshape(-1, 3)
    per_image = (grids.prod(-1) // merge_size ** 2).tolist()
    before = int((tokens[:cu_pad[index]] == image_token_id).sum())
    start, n = cu_pad[index], cu[index + 1] - cu[index]
    mine = int((tokens[start:start + n] == image_token_id).sum())
    seen, first, last = 0, 0, 0
    while first < len(per_image) and seen < before:
        seen, first = seen + per_image[first], first + 1
    seen, last = 0, first
    while last < len(per_image) and seen < mine:
        seen, last = seen + per_image[last], last + 1
    patches = (grids.prod(-1)).tolist()
    rows = slice(sum(patches[:first]), sum(patches[:last]))
    return {"tokens": tokens[None, start:start + n], "labels": batch["labels"].reshape(-1)[None, start:start + n],
            "loss_mask": batch["loss_mask"].reshape(-1)[None, start:start + n],
            "position_ids": torch.arange(n)[None], "cu_seqlens": torch.tensor([0, n], dtype=torch.int32),
            "cu_seqlens_padded": torch.tensor([0, n], dtype=torch.int32), "max_seqlen": n,
            "pixel_values": batch["pixel_values"].reshape(-1, batch["pixel_values"].shape[-1])[rows],
            "image_grid_thw": grids[first:last], "sample_ids": batch["sample_ids"].reshape(-1)[index:index + 1],
            "mrope_position_ids": batch["mrope_position_ids"].reshape(3, -1)[:, start:start + n]}
