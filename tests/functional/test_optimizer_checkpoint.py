"""One optimizer, one checkpoint: megatron-core's optimizer resumed at any layout, on real gloo ranks (CPU, float32).

Every run below is ``build_trainer`` (megatron-core's schedule, DDP and ``get_megatron_optimizer``, the objects a GPU
run builds) on the same packs, 4 steps of 4 packs (each DP rank its share of every step's packs), a checkpoint at
step 2. The cases (one 2-rank world; world 1 on its first rank):

a. ``dp2_dist`` (DP=2, distributed optimizer): 4 steps uninterrupted; the same run resumed from its step-2 checkpoint
   at the same layout takes steps 3-4 with bit-identical losses.
b. That checkpoint resumed at TP=2, at PP=2 and at world 1 (plain optimizer): steps 3-4 equal the uninterrupted run
   (relative 1e-5), and the restored ``exp_avg`` / ``exp_avg_sq`` of every parameter equal the saved run's, read back
   from the resumed optimizer (as this rank's TP shard / pipeline stage holds them). A PP=2 checkpoint resumed at
   DP=2 with the distributed optimizer likewise.
c. ``train.bf16``: bf16 weights, fp32 main params and gradients; losses within bf16 tolerance of float32; a
   same-layout resume continues bit for bit, its fp32 main params restored (not re-derived from the bf16 weights).
d. A MoE model at EP=2 (distributed optimizer) resumed at EP=1 (DP=2, plain optimizer).

Every checkpoint holds both moments of every parameter, finite, and not all zero after 2 steps: a missing or
uninitialised optimizer state fails (``_check_checkpoint_state``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import ListLoader, spawn_world, sub_world
from _packs import random_packs

STEPS, PACKS_PER_STEP, NUM_EXPERTS = 4, 4, 4

RUNS = {  # id -> (world, tp, pp, ep, distributed optimizer, bf16, moe)
    "dp2_dist": (2, 1, 1, 1, True, False, False),
    "pp2": (2, 1, 2, 1, False, False, False),
    "bf16": (2, 1, 1, 1, True, True, False),
    "moe_ep2": (2, 1, 1, 2, True, False, True),
}
"""The uninterrupted runs (4 steps, a checkpoint at step 2)."""

RESUMES = {  # id -> (checkpoint of run, world, tp, pp, ep, distributed optimizer, bf16, moe)
    "dp2_dist_same": ("dp2_dist", 2, 1, 1, 1, True, False, False),
    "dp2_dist_to_tp2": ("dp2_dist", 2, 2, 1, 1, False, False, False),
    "dp2_dist_to_pp2": ("dp2_dist", 2, 1, 2, 1, False, False, False),
    "dp2_dist_to_world1": ("dp2_dist", 1, 1, 1, 1, False, False, False),
    "pp2_to_dp2_dist": ("pp2", 2, 1, 1, 1, True, False, False),
    "bf16_same": ("bf16", 2, 1, 1, 1, True, True, False),
    "moe_ep2_to_ep1": ("moe_ep2", 2, 1, 1, 1, False, False, True),
}
"""Steps 3-4 from a run's step-2 checkpoint at another (or the same) layout."""


def _config(tp: int, pp: int, ep: int, distributed: bool, bf16: bool, moe: bool):
    from megatron_pack.config.schema import Config, DDPConfig, ModelConfig, ParallelConfig, TrainConfig

    experts = {"num_experts": NUM_EXPERTS, "moe_ffn_hidden_size": 32, "moe_router_topk": 2} if moe else {}
    return Config(model=ModelConfig(attention_backend="torch", num_layers=2, **experts),
                  train=TrainConfig(seed=1234, lr=3e-3, global_batch_size=PACKS_PER_STEP, train_iters=STEPS,
                                    lr_warmup_iters=1, clip_grad=1.0, weight_decay=0.1, bf16=bf16),
                  ddp=DDPConfig(use_distributed_optimizer=distributed),
                  parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                          expert_model_parallel_size=ep))


def _trainer(cfg, first_step: int):
    """``build_trainer`` with this DP rank's share of the packs of steps ``first_step + 1`` to ``STEPS``."""
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.loop import build_trainer

    packs = random_packs(11, STEPS * PACKS_PER_STEP, samples=(1, 4), length=(5, 20))
    state = initialize_parallel(cfg)
    mine = [p for s in range(first_step, STEPS)
            for p in packs[s * PACKS_PER_STEP:(s + 1) * PACKS_PER_STEP][state.dp_rank::state.dp_size]]
    return build_trainer(cfg, state, ListLoader([collate_thd(p, pack_size=64, pad_multiple=8) for p in mine]))


