"""Kill and resume on a prepared dataset, and the quickstart through its real script (CPU, float32).

4. A run stopped after step 4 (its last checkpoint is step 3, so step 4 is lost as in a crash)
   and resumed gives the same losses at steps 4-6 as an uninterrupted run, and the same packs.
5. ``scripts/quickstart.sh`` shortened to a few steps: setup, prepare (a no-op on the dataset the
   session already prepared), torchrun with 2 processes and CP=2, the end summary.

The tiny dataset is prepared once per session (quickstart preset, 240 synthetic samples).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _dist import spawn_world

REPO = Path(__file__).resolve().parents[2]
DATA_OVERRIDES = ["experiment=quickstart", "data.synthetic_num_samples=240"]


@pytest.fixture(scope="session")
def prepared_dataset(tmp_path_factory) -> str:
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    dataset_dir = str(tmp_path_factory.mktemp("quickstart_data") / "synthetic")
    prepare(load_config(DATA_OVERRIDES + [f"data.dataset_dir={dataset_dir}"]), progress=False)
    return dataset_dir


def _run(dataset_dir: str, out: str, *extra: str):
    """One training run in this (already started) world; returns the trainer."""
    from megatron_pack.config import load_config
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.training.loop import build_loader, run_training

    overrides = DATA_OVERRIDES + [f"data.dataset_dir={dataset_dir}", f"train.output_dir={out}", "train.train_iters=6",
                                  "train.global_batch_size=4", "checkpoint.save_interval=3",
                                  "logging.tensorboard=false", *extra]
    cfg = load_config(overrides, world_size=2)
    state = initialize_parallel(cfg)
    dataset = open_dataset(cfg)
    trainer = run_training(cfg, state, build_loader(cfg, state, dataset))
    destroy_parallel()
    return trainer


def _kill_and_resume(rank: int, world_size: int, dataset_dir: str, tmp: str) -> dict:
    full = _run(dataset_dir, f"{tmp}/full")
    killed = _run(dataset_dir, f"{tmp}/killed", "train.exit_after_iters=4")
    resumed = _run(dataset_dir, f"{tmp}/killed")
    out = {"full_losses": [m.lm_loss for m in full.history], "killed_losses": [m.lm_loss for m in killed.history],
           "resumed_losses": [m.lm_loss for m in resumed.history], "resumed_steps": [m.step for m in resumed.history]}
    for name, trainer in (("full", full), ("killed", killed), ("resumed", resumed)):
        out[f"{name}_packs"] = _flat_packs(trainer.pack_log)
    return out


def _flat_packs(pack_log: list[list[list[int]]]) -> np.ndarray:
    """[step, micro-batch] -> the pack's sample ids joined as a string (npz-friendly, no pickle)."""
    return np.array([[",".join(map(str, ids)) for ids in step] for step in pack_log])


@pytest.mark.slow
def test_kill_and_resume_replays_losses_and_packs(prepared_dataset, tmp_path):
    ranks = spawn_world(_kill_and_resume, 2, tmp_path, prepared_dataset, str(tmp_path))
    r = ranks[0]
    full, killed, resumed = r["full_losses"], r["killed_losses"], r["resumed_losses"]
    assert len(full) == 6 and len(killed) == 4 and list(r["resumed_steps"]) == [4, 5, 6]
    assert len(set(np.round(full, 6))) == 6  # every step is a different number
    np.testing.assert_array_equal(killed, full[:4])
    np.testing.assert_array_equal(resumed, full[3:])  # bit for bit: float32 CPU runs are deterministic
    assert r["full_packs"].shape == (6, 4) and all(len(p) > 0 for p in r["full_packs"].ravel())
    np.testing.assert_array_equal(r["resumed_packs"], r["full_packs"][3:])
    np.testing.assert_array_equal(r["killed_packs"], r["full_packs"][:4])
    assert len(set(r["full_packs"].ravel())) == 24  # 24 different packs: the order really advanced
    for other in ranks[1:]:  # the CP peer read the same packs
        np.testing.assert_array_equal(other["full_packs"], r["full_packs"])
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text() == "step_00000006"


@pytest.mark.slow
def test_quickstart_script_shortened(prepared_dataset, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    args = DATA_OVERRIDES[1:] + [f"data.dataset_dir={prepared_dataset}", f"train.output_dir={out}",
                                 "train.train_iters=3", "checkpoint.save_interval=0"]
    proc = subprocess.run(["bash", str(REPO / "scripts" / "quickstart.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "parallel layout: world 2 = dp 1 x cp 2 x tp 1" in log
    assert "context_parallel_size: 2" not in log  # the resolved config is in the run folder, not on the console
    assert "context_parallel_size: 2" in (out / "config.yaml").read_text()
    for step in (1, 2, 3):
        assert f"step {step}/3 | loss" in log
    summary = log[log.index("lm loss: first"):]
    assert "(step 1) -> last" in summary and "(step 3)" in summary
    assert f"TensorBoard: tensorboard --logdir {out / 'tensorboard'}" in summary
    report = summary.split("packing report: ")[1].split(" and ")[0]
    assert Path(report).is_file() and Path(report).parent.parent.parent == Path(prepared_dataset)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "step_00000003" / "meta.json").is_file()
