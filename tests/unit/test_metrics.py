"""Token-weighted step metrics, the log line, metrics.jsonl and TensorBoard files."""

import json
import sys
import time
from pathlib import Path

import pytest

from megatron_pack.training.metrics import MetricsWriter, StepCounts, StepMetrics, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_docstring_example_token_weighted():
    counts = StepCounts()
    counts.add_pack(loss_sum=3.0, target_tokens=5, real_tokens=7, slots=8, samples=2, owns_pack=True)
    counts.add_pack(loss_sum=6.0, target_tokens=4, real_tokens=5, slots=8, samples=1, owns_pack=True)
    total = counts.reduce(None)
    assert total.lm_loss() == pytest.approx(1.0)  # mean of means would be (0.6 + 1.5) / 2 = 1.05
    m = StepMetrics(step=1, lm_loss=total.lm_loss(), target_tokens=9, real_tokens=total.real_tokens,
                    slots=total.slots, samples=total.samples, grad_norm=0.5, lr=1e-3, step_time_s=0.5)
    assert (m.real_tokens, m.slots, m.samples) == (12, 16, 3)
    assert m.padding_share == pytest.approx(0.25)
    assert m.target_tokens_per_s == pytest.approx(18.0) and m.real_tokens_per_s == pytest.approx(24.0)


def test_non_owner_adds_loss_but_not_pack_counts():
    counts = StepCounts()
    counts.add_pack(loss_sum=1.0, target_tokens=2, real_tokens=7, slots=8, samples=2, owns_pack=False)
    assert (counts.loss_sum, counts.target_tokens, counts.real_tokens, counts.slots, counts.samples) == (1.0, 2, 0, 0, 0)


def test_all_masked_gives_zero_not_nan():
    assert StepCounts().lm_loss() == 0.0


def test_writer_files_and_line(tmp_path, caplog):
    caplog.set_level("INFO", logger="megatron_pack.train")
    w = MetricsWriter(tmp_path, enabled=True, log_interval=2, tensorboard=True, train_iters=3)
    for step, loss in ((1, 2.0), (2, 1.5), (3, 1.0), (2, 1.25)):
        w.write(StepMetrics(step=step, lm_loss=loss, target_tokens=10, real_tokens=20, slots=32, samples=4,
                            grad_norm=1.0, lr=1e-3, step_time_s=0.1))
    w.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records[1]["lm_loss"] == 1.25
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    lines = [r.message for r in caplog.records]
    assert len(lines) == 3 and lines[0].startswith("step 2/3 | loss 1.500000")
    assert "padding 37.5%" in lines[0] and "200 tok/s" in lines[0] and records[1]["target_tokens_per_s"] == 100


def test_disabled_writer_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "x", enabled=False)
    w.write(StepMetrics(step=1, lm_loss=1.0, target_tokens=1, real_tokens=1, slots=1, samples=1, grad_norm=0.0,
                        lr=0.1, step_time_s=0.1))
    assert not (tmp_path / "x").exists()


def _metrics(step: int, loss: float) -> StepMetrics:
    return StepMetrics(step=step, lm_loss=loss, target_tokens=10, real_tokens=20, slots=32, samples=4,
                       grad_norm=1.0, lr=1e-3, step_time_s=0.1)


@pytest.mark.parametrize("tail", [b'{"step": 3, "lm_lo', b"{", b""], ids=["torn-record", "torn-brace", "clean"])
def test_resumed_writer_cuts_a_torn_last_record(tmp_path, tail):
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    w.write(_metrics(1, 2.0))
    w.write(_metrics(2, 1.5))
    path = tmp_path / "metrics.jsonl"
    with path.open("ab") as f:  # a kill -9 in the middle of writing step 3's line
        f.write(tail)
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=False)  # the restarted run
    w.write(_metrics(3, 1.0))  # step 3 replayed from the checkpoint
    records = read_metrics(path)
    assert [(r["step"], r["lm_loss"]) for r in records] == [(1, 2.0), (2, 1.5), (3, 1.0)]
    assert path.read_bytes().count(b"\n") == 3


