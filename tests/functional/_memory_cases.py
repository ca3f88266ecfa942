"""The memory estimate ``train --check`` prints against what a real step allocates (2 gloo ranks, CPU).

The cases run inside test_recompute.py's 2-rank world (one world, no second start-up); the
assertions are ``test_memory_estimate_within_25_percent_of_measured`` there.

For each layout a tiny model runs one training step on full packs of packing.packed_sequence_size
tokens, and each component the estimate models is measured on every rank: parameter bytes, the
DDP main-grad buffer's bytes, the optimizer-state bytes (megatron-core's optimizer: Adam moments of this rank's
main params, whole or its distributed shard, plus fp32 main copies of 16-bit weights) and the peak bytes autograd
held for backward
(``SavedActivationMeter``; on CPU there is no allocator peak). Each must be within 25% of the
estimate for that rank's stage, and the total too. The cases (and their numbers) are the table in
docs/benchmarks.md.
"""

from __future__ import annotations

from _dist import ListLoader

TOLERANCE = 0.25
COMMON = ["packing.packed_sequence_size=256", "model.seq_length=256", "model.num_layers=2", "model.hidden_size=64",
          "model.ffn_hidden_size=176", "train.global_batch_size=4", "train.device=cpu"]
CASES = {"dp2": [], "dp2_distributed_optimizer_full_recompute": ["ddp.use_distributed_optimizer=true",
                                                                "model.recompute_granularity=full"],
         "dp2_selective_recompute": ["model.recompute_granularity=selective"],
         "pp2": ["parallel.pipeline_model_parallel_size=2"],
         # 4 routed experts (top-2), 2 per rank: dense state sharded over DP, each rank's experts whole (expert-DP 1)
         "dp2_moe_ep2_distributed_optimizer": ["model.num_experts=4", "model.moe_router_topk=2",
                                               "model.moe_ffn_hidden_size=96", "parallel.expert_model_parallel_size=2",
                                               "model.moe_aux_loss_coeff=0.01", "ddp.use_distributed_optimizer=true"],
         # a hybrid stack (Qwen3.5's layers): layer 0 a packed Gated DeltaNet (its conv1d window, the torch kernel's
         # chunk products and recurrent states), layer 1 gated full attention
         "dp2_hybrid_linear_attention": ["model.full_attention_interval=2", "model.linear_num_key_heads=2",
                                         "model.linear_num_value_heads=4", "model.linear_key_head_dim=16",
                                         "model.linear_value_head_dim=16", "model.attention_output_gate=true"]}
COMPONENTS = ("params", "grads", "optimizer", "activations", "total")


def _full_packs(num_packs: int) -> list[dict]:
    """Packs of one 256-token sample each (the worst pack the estimate assumes), half prompt."""
    import numpy as np

    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(0)
    packs, next_id = [], 0
    for _ in range(num_packs):
        samples = []
        for length in (256,):
            samples.append({"input_ids": rng.integers(1, 380, size=length).tolist(),
                            "loss_mask": [0] * (length // 2) + [1] * (length - length // 2), "sample_id": next_id})
            next_id += 1
        packs.append(collate_thd(samples, pack_size=256, pad_multiple=4))
    return packs


def _measure(trainer, meter) -> dict:
    opt = trainer.optimizer
    params = list(trainer.model.parameters())
    grads = {}
    for p in params:
        storage = p.main_grad.untyped_storage()
        grads[storage.data_ptr()] = storage.nbytes()
    state = 0
    for part in opt.parts:
        state += sum(t.numel() * t.element_size() for s in part.optimizer.state.values() for t in s.values()
                     if t.dim() > 0)
        copies = getattr(part, "fp32_from_float16_groups", None) or getattr(part, "shard_fp32_from_float16_groups", [])
        state += sum(p.numel() * p.element_size() for group in copies for p in group)  # main params of 16-bit ones
    out = {"params": sum(p.numel() * p.element_size() for p in params), "grads": sum(grads.values()),
           "optimizer": state, "activations": meter.peak_bytes}
    out["total"] = sum(out.values())
    return out


def memory_cases(world: int, tmp: str) -> dict:
    """``{case.component: (measured bytes, estimated bytes)}`` of this rank, every case of ``CASES``."""
    from megatron_pack.config import load_config
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer
    from megatron_pack.training.memory import SavedActivationMeter
    from megatron_pack.training.memory_estimate import estimate_stage

    out = {}
    for name, extra in CASES.items():
        cfg = load_config([*COMMON, f"train.output_dir={tmp}/memory_{name}", *extra], world_size=world)
        state = initialize_parallel(cfg)
        trainer = build_trainer(cfg, state, ListLoader(_full_packs(4)))
        meter = SavedActivationMeter(exclude=trainer.model.parameters())
        with meter:
            trainer.compute_gradients()
        trainer.optimizer.step(cfg.train.lr)  # AdamW allocates its state on the first step
        measured = _measure(trainer, meter)
        est = estimate_stage(cfg, state.pp_rank, world)
        for key in COMPONENTS:
            out[f"{name}.{key}"] = (measured[key], getattr(est, key))
        destroy_parallel()
    return out


CHECKED = [(n, c) for n in CASES for c in COMPONENTS]
