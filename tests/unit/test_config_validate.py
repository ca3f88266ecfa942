"""Every cross-group validator: a passing and a failing case each, messages name key and fix."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config import Config, ConfigError, validate
from megatron_pack.config.host import Host
from megatron_pack.config.layout import pad_multiple

# The package re-exports the function ``validate``, which shadows the module's attribute name.
validate_module = importlib.import_module("megatron_pack.config.validate")


def make(**dotted) -> Config:
    """``make(parallel__context_parallel_size=2)``: the default Config with fields replaced."""
    by_group: dict[str, dict] = {}
    for key, value in dotted.items():
        group, name = key.split("__")
        by_group.setdefault(group, {})[name] = value
    base = Config()
    return Config(**{f.name: dataclasses.replace(getattr(base, f.name), **by_group.get(f.name, {}))
                     for f in dataclasses.fields(Config)})


CP2_TP4_SP = dict(parallel__context_parallel_size=2, parallel__tensor_model_parallel_size=4,
                  parallel__sequence_parallel=True, model__num_query_groups=4)
GRAPHS = dict(model__cuda_graph_impl="local", data__pad_to_max_length=True)
SOURCES = [{"name": "chat", "input": "chat.jsonl", "weight": 0.7}, {"name": "code", "input": "code.jsonl", "weight": 0.3}]
VLM = dict(model__mrope_section=[2, 3, 3], model__mrope_interleaved=True, model__image_token_id=5,
           model__pretrained="models/qwen3-vl")  # what a Qwen3-VL config.json sets (the folder is not read here)
CPU_HOST = Host(gpu=False, transformer_engine=False)
GPU_TE = Host(gpu=True, transformer_engine=True)
GPU_NO_TE = Host(gpu=True, transformer_engine=False)
GPU_TE_NONDETERMINISTIC = Host(gpu=True, transformer_engine=True, nvte_allow_nondeterministic="1")
META_OK = {"pack_size": 512, "max_samples_per_bin": 7, "pad_seq_to_mult": 4, "vocab_size": 260}

# (rule, config overrides, extra kwargs for the rule, fragments the problem must contain; () = passes)
CASES = [
    ("verify_reference", dict(verify__reference="self"), {}, ()),
    ("verify_reference", dict(verify__reference="transformers"), {},
     ("verify.reference (transformers) needs model.pretrained=DIR", "verify.reference=self")),
    ("verify_reference", dict(verify__reference="transformers", model__pretrained="models/x", verify__checkpoint="ck"),
     {}, ("verify.checkpoint (ck) with verify.reference=transformers", "megatron-pack export")),


    ("evaluation", dict(data__validation_fraction=0.1, train__eval_interval=5, train__eval_iters=2), {}, ()),
    ("evaluation", {}, {}, ()),
    ("evaluation", dict(train__eval_interval=5), {},
     ("train.eval_interval (5) has no validation set", "set data.validation=/path/to/valid.jsonl",
      "or train.eval_interval=0")),
    ("evaluation", dict(data__validation="v.jsonl", packing__mode="in_batch", train__micro_batch_size=4), {},
     ("data.validation needs packs", "set packing.mode=offline or unset data.validation")),
    ("evaluation", dict(data__source="files", data__sources=SOURCES, data__validation_fraction=0.1), {}, ()),
    # one validation file beside mixed sources: one validation loss (the file has no sources to split it by)
    ("evaluation", dict(data__source="files", data__sources=SOURCES, data__validation="v.jsonl"), {}, ()),
    ("world_size", dict(parallel__tensor_model_parallel_size=2, parallel__context_parallel_size=2),
     dict(world_size=8), ()),
    ("world_size", dict(parallel__tensor_model_parallel_size=2, parallel__context_parallel_size=2),
     dict(world_size=6), ("world size (6)", "2*2*1 = 4", "launch 4 or 8 ranks")),
    ("world_size", {}, dict(world_size=None), ()),
    ("pipeline_parallel", {}, {}, ()),
    ("pipeline_parallel", dict(parallel__pipeline_model_parallel_size=2), {}, ()),
    ("pipeline_parallel", dict(parallel__pipeline_model_parallel_size=4, model__num_layers=4), {}, ()),
    ("pipeline_parallel", dict(parallel__pipeline_model_parallel_size=3), {},
     ("model.num_layers (2) must be a multiple of parallel.pipeline_model_parallel_size (3)",
      "set parallel.pipeline_model_parallel_size to one of [2]")),
    ("pipeline_parallel", dict(parallel__pipeline_model_parallel_size=2, peft__method="lora",
                               model__pretrained="models/tiny"), {}, ()),  # LoRA on every stage
    ("pipeline_parallel", dict(parallel__pipeline_model_parallel_size=2, **GRAPHS), {},
     ("model.cuda_graph_impl (local) with parallel.pipeline_model_parallel_size (2) > 1",
      "set model.cuda_graph_impl=none")),
    ("pipeline_parallel", dict(parallel__pipeline_model_parallel_size=2, model__fp8="delayed"), {},
     ("model.fp8 (delayed) with parallel.pipeline_model_parallel_size (2) > 1", "set model.fp8=none")),
    ("virtual_pipeline", {}, dict(world_size=4), ()),
    ("virtual_pipeline", dict(parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=2,
                              model__num_layers=4), dict(world_size=4), ()),
    ("virtual_pipeline", dict(parallel__virtual_pipeline_model_parallel_size=2, model__num_layers=4), {},
     ("parallel.virtual_pipeline_model_parallel_size (2) needs parallel.pipeline_model_parallel_size > 1",
      "set parallel.pipeline_model_parallel_size=2 or parallel.virtual_pipeline_model_parallel_size=null")),
    ("virtual_pipeline", dict(parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=2,
                              model__num_layers=6), {},
     ("model.num_layers (6) must be a multiple of parallel.pipeline_model_parallel_size (2) x "
      "parallel.virtual_pipeline_model_parallel_size (2) = 4",
      "set parallel.virtual_pipeline_model_parallel_size to one of [3] or model.num_layers=8")),
    ("virtual_pipeline", dict(parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=2,
                              model__num_layers=4, train__global_batch_size=6), dict(world_size=4),
     ("train.global_batch_size (6) gives 3 micro-batches per data-parallel rank",
      "multiple of parallel.pipeline_model_parallel_size (2)", "set train.global_batch_size=8")),
    ("virtual_pipeline", dict(parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=2,
                              model__num_layers=4, train__global_batch_size=2), dict(world_size=2),
     ("train.global_batch_size (2) gives 2 micro-batches per data-parallel rank", "all in its warm-up",
      "deadlocks", "set train.global_batch_size=4 (or data.pad_to_max_length=true")),
    ("virtual_pipeline", dict(parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=2,
                              model__num_layers=4, train__global_batch_size=2, data__pad_to_max_length=True,
                              packing__pad_cu_seqlens=True), dict(world_size=2), ()),
    ("virtual_pipeline", dict(parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=2,
                              model__num_layers=4, train__global_batch_tokens=4096), {},
     ("train.global_batch_tokens (4096) with parallel.virtual_pipeline_model_parallel_size (2)",
      "the interleaved schedule needs the same micro-batch count")),
    ("virtual_pipeline", dict(parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=2,
                              model__num_layers=4, peft__method="lora"), {},
     ("peft.method (lora) with parallel.virtual_pipeline_model_parallel_size (2)", "not yet with virtual stages",
      "set parallel.virtual_pipeline_model_parallel_size=null or peft.method=none")),
    ("pipeline_parallel", dict(parallel__pipeline_model_parallel_size=2, model__num_experts=4), {}, ()),
    ("virtual_pipeline", dict(parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=2,
                              model__num_layers=4, model__num_experts=4), {},
     ("model.num_experts (4) with parallel.virtual_pipeline_model_parallel_size (2)", "not yet with virtual stages",
      "set parallel.virtual_pipeline_model_parallel_size=null")),
    ("context_parallel", dict(parallel__context_parallel_size=2), {}, ()),
    ("context_parallel", dict(parallel__context_parallel_size=4, packing__mode="in_batch", train__micro_batch_size=4, model__seq_length=20),
     {}, ("model.seq_length (20)", "2*parallel.context_parallel_size = 8", "set model.seq_length=24")),
    ("per_token_loss", dict(parallel__context_parallel_size=2), {}, ()),
    ("per_token_loss", dict(parallel__context_parallel_size=2, model__calculate_per_token_loss=False), {},
     ("model.calculate_per_token_loss (False)", "parallel.context_parallel_size=2", "set model.calculate_per_token_loss=true")),
    # per-token loss off trained 0.5x gradients at DP=2 with packing (issue 10): refused at CP=1 too
    ("per_token_loss", dict(model__calculate_per_token_loss=False), {},
     ("model.calculate_per_token_loss (False)", "packing.mode=offline", "set model.calculate_per_token_loss=true")),
    ("per_token_loss", dict(model__calculate_per_token_loss=False, packing__mode="in_batch", train__micro_batch_size=4), {},
     ("model.calculate_per_token_loss (False)", "packing.mode=in_batch", "set model.calculate_per_token_loss=true")),
    ("per_token_loss", dict(packing__mode="in_batch", train__micro_batch_size=4), {}, ()),
    ("per_token_loss", dict(ddp__average_in_collective=True), {},
     ("ddp.average_in_collective (True)", "set ddp.average_in_collective=false")),
    ("offline_packing", {}, {}, ()),
    ("offline_packing", dict(train__micro_batch_size=2), {},
     ("train.micro_batch_size (2)", "set train.micro_batch_size=1", "train.global_batch_size (e.g. 16)")),
    ("offline_packing", dict(packing__mode="in_batch", train__micro_batch_size=4, data__pad_to_max_length=True), {},
     ("data.pad_to_max_length (True)", "packing.mode=in_batch", "set packing.mode=offline (or online)")),
    ("packing_strategy", dict(packing__on_overflow="split", packing__split_overlap=16, packing__buckets=[128],
                              packing__bucket_order="sequential"), {}, ()),
    ("packing_strategy", dict(packing__algorithm="wrapped", packing__wrapped_attention="cross",
                              data__answer_only_loss=False), {}, ()),
    ("packing_strategy", dict(packing__split_overlap=8), {},
     ("packing.split_overlap (8)", "set packing.on_overflow=split or packing.split_overlap=0")),
    ("packing_strategy", dict(packing__on_overflow="split", packing__split_overlap=512), {},
     ("packing.split_overlap (512)", "must be smaller than the longest piece (512 tokens)")),
    ("packing_strategy", dict(packing__algorithm="wrapped", packing__wrapped_attention="cross"), {},
     ("packing.wrapped_attention=cross with data.answer_only_loss=true is refused", "set data.answer_only_loss=false")),
    ("packing_strategy", dict(packing__algorithm="wrapped", packing__buckets="auto"), {},
     ("packing.buckets cannot be used with packing.algorithm=wrapped",)),
    ("packing_strategy", dict(packing__algorithm="wrapped", packing__on_overflow="drop"), {},
     ("packing.on_overflow (drop) does not apply", "set packing.on_overflow=split")),
    # wrapped pieces repeat no context: an overlap masked 612 of 5223 targets on 60 records at pack 64
    ("packing_strategy", dict(packing__algorithm="wrapped", packing__on_overflow="split", packing__split_overlap=8),
     {}, ("packing.split_overlap (8) does not apply to packing.algorithm=wrapped", "set packing.split_overlap=0")),
    ("packing_strategy", dict(packing__wrapped_attention="cross"), {},
     ("packing.wrapped_attention (cross) only applies with packing.algorithm=wrapped",)),
    ("packing_strategy", dict(packing__on_overflow="split", packing__export="bridge"), {}, ()),
    ("packing_strategy", dict(packing__algorithm="wrapped", packing__export="bridge"), {}, ()),
    ("packing_strategy", dict(packing__algorithm="wrapped", packing__wrapped_attention="cross", packing__export="bridge",
                              data__answer_only_loss=False), {},
     ("packing.export=bridge cannot carry packing.wrapped_attention=cross rows", "set packing.wrapped_attention=document "
      "or packing.export=none")),
    ("packing_strategy", dict(packing__bucket_order="sequential"), {},
     ("packing.bucket_order (sequential) needs length buckets", "set packing.buckets=auto")),
    # issue 23: packs made at run time have no buckets; the order was silently ignored there
    ("packing_strategy", dict(packing__mode="online", packing__buckets="auto", packing__bucket_order="sequential"), {},
     ("packing.buckets (auto) and packing.bucket_order (sequential) sort the packs of a prepared plan",
      "packing.mode=online makes its packs at run time", "or set packing.mode=offline")),
    ("in_batch_packing", dict(packing__mode="in_batch", train__micro_batch_size=4), {}, ()),
    ("online_packing", dict(packing__mode="online"), {}, ()),
    ("online_packing", dict(packing__mode="online", packing__balance="dp", train__global_batch_tokens=4096,
                            data__num_workers=2), {}, ()),
    ("online_packing", dict(packing__mode="online", packing__pad_cu_seqlens=True, data__pad_to_max_length=True), {}, ()),
    ("online_packing", dict(packing__mode="online", packing__pad_cu_seqlens=True, data__pad_to_max_length=True,
                            packing__max_samples_per_pack=16), {}, ()),
    ("online_packing", dict(packing__mode="online", packing__on_overflow="split"), {},
     ("packing.on_overflow (split) cuts over-long samples", "set packing.on_overflow=truncate")),
    ("online_packing", dict(packing__max_samples_per_pack=16), {},
     ("packing.max_samples_per_pack (16) caps packs made at run time", "set packing.mode=online")),
    ("online_packing", dict(packing__mode="online", packing__buffer_tokens=100), {},
     ("packing.buffer_tokens (100)", "set packing.buffer_tokens=8192")),
    ("step_batches", dict(train__global_batch_tokens=4096, packing__balance="dp"), {}, ()),
    ("step_batches", dict(train__global_batch_tokens=4096, packing__mode="in_batch", train__micro_batch_size=4), {},
     ("train.global_batch_tokens (4096) needs packs", "unset train.global_batch_tokens")),
    ("step_batches", dict(packing__balance="dp", packing__mode="in_batch", train__micro_batch_size=4), {},
     ("packing.balance (dp) needs packs", "packing.balance=none")),
    ("in_batch_packing", dict(packing__mode="in_batch"), {},
     ("train.micro_batch_size (1)", "set train.micro_batch_size=4")),
    # issue 23: train.num_epochs online passed validate() and raised ValueError once process groups had started
    ("epochs", dict(train__train_iters=None, train__num_epochs=2, packing__balance="dp", train__global_batch_tokens=4096),
     {}, ()),
    ("epochs", dict(train__train_iters=None, train__num_epochs=2, packing__mode="online"), {},
     ("train.num_epochs (2) needs the packs of an epoch counted before the run", "packing.mode=online",
      "set train.train_iters=<steps> train.num_epochs=null")),
    ("pad_cu_seqlens", dict(packing__pad_cu_seqlens=True, data__pad_to_max_length=True), {}, ()),
    ("pad_cu_seqlens", dict(packing__pad_cu_seqlens=True), {},
     ("packing.pad_cu_seqlens (True)", "set data.pad_to_max_length=true")),
    ("cuda_graphs", dict(GRAPHS, packing__pad_cu_seqlens=True), {}, ()),
    ("cuda_graphs", dict(GRAPHS, model__cuda_graph_scope=["mlp"]), {}, ()),
    ("cuda_graphs", dict(model__cuda_graph_impl="local"), {},
     ("model.cuda_graph_impl (local)", "set data.pad_to_max_length=true", "set packing.pad_cu_seqlens=true")),
    ("cuda_graphs", dict(GRAPHS, model__cuda_graph_scope=["attn"]), {},
     ("model.cuda_graph_scope=['attn']", "set packing.pad_cu_seqlens=true", "model.cuda_graph_scope=[mlp]")),
    ("cuda_graphs", dict(model__cuda_graph_impl="transformer_engine", packing__mode="in_batch", train__micro_batch_size=4), {},
     ("model.cuda_graph_impl (transformer_engine)", "set model.cuda_graph_impl=none")),
    ("pad_multiple", dict(CP2_TP4_SP, packing__pad_seq_to_mult=8), {}, ()),
    ("pad_multiple", dict(CP2_TP4_SP, packing__pad_seq_to_mult=4), {},
     ("packing.pad_seq_to_mult (4) must be a multiple of lcm(2*cp=4, cp*tp=8) = 8 for cp=2, tp=4 with "
      "sequence_parallel; set packing.pad_seq_to_mult=8",)),
    ("pad_multiple", dict(parallel__context_parallel_size=2, packing__pad_seq_to_mult=6), {},
     ("packing.pad_seq_to_mult (6)", "= 4 for cp=2, tp=1;", "set packing.pad_seq_to_mult=8")),
    ("packed_sizes", {}, {}, ()),
    ("packed_sizes", dict(packing__packed_sequence_size=510, model__seq_length=510, packing__pad_seq_to_mult=4), {},
     ("packing.packed_sequence_size (510)", "pad multiple 4", "set packing.packed_sequence_size=512")),
    ("packed_sizes", dict(packing__max_single_sequence_length=1024), {},
     ("packing.max_single_sequence_length (1024)", "set packing.max_single_sequence_length=512")),
    ("packed_sizes", dict(model__seq_length=256), {},
     ("model.seq_length (256) must equal packing.packed_sequence_size (512)", "set model.seq_length=512")),
    ("tensor_parallel", dict(parallel__tensor_model_parallel_size=2), {}, ()),
    ("tensor_parallel", dict(parallel__tensor_model_parallel_size=8), {},
     ("model.num_attention_heads (4)", "parallel.tensor_model_parallel_size (8)", "set parallel.tensor_model_parallel_size")),
    ("tensor_parallel", dict(parallel__tensor_model_parallel_size=4), {},
     ("model.num_query_groups (2)", "set parallel.tensor_model_parallel_size to a divisor of 2")),
    ("linear_attention", dict(model__full_attention_interval=4, parallel__tensor_model_parallel_size=2), {}, ()),
    ("linear_attention", dict(model__full_attention_interval=4, model__linear_num_key_heads=2,
                              parallel__tensor_model_parallel_size=2, parallel__context_parallel_size=2), {},
     ("model.linear_num_key_heads (2) must be divisible", "choose TP x CP dividing 2")),
    ("deepstack", dict(VLM, model__deepstack_layers=1, parallel__pipeline_model_parallel_size=2), {}, ()),
    ("deepstack", dict(VLM, model__deepstack_layers=2, parallel__pipeline_model_parallel_size=2), {},
     ("puts 1 of 2 layers on the first stage", "layers 0..1", "choose stages of at least 2 layers")),
    ("sequence_parallel", dict(parallel__sequence_parallel=True, parallel__tensor_model_parallel_size=2), {}, ()),
    ("sequence_parallel", dict(parallel__sequence_parallel=True), {},
     ("parallel.sequence_parallel (True)", "set parallel.sequence_parallel=false")),
    ("batch_size", {}, dict(world_size=4), ()),
    ("batch_size", {}, dict(world_size=3),
     ("train.global_batch_size (8)", "1*3", "set train.global_batch_size=9")),
    ("device", dict(train__device="cpu"), {}, ()),
    ("device", dict(train__device="cpu", model__attention_backend="te", parallel__backend="nccl"), {},
     ("model.attention_backend (te)", "set model.attention_backend=auto", "set parallel.backend=gloo")),
    ("dataset_meta", dict(parallel__context_parallel_size=2, packing__pad_cu_seqlens=True,
                          data__pad_to_max_length=True), dict(meta=META_OK), ()),
    ("dataset_meta", dict(packing__pad_cu_seqlens=True, data__pad_to_max_length=True), dict(meta={}),
     ("packing.pad_cu_seqlens (True) needs max_samples_per_bin", "data.dataset_dir (data/synthetic)",
      "re-run `megatron-pack prepare`")),
    ("dataset_meta", {}, dict(meta=dict(META_OK, pack_size=1024)),
     ("packing.packed_sequence_size (512)", "pack_size=1024", "set packing.packed_sequence_size=1024")),
    ("dataset_meta", dict(parallel__context_parallel_size=2), dict(meta=dict(META_OK, pad_seq_to_mult=2)),
     ("pad_seq_to_mult=2", "lcm(2*cp=4) = 4", "re-run `megatron-pack prepare`")),
    ("dataset_meta", dict(parallel__context_parallel_size=2, packing__pad_seq_to_mult=8), dict(meta=META_OK),
     ("packing.pad_seq_to_mult (8) does not divide pad_seq_to_mult=4", "set packing.pad_seq_to_mult=4")),
    ("dataset_meta", {}, dict(meta=dict(META_OK, vocab_size=50000)),
     ("model.vocab_size (384)", "set model.vocab_size=50000")),
    # item 10 of issue 11: refused late (builder, loop) before; refused by validate() now
    ("vocab_size", dict(parallel__tensor_model_parallel_size=2, model__vocab_size=384), {}, ()),
    ("vocab_size", dict(parallel__tensor_model_parallel_size=2, model__vocab_size=385), {},
     ("model.vocab_size (385)", "parallel.tensor_model_parallel_size (2)", "set model.vocab_size=386")),
    ("vocab_size", dict(parallel__tensor_model_parallel_size=4, model__vocab_size=258, model__num_query_groups=4), {},
     ("model.vocab_size (258)", "set model.vocab_size=260")),
    ("attention_backend", dict(model__attention_backend="te"), {}, ()),
    ("attention_backend", dict(model__attention_backend="torch", **GRAPHS, packing__pad_cu_seqlens=True), {},
     ("model.cuda_graph_impl (local) needs the Transformer Engine backend", "set model.attention_backend=te")),
    ("attention_backend", dict(model__attention_backend="te", verify__attention="pack_causal"), {},
     ("verify.attention (pack_causal)", "set model.attention_backend=torch")),
    # issue 27: model.fp8 (the pack-size and dataset rules are table-driven in tests/unit/test_fp8_pack_rule.py)
    ("fp8", dict(model__fp8="delayed"), {}, ()),
    ("fp8", dict(model__fp8="current", model__attention_backend="torch"), {},
     ("model.fp8 (current) runs Transformer Engine's FP8 linear layers", "model.attention_backend=torch",
      "set model.attention_backend=auto (or te)")),
    ("fp8", dict(model__fp8="delayed", model__normalization="LayerNorm"), {},
     ("model.fp8 (delayed) with model.normalization=LayerNorm", "set model.normalization=RMSNorm")),
    ("fp8", dict(model__fp8="mxfp8", parallel__tensor_model_parallel_size=2), {},
     ("linear_fc2's weight is [64, 88] per TP rank (tp=2)", "a multiple of 16")),
    ("packed_sizes", dict(model__fp8="delayed", parallel__context_parallel_size=2), {}, ()),
    ("packed_sizes", dict(model__fp8="mxfp8", parallel__context_parallel_size=2, packing__packed_sequence_size=504,
                          model__seq_length=504), {},
     ("packing.packed_sequence_size (504) must be divisible by the pack multiple 64 = cp*32 = 2*32 = 64 "
      "(model.fp8=mxfp8)", "set packing.packed_sequence_size=512 and model.seq_length=512")),
    ("device", dict(train__device="cpu", model__fp8="blockwise"), {},
     ("model.fp8 (blockwise) needs CUDA and Transformer Engine", "set model.fp8=none")),
    # issue 34 item 4: the host a run starts on (train, verify and the launch scripts probe it before launch)
    ("device", dict(model__fp8="delayed"), dict(host=CPU_HOST),
     ("model.fp8 (delayed) needs CUDA and Transformer Engine", "train.device=auto finds no GPU on this host",
      "set model.fp8=none")),
    ("device", dict(model__fp8="delayed"), dict(host=GPU_TE), ()),
    ("device", dict(model__fp8="delayed", model__cuda_graph_impl="local", data__pad_to_max_length=True,
                    packing__pad_cu_seqlens=True), dict(host=GPU_NO_TE),
     ("model.fp8 (delayed) needs Transformer Engine, which is not installed", "set model.fp8=none",
      "model.cuda_graph_impl (local) needs Transformer Engine")),
    ("device", dict(train__device="cuda"), dict(host=CPU_HOST), ("train.device (cuda) needs a GPU",
                                                                  "set train.device=cpu (or auto)")),
    ("device", dict(model__attention_backend="te"), dict(host=GPU_TE_NONDETERMINISTIC),
     ("NVTE_ALLOW_NONDETERMINISTIC_ALGO=0", "set train.deterministic=false")),
    ("device", dict(parallel__backend="nccl"), dict(host=CPU_HOST), ("parallel.backend (nccl) needs CUDA",)),
    ("trackers", dict(logging__wandb=True, logging__mlflow=True),
     dict(host=Host(gpu=False, transformer_engine=False, packages=frozenset({"wandb", "mlflow"}))), ()),
    ("trackers", dict(logging__mlflow=True), dict(host=Host(gpu=False, transformer_engine=False, packages=frozenset())),
     ("logging.mlflow=true needs the mlflow package", "pip install 'megatron-pack[mlflow]', or set logging.mlflow=false")),
    ("verify_layout", dict(parallel__pipeline_model_parallel_size=2), dict(command="train", world_size=2), ()),
    ("verify_layout", dict(parallel__pipeline_model_parallel_size=2), dict(command="verify", world_size=2), ()),
    ("verify_layout", dict(parallel__pipeline_model_parallel_size=2, verify__checkpoint="ck"),
     dict(command="verify", world_size=2),
     ("parallel.pipeline_model_parallel_size (2) > 1 with verify.checkpoint (ck)", "launch it with TP = PP = EP = 1",
      "verify.reference=transformers")),
    ("verify_layout", dict(parallel__context_parallel_size=2, verify__checkpoint="ck"),
     dict(command="verify", world_size=2), ()),
    ("prepare_input", {}, dict(command="prepare"), ()),
    ("prepare_input", dict(data__source="files"), dict(command="prepare"),
     ("data.input (None) is required by prepare", "set data.input=/path/to/train.jsonl")),
    ("dataset_meta", dict(model__fp8="delayed", parallel__context_parallel_size=2),
     dict(meta=dict(META_OK, pack_multiple=32)), ()),
    ("dataset_meta", dict(model__fp8="delayed", parallel__context_parallel_size=2), dict(meta=META_OK),
     ("model.fp8 (delayed): the dataset was planned with packs padded to a multiple of 4 tokens",
      "this run needs 32", "re-run `megatron-pack prepare` with this config and model.fp8=delayed")),
    # issue 35: a dataset with images trains offline or in-batch, never online
    ("image_dataset", {}, dict(meta={"images": {"num_images": 6}}), ()),
    ("image_dataset", dict(packing__mode="online"), dict(meta={"images": {"num_images": 6}}),
     ("packing.mode (online) packs token streams without their images", "holds 6 images",
      "set packing.mode=offline (train.micro_batch_size=1) or packing.mode=in_batch")),
    # issue 25: mixture of experts
    ("moe", dict(model__num_experts=4, parallel__context_parallel_size=2), {}, ()),
    ("moe", dict(model__num_experts=4, parallel__tensor_model_parallel_size=2), {},
     ("parallel.tensor_model_parallel_size (2) without parallel.sequence_parallel with a MoE model",
      "set parallel.sequence_parallel=true")),
    ("moe", dict(model__num_experts=4, peft__method="lora"), {}, ()),  # LoRA on attention and every expert
    ("moe", dict(model__num_experts=4, peft__method="lora", parallel__tensor_model_parallel_size=2,
                 parallel__sequence_parallel=True), {}, ()),  # expert adapters split over expert TP 2 (= TP)
    ("moe", dict(model__num_experts=4, peft__method="lora", parallel__tensor_model_parallel_size=2,
                 parallel__sequence_parallel=True, parallel__expert_model_parallel_size=2), {},
     ("peft.target_modules (['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2']) with expert tensor parallel "
      "size 2 and parallel.expert_model_parallel_size (2) with a MoE model", "split over expert TP and EP at once",
      "set parallel.expert_tensor_parallel_size=1 (whole experts) or parallel.expert_model_parallel_size=1 or "
      "peft.target_modules=[linear_qkv,linear_proj]")),
    ("moe", dict(model__num_experts=4, peft__method="lora", parallel__tensor_model_parallel_size=2,
                 parallel__sequence_parallel=True, parallel__expert_tensor_parallel_size=1,
                 parallel__expert_model_parallel_size=2), {}, ()),  # whole experts: expert adapters whole too
    ("moe", dict(model__num_experts=4, peft__method="lora", peft__target_modules=["linear_fc2"], peft__dropout=0.1),
     {}, ("peft.dropout (0.1) with peft.target_modules (['linear_fc2']) with a MoE model",
          "ParamWrapper has no dropout", "set peft.dropout=0 or peft.target_modules=[linear_qkv,linear_proj]")),
    ("moe", dict(model__num_experts=4, peft__method="lora", peft__target_modules=["linear_qkv"], peft__dropout=0.1,
                 parallel__tensor_model_parallel_size=2, parallel__sequence_parallel=True), {}, ()),
    ("moe", dict(model__num_experts=4, peft__method="lora", peft__target_modules=["linear_qkv", "linear_proj"]), {},
     ()),
    ("moe", dict(model__num_experts=4, ddp__use_distributed_optimizer=True,
                 parallel__expert_model_parallel_size=2), {}, ()),  # experts sharded over expert-DP (optim.py)
]


def _case_id(case) -> str:
    rule, overrides, kwargs, fragments = case
    return f"{rule}-{'fail' if fragments else 'pass'}-" + "-".join(f"{k.split('__')[1]}" for k in overrides)[:60]


def _run_rule(rule: str, cfg: Config, kwargs: dict) -> list[str]:
    fn = getattr(validate_module, f"_validate_{rule}")
    return fn(cfg, *kwargs.values())


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_rule(case):
    rule, overrides, kwargs, fragments = case
    cfg = make(**overrides)
    problems = _run_rule(rule, cfg, kwargs)
    validate_kwargs = dict(world_size=kwargs.get("world_size"), dataset_meta=kwargs.get("meta"), host=kwargs.get("host"),
                           command=kwargs.get("command"))
    if not fragments:
        assert problems == []
        validate(cfg, **validate_kwargs)  # the passing case is a fully valid config
        return
    assert problems, f"_validate_{rule} found nothing for {overrides}"
    joined = "\n".join(problems)
    for fragment in fragments:
        assert fragment in joined
    with pytest.raises(ConfigError) as info:
        validate(cfg, **validate_kwargs)
    for problem in problems:  # validate reports what the rule found, among any others
        assert problem in info.value.problems


def test_every_rule_has_a_passing_and_a_failing_case():
    rules = {name[len("_validate_"):] for name, _ in inspect.getmembers(validate_module, inspect.isfunction)
             if name.startswith("_validate_")}
    assert len(rules) >= 14
    passing = {c[0] for c in CASES if not c[3]}
    failing = {c[0] for c in CASES if c[3]}
    assert rules == passing == failing


def test_several_problems_reported_together():
    cfg = make(parallel__context_parallel_size=2, model__calculate_per_token_loss=False, train__micro_batch_size=2,
               parallel__sequence_parallel=True, packing__pad_cu_seqlens=True, packing__pad_seq_to_mult=2,
               train__global_batch_size=7)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=3)
    keys = ["world size (3)", "model.calculate_per_token_loss", "train.micro_batch_size (2)",
            "parallel.sequence_parallel (True)", "packing.pad_cu_seqlens (True)", "packing.pad_seq_to_mult (2)",
            "train.global_batch_size (7)"]
    assert len(info.value.problems) >= len(keys)
    text = str(info.value)
    assert text.startswith(f"{len(info.value.problems)} config problem(s):")
    for key in keys:
        assert key in text
    assert isinstance(info.value, ValueError)


def test_default_config_is_valid():
    validate(Config(), world_size=1, dataset_meta={"pack_size": 512, "pad_seq_to_mult": 1})


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 8), tp=st.integers(1, 8), sp=st.booleans(), factor=st.integers(1, 6), delta=st.integers(1, 7))
def test_pad_multiple_rule_property(cp, tp, sp, factor, delta):
    """Every multiple of the lcm rule passes; every non-multiple fails and names the rule's value."""
    required = pad_multiple(cp, tp, sp)
    layout = dict(parallel__context_parallel_size=cp, parallel__tensor_model_parallel_size=tp,
                  parallel__sequence_parallel=sp)
    assert validate_module._validate_pad_multiple(make(**layout, packing__pad_seq_to_mult=required * factor)) == []
    bad = required * factor + delta
    problems = validate_module._validate_pad_multiple(make(**layout, packing__pad_seq_to_mult=bad))
    if bad % required:
        assert len(problems) == 1 and f"= {required} for cp={cp}, tp={tp}" in problems[0]
        fix = int(problems[0].split("set packing.pad_seq_to_mult=")[1].split(" ")[0].rstrip("."))
        assert fix % required == 0 and fix >= bad
    else:
        assert problems == []


