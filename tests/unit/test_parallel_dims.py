"""ParallelDims: degrees from config + world size, derived dp and pad multiple."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config import Config, ConfigError, PackingConfig, ParallelConfig
from megatron_pack.config.layout import effective_pad_multiple
from megatron_pack.parallel.dims import ParallelDims


def config(cp=1, tp=1, sp=False, pp=1, pad=None) -> Config:
    return Config(parallel=ParallelConfig(context_parallel_size=cp, tensor_model_parallel_size=tp,
                                          pipeline_model_parallel_size=pp, sequence_parallel=sp),
                  packing=PackingConfig(pad_seq_to_mult=pad))


PAD_TABLE = [  # (id, cp, tp, sp, explicit pad_seq_to_mult, expected pad multiple)
    ("cp1-tp1", 1, 1, False, None, 1),
    ("cp2", 2, 1, False, None, 4),
    ("cp2-tp4-sp", 2, 4, True, None, 8),
    ("cp2-tp4-no-sp", 2, 4, False, None, 4),
    ("cp1-tp2-sp", 1, 2, True, None, 2),
    ("cp4-tp2-sp", 4, 2, True, None, 8),
    ("cp3-tp4-sp", 3, 4, True, None, 12),
    ("explicit-wins", 2, 1, False, 16, 16),
    ("explicit-wins-cp1", 1, 1, False, 64, 64),
]


@pytest.mark.parametrize("cp,tp,sp,pad,expected", [c[1:] for c in PAD_TABLE], ids=[c[0] for c in PAD_TABLE])
def test_pad_multiple(cp, tp, sp, pad, expected):
    cfg = config(cp=cp, tp=tp, sp=sp, pad=pad)
    dims = ParallelDims.from_config(cfg, world_size=cp * tp * 2)
    assert dims.pad_multiple == expected == effective_pad_multiple(cfg)
    assert dims.pad_multiple_explicit == (pad is not None)
    assert dims.pad_multiple % dims.required_pad_multiple == 0


DP_TABLE = [  # (id, world, cp, tp, dp, cp_enabled, tp_enabled, dp_enabled)
    ("single", 1, 1, 1, 1, False, False, False),
    ("dp4", 4, 1, 1, 4, False, False, True),
    ("cp2", 2, 2, 1, 1, True, False, False),
    ("cp2-dp2", 4, 2, 1, 2, True, False, True),
    ("tp2-cp2-dp2", 8, 2, 2, 2, True, True, True),
    ("tp4-dp2", 8, 1, 4, 2, False, True, True),
]


@pytest.mark.parametrize("world,cp,tp,dp,cp_on,tp_on,dp_on", [c[1:] for c in DP_TABLE], ids=[c[0] for c in DP_TABLE])
def test_dp_from_world_size(world, cp, tp, dp, cp_on, tp_on, dp_on):
    dims = ParallelDims.from_config(config(cp=cp, tp=tp), world_size=world)
    assert (dims.world_size, dims.tp, dims.cp, dims.pp, dims.dp) == (world, tp, cp, 1, dp)
    assert (dims.cp_enabled, dims.tp_enabled, dims.dp_enabled, dims.pp_enabled) == (cp_on, tp_on, dp_on, False)
    assert dims.dp_cp == dp * cp


@pytest.mark.parametrize("world", [3, 6, 0, -2, True], ids=["3", "6", "zero", "negative", "bool"])
def test_bad_world_size_raises(world):
    with pytest.raises(ConfigError, match="world size"):
        ParallelDims.from_config(config(cp=2, tp=2), world_size=world)


def test_describe_names_every_degree():
    text = ParallelDims.from_config(config(cp=2, tp=4, sp=True), world_size=16).describe()
    assert text == ("world 16 = dp 2 x cp 2 x tp 4 x pp 1; sequence_parallel on; "
                    "pad multiple 8 (derived: lcm(2*cp=4, cp*tp=8))")
    explicit = ParallelDims.from_config(config(cp=2, pad=16), world_size=2).describe()
    assert "pad multiple 16 (packing.pad_seq_to_mult" in explicit and "multiple of 4" in explicit


def test_dims_are_read_only():
    dims = ParallelDims.from_config(config(cp=2), world_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.dp = 3


@settings(max_examples=80, deadline=None)
@given(cp=st.integers(1, 8), tp=st.integers(1, 8), pp=st.integers(1, 2), dp=st.integers(1, 8), sp=st.booleans(),
       extra=st.integers(1, 7))
def test_world_size_property(cp, tp, pp, dp, sp, extra):
    """dp * tp * cp * pp == world; a world that does not divide raises and names both numbers."""
    cfg = config(cp=cp, tp=tp, pp=pp, sp=sp)
    world = dp * tp * cp * pp
    dims = ParallelDims.from_config(cfg, world)
    assert dims.dp * dims.tp * dims.cp * dims.pp == world and dims.dp == dp
    assert dims.pad_multiple % (2 * cp if cp > 1 else 1) == 0
    assert not (sp and tp > 1) or dims.pad_multiple % (cp * tp) == 0
    bad = world + extra
    if bad % (tp * cp * pp):
        with pytest.raises(ConfigError) as info:
            ParallelDims.from_config(cfg, bad)
        assert f"world size ({bad})" in str(info.value) and f"= {tp * cp * pp};" in str(info.value)
