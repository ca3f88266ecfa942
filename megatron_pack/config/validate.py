"""Cross-group validation: one small ``_validate_*`` function per rule, all called from ``validate``.

Single-field checks live in each group's ``field_problems`` (schema.py) and run when a group is
built. The rules here span groups; each returns a list of messages (empty when the rule holds),
and ``validate`` raises one ``ConfigError`` listing every problem of every rule. Each message
names the dotted key, its value and the fix, for example::

    packing.pad_seq_to_mult (4) must be a multiple of lcm(2*cp=4, cp*tp=8) = 8 for cp=2, tp=4 with
    sequence_parallel; set packing.pad_seq_to_mult=8.

Rules that need the world size run only when ``world_size`` is given; rules about the prepared
dataset run only when ``dataset_meta`` (the packed dataset's plan metadata) is given.
docs/configuration.md lists every rule with its message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_pack.config.choices import GATED_ACTIVATIONS, TE_MIN_VERSION_SOFTMAX_TYPE
from megatron_pack.config.device import device_problems
from megatron_pack.config.host import Host
from megatron_pack.config.schema import Config, ConfigError, ParallelConfig
from megatron_pack.config.layout import (effective_pack_multiple, effective_pad_multiple, fp8_rule_text,
                                         fp8_token_multiple, pad_rule_text, required_pad_multiple, round_up,
                                         world_size_problem)

__all__ = ["RULES", "Rule", "collect_problems", "config_warnings", "effective_pad_multiple", "launch_problems", "prepare_problems",
           "tokenizer_vocab_problems", "validate", "validate_parallel", "vocab_problems"]


def _ceil_to(value: int, multiple: int) -> int:
    """The smallest positive multiple of ``multiple`` that is >= ``value`` (a suggested fix)."""
    return max(multiple, round_up(value, multiple))


def _sp_text(cp: int, tp: int, sp: bool) -> str:
    return " with sequence_parallel" if sp and tp > 1 else ""


def _layout(cfg: Config) -> tuple[int, int, bool]:
    par = cfg.parallel
    return par.context_parallel_size, par.tensor_model_parallel_size, par.sequence_parallel


def _world_size_problems(par: ParallelConfig, world_size: Optional[int]) -> list[str]:
    if world_size is None:
        return []
    tp, cp, pp = par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size
    problem = world_size_problem(world_size, tp, cp, pp)
    return [problem] if problem else []


def _pipeline_problems(par: ParallelConfig) -> list[str]:
    """What pipeline stages need of ``parallel.*`` alone (the process groups are built from it)."""
    return []


def _pipeline_layer_problems(cfg: Config) -> list[str]:
    pp, layers = cfg.parallel.pipeline_model_parallel_size, cfg.model.num_layers
    if layers % pp:
        fits = [d for d in range(2, layers + 1) if layers % d == 0]
        return [f"model.num_layers ({layers}) must be a multiple of parallel.pipeline_model_parallel_size ({pp}) "
                f"(every stage holds the same layers); set parallel.pipeline_model_parallel_size to one of {fits}."]
    return []


_PIPELINE_REFUSED: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("model.fp8", lambda cfg: cfg.model.fp8 != "none",
     "FP8 with pipeline stages is not tested yet (it needs a GPU run of the stages' padding hooks); set "
     "model.fp8=none or parallel.pipeline_model_parallel_size=1"),
    ("model.cuda_graph_impl", lambda cfg: cfg.model.cuda_graph_impl != "none",
     "CUDA graphs with pipeline stages are not tested yet (megatron-core captures per stage and micro-batch); set "
     "model.cuda_graph_impl=none or parallel.pipeline_model_parallel_size=1"),
)
"""(key, refused when, reason and fix): what does not run with pipeline stages yet."""


def _pipeline_support_problems(cfg: Config) -> list[str]:
    """Features that do not run with pipeline stages yet, each refused with its reason."""
    pp = cfg.parallel.pipeline_model_parallel_size
    return [f"{key} ({_value_of(cfg, key)}) with parallel.pipeline_model_parallel_size ({pp}) > 1: {reason}."
            for key, refused, reason in _PIPELINE_REFUSED if refused(cfg)]


_VP_VARIABLE_MICROBATCHES = (  # (key, set when) settings that plan a different micro-batch count each step
    ("train.global_batch_tokens", lambda cfg: cfg.train.global_batch_tokens is not None),
    ("packing.balance", lambda cfg: cfg.packing.balance == "dp"),
    ("packing.mode", lambda cfg: cfg.packing.mode == "online"),
)


def _validate_virtual_pipeline(cfg: Config, world_size: Optional[int] = None) -> list[str]:
    """VP > 1 (interleaved 1F1B): pipeline stages, every chunk the same layers, and megatron-core 0.16.1's
    micro-batch rule (groups of PP micro-batches per chunk: the count per DP rank is a multiple of PP)."""
    par = cfg.parallel
    vp, pp, layers = par.virtual_pipeline_model_parallel_size, par.pipeline_model_parallel_size, cfg.model.num_layers
    if vp is None or vp == 1:
        return []
    key = f"parallel.virtual_pipeline_model_parallel_size ({vp})"
    if pp == 1:
        return [f"{key} needs parallel.pipeline_model_parallel_size > 1 (virtual stages interleave pipeline stages); "
                "set parallel.pipeline_model_parallel_size=2 or parallel.virtual_pipeline_model_parallel_size=null."]
    problems = []
    if layers % (pp * vp):
        fits = [v for v in range(2, layers // pp + 1) if layers % (pp * v) == 0] if layers % pp == 0 else []
        fixes = [f"parallel.virtual_pipeline_model_parallel_size to one of {fits}"] if fits else []
        if cfg.model.pretrained:  # its layers come from config.json: change the stages, not the model
            fixes.append("parallel.virtual_pipeline_model_parallel_size=null")
        else:
            fixes.append(f"model.num_layers={_ceil_to(layers, pp * vp)}")
        problems.append(f"model.num_layers ({layers}) must be a multiple of parallel.pipeline_model_parallel_size ({pp}) x "
                        f"{key} = {pp * vp} (every model chunk holds the same layers); set {' or '.join(fixes)}.")
    problems += [f"{name} ({_value_of(cfg, name)}) with {key}: the interleaved schedule needs the same micro-batch "
                 f"count, a multiple of parallel.pipeline_model_parallel_size ({pp}), on every step; unset {name} "
                 "(train.global_batch_tokens=null, packing.balance=none, packing.mode=offline) or set "
                 "parallel.virtual_pipeline_model_parallel_size=null." for name, on in _VP_VARIABLE_MICROBATCHES if on(cfg)]
    if cfg.model.num_experts:
        problems.append(f"model.num_experts ({cfg.model.num_experts}) with {key}: mixture-of-experts models are run "
                        "with pipeline stages of one model chunk each, not yet with virtual stages (not tested); set "
                        "parallel.virtual_pipeline_model_parallel_size=null.")
    if cfg.peft.method != "none":
        problems.append(f"peft.method ({cfg.peft.method}) with {key}: LoRA is run with pipeline stages of one model "
                        "chunk each, not yet with virtual stages (adapter seeds, checkpoints and the peft export of "
                        "several chunks per rank are not tested); set parallel.virtual_pipeline_model_parallel_size=null "
                        "or peft.method=none.")
    model_parallel = par.tensor_model_parallel_size * par.context_parallel_size * pp
    if isinstance(world_size, int) and world_size > 0 and world_size % model_parallel == 0:
        dp, mbs = world_size // model_parallel, cfg.train.micro_batch_size
        num = cfg.train.global_batch_size // (dp * mbs)
        if num % pp:
            problems.append(f"train.global_batch_size ({cfg.train.global_batch_size}) gives {num} micro-batches per "
                            f"data-parallel rank (/ (dp {dp} * train.micro_batch_size {mbs})), which {key} needs as a "
                            f"multiple of parallel.pipeline_model_parallel_size ({pp}) (megatron-core 0.16.1's "
                            f"interleaved schedule); set train.global_batch_size={_ceil_to(num, pp) * dp * mbs}.")
        elif not (cfg.data.pad_to_max_length and cfg.packing.pad_cu_seqlens):
            problems += _all_in_warmup(cfg, num, dp * mbs)
    return problems


def _all_in_warmup(cfg: Config, num: int, per_microbatch: int) -> list[str]:
    """megatron-core 0.16.1's interleaved schedule deadlocks when pipeline rank 0 runs every virtual micro-batch
    in its warm-up, ``2 (PP - 1) + (VP - 1) PP >= M VP``, and the packs vary in shape: the last stage's shape
    exchange waits for a gradient shape that rank 0 sends only after its own exchange, which waits for the
    last stage (with fixed shapes every message is posted at once, and nothing waits)."""
    par = cfg.parallel
    pp, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    warmup = 2 * (pp - 1) + (vp - 1) * pp
    if num * vp > warmup:
        return []
    least = next(m for m in range(pp, warmup + pp + 1, pp) if m * vp > warmup)
    return [f"train.global_batch_size ({cfg.train.global_batch_size}) gives {num} micro-batches per data-parallel rank, "
            f"which megatron-core's interleaved schedule runs all in its warm-up with parallel."
            f"virtual_pipeline_model_parallel_size ({vp}) and {pp} stages, and with packs of varying shape "
            f"that deadlocks; set train.global_batch_size={least * per_microbatch} (or data.pad_to_max_length=true with "
            "packing.pad_cu_seqlens=true)."]


def _value_of(cfg: Config, key: str) -> Any:
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def _sequence_parallel_problems(par: ParallelConfig) -> list[str]:
    tp = par.tensor_model_parallel_size
    if par.sequence_parallel and tp <= 1:
        return ["parallel.sequence_parallel (True) requires parallel.tensor_model_parallel_size > 1 "
                f"(it is {tp}); set parallel.sequence_parallel=false or parallel.tensor_model_parallel_size=2."]
    return []


def _validate_sequence_parallel(cfg: Config) -> list[str]:
    """Sequence parallelism splits the sequence over the TP ranks: it needs TP > 1."""
    return _sequence_parallel_problems(cfg.parallel)


def _validate_world_size(cfg: Config, world_size: Optional[int]) -> list[str]:
    """world size divisible by TP*CP*PP (only where the world size is known)."""
    return _world_size_problems(cfg.parallel, world_size)


def _validate_pipeline_parallel(cfg: Config) -> list[str]:
    """PP > 1: the layers split evenly over the stages, and only what runs with stages is accepted."""
    if cfg.parallel.pipeline_model_parallel_size == 1:
        return []
    return _pipeline_problems(cfg.parallel) + _pipeline_layer_problems(cfg) + _pipeline_support_problems(cfg)


def _validate_context_parallel(cfg: Config) -> list[str]:
    cp = cfg.parallel.context_parallel_size
    seq = cfg.model.seq_length
    if cfg.packing.makes_packs and seq == cfg.packing.packed_sequence_size:
        return []  # _validate_packed_sizes names the one fix for both keys (the pad multiple is a multiple of 2*CP)
    if cp > 1 and seq % (2 * cp):
        return [f"model.seq_length ({seq}) must be divisible by 2*parallel.context_parallel_size = {2 * cp} "
                f"(each sequence is cut into 2*CP chunks); set model.seq_length={_ceil_to(seq, 2 * cp)}."]
    return []


def _expert_parallel_problems(par: ParallelConfig, world_size: Optional[int] = None) -> list[str]:
    """EP spans the data- and context-parallel ranks: world = etp * ep * expert-DP * pp (megatron-core's expert
    grid); an expert's weights split like every other weight (expert TP = TP)."""
    problems = []
    ep, etp_size = par.expert_model_parallel_size, par.expert_tensor_parallel_size or par.tensor_model_parallel_size
    grid = ep * etp_size * par.pipeline_model_parallel_size
    if world_size is not None and ep > 1 and world_size % grid:
        problems.append(f"parallel.expert_model_parallel_size ({ep}) x expert tensor parallel ({etp_size}) x "
                        f"pipeline ({par.pipeline_model_parallel_size}) = {grid} must divide the world size "
                        f"({world_size}); set parallel.expert_model_parallel_size to a divisor of "
                        f"{world_size // (etp_size * par.pipeline_model_parallel_size)}.")
    etp = par.expert_tensor_parallel_size
    if etp is not None and etp not in (1, par.tensor_model_parallel_size):
        problems.append(f"parallel.expert_tensor_parallel_size ({etp}) must be 1 or parallel.tensor_model_parallel_size "
                        f"({par.tensor_model_parallel_size}) (experts split like the dense weights, or whole on every "
                        "rank); set parallel.expert_tensor_parallel_size=null.")
    elif etp == 1 and par.tensor_model_parallel_size > 1 and ep == 1:
        problems.append(f"parallel.expert_tensor_parallel_size (1) below parallel.tensor_model_parallel_size "
                        f"({par.tensor_model_parallel_size}) needs parallel.expert_model_parallel_size > 1: at EP 1 "
                        "megatron-core 0.16.1 treats the experts as dense weights and never sums their gradients over "
                        "the TP ranks (each routes its own tokens); set parallel.expert_model_parallel_size="
                        f"{par.tensor_model_parallel_size} or parallel.expert_tensor_parallel_size=null.")
    return problems


