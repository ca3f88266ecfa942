"""Training math across layouts, on real gloo ranks, CPU, float32.

1. The same global batch for 5 steps: world 1, CP2, DP2 and TP2 x CP2 give the world-1 losses
   per step and the world-1 parameters after 5 steps (relative 1e-5).
2. Per-token normalisation: two micro-batches with very different target counts give the
   token-weighted mean loss and its gradient, not a mean of per-pack means.
3. A CP rank whose tokens are all masked: finite loss, gradients equal to world 1's.

Three process groups in all (worlds of 1, 2 and 4), each running every case it hosts, so the
~4 s megatron-core import is paid 7 times, not once per case.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from _dist import ListLoader, num_threads, spawn_world

NUM_STEPS, GLOBAL_BATCH, PAD_MULTIPLE = 5, 4, 4
LAYOUTS = {"world1": (1, 1, 1), "cp2": (2, 1, 2), "dp2": (2, 1, 1), "tp2_cp2": (4, 2, 2)}
"""name -> (world size, TP, CP)."""


def _sample(rng: np.random.Generator, sample_id: int, length: int, num_prompt: int) -> dict:
    ids = rng.integers(1, 380, size=length).tolist()
    mask = [0] * num_prompt + [1] * (length - num_prompt)
    return {"input_ids": ids, "loss_mask": mask, "sample_id": sample_id}


def make_packs(num_packs: int, seed: int = 0) -> list[dict]:
    """Deterministic THD packs of 1-4 samples (lengths 6-40, half-prompt), padded to 4."""
    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(seed)
    packs, next_id = [], 0
    for _ in range(num_packs):
        samples = []
        for _ in range(int(rng.integers(1, 5))):
            length = int(rng.integers(6, 41))
            samples.append(_sample(rng, next_id, length, length // 2))
            next_id += 1
        packs.append(collate_thd(samples, pack_size=256, pad_multiple=PAD_MULTIPLE))
    return packs




def dp_share(packs: list[dict], dp_size: int, dp_rank: int, global_batch: int) -> list[dict]:
    """This DP rank's packs: each step's global batch split in contiguous blocks."""
    per_rank = global_batch // dp_size
    return [packs[start + dp_rank * per_rank + i] for start in range(0, len(packs), global_batch)
            for i in range(per_rank)]


def make_config(tmp: str, *, tp: int = 1, cp: int = 1, train_iters: int = NUM_STEPS, **train):
    from megatron_pack.config.schema import CheckpointConfig, Config, LoggingConfig, ParallelConfig, TrainConfig

    # adam_eps 1e-4: AdamW moves an element by about lr * g / (|g| + eps), whose slope at g ~ 0 is
    # lr / eps. With eps 1e-8 (or 1e-6) that amplifies float32 rounding differences of near-zero
    # gradient elements (another summation order across CP/DP/TP, ~1e-11) into parameter
    # differences of 1e-5 relative after 5 steps (measured) that say nothing about the parallel
    # math; with 1e-4 the largest is 1.4e-6. Losses and gradients are compared at 1e-5 regardless.
    train_kw = dict(global_batch_size=GLOBAL_BATCH, train_iters=train_iters, lr=3e-3, min_lr=3e-4,
                    lr_warmup_iters=1, output_dir=tmp, clip_grad=1.0, adam_eps=1e-4)
    train_kw.update(train)
    return Config(parallel=ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp),
                  train=TrainConfig(**train_kw), checkpoint=CheckpointConfig(enabled=False),
                  logging=LoggingConfig(tensorboard=False))


def full_tensors(trainer, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its main_grad) gathered whole over TP, keyed by name."""
    import torch.distributed as dist

    group, out = trainer.state.tp_group, {}
    for name, param in trainer.model.module.named_parameters():
        local = (param.main_grad if grads else param).detach().clone()
        if getattr(param, "tensor_model_parallel", False) and trainer.state.tp_size > 1:
            parts = [torch.empty_like(local) for _ in range(trainer.state.tp_size)]
            dist.all_gather(parts, local, group=group)
            # a strided shard (SwiGLU fc1: [gate_r; up_r]) holds `stride` pieces: regroup them
            dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
            pieces = [part.chunk(stride, dim=dim) for part in parts]
            local = torch.cat([p[s] for s in range(stride) for p in pieces], dim=dim)
        out[name.replace(".", "__")] = local
    return out


def _train_layout(tmp: str, tp: int, cp: int) -> dict:
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import run_training

    cfg = make_config(tmp, tp=tp, cp=cp)
    state = initialize_parallel(cfg)
    # the same global batch every step, so the falling loss shows the compared numbers really move
    packs = dp_share(make_packs(GLOBAL_BATCH) * NUM_STEPS, state.dp_size, state.dp_rank, GLOBAL_BATCH)
    trainer = run_training(cfg, state, ListLoader(packs))
    result = {f"param.{k}": v for k, v in full_tensors(trainer).items()}
    result["losses"] = np.array([m.lm_loss for m in trainer.history])
    result["target_tokens"] = np.array([m.target_tokens for m in trainer.history])
    destroy_parallel()
    return result


