"""Warmup + decay learning-rate schedule: hand-computed cases and properties."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config.schema import Config, TrainConfig
from megatron_pack.training.optim import LRSchedule, lr_at

CASES = [
    # (step, lr, min_lr, warmup, train_iters, style, expected)
    (1, 1.0, 0.0, 2, 4, "cosine", 0.5),
    (2, 1.0, 0.0, 2, 4, "cosine", 1.0),
    (3, 1.0, 0.0, 2, 4, "cosine", 0.5),
    (4, 1.0, 0.0, 2, 4, "cosine", 0.0),
    (9, 1.0, 0.1, 2, 4, "cosine", 0.1),
    (1, 1.0, 0.2, 0, 3, "cosine", 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 3))),
    (3, 2.0, 0.0, 1, 5, "linear", 1.0),
    (5, 2.0, 0.0, 1, 5, "linear", 0.0),
    (4, 2.0, 0.0, 1, 5, "constant", 2.0),
    (3, 1.0, 0.5, 3, 3, "cosine", 1.0),
]


@pytest.mark.parametrize("step,lr,min_lr,warmup,iters,style,expected", CASES,
                         ids=[f"{c[5]}-s{c[0]}-w{c[3]}-n{c[4]}" for c in CASES])
def test_lr_at_hand_computed(step, lr, min_lr, warmup, iters, style, expected):
    got = lr_at(step, lr=lr, min_lr=min_lr, warmup_iters=warmup, train_iters=iters, decay_style=style)
    assert got == pytest.approx(expected, abs=1e-12)


def test_lr_at_rejects_step_zero():
    with pytest.raises(ValueError, match="1-based"):
        lr_at(0, lr=1.0, min_lr=0.0, warmup_iters=0, train_iters=3)


@settings(max_examples=200, deadline=None)
@given(lr=st.floats(1e-6, 1.0), frac=st.floats(0.0, 1.0), warmup=st.integers(0, 20), iters=st.integers(1, 200),
       style=st.sampled_from(["cosine", "linear"]))
def test_lr_bounded_and_monotone_after_warmup(lr, frac, warmup, iters, style):
    min_lr = lr * frac
    lrs = [lr_at(s, lr=lr, min_lr=min_lr, warmup_iters=warmup, train_iters=iters, decay_style=style)
           for s in range(1, iters + 3)]
    assert all(min(min_lr, lr / max(warmup, 1)) - 1e-12 <= x <= lr * (1 + 1e-12) for x in lrs)
    after = lrs[min(warmup, len(lrs)):]
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))
    past = lr_at(max(iters, warmup) + 1, lr=lr, min_lr=min_lr, warmup_iters=warmup, train_iters=iters,
                 decay_style=style)
    assert past == pytest.approx(min_lr, rel=1e-9, abs=1e-15)


def test_schedule_state_round_trip():
    cfg = Config(train=TrainConfig(lr=1.0, min_lr=0.0, lr_warmup_iters=2, train_iters=4))
    a = LRSchedule(cfg)
    first = [a.next_lr() for _ in range(2)]
    b = LRSchedule(cfg)
    b.load_state_dict(a.state_dict())
    assert first == [0.5, 1.0]
    assert [b.next_lr() for _ in range(2)] == pytest.approx([0.5, 0.0], abs=1e-12)
