"""The tiny megatron-core GPTModel on 4 gloo ranks: packing changes nothing, and neither do TP, CP, SP.

One spawned world of 4 CPU processes runs every parallel layout in turn (``CASES``), rebuilding
megatron-core's groups between them, and compares each with the ``tp1_cp1`` reference that
rank 0 computes on its own (no collectives, no DP) in the same run:

1. packed == alone: each sample's logits inside a pack equal its logits run alone (<= 1e-5);
2. no leak: changing every token of one sample leaves the other samples' logits unchanged
   (<= 1e-6) while its own logits do change;
3. parallel invariance: reassembled logits (TP vocab shards + CP zigzag chunks), the loss and
   every parameter gradient (megatron-core DDP + ``finalize_model_grads``, TP shards gathered)
   equal the reference (relative <= 1e-5);
4. RoPE positions: under CP, every local token is rotated by the position it has when its sample
   runs alone.

Every worker-side number is returned to pytest and asserted per case id, with guards that the
comparisons covered real tokens and every parameter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import full_param, spawn_world
from _packs import random_packs

WORLD_SIZE = 4
PAD_MULTIPLE = 8  # lcm of every case's requirement: 2*CP=8 for cp4, CP*TP=4 for tp2_cp2_sp
CASES = [  # (id, tp, cp, sequence_parallel); dp = 4 / (tp * cp)
    ("tp1_cp1", 1, 1, False),
    ("tp1_cp2", 1, 2, False),
    ("tp1_cp4", 1, 4, False),
    ("tp2_cp1", 2, 1, False),
    ("tp2_cp2", 2, 2, False),
    ("tp2_cp2_sp", 2, 2, True),
]
CASE_IDS = [c[0] for c in CASES]
NUM_PACKS = 4
LEAK_PACK, LEAK_SAMPLE = 0, 1


def _samples(seed: int = 7) -> list[list[dict]]:
    """NUM_PACKS packs of 3-5 samples of mixed lengths (ids end with eos=2; answer mask on the tail)."""
    return random_packs(seed, NUM_PACKS, samples=(3, 6), length=(4, 30))


def _changed(pack: list[dict]) -> list[dict]:
    out = [dict(s) for s in pack]
    out[LEAK_SAMPLE] = dict(out[LEAK_SAMPLE], input_ids=[(t * 7 + 11) % 377 + 3 for t in out[LEAK_SAMPLE]["input_ids"]])
    return out


def _config(tp: int, cp: int, sp: bool):
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig

    return Config(model=ModelConfig(attention_backend="torch"), train=TrainConfig(seed=1234),
                  parallel=ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp))


def _forward(model, batch, pg, *, labels: bool = False):
    """This rank's CP slice through the model: logits [1, T/CP, V/TP] or per-token losses [1, T/CP]."""
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.training.step import get_packed_seq_params

    local = slice_thd_batch(batch, pg.cp_size, pg.cp_rank)
    return model(local["tokens"], local["position_ids"], None, packed_seq_params=get_packed_seq_params(batch),
                 labels=local["labels"] if labels else None)


def _full_logits(logits, batch, pg):
    """Reassemble [1, T, V] from every rank's [1, T/CP, V/TP] (TP all-gather, CP all-gather + unslice)."""
    from megatron_pack.parallel.groups import gather_full_logits

    return gather_full_logits(logits, batch["cu_seqlens_padded"], pg)


def _sample_rows(batch) -> list[tuple[int, int]]:
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    return [(cu_pad[i], cu[i + 1] - cu[i]) for i in range(len(batch["sample_ids"]))]


