"""loss_func and check_finite: sum/count contract, masked inf/NaN never leak, CP shards add up."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_pack.parallel.cp import slice_thd_batch
from megatron_pack.training.step import check_finite, loss_func

INF, NAN = math.inf, math.nan
LOSS_CASES = [
    ("all-counted", [1.0, 2.0, 3.0, 4.0], [1, 1, 1, 1], 10.0, 4),
    ("prompt-masked", [1.0, 2.0, 3.0, 4.0], [0, 0, 1, 1], 7.0, 2),
    ("inf-on-masked", [1.0, 2.0, INF, 4.0], [1, 1, 0, 0], 3.0, 2),
    ("nan-on-masked", [NAN, 2.0, 5.0, NAN], [0, 1, 1, 0], 7.0, 2),
    ("all-masked-with-inf", [INF, NAN, -INF, 1.0], [0, 0, 0, 0], 0.0, 0),
    ("float-mask", [1.5, 2.5], [1.0, 1.0], 4.0, 2),
]


@pytest.mark.parametrize("losses,mask,expected_sum,expected_count", [c[1:] for c in LOSS_CASES],
                         ids=[c[0] for c in LOSS_CASES])
def test_loss_func_table(losses, mask, expected_sum, expected_count):
    output = torch.tensor([losses], requires_grad=True)
    loss_sum, num_tokens, report = loss_func(torch.tensor([mask], dtype=torch.float32), output)
    assert loss_sum.dtype == torch.float32 and loss_sum.dim() == 0
    assert float(loss_sum) == expected_sum
    assert num_tokens.dtype == torch.int32 and int(num_tokens) == expected_count
    assert report["lm loss"].tolist() == [expected_sum, float(expected_count)]
    assert not report["lm loss"].requires_grad
    loss_sum.backward()
    assert torch.isfinite(output.grad).all()
    assert output.grad.tolist() == [[float(m != 0) for m in mask]]


def test_num_tokens_adds_into_megatron_int_counter():
    total = torch.zeros([], dtype=torch.int)  # what megatron-core's schedules accumulate into
    for mask in ([1, 0, 1], [1, 1, 1]):
        _, num_tokens, _ = loss_func(torch.tensor([mask], dtype=torch.float32), torch.ones(1, 3))
        total += num_tokens
    assert int(total) == 5


def test_loss_sums_over_cp_shards_equal_the_whole_pack():
    torch.manual_seed(0)
    num_tokens = 24
    batch = {
        "tokens": torch.zeros(1, num_tokens, dtype=torch.int64), "loss_mask": (torch.rand(1, num_tokens) > 0.4).float(),
        "cu_seqlens_padded": torch.tensor([0, 8, 24], dtype=torch.int32),
    }
    batch["labels"] = torch.rand(1, num_tokens)  # stands in for the per-token losses, sliced identically
    whole_sum, whole_count, _ = loss_func(batch["loss_mask"], batch["labels"])
    assert int(whole_count) > 0
    shards = [slice_thd_batch(batch, 2, r) for r in range(2)]
    parts = [loss_func(s["loss_mask"], s["labels"]) for s in shards]
    assert sum(int(p[1]) for p in parts) == int(whole_count)
    assert abs(sum(float(p[0]) for p in parts) - float(whole_sum)) < 1e-5


def test_loss_func_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="slice loss_mask with the same CP slice"):
        loss_func(torch.ones(1, 4), torch.ones(1, 8))


def test_check_finite_names_the_sample_ids():
    batch = {"sample_ids": torch.tensor([17, 4, 99]), "num_target_tokens": 12}
    check_finite(torch.tensor(3.5), batch)
    for bad in (INF, NAN):
        with pytest.raises(FloatingPointError, match=r"sample_ids \[17, 4, 99\].*12 target tokens"):
            check_finite(torch.tensor(bad), batch)
