"""The trainer at PP=2 on 2 gloo ranks: the same steps as PP=1, and checkpoints that cross the layouts.

One spawned world of 2 CPU processes runs three trainers (``build_trainer``, AdamW, clipping) over
the same 12 packs, 4 per step (DP=1 in every layout, so the packs of each step are the same):

* A, PP=1 x TP=2: saves a checkpoint before its first step and after its second, runs 3 steps;
* B, PP=2 with the distributed optimizer: resumes A's step-0 checkpoint (PP=1 -> PP=2), runs 2 steps, saves;
* C, PP=1 x TP=2: resumes B's step-2 checkpoint (PP=2 -> PP=1), runs the last step.

The embeddings are tied, so at PP=2 the last stage holds a copy of the first stage's embedding
(kept equal by megatron-core's embedding-group all-reduce, counted once in the gradient norm).
B's and C's losses and gradient norms equal A's (relative 1e-5), every rank of B reports the same
step outcome, and B's stages ran the pipeline schedule (its shape exchanges are counted).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import ListLoader, spawn_world
from _packs import random_packs

NUM_STEPS, PACKS_PER_STEP = 3, 4


def _packs(seed: int = 5) -> list[dict]:
    from megatron_pack.data.batches.thd import collate_thd

    return [collate_thd(samples, pack_size=64, pad_multiple=8)
            for samples in random_packs(seed, NUM_STEPS * PACKS_PER_STEP, samples=(2, 4), length=(5, 20))]


def _config(pp: int, tp: int, distributed_optimizer: bool = False):
    from megatron_pack.config.schema import Config, DDPConfig, ModelConfig, ParallelConfig, TrainConfig

    return Config(model=ModelConfig(attention_backend="torch", untie_embeddings_and_output_weights=False),
                  ddp=DDPConfig(use_distributed_optimizer=distributed_optimizer),
                  train=TrainConfig(seed=1234, lr=3e-3, global_batch_size=PACKS_PER_STEP, train_iters=NUM_STEPS,
                                    lr_warmup_iters=0, clip_grad=0.05),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp))


def _trainer(pp: int, tp: int, packs, **kwargs):
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.loop import build_trainer

    cfg = _config(pp, tp, **kwargs)
    return build_trainer(cfg, initialize_parallel(cfg), ListLoader(packs))


def _steps(trainer, num: int) -> list[tuple[float, float]]:
    return [(m.lm_loss, m.grad_norm) for m in (trainer.train_step() for _ in range(num))]


def _world_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_pack.parallel.groups import destroy_parallel

    packs = _packs()
    a = _trainer(1, 2, packs)
    start = a.save(f"{root}/a")
    run_a = _steps(a, NUM_STEPS)
    destroy_parallel()

    b = _trainer(2, 1, packs, distributed_optimizer=True)
    b.load(start)
    b_start = b.save(f"{root}/b")  # A's step-0 weights, written by the two stages
    run_b = _steps(b, 2)
    middle = b.save(f"{root}/b")
    exchanges = b.link.num_shape_exchanges if getattr(b, "link", None) is not None else -1
    destroy_parallel()

    c = _trainer(1, 2, packs)
    c.load(middle)
    run_c = _steps(c, 1)
    destroy_parallel()
    out = {"a": np.array(run_a), "b": np.array(run_b), "c": np.array(run_c), "b_exchanges": exchanges,
           "b_step": b.step, "c_step": c.step}
    if rank == 0:  # what export reads: the whole model of the PP=2 checkpoint against the PP=1 one
        from megatron_pack.training.checkpoint import read_full_model

        pp1, pp2 = read_full_model(start), read_full_model(b_start)
        out["export_same_names"] = sorted(pp1) == sorted(pp2)
        out["export_num_tensors"] = len(pp1)
        out["export_equal"] = all(torch.equal(pp1[n], pp2[n]) for n in pp1)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("pipeline_train")
    return spawn_world(_world_worker, 2, root, str(root / "ckpt"))


def _rel(got, want) -> float:
    return float(np.max(np.abs(got - want) / np.abs(want)))


def test_pp2_resumed_from_pp1_takes_the_same_steps(world):
    for r in world:
        assert r["b"].shape == (2, 2) and np.all(r["a"][:, 1] > 0)
        assert _rel(r["b"], r["a"][:2]) <= 1e-5  # losses and gradient norms
        assert int(r["b_step"]) == 2
    assert int(world[0]["b_exchanges"]) > 0 and int(world[1]["b_exchanges"]) > 0  # the stages exchanged shapes


def test_pp1_resumed_from_pp2_takes_the_same_last_step(world):
    for r in world:
        assert int(r["c_step"]) == NUM_STEPS
        assert _rel(r["c"], r["a"][2:]) <= 1e-5


def test_pp2_checkpoint_holds_the_pp1_model_for_export(world):
    """Export reads a checkpoint's whole model (``checkpoint.read_full_model``): the same weights saved
    by the two stages at PP=2 and by PP=1 x TP=2 give every tensor under the same name, bit for bit."""
    assert bool(world[0]["export_same_names"]) and int(world[0]["export_num_tensors"]) == 14  # tied: no output layer
    assert bool(world[0]["export_equal"])


def test_every_rank_reports_the_same_pipelined_steps(world):
    assert np.array_equal(world[0]["b"], world[1]["b"])