_MOE_REFUSED = (  # (applies, key and value, why and fix) for a MoE model (model.num_experts)
    (lambda c: c.parallel.tensor_model_parallel_size > 1 and not c.parallel.sequence_parallel,
     lambda c: f"parallel.tensor_model_parallel_size ({c.parallel.tensor_model_parallel_size}) without "
     "parallel.sequence_parallel", "megatron-core's MoE layer trains under TP only with sequence parallelism "
     "(each TP rank routes its own tokens); set parallel.sequence_parallel=true"),
    (lambda c: _expert_lora(c) and _expert_tp(c) > 1 and c.parallel.expert_model_parallel_size > 1,
     lambda c: f"peft.target_modules ({list(c.peft.target_modules)}) with expert tensor parallel size {_expert_tp(c)} "
     f"and parallel.expert_model_parallel_size ({c.parallel.expert_model_parallel_size})", "LoRA on the experts' "
     "linears (linear_fc1 / linear_fc2) split over expert TP and EP at once (not run yet: the gradient norm would "
     "count an expert adapter's replicated half once per expert-TP rank); set parallel.expert_tensor_parallel_size=1 "
     "(whole experts) or parallel.expert_model_parallel_size=1 or peft.target_modules=[linear_qkv,linear_proj]"),
    (lambda c: _expert_lora(c) and c.peft.dropout > 0, lambda c: f"peft.dropout ({c.peft.dropout}) with "
     f"peft.target_modules ({list(c.peft.target_modules)})", "dropout on the experts' adapters (peft adapts the 3D "
     "expert parameters of transformers 5 through target_parameters, whose ParamWrapper has no dropout, so the "
     "export would not load); set peft.dropout=0 or peft.target_modules=[linear_qkv,linear_proj]"),
    (lambda c: c.model.fp8 != "none", lambda c: f"model.fp8 ({c.model.fp8})", "FP8 experts (not built); set "
     "model.fp8=none"),
    (lambda c: c.model.add_bias_linear and _expert_tp(c) > 1, lambda c: f"model.add_bias_linear (True) with expert "
     f"tensor parallel size {_expert_tp(c)}", "biased experts split over expert TP (megatron-core 0.16.1 adds an "
     "expert's bias only with whole experts); set parallel.expert_tensor_parallel_size=1 and "
     "parallel.expert_model_parallel_size to a multiple of parallel.tensor_model_parallel_size"),
    (lambda c: c.model.cuda_graph_impl != "none", lambda c: f"model.cuda_graph_impl ({c.model.cuda_graph_impl})",
     "CUDA graphs of MoE layers (the router reads per-pack metadata on the host); set model.cuda_graph_impl=none"),
)


