"""The MoE routing rules on packs, by hand: pack metadata -> per-position sub-sequences, and the per-sample
load-balancing / z-losses (model/moe.py) on cases small enough to compute on paper."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.model.moe import (PackRouting, max_sub_sequences, per_sample_aux_losses, routing_index,
                                     set_step_tokens, step_token_counts)
from megatron_pack.parallel.cp import thd_local_segments

BATCH = {"cu_seqlens": torch.tensor([0, 3, 5]), "cu_seqlens_padded": torch.tensor([0, 4, 8]),
         "loss_mask": torch.tensor([[0, 1, 1, 0, 1, 0, 0, 0]])}


@pytest.mark.parametrize("batch,cp,rank,seq", [
    (BATCH, 1, 0, [0, 0, 0, -1, 1, 1, -1, -1]),
    (BATCH, 2, 0, [0, -1, 1, -1]),  # global rows 0, 3, 4, 7
    (BATCH, 2, 1, [0, 0, 1, -1]),  # global rows 1, 2, 5, 6
    # a fixed cu_seqlens tail (zero-length entries, CUDA graphs) holds no rows and takes no number
    ({"cu_seqlens": torch.tensor([0, 3, 5, 5, 5]), "cu_seqlens_padded": torch.tensor([0, 4, 8, 8, 8])}, 1, 0,
     [0, 0, 0, -1, 1, 1, -1, -1]),
    # a zero-length sub-sequence between two others takes no number: the numbering stays dense
    ({"cu_seqlens": torch.tensor([0, 2, 2, 5]), "cu_seqlens_padded": torch.tensor([0, 2, 2, 6])}, 1, 0,
     [0, 0, 1, 1, 1, -1]),
    ({"cu_seqlens": torch.tensor([0, 3, 3]), "cu_seqlens_padded": torch.tensor([0, 4, 8])}, 2, 1, [0, 0, -1, -1]),
], ids=["cp1", "cp2-rank0", "cp2-rank1", "fixed-tail", "zero-length-middle", "real-less-tail-cp2"])
def test_routing_index_from_metadata(batch, cp, rank, seq):
    got = routing_index(batch, cp, rank)
    assert got.shape == (1, len(seq)) and got.dtype == torch.int64
    assert got[0].tolist() == seq


@pytest.mark.parametrize("tokens,cp,tp,sp,bound", [
    (64, 1, 1, False, 64), (64, 2, 1, False, 16), (64, 2, 2, True, 16), (64, 1, 4, True, 16), (3, 2, 1, False, 1),
], ids=["cp1", "cp2", "cp2-tp2-sp", "tp4-sp", "tiny"])
def test_the_sub_sequence_bound_is_the_pad_rule(tokens, cp, tp, sp, bound):
    # each sub-sequence with rows holds a multiple of pad_multiple(cp, tp, sp): 2 * CP at CP > 1, CP * TP under SP
    assert max_sub_sequences(tokens, cp, tp, sp) == bound


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6), cp=st.sampled_from([1, 2, 4]),
       tp=st.sampled_from([1, 2]), tail=st.integers(0, 2))
def test_routing_index_counts_each_sample_once_and_stays_under_the_bound(lengths, cp, tp, tail):
    from megatron_pack.config.layout import pad_multiple, round_up

    multiple = pad_multiple(cp, tp, True)
    padded = [round_up(n, multiple) for n in lengths] + [0] * tail  # a fixed cu_seqlens tail of zero-length entries
    real = lengths + [0] * tail
    batch = {"cu_seqlens": torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()]),
             "cu_seqlens_padded": torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()])}
    index = torch.cat([routing_index(batch, cp, r)[0] for r in range(cp)])
    assert index.numel() == sum(padded)
    bound = max_sub_sequences(sum(padded), cp, tp, True)
    numbered = [n for n, p in zip(lengths, padded) if p > 0]  # the sub-sequences with rows, in order
    assert all(int(i) < bound for i in index)
    assert [int((index == s).sum()) for s in range(len(numbered))] == numbered
    assert int((index >= len(numbered)).sum()) == 0 and int((index == -1).sum()) == sum(padded) - sum(lengths)


def test_local_segments_name_the_owner_of_padding_rows():
    seq, real = thd_local_segments(BATCH["cu_seqlens"], BATCH["cu_seqlens_padded"], 8, 1, 0)
    assert seq.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert real.tolist() == [True, True, True, False, True, True, False, False]


def test_per_sample_losses_by_hand():
    # one sample of 2 real tokens (weight m=2) and a padding row that must count nowhere; E=2, top-1
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0], [9.0, -9.0]])
    routing = torch.tensor([[True, False], [False, True], [False, False]])
    aux, z, load = per_sample_aux_losses(logits, routing, torch.tensor([0, 0, -1]), topk=1, num_seqs=3)
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
    packed, _, _ = per_sample_aux_losses(logits, routing, seq, topk=2, num_seqs=2)
    loose, _, _ = per_sample_aux_losses(logits, routing, seq, topk=2, num_seqs=7)  # a bound's unused rows: nothing
    alone = [per_sample_aux_losses(logits[seq == s], routing[seq == s], torch.zeros(int((seq == s).sum()),
                                   dtype=torch.long), topk=2, num_seqs=1)[0] for s in (0, 1)]
    assert float(packed) == pytest.approx(float(alone[0] + alone[1]), rel=1e-6)
    assert float(loose) == float(packed)
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
        return per_sample_aux_losses(x, routing, seq, topk=2, num_seqs=len(members))[:2]

    splits = {"one pack": [[0, 1, 2, 3]], "two packs": [[0, 3], [1, 2]], "alone": [[0], [1], [2], [3]]}
    totals = {k: torch.stack([torch.stack(pack_loss(p)) for p in packs]).sum(0) / sum(lengths)
              for k, packs in splits.items()}
    assert float(totals["alone"][0]) > 0 and float(totals["alone"][1]) > 0
    for name, total in totals.items():
        torch.testing.assert_close(total, totals["alone"], rtol=1e-6, atol=0, msg=name)


def test_the_transformer_engine_spec_takes_our_moe_layer_and_router(monkeypatch):
    # Transformer Engine is not installed here: stand in for megatron-core's TE spec function with the layer spec it
    # returns for a MoE model (megatron-core's MoELayer and TopKRouter, TE experts): our step passes the routing
    # index as padding_mask, which megatron-core's own layer would read as a boolean mask (index != 0 = padding)
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megatron_pack.model.builder import te_layer_spec
    from megatron_pack.model.moe_router import PackedMoELayer, PackedTopKRouter

    experts = ModuleSpec(module=object)  # TE's experts, kept as they are

    def te_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False):
        mlp = ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts, router=TopKRouter))
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(mlp=mlp))

    monkeypatch.setattr(specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    mlp = te_layer_spec(num_experts=4).submodules.mlp
    assert (mlp.module, mlp.submodules.router, mlp.submodules.experts) == (PackedMoELayer, PackedTopKRouter, experts)
