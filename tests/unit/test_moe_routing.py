"""The MoE routing rules on packs, by hand: pack metadata -> per-position sub-sequences, and the per-sample
load-balancing / z-losses (model/moe.py) on cases small enough to compute on paper."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_pack.model.moe import PackRouting, per_sample_aux_losses, sequence_layout, set_step_tokens, step_token_counts
from megatron_pack.parallel.cp import thd_local_segments

BATCH = {"cu_seqlens": torch.tensor([0, 3, 5]), "cu_seqlens_padded": torch.tensor([0, 4, 8]),
         "loss_mask": torch.tensor([[0, 1, 1, 0, 1, 0, 0, 0]])}


@pytest.mark.parametrize("cp,rank,seq,weight", [
    (1, 0, [0, 0, 0, -1, 1, 1, -1, -1], [3.0, 2.0]),
    (2, 0, [0, -1, 1, -1], [3.0, 2.0]),  # global rows 0, 3, 4, 7
    (2, 1, [0, 0, 1, -1], [3.0, 2.0]),  # global rows 1, 2, 5, 6
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


def test_step_tokens_from_metadata_and_the_scale_the_routers_attach():
    # two packs: 3 targets of 5 real tokens (BATCH) and 1 target of 2 real tokens; M / N = 4 / 7
    other = {"cu_seqlens": torch.tensor([0, 2]), "cu_seqlens_padded": torch.tensor([0, 4]),
             "loss_mask": torch.tensor([[0, 1, 0, 0]])}
    assert step_token_counts([BATCH, other]) == (4.0, 7.0)

    class Model(torch.nn.Module):
        pack_routing = PackRouting()

    model = Model()
    assert set_step_tokens(model, [BATCH, other]) == (4.0, 7.0)
    assert model.pack_routing.step_scale == pytest.approx(4.0 / 7.0)
    assert set_step_tokens(torch.nn.Linear(1, 1), [BATCH]) is None  # dense: nothing to count, no collective


def test_the_global_batch_loss_does_not_depend_on_how_samples_are_split_into_packs():
    # LB = sum_s n_s L_s / N over the step: any split of the samples over packs (micro-batches, DP ranks) gives it
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 5, 2, 4]
    logits = [torch.randn(n, 4, generator=gen) for n in lengths]

    def pack_loss(members):
        x = torch.cat([logits[s] for s in members])
        routing = torch.zeros(x.shape[0], 4, dtype=torch.bool).scatter(1, x.topk(2, dim=-1).indices, True)
        seq = torch.cat([torch.full((lengths[s],), i) for i, s in enumerate(members)])
        weight = torch.tensor([float(lengths[s]) for s in members])
        return per_sample_aux_losses(x, routing, seq, weight, topk=2)[:2]

    splits = {"one pack": [[0, 1, 2, 3]], "two packs": [[0, 3], [1, 2]], "alone": [[0], [1], [2], [3]]}
    totals = {k: torch.stack([torch.stack(pack_loss(p)) for p in packs]).sum(0) / sum(lengths)
              for k, packs in splits.items()}
    assert float(totals["alone"][0]) > 0 and float(totals["alone"][1]) > 0
    for name, total in totals.items():
        torch.testing.assert_close(total, totals["alone"], rtol=1e-6, atol=0, msg=name)