def _expert_lora(cfg: Config) -> bool:
    """LoRA on a MoE model's expert linears (and Qwen2-MoE's shared expert): linear_fc1 / linear_fc2 targeted."""
    return cfg.peft.method != "none" and bool({"linear_fc1", "linear_fc2"} & set(cfg.peft.target_modules))


def _expert_tp(cfg: Config) -> int:
    """The experts' tensor-parallel size (parallel.expert_tensor_parallel_size; null: the dense TP size)."""
    return cfg.parallel.expert_tensor_parallel_size or cfg.parallel.tensor_model_parallel_size


def _validate_moe(cfg: Config) -> list[str]:
    """What a mixture-of-experts model (``model.num_experts``) does not combine with yet, one line each."""
    experts, ep = cfg.model.num_experts, cfg.parallel.expert_model_parallel_size
    if not experts:
        return [] if ep == 1 else [f"parallel.expert_model_parallel_size ({ep}) needs a mixture-of-experts model "
                                   "(model.num_experts, from a qwen3_moe / mixtral model.pretrained); set "
                                   "parallel.expert_model_parallel_size=1."]
    problems = [f"{key(cfg)} with a MoE model (model.num_experts={experts}) is not supported: {why}."
                for applies, key, why in _MOE_REFUSED if applies(cfg)]
    if experts % ep:
        problems.append(f"parallel.expert_model_parallel_size ({ep}) must divide model.num_experts ({experts}) "
                        "(each EP rank holds num_experts / EP experts); set it to a divisor of {experts}."
                        .replace("{experts}", str(experts)))
    return problems


def _validate_per_token_loss(cfg: Config) -> list[str]:
    """CP>1 and packing need per-token loss; per-token loss needs summed (not averaged) gradient reduction.

    Without per-token loss megatron-core pre-scales gradients by 1/(DP*CP) and averages per-pack
    means (a pack's weight would not follow its target tokens), a different objective from the
    token-weighted mean that packing trains.
    """
    problems = []
    cp = cfg.parallel.context_parallel_size
    if not cfg.model.calculate_per_token_loss:  # every packing.mode packs samples together
        why = ([f"parallel.context_parallel_size={cp}"] if cp > 1 else []) + [f"packing.mode={cfg.packing.mode}"]
        problems.append(
            f"model.calculate_per_token_loss (False) must be True with {' and '.join(why)}: packs and CP ranks hold "
            "different numbers of target tokens, so the loss is a sum scaled once by the global token count "
            "(without it gradients are averaged over DP x CP on top: another objective); "
            "set model.calculate_per_token_loss=true.")
    if (cp > 1 or cfg.model.calculate_per_token_loss) and cfg.ddp.average_in_collective:
        problems.append(
            "ddp.average_in_collective (True) must be False with per-token loss (gradients are summed over "
            "DP x CP and scaled once by 1/global target tokens; megatron-core refuses the combination); "
            "set ddp.average_in_collective=false.")
    return problems


def _validate_offline_packing(cfg: Config) -> list[str]:
    """One pack is one row; the fixed-shape options need packs of a fixed size."""
    problems = []
    size, mbs, mode = cfg.packing.packed_sequence_size, cfg.train.micro_batch_size, cfg.packing.mode
    if cfg.packing.makes_packs and mbs != 1:
        problems.append(
            f"train.micro_batch_size ({mbs}) must be 1 with packing.mode={mode} (packing.packed_sequence_size={size}: "
            f"one pack is one row); set train.micro_batch_size=1 and raise train.global_batch_size "
            f"(e.g. {cfg.train.global_batch_size * mbs}) or packing.packed_sequence_size "
            f"(e.g. {size * mbs}) to keep the tokens per step, or set packing.mode=in_batch.")
    if not cfg.packing.makes_packs:
        for key, on in (("data.pad_to_max_length", cfg.data.pad_to_max_length),
                        ("packing.pad_cu_seqlens", cfg.packing.pad_cu_seqlens)):
            if on:
                problems.append(
                    f"{key} (True) needs packs of packing.packed_sequence_size tokens, but packing.mode=in_batch "
                    f"packs micro-batches of any length; set packing.mode=offline (or online) or {key}=false.")
    return problems


def _validate_in_batch_packing(cfg: Config) -> list[str]:
    if cfg.packing.mode == "in_batch" and cfg.train.micro_batch_size <= 1:
        return [f"train.micro_batch_size ({cfg.train.micro_batch_size}) must be > 1 with packing.mode=in_batch "
                "(it packs the rows of one micro-batch into one THD row); set train.micro_batch_size=4 "
                "or packing.mode=offline."]
    return []


def _validate_image_dataset(cfg: Config, meta: Optional[dict[str, Any]]) -> list[str]:
    """A dataset with images (``images`` in its metadata) trains offline (micro_batch_size 1, one pack a row) or
    in-batch (micro_batch_size >= 2 packed at collate, the VLM path of Megatron-Bridge's packing card): online
    packing does not carry images."""
    if not meta or not meta.get("images") or cfg.packing.mode != "online":
        return []
    return [f"packing.mode (online) packs token streams without their images, but data.dataset_dir "
            f"({cfg.data.dataset_dir}) holds {meta['images'].get('num_images')} images; set packing.mode=offline "
            "(train.micro_batch_size=1) or packing.mode=in_batch (train.micro_batch_size >= 2)."]


def _validate_online_packing(cfg: Config) -> list[str]:
    """packing.mode=online needs a buffer that holds a pack; its cap on samples per pack
    is online only (workers, token budgets, balancing and fixed cu_seqlens work online:
    data/batches/online.py)."""
    p = cfg.packing
    if p.mode != "online":
        if p.max_samples_per_pack is not None:
            how = ("packs by the prepared plan (which records its own max_samples_per_bin)" if p.mode == "offline"
                   else "packs train.micro_batch_size samples a row")
            return [f"packing.max_samples_per_pack ({p.max_samples_per_pack}) caps packs made at run time, but "
                    f"packing.mode={p.mode} {how}; unset packing.max_samples_per_pack, or set packing.mode=online."]
        return []
    problems = []
    if p.on_overflow == "split":
        problems.append("packing.on_overflow (split) cuts over-long samples into pieces in the offline plan, which "
                        "packing.mode=online does not make (it would truncate them instead); set "
                        "packing.on_overflow=truncate (or drop), or packing.mode=offline.")
    if p.buffer_tokens is not None and p.buffer_tokens < p.packed_sequence_size:
        problems.append(f"packing.buffer_tokens ({p.buffer_tokens}) must hold at least one pack "
                        f"(packing.packed_sequence_size={p.packed_sequence_size}); set "
                        f"packing.buffer_tokens={p.packed_sequence_size * 16} or leave it unset.")
    return problems


def _validate_step_batches(cfg: Config) -> list[str]:
    """Token budgets and balancing work on packs (offline or online), not on in-batch rows."""
    problems = []
    if cfg.train.global_batch_tokens is not None and not cfg.packing.makes_packs:
        problems.append(f"train.global_batch_tokens ({cfg.train.global_batch_tokens}) needs packs (packing.mode "
                        "offline or online), but packing.mode=in_batch; set packing.mode=offline or unset "
                        "train.global_batch_tokens.")
    if cfg.packing.balance == "dp" and not cfg.packing.makes_packs:
        problems.append("packing.balance (dp) needs packs (packing.mode offline or online), but packing.mode=in_batch; "
                        "set packing.mode=offline or packing.balance=none.")
    return problems


