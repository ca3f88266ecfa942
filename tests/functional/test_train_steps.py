"""Planned steps and online packing through the real loop, on 2 gloo ranks (DP=2), CPU, float32.

1. ``packing.balance=dp`` moves packs between the DP ranks but trains the same global batch, so the
   per-step losses equal the round-robin run's (1e-5; only the gradient summation order differs).
2. A token-budget run (``train.global_batch_tokens``, balanced) and an online run
   (``packing.mode=online``) killed after step 2 and resumed from their step-2 checkpoint give
   the uninterrupted run's losses and packs at steps 3-4, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from _dist import spawn_world

DATA = ["experiment=quickstart", "data.synthetic_num_samples=240", "parallel.context_parallel_size=1"]


@pytest.fixture(scope="module")
def prepared_dataset(tmp_path_factory) -> str:
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    dataset_dir = str(tmp_path_factory.mktemp("steps_data") / "synthetic")
    prepare(load_config(DATA + [f"data.dataset_dir={dataset_dir}"]), progress=False)
    return dataset_dir


def _run(dataset_dir: str, out: str, *extra: str):
    from megatron_pack.config import load_config, validate
    from megatron_pack.data.batches.loader import open_dataset
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_loader, run_training

    cfg = load_config(DATA + [f"data.dataset_dir={dataset_dir}", f"train.output_dir={out}", "train.train_iters=4",
                              "train.global_batch_size=4", "checkpoint.save_interval=2", "logging.tensorboard=false",
                              "train.adam_eps=1e-4", *extra], world_size=2)
    dataset = open_dataset(cfg)
    validate(cfg, world_size=2, dataset_meta=dict(dataset.metadata))
    state = initialize_parallel(cfg)
    trainer = run_training(cfg, state, build_loader(cfg, state, dataset))
    destroy_parallel()
    return trainer


def _packs(trainer) -> np.ndarray:
    return np.array([";".join(",".join(map(str, ids)) for ids in step) for step in trainer.pack_log])


def _worker(rank: int, world_size: int, dataset_dir: str, tmp: str) -> dict:
    out = {}
    for name, extra in (("rr", ()), ("bal", ("packing.balance=dp",))):
        t = _run(dataset_dir, f"{tmp}/{name}", "checkpoint.enabled=false", *extra)
        out[f"{name}_losses"] = [m.lm_loss for m in t.history]
        out[f"{name}_target"] = [m.target_tokens for m in t.history]
        out[f"{name}_packs"] = _packs(t)
        out[f"{name}_imbalance"] = [[m.imbalance_before or 0.0, m.imbalance_after or 0.0] for m in t.history]
    for name, extra in (("budget", ("train.global_batch_tokens=1200", "packing.balance=dp")),
                        ("online", ("packing.mode=online", "packing.buffer_size=64"))):
        full = _run(dataset_dir, f"{tmp}/{name}_full", *extra)
        _run(dataset_dir, f"{tmp}/{name}_killed", "train.exit_after_iters=2", *extra)
        resumed = _run(dataset_dir, f"{tmp}/{name}_killed", *extra)
        out[f"{name}_full_losses"] = [m.lm_loss for m in full.history]
        out[f"{name}_resumed_losses"] = [m.lm_loss for m in resumed.history]
        out[f"{name}_full_target"] = [m.target_tokens for m in full.history]
        out[f"{name}_full_packs"] = _packs(full)
        out[f"{name}_resumed_packs"] = _packs(resumed)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_balanced_same_losses_and_planned_steps_resume_exactly(prepared_dataset, tmp_path):
    ranks = spawn_world(_worker, 2, tmp_path, prepared_dataset, str(tmp_path), timeout_s=480)
    r0, r1 = ranks
    # 1. the same global batch, dealt differently: the same losses
    np.testing.assert_allclose(r0["bal_losses"], r0["rr_losses"], rtol=1e-5)
    np.testing.assert_array_equal(r0["bal_target"], r0["rr_target"])
    moved = [set(a.split(";")) != set(b.split(";")) for a, b in zip(r0["bal_packs"], r0["rr_packs"])]
    assert any(moved), "balancing moved no pack between ranks: the comparison would be vacuous"
    for step in range(4):  # the union over ranks is the same set of packs
        assert (set(r0["bal_packs"][step].split(";")) | set(r1["bal_packs"][step].split(";"))
                == set(r0["rr_packs"][step].split(";")) | set(r1["rr_packs"][step].split(";")))
    before, after = np.asarray(r0["bal_imbalance"]).T
    assert np.all(after <= before + 1e-12) and np.all(before >= 1.0)
    # 2. kill after step 2, resume from its checkpoint: steps 3-4 as the uninterrupted run
    for name in ("budget", "online"):
        for r in ranks:
            assert len(r[f"{name}_full_losses"]) == 4 and len(set(np.round(r[f"{name}_full_losses"], 6))) == 4
            np.testing.assert_array_equal(r[f"{name}_resumed_losses"], r[f"{name}_full_losses"][2:])
            np.testing.assert_array_equal(r[f"{name}_resumed_packs"], r[f"{name}_full_packs"][2:])
    target = np.asarray(r0["budget_full_target"])
    assert np.all(target >= 1200) and np.ptp(target) < 1200, target
