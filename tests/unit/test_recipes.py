"""Every recipe in configs/experiment passes ``validate()`` at the world size it states.

A recipe states its world size in a header line ``# world size: N``; a recipe without one fails
here (a launch size is part of a recipe). Recipes reading ``data.source=files`` get a placeholder
``data.input`` (the user's file; ``validate()`` does not open it). Nothing a recipe sets may be
refused later: the distributed optimizer, recompute and every other key go through the same
``validate()`` the training entry runs before any process group starts.
"""

from __future__ import annotations

import re

import pytest

from megatron_pack.config import load_config
from megatron_pack.config.loader import config_dir
from test_gpt_oss import HUB_20B  # the Hub config.json: one home, tests/unit/test_gpt_oss.py
from test_qwen3_5 import HUB_MOE_TEXT as QWEN3_5_MOE_TEXT  # 40 layers of it: transformers' default sizes
from test_qwen3_5 import HUB_TEXT as QWEN3_5_TEXT, LAYER_TYPES  # 32 layers of it: transformers' default sizes
from test_qwen3_vl import HUB_QWEN3_VL_30B_A3B, HUB_QWEN3_VL_8B, hub_qwen3_5  # the Hub's config.json; Qwen3.5 VLM's

# config.json of the Hugging Face folders the pretrained recipes name (architecture keys only: what
# load_config reads from model.pretrained); the published configs of these models.
_LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               "torch_dtype": "bfloat16"}
_QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
              "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
              "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
              "torch_dtype": "bfloat16"}
_LLAMA33_70B = {**_LLAMA31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8}
_QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                  "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                  "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
                  "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                  "torch_dtype": "bfloat16"}
_QWEN25_VL_7B = {**_QWEN25_7B, "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
                 "max_position_embeddings": 128000, "image_token_id": 151655, "video_token_id": 151656,
                 "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
                 "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                                   "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                                   "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                                   "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                                   "temporal_patch_size": 2}}
_GEMMA3_12B_TEXT = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 3840,
                    "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
                    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "final_logit_softcapping": None, "attn_logit_softcapping": None, "torch_dtype": "bfloat16"}
"""Gemma 3 12B's text_config (google/gemma-3-12b-it) as its language model alone (Gemma3ForCausalLM)."""
PRETRAINED_QWEN3_5_MOE_TEXT = {**QWEN3_5_MOE_TEXT, "num_hidden_layers": 40, "layer_types": LAYER_TYPES * 10}
PRETRAINED = {"models/Llama-3.1-8B-Instruct": _LLAMA31_8B, "models/Qwen2.5-7B-Instruct": _QWEN25_7B,
              "models/Llama-3.3-70B-Instruct": _LLAMA33_70B, "models/Qwen3-30B-A3B": _QWEN3_30B_A3B,
              "models/Qwen2.5-VL-7B-Instruct": _QWEN25_VL_7B, "models/gemma-3-12b-it-text": _GEMMA3_12B_TEXT,
              "models/gpt-oss-20b-bf16": HUB_20B,
              "models/qwen3_5-text": {**QWEN3_5_TEXT, "num_hidden_layers": 32, "layer_types": LAYER_TYPES * 8},
              "models/qwen3_5-moe-text": PRETRAINED_QWEN3_5_MOE_TEXT,
              "models/Qwen3-VL-8B-Instruct": HUB_QWEN3_VL_8B, "models/Qwen3-VL-30B-A3B-Instruct": HUB_QWEN3_VL_30B_A3B,
              "models/qwen3_5": {**hub_qwen3_5(), "text_config": {**hub_qwen3_5()["text_config"], "num_hidden_layers": 32,
                                                                  "layer_types": LAYER_TYPES * 8}},
              "models/qwen3_5_moe": {**hub_qwen3_5(moe=True),  # its merger's output the MoE text hidden 2048
                                     "text_config": {k: v for k, v in PRETRAINED_QWEN3_5_MOE_TEXT.items()
                                                     if k != "architectures"},
                                     "vision_config": {**hub_qwen3_5(moe=True)["vision_config"], "out_hidden_size": 2048,
                                                       "model_type": "qwen3_5_moe"}}}

RECIPES = sorted(p for p in (config_dir() / "experiment").glob("*.yaml"))


