"""Pipeline stages on 4 gloo ranks: the 1F1B schedule gives the float64 reference's loss and gradients.

One spawned world of 4 CPU processes runs every pipeline layout in ``CASES`` in turn (megatron-core's
groups rebuilt between them). Each case builds the stage's GPTModel chunk, runs one step of the
CPU 1F1B schedule (``training.pipeline_schedule``) over this DP rank's packs and megatron-core's
``finalize_model_grads``, and compares with ``tests/_float64_gpt.py`` (plain torch, float64, each
sample alone) evaluated on the weights the stages hold (gathered from every stage and TP rank):

1. the global per-token loss and every parameter gradient, relative <= 1e-5;
2. the step outcome (loss, target count) is the same on every rank of the world;
3. the validation loss (forward only through the stages) equals the reference on every rank;
4. the shape exchange runs for variable packs and is skipped with fixed shapes;
5. the Megatron-Bridge #2952 trap: the activation a middle stage sends on for a pack equals, row
   for row, the activation of each of its samples run alone (and a model that attends across
   the pack's boundaries, ``pack_causal``, does not pass: the check can fail).

The packs include a micro-batch without target tokens and a sample that leaves CP rank 1 with
padding only; DP ranks run unequal numbers of micro-batches (5 packs over 2 DP ranks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import spawn_world
from _float64_gpt import Shape, sample_loss, to_float64
from _packs import random_packs

WORLD_SIZE = 4
PAD_MULTIPLE = 8
PACK_SIZE = 96
CASES = [  # (id, pp, tp, cp, sequence_parallel, num_layers, fixed shapes, tied embeddings); dp = 4 / (pp*tp*cp)
    ("pp2_fixed_tied", 2, 1, 1, False, 2, True, True),
    ("pp2_cp2_recompute", 2, 1, 2, False, 2, False, False),
    ("pp2_tp2_sp", 2, 2, 1, True, 2, False, False),
    ("pp4", 4, 1, 1, False, 4, False, False),
]
CASE_IDS = [c[0] for c in CASES]
NUM_PACKS = 5
NO_TARGET_PACK = 2


def _samples(seed: int = 11) -> list[list[dict]]:
    """NUM_PACKS packs of 2-4 samples; pack NO_TARGET_PACK has no target token, the last pack holds a
    2-token sample that leaves CP rank 1 of 2 with padding only (its 8 padded slots: rank 1 keeps 2..5)."""
    packs = random_packs(seed, NUM_PACKS, samples=(2, 5), length=(4, 20), no_target=(NO_TARGET_PACK,))
    packs[-1] = [{"input_ids": [5, 9, 2], "loss_mask": [0, 1, 1]}]
    return packs


def _config(pp: int, tp: int, cp: int, sp: bool, num_layers: int, fixed: bool, tied: bool, recompute: bool = False):
    from megatron_pack.config.schema import (Config, DataConfig, ModelConfig, PackingConfig, ParallelConfig,
                                             TrainConfig)

    return Config(model=ModelConfig(attention_backend="torch", num_layers=num_layers,
                                    untie_embeddings_and_output_weights=not tied,
                                    recompute_granularity="full" if recompute else None),
                  train=TrainConfig(seed=1234), data=DataConfig(pad_to_max_length=fixed),
                  packing=PackingConfig(packed_sequence_size=PACK_SIZE, pad_cu_seqlens=fixed),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                                          context_parallel_size=cp, sequence_parallel=sp))


def _batches(packs, fixed: bool) -> list[dict]:
    from megatron_pack.data.batches.thd import collate_thd

    num_cu = max(len(p) for p in packs) + 2 if fixed else None
    return [collate_thd(p, pack_size=PACK_SIZE, pad_multiple=PAD_MULTIPLE, pad_to_max_length=fixed,
                        num_cu_seqlens=num_cu) for p in packs]


def _full_param(tensor, param, state):
    """A TP-sharded parameter (or its grad) gathered into the full tensor (``model_reader.merge_tp_shards``)."""
    import torch.distributed as dist

    from megatron_pack.training.model_reader import merge_tp_shards

    tensor = tensor.detach().contiguous()
    if state.tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(state.tp_size)]
    dist.all_gather(shards, tensor, group=state.tp_group)
    return merge_tp_shards(shards, param)


def _global_name(name: str, offset: int) -> str:
    """decoder.layers.<local i>... -> decoder.layers.<offset + i>... (a stage's layer under its global index)."""
    if name.startswith("decoder.layers."):
        head, index, rest = name.split(".", 3)[1], int(name.split(".")[2]), name.split(".", 3)[3]
        return f"decoder.{head}.{offset + index}.{rest}"
    return name


def _whole_model(named: dict, offset: int, state) -> dict:
    """Every stage's full (TP-gathered) tensors under global names, on every rank."""
    import torch.distributed as dist

    mine = {_global_name(n, offset): t.numpy() for n, t in named.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    whole = {}
    for part in everyone:
        whole.update({n: torch.from_numpy(a) for n, a in part.items()})
    return whole


def _reference(params: dict, packs: list[list[dict]], num_layers: int, tied: bool) -> tuple[float, dict]:
    """float64 global per-token loss and its gradient, each sample alone."""
    p = to_float64({n: t for n, t in params.items() if not (tied and n == "output_layer.weight")})
    if tied:
        p["output_layer.weight"] = p["embedding.word_embeddings.weight"]
    shape = Shape(num_layers=num_layers)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for pack in packs:
        for s in pack:
            loss_sum, n = sample_loss(p, s["input_ids"], s["loss_mask"], shape)
            total, count = total + loss_sum, count + n
    (total / count).backward()
    return float(total / count), {n: t.grad for n, t in p.items()}


def _step(cfg, state, model, batches, link):
    """One pipelined step on this rank: 1F1B + finalize_model_grads; returns (loss, count) of the world."""
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from megatron_pack.training.pipeline_schedule import forward_backward_1f1b
    from megatron_pack.training.step import forward_step

    model.zero_grad_buffer()
    mine = batches[state.dp_rank::state.dp_size]
    reports, num_tokens = forward_backward_1f1b(forward_step_func=forward_step, data_iterator=iter(mine),
                                                model=model, num_microbatches=len(mine), link=link)
    finalize_model_grads([model], num_tokens=num_tokens.clone(), pg_collection=state.pg_collection)
    outcome = torch.zeros(2, dtype=torch.float64)
    for report in reports:
        outcome += report["lm loss"].double()
    dist.all_reduce(outcome)  # every rank: the last stages' sums over DP x CP (TP ranks hold copies)
    return outcome / state.tp_size


def _stage_outputs(cfg, state, model, link, batch) -> torch.Tensor:
    """The activation stage 1 (a middle stage at PP=4) sends on for ``batch``, forward only."""
    from megatron_pack.training.pipeline_schedule import forward_backward_1f1b
    from megatron_pack.training.step import forward_step

    captured = []

    def capture(data_iterator, model):
        output, loss_fn = forward_step(data_iterator, model)
        captured.append(output.detach())
        return output, loss_fn

    forward_backward_1f1b(forward_step_func=capture, data_iterator=iter([batch]), model=model,
                          num_microbatches=1, link=link, forward_only=True)
    return captured[0]


def _trap(cfg, state, model, link, packs) -> dict:
    """#2952: middle-stage rows of a pack == each sample alone (and the leaky attention differs)."""
    from megatron_pack.model.builder import build_model

    batch = _batches([packs[0]], False)[0]
    alone = [_batches([[s]], False)[0] for s in packs[0]]
    packed = _stage_outputs(cfg, state, model, link, batch)
    solo = [_stage_outputs(cfg, state, model, link, a) for a in alone]
    leaky_model = build_model(cfg, state, attention_mode="pack_causal")
    leaky_model.load_state_dict(model.state_dict())
    leaky = _stage_outputs(cfg, state, leaky_model, link, batch)
    if leaky_model.post_process:  # the last stage's outputs are losses, not activations
        return {}
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    worst = worst_leaky = 0.0
    rows = 0
    for i, s in enumerate(solo):
        start, n = cu_pad[i], cu[i + 1] - cu[i]
        worst = max(worst, float((packed[start:start + n] - s[:n]).abs().max()))
        worst_leaky = max(worst_leaky, float((leaky[start:start + n] - s[:n]).abs().max()))
        rows += n
    return {"trap_diff": worst, "trap_leaky_diff": worst_leaky, "trap_rows": rows}


def _run_case(case, rank: int, packs) -> dict:
    from megatron_pack.model.builder import build_model, fixed_pack_shapes, stage_of
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.parallel.pipeline import StageLink, fixed_activation_shape
    from megatron_pack.training.chunks import wrap_ddp

    case_id, pp, tp, cp, sp, num_layers, fixed, tied = case
    cfg = _config(pp, tp, cp, sp, num_layers, fixed, tied, recompute="recompute" in case_id)
    state = initialize_parallel(cfg)
    stage = stage_of(cfg, state)
    model = build_model(cfg, state)
    shape = (fixed_activation_shape(PACK_SIZE, cp=cp, tp=tp, sequence_parallel=sp, hidden_size=cfg.model.hidden_size)
             if fixed_pack_shapes(cfg) else None)
    link = StageLink(state.pg_collection.pp, fixed_shape=shape)
    out = {}
    if case_id == "pp4":  # stage 1 is a middle stage
        trap = _trap(cfg, state, model, link, packs)
        if stage.pp_rank == 1:
            out.update(trap)
    params = _whole_model({n: _full_param(p, p, state) for n, p in model.named_parameters()},
                          stage.layer_offset, state)
    from megatron_pack.training.eval import evaluate
    from megatron_pack.training.step import forward_step

    mine = _batches(packs, fixed)[state.dp_rank::state.dp_size]
    out["eval_loss"] = evaluate(model, mine, forward_step_func=forward_step, group=state.pg_collection.dp_cp,
                                link=link).loss  # before the step: the reference's weights
    ddp = wrap_ddp(cfg, model, state)
    outcome = _step(cfg, state, ddp, _batches(packs, fixed), link)
    grads = _whole_model({n: _full_param(p.main_grad, p, state) for n, p in model.named_parameters()},
                         stage.layer_offset, state)
    out.update({"loss": float(outcome[0] / outcome[1]), "count": float(outcome[1]),
                "shape_exchanges": link.num_shape_exchanges, "pp_rank": stage.pp_rank})
    if rank == 0:
        ref_loss, ref_grads = _reference(params, packs, num_layers, tied)
        if tied:  # megatron-core keeps the embedding's gradient on both stages, summed: compare it once
            grads.pop("output_layer.weight")
            ref_grads.pop("output_layer.weight")
        out["ref_loss"] = ref_loss
        out["grad_rel"] = max(float((grads[n] - ref_grads[n].float()).abs().max()) /
                              max(float(ref_grads[n].abs().max()), 1e-30) for n in ref_grads)
        out["num_grads"] = sum(1 for n in ref_grads if n in grads and float(ref_grads[n].abs().max()) > 0)
        out["num_params"] = len(params)
    return out


def _hf_samples() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 300, size=n).tolist() + [2] for n in (9, 17, 6)]


