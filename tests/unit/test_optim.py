"""megatron-core's optimizer as the trainer steps it (plain and distributed, world 1): weight-decay groups by
parameter name, steps equal to a float64 AdamW written here, the checkpoint view of its state round-tripping."""

import math

import pytest
import torch

from megatron_pack.config.schema import Config, DDPConfig, ModelConfig, TrainConfig

LR, WD, CLIP = 1e-2, 0.1, 0.5


@pytest.fixture
def world_of_one():
    """megatron-core's groups at world 1 in this process (``initialize_parallel``), torn down afterwards; yields
    a builder of (model chunk in DDP, optimizer)."""
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    enable_cpu_compat_without_cuda()
    model = ModelConfig(attention_backend="torch", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                        num_attention_heads=4, num_query_groups=2, kv_channels=8, seq_length=64,
                        add_qkv_bias=True)
    made = []

    def build(distributed: bool, clip_grad: float = CLIP):
        from megatron_pack.training.chunks import wrap_ddp
        from megatron_pack.model.builder import build_model
        from megatron_pack.training.optim import build_optimizer

        cfg = Config(model=model, ddp=DDPConfig(use_distributed_optimizer=distributed),
                     train=TrainConfig(lr=LR, weight_decay=WD, clip_grad=clip_grad, adam_beta1=0.9, adam_beta2=0.95,
                                       adam_eps=1e-8))
        if not made:
            made.append(initialize_parallel(cfg))
        torch.manual_seed(0)
        ddp = wrap_ddp(cfg, build_model(cfg, made[0]), made[0])
        return ddp, build_optimizer(cfg, [ddp])

    yield build
    destroy_parallel(destroy_process_group=True)


def _decayed(name: str, param: torch.Tensor) -> bool:
    """The rule, written here: matrices decay; biases and every 1-D parameter (norm weights) do not."""
    return param.dim() > 1 and not name.endswith(".bias")


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_weight_decay_groups_by_parameter_name(world_of_one, distributed):
    ddp, optimizer = world_of_one(distributed)
    kinds = {type(o).__name__ for o in optimizer.parts}
    assert kinds == {"DistributedOptimizer" if distributed else "FP32Optimizer"}
    model_params = {p: n for p, n in optimizer.names.items()}
    for p in ddp.parameters():
        p.main_grad.fill_(0.01)
    optimizer.step(LR)
    seen = {}
    for group in optimizer.optimizer.param_groups:
        assert group["weight_decay"] == pytest.approx(WD * group["wd_mult"])
        seen.update({id(p): group["wd_mult"] for p in group["params"]})
    names = {n: p for p, n in model_params.items()}
    biases = [n for n in names if n.endswith(".bias")]
    norms = [n for n in names if "layernorm" in n and n.endswith(".weight")]
    assert biases and norms  # guard: both kinds are there
    if not distributed:  # the plain optimizer steps the model's own parameters
        for name, param in names.items():
            assert seen[id(param)] == (1.0 if _decayed(name, param) else 0.0), name


def _reference_step(params: dict, grads: dict, state: dict, step: int) -> None:
    """float64 AdamW with global-norm clipping and decay groups by name (torch's formulas, written out)."""
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
    scale = min(1.0, CLIP / (norm + 1e-6))
    for name, p in params.items():
        g = grads[name] * scale
        m, v = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        state[name] = (m, v)
        if _decayed(name, p):
            p.mul_(1 - LR * WD)
        m_hat, v_hat = m / (1 - 0.9 ** step), v / (1 - 0.95 ** step)
        p.sub_(LR * m_hat / (v_hat.sqrt() + 1e-8))


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_steps_equal_a_float64_adamw(world_of_one, distributed):
    """Three steps on random main_grad (clipping active): every parameter equals the float64 reference (1e-5),
    and the reported norm is the pre-clip global norm."""
    ddp, optimizer = world_of_one(distributed)
    named = {n: p for p, n in optimizer.names.items()}
    ref = {n: p.detach().double().clone() for n, p in named.items()}
    state = {}
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        grads = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1 for n, p in named.items()}
        for n, p in named.items():
            p.main_grad.copy_(grads[n])
        norm = optimizer.step(LR)
        expected_norm = math.sqrt(sum(float((g.float().double() ** 2).sum()) for g in grads.values()))
        assert norm == pytest.approx(expected_norm, rel=1e-5) and norm > CLIP  # guard: clipping was active
        _reference_step(ref, {n: g.float().double() for n, g in grads.items()}, state, step)
    assert len(named) >= 10
    for n, p in named.items():
        torch.testing.assert_close(p.detach().double(), ref[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_checkpoint_tensors_round_trip(world_of_one, distributed):
    """The checkpoint view (moments by parameter name, the step) loads into a fresh optimizer: its view is the
    same, and the next step moves both models identically, bit for bit."""
    ddp, optimizer = world_of_one(distributed)
    for step in range(2):
        for p in ddp.parameters():
            p.main_grad.copy_(torch.randn_like(p.main_grad))
        optimizer.step(LR)
    saved, step = optimizer.checkpoint_tensors()
    saved = {n: {k: t.clone() for k, t in s.items()} for n, s in saved.items()}
    assert float(step) == 2 and all(set(s) == {"exp_avg", "exp_avg_sq"} for s in saved.values())
    assert all(float(s["exp_avg_sq"].abs().max()) > 0 for s in saved.values())  # guard: moments are set
    other, fresh = world_of_one(distributed)
    with torch.no_grad():
        for a, b in zip(ddp.parameters(), other.parameters()):
            b.copy_(a)
    fresh.load_checkpoint_tensors(saved, step)
    loaded, loaded_step = fresh.checkpoint_tensors()
    assert float(loaded_step) == 2
    for name, tensors in saved.items():
        for key, value in tensors.items():
            assert torch.equal(loaded[name][key], value), (name, key)
    grads = [torch.randn_like(p.main_grad) for p in ddp.parameters()]
    for model, opt in ((ddp, optimizer), (other, fresh)):
        for p, g in zip(model.parameters(), grads):
            p.main_grad.copy_(g)
        opt.step(LR)
    for a, b in zip(ddp.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_missing_optimizer_state_is_refused(world_of_one):
    _, optimizer = world_of_one(False)
    tensors, step = optimizer.checkpoint_tensors()
    name = next(iter(tensors))
    del tensors[name]
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        optimizer.load_checkpoint_tensors(tensors, step)
