"""The record of one Hugging Face model family, and the registry of records (torch-free data).

A ``Family`` says everything megatron_pack knows about a family: its ``model_type`` and
``architectures``, the ``model.*`` keys it fixes beyond the common derivation, the config.json
keys it refuses, and its name rules (HF tensor names <-> megatron-core parameter names, each with
the transform that joins them and the HF shape config.json implies). A rule names its transform
by the name it is registered under in ``megatron_pack.model.hf.transforms``; this layer knows only
the name, so ``load_config`` reads the records without torch and without the model layer.

Example (Llama's fused MLP input, per layer)::

    Rule("decoder.layers.{i}.mlp.linear_fc1.weight",
         ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
         "gate_up", ("ffn", "hidden"))

``{i}`` is the layer and ``{e}`` the expert of a mixture-of-experts layer: local indices in the
megatron-core name (a pipeline stage's layer 0, an expert-parallel rank's expert 0), global ones
in the HF names (``megatron_pack.model.hf.rules.Placement`` gives the offsets).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

ARCH_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
             "kv_channels", "vocab_size", "max_position_embeddings", "normalization", "activation",
             "rotary_base", "norm_epsilon", "untie_embeddings_and_output_weights", "add_qkv_bias", "qk_layernorm",
             "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_position_embeddings", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
             "moe_router_pre_softmax", "moe_shared_expert_ffn_hidden_size", "moe_shared_expert_gate",
             "mrope_section", "image_token_id", "window_size", "window_attn_skip_freq", "softmax_type",
             "rotary_base_local", "softmax_scale", "zero_centered_norm", "post_norms", "scale_embeddings",
             "add_bias_linear", "glu_linear_offset", "activation_clamp", "rope_yarn_beta_fast", "rope_yarn_beta_slow",
             "rope_yarn_truncate")
"""The ``model.*`` keys that come from config.json when ``model.pretrained`` is set."""
ARCH_KEYS += ("full_attention_interval", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "attention_output_gate", "rotary_percent")
"""... and those of a hybrid linear-attention stack (Qwen3.5)."""
ARCH_KEYS += ("mrope_interleaved", "deepstack_layers")
"""... and a Qwen3-VL / Qwen3.5 vision-language model's (interleaved M-RoPE, DeepStack)."""

SHAPE_SIZES = ("hidden", "ffn", "vocab", "head_dim", "q", "kv", "experts", "expert_ffn", "shared_ffn", "one",
               "heads")
"""Names a rule's ``shape`` may use: hidden size, FFN size, vocabulary, head dim, all query heads
(heads x head dim), all key/value heads (groups x head dim), the experts of a MoE layer (a
router's rows), one expert's FFN size, a shared expert's, 1 (a gate's single row) and the query heads (a sink
logit each); ``transforms.Dims.size`` resolves them."""


SHAPE_SIZES += ("lin_conv", "lin_v", "lin_heads", "lin_dv", "conv_width")
"""A linear-attention (Gated DeltaNet) layer's sizes: its conv1d channels (query, key and value heads: 2 x key
heads x key dim + value heads x value dim), all value heads x value dim, the value heads, one value head's dim, and
the conv1d width."""


@dataclass(frozen=True)
class Rule:
    """One megatron-core parameter and the Hugging Face tensor(s) it is made of."""

    mcore: str
    """megatron-core name in the model chunk; ``{i}`` its local layer, ``{e}`` its local expert."""
    hf: tuple[str, ...]
    """Hugging Face name(s), in the order the transform joins them; ``{i}`` / ``{e}`` global indices."""
    kind: str
    """The transform's registered name: 'replicated', 'row', 'vocab', 'qkv', 'gate_up', ..."""
    shape: Optional[tuple[str, ...]] = None
    """Each HF tensor's shape in ``SHAPE_SIZES`` names; for 'qkv' one head's (the transform counts the heads)."""
    layer_type: Optional[str] = None
    """A per-layer rule of one kind of layer only ('full_attention' or 'linear_attention' of a hybrid stack, where
    ``rules.Placement.linear_layers`` says which layers are linear); None: every layer."""

    def __post_init__(self):
        for placeholder in ("{i}", "{e}"):
            if any(placeholder in h for h in self.hf) != (placeholder in self.mcore):
                raise ValueError(f"rule {self.mcore}: {placeholder} must be in the megatron-core name and in every "
                                 f"Hugging Face name, or in neither ({self.hf}).")
        unknown = [s for s in self.shape or () if s not in SHAPE_SIZES]
        if unknown:
            raise ValueError(f"rule {self.mcore}: shape names {unknown} are not sizes; use {list(SHAPE_SIZES)}.")

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.mcore

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.mcore

    def names(self, layer: Optional[int] = None, expert: Optional[int] = None, *, layer_offset: int = 0,
              expert_offset: int = 0) -> tuple[str, tuple[str, ...]]:
        """(megatron-core name, HF names) of local ``layer`` / ``expert``: local indices on the
        megatron-core side, plus the offsets on the HF side.

        >>> Rule("decoder.layers.{i}.x", ("model.layers.{i}.x",), "replicated").names(0, layer_offset=4)
        ('decoder.layers.0.x', ('model.layers.4.x',))
        """
        local = {"i": layer, "e": expert}
        glob = {"i": None if layer is None else layer + layer_offset,
                "e": None if expert is None else expert + expert_offset}
        return _fill(self.mcore, local), tuple(_fill(h, glob) for h in self.hf)


