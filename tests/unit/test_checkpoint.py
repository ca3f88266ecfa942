"""Atomic DCP checkpoints in one process: round trip, RNG, crash mid-save, pruning, layout check.

Checkpoints here are what the trainer writes (``_checkpoints``: plain tensors through ``save_checkpoint``'s
sharded state and the trainer's reader, in a world of one)."""

import random

import numpy as np
import pytest
import torch
from _checkpoints import load, save, world_of_one

from megatron_pack.training import checkpoint as ckpt
from megatron_pack.training.checkpoint_files import find_latest
from megatron_pack.training.resume import layout_meta

META = layout_meta(world_size=1, tp=1, cp=1, dp=1)


@pytest.fixture(autouse=True)
def world():
    with world_of_one():
        yield


def _states(seed):
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
    optim = {"exp_avg.w": torch.randn(3, 4, generator=g), "step": torch.tensor(float(seed))}
    return model, optim


def _save(root, step, seed, keep_last=2):
    model, optim = _states(seed)
    return save(root, step, model, optim, rank_state={"sampler": {"num_consumed": step}, "rng": ckpt.rng_state()},
                meta=META, keep_last=keep_last)


def test_round_trip_in_place(tmp_path):
    path = _save(tmp_path, 3, seed=1)
    assert path.name == "step_00000003" and find_latest(tmp_path) == path
    model, optim = load(path, *_states(seed=2))
    rank_state = ckpt.read_rank_state(path)
    ref_model, ref_optim = _states(seed=1)
    assert any(not torch.equal(a, b) for a, b in zip(_states(seed=2)[0].values(), ref_model.values()))  # not vacuous
    for got, ref in ((model, ref_model), (optim, ref_optim)):
        for k in ref:
            assert torch.equal(got[k], ref[k]), k
    assert rank_state["sampler"] == {"num_consumed": 3}


def test_rng_round_trip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = ckpt.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.set_rng_state(state)
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_rng_round_trip_includes_megatron_named_streams(tmp_path):
    """Dropout inside TP regions (LoRA's row-parallel adapters, attention dropout) draws from
    megatron's tracker streams; a resumed run must continue them, not restart them from the seed."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda

    enable_cpu_compat_without_cuda()
    model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        torch.rand(3)  # advance the stream past its seed
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    with tracker.fork():
        want = torch.rand(4)
    model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)  # a fresh process re-seeds
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    with tracker.fork():
        got = torch.rand(4)
    assert torch.equal(got, want)


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    good = _save(tmp_path, 2, seed=1)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing shards")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _save(tmp_path, 4, seed=2)
    assert (tmp_path / "tmp.step_00000004").exists()
    assert find_latest(tmp_path) == good
    monkeypatch.undo()
    _save(tmp_path, 4, seed=2)
    assert not list(tmp_path.glob("tmp.*")) and find_latest(tmp_path).name == "step_00000004"


def test_missing_latest_pointer_falls_back_to_newest_complete(tmp_path):
    _save(tmp_path, 1, seed=1)
    _save(tmp_path, 2, seed=1)
    (tmp_path / "latest").unlink()
    (tmp_path / "step_00000009").mkdir()  # incomplete: no meta.json
    assert find_latest(tmp_path).name == "step_00000002"
    assert find_latest(tmp_path / "nothing") is None


def test_keep_last_prunes_old(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, seed=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]


def test_another_layout_resumes_on_every_device(tmp_path):
    """One format on every device (weights and megatron-core's optimizer state by global identity): a checkpoint
    written at TP=1 resumes at TP=2, with train.device=cuda as with cpu (it used to be refused on a GPU)."""
    from megatron_pack.config import load_config
    from megatron_pack.training.resume import check_resume

    path = _save(tmp_path / "ckpt", 1, seed=1)
    for device in ("cpu", "cuda"):
        cfg = load_config([f"train.output_dir={tmp_path}/run", "parallel.tensor_model_parallel_size=2",
                           f"checkpoint.load={path.parent}", f"train.device={device}"])
        assert check_resume(cfg, 2) == path


class _FP8Linear(torch.nn.Module):
    """Stands in for a Transformer Engine layer: its FP8 metadata (amax history, scale) is extra state."""

    def __init__(self, history=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))
        self.amax_history = torch.zeros(4) if history is None else history

    def get_extra_state(self):
        return self.amax_history.clone()

    def set_extra_state(self, state):
        self.amax_history = state.clone()


class _Chunk(torch.nn.Module):
    def __init__(self, history=None):
        super().__init__()
        self.decoder = torch.nn.ModuleList([_FP8Linear(history), torch.nn.Linear(2, 2)])


@pytest.mark.parametrize("num_chunks", [1, 2], ids=["one-chunk", "virtual-stages"])
def test_extra_state_kept_in_the_rank_file_and_restored(tmp_path, num_chunks):
    """An FP8 run's scaling history survives a resume: it is in the state the checkpoint writes, read back with
    weights_only, and set on the fresh model's modules (the plain Linear has none and is left alone)."""
    from megatron_pack.training.trainer_checkpoint import module_extra_states, restore_extra_states

    trained = [_Chunk(torch.tensor([3.0, 1.5, 0.25, 8.0]) * (v + 1)) for v in range(num_chunks)]
    states = module_extra_states(trained)
    prefix = [""] if num_chunks == 1 else ["chunk0.", "chunk1."]
    assert sorted(states) == [f"{p}decoder.0" for p in prefix]
    path = save(tmp_path, 1, *_states(1), meta=META, rank_state={"rng": ckpt.rng_state(), "extra_state": states})
    fresh = [_Chunk() for _ in range(num_chunks)]
    assert all(float(c.decoder[0].amax_history.abs().sum()) == 0 for c in fresh)  # not vacuous: it starts over
    assert restore_extra_states(fresh, ckpt.read_rank_state(path)["extra_state"]) == num_chunks
    for v, chunk in enumerate(fresh):
        assert torch.equal(chunk.decoder[0].amax_history, torch.tensor([3.0, 1.5, 0.25, 8.0]) * (v + 1))

