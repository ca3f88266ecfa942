"""Memory per rank from the config alone: parameters, gradients, optimizer state, activations.

Torch-free (``train --check`` prints it before anything is built). For the rank of each pipeline
stage, in bytes:

- parameters: the stage's layers (``/ TP`` for the sharded matrices; norms replicated), plus the
  embedding on the first stage and the final norm and output layer on the last (with tied
  embeddings at PP > 1 the last stage holds its own copy of the embedding, as megatron-core does);
  2 B each with ``train.bf16`` or bfloat16 parameters, else 4 B.
- a MoE layer (``model.num_experts``): its router (``[experts, hidden]``, replicated) and shared expert (``/ TP``)
  with the layer, its routed experts apart: ``num_experts / EP`` experts per rank, each ``/ expert TP``.
- gradients: megatron-core DDP's contiguous main-grad buffer, one element per parameter, 4 B
  (``ddp.grad_reduce_in_fp32``) or the parameter's size. The distributed optimizer reduce-scatters
  in place: the buffer stays whole.
- optimizer state (megatron-core's optimizer on every device): Adam's two fp32 moments, plus an fp32 main copy
  when parameters are 16-bit; sharded over the data-parallel x CP ranks (megatron-core's ``intra_dp_cp`` group)
  with ``ddp.use_distributed_optimizer``; routed experts are replicated only over the expert-data-parallel
  ranks (world / (expert TP x EP x PP)), so their state is sharded over those.
- a vision-language model's first stage adds its vision tower (``vision_memory``): parameters, the
  gradients and optimizer state of the part that trains (the merger with ``model.freeze_vision``), and the
  tower's activations for a pack of image tokens only.
- activations: the tensors autograd keeps for backward, per token of a micro-batch (a pack of
  ``packing.packed_sequence_size`` tokens, ``/ CP`` per rank), per layer, times the micro-batches a
  stage holds under 1F1B: ``min(PP - stage, micro-batches)``; with virtual stages (VP chunks of
  ``layers / VP`` per rank, the interleaved 1F1B) the chunk forwards it holds at once,
  ``min((PP - stage - 1) * 2 + (VP - 1) * PP + 1, micro-batches * VP)``. Per layer and token, without
  recomputation, with the fused GPU kernels (Transformer Engine norms, flash attention): the inputs
  of the two norms and of the linear layers they feed (``4 h``, ``/ TP`` with sequence
  parallelism), attention's q, k, v and output (``2 q + 2 kv``, ``/ TP``; flash attention keeps no
  score matrix) and the MLP's ``fc1`` output and activation (``3 ffn`` with SwiGLU, ``2 ffn`` with
  GeLU, ``/ TP``); a MoE layer's MLP part instead keeps the router's fp32 logits and probabilities and,
  for each of a token's top-k copies (routing assumed balanced), the permuted input, the expert MLP's
  working set (``/ expert TP``) and its output. With ``train.device=cpu`` the unfused torch kernels keep more
  (``unfused_kernels``), among them the attention weights, ``heads x longest sample`` per token:
  the estimate takes the worst pack, one sample as long as ``packing.max_single_sequence_length``
  (else the pack). Full recomputation keeps one layer input per recompute
  unit and, while a unit is recomputed in backward, that unit's full working set; ``selective``
  (core attention) keeps the same bytes as none with flash attention (no weights to drop), and
  drops the weights and expanded k, v (keeping q, k, v) with the unfused CPU kernels. The last stage adds the loss's fp32 softmax, ``vocab / TP x tokens x 4 B``,
  and its final norm.
- a hybrid stack's Gated DeltaNet layer (``model.full_attention_interval``: every N-th layer full attention, with
  its output gate's ``2 q`` when ``model.attention_output_gate``) keeps the same norms and MLP and, instead of
  attention, ``linear_mixer_bytes_per_token``: in_proj's output, the conv1d window (each of its K taps' input), the
  normalised q and k, the gated output norm, fp32 decay and beta; with the torch kernel (the CPU path) every
  chunk's fp32 products and the recurrent state ``[value heads / TP, dk, dv]`` of every 64-token chunk of each
  sub-sequence (``linear_state_bytes_per_token``); with fla (the GPU) its chunk matrix, and the chunk states its
  backward recomputes as one layer's working set (``linear_working_bytes_per_token``; the GPU estimate assumes
  fla is installed: without it the torch kernel runs there too and keeps the CPU path's states).

The worst rank (``peak_stage``) is the stage with the largest total: the first stage holds the
embedding and the most micro-batches in flight, the last the output layer.

    >>> from megatron_pack.config.schema import Config
    >>> est = estimate_memory(Config())     # the tiny default model, one rank, float32
    >>> est.num_params, est.params, est.grads, est.optimizer   # 2 layers of hidden 64
    (141632, 566528, 566528, 1133056)
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pack.config.choices import GATED_ACTIVATIONS

GIB = 1024 ** 3
ADAM_MOMENT_BYTES = 8
"""AdamW's exp_avg and exp_avg_sq, fp32."""
MASTER_BYTES = 4
"""The fp32 master copy of a 16-bit parameter."""


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of pipeline stage ``stage`` holds (see the module docstring)."""

    stage: int
    num_params: int
    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def line(self, num_stages: int, kernels: str = "fused GPU kernels") -> str:
        """``memory per rank (est.): params 8.46, grads 16.92, ... GiB (stage 0 of PP 4; ...)``."""
        gib = [f"{name} {value / GIB:.2f}" for name, value in
               (("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
                ("activations", self.activations), ("total", self.total))]
        return (f"memory per rank (est.): {', '.join(gib)} GiB (stage {self.stage} of PP {num_stages}; "
                f"{count_text(self.num_params)} parameters on this rank; activations of {kernels})")


def count_text(num: int) -> str:
    """A count as people read it: ``4.19M``, ``4.54B``, ``812K``, ``96``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num >= scale:
            return f"{num / scale:.3g}{suffix}"
    return str(num)


