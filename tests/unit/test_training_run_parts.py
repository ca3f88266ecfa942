"""The pure parts of a complete run: the held-out split, epochs, eval sizes, changed settings,
the step line, the run record, the activation meter, the CPU distributed optimizer at DP=1."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_pack.config import Config, ConfigError
from megatron_pack.config.schema import TrainConfig
from megatron_pack.data.store.metadata import held_out_mask


@pytest.mark.parametrize("num,fraction,expected", [(10, 0.2, 2), (10, 0.0, 0), (240, 0.1, 24), (7, 0.5, 4), (3, 0.1, 0)],
                         ids=["10x0.2", "none", "240x0.1", "round-half", "too-few"])
def test_held_out_mask_size(num, fraction, expected):
    assert int(held_out_mask(num, fraction, seed=0).sum()) == expected


@settings(max_examples=50, deadline=None)
@given(num=st.integers(1, 2000), fraction=st.floats(0.01, 0.99), seed=st.integers(0, 2**31 - 1))
def test_held_out_mask_is_seeded_and_exact(num, fraction, seed):
    mask = held_out_mask(num, fraction, seed)
    assert mask.shape == (num,) and int(mask.sum()) == round(fraction * num)
    np.testing.assert_array_equal(mask, held_out_mask(num, fraction, seed))


def test_held_out_mask_depends_on_the_seed():
    masks = {held_out_mask(1000, 0.1, seed).tobytes() for seed in range(5)}
    assert len(masks) == 5


def _cfg(**train) -> Config:
    base = dict(train_iters=None, num_epochs=2, global_batch_size=8)
    base.update(train)
    return Config(train=TrainConfig(**base))


@pytest.mark.parametrize("train,num_packs,dp,expected", [
    (dict(train_iters=7, num_epochs=None), 103, 2, 7),
    (dict(), 103, 2, 25),           # 2 * (103 - 1) // 8
    (dict(), 104, 1, 26),
    (dict(num_epochs=1, global_batch_size=4), 10, 4, 2),  # 8 packs per epoch at dp 4
], ids=["iters", "epochs-dp2", "epochs-dp1", "epochs-drop-last"])
def test_resolve_train_iters(train, num_packs, dp, expected):
    from megatron_pack.training.resume import resolve_train_iters

    cfg = _cfg(**train)
    assert resolve_train_iters(cfg, _fixed_steps(cfg, num_packs, dp)) == expected


def _fixed_steps(cfg, num_packs, dp):
    """The step planner of a fixed global batch over ``num_packs`` packs (what ``build_loader`` plans)."""
    from megatron_pack.data.packing.order import EpochOrder
    from megatron_pack.data.batches.steps import StepPlanner, StepRule

    return StepPlanner(None, EpochOrder(num_packs, seed=0), StepRule(dp_size=dp, global_batch_size=cfg.train.global_batch_size))


def test_resolve_train_iters_refuses_less_than_one_step():
    from megatron_pack.training.resume import resolve_train_iters

    cfg = _cfg(num_epochs=1)
    with pytest.raises(ConfigError, match=r"train.num_epochs \(1\) over 6 packs per epoch is less than one global batch"):
        resolve_train_iters(cfg, _fixed_steps(cfg, 6, 1))


def test_changed_settings_lists_each_change():
    from megatron_pack.training.resume import changed_settings, run_settings

    before = run_settings(Config(), 50, "abc")
    after = run_settings(Config(train=TrainConfig(lr=1e-3, global_batch_size=16)), 50, "def")
    # train.min_lr follows train.lr (lr / 10) unless set, so it changes with it
    assert changed_settings(before, after) == ["train.lr: 0.003 -> 0.001",
                                               f"train.min_lr: {0.003 / 10} -> {0.001 / 10}",
                                               "train.global_batch_size: 8 -> 16", "data plan: 'abc' -> 'def'"]
    assert changed_settings(before, run_settings(Config(), 50, "abc")) == []
    assert changed_settings({}, after) == []  # an older checkpoint recorded nothing to compare


@pytest.mark.parametrize("seconds,text", [(4.3, "4s"), (65.2, "1m05s"), (3725.0, "1h02m05s")])
def test_format_duration(seconds, text):
    from megatron_pack.training.metrics import format_duration

    assert format_duration(seconds) == text


def test_step_line_carries_validation_and_eta_and_the_record_the_rest():
    from megatron_pack.training.metrics import StepMetrics

    m = StepMetrics(step=3, lm_loss=2.0, target_tokens=10, real_tokens=20, slots=32, samples=4, grad_norm=1.0,
                    lr=1e-3, step_time_s=0.5, epoch=1.25, consumed_samples=12, consumed_target_tokens=30,
                    elapsed_s=65.0, eta_s=4.0, val_loss=1.5)
    line = m.line(5)
    for fragment in ("step 3/5", "loss 2.000000", "val loss 1.500000", "lr 1.00e-03", "40 tok/s", "padding 37.5%",
                     "500 ms", "ETA 4s"):
        assert fragment in line
    record = m.record()
    assert record["val_loss"] == 1.5 and record["epoch"] == 1.25 and record["consumed_target_tokens"] == 30
    assert record["consumed_samples"] == 12 and record["elapsed_s"] == 65.0
    assert "val_source_loss" not in record and m.validation_scalars() == {"lm_loss": 1.5}


def test_validation_per_source_in_the_record_line_and_tensorboard_tags():
    from megatron_pack.training.eval import EvalResult
    from megatron_pack.training.metrics import StepMetrics

    m = StepMetrics(step=3, lm_loss=2.0, target_tokens=10, real_tokens=20, slots=32, samples=4, grad_norm=1.0,
                    lr=1e-3, step_time_s=0.5)
    m.add_validation(EvalResult(loss=2.5, target_tokens=4, num_packs=2, source_loss={"chat": 2.0, "code": None},
                                source_target_tokens={"chat": 4, "code": 0}))
    record = m.record()
    assert record["val_loss"] == 2.5 and record["val_source_loss"] == {"chat": 2.0, "code": None}
    assert record["val_source_target_tokens"] == {"chat": 4, "code": 0}
    assert record["val_source_target_share"] == {"chat": 1.0, "code": 0.0}
    assert m.validation_scalars() == {"lm_loss": 2.5, "source_chat/loss": 2.0, "source_chat/target_share": 1.0,
                                      "source_code/target_share": 0.0}
    assert "val loss 2.500000" in m.line(5) and "chat" not in m.line(5)  # per source: the record and TensorBoard


def test_num_eval_packs():
    from megatron_pack.training.eval import num_eval_packs

    assert [num_eval_packs(10, 0, 4), num_eval_packs(10, 2, 4), num_eval_packs(10, 3, 4)] == [10, 8, 10]


class _Model(torch.nn.Module):
    """Stands in for the model: ``evaluate`` only switches its mode."""


def _fake_forward(data_iterator, model):
    """``forward_step``'s contract without a model: the batch carries its per-token losses."""
    from functools import partial

    from megatron_pack.training.step import loss_func, loss_func_with_sources

    batch = next(data_iterator)
    if "token_source" in batch:
        return batch["losses"], partial(loss_func_with_sources, batch["loss_mask"], batch["token_source"],
                                        batch["num_sources"])
    return batch["losses"], partial(loss_func, batch["loss_mask"])


