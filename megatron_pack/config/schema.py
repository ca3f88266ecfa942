"""Config dataclasses, one per group.

Every group is a keyword-only dataclass with a docstring under each field. They are registered
as Hydra structured configs (see ``megatron_pack.config.loader``), so an override naming a key
that does not exist fails at once. Single-field checks live in each group's ``field_problems``
(called from ``__post_init__``); checks that span groups live in ``megatron_pack.config.validate``.

Config is read-only after ``load_config``: derived numbers (data-parallel size, pad multiple)
come from ``megatron_pack.parallel.dims.ParallelDims``, never from mutating a field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_pack.config.choices import (CHAT_ROLES, CHOICES, CUDA_GRAPH_SCOPES, DEFAULT_COST_A, DEFAULT_COST_B,
                                          NULLABLE_CHOICES, STOP_SIGNALS)


class ConfigError(ValueError):
    """One or more config problems; ``problems`` holds one message per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} config problem(s):\n{lines}")


def _positive(group: str, obj: Any, names: tuple[str, ...], allow_zero: tuple[str, ...] = ()) -> list[str]:
    """Messages for integer fields that must be > 0 (or >= 0 for ``allow_zero``)."""
    problems = []
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        floor = 0 if name in allow_zero else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < floor:
            kind = "a non-negative integer" if floor == 0 else "a positive integer"
            problems.append(f"{group}.{name} ({value!r}) must be {kind}; set {group}.{name}=<int >= {floor}>.")
    return problems


def nearest(value: Any, choices: tuple[str, ...]) -> str:
    """The choice closest to a mistyped ``value`` (``'sharegtp' -> 'sharegpt'``, ``'trunc' -> 'truncate'``);
    the first choice (the default) when none is close (``'greedy'``: no algorithm is spelt like it)."""
    import difflib

    text = str(value)
    prefixed = [c for c in choices if c.startswith(text) or text.startswith(c)]
    if prefixed:
        return max(prefixed, key=lambda c: difflib.SequenceMatcher(None, text, c).ratio())
    scored = [(difflib.SequenceMatcher(None, text, c).ratio(), -i, c) for i, c in enumerate(choices)]
    best = max(scored)
    return best[2] if best[0] >= 0.6 else choices[0]


def _choice(group: str, obj: Any, name: str) -> list[str]:
    """``group.name`` holds a value of its list in ``choices.CHOICES`` (or null where the key allows it)."""
    key = f"{group}.{name}"
    value, choices = getattr(obj, name), CHOICES[key]
    if value in choices or (value is None and key in NULLABLE_CHOICES):
        return []
    also = " or null" if key in NULLABLE_CHOICES else ""
    return [f"{key} ({value!r}) must be one of {list(choices)}{also}; set {key}={nearest(value, choices)}."]


