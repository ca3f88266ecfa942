"""`megatron-pack verify model.pretrained=DIR verify.reference=transformers`.

For the first ``verify.num_packs`` packs: our packed THD forward of the model loaded from DIR
(at the configured TP / CP when launched by torchrun, else TP = CP = 1) against transformers'
``AutoModelForCausalLM.from_pretrained(DIR)`` forward of each sample alone, float32, no remote
code. Per pack it prints the largest logit difference over every real token (the real
vocabulary; TP padding columns excluded), each sample's mean answer-token loss both ways, and
PASS / FAIL against ``verify.tolerance``. Rank 0 runs transformers and prints; every rank runs
our forward (its TP / CP collectives need them all). Example::

    torchrun --nproc-per-node 4 -m megatron_pack.cli.main verify model.pretrained=models/Llama-3.2-1B \\
        verify.reference=transformers parallel=tp2_cp2_sp data.dataset_dir=data/llama
    pack 0: 7 samples, 3981 real tokens  max |logit diff| 3.1e-05  max |loss diff| 2.0e-07  PASS
"""

from __future__ import annotations

import os

import torch


def _full_logits(logits: torch.Tensor, batch: dict, state) -> torch.Tensor:
    """[T, V_padded] from this rank's [1, T/CP, V/TP] (TP all-gather, CP all-gather + unslice)."""
    import torch.distributed as dist

    from megatron_pack.parallel.cp import thd_unslice

    logits = logits.detach().float().contiguous()
    if state.tp_size > 1:
        shards = [torch.empty_like(logits) for _ in range(state.tp_size)]
        dist.all_gather(shards, logits, group=state.tp_group)
        logits = torch.cat(shards, dim=-1)
    if state.cp_size > 1:
        shards = [torch.empty_like(logits) for _ in range(state.cp_size)]
        dist.all_gather(shards, logits, group=state.cp_group)
        logits = thd_unslice(shards, batch["cu_seqlens_padded"], dim=1)
    return logits[0]


def _ours(model, batch: dict, state) -> torch.Tensor:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.training.step import get_packed_seq_params

    local = slice_thd_batch(batch, state.cp_size, state.cp_rank)
    params = get_packed_seq_params(batch)
    params = PackedSeqParams(**{k: (v.to(state.device) if torch.is_tensor(v) else v) for k, v in vars(params).items()})
    with torch.no_grad():
        logits = model(local["tokens"].to(state.device), local["position_ids"].to(state.device), None,
                       packed_seq_params=params)
    return _full_logits(logits.cpu(), batch, state)


def compare_with_transformers(packed: torch.Tensor, batch: dict, reference, vocab: int, index: int):
    """One pack: our packed logits [T, V'] against transformers on each sample alone."""
    from megatron_pack.cli.verify import PackResult, SampleResult, _mean_loss

    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    ids = batch.get("sample_ids", torch.full((len(cu) - 1,), -1)).tolist()
    result = PackResult(index=index)
    for i in range(len(cu) - 1):
        start, num_tokens = cu_pad[i], cu[i + 1] - cu[i]
        if num_tokens == 0:  # a pad_to_max_length tail: no sample
            continue
        rows = slice(start, start + num_tokens)
        with torch.no_grad():
            theirs = reference(batch["tokens"][:, rows]).logits[0].float()
        ours = packed[rows, :vocab]
        labels, mask = batch["labels"][0, rows], batch["loss_mask"][0, rows]
        result.samples.append(SampleResult(
            sample_id=int(ids[i]) if i < len(ids) else -1, num_tokens=num_tokens,
            max_logit_diff=float((ours - theirs).abs().max()),
            loss_packed=_mean_loss(ours, labels, mask), loss_alone=_mean_loss(theirs, labels, mask)))
    return result


def run_verify_transformers(cfg, *, out=print) -> int:
    """Verify against transformers; 0 when every pack passes, else 1 (rank 0 decides, all ranks return it)."""
    import torch.distributed as dist

    from megatron_pack.cli.verify import format_pack, single_process_config
    from megatron_pack.data.dataset import PackedSFTDataset
    from megatron_pack.data.thd import make_collate_fn
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    dataset = PackedSFTDataset.from_config(cfg)
    collate = make_collate_fn(dataset.metadata, pad_to_max_length=cfg.data.pad_to_max_length,
                              pad_cu_seqlens=cfg.packing.pad_cu_seqlens)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    run_cfg = cfg if launched else single_process_config(cfg)
    owns_process_group = not dist.is_initialized()
    state = initialize_parallel(run_cfg)
    tol, num_packs = cfg.verify.tolerance, min(cfg.verify.num_packs, len(dataset))
    try:
        model = build_model(run_cfg, state)
        model.eval()
        reference = None
        if state.rank == 0:
            import transformers

            reference = transformers.AutoModelForCausalLM.from_pretrained(
                cfg.model.pretrained, dtype=torch.float32, local_files_only=True, trust_remote_code=False)
            reference.eval()
            out(f"verify: {dataset.plan_dir} ({len(dataset)} packs, checking {num_packs}); ours: {cfg.model.pretrained} "
                f"at TP={state.tp_size} CP={state.cp_size} ({model.attention_backend} attention, "
                f"{cfg.model.params_dtype}); reference: transformers {transformers.__version__} float32, each sample alone")
        num_passed = 0
        for i in range(num_packs):
            batch = collate(dataset[i])
            packed = _ours(model, batch, state)
            if state.rank == 0:
                result = compare_with_transformers(packed, batch, reference, cfg.model.vocab_size, i)
                out(format_pack(result, tol))
                num_passed += result.passed(tol)
        verdict = torch.tensor([int(num_packs > 0 and num_passed == num_packs)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(verdict, src=0)
    finally:
        destroy_parallel(destroy_process_group=owns_process_group)
    if state.rank == 0:
        out(f"verify: {num_passed}/{num_packs} packs PASS (tolerance {tol}, reference transformers): "
            f"{'PASS' if verdict.item() else 'FAIL'}")
    return 0 if verdict.item() else 1