# (what the late check was, how it is reached now) -- the backstops give validate()'s message
def test_builder_backstop_gives_the_validate_message():
    from megatron_pack.model import builder

    cfg = make(parallel__tensor_model_parallel_size=2, model__vocab_size=385)
    with pytest.raises(ConfigError) as info:
        builder._check_divisibility(cfg)
    assert info.value.problems == validate_module._validate_vocab_size(cfg) != []


def test_validate_parallel_is_validate_world_rules():
    """initialize_parallel's check (validate_parallel) reports exactly validate()'s layout problems."""
    cfg = make(parallel__pipeline_model_parallel_size=2, parallel__sequence_parallel=True,
               parallel__context_parallel_size=2)
    with pytest.raises(ConfigError) as info:
        validate_module.validate_parallel(cfg.parallel, world_size=3)
    assert len(info.value.problems) == 2  # world size and sequence parallelism; PP itself is a whole-config rule
    with pytest.raises(ConfigError) as full:
        validate(cfg, world_size=3)
    assert set(info.value.problems) <= set(full.value.problems)
    validate_module.validate_parallel(make().parallel, world_size=4)  # a valid layout passes

def _apply_fixes(cfg: Config, problems: list[str]) -> tuple[Config, int]:
    """``cfg`` with every ``set group.key=<int>`` a message names applied; and how many were applied."""
    import re

    changes = {}
    for text in problems:
        for key, value in re.findall(r"(?:set|and) ([a-z]+\.[a-z_]+)=(\d+)", text):
            changes[key.replace(".", "__")] = int(value)
    fields = {f"{g}__{f.name}": getattr(getattr(cfg, g), f.name)
              for g in ("packing", "model", "parallel") for f in dataclasses.fields(getattr(cfg, g))}
    return make(**{**{k: v for k, v in fields.items() if k.startswith(("packing", "model", "parallel"))},
                   **changes}), len(changes)