class _Group:
    """Mixin: raise ``ConfigError`` from ``__post_init__`` listing this group's field problems."""

    GROUP = ""

    def field_problems(self) -> list[str]:  # overridden per group
        return []

    def __post_init__(self) -> None:
        problems = self.field_problems()
        if problems:
            raise ConfigError(problems)


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig(_Group):
    GROUP = "model"

    name: str = "tiny"
    """Human-readable model name (the YAML preset under configs/model/)."""
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 176
    """MLP inner width (per SwiGLU branch)."""
    num_attention_heads: int = 4
    """Number of query heads; must be divisible by the tensor-parallel size."""
    num_query_groups: Optional[int] = 2
    """Number of key/value heads for grouped-query attention; None means one per query head."""
    kv_channels: Optional[int] = None
    """Per-head dimension; None means hidden_size / num_attention_heads."""
    vocab_size: int = 384
    """Embedding rows; must be >= the tokenizer's vocabulary (padded for TP divisibility)."""
    seq_length: int = 512
    """Tokens per micro-batch row; equals packing.packed_sequence_size when packing."""
    max_position_embeddings: Optional[int] = None
    """Longest position RoPE is built for; None means seq_length."""
    normalization: str = "RMSNorm"
    """'RMSNorm' or 'LayerNorm'."""
    activation: str = "swiglu"
    """'swiglu', 'gelu', 'geglu' or 'quick_geglu' (config/choices.py ACTIVATIONS)."""
    rotary_base: int = 10000
    """RoPE base frequency."""
    untie_embeddings_and_output_weights: bool = True
    """Use a separate output projection instead of the input embedding."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (0 keeps runs deterministic)."""
    hidden_dropout: float = 0.0
    """Dropout on hidden states (0 keeps runs deterministic)."""
    attention_backend: str = "auto"
    """'auto' (Transformer Engine when CUDA and TE are present, else torch), 'torch' or 'te'."""
    calculate_per_token_loss: bool = True
    """Normalise by the global number of target tokens (required with CP and packing)."""
    params_dtype: str = "float32"
    """'float32' or 'bfloat16' parameters."""
    cuda_graph_impl: str = "none"
    """'none', 'local' (megatron-core CUDA graphs) or 'transformer_engine'."""
    fp8: str = "none"
    """FP8 recipe of the linear layers (Transformer Engine, GPU): 'none', 'delayed', 'current' (megatron-core's
    'tensorwise'), 'mxfp8' or 'blockwise'. Each pack's tokens are then padded to a multiple of
    cp * (tp with sequence_parallel) * 16 / 16 / 32 / 128 (docs/thd.md); padding stays zero and out of the scales."""
    cuda_graph_scope: list[str] = field(default_factory=list)
    """Parts captured by CUDA graphs: empty means the whole layer; or any of 'attn', 'mlp'."""
    pretrained: Optional[str] = None
    """A local Hugging Face model folder: architecture keys come from its config.json and the weights
    from its safetensors (docs/models.md); None trains from a random init."""
    resize_vocab: bool = False
    """Grow model.pretrained's embedding and output layer to data.tokenizer's vocabulary when the tokenizer has
    more ids than config.json's vocab_size (new rows: the mean of the old ones, as transformers'
    resize_token_embeddings(mean_resizing=True)); false refuses such a tokenizer (docs/models.md)."""
    check_pretrained_values: bool = True
    """train --check (the launch scripts) reads every weight of model.pretrained and refuses NaN / Inf
    before launch; false checks the safetensors headers only (each rank still checks its shard on load)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every RMSNorm / LayerNorm (config.json rms_norm_eps)."""
    add_qkv_bias: bool = False
    """A bias on the fused query/key/value projection (Qwen2 / Qwen2.5)."""
    qk_layernorm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3)."""
    window_size: Optional[list[int]] = None
    """Sliding-window attention (megatron-core's window_size): [left, 0], the query at position p of a sample reads
    that sample's keys max(0, p - left)..p (never the previous sample's); null: full causal attention. transformers'
    sliding_window=W is [W - 1, 0]."""
    window_attn_skip_freq: Optional[int] = None
    """With model.window_size: every N-th layer (N, 2N, ... counted from 1) keeps full attention, the others are
    windowed (2: alternating, as gpt-oss; 6: five windowed to one full, as Gemma 3); null: every layer windowed."""
    rotary_base_local: Optional[int] = None
    """RoPE base of the windowed layers (model.window_size; Gemma 3: 10000), model.rotary_base (and
    model.rope_scaling) then being the full-attention layers'; null: model.rotary_base everywhere."""
    softmax_scale: Optional[float] = None
    """Attention logit scale (Gemma 3: query_pre_attn_scalar ** -0.5); null: 1 / sqrt(kv_channels)."""
    zero_centered_norm: bool = False
    """Every RMSNorm scales by 1 + weight (Gemma): the weights are stored centred on 0, as in its checkpoints."""
    post_norms: bool = False
    """An RMSNorm on the attention output and on the MLP output before each residual add (Gemma 3's
    post_attention_layernorm and post_feedforward_layernorm)."""
    scale_embeddings: bool = False
    """Multiply the token embeddings by sqrt(hidden_size), rounded to their dtype (Gemma)."""
    full_attention_interval: Optional[int] = None
    """Hybrid linear attention (Qwen3.5): every N-th layer (N, 2N, ... counted from 1) is full attention, the others
    packed Gated DeltaNet layers (model/linear_attention.py; config.json full_attention_interval / layer_types);
    null: every layer full attention. The linear_* keys below size the linear-attention layers."""
    linear_num_key_heads: int = 16
    """Gated DeltaNet query/key heads (with model.full_attention_interval)."""
    linear_num_value_heads: int = 32
    """Gated DeltaNet value heads, a multiple of model.linear_num_key_heads."""
    linear_key_head_dim: int = 128
    """Gated DeltaNet query/key head dim."""
    linear_value_head_dim: int = 128
    """Gated DeltaNet value head dim."""
    linear_conv_kernel_dim: int = 4
    """Gated DeltaNet causal conv1d width (restarted at every sample)."""
    attention_output_gate: bool = False
    """Full-attention output gated per channel by sigmoid of a second query projection (Qwen3.5's doubled q_proj;
    megatron-core's attention_output_gate)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dims RoPE rotates, the first ones (Qwen3.5: partial_rotary_factor 0.25)."""
    softmax_type: str = "vanilla"
    """'vanilla', 'off-by-one' (a sink logit 0 per head) or 'learnable' (a trained sink logit per head,
    softmax_offset, as gpt-oss): an extra logit in every query's softmax with no value behind it."""
    rope_scaling: str = "none"
    """'none', 'llama3' (Llama 3.1 / 3.2 frequency scaling, the four rope_* keys below), 'linear' or 'yarn'
    (the model.rope_yarn_* keys)."""
    rope_scaling_factor: float = 8.0
    """llama3, linear or yarn rope scaling: factor."""
    rope_low_freq_factor: float = 1.0
    """llama3 rope scaling: low_freq_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 rope scaling: high_freq_factor."""
    rope_original_max_position_embeddings: int = 8192
    """llama3 or yarn rope scaling: original_max_position_embeddings."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation (megatron-core): None (off), 'selective' (core attention) or 'full' (whole layers)."""
    recompute_method: Optional[str] = None
    """With 'full': 'uniform' (checkpoint every recompute_num_layers layers) or 'block'; None means 'uniform'."""
    recompute_num_layers: Optional[int] = None
    """With 'full': layers per recompute unit ('uniform') or layers recomputed ('block'); None means 1 ('uniform')
    or every layer ('block')."""
    num_experts: Optional[int] = None
    """Routed experts of every MoE layer (config.json num_experts / num_local_experts); None: a dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to (config.json num_experts_per_tok)."""
    moe_ffn_hidden_size: Optional[int] = None
    """One expert's MLP inner width (config.json moe_intermediate_size; Mixtral: intermediate_size)."""
    moe_shared_expert_ffn_hidden_size: Optional[int] = None
    """A shared expert's MLP inner width, every token through it (Qwen2-MoE shared_expert_intermediate_size); None: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . gate) (Qwen2-MoE's shared_expert_gate)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts, then top-k, no renormalisation (Qwen3-MoE with norm_topk_prob false);
    false: top-k of the logits, then softmax over those k (Mixtral; Qwen3-MoE with norm_topk_prob true)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (per sample, over its real tokens; docs/training.md); 0: off."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss (mean over real tokens of logsumexp(router logits)^2); 0: off."""
    add_bias_linear: bool = False
    """A bias on every linear layer: attention's QKV and output projections, the MLP's or every expert's two
    linears and the router (gpt-oss); false: none (model.add_qkv_bias adds QKV's alone)."""
    glu_linear_offset: float = 0.0
    """Added to the up half of a gated MLP before the product: act(gate) * (up + offset) (gpt-oss: 1)."""
    activation_clamp: Optional[float] = None
    """Gated MLP clamps: gate to at most this value, up to [-value, value], before the product (gpt-oss
    swiglu_limit: 7); null: no clamp."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN (model.rope_scaling=yarn): beta_fast, rotations above which a frequency is kept (extrapolated)."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: beta_slow, rotations below which a frequency is divided by model.rope_scaling_factor."""
    rope_yarn_truncate: bool = True
    """YaRN: round the correction range to whole dims (config.json rope_scaling.truncate; gpt-oss: false)."""
    mrope_section: Optional[list[int]] = None
    """Multimodal RoPE (Qwen2.5-VL): rotary frequency pairs per (temporal, height, width) position row, summing to
    kv_channels / 2 (config.json rope_scaling.mrope_section); None: 1-D RoPE. Set by a vision-language model.pretrained."""
    mrope_interleaved: bool = False
    """Multimodal RoPE with the rows interleaved (Qwen3-VL, Qwen3.5: config.json mrope_interleaved): frequency pair j
    turns with the height row when j % 3 == 1 (j < 3 x section[1]), the width row when j % 3 == 2 (j < 3 x
    section[2]), else the temporal row; false: contiguous sections (Qwen2.5-VL). Set by model.pretrained."""
    deepstack_layers: int = 0
    """DeepStack (Qwen3-VL): the vision tower's features of its config.json deepstack_visual_indexes blocks are added
    at the image tokens to the outputs of decoder layers 0 .. deepstack_layers - 1; 0: none. Set by model.pretrained."""
    image_token_id: Optional[int] = None
    """The image placeholder token whose positions receive the vision features (config.json image_token_id);
    set by a vision-language model.pretrained."""
    freeze_vision: bool = True
    """Vision-language models: the vision tower's patch embedding and blocks do not train (the merger and the
    language model do); false trains the whole tower."""

    def field_problems(self) -> list[str]:
        g = self.GROUP
        problems = _positive(g, self, ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                       "num_query_groups", "kv_channels", "vocab_size", "seq_length",
                                       "max_position_embeddings", "rotary_base", "rotary_base_local",
                                       "rope_original_max_position_embeddings"))
        problems += _choice(g, self, "rope_scaling")
        if not 0 < self.norm_epsilon < 1:
            problems.append(f"model.norm_epsilon ({self.norm_epsilon}) must be in (0, 1); set model.norm_epsilon=1e-5.")
        if self.rope_scaling == "llama3" and not (self.rope_scaling_factor > 0
                                                  and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            problems.append(f"model.rope_scaling_factor ({self.rope_scaling_factor}) must be > 0 and "
                            f"0 < model.rope_low_freq_factor ({self.rope_low_freq_factor}) < "
                            f"model.rope_high_freq_factor ({self.rope_high_freq_factor}); use the values of the "
                            "model's config.json (Llama 3.1: 8, 1, 4).")
        for name in ("normalization", "activation", "attention_backend", "params_dtype", "cuda_graph_impl", "fp8"):
            problems += _choice(g, self, name)
        problems += _recompute_problems(self)
        problems += _moe_problems(self) + _gpt_oss_problems(self)
        for scope in self.cuda_graph_scope:
            if scope not in CUDA_GRAPH_SCOPES:
                problems.append(f"model.cuda_graph_scope entry {scope!r} must be "
                                f"{' or '.join(map(repr, CUDA_GRAPH_SCOPES))}; leave the list empty to capture whole layers.")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"model.{name} ({getattr(self, name)}) must be in [0, 1); set model.{name}=0.0.")
        if not problems:
            problems += self._head_problems()
        if self.resize_vocab and self.pretrained is None:
            problems.append("model.resize_vocab (True) grows a pretrained model's vocabulary and needs model.pretrained "
                            "(None); a model built from model.* takes the tokenizer's size by itself: drop "
                            "model.resize_vocab.")
        return problems + self._mrope_problems() + _window_problems(self) + _linear_attention_problems(self)

    def _mrope_problems(self) -> list[str]:
        if self.mrope_section is None:  # the multimodal keys without a vision-language model would do nothing
            return [f"model.{key} ({getattr(self, key)}) comes with a vision-language model.pretrained (Qwen3-VL, "
                    f"Qwen3.5) and its model.mrope_section; leave it to config.json (drop model.{key})."
                    for key in ("mrope_interleaved", "deepstack_layers") if getattr(self, key)]
        head_dim = self.kv_channels or self.hidden_size // self.num_attention_heads
        rotary = int(head_dim * self.rotary_percent) if self.rotary_percent < 1.0 else head_dim  # megatron-core's
        if len(self.mrope_section) != 3 or sum(self.mrope_section) * 2 != rotary:
            return [f"model.mrope_section ({list(self.mrope_section)}) must be three numbers summing to the rotary "
                    f"kv_channels x rotary_percent / 2 ({rotary // 2}); leave it to model.pretrained's config.json "
                    "(rope_scaling.mrope_section)."]
        if self.pretrained is None or self.image_token_id is None:
            return [f"model.mrope_section ({list(self.mrope_section)}) comes with a vision-language model.pretrained "
                    "(its vision tower and image_token_id); set model.pretrained to a Qwen2.5-VL folder or "
                    "model.mrope_section=null."]
        return []

    def _head_problems(self) -> list[str]:
        """Head-shape checks; run only once every size is a positive integer."""
        problems = []
        heads, groups = self.num_attention_heads, self.num_query_groups
        if groups is not None and heads % groups:
            problems.append(f"model.num_query_groups ({groups}) must divide model.num_attention_heads ({heads}); "
                            f"set model.num_query_groups to a divisor of {heads} (e.g. {_largest_divisor(heads, groups)}).")
        if self.kv_channels is None and self.hidden_size % heads:
            problems.append(f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_attention_heads "
                            f"({heads}) when model.kv_channels is None; set model.kv_channels=<head dim> "
                            f"or model.num_attention_heads to a divisor of {self.hidden_size}.")
        return problems


