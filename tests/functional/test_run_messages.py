"""What a training run prints, from the command line (issue 43, finding 8), on the session's torchrun world of 2.

| case | the slip | fixed |
|---|---|---|
| online | online packing's summary said "0.00 epochs" after part of an epoch | the fraction of the store's samples |
| pp2_vp2 | the header said "pp 2" for virtual stages | "pp 2 (x 2 virtual: 4 stages, 2 model chunks a rank)" |
| moe | megatron-core's "Unknown MLP type" warning, once per MoE layer (twice) | said once |
| warmup | the lr warmup warning (said by the launch scripts' check and again by the run) | the run says it once |
"""

from __future__ import annotations

import pytest

from _hf import prepare_in
from _train_world import run_in_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BASE = ["experiment=quickstart", "data.synthetic_num_samples=200", "train.train_iters=2", "checkpoint.enabled=false",
        "logging.tensorboard=false"]
CASES = {
    "online": [*BASE, "parallel=cp1", "data.dataset_dir=data/cp1", "packing.mode=online", "packing.buffer_size=64", "train.output_dir=runs/online"],
    "pp2_vp2": [*BASE, "parallel=pp2_vp2", "data.dataset_dir=data/cp1", "model.num_layers=4", "train.global_batch_size=4",
                "train.output_dir=runs/vp"],
    "moe": [*BASE, "data.dataset_dir=data/cp2", "model.num_experts=4", "model.moe_ffn_hidden_size=32", "train.output_dir=runs/moe"],
    "warmup": [*BASE, "data.dataset_dir=data/cp2", "train.lr_warmup_iters=5", "train.output_dir=runs/warmup"],
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("run_messages")
    prepare_in(root, [*BASE, "parallel=cp1", "data.dataset_dir=data/cp1"])  # pad multiple 1: pipeline, online
    prepare_in(root, [*BASE, "data.dataset_dir=data/cp2"])  # CP=2's pad multiple 4: the MoE and warmup runs
    return run_in_world(root, {name: ["train", *argv] for name, argv in CASES.items()})


def test_online_summary_counts_the_epoch_read(outputs):
    out = outputs["online"]
    assert "epochs (" in out and " of 200 samples an epoch)" in out, out[-3000:]
    assert ", 0.00 epochs" not in out


def test_header_names_virtual_stages(outputs):
    assert "x pp 2 (x 2 virtual: 4 stages, 2 model chunks a rank)" in outputs["pp2_vp2"], outputs["pp2_vp2"][-3000:]


def test_megatron_warning_said_once_in_a_moe_run(outputs):
    out = outputs["moe"]
    assert "Traceback" not in out and "lm loss: first" in out, out[-3000:]  # guard: the MoE run trained
    assert out.count("Unknown MLP type") == 1, out[-3000:]  # megatron-core logs it for each of the 2 MoE layers


def test_warmup_warning_said_once(outputs):
    assert outputs["warmup"].count("warning: train.lr_warmup_iters (5) >= train.train_iters (2)") == 1, \
        outputs["warmup"][-3000:]
