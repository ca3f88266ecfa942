"""get_packed_seq_params: real vs padded cu_seqlens, ints for max_seqlen, no device reads."""

from __future__ import annotations

import pytest
import torch

from megatron_pack.training.step import get_packed_seq_params


def _batch(real, padded, max_seqlen, num_pad_tokens=None):
    batch = {"cu_seqlens": torch.tensor(real, dtype=torch.int32),
             "cu_seqlens_padded": torch.tensor(padded, dtype=torch.int32), "max_seqlen": max_seqlen}
    if num_pad_tokens is not None:
        batch["num_pad_tokens"] = num_pad_tokens
    return batch


PSP_CASES = [
    ("padded-6-token-example", _batch([0, 2, 4], [0, 4, 8], 4, 4), [0, 4, 8]),
    ("unpadded", _batch([0, 3, 8], [0, 3, 8], 5, 0), None),
    ("unpadded-no-count", _batch([0, 3, 8], [0, 3, 8], 5), None),
    ("padded-no-count", _batch([0, 3, 8], [0, 4, 12], 8), [0, 4, 12]),
    ("fixed-length-tail", _batch([0, 3, 8, 8, 8], [0, 4, 12, 16, 16], 16, 8), [0, 4, 12, 16, 16]),
]


@pytest.mark.parametrize("batch,expected_padded", [c[1:] for c in PSP_CASES], ids=[c[0] for c in PSP_CASES])
def test_packed_seq_params_table(batch, expected_padded):
    params = get_packed_seq_params(batch)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == batch["cu_seqlens"].tolist()
    assert params.cu_seqlens_kv.dtype == torch.int32 and params.cu_seqlens_q.dtype == torch.int32
    if expected_padded is None:
        assert params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None
    else:
        assert params.cu_seqlens_q_padded.tolist() == expected_padded
        assert params.cu_seqlens_kv_padded.tolist() == expected_padded
    assert type(params.max_seqlen_q) is int and params.max_seqlen_q == params.max_seqlen_kv == batch["max_seqlen"]


def test_force_padded_keeps_arguments_fixed_for_cuda_graphs():
    params = get_packed_seq_params(_batch([0, 4, 8], [0, 4, 8], 4, 0), force_padded=True)
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 8]


def test_device_tensors_without_count_are_refused():
    batch = _batch([0, 3], [0, 4], 4)
    batch["cu_seqlens"] = batch["cu_seqlens"].to("meta")
    with pytest.raises(ValueError, match="num_pad_tokens"):
        get_packed_seq_params(batch)
