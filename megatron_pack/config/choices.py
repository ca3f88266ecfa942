"""Value lists of the config keys, each written once here (config is the bottom layer).

``CHOICES`` maps every key with a fixed set of values to its list: the schema checks a field
against it (``schema._choice``), the validators and the code that acts on a value use the same
tuple, and tests/unit/test_layout.py checks that every listed value validates, any other is
refused naming the list, and docs/configuration.md's row of the key names every value. Add a
value here, then teach the code it names (a test fails until every consumer knows it).
"""

PACKING_ALGORITHMS = ("bfd", "ffd", "first_fit_shuffle", "sequential", "wrapped")
"""``packing.algorithm``: best-fit decreasing, first-fit decreasing, seeded shuffle + first fit, next fit,
and the wrapped stream (documents cut at row ends: ``data.packing.wrapped``, not a bin packing of whole samples)."""

ATTENTION_MODES = ("thd", "pack_causal")
"""``verify.attention``: the real THD attention, or plain causal attention over the whole pack (broken on purpose)."""

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
"""``parallel.cp_comm_type``: Transformer Engine's context-parallel communication."""

PACKING_MODES = ("offline", "online", "in_batch")
"""``packing.mode``, the one switch of how packing happens: packs from a prepared plan, packs made at run time
from a bounded buffer, or each micro-batch of ``train.micro_batch_size`` samples packed into one row at collate."""

ONLINE_SOURCES = ("store", "stream")
"""``packing.online_source``: the prepared token store, or data.input tokenized on the fly."""

BALANCE_MODES = ("none", "dp")
"""``packing.balance``: deal packs round-robin, or assign them to DP ranks by cost."""

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
"""``checkpoint.signals``: signals that stop a run after its step with a checkpoint (SIGKILL / SIGSTOP cannot be caught)."""

BAD_RECORD_POLICIES = ("error", "skip")
"""``data.on_bad_record``: stop at the first bad record (file and line), or skip each one, counted by reason."""

TOKEN_BUDGET_KINDS = ("target", "real")
"""``train.token_budget``: what ``train.global_batch_tokens`` counts: loss-carrying tokens or all real tokens."""

DEFAULT_COST_A = 1.0
"""``packing.cost_a``: cost per real token of a pack (the unit)."""

DEFAULT_COST_B = 0.0013
"""``packing.cost_b``: cost per squared sub-sequence token, relative to cost_a: b/a = 0.001304 (1/767) fitted by
``bench/balance.py --fit`` (tiny model, CPU; docs/benchmarks.md), which is the flop count's 1/(12 * hidden_size)
for hidden 64. Refit for your model and hardware (about 1/(12 * hidden_size) by flops)."""

FP8_RECIPES = ("none", "delayed", "current", "mxfp8", "blockwise")
"""``model.fp8``: no FP8, or a Transformer Engine FP8 recipe for the linear layers' GEMMs: delayed scaling
(``DelayedScaling``, amax history), current per-tensor scaling (``Float8CurrentScaling``; megatron-core calls it
'tensorwise'), MXFP8 (``MXFP8BlockScaling``, 32-element blocks, Blackwell) or blockwise FP8
(``Float8BlockScaling``, 1x128 / 128x128 blocks, Hopper)."""

FP8_TOKEN_ALIGNMENT = {"none": 1, "delayed": 16, "current": 16, "mxfp8": 32, "blockwise": 128}
"""Tokens the rows of every FP8 GEMM input must come in multiples of, per ``model.fp8`` recipe
(docs/thd.md "FP8 recipes" cites the Transformer Engine sources): 16 for per-tensor scaling (cuBLASLt's
FP8 leading-dimension rule; the token dimension is the inner one of the weight-gradient GEMM), 32 for
MXFP8 (its scaling block) and 128 for blockwise FP8 (its scaling block and quantized all-gather)."""

ROPE_SCALINGS = ("none", "llama3", "linear", "yarn")
"""``model.rope_scaling``: plain RoPE, Llama 3.1 / 3.2 frequency scaling, linear (positions divided by
``model.rope_scaling_factor``; Gemma 3's full-attention layers), or YaRN (gpt-oss: the ``model.rope_yarn_*`` keys)."""

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
"""``model.normalization``."""

ACTIVATIONS = ("swiglu", "gelu", "geglu", "quick_geglu")
"""``model.activation``: gated SiLU, plain GELU, gated GELU with the tanh approximation (Gemma's
gelu_pytorch_tanh), or gated quick GELU x * sigmoid(1.702 x) (gpt-oss); ``GATED_ACTIVATIONS`` have a gate and an
up half in ``linear_fc1``."""

GATED_ACTIVATIONS = ("swiglu", "geglu", "quick_geglu")
"""``model.activation`` values whose MLP is gated (``linear_fc1`` holds [gate; up])."""

ATTENTION_BACKENDS = ("auto", "torch", "te")
"""``model.attention_backend``: Transformer Engine when CUDA and TE are present (else torch), torch, or TE."""