def test_moe_numbers_in_the_step_line_and_tensorboard_tags():
    from megatron_pack.training.metrics import StepMetrics

    moe = {"load_balancing_loss": 1.25, "z_loss": 0.5, "tokens_per_expert": [[3, 1], [2, 2]],
           "max_over_mean_load": [1.5, 1.0]}
    m = StepMetrics(step=1, lm_loss=2.0, target_tokens=4, real_tokens=4, slots=4, samples=1, grad_norm=1.0, lr=1e-3,
                    step_time_s=1.0, moe=moe)
    assert "| lb 1.2500 load max/mean 1.50 |" in m.line(10)
    tags = m.breakdown_scalars()
    assert tags["moe/load_balancing_loss"] == 1.25 and tags["moe/z_loss"] == 0.5
    assert tags["moe/layer_0/max_over_mean_load"] == 1.5 and tags["moe/layer_1/expert_1_tokens"] == 2.0
    assert m.record()["moe"] == moe
    dense = StepMetrics(step=1, lm_loss=2.0, target_tokens=4, real_tokens=4, slots=4, samples=1, grad_norm=1.0,
                        lr=1e-3, step_time_s=1.0)
    assert "moe" not in dense.record() and " lb " not in dense.line(10)


# (steps the killed run logged, step its checkpoint holds) -> steps left in metrics.jsonl, steps moved aside
RESUMES = {
    "killed-after-step-7-resumed-at-5": ([1, 2, 3, 4, 5, 6, 7], 5, [1, 2, 3, 4, 5], [6, 7]),
    "stopped-at-its-checkpoint": ([1, 2, 3, 4], 4, [1, 2, 3, 4], []),
    "no-checkpoint-fresh-start": ([1, 2], 0, [], [1, 2]),
}


@pytest.mark.parametrize("logged,resume_step,kept,moved", RESUMES.values(), ids=list(RESUMES))
def test_resumed_writer_holds_each_step_once(tmp_path, logged, resume_step, kept, moved):
    first = MetricsWriter(tmp_path, enabled=True, tensorboard=False, resume_step=0)
    for step in logged:
        first.write(_metrics(step, 10.0 + step))
    first.close()  # the kill: no cleanup of its own
    resumed = MetricsWriter(tmp_path, enabled=True, tensorboard=False, resume_step=resume_step)
    for step in range(resume_step + 1, max(logged) + 2):  # replayed from the checkpoint, then one step further
        resumed.write(_metrics(step, 1.0 + step))
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines]
    assert steps == list(range(1, max(logged) + 2))  # each step once, in order: the raw file, not read_metrics
    assert [r["lm_loss"] for r in lines] == [10.0 + s if s in kept else 1.0 + s for s in steps]
    aside = tmp_path / "metrics.replaced.jsonl"
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == moved if moved else not aside.exists()


def test_tensorboard_purges_the_steps_after_the_resume_point(tmp_path):
    from _trackers import tensorboard_scalars, tensorboard_steps

    first = MetricsWriter(tmp_path, enabled=True, resume_step=0)
    for step in (1, 2, 3, 4):
        first.write(_metrics(step, 10.0 + step))
    first.close()
    time.sleep(1.1)  # event files are named by the second they were opened in
    resumed = MetricsWriter(tmp_path, enabled=True, resume_step=2)
    for step in (3, 4, 5):
        resumed.write(_metrics(step, 1.0 + step))
    resumed.close()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the old events are still there
    assert tensorboard_steps(tmp_path / "tensorboard") == [1, 2, 3, 4, 5]  # ... but the plot never goes back
    losses = {step: tags["train/lm_loss"] for step, tags in tensorboard_scalars(tmp_path / "tensorboard").items()}
    assert losses == pytest.approx({1: 11.0, 2: 12.0, 3: 4.0, 4: 5.0, 5: 6.0})


def test_record_has_mfu_null_without_a_device_peak(tmp_path):
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    metrics = _metrics(1, 2.0)
    metrics.model_tflops_per_device = 0.02  # a CPU run: throughput known, no peak to divide by
    w.write(metrics)
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["model_tflops_per_device"] == 0.02 and "mfu" in record and record["mfu"] is None
    assert "bucket_real_tokens" not in record  # a breakdown the run does not have stays out


class _Recorder:
    def __init__(self):
        self.logged, self.closed = [], False

    def log(self, scalars, step):
        self.logged.append((step, dict(scalars)))

    def close(self):
        self.closed = True


def test_trackers_get_the_tensorboard_scalars(tmp_path):
    from _trackers import tensorboard_scalars

    tracker = _Recorder()
    w = MetricsWriter(tmp_path, enabled=True, resume_step=0, trackers=[tracker])
    for step in (1, 2):
        metrics = _metrics(step, 2.0 / step)
        metrics.val_loss = 3.0 if step == 2 else None
        w.write(metrics)
    w.close()
    assert tracker.closed and [step for step, _ in tracker.logged] == [1, 2]
    tensorboard = tensorboard_scalars(tmp_path / "tensorboard")
    assert len(tracker.logged[1][1]) > 10 and "validation/lm_loss" in tracker.logged[1][1]
    for step, scalars in tracker.logged:
        assert scalars == pytest.approx(tensorboard[step])