def stacked_part(name: str) -> Optional[tuple[str, int]]:
    """(stacked tensor, index) of an HF name ``<tensor>[<k>]``: slice k of a tensor that stacks every expert of a
    layer along dim 0 (gpt-oss's ``mlp.experts.gate_up_proj`` [experts, hidden, 2 * ffn]); None for a plain name.

    >>> stacked_part("model.layers.0.mlp.experts.down_proj[3]"), stacked_part("model.norm.weight")
    (('model.layers.0.mlp.experts.down_proj', 3), None)
    """
    if not name.endswith("]") or "[" not in name:
        return None
    base, index = name[:-1].rsplit("[", 1)
    return base, int(index)


def _fill(name: str, values: dict[str, Optional[int]]) -> str:
    for key, value in values.items():
        if value is not None:
            name = name.replace("{" + key + "}", str(value))
    return name


@dataclass(frozen=True)
class Refuse:
    """A config.json key the family refuses when it is present with a value not in ``allowed``.

    >>> window = Refuse("sliding_window", "is not supported.", allowed=(None,))
    >>> window.problem({"sliding_window": 4096}, "x", "mistral", "")
    'x: sliding_window=4096 is not supported.'
    """

    key: str
    why: str
    """Completes ``<where>: <key>=<value> ``; ``{model_type}`` and ``{supported}`` are filled in."""
    allowed: tuple = (None, False)
    """Values that pass (by default JSON null, false and 0)."""

    def problem(self, hf: dict[str, Any], where: str, model_type: str, supported: str) -> Optional[str]:
        if self.key not in hf or hf[self.key] in self.allowed:
            return None
        why = self.why.format(model_type=model_type, supported=supported)
        return f"{where}: {self.key}={_show(hf[self.key])} {why}"


def _show(value: Any) -> str:
    """config.json values as a user reads them: true / null / 4096 / 'gelu'."""
    return json.dumps(value) if value is None or isinstance(value, bool) else repr(value)


@dataclass(frozen=True)
class VisionTower:
    """A vision tower and merger used as transformers builds them, under one name prefix on each side.

    Its tensors keep their transformers names: ``visual.blocks.0.attn.qkv.weight`` (the Hub's layout) is
    the parameter ``vision_model.blocks.0.attn.qkv.weight`` of the first pipeline stage, replicated on every
    TP and CP rank (no transform). Example (Qwen2.5-VL): ``VisionTower("Qwen2_5_VisionTransformerPretrainedModel",
    "Qwen2_5_VLVisionConfig")``.
    """

    module_class: str
    """transformers class of the tower (built from config.json's ``vision_config``)."""
    config_class: str
    """transformers class of ``vision_config``."""
    mcore_prefix: str = "vision_model."
    """Prefix of its parameters in the megatron-core model chunk."""
    hf_prefix: str = "visual."
    """Prefix of its tensors in the Hugging Face folder."""
    trainable_when_frozen: tuple[str, ...] = ("merger.",)
    """Parameter prefixes (inside the tower) that still train with ``model.freeze_vision``."""