def _linear_attention_problems(m: "ModelConfig") -> list[str]:
    """model.full_attention_interval (>= 1) and the Gated DeltaNet sizes; model.rotary_percent in (0, 1]."""
    problems = _positive("model", m, ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                      "linear_value_head_dim", "linear_conv_kernel_dim"))
    every = m.full_attention_interval
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        problems.append(f"model.full_attention_interval ({every!r}) must be an integer >= 1 (every N-th layer full "
                        "attention; Qwen3.5: 4); null makes every layer full attention.")
    if not problems and m.linear_num_value_heads % m.linear_num_key_heads:
        problems.append(f"model.linear_num_value_heads ({m.linear_num_value_heads}) must be a multiple of "
                        f"model.linear_num_key_heads ({m.linear_num_key_heads}); use config.json's values.")
    if not 0 < m.rotary_percent <= 1:
        problems.append(f"model.rotary_percent ({m.rotary_percent}) must be in (0, 1] (config.json "
                        "partial_rotary_factor); 1 rotates every dim.")
    return problems


def _window_problems(m: "ModelConfig") -> list[str]:
    """model.window_size is [left >= 0, 0]; model.window_attn_skip_freq (>= 2) only with a window."""
    problems = _choice("model", m, "softmax_type")
    window = m.window_size
    if window is not None and (len(window) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in window)
                               or window[0] < 0 or window[1] != 0):
        problems.append(f"model.window_size ({list(window)}) must be [left, 0] with left >= 0 (causal attention reads "
                        "no later key); for transformers' sliding_window=W set model.window_size=[W-1,0], or null.")
    skip = m.window_attn_skip_freq
    if skip is not None and (isinstance(skip, bool) or skip < 2):
        problems.append(f"model.window_attn_skip_freq ({skip!r}) must be an integer >= 2 (every N-th layer full); "
                        "null windows every layer.")
    if m.rotary_base_local is not None and window is None:
        problems.append(f"model.rotary_base_local ({m.rotary_base_local}) is the RoPE base of the windowed layers but "
                        "model.window_size is null; set model.window_size=[left,0] or model.rotary_base_local=null.")
    if m.softmax_scale is not None and not m.softmax_scale > 0:
        problems.append(f"model.softmax_scale ({m.softmax_scale}) must be > 0; null uses 1 / sqrt(kv_channels).")
    if m.rope_scaling == "linear" and not m.rope_scaling_factor >= 1:
        problems.append(f"model.rope_scaling_factor ({m.rope_scaling_factor}) must be >= 1 with model.rope_scaling="
                        "linear (config.json rope_scaling.factor).")
    elif skip is not None and window is None:
        problems.append(f"model.window_attn_skip_freq ({skip}) picks the full-attention layers among windowed ones "
                        "but model.window_size is null; set model.window_size=[left,0] or "
                        "model.window_attn_skip_freq=null.")
    return problems


