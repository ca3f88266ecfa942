"""``megatron-pack train logging.wandb=true logging.wandb_mode=offline logging.mlflow=true`` (issue 43 item 8), run
as written on the session's torchrun world of 2 ranks (tests/_train_world.py): rank 0 logs, to W&B's offline run and
to MLflow's file store, the same scalars at the same steps as TensorBoard, and the resolved config; rank 1 logs
nothing. Both are read back from their files (tests/_trackers.py), not from our own code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _trackers import mlflow_run, tensorboard_scalars, wandb_run  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

RUN = ["experiment=quickstart", "data.synthetic_num_samples=120", "data.validation_fraction=0.1",
       "train.train_iters=3", "train.global_batch_size=2", "train.eval_interval=2", "train.eval_iters=1",
       "checkpoint.save_interval=0", "train.lr=0.0007"]


def test_train_logs_the_tensorboard_scalars_to_wandb_and_mlflow(tmp_path):
    from _train_world import run_in_world

    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    prepare(load_config([*RUN, f"data.dataset_dir={tmp_path / 'data'}"]), progress=False)
    out = tmp_path / "run"
    run_in_world(tmp_path, {"trackers": ["train", *RUN, f"data.dataset_dir={tmp_path / 'data'}",
                                         f"train.output_dir={out}", "logging.wandb=true", "logging.wandb_mode=offline",
                                         "logging.mlflow=true"]}, timeout=500)
    tensorboard = tensorboard_scalars(out / "tensorboard")
    assert sorted(tensorboard) == [1, 2, 3] and "validation/lm_loss" in tensorboard[2]  # the check has something
    for name, read in (("wandb", wandb_run), ("mlflow", mlflow_run)):
        history, config = read(out)  # one run each: rank 1 opened none
        assert sorted(history) == [1, 2, 3], name
        for step, scalars in history.items():
            assert scalars == pytest.approx(tensorboard[step]), (name, step)
        assert float(config["train.lr"]) == 0.0007 and config["logging.wandb_mode"] == "offline", name
        assert int(config["parallel.context_parallel_size"]) == 2, name  # the resolved config: the preset's CP
