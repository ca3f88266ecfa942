"""Numerics on real gloo ranks (CPU, float32): NaN is reported precisely, masked ranks train normally.

One spawned world of 2 ranks runs the four parts:

1. DP=2, 4 steps. A NaN put into the per-token losses of one micro-batch at *masked* positions
   (prompt, padding) on rank 0 at step 2 changes nothing: ``loss_func`` never lets a masked
   position through. A NaN at one *target* position on rank 1 at step 3 stops both ranks at
   step 3, before the optimizer step: rank 1's error names the step, the rank and the sample ids
   of the pack; rank 0's says another rank holds the culprit. Parameters stay finite.
2. DP=2, a NaN in rank 1's copy of one weight: the check after loading and the next step's
   non-finite loss both report **weights**, naming the tensor on rank 1 (never the samples), and
   stop rank 0 at the same point.
3. CP=2, 3 steps on packs whose targets all sit in CP rank 0's chunks, so CP rank 1 never holds
   a target token: losses and parameters equal a DP=2 run of the same packs (1e-5; Adam's eps
   is 1e-3 there so near-zero gradients do not amplify rounding), and the loss falls. (One
   step's gradients are also checked in
   tests/functional/test_train_parallel.py::test_fully_masked_cp_rank_gives_reference_gradients.)
4. A pipeline of 2 stages (stage = rank, DP=1), simulated with its own groups: only the last stage
   (rank 1) holds loss reports; the step outcome it reduces reaches stage 0 by the broadcast over
   the pipeline group (``training/outcome.py``), so both ranks hold the same counts, extra reports
   and finalize_model_grads token count. A NaN loss on the last stage, and a NaN weight on the
   first stage (which holds no loss), stop both ranks at once, each with its own line (a rank that
   skipped a collective would hang the world: the deadline fails the test instead).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import ListLoader, spawn_world

NAN_MASKED_AT, NAN_TARGET_AT, NUM_STEPS, CP_STEPS = (2, 0), (3, 1), 4, 3
"""(step, rank) of each injected NaN; steps of the NaN run and of the masked-CP runs."""


def _config(out: str, *, cp: int, global_batch: int, num_steps: int = NUM_STEPS, adam_eps: float = 1e-8):
    from megatron_pack.config.schema import (CheckpointConfig, Config, LoggingConfig, ModelConfig, PackingConfig,
                                             ParallelConfig, TrainConfig)

    return Config(model=ModelConfig(seq_length=64), packing=PackingConfig(packed_sequence_size=64),
                  parallel=ParallelConfig(context_parallel_size=cp),
                  train=TrainConfig(global_batch_size=global_batch, train_iters=num_steps, lr=1e-2, min_lr=1e-3,
                                    lr_warmup_iters=1, output_dir=out, adam_eps=adam_eps),
                  checkpoint=CheckpointConfig(enabled=False), logging=LoggingConfig(tensorboard=False))




def _packs(num_packs: int, seed: int, *, masked_cp_rank: bool) -> list[dict]:
    """Packs of 2 samples (THD length 16, padded to 4). With ``masked_cp_rank`` every target sits
    at THD positions 0-3 and 12-15 of its sample: CP=2 rank 0's chunks; rank 1 gets none."""
    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(seed)
    packs, next_id = [], 1000 * seed
    for _ in range(num_packs):
        samples = []
        for _ in range(2):
            ids = rng.integers(1, 380, size=17).tolist()
            mask = [0] + [1] * 4 + [0] * 8 + [1] * 4 if masked_cp_rank else [0] * 6 + [1] * 11
            samples.append({"input_ids": ids, "loss_mask": mask, "sample_id": next_id})
            next_id += 1
        packs.append(collate_thd(samples, pack_size=64, pad_multiple=4))
    return packs


def _nan_forward_step(rank: int, trainer_box: list):
    """forward_step that poisons the per-token losses of the first micro-batch at the chosen (step, rank)."""
    from megatron_pack.training.step import forward_step

    calls: dict[int, int] = {}

    def step_func(data_iterator, model):
        output, loss_fn = forward_step(data_iterator, model)
        step = trainer_box[0].step + 1
        calls[step] = calls.get(step, 0) + 1
        mask = loss_fn.args[0].reshape(output.shape) != 0
        if calls[step] > 1:  # only the step's first micro-batch is poisoned
            return output, loss_fn
        if (step, rank) == NAN_MASKED_AT:
            poison = ~mask  # prompt and padding positions only
        elif (step, rank) == NAN_TARGET_AT:
            poison = torch.zeros_like(mask)
            poison.view(-1)[int(torch.nonzero(mask.view(-1))[0])] = True  # one target token
        else:
            return output, loss_fn
        assert poison.any()
        return output + torch.where(poison, torch.full_like(output, float("nan")), torch.zeros_like(output)), loss_fn

    return step_func