def _world_size(path) -> int:
    match = re.search(r"^# world size: (\d+)", path.read_text(encoding="utf-8"), flags=re.M)
    assert match, f"{path.name} does not state its world size; add a header line '# world size: N'"
    return int(match.group(1))


def test_recipes_exist():
    assert {p.stem for p in RECIPES} >= {"quickstart", "llama3_8b_tp2_cp2"}


def _pretrained_folder(path, root) -> list[str]:
    """The recipe's model.pretrained folder under ``root`` (config.json only; tiny-llama: a tiny random one)."""
    import json

    match = re.search(r"^  pretrained: (\S+)", path.read_text(encoding="utf-8"), flags=re.M)
    if not match:
        return []
    folder = root / match.group(1)
    if match.group(1) in PRETRAINED:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(PRETRAINED[match.group(1)]))
    else:
        import sys

        sys.path.insert(0, str(config_dir().parent / "tests"))
        from _hf import make_family

        make_family(folder.parent, "llama_rope", name=folder.name)
    return [f"model.pretrained={folder}", "data.tokenizer=byte"]


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates_at_its_world_size(path, tmp_path):
    world_size = _world_size(path)
    reads_files = re.search(r"override /data: files", path.read_text(encoding="utf-8")) is not None
    extra = (["data.input=train.jsonl"] if reads_files else []) + _pretrained_folder(path, tmp_path)
    cfg = load_config([f"experiment={path.stem}", *extra], world_size=world_size)  # validate() runs inside
    par = cfg.parallel
    assert world_size % (par.tensor_model_parallel_size * par.context_parallel_size) == 0


def test_llama3_70b_recipe_is_a_pipeline_layout(tmp_path):
    path = config_dir() / "experiment" / "llama3_70b_sft.yaml"
    cfg = load_config(["experiment=llama3_70b_sft", "data.input=train.jsonl",
                       *_pretrained_folder(path, tmp_path)], world_size=_world_size(path))
    par = cfg.parallel
    assert (par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size) == (4, 2, 4)
    assert cfg.model.num_layers == 80 and cfg.ddp.use_distributed_optimizer and par.sequence_parallel


def test_llama3_recipe_uses_the_distributed_optimizer():
    cfg = load_config(["experiment=llama3_8b_tp2_cp2", "data.input=train.jsonl"], world_size=8)
    assert cfg.ddp.use_distributed_optimizer and cfg.parallel.sequence_parallel


def test_qwen3_moe_recipe_is_expert_parallel():
    import json

    folder_args = []
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / "models/Qwen3-30B-A3B"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(_QWEN3_30B_A3B))
        folder_args = [f"model.pretrained={folder}", "data.tokenizer=byte", "data.input=train.jsonl"]
        cfg = load_config(["experiment=qwen3_30b_a3b_sft", *folder_args], world_size=32)
        distributed = load_config(["experiment=qwen3_30b_a3b_sft", *folder_args, "ddp.use_distributed_optimizer=true"],
                                  world_size=32)
    from megatron_pack.training.memory_estimate import estimate_memory

    # the header states what train --check estimates, with and without the distributed optimizer
    header = " ".join(line.lstrip("# ") for line in
                      (config_dir() / "experiment" / "qwen3_30b_a3b_sft.yaml").read_text().splitlines())
    est, dist = estimate_memory(cfg, 32), estimate_memory(distributed, 32)
    gib = lambda v: f"{v / 2 ** 30:.2f}"  # noqa: E731
    assert (f"params {gib(est.params)}, grads {gib(est.grads)}, optimizer {gib(est.optimizer)}, activations "
            f"{gib(est.activations)} (8k tokens, selective recompute), total {gib(est.total)} GiB") in header
    assert f"brings the optimizer to {gib(dist.optimizer)} and the total to {gib(dist.total)} GiB" in header
    m, p = cfg.model, cfg.parallel
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_router_pre_softmax) == (128, 8, 768, False)
    assert (p.expert_model_parallel_size, p.expert_tensor_parallel_size, p.context_parallel_size) == (16, 1, 2)
    assert p.tensor_model_parallel_size == 2 and p.sequence_parallel


