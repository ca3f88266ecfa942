"""The MoE routing rules on packs, by hand: pack metadata -> per-position sub-sequences, and the per-sample
load-balancing / z-losses (model/moe.py) on cases small enough to compute on paper."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_pack.model.moe import per_sample_aux_losses, sequence_layout
from megatron_pack.parallel.cp import thd_local_segments

BATCH = {"cu_seqlens": torch.tensor([0, 3, 5]), "cu_seqlens_padded": torch.tensor([0, 4, 8]),
         "loss_mask": torch.tensor([[0, 1, 1, 0, 1, 0, 0, 0]])}


@pytest.mark.parametrize("cp,rank,seq,weight", [
    (1, 0, [0, 0, 0, -1, 1, 1, -1, -1], [2.0, 1.0]),
    (2, 0, [0, -1, 1, -1], [2.0, 1.0]),  # global rows 0, 3, 4, 7
    (2, 1, [0, 0, 1, -1], [2.0, 1.0]),  # global rows 1, 2, 5, 6
], ids=["cp1", "cp2-rank0", "cp2-rank1"])
def test_sequence_layout_from_metadata(cp, rank, seq, weight):
    got_seq, got_weight = sequence_layout(BATCH, cp, rank)
    assert got_seq.tolist() == seq and got_weight.tolist() == weight


def test_local_segments_name_the_owner_of_padding_rows():
    seq, real = thd_local_segments(BATCH["cu_seqlens"], BATCH["cu_seqlens_padded"], 8, 1, 0)
    assert seq.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert real.tolist() == [True, True, True, False, True, True, False, False]


def test_per_sample_losses_by_hand():
    # one sample of 2 real tokens (weight m=2) and a padding row that must count nowhere; E=2, top-1
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0], [9.0, -9.0]])
    routing = torch.tensor([[True, False], [False, True], [False, False]])
    aux, z, load = per_sample_aux_losses(logits, routing, torch.tensor([0, 0, -1]), torch.tensor([2.0]), topk=1)
    # c = [1, 1], P = [s + (1 - s), (1 - s) + s] = [1, 1]: L = E / (k n^2) * sum c P = 2 / 4 * 2 = 1
    assert float(aux) == pytest.approx(2.0 * 1.0, rel=1e-6)
    assert float(z) == pytest.approx(2.0 * math.log(math.e + 1) ** 2, rel=1e-6)
    assert load.tolist() == [1.0, 1.0]


def test_a_sample_alone_and_packed_with_others_gets_the_same_loss():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 4, generator=gen)
    top = logits.topk(2, dim=-1).indices
    routing = torch.zeros(7, 4, dtype=torch.bool).scatter(1, top, True)
    seq = torch.tensor([0, 0, 0, 1, 1, -1, 1])
    weight = torch.tensor([3.0, 2.0])
    packed, _, _ = per_sample_aux_losses(logits, routing, seq, weight, topk=2)
    alone = [per_sample_aux_losses(logits[seq == s], routing[seq == s], torch.zeros(int((seq == s).sum()),
                                   dtype=torch.long), weight[s:s + 1], topk=2)[0] for s in (0, 1)]
    assert float(packed) == pytest.approx(float(alone[0] + alone[1]), rel=1e-6)
    assert all(float(a) > 0 for a in alone)