def _one_by_one(*, forward_step_func, data_iterator, model_chunks, num_microbatches, forward_only):
    """``evaluate``'s schedule without a model: each pack's forward, in order (the trainer's is megatron-core's)."""
    assert forward_only
    reports = []
    for _ in range(num_microbatches):
        output, loss_fn = forward_step_func(data_iterator, model_chunks[0])
        reports.append(loss_fn(output)[2])
    return reports


def _pack(losses, mask, sources=None, num_sources=0):
    batch = {"losses": torch.tensor([losses], dtype=torch.float32), "loss_mask": torch.tensor([mask], dtype=torch.float32)}
    if sources is not None:
        batch.update(token_source=torch.tensor([sources]), num_sources=num_sources)
    return batch


def test_evaluate_per_source_hand_computed():
    """The eval module's example: chat targets 1 and 3, code 2 and 4 (inf at a masked position, -1 on padding)."""
    from megatron_pack.training.eval import evaluate

    names = ["chat", "code", "math"]
    packs = [_pack([1.0, 3.0, 2.0, float("inf")], [1, 1, 1, 0], [0, 0, 1, 1], 3), _pack([4.0, 7.0], [1, 0], [1, -1], 3)]
    model = _Model().train()
    result = evaluate(model, packs, forward_step_func=_fake_forward, group=None, schedule=_one_by_one, num_packs=2, source_names=names)
    assert model.training  # the training mode is restored
    assert (result.loss, result.target_tokens, result.num_packs) == (2.5, 4, 2)
    assert result.source_loss == {"chat": 2.0, "code": 3.0, "math": None}  # math: nothing measured, not 0
    assert result.source_target_tokens == {"chat": 2, "code": 2, "math": 0}
    assert result.source_target_share == {"chat": 0.5, "code": 0.5, "math": 0.0}
    plain = evaluate(model, [_pack([1.0, 3.0], [1, 1])], forward_step_func=_fake_forward, group=None, schedule=_one_by_one)
    assert (plain.loss, plain.source_loss, plain.source_target_tokens) == (2.0, {}, {})
    with pytest.raises(ValueError, match="has no token_source"):
        evaluate(model, [_pack([1.0], [1])], forward_step_func=_fake_forward, group=None, schedule=_one_by_one, source_names=names)


