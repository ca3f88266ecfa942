"""CUDA graphs on a CPU: what can be proved without a GPU (tests/gpu/run.sh captures through the loop on one).

* the step's ``PackedSeqParams`` have one structure (fields, shapes, dtypes, ints) for packs of different contents
  whenever a graph impl is set;
* the loop's capture (``training/cuda_graphs.py``) drives megatron-core's helper at the step it should, and stops a
  run whose graphs were never made;
* ``validate()`` refuses what megatron-core 0.16.1's Transformer Engine graphs cannot capture.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_pack.config import ConfigError, validate
from megatron_pack.config.validate import _validate_cuda_graphs
from megatron_pack.data.batches.thd import collate_thd
from megatron_pack.training import cuda_graphs
from megatron_pack.training.step import step_packed_seq_params
from test_config_validate import make as _make  # the default Config with fields replaced


def _packs(num_cu_seqlens: int = 8) -> list[dict]:
    """Packs of 64 tokens (data.pad_to_max_length) with cu_seqlens fixed at 8 entries (packing.pad_cu_seqlens)."""
    rng = np.random.default_rng(0)
    lengths = [[5, 9, 13], [7, 7], [26, 18, 10, 4], [65]]  # the last pack fills all 64 tokens: no padding at all
    packs = []
    for pack in lengths:
        samples = [{"input_ids": rng.integers(3, 50, size=n - 1).tolist() + [2], "loss_mask": [1] * n} for n in pack]
        packs.append(collate_thd(samples, pack_size=64, pad_multiple=4, pad_to_max_length=True,
                                 num_cu_seqlens=num_cu_seqlens))
    return packs


def _structure(params) -> dict:
    out = {}
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        out[field.name] = (tuple(value.shape), value.dtype) if torch.is_tensor(value) else value
    return out


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_graph_impl_gives_fixed_shape_params_for_any_pack(impl):
    packs = _packs()
    structures = [_structure(step_packed_seq_params(SimpleNamespace(cuda_graph_impl=impl), p)) for p in packs]
    assert all(s == structures[0] for s in structures[1:]), structures
    assert structures[0]["cu_seqlens_q_padded"] == ((8,), torch.int32) and structures[0]["max_seqlen_q"] == 64
    # not vacuous: the packs differ in content, and one of them has no padding at all
    assert len({tuple(p["cu_seqlens"].tolist()) for p in packs}) == len(packs)
    assert torch.equal(packs[-1]["cu_seqlens"], packs[-1]["cu_seqlens_padded"])
    # ... which without a graph impl drops the padded arrays: another structure, which a graph could not replay
    eager = [_structure(step_packed_seq_params(SimpleNamespace(cuda_graph_impl="none"), p)) for p in packs]
    assert eager[-1]["cu_seqlens_q_padded"] is None and eager[0]["cu_seqlens_q_padded"] is not None


def test_forward_step_builds_the_params_through_the_graph_rule():
    import inspect

    from megatron_pack.training import step

    assert "step_packed_seq_params(core.config, batch, device)" in inspect.getsource(step.forward_step)


FIXED = dict(data__pad_to_max_length=True, packing__pad_cu_seqlens=True, model__attention_backend="te")
# (id, overrides, fragments of the refusal; () passes)
VALIDATE_CASES = [
    ("local-whole-layers", dict(FIXED, model__cuda_graph_impl="local"), ()),
    ("te-mlp-bf16", dict(FIXED, model__cuda_graph_impl="transformer_engine", model__cuda_graph_scope=["mlp"],
                         train__bf16=True), ()),
    ("te-whole-layers", dict(FIXED, model__cuda_graph_impl="transformer_engine", train__bf16=True),
     ("model.cuda_graph_scope=[] (whole layers)", "without packed_seq_params", "set model.cuda_graph_scope=[mlp]")),
    ("te-attn", dict(FIXED, model__cuda_graph_impl="transformer_engine", model__cuda_graph_scope=["attn", "mlp"],
                     train__bf16=True), ("model.cuda_graph_scope=['attn', 'mlp']", "model.cuda_graph_impl=local")),
    ("te-mlp-float32", dict(FIXED, model__cuda_graph_impl="transformer_engine", model__cuda_graph_scope=["mlp"]),
     ("train.bf16=false", "set train.bf16=true")),
]


@pytest.mark.parametrize("overrides,fragments", [c[1:] for c in VALIDATE_CASES], ids=[c[0] for c in VALIDATE_CASES])
def test_validate_refuses_what_te_graphs_cannot_capture(overrides, fragments):
    cfg = _make(**overrides)
    problems = _validate_cuda_graphs(cfg)
    if not fragments:
        assert problems == []
        return
    assert problems and all("\n" not in p for p in problems)
    joined = " ".join(problems)
    assert all(f in joined for f in fragments), joined
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert set(problems) <= set(err.value.problems)


class StandInHelper:
    """megatron-core's TECudaGraphHelper as the loop drives it."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.created = kwargs, [], False

    def graphs_created(self):
        return self.created

    def create_cudagraphs(self):
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        self.calls.append(("create", get_num_microbatches()))  # the helper reads it: it must be set
        self.created = True

    def cuda_graph_set_manual_hooks(self):
        self.calls.append(("hooks",))


