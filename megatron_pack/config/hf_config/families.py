"""The supported Hugging Face families, one record each (``record.Family``).

Adding a family is one record here (plus, at most, one transform class in
``megatron_pack/model/hf/transforms.py`` when its HF checkpoint lays a tensor out in a way no
registered transform does). Shapes in ``record.SHAPE_SIZES`` names; for Llama 3.1 8B (hidden
4096, 32 heads in 8 groups of 128, FFN 14336, vocabulary 128256) ``("hidden", "q")`` is
[4096, 4096] and ``("ffn", "hidden")`` [14336, 4096].
"""

from __future__ import annotations

from typing import Optional

from megatron_pack.config.hf_config.record import Family, Refuse, Rule, VisionTower, register_family, rope_settings

_L, _A, _M = "decoder.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}."
LLAMA_RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", ("vocab", "hidden")),
    Rule(_L + "input_layernorm.weight", (_M + "input_layernorm.weight",), "replicated", ("hidden",)),
    Rule(_L + "self_attention.linear_qkv.weight", (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"),
         "qkv", ("head_dim", "hidden")),
    Rule(_L + "self_attention.linear_proj.weight", (_A + "o_proj.weight",), "row", ("hidden", "q")),
    Rule(_L + "pre_mlp_layernorm.weight", (_M + "post_attention_layernorm.weight",), "replicated", ("hidden",)),
    Rule(_L + "mlp.linear_fc1.weight", (_M + "mlp.gate_proj.weight", _M + "mlp.up_proj.weight"), "gate_up",
         ("ffn", "hidden")),
    Rule(_L + "mlp.linear_fc2.weight", (_M + "mlp.down_proj.weight",), "row", ("hidden", "ffn")),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", ("hidden",)),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab", ("vocab", "hidden")),
)
QKV_BIAS_RULES = (Rule(_L + "self_attention.linear_qkv.bias", (_A + "q_proj.bias", _A + "k_proj.bias",
                                                               _A + "v_proj.bias"), "qkv", ("head_dim",)),)
QK_NORM_RULES = (Rule(_L + "self_attention.q_layernorm.weight", (_A + "q_norm.weight",), "replicated", ("head_dim",)),
                 Rule(_L + "self_attention.k_layernorm.weight", (_A + "k_norm.weight",), "replicated", ("head_dim",)))

_MOE = "(mixture of experts) is not supported; {supported}."
_MTP = "(multi-token-prediction heads) is not supported; {supported}."
DENSE_REFUSALS = (
    *(Refuse(key, _MOE) for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
                                    "num_experts_per_tok")),
    *(Refuse(key, _MTP) for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")),
    Refuse("use_sliding_window", "is not supported (full causal attention only); {supported}."),
    Refuse("hidden_act", "is not supported (SwiGLU with silu only).", allowed=("silu",)),
    Refuse("mlp_bias", "is not supported (MLP without bias only)."),
)
"""What a dense decoder with full causal attention and a SwiGLU MLP refuses (a MoE family would not
list the expert keys)."""
O_PROJ_BIAS = Refuse("attention_bias", "for {model_type} (a bias on o_proj too) is not supported; QKV bias is "
                     "supported for qwen2 only.")

LLAMA = register_family(Family(
    model_type="llama", summary="Llama 2 / 3 / 3.1 / 3.2 (LlamaForCausalLM; rope_scaling none or llama3)",
    architectures=("LlamaForCausalLM",), rules=LLAMA_RULES, refused=DENSE_REFUSALS + (O_PROJ_BIAS,)))
QWEN2 = register_family(Family(
    model_type="qwen2", summary="Qwen2 / Qwen2.5 dense (Qwen2ForCausalLM; QKV bias; no sliding window)",
    architectures=("Qwen2ForCausalLM",), rules=LLAMA_RULES + QKV_BIAS_RULES, model_keys={"add_qkv_bias": True},
    refused=DENSE_REFUSALS))
QWEN3 = register_family(Family(
    model_type="qwen3", summary="Qwen3 dense (Qwen3ForCausalLM; QK norm; no sliding window)",
    architectures=("Qwen3ForCausalLM",), rules=LLAMA_RULES + QK_NORM_RULES, model_keys={"qk_layernorm": True},
    refused=DENSE_REFUSALS + (O_PROJ_BIAS,)))


