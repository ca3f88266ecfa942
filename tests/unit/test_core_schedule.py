"""The step runs megatron-core's schedules on CPU: ``training.schedule.forward_backward`` over
``get_forward_backward_func`` (through ``model.cpu_compat``), and its small pure helpers.

The numerics through the pipelined schedules (1F1B, interleaved) against the float64 reference are in
``tests/functional/test_pipeline_parallel.py``; here: at world 1, megatron-core's no-pipelining schedule is
what runs, backward on each pack's loss SUM (gradients equal one autograd pass over the summed losses);
``CudaAsCpu`` maps the CUDA device arguments megatron-core makes; the chunk iterators and the forward-only
filler of the interleaved schedule.
"""

import pytest
import torch

from megatron_pack.training.schedule import _repeat_last, chunk_iterators


def test_chunk_iterators_replay_each_pack_to_every_chunk():
    source = iter(["a", "b", "c"])
    first, second = chunk_iterators(source, 2)
    assert [next(first), next(first), next(second), next(first), next(second), next(second)] == list("abacbc")
    with pytest.raises(RuntimeError, match="before chunk 0 read it"):
        next(second)


@pytest.mark.parametrize("items,extra,expected", [
    (["a", "b", "c"], 1, ["a", "b", "c", "c"]),  # 3 validation packs at PP=2: one group of 2 filled
    (["a"], 3, ["a", "a", "a", "a"]),  # 1 pack at PP=4
    (["a", "b"], 0, ["a", "b"]),
], ids=["three_at_pp2", "one_at_pp4", "none_missing"])
def test_repeat_last_fills_the_last_group(items, extra, expected):
    assert list(_repeat_last(iter(items), extra)) == expected


def test_cuda_as_cpu_maps_device_arguments():
    from megatron_pack.model.cpu_compat import CudaAsCpu

    with CudaAsCpu():
        made = [torch.zeros([], dtype=torch.int, device="cuda"), torch.empty(3, device=torch.device("cuda", 0)),
                torch.ones(2).cuda(), torch.ones(2).to("cuda"), torch.ones(2).to(device="cuda:0")]
        name = torch.ones(2).type()
    assert [t.device.type for t in made] == ["cpu"] * len(made)
    assert name == "torch.cuda.FloatTensor"
    assert torch.ones(2).type() == "torch.FloatTensor"  # only inside the mode


@pytest.fixture
def trainer_parts():
    """A 2-layer model at world 1 in this process, wrapped in DDP as the trainer does; torn down afterwards."""
    from megatron_pack.config.schema import Config, ModelConfig
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.chunks import build_model_chunks

    cfg = Config(model=ModelConfig(attention_backend="torch", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                                   num_attention_heads=4, num_query_groups=2, kv_channels=8, seq_length=64))
    state = initialize_parallel(cfg)
    yield cfg, state, build_model_chunks(cfg, state)
    destroy_parallel(destroy_process_group=True)


def _packs():
    from megatron_pack.data.batches.thd import collate_thd

    gen = torch.Generator().manual_seed(0)
    packs = []
    for lengths in ([9, 14], [20], [5, 7, 11]):
        samples = [{"input_ids": torch.randint(3, 300, (n,), generator=gen).tolist(),
                    "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)} for n in lengths]
        packs.append(collate_thd(samples, pack_size=64, pad_multiple=8))
    return packs


def test_megatron_cores_schedule_runs_the_step(trainer_parts, monkeypatch):
    """At world 1 ``forward_backward`` calls megatron-core's ``forward_backward_no_pipelining`` (counted), one
    report per pack, and the gradients are those of one backward over the sum of the packs' loss sums."""
    from megatron.core.pipeline_parallel import schedules

    from megatron_pack.training.schedule import forward_backward
    from megatron_pack.training.step import forward_step

    cfg, state, chunks = trainer_parts
    calls = []
    run = schedules.forward_backward_no_pipelining
    monkeypatch.setattr(schedules, "forward_backward_no_pipelining",
                        lambda **kwargs: calls.append(kwargs["num_microbatches"]) or run(**kwargs))
    packs = _packs()
    chunks[0].zero_grad_buffer()
    reports = forward_backward(forward_step_func=forward_step, data_iterator=iter(packs), model_chunks=chunks,
                               num_microbatches=len(packs), state=state, seq_length=64)
    assert calls == [3] and len(reports) == 3
    got = {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()}
    chunks[0].zero_grad_buffer()
    total = torch.zeros(())
    for batch in packs:  # one plain autograd pass; DDP's hooks add the gradients into main_grad
        output, loss = forward_step(iter([batch]), chunks[0])
        total = total + loss(output)[0]
    total.backward()
    assert sum(float(r["lm loss"][0]) for r in reports) == pytest.approx(float(total), rel=1e-6)
    compared = 0
    for n, p in chunks[0].module.named_parameters():
        torch.testing.assert_close(got[n], p.main_grad, rtol=1e-5, atol=1e-7)
        compared += int(p.main_grad.abs().max() > 0)
    assert compared >= 10  # guard: real gradients were compared
