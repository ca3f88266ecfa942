"""A model chunk's part of the mapping: pipeline stages (a layer offset, the embedding on the first
stage, the output on the last) and expert-parallel ranks (an expert offset, expert TP).

Stages are proved against transformers: a megatron-core ``GPTModel`` built with 2 of a 4-layer
Llama's layers (and the stage's embedding / output) reads exactly the HF tensors of its global
layers, and exports them under their global names with every bit of transformers' state dict.
Experts are proved on a synthetic record (no MoE model yet): tensors whose entries name their
expert and row, so where each lands can be written down.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf import _COMMON, _randomise  # noqa: E402

from megatron_pack.config.hf_config.record import FAMILIES, Family, Rule, register_family  # noqa: E402
from megatron_pack.model.hf.mapping import export_tensors, load_shard, shard_shape  # noqa: E402
from megatron_pack.model.hf.transforms import Dims  # noqa: E402
from megatron_pack.model.hf.rules import Placement, rules_for, shapes_for  # noqa: E402

NUM_LAYERS = 4
STAGES = [  # (id, tied, layer offset, layers, pre_process, post_process)
    ("first-stage", False, 0, 2, True, False),
    ("middle-stage", False, 1, 2, False, False),
    ("last-stage", False, 2, 2, False, True),
    ("last-stage-tied", True, 2, 2, False, True),
]


def _hf_layer(name: str):
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def _stage_names(state_dict: dict, tied: bool, offset: int, num: int, pre: bool, post: bool) -> set[str]:
    """The HF tensors a stage holds, from transformers' names alone (no rule of ours)."""
    names = {n for n in state_dict if _hf_layer(n) is not None and offset <= _hf_layer(n) < offset + num}
    if pre or (post and tied):  # a tied last stage's output layer is the embedding's copy
        names.add("model.embed_tokens.weight")
    if post:
        names.add("model.norm.weight")
        names |= set() if tied else {"lm_head.weight"}
    return names


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A 4-layer Llama saved by transformers (several shards), untied and tied, with its state dict."""
    import transformers as T

    root, out = tmp_path_factory.mktemp("stages"), {}
    for tied in (False, True):
        torch.manual_seed(3)
        model = T.LlamaForCausalLM(T.LlamaConfig(**{**_COMMON, "num_hidden_layers": NUM_LAYERS},
                                                 tie_word_embeddings=tied))
        _randomise(model, 4)
        model.save_pretrained(root / f"tied{tied}", max_shard_size="60KB")
        out[tied] = (root / f"tied{tied}", {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _stage_config(folder: Path, num_layers: int):
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig

    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=str(folder), attention_backend="torch")), [])
    return replace(cfg, model=replace(cfg.model, num_layers=num_layers))


def _stage_model(cfg, state, *, pre: bool, post: bool):
    """A megatron-core GPTModel chunk as a pipeline stage builds it (its layers, maybe embedding / output)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_pack.model.builder import local_block_spec, transformer_config_from
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda

    enable_cpu_compat_without_cuda()
    return GPTModel(config=transformer_config_from(cfg), transformer_layer_spec=local_block_spec(cfg.model.num_layers),
                    vocab_size=cfg.model.vocab_size, max_sequence_length=cfg.model.max_position_embeddings,
                    pre_process=pre, post_process=post, position_embedding_type="rope",
                    share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
                    rotary_base=cfg.model.rotary_base, pg_collection=state.pg_collection)