def _global_name(name: str, cfg, state) -> str:
    """This rank's parameter name as the whole TP=1 model names it: a pipeline stage's layer numbers shifted by
    its offset, an expert-parallel rank's local experts by its first expert."""
    from megatron_pack.model.builder import stage_of

    if ".layers." in name:
        head, rest = name.split(".layers.", 1)
        index, tail = rest.split(".", 1)
        name = f"{head}.layers.{stage_of(cfg, state).layer_offset + int(index)}.{tail}"
    marker = "mlp.experts.local_experts."
    if marker in name:
        head, rest = name.split(marker)
        index, tail = rest.split(".", 1)
        num_local = NUM_EXPERTS // state.pg_collection.ep.size()
        name = f"{head}{marker}{state.pg_collection.ep.rank() * num_local + int(index)}.{tail}"
    return name


def _optimizer_state(trainer) -> dict[str, np.ndarray]:
    """``state/<global name>/<key>``: the optimizer state of every parameter this rank holds (a distributed
    optimizer's shards gathered: every rank enters), as the checkpoint view gives it."""
    tensors, _ = trainer.optimizer.checkpoint_tensors()
    return {f"state/{_global_name(n, trainer.cfg, trainer.state)}/{k}": t.double().numpy()
            for n, state in tensors.items() for k, t in state.items()}


def _run_case(rank: int, tmp: str, name: str) -> dict:
    from megatron_pack.parallel.groups import destroy_parallel

    world, tp, pp, ep, distributed, bf16, moe = RUNS[name]
    cfg = _config(tp, pp, ep, distributed, bf16, moe)
    trainer = _trainer(cfg, 0)
    losses = [trainer.train_step().lm_loss for _ in range(2)]
    path = trainer.save(f"{tmp}/{name}")
    out = {"saved": _optimizer_state(trainer), "path": str(path)}
    if bf16:
        name, param = next((n, p) for p, n in trainer.optimizer.names.items() if n.endswith("linear_qkv.weight"))
        main = trainer.optimizer.checkpoint_tensors()[0][name]["fp32_param"]
        out["dtypes"] = np.array([str(param.dtype), str(param.main_grad.dtype), str(main.dtype)])
    losses += [trainer.train_step().lm_loss for _ in range(2)]
    out["losses"] = np.array(losses)
    destroy_parallel()
    return out


def _resume_case(rank: int, tmp: str, name: str) -> dict:
    from megatron_pack.parallel.groups import destroy_parallel

    run, world, tp, pp, ep, distributed, bf16, moe = RESUMES[name]
    cfg = _config(tp, pp, ep, distributed, bf16, moe)
    trainer = _trainer(cfg, 2)
    trainer.load(f"{tmp}/{run}/step_00000002")
    loader = trainer.loader  # this run's own packs of steps 3-4 (the checkpoint's position is of its layout)
    loader.load_state_dict({"kind": "batches", "next": 0})
    out = {"restored": _optimizer_state(trainer), "step": np.array(trainer.step),
           "tp_rank": np.array(trainer.state.tp_rank)}
    out["losses"] = np.array([trainer.train_step().lm_loss for _ in range(2)])
    destroy_parallel()
    return out


def _flatten(prefix: str, result: dict) -> dict:
    flat = {}
    for key, value in result.items():
        if isinstance(value, dict):
            flat.update({f"{prefix}{key}/{k}": v for k, v in value.items()})
        else:
            flat[f"{prefix}{key}"] = np.asarray(value)
    return flat


