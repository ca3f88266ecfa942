"""``ParallelDims``: the parallel layout, built once from the config and the world size.

Everything that depends on the degrees (data-parallel size, the pad multiple of packed
sub-sequences) is derived here, so nothing mutates the read-only config and nothing reads
global process-group state to find a degree.

Example (8 ranks, ``parallel=tp2_cp2_sp``)::

    >>> dims = ParallelDims.from_config(load_config(["parallel=tp2_cp2_sp"]), world_size=8)
    >>> dims.dp, dims.cp_enabled, dims.pad_multiple
    (2, True, 4)
    >>> print(dims.describe())
    world 8 = dp 2 x cp 2 x tp 2 x pp 1; sequence_parallel on; pad multiple 4 (derived: lcm(2*cp=4, cp*tp=4))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_pack.config.schema import Config


def required_pad_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """The smallest multiple every packed sub-sequence must be padded to for this layout.

    The rule itself is ``megatron_pack.parallel.cp.pad_multiple``, imported here on first use so
    that loading a config does not import torch until a pad multiple is needed.
    """
    from megatron_pack.parallel.cp import pad_multiple

    return pad_multiple(cp, tp, sequence_parallel)


def effective_pad_multiple(cfg: "Config") -> int:
    """packing.pad_seq_to_mult when set, else the lcm rule for the configured degrees (no world size needed)."""
    if cfg.packing.pad_seq_to_mult is not None:
        return cfg.packing.pad_seq_to_mult
    par = cfg.parallel
    return required_pad_multiple(par.context_parallel_size, par.tensor_model_parallel_size, par.sequence_parallel)


def pad_rule_text(cp: int, tp: int, sequence_parallel: bool) -> str:
    """The rule with its numbers filled in, for messages: ``lcm(2*cp=4, cp*tp=8)``."""
    terms = []
    if cp > 1:
        terms.append(f"2*cp={2 * cp}")
    if sequence_parallel and tp > 1:
        terms.append(f"cp*tp={cp * tp}")
    return f"lcm({', '.join(terms)})" if terms else "1 (no CP, no TP sequence parallelism)"


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Degrees of one run: ``world_size == dp * cp * tp * pp``."""

    world_size: int
    """Number of ranks."""
    tp: int
    """Tensor-parallel degree."""
    cp: int
    """Context-parallel degree."""
    pp: int
    """Pipeline-parallel degree (1: pipelines are not supported)."""
    dp: int
    """Data-parallel degree, derived: world_size / (tp * cp * pp)."""
    sp: bool
    """Sequence parallelism inside TP regions."""
    pad_multiple: int
    """Effective pad multiple: packing.pad_seq_to_mult when set, else the lcm rule."""
    pad_multiple_explicit: bool = False
    """True when pad_multiple came from packing.pad_seq_to_mult rather than the rule."""

    @classmethod
    def from_config(cls, cfg: "Config", world_size: int) -> "ParallelDims":
        """Derive the layout; raises ``ConfigError`` when world_size does not divide into it."""
        from megatron_pack.config.schema import ConfigError  # here, so config may import this module

        par = cfg.parallel
        tp, cp, pp = par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size
        model_parallel = tp * cp * pp
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError([f"world size ({world_size!r}) must be a positive integer."])
        if world_size % model_parallel:
            raise ConfigError([world_size_message(world_size, tp, cp, pp)])
        return cls(world_size=world_size, tp=tp, cp=cp, pp=pp, dp=world_size // model_parallel,
                   sp=par.sequence_parallel, pad_multiple=effective_pad_multiple(cfg),
                   pad_multiple_explicit=cfg.packing.pad_seq_to_mult is not None)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def required_pad_multiple(self) -> int:
        """The lcm rule for this layout (pad_multiple is a multiple of it once validated)."""
        return required_pad_multiple(self.cp, self.tp, self.sp)

    @property
    def dp_cp(self) -> int:
        """Ranks that share one gradient reduction (and one global token count): dp * cp."""
        return self.dp * self.cp

    def describe(self) -> str:
        """One line naming every degree and where the pad multiple comes from."""
        rule = pad_rule_text(self.cp, self.tp, self.sp)
        source = (f"packing.pad_seq_to_mult; the rule {rule} requires a multiple of {self.required_pad_multiple}"
                  if self.pad_multiple_explicit else f"derived: {rule}")
        return (f"world {self.world_size} = dp {self.dp} x cp {self.cp} x tp {self.tp} x pp {self.pp}; "
                f"sequence_parallel {'on' if self.sp else 'off'}; pad multiple {self.pad_multiple} ({source})")


def world_size_message(world_size: int, tp: int, cp: int, pp: int) -> str:
    """The problem message for a world size that tp*cp*pp does not divide."""
    model_parallel = tp * cp * pp
    lower = (world_size // model_parallel) * model_parallel
    upper = lower + model_parallel
    hint = f"{upper}" if lower == 0 else f"{lower} or {upper}"
    return (f"world size ({world_size}) must be divisible by tensor_model_parallel_size * context_parallel_size * "
            f"pipeline_model_parallel_size = {tp}*{cp}*{pp} = {model_parallel}; launch {hint} ranks "
            f"or change parallel.context_parallel_size / parallel.tensor_model_parallel_size.")
