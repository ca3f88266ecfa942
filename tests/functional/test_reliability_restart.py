"""A rank killed mid-training under ``torchrun --max-restarts 1`` resumes from the last checkpoint,
and the logged sample ids show that no pack was skipped or repeated.

The real entry (``megatron_pack.cli.train.main``) runs under torchrun with 2 ranks (DP=2, tiny
model, 240 synthetic samples in 512-token packs, 6 steps of 2 packs per rank, a checkpoint every
2 steps, ``logging.log_sample_ids=true``). A wrapper script (test instrumentation only) sends
SIGKILL to rank 1 as it starts step 4 of the first attempt, so step 3 finished but was never
checkpointed. torchrun tears the job down and restarts it; the new attempt resumes from step 2.

Checked from the logs: the second attempt starts at step 3; the steps that count (1-2 from the
first attempt, 3-6 from the second) consumed, rank by rank, exactly the packs an uninterrupted
``PackSampler`` deals, each pack once; the lost step 3 was replayed with the same packs and the
same loss, bit for bit. (A graceful stop and resume is tests/functional/test_train_resume_quickstart.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NUM_STEPS, KILL_AT_STEP, SAVE_INTERVAL, DP_SIZE, PACKS_PER_RANK = 6, 4, 2, 2, 2
WRAPPER = textwrap.dedent("""
    import logging, os, signal, sys
    from megatron_pack.cli import train
    from megatron_pack.training import loop

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_at = int(os.environ["RELIABILITY_KILL_AT_STEP"])
    real_step = loop.Trainer.train_step

    def train_step(self):
        if attempt == 0 and self.state.rank == 1 and self.step + 1 == kill_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no cleanup, no checkpoint
        return real_step(self)

    class Attempt(logging.Filter):
        def filter(self, record):
            record.msg = f"attempt {attempt} " + str(record.msg)
            return True

    loop.Trainer.train_step = train_step
    loop.sample_log.addFilter(Attempt())
    loop.log.addFilter(Attempt())
    sys.exit(train.main(sys.argv[1:]))
""")
SAMPLE_LINE = re.compile(r"attempt (\d+) step (\d+) rank (\d+) dp_rank (\d+) packs (\[.*\])")


def _overrides(dataset_dir: Path, out: Path) -> list[str]:
    return ["experiment=quickstart", "parallel=cp1", "data.synthetic_num_samples=240", f"data.dataset_dir={dataset_dir}",
            f"train.output_dir={out}", f"train.train_iters={NUM_STEPS}",
            f"train.global_batch_size={DP_SIZE * PACKS_PER_RANK}", f"checkpoint.save_interval={SAVE_INTERVAL}",
            "logging.log_sample_ids=true", "logging.tensorboard=false"]


def _expected_packs(dataset_dir: Path, out: Path) -> dict[tuple[int, int], list[list[int]]]:
    """(step, dp_rank) -> sample ids of each pack, as an uninterrupted PackSampler deals them."""
    from megatron_pack.config import load_config
    from megatron_pack.data.dataset import PackedSFTDataset
    from megatron_pack.data.sampler import PackSampler

    cfg = load_config(_overrides(dataset_dir, out), world_size=DP_SIZE)
    dataset = PackedSFTDataset.from_config(cfg)
    assert len(dataset) >= NUM_STEPS * DP_SIZE * PACKS_PER_RANK  # one epoch covers the run: no pack may repeat
    expected = {}
    for dp_rank in range(DP_SIZE):
        order = iter(PackSampler(len(dataset), dp_rank=dp_rank, dp_size=DP_SIZE, seed=cfg.train.seed))
        for step in range(1, NUM_STEPS + 1):
            expected[step, dp_rank] = [dataset.sample_ids(next(order)).tolist() for _ in range(PACKS_PER_RANK)]
    return expected


def _logged(log: str) -> dict[tuple[int, int, int], list[list[int]]]:
    """(attempt, step, dp_rank) -> logged packs."""
    out = {}
    for attempt, step, _, dp_rank, packs in SAMPLE_LINE.findall(log):
        key = (int(attempt), int(step), int(dp_rank))
        assert key not in out, f"step logged twice in one attempt: {key}"
        out[key] = json.loads(packs)
    return out


def _losses(metrics: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["lm_loss"]) for r in map(json.loads, metrics.read_text().splitlines()) if r.get("step")]


@pytest.mark.slow
def test_rank_killed_mid_training_resumes_without_skipping_or_repeating(tmp_path):
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    dataset_dir, out = tmp_path / "data", tmp_path / "run"
    prepare(load_config(_overrides(dataset_dir, out)), progress=False)
    wrapper = tmp_path / "train_with_kill.py"
    wrapper.write_text(WRAPPER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "RELIABILITY_KILL_AT_STEP": str(KILL_AT_STEP)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(DP_SIZE),
           "--max-restarts", "1", "--monitor-interval", "0.5", str(wrapper), *_overrides(dataset_dir, out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "attempt 1 resumed from" in log and f"at step {SAVE_INTERVAL}" in log, log[-4000:]

    logged = _logged(log)
    first = {k[1:]: v for k, v in logged.items() if k[0] == 0}
    second = {k[1:]: v for k, v in logged.items() if k[0] == 1}
    assert {s for s, _ in first} == set(range(1, KILL_AT_STEP))  # the first attempt reached step 3, then died
    assert {s for s, _ in second} == set(range(SAVE_INTERVAL + 1, NUM_STEPS + 1))  # resumed after step 2
    counted = {k: v for k, v in first.items() if k[0] <= SAVE_INTERVAL} | second
    expected = _expected_packs(dataset_dir, out)
    assert counted == expected  # rank by rank, step by step, the uninterrupted order
    packs = [tuple(map(tuple, v)) for v in counted.values()]
    flat = [pack for step_packs in packs for pack in step_packs]
    assert len(flat) == NUM_STEPS * DP_SIZE * PACKS_PER_RANK == len(set(flat))  # each pack exactly once
    for dp_rank in range(DP_SIZE):  # the step lost with the kill was replayed with the same packs
        assert first[KILL_AT_STEP - 1, dp_rank] == second[KILL_AT_STEP - 1, dp_rank]

    losses = _losses(out / "metrics.jsonl")
    by_attempt = {}
    for step, loss in losses:
        by_attempt.setdefault(step, []).append(loss)
    assert sorted(by_attempt) == list(range(1, NUM_STEPS + 1))
    replayed = by_attempt[KILL_AT_STEP - 1]
    assert len(replayed) == 2 and replayed[0] == replayed[1]  # the lost step replays bit for bit
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{NUM_STEPS:08d}"
