"""The pad and world-size rules of a parallel layout: plain integers in, integers or messages out.

This module is the bottom of the package (no torch, no numpy; of megatron_pack only the value lists of
``config.choices``), so config validation, the packer, the collate and the process-group setup all read one rule::

    >>> pad_multiple(cp=2, tp=4, sequence_parallel=True)    # lcm(2*cp=4, cp*tp=8)
    8
    >>> round_up(13, 8), round_up(16, 8), round_up(0, 8)
    (16, 16, 0)

``world_size_problem(6, tp=2, cp=2, pp=1)`` names the fix ("launch 4 or 8 ranks ...").

A low-precision recipe (``model.fp8``) adds a rule on the whole pack, not on each sub-sequence:
the pack's token count ``T`` is padded (by a tail sub-sequence of zero real length) to a multiple of
``pack_multiple``, so every FP8 GEMM sees a multiple of the recipe's alignment on every rank::

    >>> fp8_token_multiple(cp=2, tp=2, sequence_parallel=True, fp8="delayed")   # 2 * 2 * 16
    64
    >>> pack_multiple(cp=2, tp=1, sequence_parallel=False, fp8="mxfp8")          # lcm(4, 2 * 32)
    64


DESIGN.md's path ``megatron_pack.parallel.cp.pad_multiple`` resolves to ``pad_multiple`` here
through the table of moved public names (``megatron_pack._deprecated``), with a DeprecationWarning.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from megatron_pack.config.choices import FP8_TOKEN_ALIGNMENT

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


def fp8_token_multiple(cp: int, tp: int, sequence_parallel: bool, fp8: str) -> int:
    """The multiple of a pack's token count ``T`` that recipe ``fp8`` needs (1 for ``none``).

    CP slicing hands each CP rank ``T / cp`` rows whatever the sub-sequences are (every sub-sequence
    gives each rank ``L_i / cp`` rows), and with sequence parallelism each TP rank holds
    ``T / (cp * tp)`` rows between its GEMMs (Transformer Engine quantizes that shard before the
    all-gather). So ``T`` must be a multiple of ``cp * (tp if sequence_parallel) * alignment``.
    Examples: ``(1, 1, False, "delayed") -> 16``, ``(8, 2, False, "mxfp8") -> 256``,
    ``(2, 2, True, "blockwise") -> 512``, ``(4, 2, True, "none") -> 1``.
    """
    if fp8 not in FP8_TOKEN_ALIGNMENT:
        raise ValueError(f"model.fp8 ({fp8!r}) must be one of {list(FP8_TOKEN_ALIGNMENT)}; set model.fp8=none.")
    align = FP8_TOKEN_ALIGNMENT[fp8]
    if align == 1:
        return 1
    return cp * (tp if sequence_parallel and tp > 1 else 1) * align


def pack_multiple(cp: int, tp: int, sequence_parallel: bool, fp8: str = "none",
                  pad_seq_to_mult: Optional[int] = None) -> int:
    """The multiple a pack's token count is padded to: ``lcm(pad multiple, fp8_token_multiple)``.

    The pad multiple is ``pad_seq_to_mult`` when given, else ``pad_multiple(cp, tp, sp)``; taking
    the lcm keeps the tail a sub-sequence padded like the others (its CP chunks are whole). Without
    FP8 it is the pad multiple itself, which every pack already is (a sum of padded sub-sequences).
    Examples: ``(1, 1, False, "delayed") -> 16``, ``(2, 1, False, "delayed", 48) -> 96``,
    ``(4, 1, False, "none") -> 8``.
    """
    pad = pad_seq_to_mult if pad_seq_to_mult is not None else pad_multiple(cp, tp, sequence_parallel)
    return math.lcm(pad, fp8_token_multiple(cp, tp, sequence_parallel, fp8))


def effective_pack_multiple(cfg: "Config") -> int:
    """``pack_multiple`` for the configured degrees, ``model.fp8`` and pad multiple (no world size needed)."""
    par = cfg.parallel
    return pack_multiple(par.context_parallel_size, par.tensor_model_parallel_size, par.sequence_parallel,
                         cfg.model.fp8, effective_pad_multiple(cfg))


def fp8_rule_text(cp: int, tp: int, sequence_parallel: bool, fp8: str) -> str:
    """The FP8 pack rule with its numbers, for messages: ``cp*tp*16 = 2*2*16 = 64 (model.fp8=delayed)``."""
    align = FP8_TOKEN_ALIGNMENT[fp8]
    if sequence_parallel and tp > 1:
        return f"cp*tp*{align} = {cp}*{tp}*{align} = {cp * tp * align} (model.fp8={fp8}, sequence_parallel)"
    return f"cp*{align} = {cp}*{align} = {cp * align} (model.fp8={fp8})"


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
