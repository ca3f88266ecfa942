"""An image deleted or replaced after prepare is refused before launch by ``train`` and ``verify`` (issue 43, 2).

The store records each image's path, patch grid (from its pixel size) and sha256. Before any process group, train
and verify open the header of every image file the plan uses: a missing file, a file that is no image, or one whose
pixel size gives another patch grid is one line naming the sample's record, the file and the fix, exit 2. (An
image replaced by one of the same size is found by its sha256 when its pack is read: the run then stops after that
step with a checkpoint, tests/functional/test_reliability_images_mid_run.py.) Before, training ran until the pack was
read, then died with a 162-line traceback, no checkpoint, the steps since the last save lost.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _vlm_data import VLM_CHAT_RUN as RUN


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    from _hf import prepare_in
    from _vlm_data import vlm_chat_folder

    root = vlm_chat_folder(tmp_path_factory.mktemp("images"))
    prepare_in(root, RUN)
    return root


def _resize(path: Path) -> None:
    from _vlm_data import make_image

    make_image(path, 84, 28)


# id, damage to img4.png, what the line says about it
CASES = [
    ("deleted", lambda p: p.unlink(), "is missing"),
    ("resized", _resize, "has 84x28 pixels, which is not the size prepare recorded (patch grid (1, 2, 4))"),
    ("not-an-image", lambda p: p.write_text("not a png"), "cannot be read as an image"),
]


@pytest.mark.parametrize("command", ["train", "verify"])
@pytest.mark.parametrize("damage,why", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_changed_image_is_refused_before_launch(prepared, monkeypatch, capsys, command, damage, why):
    from megatron_pack.cli.main import main

    image = prepared / "img4.png"
    kept = image.read_bytes()
    monkeypatch.chdir(prepared)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    damage(image)
    try:
        assert main([command, *RUN, "train.output_dir=runs/refused"]) == 2
    finally:
        image.write_bytes(kept)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"megatron-pack {command}: 1 image file(s) the training data uses changed since prepare: "
                          f"sample 4 (chat.jsonl: line 5): image 0 {image} {why}"), err
    assert err.endswith("re-run `megatron-pack prepare` with data.overwrite=true to prepare the data as it is now.")
    assert len(err.splitlines()) == 1 and not (prepared / "runs/refused").exists(), err


def test_the_unchanged_images_pass_the_check(prepared, monkeypatch, capsys):
    """Guard: the refusals come from the damage (the same command passes with the images as prepared), and the
    plan really uses images from files (so the check had files to look at)."""
    from megatron_pack.cli.main import main
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.config import load_config

    monkeypatch.chdir(prepared)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--check", *RUN, "train.output_dir=runs/checked"]) == 0, capsys.readouterr().err
    dataset = open_dataset(load_config(RUN, world_size=2))
    images = dataset.store.images
    assert sum(int(images.offsets[i + 1] - images.offsets[i]) for i in set(dataset.sample_order.tolist())) == 6
    assert {images.image(j).get("path") for j in range(6)} == {str(prepared / f"img{i}.png") for i in range(0, 12, 2)}
    assert os.path.isfile(prepared / "img4.png")
