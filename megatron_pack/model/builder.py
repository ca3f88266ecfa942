"""Build megatron-core's ``GPTModel`` from our ``Config``: RoPE, GQA, SwiGLU, RMSNorm/LayerNorm.

Two layer specs, chosen by ``model.attention_backend``:

* ``te``    Transformer Engine's layer spec (fused THD attention with CP, ``parallel.cp_comm_type``,
            TE norms and linears). Needs ``transformer_engine`` and CUDA.
* ``torch`` megatron-core's local modules with our ``ThdCoreAttention`` (pure torch, THD + CP)
            and ``SequenceParallelNorm`` (so sequence parallelism works), and RoPE by in-sequence
            position whatever ``max_seqlen`` says (``model/rope.py``); runs on CPU and GPU.
* ``auto``  ``te`` when ``transformer_engine`` imports and CUDA is present, else ``torch``.

``model.fp8`` (a recipe other than 'none') sets megatron-core's FP8 settings on the ``te`` backend
and keeps padded rows at zero (``model/fp8.py``); on the torch backend (CPU) it is refused, never ignored.

The whole ``TransformerConfig`` comes from one function, ``transformer_config_from(cfg)``.

Example::

    state = initialize_parallel(cfg)                # groups first (gloo on CPU)
    model = build_model(cfg, state)                 # GPTModel, float32 on CPU
    logits = model(tokens, position_ids, None, packed_seq_params=params)   # [1, T/CP, V/TP]
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_pack.config.choices import CP_COMM_TYPES, GATED_ACTIVATIONS
from megatron_pack.config.schema import Config, ConfigError
from megatron_pack.config.validate import vocab_problems
from megatron_pack.model.attention import ATTENTION_MODES, ThdCoreAttention
from megatron_pack.model.fp8 import fp8_config_kwargs, te_recipe_problem, zero_padding_rows
from megatron_pack.model.moe import attach_pack_routing, moe_config_kwargs
from megatron_pack.model.norms import SequenceParallelNorm
from megatron_pack.parallel.groups import ParallelState
from megatron_pack.parallel.pipeline import StageLayout, stage_layout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_TE_CP_COMM_SPELLING = {"allgather": "all_gather"}
"""parallel.cp_comm_type values (``config.choices.CP_COMM_TYPES``) that Transformer Engine spells otherwise."""


def te_cp_comm_type(value: str) -> str:
    """``parallel.cp_comm_type`` in megatron-core / Transformer Engine spelling: ``allgather -> all_gather``."""
    if value not in CP_COMM_TYPES:
        raise ValueError(f"parallel.cp_comm_type ({value!r}) must be one of {list(CP_COMM_TYPES)}.")
    return _TE_CP_COMM_SPELLING.get(value, value)


def te_import_error() -> Optional[str]:
    """None when Transformer Engine's torch extension imports, else why it does not."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken CUDA install raising anything else
        return f"{type(exc).__name__}: {exc}"
    return None


def apex_wgrad_fusion_available(on_gpu: bool = False) -> bool:
    """True for a GPU run (``on_gpu``: the run's device, ``ParallelState.device``) where apex's
    ``fused_weight_gradient_mlp_cuda`` extension imports."""
    if not on_gpu:
        return False
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401  (apex built with --cuda_ext)
    except ImportError:
        return False
    return True


def choose_backend(requested: str, *, attention_mode: str = "thd", on_gpu: bool = False) -> str:
    """Resolve ``model.attention_backend`` to 'te' or 'torch' (see the module docstring); ``on_gpu``: the
    run computes on a GPU (``ParallelState.device``)."""
    if attention_mode != "thd":
        if requested == "te":
            raise ValueError(f"verify.attention={attention_mode} exists only in the torch attention; "
                             "set model.attention_backend=torch (or auto).")
        return "torch"
    if requested == "torch":
        return "torch"
    te_error = te_import_error()
    if requested == "te":
        if te_error is not None or not on_gpu:
            why = te_error if te_error is not None else "this run's device is the CPU"
            raise ValueError(f"model.attention_backend ('te') needs Transformer Engine and CUDA ({why}); "
                             "install megatron_pack[gpu] on a GPU host or set model.attention_backend=torch.")
        return "te"
    if requested == "auto":
        return "te" if te_error is None and on_gpu else "torch"
    raise ValueError(f"model.attention_backend ({requested!r}) must be one of ['auto', 'torch', 'te'].")


