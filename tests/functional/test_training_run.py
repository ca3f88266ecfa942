"""A complete fine-tuning run on real gloo ranks (CPU, float32): validation loss, resume across
layouts, weights-only start, the changed-settings refusal, the distributed optimizer.

1. Validation loss: world 1, CP2, DP2 and TP2 x CP2 give the same token-weighted validation loss
   (relative 1e-5) on the same held-out packs, before training and after each of 2 steps; it
   equals a per-sample reference (each validation sample alone, summed in float64 here); no
   validation sample is ever in a training pack.
2. Resume across layouts: 4 steps at TP2 x CP2 (4 processes), resumed at world 1 (CP=1) and at
   DP=2 (with the distributed optimizer): steps 5-6 give the uninterrupted TP2 x CP2 run's losses
   (relative 1e-5) on the same packs. ``checkpoint.load_weights_only`` starts at step 0 from those
   weights.
3. Distributed optimizer (DP=2, megatron-core's): the plain optimizer's losses (relative 1e-6) and parameters
   after 5 steps (its gradients are reduce-scattered, not all-reduced: the same sums in another order); each
   rank holds about half of the optimizer state.
5. Resuming with a changed lr or global batch is refused before launch, naming every change and
   the fix; ``checkpoint.allow_changed=true`` goes on with the new lr.

Worlds: 1, 2 and 4 processes, several cases each (the megatron-core import is paid per process).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from _dist import spawn_world

pytestmark = pytest.mark.timeout(900)

DATA = ["experiment=quickstart", "data.synthetic_num_samples=240", "data.validation_fraction=0.1",
        "packing.pad_seq_to_mult=4"]
TRAIN = ["train.global_batch_size=4", "train.adam_eps=1e-4", "train.lr_warmup_iters=1", "logging.tensorboard=false",
         "train.min_lr=3e-4"]
# adam_eps 1e-4 as in test_train_parallel.py: eps 1e-8 turns float32 rounding of near-zero gradient
# elements (another summation order per layout) into 1e-5 parameter differences that say nothing.


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> str:
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    path = str(tmp_path_factory.mktemp("run_data") / "synthetic")
    prepare(load_config(DATA + [f"data.dataset_dir={path}"]), progress=False)
    return path


def _config(dataset_dir: str, out: str, tp: int, cp: int, world: int, *extra: str):
    from megatron_pack.config import load_config

    return load_config(DATA + TRAIN + [f"data.dataset_dir={dataset_dir}", f"train.output_dir={out}",
                                       f"parallel.tensor_model_parallel_size={tp}",
                                       f"parallel.context_parallel_size={cp}", *extra], world_size=world)


def _run(dataset_dir: str, out: str, tp: int, cp: int, world: int, *extra: str):
    """One training run in this (already started) world; returns the trainer."""
    from megatron_pack.data.batches.opening import open_dataset, open_validation
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.eval import build_validation_loader
    from megatron_pack.training.loop import build_loader, run_training

    cfg = _config(dataset_dir, out, tp, cp, world, *extra)
    state = initialize_parallel(cfg)
    dataset = open_dataset(cfg)
    validation = build_validation_loader(cfg, state, open_validation(cfg, dataset))
    trainer = run_training(cfg, state, build_loader(cfg, state, dataset), validation=validation)
    destroy_parallel()
    return trainer


def _packs(trainer, prefix: str) -> dict:
    """This rank's packs per step as one flat array + counts (the parent merges DP ranks)."""
    flat = [sorted(sum(step, [])) for step in trainer.pack_log]
    return {f"{prefix}_ids": np.array(sum(flat, []), dtype=np.int64),
            f"{prefix}_counts": np.array([len(f) for f in flat], dtype=np.int64)}


def _merge_packs(results: list[dict], prefix: str) -> list[list[int]]:
    """Per step, the sorted sample ids of all ranks' packs (TP/CP ranks repeat their DP rank's)."""
    steps: list[set] = []
    for r in results:
        ids, counts = r[f"{prefix}_ids"].tolist(), r[f"{prefix}_counts"].tolist()
        at = 0
        for i, n in enumerate(counts):
            while len(steps) <= i:
                steps.append(set())
            steps[i] |= set(ids[at:at + n])
            at += n
    return [sorted(s) for s in steps]


# ----- 1. validation loss across layouts ----------------------------------------------------