@pytest.mark.parametrize("progress", [True, False], ids=["rank-0-bar", "other-ranks-quiet"])
def test_evaluate_shows_a_bar_counting_its_forwards(progress, capsys):
    """The end-of-run validation is not silent: the rank that shows progress draws a bar over the schedule's
    forwards (3 packs: 3/3), the others print nothing."""
    from megatron_pack.training.eval import evaluate

    packs = [_pack([1.0, 2.0], [1, 1]) for _ in range(3)]
    result = evaluate(_Model(), packs, forward_step_func=_fake_forward, group=None, schedule=_one_by_one,
                      progress=progress)
    err = capsys.readouterr().err
    assert result.target_tokens == 6
    assert ("validation: 100%" in err and "3/3" in err) if progress else err == ""


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(0.0, 20.0), st.booleans(), st.integers(-1, 2)), min_size=1, max_size=12),
                min_size=1, max_size=5))
def test_evaluate_per_source_equals_a_float64_reference(packs):
    from megatron_pack.training.eval import evaluate

    names = ["a", "b", "c"]
    batches = [_pack([t[0] for t in p], [int(t[1]) for t in p], [t[2] for t in p], 3) for p in packs]
    result = evaluate(_Model(), batches, forward_step_func=_fake_forward, group=None, schedule=_one_by_one, source_names=names)
    tokens = [t for p in packs for t in p if t[1] and t[2] >= 0]  # padding (-1) counts in the total only
    total = [t for p in packs for t in p if t[1]]
    assume(tokens)  # guard: some source holds a target
    for s, name in enumerate(names):
        mine = [np.float64(np.float32(t[0])) for t in tokens if t[2] == s]
        assert result.source_target_tokens[name] == len(mine)
        if mine:
            assert result.source_loss[name] == pytest.approx(sum(mine) / len(mine), rel=1e-6, abs=1e-6)
        else:
            assert result.source_loss[name] is None
    assert result.target_tokens == len(total)
    if len(tokens) == len(total) and total:  # no masked-in padding: the sources weighted by their counts are the total
        weighted = sum(result.source_loss[n] * result.source_target_tokens[n] for n in names if result.source_loss[n])
        assert weighted / len(total) == pytest.approx(result.loss, rel=1e-6, abs=1e-6)