def test_gpt_oss_20b_recipe_fits_its_memory_estimate_and_a_transformer_engine_host(tmp_path):
    """gpt-oss-20b at its world size: the header states what train --check estimates (with and without the
    distributed optimizer; under 80 GB), and the layout passes the Transformer Engine rules (windows and sinks under
    CP need cp_comm_type=a2a, biased experts expert TP 1)."""
    from megatron_pack.config.host import Host
    from megatron_pack.config.validate import validate
    from megatron_pack.training.memory_estimate import estimate_memory

    path = config_dir() / "experiment" / "gpt_oss_20b_sft.yaml"
    args = ["experiment=gpt_oss_20b_sft", "data.input=train.jsonl", *_pretrained_folder(path, tmp_path)]
    cfg = load_config(args, world_size=8)
    plain = load_config([*args, "ddp.use_distributed_optimizer=false"], world_size=8)
    validate(cfg, world_size=8, host=Host(gpu=True, transformer_engine=True, transformer_engine_version="2.9.0"))
    header = " ".join(line.lstrip("# ") for line in path.read_text().splitlines())
    est, alone = estimate_memory(cfg, 8), estimate_memory(plain, 8)
    gib = lambda v: f"{v / 2 ** 30:.2f}"  # noqa: E731
    assert (f"params {gib(est.params)}, grads {gib(est.grads)}, optimizer {gib(est.optimizer)}, activations "
            f"{gib(est.activations)} (8k tokens, selective recompute), total {gib(est.total)} GiB") in header
    assert f"optimizer is {gib(alone.optimizer)} and the total {gib(alone.total)} GiB" in header
    assert est.total < 80e9
    m, p = cfg.model, cfg.parallel
    assert (m.num_experts, m.moe_router_topk, m.window_size, m.softmax_type, m.rope_scaling) == (
        32, 4, [127, 0], "learnable", "yarn")
    assert (p.expert_model_parallel_size, p.expert_tensor_parallel_size, p.cp_comm_type) == (8, 1, "a2a")


def test_qwen2_5_vl_recipe_counts_the_vision_tower(tmp_path):
    """The 7B VLM recipe: M-RoPE and the image token from config.json, and the memory estimate's first stage
    holds the 0.68B-parameter tower, of which only the merger (45M) has gradients and optimizer state."""
    from megatron_pack.training.memory_estimate import estimate_stage

    path = config_dir() / "experiment" / "qwen2_5_vl_7b_sft.yaml"
    cfg = load_config(["experiment=qwen2_5_vl_7b_sft", "data.input=train.jsonl",
                       *_pretrained_folder(path, tmp_path)], world_size=_world_size(path))
    assert (cfg.model.mrope_section, cfg.model.image_token_id, cfg.model.freeze_vision) == ([16, 24, 24], 151655, True)
    text = load_config(["experiment=qwen2.5_7b_sft", "data.input=train.jsonl",
                        *_pretrained_folder(config_dir() / "experiment" / "qwen2.5_7b_sft.yaml", tmp_path / "t")],
                       world_size=8)
    vlm, plain = estimate_stage(cfg, 0, 8), estimate_stage(text, 0, 8)
    tower, merger = vlm.num_params - plain.num_params, 1280 + 5120 * 5120 + 5120 + 3584 * 5120 + 3584
    assert 0.66e9 < tower < 0.70e9  # Qwen2.5-VL's vision encoder, ~0.67B parameters
    assert vlm.grads - plain.grads == merger * 4  # fp32 gradient buffer of the merger only
    assert vlm.activations > plain.activations


_QWEN3_8B_TEXT = {**{k: v for k, v in HUB_QWEN3_VL_8B["text_config"].items() if k != "rope_scaling"},
                  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "tie_word_embeddings": False}
"""Qwen3-VL-8B's language model alone as a Qwen3 text folder (the same sizes, plain RoPE): the VLM recipe less its
tower."""
_QWEN3_30B_A3B_TEXT = {**{k: v for k, v in HUB_QWEN3_VL_30B_A3B["text_config"].items() if k != "rope_scaling"},
                       "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "norm_topk_prob": True,
                       "tie_word_embeddings": False}