@settings(max_examples=150, deadline=None)
@given(cp=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 4]), sp=st.booleans(),
       pad=st.one_of(st.none(), st.integers(1, 24)), size=st.integers(8, 600))
def test_pad_and_pack_size_messages_give_one_fix_that_works(cp, tp, sp, pad, size):
    """issue 11 item 7: applying the fixes the pad-multiple, pack-size and CP messages name (each
    names one value per key) leaves none of those problems; they never contradict each other."""
    cfg = make(parallel__context_parallel_size=cp, parallel__tensor_model_parallel_size=tp,
               parallel__sequence_parallel=sp and tp > 1, model__num_query_groups=4, packing__pad_seq_to_mult=pad,
               packing__packed_sequence_size=size, model__seq_length=size)
    rules = (validate_module._validate_pad_multiple, validate_module._validate_packed_sizes,
             validate_module._validate_context_parallel)
    problems = [p for rule in rules for p in rule(cfg)]
    keys = [p.split(" ", 1)[0] for p in problems]
    assert len(keys) == len(set(keys)), problems  # one message per key
    fixed, num_changes = _apply_fixes(cfg, problems)
    assert bool(problems) == bool(num_changes), problems  # a problem always names a value to set
    assert [p for rule in rules for p in rule(fixed)] == [], (problems, fixed.packing, fixed.model.seq_length)


