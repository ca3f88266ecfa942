"""What a training run says at its start, said once and right (issue 43, finding 8).

* A config warning (train.lr_warmup_iters >= train.train_iters) was printed twice by the launch scripts: once by
  their ``train --check`` (``MEGATRON_PACK_CHECK_HOST=here``), once by the run. The scripts' check leaves it to the
  run; a plain ``train --check`` still says it.
* megatron-core's ``Unknown MLP type ...`` (logged once per MoE layer) was printed once per layer.
* The run header said ``pp 2`` for 2 pipeline ranks of 2 virtual stages each.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

WARMUP = ["experiment=quickstart", "train.train_iters=2", "train.lr_warmup_iters=5", "data.synthetic_num_samples=40",
          "packing.packed_sequence_size=256", "model.seq_length=256"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    root = tmp_path_factory.mktemp("said_once")
    prepare(load_config(WARMUP + [f"data.dataset_dir={root / 'ds'}"]), progress=False)
    return root / "ds"


@pytest.mark.parametrize("launch_check,said", [(False, 1), (True, 0)], ids=["plain-check", "launch-scripts-check"])
def test_config_warning_is_said_by_one_command(dataset, tmp_path, monkeypatch, capsys, launch_check, said):
    from megatron_pack.cli.train import CHECK_HOST_ENV, main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    if launch_check:
        monkeypatch.setenv(CHECK_HOST_ENV, "here")
    else:
        monkeypatch.delenv(CHECK_HOST_ENV, raising=False)
    assert main(["--check", *WARMUP, f"data.dataset_dir={dataset}", f"train.output_dir={tmp_path / 'run'}"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: train.lr_warmup_iters (5) >= train.train_iters (2)") == said, err


def test_a_megatron_warning_repeated_per_layer_is_said_once(capsys):
    from megatron_pack.cli.train import _setup_logging

    _setup_logging("INFO", 0)
    try:
        layer = logging.getLogger("megatron.core.transformer.transformer_layer")
        for _ in range(2):  # one per MoE layer, as megatron-core logs it
            layer.warning("Unknown MLP type: <class 'ModuleSpec'>. Using default kwargs.")
        layer.warning("another message")
        logging.getLogger("megatron_pack.train").info("ours, twice")
        logging.getLogger("megatron_pack.train").info("ours, twice")
    finally:
        logging.basicConfig(force=True)
    out = capsys.readouterr().out
    assert out.count("Unknown MLP type") == 1 and out.count("another message") == 1, out
    assert out.count("ours, twice") == 2, out  # our own lines are never filtered


@pytest.mark.parametrize("parallel,expected", [
    ("pp2_vp2", "world 2 = dp 1 x cp 1 x tp 1 x pp 2 (x 2 virtual: 4 stages, 2 model chunks a rank)"),
    ("pp2", "world 2 = dp 1 x cp 1 x tp 1 x pp 2 |")], ids=["virtual-stages", "one-chunk-a-rank"])
def test_run_header_names_virtual_stages(parallel, expected):
    from megatron_pack.cli.train import run_line
    from megatron_pack.config import load_config
    from megatron_pack.parallel.dims import ParallelDims

    cfg = load_config(["experiment=quickstart", f"parallel={parallel}", "model.num_layers=4"])
    state = SimpleNamespace(dims=ParallelDims.from_config(cfg, 2))
    line = run_line(cfg, state, type("D", (), {"plan_dir": "data/x/plans/p", "__len__": lambda self: 3})(), None)
    assert expected in line, line


@pytest.mark.parametrize("mode,source,expected", [
    ("online", "store", "350 samples, 0.18 epochs (350 of 1,900 samples an epoch)"),
    ("online", "synthetic", "350 samples, 0.35 epochs (350 of 1,000 samples an epoch)"),
    ("offline", "store", "350 samples, 0.18 epochs\n")],
    ids=["online-store", "online-synthetic", "offline"])
def test_run_summary_counts_online_epochs(tmp_path, mode, source, expected):
    """Online packing's loader counts whole epochs: the summary said "0.00 epochs" after 350 of 1,900 samples."""
    import json

    import numpy as np

    from megatron_pack.config import load_config
    from megatron_pack.training.summary import run_summary

    cfg = load_config(["experiment=quickstart", f"train.output_dir={tmp_path}", "data.synthetic_num_samples=1000",
                       *([f"packing.mode={mode}"] if mode == "online" else [])]
                      + (["packing.online_source=stream"] if source == "synthetic" else []))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 7, "lm_loss": 3.0, "elapsed_s": 1.0, "epoch": 0.0 if
                                                        mode == "online" else 0.184, "consumed_samples": 350,
                                                        "consumed_target_tokens": 5000}) + "\n")
    dataset = SimpleNamespace(metadata={"mode": "online"} if mode == "online" else {}, plan_dir=None,
                              store=np.zeros(1900) if source == "store" else None, _held_out=None)
    assert expected in run_summary(cfg, dataset) + "\n", run_summary(cfg, dataset)
