"""LoRA: the adapter math, the peft-format mapping, the config group, and B = 0 == the base exactly.

Hand-computed cases (the adapter formula, a merge, which rows of a fused B go to q / k / v),
hypothesis properties (export and import of adapters are exact inverses at TP 1 / 2 / 4 for any
head layout), and the one-process model check of issue 14's test 1.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config.schema import ConfigError, PeftConfig
from megatron_pack.model.peft.export import (PEFT_PREFIX, adapter_config, hf_module_names, peft_tensors,
                                             shards_from_peft)
from megatron_pack.model.peft.lora import LoRAAdapter, count_parameters, merged_shards

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf import make_family  # noqa: E402

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


# ----- the adapter ------------------------------------------------------------------------------

def _adapter(parallel: str, dim: int = 2, alpha: float = 4.0, in_f: int = 3, out_f: int = 2) -> LoRAAdapter:
    return LoRAAdapter(in_features=in_f, out_features=out_f, dim=dim, alpha=alpha, dropout=0.0, parallel=parallel,
                       tp_group=None, tp_size=1, sequence_parallel=False, dtype=torch.float32)


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_adapter_output_is_scaled_b_a_x(parallel):
    adapter = _adapter(parallel)
    with torch.no_grad():
        adapter.linear_in.weight.copy_(torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]]))  # A [2, 3]
        adapter.linear_out.weight.copy_(torch.tensor([[1.0, 1.0], [0.0, -1.0]]))  # B [2, 2]
    x = torch.tensor([[[1.0, 2.0, 3.0]]])  # [s=1, b=1, 3]
    # A x = [7, 2]; B A x = [9, -2]; scale alpha / r = 4 / 2 = 2
    assert adapter(x).flatten().tolist() == [18.0, -4.0]
    assert adapter.delta_weight().tolist() == [[2.0, 2.0, 4.0], [0.0, -2.0, 0.0]]


@pytest.mark.parametrize("parallel, split, whole", [("column", "linear_out", "linear_in"),
                                                    ("row", "linear_in", "linear_out")], ids=["column", "row"])
def test_tp_attributes_follow_the_base(parallel, split, whole):
    adapter = LoRAAdapter(in_features=3, out_features=2, dim=2, alpha=2.0, dropout=0.0, parallel=parallel,
                          tp_group=None, tp_size=2, sequence_parallel=True, dtype=torch.float32, partition_stride=2)
    s, w = getattr(adapter, split).weight, getattr(adapter, whole).weight
    assert s.tensor_model_parallel and s.partition_dim == (0 if parallel == "column" else 1) and s.partition_stride == 2
    assert not w.tensor_model_parallel and w.sequence_parallel  # partial over the sequence shard: summed over TP


def test_merge_adds_scaled_b_a_to_the_base_weight():
    base = {"l.linear_qkv.weight": torch.eye(2), "l.norm.weight": torch.ones(2)}
    adapters = {"l.linear_qkv.adapter.linear_in.weight": torch.tensor([[1.0, 2.0]]),
                "l.linear_qkv.adapter.linear_out.weight": torch.tensor([[1.0], [0.0]])}
    merged = merged_shards(base, adapters, scale=2.0)
    assert merged["l.linear_qkv.weight"].tolist() == [[3.0, 4.0], [0.0, 1.0]]
    assert merged["l.norm.weight"] is base["l.norm.weight"]


def test_count_parameters_counts_split_tensors_per_rank_and_replicated_once():
    model = torch.nn.Module()
    model.split = torch.nn.Parameter(torch.zeros(4, 2))
    model.split.tensor_model_parallel = True
    model.frozen = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
    assert count_parameters(model) == (8, 18)


# ----- the peft format --------------------------------------------------------------------------

def _model_cfg(*, heads: int, groups: int, head_dim: int, ffn: int, hidden: int = 8, layers: int = 1):
    return SimpleNamespace(num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim,
                           hidden_size=hidden, ffn_hidden_size=ffn, vocab_size=11, num_layers=layers)


def test_fused_b_rows_go_to_q_k_v_and_gate_up_by_hand():
    """2 query heads in 1 group, head dim 1, r=1, TP=1: linear_qkv rows are [q0, q1, k0, v0]."""
    cfg = _model_cfg(heads=2, groups=1, head_dim=1, ffn=2, hidden=2)
    row = lambda *v: torch.tensor(v, dtype=torch.float32).reshape(-1, 1)  # noqa: E731
    shard = {"decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight": torch.tensor([[5.0, 6.0]]),
             "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight": row(1, 2, 3, 4),
             "decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight": torch.tensor([[7.0, 8.0]]),
             "decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight": row(10, 11, 20, 21)}
    out = peft_tensors([shard], "llama", cfg, ["linear_qkv", "linear_fc1"])
    attn, mlp = PEFT_PREFIX + "model.layers.0.self_attn.", PEFT_PREFIX + "model.layers.0.mlp."
    assert out[attn + "q_proj.lora_B.weight"].flatten().tolist() == [1, 2]
    assert out[attn + "k_proj.lora_B.weight"].flatten().tolist() == [3]
    assert out[attn + "v_proj.lora_B.weight"].flatten().tolist() == [4]
    assert all(out[attn + f"{p}_proj.lora_A.weight"].tolist() == [[5.0, 6.0]] for p in "qkv")
    assert out[mlp + "gate_proj.lora_B.weight"].flatten().tolist() == [10, 11]
    assert out[mlp + "up_proj.lora_B.weight"].flatten().tolist() == [20, 21]
    assert len(out) == 10


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), groups_per_rank=st.integers(1, 2), heads_per_group=st.integers(1, 3),
       head_dim=st.integers(1, 3), ffn_per_rank=st.integers(1, 3), dim=st.integers(1, 3), seed=st.integers(0, 99))
def test_peft_export_and_import_are_exact_inverses(tp, groups_per_rank, heads_per_group, head_dim, ffn_per_rank,
                                                   dim, seed):
    groups = groups_per_rank * tp
    hidden = 2 * tp  # divisible by TP for the row-parallel A
    cfg = _model_cfg(heads=groups * heads_per_group, groups=groups, head_dim=head_dim, ffn=ffn_per_rank * tp,
                     hidden=hidden, layers=2)
    gen = torch.Generator().manual_seed(seed)
    q, kv, h, f = groups * heads_per_group * head_dim, groups * head_dim, hidden, ffn_per_rank * tp
    tensors = {}
    for layer in range(2):
        attn, mlp = f"{PEFT_PREFIX}model.layers.{layer}.self_attn.", f"{PEFT_PREFIX}model.layers.{layer}.mlp."
        shared_qkv, shared_fc1 = torch.randn(dim, h, generator=gen), torch.randn(dim, h, generator=gen)
        for name, out_f in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            tensors[attn + name + ".lora_A.weight"] = shared_qkv
            tensors[attn + name + ".lora_B.weight"] = torch.randn(out_f, dim, generator=gen)
        for name in ("gate_proj", "up_proj"):
            tensors[mlp + name + ".lora_A.weight"] = shared_fc1
            tensors[mlp + name + ".lora_B.weight"] = torch.randn(f, dim, generator=gen)
        tensors[attn + "o_proj.lora_A.weight"] = torch.randn(dim, q, generator=gen)
        tensors[attn + "o_proj.lora_B.weight"] = torch.randn(h, dim, generator=gen)
        tensors[mlp + "down_proj.lora_A.weight"] = torch.randn(dim, f, generator=gen)
        tensors[mlp + "down_proj.lora_B.weight"] = torch.randn(h, dim, generator=gen)
    shards = [shards_from_peft(tensors, "llama", cfg, TARGETS, tp_rank=r, tp_size=tp) for r in range(tp)]
    assert len(shards[0]) == 2 * 4 * 2
    if tp > 1:  # the split tensor really is split: a rank holds 1/TP of B (column) or of A (row)
        b = "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight"
        assert shards[0][b].shape[0] * tp == q + 2 * kv
    back = peft_tensors(shards, "llama", cfg, TARGETS)
    assert sorted(back) == sorted(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_import_refuses_fused_parts_with_different_lora_a():
    cfg = _model_cfg(heads=2, groups=1, head_dim=1, ffn=2, hidden=2)
    attn = PEFT_PREFIX + "model.layers.0.self_attn."
    tensors = {attn + f"{p}_proj.lora_A.weight": torch.full((1, 2), float(i)) for i, p in enumerate("qkv")}
    tensors.update({attn + f"{p}_proj.lora_B.weight": torch.zeros(2 if p == "q" else 1, 1) for p in "qkv"})
    with pytest.raises(ValueError, match="one lora_A for its parts"):
        shards_from_peft(tensors, "llama", cfg, ["linear_qkv"], tp_rank=0, tp_size=1)


def test_adapter_config_names_hf_modules():
    meta = {"dim": 16, "alpha": 32.0, "dropout": 0.05, "target_modules": ["linear_qkv", "linear_fc2"]}
    config = adapter_config(meta, "qwen2", "/models/base")
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (16, 32.0, 0.05)
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == "/models/base"
    assert hf_module_names("llama", TARGETS) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"]


def test_expert_adapters_in_peft_layout_by_hand():
    """peft's ParamWrapper layout for E=2 experts, r=2: lora_A rows [A_0; A_1], lora_B columns interleaved
    (expert e's B is columns e, e + E), and an expert-TP rank's part like the expert's weight."""
    from megatron_pack.model.peft.export import expert_tp_shard, stack_experts, unstack_expert

    a0, a1 = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0], [7.0, 8.0]])
    b0, b1 = torch.tensor([[10.0, 11.0]]), torch.tensor([[20.0, 21.0]])
    lora_a, lora_b = stack_experts([a0, a1], [b0, b1])
    assert lora_a.tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]] and lora_b.tolist() == [[10, 20, 11, 21]]
    for e, (a, b) in enumerate([(a0, b0), (a1, b1)]):
        got_a, got_b = unstack_expert(lora_a, lora_b, e, 2)
        assert torch.equal(got_a, a) and torch.equal(got_b, b)
    b_fc1 = torch.arange(4.0).reshape(4, 1)  # [gate rows 0, 1; up rows 2, 3]
    assert expert_tp_shard("x.linear_fc1", a0, b_fc1, 1, 2)[1].flatten().tolist() == [1, 3]  # [gate_1; up_1]
    a_fc2 = torch.arange(8.0).reshape(2, 4)
    assert expert_tp_shard("x.linear_fc2", a_fc2, b0, 1, 2)[0].tolist() == [[2, 3], [6, 7]]


