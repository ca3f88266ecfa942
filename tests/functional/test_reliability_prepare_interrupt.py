"""Ctrl-C in ``megatron-pack prepare``: one line, exit 130, nothing partial (issue 43, finding 4).

The console script runs in a session of its own; once its tokenize progress bar shows, SIGINT goes to its whole
process group, as a terminal's Ctrl-C does (the tokenize workers get it too). It printed two KeyboardInterrupt
tracebacks (about 50 lines, one from a forked report painter, since replaced by drawing report.png in-process) before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "megatron-pack"


@pytest.mark.parametrize("workers", ["1", "2"], ids=["in-process", "worker-processes"])
def test_ctrl_c_in_prepare_is_one_line_and_leaves_nothing(tmp_path, workers):
    dataset = tmp_path / "ds"
    proc = subprocess.Popen([str(SCRIPT), "prepare", "data=synthetic", "data.synthetic_num_samples=400000",
                             f"data.dataset_dir={dataset}", "packing.packed_sequence_size=512",
                             f"data.tokenize_workers={workers}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b"")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while b"records/s" not in b"".join(chunks) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the first progress update: tokenizing
    assert proc.poll() is None, b"".join(chunks).decode()  # guard: interrupted while it works, not after
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    reader.join(timeout=10)
    out = b"".join(chunks).decode()
    lines = [line for line in out.replace("\r", "\n").splitlines() if line.strip()]
    assert "records/s" in out and "dataset:" not in out  # guard: it was tokenizing, it did not finish
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    said = [line for line in lines if not line.startswith("tokenize:")]
    assert said == [f"megatron-pack prepare: interrupted (Ctrl-C); nothing was written to {dataset} (what it held "
                    "before is unchanged); run the same command to start again."], out
    assert not dataset.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".ds")]
