"""What reaches Transformer Engine's THD attention for a tail-padded CP=2 pack (TE issue #3331).

Transformer Engine is not installed here: megatron-core's ``extensions/transformer_engine.py`` is executed a second
time against a stand-in for TE (its ``DotProductAttention`` records the arguments it is called with; every other TE
name is an empty class), so megatron-core's own ``TEDotProductAttention`` turns ``PackedSeqParams`` into TE's
arguments exactly as on a GPU, and the test reads what TE would receive.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from megatron_pack.data.batches.thd import collate_thd
from megatron_pack.parallel.cp import slice_thd_batch
from megatron_pack.training.step import get_packed_seq_params


class StandInTEAttention(torch.nn.Module):
    """TE's ``DotProductAttention`` as megatron-core calls it: records ``__init__`` and ``forward`` arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.init_kwargs = kwargs
        self.calls: list[dict] = []

    def forward(self, query, key, value, attention_mask=None, qkv_format=None, cu_seqlens_q=None,
                cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type=None, pad_between_seqs=None, **rest):
        self.calls.append(dict(qkv_format=qkv_format, cu_seqlens_q=cu_seqlens_q, cu_seqlens_q_padded=cu_seqlens_q_padded,
                               cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                               max_seqlen_q=max_seqlen_q, attn_mask_type=attn_mask_type,
                               pad_between_seqs=pad_between_seqs, num_rows=query.shape[0], **rest))
        return query.reshape(query.shape[0], -1)


class OldTEAttention(torch.nn.Module):
    def forward(self, query, key, value, attention_mask=None, qkv_format=None, cu_seqlens_q=None):
        return query


def _fake_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []

    def attribute(attr):  # an empty class for a TE class name, a nested stand-in module for anything else
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = type(attr, (torch.nn.Module,), {}) if attr[:1].isupper() else _fake_module(f"{name}.{attr}")
        setattr(module, attr, value)
        return value

    module.__getattr__ = attribute
    return module


@pytest.fixture
def mcore_te(monkeypatch):
    """megatron-core's TE extension module, executed against the stand-in TE 2.17.1 (one of the reported versions)."""
    import megatron.core.extensions.transformer_engine as real  # noqa: F401  (imported once, with TE absent)
    import megatron.core.utils as mutils

    te = _fake_module("transformer_engine")
    te.__version__ = "2.17.1"
    te.pytorch = _fake_module("transformer_engine.pytorch")
    te.pytorch.DotProductAttention = StandInTEAttention
    for name, module in {"transformer_engine": te, "transformer_engine.pytorch": te.pytorch,
                         "transformer_engine.pytorch.fp8": _fake_module("transformer_engine.pytorch.fp8"),
                         "transformer_engine.pytorch.router": _fake_module("transformer_engine.pytorch.router")}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(mutils, "_te_version", None)  # megatron-core caches the version it reads: restored after
    spec = importlib.util.spec_from_file_location("mcore_te_standin", real.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.HAVE_TE and StandInTEAttention in module.TEDotProductAttention.__mro__
    return module


def _attention(cls, mcore_te, monkeypatch, cp: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(mcore_te.TEDotProductAttention, "cp_stream", object())  # no CUDA stream on a CPU
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: list(range(cp)))
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=cp)
    return cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
               cp_comm_type="p2p", pg_collection=SimpleNamespace(tp=None, cp="the CP group"))


def _pack(lengths: list[int], pad_multiple: int) -> dict:
    samples = [{"input_ids": list(range(3, 3 + n - 1)) + [2], "loss_mask": [1] * n} for n in lengths]
    return collate_thd(samples, pack_size=64, pad_multiple=pad_multiple)


def _calls_for(module, batch: dict, cp: int) -> list[dict]:
    from megatron.core.transformer.enums import AttnMaskType

    params = get_packed_seq_params(batch)
    for rank in range(cp):
        rows = slice_thd_batch(batch, cp, rank)["tokens"].shape[1]
        q, k, v = (torch.randn(rows, 4, 8) for _ in range(3))
        module(q, k, v, None, AttnMaskType.causal, packed_seq_params=params)
    return module.calls