def sliding_window_keys(hf: dict) -> dict:
    """config.json's ``sliding_window=W`` (every layer reads its W most recent keys, its own included) as
    ``model.window_size=[W - 1, 0]`` (``model/attention_reach.py``); null: full causal attention.

    >>> sliding_window_keys({"sliding_window": 4096}), sliding_window_keys({"sliding_window": None})
    ({'window_size': [4095, 0]}, {})
    """
    window = hf.get("sliding_window")
    return {"window_size": [int(window) - 1, 0]} if window else {}


MISTRAL = register_family(Family(
    model_type="mistral", summary="Mistral (MistralForCausalLM; sliding_window null or a window on every layer)",
    architectures=("MistralForCausalLM",), rules=LLAMA_RULES, refused=DENSE_REFUSALS + (O_PROJ_BIAS,),
    derive=sliding_window_keys))

# Mixture-of-experts families: the attention of their dense relatives, a router and per-expert SwiGLU MLPs.
# megatron-core's SequentialMLP names expert e's linears mlp.experts.local_experts.{e}.linear_fc1/2; the
# router's [experts, hidden] weight is replicated over TP (every rank routes its own tokens).
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
MOE_ATTENTION_RULES = tuple(r for r in LLAMA_RULES if not r.mcore.endswith(_DENSE_MLP))
_EXPERT = _L + "mlp.experts.local_experts.{e}."


def expert_rules(block: str, gate: str, up: str, down: str, router: str) -> tuple[Rule, ...]:
    """Router and experts of one HF MoE block (``block`` under ``model.layers.{i}.``, names of its linears).

    Qwen3-MoE: ``expert_rules("mlp", "gate_proj", "up_proj", "down_proj", "gate")`` maps
    ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` [moe_intermediate_size, hidden] (with up_proj)
    to ``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight`` [2 * moe_intermediate_size, hidden].
    """
    hf_expert = f"{_M}{block}.experts.{{e}}."
    return (
        Rule(_L + "mlp.router.weight", (f"{_M}{block}.{router}.weight",), "replicated", ("experts", "hidden")),
        Rule(_EXPERT + "linear_fc1.weight", (hf_expert + f"{gate}.weight", hf_expert + f"{up}.weight"), "gate_up",
             ("expert_ffn", "hidden")),
        Rule(_EXPERT + "linear_fc2.weight", (hf_expert + f"{down}.weight",), "row", ("hidden", "expert_ffn")),
    )


def _num_experts(hf: dict) -> int:
    """Qwen3-MoE checkpoints on the Hub spell it num_experts; transformers 5 writes num_local_experts."""
    return int(hf.get("num_experts") or hf["num_local_experts"])