LAYOUTS = {"world1": (1, 1, 1), "cp2": (2, 1, 2), "dp2": (2, 1, 1), "tp2_cp2": (4, 2, 2)}
"""name -> (world size, TP, CP)."""


def _validation_case(dataset_dir: str, tmp: str, name: str) -> dict:
    world, tp, cp = LAYOUTS[name]
    from megatron_pack.data.batches.opening import open_dataset, open_validation
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.eval import build_validation_loader
    from megatron_pack.training.loop import build_loader, build_trainer, run_training

    cfg = _config(dataset_dir, f"{tmp}/{name}_init", tp, cp, world, "train.train_iters=2")
    state = initialize_parallel(cfg)
    dataset = open_dataset(cfg)
    validation = build_validation_loader(cfg, state, open_validation(cfg, dataset))
    initial = build_trainer(cfg, state, build_loader(cfg, state, dataset), validation=validation).evaluate()
    destroy_parallel()
    trained = _run(dataset_dir, f"{tmp}/{name}", tp, cp, world, "train.train_iters=2", "train.eval_interval=1",
                   "logging.log_sample_ids=true")
    return {f"{name}_val": np.array([initial.loss] + [v for _, v in trained.val_history]),
            f"{name}_val_tokens": np.array(initial.target_tokens), **_packs(trained, f"{name}_train")}


def _validation_world(rank: int, world: int, dataset_dir: str, tmp: str) -> dict:
    out = {}
    for name in [n for n, (w, _, _) in LAYOUTS.items() if w == world]:
        out.update(_validation_case(dataset_dir, tmp, name))
    if world == 1:
        out.update(_per_sample_reference(dataset_dir, tmp))
    return out


def _per_sample_reference(dataset_dir: str, tmp: str) -> dict:
    """Each validation sample alone (its own one-sample pack), world 1; loss sums added in float64."""
    import torch

    from megatron_pack.data.batches.opening import open_dataset, open_validation
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cfg = _config(dataset_dir, f"{tmp}/reference", 1, 1, 1, "train.train_iters=2")
    state = initialize_parallel(cfg)
    validation = open_validation(cfg, open_dataset(cfg))
    model = build_model(cfg, state).eval()
    loss_sum, count, ids = 0.0, 0, []
    with torch.no_grad():
        for i in range(len(validation)):
            for sample in validation[i]:
                ids.append(sample["sample_id"])
                batch = collate_thd([sample], pack_size=cfg.packing.packed_sequence_size, pad_multiple=4)
                losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                               packed_seq_params=get_packed_seq_params(batch))
                mask = batch["loss_mask"] != 0
                loss_sum += float(losses.double()[mask].sum())
                count += int(mask.sum())
    destroy_parallel()
    return {"reference_val": np.array(loss_sum / count), "validation_ids": np.array(sorted(ids))}


@pytest.fixture(scope="module")
def validation_results(dataset_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("validation")
    merged: dict = {}
    for world in (1, 2, 4):
        results = spawn_world(_validation_world, world, tmp, dataset_dir, str(tmp))
        merged.update({k: v for k, v in results[0].items() if not k.endswith(("_ids", "_counts"))
                       or k == "validation_ids"})
        for name in [n for n, (w, _, _) in LAYOUTS.items() if w == world]:
            merged[f"{name}_train_packs"] = _merge_packs(results, f"{name}_train")
    return merged


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "world1"])
def test_validation_loss_equal_at_every_layout(validation_results, name):
    ref = validation_results["world1_val"]
    got = validation_results[f"{name}_val"]
    assert ref.shape == (3,) and np.all(ref > 0) and ref[0] != ref[2]  # it evaluated 3 times, and training moved it
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert int(validation_results[f"{name}_val_tokens"]) == int(validation_results["world1_val_tokens"]) > 0


def test_validation_loss_equals_per_sample_reference(validation_results):
    np.testing.assert_allclose(validation_results["world1_val"][0], validation_results["reference_val"], rtol=1e-5)


def test_validation_samples_never_trained_on(validation_results, dataset_dir):
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.store.metadata import list_plans

    held_out = set(validation_results["validation_ids"].tolist())
    assert 10 < len(held_out) <= 24  # round(0.1 * 240) held out, less any sample without answer tokens
    for name in LAYOUTS:
        trained = set(sum(validation_results[f"{name}_train_packs"], []))
        assert len(trained) >= 8 and not trained & held_out
    plan_dir = list_plans(Path(dataset_dir))[0]
    train_ids = set(PackedSFTDataset(dataset_dir, plan_dir).sample_order.tolist())
    assert train_ids and not train_ids & held_out
    assert PackedSFTDataset(dataset_dir, plan_dir).metadata["split"]["num_samples_held_out"] == 24


