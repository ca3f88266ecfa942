"""The Hugging Face <-> megatron-core name tables: one record per family, torch-free.

``mapping`` adds the transforms (torch) that load and export by these tables; the checks made
before launch (``megatron_pack.model.hf.folder_check``) read only the tables and the shapes
config.json gives, so they run without torch. Example (Llama, layer 0)::

    Rule("decoder.layers.{i}.mlp.linear_fc1.weight",
         ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), "gate_up")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_pack.config.hf_config import derive_model_keys


@dataclass(frozen=True)
class Rule:
    """One megatron-core parameter and the Hugging Face tensor(s) it maps to."""

    mcore: str
    """megatron-core name; ``{i}`` is the layer index."""
    hf: tuple[str, ...]
    """Hugging Face name(s), in the order the transform joins them."""
    kind: str
    """'replicated', 'row', 'vocab', 'qkv' or 'gate_up'."""

    def names(self, layer: Optional[int]) -> tuple[str, tuple[str, ...]]:
        fill = (lambda s: s.format(i=layer)) if layer is not None else (lambda s: s)
        return fill(self.mcore), tuple(fill(h) for h in self.hf)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.mcore


_L, _A, _M = "decoder.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}."
LLAMA = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule(_L + "input_layernorm.weight", (_M + "input_layernorm.weight",), "replicated"),
    Rule(_L + "self_attention.linear_qkv.weight", (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"),
         "qkv"),
    Rule(_L + "self_attention.linear_proj.weight", (_A + "o_proj.weight",), "row"),
    Rule(_L + "pre_mlp_layernorm.weight", (_M + "post_attention_layernorm.weight",), "replicated"),
    Rule(_L + "mlp.linear_fc1.weight", (_M + "mlp.gate_proj.weight", _M + "mlp.up_proj.weight"), "gate_up"),
    Rule(_L + "mlp.linear_fc2.weight", (_M + "mlp.down_proj.weight",), "row"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab"),
)
QKV_BIAS = (Rule(_L + "self_attention.linear_qkv.bias", (_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias"),
                 "qkv"),)
QK_NORM = (Rule(_L + "self_attention.q_layernorm.weight", (_A + "q_norm.weight",), "replicated"),
           Rule(_L + "self_attention.k_layernorm.weight", (_A + "k_norm.weight",), "replicated"))
FAMILY_RULES: dict[str, tuple[Rule, ...]] = {
    "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA + QKV_BIAS, "qwen3": LLAMA + QK_NORM,
}
TE_ALIASES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
"""local-spec suffix -> Transformer Engine spec suffix of the same tensor."""
IGNORED_HF = ("rotary_emb.inv_freq",)
"""HF tensors that are buffers recomputed from config.json (older checkpoints store them)."""




def rules_for(model_type: str, *, tied: bool, num_layers: int) -> list[tuple[Rule, str, tuple[str, ...]]]:
    """Every (rule, megatron name, HF names) of a model, in layer order; no output layer when tied."""
    out = []
    for rule in FAMILY_RULES[model_type]:
        if tied and rule.mcore == "output_layer.weight":
            continue
        for layer in (range(num_layers) if rule.per_layer else [None]):
            mcore, hf = rule.names(layer)
            out.append((rule, mcore, hf))
    return sorted(out, key=lambda item: _order(item[1]))


def _order(name: str) -> tuple:
    if name.startswith("embedding"):
        return (0,)
    if name.startswith("decoder.layers."):
        return (1, int(name.split(".")[2]))
    return (2, name)




def hf_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a supported config.json, in table order.

    Example: Llama with hidden 64, 4 heads of 16 in 2 groups, FFN 96, vocabulary 301 gives
    ``model.embed_tokens.weight (301, 64)``, ``...self_attn.k_proj.weight (32, 64)``,
    ``...mlp.gate_proj.weight (96, 64)``, ``model.norm.weight (64,)``.
    """
    m = derive_model_keys(hf)
    h, d, f, v = m["hidden_size"], m["kv_channels"], m["ffn_hidden_size"], m["vocab_size"]
    q, kv = m["num_attention_heads"] * d, m["num_query_groups"] * d
    by_suffix = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "q_proj.weight": (q, h),
                 "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "q_proj.bias": (q,), "k_proj.bias": (kv,),
                 "v_proj.bias": (kv,), "o_proj.weight": (h, q), "gate_proj.weight": (f, h), "up_proj.weight": (f, h),
                 "down_proj.weight": (h, f), "q_norm.weight": (d,), "k_norm.weight": (d,), "layernorm.weight": (h,),
                 "norm.weight": (h,)}
    shapes = {}
    tied = not m["untie_embeddings_and_output_weights"]
    for _, _, names in rules_for(hf["model_type"], tied=tied, num_layers=m["num_layers"]):
        for name in names:
            shapes[name] = next(shape for suffix, shape in by_suffix.items() if name.endswith(suffix))
    return shapes