def test_fix_property_is_not_vacuous():
    bad = make(parallel__context_parallel_size=2, packing__pad_seq_to_mult=6)
    problems = validate_module._validate_pad_multiple(bad) + validate_module._validate_packed_sizes(bad)
    assert problems == ["packing.pad_seq_to_mult (6) must be a multiple of lcm(2*cp=4) = 4 for cp=2, tp=1; "
                        "set packing.pad_seq_to_mult=8."]


EP_CASES = [  # (id, overrides, world size, message fragment or None)
    ("ep2-moe-world2", dict(model__num_experts=4, parallel__expert_model_parallel_size=2), 2, None),
    ("ep2-cp2-world4", dict(model__num_experts=4, parallel__expert_model_parallel_size=2,
                            parallel__context_parallel_size=2), 4, None),
    ("ep2-dense", dict(parallel__expert_model_parallel_size=2), 2, "needs a mixture-of-experts model"),
    ("ep2-world3", dict(model__num_experts=4, parallel__expert_model_parallel_size=2), 3, "must divide the world size"),
    ("ep2-3-experts", dict(model__num_experts=3, model__moe_router_topk=1, parallel__expert_model_parallel_size=2), 2,
     "must divide model.num_experts (3)"),
    ("etp2-tp1", dict(model__num_experts=4, parallel__expert_tensor_parallel_size=2), 2,
     "parallel.expert_tensor_parallel_size (2) must be 1 or"),
    ("tp2-sp-etp1-ep2", dict(model__num_experts=4, parallel__tensor_model_parallel_size=2,
                             parallel__sequence_parallel=True, parallel__expert_tensor_parallel_size=1,
                             parallel__expert_model_parallel_size=2), 2, None),
    ("tp2-sp-etp1-ep1", dict(model__num_experts=4, parallel__tensor_model_parallel_size=2,
                             parallel__sequence_parallel=True, parallel__expert_tensor_parallel_size=1), 2,
     "never sums their gradients over the TP ranks"),
]


@pytest.mark.parametrize("overrides,world_size,fragment", [c[1:] for c in EP_CASES], ids=[c[0] for c in EP_CASES])
def test_expert_parallel_rules(overrides, world_size, fragment):
    cfg = make(**overrides)
    if fragment is None:
        validate(cfg, world_size=world_size)
        return
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=world_size)
    assert sum(fragment in p for p in info.value.problems) == 1, info.value.problems
