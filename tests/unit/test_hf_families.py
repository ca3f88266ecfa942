"""Families are records and transforms are registered classes: the supported records are complete,
no string dispatch on a transform's name is left, the checks before launch stay torch-free, and a
family defined here (one record and one new transform, no package code touched) loads and exports.

The family defined here, ``toy``, names every tensor its own way and stores gate and up as one
fused tensor (as Phi-3 does): ``transformer.h.{i}.mlp.gate_up.weight`` [2F, H] = [gate; up]. Its
folder is a transformers Llama's tensors renamed and fused, so its megatron-core shards must equal
the Llama folder's bit for bit, and its export must give back the toy folder's tensors.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf import make_family  # noqa: E402

from megatron_pack.config.hf_config import UnsupportedModel, derive_model_keys, pretrained_model_keys  # noqa: E402
from megatron_pack.config.hf_config.record import FAMILIES, Family, Refuse, Rule, register_family  # noqa: E402
from megatron_pack.config.hf_config.families import DENSE_REFUSALS  # noqa: E402
from megatron_pack.model.hf.transforms import TRANSFORMS, Transform, register_transform  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_every_record_names_registered_transforms_and_shapes():
    assert list(FAMILIES) == ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "qwen2_moe",
                             "qwen2_5_vl", "gemma3_text", "qwen3_5_text", "qwen3_5_moe_text", "gpt_oss", "qwen3_5",
                             "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"]
    rules = [rule for family in FAMILIES.values() for rule in family.rules]
    assert len(rules) >= 4 * 9
    assert {rule.kind for rule in rules} == {"replicated", "row", "vocab", "qkv", "gate_up", "heads", "interleaved_gate_up",
                                                 "row_transposed", "qkv_gated", "gdn_columns",
                                                 "stacked_gate_up", "stacked_down"} <= set(TRANSFORMS)
    assert all(rule.shape is not None for rule in rules)
    models = (ROOT / "docs/models.md").read_text()
    assert all(f"| `{model_type}` |" in models for model_type in FAMILIES)  # the docs list every record


def _dispatch_on_kind(path: Path) -> list[str]:
    """``x.kind == "..."`` / ``x.kind in (...)`` comparisons: a transform chosen by string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_transform_is_chosen_by_string_comparison():
    files = sorted((ROOT / "megatron_pack/model").rglob("*.py"))
    uses = sum(path.read_text().count(".kind") for path in files)
    assert uses >= 4, "too few rule.kind uses found: the check would pass vacuously"
    assert [hit for path in files for hit in _dispatch_on_kind(path)] == []


def test_folder_checks_and_records_stay_torch_free(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}))
    code = ("import sys; from megatron_pack.model.hf.folder_check import folder_problems; "
            "from megatron_pack.model.hf.rules import hf_shapes; from megatron_pack.config.hf_config import refusal; "
            f"hf = {{**__import__('json').load(open({str(tmp_path / 'config.json')!r}))}}; "
            f"print(len(hf_shapes(hf)), len(folder_problems({str(tmp_path)!r})), refusal(hf, 'x'), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["14", "1", "None", "False"], out.stdout + out.stderr


# --- a family defined in the test: one record, one new transform ---

def _half(rank: int, per_rank: int, offset: int = 0) -> slice:
    return slice(offset + rank * per_rank, offset + (rank + 1) * per_rank)


class FusedGateUp(Transform):
    """One HF tensor [gate; up] [2F, H] -> linear_fc1 = [gate_r; up_r] per rank; the rule's shape is one half's."""

    name, split_dim = "fused_gate_up", 0

    def hf_shapes(self, shape, num_parts, dims):
        return [(2 * shape[0],) + tuple(shape[1:])]

    def shard_shape(self, hf_shapes, dims):
        return (hf_shapes[0][0] // dims.tp,) + tuple(hf_shapes[0][1:])

    def load(self, names, reader, dims, rank):
        ffn = reader.shape(names[0])[0] // 2
        per = ffn // dims.tp
        return torch.cat([reader.read(names[0], _half(rank, per)), reader.read(names[0], _half(rank, per, ffn))])

    def export(self, shards, dims):
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves] + [h[1] for h in halves])]


_L, _T = "decoder.layers.{i}.", "transformer.h.{i}."
TOY = Family(
    model_type="toy", summary="Toy (ToyForCausalLM; a test's own family)", architectures=("ToyForCausalLM",),
    rules=(Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), "vocab", ("vocab", "hidden")),
           Rule(_L + "input_layernorm.weight", (_T + "ln_1.weight",), "replicated", ("hidden",)),
           Rule(_L + "self_attention.linear_qkv.weight", (_T + "attn.q.weight", _T + "attn.k.weight",
                                                          _T + "attn.v.weight"), "qkv", ("head_dim", "hidden")),
           Rule(_L + "self_attention.linear_proj.weight", (_T + "attn.o.weight",), "row", ("hidden", "q")),
           Rule(_L + "pre_mlp_layernorm.weight", (_T + "ln_2.weight",), "replicated", ("hidden",)),
           Rule(_L + "mlp.linear_fc1.weight", (_T + "mlp.gate_up.weight",), "fused_gate_up", ("ffn", "hidden")),
           Rule(_L + "mlp.linear_fc2.weight", (_T + "mlp.down.weight",), "row", ("hidden", "ffn")),
           Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), "replicated", ("hidden",)),
           Rule("output_layer.weight", ("head.weight",), "vocab", ("vocab", "hidden"))),
    refused=DENSE_REFUSALS + (Refuse("toy_window", "is not supported (full causal attention only)."),))