def _nan_case(rank: int, tmp: str) -> dict:
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    cfg = _config(f"{tmp}/nan", cp=1, global_batch=4)
    state = initialize_parallel(cfg)
    packs = _packs(2 * NUM_STEPS, seed=10 + rank, masked_cp_rank=False)
    box: list = []
    trainer = build_trainer(cfg, state, ListLoader(packs), forward_step_func=_nan_forward_step(rank, box))
    box.append(trainer)
    losses, error = [], ""
    try:
        while trainer.step < NUM_STEPS:
            losses.append(trainer.train_step().lm_loss)
    except FloatingPointError as exc:
        error = str(exc)
    params_finite = all(bool(torch.isfinite(p).all()) for p in trainer.model.module.parameters())
    nan_pack_ids = packs[2 * (NAN_TARGET_AT[0] - 1)]["sample_ids"]
    destroy_parallel()
    return {"nan.losses": np.array(losses), "nan.error": np.array(error), "nan.step": trainer.step,
            "nan.params_finite": params_finite, "nan.pack_ids": nan_pack_ids}


WEIGHT = "decoder.layers.1.mlp.linear_fc2.weight"
"""The parameter poisoned on rank 1 (the weights case)."""


def _weights_case(rank: int, tmp: str) -> dict:
    """A NaN in rank 1's copy of one weight: the check after loading and the non-finite loss of the
    next step both name it on rank 1, and stop rank 0 too (it says another rank's shard)."""
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.finite import NonFiniteWeights, check_weights
    from megatron_pack.training.loop import build_trainer

    cfg = _config(f"{tmp}/weights", cp=1, global_batch=4)
    state = initialize_parallel(cfg)
    trainer = build_trainer(cfg, state, ListLoader(_packs(4, seed=20 + rank, masked_cp_rank=False)))
    finite = check_weights(trainer.model, where=f"rank {rank}", device=state.device, source="the guard",
                           fix="-")  # the clean model passes (None) on both ranks
    if rank == 1:
        with torch.no_grad():
            dict(trainer.model.module.named_parameters())[WEIGHT].view(-1)[3] = float("nan")
    errors = []
    try:
        check_weights(trainer.model, where=f"rank {rank}", device=state.device,
                      source="model.pretrained (DIR)", fix="re-download the folder")
    except NonFiniteWeights as exc:
        errors.append(str(exc))
    try:
        trainer.train_step()
    except FloatingPointError as exc:
        errors.append(str(exc))
    destroy_parallel()
    return {"weights.errors": np.array(errors), "weights.clean": np.array(finite is None), "weights.step": trainer.step}


def _train(tmp: str, *, cp: int, packs: list[dict], global_batch: int) -> dict:
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import run_training

    # adam_eps 1e-3: Adam's g / (sqrt(v) + eps) turns float32 summation-order noise on gradients
    # near eps into large update differences; a larger eps keeps the comparison well-conditioned
    cfg = _config(tmp, cp=cp, global_batch=global_batch, num_steps=CP_STEPS, adam_eps=1e-3)
    state = initialize_parallel(cfg)
    trainer = run_training(cfg, state, ListLoader(packs))
    out = {"losses": np.array([m.lm_loss for m in trainer.history]),
           "target_tokens": np.array([m.target_tokens for m in trainer.history])}
    out.update({f"param.{n}": p.detach().clone() for n, p in trainer.model.module.named_parameters()})
    destroy_parallel()
    return out


# the pipeline case: the last stage's micro-batches (loss sum, target tokens, aux report) and packs
PIPELINE_REPORTS = [(3.0, 6.0, 0.5), (1.0, 2.0, 0.25)]
PIPELINE_PACKS = [([1, 2], 9, 16), ([3], 4, 16)]


