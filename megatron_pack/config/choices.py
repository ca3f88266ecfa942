"""Value lists that several layers read, each written once here (config is the bottom layer).

The schema checks a field against its list, the code that acts on the value dispatches on the
same tuple, and tests/unit/test_config_docs.py checks that docs/configuration.md names every
value. Add a value here, then teach the code it names (a test fails until every consumer knows it).
"""

PACKING_ALGORITHMS = ("bfd", "ffd", "first_fit_shuffle", "sequential", "wrapped")
"""``packing.algorithm``: best-fit decreasing, first-fit decreasing, seeded shuffle + first fit, next fit,
and the wrapped stream (documents cut at row ends: ``data.packing.wrapped``, not a bin packing of whole samples)."""

ATTENTION_MODES = ("thd", "pack_causal")
"""``verify.attention``: the real THD attention, or plain causal attention over the whole pack (broken on purpose)."""

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
"""``parallel.cp_comm_type``: Transformer Engine's context-parallel communication."""

PACKING_MODES = ("offline", "online")
"""``packing.mode``: packs from a prepared plan, or made at run time from a bounded buffer."""

ONLINE_SOURCES = ("store", "stream")
"""``packing.online_source``: the prepared token store, or data.input tokenized on the fly."""

BALANCE_MODES = ("none", "dp")
"""``packing.balance``: deal packs round-robin, or assign them to DP ranks by cost."""

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
"""``checkpoint.signals``: signals that stop a run after its step with a checkpoint (SIGKILL / SIGSTOP cannot be caught)."""

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