PARAMS_DTYPES = ("float32", "bfloat16")
"""``model.params_dtype`` (and ``export.dtype``, which also takes null: the source folder's dtype)."""

CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
"""``model.cuda_graph_impl``: no CUDA graphs, megatron-core's, or Transformer Engine's."""

CUDA_GRAPH_SCOPES = ("attn", "mlp")
"""Entries of ``model.cuda_graph_scope`` (empty: whole layers)."""

RECOMPUTE_GRANULARITIES = ("selective", "full")
"""``model.recompute_granularity`` (or null: off)."""

RECOMPUTE_METHODS = ("uniform", "block")
"""``model.recompute_method`` (or null: uniform)."""

DATA_SOURCES = ("synthetic", "files")
"""``data.source``: the embedded synthetic SFT set, or ``data.input``."""

RECORD_SCHEMAS = ("auto", "prompt_completion", "chat")
"""``data.schema``."""

RECORD_FORMATS = ("default", "sharegpt")
"""``data.format``: the keys of data.*, or ShareGPT's conversations/from/value."""

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles ``data.role_aliases`` may map to."""

OVERFLOW_POLICIES = ("error", "drop", "truncate", "split")
"""``packing.on_overflow``: what happens to a sample longer than the pack."""

BUCKET_ORDERS = ("interleave", "sequential")
"""``packing.bucket_order``: one shuffle over all packs, or bucket after bucket, shortest first."""

WRAPPED_ATTENTIONS = ("document", "cross")
"""``packing.wrapped_attention``: no attention across documents of a wrapped row, or one sequence per row."""

PACKING_EXPORTS = ("none", "bridge")
"""``packing.export``: nothing more, or also Megatron-Bridge's packed parquet."""

DIST_BACKENDS = ("auto", "nccl", "gloo")
"""``parallel.backend``: nccl with CUDA, else gloo; or either."""

LR_DECAY_STYLES = ("cosine", "linear", "constant")
"""``train.lr_decay_style``."""

DEVICES = ("auto", "cuda", "cpu")
"""``train.device``: cuda when available."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""``logging.level``."""

WANDB_MODES = ("online", "offline")
"""``logging.wandb_mode``: log to the W&B server, or to files under the output folder for ``wandb sync``."""

VERIFY_REFERENCES = ("self", "transformers")
"""``verify.reference``: each sample alone through our model, or through transformers' forward."""

PEFT_METHODS = ("none", "lora")
"""``peft.method``: full fine-tuning, or LoRA adapters."""

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
"""``model.softmax_type`` (megatron-core's): plain softmax, a sink logit of 0 per head, or a learned sink logit
per head (``softmax_offset``; gpt-oss); ``model/attention_reach.py``."""

TE_MIN_VERSION_SOFTMAX_TYPE = "2.8.0"
"""The first Transformer Engine whose ``DotProductAttention`` takes ``softmax_type`` (megatron-core 0.16.1's check)."""

CHOICES = {
    "model.rope_scaling": ROPE_SCALINGS, "model.normalization": NORMALIZATIONS, "model.activation": ACTIVATIONS,
    "model.attention_backend": ATTENTION_BACKENDS, "model.params_dtype": PARAMS_DTYPES,
    "model.cuda_graph_impl": CUDA_GRAPH_IMPLS, "model.fp8": FP8_RECIPES,
    "model.recompute_granularity": RECOMPUTE_GRANULARITIES, "model.recompute_method": RECOMPUTE_METHODS,
    "data.source": DATA_SOURCES, "data.schema": RECORD_SCHEMAS, "data.format": RECORD_FORMATS,
    "data.on_bad_record": BAD_RECORD_POLICIES,
    "packing.algorithm": PACKING_ALGORITHMS, "packing.on_overflow": OVERFLOW_POLICIES,
    "packing.bucket_order": BUCKET_ORDERS, "packing.wrapped_attention": WRAPPED_ATTENTIONS,
    "packing.export": PACKING_EXPORTS, "packing.mode": PACKING_MODES, "packing.online_source": ONLINE_SOURCES,
    "packing.balance": BALANCE_MODES, "parallel.cp_comm_type": CP_COMM_TYPES, "parallel.backend": DIST_BACKENDS,
    "train.token_budget": TOKEN_BUDGET_KINDS, "train.lr_decay_style": LR_DECAY_STYLES, "train.device": DEVICES,
    "logging.level": LOG_LEVELS, "logging.wandb_mode": WANDB_MODES, "verify.attention": ATTENTION_MODES, "verify.reference": VERIFY_REFERENCES,
    "export.dtype": PARAMS_DTYPES, "peft.method": PEFT_METHODS, "model.softmax_type": SOFTMAX_TYPES,
}
"""Every config key with a fixed set of values -> its list (a key whose field is Optional also takes null)."""

NULLABLE_CHOICES = ("model.recompute_granularity", "model.recompute_method", "export.dtype")
"""Keys of ``CHOICES`` that also take null (off, or the default it stands for)."""