@pytest.mark.parametrize("tied,offset,num,pre,post", [c[1:] for c in STAGES], ids=[c[0] for c in STAGES])
def test_stage_loads_its_global_layers_and_exports_them_under_global_names(folders, tied, offset, num, pre, post):
    from megatron_pack.model.hf.export import hf_tensors
    from megatron_pack.model.hf.load import load_pretrained
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    folder, reference = folders[tied]
    cfg = _stage_config(folder, num)
    stage = Placement(num, layer_offset=offset, pre_process=pre, post_process=post)
    state = initialize_parallel(cfg)
    try:
        model = _stage_model(cfg, state, pre=pre, post=post)
        report = load_pretrained(model, folder, cfg.model, tp_rank=0, tp_size=1, placement=stage)
    finally:
        destroy_parallel(destroy_process_group=True)
    want = _stage_names(reference, tied, offset, num, pre, post)
    assert len(want) >= 2 * 9 and set(report.hf_names) == want  # guard: two whole layers
    assert report.bytes_read == sum(reference[n].numel() * reference[n].element_size() for n in want)
    params = {n: p.detach() for n, p in model.named_parameters()}
    for j in range(num):  # local layer j is HF layer offset + j
        assert torch.equal(params[f"decoder.layers.{j}.input_layernorm.weight"],
                           reference[f"model.layers.{offset + j}.input_layernorm.weight"])
    exported = hf_tensors([params], "llama", cfg.model, placement=stage)
    assert set(exported) == want - ({"model.embed_tokens.weight"} if tied and not pre else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("tied,offset,num,pre,post", [c[1:] for c in STAGES], ids=[c[0] for c in STAGES])
def test_stage_round_trips_at_tp2_without_a_model(folders, tied, offset, num, pre, post):
    """The TP=2 shards of a stage, straight from the folder, export to transformers' tensors."""
    from megatron_pack.model.hf.export import hf_tensors, shards_from_pretrained

    folder, reference = folders[tied]
    cfg = _stage_config(folder, NUM_LAYERS)
    stage = Placement(num, layer_offset=offset, pre_process=pre, post_process=post)
    shards = shards_from_pretrained(folder, cfg.model, tp=2, placement=stage)
    assert {int(n.split(".")[2]) for n in shards[0] if n.startswith("decoder.layers.")} == set(range(num))
    exported = hf_tensors(shards, "llama", cfg.model, placement=stage)
    assert set(exported) == _stage_names(reference, tied, offset, num, pre, post) - (
        {"model.embed_tokens.weight"} if tied and not pre else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name]), name


def test_placement_of_a_megatron_chunk_reads_its_global_layer_numbers():
    from megatron_pack.model.hf.load import placement_of

    layers = [SimpleNamespace(layer_number=n) for n in (6, 7, 8)]  # megatron-core: 1-based, global
    chunk = SimpleNamespace(decoder=SimpleNamespace(layers=layers), pre_process=False, post_process=True)
    assert placement_of(chunk) == Placement(3, layer_offset=5, pre_process=False, post_process=True)
    empty = SimpleNamespace(decoder=SimpleNamespace(layers=[]), pre_process=True, post_process=False)
    assert placement_of(empty) == Placement(0, pre_process=True, post_process=False)


NAMES = [  # (id, tied, placement, expected (megatron-core name, first HF name) of a few bindings)
    ("middle-has-no-embedding-or-output", False, Placement(1, layer_offset=3, pre_process=False, post_process=False),
     {("decoder.layers.0.mlp.linear_fc2.weight", "model.layers.3.mlp.down_proj.weight")}),
    ("tied-last-stage-copies-the-embedding", True, Placement(1, layer_offset=1, pre_process=False),
     {("output_layer.weight", "model.embed_tokens.weight"), ("decoder.final_layernorm.weight", "model.norm.weight")}),
    ("tied-single-stage-has-no-output", True, Placement(1), {("embedding.word_embeddings.weight",
                                                              "model.embed_tokens.weight")}),
]


@pytest.mark.parametrize("tied,placement,expected", [c[1:] for c in NAMES], ids=[c[0] for c in NAMES])
def test_stage_names_by_hand(tied, placement, expected):
    names = {(m, h[0]) for _, m, h in rules_for("llama", tied=tied, placement=placement)}
    assert expected <= names
    mcore = {m for m, _ in names}
    assert ("embedding.word_embeddings.weight" in mcore) == placement.pre_process
    assert ("decoder.final_layernorm.weight" in mcore) == placement.post_process
    assert ("output_layer.weight" in mcore) == (placement.post_process and not (tied and placement.pre_process))


# --- experts: a synthetic record with {e} rules, EP=2 ranks of 2 experts each, expert TP=2, dense TP=1 ---

_X = "decoder.layers.{i}.mlp.experts.local_experts.{e}."
_H = "model.layers.{i}.mlp.experts.{e}."
TOY_MOE = Family(
    model_type="toy_moe", summary="a synthetic MoE record (tests only)", architectures=("ToyMoeForCausalLM",),
    rules=(Rule("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.mlp.gate.weight",), "replicated",
                ("experts", "hidden")),
           Rule(_X + "linear_fc1.weight", (_H + "gate_proj.weight", _H + "up_proj.weight"), "gate_up",
                ("ffn", "hidden")),
           Rule(_X + "linear_fc2.weight", (_H + "down_proj.weight",), "row", ("hidden", "ffn"))))
MOE_DIMS = Dims(num_heads=2, num_groups=1, head_dim=2, ffn=4, vocab=8, tp=1, hidden=2, ep=2, etp=2, num_experts=4)