def _world(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for name in RUNS:
        out.update(_flatten(f"{name}/", _run_case(rank, tmp, name)))
    for name, spec in RESUMES.items():
        if spec[1] == 2:
            out.update(_flatten(f"{name}/", _resume_case(rank, tmp, name)))
            continue
        with sub_world(rank, 1, tmp, f"resume_{name}") as member:
            if member:
                out.update(_flatten(f"{name}/", _resume_case(rank, tmp, name)))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("optimizer_checkpoint")
    return spawn_world(_world, 2, tmp, str(tmp), timeout_s=400)


def _states(result: dict, prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v for k, v in result.items() if k.startswith(prefix)}


def test_same_layout_resume_is_bit_identical(results):
    """(a) and (c): 4 steps uninterrupted == 2 steps + resume + 2 steps, bit for bit, on every rank."""
    for run, resume in (("dp2_dist", "dp2_dist_same"), ("bf16", "bf16_same")):
        for r in results:
            full = r[f"{run}/losses"]
            assert len(set(full.tolist())) == STEPS  # guard: every step moved
            assert int(r[f"{resume}/step"]) == 2
            np.testing.assert_array_equal(r[f"{resume}/losses"], full[2:])


@pytest.mark.parametrize("resume", list(RESUMES))
def test_resume_at_another_layout_restores_every_moment(results, resume):
    """(b) and (d): steps 3-4 at another layout equal the uninterrupted run's, and every restored moment equals
    the saved one (this rank's shard of it)."""
    run = RESUMES[resume][0]
    world = RESUMES[resume][1]
    members = results[:world]
    full = results[0][f"{run}/losses"]
    for r in members:
        np.testing.assert_allclose(r[f"{resume}/losses"], full[2:], rtol=1e-5)
    num_checked = 0
    for r in members:
        restored = _states(r, f"{resume}/restored/")
        saved = {}
        for s in results:
            saved.update(_states(s, f"{run}/saved/"))
        for key, value in restored.items():
            name, state = key.rsplit("/", 1)
            expected = _tp_part(name, saved[key], int(r[f"{resume}/tp_rank"]), value.shape)
            np.testing.assert_array_equal(value, expected, err_msg=key)
            num_checked += 1
    num_params = len({k.rsplit("/", 1)[0] for r in results for k in _states(r, f"{run}/saved/")})
    assert num_params >= 10 and num_checked >= 2 * num_params  # guard: every parameter's two moments


def _tp_part(name: str, whole: np.ndarray, tp_rank: int, shape: tuple) -> np.ndarray:
    """The part of the TP=1 tensor ``whole`` that TP rank ``tp_rank`` of 2 holds as ``shape`` (sliced here, not by
    megatron): all of it (replicated), rows (column-parallel; fc1 as [gate_r; up_r]) or columns (row-parallel)."""
    if tuple(shape) == whole.shape:
        return whole
    if shape[0] != whole.shape[0]:
        if "linear_fc1" in name:
            gate, up = np.split(whole, 2, axis=0)
            return np.concatenate([np.split(gate, 2, axis=0)[tp_rank], np.split(up, 2, axis=0)[tp_rank]])
        return np.split(whole, 2, axis=0)[tp_rank]
    return np.split(whole, 2, axis=1)[tp_rank]


def test_checkpoints_hold_every_moment_initialised(results):
    """Every parameter's both moments in every checkpoint: finite, exp_avg_sq >= 0, not all zero after 2 steps."""
    from megatron_pack.training.checkpoint import read_full_model

    for run in RUNS:
        saved = {}
        for r in results:
            saved.update(_states(r, f"{run}/saved/"))
        names = {k.rsplit("/", 1)[0] for k in saved}
        assert len(names) >= 10
        for name in names:
            for key in ("exp_avg", "exp_avg_sq"):
                value = saved[f"{name}/{key}"]
                assert np.isfinite(value).all() and np.abs(value).max() > 0, (run, name, key)
            assert (saved[f"{name}/exp_avg_sq"] >= 0).all()
        assert len(read_full_model(str(results[0][f"{run}/path"]))) == len(names)


def test_bf16_trains_with_fp32_main_params_near_float32(results):
    """(c): bf16 weights, fp32 main_grad and main params; the loss within bf16 tolerance of the float32 run; the
    checkpoint's fp32 main params are not the bf16 weights widened."""
    weight, grad, main = results[0]["bf16/dtypes"].tolist()
    assert (weight, grad, main) == ("torch.bfloat16", "torch.float32", "torch.float32")
    np.testing.assert_allclose(results[0]["bf16/losses"], results[0]["dp2_dist/losses"], rtol=2e-2)
    mains = _states(results[0], "bf16/saved/")
    fp32 = [k for k in mains if k.endswith("/fp32_param")]
    assert len(fp32) >= 10
    widened = [np.array_equal(mains[k], torch.tensor(mains[k]).bfloat16().double().numpy()) for k in fp32]
    assert not all(widened)  # the main params hold more than bf16 precision