def _validate_epochs(cfg: Config) -> list[str]:
    """train.num_epochs needs the steps of an epoch counted before the run (the loader's ``num_steps``):
    offline packs and in-batch micro-batches count them from the plan; online packs are made at run time."""
    if cfg.train.num_epochs is not None and cfg.packing.mode == "online":
        return [f"train.num_epochs ({cfg.train.num_epochs}) needs the packs of an epoch counted before the run, but "
                "packing.mode=online makes them at run time (their number depends on the buffer); set "
                "train.train_iters=<steps> train.num_epochs=null, or packing.mode=offline."]
    return []


def _validate_pad_cu_seqlens(cfg: Config) -> list[str]:
    if cfg.packing.pad_cu_seqlens and not cfg.data.pad_to_max_length:
        return ["packing.pad_cu_seqlens (True) requires data.pad_to_max_length=true (fixed-length cu_seqlens "
                "only help when the token count is fixed too); set data.pad_to_max_length=true."]
    return []


def _validate_cuda_graphs(cfg: Config) -> list[str]:
    """Captured graphs replay fixed shapes: packing must pad tokens and cu_seqlens to fixed sizes."""
    impl, scope = cfg.model.cuda_graph_impl, list(cfg.model.cuda_graph_scope)
    if impl == "none":
        return []
    if cfg.packing.mode == "in_batch":
        return [f"model.cuda_graph_impl ({impl}) cannot capture in-batch packing (packing.mode=in_batch gives a "
                "different cu_seqlens every step); use offline packing with data.pad_to_max_length=true and "
                "packing.pad_cu_seqlens=true, or set model.cuda_graph_impl=none."]
    problems = []
    if not cfg.data.pad_to_max_length:
        problems.append(f"model.cuda_graph_impl ({impl}) with packing requires data.pad_to_max_length=true "
                        "(a captured graph needs the same token count every step); set data.pad_to_max_length=true.")
    captures_attention = not scope or "attn" in scope
    if captures_attention and not cfg.packing.pad_cu_seqlens:
        shown = "[] (whole layers)" if not scope else str(scope)
        problems.append(f"model.cuda_graph_impl ({impl}) capturing attention (model.cuda_graph_scope={shown}) with "
                        "packing requires packing.pad_cu_seqlens=true (cu_seqlens must keep one shape); set "
                        "packing.pad_cu_seqlens=true, or model.cuda_graph_scope=[mlp].")
    return problems + _te_graph_problems(cfg)


def _te_graph_problems(cfg: Config) -> list[str]:
    """What megatron-core 0.16.1's Transformer Engine graphs (``TECudaGraphHelper``, which the loop runs) cannot
    capture: attention of packed sequences (its graphs are captured without ``packed_seq_params``, so a pack would
    attend as one sequence, and it refuses them at replay) and layer inputs other than bf16 (its capture inputs)."""
    if cfg.model.cuda_graph_impl != "transformer_engine":
        return []
    problems = []
    scope = list(cfg.model.cuda_graph_scope)
    if not scope or "attn" in scope:
        shown = "[] (whole layers)" if not scope else str(scope)
        problems.append(f"model.cuda_graph_impl (transformer_engine) cannot capture the attention of packed sequences "
                        f"(model.cuda_graph_scope={shown}): megatron-core 0.16.1 captures Transformer Engine graphs "
                        "without packed_seq_params; set model.cuda_graph_scope=[mlp], or model.cuda_graph_impl=local "
                        "(megatron-core's graphs take the step's fixed-shape packed_seq_params).")
    if not cfg.train.bf16:
        problems.append("model.cuda_graph_impl (transformer_engine) captures bf16 layer inputs (megatron-core 0.16.1's "
                        "TECudaGraphHelper), but train.bf16=false; set train.bf16=true, or model.cuda_graph_impl=local.")
    return problems


def _pad_multiple_fix(cfg: Config) -> Optional[int]:
    """None when packing.pad_seq_to_mult is unset or valid; else the one value to set it to.

    The smallest multiple of the lcm rule that is >= the chosen value and divides the pack size
    (so the pack-size rule then holds too), or the smallest multiple >= the value when none does.
    """
    value = cfg.packing.pad_seq_to_mult
    required = required_pad_multiple(*_layout(cfg))
    if value is None or value % required == 0:
        return None
    size = cfg.packing.packed_sequence_size
    fixes = [m for m in range(_ceil_to(value, required), size + 1, required) if size % m == 0] if size else []
    return fixes[0] if fixes else _ceil_to(value, required)


def _validate_pad_multiple(cfg: Config) -> list[str]:
    """An explicit pad_seq_to_mult must be a multiple of the lcm rule."""
    fix = _pad_multiple_fix(cfg)
    if fix is None:
        return []
    cp, tp, sp = _layout(cfg)
    required = required_pad_multiple(cp, tp, sp)
    return [f"packing.pad_seq_to_mult ({cfg.packing.pad_seq_to_mult}) must be a multiple of "
            f"{pad_rule_text(cp, tp, sp)} = {required} for cp={cp}, tp={tp}{_sp_text(cp, tp, sp)}; "
            f"set packing.pad_seq_to_mult={fix}."]


def _validate_packed_sizes(cfg: Config) -> list[str]:
    """Pack size vs pad multiple, longest sample and model.seq_length (packs: mode offline or online)."""
    if not cfg.packing.makes_packs:
        return []
    problems = []
    size = cfg.packing.packed_sequence_size
    pad = _pad_multiple_fix(cfg) or effective_pad_multiple(cfg)  # the value the pad message says to set
    fp8_multiple = fp8_token_multiple(*_layout(cfg), cfg.model.fp8)
    multiple = math.lcm(pad, fp8_multiple)
    if size % multiple:
        source = ("packing.pad_seq_to_mult" if cfg.packing.pad_seq_to_mult is not None
                  else f"derived: {pad_rule_text(*_layout(cfg))}")
        both = (f" and model.seq_length={_ceil_to(size, multiple)} (a pack is one sequence)"
                if cfg.model.seq_length == size else "")
        if fp8_multiple == 1:
            problems.append(f"packing.packed_sequence_size ({size}) must be divisible by the pad multiple {pad} "
                            f"({source}); set packing.packed_sequence_size={_ceil_to(size, pad)}{both}.")
        else:
            problems.append(_fp8_pack_size_problem(cfg, size, pad, source, multiple, both))
    longest = cfg.packing.max_single_sequence_length
    if longest is not None and longest > size:
        problems.append(f"packing.max_single_sequence_length ({longest}) must be <= packing.packed_sequence_size "
                        f"({size}); set packing.max_single_sequence_length={size} (or leave it unset).")
    if cfg.model.seq_length != size:
        problems.append(f"model.seq_length ({cfg.model.seq_length}) must equal packing.packed_sequence_size ({size}) "
                        f"with packing.mode={cfg.packing.mode} (a pack is one sequence); set model.seq_length={size}.")
    return problems


def _fp8_pack_size_problem(cfg: Config, size: int, pad: int, source: str, multiple: int, both: str) -> str:
    """The pack size breaks the FP8 rule: every rank's rows of a pack come in multiples of the alignment."""
    cp, tp, sp = _layout(cfg)
    required = required_pad_multiple(cp, tp, sp)
    other = ""
    if cfg.packing.pad_seq_to_mult is not None and size % math.lcm(required, fp8_token_multiple(cp, tp, sp, cfg.model.fp8)) == 0:
        other = " (or unset packing.pad_seq_to_mult)"
    rule = fp8_rule_text(cp, tp, sp, cfg.model.fp8)
    if multiple != fp8_token_multiple(cp, tp, sp, cfg.model.fp8):
        rule = f"lcm(pad multiple {pad} ({source}), {rule})"
    return (f"packing.packed_sequence_size ({size}) must be divisible by the pack multiple {multiple} = {rule}, so "
            f"every rank's rows of a padded pack come in whole FP8 blocks; set packing.packed_sequence_size="
            f"{_ceil_to(size, multiple)}{both}{other}.")


FP8_WEIGHT_RULE = (16, 8)
"""Transformer Engine's FP8 GEMM shape rule (``assert_dim_for_fp8_exec``): a weight [out, in] needs in % 16 == 0
and out % 8 == 0, per TP rank."""