def _reference(model, pg, batches, alone_batches) -> dict:
    """tp1_cp1 on rank 0 alone: packed and alone logits, loss and grads (summed, / target tokens)."""
    ref = {"logits": [_forward(model, b, pg).detach() for b in batches],
           "alone": [[_forward(model, a, pg).detach() for a in pack] for pack in alone_batches]}
    model.zero_grad(set_to_none=True)
    loss_sum, num_tokens = 0.0, 0.0
    for b in batches:
        loss = (_forward(model, b, pg, labels=True) * b["loss_mask"]).sum()
        loss.backward()
        loss_sum, num_tokens = loss_sum + loss.item(), num_tokens + float(b["loss_mask"].sum())
    ref["loss"] = loss_sum / num_tokens
    ref["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref["grads"] = {n: p.grad.detach() / num_tokens for n, p in model.named_parameters()}
    return ref


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def _packed_vs_alone(logits_list, alone_list, batches) -> tuple[float, int]:
    worst, num_tokens = 0.0, 0
    for logits, alone, batch in zip(logits_list, alone_list, batches):
        for (start, n), solo in zip(_sample_rows(batch), alone):
            worst = max(worst, float((logits[0, start:start + n] - solo[0, :n]).abs().max()))
            num_tokens += n
    return worst, num_tokens


def _leak(logits, changed_logits, batch) -> tuple[float, float]:
    others, own = 0.0, 0.0
    for i, (start, n) in enumerate(_sample_rows(batch)):
        diff = float((logits[0, start:start + n] - changed_logits[0, start:start + n]).abs().max())
        if i == LEAK_SAMPLE:
            own = diff
        else:
            others = max(others, diff)
    return others, own


def _rope_positions(model, batch, pg) -> torch.Tensor:
    """The position megatron-core's THD RoPE gives each local token, read back from a probe vector.

    Records the arguments of the model's first ``apply_rotary_pos_emb`` call, rotates a probe
    whose pairs are (1, 0) with them, and reads the angle of the lowest frequency.
    """
    import megatron.core.transformer.attention as mattn

    original, calls = mattn.apply_rotary_pos_emb, []

    def spy(t, freqs, config, cu_seqlens=None, **kwargs):
        calls.append((t.size(0), freqs, config, cu_seqlens, kwargs))
        return original(t, freqs, config, cu_seqlens, **kwargs)

    mattn.apply_rotary_pos_emb = spy
    try:
        with torch.no_grad():
            _forward(model, batch, pg)
    finally:
        mattn.apply_rotary_pos_emb = original
    num_local, freqs, config, cu_seqlens, kwargs = calls[0]
    dim = freqs.size(-1)
    probe = torch.zeros(num_local, 1, dim)
    probe[..., : dim // 2] = 1.0
    rotated = original(probe, freqs, config, cu_seqlens, **kwargs)[:, 0]
    angle = torch.atan2(rotated[:, dim - 1].double(), rotated[:, dim // 2 - 1].double())
    inv_freq = float(model.rotary_pos_emb.inv_freq[-1])
    return torch.round(angle / inv_freq).long()


def _check_positions(model, batch, pg) -> tuple[int, int, int]:
    """(mismatches, real tokens compared, those in a late zigzag chunk) for this rank's slice."""
    from megatron_pack.parallel.cp import thd_partition_indices

    got = _rope_positions(model, batch, pg)
    rows = thd_partition_indices(batch["cu_seqlens_padded"], pg.cp_size, pg.cp_rank)
    cu, cu_pad = batch["cu_seqlens"].long(), batch["cu_seqlens_padded"].long()
    seq = torch.searchsorted(cu_pad, rows, right=True) - 1
    offset = rows - cu_pad[seq]
    real = offset < (cu[seq + 1] - cu[seq])
    solo_position = offset  # a sample alone is rotated by 0..n-1 (checked on the reference)
    late = offset >= (cu_pad[seq + 1] - cu_pad[seq]) // 2
    return int((got[real] != solo_position[real]).sum()), int(real.sum()), int((real & late).sum())


def _grads_and_loss(model, pg, batches) -> tuple[dict, float]:
    """megatron-core DDP + finalize_model_grads over this DP rank's packs; full grads and global loss."""
    import torch.distributed as dist
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron_pack.parallel.cp import slice_thd_batch

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, average_in_collective=False, overlap_grad_reduce=False), model,
        pg_collection=pg.pg_collection)
    ddp.zero_grad_buffer()
    totals = torch.zeros(2, dtype=torch.float64)
    for b in batches[pg.dp_rank::pg.dp_size]:
        mask = slice_thd_batch(b, pg.cp_size, pg.cp_rank)["loss_mask"]
        loss = (_forward(ddp, b, pg, labels=True) * mask).sum()
        loss.backward()
        totals += torch.tensor([loss.item(), float(mask.sum())], dtype=torch.float64)
    finalize_model_grads([ddp], num_tokens=totals[1:].to(torch.float32).clone(), pg_collection=pg.pg_collection)
    dist.all_reduce(totals, group=pg.dp_cp_group)
    grads = {n: full_param(p.main_grad, p, pg) for n, p in model.named_parameters()}
    return grads, float(totals[0] / totals[1])


def _run_case(cfg, pg, batches, changed, ref, rank) -> dict:
    from megatron_pack.model.builder import build_model

    model = build_model(cfg, pg)
    params = {n: full_param(p, p, pg) for n, p in model.named_parameters()}
    logits = [_full_logits(_forward(model, b, pg), b, pg) for b in batches]
    changed_logits = _full_logits(_forward(model, changed, pg), changed, pg)
    positions = torch.tensor([_check_positions(model, b, pg) for b in batches]).sum(dim=0)
    torch.distributed.all_reduce(positions, group=pg.cp_group)  # every CP rank's tokens
    grads, loss = _grads_and_loss(model, pg, batches)
    if rank != 0:
        return {}
    out = {"positions": positions.numpy(), "sequence_parallel": bool(model.config.sequence_parallel),
           "num_sp_params": sum(bool(getattr(p, "sequence_parallel", False)) for p in model.parameters())}
    out["init_max_diff"] = max(float((params[n] - ref["params"][n]).abs().max()) for n in ref["params"])
    out["packed_vs_alone"], out["num_alone_tokens"] = _packed_vs_alone(logits, ref["alone"], batches)
    out["leak_others"], out["leak_own"] = _leak(logits[LEAK_PACK], changed_logits, batches[LEAK_PACK])
    out["logits_rel"] = max(_max_rel(got, want) for got, want in zip(logits, ref["logits"]))
    out["loss_rel"] = abs(loss - ref["loss"]) / abs(ref["loss"])
    out["grad_rel"] = max(_max_rel(grads[n], ref["grads"][n]) for n in ref["grads"])
    out["num_grads"] = sum(1 for n in ref["grads"] if grads[n].shape == ref["grads"][n].shape
                           and float(ref["grads"][n].abs().max()) > 0)
    return out


def _world_worker(rank: int, world_size: int) -> dict:
    """Rank 0 computes the reference, then every case runs on all 4 ranks; rank 0 returns the numbers."""
    import torch.distributed as dist
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    packs = _samples()
    batches = [collate_thd(p, pack_size=512, pad_multiple=PAD_MULTIPLE) for p in packs]
    unpadded = [collate_thd(p, pack_size=512) for p in packs]
    alone = [[collate_thd([s], pack_size=512) for s in p] for p in packs]
    changed = collate_thd(_changed(packs[LEAK_PACK]), pack_size=512, pad_multiple=PAD_MULTIPLE)
    out, ref = {}, {}
    for case_id, tp, cp, sp in CASES:
        cfg = _config(tp, cp, sp)
        pg = initialize_parallel(cfg)
        if case_id == "tp1_cp1" and rank == 0:
            model = build_model(cfg, pg)
            ref = _reference(model, pg, batches, alone)
            unpadded_logits = [_forward(model, b, pg).detach() for b in unpadded]
            out["unpadded/packed_vs_alone"], out["unpadded/num_alone_tokens"] = _packed_vs_alone(
                unpadded_logits, ref["alone"], unpadded)
            solo = [_rope_positions(model, a, pg) for a in alone[0]]
            out["solo_positions_ok"] = all(torch.equal(p, torch.arange(p.numel())) for p in solo)
        dist.barrier()
        for key, value in _run_case(cfg, pg, batches, changed, ref, rank).items():
            out[f"{case_id}/{key}"] = value
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return spawn_world(_world_worker, WORLD_SIZE, tmp_path_factory.mktemp("model_parallel"))[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unpadded"] + CASE_IDS)
def test_packed_equals_alone(world, case):
    assert float(world[f"{case}/num_alone_tokens"]) > 100  # every sample of 4 packs was compared
    assert float(world[f"{case}/packed_vs_alone"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", CASE_IDS)
def test_no_leak_between_samples(world, case):
    assert float(world[f"{case}/leak_own"]) > 1e-3  # the changed sample's own logits did change
    assert float(world[f"{case}/leak_others"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("case", CASE_IDS)
def test_parallel_invariance(world, case):
    assert float(world[f"{case}/init_max_diff"]) == 0.0  # CPU init: the same full weights at every TP size
    assert int(world[f"{case}/num_grads"]) == int(world["tp1_cp1/num_grads"]) == 15  # every parameter of the 2-layer model
    assert float(world[f"{case}/logits_rel"]) <= 1e-5
    assert float(world[f"{case}/loss_rel"]) <= 1e-5
    assert float(world[f"{case}/grad_rel"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", CASE_IDS)
def test_sequence_parallel_norms_are_marked(world, case):
    """SP runs with megatron's marking on every norm parameter, so finalize_model_grads reduces them."""
    expected_sp = case.endswith("_sp")
    assert bool(world[f"{case}/sequence_parallel"]) == expected_sp
    assert int(world[f"{case}/num_sp_params"]) == (5 if expected_sp else 0)  # 2 layers x 2 norms + final norm


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASE_IDS if "cp1" not in c])
def test_rope_positions_under_cp_equal_solo(world, case):
    assert bool(world["solo_positions_ok"])  # the probe reads 0..n-1 for a sample alone
    mismatches, num_compared, num_late = (int(v) for v in world[f"{case}/positions"])
    assert num_compared == int(world[f"{case}/num_alone_tokens"])  # every real token of every pack
    assert num_late > 10  # tokens of the late zigzag chunks were among them
    assert mismatches == 0


if __name__ == "__main__":  # print every number the tests assert on
    import sys
    import tempfile

    for key, value in sorted(spawn_world(_world_worker, WORLD_SIZE, tempfile.mkdtemp())[0].items()):
        print(f"{key:40s} {value}", file=sys.stderr)