def _recompute_problems(m: "ModelConfig") -> list[str]:
    problems = _choice("model", m, "recompute_granularity") + _choice("model", m, "recompute_method")
    if m.recompute_num_layers is not None and (isinstance(m.recompute_num_layers, bool)
                                               or m.recompute_num_layers < 1):
        problems.append(f"model.recompute_num_layers ({m.recompute_num_layers!r}) must be a positive integer; "
                        "set model.recompute_num_layers=1.")
    if m.recompute_granularity != "full":
        for key in ("recompute_method", "recompute_num_layers"):
            if getattr(m, key) is not None:
                problems.append(f"model.{key} ({getattr(m, key)!r}) applies only to model.recompute_granularity=full "
                                f"(it is {m.recompute_granularity!r}); set model.recompute_granularity=full or "
                                f"model.{key}=null.")
    elif m.recompute_num_layers is not None and m.recompute_num_layers > m.num_layers:
        problems.append(f"model.recompute_num_layers ({m.recompute_num_layers}) must be <= model.num_layers "
                        f"({m.num_layers}); set model.recompute_num_layers={m.num_layers}.")
    return problems


def _moe_problems(m: "ModelConfig") -> list[str]:
    problems = _positive("model", m, ("num_experts", "moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size"))
    if m.num_experts is not None and not 1 <= m.moe_router_topk <= m.num_experts:
        problems.append(f"model.moe_router_topk ({m.moe_router_topk}) must be in [1, model.num_experts "
                        f"({m.num_experts})]; set model.moe_router_topk=2 (config.json num_experts_per_tok).")
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if not getattr(m, key) >= 0:
            problems.append(f"model.{key} ({getattr(m, key)}) must be >= 0; set model.{key}=0 to turn it off.")
    return problems


def _gpt_oss_problems(m: "ModelConfig") -> list[str]:
    """The gated-MLP clamp and offset, and YaRN's numbers (gpt-oss's features, each usable alone)."""
    from megatron_pack.config.choices import GATED_ACTIVATIONS

    problems = []
    if m.activation_clamp is not None and not m.activation_clamp > 0:
        problems.append(f"model.activation_clamp ({m.activation_clamp}) must be > 0 (config.json swiglu_limit); "
                        "null clamps nothing.")
    if (m.activation_clamp is not None or m.glu_linear_offset) and m.activation not in GATED_ACTIVATIONS:
        problems.append(f"model.activation_clamp / model.glu_linear_offset act on a gated MLP, but model.activation "
                        f"({m.activation!r}) is not gated; set model.activation to one of {list(GATED_ACTIVATIONS)}.")
    yarn_ok = m.rope_scaling_factor >= 1 and m.rope_yarn_beta_fast > m.rope_yarn_beta_slow > 0
    if m.rope_scaling == "yarn" and not yarn_ok:
        problems.append(f"model.rope_scaling=yarn needs model.rope_scaling_factor ({m.rope_scaling_factor}) >= 1 and "
                        f"model.rope_yarn_beta_fast ({m.rope_yarn_beta_fast}) > model.rope_yarn_beta_slow "
                        f"({m.rope_yarn_beta_slow}) > 0; use config.json's rope_scaling (gpt-oss: 32, 32, 1).")
    return problems


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is <= ``at_most`` (for 'set it to ...' hints)."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig(_Group):
    GROUP = "data"

    name: str = "synthetic"
    """Preset name (configs/data/<name>.yaml)."""
    source: str = "synthetic"
    """'synthetic' (embedded deterministic SFT set) or 'files' (read data.input)."""
    input: Optional[str] = None
    """A JSONL/Parquet/Arrow file, a directory, a glob or a Hugging Face datasets folder (Dataset.save_to_disk);
    required by prepare when data.source=files (train/verify check it against the store when given)."""
    split: Optional[str] = None
    """The split of a DatasetDict folder in data.input (e.g. 'train'); None for any other input (or a
    DatasetDict of one split)."""
    schema: str = "auto"
    """'auto', 'prompt_completion' or 'chat' (a 'messages' list of {role, content})."""
    prompt_key: str = "prompt"
    """Prompt column for the prompt_completion schema."""
    completion_key: str = "completion"
    """Completion column for the prompt_completion schema."""
    messages_key: str = "messages"
    """Messages column for the chat schema."""
    role_key: str = "role"
    """Role field of each chat message (ShareGPT: 'from')."""
    content_key: str = "content"
    """Content field of each chat message (ShareGPT: 'value'); a string or a list of {type: text, text} parts."""
    role_aliases: dict[str, str] = field(default_factory=dict)
    """Extra role names mapped to system/user/assistant/tool, e.g. {human: user, gpt: assistant}."""
    images_key: str = "images"
    """Column listing a record's images (paths or bytes) for ShareGPT '<image>' placeholders and image parts
    without an 'image' of their own; read when data.tokenizer is a vision-language folder."""
    image_root: Optional[str] = None
    """Folder relative image paths start at; None: the folder of the data file that names them."""
    format: str = "default"
    """'default' (the keys above) or 'sharegpt' (conversations/from/value, human/gpt/system roles)."""
    chat_template: Optional[str] = None
    """A Jinja chat-template file that replaces the tokenizer's own; None keeps the tokenizer's."""
    sources: list[Any] = field(default_factory=list)
    """Mix several inputs: a list of {name, input, weight | tokens} (plus optional schema keys such as
    format, messages_key, prompt_key); empty means the single data.input."""
    synthetic_num_samples: int = 4000
    """Number of samples data.source=synthetic generates."""
    synthetic_seed: int = 0
    """Seed of the synthetic generator."""
    tokenizer: str = "byte"
    """'byte' (embedded byte-level tokenizer, no download) or a local Hugging Face tokenizer directory."""
    answer_only_loss: bool = True
    """Train on completion/assistant tokens (and their eos) only; False trains on every token."""
    on_bad_record: str = "error"
    """'error' (stop at the first bad record, naming its file and line) or 'skip' (leave each bad record out,
    counted by reason; the first 10 listed with their lines in the prepare summary and the store metadata)."""
    dataset_dir: str = "data/synthetic"
    """Directory of the prepared token store and plans (written by prepare, read by train)."""
    plan: Optional[str] = None
    """Plan folder under data.dataset_dir/plans to train, verify, inspect or export with; None picks the one plan
    whose manifest agrees with the keys given on the command line."""
    overwrite: bool = False
    """Let prepare replace a token store built from other inputs (files, tokenizer, template, schema) in
    data.dataset_dir, and with it every plan there; false refuses, naming what differs."""
    pad_to_max_length: bool = False
    """Pad every pack to packing.packed_sequence_size (fixed shapes; required for CUDA graphs)."""
    num_workers: int = 0
    """DataLoader worker processes for training."""
    tokenize_workers: int = 0
    """Processes used to tokenize in prepare; 0 means auto (1 for a Hugging Face fast tokenizer, whose batch
    encoding uses every core; all cores for the byte tokenizer)."""
    validation: Optional[str] = None
    """Validation JSONL/Parquet file, directory or glob, prepared like the training data into
    <data.dataset_dir>/validation (its own packs, same pack size and pad multiple); None: none."""
    validation_fraction: float = 0.0
    """Share of the training samples held out for validation, chosen by data.validation_seed before packing
    (never trained on, recorded in the plan metadata); 0 holds out nothing."""
    validation_seed: int = 0
    """Seed choosing the held-out validation samples of data.validation_fraction."""

    def field_problems(self) -> list[str]:
        g = self.GROUP
        problems = _positive(g, self, ("synthetic_num_samples", "num_workers", "tokenize_workers"),
                             allow_zero=("num_workers", "tokenize_workers"))
        for name in ("source", "schema", "format", "on_bad_record"):
            problems += _choice(g, self, name)
        for alias, role in self.role_aliases.items():
            if role not in CHAT_ROLES:
                problems.append(f"data.role_aliases.{alias} ({role!r}) must map to one of {'/'.join(CHAT_ROLES)}; "
                                f"set data.role_aliases.{alias}=user (or assistant).")
        problems += _source_problems(self.sources, self.input)
        if self.sources and self.source != "files":
            problems.append(f"data.sources needs data.source=files (it is {self.source}); set data.source=files.")
        if not 0.0 <= self.validation_fraction < 1.0:
            problems.append(f"data.validation_fraction ({self.validation_fraction}) must be in [0, 1); "
                            "set data.validation_fraction=0.05 (or 0 for none).")
        if self.validation is not None and self.validation_fraction > 0:
            problems.append(f"data.validation ({self.validation}) and data.validation_fraction "
                            f"({self.validation_fraction}) both choose a validation set; set data.validation=null "
                            "or data.validation_fraction=0.")
        return problems


