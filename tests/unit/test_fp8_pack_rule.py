"""model.fp8's pack rule: every CP (x SP-TP) rank's rows of a pack in whole FP8 blocks (issue 27).

The rule binds the pack's token count T, not each sub-sequence (docs/thd.md, "FP8 recipes and the
pack multiple"): sub-sequences keep the pad multiple lcm(2*CP, CP*TP), and the collate pads T to
``pack_multiple = lcm(pad multiple, CP * (TP if SP) * alignment)`` with a tail sub-sequence.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config import ConfigError, load_config
from megatron_pack.config.choices import FP8_RECIPES, FP8_TOKEN_ALIGNMENT
from megatron_pack.config.layout import effective_pack_multiple, fp8_token_multiple, pack_multiple, pad_multiple
from megatron_pack.data.batches.in_batch import collate_in_batch
from megatron_pack.data.batches.thd import collate_cross, collate_thd, make_collate_fn
from megatron_pack.data.formats.sources import DataError
from megatron_pack.parallel.cp import slice_thd_batch

ROOT = Path(__file__).resolve().parents[2]

# (cp, tp, sp, recipe) -> (pad multiple, pack multiple), computed by hand
HAND = [
    (1, 1, False, "none", 1, 1),
    (1, 1, False, "delayed", 1, 16),      # 1 * 16
    (1, 1, False, "blockwise", 1, 128),
    (2, 1, False, "current", 4, 32),      # lcm(4, 2 * 16)
    (2, 1, False, "mxfp8", 4, 64),        # lcm(4, 2 * 32)
    (2, 2, True, "delayed", 4, 64),       # lcm(lcm(4, 4), 2 * 2 * 16)
    (2, 2, False, "delayed", 4, 32),      # no SP: each TP rank sees all T/2 rows
    (1, 2, True, "mxfp8", 2, 64),         # lcm(2, 1 * 2 * 32)
    (4, 2, False, "mxfp8", 8, 128),       # lcm(8, 4 * 32)
    (8, 2, False, "mxfp8", 16, 256),      # lcm(16, 8 * 32)
    (8, 2, True, "blockwise", 16, 2048),  # lcm(16, 8 * 2 * 128)
    (8, 1, False, "none", 16, 16),
]


@pytest.mark.parametrize("cp,tp,sp,recipe,pad,multiple", HAND, ids=[f"cp{c}-tp{t}-{'sp' if s else 'nosp'}-{r}"
                                                                      for c, t, s, r, _, _ in HAND])
def test_pack_multiple_hand_computed(cp, tp, sp, recipe, pad, multiple):
    assert pad_multiple(cp, tp, sp) == pad
    assert pack_multiple(cp, tp, sp, recipe) == multiple


def test_explicit_pad_multiple_joins_the_lcm():
    assert pack_multiple(2, 1, False, "delayed", pad_seq_to_mult=48) == 96
    cfg = load_config(["parallel=cp2", "model.fp8=delayed", "packing.pad_seq_to_mult=48",
                       "packing.packed_sequence_size=576", "model.seq_length=576"])
    assert effective_pack_multiple(cfg) == 96


# the whole table: CP in {1,2,4,8}, TP in {1,2}, SP on/off (only with TP > 1), every recipe
GRID = [(cp, tp, sp, r) for cp, tp, sp, r in itertools.product((1, 2, 4, 8), (1, 2), (False, True), FP8_RECIPES)
        if not (sp and tp == 1)]


def _samples(rng, num, longest):
    lengths = rng.integers(2, longest, size=num)
    return [{"input_ids": rng.integers(3, 200, size=n).tolist(), "loss_mask": [0] + [1] * (n - 1),
             "sample_id": i} for i, n in enumerate(lengths)]


@pytest.mark.parametrize("cp,tp,sp,recipe", GRID, ids=[f"cp{c}-tp{t}-{'sp' if s else 'nosp'}-{r}" for c, t, s, r in GRID])
def test_every_rank_holds_whole_fp8_blocks(cp, tp, sp, recipe):
    """Collated packs at the rule: T % pack multiple == 0, each sub-sequence (tail included) splits into 2*CP
    chunks, each CP rank's slice (and each SP shard of it) is a multiple of the recipe's alignment, the tail
    carries no loss, and the pack never outgrows its size."""
    pad, whole = pad_multiple(cp, tp, sp), pack_multiple(cp, tp, sp, recipe)
    align, shards = FP8_TOKEN_ALIGNMENT[recipe], tp if sp else 1
    assert whole == math.lcm(pad, fp8_token_multiple(cp, tp, sp, recipe))
    pack_size = whole * max(1, 256 // whole)
    rng = np.random.default_rng(cp * 100 + tp * 10 + FP8_RECIPES.index(recipe))
    tails = 0
    for _ in range(4):
        samples = _samples(rng, 3, max(4, pack_size // 4 - pad))
        batch = collate_thd(samples, pack_size=pack_size, pad_multiple=pad, pack_multiple=whole)
        num_tokens = batch["tokens"].shape[1]
        assert num_tokens % whole == 0 and num_tokens <= pack_size
        lengths = np.diff(batch["cu_seqlens_padded"].numpy())
        assert (lengths % pad == 0).all()
        if len(lengths) > len(samples):  # the tail: zero real length, no loss
            tails += 1
            assert int(batch["cu_seqlens"][-1]) == int(batch["cu_seqlens"][-2])
            assert float(batch["loss_mask"][0, int(batch["cu_seqlens_padded"][-2]):].sum()) == 0
        for rank in range(cp):
            local = slice_thd_batch(batch, cp, rank)["tokens"].shape[1]
            assert local * cp == num_tokens and (local // shards) * shards == local
            assert (local // shards) % align == 0
    assert tails > 0 or whole == pad  # the rule was exercised (a tail was needed) wherever it adds one


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_collate_shapes_under_each_recipe(recipe):
    """Two samples of 3 ids at CP 2 (pad 4): without the rule T = 8; with it T = the pack multiple."""
    whole = pack_multiple(2, 1, False, recipe)
    samples = [{"input_ids": [5, 6, 2], "loss_mask": [0, 1, 1]}, {"input_ids": [7, 8, 2], "loss_mask": [0, 1, 1]}]
    size = max(whole, 16)
    batch = collate_thd(samples, pack_size=size, pad_multiple=4, pack_multiple=whole)
    expected_tail = [] if whole == 4 else [whole]
    assert batch["cu_seqlens_padded"].tolist() == [0, 4, 8] + expected_tail
    assert batch["cu_seqlens"].tolist() == [0, 2, 4] + ([4] if expected_tail else [])
    assert batch["tokens"].shape == (1, max(whole, 8)) and batch["max_seqlen"] == max(4, whole - 8)
    assert batch["num_target_tokens"] == 4 and batch["position_ids"][0, 8:].tolist() == list(range(max(whole, 8) - 8))
    fixed = collate_thd(samples, pack_size=size, pad_multiple=4, pack_multiple=whole, pad_to_max_length=True,
                        num_cu_seqlens=5)  # CUDA graphs: T and the cu_seqlens length are fixed as before
    assert fixed["tokens"].shape == (1, size) and fixed["cu_seqlens_padded"].tolist() == [0, 4, 8, size, size]
    in_batch = collate_in_batch(samples, pad_multiple=4, pack_multiple=whole)
    assert in_batch["cu_seqlens_padded"].tolist() == batch["cu_seqlens_padded"].tolist()
    assert in_batch["tokens"].shape == batch["tokens"].shape and in_batch["sample_ids"].tolist() == [-1, -1]
    cross = collate_cross(samples, pack_size=size, pad_multiple=4, pack_multiple=whole)
    # cross: the pieces are one sequence of 4 real tokens (padded to 4), then the same tail rule
    assert cross["cu_seqlens_padded"].tolist() == [0, 4] + ([whole] if whole > 4 else [])


def test_make_collate_fn_reads_the_recorded_pack_multiple():
    meta = {"pack_size": 64, "pad_seq_to_mult": 4, "pack_multiple": 32, "pad_id": 0, "max_samples_per_bin": 3,
            "dataset_max_seqlen": 6}
    samples = [{"input_ids": [5, 6, 2], "loss_mask": [0, 1, 1]}]
    assert make_collate_fn(meta)(samples)["tokens"].shape == (1, 32)
    assert make_collate_fn({**meta, "pack_multiple": 4})(samples)["tokens"].shape == (1, 4)
    assert make_collate_fn(meta, pack_multiple=64)(samples)["tokens"].shape == (1, 64)
    old_plan = {k: v for k, v in meta.items() if k != "pack_multiple"}  # made before model.fp8: pad multiple only
    assert make_collate_fn(old_plan)(samples)["tokens"].shape == (1, 4)
    graphed = make_collate_fn(meta, pad_cu_seqlens=True)(samples)  # fixed max_seqlen covers the tail
    assert graphed["max_seqlen"] == 32 and graphed["cu_seqlens"].numel() == 5


def test_collate_refuses_a_pack_size_off_the_rule():
    with pytest.raises(ValueError, match=r"pack_size \(40\) is not a multiple of the pack multiple \(32\)"):
        collate_thd([{"input_ids": [5, 6, 2], "loss_mask": [0, 1, 1]}], pack_size=40, pad_multiple=4, pack_multiple=32)
    with pytest.raises(ValueError, match="pack_multiple .6. must be a multiple of pad_multiple .4."):
        collate_thd([{"input_ids": [5, 6, 2], "loss_mask": [0, 1, 1]}], pack_size=48, pad_multiple=4, pack_multiple=6)


# refusals through validate(): the one line and the value that works
REFUSALS = [
    (["model.fp8=delayed", "packing.packed_sequence_size=200", "model.seq_length=200"],
     "packing.packed_sequence_size (200) must be divisible by the pack multiple 16 = cp*16 = 1*16 = 16 "
     "(model.fp8=delayed), so every rank's rows of a padded pack come in whole FP8 blocks; set "
     "packing.packed_sequence_size=208 and model.seq_length=208"),
    (["model.fp8=blockwise", "parallel=cp2", "packing.packed_sequence_size=384", "model.seq_length=384"],
     "must be divisible by the pack multiple 256 = cp*128 = 2*128 = 256 (model.fp8=blockwise)"),
    (["model.fp8=current", "parallel=tp2_cp2_sp", "model.ffn_hidden_size=192", "packing.packed_sequence_size=480",
      "model.seq_length=480"],
     "the pack multiple 64 = cp*tp*16 = 2*2*16 = 64 (model.fp8=current, sequence_parallel)"),
    (["model.fp8=delayed", "parallel=cp2", "packing.pad_seq_to_mult=48", "packing.packed_sequence_size=528",
      "model.seq_length=528"],
     "the pack multiple 96 = lcm(pad multiple 48 (packing.pad_seq_to_mult), cp*16 = 2*16 = 32 (model.fp8=delayed))"),
    (["model.fp8=delayed", "parallel=cp2", "packing.pad_seq_to_mult=48", "packing.packed_sequence_size=512",
      "model.seq_length=512"],
     "set packing.packed_sequence_size=576 and model.seq_length=576 (a pack is one sequence) "
     "(or unset packing.pad_seq_to_mult)"),
]


@pytest.mark.parametrize("overrides,fragment", REFUSALS, ids=["cp1-delayed", "cp2-blockwise", "tp2cp2sp-current",
                                                              "explicit-pad", "explicit-pad-unset"])
def test_validate_refuses_a_pack_size_off_the_rule(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    (line,) = [p for p in info.value.problems if "pack multiple" in p]
    assert fragment in line and "\n" not in line
    fixed = [o for o in overrides if not o.startswith(("packing.packed", "model.seq"))]
    value = int(line.split("set packing.packed_sequence_size=")[1].split()[0].rstrip("."))
    load_config(fixed + [f"packing.packed_sequence_size={value}", f"model.seq_length={value}"])  # the fix works


def test_in_batch_and_online_follow_the_rule():
    from megatron_pack.data.batches.loader import collate_from_config

    cfg = load_config(["model.fp8=mxfp8", "packing.mode=in_batch",
                       "train.micro_batch_size=2", "parallel=cp2"])
    collate = collate_from_config(cfg, {"pad_id": 0})
    batch = collate([{"input_ids": [5, 6, 2], "loss_mask": [0, 1, 1]}, {"input_ids": [7, 2], "loss_mask": [0, 1]}])
    assert batch["tokens"].shape == (1, 64) and batch["cu_seqlens_padded"].tolist() == [0, 4, 8, 64]
    online = load_config(["model.fp8=delayed", "packing.mode=online", "parallel=cp2"])
    assert collate_from_config(online, {"pack_size": 512, "pad_seq_to_mult": 4, "pad_id": 0})(
        [{"input_ids": [5, 6, 2], "loss_mask": [0, 1, 1]}])["tokens"].shape == (1, 32)


@pytest.fixture(scope="module")
def bf16_plan(tmp_path_factory):
    """A token store with one bf16 plan (CP 2, pack 512)."""
    from megatron_pack.data.prepare import prepare

    target = tmp_path_factory.mktemp("fp8_plans")
    common = [f"data.dataset_dir={target}", "data.synthetic_num_samples=200", "parallel=cp2"]
    return target, common, prepare(load_config(common), progress=False)


def test_a_bf16_plan_is_refused_for_an_fp8_run_and_the_fix_works(bf16_plan):
    """The plan records its pack multiple; an FP8 run refuses a plan made without the recipe (by selection,
    and by validate() when data.plan names it), names the prepare that fits, and that prepare fixes it."""
    from megatron_pack.cli.run_config import load_run_config
    from megatron_pack.data.prepare import prepare
    from megatron_pack.data.store.atomic import read_json

    target, common, bf16 = bf16_plan
    assert read_json(bf16 / "metadata.json")["pack_multiple"] == 4
    fp8_run = [f"data.dataset_dir={target}", "parallel=cp2", "model.fp8=delayed"]
    with pytest.raises(DataError) as info:
        load_run_config(fp8_run, world_size=2, open_data=False)
    message = str(info.value)
    assert "pad packs to a multiple of 4 tokens, but model.fp8=delayed with cp=2 needs 32" in message
    assert "parallel.context_parallel_size=2 model.fp8=delayed` (pads to 32)" in message and "\n" not in message
    with pytest.raises(ConfigError, match="model.fp8 .delayed.: the dataset was planned with packs padded to a "
                                          "multiple of 4 tokens"):  # naming the plan does not skip the check
        load_run_config(fp8_run + [f"data.plan={bf16.name}"], world_size=2, open_data=False)

    fp8 = prepare(load_config(common + ["model.fp8=delayed"]), progress=False)  # the command the message names
    assert fp8 != bf16 and fp8.name.startswith("pack512_mult4_") and read_json(fp8 / "metadata.json")["pack_multiple"] == 32
    run = load_run_config(fp8_run, world_size=2)
    assert run.dataset.plan_dir == fp8
    batch = make_collate_fn(run.dataset.metadata, pack_multiple=effective_pack_multiple(run.cfg))(run.dataset[0])
    assert batch["tokens"].shape[1] % 32 == 0
    bf16_run = load_run_config([f"data.dataset_dir={target}", "parallel=cp2"], world_size=2)
    assert bf16_run.dataset.plan_dir == bf16  # both fit a bf16 run; the one padded as it needs is taken
    assert bf16_run.cfg.model.fp8 == "none"  # a plan's recipe is never taken from the dataset
    manifests = {p: read_json(p / "metadata.json")["manifest"]["model.fp8"] for p in (bf16, fp8)}
    assert manifests == {bf16: {"recipe": "none", "pack_multiple": 4}, fp8: {"recipe": "delayed", "pack_multiple": 32}}


def test_train_check_refuses_fp8_on_cpu_in_one_line(bf16_plan):
    """The user's path: `megatron-pack train --check` on this CPU host with model.fp8 and train.device=cpu."""
    target, _, _ = bf16_plan
    out = subprocess.run([sys.executable, "-m", "megatron_pack.cli.main", "train", "--check",
                          f"data.dataset_dir={target}", "parallel=cp2", "model.fp8=delayed", "train.device=cpu"],
                         capture_output=True, text=True, cwd=ROOT, env={"WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"},
                         timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "model.fp8 (delayed) needs CUDA and Transformer Engine (FP8 GEMMs), but train.device=cpu" in out.stderr
    assert "Traceback" not in out.stderr


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(GRID), lengths=st.lists(st.integers(2, 300), min_size=1, max_size=40),
       packs=st.integers(1, 4), pad_to_max=st.booleans())