# ----- 2 and 5. resume across layouts; the changed-settings refusal ---------------------------

RESUME = ["train.train_iters=6", "checkpoint.save_interval=2", "logging.log_sample_ids=true"]


def _full_params(trainer) -> dict:
    from test_train_parallel import full_tensors

    return {f"param.{k}": v for k, v in full_tensors(trainer).items()}


def _tp2_cp2_world(rank: int, world: int, dataset_dir: str, tmp: str) -> dict:
    full = _run(dataset_dir, f"{tmp}/full", 2, 2, 4, *RESUME)
    killed = _run(dataset_dir, f"{tmp}/killed", 2, 2, 4, *RESUME, "train.exit_after_iters=4")
    return {"full_losses": np.array([m.lm_loss for m in full.history]), **_packs(full, "full"),
            "killed_steps": np.array([m.step for m in killed.history]), **_full_params(killed)}


def _resume_world(rank: int, world: int, dataset_dir: str, tmp: str) -> dict:
    """world 1: resume at CP=1, weights-only start, allow_changed; world 2: resume at DP=2 (distributed optimizer)."""
    load = f"checkpoint.load={tmp}/killed/checkpoints"
    extra = ["train.exit_after_iters=2"]  # steps 5 and 6 only, never past them
    if world == 2:
        resumed = _run(dataset_dir, f"{tmp}/dp2", 1, 1, 2, *RESUME, load, "ddp.use_distributed_optimizer=true")
        return {"losses": np.array([m.lm_loss for m in resumed.history]),
                "steps": np.array([m.step for m in resumed.history]), **_packs(resumed, "resumed")}
    resumed = _run(dataset_dir, f"{tmp}/world1", 1, 1, 1, *RESUME, load, *extra)
    out = {"losses": np.array([m.lm_loss for m in resumed.history]),
           "steps": np.array([m.step for m in resumed.history]), **_packs(resumed, "resumed")}
    out.update(_weights_only(dataset_dir, tmp, load))
    out.update(_allowed_change(dataset_dir, tmp, load))
    return out


def _weights_only(dataset_dir: str, tmp: str, load: str) -> dict:
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.training.loop import build_loader, build_trainer
    from megatron_pack.training.trainer_checkpoint import start_or_resume

    cfg = _config(dataset_dir, f"{tmp}/weights", 1, 1, 1, *RESUME, load, "checkpoint.load_weights_only=true",
                  "train.lr=1e-3")  # a new run may change anything
    state = initialize_parallel(cfg)
    trainer = build_trainer(cfg, state, build_loader(cfg, state, open_dataset(cfg)))
    start_or_resume(cfg, trainer)
    out = {f"weights_{k}": v for k, v in _full_params(trainer).items()}
    out.update(weights_step=np.array(trainer.step), weights_schedule=np.array(trainer.schedule.num_steps),
               weights_loader=np.array(trainer.loader.state_dict()["consumed"]),
               weights_optim=np.array(max(float(t.abs().max()) for s in trainer.optimizer.checkpoint_tensors()[0].values()
                                          for t in s.values())))
    destroy_parallel()
    return out


def _allowed_change(dataset_dir: str, tmp: str, load: str) -> dict:
    resumed = _run(dataset_dir, f"{tmp}/changed", 1, 1, 1, *RESUME, load, "train.exit_after_iters=1",
                   "train.lr=1e-3", "checkpoint.allow_changed=true")
    return {"changed_steps": np.array([m.step for m in resumed.history]),
            "changed_lr": np.array([m.lr for m in resumed.history])}


