"""One reader of a checkpoint's model weights (training/model_reader.py) for train, verify and export:
the per-TP-rank format read in one process, loaded into a model with its names and shapes checked,
and refused by the trainer's resharding read with the reason. (The layout-free format is read by the
functional tests of train, verify and export: test_training_run, test_model_verify, test_hf_models.)"""

import pytest
import torch

from megatron_pack.training.checkpoint import save_checkpoint
from megatron_pack.training.model_reader import CheckpointModel


@pytest.fixture()
def linear_checkpoint(tmp_path):
    torch.manual_seed(0)
    trained = torch.nn.Linear(3, 2)
    state = {n: p.detach().clone() for n, p in trained.named_parameters()}
    path = save_checkpoint(tmp_path / "ckpt", 5, model_state=state, optim_state={}, rank_state={},
                           meta={"tensor_model_parallel_size": 1})
    return path, state


def test_one_reader_serves_verify_and_export(linear_checkpoint):
    from megatron_pack.cli.export import read_model_shards
    from megatron_pack.cli.verify import load_model_weights

    path, state = linear_checkpoint
    reader = CheckpointModel.open(path.parent, "verify.checkpoint")  # the root: its newest intact checkpoint
    assert reader.path == path and not reader.layout_free and reader.peft is None
    (shard,) = reader.shards()
    assert sorted(shard) == ["bias", "weight"] and all(torch.equal(shard[n], state[n]) for n in state)
    assert all(torch.equal(read_model_shards(path)[0][n], state[n]) for n in state)  # export's path
    fresh = torch.nn.Linear(3, 2)
    assert load_model_weights(fresh, path) == path  # verify's path
    assert all(torch.equal(p, state[n]) for n, p in fresh.named_parameters())


@pytest.mark.parametrize("model,match", [
    (torch.nn.Linear(3, 4), r"weight has shape \(2, 3\), the model expects \(4, 3\)"),
    (torch.nn.Sequential(torch.nn.Linear(3, 2)), r"has no model/tp0/0\.weight: it was written for another model"),
], ids=["other-shape", "other-names"])
def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(linear_checkpoint, model, match):
    path, _ = linear_checkpoint
    with pytest.raises(ValueError, match=match):
        CheckpointModel(path, "verify.checkpoint").load_into(model)


def test_the_trainer_cannot_reshard_the_per_rank_format(linear_checkpoint):
    path, _ = linear_checkpoint
    with pytest.raises(ValueError, match="older per-tensor-parallel-rank format"):
        CheckpointModel(path).read_slices({})
