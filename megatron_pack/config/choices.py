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