@dataclass(kw_only=True, slots=True, frozen=True)
class PackingConfig(_Group):
    GROUP = "packing"

    packed_sequence_size: int = 512
    """Tokens per pack (packing.mode offline or online); mode=in_batch packs micro-batches of whole samples
    (each up to model.seq_length) and does not read it."""
    pad_seq_to_mult: Optional[int] = None
    """Pad every sub-sequence to this multiple; None derives lcm(2*CP, CP*TP if SP) from parallel."""
    max_single_sequence_length: Optional[int] = None
    """Longest sample (in THD tokens) kept; None means packed_sequence_size."""
    algorithm: str = "bfd"
    """'bfd' (best-fit decreasing), 'ffd', 'first_fit_shuffle', 'sequential' or 'wrapped' (one token
    stream cut into full rows; see packing.wrapped_attention)."""
    seed: int = 0
    """Seed of the plan (bin order, shuffles)."""
    on_overflow: str = "error"
    """What to do with a sample longer than the pack: 'error', 'drop', 'truncate' or 'split'."""
    split_overlap: int = 0
    """With on_overflow=split: tokens of context repeated at the start of each following piece (no loss on them)."""
    buckets: Optional[Any] = None
    """Length buckets packed separately: None (one bucket), a list of THD-length boundaries such as
    [512, 2048], or 'auto' (boundaries at the length quartiles)."""
    bucket_order: str = "interleave"
    """How training reads bucketed packs: 'interleave' (one shuffle over all packs) or 'sequential'
    (each epoch reads the buckets shortest first, packs shuffled inside a bucket)."""
    wrapped_attention: str = "document"
    """With algorithm=wrapped: 'document' (sub-sequence per document piece, no attention across
    documents) or 'cross' (one sequence per row, attention crosses documents: pretraining style)."""
    pad_cu_seqlens: bool = False
    """Give cu_seqlens a fixed length (max_samples_per_bin + 2) for CUDA graphs."""
    export: str = "none"
    """'none' or 'bridge' (also write Megatron-Bridge's packed parquet in prepare)."""
    mode: str = "offline"
    """How packing happens, the one switch: 'offline' (packs from the prepared plan), 'online' (packed at run time
    from a bounded buffer) or 'in_batch' (each micro-batch of train.micro_batch_size samples from the token store,
    no plan, packed into one THD row at collate; needs micro_batch_size > 1)."""
    online_source: str = "store"
    """With mode=online: 'store' (the prepared token store) or 'stream' (data.input tokenized on the fly)."""
    buffer_size: int = 1024
    """With mode=online: most samples the packing buffer holds."""
    buffer_tokens: Optional[int] = None
    """With mode=online: most padded tokens the buffer holds; None means buffer_size * packed_sequence_size."""
    max_samples_per_pack: Optional[int] = None
    """With mode=online: most samples one pack holds (None: no cap). With pad_cu_seqlens the cu_seqlens
    length is this + 2; without a cap it is the bound packed_sequence_size // pad multiple + 2."""
    balance: str = "none"
    """'none' (deal packs round-robin over DP ranks) or 'dp' (assign each step's packs by cost; at PP>1 by the pipelined cost)."""
    cost_a: float = DEFAULT_COST_A
    """Balance cost per real token of a pack."""
    cost_b: float = DEFAULT_COST_B
    """Balance cost per squared sub-sequence token (attention), relative to cost_a."""

    def field_problems(self) -> list[str]:
        g = self.GROUP
        if self.packed_sequence_size == 0 and not isinstance(self.packed_sequence_size, bool):
            problems = ["packing.packed_sequence_size (0) no longer turns offline packing off: packing.mode is the one "
                        "switch; set packing.mode=in_batch (and leave packing.packed_sequence_size unset) to pack "
                        "each micro-batch at collate."]
        else:
            problems = _positive(g, self, ("packed_sequence_size",))
        problems += _positive(g, self, ("pad_seq_to_mult", "max_single_sequence_length", "seed"), allow_zero=("seed",))
        for name in ("algorithm", "on_overflow", "bucket_order", "wrapped_attention", "export", "mode", "online_source",
                     "balance"):
            problems += _choice(g, self, name)
        problems += _positive(g, self, ("split_overlap",), allow_zero=("split_overlap",))
        problems += _bucket_problems(self.buckets)
        problems += _positive(g, self, ("buffer_size", "buffer_tokens", "max_samples_per_pack"))
        for name in ("cost_a", "cost_b"):
            if not getattr(self, name) >= 0:
                problems.append(f"packing.{name} ({getattr(self, name)}) must be >= 0; set packing.{name}=1.0.")
        if self.cost_a == 0 and self.cost_b == 0:
            problems.append("packing.cost_a and packing.cost_b are both 0, so every pack costs nothing; "
                            f"set packing.cost_a={DEFAULT_COST_A} packing.cost_b={DEFAULT_COST_B}.")
        return problems

    @property
    def makes_packs(self) -> bool:
        """True when training reads packs of ``packed_sequence_size`` tokens (mode offline or online, not in_batch)."""
        return self.mode != "in_batch"


