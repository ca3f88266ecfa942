"""The trainer at PP=2 on 2 gloo ranks: the same steps as PP=1, and checkpoints that cross the layouts.

One spawned world of 2 CPU processes runs three trainers (``build_trainer``, AdamW, clipping) over
the same 12 packs, 4 per step (DP=1 in every layout, so the packs of each step are the same):

* A, PP=1 x TP=2: saves a checkpoint before its first step and after its second, runs 3 steps;
* B, PP=2 with the distributed optimizer: resumes A's step-0 checkpoint (PP=1 -> PP=2), runs 2 steps, saves;
* C, PP=1 x TP=2: resumes B's step-2 checkpoint (PP=2 -> PP=1), runs the last step;
* D, PP=2 x VP=2 (virtual stages: two model chunks per rank, the interleaved 1F1B) with the distributed
  optimizer (one AdamW over both chunks' parameters): resumes A's step-0
  checkpoint (PP=1 -> PP=2 x VP=2), runs 2 steps, saves;
* E, PP=1 x TP=2: resumes D's step-2 checkpoint (PP=2 x VP=2 -> PP=1), runs the last step.

The embeddings are tied, so at PP=2 the last stage holds a copy of the first stage's embedding
(kept equal by megatron-core's embedding-group all-reduce, counted once in the gradient norm).
B's, C's, D's and E's losses and gradient norms equal A's (relative 1e-5), every rank of B and D reports
the same step outcome, and their stages ran the pipeline schedules (the shape exchanges are counted). The
model has 4 layers (PP x VP = 4 chunks of one layer).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import ListLoader, spawn_world

NUM_STEPS, PACKS_PER_STEP = 3, 4
NUM_LAYERS = 4


def _packs(seed: int = 5) -> list[dict]:
    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(seed)
    packs = []
    for p in range(NUM_STEPS * PACKS_PER_STEP):
        samples = []
        for _ in range(int(rng.integers(2, 4))):
            n = int(rng.integers(5, 20))
            ids = rng.integers(3, 380, size=n)
            ids[-1] = 2
            mask = np.zeros(n, dtype=np.int64)
            mask[int(rng.integers(1, n - 1)):] = 1
            samples.append({"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "sample_id": len(packs) * 8})
        packs.append(collate_thd(samples, pack_size=64, pad_multiple=8))
    return packs


def _config(pp: int, tp: int, distributed_optimizer: bool = False, vp=None):
    from megatron_pack.config.schema import Config, DDPConfig, ModelConfig, ParallelConfig, TrainConfig

    return Config(model=ModelConfig(attention_backend="torch", untie_embeddings_and_output_weights=False,
                                    num_layers=NUM_LAYERS),
                  ddp=DDPConfig(use_distributed_optimizer=distributed_optimizer),
                  train=TrainConfig(seed=1234, lr=3e-3, global_batch_size=PACKS_PER_STEP, train_iters=NUM_STEPS,
                                    lr_warmup_iters=0, clip_grad=0.05),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                                          virtual_pipeline_model_parallel_size=vp))


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

    d = _trainer(2, 1, packs, vp=2, distributed_optimizer=True)
    d.load(start)
    d_start = d.save(f"{root}/d")
    run_d = _steps(d, 2)
    d_middle = d.save(f"{root}/d")
    d_exchanges, d_chunks = d.link.num_shape_exchanges, len(d.model_chunks)
    destroy_parallel()

    e = _trainer(1, 2, packs)
    e.load(d_middle)
    run_e = _steps(e, 1)
    destroy_parallel()
    out = {"a": np.array(run_a), "b": np.array(run_b), "c": np.array(run_c), "b_exchanges": exchanges,
           "b_step": b.step, "c_step": c.step, "d": np.array(run_d), "e": np.array(run_e), "d_step": d.step,
           "e_step": e.step, "d_exchanges": d_exchanges, "d_chunks": d_chunks}
    if rank == 0:  # what export reads: the whole model of the PP=2 (x VP=2) checkpoints against the PP=1 one
        from megatron_pack.training.checkpoint import read_full_model

        pp1 = read_full_model(start)
        out["export_num_tensors"] = len(pp1)
        for key, path in (("export", b_start), ("vp_export", d_start)):
            other = read_full_model(path)
            out[f"{key}_same_names"] = sorted(pp1) == sorted(other)
            out[f"{key}_equal"] = all(torch.equal(pp1[n], other[n]) for n in pp1)
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
    assert bool(world[0]["export_same_names"]) and int(world[0]["export_num_tensors"]) == 2 + 6 * NUM_LAYERS
    assert bool(world[0]["export_equal"])  # tied: no output layer


def test_vp_resumed_from_pp1_takes_the_same_steps(world):
    """PP=1 -> PP=2 x VP=2: the interleaved schedule over two chunks per rank gives A's losses and norms."""
    for r in world:
        assert int(r["d_chunks"]) == 2 and int(r["d_step"]) == 2
        assert r["d"].shape == (2, 2) and _rel(r["d"], r["a"][:2]) <= 1e-5
        assert int(r["d_exchanges"]) > 0  # the ring carried each pack's shape
    assert np.array_equal(world[0]["d"], world[1]["d"])  # every rank: the same step outcome


def test_pp1_resumed_from_vp_takes_the_same_last_step(world):
    for r in world:
        assert int(r["e_step"]) == NUM_STEPS
        assert _rel(r["e"], r["a"][2:]) <= 1e-5


def test_vp_checkpoint_holds_the_pp1_model_for_export(world):
    """The chunks of PP=2 x VP=2 write every tensor under its global name: export reads the PP=1 model."""
    assert bool(world[0]["vp_export_same_names"]) and bool(world[0]["vp_export_equal"])


def test_every_rank_reports_the_same_pipelined_steps(world):
    assert np.array_equal(world[0]["b"], world[1]["b"])
