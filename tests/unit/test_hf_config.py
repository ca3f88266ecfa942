"""config.json -> model.*: the derivation (hand-computed for real configs), the support list and
every refusal with its message, command-line contradictions, and the recipes passing validate()."""

from __future__ import annotations

import json
import re
import os
from pathlib import Path

import pytest

from megatron_pack.config import ConfigError, load_config
from megatron_pack.config.hf_config import (SUPPORTED_FAMILIES, UnsupportedModel, derive_model_keys,
                                            pretrained_model_keys, refusal)
from megatron_pack.config.hf_config.record import ARCH_KEYS

LLAMA31_8B = {  # Meta-Llama-3.1-8B-Instruct/config.json as published (transformers 4.x spelling)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256}
QWEN25_7B = {  # Qwen2.5-7B-Instruct/config.json as published
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064}
QWEN25_VL_7B = {  # Qwen2.5-VL-7B-Instruct/config.json as published (the language model's keys at the top)
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
LLAMA32_1B_V5 = {  # transformers 5.x spelling (rope_parameters), tied embeddings
    "architectures": ["LlamaForCausalLM"], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "vocab_size": 128256}
MISTRAL_V03 = {
    "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "vocab_size": 32768}
def _with(base: dict, **changes) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "vocab_size": 32000}

QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}

DERIVED = [  # (id, config.json, expected subset of model.* keys), hand-written from the configs above
    ("llama3.1-8b", LLAMA31_8B, dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                                     num_query_groups=8, kv_channels=128, vocab_size=128256, rotary_base=500000,
                                     max_position_embeddings=131072, norm_epsilon=1e-5, rope_scaling="llama3",
                                     rope_scaling_factor=8.0, rope_original_max_position_embeddings=8192,
                                     untie_embeddings_and_output_weights=True, add_qkv_bias=False,
                                     qk_layernorm=False)),
    ("qwen2.5-7b", QWEN25_7B, dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_query_groups=4,
                                   kv_channels=128, vocab_size=152064, rotary_base=1000000, norm_epsilon=1e-6,
                                   add_qkv_bias=True, qk_layernorm=False, rope_scaling="none")),
    ("qwen3-8b", QWEN3_8B, dict(num_layers=36, kv_channels=128, ffn_hidden_size=12288, qk_layernorm=True,
                                add_qkv_bias=False, max_position_embeddings=40960)),
    ("llama3.2-1b-v5-spelling", LLAMA32_1B_V5, dict(kv_channels=64, rotary_base=500000, rope_scaling="llama3",
                                                    rope_scaling_factor=32.0,
                                                    untie_embeddings_and_output_weights=False)),
    ("mistral-v0.3", MISTRAL_V03, dict(vocab_size=32768, rotary_base=1000000, rope_scaling="none")),
    ("dense-has-no-experts", MISTRAL_V03, dict(num_experts=None, moe_ffn_hidden_size=None)),
    ("qwen3-30b-a3b", QWEN3_30B_A3B, dict(num_layers=48, kv_channels=128, qk_layernorm=True, num_query_groups=4,
                                          num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                                          moe_router_pre_softmax=False)),
    ("qwen3-moe-no-renormalisation", _with(QWEN3_30B_A3B, norm_topk_prob=False), dict(moe_router_pre_softmax=True)),
    ("qwen3-moe-v5-spelling", _with(QWEN3_30B_A3B, num_experts=None, num_local_experts=16), dict(num_experts=16)),
    ("qwen1.5-moe-a2.7b", QWEN15_MOE_A27B, dict(num_experts=60, moe_router_topk=4, moe_ffn_hidden_size=1408,
                                                moe_router_pre_softmax=True, add_qkv_bias=True,
                                                moe_shared_expert_ffn_hidden_size=5632, moe_shared_expert_gate=True)),
    ("mixtral-8x7b", MIXTRAL_8X7B, dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336,
                                        moe_router_pre_softmax=False, qk_layernorm=False, rotary_base=1000000)),
]


@pytest.mark.parametrize("hf,expected", [c[1:] for c in DERIVED], ids=[c[0] for c in DERIVED])
def test_derivation(hf, expected):
    derived = derive_model_keys(hf)
    assert refusal(hf, "x") is None
    assert set(derived) == set(ARCH_KEYS)
    for key, value in expected.items():
        assert derived[key] == value, key