TOY_NAMES = {"model.embed_tokens.": "transformer.wte.", "model.layers.": "transformer.h.", "self_attn.": "attn.",
             "input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "q_proj": "q", "k_proj": "k",
             "v_proj": "v", "o_proj": "o", "down_proj": "down", "model.norm.": "transformer.ln_f.", "lm_head.": "head."}


@pytest.fixture()
def toy():
    register_transform(FusedGateUp)
    register_family(TOY)
    yield TOY
    FAMILIES.pop(TOY.model_type)
    TRANSFORMS.pop(FusedGateUp.name)


def _toy_name(name: str) -> str:
    for old, new in TOY_NAMES.items():
        name = name.replace(old, new)
    return name


def _toy_folder(llama: Path, out: Path) -> dict[str, torch.Tensor]:
    """The Llama folder's tensors under toy names, gate and up fused; config.json says model_type toy."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for file in sorted(llama.glob("*.safetensors")):
        tensors.update(load_file(file))
    toy = {_toy_name(n): t for n, t in tensors.items() if not n.endswith(("gate_proj.weight", "up_proj.weight"))}
    for n in [n for n in tensors if n.endswith("gate_proj.weight")]:
        toy[_toy_name(n.replace("gate_proj", "gate_up"))] = torch.cat([tensors[n], tensors[n.replace("gate", "up")]])
    out.mkdir()
    save_file(toy, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((llama / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "toy", "architectures": ["ToyForCausalLM"]}))
    return toy


def test_a_family_defined_outside_the_package_loads_and_exports(toy, tmp_path):
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.hf.export import hf_tensors, shards_from_pretrained
    from megatron_pack.model.hf.folder_check import folder_problems
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    llama = make_family(tmp_path, "llama_rope", seed=5)
    toy_tensors = _toy_folder(llama, tmp_path / "toy")
    assert len(toy_tensors) == 2 * 8 + 3 and "transformer.h.1.mlp.gate_up.weight" in toy_tensors
    assert folder_problems(tmp_path / "toy") == []  # the torch-free check reads the new record and transform
    assert pretrained_model_keys(tmp_path / "toy") == pretrained_model_keys(llama)
    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=str(tmp_path / "toy"), attention_backend="torch")), [])
    for tp in (1, 2):
        ours = shards_from_pretrained(tmp_path / "toy", cfg.model, tp)
        reference = shards_from_pretrained(llama, cfg.model, tp)
        assert [sorted(s) for s in ours] == [sorted(s) for s in reference]
        assert all(torch.equal(a[n], b[n]) for a, b in zip(ours, reference) for n in a)
        exported = hf_tensors(ours, "toy", cfg.model)
        assert sorted(exported) == sorted(toy_tensors)
        assert all(torch.equal(exported[n], t) for n, t in toy_tensors.items())
    state = initialize_parallel(cfg)
    try:
        model = build_model(cfg, state)  # load_pretrained on the toy folder, as train does
    finally:
        destroy_parallel(destroy_process_group=True)
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert model.pretrained_report.num_tensors == len(params) == len(reference[0])
    assert all(torch.equal(params[n], t) for n, t in shards_from_pretrained(llama, cfg.model, 1)[0].items())


def test_a_family_record_refuses_its_own_keys(toy, tmp_path):
    config = {"model_type": "toy", "architectures": ["ToyForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
              "num_hidden_layers": 1, "intermediate_size": 12, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps({**config, "toy_window": 128}))
    with pytest.raises(UnsupportedModel, match=r"toy_window=128 is not supported \(full causal attention only\)"):
        pretrained_model_keys(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    with pytest.raises(UnsupportedModel, match="num_local_experts=8 .*supported: llama = .*; toy = Toy"):
        pretrained_model_keys(tmp_path)
    assert derive_model_keys(config)["ffn_hidden_size"] == 12


def test_records_refuse_bad_rules_and_duplicates():
    with pytest.raises(ValueError, match=r"\{i\} must be in the megatron-core name and in every"):
        Rule("decoder.layers.{i}.x", ("model.x",), "replicated")
    with pytest.raises(ValueError, match=r"shape names \['width'\] are not sizes"):
        Rule("x", ("y",), "replicated", ("width",))
    with pytest.raises(ValueError, match="model_type 'llama' already has a family record"):
        register_family(FAMILIES["llama"])
    with pytest.raises(ValueError, match="transform 'qkv' is registered already"):
        register_transform(type(TRANSFORMS["qkv"]))
    from megatron_pack.model.hf.transforms import transform

    with pytest.raises(ValueError, match="unknown transform 'fused'; registered: "):
        transform("fused")