def _mlp_params(cfg, ffn: int) -> int:
    """One (unsharded) MLP of inner width ``ffn``: fc1 (``[gate; up]`` with SwiGLU) and fc2."""
    h = cfg.model.hidden_size
    return h * (2 * ffn if cfg.model.activation in GATED_ACTIVATIONS else ffn) + ffn * h


def layer_params(cfg, tp: int, linear: bool = False) -> int:
    """Parameters of one transformer layer on one TP rank, without a MoE layer's routed experts
    (``expert_layer_params``): its MLP is then the router ([experts, hidden], replicated) and the shared
    expert (split over TP like a dense MLP) with its gate. ``linear``: a hybrid stack's Gated DeltaNet layer."""
    m = cfg.model
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    q, g = m.num_attention_heads * kv, (m.num_query_groups or m.num_attention_heads) * kv
    h = m.hidden_size
    sharded = h * (q + 2 * g) + q * h + (h * q if m.attention_output_gate else 0)  # the gate: q_proj doubled
    sharded += (q + 2 * g) if m.add_qkv_bias else 0
    norms = 2 * h * (2 if m.normalization == "LayerNorm" else 1) + (2 * kv if m.qk_layernorm else 0)
    if linear:  # a Gated DeltaNet layer: in_proj, conv1d, dt_bias, A_log and out_proj split by heads; out_norm whole
        dv, hv = m.linear_value_head_dim, m.linear_num_value_heads
        qk, v = m.linear_num_key_heads * m.linear_key_head_dim, hv * dv
        sharded = h * (2 * qk + 2 * v + 2 * hv) + (2 * qk + v) * m.linear_conv_kernel_dim + 2 * hv + v * h
        norms = 2 * h * (2 if m.normalization == "LayerNorm" else 1) + dv
    if not m.num_experts:
        return (sharded + _mlp_params(cfg, m.ffn_hidden_size)) // tp + norms
    shared = _mlp_params(cfg, m.moe_shared_expert_ffn_hidden_size) if m.moe_shared_expert_ffn_hidden_size else 0
    router = m.num_experts * h + (h if m.moe_shared_expert_gate else 0)
    return (sharded + shared) // tp + norms + router


