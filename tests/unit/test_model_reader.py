"""One reader of a checkpoint's model weights (training/model_reader.py) for train, verify and export:
a checkpoint in the trainer's format read in one process, loaded into a model with its names and shapes
checked, and a folder of another format (an older megatron_pack's) refused by every reader in one line.
(Checkpoints of real training runs are read by the functional tests of train, verify and export:
test_training_run, test_model_verify, test_hf_models.)"""

import json

import pytest
import torch
from _checkpoints import save, world_of_one

from megatron_pack.training.checkpoint_files import OlderCheckpoint, digest, write_manifest
from megatron_pack.training.model_reader import CheckpointModel


@pytest.fixture()
def linear_checkpoint(tmp_path):
    torch.manual_seed(0)
    trained = torch.nn.Linear(3, 2)
    state = {n: p.detach().clone() for n, p in trained.named_parameters()}
    with world_of_one():
        path = save(tmp_path / "ckpt", 5, state, {}, rank_state={}, meta={"tensor_model_parallel_size": 1})
    return path, state


def test_one_reader_serves_verify_and_export(linear_checkpoint):
    from megatron_pack.cli.export import read_model_shards
    from megatron_pack.cli.verify import load_model_weights

    path, state = linear_checkpoint
    reader = CheckpointModel.open(path.parent, "verify.checkpoint")  # the root: its newest intact checkpoint
    assert reader.path == path and reader.peft is None
    (shard,) = reader.shards()
    assert sorted(shard) == ["bias", "weight"] and all(torch.equal(shard[n], state[n]) for n in state)
    assert all(torch.equal(read_model_shards(path)[0][n], state[n]) for n in state)  # export's path
    fresh = torch.nn.Linear(3, 2)
    assert load_model_weights(fresh, path) == path  # verify's path
    assert all(torch.equal(p, state[n]) for n, p in fresh.named_parameters())


@pytest.mark.parametrize("model,match", [
    (torch.nn.Linear(3, 4), r"weight has shape \(2, 3\), the model expects \(4, 3\)"),
    (torch.nn.Sequential(torch.nn.Linear(3, 2)), r"has no 0\.weight: it was written for another model"),
], ids=["other-shape", "other-names"])
def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(linear_checkpoint, model, match):
    path, _ = linear_checkpoint
    with pytest.raises(ValueError, match=match):
        CheckpointModel(path, "verify.checkpoint").load_into(model)


def test_the_trainer_cannot_reshard_the_per_rank_format(linear_checkpoint):
    """A folder whose meta.json has another format (or none) is refused when any reader opens it."""
    from megatron_pack.training.checkpoint import read_full_model

    path, _ = linear_checkpoint
    meta = json.loads((path / "meta.json").read_text())
    assert CheckpointModel(path).meta["format"] == meta["format"]  # not vacuous: the genuine one opens
    del meta["format"]
    (path / "meta.json").write_text(json.dumps(meta))
    write_manifest(path, {f.name: digest(f) for f in path.iterdir() if f.name != "manifest.json"})  # intact
    for read in (lambda: CheckpointModel(path).read_slices({}), lambda: CheckpointModel.open(path, "verify.checkpoint"),
                 lambda: read_full_model(path)):
        with pytest.raises(OlderCheckpoint, match=r"\(.*step_00000005\): its meta.json has format None, not "
                                                  r"'megatron_pack.sharded/1': it was written by an older megatron_pack"):
            read()


def test_export_refuses_an_older_checkpoint_in_one_line(linear_checkpoint, tmp_path, capsys):
    """The user's command: `megatron-pack export checkpoint=<root of an older run>` exits 2 with one line
    naming the folder and the way out, before reading any tensor or writing the output."""
    from megatron_pack.cli.main import main

    path, _ = linear_checkpoint
    meta = json.loads((path / "meta.json").read_text())
    meta["format"] = "megatron_pack.per_tp_rank"
    (path / "meta.json").write_text(json.dumps(meta))
    write_manifest(path, {f.name: digest(f) for f in path.iterdir() if f.name != "manifest.json"})
    assert main(["export", f"checkpoint={path.parent}", f"output={tmp_path / 'hf'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"megatron-pack export: export.checkpoint ({path}): its meta.json has format "
                          "'megatron_pack.per_tp_rank'"), err
    assert "export it with the version that wrote it" in err and "model.pretrained=DIR" in err, err
    assert not (tmp_path / "hf").exists()
