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


@pytest.fixture
def world_of_one():
    """megatron-core's groups at world 1 in this process (``initialize_parallel``), torn down afterwards."""
    from megatron_pack.config.schema import DDPConfig, ModelConfig
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    enable_cpu_compat_without_cuda()
    model = ModelConfig(attention_backend="torch", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                        num_attention_heads=4, num_query_groups=2, kv_channels=8, seq_length=64)

    def config(distributed: bool) -> Config:
        return Config(model=model, ddp=DDPConfig(use_distributed_optimizer=distributed),
                      train=TrainConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0))

    state = initialize_parallel(config(False))
    yield config, state
    destroy_parallel(destroy_process_group=True)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_megatron_train_optimizer_builds_and_steps(world_of_one, distributed):
    """The GPU's optimizer object (megatron-core's ``get_megatron_optimizer`` over its DDP) is built with the
    groups ``initialize_parallel`` makes (no gloo copies: megatron-core's default asked for them and stopped at
    "Intra partial data parallel group is not initialized") and takes a step: the gradient norm of a constant
    gradient 0.01 is 0.01 * sqrt(#elements), and Adam's first update moves every element by lr."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_pack.model.builder import build_model
    from megatron_pack.training.optim import MegatronTrainOptimizer

    config, state = world_of_one
    cfg = config(distributed)
    model = build_model(cfg, state)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                                  model, pg_collection=state.pg_collection)
    optimizer = MegatronTrainOptimizer(cfg, [ddp])
    kinds = {type(o).__name__ for o in optimizer.optimizer.chained_optimizers}
    assert kinds == {"DistributedOptimizer" if distributed else "FP32Optimizer"}
    params = list(ddp.parameters())
    for p in params:
        p.main_grad.fill_(0.01)
    before = [p.detach().clone() for p in params]
    norm = optimizer.step(1e-3)
    num_elements = sum(p.numel() for p in params)
    assert num_elements > 1000  # guard: a real model's parameters were stepped
    assert norm == pytest.approx(0.01 * math.sqrt(num_elements), rel=1e-5)  # summed in float32
    for old, p in zip(before, params):
        torch.testing.assert_close(old - p.detach(), torch.full_like(old, 1e-3), rtol=1e-4, atol=1e-7)