def _qwen3_moe_keys(hf: dict) -> dict:
    # HF: softmax over all experts, top-k, then (norm_topk_prob) divide by the k probabilities' sum,
    # which is the softmax over the k logits: megatron-core's pre_softmax=False; without the
    # renormalisation it is pre_softmax=True (softmax, then top-k of the probabilities).
    return {"num_experts": _num_experts(hf), "moe_router_topk": int(hf["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
            "moe_router_pre_softmax": not bool(hf.get("norm_topk_prob", False))}


def _mixtral_keys(hf: dict) -> dict:
    # HF Mixtral always renormalises the top-k softmax probabilities (softmax over the k logits).
    return {"num_experts": int(hf["num_local_experts"]), "moe_router_topk": int(hf["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(hf["intermediate_size"]), "moe_router_pre_softmax": False}


_EVERY_LAYER = "is not supported (every layer must be a MoE layer: decoder_sparse_step 1, no mlp_only_layers)."
MOE_REFUSALS = (
    *(Refuse(key, _MTP) for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")),
    Refuse("use_sliding_window", "is not supported (full causal attention only); {supported}."),
    Refuse("hidden_act", "is not supported (SwiGLU with silu only).", allowed=("silu",)),
    Refuse("mlp_bias", "is not supported (MLP without bias only)."),
    Refuse("decoder_sparse_step", _EVERY_LAYER, allowed=(None, 1)),
    Refuse("mlp_only_layers", _EVERY_LAYER, allowed=(None, [])),
    Refuse("shared_expert_intermediate_size", "(a shared expert) is not supported for {model_type}.",
           allowed=(None, 0)),
    Refuse("n_shared_experts", "(shared experts) is not supported for {model_type}.", allowed=(None, 0)),
)
"""What a MoE family with full causal attention and SwiGLU experts in every layer refuses."""

QWEN3_MOE = register_family(Family(
    model_type="qwen3_moe", summary="Qwen3-MoE (Qwen3MoeForCausalLM; QK norm; a MoE block in every layer)",
    architectures=("Qwen3MoeForCausalLM",),
    rules=MOE_ATTENTION_RULES + QK_NORM_RULES + expert_rules("mlp", "gate_proj", "up_proj", "down_proj", "gate"),
    model_keys={"qk_layernorm": True}, refused=MOE_REFUSALS + (O_PROJ_BIAS,), derive=_qwen3_moe_keys))
MIXTRAL = register_family(Family(
    model_type="mixtral", summary="Mixtral (MixtralForCausalLM; sliding_window null; router_jitter_noise 0)",
    architectures=("MixtralForCausalLM",),
    rules=MOE_ATTENTION_RULES + expert_rules("block_sparse_moe", "w1", "w3", "w2", "gate"),
    refused=MOE_REFUSALS + (
        Refuse("sliding_window", "is not supported for Mixtral (windows are proved against transformers for "
               "Mistral only); supported: Mixtral with sliding_window null.", allowed=(None,)),
        Refuse("router_jitter_noise", "is not supported (HF multiplies the experts' input by the noise, "
               "megatron-core only the router's); set it to 0.", allowed=(None, 0, 0.0)),
        O_PROJ_BIAS),
    derive=_mixtral_keys))


_SHARED = _L + "mlp.shared_experts."
SHARED_EXPERT_RULES = (
    Rule(_SHARED + "linear_fc1.weight", (_M + "mlp.shared_expert.gate_proj.weight", _M + "mlp.shared_expert.up_proj.weight"),
         "gate_up", ("shared_ffn", "hidden")),
    Rule(_SHARED + "linear_fc2.weight", (_M + "mlp.shared_expert.down_proj.weight",), "row", ("hidden", "shared_ffn")),
    Rule(_SHARED + "gate_weight", (_M + "mlp.shared_expert_gate.weight",), "replicated", ("one", "hidden")),
)
"""Qwen2-MoE's shared expert (every token, megatron-core's SharedExpertMLP) and its sigmoid gate [1, hidden]."""


def _qwen2_moe_keys(hf: dict) -> dict:
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    return {**_qwen3_moe_keys(hf), "add_qkv_bias": bool(hf.get("qkv_bias", True)),
            "moe_shared_expert_ffn_hidden_size": shared or None, "moe_shared_expert_gate": bool(shared)}


QWEN2_MOE = register_family(Family(
    model_type="qwen2_moe", summary="Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM; QKV bias; gated shared expert)",
    architectures=("Qwen2MoeForCausalLM",),
    rules=MOE_ATTENTION_RULES + QKV_BIAS_RULES + expert_rules("mlp", "gate_proj", "up_proj", "down_proj", "gate")
    + SHARED_EXPERT_RULES,
    refused=tuple(r for r in MOE_REFUSALS if r.key != "shared_expert_intermediate_size"), derive=_qwen2_moe_keys))


def _qwen2_5_vl_keys(hf: dict) -> dict:
    # hf is the language model's view (text_config merged over the top level); the M-RoPE sections
    # are rope_scaling's (Hub) or rope_parameters' (transformers 5)
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else hf.get("rope_scaling")
    return {"mrope_section": [int(n) for n in params["mrope_section"]], "image_token_id": int(hf["image_token_id"]),
            "mrope_interleaved": bool(params.get("mrope_interleaved", False))}


QWEN2_5_VL = register_family(Family(
    model_type="qwen2_5_vl", summary="Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration; images; M-RoPE; QKV bias)",
    architectures=("Qwen2_5_VLForConditionalGeneration",), rules=LLAMA_RULES + QKV_BIAS_RULES,
    model_keys={"add_qkv_bias": True}, refused=DENSE_REFUSALS, derive=_qwen2_5_vl_keys,
    vision=VisionTower("Qwen2_5_VisionTransformerPretrainedModel", "Qwen2_5_VLVisionConfig")))


# Gemma 3 (text): Llama's tensors plus QK norms and a norm after attention and after the MLP; every norm scales by
# 1 + weight (zero_centered_norm), so its tensors map as they are stored.
def _gemma3_rule(rule: Rule) -> Rule:
    if rule.mcore.endswith("pre_mlp_layernorm.weight"):  # Gemma's post_attention_layernorm is a post-norm
        return Rule(rule.mcore, (_M + "pre_feedforward_layernorm.weight",), rule.kind, rule.shape)
    return rule


GEMMA3_RULES = tuple(_gemma3_rule(r) for r in LLAMA_RULES) + QK_NORM_RULES + (
    Rule(_L + "self_attention.post_layernorm.weight", (_M + "post_attention_layernorm.weight",), "replicated",
         ("hidden",)),
    Rule(_L + "mlp.post_layernorm.weight", (_M + "post_feedforward_layernorm.weight",), "replicated", ("hidden",)),
)


def gemma3_layer_pattern(layer_types: list[str]) -> Optional[int]:
    """``window_attn_skip_freq`` for Gemma 3's ``layer_types``: every N-th layer full (None: every layer windowed).

    >>> gemma3_layer_pattern(["sliding_attention"] * 5 + ["full_attention"]), gemma3_layer_pattern(["sliding_attention"])
    (6, None)
    """
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    if not full:
        return None
    every = full[0] + 1
    if every < 2 or full != list(range(every - 1, len(layer_types), every)):
        raise ValueError(f"layer_types {layer_types} is not every N-th layer full_attention (N >= 2).")
    return every


def _gemma3_layer_types(hf: dict) -> list[str]:
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    return hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                     for i in range(int(hf["num_hidden_layers"]))]


def _gemma3_rope(hf: dict) -> tuple[float, float, Optional[float]]:
    """(full-attention base, sliding base, linear factor or None) from either transformers spelling."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        return (float(full.get("rope_theta", 1e6)), float(local.get("rope_theta", 1e4)),
                float(full["factor"]) if full.get("rope_type") == "linear" else None)
    scaling = hf.get("rope_scaling") or {}
    factor = float(scaling["factor"]) if scaling.get("rope_type", scaling.get("type")) == "linear" else None
    return float(hf.get("rope_theta", 1e6)), float(hf.get("rope_local_base_freq", 1e4)), factor


def _gemma3_keys(hf: dict) -> dict:
    full_base, local_base, factor = _gemma3_rope(hf)
    every = gemma3_layer_pattern(_gemma3_layer_types(hf))
    window = hf.get("sliding_window")
    return {"activation": "geglu", "qk_layernorm": True, "zero_centered_norm": True, "post_norms": True,
            "scale_embeddings": True, "softmax_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            "rotary_base": int(full_base), "rotary_base_local": int(local_base) if window else None,
            "rope_scaling": "linear" if factor else "none", "rope_scaling_factor": factor or 8.0,
            "window_size": [int(window) - 1, 0] if window else None,
            "window_attn_skip_freq": every if window else None,
            "untie_embeddings_and_output_weights": not bool(hf.get("tie_word_embeddings", True)),
            "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6))}


GEMMA3 = register_family(Family(
    model_type="gemma3_text", summary="Gemma 3 text (Gemma3ForCausalLM; 5 local sliding-window layers to 1 global, "
    "two RoPE bases, QK norm, four norms per layer, scaled tied embeddings)",
    architectures=("Gemma3ForCausalLM",), rules=GEMMA3_RULES,
    refused=tuple(r for r in DENSE_REFUSALS if r.key != "hidden_act") + (
        O_PROJ_BIAS, Refuse("use_bidirectional_attention", "(bidirectional attention) is not supported (causal only)."),
        Refuse("hidden_activation", "is not supported (gelu_pytorch_tanh only).", allowed=("gelu_pytorch_tanh",)),
        Refuse("hidden_act", "is not supported (gelu_pytorch_tanh only).", allowed=(None, "gelu_pytorch_tanh")),
        Refuse("attn_logit_softcapping", "(attention logit soft-capping) is not supported.", allowed=(None,)),
        Refuse("final_logit_softcapping", "(final logit soft-capping) is not supported.", allowed=(None,))),
    layer_types=("full_attention", "sliding_attention"), rope_types=("default", "linear"), derive=_gemma3_keys))


# Qwen3.5 text: Gated DeltaNet (linear attention, model/linear_attention.py) layers with every N-th layer a gated
# full attention (q_proj doubled: each head's query then its output gate); Llama's MLP and norms, every norm but the
# Gated DeltaNet's output norm scaling by 1 + weight.
_LA, _SA = "model.layers.{i}.linear_attn.", _L + "self_attention."
_LLAMA_ATTENTION = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight")
QWEN3_5_RULES = tuple(r for r in LLAMA_RULES if not r.mcore.endswith(_LLAMA_ATTENTION)) + (
    Rule(_SA + "linear_qkv.weight", (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"), "qkv_gated",
         ("head_dim", "hidden"), layer_type="full_attention"),
    Rule(_SA + "linear_proj.weight", (_A + "o_proj.weight",), "row", ("hidden", "q"), layer_type="full_attention"),
    *(Rule(r.mcore, r.hf, r.kind, r.shape, layer_type="full_attention") for r in QK_NORM_RULES),
    Rule(_SA + "in_proj.weight", tuple(_LA + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")), "gdn_columns",
         ("lin_conv", "hidden"), layer_type="linear_attention"),
    Rule(_SA + "conv1d.weight", (_LA + "conv1d.weight",), "gdn_columns", ("lin_conv", "one", "conv_width"),
         layer_type="linear_attention"),
    Rule(_SA + "dt_bias", (_LA + "dt_bias",), "gdn_columns", ("lin_heads",), layer_type="linear_attention"),
    Rule(_SA + "A_log", (_LA + "A_log",), "gdn_columns", ("lin_heads",), layer_type="linear_attention"),
    Rule(_SA + "out_norm.weight", (_LA + "norm.weight",), "replicated", ("lin_dv",), layer_type="linear_attention"),
    Rule(_SA + "out_proj.weight", (_LA + "out_proj.weight",), "row", ("hidden", "lin_v"),
         layer_type="linear_attention"),
)


def hybrid_layer_interval(layer_types: list[str]) -> int:
    """``model.full_attention_interval`` for Qwen3.5's ``layer_types``: every N-th layer full attention.

    >>> hybrid_layer_interval(["linear_attention"] * 3 + ["full_attention"]), hybrid_layer_interval(["full_attention"])
    (4, 1)
    """
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    every = full[0] + 1 if full else 0
    if not full or full != list(range(every - 1, len(layer_types), every)):
        raise ValueError(f"layer_types {layer_types} is not every N-th layer full_attention (N >= 1), the others "
                         "linear_attention.")
    return every


def _qwen3_5_keys(hf: dict) -> dict:
    every = int(hf.get("full_attention_interval") or 4)
    layer_types = hf.get("layer_types") or ["linear_attention" if (i + 1) % every else "full_attention"
                                            for i in range(int(hf["num_hidden_layers"]))]
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))  # transformers' default
    return {"qk_layernorm": True, "zero_centered_norm": True, "attention_output_gate": True,
            "rotary_percent": float(partial), "full_attention_interval": hybrid_layer_interval(layer_types),
            **{key: int(hf[key]) for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                             "linear_value_head_dim", "linear_conv_kernel_dim")}}


QWEN3_5 = register_family(Family(
    model_type="qwen3_5_text", summary="Qwen3.5 text, dense (Qwen3_5ForCausalLM; Gated DeltaNet linear attention with "
    "every N-th layer a gated full attention, QK norm, partial RoPE; no MTP head)",
    architectures=("Qwen3_5ForCausalLM",), rules=QWEN3_5_RULES,
    # mtp_num_hidden_layers stays in the text config transformers saves from a Hub folder; Qwen3_5ForCausalLM builds
    # no MTP head from it (nor do we: a folder that still holds mtp.* tensors is refused by the folder check)
    refused=tuple(r for r in DENSE_REFUSALS if not r.key.startswith("mtp_")) + (O_PROJ_BIAS,),
    layer_types=("full_attention", "linear_attention"), text_positions=True, derive=_qwen3_5_keys))


def _qwen3_5_moe_keys(hf: dict) -> dict:
    # HF: softmax over all experts, top-k, then always divided by the k probabilities' sum (megatron-core's
    # pre_softmax=False); a shared expert behind a sigmoid gate in every layer
    return {**_qwen3_5_keys(hf), "num_experts": int(hf["num_experts"]),
            "moe_router_topk": int(hf["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]), "moe_router_pre_softmax": False,
            "ffn_hidden_size": int(hf["moe_intermediate_size"]),
            "moe_shared_expert_ffn_hidden_size": int(hf.get("shared_expert_intermediate_size") or 0) or None,
            "moe_shared_expert_gate": bool(hf.get("shared_expert_intermediate_size"))}


QWEN3_5_MOE = register_family(Family(
    model_type="qwen3_5_moe_text", summary="Qwen3.5-MoE text (Qwen3_5MoeForCausalLM; Qwen3.5's hybrid layers, a MoE "
    "block with a gated shared expert in every layer; no MTP head)",
    architectures=("Qwen3_5MoeForCausalLM",),
    rules=tuple(r for r in QWEN3_5_RULES if not r.mcore.endswith(_DENSE_MLP))
    + expert_rules("mlp", "gate_proj", "up_proj", "down_proj", "gate") + SHARED_EXPERT_RULES,
    refused=tuple(r for r in MOE_REFUSALS
                  if not r.key.startswith("mtp_") and r.key != "shared_expert_intermediate_size")
    + (O_PROJ_BIAS,),
    layer_types=("full_attention", "linear_attention"), text_positions=True, derive=_qwen3_5_moe_keys))


# gpt-oss: attention with biases on q/k/v/o and a learnable sink logit per head, windowed and full layers in
# turn, YaRN RoPE, and a MoE block whose router and experts carry biases. transformers stacks every expert of a
# layer in one tensor: ``name[e]`` is its slice e (``record.stacked_part``). gate_up_proj[e] [hidden, 2 * ffn]
# interleaves gate and up columns (gate = [:, 0::2], up = [:, 1::2]); down_proj[e] is [ffn, hidden] (x @ W, not
# W @ x as a linear's weight).
_OSS = _M + "mlp."
GPT_OSS_RULES = MOE_ATTENTION_RULES + QKV_BIAS_RULES + (
    Rule(_L + "self_attention.linear_proj.bias", (_A + "o_proj.bias",), "replicated", ("hidden",)),
    Rule(_L + "self_attention.core_attention.softmax_offset", (_A + "sinks",), "heads", ("heads",)),
    Rule(_L + "mlp.router.weight", (_OSS + "router.weight",), "replicated", ("experts", "hidden")),
    Rule(_L + "mlp.router.bias", (_OSS + "router.bias",), "replicated", ("experts",)),
    Rule(_EXPERT + "linear_fc1.weight", (_OSS + "experts.gate_up_proj[{e}]",), "interleaved_gate_up",
         ("hidden", "expert_ffn")),
    Rule(_EXPERT + "linear_fc1.bias", (_OSS + "experts.gate_up_proj_bias[{e}]",), "interleaved_gate_up",
         ("expert_ffn",)),
    Rule(_EXPERT + "linear_fc2.weight", (_OSS + "experts.down_proj[{e}]",), "row_transposed", ("expert_ffn", "hidden")),
    Rule(_EXPERT + "linear_fc2.bias", (_OSS + "experts.down_proj_bias[{e}]",), "replicated", ("hidden",)),
)


def yarn_keys(hf: dict, head_dim: int) -> dict:
    """config.json's YaRN rope_scaling as model.* keys: the frequencies (``rope_scaling=yarn`` and its numbers) and
    the attention factor ``a`` that transformers multiplies cos and sin by, which scales every attention logit by
    ``a ** 2``: ``softmax_scale = a ** 2 / sqrt(head_dim)`` (``a = 0.1 ln(factor) + 1`` unless given).

    >>> keys = yarn_keys({"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    ...                   "original_max_position_embeddings": 4096, "truncate": False}}, 64)
    >>> keys["rope_scaling_factor"], keys["rope_yarn_truncate"], round(keys["softmax_scale"], 6)
    (32.0, False, 0.226658)
    """
    import math

    scaling = rope_settings(hf)[1]
    if scaling["rope_type"] != "yarn":
        return {"rope_scaling": "none"}
    factor = float(scaling["factor"])
    attention = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return {"rope_scaling": "yarn", "rope_scaling_factor": factor,
            "rope_original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
            "rope_yarn_beta_fast": float(scaling.get("beta_fast") or 32.0),
            "rope_yarn_beta_slow": float(scaling.get("beta_slow") or 1.0),
            "rope_yarn_truncate": bool(scaling.get("truncate", True)),
            "softmax_scale": float(attention) ** 2 / math.sqrt(head_dim)}


def mxfp4_integration() -> bool:
    """transformers ships its MXFP4 integration (``transformers.integrations.mxfp4``, >= 4.55), found without
    importing transformers (this layer is torch-free)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("transformers")
    return bool(spec and spec.submodule_search_locations and any(
        (Path(p) / "integrations" / "mxfp4.py").is_file() for p in spec.submodule_search_locations))


class RefuseQuantization(Refuse):
    """A quantised checkpoint: MXFP4 (the Hub's gpt-oss) loads, dequantised by transformers' own code
    (``model/hf/load.py``), where transformers has it; anything else is refused with the way to dequantise it."""

    def problem(self, hf, where, model_type, supported):
        config = hf.get(self.key)
        if isinstance(config, dict) and config.get("quant_method") == "mxfp4" and mxfp4_integration():
            return None
        if isinstance(config, dict) and config.get("quant_method") == "mxfp4":
            return (f"{where}: quantization_config quant_method 'mxfp4' is dequantised on load by transformers' MXFP4 "
                    "integration (transformers >= 4.55), which is not installed; install it, or "
                    + self.why.removeprefix("is not loaded as it is: "))
        return super().problem(hf, where, model_type, supported)


def _gpt_oss_keys(hf: dict) -> dict:
    layer_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(int(hf["num_hidden_layers"]))]
    window = hf.get("sliding_window") if "sliding_attention" in layer_types else None
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    return {"num_experts": int(hf["num_local_experts"]), "moe_router_topk": int(hf["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(hf["intermediate_size"]), "moe_router_pre_softmax": False,
            "add_qkv_bias": True, "add_bias_linear": True, "softmax_type": "learnable", "activation": "quick_geglu",
            "glu_linear_offset": 1.0, "activation_clamp": float(hf.get("swiglu_limit", 7.0)),
            "window_size": [int(window) - 1, 0] if window else None,
            "window_attn_skip_freq": gemma3_layer_pattern(layer_types) if window else None,
            **yarn_keys(hf, head_dim)}


GPT_OSS = register_family(Family(
    model_type="gpt_oss", summary="gpt-oss (GptOssForCausalLM; sliding-window and full layers in turn, learnable "
    "sinks, YaRN, a biased MoE block with a clamped SwiGLU; MXFP4 experts dequantised on load)",
    architectures=("GptOssForCausalLM",), rules=GPT_OSS_RULES,
    refused=(
        RefuseQuantization("quantization_config", "is not loaded as it is: dequantise it with transformers and save "
                           "it in bf16 (GptOssForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config("
                           "dequantize=True), dtype=torch.bfloat16).save_pretrained(out)), then set "
                           "model.pretrained=out.", allowed=(None,)),
        Refuse("attention_bias", "is not supported (gpt-oss with biases on q/k/v/o only).", allowed=(True, None)),
        Refuse("swiglu_alpha", "is not supported (the experts' gate is x * sigmoid(1.702 x): swiglu_alpha 1.702).",
               allowed=(None, 1.702)),
        Refuse("router_jitter_noise", "is not supported; set it to 0.", allowed=(None, 0, 0.0)),
        *(Refuse(key, _MTP) for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"))),
    layer_types=("full_attention", "sliding_attention"), rope_types=("default", "yarn"), derive=_gpt_oss_keys))



# Qwen3.5 and Qwen3-VL as vision-language models: the text stacks above (Qwen3.5's hybrid one, Qwen3's), interleaved
# M-RoPE (Qwen3.5: on its partial rotary dims), and transformers' vision towers (Qwen3-VL's with DeepStack). Hub and
# transformers both store them under transformers' module names (model.language_model.*, model.visual.*), which the
# export writes back.
def _deepstack_keys(hf: dict) -> dict:
    """``model.deepstack_layers``: Qwen3-VL adds the features of its ``deepstack_visual_indexes`` blocks after
    decoder layers 0, 1, ... in that order (transformers' ``_deepstack_process``).

    >>> _deepstack_keys({"vision_config": {"deepstack_visual_indexes": [8, 16, 24]}})
    {'deepstack_layers': 3}
    """
    return {"deepstack_layers": len((hf.get("vision_config") or {}).get("deepstack_visual_indexes") or [])}


QWEN3_5_VL = register_family(Family(
    model_type="qwen3_5", summary="Qwen3.5, dense, vision-language (Qwen3_5ForConditionalGeneration; the Qwen3.5 text "
    "stack with interleaved M-RoPE on its partial rotary dims; images; no MTP head; video refused)",
    architectures=("Qwen3_5ForConditionalGeneration",), rules=QWEN3_5_RULES,
    refused=QWEN3_5.refused, layer_types=("full_attention", "linear_attention"), partial_rotary=True,
    derive=lambda hf: {**_qwen3_5_keys(hf), **_qwen2_5_vl_keys(hf)},
    vision=VisionTower("Qwen3_5VisionModel", "Qwen3_5VisionConfig", hf_prefix="visual."), module_names=True))
QWEN3_5_MOE_VL = register_family(Family(
    model_type="qwen3_5_moe", summary="Qwen3.5-MoE, vision-language (Qwen3_5MoeForConditionalGeneration; the "
    "Qwen3.5-MoE text stack with interleaved M-RoPE; images; no MTP head; video refused)",
    architectures=("Qwen3_5MoeForConditionalGeneration",), rules=QWEN3_5_MOE.rules,
    refused=QWEN3_5_MOE.refused, layer_types=("full_attention", "linear_attention"), partial_rotary=True,
    derive=lambda hf: {**_qwen3_5_moe_keys(hf), **_qwen2_5_vl_keys(hf)},
    vision=VisionTower("Qwen3_5MoeVisionModel", "Qwen3_5MoeVisionConfig"), module_names=True))
QWEN3_VL = register_family(Family(
    model_type="qwen3_vl", summary="Qwen3-VL, dense (Qwen3VLForConditionalGeneration; Qwen3's text stack with "
    "interleaved M-RoPE; DeepStack; images; video refused)",
    architectures=("Qwen3VLForConditionalGeneration",), rules=LLAMA_RULES + QK_NORM_RULES,
    model_keys={"qk_layernorm": True}, refused=DENSE_REFUSALS + (O_PROJ_BIAS,),
    derive=lambda hf: {**_qwen2_5_vl_keys(hf), **_deepstack_keys(hf)},
    vision=VisionTower("Qwen3VLVisionModel", "Qwen3VLVisionConfig",
                       trainable_when_frozen=("merger.", "deepstack_merger_list.")), module_names=True))


# Qwen3-VL-MoE: Qwen3-MoE's attention and router (softmax, top-k, always renormalised) with each layer's experts
# stacked: mlp.experts.gate_up_proj [E, H, 2F] (x @ W, gate columns then up) and down_proj [E, F, H] on the Hub;
# transformers 5's save_pretrained keeps its modules' [E, 2F, H] / [E, H, F], which read too (either_orientation);
# the export writes the Hub's.
def _qwen3_vl_moe_keys(hf: dict) -> dict:
    return {**_qwen2_5_vl_keys(hf), **_deepstack_keys(hf), "num_experts": _num_experts(hf),
            "moe_router_topk": int(hf["num_experts_per_tok"]), "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
            "moe_router_pre_softmax": False}


QWEN3_VL_MOE = register_family(Family(
    model_type="qwen3_vl_moe", summary="Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration; Qwen3-MoE's text stack with "
    "interleaved M-RoPE, stacked experts; DeepStack; images; video refused)",
    architectures=("Qwen3VLMoeForConditionalGeneration",),
    rules=MOE_ATTENTION_RULES + QK_NORM_RULES + (
        Rule(_L + "mlp.router.weight", (_M + "mlp.gate.weight",), "replicated", ("experts", "hidden")),
        Rule(_EXPERT + "linear_fc1.weight", (_M + "mlp.experts.gate_up_proj[{e}]",), "stacked_gate_up",
             ("hidden", "expert_ffn")),
        Rule(_EXPERT + "linear_fc2.weight", (_M + "mlp.experts.down_proj[{e}]",), "stacked_down",
             ("expert_ffn", "hidden"))),
    model_keys={"qk_layernorm": True}, refused=MOE_REFUSALS + (O_PROJ_BIAS,), derive=_qwen3_vl_moe_keys,
    either_orientation=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    vision=VisionTower("Qwen3VLMoeVisionModel", "Qwen3VLMoeVisionConfig",
                       trainable_when_frozen=("merger.", "deepstack_merger_list.")), module_names=True))
