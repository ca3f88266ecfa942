"""The memory estimate's arithmetic on a 2-layer model, by hand (no torch: train --check prints it).

The default tiny model: hidden 64, 4 heads of 16 (q 64) in 2 groups (k, v 32 each), SwiGLU ffn 176,
vocabulary 384, untied output layer, RMSNorm. One layer: qkv 64 x 128 = 8,192, proj 64 x 64 = 4,096,
fc1 64 x 352 = 22,528, fc2 176 x 64 = 11,264, two norms 128: 46,208. The model: 2 x 46,208 +
embedding 24,576 + output 24,576 + final norm 64 = 141,632 parameters.
"""

from __future__ import annotations

import pytest

from megatron_pack.config.schema import Config, DDPConfig, ModelConfig, PackingConfig, ParallelConfig, TrainConfig
from megatron_pack.training.memory_estimate import GIB, estimate_memory, estimate_stage, memory_line

LAYER = 46_208
PARAMS = 2 * LAYER + 2 * 24_576 + 64
PER_TOKEN_LAYER = 4 * (4 * 64 + 2 * 64 + 2 * 32 + 3 * 176)   # 3,904 B: norm/linear inputs, q k v out, fc1 + swiglu
OUTPUT_PER_TOKEN = 384 * 4 + 4 * 2 * 64                      # the loss's fp32 softmax, the final norm
# train.device=cpu (unfused): norms 6 h + 2, RoPE 4 x 16, attention 5 q + 4 heads x 512, SwiGLU 5 ffn
CPU_PER_TOKEN_LAYER = 4 * (6 * 64 + 2 + 4 * 16 + 5 * 64 + 4 * 512 + 5 * 176)   # 14,792 B
CPU_OUTPUT_PER_TOKEN = 384 * 4 + 4 * (3 * 64 + 1)