def test_validation_loader_deals_every_pack_once():
    from megatron_pack.training.eval import ValidationLoader

    shares = [ValidationLoader(list(range(7)), lambda p: p, num_packs=7, dp_rank=r, dp_size=3) for r in range(3)]
    assert [list(s) for s in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(sum((list(s) for s in shares), [])) == list(range(7))


def test_run_record(tmp_path):
    from megatron_pack.training.record import write_run_record

    cfg = Config(train=TrainConfig(output_dir=str(tmp_path)))
    state = SimpleNamespace(world_size=2, tp_size=1, cp_size=2, dp_size=1)
    path = write_run_record(cfg, state, 50)
    record = json.loads(path.read_text())
    assert record["train_iters"] == 50 and record["layout"]["context_parallel_size"] == 2
    assert record["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert record["versions"]["megatron-core"] and record["config"]["train"]["lr"] == cfg.train.lr
    assert record["git"] is None or len(record["git"]["commit"]) == 40
    assert "train:" in (tmp_path / "config.yaml").read_text()
    write_run_record(cfg, state, 50)  # a resumed process keeps the earlier record
    assert len(list(tmp_path.glob("run.*.json"))) == 1


def test_saved_activation_meter_hand_computed():
    from megatron_pack.training.memory import SavedActivationMeter

    x = torch.randn(1000, requires_grad=True)
    meter = SavedActivationMeter()
    with meter:
        y = torch.sin(x)           # saves x: 4000 bytes
        z = torch.cos(y)           # saves y: 4000 more
        z.sum().backward()
    assert meter.peak_bytes == 8000 and meter.bytes == 0
    excluded = SavedActivationMeter(exclude=[x])
    with excluded:
        torch.cos(torch.sin(x)).sum().backward()
    assert excluded.peak_bytes == 4000


# (id, the checkpoint's (tp, cp, dp), this run's (dp, dp_rank), rank file expected or None: meta.json's state)
RANK_LOADER_CASES = [
    ("tp2-to-tp1-same-dp", (2, 1, 2), (2, 1), 2),    # old ranks: tp + 2 * dp -> dp rank 1 at tp 0 is rank 2
    ("cp2tp2-to-cp1-same-dp", (2, 2, 2), (2, 1), 4),
    ("dp-rank-0", (2, 2, 2), (2, 0), 0),
    ("other-dp", (1, 1, 2), (1, 0), None),
]


@pytest.mark.parametrize("saved,run,rank_file", [c[1:] for c in RANK_LOADER_CASES],
                         ids=[c[0] for c in RANK_LOADER_CASES])
def test_another_tp_cp_layout_resumes_each_dp_ranks_own_loader_state(tmp_path, saved, run, rank_file):
    """Online loaders differ per DP rank: at another TP/CP layout with the same DP size a rank reads the
    loader state of the old rank with its DP rank (TP and CP rank 0), not rank 0's copy in meta.json."""
    from megatron_pack.training.trainer_checkpoint import rank_loader_state

    tp, cp, dp = saved
    for rank in range(tp * cp * dp):
        torch.save({"loader": {"written_by": rank}}, tmp_path / f"rank_{rank:05d}.pt")
    meta = {"tensor_model_parallel_size": tp, "context_parallel_size": cp, "data_parallel_size": dp}
    got = rank_loader_state(SimpleNamespace(dp_size=run[0], dp_rank=run[1]), tmp_path, meta, None)
    assert got == (None if rank_file is None else {"written_by": rank_file})


class _CountingTrainer:
    """``Trainer.train_step`` over fixed counts (``compute_gradients`` replaced): the window is the trainer's."""

    @staticmethod
    def build(cfg):
        from megatron_pack.training import loop
        from megatron_pack.training.metrics import StepCounts
        from megatron_pack.training.optim import LRSchedule
        from megatron_pack.training.schedule import PackInfo

        class Trainer(loop.Trainer):
            def compute_gradients(self):
                packs = [PackInfo(sample_ids=[self.step, self.step + 100], real_tokens=10, slots=16)]
                return StepCounts(loss_sum=20.0, target_tokens=8.0, real_tokens=8, slots=16, samples=2,
                                  sum_sq_seqlens=34.0), packs

        optimizer = SimpleNamespace(step=lambda lr: 1.0)
        loader = SimpleNamespace(epoch=0.0)
        return Trainer(cfg=cfg, state=SimpleNamespace(dp_size=1, world_size=2), model_chunks=[], optimizer=optimizer,
                       schedule=LRSchedule(cfg, 12), loader=loader, forward_step_func=None, train_iters=12,
                       peak_tflops=1e-3)


def test_history_and_pack_log_keep_a_window_and_metrics_jsonl_every_step(tmp_path, monkeypatch):
    from megatron_pack.training import loop
    from megatron_pack.training.metrics import MetricsWriter, read_metrics

    monkeypatch.setattr(loop, "HISTORY_WINDOW", 4)
    trainer = _CountingTrainer.build(Config(train=TrainConfig(train_iters=12, output_dir=str(tmp_path))))
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False, train_iters=12)
    for _ in range(12):
        writer.write(trainer.train_step())
    writer.close()
    assert [m.step for m in trainer.history] == [9, 10, 11, 12]  # the newest 4 steps, in order
    assert [ids for (ids,) in trainer.pack_log] == [[8, 108], [9, 109], [10, 110], [11, 111]]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 13))  # the rest: on disk
    assert loop.Trainer.__dataclass_fields__["history"].default_factory().maxlen == 4


