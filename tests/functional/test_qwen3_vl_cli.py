"""Qwen3-VL (DeepStack, interleaved M-RoPE) and Qwen3.5 (hybrid linear attention) vision-language folders through the
user's commands: ``megatron-pack prepare experiment=vlm_tiny`` (the synthetic colour-image set, the folder's image
processor of patch 16), then on the session's world of 2 ranks (``tests/_train_world.py``) ``megatron-pack verify
verify.reference=transformers`` and ``megatron-pack train`` at CP=2 and at CP=1 (DP=2), then ``megatron-pack export``
of the CP=2 run and transformers' ``generate`` from an image on the exported folder:

1. verify: every pack PASSes against transformers' VLM forward of each sample alone, at PP=1 TP=1 CP=2;
2. two training steps at CP=2 (the pack's images and DeepStack rows embedded whole before the zigzag slice; Qwen3.5's
   Gated DeltaNet all-to-all) equal the same two steps at CP=1 x DP=2 (the same global batch of the same prepared
   packs): both steps' losses, and every parameter of the checkpoints written after them;
3. the export of the CP=2 run loads in ``AutoModelForImageTextToText`` with no missing or unexpected key, the frozen
   tower's blocks bit for bit the source's, the mergers (DeepStack's too) and the language model trained, the
   processor files beside them; its ``generate`` from an image and a question through its own processor and chat
   template (KV cache, M-RoPE deltas) gives the tokens of a greedy loop of full forwards by hand.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import _vlm3 as W
from _hf import prepare_in
from _train_world import last_checkpoint_weights, run_in_world, run_losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
FAMILIES = ("qwen3_vl", "qwen3_5")
BASE = ["experiment=vlm_tiny", "logging.log_interval=1"]
VERIFY = ["verify", *BASE, "verify.reference=transformers", "verify.num_packs=2"]
TRAIN = ["train", *BASE, "train.train_iters=2", "train.lr_warmup_iters=0"]
LAYOUTS = {"cp2": ["parallel=cp2"], "cp1": ["parallel=cp1"]}
"""Both on 2 ranks: CP=2 (DP=1), and CP=1 (DP=2)."""
ATOL = 5e-6
"""Parameters after two Adam steps (lr 1e-3): a weight whose gradient is near 0 moves by g / (sqrt(v) + eps), which a
float32 sum in another order (CP's split) moves by up to about 1e-6 (measured: 1.1e-6 Qwen3-VL, 0.9e-6 Qwen3.5, of
~1e-3 updates)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict[str, str]]]:
    """family -> (its working folder, each command's output): prepare in process, then verify and both trainings on
    the session's world."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(f"{family}_cli")
        (root / "models").mkdir()
        shutil.move(str(W.make_folder(root / "models", family)), root / "models" / "tiny-vlm")
        prepare_in(root, [*BASE, "data.synthetic_num_samples=16"])
        commands = {"verify": VERIFY, **{name: [*TRAIN, *layout, f"train.output_dir=runs/{name}"]
                                         for name, layout in LAYOUTS.items()}}
        out[family] = root, run_in_world(root, commands)  # exit 0 on both ranks
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_at_cp2_against_transformers(runs, family):
    out = runs[family][1]["verify"]
    assert "at PP=1 TP=1 CP=2" in out and "2/2 packs PASS" in out and "reference transformers" in out, out[-4000:]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_steps_at_cp2_equal_cp1(runs, family):
    root, out = runs[family]
    assert "world 2 = dp 1 x cp 2" in out["cp2"] and "world 2 = dp 2 x cp 1" in out["cp1"]
    cp2, cp1 = run_losses(root, "cp2"), run_losses(root, "cp1")
    assert len(cp2) == 2 and cp2[0] != cp2[1], cp2  # guard: the first step changed the weights
    torch.testing.assert_close(torch.tensor(cp2, dtype=torch.float64), torch.tensor(cp1, dtype=torch.float64),
                               rtol=1e-5, atol=0)
    after2, after1 = last_checkpoint_weights(root, "cp2", 2), last_checkpoint_weights(root, "cp1", 2)
    assert sorted(after2) == sorted(after1)
    tower = [n for n in after2 if n.startswith("vision_model.")]  # the tower's parameters are in the checkpoint
    assert len(tower) > 10 and any("deepstack_merger_list" in n for n in tower) == (family == "qwen3_vl")
    for name in after2:
        torch.testing.assert_close(after2[name], after1[name], rtol=1e-5, atol=ATOL, msg=name)


def _export(root: Path) -> Path:
    """``megatron-pack export`` of the CP=2 run's last checkpoint, in process, in ``root``."""
    from megatron_pack.cli.export import main

    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(["checkpoint=runs/cp2/checkpoints", "output=exports/tiny-vlm"]) == 0
    finally:
        os.chdir(cwd)
    return root / "exports" / "tiny-vlm"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_export_of_the_cp2_run_generates_from_an_image_in_transformers(runs, family):
    import transformers as T

    import _vlm as V

    root, _ = runs[family]
    export = _export(root)
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (export / name).read_bytes() == (root / "models/tiny-vlm" / name).read_bytes(), name
    source, exported = _tensors(root / "models/tiny-vlm"), _tensors(export)
    assert sorted(source) == sorted(exported)
    frozen = [k for k in source if k.startswith("model.visual.") and "merger" not in k]
    trained = [k for k in source if k not in frozen]
    assert len(frozen) > 10 and all(torch.equal(source[k], exported[k]) for k in frozen)
    assert any("deepstack_merger_list" in k for k in trained) == (family == "qwen3_vl")
    assert len(trained) > 10 and all(not torch.equal(source[k], exported[k]) for k in trained)
    model, info = T.AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == W.CLASSES[family]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()

    tok, proc = T.AutoTokenizer.from_pretrained(export), T.AutoImageProcessor.from_pretrained(export)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}],
                                   tokenize=False, add_generation_prompt=True)
    pixels = proc(images=[V.make_image(64, 96, 9)], return_tensors="pt")
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    num_image_tokens = int(pixels["image_grid_thw"][0].prod()) // 4
    assert text.count("<|image_pad|>") == 1 and num_image_tokens > 1
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * num_image_tokens), return_tensors="pt")["input_ids"]
    inputs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    with torch.no_grad():
        generated = model.generate(input_ids=ids, mm_token_type_ids=(ids == image_pad).to(torch.int32), **inputs,
                                   max_new_tokens=4, do_sample=False)[0, ids.shape[1]:].tolist()
        by_hand = ids
        for _ in range(4):  # full forwards, no cache
            logits = model(input_ids=by_hand, mm_token_type_ids=(by_hand == image_pad).to(torch.int32),
                           **inputs).logits[0, -1]
            by_hand = torch.cat([by_hand, logits.argmax().view(1, 1)], 1)
    assert len(generated) == 4 and generated == by_hand[0, ids.shape[1]:].tolist()
