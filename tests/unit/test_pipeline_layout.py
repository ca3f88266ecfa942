"""Pipeline stage layout and the activation shapes between stages: hand-computed cases and a property."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_pack.parallel.pipeline import fixed_activation_shape, stage_layout

STAGES = [  # (num_layers, pp, pp_rank) -> (offset, local layers, first, last)
    ((4, 2, 0), (0, 2, True, False)),
    ((4, 2, 1), (2, 2, False, True)),
    ((4, 4, 2), (2, 1, False, False)),
    ((80, 4, 3), (60, 20, False, True)),
    ((2, 1, 0), (0, 2, True, True)),
]


@pytest.mark.parametrize("args,expected", STAGES, ids=[f"L{a[0]}_pp{a[1]}_r{a[2]}" for a, _ in STAGES])
def test_stage_layout(args, expected):
    s = stage_layout(*args)
    assert (s.layer_offset, s.num_local_layers, s.is_first, s.is_last) == expected


@pytest.mark.parametrize("args,match", [((3, 2, 0), r"model.num_layers \(3\) must be a multiple"),
                                        ((4, 2, 2), "outside a pipeline of 2 stages")], ids=["uneven", "rank"])
def test_stage_layout_refuses(args, match):
    with pytest.raises(ValueError, match=match):
        stage_layout(*args)


@given(pp=st.integers(1, 8), per_stage=st.integers(1, 6))
def test_stages_cover_every_layer_once(pp, per_stage):
    layers = [list(range(s.layer_offset, s.layer_offset + s.num_local_layers))
              for s in (stage_layout(pp * per_stage, pp, r) for r in range(pp))]
    assert sum(layers, []) == list(range(pp * per_stage))


@pytest.mark.parametrize("kwargs,expected", [
    (dict(cp=1, tp=1, sequence_parallel=False), (64, 1, 32)),
    (dict(cp=2, tp=2, sequence_parallel=False), (32, 1, 32)),
    (dict(cp=2, tp=2, sequence_parallel=True), (16, 1, 32)),
], ids=["plain", "cp2_tp2", "cp2_tp2_sp"])
def test_fixed_activation_shape(kwargs, expected):
    assert fixed_activation_shape(64, hidden_size=32, **kwargs) == expected
