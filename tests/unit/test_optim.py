"""AdamW over main_grad, TP-aware gradient norm, clipping, named optimizer state."""

import math

import pytest
import torch

from megatron_pack.config.schema import Config, TrainConfig
from megatron_pack.training.optim import build_optimizer, clip_grads_, grad_norm, param_groups


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))


def test_param_groups_split_decay():
    groups = param_groups(_model().named_parameters(), 0.1)
    assert groups[0]["names"] == ["0.weight", "2.weight"] and groups[0]["weight_decay"] == 0.1
    assert groups[1]["names"] == ["0.bias", "1.weight", "1.bias"] and groups[1]["weight_decay"] == 0.0


NORM_CASES = [
    ("3-4-5", [[3.0], [4.0]], 5.0),
    ("zeros", [[0.0, 0.0]], 0.0),
    ("ones", [[1.0] * 4, [1.0] * 5], 3.0),
]


@pytest.mark.parametrize("grads,expected", [c[1:] for c in NORM_CASES], ids=[c[0] for c in NORM_CASES])
def test_grad_norm_hand_computed(grads, expected):
    params = [torch.nn.Parameter(torch.zeros(len(g))) for g in grads]
    for p, g in zip(params, grads):
        p.grad = torch.tensor(g)
    assert grad_norm(params) == pytest.approx(expected)


def test_grad_norm_skips_shared_params():
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    p.grad, q.grad = torch.tensor([3.0]), torch.tensor([4.0])
    q.shared = True
    assert grad_norm([p, q]) == pytest.approx(3.0)


def test_clip_scales_to_max_norm_only_above():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grads_([p], 10.0, 5.0) == 1.0 and torch.equal(p.grad, torch.tensor([3.0, 4.0]))
    clip_grads_([p], 1.0, 5.0)
    assert grad_norm([p]) == pytest.approx(1.0, rel=1e-5)


def test_step_matches_plain_adamw_and_clears_grad():
    cfg = Config(train=TrainConfig(lr=0.1, min_lr=0.0, weight_decay=0.0, clip_grad=0.0))
    model, ref = _model(), _model()
    opt = build_optimizer(cfg, list(model.named_parameters()))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    x = torch.randn(5, 4)
    for _ in range(3):
        model(x).pow(2).sum().backward()
        for p in model.parameters():  # what megatron-core DDP does: grads land in main_grad
            p.main_grad, p.grad = p.grad, None
        norm = opt.step(0.1)
        assert math.isfinite(norm) and norm > 0
        assert all(p.grad is None for p in model.parameters())
        ref_opt.zero_grad()
        ref(x).pow(2).sum().backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_named_state_round_trip():
    cfg = Config(train=TrainConfig(lr=0.1, min_lr=0.0))
    model = _model()
    opt = build_optimizer(cfg, list(model.named_parameters()))
    model(torch.randn(2, 4)).sum().backward()
    for p in model.parameters():
        p.main_grad, p.grad = p.grad, None
    opt.step(0.1)
    state = {k: v.clone() for k, v in opt.named_state().items()}
    assert set(state) >= {"0.weight.exp_avg", "0.weight.exp_avg_sq", "0.weight.step"}
    fresh = build_optimizer(cfg, list(_model().named_parameters()))
    fresh.load_named_state(state)
    for k, v in fresh.named_state().items():
        assert torch.equal(v, state[k]), k
    with pytest.raises(KeyError, match="missing"):
        fresh.load_named_state({})
