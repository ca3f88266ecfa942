"""The HF <-> megatron-core transforms: hand-computed layouts, and load/export as exact inverses.

The hand-computed cases use tensors whose entries name their own HF row, so the expected
megatron-core layout can be written down: linear_qkv interleaved per query group, linear_fc1 =
[gate_r; up_r] per TP rank, the vocabulary padded to a multiple of TP with zero rows.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config.hf_config.record import FAMILIES, Rule
from megatron_pack.model.hf.mapping import export_tensors, load_shard
from megatron_pack.model.hf.rules import rules_for
from megatron_pack.model.hf.transforms import Dims


class DictReader:
    """The mapping's Reader over in-memory tensors (records every slice read)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.reads = tensors, []

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, rows=None, cols=None):
        self.reads.append((name, rows, cols))
        t = self.tensors[name]
        t = t if rows is None else t[rows]
        return (t if cols is None else t[:, cols]).clone()


def _rows(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1)


QKV = Rule("qkv", ("q", "k", "v"), "qkv")
GATE_UP = Rule("fc1", ("gate", "up"), "gate_up")
VOCAB = Rule("emb", ("emb",), "vocab")
ROW = Rule("proj", ("o",), "row")

# nq=4 query heads in ng=2 groups, head dim 1: q rows 10-13, k rows 20-21, v rows 30-31.
QKV_TENSORS = {"q": _rows([10, 11, 12, 13]), "k": _rows([20, 21]), "v": _rows([30, 31])}
HAND = [  # (id, rule, tensors, dims, tp_rank, expected shard rows)
    ("qkv-tp1", QKV, QKV_TENSORS, Dims(4, 2, 1, 4, 5, 1), 0, [10, 11, 20, 30, 12, 13, 21, 31]),
    ("qkv-tp2-rank1", QKV, QKV_TENSORS, Dims(4, 2, 1, 4, 5, 2), 1, [12, 13, 21, 31]),
    ("qkv-mha-tp2-rank0", QKV, {"q": _rows([10, 11]), "k": _rows([20, 21]), "v": _rows([30, 31])},
     Dims(2, 2, 1, 4, 5, 2), 0, [10, 20, 30]),
    ("gate-up-tp2-rank0", GATE_UP, {"gate": _rows([0, 1, 2, 3]), "up": _rows([10, 11, 12, 13])},
     Dims(4, 2, 1, 4, 5, 2), 0, [0, 1, 10, 11]),
    ("gate-up-tp2-rank1", GATE_UP, {"gate": _rows([0, 1, 2, 3]), "up": _rows([10, 11, 12, 13])},
     Dims(4, 2, 1, 4, 5, 2), 1, [2, 3, 12, 13]),
    ("vocab-5-tp2-rank0", VOCAB, {"emb": _rows([1, 2, 3, 4, 5])}, Dims(4, 2, 1, 4, 5, 2), 0, [1, 2, 3]),
    ("vocab-5-tp2-rank1-pad", VOCAB, {"emb": _rows([1, 2, 3, 4, 5])}, Dims(4, 2, 1, 4, 5, 2), 1, [4, 5, 0]),
]


@pytest.mark.parametrize("rule,tensors,dims,rank,expected", [c[1:] for c in HAND], ids=[c[0] for c in HAND])
def test_hand_computed_layouts(rule, tensors, dims, rank, expected):
    shard = load_shard(rule, rule.hf, DictReader(tensors), dims, rank)
    assert shard[:, 0].tolist() == expected


def test_row_parallel_reads_only_its_columns():
    o = torch.arange(8.0).reshape(2, 4)
    reader = DictReader({"o": o})
    shard = load_shard(ROW, ("o",), reader, Dims(4, 2, 1, 4, 5, 2), 1)
    assert shard.tolist() == [[2.0, 3.0], [6.0, 7.0]]
    assert reader.reads == [("o", None, slice(2, 4))]  # one slice, never the whole tensor


def test_qkv_reads_only_this_ranks_rows():
    reader = DictReader(QKV_TENSORS)
    load_shard(QKV, QKV.hf, reader, Dims(4, 2, 1, 4, 5, 2), 1)
    assert [(n, r) for n, r, _ in reader.reads] == [("q", slice(2, 4)), ("k", slice(1, 2)), ("v", slice(1, 2))]


