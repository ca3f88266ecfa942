"""Qwen3-VL (DeepStack, interleaved M-RoPE) and Qwen3.5 (hybrid linear attention) vision-language folders through the
user's commands at CP=2: ``megatron-pack prepare experiment=vlm_tiny`` (the synthetic colour-image set, the folder's
image processor of patch 16), then ``megatron-pack verify verify.reference=transformers`` under torchrun on the
session's world of 2 ranks (``tests/_train_world.py``): every pack PASSes against transformers' VLM forward of each
sample alone, at PP=1 TP=1 CP=2.
"""

from __future__ import annotations

import shutil

import pytest

import _vlm3 as W
from _hf import prepare_in
from _train_world import run_in_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
VERIFY = ["verify", "experiment=vlm_tiny", "verify.reference=transformers", "verify.num_packs=2"]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_verify_at_cp2_against_transformers(tmp_path, family):
    (tmp_path / "models").mkdir()
    shutil.move(str(W.make_folder(tmp_path / "models", family)), tmp_path / "models" / "tiny-vlm")
    prepare_in(tmp_path, ["experiment=vlm_tiny", "data.synthetic_num_samples=16"])
    out = run_in_world(tmp_path, {"verify": VERIFY})["verify"]  # exit 0 on both ranks
    assert "at PP=1 TP=1 CP=2" in out and "2/2 packs PASS" in out and "reference transformers" in out, out[-4000:]