def masked_cp_pack() -> dict:
    """One 16-token sample whose targets all sit in CP=2 rank 0's chunks (0-3, 12-15)."""
    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(7)
    ids = rng.integers(1, 380, size=17).tolist()
    mask = [0] + [1] * 4 + [0] * 8 + [1] * 4  # loss_mask[1:] -> targets at THD positions 0-3 and 12-15
    return collate_thd([{"input_ids": ids, "loss_mask": mask, "sample_id": 0}], pack_size=16, pad_multiple=4)


def _gradients_of(tmp: str, cp: int, packs: list[dict]) -> tuple[dict, float]:
    """main_grad after compute_gradients on ``packs`` (one step, world of CP ranks)."""
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    cfg = make_config(tmp, cp=cp, global_batch_size=len(packs))
    state = initialize_parallel(cfg)
    trainer = build_trainer(cfg, state, ListLoader(packs))
    total, _ = trainer.compute_gradients()
    grads = full_tensors(trainer, grads=True)
    destroy_parallel()
    return grads, total.lm_loss()


def _per_token_reference(tmp: str, packs: list[dict]) -> dict:
    """World 1: the loop's gradient vs a direct token-weighted mean and a mean of means."""
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.model.builder import build_model
    from megatron_pack.training.step import get_packed_seq_params

    loop_grads, loop_loss = _gradients_of(tmp, 1, packs)
    cfg = make_config(tmp)
    state = initialize_parallel(cfg)
    model = build_model(cfg, state)

    def losses(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        sums, counts = [], []
        for pack in packs:
            per_token = model(pack["tokens"], pack["position_ids"], None, labels=pack["labels"],
                              packed_seq_params=get_packed_seq_params(pack))
            sums.append((per_token * pack["loss_mask"]).sum())
            counts.append(pack["loss_mask"].sum())
        if kind == "ref":  # token-weighted mean over the whole batch
            return sum(sums) / sum(counts), torch.stack(counts)
        return sum(s / c for s, c in zip(sums, counts)) / len(packs), torch.stack(counts)

    out = {"loop_loss": loop_loss}
    for tag, key in (("ref", "token_mean"), ("mom", "mean_of_means")):
        model.zero_grad()
        loss, out["counts"] = losses(tag)
        loss.backward()
        out[key] = loss.item()
        for name, param in model.named_parameters():
            out[f"{tag}.{name.replace('.', '__')}"] = param.grad.detach().clone()
    out.update({f"loop.{k}": v for k, v in loop_grads.items()})
    destroy_parallel()
    return out


def _non_finite_error(tmp: str) -> str:
    """The error a NaN loss raises (a NaN output-layer row makes every token's loss NaN)."""
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    cfg = make_config(tmp, global_batch_size=2)
    state = initialize_parallel(cfg)
    trainer = build_trainer(cfg, state, ListLoader(make_packs(2, seed=5)))
    with torch.no_grad():
        trainer.model.module.output_layer.weight[0].fill_(float("nan"))
    try:
        trainer.compute_gradients()
        message = "no error"
    except FloatingPointError as exc:
        message = str(exc)
    destroy_parallel()
    return message


def _world1(rank: int, world_size: int, tmp: str) -> dict:
    out = {f"train.{k}": v for k, v in _train_layout(tmp + "/w1", 1, 1).items()}
    packs = make_packs(40, seed=3)
    by_count = sorted(packs, key=lambda p: float(p["loss_mask"].sum()))
    out.update({f"tok.{k}": v for k, v in _per_token_reference(tmp + "/tok", [by_count[0], by_count[-1]]).items()})
    grads, loss = _gradients_of(tmp + "/m1", 1, [masked_cp_pack()])
    out.update({f"mask.{k}": v for k, v in grads.items()}, **{"mask.loss": loss})
    out["nan_error"] = _non_finite_error(tmp + "/nan")
    return out


def _world2(rank: int, world_size: int, tmp: str) -> dict:
    import gc

    from megatron_pack.parallel.groups import _layout_groups

    threads_before = num_threads(os.getpid())
    out = {f"cp2.{k}": v for k, v in _train_layout(tmp + "/cp2", 1, 2).items()}
    out.update({f"dp2.{k}": v for k, v in _train_layout(tmp + "/dp2", 1, 1).items()})
    grads, loss = _gradients_of(tmp + "/m2", 2, [masked_cp_pack()])
    out.update({f"mask.{k}": v for k, v in grads.items()}, **{"mask.loss": loss})
    # three layouts built and torn down (destroy_parallel): none of their groups, nor the groups' threads, is left
    gc.collect()  # the last layout's model, garbage since its function returned
    out.update(threads_before=threads_before, threads_after=num_threads(os.getpid()),
               groups_after=len(_layout_groups()))
    return out


def _world4(rank: int, world_size: int, tmp: str) -> dict:
    return {f"tp2_cp2.{k}": v for k, v in _train_layout(tmp + "/tp2cp2", 2, 2).items()}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_parallel")
    return {1: spawn_world(_world1, 1, tmp, str(tmp))[0], 2: spawn_world(_world2, 2, tmp, str(tmp)),
            4: spawn_world(_world4, 4, tmp, str(tmp))}


def _layout_result(worlds, name: str) -> dict:
    if name == "world1":
        return {k[len("train."):]: v for k, v in worlds[1].items() if k.startswith("train.")}
    ranks = worlds[LAYOUTS[name][0]]
    return {k[len(name) + 1:]: v for k, v in ranks[0].items() if k.startswith(name + ".")}


def _assert_rel_close(got: np.ndarray, ref: np.ndarray, rel: float, what: str) -> None:
    scale = max(float(np.abs(ref).max()), 1e-12)
    err = float(np.abs(got - ref).max()) / scale
    assert err <= rel, f"{what}: max |diff| / max |ref| = {err:.2e} > {rel:.0e}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2", "dp2", "tp2_cp2"], ids=["world2-cp2", "world2-dp2", "world4-tp2-cp2"])
