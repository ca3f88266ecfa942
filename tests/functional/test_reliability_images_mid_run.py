"""An image replaced after prepare by one of the same size stops the run through the stop-signal path (issue 43, 2).

The check before launch reads each image's header (tests/unit/test_reliability_images.py); a file of the same pixel
size passes it, and its sha256 differs only when the loader reads it. Then the loader does not raise: the sample's
loss is masked, a black stand-in keeps the pack's shapes, and after the step every rank agrees to stop (the
all-reduce SIGTERM uses), saves a checkpoint and exits 2 with one line naming the record, the image and the fix.
Before: 2 steps trained, then a 162-line DataError traceback, exit 1, no checkpoint.
"""

from __future__ import annotations

import re

import pytest

from _train_world import run_in_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_an_image_changed_mid_run_stops_with_a_checkpoint_and_one_line(tmp_path):
    from _hf import prepare_in
    from _vlm_data import VLM_CHAT_RUN as RUN, make_image, vlm_chat_folder

    root = vlm_chat_folder(tmp_path)
    prepare_in(root, RUN)
    for i in range(0, 12, 2):  # the same size (the check before launch passes), other pixels: every image changed
        make_image(root / f"img{i}.png", 56, 28, seed=100 + i)
    out = run_in_world(root, {"changed": ["train", *RUN, "train.output_dir=runs/changed"]}, expect=2)["changed"]
    assert "run runs/changed: 3 steps" in out, out[-3000:]  # guard: the check before launch let it start
    lines = [line for line in out.splitlines() if line.startswith("megatron-pack train: ")]
    assert len(lines) == 1, out[-3000:]  # said once (one DP rank of CP=2 read it)
    said = re.fullmatch(r"megatron-pack train: sample (\d+) \(chat\.jsonl: line (\d+)\): image 0 \((\S+)\) changed "
                        r"since prepare \(its sha256 differs\); restore it or re-run `megatron-pack prepare` with "
                        r"data\.overwrite=true; stopped after step 1 of 3: saved checkpoint (\S+) \(this sample's loss "
                        r"left out of step 1\); once the image is back, run the same command to resume from it\.",
                        lines[0])
    assert said, lines[0]
    sample, line, image, checkpoint = said.groups()
    assert int(line) == int(sample) + 1 and image == str(root / f"img{sample}.png")
    assert checkpoint.endswith("runs/changed/checkpoints/step_00000001") and (root / checkpoint / "meta.json").is_file()
    assert "Traceback" not in out and "DataError" not in out, out[-3000:]
