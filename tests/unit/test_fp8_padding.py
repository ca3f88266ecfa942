"""model.fp8's padding rule on the model: padded rows are exactly 0 at every GEMM input, forward and backward.

The FP8 GEMMs themselves need Transformer Engine and a GPU (tests/gpu/run.sh checks the amax
history there); what makes padding invisible to their statistics is model-side and runs here on
the same GPTModel class with the torch layers: ``model.fp8.zero_padding_rows`` installed by hand
(``build_model`` installs it when ``model.fp8`` is set, which CPU runs refuse).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_pack.config.layout import pack_multiple
from megatron_pack.config.schema import Config, ConfigError, ModelConfig
from megatron_pack.data.batches.thd import collate_thd
from megatron_pack.model import builder
from megatron_pack.model.fp8 import MCORE_FP8, fp8_config_kwargs, zero_padding_rows
from megatron_pack.parallel.cp import thd_partition_indices, thd_real_token_mask
from megatron_pack.training.step import get_packed_seq_params

torch.use_deterministic_algorithms(True)

# (cu_seqlens, cu_seqlens_padded) with alignment padding, a tail and a zero-length fixed-shape fill
PACKS = [([0, 3, 5], [0, 4, 8]), ([0, 5, 6, 6], [0, 8, 16, 32]), ([0, 7, 7, 7], [0, 8, 64, 64]),
         ([0, 16, 17], [0, 16, 32])]


# every pack at every CP whose 2*CP chunks its padded lengths allow (the collate makes no others)
MASK_CASES = [(cp, cu, cu_pad) for cp in (1, 2, 4, 8) for cu, cu_pad in PACKS
              if cp == 1 or not any((b - a) % (2 * cp) for a, b in zip(cu_pad, cu_pad[1:]))]


@pytest.mark.parametrize("cp,cu,cu_pad", MASK_CASES, ids=[f"cp{c}-{p[-1]}" for c, _, p in MASK_CASES])
def test_real_token_mask_is_the_slice_of_the_global_mask(cp, cu, cu_pad):
    """The device mask of each CP rank's rows == the global real/padded mask cut by thd_partition_indices."""
    real = torch.zeros(cu_pad[-1], dtype=torch.bool)
    for i in range(len(cu) - 1):
        real[cu_pad[i]:cu_pad[i] + cu[i + 1] - cu[i]] = True
    assert bool(real.any()) and not bool(real.all())  # both kinds of rows are present
    for rank in range(cp):
        index = thd_partition_indices(torch.tensor(cu_pad), cp, rank)
        got = thd_real_token_mask(torch.tensor(cu), torch.tensor(cu_pad), index.numel(), cp, rank)
        assert torch.equal(got, real[index]), (cp, rank)


def test_mask_cases_reach_cp8():
    assert {c for c, _, _ in MASK_CASES} == {1, 2, 4, 8} and len(MASK_CASES) >= 10


def test_real_token_mask_worked_example_and_unpadded_pack():
    cu, cu_pad = torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8])
    assert thd_real_token_mask(cu, cu_pad, 8, 1, 0).tolist() == [True] * 3 + [False] + [True] * 2 + [False] * 2
    assert thd_real_token_mask(cu, cu_pad, 4, 2, 0).tolist() == [True, False, True, False]
    assert thd_real_token_mask(cu, None, 5, 1, 0).all()


@pytest.fixture
def world_of_one():
    from megatron_pack.parallel.groups import destroy_parallel

    yield
    destroy_parallel(destroy_process_group=True)


def _linears(model):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [(n, m) for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
            and n != "output_layer"]