def test_adapter_config_names_expert_parameters():
    meta = {"dim": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["linear_fc1", "linear_fc2"]}
    config = adapter_config(meta, "qwen3_moe", None)
    assert config["target_modules"] is None
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert adapter_config(meta, "qwen2_moe", None)["target_modules"] == ["gate_proj", "up_proj", "down_proj"]
    assert adapter_config(dict(meta, target_modules=["linear_qkv"]), "mixtral", None)["target_parameters"] is None


# ----- config -----------------------------------------------------------------------------------

BAD_PEFT = [
    ("method", dict(method="qlora"), "peft.method ('qlora') must be one of"),
    ("dim", dict(dim=0), "peft.dim (0) must be a positive integer"),
    ("alpha", dict(alpha=0.0), "peft.alpha (0.0) must be > 0"),
    ("dropout", dict(dropout=1.0), "peft.dropout (1.0) must be in [0, 1)"),
    ("hf_name", dict(target_modules=["q_proj"]), "peft.target_modules (['q_proj']) must be distinct names"),
    ("empty", dict(target_modules=[]), "peft.target_modules ([]) must be distinct names"),
    ("duplicate", dict(target_modules=["linear_qkv", "linear_qkv"]), "must be distinct names"),
]


@pytest.mark.parametrize("kwargs, message", [c[1:] for c in BAD_PEFT], ids=[c[0] for c in BAD_PEFT])
def test_peft_config_problems(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        PeftConfig(**kwargs)


def test_lora_preset_is_megatron_bridge_default():
    from megatron_pack.config import load_config

    p = load_config(["peft=lora"]).peft
    assert (p.method, p.dim, p.alpha, p.dropout) == ("lora", 32, 32.0, 0.0)
    assert list(p.target_modules) == TARGETS
    assert load_config([]).peft.method == "none"


def test_export_adapter_and_merge_together_is_refused():
    from megatron_pack.config.schema import ExportConfig

    with pytest.raises(ConfigError, match="choose one"):
        ExportConfig(adapter=True, merge=True)


# ----- B = 0: the adapted model is the base, exactly ---------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama_rope", "qwen3_qknorm"])
def test_b_zero_logits_equal_base_exactly(tmp_path, family):
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    folder = make_family(tmp_path, family)
    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=str(folder), attention_backend="torch",
                                                    seq_length=64)), [])
    batch = collate_thd([{"input_ids": [5, 6, 7, 8, 9, 2], "loss_mask": [1] * 6},
                         {"input_ids": [15, 16, 17, 30, 2], "loss_mask": [1] * 5}], pack_size=16)
    state = initialize_parallel(cfg)
    try:
        base = build_model(cfg, state)
        lora = build_model(dataclasses.replace(cfg, peft=PeftConfig(method="lora", dim=4, alpha=8.0)), state)
        run = lambda m: m(batch["tokens"], batch["position_ids"], None,  # noqa: E731
                          packed_seq_params=get_packed_seq_params(batch))
        adapters = [p for n, p in lora.named_parameters() if ".adapter." in n]
        assert lora.num_adapters == 8 and len(adapters) == 16
        assert all(p.requires_grad for p in adapters)
        assert not any(p.requires_grad for n, p in lora.named_parameters() if ".adapter." not in n)
        assert all(float(p.abs().max()) > 0 for n, p in lora.named_parameters() if n.endswith("linear_in.weight"))
        with torch.no_grad():
            assert torch.equal(run(lora), run(base))
            for n, p in lora.named_parameters():  # guard: a non-zero B does reach the logits
                if n.endswith("linear_out.weight"):
                    p.normal_(generator=torch.Generator().manual_seed(0))
            assert float((run(lora) - run(base)).abs().max()) > 1e-3
    finally:
        destroy_parallel(destroy_process_group=True)
