"""The memory estimate of a hybrid linear-attention stack (Qwen3.5), by hand (no torch: train --check prints it).

The default tiny model (hidden 64, 4 heads of 16 in 2 groups, SwiGLU ffn 176, vocabulary 384, 512-token packs) with
``model.full_attention_interval=2``: layer 0 a Gated DeltaNet, layer 1 full attention. Gated DeltaNet sizes: 2 key
heads of dk 8 (qk 16), 4 value heads of dv 16 (v 64), conv1d width 4 (conv channels 2 qk + v = 96).

Per token of the Gated DeltaNet's mixer, in the parameters' dtype (float32 here, 4 B):
in_proj's output 2 qk + 2 v + 2 hv = 168; the conv1d's 4 taps' inputs and its sum before and after SiLU (4 + 2) x 96
= 576; q and k normalised and expanded to the value heads 2 x 4 x 8 = 64; the gated norm's 4 v = 256: 1,064 elements.
fp32: g and beta 2 x 4 = 8, and with fla (the GPU) the chunk matrix A 64 x 4 = 256; with the torch kernel (the CPU)
every chunk's copies and products 4 x (8 x 8 + 7 x 16 + 3 x 64 + 3) = 1,484 and the recurrent state, one fp32
[4, 8, 16] per 64 tokens: 4 x 4 x 8 x 16 / 64 = 32 B per token.
"""

from __future__ import annotations

import pytest

from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_pack.training.memory_estimate import estimate_stage, linear_state_bytes_per_token

HYBRID = dict(full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=16, linear_conv_kernel_dim=4)
MIXER = 4 * 1_064                                              # the mixer's elements, float32
FULL_LAYER = 4 * (4 * 64 + 2 * 64 + 2 * 32 + 3 * 176)          # 3,904 B (test_memory_estimate_arithmetic's)
OUTPUT = 384 * 4 + 4 * 2 * 64                                  # the loss's fp32 softmax, the final norm
# GPU: the layer's norms and linear inputs 4 h and SwiGLU 3 ffn, the mixer, fla's fp32 g, beta and A
LINEAR_LAYER = 4 * (4 * 64 + 3 * 176) + MIXER + 4 * (8 + 256)  # 3,136 + 4,256 + 1,056 = 8,448 B
# CPU (unfused): norms 6 h + 2, SwiGLU 5 ffn; attention as test_memory_estimate_arithmetic's
CPU_FULL_LAYER = 4 * (6 * 64 + 2 + 4 * 16 + 5 * 64 + 4 * 512 + 5 * 176)          # 14,792 B
CPU_LINEAR_LAYER = 4 * (6 * 64 + 2 + 5 * 176) + MIXER + 4 * (8 + 1_484) + 32       # 5,064 + 4,256 + 5,968 + 32
CPU_OUTPUT = 384 * 4 + 4 * (3 * 64 + 1)

CASES = [  # (id, config, activations of the one stage in bytes)
    ("gpu", Config(model=ModelConfig(**HYBRID), train=TrainConfig(device="cuda")),
     512 * (FULL_LAYER + LINEAR_LAYER + OUTPUT)),  # fla's recomputed states (32 B per token) < the output's
    ("cpu", Config(model=ModelConfig(**HYBRID), train=TrainConfig(device="cpu")),
     512 * (CPU_FULL_LAYER + CPU_LINEAR_LAYER + CPU_OUTPUT)),
    # the output gate (q_proj doubled) keeps its rows and their sigmoid, 2 q = 128 more elements per full layer
    ("gpu-gated", Config(model=ModelConfig(**HYBRID, attention_output_gate=True), train=TrainConfig(device="cuda")),
     512 * (FULL_LAYER + 4 * 128 + LINEAR_LAYER + OUTPUT)),
]


@pytest.mark.parametrize("cfg,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hybrid_activations_by_hand(cfg, expected):
    assert CPU_LINEAR_LAYER == 15_320 and LINEAR_LAYER == 8_448  # the sums in the comments above
    assert estimate_stage(cfg, 0, 1).activations == expected


def test_the_recurrent_state_is_counted_per_chunk_and_split_over_tensor_parallel_heads():
    """Qwen3.5's sizes (32 value heads of dk = dv = 128): one fp32 [heads, 128, 128] state per 64 tokens is 32 KiB per
    token on one rank, 16 KiB at TP=2 (each rank runs half of the heads); CP leaves it per local token (a rank runs
    every token of heads / CP after the all-to-all)."""
    big = dict(HYBRID, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128)
    one = Config(model=ModelConfig(**big))
    assert linear_state_bytes_per_token(one) == 4 * 32 * 128 * 128 // 64 == 32_768
    tp2 = Config(model=ModelConfig(**big), parallel=ParallelConfig(tensor_model_parallel_size=2))
    cp2 = Config(model=ModelConfig(**big), parallel=ParallelConfig(context_parallel_size=2))
    assert linear_state_bytes_per_token(tp2) == 16_384 and linear_state_bytes_per_token(cp2) == 32_768
