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
from typing import Optional

from megatron_pack.config.layout import pad_rule_text, required_pad_multiple, world_size_problem
from megatron_pack.config.schema import Config, ConfigError, ParallelConfig

__all__ = ["ParallelDims"]


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
    """Pipeline-parallel degree (stages; 1: no pipeline)."""
    dp: int
    """Data-parallel degree, derived: world_size / (tp * cp * pp)."""
    sp: bool
    """Sequence parallelism inside TP regions."""
    pad_multiple: int
    """Effective pad multiple: packing.pad_seq_to_mult when set, else the lcm rule."""
    pad_multiple_explicit: bool = False
    """True when pad_multiple came from packing.pad_seq_to_mult rather than the rule."""
    ep: int = 1
    """Expert-parallel degree, over the data- and context-parallel ranks (parallel.expert_model_parallel_size)."""
    etp: Optional[int] = None
    """Expert tensor-parallel degree (None: tp, megatron-core's default)."""

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "ParallelDims":
        """Derive the layout; raises ``ConfigError`` when world_size does not divide into it."""
        return cls.from_parallel_config(cfg.parallel, world_size, pad_seq_to_mult=cfg.packing.pad_seq_to_mult)

    @classmethod
    def from_parallel_config(cls, par: ParallelConfig, world_size: int, *,
                             pad_seq_to_mult: Optional[int] = None) -> "ParallelDims":
        """The layout of ``parallel.*`` on ``world_size`` ranks; ``pad_seq_to_mult`` None derives the pad multiple."""
        tp, cp, pp = par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size
        problem = world_size_problem(world_size, tp, cp, pp)
        if problem:
            raise ConfigError([problem])
        rule = required_pad_multiple(cp, tp, par.sequence_parallel)
        return cls(world_size=world_size, tp=tp, cp=cp, pp=pp, dp=world_size // (tp * cp * pp),
                   sp=par.sequence_parallel, pad_multiple=rule if pad_seq_to_mult is None else pad_seq_to_mult,
                   pad_multiple_explicit=pad_seq_to_mult is not None, ep=par.expert_model_parallel_size,
                   etp=par.expert_tensor_parallel_size)

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
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def expert_tp(self) -> int:
        """Ranks an expert's weight is split over."""
        return self.tp if self.etp is None else self.etp

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
        experts = f"; experts: ep {self.ep} x expert tp {self.expert_tp}" if self.ep_enabled else ""
        return (f"world {self.world_size} = dp {self.dp} x cp {self.cp} x tp {self.tp} x pp {self.pp}{experts}; "
                f"sequence_parallel {'on' if self.sp else 'off'}; pad multiple {self.pad_multiple} ({source})")