@pytest.fixture(scope="module")
def resume_results(dataset_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("resume")
    four = spawn_world(_tp2_cp2_world, 4, tmp, dataset_dir, str(tmp))
    one = spawn_world(_resume_world, 1, tmp, dataset_dir, str(tmp))
    two = spawn_world(_resume_world, 2, tmp, dataset_dir, str(tmp))
    return {"tmp": tmp, "full": four[0], "full_packs": _merge_packs(four, "full"), "one": one[0],
            "one_packs": _merge_packs(one, "resumed"), "two": two[0], "two_packs": _merge_packs(two, "resumed")}


@pytest.mark.parametrize("layout", ["one", "two"], ids=["world1_cp1", "dp2_distributed_optimizer"])
def test_resume_on_another_layout_continues_the_run(resume_results, layout):
    full, got = resume_results["full"], resume_results[layout]
    assert resume_results["full"]["killed_steps"].tolist() == [1, 2, 3, 4]
    assert got["steps"].tolist() == [5, 6]
    assert full["full_losses"][4] != full["full_losses"][5]
    np.testing.assert_allclose(got["losses"], full["full_losses"][4:6], rtol=1e-5)
    packs = resume_results[f"{layout}_packs"]
    assert len(packs) == 2 and all(len(p) >= 4 for p in packs)
    assert packs == resume_results["full_packs"][4:6]


def test_load_weights_only_starts_a_new_run_from_the_weights(resume_results):
    one, full = resume_results["one"], resume_results["full"]
    names = [k for k in full if k.startswith("param.")]
    assert len(names) >= 10
    for name in names:
        np.testing.assert_array_equal(one[f"weights_{name}"], full[name])
    assert int(one["weights_step"]) == 0 and int(one["weights_schedule"]) == 0
    assert int(one["weights_loader"]) == 0 and float(one["weights_optim"]) == 0.0


def test_allow_changed_goes_on_with_the_new_lr(resume_results):
    from megatron_pack.training.optim import lr_at

    one = resume_results["one"]
    assert one["changed_steps"].tolist() == [5]
    expected = lr_at(5, lr=1e-3, min_lr=3e-4, warmup_iters=1, train_iters=6)
    np.testing.assert_allclose(one["changed_lr"], [expected], rtol=1e-12)


@pytest.mark.parametrize("change,fragment", [
    (["train.lr=1e-3"], "train.lr: 0.003 -> 0.001"),
    (["train.global_batch_size=8"], "train.global_batch_size: 4 -> 8"),
    (["train.lr_decay_style=linear", "train.train_iters=8"], "train.lr_decay_style: 'cosine' -> 'linear'"),
], ids=["lr", "global_batch", "schedule"])
def test_changed_settings_refused_before_launch(resume_results, dataset_dir, change, fragment):
    from megatron_pack.config import ConfigError
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.training.resume import check_resume

    tmp = resume_results["tmp"]
    args = [a for a in RESUME if a.split("=")[0] not in {c.split("=")[0] for c in change}]
    cfg = _config(dataset_dir, f"{tmp}/refused", 1, 1, 1, *args, *change, f"checkpoint.load={tmp}/killed/checkpoints")
    with pytest.raises(ConfigError) as info:
        check_resume(cfg, 1, open_dataset(cfg))
    message = info.value.problems[0]
    assert fragment in message and "set checkpoint.allow_changed=true" in message
    assert "\n" not in message
    allowed = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, allow_changed=True))
    assert check_resume(allowed, 1, open_dataset(cfg)) is not None  # allowed: no error (the run logs the changes)


# ----- 3. distributed optimizer on CPU ------------------------------------------------------


def _distributed_optimizer_world(rank: int, world: int, dataset_dir: str, tmp: str) -> dict:
    out = {}
    for flag in ("false", "true"):
        trainer = _run(dataset_dir, f"{tmp}/distopt_{flag}", 1, 1, 2, "train.train_iters=5", "checkpoint.enabled=false",
                       f"ddp.use_distributed_optimizer={flag}")
        out[f"{flag}_losses"] = np.array([m.lm_loss for m in trainer.history])
        out[f"{flag}_state"] = np.array(trainer.optimizer.num_state_elements)
        out.update({f"{flag}_{k}": v for k, v in _full_params(trainer).items()})
        out[f"{flag}_num_params"] = np.array(sum(p.numel() for p in trainer.optimizer.names if p.requires_grad))
    return out


