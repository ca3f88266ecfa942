"""A Hugging Face ``config.json`` -> our ``model.*`` keys, and the supported-family list.

torch-free and read before anything is launched, so an unsupported folder is refused by
``load_config`` (this module lives in the config layer because ``load_config`` calls it; the
weight mapping is ``megatron_pack.model.hf``, which re-exports these names). Each family is one
record (``families.py``; the record type in ``record.py``): its model type, architectures, the
``model.*`` keys it fixes, the config.json keys it refuses and its name rules.

Worked example: Llama 3.1 8B's ``config.json`` (``hidden_size 4096, num_attention_heads 32,
num_key_value_heads 8, intermediate_size 14336, rope_theta 500000, rope_scaling {rope_type:
llama3, factor: 8}``) derives ``model.hidden_size=4096, model.num_query_groups=8,
model.kv_channels=128, model.ffn_hidden_size=14336, model.rotary_base=500000,
model.rope_scaling=llama3, model.rope_scaling_factor=8.0``, ...

Both spellings of RoPE settings are read: ``rope_theta`` + ``rope_scaling`` (transformers 4.x,
what hub checkpoints carry) and ``rope_parameters`` (transformers 5.x ``save_pretrained``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import megatron_pack.config.hf_config.families  # noqa: F401  (registers the supported families)
from megatron_pack.config.hf_config.record import FAMILIES, Family, rope_settings, text_view

__all__ = ["ARCHITECTURES", "SUPPORTED_FAMILIES", "UnsupportedModel", "apply_pretrained", "contradictions",
           "derive_model_keys", "family_of", "hub_id_problem", "pretrained_model_keys", "read_hf_config", "refusal"]


class _FamilyField(Mapping):
    """model_type -> one field of its record, always the registry's current content."""

    def __init__(self, read):
        self._read = read

    def __getitem__(self, model_type: str):
        return self._read(FAMILIES[model_type])

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


SUPPORTED_FAMILIES: Mapping[str, str] = _FamilyField(lambda family: family.summary)
"""model_type -> what is supported; the refusal messages and docs/models.md list these."""
ARCHITECTURES: Mapping[str, str] = _FamilyField(lambda family: family.architectures[0])
"""model_type -> the architecture its config.json names."""


class UnsupportedModel(ValueError):
    """The folder holds a model this package does not load; the message names the field and the list."""