def test_planned_packs_never_overflow_after_the_tail(layout, lengths, packs, pad_to_max):
    """The packer packs padded lengths into pack_size (a multiple of the pack multiple); adding the tail never
    overflows, and every pack's T is a multiple of the pack multiple."""
    from megatron_pack.data.packing.algorithms import plan_packing, thd_lengths

    cp, tp, sp, recipe = layout
    pad, whole = pad_multiple(cp, tp, sp), pack_multiple(cp, tp, sp, recipe)
    pack_size = whole * packs * max(1, 512 // whole)
    num_ids = np.asarray(lengths) + 1
    keep = thd_lengths(num_ids, pad) <= pack_size
    num_ids = num_ids[keep]
    if not num_ids.size:
        return
    plan = plan_packing(thd_lengths(num_ids, pad), pack_size)
    for members in plan.bins():
        samples = [{"input_ids": [3] * int(num_ids[i]), "loss_mask": [1] * int(num_ids[i])} for i in members]
        batch = collate_thd(samples, pack_size=pack_size, pad_multiple=pad, pack_multiple=whole,
                            pad_to_max_length=pad_to_max)
        num_tokens = batch["tokens"].shape[1]
        assert num_tokens <= pack_size and num_tokens % whole == 0
        assert batch["num_real_tokens"] == int(num_ids[members].sum() - len(members))