def test_layouts_match_world1(worlds, layout):
    ref, got = _layout_result(worlds, "world1"), _layout_result(worlds, layout)
    assert len(ref["losses"]) == NUM_STEPS and np.all(ref["target_tokens"] > 0)
    assert ref["losses"][0] - ref["losses"][-1] > 0.05  # it trained: the check compares moving numbers
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    np.testing.assert_array_equal(got["target_tokens"], ref["target_tokens"])
    names = [k for k in ref if k.startswith("param.")]
    assert len(names) >= 10
    for name in names:
        assert got[name].shape == ref[name].shape, name
        _assert_rel_close(got[name], ref[name], 1e-5, f"{layout} {name}")
    moved = max(float(np.abs(ref[n]).max()) for n in names)
    assert moved > 0


@pytest.mark.slow
def test_per_token_normalisation_not_mean_of_means(worlds):
    r = {k[len("tok."):]: v for k, v in worlds[1].items() if k.startswith("tok.")}
    counts = r["counts"]
    assert counts.max() >= 4 * counts.min() > 0  # very different target counts
    assert float(r["loop_loss"]) == pytest.approx(float(r["token_mean"]), rel=1e-6)
    assert abs(float(r["token_mean"]) - float(r["mean_of_means"])) > 1e-3
    names = [k[len("ref."):] for k in r if k.startswith("ref.")]
    assert len(names) >= 10
    differs = 0
    for name in names:
        _assert_rel_close(r["loop." + name], r["ref." + name], 1e-5, name)
        ref, mom = r["ref." + name], r["mom." + name]
        differs += float(np.abs(ref - mom).max()) > 1e-3 * float(np.abs(ref).max())
    assert differs >= len(names) // 2  # the mean-of-means gradient is really different


@pytest.mark.slow
def test_fully_masked_cp_rank_gives_reference_gradients(worlds):
    from megatron_pack.parallel.cp import slice_thd_batch

    pack = masked_cp_pack()
    assert float(slice_thd_batch(pack, 2, 1)["loss_mask"].sum()) == 0  # rank 1 holds no target
    assert float(slice_thd_batch(pack, 2, 0)["loss_mask"].sum()) == 8
    ref = {k[len("mask."):]: v for k, v in worlds[1].items() if k.startswith("mask.")}
    names = [k for k in ref if k != "loss"]
    assert len(names) >= 10
    for rank_result in worlds[2]:
        got = {k[len("mask."):]: v for k, v in rank_result.items() if k.startswith("mask.")}
        assert np.isfinite(got["loss"]) and float(got["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-6)
        for name in names:
            assert np.all(np.isfinite(got[name])), name
            _assert_rel_close(got[name], ref[name], 1e-5, name)
    assert max(float(np.abs(ref[n]).max()) for n in names) > 0


@pytest.mark.slow
def test_non_finite_loss_from_weights_names_the_tensor_not_the_data(worlds):
    """A NaN output-layer row makes every loss NaN: the message blames the weights (the tensor), not the
    samples, and at step 1 it points at the starting weights, not at an optimizer step. (A NaN from the
    data, with finite weights: test_reliability_numerics.py names step, rank and sample ids.)"""
    message = str(worlds[1]["nan_error"])
    assert message.startswith("step 1, rank 0: weights: output_layer.weight of the model the run started from "
                              "holds 64 NaN and 0 Inf values"), message
    assert "not the data" in message and "no step ran yet" in message and "sample_ids" not in message, message


def test_destroy_parallel_ends_every_group_of_the_layout(worlds):
    """Three layouts one after another in one process (``_world2``): ``destroy_parallel`` leaves no group but the
    default one, and the threads of their gloo groups end with them (before: about 60 threads a layout stayed,
    waking while idle; a 4-rank test world reached 975 a rank), the CP group megatron-core's rotary cache held
    included (3 threads a layout before), but for the one group megatron-core's parallel state keeps until the next
    layout replaces it (``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``)."""
    for rank, out in enumerate(worlds[2]):
        assert int(out["groups_after"]) == 0, rank
        assert int(out["threads_after"]) <= int(out["threads_before"]) + 3, (rank, out["threads_before"],
                                                                             out["threads_after"])