def _supported_text() -> str:
    return "supported: " + "; ".join(f"{k} = {v}" for k, v in SUPPORTED_FAMILIES.items())


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``org/name``: what a Hugging Face Hub id looks like (a relative path of two parts does too)."""


def hub_id_problem(value: str, key: str) -> str | None:
    """The one line for a ``key`` that names no local path but looks like a Hugging Face Hub id
    (``mistralai/Mistral-7B-v0.1``; nothing here downloads), else None."""
    if Path(value).exists() or not _HUB_ID.match(value) or value.startswith((".", "/", "~")):
        return None
    return (f"{key} ({value}) is not a local folder (nothing at {Path(value).absolute()}); if it is a Hugging Face "
            "Hub id: there is no network access to model hubs here; download it and pass the local folder "
            f"({key}=/path/to/folder).")


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """``config.json`` of a local Hugging Face model folder (a ``FileNotFoundError`` naming the key)."""
    path = Path(folder) / "config.json"
    missing = hub_id_problem(str(folder), "model.pretrained")
    if missing:
        raise FileNotFoundError(missing)
    if not path.is_file():
        raise FileNotFoundError(f"model.pretrained ({folder}) has no config.json; point model.pretrained at a local "
                                "Hugging Face model folder (config.json, *.safetensors, tokenizer files).")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UnsupportedModel(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg}); re-download the model "
                               "folder.") from None


def family_of(model_type: str) -> Family:
    """The record of a supported ``model_type`` (``UnsupportedModel`` naming the list otherwise)."""
    if model_type not in FAMILIES:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported; {_supported_text()}.")
    return FAMILIES[model_type]


def refusal(hf: dict[str, Any], where: str) -> str | None:
    """Why ``hf`` (a parsed config.json) is not supported, or None when it is."""
    model_type = hf.get("model_type")
    if hf.get("auto_map"):
        return (f"{where}: config.json has auto_map (custom modelling code, needs trust_remote_code, which "
                f"megatron_pack never enables); {_supported_text()}.")
    if model_type not in FAMILIES:
        return f"{where}: model_type {model_type!r} is not supported; {_supported_text()}."
    family = FAMILIES[model_type]
    hf = text_view(hf)
    archs = hf.get("architectures") or [family.architectures[0]]
    if len(archs) != 1 or archs[0] not in family.architectures:
        return (f"{where}: architectures {archs} is not supported for {model_type}; "
                f"expected {list(family.architectures)}.")
    for refuse in family.refused:
        problem = refuse.problem(hf, where, model_type, _supported_text())
        if problem:
            return problem
    return (_layer_types_refusal(hf, where, family) or _rope_refusal(hf, where, family)
            or _mrope_refusal(hf, where, family))


def _layer_types_refusal(hf: dict[str, Any], where: str, family: Family) -> str | None:
    layer_types = hf.get("layer_types") or []
    if any(t not in family.layer_types for t in layer_types):
        other = sorted({t for t in layer_types if t not in family.layer_types})
        return (f"{where}: layer_types {other} is not supported for {family.model_type} (its layers: "
                f"{', '.join(family.layer_types)}).")
    return None


def _rope_refusal(hf: dict[str, Any], where: str, family: Family) -> str | None:
    theta, scaling = rope_settings(hf)
    kind = scaling["rope_type"]
    if kind not in family.rope_types:
        return (f"{where}: rope_scaling rope_type {kind!r} is not supported for {family.model_type}; supported "
                f"rope_type: {', '.join(family.rope_types)} (llama3: Llama 3.1 / 3.2).")
    if float(theta) != int(theta):
        return f"{where}: rope_theta={theta} is not an integer, which model.rotary_base needs."
    if hf.get("partial_rotary_factor", 1.0) != 1.0 and not (family.text_positions or family.partial_rotary):
        return f"{where}: partial_rotary_factor={hf['partial_rotary_factor']} is not supported (full rotary only)."
    return None


def _mrope_refusal(hf: dict[str, Any], where: str, family: Family) -> str | None:
    section = rope_settings(hf)[1].get("mrope_section")
    if section is not None and family.vision is None and not family.text_positions:
        return (f"{where}: rope_scaling mrope_section {section} (multimodal RoPE) is not supported for "
                f"{family.model_type}; a vision-language model needs its family ({_vision_families()}).")
    if family.vision is not None and section is None:
        return f"{where}: {family.model_type} without rope_scaling mrope_section is not supported; re-download config.json."
    if family.vision is not None and not (isinstance(hf.get("vision_config"), dict) and "image_token_id" in hf):
        return (f"{where}: {family.model_type} (a vision-language model) without vision_config and image_token_id is "
                "not supported; re-download config.json (a text-only folder has its own family: "
                f"{_text_families()}).")
    return None


def _text_families() -> str:
    return ", ".join(t for t, f in FAMILIES.items() if f.vision is None)


def _vision_families() -> str:
    return ", ".join(t for t, f in FAMILIES.items() if f.vision is not None) or "none"


def derive_model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model.*`` architecture keys (``ARCH_KEYS``) for a supported config.json: the common
    derivation, then the keys the family's record fixes."""
    theta, scaling = rope_settings(hf)
    model_type, hf = hf.get("model_type"), text_view(hf)
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // heads
    llama3 = scaling["rope_type"] == "llama3"
    return {
        "num_layers": int(hf["num_hidden_layers"]), "hidden_size": int(hf["hidden_size"]),
        # a MoE config.json may name no dense MLP (Qwen3.5-MoE): its experts' width, until the family derives it
        "ffn_hidden_size": int(hf.get("intermediate_size") or hf["moe_intermediate_size"]), "num_attention_heads": heads,
        "num_query_groups": int(hf.get("num_key_value_heads") or heads), "kv_channels": int(head_dim),
        "vocab_size": int(hf["vocab_size"]), "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
        "normalization": "RMSNorm", "activation": "swiglu", "rotary_base": int(theta),
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "untie_embeddings_and_output_weights": not bool(hf.get("tie_word_embeddings", False)),
        "add_qkv_bias": bool(hf.get("attention_bias", False)), "qk_layernorm": False,
        "rope_scaling": "llama3" if llama3 else "none",
        "rope_scaling_factor": float(scaling.get("factor", 8.0)) if llama3 else 8.0,
        "rope_low_freq_factor": float(scaling.get("low_freq_factor", 1.0)) if llama3 else 1.0,
        "rope_high_freq_factor": float(scaling.get("high_freq_factor", 4.0)) if llama3 else 4.0,
        "rope_original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 8192))
        if llama3 else 8192,
        "num_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None, "moe_router_pre_softmax": False,
        "moe_shared_expert_ffn_hidden_size": None, "moe_shared_expert_gate": False,
        "mrope_section": None, "image_token_id": None, "mrope_interleaved": False, "deepstack_layers": 0,
        "window_size": None, "window_attn_skip_freq": None, "softmax_type": "vanilla",
        "rotary_base_local": None, "softmax_scale": None, "zero_centered_norm": False, "post_norms": False,
        "scale_embeddings": False, "add_bias_linear": False, "glu_linear_offset": 0.0, "activation_clamp": None,
        "rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0, "rope_yarn_truncate": True,
        "full_attention_interval": None, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "attention_output_gate": False, "rotary_percent": 1.0,
        **family_of(model_type).model_keys,
        **(family.derive(hf) if (family := family_of(model_type)).derive else {}),
    }


