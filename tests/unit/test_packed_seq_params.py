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


@pytest.mark.parametrize("padded", [[0, 4, 8], [0, 2, 4]], ids=["padded", "unpadded"])
def test_params_move_to_an_accelerator_in_the_one_place_they_are_built(padded):
    """``device=`` moves the cu_seqlens (the meta device stands in for a GPU: not cpu, no data); a CPU
    device keeps the batch's own tensors. forward_step and both verify paths call it this way."""
    batch = _batch([0, 2, 4], padded, 4)
    moved = get_packed_seq_params(batch, device=torch.device("meta"))
    kept = get_packed_seq_params(batch, device=torch.device("cpu"))
    assert moved.cu_seqlens_q.device.type == "meta" and moved.cu_seqlens_kv.device.type == "meta"
    assert (moved.cu_seqlens_q_padded is None) == (padded == [0, 2, 4])
    if moved.cu_seqlens_q_padded is not None:
        assert moved.cu_seqlens_q_padded.device.type == moved.cu_seqlens_kv_padded.device.type == "meta"
    assert type(moved.max_seqlen_q) is int and moved.max_seqlen_q == 4
    assert kept.cu_seqlens_q is batch["cu_seqlens"] and batch["cu_seqlens"].device.type == "cpu"


def test_device_tensors_without_count_are_refused():
    batch = _batch([0, 3], [0, 4], 4)
    batch["cu_seqlens"] = batch["cu_seqlens"].to("meta")
    with pytest.raises(ValueError, match="num_pad_tokens"):
        get_packed_seq_params(batch)


# issue 11 item 11: a DataLoader's batch dimension is squeezed; shapes that are not one row are
# refused naming the key (was a bare torch error)
SQUEEZED = [
    ("cu-1xN", {"cu_seqlens": torch.tensor([[0, 2, 4]]), "cu_seqlens_padded": torch.tensor([[0, 4, 8]]),
                "max_seqlen": 4}),
    ("max-seqlen-tensor-1", {"cu_seqlens": torch.tensor([0, 2, 4]), "cu_seqlens_padded": torch.tensor([0, 4, 8]),
                             "max_seqlen": torch.tensor([4])}),
    ("max-seqlen-0d", {"cu_seqlens": [0, 2, 4], "cu_seqlens_padded": [0, 4, 8], "max_seqlen": torch.tensor(4)}),
]


@pytest.mark.parametrize("batch", [c[1] for c in SQUEEZED], ids=[c[0] for c in SQUEEZED])
def test_batch_dimension_of_one_is_squeezed(batch):
    params = get_packed_seq_params(batch)
    assert params.cu_seqlens_q.tolist() == [0, 2, 4] and params.cu_seqlens_q_padded.tolist() == [0, 4, 8]
    assert params.cu_seqlens_q.dtype == torch.int32
    assert type(params.max_seqlen_q) is int and params.max_seqlen_q == 4


REFUSED = [
    ("max-seqlen-per-row", {"cu_seqlens": torch.tensor([0, 2, 4]), "cu_seqlens_padded": torch.tensor([0, 4, 8]),
                            "max_seqlen": torch.tensor([4, 4])}, "batch['max_seqlen'] has shape [2]"),
    ("cu-2xN", {"cu_seqlens": torch.tensor([[0, 2, 4], [0, 1, 2]]), "cu_seqlens_padded": torch.tensor([0, 4, 8]),
                "max_seqlen": 4}, "batch['cu_seqlens'] has shape [2, 3]"),
    ("cu-padded-2xN", {"cu_seqlens": torch.tensor([0, 2, 4]), "cu_seqlens_padded": torch.tensor([[0, 4, 8], [0, 4, 8]]),
                       "max_seqlen": 4}, "batch['cu_seqlens_padded'] has shape [2, 3]"),
    ("cu-scalar", {"cu_seqlens": torch.tensor(4), "cu_seqlens_padded": torch.tensor([0, 4]), "max_seqlen": 4},
     "batch['cu_seqlens'] has shape []"),
    ("length-mismatch", {"cu_seqlens": torch.tensor([0, 2]), "cu_seqlens_padded": torch.tensor([0, 4, 8]),
                         "max_seqlen": 4}, "has 2 entries but batch['cu_seqlens_padded'] has 3"),
]


@pytest.mark.parametrize("batch,message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_not_one_row_is_refused_naming_the_key(batch, message):
    with pytest.raises(ValueError) as info:
        get_packed_seq_params(batch)
    assert message in str(info.value)
