"""Pipeline stage layout and the activation shapes between stages: hand-computed cases and a property."""

import pytest
import torch
from hypothesis import given, settings
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


VIRTUAL = [  # (num_layers, pp, pp_rank, vp, vp_stage) -> (offset, local layers, first, last)
    ((4, 2, 0, 2, 0), (0, 1, True, False)),
    ((4, 2, 1, 2, 0), (1, 1, False, False)),
    ((4, 2, 0, 2, 1), (2, 1, False, False)),
    ((4, 2, 1, 2, 1), (3, 1, False, True)),
    ((16, 4, 3, 2, 0), (6, 2, False, False)),
    ((16, 4, 0, 2, 1), (8, 2, False, False)),
]


@pytest.mark.parametrize("args,expected", VIRTUAL, ids=[f"L{a[0]}_pp{a[1]}_r{a[2]}_vp{a[3]}_v{a[4]}" for a, _ in VIRTUAL])
def test_virtual_stage_layout(args, expected):
    s = stage_layout(*args)
    assert (s.layer_offset, s.num_local_layers, s.is_first, s.is_last) == expected


@settings(max_examples=40, deadline=None)  # the first example imports megatron-core
@given(pp=st.integers(2, 6), vp=st.integers(2, 4), per_chunk=st.integers(1, 3))
def test_virtual_offsets_are_megatron_cores(pp, vp, per_chunk):
    """Our chunk offsets equal megatron-core's ``get_transformer_layer_offset(config, vp_stage, pp_rank)``,
    and the chunks in forward order (v, then r) hold every layer once, in order."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layers = pp * vp * per_chunk
    config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                               pipeline_dtype=torch.float32)
    order = []
    for v in range(vp):
        for r in range(pp):
            s = stage_layout(layers, pp, r, vp, v)
            assert s.layer_offset == get_transformer_layer_offset(config, vp_stage=v, pp_rank=r)
            order += list(range(s.layer_offset, s.layer_offset + s.num_local_layers))
    assert order == list(range(layers))


def test_virtual_stage_layout_refuses():
    with pytest.raises(ValueError, match=r"model.num_layers \(6\) must be a multiple"):
        stage_layout(6, 2, 0, 2, 0)
    with pytest.raises(ValueError, match="virtual stage 2 is outside 2 model chunks"):
        stage_layout(4, 2, 0, 2, 2)


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