def _fp8_gemm_shapes(cfg: Config) -> list[tuple[str, int, int]]:
    """(name, out, in) of each linear's weight on one TP rank (megatron-core's fused qkv and fc1)."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    fc1 = m.ffn_hidden_size * (2 if m.activation in GATED_ACTIVATIONS else 1)
    return [("linear_qkv", (m.num_attention_heads + 2 * groups) * kv // tp, m.hidden_size),
            ("linear_proj", m.hidden_size, m.num_attention_heads * kv // tp),
            ("linear_fc1", fc1 // tp, m.hidden_size), ("linear_fc2", m.hidden_size, m.ffn_hidden_size // tp)]


def _validate_fp8(cfg: Config) -> list[str]:
    """model.fp8 runs Transformer Engine's FP8 GEMMs with padding kept at exactly zero (docs/thd.md)."""
    m, fp8 = cfg.model, cfg.model.fp8
    if fp8 == "none":
        return []
    problems = []
    if m.attention_backend == "torch" or cfg.verify.attention != "thd":
        why = ("model.attention_backend=torch" if m.attention_backend == "torch"
               else f"verify.attention={cfg.verify.attention} (torch attention only)")
        problems.append(f"model.fp8 ({fp8}) runs Transformer Engine's FP8 linear layers, but {why} builds the local "
                        "torch layers, which have no FP8 GEMMs; set model.attention_backend=auto (or te) and "
                        "verify.attention=thd, or model.fp8=none.")
    if m.normalization != "RMSNorm":
        problems.append(f"model.fp8 ({fp8}) with model.normalization={m.normalization}: a zeroed padding row leaves "
                        "LayerNorm as its bias, which would enter the FP8 scales (RMSNorm keeps it 0); set "
                        "model.normalization=RMSNorm or model.fp8=none.")
    tp = cfg.parallel.tensor_model_parallel_size
    if m.ffn_hidden_size % tp or m.num_attention_heads % tp:
        return problems  # _validate_tensor_parallel names the fix first
    need_in, need_out = FP8_WEIGHT_RULE
    for name, out, inp in _fp8_gemm_shapes(cfg):
        if inp % need_in or out % need_out:
            problems.append(f"model.fp8 ({fp8}): {name}'s weight is [{out}, {inp}] per TP rank (tp={tp}), but Transformer "
                            f"Engine's FP8 GEMMs need its input size a multiple of {need_in} and its output size a "
                            f"multiple of {need_out}; choose model sizes (hidden_size, ffn_hidden_size, heads, "
                            "kv_channels) or a parallel.tensor_model_parallel_size that give them, or model.fp8=none.")
    return problems


def _validate_tensor_parallel(cfg: Config) -> list[str]:
    problems = []
    tp, model = cfg.parallel.tensor_model_parallel_size, cfg.model
    groups = model.num_query_groups if model.num_query_groups is not None else model.num_attention_heads
    for key, value in (("num_attention_heads", model.num_attention_heads), ("num_query_groups", groups),
                       ("ffn_hidden_size", model.ffn_hidden_size)):
        if value % tp:
            other = f", or model.{key}={_ceil_to(value, tp)}" if not model.pretrained else ""  # else from config.json
            problems.append(f"model.{key} ({value}) must be divisible by parallel.tensor_model_parallel_size ({tp}); "
                            f"set parallel.tensor_model_parallel_size to a divisor of {value}{other}.")
    return problems


def _validate_linear_attention(cfg: Config) -> list[str]:
    """The Gated DeltaNet layers split their key heads over TP, then over CP (model/linear_attention.py)."""
    model, par = cfg.model, cfg.parallel
    if model.full_attention_interval is None or model.full_attention_interval == 1:
        return []
    if model.attention_backend == "te":
        return ["model.attention_backend ('te') with model.full_attention_interval: the linear-attention (hybrid) "
                "stack is built on the torch backend only (auto picks it); set model.attention_backend=torch."]
    problems = []
    tp, cp, heads = par.tensor_model_parallel_size, par.context_parallel_size, model.linear_num_key_heads
    if heads % (tp * cp):
        problems.append(f"model.linear_num_key_heads ({heads}) must be divisible by parallel.tensor_model_parallel_size"
                        f" x parallel.context_parallel_size ({tp} x {cp}): the linear-attention layers split their "
                        f"heads over TP, then over CP; choose TP x CP dividing {heads}.")
    return problems


def _validate_deepstack(cfg: Config) -> list[str]:
    """DeepStack (Qwen3-VL) adds the vision tower's features after decoder layers 0 .. deepstack_layers - 1: they
    must be on the first stage's first chunk, beside the tower (model/vlm.py); the add is a forward hook, which
    full-layer recompute would run outside the recomputed graph."""
    model, par = cfg.model, cfg.parallel
    if not model.deepstack_layers:
        return []
    problems = []
    first = model.num_layers // max(1, par.pipeline_model_parallel_size * par.num_model_chunks)
    if model.deepstack_layers > first:
        problems.append(f"parallel.pipeline_model_parallel_size ({par.pipeline_model_parallel_size}) x parallel."
                        f"virtual_pipeline_model_parallel_size ({par.num_model_chunks}) puts {first} of "
                        f"{model.num_layers} layers on the first stage, but DeepStack adds the vision features after "
                        f"layers 0..{model.deepstack_layers - 1} (model.deepstack_layers {model.deepstack_layers}, "
                        "config.json deepstack_visual_indexes), which must sit with the vision tower on the first "
                        f"stage; choose stages of at least {model.deepstack_layers} layers.")
    if model.recompute_granularity == "full":
        problems.append("model.recompute_granularity (full) with DeepStack (model.deepstack_layers "
                        f"{model.deepstack_layers}): the features are added after those layers outside the recomputed "
                        "graph; set model.recompute_granularity=selective or null.")
    return problems


def vocab_problems(cfg: Config) -> list[str]:
    """model.vocab_size divisible by TP (the embedding and output layer are split over TP ranks).

    A pretrained model is padded to a multiple of TP instead (model/builder.py ``padded_vocab_size``:
    the pad rows' logits are masked and export drops them), so its vocabulary is never refused."""
    tp, vocab = cfg.parallel.tensor_model_parallel_size, cfg.model.vocab_size
    if vocab % tp and not cfg.model.pretrained:
        return [f"model.vocab_size ({vocab}) must be divisible by parallel.tensor_model_parallel_size ({tp}) so every "
                f"TP size builds the same model; set model.vocab_size={_ceil_to(vocab, tp)}."]
    return []


def _validate_vocab_size(cfg: Config) -> list[str]:
    return vocab_problems(cfg)


def _validate_attention_backend(cfg: Config) -> list[str]:
    """The torch THD attention cannot be captured in a CUDA graph, and the broken verify mode exists only there."""
    problems = []
    backend, impl, mode = cfg.model.attention_backend, cfg.model.cuda_graph_impl, cfg.verify.attention
    if backend == "torch" and impl != "none":
        problems.append(f"model.cuda_graph_impl ({impl}) needs the Transformer Engine backend (the torch THD attention "
                        "reads cu_seqlens on the host, which a CUDA graph cannot capture), but model.attention_backend="
                        "torch; set model.attention_backend=te or model.cuda_graph_impl=none.")
    if backend == "te" and mode != "thd":
        problems.append(f"verify.attention ({mode}) exists only in the torch attention, but model.attention_backend=te; "
                        "set model.attention_backend=torch (or auto).")
    return problems


