"""A vision-language fine-tune through the user's commands, and the result back in transformers.

`experiment=vlm_tiny` as written (a tiny random Qwen2.5-VL in models/tiny-vlm, built by docs/models.md's
snippet as written; the synthetic colour-image records whose PNGs prepare generates): ``megatron-pack prepare``, then
``bash launch/single_node.sh 2`` (CP=2 on two CPU ranks, 3 steps), ``megatron-pack verify`` (packed against
each sample alone, and against transformers' VLM forward), ``megatron-pack export``, and transformers:

1. prepare stores images (the store's image arrays, image tokens in the plan's lengths);
2. the run logs 3 finite losses at CP=2 and saves its checkpoint;
3. verify PASSes on the packs with images, against itself and against transformers, in one process and under
   torchrun at PP=2 (the session's world of 2 ranks, tests/_train_world.py: the tower on the first stage,
   megatron-core's forward-only schedule);
4. the export loads in ``Qwen2_5_VLForConditionalGeneration`` with every tensor used: the frozen vision tower
   exactly as the source folder had it, the merger and the language model trained, the processor, chat
   template and tokenizer beside it; and it generates from an image and a question through transformers' own
   image processor and chat template, equal to the same model run by hand on the same inputs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from _hf import cli
from _launch import REPO, launch_env
from _train_world import run_in_world

RUN = ["experiment=vlm_tiny", "checkpoint.save_interval=3", "logging.log_interval=1"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """The working folder after prepare and the 2-rank training run; the run's output."""
    from _hf import docs_tiny_folder

    root = tmp_path_factory.mktemp("vlm_cli")
    docs_tiny_folder(root, "vlm_tiny", "tiny-vlm")
    status, out = cli(root, "prepare", *RUN)
    assert status == 0, out
    proc = subprocess.run(["bash", str(REPO / "launch" / "single_node.sh"), "2", *RUN], cwd=root,
                          env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return root, proc.stdout + proc.stderr


def test_prepare_stores_the_images(trained):
    root, _ = trained
    store = root / "data" / "vlm_tiny"
    meta = json.loads((store / "metadata.json").read_text())
    assert meta["images"], meta.keys()
    offsets = np.load(store / "image_offsets.npy")
    assert offsets[-1] > 0 and (np.diff(offsets) == 0).any() and (np.diff(offsets) > 0).any()  # mixed samples


def test_training_at_cp2_logs_finite_losses_and_saves(trained):
    root, out = trained
    assert "parallel layout: world 2 = dp 1 x cp 2" in out
    metrics = [json.loads(line) for line in (root / "runs/vlm_tiny/metrics.jsonl").read_text().splitlines()]
    losses = [m["lm_loss"] for m in metrics if "lm_loss" in m]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[0] != losses[-1], losses
    assert (root / "runs/vlm_tiny/checkpoints/step_00000003/meta.json").is_file()


@pytest.mark.parametrize("reference", ["self", "transformers"])
def test_verify_passes_on_packs_with_images(trained, reference):
    root, _ = trained
    status, out = cli(root, "verify", "experiment=vlm_tiny", f"verify.reference={reference}")
    assert status == 0, out
    assert "4/4 packs PASS" in out, out  # verify.num_packs's default


def test_verify_at_pp2_under_torchrun_against_transformers(trained):
    root, _ = trained
    out = run_in_world(root, {"verify": ["verify", "experiment=vlm_tiny", "parallel=pp2",
                                         "verify.reference=transformers"]})["verify"]  # exit 0 on both ranks
    assert "at PP=2 TP=1 CP=1" in out and "4/4 packs PASS" in out, out[-5000:]


def test_export_loads_in_transformers_and_generates_from_an_image(trained):
    import transformers as T
    from PIL import Image
    from safetensors.torch import load_file

    root, _ = trained
    status, out = cli(root, "export", "checkpoint=runs/vlm_tiny/checkpoints", "output=exports/tiny-vlm")
    assert status == 0, out
    export = root / "exports" / "tiny-vlm"
    assert {"preprocessor_config.json", "chat_template.jinja", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    model, info = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(export, dtype=torch.float32,
                                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    source = {k: v for f in (root / "models/tiny-vlm").glob("*.safetensors") for k, v in load_file(f).items()}
    exported = {k: v for f in export.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(source) == sorted(exported)
    tower = [k for k in source if k.startswith("visual.") and not k.startswith("visual.merger.")]
    trained_names = [k for k in source if not k.startswith("visual.") or k.startswith("visual.merger.")]
    assert len(tower) > 10 and all(torch.equal(source[k], exported[k]) for k in tower)  # frozen
    assert len(trained_names) > 10 and all(not torch.equal(source[k], exported[k]) for k in trained_names)

    tokenizer = T.AutoTokenizer.from_pretrained(export)
    processor = T.AutoImageProcessor.from_pretrained(export)
    image = Image.new("RGB", (56, 84), (200, 30, 30))
    pixels = processor(images=[image], return_tensors="pt")
    merge = model.config.vision_config.spatial_merge_size
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": "what colour is it?"}]}], tokenize=False, add_generation_prompt=True)
    num_image_tokens = int(pixels["image_grid_thw"].prod()) // merge ** 2
    assert text.count("<|image_pad|>") == 1 and num_image_tokens > 1
    ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * num_image_tokens), return_tensors="pt")
    model.eval()
    with torch.no_grad():
        generated = model.generate(**ids, **pixels, max_new_tokens=4, do_sample=False)
        new = generated[0, ids["input_ids"].shape[1]:]
        logits = model(**ids, **pixels).logits[0, -1]  # the first generated token, by hand
    assert new.numel() == 4 and int(new[0]) == int(logits.argmax())
