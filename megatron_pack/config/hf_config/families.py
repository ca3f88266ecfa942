"""The supported Hugging Face families, one record each (``record.Family``).

Adding a family is one record here (plus, at most, one transform class in
``megatron_pack/model/hf/transforms.py`` when its HF checkpoint lays a tensor out in a way no
registered transform does). Shapes in ``record.SHAPE_SIZES`` names; for Llama 3.1 8B (hidden
4096, 32 heads in 8 groups of 128, FFN 14336, vocabulary 128256) ``("hidden", "q")`` is
[4096, 4096] and ``("ffn", "hidden")`` [14336, 4096].
"""

from __future__ import annotations

from megatron_pack.config.hf_config.record import Family, Refuse, Rule, register_family

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
MISTRAL = register_family(Family(
    model_type="mistral", summary="Mistral (MistralForCausalLM; sliding_window null)",
    architectures=("MistralForCausalLM",), rules=LLAMA_RULES,
    refused=DENSE_REFUSALS + (Refuse("sliding_window", "is not supported (THD attention here is full causal); "
                                     "supported: Mistral with sliding_window null.", allowed=(None,)),
                              O_PROJ_BIAS)))