def _validate_batch_size(cfg: Config, world_size: Optional[int]) -> list[str]:
    """global_batch_size splits into whole micro-batches on every data-parallel rank."""
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    par = cfg.parallel
    model_parallel = par.tensor_model_parallel_size * par.context_parallel_size * par.pipeline_model_parallel_size
    if world_size is None or not isinstance(world_size, int) or world_size % model_parallel:
        dp, where = 1, "train.micro_batch_size"
    else:
        dp = world_size // model_parallel
        where = (f"train.micro_batch_size * data-parallel size = {mbs}*{dp} "
                 f"(world {world_size} / (tp*cp*pp = {model_parallel}))")
    per_step = mbs * dp
    if cfg.train.global_batch_tokens is not None:  # the budget replaces the fixed count
        return []
    if gbs % per_step:
        return [f"train.global_batch_size ({gbs}) must be divisible by {where} = {per_step}; "
                f"set train.global_batch_size={_ceil_to(gbs, per_step)}."]
    return []


def _validate_device(cfg: Config, host: Optional[Host] = None) -> list[str]:
    """Options that need CUDA (or Transformer Engine) are refused where the run will not have it: on an explicit
    CPU run always, and, where the host is known (train, verify, the launch scripts), on the device
    ``train.device`` resolves to here. Nothing else refuses them later (model/builder.py, parallel/groups.py)."""
    host = None if host is None else host.for_device(cfg.train.device)
    device = cfg.train.device if host is None else host.device(cfg.train.device)
    why = f"train.device={cfg.train.device}" if host is None else host.describe(cfg.train.device)
    if device == "cpu":
        return _cpu_problems(cfg, why)
    if host is None or device != "cuda":
        return []
    if not host.gpu:
        return device_problems("cuda", gpu_present=False)
    return _gpu_host_problems(cfg, host)


def _cpu_problems(cfg: Config, why: str) -> list[str]:
    problems = []
    if cfg.model.attention_backend == "te":
        problems.append(f"model.attention_backend (te) needs CUDA and Transformer Engine, but {why}; "
                        "set model.attention_backend=auto (or torch).")
    if cfg.model.cuda_graph_impl != "none":
        problems.append(f"model.cuda_graph_impl ({cfg.model.cuda_graph_impl}) needs CUDA, but {why}; "
                        "set model.cuda_graph_impl=none.")
    if cfg.parallel.backend == "nccl":
        problems.append(f"parallel.backend (nccl) needs CUDA, but {why}; set parallel.backend=gloo (or auto).")
    if cfg.model.fp8 != "none":
        problems.append(f"model.fp8 ({cfg.model.fp8}) needs CUDA and Transformer Engine (FP8 GEMMs), but {why}; "
                        "set model.fp8=none (prepare accepts model.fp8 on CPU: it only shapes the packs).")
    return problems


def _gpu_host_problems(cfg: Config, host: Host) -> list[str]:
    """A GPU host: what needs Transformer Engine there, and its deterministic mode's environment."""
    problems = []
    uses_te = cfg.model.attention_backend == "te" or (cfg.model.attention_backend == "auto" and host.transformer_engine)
    if not host.transformer_engine:
        for key, on in (("model.attention_backend", cfg.model.attention_backend == "te"),
                        ("model.fp8", cfg.model.fp8 != "none"), ("model.cuda_graph_impl", cfg.model.cuda_graph_impl != "none")):
            if on:
                problems.append(f"{key} ({_value_of(cfg, key)}) needs Transformer Engine, which is not installed "
                                f"here; install megatron_pack[gpu] or set {key}="
                                + ("auto." if key == "model.attention_backend" else "none."))
    if uses_te:
        problems += te_window_sink_problems(cfg, host.transformer_engine_version)
    nvte = host.nvte_allow_nondeterministic
    if uses_te and cfg.train.deterministic and nvte not in (None, "0"):
        problems.append(f"train.deterministic (True) with Transformer Engine needs NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, "
                        f"but the environment sets it to {nvte!r}; unset it or set train.deterministic=false.")
    return problems


def te_window_sink_problems(cfg: Config, te_version: Optional[str]) -> list[str]:
    """What Transformer Engine's THD attention cannot do of model.window_size / model.softmax_type (the torch core
    does all of it): softmax_type needs TE >= 2.8.0 (megatron-core's check, made here before launch); under CP
    both need parallel.cp_comm_type=a2a (TE's p2p has no window nor sink, its all-gather takes no THD)."""
    m, p = cfg.model, cfg.parallel
    problems, fix = [], "or set model.attention_backend=torch (the torch THD core computes it at any layout)"
    if m.softmax_type != "vanilla" and te_version is not None and _version(te_version) < _version(
            TE_MIN_VERSION_SOFTMAX_TYPE):
        problems.append(f"model.softmax_type ({m.softmax_type}) needs Transformer Engine >= "
                        f"{TE_MIN_VERSION_SOFTMAX_TYPE}, but {te_version} is installed; upgrade it, {fix}.")
    for key, on in (("model.window_size", m.window_size is not None), ("model.softmax_type", m.softmax_type != "vanilla")):
        if on and p.context_parallel_size > 1 and p.cp_comm_type != "a2a":
            problems.append(f"{key} ({_value_of(cfg, key)}) with Transformer Engine under context parallelism needs "
                            f"parallel.cp_comm_type=a2a (TE's {p.cp_comm_type} has none for THD packs), but it is "
                            f"{p.cp_comm_type}; set parallel.cp_comm_type=a2a, {fix}.")
    return problems


def _version(text: str) -> tuple[int, ...]:
    """'2.8.0.dev0+abc' -> (2, 8, 0): the leading numbers of a version."""
    import re

    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


def _validate_dataset_meta(cfg: Config, meta: Optional[dict[str, Any]]) -> list[str]:
    """The prepared dataset (its plan metadata) agrees with the config; skipped when meta is None."""
    if meta is None:
        return []
    where = f"the packed dataset's metadata in data.dataset_dir ({cfg.data.dataset_dir})"
    redo = "re-run `megatron-pack prepare` with this config"
    problems = []
    if cfg.packing.pad_cu_seqlens and meta.get("max_samples_per_bin") is None:
        problems.append(f"packing.pad_cu_seqlens (True) needs max_samples_per_bin from {where}, which is missing "
                        f"(no metadata, or written without it); {redo}.")
    pack_size = meta.get("pack_size")
    if cfg.packing.makes_packs and pack_size is not None and pack_size != cfg.packing.packed_sequence_size:
        problems.append(f"packing.packed_sequence_size ({cfg.packing.packed_sequence_size}) does not match "
                        f"pack_size={pack_size} in {where}; set packing.packed_sequence_size={pack_size} or {redo}.")
    problems += _dataset_pad_problems(cfg, meta.get("pad_seq_to_mult"), where, redo)
    problems += _dataset_pack_problems(cfg, meta, where, redo)
    return problems + tokenizer_vocab_problems(cfg, meta.get("vocab_size"), f"vocab_size={meta.get('vocab_size')} "
                                                                             f"in {where}")


def tokenizer_vocab_problems(cfg: Config, tokenizer_vocab: Optional[int], where: str) -> list[str]:
    """The vocabulary rule, the one place it is written (``prepare`` once the tokenizer is loaded; ``train``,
    ``train --check`` and ``verify`` from the dataset's metadata): every id of the tokenizer (``tokenizer_vocab``
    ids, ``where`` says where that number comes from) needs an embedding row. A pretrained folder's vocabulary
    is its config.json's and never grows silently: a larger tokenizer is refused unless ``model.resize_vocab``
    (then the recorded settings set model.vocab_size to the tokenizer's and the loader adds mean rows).
    Example: a Llama folder of 256 rows with a 32000-id tokenizer is refused naming both sizes."""
    if tokenizer_vocab is None or tokenizer_vocab <= cfg.model.vocab_size or (cfg.model.pretrained
                                                                             and cfg.model.resize_vocab):
        return []
    if cfg.model.pretrained:
        return [f"data.tokenizer ({cfg.data.tokenizer}) has {tokenizer_vocab} ids ({where}) but model.pretrained "
                f"({cfg.model.pretrained}) has {cfg.model.vocab_size} embedding rows (config.json vocab_size); use "
                f"the tokenizer the model was trained with (data.tokenizer={cfg.model.pretrained}), or set "
                f"model.resize_vocab=true to grow the embedding and output layer to {tokenizer_vocab} rows."]
    return [f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary ({where}); set "
            f"model.vocab_size={tokenizer_vocab} (or larger)."]