# (id, sub-sequence lengths in ids (each gives n-1 tokens), pad multiple, CP, what TE must be told)
CASES = [
    ("cp2-tail-padded", [6, 9, 12], 4, 2, True),
    ("cp2-no-padding", [5, 9, 13], 4, 2, False),
    ("cp1-tail-padded", [6, 9], 8, 1, True),
]


@pytest.mark.parametrize("lengths,pad_multiple,cp,told", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_te_is_told_that_sub_sequences_are_padded(mcore_te, monkeypatch, lengths, pad_multiple, cp, told):
    from megatron_pack.model.te_attention import padded_thd_attention_class

    batch = _pack(lengths, pad_multiple)
    real, padded = batch["cu_seqlens"], batch["cu_seqlens_padded"]
    # not vacuous: a padded case differs at an interior boundary, an unpadded one nowhere
    assert (not torch.equal(real[:-1], padded[:-1])) is told
    module = _attention(padded_thd_attention_class(mcore_te), mcore_te, monkeypatch, cp)
    if cp > 1:
        assert module.init_kwargs["cp_comm_type"] == "p2p" and module.init_kwargs["cp_group"] == "the CP group"
    calls = _calls_for(module, batch, cp)
    assert len(calls) == cp
    for call in calls:
        assert call["pad_between_seqs"] is told
        assert (call["qkv_format"], call["attn_mask_type"]) == ("thd", "padding_causal")
        assert torch.equal(call["cu_seqlens_q"], real) and torch.equal(call["cu_seqlens_kv"], real)
        if told:
            assert torch.equal(call["cu_seqlens_q_padded"], padded) and torch.equal(call["cu_seqlens_kv_padded"], padded)
        else:
            assert call["cu_seqlens_q_padded"] is None
        assert call["max_seqlen_q"] == batch["max_seqlen"]
    assert sum(c["num_rows"] for c in calls) == int(padded[-1])  # every rank's rows, CP-sliced


def test_megatron_core_alone_says_nothing(mcore_te, monkeypatch):
    """What the guard is for: megatron-core 0.16.1's class passes both boundary arrays and no pad_between_seqs,
    leaving TE to guess (the path of TE issue #3331)."""
    module = _attention(mcore_te.TEDotProductAttention, mcore_te, monkeypatch, 2)
    calls = _calls_for(module, _pack([6, 9, 12], 4), 2)
    assert calls and all(c["pad_between_seqs"] is None and c["cu_seqlens_q_padded"] is not None for c in calls)


def test_the_te_spec_uses_the_padded_attention(mcore_te, monkeypatch):
    import megatron.core.extensions.transformer_engine as real
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megatron_pack.model.builder import te_layer_spec

    def te_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False):
        attention = ModuleSpec(module=SelfAttention,
                               submodules=SelfAttentionSubmodules(linear_qkv=object, core_attention=mcore_te.TEDotProductAttention))
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(self_attention=attention))

    monkeypatch.setattr(specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    monkeypatch.setattr(real, "TEDotProductAttention", mcore_te.TEDotProductAttention)
    monkeypatch.setattr(real, "te", mcore_te.te)
    core = te_layer_spec().submodules.self_attention.submodules.core_attention
    assert core.__name__ == "PaddedTHDAttention"
    assert core.__mro__[1] is mcore_te.TEDotProductAttention and StandInTEAttention in core.__mro__


def test_a_te_without_pad_between_seqs_is_refused_in_one_line():
    from megatron_pack.config.schema import ConfigError
    from megatron_pack.model.te_attention import padded_thd_attention_class

    old = SimpleNamespace(TEDotProductAttention=type("TEDotProductAttention", (OldTEAttention,), {}),
                          te=SimpleNamespace(pytorch=SimpleNamespace(DotProductAttention=OldTEAttention)))
    with pytest.raises(ConfigError) as err:
        padded_thd_attention_class(old)
    (line,) = err.value.problems
    assert "pad_between_seqs" in line and "megatron_pack[gpu]" in line and "\n" not in line
