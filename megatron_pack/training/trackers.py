"""Experiment trackers beside TensorBoard: Weights & Biases (``logging.wandb``) and MLflow (``logging.mlflow``).

Rank 0 opens each enabled tracker once, after the resume point is known, logs the run's resolved config
(flattened, ``{"train.lr": 3e-4, ...}``) and then, every step, the same scalars by the same tags as TensorBoard
(``metrics.step_scalars``: ``train/lm_loss``, ``validation/lm_loss``, ...). Both packages are optional extras
(``pip install 'megatron-pack[wandb]'``, ``'megatron-pack[mlflow]'``); ``validate()`` refuses a tracker whose
package this host lacks before any process starts (``config.validate._validate_trackers``).

Each process of a run opens its own tracker run, named ``<output dir name>`` (``-from-step-<n>`` when it resumes
from step n) and grouped (W&B ``group``, MLflow tag ``megatron_pack.output_dir``) by the output folder, so a
resumed run's steps start after the checkpoint instead of rewriting the first process's history.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

OUTPUT_DIR_TAG = "megatron_pack.output_dir"


def run_name(output_dir: Path, start_step: int) -> str:
    """``run_name(Path("runs/sft"), 0) == "sft"``; ``run_name(Path("runs/sft"), 4) == "sft-from-step-4"``."""
    name = output_dir.resolve().name
    return f"{name}-from-step-{start_step}" if start_step else name


class WandbTracker:
    """A W&B run (``logging.wandb_mode``: online, or offline to ``<output_dir>/wandb`` for ``wandb sync`` later)."""

    def __init__(self, cfg, config: dict, start_step: int):
        import wandb

        out = Path(cfg.train.output_dir)
        log = cfg.logging
        # the group is the output folder's path, its last 128 characters (W&B's limit)
        self._run = wandb.init(project=log.wandb_project, entity=log.wandb_entity, mode=log.wandb_mode,
                               dir=str(out), name=run_name(out, start_step), group=str(out.resolve())[-128:],
                               config=config, settings=wandb.Settings(console="off", silent=True))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        wandb.teardown()  # ends wandb's service process, which writes the run's last records before it exits


class MlflowTracker:
    """An MLflow run in ``logging.mlflow_experiment`` at ``logging.mlflow_tracking_uri`` (default: a local file store,
    ``<output_dir>/mlruns``; browse it with ``mlflow ui --backend-store-uri <output_dir>/mlruns``)."""

    def __init__(self, cfg, config: dict, start_step: int):
        out = Path(cfg.train.output_dir)
        uri = cfg.logging.mlflow_tracking_uri or (out.resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):  # MLflow 3 asks a file store's user to opt in; this one was chosen on purpose
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        name = cfg.logging.mlflow_experiment
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        run = self._client.create_run(experiment_id, run_name=run_name(out, start_step),
                                      tags={OUTPUT_DIR_TAG: str(out.resolve())})
        self.run_id = run.info.run_id
        params = [Param(key, str(value)) for key, value in config.items()]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self._client.log_batch(self.run_id, params=params[first:first + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(tag, value, now, step) for tag, value in scalars.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def open_trackers(cfg, *, enabled: bool, start_step: int) -> list:
    """The trackers ``cfg.logging`` enables (only where ``enabled``: global rank 0), each holding the resolved config."""
    if not enabled or not (cfg.logging.wandb or cfg.logging.mlflow):
        return []
    from megatron_pack.training.record import flat_config

    config = flat_config(cfg)
    trackers = []
    if cfg.logging.wandb:
        trackers.append(WandbTracker(cfg, config, start_step))
    if cfg.logging.mlflow:
        trackers.append(MlflowTracker(cfg, config, start_step))
    return trackers
