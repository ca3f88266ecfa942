"""W&B and MLflow get the TensorBoard scalars and the resolved config, offline (W&B's offline mode, MLflow's file
store under tmp), read back from their files; a missing package is refused by validate() in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _trackers import mlflow_run, tensorboard_scalars, wandb_run  # noqa: E402

from megatron_pack.config import ConfigError, load_config, validate  # noqa: E402
from megatron_pack.config.host import Host  # noqa: E402
from megatron_pack.training.metrics import MetricsWriter, StepMetrics  # noqa: E402
from megatron_pack.training.trackers import open_trackers  # noqa: E402

TRACKERS = {"wandb": (["logging.wandb=true", "logging.wandb_mode=offline"], wandb_run),
            "mlflow": (["logging.mlflow=true"], mlflow_run)}


@pytest.mark.parametrize("overrides,read", TRACKERS.values(), ids=list(TRACKERS))
def test_tracker_logs_the_tensorboard_scalars_and_the_config(tmp_path, overrides, read):
    pytest.importorskip(overrides[0].split(".")[1].split("=")[0])
    cfg = load_config([*overrides, f"train.output_dir={tmp_path}", "train.lr=0.0123"])
    writer = MetricsWriter(tmp_path, enabled=True, resume_step=0,
                           trackers=open_trackers(cfg, enabled=True, start_step=0))
    for step in (1, 2, 3):
        writer.write(StepMetrics(step=step, lm_loss=3.0 / step, target_tokens=10, real_tokens=20, slots=32,
                                 samples=4, grad_norm=1.0, lr=1e-3 * step, step_time_s=0.1,
                                 val_loss=2.5 if step == 3 else None))
    writer.close()
    history, config = read(tmp_path)
    tensorboard = tensorboard_scalars(tmp_path / "tensorboard")
    assert sorted(history) == [1, 2, 3] and len(history[3]) > 10 and "validation/lm_loss" in history[3]
    for step, scalars in history.items():
        assert scalars == pytest.approx(tensorboard[step]), step
    assert float(config["train.lr"]) == 0.0123 and len(config) > 80  # every key of the resolved config


def test_trackers_open_only_on_rank_0_and_when_asked(tmp_path):
    cfg = load_config(["logging.wandb=true", "logging.mlflow=true", f"train.output_dir={tmp_path}"])
    assert open_trackers(cfg, enabled=False, start_step=0) == []
    assert open_trackers(load_config([f"train.output_dir={tmp_path}"]), enabled=True, start_step=0) == []
    assert not list(tmp_path.iterdir())


# host packages -> the refusals validate() gives logging.wandb=true logging.mlflow=true
MISSING = {
    "neither": (frozenset(), ["logging.wandb", "logging.mlflow"]),
    "no-mlflow": (frozenset({"wandb"}), ["logging.mlflow"]),
    "both-installed": (frozenset({"wandb", "mlflow"}), []),
    "host-unknown": (None, []),
}


@pytest.mark.parametrize("packages,refused", MISSING.values(), ids=list(MISSING))
def test_a_missing_package_is_refused_by_validate(packages, refused):
    cfg = load_config(["logging.wandb=true", "logging.mlflow=true"])
    host = Host(gpu=False, transformer_engine=False, packages=packages)
    if not refused:
        validate(cfg, host=host)
        return
    with pytest.raises(ConfigError) as info:
        validate(cfg, host=host)
    assert [p.split("=")[0] for p in info.value.problems] == refused
    for key, problem in zip(refused, info.value.problems):
        assert problem == (f"{key}=true needs the {key.split('.')[1]} package, which is not installed here; pip install "
                           f"'megatron-pack[{key.split('.')[1]}]', or set {key}=false.")


def test_train_check_refuses_a_missing_package_in_one_line(tmp_path):
    hide = "import sys; sys.modules['wandb'] = None; from megatron_pack.cli.main import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", hide, "train", "--check", "logging.wandb=true"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, out
    assert "logging.wandb=true needs the wandb package" in out and "Traceback" not in out
    assert len([line for line in out.splitlines() if "logging.wandb" in line]) == 1