REFUSALS = [  # (id, config.json, fragments of the message)
    ("unknown-model-type", _with(LLAMA31_8B, model_type="gpt2", architectures=["GPT2LMHeadModel"]),
     ["model_type 'gpt2' is not supported", "supported: llama"]),
    ("moe-model-type", _with(QWEN3_8B, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"]),
     ["model_type 'qwen3_next'", "qwen3 = Qwen3 dense", "qwen3_moe = Qwen3-MoE"]),
    ("moe-dense-layers", _with(QWEN3_30B_A3B, mlp_only_layers=[0]), ["mlp_only_layers=[0]", "every layer"]),
    ("moe-sparse-step", _with(QWEN3_30B_A3B, decoder_sparse_step=2), ["decoder_sparse_step=2", "every layer"]),
    ("moe-shared-expert", _with(QWEN3_30B_A3B, shared_expert_intermediate_size=512),
     ["shared_expert_intermediate_size=512", "shared expert"]),
    ("mixtral-jitter", _with(MIXTRAL_8X7B, router_jitter_noise=0.1), ["router_jitter_noise=0.1"]),
    ("mixtral-sliding-window", _with(MIXTRAL_8X7B, sliding_window=4096), ["sliding_window=4096"]),
    ("moe-mtp", _with(QWEN3_30B_A3B, num_nextn_predict_layers=1), ["num_nextn_predict_layers=1", "multi-token"]),
    ("moe-experts-key", _with(MISTRAL_V03, num_local_experts=8), ["num_local_experts=8", "mixture of experts"]),
    ("mtp-heads", _with(QWEN3_8B, num_nextn_predict_layers=1), ["num_nextn_predict_layers=1", "multi-token"]),
    ("remote-code", _with(LLAMA31_8B, auto_map={"AutoModelForCausalLM": "modeling_x.X"}),
     ["auto_map", "trust_remote_code"]),
    ("qwen2-use-sliding-window", _with(QWEN25_7B, use_sliding_window=True), ["use_sliding_window=true"]),
    ("sliding-layer-types", _with(QWEN3_8B, layer_types=["full_attention", "sliding_attention"]),
     ["layer_types ['sliding_attention']"]),
    ("rope-yarn", _with(QWEN25_7B, rope_scaling={"type": "yarn", "factor": 4.0}),
     ["rope_type 'yarn' is not supported", "llama3"]),
    ("rope-dynamic-v5", _with(LLAMA32_1B_V5, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     ["rope_type 'dynamic'"]),
    ("llama-attention-bias", _with(LLAMA31_8B, attention_bias=True), ["attention_bias=true", "qwen2 only"]),
    ("mlp-bias", _with(LLAMA31_8B, mlp_bias=True), ["mlp_bias=true"]),
    ("gelu", _with(MISTRAL_V03, hidden_act="gelu"), ["hidden_act='gelu'"]),
    ("wrong-architecture", _with(LLAMA31_8B, architectures=["LlamaForSequenceClassification"]),
     ["architectures ['LlamaForSequenceClassification']"]),
]


@pytest.mark.parametrize("hf,fragments", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_refusals_name_the_field_and_the_list(hf, fragments, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModel) as info:
        pretrained_model_keys(tmp_path)
    message = str(info.value)
    assert message.startswith(f"model.pretrained ({tmp_path})") and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_refusal_reaches_load_config_before_launch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_with(MIXTRAL_8X7B, sliding_window=4096)))
    with pytest.raises(ConfigError) as info:
        load_config([f"model.pretrained={tmp_path}"])
    assert "sliding_window=4096" in str(info.value)


def test_modelling_code_in_the_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B))
    (tmp_path / "modeling_custom.py").write_text("# would need trust_remote_code\n")
    with pytest.raises(UnsupportedModel, match="trust_remote_code"):
        pretrained_model_keys(tmp_path)


def test_missing_folder_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model.pretrained \(.*nothing\) has no config.json"):
        load_config([f"model.pretrained={tmp_path / 'nothing'}"])


GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
             "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512,
             "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"}


def test_every_family_listed_is_derivable():
    from test_gpt_oss import HUB_20B
    from test_qwen3_5 import HUB_MOE_TEXT, HUB_TEXT
    from test_qwen3_vl import HUB_QWEN3_VL_8B, HUB_QWEN3_VL_30B_A3B, hub_qwen3_5

    examples = {"llama": LLAMA31_8B, "qwen2": QWEN25_7B, "qwen3": QWEN3_8B, "mistral": MISTRAL_V03,
                "qwen3_moe": QWEN3_30B_A3B, "mixtral": MIXTRAL_8X7B, "qwen2_moe": QWEN15_MOE_A27B,
                "qwen2_5_vl": QWEN25_VL_7B, "gemma3_text": GEMMA3_1B, "gpt_oss": HUB_20B, "qwen3_5_text": HUB_TEXT,
                "qwen3_5_moe_text": HUB_MOE_TEXT, "qwen3_5": hub_qwen3_5(), "qwen3_5_moe": hub_qwen3_5(moe=True),
                "qwen3_vl": HUB_QWEN3_VL_8B, "qwen3_vl_moe": HUB_QWEN3_VL_30B_A3B}
    assert set(examples) == set(SUPPORTED_FAMILIES)
    assert all(refusal(hf, "x") is None for hf in examples.values())


def _nested_like_transformers5(hub: dict) -> dict:
    """The Hub's Qwen2.5-VL config.json as transformers 5's save_pretrained writes it: the language model's
    keys under text_config, rope_parameters instead of rope_theta + rope_scaling."""
    text_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                 "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act", "use_sliding_window",
                 "sliding_window")
    text = {k: hub[k] for k in text_keys}
    text["rope_parameters"] = {"rope_theta": hub["rope_theta"], "rope_type": "default", "type": "mrope",
                               "mrope_section": hub["rope_scaling"]["mrope_section"]}
    rest = {k: v for k, v in hub.items() if k not in text_keys + ("rope_theta", "rope_scaling")}
    return {**rest, "text_config": text}


