"""Activation recomputation with THD + CP=2 (2 gloo ranks, CPU, float32).

``model.recompute_granularity`` selective (core attention) and full (uniform and block) give the
loss and every gradient of the run without recomputation (relative 1e-6: the recomputed forward
is the same arithmetic), and lower peak activation memory, measured as the peak bytes of
tensors alive for backward (``SavedActivationMeter``; on CPU there is no allocator peak).

The same world then runs the memory-estimate cases (``_memory_cases.py``): parameters, gradients,
optimizer state, activations and their total, measured in a real step, within 25% of what
``train --check`` estimates for that rank's stage.
"""

from __future__ import annotations

import numpy as np
import pytest

from _dist import ListLoader, spawn_world
from _memory_cases import CHECKED, TOLERANCE, memory_cases

pytestmark = pytest.mark.timeout(600)

CASES = {"none": [], "selective": ["model.recompute_granularity=selective"],
         "full_uniform": ["model.recompute_granularity=full"],
         "full_block": ["model.recompute_granularity=full", "model.recompute_method=block",
                        "model.recompute_num_layers=2"]}


def _case(tmp: str, name: str, packs: list[dict]) -> dict:
    from test_train_parallel import full_tensors

    from megatron_pack.config import load_config
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer
    from megatron_pack.training.memory import SavedActivationMeter

    cfg = load_config(["parallel=cp2", "packing.packed_sequence_size=256", "model.seq_length=256",
                       "model.num_layers=2", f"train.global_batch_size={len(packs)}", f"train.output_dir={tmp}",
                       *CASES[name]], world_size=2)
    state = initialize_parallel(cfg)
    trainer = build_trainer(cfg, state, ListLoader(packs))
    meter = SavedActivationMeter(exclude=trainer.model.parameters())
    with meter:
        total, _ = trainer.compute_gradients()
    out = {f"{name}_grad.{k}": v for k, v in full_tensors(trainer, grads=True).items()}
    out[f"{name}_loss"] = np.array(total.lm_loss())
    out[f"{name}_peak"] = np.array(meter.peak_bytes)
    destroy_parallel()
    return out


def _world(rank: int, world: int, tmp: str) -> dict:
    from test_train_parallel import make_packs

    packs = make_packs(2, seed=3)
    out = {}
    for name in CASES:
        out.update(_case(tmp, name, packs))
    out.update(memory_cases(world, tmp))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("recompute")
    return spawn_world(_world, 2, tmp, str(tmp))


@pytest.mark.parametrize("name", [n for n in CASES if n != "none"])
def test_recompute_same_loss_and_gradients(results, name):
    for r in results:
        assert float(r["none_loss"]) > 0
        np.testing.assert_allclose(r[f"{name}_loss"], r["none_loss"], rtol=1e-6)
        grads = [k[len("none_grad."):] for k in r if k.startswith("none_grad.")]
        assert len(grads) >= 10 and all(np.abs(r[f"none_grad.{g}"]).max() > 0 for g in grads)
        for g in grads:
            np.testing.assert_allclose(r[f"{name}_grad.{g}"], r[f"none_grad.{g}"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", [n for n in CASES if n != "none"])
def test_recompute_lowers_peak_activation_memory(results, name):
    for r in results:
        baseline, got = int(r["none_peak"]), int(r[f"{name}_peak"])
        assert baseline > 100_000
        assert got < baseline, f"{name}: peak {got} bytes is not below {baseline} without recompute"


@pytest.mark.parametrize("name,component", CHECKED, ids=[f"{n}-{c}" for n, c in CHECKED])
def test_memory_estimate_within_25_percent_of_measured(results, name, component):
    for rank, r in enumerate(results):
        measured, estimate = (int(v) for v in r[f"{name}.{component}"])
        assert measured > 100_000, f"{name} rank {rank}: {component} measured only {measured} bytes"
        assert abs(estimate - measured) <= TOLERANCE * measured, (
            f"{name} rank {rank}: {component} estimated {estimate} bytes, measured {measured}")