def _activation(name: str):
    """swiglu: SiLU; geglu: GELU with the tanh approximation; quick_geglu: x * sigmoid(1.702 x) (megatron-core's
    quick_gelu, gpt-oss); gated by GATED_ACTIVATIONS; gelu: exact GELU."""
    if name == "quick_geglu":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    return {"swiglu": F.silu, "geglu": functools.partial(F.gelu, approximate="tanh")}.get(name, F.gelu)


def transformer_config_from(cfg: Config, *, backend: str = "torch", on_gpu: bool = False):
    """megatron-core ``TransformerConfig`` for ``cfg`` (the one place our config meets megatron's);
    ``on_gpu``: the run computes on a GPU (``ParallelState.device``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p = cfg.model, cfg.parallel
    fused = backend == "te"
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels, normalization=m.normalization, layernorm_epsilon=m.norm_epsilon,
        add_qkv_bias=m.add_qkv_bias, qk_layernorm=m.qk_layernorm,
        # windows and sinks (model/attention_reach.py): the torch core and TE read the same three fields
        window_size=tuple(m.window_size) if m.window_size is not None else None,
        window_attn_skip_freq=m.window_attn_skip_freq, softmax_type=m.softmax_type,
        gated_linear_unit=m.activation in GATED_ACTIVATIONS, activation_func=_activation(m.activation),
        softmax_scale=m.softmax_scale, layernorm_zero_centered_gamma=m.zero_centered_norm,
        # the hybrid stack's Gated DeltaNet sizes (read by model/linear_attention.py) and the gated full attention
        linear_num_key_heads=m.linear_num_key_heads, linear_num_value_heads=m.linear_num_value_heads,
        linear_key_head_dim=m.linear_key_head_dim, linear_value_head_dim=m.linear_value_head_dim,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim, attention_output_gate=m.attention_output_gate,
        # a hybrid stack's layers hold different tensors: checkpoint them per layer, not stacked over layers
        hetereogenous_dist_checkpoint=m.full_attention_interval is not None,
        add_bias_linear=m.add_bias_linear, init_method_std=m.init_method_std,
        # gpt-oss's experts: act(min(gate, c)) * (clamp(up, -c, c) + offset)
        glu_linear_offset=m.glu_linear_offset, activation_func_clamp_value=m.activation_clamp,
        attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout,
        params_dtype=_DTYPES[m.params_dtype], bf16=cfg.train.bf16,
        # the stages exchange what Float16Module's chunks produce: bfloat16 activations with train.bf16
        pipeline_dtype=torch.bfloat16 if cfg.train.bf16 else _DTYPES[m.params_dtype],
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        context_parallel_size=p.context_parallel_size, pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size if p.num_model_chunks > 1 else None,
        sequence_parallel=p.sequence_parallel, cp_comm_type=te_cp_comm_type(p.cp_comm_type) if fused else None,
        calculate_per_token_loss=m.calculate_per_token_loss,
        # CPU init builds each full weight from the default generator and slices it, so a model
        # has the same weights for every TP size (what the parallel-invariance tests rely on).
        use_cpu_initialization=not on_gpu, perform_initialization=True,
        # megatron-core's deterministic paths (TE attention, the embedding's gather) where they differ: a GPU
        deterministic_mode=cfg.train.deterministic and (fused or on_gpu),
        # M-RoPE: megatron-core's unfused THD RoPE reads per-token frequencies of the whole pack (model/vlm.py)
        bias_dropout_fusion=fused, apply_rope_fusion=fused and m.mrope_section is None, masked_softmax_fusion=False,
        mrope_section=list(m.mrope_section) if m.mrope_section is not None else None,
        # apex's fused weight-gradient accumulation into DDP's main_grad (GPU, when apex is built)
        bias_activation_fusion=False, gradient_accumulation_fusion=apex_wgrad_fusion_available(on_gpu),
        persist_layer_norm=False,
        # stage links as plain isend/irecv, posted even/odd so both ends of a link match them in order (the
        # batched ops cross a forward and a backward tensor where the previous and next stage are one rank:
        # the interleaved ring at PP=2; gloo has no coalesced batch either)
        batch_p2p_comm=False,
        cuda_graph_impl=m.cuda_graph_impl, cuda_graph_scope=list(m.cuda_graph_scope),  # [] = whole layer
        use_te_rng_tracker=graph_rng(cfg, "te" if fused else "torch"),  # graphs capture TE's graph-safe RNG
        **recompute_kwargs(cfg), **fp8_config_kwargs(m.fp8 if fused else "none"),
        **moe_config_kwargs(m),
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
    )
    # megatron-core's GPU pipeline schedules exchange activation shapes unless every pack has one
    # shape; set after __post_init__, whose check of it concerns the MoE allgather dispatcher only
    config.variable_seq_lengths = p.pipeline_model_parallel_size > 1 and not fixed_pack_shapes(cfg)
    return config


def fixed_pack_shapes(cfg: Config) -> bool:
    """Every pack has the same token count and cu_seqlens length (``data.pad_to_max_length`` with
    ``packing.pad_cu_seqlens``): pipeline stages then skip the shape exchange (CUDA graphs)."""
    return cfg.data.pad_to_max_length and cfg.packing.pad_cu_seqlens


def recompute_kwargs(cfg: Config) -> dict:
    """megatron-core's recompute settings for ``model.recompute_*``.

    'selective' recomputes core attention (megatron-core's default module list ``["core_attn"]``);
    'full' checkpoints whole layers: 'uniform' every ``recompute_num_layers`` (default 1) layers,
    'block' the first ``recompute_num_layers`` (default all) layers.
    """
    m = cfg.model
    if m.recompute_granularity is None:
        return {}
    if m.recompute_granularity == "selective":
        return {"recompute_granularity": "selective"}
    method = m.recompute_method or "uniform"
    default_layers = 1 if method == "uniform" else m.num_layers
    return {"recompute_granularity": "full", "recompute_method": method,
            "recompute_num_layers": m.recompute_num_layers or default_layers}


def local_block_spec(num_layers: int, *, attention_mode: str = "thd", qk_layernorm: bool = False,
                     num_experts: Optional[int] = None, full_attention_interval: Optional[int] = None,
                     layer_offset: int = 0):
    """Block spec of megatron-core local modules with our THD attention core and SP-capable norms.

    ``qk_layernorm`` (Qwen3) norms each query/key head; megatron-core's ``finalize_model_grads``
    sums those weights' gradients over TP (each TP rank sees only its own heads).
    ``full_attention_interval`` N (Qwen3.5): global layer i (from 0; this chunk's first is ``layer_offset``) is full
    attention when (i + 1) % N == 0, a packed Gated DeltaNet layer otherwise."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megatron_pack.model.moe_router import moe_mlp_spec

    if attention_mode not in ATTENTION_MODES:
        raise ValueError(f"verify.attention ({attention_mode!r}) must be one of {list(ATTENTION_MODES)}.")
    attention = ModuleSpec(
        module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear, linear_proj=RowParallelLinear,
            core_attention=ModuleSpec(module=ThdCoreAttention, params={"mode": attention_mode}),
            q_layernorm=SequenceParallelNorm if qk_layernorm else IdentityOp,
            k_layernorm=SequenceParallelNorm if qk_layernorm else IdentityOp))
    layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=SequenceParallelNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=SequenceParallelNorm,
        mlp=moe_mlp_spec() if num_experts else ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    specs = [layer] * num_layers
    if full_attention_interval is not None:
        from megatron_pack.model.linear_attention import linear_attention_layer_spec

        linear = linear_attention_layer_spec(layer)
        specs = [layer if is_full_attention(layer_offset + i, full_attention_interval) else linear
                 for i in range(num_layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=SequenceParallelNorm)


def is_full_attention(layer: int, full_attention_interval: Optional[int]) -> bool:
    """Whether global layer ``layer`` (from 0) is full attention: every N-th counted from 1; None: every layer.

    >>> [is_full_attention(i, 4) for i in range(4)]
    [False, False, False, True]
    """
    return full_attention_interval is None or (layer + 1) % full_attention_interval == 0


def te_layer_spec(qk_layernorm: bool = False, num_experts: Optional[int] = None):
    """Transformer Engine layer spec (fused THD attention with CP, told ``pad_between_seqs``: ``model/te_attention.py``;
    TE norms and linears); a MoE model's
    MLP is our MoE layer and router (``model/moe.py``: they read the routing index the step passes as
    ``padding_mask``, which megatron-core's own layer would read as a boolean mask) with TE's experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_pack.model.moe_router import moe_mlp_spec

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                      qk_layernorm=qk_layernorm)
    attention = getattr(spec.submodules.self_attention, "submodules", None)
    if attention is not None:  # TE is told that sub-sequences are padded (model/te_attention.py, TE issue #3331)
        from megatron_pack.model.te_attention import padded_thd_attention_class

        attention.core_attention = padded_thd_attention_class()
    if num_experts:
        ours = moe_mlp_spec()
        spec.submodules.mlp.module = ours.module
        spec.submodules.mlp.submodules.router = ours.submodules.router
    return spec


def _deterministic_te_env(cfg: Config, backend: str) -> None:
    """TE attention in megatron's deterministic mode needs NVTE_ALLOW_NONDETERMINISTIC_ALGO=0."""
    if backend != "te" or not cfg.train.deterministic:
        return
    current = os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    if current != "0":
        raise ValueError(f"train.deterministic (True) with Transformer Engine needs NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, "
                         f"but the environment sets it to {current!r}; unset it or set train.deterministic=false.")


def _check_fp8(cfg: Config, backend: str, on_gpu: bool = False) -> None:
    """model.fp8 needs Transformer Engine on a GPU that runs the recipe: refused otherwise, never ignored."""
    recipe = cfg.model.fp8
    if recipe == "none":
        return
    if backend != "te":
        why = te_import_error() or ("this run's device is the CPU" if not on_gpu
                                    else "model.attention_backend/verify.attention chose the torch layers")
        raise ConfigError([f"model.fp8 ({recipe}) needs Transformer Engine's FP8 linear layers on a GPU, but this run "
                           f"builds the torch layers ({why}); set model.fp8=none, or run on a GPU host with "
                           "megatron_pack[gpu] installed (prepare alone accepts model.fp8 anywhere)."])
    problem = te_recipe_problem(recipe)
    if problem:
        raise ConfigError([f"model.fp8 ({recipe}) cannot run here: {problem}; choose another model.fp8 "
                           "(delayed or current need compute capability >= 8.9, blockwise 9.0 with CUDA >= 12.9, "
                           "mxfp8 10.0) or model.fp8=none."])


def graph_rng(cfg: Config, backend: str) -> bool:
    """CUDA graphs need Transformer Engine's graph-safe RNG tracker (megatron-core's ``CudaGraphManager`` and TE's
    ``make_graphed_callables`` refuse others); only the TE backend runs graphs (``_check_cuda_graphs``)."""
    return backend == "te" and cfg.model.cuda_graph_impl != "none"


def _check_cuda_graphs(cfg: Config, backend: str) -> None:
    if backend == "torch" and cfg.model.cuda_graph_impl != "none":
        raise ValueError(f"model.cuda_graph_impl ({cfg.model.cuda_graph_impl!r}) needs the Transformer Engine backend "
                         "(the torch THD attention reads cu_seqlens on the host, which a CUDA graph cannot "
                         "capture); set model.attention_backend=te or model.cuda_graph_impl=none.")


def padded_vocab_size(cfg: Config) -> int:
    """Embedding rows built: ``model.vocab_size``, rounded up to a multiple of TP for a pretrained
    model (the pad rows are masked out of the logits and dropped again on export)."""
    tp, vocab = cfg.parallel.tensor_model_parallel_size, cfg.model.vocab_size
    return -(-vocab // tp) * tp if cfg.model.pretrained else vocab


def _check_divisibility(cfg: Config) -> None:
    """validate()'s vocab rule again, for a ``Config`` built in Python without ``load_config``."""
    problems = vocab_problems(cfg)
    if problems:
        raise ConfigError(problems)


def stage_of(cfg: Config, pg: ParallelState, vp_stage: int = 0) -> StageLayout:
    """This rank's pipeline stage, model chunk ``vp_stage`` of it (its layers, and whether it holds the
    embedding / the output layer)."""
    pp_group = getattr(pg.pg_collection, "pp", None)
    pp_rank = pp_group.rank() if pp_group is not None else 0
    return stage_layout(cfg.model.num_layers, cfg.parallel.pipeline_model_parallel_size, pp_rank,
                        cfg.parallel.num_model_chunks, vp_stage)


def build_model(cfg: Config, pg: Optional[ParallelState] = None, *, attention_mode: str = "thd", vp_stage: int = 0):
    """megatron-core ``GPTModel`` for ``cfg`` on this process's groups (``ParallelState``).

    ``pg`` None initialises the groups from ``cfg`` first (a world of one outside torchrun).
    Seeds the weights with ``train.seed`` (CPU: identical full weights for every TP size).
    ``attention_mode='pack_causal'`` builds the broken model ``verify.attention`` demonstrates.
    ``vp_stage``: which of the rank's model chunks (``parallel.virtual_pipeline_model_parallel_size``)
    to build (megatron-core's ``GPTModel(vp_stage=)``: its layers' global numbers follow from it).
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    if pg is None:
        from megatron_pack.parallel.groups import initialize_parallel

        pg = initialize_parallel(cfg)
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda

    enable_cpu_compat_without_cuda()
    _check_divisibility(cfg)
    on_gpu = pg.device.type == "cuda"  # decided once, in the parallel state
    requested = cfg.model.attention_backend
    if cfg.model.full_attention_interval is not None and requested == "auto":
        requested = "torch"  # the hybrid (linear-attention) stack is built from the local spec only
    backend = choose_backend(requested, attention_mode=attention_mode, on_gpu=on_gpu)
    _check_cuda_graphs(cfg, backend)
    _check_fp8(cfg, backend, on_gpu)
    _deterministic_te_env(cfg, backend)
    config = transformer_config_from(cfg, backend=backend, on_gpu=on_gpu)
    if cfg.model.pretrained:  # every weight is read from the folder; skip the random init
        config.perform_initialization = False
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(cfg.train.seed)
    # megatron's named RNG streams (CPU generator states under cpu_compat)
    model_parallel_cuda_manual_seed(cfg.train.seed, tp_rank=pg.tp_rank, ep_rank=pg.ep_rank, etp_rank=pg.etp_rank,
                                    te_rng_tracker=graph_rng(cfg, backend), force_reset_rng=graph_rng(cfg, backend))
    stage = stage_of(cfg, pg, vp_stage)
    if backend == "te" and cfg.model.full_attention_interval is not None:  # validate() refuses it first
        raise ValueError("model.full_attention_interval (linear attention) runs on model.attention_backend=torch only.")
    spec = (te_layer_spec(cfg.model.qk_layernorm, cfg.model.num_experts) if backend == "te" else
            local_block_spec(stage.num_local_layers, attention_mode=attention_mode, qk_layernorm=cfg.model.qk_layernorm,
                             num_experts=cfg.model.num_experts,
                             full_attention_interval=cfg.model.full_attention_interval,
                             layer_offset=stage.layer_offset))
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=padded_vocab_size(cfg),
        max_sequence_length=cfg.model.max_position_embeddings or cfg.model.seq_length,
        pre_process=stage.is_first, post_process=stage.is_last, parallel_output=True,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type="rope" if cfg.model.mrope_section is None else "mrope",
        rotary_base=cfg.model.rotary_base, rotary_percent=cfg.model.rotary_percent,
        seq_len_interpolation_factor=cfg.model.rope_scaling_factor if cfg.model.rope_scaling == "linear" else None,
        pg_collection=pg.pg_collection, vp_stage=vp_stage if stage.vp_size > 1 else None,
    )
    if not config.perform_initialization:
        mark_tensor_parallel(model)
    if cfg.model.mrope_section is not None:  # a vision-language model (model/vlm.py)
        from megatron_pack.model.vlm import attach_vision

        attach_vision(model, cfg.model.pretrained, cfg.model.image_token_id, _DTYPES[cfg.model.params_dtype],
                      interleaved=cfg.model.mrope_interleaved, deepstack_layers=cfg.model.deepstack_layers)
    elif backend == "torch":  # TE's fused RoPE already rotates by in-sequence position
        from megatron_pack.model.rope import use_in_sequence_rope

        use_in_sequence_rope(model)
    model.attention_backend = backend
    _attach_layer_features(model, cfg)
    attach_pack_routing(model, cfg.model)
    if cfg.model.fp8 != "none":  # padding rows stay 0 at every FP8 GEMM input (model/fp8.py)
        model.fp8_padding_hooks = zero_padding_rows(
            model, cp_size=cfg.parallel.context_parallel_size, cp_rank=pg.cp_rank,
            tp_size=cfg.parallel.tensor_model_parallel_size, tp_rank=pg.tp_rank,
            sequence_parallel=cfg.parallel.sequence_parallel)
    _apply_rope_scaling(model, cfg)
    _mask_padded_vocab(model, cfg, pg.tp_rank)
    if cfg.model.pretrained:
        from megatron_pack.model.hf.load import load_pretrained

        from megatron_pack.model.hf.transforms import Dims

        p = cfg.parallel  # an expert-parallel rank reads only its own experts (the model's placement)
        dims = Dims.from_model_config(cfg.model, p.tensor_model_parallel_size, ep=p.expert_model_parallel_size,
                                      etp=p.expert_tensor_parallel_size)
        model.pretrained_report = load_pretrained(model, cfg.model.pretrained, cfg.model, tp_rank=pg.tp_rank,
                                                  tp_size=p.tensor_model_parallel_size, etp_rank=pg.etp_rank,
                                                  dims=dims)
    if cfg.model.mrope_section is not None:
        from megatron_pack.model.vlm import freeze_vision

        freeze_vision(model, cfg.model.pretrained, cfg.model.freeze_vision)
    if cfg.peft.method == "lora":  # after loading: the base is complete and then frozen
        from megatron_pack.model.peft.lora import apply_lora

        model.num_adapters = apply_lora(model, cfg.peft, seed=cfg.train.seed, tp_group=pg.tp_group,
                                        tp_size=cfg.parallel.tensor_model_parallel_size, tp_rank=pg.tp_rank,
                                        sequence_parallel=cfg.parallel.sequence_parallel,
                                        layer_offset=stage_of(cfg, pg, vp_stage).layer_offset)
        if cfg.model.resize_vocab:  # grown rows start at the mean: the vocabulary layers train (peft/meta.py)
            from megatron_pack.model.peft.lora import train_vocab_layers

            train_vocab_layers(model)
    return model.to(pg.device)


def _attach_layer_features(model, cfg: Config) -> None:
    """The features of ``model/layer_features.py`` a family asks for (Gemma 3: post-norms, local RoPE base, scaled
    embeddings); before the weights load, so a pretrained folder fills the post-norms too."""
    from megatron_pack.model.layer_features import add_post_norms, scale_embeddings, use_local_rope

    if cfg.model.post_norms:
        add_post_norms(model)
    if cfg.model.rotary_base_local is not None:
        use_local_rope(model, cfg.model.rotary_base_local)
    if cfg.model.scale_embeddings:
        scale_embeddings(model)


def mark_tensor_parallel(model) -> int:
    """Give the TP-split weights megatron-core's ``tensor_model_parallel`` / ``partition_dim`` attributes.

    megatron-core 0.16.1 sets them only inside its weight initialisation, which a pretrained model
    skips (``perform_initialization=False``): without them the gradient norm counted a TP-split
    weight on TP rank 0 only (clipping under TP, and with it every update, depended on the layout).
    Column-parallel linears and the vocabulary split dim 0 (and their bias), row-parallel linears dim 1.
    Returns the number of tensors marked."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding, set_tensor_model_parallel_attributes)

    marked = 0
    for module in model.modules():
        dim = 0 if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) else (
            1 if isinstance(module, RowParallelLinear) else None)
        if dim is None:
            continue
        tensors = [module.weight] + ([module.bias] if dim == 0 and getattr(module, "bias", None) is not None else [])
        for tensor in tensors:
            if tensor is not None and not hasattr(tensor, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(tensor, True, dim, 1)
                marked += 1
    return marked


def _apply_rope_scaling(model, cfg: Config) -> None:
    """Llama 3.1 frequency scaling with the model's own four numbers (megatron-core's own
    ``rope_scaling`` hard-codes low 1, high 4, original 8192; its ``_apply_scaling`` takes all four); YaRN's
    frequencies (``rope.yarn_inv_freq``; its attention factor is in ``model.softmax_scale``)."""
    m = cfg.model
    if m.rope_scaling == "yarn":
        from megatron_pack.model.rope import yarn_inv_freq

        rope = model.rotary_pos_emb
        rope.inv_freq = yarn_inv_freq(rope.inv_freq, m)
        return
    if m.rope_scaling != "llama3":
        return
    rope = model.rotary_pos_emb
    rope.inv_freq = rope._apply_scaling(rope.inv_freq, factor=m.rope_scaling_factor,
                                        low_freq_factor=m.rope_low_freq_factor,
                                        high_freq_factor=m.rope_high_freq_factor,
                                        original_max_position_embeddings=m.rope_original_max_position_embeddings)


def _mask_padded_vocab(model, cfg: Config, tp_rank: int) -> None:
    """Logits of the pad rows (vocabulary padded for TP) are -inf, so softmax and loss see only real tokens.

    Example: vocab 301 at TP=2 builds 302 rows; rank 1 holds rows 151-301, whose last column is masked.
    """
    padded, vocab = padded_vocab_size(cfg), cfg.model.vocab_size
    per_rank = padded // cfg.parallel.tensor_model_parallel_size
    first_pad = vocab - tp_rank * per_rank
    if padded == vocab or first_pad >= per_rank or not model.post_process:
        return

    def hook(module, args, output):
        logits, bias = output
        logits = logits.clone()
        logits[..., max(first_pad, 0):] = float("-inf")
        return logits, bias

    model.output_layer.register_forward_hook(hook)
