"""Value lists that several layers read, each written once here (config is the bottom layer).

The schema checks a field against its list, the code that acts on the value dispatches on the
same tuple, and tests/unit/test_config_docs.py checks that docs/configuration.md names every
value. Add a value here, then teach the code it names (a test fails until every consumer knows it).
"""

PACKING_ALGORITHMS = ("bfd", "ffd", "first_fit_shuffle", "sequential")
"""``packing.algorithm``: best-fit decreasing, first-fit decreasing, seeded shuffle + first fit, next fit."""

ATTENTION_MODES = ("thd", "pack_causal")
"""``verify.attention``: the real THD attention, or plain causal attention over the whole pack (broken on purpose)."""

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
"""``parallel.cp_comm_type``: Transformer Engine's context-parallel communication."""
