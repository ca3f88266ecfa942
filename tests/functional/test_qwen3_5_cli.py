"""Qwen3.5 text on the command line, as a user runs it: `megatron-pack train` and `megatron-pack verify` on tiny random
Qwen3.5 folders (tests/_qwen3_5.py: three Gated DeltaNet layers and one gated full attention; dense, and MoE with 4
experts and a shared expert), on the session's torchrun world of 2 ranks (tests/_train_world.py).

1. Two training steps at CP=2 (the linear-attention layers' all-to-all from sequence to head shards, forward and
   backward) equal the same two steps at CP=1 (DP=2: the same global batch of the same prepared packs; the MoE
   stack at DP=2 x EP=2): the losses of both steps, and every parameter of the checkpoints written after them.
2. ``verify verify.reference=transformers`` at ``parallel=cp2`` passes on packs of several samples for both stacks
   (transformers' forward of each sample alone, the folder's weights).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from _hf import prepare_in
from _qwen3_5 import make_dense_folder, make_moe_folder
from _train_world import last_checkpoint_weights, run_in_world, run_losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STACKS = {"dense": "models/qwen3_5", "moe": "models/qwen3_5_moe"}
BASE = ["experiment=pretrained_tiny", "data.synthetic_num_samples=16", "data.dataset_dir=data/q35",
        "logging.log_interval=1"]
"""The tiny fine-tuning recipe, its data prepared once (the tokenizer is both folders' own: the same packs)."""
TRAIN = ["train.train_iters=2", "train.lr_warmup_iters=0"]
LAYOUTS = {"cp2": ["parallel=cp2"], "cp1": ["parallel=cp1"]}
"""Both on 2 ranks: CP=2, and CP=1 (DP=2) with the MoE stack's experts over EP=2."""
ATOL = {"dense": 1e-6, "moe": 1e-5}
"""Parameters after two Adam steps (lr 1e-3): a weight whose gradient is near 0 moves by g / (sqrt(v) + eps), which a
float32 sum in another order (CP's split, the MoE dispatch at EP=2) moves by up to a few 1e-6 (measured: 5e-6 on 3
of ~90k MoE weights, all others under 1e-6); 1e-5 is 1% of one step's largest update."""
PACK_LINE = re.compile(r"^pack \d+: (\d+) samples, .* max \|logit diff\| (\S+)  max \|loss diff\| (\S+)  (?:routed .*  )?(PASS|FAIL)$",
                       re.M)
"""One pack's line of verify's report (a MoE model's names the tokens its routers saw)."""


def _commands() -> dict[str, list[str]]:
    out = {}
    for stack, folder in STACKS.items():
        model = [f"model.pretrained={folder}", f"model.name=qwen3_5_{stack}"]
        for layout, parallel in LAYOUTS.items():
            experts = ["parallel.expert_model_parallel_size=2"] if stack == "moe" and layout == "cp1" else []
            out[f"{stack}_{layout}"] = ["train", *BASE, *model, *TRAIN, *parallel, *experts,
                                        f"train.output_dir=runs/{stack}_{layout}"]
        out[f"{stack}_verify"] = ["verify", *BASE, *model, "parallel=cp2", "verify.reference=transformers",
                                  "verify.num_packs=2"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("qwen3_5_cli")
    (root / "models").mkdir()
    make_dense_folder(root / "models", "qwen3_5")
    make_moe_folder(root / "models", "qwen3_5_moe")
    prepare_in(root, [*BASE, f"model.pretrained={STACKS['dense']}"])
    return root, run_in_world(root, _commands(), timeout=500)


@pytest.mark.parametrize("stack", list(STACKS))
def test_two_steps_at_cp2_equal_cp1(runs, stack):
    from safetensors.torch import load_file

    root, out = runs
    assert "world 2 = dp 1 x cp 2" in out[f"{stack}_cp2"] and "world 2 = dp 2 x cp 1" in out[f"{stack}_cp1"]
    cp2, cp1 = run_losses(root, f"{stack}_cp2"), run_losses(root, f"{stack}_cp1")
    assert len(cp2) == 2 and cp2[0] != cp2[1], cp2  # guard: the first step changed the weights
    torch.testing.assert_close(torch.tensor(cp2, dtype=torch.float64), torch.tensor(cp1, dtype=torch.float64),
                               rtol=1e-5, atol=0)
    after2, after1 = last_checkpoint_weights(root, f"{stack}_cp2", 2), last_checkpoint_weights(root, f"{stack}_cp1", 2)
    assert sorted(after2) == sorted(after1) and any(".self_attention.A_log" in k for k in after2)
    source = load_file(root / STACKS[stack] / "model.safetensors")
    assert not torch.equal(after2["decoder.layers.0.self_attention.A_log"],
                           source["model.layers.0.linear_attn.A_log"])  # guard: the Gated DeltaNet trained
    for name in after2:
        torch.testing.assert_close(after2[name], after1[name], rtol=1e-5, atol=ATOL[stack], msg=name)


@pytest.mark.parametrize("stack", list(STACKS))
def test_verify_against_transformers_at_cp2(runs, stack):
    _, out = runs
    text = out[f"{stack}_verify"]
    lines = PACK_LINE.findall(text)
    assert len(lines) == 2 and sum(int(n) for n, *_ in lines) > 2, text[-3000:]  # packs of several samples
    assert all(verdict == "PASS" and float(diff) <= 1e-4 for _, diff, _, verdict in lines), text[-3000:]
    assert "CP=2" in text and "2/2 packs PASS" in text
