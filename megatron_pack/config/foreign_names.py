"""Names people type from other tools (TRL, the Hugging Face Trainer, Megatron-LM), each answered with our key.

A reviewed table, not a spelling guess: ``model_name_or_path=...`` is answered with ``model.pretrained`` (not
the close spelling ``model.name``), ``eval_steps`` with ``train.eval_interval`` (not ``train.eval_iters``, the
number of validation batches), and where the meaning differs the answer says how, in one line. The loader
answers an unknown ``key=value`` with it (``suggest_key``), the command line an unknown ``--flag``
(``cli/args.py``), and docs/configuration.md ("Names from other tools") holds the table as ``markdown_table()``
writes it (a test compares them).

    >>> answer("warmup_ratio")
    "did you mean 'train.lr_warmup_iters'? (HF Trainer's warmup_ratio is a fraction of the steps; ours is a step count: set train.lr_warmup_iters=<warmup_ratio * train.train_iters>)"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

HF = "TRL / HF Trainer"
MLM = "Megatron-LM"
OURS = "prepare shorthand / short name"


@dataclass(frozen=True, kw_only=True)
class ForeignName:
    """One name from another tool and the key it means here."""

    name: str
    """As typed: a field name (``learning_rate``) or a command-line flag (``--lr``)."""
    source: str
    """The tool it comes from (``HF``, ``MLM`` or ``OURS``)."""
    key: str
    """Our dotted key."""
    differs: str = ""
    """How the meaning differs, and what to write instead (empty: the same meaning)."""
    flag_value: Optional[str] = None
    """For a flag that takes no value (``--bf16``): the value our key takes."""

    def hint(self) -> str:
        """``did you mean 'train.lr'?``, plus how the meaning differs."""
        how = f" ({self.source}'s {self.name} {self.differs})" if self.differs else ""
        return f"did you mean '{self.key}'?{how}"


def _hf(name: str, key: str, differs: str = "") -> ForeignName:
    return ForeignName(name=name, source=HF, key=key, differs=differs)


def _mlm(name: str, key: str, differs: str = "", flag_value: Optional[str] = None) -> ForeignName:
    return ForeignName(name=name, source=MLM, key=key, differs=differs, flag_value=flag_value)


def _ours(name: str, key: str) -> ForeignName:
    return ForeignName(name=name, source=OURS, key=key)


FOREIGN_NAMES: tuple[ForeignName, ...] = (
    _hf("model_name_or_path", "model.pretrained", "may be a hub name; ours is a local Hugging Face folder "
        "(config.json + safetensors), whose tokenizer is used unless data.tokenizer is set"),
    _hf("learning_rate", "train.lr"),
    _hf("num_train_epochs", "train.num_epochs", "may be fractional; ours is a whole number of passes over the "
        "packs (set train.train_iters=null with it)"),
    _hf("max_steps", "train.train_iters"),
    _hf("per_device_train_batch_size", "train.micro_batch_size", "counts samples; here a micro-batch is one pack "
        "of several samples, so it stays 1: set train.global_batch_size (packs per step) instead"),
    _hf("gradient_accumulation_steps", "train.global_batch_size", "has no key here: the micro-batches accumulated "
        "are train.global_batch_size / (train.micro_batch_size * data-parallel size); set "
        "train.global_batch_size=<data-parallel size * gradient_accumulation_steps>"),
    _hf("max_seq_length", "packing.packed_sequence_size", "caps each sample; ours is the tokens of a pack of "
        "several samples (model.seq_length follows it; longer samples follow packing.on_overflow)"),
    _hf("max_length", "packing.packed_sequence_size", "caps each sample; ours is the tokens of a pack of several "
        "samples (model.seq_length follows it; longer samples follow packing.on_overflow)"),
    _hf("eval_steps", "train.eval_interval"),
    _hf("save_steps", "checkpoint.save_interval"),
    _hf("logging_steps", "logging.log_interval"),
    _hf("warmup_ratio", "train.lr_warmup_iters", "is a fraction of the steps; ours is a step count: set "
        "train.lr_warmup_iters=<warmup_ratio * train.train_iters>"),
    _hf("warmup_steps", "train.lr_warmup_iters"),
    _hf("lr_scheduler_type", "train.lr_decay_style", "has more schedules; ours are cosine, linear or constant, "
        "after a linear warmup"),
    _hf("max_grad_norm", "train.clip_grad"),
    _hf("weight_decay", "train.weight_decay"),
    _hf("seed", "train.seed"),
    _hf("output_dir", "train.output_dir"),
    _hf("bf16", "train.bf16"),
    _hf("gradient_checkpointing", "model.recompute_granularity", "is a switch; ours names what is recomputed: "
        "set model.recompute_granularity=full (whole layers) or selective (core attention)"),
    _hf("packing", "packing.mode", "is a switch; packing is always on here: packing.mode=offline (prepared "
        "plan), online or in_batch"),
    _hf("lora_r", "peft.dim"),
    _hf("lora_alpha", "peft.alpha"),
    _hf("lora_dropout", "peft.dropout"),
    _hf("min_learning_rate", "train.min_lr"),
    _mlm("--tensor-model-parallel-size", "parallel.tensor_model_parallel_size"),
    _mlm("--pipeline-model-parallel-size", "parallel.pipeline_model_parallel_size"),
    _mlm("--num-layers-per-virtual-pipeline-stage", "parallel.virtual_pipeline_model_parallel_size",
         "counts layers per chunk; ours counts model chunks per pipeline stage"),
    _mlm("--context-parallel-size", "parallel.context_parallel_size"),
    _mlm("--expert-model-parallel-size", "parallel.expert_model_parallel_size"),
    _mlm("--expert-tensor-parallel-size", "parallel.expert_tensor_parallel_size"),
    _mlm("--sequence-parallel", "parallel.sequence_parallel", flag_value="true"),
    _mlm("--micro-batch-size", "train.micro_batch_size", "counts samples; here a micro-batch is one pack, so it "
         "stays 1 with packs"),
    _mlm("--global-batch-size", "train.global_batch_size", "counts samples; ours counts packs (with "
         "packing.mode=in_batch, samples)"),
    _mlm("--lr", "train.lr"),
    _mlm("--min-lr", "train.min_lr"),
    _mlm("--lr-warmup-iters", "train.lr_warmup_iters"),
    _mlm("--lr-decay-style", "train.lr_decay_style"),
    _mlm("--train-iters", "train.train_iters"),
    _mlm("--seq-length", "model.seq_length", "is any sequence length; ours equals the pack size: set "
         "packing.packed_sequence_size (model.seq_length follows it)"),
    _mlm("--eval-interval", "train.eval_interval"),
    _mlm("--eval-iters", "train.eval_iters"),
    _mlm("--save-interval", "checkpoint.save_interval"),
    _mlm("--save", "checkpoint.save"),
    _mlm("--load", "checkpoint.load"),
    _mlm("--tokenizer-model", "data.tokenizer", "is a tokenizer file; ours is a Hugging Face tokenizer folder"),
    _mlm("--data-path", "data.input", "is an indexed dataset; ours is a raw JSONL / Parquet file that "
         "`megatron-pack prepare` tokenizes"),
    _mlm("--bf16", "train.bf16", flag_value="true"),
    _mlm("--clip-grad", "train.clip_grad"),
    _mlm("--weight-decay", "train.weight_decay"),
    _mlm("--seed", "train.seed"),
    _mlm("--use-distributed-optimizer", "ddp.use_distributed_optimizer", flag_value="true"),
    _mlm("--recompute-granularity", "model.recompute_granularity"),
    _mlm("--num-layers", "model.num_layers", "builds a new model; a pretrained one takes its layers from "
         "model.pretrained's config.json"),
    _mlm("--num-experts", "model.num_experts", "builds a new model; a pretrained one takes its experts from "
         "model.pretrained's config.json"),
    _ours("lr", "train.lr"),
    _ours("num_steps", "train.train_iters"),
    _ours("steps", "train.train_iters"),
    _ours("warmup_iters", "train.lr_warmup_iters"),
    _ours("batch_size", "train.global_batch_size"),
    _ours("pack_size", "packing.packed_sequence_size"),
    _ours("seq_length", "model.seq_length"),
    _ours("tp", "parallel.tensor_model_parallel_size"),
    _ours("tensor_parallel_size", "parallel.tensor_model_parallel_size"),
    _ours("cp", "parallel.context_parallel_size"),
    _ours("context_parallel_size", "parallel.context_parallel_size"),
    _ours("output", "data.dataset_dir"),
    _ours("dataset_dir", "data.dataset_dir"),
    _ours("input", "data.input"),
    _ours("dataset", "data.input"),
    _ours("tokenizer", "data.tokenizer"),
    _ours("save", "checkpoint.save"),
    _ours("load", "checkpoint.load"),
    _ours("resume", "checkpoint.load"),
)
"""Every name from another tool answered with our key (reviewed: each was checked against the tool's docs)."""

_BY_NAME = {f.name: f for f in FOREIGN_NAMES}


def foreign_name(typed: str) -> Optional[ForeignName]:
    """The entry for ``typed``: a field name (its last dotted part: ``train.learning_rate``) or a flag
    (``--tensor-model-parallel-size``, ``--lr=1e-4``); None when it comes from no tool we know."""
    typed = typed.split("=", 1)[0]
    if typed.startswith("-"):
        return _BY_NAME.get("--" + typed.lstrip("-").replace("_", "-"))
    return _BY_NAME.get(typed.rsplit(".", 1)[-1].lstrip("+~"))


def answer(typed: str) -> Optional[str]:
    """The hint for ``typed`` (``did you mean 'train.lr'?`` and how the meaning differs), or None."""
    entry = foreign_name(typed)
    return entry.hint() if entry else None


def flag_override(argv: list[str], i: int) -> Optional[str]:
    """The ``key=value`` a Megatron-LM flag at ``argv[i]`` means (``--lr 1e-4`` -> ``train.lr=1e-4``), or None."""
    entry = foreign_name(argv[i])
    if entry is None or entry.source != MLM:
        return None
    if "=" in argv[i]:
        return f"{entry.key}={argv[i].split('=', 1)[1]}"
    if entry.flag_value is not None:
        return f"{entry.key}={entry.flag_value}"
    after = argv[i + 1] if i + 1 < len(argv) else ""
    value = after if after and "=" not in after and not after.startswith("-") else "<value>"
    return f"{entry.key}={value}"


def markdown_table() -> str:
    """The table docs/configuration.md shows ("Names from other tools")."""
    rows = ["| you typed | from | our key | how the meaning differs |", "|---|---|---|---|"]
    rows += [f"| `{f.name}` | {f.source} | `{f.key}` | {f.differs or 'the same'} |" for f in FOREIGN_NAMES]
    return "\n".join(rows)