def _hf_case(rank: int, folder: str) -> dict:
    """HF load at PP=2 x TP=2 (tied Llama, vocabulary 301 padded to 302): each stage reads its own
    layers' tensors; the last stage's logits of one pack of 3 samples, reassembled over TP."""
    import torch.distributed as dist

    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.parallel.groups import gather_full_logits, initialize_parallel
    from megatron_pack.parallel.pipeline import StageLink
    from megatron_pack.training.chunks import core_model
    from megatron_pack.training.pipeline_schedule import forward_backward_1f1b
    from megatron_pack.training.step import get_packed_seq_params

    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=64),
                                  parallel=ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2)),
                           [])
    state = initialize_parallel(cfg)
    model = build_model(cfg, state)
    read = list(model.pretrained_report.hf_names)
    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _hf_samples()], pack_size=64,
                        pad_multiple=8)
    captured = []

    def logits_step(data_iterator, chunk):
        b = next(data_iterator)
        core = core_model(chunk)
        local = slice_thd_batch(b, 1, 0)
        out = chunk(local["tokens"] if core.pre_process else None, local["position_ids"], None,
                    packed_seq_params=get_packed_seq_params(b))
        captured.append(out)
        return out, lambda o: (o.sum() * 0, torch.zeros((), dtype=torch.int32), {"lm loss": torch.zeros(2)})

    forward_backward_1f1b(forward_step_func=logits_step, data_iterator=iter([batch]), model=model,
                          num_microbatches=1, link=StageLink(state.pp_group), forward_only=True)
    out = {"hf/pp_rank": state.pp_rank, "hf/read": " ".join(read)}
    if state.is_last_stage:
        logits = gather_full_logits(captured[0], batch["cu_seqlens_padded"], state)[0]
        cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
        for i in range(len(cu) - 1):
            out[f"hf/logits{i}"] = logits[cu_pad[i]:cu_pad[i] + cu[i + 1] - cu[i], :301].numpy()
    dist.barrier()
    return out