# (id, config, world size, stage, (params, grads, optimizer, activations) in bytes)
CASES = [
    ("fp32-world1", Config(), 1, 0,
     (4 * PARAMS, 4 * PARAMS, 8 * PARAMS, 512 * (2 * PER_TOKEN_LAYER + OUTPUT_PER_TOKEN))),
    ("fp32-world1-cpu-kernels", Config(train=TrainConfig(device="cpu")), 1, 0,
     (4 * PARAMS, 4 * PARAMS, 8 * PARAMS, 512 * (2 * CPU_PER_TOKEN_LAYER + CPU_OUTPUT_PER_TOKEN))),
    ("fp32-full-recompute", Config(model=ModelConfig(recompute_granularity="full")), 1, 0,
     (4 * PARAMS, 4 * PARAMS, 8 * PARAMS, 512 * (2 * 4 * 64 + max(PER_TOKEN_LAYER, OUTPUT_PER_TOKEN)))),  # softmax freed first
    # bf16 at PP=2 x DP=2 with the distributed optimizer on GPU: stage 0 = 1 layer + embedding, 2 of the
    # 4 micro-batches (global 8 / DP 2) in flight; optimizer 12 B / param over DP 2
    ("bf16-pp2-dp2-distopt-stage0",
     Config(parallel=ParallelConfig(pipeline_model_parallel_size=2), ddp=DDPConfig(use_distributed_optimizer=True),
            train=TrainConfig(bf16=True, device="cuda")), 4, 0,
     (2 * (LAYER + 24_576), 4 * (LAYER + 24_576), 6 * (LAYER + 24_576), 2 * 512 * PER_TOKEN_LAYER // 2)),
    # MoE, 4 experts (ffn 32, top-2) at EP=2 on 4 ranks (DP 4, expert-DP 2), the distributed optimizer, fp32 on GPU.
    # A layer without its experts: qkv 8,192 + proj 4,096 + norms 128 + router 4 x 64 = 12,672; its 2 local experts
    # 2 x (64 x 64 + 32 x 64) = 12,288. Dense 2 x 12,672 + 49,216 = 74,560 (state over DP 4), experts 24,576 (over 2).
    # Activations per layer and token: 4 h + 2 q + 2 kv = 448 elements, the router's 3 x 4 fp32, and per top-k copy
    # 2 h + 3 x 32: 4 x 448 + 48 + 4 x 2 x 224 = 3,632 B
    ("moe-ep2-world4-distopt",
     Config(model=ModelConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32),
            parallel=ParallelConfig(expert_model_parallel_size=2), ddp=DDPConfig(use_distributed_optimizer=True),
            train=TrainConfig(device="cuda")), 4, 0,
     (4 * 99_136, 4 * 99_136, 8 * 74_560 // 4 + 8 * 24_576 // 2, 512 * (2 * 3_632 + OUTPUT_PER_TOKEN))),
    ("bf16-pp2-dp2-distopt-stage1",
     Config(parallel=ParallelConfig(pipeline_model_parallel_size=2), ddp=DDPConfig(use_distributed_optimizer=True),
            train=TrainConfig(bf16=True, device="cuda")), 4, 1,
     (2 * (LAYER + 24_576 + 64), 4 * (LAYER + 24_576 + 64), 6 * (LAYER + 24_576 + 64),
      512 * (PER_TOKEN_LAYER // 2 + 384 * 4 + 2 * 2 * 64))),
]


@pytest.mark.parametrize("cfg,world,stage,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_estimate_by_hand(cfg, world, stage, expected):
    est = estimate_stage(cfg, stage, world)
    assert (est.params, est.grads, est.optimizer, est.activations) == expected
    assert est.total == sum(expected) > 0


def test_worst_rank_and_line():
    cfg = Config(parallel=ParallelConfig(pipeline_model_parallel_size=2), train=TrainConfig(bf16=True))
    stages = [estimate_stage(cfg, s, 2) for s in (0, 1)]
    assert estimate_memory(cfg, 2) == max(stages, key=lambda s: s.total)
    line = memory_line(Config(), 1)
    assert line.startswith("memory per rank (est.): params 0.00, grads 0.00") and "(stage 0 of PP 1;" in line
    assert f"total {estimate_memory(Config()).total / GIB:.2f} GiB" in line


def test_packs_and_context_parallel_divide_the_tokens():
    small = estimate_stage(Config(packing=PackingConfig(packed_sequence_size=256)), 0, 1).activations
    assert small * 2 == estimate_stage(Config(), 0, 1).activations
    cp = Config(parallel=ParallelConfig(context_parallel_size=2))
    assert estimate_stage(cp, 0, 2).activations == small


def test_llama3_70b_recipe_header_matches_the_estimate(tmp_path):
    """The recipe's header states the estimate ``train --check`` prints at its world size (64)."""
    import json
    import re
    import sys
    from pathlib import Path

    from megatron_pack.config import load_config
    from megatron_pack.config.loader import config_dir

    sys.path.insert(0, str(Path(__file__).parent))
    from test_recipes import PRETRAINED

    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PRETRAINED["models/Llama-3.3-70B-Instruct"]))
    cfg = load_config(["experiment=llama3_70b_sft", "data.input=train.jsonl", f"model.pretrained={folder}"],
                      world_size=64)
    est = estimate_memory(cfg, 64)
    header = (config_dir() / "experiment" / "llama3_70b_sft.yaml").read_text()
    stated = [float(x) for x in re.findall(r"-> ([\d.]+) GB|weights ([\d.]+) GB", header.replace(
        "gradients", "weights")) for x in x if x]
    assert est.stage == 0 and f"{est.num_params / 1e9:.2f}e9 parameters" in header
    expected = [est.params / 1e9, est.grads / 1e9, est.optimizer / 1e9]
    assert stated == [round(v, 1) for v in expected]
    assert f"{est.activations / 1e9:.1f} GB; total about {est.total / 1e9:.0f} GB ({est.total / GIB:.0f} GiB)" in header
    training_md = " ".join((config_dir().parent / "docs" / "training.md").read_text().split())
    assert f"`{memory_line(cfg, 64)}`" in training_md  # the example line of docs/training.md


def test_moe_line_counts_the_routed_experts():
    """A MoE config gets numbers (its routed experts modelled), never the dense model's."""
    dense = memory_line(Config(), 1)
    moe = memory_line(Config(model=ModelConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)), 1)
    assert "GiB" in moe and moe != dense and "not computed" not in moe


def test_virtual_stages_hold_the_interleaved_schedules_chunk_forwards():
    """PP=2 x VP=2, 8 micro-batches, 4 layers: stage 0 holds (2-0-1)*2 + (2-1)*2 + 1 = 5 chunk forwards of
    one layer, stage 1 holds 3; at VP=1 the stages hold 2 and 1 micro-batches of two layers. The
    parameters per stage are the same with and without virtual stages (the same layers, in two chunks)."""
    from megatron_pack.training.memory_estimate import microbatches_in_flight, stage_activation_bytes

    model = ModelConfig(num_layers=4)
    plain = Config(model=model, parallel=ParallelConfig(pipeline_model_parallel_size=2))
    virtual = Config(model=model, parallel=ParallelConfig(pipeline_model_parallel_size=2,
                                                          virtual_pipeline_model_parallel_size=2))
    assert [microbatches_in_flight(virtual, s, 1) for s in (0, 1)] == [5, 3]
    assert [microbatches_in_flight(plain, s, 1) for s in (0, 1)] == [2, 1]
    # no output layer on stage 0: the held activations alone, 5 x 1 layer against 2 x 2 layers
    assert stage_activation_bytes(virtual, 0, 1) * 4 == stage_activation_bytes(plain, 0, 1) * 5
    for s in (0, 1):
        assert estimate_stage(virtual, s, 2).params == estimate_stage(plain, s, 2).params