def test_qwen2_5_vl_both_config_layouts_derive_the_same_keys():
    hub = derive_model_keys(QWEN25_VL_7B)
    assert hub == derive_model_keys(_nested_like_transformers5(QWEN25_VL_7B))
    assert (hub["mrope_section"], hub["image_token_id"], hub["add_qkv_bias"], hub["kv_channels"],
            hub["rotary_base"], hub["rope_scaling"]) == ([16, 24, 24], 151655, True, 128, 1000000, "none")


@pytest.mark.parametrize("case, change, match", [
    ("mrope_on_a_text_family", {**QWEN25_7B, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
     "mrope_section .* is not supported for qwen2"),
    ("vl_without_mrope", {**QWEN25_VL_7B, "rope_scaling": None}, "qwen2_5_vl without rope_scaling mrope_section"),
], ids=lambda v: v if isinstance(v, str) and " " not in v and "." not in v else "")
def test_mrope_refusals(case, change, match):
    problem = refusal(change, "x")
    assert problem is not None and re.search(match, problem), problem


@pytest.fixture()
def llama_dir(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B))
    return tmp_path


def test_config_json_replaces_preset_keys_and_sets_the_tokenizer(llama_dir):
    cfg = load_config([f"model.pretrained={llama_dir}", "model.seq_length=8192", "packing.packed_sequence_size=8192"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_query_groups) == (32, 4096, 8)
    assert cfg.model.rope_scaling == "llama3" and cfg.model.rotary_base == 500000
    assert cfg.data.tokenizer == str(llama_dir)
    other = load_config([f"model.pretrained={llama_dir}", "data.tokenizer=byte", "model.seq_length=8192",
                         "packing.packed_sequence_size=8192"])
    assert other.data.tokenizer == "byte"  # given on the command line: kept


@pytest.mark.parametrize("override,agrees", [("model.num_layers=32", True), ("model.num_layers=3", False),
                                             ("model.rotary_base=500000", True), ("model.norm_epsilon=1e-6", False),
                                             ("model.untie_embeddings_and_output_weights=false", False)],
                         ids=["layers-agree", "layers-contradict", "rope-agrees", "eps-contradicts", "tie-contradicts"])
def test_command_line_contradiction_names_both_values(llama_dir, override, agrees):
    argv = [f"model.pretrained={llama_dir}", override, "model.seq_length=8192", "packing.packed_sequence_size=8192"]
    if agrees:
        load_config(argv)
        return
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    key, value = override.split("=")
    message = str(info.value)
    assert key in message and "contradicts" in message and "config.json" in message
    assert str(derive_model_keys(LLAMA31_8B)[key.split(".")[1]]) in message


RECIPES = [  # (experiment, world size, folders it reads (relative), the config.json each holds)
    ("llama3_8b_sft", 8, {"models/Llama-3.1-8B-Instruct": LLAMA31_8B}),
    ("qwen2.5_7b_sft", 8, {"models/Qwen2.5-7B-Instruct": QWEN25_7B}),
    ("llama3_8b_sft_16k", 4, {"models/Llama-3.1-8B-Instruct": LLAMA31_8B}),
    ("pretrained_tiny", 2, {"models/tiny-llama": _with(LLAMA31_8B, hidden_size=64, intermediate_size=96,
                                                       num_hidden_layers=2, num_attention_heads=4,
                                                       num_key_value_heads=2, vocab_size=301)}),
]


@pytest.mark.parametrize("experiment,world_size,folders", RECIPES, ids=[r[0] for r in RECIPES])
def test_recipes_pass_validate_as_written(experiment, world_size, folders, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for folder, hf in folders.items():
        Path(folder).mkdir(parents=True)
        (Path(folder) / "config.json").write_text(json.dumps(hf))
    cfg = load_config([f"experiment={experiment}"], world_size=world_size)
    assert cfg.model.pretrained == next(iter(folders))
    assert cfg.model.num_layers == folders[cfg.model.pretrained]["num_hidden_layers"]
    assert cfg.data.tokenizer == cfg.model.pretrained
    assert cfg.model.seq_length == cfg.packing.packed_sequence_size
    if experiment == "llama3_8b_sft_16k":
        from megatron_pack.config.layout import effective_pad_multiple

        assert cfg.packing.packed_sequence_size == 16384 and effective_pad_multiple(cfg) == 4
    assert os.path.isdir(cfg.model.pretrained)


@pytest.mark.parametrize("case, keys, match", [
    ("sections_do_not_sum", {"mrope_section": [2, 3, 2]}, r"model.mrope_section \(\[2, 3, 2\]\) must be three numbers summing"),
    ("without_a_vlm_folder", {"mrope_section": [2, 3, 3]}, r"comes with a vision-language model.pretrained"),
], ids=lambda v: v if isinstance(v, str) and v.isidentifier() else "")
def test_mrope_section_alone_is_refused(case, keys, match):
    from megatron_pack.config.schema import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match=match):
        ModelConfig(hidden_size=64, num_attention_heads=4, kv_channels=16, **keys)