def expert_tp(cfg) -> int:
    """Expert tensor parallelism (``parallel.expert_tensor_parallel_size``; null: TP)."""
    par = cfg.parallel
    return par.expert_tensor_parallel_size or par.tensor_model_parallel_size


def expert_layer_params(cfg) -> int:
    """A MoE layer's routed experts on one rank: ``num_experts / EP`` experts, each split over expert TP."""
    m = cfg.model
    if not m.num_experts:
        return 0
    local = m.num_experts // cfg.parallel.expert_model_parallel_size
    return local * _mlp_params(cfg, m.moe_ffn_hidden_size or m.ffn_hidden_size) // expert_tp(cfg)


def expert_data_parallel(cfg, world_size: int) -> int:
    """Ranks holding the same experts (megatron-core's expert-data-parallel group): world / (expert TP x EP x PP)."""
    par = cfg.parallel
    return max(1, world_size // (expert_tp(cfg) * par.expert_model_parallel_size * par.pipeline_model_parallel_size))


def _vocab(cfg, tp: int) -> int:
    vocab = cfg.model.vocab_size
    return -(-vocab // tp) * tp if cfg.model.pretrained else vocab


def stage_expert_params(cfg, stage: int) -> int:
    """Routed-expert parameters one rank of ``stage`` holds (0 for a dense model)."""
    return expert_layer_params(cfg) * (cfg.model.num_layers // cfg.parallel.pipeline_model_parallel_size)


def stage_params(cfg, stage: int) -> int:
    """Parameters one rank of ``stage`` holds (a MoE model's routed experts included)."""
    m, par = cfg.model, cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    h, vocab_rows = m.hidden_size, _vocab(cfg, tp) // tp
    per_stage = m.num_layers // pp
    num_linear = 0 if m.full_attention_interval is None else per_stage - per_stage // m.full_attention_interval
    total = (layer_params(cfg, tp) * (per_stage - num_linear) + layer_params(cfg, tp, linear=True) * num_linear
             + stage_expert_params(cfg, stage))
    if stage == 0:
        total += vocab_rows * h
    if stage == pp - 1:
        total += h * (2 if m.normalization == "LayerNorm" else 1)
        if m.untie_embeddings_and_output_weights or pp > 1:
            total += vocab_rows * h
    return total


def _element_bytes(cfg) -> int:
    return 2 if cfg.train.bf16 or cfg.model.params_dtype == "bfloat16" else 4


def unfused_kernels(cfg, host=None) -> bool:
    """True for ``train.device=cpu`` (or ``auto`` on a ``host`` without a GPU): torch's unfused norms, RoPE
    and math-path attention (the CPU path); otherwise (cuda, auto) the fused GPU kernels: Transformer Engine
    norms, fused RoPE, flash attention."""
    return (cfg.train.device if host is None else host.device(cfg.train.device)) == "cpu"


def longest_sequence(cfg) -> int:
    """The longest sample a pack holds (packing.max_single_sequence_length, else the pack size)."""
    return cfg.packing.max_single_sequence_length or cfg.packing.packed_sequence_size


def layer_activation_bytes_per_token(cfg, linear: bool = False) -> int:
    """Bytes autograd keeps per token for one layer without recomputation, on one rank. ``linear``: a hybrid
    stack's Gated DeltaNet layer (its mixer is ``linear_mixer_bytes_per_token``'s, the norms and MLP the same)."""
    m, par = cfg.model, cfg.parallel
    tp = par.tensor_model_parallel_size
    sp = tp if par.sequence_parallel else 1
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    q, g = m.num_attention_heads * kv, (m.num_query_groups or m.num_attention_heads) * kv
    gate = 2 * q if m.attention_output_gate else 0  # the output gate's rows and their sigmoid
    unfused = unfused_kernels(cfg)
    per_ffn = (5 if unfused else 3) if m.activation in GATED_ACTIVATIONS else 2
    # a MoE layer's MLP part is its own (below); a dense layer's is per_ffn x ffn, / TP
    mlp = 0 if m.num_experts else per_ffn * m.ffn_hidden_size
    if linear:
        norms = (6 * m.hidden_size + 2) // sp if unfused else 4 * m.hidden_size // sp
        elements = norms + mlp // tp
    elif unfused:  # per norm: input, normalized, rstd + the linear's input; RoPE's cos/sin;
        # math attention: q, k and v expanded to every head, the weights (heads x sequence), the output
        # twice (its copy into the pack, the projection's input); SwiGLU: fc1 out, silu, gate, fc2 input
        heads = m.num_attention_heads * longest_sequence(cfg)
        attention = 5 * q + heads if m.recompute_granularity != "selective" else 3 * q + 2 * g
        elements = (6 * m.hidden_size + 2) // sp + 4 * kv + (attention + gate + mlp) // tp
    else:
        elements = 4 * m.hidden_size // sp + (2 * q + 2 * g + gate + mlp) // tp
    moe = _moe_activation_bytes_per_token(cfg, per_ffn, sp) if m.num_experts else 0
    mixer = linear_mixer_bytes_per_token(cfg) if linear else 0
    return _element_bytes(cfg) * elements + moe + mixer


DELTA_RULE_CHUNK = 64
"""The chunk of the chunked delta rule (``model/delta_rule.py`` ``CHUNK_SIZE``, fla's): one recurrent state per chunk."""


def _linear_heads(cfg) -> tuple[int, int, int, int, int]:
    """(key heads, value heads) of one TP rank, key and value head dims, conv1d width: a Gated DeltaNet layer's."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    return (m.linear_num_key_heads // tp, m.linear_num_value_heads // tp, m.linear_key_head_dim,
            m.linear_value_head_dim, m.linear_conv_kernel_dim)


def linear_state_bytes_per_token(cfg) -> int:
    """The Gated DeltaNet's recurrent state, per token of this rank: one fp32 state ``[value heads / TP, dk, dv]`` per
    ``DELTA_RULE_CHUNK`` tokens of every sub-sequence (the state entering each chunk; chunks assumed full). Under CP
    a rank runs every token of ``heads / CP`` heads (the all-to-all): the same bytes per local token."""
    _, hv, dk, dv, _ = _linear_heads(cfg)
    return 4 * hv * dk * dv // DELTA_RULE_CHUNK


def linear_mixer_bytes_per_token(cfg) -> int:
    """A Gated DeltaNet mixer's kept bytes per token of this rank (``model/linear_attention.py``), heads ``/ TP``:

    - in the parameters' dtype: in_proj's output ``2 qk + 2 v + 2 hv`` (q, k, v, the gate z, b, a); the conv1d's
      window, each of its ``K`` taps' shifted input, and its sum before and after SiLU (``(K + 2) x (2 qk + v)``);
      q and k L2-normalised and expanded to the value heads (``2 hv dk``); the gated output norm's input, normed
      output, act(z) and product (``4 v``);
    - fp32: the decay g and beta (``2 hv``); the delta rule's: with fla (fused GPU kernels) its chunk matrix A
      (``64 hv``), the states recomputed in backward (``linear_working_bytes_per_token``); with the torch kernel
      (the CPU path) every chunk's fp32 copies and products (``hv (8 dk + 7 dv + 3 x 64 + 3)``) and the recurrent
      state of every chunk (``linear_state_bytes_per_token``).

    With ``qk = key heads x dk``, ``v = value heads x dv``, ``hv`` value heads (all per TP rank)."""
    hk, hv, dk, dv, width = _linear_heads(cfg)
    qk, v = hk * dk, hv * dv
    elements = 2 * qk + 2 * v + 2 * hv + (width + 2) * (2 * qk + v) + 2 * hv * dk + 4 * v
    if unfused_kernels(cfg):
        fp32 = 2 * hv + hv * (8 * dk + 7 * dv + 3 * DELTA_RULE_CHUNK + 3)
        return _element_bytes(cfg) * elements + 4 * fp32 + linear_state_bytes_per_token(cfg)
    return _element_bytes(cfg) * elements + 4 * (2 * hv + DELTA_RULE_CHUNK * hv)


def linear_working_bytes_per_token(cfg) -> int:
    """fla's backward recomputes the chunk states of a layer (``[chunks, value heads, dk, dv]`` in the parameters'
    dtype) and holds them while that layer's backward runs: a working set of one layer, not kept across layers
    (the torch kernel keeps them instead: ``linear_mixer_bytes_per_token``)."""
    if unfused_kernels(cfg):
        return 0
    _, hv, dk, dv, _ = _linear_heads(cfg)
    return _element_bytes(cfg) * hv * dk * dv // DELTA_RULE_CHUNK


def _num_linear_layers(cfg, layers: int) -> int:
    """Gated DeltaNet layers among ``layers`` of a hybrid stack (every ``full_attention_interval``-th is full)."""
    interval = cfg.model.full_attention_interval
    return 0 if interval is None else layers - layers // interval


def _moe_activation_bytes_per_token(cfg, per_ffn: int, sp: int) -> int:
    """A MoE layer's MLP part, per token of this rank (``/ TP`` with sequence parallelism: each TP rank routes its
    own tokens): the router's fp32 logits and probabilities over the experts, and, for each of the token's top-k
    copies (balanced routing: a rank's experts process top-k rows per local token on average), the permuted input
    (``h``), the expert MLP's working set (``per_ffn x ffn``, ``/ expert TP``) and its output (``h``); a shared
    expert keeps a dense MLP's (``/ TP``)."""
    m = cfg.model
    h, k = m.hidden_size, m.moe_router_topk
    router = 3 * m.num_experts * 4
    routed = k * (2 * h + per_ffn * (m.moe_ffn_hidden_size or m.ffn_hidden_size) // expert_tp(cfg))
    shared = (per_ffn * m.moe_shared_expert_ffn_hidden_size // cfg.parallel.tensor_model_parallel_size
              if m.moe_shared_expert_ffn_hidden_size else 0)
    return (router + _element_bytes(cfg) * routed) // sp + _element_bytes(cfg) * shared


def _output_bytes_per_token(cfg) -> int:
    """The last stage: the loss's fp32 softmax over this rank's vocabulary, and the final norm."""
    par = cfg.parallel
    tp = par.tensor_model_parallel_size
    sp = tp if par.sequence_parallel else 1
    norm = (3 * cfg.model.hidden_size + 1) if unfused_kernels(cfg) else 2 * cfg.model.hidden_size
    return _vocab(cfg, tp) // tp * 4 + _element_bytes(cfg) * norm // sp


def _layer_input_bytes_per_token(cfg) -> int:
    par = cfg.parallel
    sp = par.tensor_model_parallel_size if par.sequence_parallel else 1
    return _element_bytes(cfg) * cfg.model.hidden_size // sp


def tokens_per_microbatch(cfg) -> int:
    """Tokens of one micro-batch on one rank: a pack (or seq_length tokens in-batch), ``/ CP``."""
    size = cfg.packing.packed_sequence_size if cfg.packing.mode != "in_batch" else cfg.model.seq_length
    return size // cfg.parallel.context_parallel_size


def microbatches_in_flight(cfg, stage: int, dp: int) -> int:
    """Micro-batches whose activations ``stage`` holds at once under 1F1B: ``min(PP - stage, micro-batches)``;
    with VP > 1 model chunks, the chunk forwards of the interleaved 1F1B (its warm-up plus one, each
    holding one chunk's layers): ``min((PP - stage - 1) * 2 + (VP - 1) * PP + 1, micro-batches * VP)``."""
    t, pp, vp = cfg.train, cfg.parallel.pipeline_model_parallel_size, cfg.parallel.num_model_chunks
    num_micro = max(1, t.global_batch_size // (dp * t.micro_batch_size)) if t.global_batch_tokens is None else pp
    if vp > 1:
        return min((pp - stage - 1) * 2 + (vp - 1) * pp + 1, num_micro * vp)
    return min(pp - stage, num_micro)


def stage_activation_bytes(cfg, stage: int, dp: int) -> int:
    """Peak activation bytes of one rank of ``stage`` (see the module docstring)."""
    m, par = cfg.model, cfg.parallel
    tokens = tokens_per_microbatch(cfg)
    layers = m.num_layers // (par.pipeline_model_parallel_size * par.num_model_chunks)  # one chunk's
    num_linear = _num_linear_layers(cfg, layers)
    full, kept = layer_activation_bytes_per_token(cfg), _layer_input_bytes_per_token(cfg)
    linear = layer_activation_bytes_per_token(cfg, linear=True) if num_linear else 0
    every = (layers - num_linear) * full + num_linear * linear  # the chunk's layers, each keeping everything
    if m.recompute_granularity == "full":
        n, largest = m.recompute_num_layers or 1, max(full, linear)
        if (m.recompute_method or "uniform") == "uniform":
            held, working = -(-layers // n) * kept, min(n, layers) * largest
        else:  # block: the first n layers of the stage recomputed, the rest keep everything (at most)
            recomputed = min(n, layers)
            held, working = recomputed * kept + (layers - recomputed) * largest, largest
    else:
        held, working = every, 0
    if num_linear:  # fla's backward of one Gated DeltaNet layer recomputes its chunk states
        working = max(working, linear_working_bytes_per_token(cfg))
    output = _output_bytes_per_token(cfg) if stage == par.pipeline_model_parallel_size - 1 else 0
    # the softmax of the loss is freed before backward reaches the layers (and any recomputation)
    return tokens * (held * microbatches_in_flight(cfg, stage, dp) + max(output, working))


def estimate_stage(cfg, stage: int, world_size: int) -> StageMemory:
    """The bytes of one rank of ``stage`` at ``world_size`` ranks."""
    par, dist_opt = cfg.parallel, cfg.ddp.use_distributed_optimizer
    model_parallel = par.tensor_model_parallel_size * par.context_parallel_size * par.pipeline_model_parallel_size
    dp = max(1, world_size // model_parallel)
    num, experts = stage_params(cfg, stage), stage_expert_params(cfg, stage)
    element = _element_bytes(cfg)
    vision, frozen, vision_acts = _vision_share(cfg, stage, element)
    state = ADAM_MOMENT_BYTES + (MASTER_BYTES if element < 4 else 0)  # fp32 main params of 16-bit weights
    shards = dp * par.context_parallel_size if dist_opt else 1
    # routed experts are replicated only over the expert-data-parallel ranks: their state is sharded over those
    expert_shards = expert_data_parallel(cfg, world_size) if dist_opt else 1
    optimizer = -(-(num + vision - frozen - experts) * state // shards) + -(-experts * state // expert_shards)
    return StageMemory(stage=stage, num_params=num + vision, params=(num + vision) * element,
                       grads=(num + vision - frozen) * (4 if cfg.ddp.grad_reduce_in_fp32 else element),
                       optimizer=optimizer,
                       activations=stage_activation_bytes(cfg, stage, dp) + vision_acts * microbatches_in_flight(
                           cfg, stage, dp))


def _vision_share(cfg, stage: int, element: int) -> tuple[int, int, int]:
    """(vision tower parameters, of them frozen, activation bytes per micro-batch) on a rank of ``stage``:
    a vision-language model's first stage holds the whole tower (``vision_memory``)."""
    from megatron_pack.training.vision_memory import vision_activation_bytes, vision_config, vision_params, \
        vision_trainable_params

    vc = vision_config(cfg) if stage == 0 else None
    if vc is None:
        return 0, 0, 0
    total = vision_params(vc)
    return total, total - vision_trainable_params(vc, cfg.model.freeze_vision), vision_activation_bytes(cfg, vc, element)


def estimate_memory(cfg, world_size: int = 1) -> StageMemory:
    """The worst rank: the pipeline stage whose total is the largest."""
    stages = [estimate_stage(cfg, s, world_size) for s in range(cfg.parallel.pipeline_model_parallel_size)]
    return max(stages, key=lambda s: s.total)


def memory_line(cfg, world_size: int, host=None) -> str:
    """The line ``train --check`` prints (a MoE model's with routing assumed balanced); ``host``
    (``config.host.Host``) resolves ``train.device=auto`` to the kernels a run here gets."""
    kernels = "unfused CPU kernels" if unfused_kernels(cfg, host) else "fused GPU kernels"
    return estimate_memory(cfg, world_size).line(cfg.parallel.pipeline_model_parallel_size, kernels)