@pytest.fixture()
def toy_moe():
    register_family(TOY_MOE)
    yield TOY_MOE
    FAMILIES.pop(TOY_MOE.model_type)


class DictReader:
    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, rows=None, cols=None):
        t = self.tensors[name]
        t = t if rows is None else t[rows]
        return (t if cols is None else t[:, cols]).clone()


def _named(shape: tuple[int, int], base: int) -> torch.Tensor:
    return base + torch.arange(shape[0]).reshape(-1, 1) + torch.arange(shape[1]).reshape(1, -1) / 10


def _expert_tensors(num_layers: int = 2) -> dict[str, torch.Tensor]:
    """Entry [row, col] of layer i, expert e, projection p is 1000 i + 100 e + 10 p + row + col / 10
    (the router of layer i: 1000 i + 900 + row + col / 10)."""
    out = {}
    for i in range(num_layers):
        out[f"model.layers.{i}.mlp.gate.weight"] = _named((4, 2), 1000 * i + 900)
        for e in range(MOE_DIMS.num_experts):
            for p, (proj, shape) in enumerate([("gate_proj", (4, 2)), ("up_proj", (4, 2)), ("down_proj", (2, 4))]):
                out[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] = _named(shape, 1000 * i + 100 * e + 10 * p)
    return out


def test_expert_rules_expand_local_experts_to_global_names(toy_moe):
    rank1 = Placement(2).with_experts(MOE_DIMS, ep_rank=1)
    assert (rank1.num_experts, rank1.expert_offset) == (2, 2)
    names = {m: h for _, m, h in rules_for("toy_moe", tied=False, placement=rank1)}
    assert names["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"] == (
        "model.layers.1.mlp.experts.2.down_proj.weight",)
    assert names["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"] == (
        "model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight")
    assert len(names) == 2 * (1 + 2 * 2)  # per layer: the router, 2 local experts x 2 rules
    with pytest.raises(ValueError, match="per expert, but the placement holds no experts"):
        rules_for("toy_moe", tied=False, num_layers=2)
    whole = shapes_for(TOY_MOE, MOE_DIMS, tied=False, placement=Placement(2, num_experts=4))
    assert whole == {name: tuple(t.shape) for name, t in _expert_tensors().items()}  # every expert, global names


def test_expert_shards_split_over_expert_tp_and_export_back_exactly(toy_moe):
    tensors = _expert_tensors()
    reader = DictReader(tensors)
    exported, seen = {}, set()
    for ep_rank in range(MOE_DIMS.ep):
        placement = Placement(2).with_experts(MOE_DIMS, ep_rank)
        for rule, mcore, hf in rules_for("toy_moe", tied=False, placement=placement):
            # dense weights split over TP (1 rank here), an expert's over expert TP (2 ranks)
            ranks = MOE_DIMS.etp if rule.per_expert else MOE_DIMS.tp
            shards = [load_shard(rule, hf, reader, MOE_DIMS, 0, etp_rank=r) for r in range(ranks)]
            assert all(tuple(s.shape) == shard_shape(rule, hf, reader, MOE_DIMS) for s in shards)
            if mcore == "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight" and ep_rank == 1:
                # expert 3 of layer 1, expert-TP rank 1: [gate rows 2, 3; up rows 2, 3]
                assert shards[1][:, 0].tolist() == [1302, 1303, 1312, 1313]
            if mcore == "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight" and ep_rank == 0:
                assert shards[1][0].tolist() == pytest.approx([20.2, 20.3])  # down_proj columns 2, 3 of expert 0
            exported.update(zip(hf, export_tensors(rule, shards, MOE_DIMS)))
            seen.update(hf)
    assert seen == set(tensors) and len(seen) == 2 * (1 + 4 * 3)  # every expert of every layer, once
    for name, tensor in tensors.items():
        assert torch.equal(exported[name], tensor), name


def test_expert_axis_is_trivial_at_ep1():
    from megatron_pack.config.schema import Config
    from megatron_pack.parallel.dims import ParallelDims

    dims = Dims.from_model_config(SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=16,
                                                  hidden_size=64, ffn_hidden_size=96, vocab_size=301), tp=2)
    assert (dims.ep, dims.expert_tp, dims.num_local_experts, dims.expert_offset(0)) == (1, 2, 0, 0)
    assert dims.for_experts() == dims
    parallel = ParallelDims.from_config(Config(), world_size=2)
    assert (parallel.ep, parallel.expert_tp, parallel.ep_enabled) == (1, parallel.tp, False)
    with pytest.raises(ValueError, match="3 experts do not divide over 2"):
        replace(dims, ep=2, num_experts=3)