def _dataset_pad_problems(cfg: Config, planned: Optional[int], where: str, redo: str) -> list[str]:
    """The plan reserved room for padding to ``planned``; collate must not pad to more."""
    if planned is None or not cfg.packing.makes_packs:
        return []
    cp, tp, sp = _layout(cfg)
    required = required_pad_multiple(cp, tp, sp)
    if planned % required:
        return [f"packing.pad_seq_to_mult: the dataset was planned with pad_seq_to_mult={planned} ({where}), which "
                f"is not a multiple of {pad_rule_text(cp, tp, sp)} = {required} for cp={cp}, tp={tp}"
                f"{_sp_text(cp, tp, sp)}; {redo} (it pads to {required})."]
    chosen = cfg.packing.pad_seq_to_mult
    if chosen is not None and planned % chosen:
        return [f"packing.pad_seq_to_mult ({chosen}) does not divide pad_seq_to_mult={planned} the dataset was "
                f"planned with ({where}), so padded packs could overflow; set packing.pad_seq_to_mult={planned} "
                f"(or leave it unset) or {redo}."]
    return []


def _dataset_pack_problems(cfg: Config, meta: dict[str, Any], where: str, redo: str) -> list[str]:
    """The plan's packs are padded to the pack multiple the run needs (model.fp8: a whole number of FP8 blocks
    per rank); a plan made without the recipe (or for a smaller CP) is refused with the prepare that fits."""
    planned = meta.get("pack_multiple", meta.get("pad_seq_to_mult"))
    if planned is None or not cfg.packing.makes_packs or cfg.model.fp8 == "none":
        return []
    needed = effective_pack_multiple(cfg)
    if int(planned) % needed == 0:
        return []
    cp, tp, sp = _layout(cfg)
    return [f"model.fp8 ({cfg.model.fp8}): the dataset was planned with packs padded to a multiple of {planned} tokens "
            f"(pack_multiple in {where}), but this run needs {needed} = lcm(pad multiple, FP8 rows "
            f"{fp8_rule_text(cp, tp, sp, cfg.model.fp8)}); {redo} and model.fp8={cfg.model.fp8} (its packs pad to "
            f"{needed})."]


def _validate_verify_reference(cfg: Config) -> list[str]:
    """verify.reference=transformers runs transformers on model.pretrained's own weights."""
    v = cfg.verify
    if v.reference != "transformers":
        return []
    if cfg.model.pretrained is None:
        return ["verify.reference (transformers) needs model.pretrained=DIR (the Hugging Face folder transformers "
                "loads); set model.pretrained or verify.reference=self."]
    if v.checkpoint is not None:
        return [f"verify.checkpoint ({v.checkpoint}) with verify.reference=transformers would compare trained weights "
                "with the untrained folder; export the checkpoint (megatron-pack export) and pass "
                "model.pretrained=<export> instead, or drop verify.checkpoint."]
    return []


def _validate_packing_strategy(cfg: Config) -> list[str]:
    """Split, buckets and the wrapped stream: each key does something, and only where it means something."""
    p, problems = cfg.packing, []
    if p.split_overlap and p.on_overflow != "split":
        problems.append(f"packing.split_overlap ({p.split_overlap}) only applies with packing.on_overflow=split "
                        f"(it is {p.on_overflow}); set packing.on_overflow=split or packing.split_overlap=0.")
    longest = min(p.max_single_sequence_length or p.packed_sequence_size, p.packed_sequence_size)
    if p.on_overflow == "split" and p.makes_packs and p.split_overlap >= longest:
        problems.append(f"packing.split_overlap ({p.split_overlap}) must be smaller than the longest piece "
                        f"({longest} tokens), or no piece would carry a new target; set packing.split_overlap="
                        f"{min(p.split_overlap, longest // 4)}.")
    if p.algorithm == "wrapped":
        if p.buckets is not None:
            problems.append("packing.buckets cannot be used with packing.algorithm=wrapped (wrapped cuts one token "
                            "stream into full rows, there is nothing to bucket); unset packing.buckets or choose "
                            "packing.algorithm=bfd.")
        if p.on_overflow in ("drop", "truncate"):
            problems.append(f"packing.on_overflow ({p.on_overflow}) does not apply to packing.algorithm=wrapped "
                            "(documents are cut at row ends by construction); set packing.on_overflow=split.")
        if p.split_overlap:  # the dataset would mask the first split_overlap targets of every continued piece
            problems.append(f"packing.split_overlap ({p.split_overlap}) does not apply to packing.algorithm=wrapped "
                            "(a row's continued piece repeats no context, so its first targets would go untrained); "
                            "set packing.split_overlap=0.")
        if p.wrapped_attention == "cross" and cfg.data.answer_only_loss:
            problems.append("packing.wrapped_attention=cross with data.answer_only_loss=true is refused: answer "
                            "tokens would attend to unrelated documents' prompts; set data.answer_only_loss=false "
                            "(pretraining-style data) or packing.wrapped_attention=document.")
    elif p.wrapped_attention != "document":
        problems.append(f"packing.wrapped_attention ({p.wrapped_attention}) only applies with "
                        "packing.algorithm=wrapped; set packing.algorithm=wrapped or packing.wrapped_attention=document.")
    if p.export == "bridge" and p.algorithm == "wrapped" and p.wrapped_attention == "cross":
        # a Bridge sample's labels are its ids shifted by one: one sequence of several documents would
        # train each document's last position on the next document's first token, never on its eos
        problems.append("packing.export=bridge cannot carry packing.wrapped_attention=cross rows (a row is one "
                        "sequence of several documents, which Bridge would train to predict the next document's "
                        "first token instead of each document's eos); set packing.wrapped_attention=document or "
                        "packing.export=none.")
    if p.bucket_order != "interleave" and p.buckets is None:
        problems.append(f"packing.bucket_order ({p.bucket_order}) needs length buckets; set packing.buckets=auto "
                        "(or boundaries such as [512,2048]) or packing.bucket_order=interleave.")
    if p.mode != "offline" and (p.buckets is not None or p.bucket_order != "interleave"):
        problems.append(f"packing.buckets ({p.buckets}) and packing.bucket_order ({p.bucket_order}) sort the packs of a "
                        f"prepared plan into length buckets, but packing.mode={p.mode} makes its packs at run time "
                        "(nothing to bucket); unset packing.buckets and packing.bucket_order, or set packing.mode=offline.")
    return problems


def _validate_evaluation(cfg: Config) -> list[str]:
    """Evaluation settings need a validation set; a validation set needs offline packs."""
    d, t = cfg.data, cfg.train
    has_validation = d.validation is not None or d.validation_fraction > 0
    problems = []
    if not has_validation:
        for key in ("eval_interval", "eval_iters"):
            if getattr(t, key):
                problems.append(f"train.{key} ({getattr(t, key)}) has no validation set to evaluate; set "
                                "data.validation=/path/to/valid.jsonl or data.validation_fraction=0.05, "
                                f"or train.{key}=0.")
    elif not cfg.packing.makes_packs:
        key = "data.validation" if d.validation is not None else "data.validation_fraction"
        problems.append(f"{key} needs packs (validation packs are prepared like offline training packs), but "
                        f"packing.mode=in_batch; set packing.mode=offline or unset {key}.")
    return problems