HF_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""(other spelling, the one the rules use) of HF tensor names: a vision-language folder saved with
transformers' module names (``model.language_model.layers.0...``) reads as the Hub's (``model.layers.0...``)."""


def shape_matches(family: "Family", name: str, got: tuple, want: tuple) -> bool:
    """The file's shape ``got`` of stored tensor ``name`` is the ``want`` config.json implies, or (a name in
    ``family.either_orientation``) ``want`` with its last two dims swapped.

    >>> f = Family("x", "", ("X",), (), either_orientation=("experts.down_proj",))
    >>> shape_matches(f, "m.experts.down_proj", (4, 64, 16), (4, 16, 64)), shape_matches(f, "m.w", (2, 3), (3, 2))
    (True, False)
    """
    got, want = tuple(got), tuple(want)
    if got == want:
        return True
    swapped = want[:-2] + (want[-1], want[-2]) if len(want) >= 2 else want
    return name.endswith(family.either_orientation) and bool(family.either_orientation) and got == swapped


def export_hf_name(name: str, family: "Family") -> str:
    """``name`` (the rules' spelling) as ``family``'s folders store it: transformers' module names where
    ``family.module_names``.

    >>> export_hf_name("visual.merger.norm.weight", Family("x", "", ("X",), (), module_names=True))
    'model.visual.merger.norm.weight'
    """
    if family.module_names:
        for other, ours in HF_ALIASES:
            if name.startswith(ours):
                return other + name[len(ours):]
    return name


def canonical_hf_name(name: str) -> str:
    """``name`` in the Hub spelling the rules use (``HF_ALIASES``).

    >>> canonical_hf_name("model.language_model.norm.weight"), canonical_hf_name("model.norm.weight")
    ('model.norm.weight', 'model.norm.weight')
    """
    for other, ours in HF_ALIASES:
        if name.startswith(other):
            return ours + name[len(other):]
    return name


@dataclass(frozen=True)
class Family:
    """Everything about one Hugging Face model family (``families.py`` holds the supported ones)."""

    model_type: str
    """config.json's ``model_type``."""
    summary: str
    """What is supported, for the refusal messages and docs/models.md."""
    architectures: tuple[str, ...]
    """config.json ``architectures`` accepted (one of them)."""
    rules: tuple[Rule, ...]
    """The name rules, in the order tensors are loaded and exported."""
    model_keys: dict[str, Any] = field(default_factory=dict)
    """``model.*`` keys this family fixes over the common derivation (Qwen2: ``add_qkv_bias=True``)."""
    refused: tuple[Refuse, ...] = ()
    """config.json keys refused, in order, after the checks every family shares."""
    ignored: tuple[str, ...] = ("rotary_emb.inv_freq",)
    """HF tensor name endings that are not weights (buffers recomputed from config.json)."""
    vision: Optional["VisionTower"] = None
    """A vision-language family's vision tower and merger (taken from transformers as they are); None: text only."""
    layer_types: tuple[str, ...] = ("full_attention",)
    """config.json ``layer_types`` values the family reads (its ``derive`` turns a pattern into model.* keys)."""
    rope_types: tuple[str, ...] = ("default", "llama3")
    """RoPE ``rope_type`` values the family reads (Gemma 3's full-attention layers: linear)."""
    text_positions: bool = False
    """RoPE read for text alone: a partial_rotary_factor (model.rotary_percent) and an M-RoPE section (Qwen3.5's
    text stack: with text positions its three position rows are equal, which is plain RoPE) are accepted."""
    either_orientation: tuple[str, ...] = ()
    """Stored tensor name endings whose last two dims may come swapped (Qwen3-VL-MoE's stacked experts: the Hub's
    [E, H, 2F] or transformers 5's ``save_pretrained`` [E, 2F, H]); their transforms read either (``shape_matches``)."""
    partial_rotary: bool = False
    """A ``partial_rotary_factor`` below 1 is read (its derive sets model.rotary_percent) with M-RoPE positions too
    (Qwen3.5 as a vision-language model)."""
    module_names: bool = False
    """The folder stores transformers' module names (``model.language_model.*``, ``model.visual.*``: Qwen3.5,
    Qwen3-VL on the Hub and from ``save_pretrained``): the export writes them (``export_hf_name``); false: the
    spelling the rules use (Qwen2.5-VL's Hub layout)."""
    derive: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None
    """config.json -> the ``model.*`` keys that depend on its values (a MoE family's experts, top-k, router
    normalisation), applied after ``model_keys``; torch-free."""

    def __post_init__(self):
        unknown = sorted(set(self.model_keys) - set(ARCH_KEYS))
        if unknown:
            raise ValueError(f"family {self.model_type}: model_keys {unknown} are not config.json-derived model.* "
                             f"keys ({', '.join(ARCH_KEYS)}).")
        mcore = [r.mcore for r in self.rules]
        if len(set(mcore)) != len(mcore):
            raise ValueError(f"family {self.model_type}: a megatron-core name has two rules.")


FAMILIES: dict[str, Family] = {}
"""model_type -> record, in the order the supported list is shown."""


def register_family(family: Family) -> Family:
    """Add ``family`` to the supported list (its transforms must be registered in model/hf/transforms.py)."""
    if family.model_type in FAMILIES:
        raise ValueError(f"model_type {family.model_type!r} already has a family record.")
    FAMILIES[family.model_type] = family
    return family


def text_view(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as its language model reads it: a vision-language config saved by transformers 5 nests the
    language model's keys under ``text_config`` (the Hub's Qwen2.5-VL files keep them at the top)."""
    text = hf.get("text_config")
    return {**hf, **text} if isinstance(text, dict) else hf


def rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, rope scaling dict with 'rope_type') from either transformers spelling.

    Multimodal RoPE (``{"type": "mrope", "mrope_section": [16, 24, 24]}``) is rope_type 'default' with
    an ``mrope_section``: the frequencies are the default ones, split over three position rows."""
    hf = text_view(hf)
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3, transformers 5): the full-attention layers'
    if isinstance(params, dict):
        scaling = dict(params)
        theta = scaling.pop("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        scaling = dict(hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", 10000.0)
    kind = scaling.get("type", "default")
    scaling.setdefault("rope_type", "default" if kind == "mrope" else kind)
    return float(theta), scaling