def _run(model, batch, watch: bool):
    """Loss sum and, with ``watch``, each linear's max |input| and max |output grad| over padded rows."""
    from megatron_pack.training.step import loss_func

    padded = ~thd_real_token_mask(batch["cu_seqlens"], batch["cu_seqlens_padded"], batch["tokens"].shape[1], 1, 0)
    seen: dict[str, list[float]] = {}
    handles = []
    if watch:
        for name, module in _linears(model):
            def fwd(mod, args, name=name):
                seen.setdefault(name, []).append(float(args[0].reshape(padded.numel(), -1)[padded].abs().max()))

            def bwd(mod, grad_in, grad_out, name=name):
                seen.setdefault(name + ".grad", []).append(
                    float(grad_out[0].reshape(padded.numel(), -1)[padded].abs().max()))
            handles += [module.register_forward_pre_hook(fwd), module.register_full_backward_hook(bwd)]
    model.zero_grad(set_to_none=True)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=get_packed_seq_params(batch))
    loss, _, _ = loss_func(batch["loss_mask"], losses)
    loss.backward()
    for h in handles:
        h.remove()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, seen


def test_padded_rows_stay_zero_at_every_linear_and_loss_is_unchanged(world_of_one):
    from megatron_pack.parallel.groups import initialize_parallel

    cfg = Config(model=ModelConfig(attention_backend="torch"))
    state = initialize_parallel(cfg)
    plain = builder.build_model(cfg, state)
    zeroed = builder.build_model(cfg, state)
    zero_padding_rows(zeroed, cp_size=1, cp_rank=0)
    samples = [{"input_ids": list(range(3, 3 + n)) + [2], "loss_mask": [0] * 3 + [1] * (n - 2)} for n in (8, 5, 11)]
    batch = collate_thd(samples, pack_size=64, pad_multiple=4, pack_multiple=pack_multiple(1, 1, False, "delayed"))
    # rows 8, 5, 11 padded to 8, 8, 12 (28) and a tail of 4 to the pack multiple 16
    assert batch["cu_seqlens_padded"].tolist() == [0, 8, 16, 28, 32] and batch["num_pad_tokens"] == 8

    loss_plain, grads_plain, seen_plain = _run(plain, batch, watch=True)
    loss_zero, grads_zero, seen = _run(zeroed, batch, watch=True)
    assert len(seen) == 2 * len(_linears(zeroed)) == 16  # every linear's input and output gradient was watched
    assert all(v == [0.0] for v in seen.values()), seen
    assert max(max(v) for v in seen_plain.values()) > 0  # without the hooks the padded rows are not zero
    assert torch.equal(loss_plain, loss_zero)
    for a, b in zip(grads_plain, grads_zero):  # padded rows never reached a real token or the loss
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


@pytest.mark.parametrize("recipe", sorted(MCORE_FP8))
def test_fp8_config_kwargs_are_megatron_core_names(recipe):
    from megatron.core.enums import Fp8Recipe

    fmt, name = MCORE_FP8[recipe]
    assert fp8_config_kwargs(recipe) == {"fp8": fmt, "fp8_recipe": name}
    assert name in {r.value for r in Fp8Recipe} and fmt in ("e4m3", "hybrid")
    assert fp8_config_kwargs("none") == {}


def test_transformer_config_carries_the_recipe_only_on_te(monkeypatch):
    """On the te backend TransformerConfig gets fp8/fp8_recipe (its fused RoPE needs TE to build, so the
    kwargs are recorded here); the torch layers get none and a real TransformerConfig has fp8 None."""
    from megatron.core.transformer import transformer_config

    cfg = Config(model=ModelConfig(fp8="current"))
    assert builder.transformer_config_from(cfg, backend="torch").fp8 is None
    seen = {}
    monkeypatch.setattr(transformer_config, "TransformerConfig", lambda **kwargs: seen.update(kwargs) or SimpleNamespace())
    builder.transformer_config_from(cfg, backend="te")
    assert (seen["fp8"], seen["fp8_recipe"]) == ("hybrid", "tensorwise")


def test_fp8_on_the_torch_layers_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(builder, "te_import_error", lambda: "ImportError: no transformer_engine")
    with pytest.raises(ConfigError) as info:
        builder._check_fp8(Config(model=ModelConfig(fp8="mxfp8")), "torch")
    (line,) = info.value.problems
    assert "model.fp8 (mxfp8) needs Transformer Engine's FP8 linear layers" in line and "set model.fp8=none" in line
    assert "ImportError: no transformer_engine" in line and "\n" not in line
    builder._check_fp8(Config(), "torch")  # none: nothing to refuse