SOURCE_SCHEMA_KEYS = ("schema", "format", "prompt_key", "completion_key", "messages_key", "role_key", "content_key",
                      "role_aliases", "images_key")
"""Keys a data.sources entry may set for its own records (they default to the data.* values)."""


def _source_problems(sources: Any, single_input: Optional[str]) -> list[str]:
    """data.sources: named inputs, each with a positive weight or token budget (all of one kind)."""
    if not sources:
        return []
    problems, names, kinds = [], set(), set()
    fix = "write data.sources=[{name: chat, input: chat.jsonl, weight: 0.7}, {name: code, input: code.jsonl, weight: 0.3}]"
    if single_input:
        problems.append(f"data.input ({single_input}) and data.sources are both set; put every input in data.sources "
                        "and set data.input=null.")
    for i, entry in enumerate(sources):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} ({entry!r}) must be a mapping; {fix}.")
            continue
        unknown = sorted(set(entry) - {"name", "input", "weight", "tokens", *SOURCE_SCHEMA_KEYS})
        if unknown:
            problems.append(f"{where} has unknown key(s) {unknown}; allowed: name, input, weight | tokens, "
                            f"{', '.join(SOURCE_SCHEMA_KEYS)}.")
        name = entry.get("name")
        if not isinstance(name, str) or not name or name in names:
            problems.append(f"{where}.name ({name!r}) must be a unique non-empty string; set {where}.name=<source name>.")
        names.add(name)
        if not isinstance(entry.get("input"), str) or not entry.get("input"):
            problems.append(f"{where}.input ({entry.get('input')!r}) is required; set {where}.input=/path/to/file.jsonl.")
        given = [k for k in ("weight", "tokens") if entry.get(k) is not None]
        if len(given) != 1:
            problems.append(f"{where} needs exactly one of weight (a share) or tokens (a token budget), got "
                            f"{given or 'neither'}; {fix}.")
            continue
        kinds.add(given[0])
        value = entry[given[0]]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
                given[0] == "tokens" and not isinstance(value, int)):
            problems.append(f"{where}.{given[0]} ({value!r}) must be a positive "
                            f"{'integer' if given[0] == 'tokens' else 'number'}; set {where}.{given[0]}=1.")
    if len(kinds) > 1:
        problems.append("data.sources mixes weight and tokens; give every source a weight (shares of the whole) "
                        "or every source a token budget.")
    return problems


def _bucket_problems(buckets: Any) -> list[str]:
    """packing.buckets is None, 'auto' or increasing positive integer boundaries."""
    if buckets is None or buckets == "auto":
        return []
    values = list(buckets) if isinstance(buckets, (list, tuple)) else None
    if (not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values)
            or any(a >= b for a, b in zip(values, values[1:]))):
        return [f"packing.buckets ({buckets!r}) must be 'auto' or increasing positive THD-length boundaries; "
                "set packing.buckets=[512,2048] or packing.buckets=auto."]
    return []


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelConfig(_Group):
    GROUP = "parallel"

    tensor_model_parallel_size: int = 1
    """Tensor-parallel degree (TP)."""
    context_parallel_size: int = 1
    """Context-parallel degree (CP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel degree (PP): stages of model.num_layers / PP layers each, run by the 1F1B schedule."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank (VP, interleaved 1F1B; megatron-core's convention): rank r holds layer
    blocks r, r + PP, ... of num_layers / (PP * VP) layers each. None (or 1): one chunk per rank."""
    sequence_parallel: bool = False
    """Shard activations along the sequence inside TP regions (needs TP > 1)."""
    cp_comm_type: str = "p2p"
    """Transformer Engine CP communication: 'p2p', 'a2a', 'allgather' or 'a2a+p2p'."""
    backend: str = "auto"
    """torch.distributed backend: 'auto' (nccl with CUDA, else gloo), 'nccl' or 'gloo'."""
    expert_model_parallel_size: int = 1
    """Expert-parallel degree (EP), over the data-parallel ranks: each holds num_experts / EP experts."""
    expert_tensor_parallel_size: Optional[int] = None
    """Ranks one expert's weights are split over (expert TP); None: tensor_model_parallel_size."""

    def field_problems(self) -> list[str]:
        g = self.GROUP
        problems = _positive(g, self, ("tensor_model_parallel_size", "context_parallel_size",
                                       "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                                       "expert_model_parallel_size",
                                       "expert_tensor_parallel_size"))
        problems += _choice(g, self, "cp_comm_type") + _choice(g, self, "backend")
        return problems

    @property
    def num_model_chunks(self) -> int:
        """Model chunks each pipeline rank runs: virtual_pipeline_model_parallel_size, or 1 without it."""
        return self.virtual_pipeline_model_parallel_size or 1


