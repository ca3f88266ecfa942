"""The pad and world-size rules of a parallel layout: plain integers in, integers or messages out.

This module is the bottom of the package (no torch, no numpy, no other megatron_pack module), so
config validation, the packer, the collate and the process-group setup all read one rule::

    >>> pad_multiple(cp=2, tp=4, sequence_parallel=True)    # lcm(2*cp=4, cp*tp=8)
    8
    >>> round_up(13, 8), round_up(16, 8), round_up(0, 8)
    (16, 16, 0)

``world_size_problem(6, tp=2, cp=2, pp=1)`` names the fix ("launch 4 or 8 ranks ...").

``megatron_pack.parallel.cp.pad_multiple`` and ``megatron_pack.parallel.dims`` re-export these
names (the public paths of DESIGN.md stay valid).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megatron_pack.config.schema import Config


def round_up(value, multiple: int):
    """``value`` rounded up to a multiple of ``multiple`` (ints, numpy or torch integer arrays).

    The one rounding rule of the package: the packer's padded lengths (``thd_lengths``), the
    collate's padded sub-sequences and in-batch packing use it, so a plan never holds a length
    the collate pads differently. ``round_up(5, 4) -> 8``, ``round_up(8, 4) -> 8``, ``round_up(0, 4) -> 0``.
    """
    return -(-value // multiple) * multiple


def pad_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """The multiple every sub-sequence is padded to for this parallel layout.

    ``lcm(2*CP if CP > 1 else 1, CP*TP if sequence_parallel and TP > 1 else 1)``: the THD CP
    split needs ``2*CP`` equal chunks, and sequence parallelism shards each CP rank's tokens over
    TP. Examples: ``(1, 1, False) -> 1``, ``(2, 1, False) -> 4``, ``(2, 4, True) -> 8``,
    ``(4, 2, False) -> 8``, ``(1, 4, True) -> 4``.
    """
    for name, value in (("cp", cp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pad_multiple: {name} ({value!r}) must be a positive integer "
                             f"(parallel.{'context' if name == 'cp' else 'tensor_model'}_parallel_size).")
    cp_multiple = 2 * cp if cp > 1 else 1
    sp_multiple = cp * tp if sequence_parallel and tp > 1 else 1
    return math.lcm(cp_multiple, sp_multiple)


def required_pad_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """The smallest multiple every packed sub-sequence must be padded to (``pad_multiple``)."""
    return pad_multiple(cp, tp, sequence_parallel)


def effective_pad_multiple(cfg: "Config") -> int:
    """packing.pad_seq_to_mult when set, else the lcm rule for the configured degrees (no world size needed)."""
    if cfg.packing.pad_seq_to_mult is not None:
        return cfg.packing.pad_seq_to_mult
    par = cfg.parallel
    return pad_multiple(par.context_parallel_size, par.tensor_model_parallel_size, par.sequence_parallel)


def pad_rule_text(cp: int, tp: int, sequence_parallel: bool) -> str:
    """The rule with its numbers filled in, for messages: ``lcm(2*cp=4, cp*tp=8)``."""
    terms = []
    if cp > 1:
        terms.append(f"2*cp={2 * cp}")
    if sequence_parallel and tp > 1:
        terms.append(f"cp*tp={cp * tp}")
    return f"lcm({', '.join(terms)})" if terms else "1 (no CP, no TP sequence parallelism)"


def world_size_message(world_size: int, tp: int, cp: int, pp: int) -> str:
    """The problem message for a world size that tp*cp*pp does not divide."""
    model_parallel = tp * cp * pp
    lower = (world_size // model_parallel) * model_parallel
    upper = lower + model_parallel
    hint = f"{upper}" if lower == 0 else f"{lower} or {upper}"
    return (f"world size ({world_size}) must be divisible by tensor_model_parallel_size * context_parallel_size * "
            f"pipeline_model_parallel_size = {tp}*{cp}*{pp} = {model_parallel}; launch {hint} ranks "
            f"or change parallel.context_parallel_size / parallel.tensor_model_parallel_size.")


def world_size_problem(world_size: object, tp: int, cp: int, pp: int) -> Optional[str]:
    """None when ``world_size`` ranks split into tp*cp*pp model-parallel groups, else the message."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return f"world size ({world_size!r}) must be a positive integer; launch at least one rank."
    if world_size % (tp * cp * pp):
        return world_size_message(world_size, tp, cp, pp)
    return None
