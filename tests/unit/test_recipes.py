"""Every recipe in configs/experiment passes ``validate()`` at the world size it states.

A recipe states its world size in a header line ``# world size: N``; a recipe without one fails
here (a launch size is part of a recipe). Recipes reading ``data.source=files`` get a placeholder
``data.input`` (the user's file; ``validate()`` does not open it). Nothing a recipe sets may be
refused later: the distributed optimizer, recompute and every other key go through the same
``validate()`` the training entry runs before any process group starts.
"""

from __future__ import annotations

import re

import pytest

from megatron_pack.config import load_config
from megatron_pack.config.loader import config_dir

RECIPES = sorted(p for p in (config_dir() / "experiment").glob("*.yaml"))


def _world_size(path) -> int:
    match = re.search(r"^# world size: (\d+)", path.read_text(encoding="utf-8"), flags=re.M)
    assert match, f"{path.name} does not state its world size; add a header line '# world size: N'"
    return int(match.group(1))


def test_recipes_exist():
    assert {p.stem for p in RECIPES} >= {"quickstart", "llama3_8b_tp2_cp2"}


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates_at_its_world_size(path):
    world_size = _world_size(path)
    reads_files = re.search(r"override /data: files", path.read_text(encoding="utf-8")) is not None
    extra = ["data.input=train.jsonl"] if reads_files else []
    cfg = load_config([f"experiment={path.stem}", *extra], world_size=world_size)  # validate() runs inside
    par = cfg.parallel
    assert world_size % (par.tensor_model_parallel_size * par.context_parallel_size) == 0


def test_llama3_recipe_uses_the_distributed_optimizer():
    cfg = load_config(["experiment=llama3_8b_tp2_cp2", "data.input=train.jsonl"], world_size=8)
    assert cfg.ddp.use_distributed_optimizer and cfg.parallel.sequence_parallel