def _trainer(impl: str, chunks: list, steps: list):
    cfg = SimpleNamespace(model=SimpleNamespace(cuda_graph_impl=impl), packing=SimpleNamespace(packed_sequence_size=64))
    trainer = SimpleNamespace(cfg=cfg, model_chunks=chunks, state=SimpleNamespace(dp_size=2), cuda_graphs=None)
    trainer.compute_gradients = lambda: steps.append(len(steps)) or ("counts", "packs")
    return trainer


@pytest.mark.parametrize("forward_hooks", [False, True], ids=["plain-ddp", "ddp-forward-hooks"])
def test_te_graphs_are_captured_after_the_warmup_steps(monkeypatch, forward_hooks):
    from megatron.core import num_microbatches_calculator as calc

    chunk = SimpleNamespace(use_forward_hook=forward_hooks)
    config = SimpleNamespace(cuda_graph_warmup_steps=2)
    monkeypatch.setattr(cuda_graphs.CudaGraphs, "for_trainer", classmethod(
        lambda cls, cfg, chunks, dp: cls("transformer_engine", chunks, config, seq_length=64, dp_size=dp,
                                         make_helper=StandInHelper)))
    steps: list = []
    trainer = _trainer("transformer_engine", [chunk], steps)
    for _ in range(2):
        assert cuda_graphs.compute_with_graphs(trainer) == ("counts", "packs")
        assert trainer.cuda_graphs.helper.calls == []  # eager warm-up steps
    cuda_graphs.compute_with_graphs(trainer)
    helper = trainer.cuda_graphs.helper
    assert helper.calls == [("create", 1)] + ([("hooks",)] if forward_hooks else [])
    assert helper.kwargs == dict(model=[chunk], config=config, seq_length=64, micro_batch_size=1, optimizers=[])
    cuda_graphs.compute_with_graphs(trainer)
    assert len(helper.calls) == 1 + forward_hooks and steps == [0, 1, 2, 3]  # captured once, every step ran
    assert calc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None  # what the capture set for itself is gone again


def test_a_graph_impl_that_captured_nothing_stops_the_run(monkeypatch):
    from megatron.core.transformer import cuda_graphs as mcore_graphs

    monkeypatch.setattr(cuda_graphs.CudaGraphs, "for_trainer", classmethod(
        lambda cls, cfg, chunks, dp: cls("local", chunks, SimpleNamespace(), seq_length=64, dp_size=dp)))
    monkeypatch.setattr(mcore_graphs._CudagraphGlobalRecord, "cudagraph_created", False)
    trainer = _trainer("local", [object()], [])
    with pytest.raises(RuntimeError, match=r"model.cuda_graph_impl \(local\) captured no CUDA graph by step 1"):
        cuda_graphs.compute_with_graphs(trainer)
    monkeypatch.setattr(mcore_graphs._CudagraphGlobalRecord, "cudagraph_created", True)  # megatron-core's schedule made them
    trainer = _trainer("local", [object()], [])
    assert cuda_graphs.compute_with_graphs(trainer) == ("counts", "packs")


def test_no_graph_impl_runs_the_step_alone():
    steps: list = []
    trainer = _trainer("none", [object()], steps)
    assert cuda_graphs.compute_with_graphs(trainer) == ("counts", "packs") and trainer.cuda_graphs is None
    assert steps == [0]
