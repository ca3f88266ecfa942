"""Memory per rank from the config alone: parameters, gradients, optimizer state, activations.

Torch-free (``train --check`` prints it before anything is built). For the rank of each pipeline
stage, in bytes:

- parameters: the stage's layers (``/ TP`` for the sharded matrices; norms replicated), plus the
  embedding on the first stage and the final norm and output layer on the last (with tied
  embeddings at PP > 1 the last stage holds its own copy of the embedding, as megatron-core does);
  2 B each with ``train.bf16`` or bfloat16 parameters, else 4 B.
- gradients: megatron-core DDP's contiguous main-grad buffer, one element per parameter, 4 B
  (``ddp.grad_reduce_in_fp32``) or the parameter's size. The distributed optimizer reduce-scatters
  in place: the buffer stays whole.
- optimizer state: AdamW's two fp32 moments, plus an fp32 master copy when parameters are 16-bit;
  sharded over the data-parallel ranks (x CP on GPU, megatron-core's ``intra_dp_cp`` group) with
  ``ddp.use_distributed_optimizer`` (which on CPU also keeps an fp32 copy of its shard:
  ``optim.ShardedTrainOptimizer``).
- activations: the tensors autograd keeps for backward, per token of a micro-batch (a pack of
  ``packing.packed_sequence_size`` tokens, ``/ CP`` per rank), per layer, times the micro-batches a
  stage holds under 1F1B: ``min(PP - stage, micro-batches)``. Per layer and token, without
  recomputation: the inputs of the two norms and of the linear layers they feed (``4 h``, ``/ TP``
  with sequence parallelism), attention's q, k, v and output (``2 q + 2 kv``, ``/ TP``; flash-style
  attention keeps no score matrix) and the MLP's ``fc1`` output and activation (``3 ffn`` with
  SwiGLU, ``2 ffn`` with GeLU, ``/ TP``). Full recomputation keeps one layer input per recompute
  unit and, while a unit is recomputed in backward, that unit's full working set; ``selective``
  (core attention) keeps the same bytes as none here, because flash-style attention has no score
  matrix for it to drop. The last stage adds its logits and the loss's fp32 softmax:
  ``vocab / TP x tokens x (element + 4) B``.

The worst rank (``peak_stage``) is the stage with the largest total: the first stage holds the
embedding and the most micro-batches in flight, the last the output layer.

    >>> from megatron_pack.config.schema import Config
    >>> est = estimate_memory(Config())     # the tiny default model, one rank, float32
    >>> est.params, est.grads, est.optimizer       # 2 layers of hidden 64: 104,512 parameters
    (418048, 418048, 836096)
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def line(self, num_stages: int) -> str:
        """``memory per rank (est.): params 8.2, grads 16.4, ... GiB (stage 0 of PP 4)``."""
        gib = [f"{name} {value / GIB:.2f}" for name, value in
               (("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
                ("activations", self.activations), ("total", self.total))]
        return (f"memory per rank (est.): {', '.join(gib)} GiB (stage {self.stage} of PP {num_stages}; "
                f"{self.num_params / 1e9:.3g}e9 parameters on this rank)")


def layer_params(cfg, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank."""
    m = cfg.model
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    q, g = m.num_attention_heads * kv, (m.num_query_groups or m.num_attention_heads) * kv
    h, ffn = m.hidden_size, m.ffn_hidden_size
    fc1 = 2 * ffn if m.activation == "swiglu" else ffn
    sharded = h * (q + 2 * g) + q * h + h * fc1 + ffn * h
    sharded += (q + 2 * g) if m.add_qkv_bias else 0
    norms = 2 * h * (2 if m.normalization == "LayerNorm" else 1) + (2 * kv if m.qk_layernorm else 0)
    return sharded // tp + norms