MIN_LR_DIVISOR = 10
"""train.min_lr when unset is train.lr / MIN_LR_DIVISOR (the lr / 10 of Megatron-LM and NeMo recipes)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig(_Group):
    GROUP = "train"

    micro_batch_size: int = 1
    """Samples per micro-batch with packing.mode=in_batch (packed into one THD row); 1 with packs (offline or
    online: a pack is one micro-batch)."""
    global_batch_size: int = 8
    """Packs (offline, online) or samples (packing.mode=in_batch) per optimizer step, summed over data-parallel ranks;
    each rank runs global_batch_size / (dp * micro_batch_size) micro-batches."""
    global_batch_tokens: Optional[int] = None
    """Tokens per optimizer step (train.token_budget): packs are taken until met; replaces global_batch_size when set."""
    token_budget: str = "target"
    """What global_batch_tokens counts: 'target' (loss-carrying tokens) or 'real' (all sample tokens)."""
    train_iters: Optional[int] = 50
    """Optimizer steps; exactly one of train.train_iters and train.num_epochs is set (null the other)."""
    num_epochs: Optional[int] = None
    """Passes over the packed training data; the steps are num_epochs * packs per epoch // global_batch_size."""
    eval_interval: int = 0
    """Validation loss every N steps (and always at the end); 0 only at the end. Needs a validation set."""
    eval_iters: int = 0
    """Validation global batches (train.global_batch_size packs each) per evaluation; 0 means every
    validation pack."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: Optional[float] = None
    """Learning rate at the end of the decay; None means train.lr / 10."""
    lr_warmup_iters: int = 5
    """Linear warmup steps."""
    lr_decay_style: str = "cosine"
    """'cosine', 'linear' or 'constant'."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    seed: int = 1234
    """Seed for model init, data order and dropout."""
    bf16: bool = False
    """Train in bfloat16 (GPU)."""
    deterministic: bool = True
    """torch's deterministic algorithms and seeds (python, numpy, torch); on a GPU also cuDNN's deterministic
    kernels and CUBLAS_WORKSPACE_CONFIG=:4096:8 (float32 CPU runs are bitwise repeatable); false: torch's defaults."""
    device: str = "auto"
    """'auto' (the GPU where one is visible, else the CPU), 'cuda' (refused on a host without a GPU) or 'cpu' (also on
    a GPU host: the run does not see the GPU and communicates over gloo)."""
    peak_tflops: Optional[float] = None
    """The device's peak TFLOP/s for MFU; None: the dense bf16 peak of a known GPU (H100/H200 989, A100 312, ...;
    training/flops.py), no MFU on a CPU or an unlisted GPU."""
    output_dir: str = "runs/default"
    """Directory for logs, TensorBoard and (by default) checkpoints."""
    exit_after_iters: Optional[int] = None
    """Stop after this many steps in this process (for tests of kill and resume); None runs to train_iters."""

    def __post_init__(self) -> None:
        if self.min_lr is None and isinstance(self.lr, (int, float)):  # derived once, so every reader sees a float
            object.__setattr__(self, "min_lr", self.lr / MIN_LR_DIVISOR)
        _Group.__post_init__(self)

    def field_problems(self) -> list[str]:
        g = self.GROUP
        problems = _positive(g, self, ("micro_batch_size", "global_batch_size", "train_iters", "num_epochs",
                                       "lr_warmup_iters", "exit_after_iters", "global_batch_tokens", "eval_interval",
                                       "eval_iters"), allow_zero=("lr_warmup_iters", "eval_interval", "eval_iters"))
        if self.peak_tflops is not None and not (isinstance(self.peak_tflops, (int, float)) and self.peak_tflops > 0):
            problems.append(f"train.peak_tflops ({self.peak_tflops!r}) must be a positive number of TFLOP/s; set "
                            "train.peak_tflops=989 (an H100's dense bf16 peak), or leave it unset.")
        problems += _choice(g, self, "token_budget")
        if (self.train_iters is None) == (self.num_epochs is None):
            problems.append(f"train.train_iters ({self.train_iters}) and train.num_epochs ({self.num_epochs}): set "
                            "exactly one, e.g. train.train_iters=null train.num_epochs=2, or train.num_epochs=null.")
        problems += _choice(g, self, "lr_decay_style") + _choice(g, self, "device")
        if not self.lr > 0:
            problems.append(f"train.lr ({self.lr}) must be > 0; set train.lr=3e-4.")
        elif not 0 <= self.min_lr <= self.lr:
            problems.append(f"train.min_lr ({self.min_lr}) must be in [0, train.lr={self.lr}]; set train.min_lr={self.lr / MIN_LR_DIVISOR:g} (or leave it unset: lr / 10).")
        if self.clip_grad < 0:
            problems.append(f"train.clip_grad ({self.clip_grad}) must be >= 0; set train.clip_grad=1.0 (0 disables).")
        return problems


@dataclass(kw_only=True, slots=True, frozen=True)
class DDPConfig(_Group):
    GROUP = "ddp"

    average_in_collective: bool = False
    """Average gradients inside the all-reduce; must be False for per-token loss (grads are summed)."""
    overlap_grad_reduce: bool = False
    """Overlap the gradient all-reduce with backward."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (megatron-core's distributed optimizer on GPU; on CPU
    the AdamW state and update are sharded over DP and the parameters all-gathered)."""
    grad_reduce_in_fp32: bool = True
    """Reduce gradients in float32."""
    check_for_nan_in_grad: bool = True
    """Raise when a reduced gradient is not finite."""
    bucket_size: Optional[int] = None
    """Gradient bucket size in elements; None lets megatron-core choose."""

    def field_problems(self) -> list[str]:
        return _positive(self.GROUP, self, ("bucket_size",))


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig(_Group):
    GROUP = "checkpoint"

    save: Optional[str] = None
    """Directory to save checkpoints into; None means <train.output_dir>/checkpoints."""
    load: Optional[str] = None
    """Directory to resume from; None means resume from checkpoint.save when it holds a checkpoint."""
    save_interval: int = 0
    """Save every N steps (and at the end); 0 saves only at the end."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted after a successful save."""
    enabled: bool = True
    """Write checkpoints at all."""
    load_weights_only: bool = False
    """Start a new run from checkpoint.load's model weights: fresh optimizer, schedule, data order and step 0."""
    allow_changed: bool = False
    """Resume even though lr, schedule, global batch or data plan differ from the checkpoint's (listed at start)."""
    save_on_signal: bool = True
    """On one of checkpoint.signals every rank finishes its step, saves a checkpoint and exits 0 (docs/launch.md)."""
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    """The signals that stop a run with a checkpoint (SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP)."""

    def field_problems(self) -> list[str]:
        problems = _positive(self.GROUP, self, ("save_interval", "keep_last"), allow_zero=("save_interval",))
        unknown = [s for s in self.signals if s not in STOP_SIGNALS]
        if unknown:
            problems.append(f"checkpoint.signals ({list(self.signals)}) names {unknown}; choose from "
                            f"{list(STOP_SIGNALS)}, e.g. checkpoint.signals=[SIGTERM,SIGUSR1].")
        if self.load_weights_only and self.load is None:
            problems.append("checkpoint.load_weights_only (True) needs checkpoint.load (None): the checkpoint whose "
                            "weights start the run; set checkpoint.load=/path/to/checkpoints.")
        return problems


