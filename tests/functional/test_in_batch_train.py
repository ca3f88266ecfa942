"""packing.mode=in_batch trains end to end (issue 11): micro-batches of samples from the token store,
packed at collate with the CP pad multiple, per-token loss. Losses equal at CP=1 and CP=2, equal to an
offline-packed run (collate_thd) on the same samples in the same micro-batches, and the first step's loss
equal to a float64 per-sample replay of the same initial model with no packing at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import ListLoader, spawn_world

MBS, GBS, NUM_STEPS = 3, 6, 4
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _overrides(ds: str, out: str, cp: int, *extra: str) -> list[str]:
    return [f"data.dataset_dir={ds}", "packing.mode=in_batch",
            f"train.micro_batch_size={MBS}", f"train.global_batch_size={GBS}", f"train.train_iters={NUM_STEPS}",
            "train.lr_warmup_iters=1", f"train.output_dir={out}", "checkpoint.enabled=false",
            "logging.tensorboard=false", f"parallel.context_parallel_size={cp}", "parallel.backend=gloo",
            "model.seq_length=256", *extra]


def _in_batch_run(ds: str, out: str, cp: int) -> tuple[dict, list[list[int]], object]:
    from megatron_pack.cli.run_config import load_run_config
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_loader, run_training

    run = load_run_config(_overrides(ds, out, cp), world_size=torch.distributed.get_world_size())
    enable_cpu_compat_without_cuda()
    state = initialize_parallel(run.cfg)
    trainer = run_training(run.cfg, state, build_loader(run.cfg, state, run.dataset))
    groups = [ids for step in trainer.pack_log for ids in step]
    result = {"losses": np.array([m.lm_loss for m in trainer.history]),
              "tokens": np.array([m.target_tokens for m in trainer.history]),
              "samples": np.array([m.samples for m in trainer.history])}
    destroy_parallel()
    return result, groups, run


def _offline_run(ds: str, out: str, cp: int, groups: list[list[int]], dataset) -> dict:
    """The same micro-batches, each packed by the offline collate (collate_thd) as one pack of a plan."""
    from megatron_pack.config import load_config
    from megatron_pack.config.layout import pad_multiple, round_up
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import run_training

    by_id = {s["sample_id"]: s for i in range(len(dataset)) for s in dataset[i]}
    mult = pad_multiple(cp, 1, False)
    packs = [[by_id[i] for i in ids] for ids in groups]
    size = max(sum(round_up(len(s["input_ids"]) - 1, mult) for s in p) for p in packs)
    size = round_up(size, 2 * cp)
    overrides = [o for o in _overrides(ds, out, cp) if not o.startswith(("packing.", "train.micro", "train.global",
                                                                           "model.seq_length"))]
    cfg = load_config(overrides + [f"packing.packed_sequence_size={size}", f"model.seq_length={size}",
                                   "train.micro_batch_size=1", f"train.global_batch_size={GBS // MBS}"],
                      world_size=torch.distributed.get_world_size())
    state = initialize_parallel(cfg)
    batches = [collate_thd(p, pack_size=size, pad_multiple=mult, pad_id=int(dataset.metadata["pad_id"]))
               for p in packs]
    trainer = run_training(cfg, state, ListLoader(batches))
    destroy_parallel()
    return {"losses": np.array([m.lm_loss for m in trainer.history])}


def _unpacked_reference(ds: str, out: str, groups: list[list[int]], dataset) -> float:
    """Step 1's loss from the same initial model run on each sample alone (a sequence of its own: no
    micro-batch, no in-batch collate, no CP, not our loss_func), cross entropy in float64:
    sum over answer tokens / their count."""
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    keep_keys = [o for o in _overrides(ds, out, 1) if not o.startswith(("packing.", "train.micro", "train.global"))]
    cfg = load_config(keep_keys + ["packing.packed_sequence_size=256"])
    state = initialize_parallel(cfg)
    model = build_model(cfg, state)  # seeded by train.seed, as the trainer's
    model.eval()
    by_id = {s["sample_id"]: s for i in range(len(dataset)) for s in dataset[i]}
    total, count = 0.0, 0
    for ids in groups[: GBS // MBS]:  # step 1's micro-batches
        for sample_id in ids:
            s = by_id[sample_id]
            x = torch.as_tensor(s["input_ids"], dtype=torch.int64)
            alone = collate_thd([s], pack_size=x.numel() - 1)
            with torch.no_grad():
                logits = model(alone["tokens"], alone["position_ids"], None,
                               packed_seq_params=get_packed_seq_params(alone))[0].double()
            losses = torch.nn.functional.cross_entropy(logits, x[1:], reduction="none")
            keep = torch.as_tensor(s["loss_mask"][1:]) != 0
            total, count = total + float(losses[keep].sum()), count + int(keep.sum())
    destroy_parallel()
    assert count > 0
    return total / count


def _world1(rank: int, world_size: int, ds: str, tmp: str) -> dict:
    result, groups, run = _in_batch_run(ds, tmp + "/ib1", cp=1)
    offline = _offline_run(ds, tmp + "/off1", 1, groups, run.dataset)
    reference = _unpacked_reference(ds, tmp + "/ref", groups, run.dataset)
    return {**{f"ib.{k}": v for k, v in result.items()}, "offline.losses": offline["losses"],
            "reference.step1": np.array(reference), "groups": np.array([len(g) for g in groups])}


def _world2(rank: int, world_size: int, ds: str, tmp: str) -> dict:
    result, groups, run = _in_batch_run(ds, tmp + "/ib2", cp=2)
    offline = _offline_run(ds, tmp + "/off2", 2, groups, run.dataset)
    return {**{f"ib.{k}": v for k, v in result.items()}, "offline.losses": offline["losses"]}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    from megatron_pack.cli.main import main

    tmp = tmp_path_factory.mktemp("in_batch")
    ds = tmp / "ds"
    assert main(["prepare", "data=synthetic", "data.synthetic_num_samples=64", "data.tokenize_workers=1",
                 f"data.dataset_dir={ds}", "packing.packed_sequence_size=256"]) == 0
    return {1: spawn_world(_world1, 1, tmp, str(ds), str(tmp))[0], 2: spawn_world(_world2, 2, tmp, str(ds), str(tmp))}


def test_in_batch_trains_and_losses_fall(worlds):
    one = worlds[1]
    assert len(one["ib.losses"]) == NUM_STEPS and np.isfinite(one["ib.losses"]).all()
    assert (one["ib.samples"] == GBS).all() and (one["groups"] == MBS).all()  # micro-batches of MBS samples
    assert one["ib.losses"][-1] < one["ib.losses"][0]  # guard: the compared numbers move


def test_cp2_equals_cp1(worlds):
    one, two = worlds[1], worlds[2]
    np.testing.assert_array_equal(two[0]["ib.tokens"], one["ib.tokens"])  # the same samples each step
    for rank in (0, 1):
        np.testing.assert_allclose(two[rank]["ib.losses"], one["ib.losses"], rtol=1e-5, atol=1e-6)


def test_equals_the_offline_packed_run_on_the_same_samples(worlds):
    np.testing.assert_allclose(worlds[1]["offline.losses"], worlds[1]["ib.losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(worlds[2][0]["offline.losses"], worlds[2][0]["ib.losses"], rtol=1e-5, atol=1e-6)


def test_first_step_equals_an_unpacked_float64_replay(worlds):
    assert worlds[1]["ib.losses"][0] == pytest.approx(float(worlds[1]["reference.step1"]), rel=1e-5)