def test_distributed_optimizer_matches_plain_with_half_the_state(dataset_dir, tmp_path):
    results = spawn_world(_distributed_optimizer_world, 2, tmp_path, dataset_dir, str(tmp_path))
    r0, r1 = results
    assert r0["false_losses"][0] != r0["false_losses"][-1]
    # gradients are reduce-scattered instead of all-reduced: the same sums in another order (float32 rounding)
    np.testing.assert_allclose(r0["true_losses"], r0["false_losses"], rtol=1e-6)
    names = [k[len("false_"):] for k in r0 if k.startswith("false_param.")]
    assert len(names) >= 10
    for name in names:
        np.testing.assert_allclose(r0[f"true_{name}"], r0[f"false_{name}"], rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(r1[f"true_{name}"], r0[f"true_{name}"])  # every rank: the same weights
    plain = int(r0["false_state"])
    assert plain == 2 * int(r0["false_num_params"])  # exp_avg + exp_avg_sq of every parameter
    for r in results:
        assert abs(int(r["true_state"]) / plain - 0.5) < 0.01


# ----- the run record, through the real entry (torchrun, CP=2) ------------------------------

def _train_cli(dataset_dir: str, out: Path, *extra: str) -> str:
    """``torchrun --nproc-per-node 2 -m megatron_pack.train ...`` on the session's world (tests/_train_world.py);
    its output (asserts exit 0 on both ranks)."""
    from _train_world import run_in_world

    argv = ["train", *DATA, f"data.dataset_dir={dataset_dir}", f"train.output_dir={out}", "logging.tensorboard=true",
            *extra]
    return run_in_world(out.parent, {"run": argv}, timeout=400)["run"]


def test_epochs_validation_and_run_record_through_the_entry(dataset_dir, tmp_path, monkeypatch, capsys):
    from megatron_pack.training.metrics import read_metrics

    out = tmp_path / "run"
    log = _train_cli(dataset_dir, out, "train.train_iters=null", "train.num_epochs=1", "train.global_batch_size=8",
                     "train.eval_interval=2", "train.eval_iters=1", "checkpoint.save_interval=0")
    from megatron_pack.data.batches.opening import open_dataset

    records = read_metrics(out / "metrics.jsonl")
    num_steps = len(records)
    num_packs = len(open_dataset(_config(dataset_dir, str(out), 1, 2, 2)))
    assert num_steps == num_packs // 8 >= 3  # one epoch of whole global batches
    assert records[-1]["epoch"] == pytest.approx(num_steps * 8 / num_packs) and records[0]["epoch"] > 0
    assert [r["step"] for r in records if r["val_loss"] is not None] == sorted(
        {s for s in range(2, num_steps + 1, 2)} | {num_steps})
    assert records[-1]["consumed_samples"] == sum(r["samples"] for r in records)
    assert records[-1]["consumed_target_tokens"] == sum(r["target_tokens"] for r in records)
    line = next(ln for ln in log.splitlines() if f"step 2/{num_steps} | loss" in ln)
    for fragment in ("val loss", "lr ", "tok/s", "padding", " ms", "ETA"):
        assert fragment in line, line
    best = min(r["val_loss"] for r in records if r["val_loss"] is not None)
    assert f"validation loss: best {best:.4f}" in log and "total: " in log and "target tokens" in log
    record = json.loads((out / "run.json").read_text())
    assert record["train_iters"] == num_steps and record["config"]["data"]["validation_fraction"] == 0.1
    assert record["versions"]["megatron-core"] and record["layout"]["context_parallel_size"] == 2
    assert (out / "config.yaml").is_file()
    assert list((out / "tensorboard" / "hparams").glob("events.out.tfevents.*"))

    # resuming with a changed lr: refused by the entry before any process group (in-process: torchrun
    # would add its own traceback of the failed child), one message naming the change and the fix
    from megatron_pack.cli.train import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    argv = [*DATA, f"data.dataset_dir={dataset_dir}", f"train.output_dir={out}", "train.train_iters=null",
            "train.num_epochs=1", "train.global_batch_size=8", "train.eval_interval=2", "train.eval_iters=1",
            "train.lr=1e-3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-pack train: 1 config problem(s):")
    assert "train.lr: 0.003 -> 0.001" in err and "set checkpoint.allow_changed=true" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2


def test_export_and_verify_read_a_tp2_cp2_checkpoint_as_the_tp1_model(resume_results):
    """``read_full_model`` (what ``export`` and ``verify.checkpoint`` read) gives the TP=1 tensors
    of a checkpoint written at TP2 x CP2: equal to the run's parameters gathered over TP."""
    from megatron_pack.training.checkpoint import read_full_model
    from megatron_pack.training.checkpoint_files import find_latest

    full = read_full_model(find_latest(resume_results["tmp"] / "killed" / "checkpoints"))
    names = [k[len("param."):] for k in resume_results["full"] if k.startswith("param.")]
    assert len(names) >= 10 and set(full) == {n.replace("__", ".") for n in names}
    for name in names:
        np.testing.assert_array_equal(full[name.replace("__", ".")].numpy(), resume_results["full"][f"param.{name}"])