@dataclass(kw_only=True, slots=True, frozen=True)
class LoggingConfig(_Group):
    GROUP = "logging"

    log_interval: int = 1
    """Print a metrics line every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files under <train.output_dir>/tensorboard."""
    level: str = "INFO"
    """Python logging level."""
    log_sample_ids: bool = False
    """Log the sample ids of every pack consumed (for audits and replay)."""
    wandb: bool = False
    """Log the TensorBoard scalars and the resolved config to Weights & Biases from rank 0 (needs the wandb package)."""
    wandb_project: str = "megatron-pack"
    """The W&B project."""
    wandb_entity: Optional[str] = None
    """The W&B entity (team or user); None for the logged-in user's default."""
    wandb_mode: str = "online"
    """'online' or 'offline' (written under <train.output_dir>/wandb; upload later with `wandb sync`)."""
    mlflow: bool = False
    """Log the TensorBoard scalars and the resolved config (as params) to MLflow from rank 0 (needs mlflow or
    mlflow-skinny)."""
    mlflow_tracking_uri: Optional[str] = None
    """The MLflow tracking URI; None for a local file store in <train.output_dir>/mlruns."""
    mlflow_experiment: str = "megatron-pack"
    """The MLflow experiment name (created when missing)."""

    def field_problems(self) -> list[str]:
        problems = _positive(self.GROUP, self, ("log_interval",))
        problems += _choice(self.GROUP, self, "level") + _choice(self.GROUP, self, "wandb_mode")
        return problems


@dataclass(kw_only=True, slots=True, frozen=True)
class VerifyConfig(_Group):
    GROUP = "verify"

    num_packs: int = 4
    """Packs checked by `megatron-pack verify`."""
    tolerance: float = 1e-4
    """Largest allowed absolute logit difference between packed and alone."""
    checkpoint: Optional[str] = None
    """Checkpoint to load weights from; None uses model.pretrained's weights when it is set, else a random init
    (seed train.seed)."""
    attention: str = "thd"
    """'thd' (the real path) or 'pack_causal' (plain causal attention over the whole pack: a broken
    setting that must FAIL, kept to show what verify catches)."""
    reference: str = "self"
    """'self' (each sample alone through our model) or 'transformers' (each sample alone through
    transformers' forward of model.pretrained; needs model.pretrained)."""

    def field_problems(self) -> list[str]:
        problems = _positive(self.GROUP, self, ("num_packs",))
        problems += _choice(self.GROUP, self, "attention") + _choice(self.GROUP, self, "reference")
        if not self.tolerance > 0:
            problems.append(f"verify.tolerance ({self.tolerance}) must be > 0; set verify.tolerance=1e-4.")
        return problems


_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> Optional[int]:
    """Bytes of '5GB' / '500MB' / '2GiB' / '1024' (transformers' units: KB = 1000, KiB = 1024); None if invalid.

    >>> parse_size("60KB"), parse_size("2GiB")
    (60000, 2147483648)
    """
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match[2].upper() not in _SIZE_UNITS | {"": 1}:
        return None
    size = int(float(match[1]) * _SIZE_UNITS.get(match[2].upper(), 1))
    return size if size > 0 else None


@dataclass(kw_only=True, slots=True, frozen=True)
class ExportConfig(_Group):
    GROUP = "export"

    checkpoint: Optional[str] = None
    """Checkpoint to export (a step_* folder or checkpoint.save); None exports model.pretrained itself."""
    output: Optional[str] = None
    """Hugging Face folder to write (created; must not hold a model already)."""
    dtype: Optional[str] = None
    """'float32' or 'bfloat16' tensors in the export; None keeps the dtype of the source folder."""
    max_shard_size: str = "5GB"
    """Largest safetensors shard written, as transformers spells it ('5GB', '500MB', '2GiB');
    model.safetensors.index.json maps tensors to shards when there are several."""
    adapter: bool = False
    """Write the LoRA adapters of a peft=lora checkpoint in the peft format (adapter_model.safetensors +
    adapter_config.json, for ``PeftModel.from_pretrained`` on the base) instead of a full model."""
    merge: bool = False
    """Write the base with the LoRA adapters of a peft=lora checkpoint merged in (a full HF model)."""

    def field_problems(self) -> list[str]:
        problems = []
        if parse_size(self.max_shard_size) is None:
            problems.append(f"export.max_shard_size ({self.max_shard_size!r}) must be a size like '5GB', '500MB' "
                            "or '2GiB'; set export.max_shard_size=5GB.")
        problems += _choice(self.GROUP, self, "dtype")
        if self.adapter and self.merge:
            problems.append("export.adapter and export.merge are both true; choose one: export.adapter=true writes "
                            "the adapters for peft, export.merge=true a full model with them merged in.")
        return problems


@dataclass(kw_only=True, slots=True, frozen=True)
class PeftConfig(_Group):
    GROUP = "peft"

    method: str = "none"
    """'none' (full fine-tuning) or 'lora' (low-rank adapters on the target linears; base frozen)."""
    dim: int = 32
    """LoRA rank r: A is [r, in], B is [out, r]."""
    alpha: float = 32.0
    """LoRA alpha; the adapter output is scaled by alpha / dim (peft's ``lora_alpha / r``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (peft's ``lora_dropout``)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """megatron-core linears that get an adapter: linear_qkv, linear_proj, linear_fc1, linear_fc2; also in_proj,
    out_proj (a hybrid model's linear-attention projections, model.full_attention_interval)."""

    def field_problems(self) -> list[str]:
        problems = _choice(self.GROUP, self, "method")
        problems += _positive(self.GROUP, self, ("dim",))
        if not self.alpha > 0:
            problems.append(f"peft.alpha ({self.alpha}) must be > 0; set peft.alpha={self.dim} (scale 1).")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"peft.dropout ({self.dropout}) must be in [0, 1); set peft.dropout=0.0.")
        unknown = [m for m in self.target_modules if m not in LORA_TARGETS + LINEAR_ATTENTION_TARGETS]
        if unknown or not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            problems.append(f"peft.target_modules ({list(self.target_modules)}) must be distinct names from "
                            f"{list(LORA_TARGETS)} (megatron-core names; q/k/v are the fused linear_qkv, gate/up "
                            "the fused linear_fc1); set peft.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2].")
        return problems


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The megatron-core linears LoRA can adapt (column-parallel: linear_qkv, linear_fc1; row-parallel: the others)."""
LINEAR_ATTENTION_TARGETS = ("in_proj", "out_proj")
"""... and a linear-attention layer's (Gated DeltaNet: in_proj column-parallel, out_proj row-parallel); not default."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """The whole run: one field per group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    data: DataConfig = field(default_factory=DataConfig)
    """Raw data, tokenizer and the prepared dataset location."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """Offline and in-batch packing."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / CP / PP / SP degrees."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batching, optimizer and schedule."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """megatron-core DistributedDataParallel settings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and logs."""
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    """The `megatron-pack verify` command."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """The `megatron-pack export` command."""
    peft: PeftConfig = field(default_factory=PeftConfig)
    """Parameter-efficient fine-tuning (LoRA)."""


GROUPS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "packing": PackingConfig, "parallel": ParallelConfig,
    "train": TrainConfig, "ddp": DDPConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
    "verify": VerifyConfig, "export": ExportConfig, "peft": PeftConfig,
}