def _validate_verify_layout(cfg: Config, command: Optional[str], world_size: Optional[int]) -> list[str]:
    """verify runs at every layout train accepts; only ``verify.checkpoint`` reads its weights into the whole
    model of one rank (no TP, pipeline or expert split)."""
    p = cfg.parallel
    split = {"tensor_model_parallel_size": p.tensor_model_parallel_size,
             "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
             "expert_model_parallel_size": p.expert_model_parallel_size}
    split = {key: size for key, size in split.items() if size > 1}
    if command != "verify" or world_size is None or not cfg.verify.checkpoint or not split:
        return []
    key, size = next(iter(split.items()))
    return [f"parallel.{key} ({size}) > 1 with verify.checkpoint ({cfg.verify.checkpoint}): verify loads a "
            "checkpoint into the whole model of each rank; launch it with TP = PP = EP = 1 (CP and DP run), or "
            "export the checkpoint and verify the folder at this layout with model.pretrained=... "
            "verify.reference=transformers."]


def _validate_prepare_input(cfg: Config, command: Optional[str]) -> list[str]:
    """What only ``prepare`` needs (it reads the raw data; train and verify read the prepared dataset)."""
    if command == "prepare" and cfg.data.source == "files" and not cfg.data.input and not cfg.data.sources:
        return ["data.input (None) is required by prepare when data.source=files; "
                "set data.input=/path/to/train.jsonl (a file, directory or glob), or input=... for short, "
                "or data.sources=[{name: ..., input: ..., weight: ...}, ...] to mix several."]
    return []


_TRACKERS = (("logging.wandb", "wandb", "wandb"), ("logging.mlflow", "mlflow", "mlflow"))
"""(key, module, extra) of each experiment tracker."""


def _validate_trackers(cfg: Config, host: Optional[Host] = None) -> list[str]:
    """``logging.wandb`` / ``logging.mlflow`` need their package on this host: refused before launch, not by rank 0
    at its first step."""
    if host is None or host.packages is None:
        return []
    return [f"{key}=true needs the {module} package, which is not installed here; pip install "
            f"'megatron-pack[{extra}]', or set {key}=false."
            for key, module, extra in _TRACKERS if _value_of(cfg, key) and module not in host.packages]


INPUTS = ("world_size", "dataset_meta", "host", "command")
"""What a rule may need besides the config: the number of ranks, the prepared plan's metadata, the machine
(``config.host.Host``) and the command (prepare, train, verify, export). Each is None where it is unknown,
and a rule says nothing it cannot decide without its inputs."""


@dataclass(frozen=True)
class Rule:
    """One validation rule, declared once with what it needs."""

    check: Callable[..., list[str]]
    """``check(cfg, *needs)``: the rule's one-line problems (empty when it holds)."""
    needs: tuple[str, ...] = ()
    """The ``INPUTS`` passed to ``check`` after the config, in this order."""
    early: bool = False
    """No setting read from a prepared dataset changes its verdict: checked before the dataset is read (so a
    refusal never suggests re-preparing for a run this config or host cannot start anyway)."""

    def problems(self, cfg: Config, inputs: dict[str, Any]) -> list[str]:
        return self.check(cfg, *(inputs[name] for name in self.needs))


RULES: tuple[Rule, ...] = (
    Rule(_validate_world_size, ("world_size",), early=True),
    Rule(lambda cfg, world_size: _expert_parallel_problems(cfg.parallel, world_size), ("world_size",), early=True),
    Rule(_validate_device, ("host",), early=True),
    Rule(_validate_trackers, ("host",), early=True),
    Rule(_validate_verify_layout, ("command", "world_size"), early=True),
    Rule(_validate_prepare_input, ("command",)),
    Rule(_validate_verify_reference),
    Rule(_validate_pipeline_parallel, early=True),
    Rule(_validate_sequence_parallel, early=True),
    Rule(_validate_tensor_parallel),
    Rule(_validate_linear_attention),
    Rule(_validate_deepstack),
    Rule(_validate_context_parallel),
    Rule(_validate_per_token_loss),
    Rule(_validate_offline_packing),
    Rule(_validate_in_batch_packing),
    Rule(_validate_online_packing),
    Rule(_validate_step_batches),
    Rule(_validate_epochs),
    Rule(_validate_pad_cu_seqlens),
    Rule(_validate_cuda_graphs),
    Rule(_validate_pad_multiple),
    Rule(_validate_packed_sizes),
    Rule(_validate_packing_strategy),
    Rule(_validate_vocab_size),
    Rule(_validate_attention_backend),
    Rule(_validate_evaluation),
    Rule(_validate_fp8),
    Rule(_validate_moe),
    Rule(_validate_batch_size, ("world_size",), early=True),
    Rule(_validate_virtual_pipeline, ("world_size",), early=True),
    Rule(_validate_dataset_meta, ("dataset_meta",)),
    Rule(_validate_image_dataset, ("dataset_meta",)),
)
"""Every cross-group rule, in the order its problems are listed. ``validate()``, ``train --check``, ``train``,
``verify``, ``prepare`` and the launch scripts (through ``train --check``) run the rules whose inputs they
have, before any process group starts."""


def collect_problems(cfg: Config, *, world_size: Optional[int] = None, dataset_meta: Optional[dict[str, Any]] = None,
                     host: Optional[Host] = None, command: Optional[str] = None, early_only: bool = False) -> list[str]:
    """Every cross-group problem of ``cfg`` (empty when it is valid); ``early_only``: the rules no dataset
    setting changes (``Rule.early``)."""
    inputs = {"world_size": world_size, "dataset_meta": dataset_meta, "host": host, "command": command}
    return [p for rule in RULES if rule.early or not early_only for p in rule.problems(cfg, inputs)]


def validate(cfg: Config, *, world_size: Optional[int] = None, dataset_meta: Optional[dict[str, Any]] = None,
             host: Optional[Host] = None, command: Optional[str] = None) -> None:
    """Raise one ``ConfigError`` listing every problem; return None when ``cfg`` is valid.

    ``world_size`` enables the rules that need it (divisibility, batch split); ``dataset_meta``
    (the packed dataset's plan metadata: ``pack_size``, ``max_samples_per_bin``,
    ``pad_seq_to_mult``, ``vocab_size``) enables the rules about the prepared dataset. Pass
    ``dataset_meta={}`` when the dataset was looked for and has no metadata file. ``host``
    (``Host.probe()``) enables the rules about this machine, ``command`` those of one command.
    """
    problems = collect_problems(cfg, world_size=world_size, dataset_meta=dataset_meta, host=host, command=command)
    if problems:
        raise ConfigError(problems)


def validate_parallel(par: ParallelConfig, *, world_size: Optional[int]) -> None:
    """The layout rules of ``validate`` alone (world size, PP, sequence parallelism), for code that
    holds only ``parallel.*``: ``initialize_parallel`` calls it before any process group starts."""
    problems = (_world_size_problems(par, world_size) + _pipeline_problems(par) + _sequence_parallel_problems(par)
                + _expert_parallel_problems(par, world_size))
    if problems:
        raise ConfigError(problems)


def config_warnings(cfg: Config) -> list[str]:
    """Settings that run but are most likely not what was meant: one line each, printed once by ``train``
    and ``train --check`` (never a refusal)."""
    t = cfg.train
    if t.train_iters is not None and t.lr_warmup_iters >= t.train_iters:
        return [f"train.lr_warmup_iters ({t.lr_warmup_iters}) >= train.train_iters ({t.train_iters}): the learning "
                f"rate never reaches train.lr ({t.lr:g}) and never decays; set train.lr_warmup_iters below "
                f"{t.train_iters} (e.g. {t.train_iters // 10}) or raise train.train_iters."]
    return []


def launch_problems(cfg: Config, *, world_size: Optional[int], host: Optional[Host] = None,
                    command: Optional[str] = None) -> list[str]:
    """The early rules (``Rule.early``: world size, PP, sequence parallelism, batch split, the host): train and
    verify check them before they look for the dataset."""
    return collect_problems(cfg, world_size=world_size, host=host, command=command, early_only=True)


def prepare_problems(cfg: Config) -> list[str]:
    """What only ``prepare`` needs (it reads the raw data; train and verify read the prepared dataset)."""
    return _validate_prepare_input(cfg, "prepare")
