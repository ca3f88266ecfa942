"""A rank killed mid-training under ``torchrun --max-restarts 1`` resumes from the last checkpoint,
and the logged sample ids show that no pack was skipped or repeated.

The real entry (``megatron_pack.cli.train.main``) runs under torchrun with 2 ranks (DP=2, tiny
model, 240 synthetic samples in 512-token packs, 6 steps of 2 packs per rank, a checkpoint every
2 steps, ``logging.log_sample_ids=true``). A wrapper script (test instrumentation only) sends
SIGKILL to rank 1 in the first attempt, either as it starts step 4 (step 3 finished but was never
checkpointed) or in the middle of the step-4 checkpoint save (its DCP shards written, its state
file not; rank 0 waits at the save's barrier). torchrun tears the job down and restarts it; the
new attempt resumes from step 2, the last complete checkpoint.

Checked from the logs: the second attempt starts at step 3; the steps that count (1-2 from the
first attempt, 3-6 from the second) consumed, rank by rank, exactly the packs an uninterrupted
``PackSampler`` deals, each pack once; the lost steps were replayed with the same packs and the
same losses, bit for bit; the killed save left no folder behind; ``metrics.jsonl`` and TensorBoard hold each step
once (the lost steps' first records moved to ``metrics.replaced.jsonl``). (A graceful stop and resume is
tests/functional/test_train_resume_quickstart.py.)
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _trackers import tensorboard_steps  # noqa: E402

NUM_STEPS, KILL_AT_STEP, SAVE_INTERVAL, DP_SIZE, PACKS_PER_RANK = 6, 4, 2, 2, 2
WRAPPER = textwrap.dedent("""
    import logging, os, signal, sys, time
    import torch
    from megatron_pack.cli import train
    from megatron_pack.training import loop

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_at, mode = int(os.environ["RELIABILITY_KILL_AT_STEP"]), os.environ["RELIABILITY_KILL_MODE"]
    real_step, real_save, real_torch_save = loop.Trainer.train_step, loop.Trainer.save, torch.save

    def die(*args, **kwargs):
        sys.stdout.flush()
        time.sleep(2)  # let rank 0 finish logging the step both ranks completed, however loaded the machine
        print(f"test instrumentation: kill -9 rank {os.environ['RANK']} ({mode})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no cleanup, no checkpoint

    def train_step(self):
        if mode == "step-start" and attempt == 0 and self.state.rank == 1 and self.step + 1 == kill_at:
            die()
        return real_step(self)

    def save(self, root):
        if mode == "mid-save" and attempt == 0 and self.state.rank == 1 and self.step == kill_at:
            torch.save = die  # DCP shards written, this rank's state file not: rank 0 waits at the barrier
        try:
            return real_save(self, root)
        finally:
            torch.save = real_torch_save

    class Attempt(logging.Filter):
        def filter(self, record):
            record.msg = f"attempt {attempt} " + str(record.msg)
            return True

    loop.Trainer.train_step, loop.Trainer.save = train_step, save
    loop.sample_log.addFilter(Attempt())
    loop.log.addFilter(Attempt())
    sys.exit(train.main(sys.argv[1:]))
""")
# mode -> last step the first attempt logged (its packs were consumed, then lost with the kill)
KILL_MODES = {"step-start": KILL_AT_STEP - 1, "mid-save": KILL_AT_STEP}
SAMPLE_LINE = re.compile(r"attempt (\d+) step (\d+) rank (\d+) dp_rank (\d+) packs (\[.*\])")


def _overrides(dataset_dir: Path, out: Path) -> list[str]:
    return ["experiment=quickstart", "parallel=cp1", "data.synthetic_num_samples=240", f"data.dataset_dir={dataset_dir}",
            f"train.output_dir={out}", f"train.train_iters={NUM_STEPS}",
            f"train.global_batch_size={DP_SIZE * PACKS_PER_RANK}", f"checkpoint.save_interval={SAVE_INTERVAL}",
            "logging.log_sample_ids=true"]


def _expected_packs(dataset_dir: Path, out: Path) -> dict[tuple[int, int], list[list[int]]]:
    """(step, dp_rank) -> sample ids of each pack, as an uninterrupted PackSampler deals them."""
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.batches.sampler import PackSampler

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
@pytest.mark.parametrize("mode", list(KILL_MODES), ids=list(KILL_MODES))
def test_rank_killed_mid_training_resumes_without_skipping_or_repeating(tmp_path, mode):
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    dataset_dir, out = tmp_path / "data", tmp_path / "run"
    prepare(load_config(_overrides(dataset_dir, out)), progress=False)
    wrapper = tmp_path / "train_with_kill.py"
    wrapper.write_text(WRAPPER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "RELIABILITY_KILL_AT_STEP": str(KILL_AT_STEP), "RELIABILITY_KILL_MODE": mode}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(DP_SIZE),
           "--max-restarts", "1", "--monitor-interval", "0.5", str(wrapper), *_overrides(dataset_dir, out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert log.count(f"test instrumentation: kill -9 rank 1 ({mode})") == 1, log[-4000:]
    # torchrun saw the failure, then restarted. It names the earliest failure of one poll, by whole seconds: rank 1's
    # SIGKILL, or rank 0 failing on the lost peer when both ended within the same poll (then the first by rank)
    killed = "failed (exitcode: -9) local_rank: 1" in log
    lost_peer = "failed (exitcode: 1) local_rank: 0" in log and "Connection closed by peer" in log
    assert killed or lost_peer, log[-4000:]
    assert "attempt 1 resumed from" in log and f"at step {SAVE_INTERVAL}" in log, log[-4000:]

    logged = _logged(log)
    first = {k[1:]: v for k, v in logged.items() if k[0] == 0}
    second = {k[1:]: v for k, v in logged.items() if k[0] == 1}
    last_logged = KILL_MODES[mode]
    assert {s for s, _ in first} == set(range(1, last_logged + 1))  # the first attempt got this far, then died
    assert {s for s, _ in second} == set(range(SAVE_INTERVAL + 1, NUM_STEPS + 1))  # resumed after step 2
    counted = {k: v for k, v in first.items() if k[0] <= SAVE_INTERVAL} | second
    assert counted == _expected_packs(dataset_dir, out)  # rank by rank, step by step, the uninterrupted order
    flat = [tuple(pack) for step_packs in counted.values() for pack in step_packs]
    assert len(flat) == NUM_STEPS * DP_SIZE * PACKS_PER_RANK == len(set(flat))  # each pack exactly once
    for step in range(SAVE_INTERVAL + 1, last_logged + 1):  # steps lost with the kill replay the same packs
        for dp_rank in range(DP_SIZE):
            assert first[step, dp_rank] == second[step, dp_rank]

    # metrics.jsonl holds each step once, in order (issue 43 item 7); the killed attempt's records of the steps
    # after the checkpoint moved to metrics.replaced.jsonl, and their replay gave the same loss, bit for bit
    losses = _losses(out / "metrics.jsonl")
    assert [step for step, _ in losses] == list(range(1, NUM_STEPS + 1))
    replaced = _losses(out / "metrics.replaced.jsonl")
    assert [step for step, _ in replaced] == list(range(SAVE_INTERVAL + 1, last_logged + 1))
    assert all(loss == losses[step - 1][1] for step, loss in replaced)
    # TensorBoard: two event files (one per attempt), and its plot holds each step once, never going back in time
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert tensorboard_steps(out / "tensorboard") == list(range(1, NUM_STEPS + 1))
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step_{NUM_STEPS:08d}"
    assert not list(checkpoints.glob("tmp.step_*"))  # the killed save's folder was cleaned up