@st.composite
def _model(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    groups = tp * draw(st.integers(1, 2))
    heads = groups * draw(st.integers(1, 3))
    return Dims(num_heads=heads, num_groups=groups, head_dim=draw(st.integers(1, 3)), ffn=tp * draw(st.integers(1, 3)),
                vocab=draw(st.integers(tp, 13)), tp=tp), draw(st.integers(1, 3)), draw(st.booleans())


_SEEN = {"tp>1": 0, "padded": 0, "bias": 0}


@settings(max_examples=60, deadline=None)
@given(_model())
def test_export_inverts_load_for_every_rule(drawn):
    dims, hidden, with_bias = drawn
    gen = torch.Generator().manual_seed(dims.vocab * 31 + hidden)
    d, q, kv = dims.head_dim, dims.num_heads * dims.head_dim, dims.num_groups * dims.head_dim
    tensors = {"q": torch.randn(q, hidden, generator=gen), "k": torch.randn(kv, hidden, generator=gen),
               "v": torch.randn(kv, hidden, generator=gen), "gate": torch.randn(dims.ffn, hidden, generator=gen),
               "up": torch.randn(dims.ffn, hidden, generator=gen), "emb": torch.randn(dims.vocab, hidden, generator=gen),
               "o": torch.randn(hidden, q, generator=gen), "qb": torch.randn(q, generator=gen),
               "kb": torch.randn(kv, generator=gen), "vb": torch.randn(kv, generator=gen)}
    rules = [QKV, GATE_UP, VOCAB, ROW, Rule("norm", ("emb",), "replicated")]
    if with_bias:
        rules.append(Rule("qkv_bias", ("qb", "kb", "vb"), "qkv"))
    reader = DictReader(tensors)
    for rule in rules:
        shards = [load_shard(rule, rule.hf, reader, dims, r) for r in range(dims.tp)]
        assert len({tuple(s.shape) for s in shards}) == 1  # every rank the same shape
        for name, tensor in zip(rule.hf, export_tensors(rule, shards, dims)):
            assert torch.equal(tensor, tensors[name]), (rule.kind, name)
    _SEEN["tp>1"] += dims.tp > 1
    _SEEN["padded"] += dims.padded_vocab != dims.vocab
    _SEEN["bias"] += with_bias


def test_property_was_not_vacuous():
    test_export_inverts_load_for_every_rule()
    assert all(count > 0 for count in _SEEN.values()), _SEEN


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tables_cover_a_layer_once(family):
    from megatron_pack.model.hf.rules import Placement

    whole = Placement(2, num_experts=4)  # a dense family's rules ignore the experts
    rules = rules_for(family, tied=False, placement=whole)
    mcore = [m for _, m, _ in rules]
    hf = [h for _, _, names in rules for h in names]
    assert len(set(mcore)) == len(mcore) and len(set(hf)) == len(hf)
    assert "output_layer.weight" in mcore
    assert "output_layer.weight" not in [m for _, m, _ in rules_for(family, tied=True, placement=whole)]
    moe = any(rule.per_expert for rule, _, _ in rules)
    assert moe == (family in ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss", "qwen3_5_moe_text", "qwen3_5_moe",
                              "qwen3_vl_moe"))
    if moe:  # 2 layers x 4 experts x (fc1, fc2), and each layer's router
        biased = family == "gpt_oss"  # and each expert's two biases, each router's bias
        assert sum(".local_experts." in m for m in mcore) == 16 * (1 + biased)
        assert sum(".router." in m for m in mcore) == 2 * (1 + biased)


def test_folder_with_only_a_pickle_is_refused(tmp_path):
    from megatron_pack.model.hf.load import SafetensorsFolder

    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin .*never loaded"):
        SafetensorsFolder(tmp_path)


def test_index_naming_a_missing_shard_is_refused(tmp_path):
    from megatron_pack.model.hf.load import SafetensorsFolder

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        SafetensorsFolder(tmp_path)


@pytest.mark.parametrize("rule,tensors,dims,rank,expected", [c[1:] for c in HAND], ids=[c[0] for c in HAND])
def test_in_place_chunked_load_equals_load_shard(rule, tensors, dims, rank, expected, monkeypatch):
    from megatron_pack.model.hf import mapping

    monkeypatch.setattr(mapping, "CHUNK_BYTES", 4)  # one row per read: the chunk loop really runs
    reader = DictReader(tensors)
    out = torch.full(mapping.shard_shape(rule, rule.hf, reader, dims), 99.0)
    mapping.load_shard_into(rule, rule.hf, reader, dims, rank, out)
    assert out[:, 0].tolist() == expected
    if rule.kind == "vocab":
        assert len(reader.reads) == sum(1 for v in expected if v != 0)  # row by row, pad rows never read


def test_row_parallel_chunks_read_only_its_columns(monkeypatch):
    from megatron_pack.model.hf import mapping

    monkeypatch.setattr(mapping, "CHUNK_BYTES", 8)
    o = torch.arange(16.0).reshape(4, 4)
    reader, out = DictReader({"o": o}), torch.empty(4, 2)
    mapping.load_shard_into(ROW, ("o",), reader, Dims(4, 2, 1, 4, 5, 2), 1, out)
    assert torch.equal(out, o[:, 2:])
    assert reader.reads == [("o", slice(0, 1), slice(2, 4)), ("o", slice(1, 2), slice(2, 4)),
                            ("o", slice(2, 3), slice(2, 4)), ("o", slice(3, 4), slice(2, 4))]
