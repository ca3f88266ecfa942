"""Single-field checks of each group (``__post_init__``): a passing and a failing case each."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_pack.config import Config, ConfigError
from megatron_pack.config.schema import GROUPS

FIELD_CASES = [  # (id, group, fields, fragments of the problem; () = valid)
    ("model-defaults", "model", {}, ()),
    ("model-positive", "model", dict(num_layers=0), ("model.num_layers (0) must be a positive integer",
                                                     "set model.num_layers=<int >= 1>")),
    ("model-bool-is-not-int", "model", dict(hidden_size=True), ("model.hidden_size (True)",)),
    ("model-choice", "model", dict(normalization="BatchNorm"), ("model.normalization ('BatchNorm')",
                                                                "set model.normalization=RMSNorm")),
    ("model-graph-scope", "model", dict(cuda_graph_scope=["layer"]), ("'layer' must be 'attn' or 'mlp'",)),
    ("model-dropout", "model", dict(hidden_dropout=1.0), ("model.hidden_dropout (1.0)", "set model.hidden_dropout=0.0")),
    ("model-gqa", "model", dict(num_query_groups=3), ("model.num_query_groups (3) must divide", "(e.g. 2)")),
    ("model-head-dim", "model", dict(hidden_size=66), ("model.hidden_size (66)", "set model.kv_channels=<head dim>")),
    ("model-head-dim-explicit", "model", dict(hidden_size=66, kv_channels=16), ()),
    # issue 11 item 6: train reads the prepared store, so data.input is required by prepare only
    ("data-files-input-optional", "data", dict(source="files"), ()),
    ("data-files", "data", dict(source="files", input="/x.jsonl"), ()),
    ("data-workers-zero-ok", "data", dict(num_workers=0), ()),
    ("data-workers-negative", "data", dict(num_workers=-1), ("data.num_workers (-1) must be a non-negative integer",)),
    # issue 23 item 5: packing.mode is the one switch; a pack size of 0 no longer turns packing off
    ("packing-off-is-refused", "packing", dict(packed_sequence_size=0),
     ("packing.packed_sequence_size (0) no longer turns offline packing off", "set packing.mode=in_batch")),
    ("packing-in-batch", "packing", dict(mode="in_batch"), ()),
    ("packing-negative", "packing", dict(packed_sequence_size=-8), ("packing.packed_sequence_size (-8)",)),
    ("packing-pad-zero", "packing", dict(pad_seq_to_mult=0), ("packing.pad_seq_to_mult (0)",)),
    ("packing-algorithm", "packing", dict(algorithm="greedy"), ("packing.algorithm ('greedy')", "set packing.algorithm=bfd")),
    ("parallel-cp0", "parallel", dict(context_parallel_size=0), ("parallel.context_parallel_size (0)",)),
    ("parallel-comm", "parallel", dict(cp_comm_type="ring"), ("parallel.cp_comm_type ('ring')",)),
    ("train-lr", "train", dict(lr=0.0), ("train.lr (0.0) must be > 0", "set train.lr=3e-4")),
    ("train-min-lr", "train", dict(min_lr=1.0), ("train.min_lr (1.0)", "set train.min_lr=")),
    ("train-clip", "train", dict(clip_grad=-1.0), ("train.clip_grad (-1.0)",)),
    ("ddp-bucket", "ddp", dict(bucket_size=0), ("ddp.bucket_size (0)",)),
    ("checkpoint-keep", "checkpoint", dict(keep_last=0), ("checkpoint.keep_last (0)",)),
    ("logging-level", "logging", dict(level="LOUD"), ("logging.level ('LOUD')",)),
    ("model-recompute-selective", "model", dict(recompute_granularity="selective"), ()),
    ("model-recompute-full", "model", dict(recompute_granularity="full", recompute_method="block",
                                           recompute_num_layers=2), ()),
    ("model-recompute-choice", "model", dict(recompute_granularity="some"),
     ("model.recompute_granularity ('some')", "set model.recompute_granularity=selective")),
    ("model-recompute-method-needs-full", "model", dict(recompute_granularity="selective", recompute_method="uniform"),
     ("model.recompute_method ('uniform') applies only to model.recompute_granularity=full",)),
    ("model-recompute-too-many-layers", "model", dict(recompute_granularity="full", recompute_num_layers=3),
     ("model.recompute_num_layers (3) must be <= model.num_layers (2)",)),
    ("data-validation-fraction", "data", dict(validation_fraction=0.1), ()),
    ("data-validation-fraction-range", "data", dict(validation_fraction=1.0),
     ("data.validation_fraction (1.0) must be in [0, 1)",)),
    ("data-validation-both", "data", dict(validation="v.jsonl", validation_fraction=0.1),
     ("both choose a validation set", "set data.validation=null or data.validation_fraction=0")),
    ("train-epochs", "train", dict(train_iters=None, num_epochs=2), ()),
    ("train-epochs-and-iters", "train", dict(num_epochs=2),
     ("train.train_iters (50) and train.num_epochs (2): set exactly one", "train.train_iters=null")),
    ("train-neither-epochs-nor-iters", "train", dict(train_iters=None), ("set exactly one",)),
    ("train-eval-negative", "train", dict(eval_interval=-1), ("train.eval_interval (-1) must be a non-negative",)),
    ("checkpoint-weights-only-needs-load", "checkpoint", dict(load_weights_only=True),
     ("checkpoint.load_weights_only (True) needs checkpoint.load", "set checkpoint.load=")),
    ("checkpoint-weights-only", "checkpoint", dict(load_weights_only=True, load="/ck"), ()),
    ("verify-tolerance", "verify", dict(tolerance=0.0), ("verify.tolerance (0.0)",)),
    ("verify-reference", "verify", dict(reference="torch"), ("verify.reference ('torch')", "set verify.reference=self")),
    ("model-rope-scaling", "model", dict(rope_scaling="dynamic"), ("model.rope_scaling ('dynamic')",)),
    ("model-llama3-factors", "model", dict(rope_scaling="llama3", rope_low_freq_factor=4.0),
     ("model.rope_low_freq_factor (4.0)",)),
    ("model-norm-eps", "model", dict(norm_epsilon=0.0), ("model.norm_epsilon (0.0)",)),
    ("export-defaults", "export", {}, ()),
    ("export-dtype", "export", dict(dtype="float16"), ("export.dtype ('float16')",)),
    ("export-shard-size", "export", dict(max_shard_size="big"), ("export.max_shard_size ('big')", "5GB")),
    ("export-shard-size-units", "export", dict(max_shard_size="500MiB"), ()),
    ("export-adapter-and-merge", "export", dict(adapter=True, merge=True), ("choose one",)),
    ("peft-defaults", "peft", {}, ()),
    ("peft-lora", "peft", dict(method="lora", dim=8, alpha=16.0, dropout=0.05, target_modules=["linear_qkv"]), ()),
    ("peft-method", "peft", dict(method="dora"), ("peft.method ('dora')",)),
    ("peft-hf-target", "peft", dict(target_modules=["q_proj"]), ("peft.target_modules (['q_proj'])", "megatron-core names")),
]


@pytest.mark.parametrize("group,fields,fragments", [c[1:] for c in FIELD_CASES], ids=[c[0] for c in FIELD_CASES])
def test_field_checks(group, fields, fragments):
    if not fragments:
        assert GROUPS[group](**fields).field_problems() == []
        return
    with pytest.raises(ConfigError) as info:
        GROUPS[group](**fields)
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text


def test_every_group_has_a_failing_case():
    assert {c[1] for c in FIELD_CASES if c[3]} == set(GROUPS)


def test_several_field_problems_of_one_group_together():
    with pytest.raises(ConfigError) as info:
        GROUPS["train"](micro_batch_size=0, lr_decay_style="step", clip_grad=-1.0)
    assert len(info.value.problems) == 3


def test_groups_are_frozen_keyword_only():
    for cls in (*GROUPS.values(), Config):
        params = dataclasses.fields(cls)
        assert all(f.kw_only for f in params), cls
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cls(), params[0].name, getattr(cls(), params[0].name))
    with pytest.raises(TypeError):
        GROUPS["model"](2)  # positional arguments are refused