"""Qwen3-VL-30B-A3B's language model alone as a Qwen3-MoE text folder."""
VLM_RECIPES = {  # recipe: (the same layout on its language model alone: recipe, folder, config.json; the tower's
    # transformers class, the DeepStack levels, the estimate's total without the distributed optimizer or None)
    "qwen3_vl_8b_sft": ("qwen3_vl_8b_sft", "models/qwen3-8b-text", _QWEN3_8B_TEXT, "Qwen3VLVisionModel", 3, True),
    "qwen3_vl_30b_a3b_sft": ("qwen3_vl_30b_a3b_sft", "models/qwen3-30b-a3b-text", _QWEN3_30B_A3B_TEXT,
                             "Qwen3VLMoeVisionModel", 3, False),
    "qwen3_5_moe_vl_sft": ("qwen3_5_moe_text_sft", "models/qwen3_5-moe-text", PRETRAINED_QWEN3_5_MOE_TEXT,
                           "Qwen3_5MoeVisionModel", 0, False),
    "qwen3_5_vl_sft": ("qwen3_5_text_sft", "models/qwen3_5-text", PRETRAINED["models/qwen3_5-text"], "Qwen3_5VisionModel",
                       0, False),
}


@pytest.mark.parametrize("recipe", list(VLM_RECIPES))
def test_qwen3_vl_and_qwen3_5_vl_recipes_count_the_tower_and_state_their_estimate(tmp_path, recipe):
    """The Qwen3-VL 8B and 30B-A3B, Qwen3.5 (9B) and Qwen3.5-MoE (35B-A3B) VLM recipes at their world size: interleaved M-RoPE, the image token and
    DeepStack from config.json; the memory estimate's first stage holds every parameter of transformers' tower
    (counted on its own module, built on the meta device) over the same layout's language model alone, of which only
    the mergers (DeepStack's too) have gradients; the header states what ``train --check`` estimates (with and without
    the distributed optimizer where it matters), under an 80 GB GPU."""
    import json

    import torch
    import transformers as T

    from megatron_pack.training.memory_estimate import estimate_memory, estimate_stage

    text_recipe, text_folder, text_hub, tower_class, deepstack, states_plain = VLM_RECIPES[recipe]
    path = config_dir() / "experiment" / f"{recipe}.yaml"
    world = _world_size(path)
    args = ["data.input=train.jsonl", *_pretrained_folder(path, tmp_path)]
    cfg = load_config([f"experiment={recipe}", *args], world_size=world)
    folder = tmp_path / text_folder
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(text_hub))
    text = load_config([f"experiment={text_recipe}", f"model.pretrained={folder}", "data.tokenizer=byte",
                        "data.input=train.jsonl"], world_size=world)
    m, p = cfg.model, cfg.parallel
    assert (m.mrope_interleaved, m.deepstack_layers, m.freeze_vision) == (True, deepstack, True)
    assert (p.tensor_model_parallel_size, p.context_parallel_size, p.sequence_parallel) == (2, 2, True)
    assert cfg.ddp.use_distributed_optimizer and text.ddp.use_distributed_optimizer
    hub = PRETRAINED[cfg.model.pretrained.split(str(tmp_path) + "/")[1]]
    vision_config = getattr(T, tower_class.replace("Model", "Config"))(**hub["vision_config"])
    with torch.device("meta"):
        tower = getattr(T, tower_class)(vision_config)
    mergers = sum(v.numel() for n, v in tower.named_parameters() if n.startswith(("merger.", "deepstack_merger_list.")))
    vlm, plain = estimate_stage(cfg, 0, world), estimate_stage(text, 0, world)
    assert vlm.num_params - plain.num_params == sum(v.numel() for v in tower.parameters()) > 0.4e9
    assert vlm.grads - plain.grads == mergers * 4 and mergers > 0  # fp32 gradient buffer of the mergers only
    assert vlm.activations > plain.activations
    est = estimate_memory(cfg, world)
    gib = lambda v: f"{v / 2 ** 30:.2f}"  # noqa: E731
    header = " ".join(line.lstrip("# ") for line in path.read_text().splitlines())
    assert (f"params {gib(est.params)}, grads {gib(est.grads)}, optimizer {gib(est.optimizer)}, activations "
            f"{gib(est.activations)} (8k tokens") in header and f"total {gib(est.total)} GiB" in header
    assert est.total < 80e9
    if states_plain:
        alone = estimate_memory(load_config([f"experiment={recipe}", *args, "ddp.use_distributed_optimizer=false"],
                                            world_size=world), world)
        assert f"optimizer is {gib(alone.optimizer)} and the total {gib(alone.total)} GiB" in header
        assert alone.total > 80e9