def _world_worker(rank: int, world_size: int, hf_folder: str) -> dict:
    from megatron_pack.parallel.groups import destroy_parallel

    packs = _samples()
    out = {}
    for case in CASES:
        for key, value in _run_case(case, rank, packs).items():
            out[f"{case[0]}/{key}"] = value
        destroy_parallel()
    out.update(_hf_case(rank, hf_folder))
    destroy_parallel()
    return out


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    from _hf import make_family

    return str(make_family(tmp_path_factory.mktemp("hf"), "llama_tied"))


@pytest.fixture(scope="module")
def world(tmp_path_factory, hf_folder) -> list[dict]:
    return spawn_world(_world_worker, WORLD_SIZE, tmp_path_factory.mktemp("pipeline_parallel"), hf_folder)


def test_hf_load_streams_only_the_stage_layers(world):
    for r in world:
        read = str(r["hf/read"]).split()
        stage = int(r["hf/pp_rank"])
        assert f"model.layers.{stage}.self_attn.q_proj.weight" in read
        assert not any(name.startswith(f"model.layers.{1 - stage}.") for name in read)
        assert "model.embed_tokens.weight" in read  # tied: the last stage's output layer is filled from it
        assert ("model.norm.weight" in read) == (stage == 1)


def test_hf_load_at_pp2_tp2_equals_transformers_logits(world, hf_folder):
    from _hf import hf_logits

    last = [r for r in world if int(r["hf/pp_rank"]) == 1]
    assert len(last) == 2  # both TP ranks of the last stage
    want = hf_logits(hf_folder, [ids[:-1] for ids in _hf_samples()])
    for r in last:
        for i, ref in enumerate(want):
            got = torch.from_numpy(r[f"hf/logits{i}"])
            assert got.shape == ref.shape and got.shape[0] > 4
            assert float((got - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max()))