def _pipeline_micro_batches(state, *, nan: bool):
    """(reports, packs, batches) of this rank: the last stage's, nothing on the first."""
    from megatron_pack.training.schedule import PackInfo

    if not state.is_last_stage:
        return [], [], []
    reports = [{"lm loss": torch.tensor([float("nan") if nan else s, n]), "aux": torch.tensor([a])}
               for s, n, a in PIPELINE_REPORTS]
    packs = [PackInfo(sample_ids=ids, real_tokens=real, slots=slots) for ids, real, slots in PIPELINE_PACKS]
    batches = [{"sample_ids": torch.tensor(ids), "num_target_tokens": int(n)}
               for (ids, _, _), (_, n, _) in zip(PIPELINE_PACKS, PIPELINE_REPORTS)]
    return reports, packs, batches


def _pipeline_check(outcome, state, reports, batches, chunk) -> str:
    from megatron_pack.training.outcome import check_step_finite

    try:
        check_step_finite(outcome, step=3, model_chunks=[chunk], reports=reports, batches=batches, state=state)
    except FloatingPointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _pipeline_case(rank: int, world_size: int) -> dict:
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_pack.training.outcome import step_outcome

    pp_group = dist.new_group(list(range(world_size)))
    dp_groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    state = SimpleNamespace(rank=rank, pp_rank=rank, pp_size=world_size, is_last_stage=rank == world_size - 1,
                            pp_group=pp_group, dp_cp_group=dp_groups[rank], cp_rank=0, device=torch.device("cpu"))
    chunk = torch.nn.Linear(2, 2)
    reports, packs, batches = _pipeline_micro_batches(state, nan=False)
    outcome = step_outcome(reports, packs, state, num_buckets=0, num_sources=0)
    c = outcome.counts
    finite_line = _pipeline_check(outcome, state, reports, batches, chunk)
    reports, packs, batches = _pipeline_micro_batches(state, nan=True)
    nan_loss = step_outcome(reports, packs, state, num_buckets=0, num_sources=0)
    nan_loss_line = _pipeline_check(nan_loss, state, reports, batches, chunk)
    if rank == 0:
        with torch.no_grad():
            chunk.weight[0, 1] = float("nan")
    nan_weight_line = _pipeline_check(nan_loss, state, reports, batches, chunk)
    return {"pp.counts": [c.loss_sum, c.target_tokens, c.real_tokens, c.slots, c.samples],
            "pp.local": outcome.local_target_tokens, "pp.aux": outcome.reports["aux"], "pp.finite": outcome.finite,
            "pp.received": outcome.received, "pp.finite_line": finite_line, "pp.nan_finite": nan_loss.finite,
            "pp.nan_loss_line": nan_loss_line, "pp.nan_weight_line": nan_weight_line}


def _world(rank: int, world_size: int, tmp: str) -> dict:
    out = _pipeline_case(rank, world_size)
    out.update(_nan_case(rank, tmp))
    out.update(_weights_case(rank, tmp))
    packs = _packs(1, seed=3, masked_cp_rank=True) * CP_STEPS  # the same pack each step: the loss must fall
    out.update({f"cp2.{k}": v for k, v in _train(f"{tmp}/cp2", cp=2, packs=packs, global_batch=1).items()})
    # DP=2 with the same pack on both ranks: the gradient of that one pack, the world-1 result
    out.update({f"dp2.{k}": v for k, v in _train(f"{tmp}/dp2", cp=1, packs=packs, global_batch=2).items()})
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("numerics")
    return spawn_world(_world, 2, tmp, str(tmp))


@pytest.mark.slow
def test_nan_in_one_micro_batch_is_reported_with_step_rank_and_sample_ids(ranks):
    r0, r1 = ranks
    ids = r1["nan.pack_ids"].tolist()
    assert ids == [11008, 11009]  # rank 1's first pack of step 3 (seed 11: ids from 11000, 2 per pack)
    message = str(r1["nan.error"])
    assert message.startswith(f"step {NAN_TARGET_AT[0]}, rank 1: data (the weights are finite): non-finite loss "
                              "sum (nan)"), message
    assert f"sample_ids {ids}" in message and "replay those samples" in message
    other = str(r0["nan.error"])
    assert other.startswith(f"step {NAN_TARGET_AT[0]}, rank 0: data (the weights are finite):") \
        and "named in the error of another rank" in other
    for r in ranks:  # the masked NaN at step 2 changed nothing; no optimizer step ran at step 3
        assert len(r["nan.losses"]) == NAN_TARGET_AT[0] - 1 and np.all(np.isfinite(r["nan.losses"]))
        assert int(r["nan.step"]) == NAN_TARGET_AT[0] - 1 and bool(r["nan.params_finite"])