def test_the_step_reports_model_flops_per_device_and_mfu(tmp_path):
    """The tiny model's step of sub-sequences 3 and 5 is 5,629,440 model FLOPs (tests/unit/test_flops.py), over
    2 devices and the step's time: in the step line and metrics.jsonl (whose keys TensorBoard's train/ tags take)."""
    from megatron_pack.training.metrics import MetricsWriter, read_metrics

    trainer = _CountingTrainer.build(Config(train=TrainConfig(train_iters=12, output_dir=str(tmp_path))))
    m = trainer.train_step()
    assert m.model_tflops_per_device == pytest.approx(5629440 / 2 / m.step_time_s / 1e12)
    assert m.mfu == pytest.approx(m.model_tflops_per_device / 1e-3)
    assert f"{m.model_tflops_per_device:.3g} TFLOP/s/dev (MFU {100 * m.mfu:.1f}%)" in m.line(12)
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False, train_iters=12)
    writer.write(m)
    writer.close()
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert record["model_tflops_per_device"] == m.model_tflops_per_device and record["mfu"] == m.mfu


def test_a_run_collects_then_freezes_what_lives_before_its_layout():
    """``megatron-pack train`` collects an earlier run's garbage (a cycle, as a trainer leaves one), then leaves the
    live objects out of later collections, so the collection at the end scans only what the run made."""
    import gc
    import weakref

    from megatron_pack.cli.train import _freeze_garbage_collection

    class Node:
        pass

    garbage, kept = Node(), Node()
    garbage.me = garbage  # garbage of an earlier run: a reference cycle
    gone = weakref.ref(garbage)
    del garbage
    gc.unfreeze()
    try:
        _freeze_garbage_collection()
        assert gone() is None  # freed, not frozen
        assert gc.get_freeze_count() > 1000 and any(o is kept for o in gc.get_objects(generation=2)) is False
    finally:
        gc.unfreeze()