def _num_params(case: str) -> int:
    layers = next(c[5] for c in CASES if c[0] == case)
    return 3 + 6 * layers  # embedding, final norm, output layer (a copy when tied) + 6 per layer


@pytest.mark.parametrize("case", CASE_IDS)
def test_loss_and_gradients_equal_float64_reference(world, case):
    rank0 = world[0]
    assert int(rank0[f"{case}/num_params"]) == _num_params(case)  # every stage's tensors were gathered
    assert int(rank0[f"{case}/num_grads"]) >= _num_params(case) - 1  # ... and compared (tied: once)
    assert abs(float(rank0[f"{case}/loss"]) - float(rank0[f"{case}/ref_loss"])) <= 1e-5 * float(rank0[f"{case}/ref_loss"])
    assert float(rank0[f"{case}/grad_rel"]) <= 1e-5


@pytest.mark.parametrize("case", CASE_IDS)
def test_validation_loss_through_the_pipeline_equals_reference(world, case):
    ref = float(world[0][f"{case}/ref_loss"])
    assert all(abs(float(r[f"{case}/eval_loss"]) - ref) <= 1e-5 * ref for r in world)  # on every stage


@pytest.mark.parametrize("case", CASE_IDS)
def test_every_rank_reaches_the_same_step_outcome(world, case):
    outcomes = {(float(r[f"{case}/loss"]), float(r[f"{case}/count"])) for r in world}
    assert len(outcomes) == 1
    assert {int(r[f"{case}/pp_rank"]) for r in world} == set(range(next(c[1] for c in CASES if c[0] == case)))


@pytest.mark.parametrize("case", CASE_IDS)
def test_shape_exchange_only_for_variable_packs(world, case):
    exchanges = [int(r[f"{case}/shape_exchanges"]) for r in world]
    if "_fixed" in case:
        assert exchanges == [0] * WORLD_SIZE
    else:
        assert all(e > 0 for e in exchanges)  # every stage sent or received each pack's shape


def test_middle_stage_activations_equal_each_sample_alone(world):
    """The #2952 trap at PP=4: stage 1 of 4 honours the pack's boundaries."""
    middle = next(r for r in world if int(r["pp4/pp_rank"]) == 1)
    assert int(middle["pp4/trap_rows"]) >= 10  # every real token of the pack's samples
    assert float(middle["pp4/trap_leaky_diff"]) > 1e-3  # attending across boundaries would be seen
    assert float(middle["pp4/trap_diff"]) <= 1e-5