@pytest.mark.slow
def test_nan_in_the_weights_is_reported_as_weights_naming_the_tensor(ranks):
    r0, r1 = ranks
    assert bool(r0["weights.clean"]) and bool(r1["weights.clean"])  # guard: the clean model passed on both
    on_load, at_step = (str(m) for m in r1["weights.errors"])
    assert on_load == (f"rank 1: weights: {WEIGHT} of model.pretrained (DIR) holds 1 NaN and 0 Inf values; the "
                       "weights are not finite (not the data): re-download the folder."), on_load
    assert at_step.startswith(f"step 1, rank 1: weights: {WEIGHT} of the model the run started from holds 1 NaN"), at_step
    assert "data" not in at_step.split(":")[1] and "sample_ids" not in at_step
    for message in (str(m) for m in r0["weights.errors"]):  # rank 0 stops too, naming where to look
        assert "rank 0: weights: the shard of another rank" in message and "named in that rank's line" in message
    assert len(r0["weights.errors"]) == 2 and int(r0["weights.step"]) == int(r1["weights.step"]) == 0


@pytest.mark.slow
def test_cp_rank_without_target_tokens_trains_normally(ranks):
    from megatron_pack.parallel.cp import slice_thd_batch

    for pack in _packs(1, seed=3, masked_cp_rank=True):  # guard: CP rank 1 really holds no target
        assert float(slice_thd_batch(pack, 2, 1)["loss_mask"].sum()) == 0
        assert float(slice_thd_batch(pack, 2, 0)["loss_mask"].sum()) == 16
    r = ranks[0]
    cp2 = {k[4:]: v for k, v in r.items() if k.startswith("cp2.")}
    dp2 = {k[4:]: v for k, v in r.items() if k.startswith("dp2.")}
    assert len(cp2["losses"]) == CP_STEPS and np.all(np.isfinite(cp2["losses"]))
    assert cp2["losses"][0] - cp2["losses"][-1] > 0.05  # it trained
    np.testing.assert_array_equal(cp2["target_tokens"], np.full(CP_STEPS, 16))
    np.testing.assert_allclose(cp2["losses"], dp2["losses"], rtol=1e-5, atol=0)
    names = [k for k in cp2 if k.startswith("param.")]
    assert len(names) >= 10
    for name in names:
        assert np.all(np.isfinite(cp2[name])), name
        scale = max(float(np.abs(dp2[name]).max()), 1e-12)
        assert float(np.abs(cp2[name] - dp2[name]).max()) / scale <= 1e-5, name
    for name in names:  # the masked CP rank holds the same parameters as its peer
        np.testing.assert_array_equal(ranks[1][f"cp2.{name}"], cp2[name])


@pytest.mark.slow
def test_every_pipeline_stage_gets_the_last_stages_outcome(ranks):
    for rank, r in enumerate(ranks):
        assert r["pp.counts"].tolist() == [4.0, 8.0, 13, 32, 3], rank  # rank 1's two micro-batches
        assert r["pp.aux"].tolist() == [0.75] and int(r["pp.local"]) == 8, rank
        assert bool(r["pp.finite"]) and bool(r["pp.received"]) and str(r["pp.finite_line"]) == "no error", rank
    # a NaN loss on the last stage: both stop; rank 1 names its first pack, stage 0 (no loss) defers to it
    assert not any(bool(r["pp.nan_finite"]) for r in ranks)
    last, first = str(ranks[1]["pp.nan_loss_line"]), str(ranks[0]["pp.nan_loss_line"])
    assert last.startswith("FloatingPointError: step 3, rank 1: data") and "sample_ids [1, 2]" in last, last
    assert first == ("FloatingPointError: step 3, rank 0: data (the weights are finite): the global lm loss is not "
                     "finite; the pack that produced it is named in the error of another rank."), first
    # a NaN weight on stage 0, which holds no loss: both report weights, rank 0 names the tensor
    first, last = str(ranks[0]["pp.nan_weight_line"]), str(ranks[1]["pp.nan_weight_line"])
    assert first.startswith("NonFiniteWeights: step 3, rank 0: weights: weight of the model after step 2 holds 1 NaN")
    assert last.startswith("NonFiniteWeights: step 3, rank 1: weights: the shard of another rank"), last
