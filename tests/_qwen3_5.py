"""Tiny random Qwen3.5 text folders (dense and MoE), built with transformers' own classes, for the unit proofs
(tests/unit/test_qwen3_5.py) and the command-line runs (tests/functional/test_qwen3_5_cli.py).

4 layers in Qwen3.5's pattern: three Gated DeltaNet linear-attention layers, then one gated full attention (q_proj
doubled for the output gate, QK norms, partial RoPE 0.25); norms that scale by 1 + weight drawn away from 0, the
Gated DeltaNet's output norm plain; decays moved off their init. The MoE folder has the same layers with 4 experts
(top 2) and a gated shared expert in every layer, its router drawn so that tokens spread over the experts.
"""

from __future__ import annotations

import torch

VOCAB = 301
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def text_config(**extra):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=LAYER_TYPES, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        bos_token_id=1, eos_token_id=2, pad_token_id=0), **extra})


def make_dense_folder(root, folder_name: str = "qwen3_5") -> str:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    from _hf import save_tokenizer

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(text_config())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms drawn so a dropped or mis-centred one would show; decays not at their init
        for name, param in model.named_parameters():
            noise = 0.3 * torch.randn(param.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):  # plain RMSNorm weight (scale w)
                param.copy_(1.0 + noise)
            elif "norm" in name:  # Qwen3_5RMSNorm: scale 1 + w
                param.copy_(noise)
            elif name.endswith(("dt_bias", "A_log")):
                param.add_(noise)
    path = root / folder_name
    model.save_pretrained(path)
    save_tokenizer(path)
    return str(path)


def samples(lengths=(47, 9, 30), seed=4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() + [2] for n in lengths]


def make_moe_folder(root, folder_name: str = "qwen3_5_moe") -> str:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    from _hf import save_tokenizer

    dense = {k: v for k, v in text_config().to_dict().items() if k in Qwen3_5MoeTextConfig.__dataclass_fields__
             and k not in ("model_type", "transformers_version", "intermediate_size")}
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**dense, "moe_intermediate_size": 24, "num_experts": 4,
                                                          "num_experts_per_tok": 2,
                                                          "shared_expert_intermediate_size": 32}))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as the dense folder; the router drawn so that tokens spread over the experts
        for name, param in model.named_parameters():
            noise = 0.3 * torch.randn(param.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + noise)
            elif "norm" in name or name.endswith("mlp.gate.weight"):
                param.copy_(noise if "norm" in name else 3 * noise)
            elif name.endswith(("dt_bias", "A_log")):
                param.add_(noise)
    path = root / folder_name
    model.save_pretrained(path)
    save_tokenizer(path)
    return str(path)