def pretrained_model_keys(folder: str | Path) -> dict[str, Any]:
    """config.json of ``folder`` -> ``model.*`` keys; raises ``UnsupportedModel`` / ``FileNotFoundError``."""
    hf = read_hf_config(folder)
    problem = refusal(hf, f"model.pretrained ({folder})")
    if problem:
        raise UnsupportedModel(problem)
    if (Path(folder) / "modeling.py").exists() or any(Path(folder).glob("modeling_*.py")):
        raise UnsupportedModel(f"model.pretrained ({folder}) ships modelling code (modeling_*.py), which needs "
                               f"trust_remote_code; megatron_pack never enables it; {_supported_text()}.")
    try:
        return derive_model_keys(hf)
    except ValueError as exc:  # a family's derive names what it cannot read (Gemma 3: an irregular layer pattern)
        raise UnsupportedModel(f"model.pretrained ({folder}): {exc}") from None


def contradictions(given: dict[str, Any], derived: dict[str, Any], folder: str | Path) -> list[str]:
    """A message per ``model.<key>`` given on the command line whose value differs from config.json."""
    problems = []
    for key, value in given.items():
        if key in derived and not _same(value, derived[key]):
            problems.append(f"model.{key}={value!r} on the command line contradicts {Path(folder) / 'config.json'}, "
                            f"which gives {derived[key]!r}; drop model.{key} (it comes from model.pretrained).")
    return problems


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _overridden_keys(overrides: list[str], group: str) -> set[str]:
    """Field names of ``group`` set by ``group.key=value`` overrides (the command line)."""
    keys = set()
    for text in overrides:
        key = text.split("=", 1)[0].lstrip("+~")
        if key.startswith(group + "."):
            keys.add(key.split(".")[1])
    return keys


def apply_pretrained(cfg, overrides: list[str]):
    """``cfg`` with the architecture keys of ``model.pretrained``'s config.json (and ``data.tokenizer``
    defaulting to that folder); raises ``ConfigError`` on a refusal or a command-line contradiction.

    Keys set by a YAML preset are replaced (the folder is the truth); keys given on the command line
    must agree with config.json.
    """
    import dataclasses

    from megatron_pack.config.schema import ConfigError

    folder = cfg.model.pretrained
    if folder is None:
        return cfg
    try:
        derived = pretrained_model_keys(folder)
    except (UnsupportedModel, FileNotFoundError) as exc:
        raise ConfigError([str(exc)]) from None
    given = {k: getattr(cfg.model, k) for k in _overridden_keys(overrides, "model")}
    problems = contradictions(given, derived, folder)
    if problems:
        raise ConfigError(problems)
    data = cfg.data
    if "tokenizer" not in _overridden_keys(overrides, "data") and data.tokenizer == "byte":
        data = dataclasses.replace(data, tokenizer=str(folder))
    if "seq_length" not in given and cfg.packing.makes_packs:
        # not an architecture key (RoPE is computed for any length): a pack is one sequence, so it follows the
        # pack size (prepare's default packs, or the size given) rather than the preset's placeholder
        derived = {**derived, "seq_length": cfg.packing.packed_sequence_size}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **derived), data=data)