def _vocab(cfg, tp: int) -> int:
    vocab = cfg.model.vocab_size
    return -(-vocab // tp) * tp if cfg.model.pretrained else vocab


def stage_params(cfg, stage: int) -> int:
    """Parameters one rank of ``stage`` holds."""
    m, par = cfg.model, cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    h, vocab_rows = m.hidden_size, _vocab(cfg, tp) // tp
    total = layer_params(cfg, tp) * (m.num_layers // pp)
    if stage == 0:
        total += vocab_rows * h
    if stage == pp - 1:
        total += h * (2 if m.normalization == "LayerNorm" else 1)
        if m.untie_embeddings_and_output_weights or pp > 1:
            total += vocab_rows * h
    return total


def _element_bytes(cfg) -> int:
    return 2 if cfg.train.bf16 or cfg.model.params_dtype == "bfloat16" else 4


def layer_activation_bytes_per_token(cfg) -> int:
    """Bytes autograd keeps per token for one layer without recomputation, on one rank."""
    m, par = cfg.model, cfg.parallel
    tp = par.tensor_model_parallel_size
    sp = tp if par.sequence_parallel else 1
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    q, g = m.num_attention_heads * kv, (m.num_query_groups or m.num_attention_heads) * kv
    mlp = (3 if m.activation == "swiglu" else 2) * m.ffn_hidden_size
    return _element_bytes(cfg) * (4 * m.hidden_size // sp + (2 * q + 2 * g + mlp) // tp)


def _layer_input_bytes_per_token(cfg) -> int:
    par = cfg.parallel
    sp = par.tensor_model_parallel_size if par.sequence_parallel else 1
    return _element_bytes(cfg) * cfg.model.hidden_size // sp


def tokens_per_microbatch(cfg) -> int:
    """Tokens of one micro-batch on one rank: a pack (or seq_length tokens in-batch), ``/ CP``."""
    size = cfg.packing.packed_sequence_size if cfg.packing.mode != "in_batch" else cfg.model.seq_length
    return size // cfg.parallel.context_parallel_size


def microbatches_in_flight(cfg, stage: int, dp: int) -> int:
    """Micro-batches whose activations ``stage`` holds at once under 1F1B: ``min(PP - stage, micro-batches)``."""
    t = cfg.train
    num_micro = max(1, t.global_batch_size // (dp * t.micro_batch_size)) if t.global_batch_tokens is None else \
        cfg.parallel.pipeline_model_parallel_size
    return min(cfg.parallel.pipeline_model_parallel_size - stage, num_micro)


def stage_activation_bytes(cfg, stage: int, dp: int) -> int:
    """Peak activation bytes of one rank of ``stage`` (see the module docstring)."""
    m, par = cfg.model, cfg.parallel
    tokens = tokens_per_microbatch(cfg)
    layers = m.num_layers // par.pipeline_model_parallel_size
    full, kept = layer_activation_bytes_per_token(cfg), _layer_input_bytes_per_token(cfg)
    if m.recompute_granularity == "full":
        n = m.recompute_num_layers or 1
        if (m.recompute_method or "uniform") == "uniform":
            held, working = -(-layers // n) * kept, min(n, layers) * full
        else:  # block: the first n layers of the stage recomputed, the rest keep everything
            recomputed = min(n, layers)
            held, working = recomputed * kept + (layers - recomputed) * full, full
    else:
        held, working = layers * full, 0
    per_micro = held * tokens
    if stage == par.pipeline_model_parallel_size - 1:
        vocab = _vocab(cfg, par.tensor_model_parallel_size) // par.tensor_model_parallel_size
        per_micro += tokens * (vocab * (_element_bytes(cfg) + 4) + _layer_input_bytes_per_token(cfg))
    return per_micro * microbatches_in_flight(cfg, stage, dp) + working * tokens


def estimate_stage(cfg, stage: int, world_size: int) -> StageMemory:
    """The bytes of one rank of ``stage`` at ``world_size`` ranks."""
    par, dist_opt = cfg.parallel, cfg.ddp.use_distributed_optimizer
    model_parallel = par.tensor_model_parallel_size * par.context_parallel_size * par.pipeline_model_parallel_size
    dp = max(1, world_size // model_parallel)
    num = stage_params(cfg, stage)
    element = _element_bytes(cfg)
    master = element < 4 or (dist_opt and cfg.train.device != "cuda")
    state = ADAM_MOMENT_BYTES + (MASTER_BYTES if master else 0)
    shards = dp * (par.context_parallel_size if cfg.train.device == "cuda" else 1) if dist_opt else 1
    return StageMemory(stage=stage, num_params=num, params=num * element,
                       grads=num * (4 if cfg.ddp.grad_reduce_in_fp32 else element),
                       optimizer=-(-num * state // shards), activations=stage_activation_bytes(cfg, stage, dp))


def estimate_memory(cfg, world_size: int = 1) -> StageMemory:
    """The worst rank: the pipeline stage whose total is the largest."""
    stages = [estimate_stage(cfg, s, world_size) for s in range(cfg.parallel.pipeline_model_parallel_size)]
    return max(stages, key=lambda s: s.total)


def memory_line(cfg, world_size: int) -> str:
    """The line ``train --check`` prints."""
    return estimate_memory(cfg, world_size).line(cfg.parallel.pipeline_model_parallel_size)
