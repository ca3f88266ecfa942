"""Pipeline stages on gloo ranks: the 1F1B schedule gives the float64 reference's loss and gradients.

One spawned world of 6 CPU processes. Its first 4 ranks (``_dist.sub_world``) run every pipeline
layout in ``CASES`` in turn (megatron-core's groups rebuilt between them), the HF load and the
trainer's resumes across layouts (``_resume_chain``); then all 6 run ``PP3_TP2``. Each case builds
the stage's GPTModel chunk, runs one step of megatron-core's 1F1B schedule and P2P communicator
(``training.schedule.forward_backward``, on CPU through ``model.cpu_compat``) over this DP rank's packs
and megatron-core's ``finalize_model_grads``, and compares with
``tests/_float64_gpt.py`` (plain torch, float64, each sample alone) evaluated on the weights the
stages hold (gathered from every stage and TP rank):

1. the global per-token loss and every parameter gradient, relative <= 1e-5;
2. the step outcome (loss, target count) is the same on every rank of the world;
3. the validation loss (forward only through the stages) equals the reference on every rank;
4. the shape exchange runs for variable packs and is skipped with fixed shapes, and the schedule that
   ran is megatron-core's (``_Seen`` counts its calls in every rank);
5. the Megatron-Bridge #2952 trap: the activation a middle stage sends on for a pack equals, row
   for row, the activation of each of its samples run alone (and a model that attends across
   the pack's boundaries, ``pack_causal``, does not pass: the check can fail); at PP=3 x TP=2 on
   both TP ranks of the middle stage (Megatron-LM #4092), and every core attention of every rank
   receives the pack's own ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen``.

The packs include a micro-batch without target tokens and a sample that leaves CP rank 1 with
padding only; DP ranks run unequal numbers of micro-batches (5 packs over 2 DP ranks).

``VP_CASES`` run virtual pipeline stages (two model chunks per rank, 4 layers: rank r's chunk v holds
layer v * 2 + r) through megatron-core's interleaved 1F1B over 6 packs
(the interleaved schedule needs a multiple of PP micro-batches per DP rank): at PP=2 x CP=2 (the
padding-only CP rank, the pack without targets), at PP=2 x DP=2 with 4 and 6 micro-batches on
the two DP ranks and at PP=4 x VP=2 (8 layers, two middle stages, 8 micro-batches), against the same float64 reference (loss, gradients, validation loss); in
``_resume_chain`` a PP=2 x VP=2 x CP=2 trainer resumes the PP=1 checkpoint and PP=1 resumes its own.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from _dist import ListLoader, full_param, spawn_world, sub_world
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
VP_CASES = [  # (id, pp, vp, cp, DP rank -> indices of the packs it runs); dp = 4 / (pp*cp), pp*vp layers
    ("pp2_vp2_cp2", 2, 2, 2, [[0, 1, 2, 3, 4, 5]]),
    ("pp2_vp2_dp2", 2, 2, 1, [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]),  # 2 would all be warm-up (validate() refuses)
    ("pp4_vp2", 4, 2, 1, [[0, 1, 2, 3, 4, 5, 6, 7]]),  # 8 layers: two middle stages, 8 chunks round the ring
]
VP_CASE_IDS = [c[0] for c in VP_CASES]
ONE_F_ONE_B = "forward_backward_pipelining_without_interleaving"
INTERLEAVED = "forward_backward_pipelining_with_interleaving"
"""megatron-core's schedules (``megatron.core.pipeline_parallel.schedules``) that the cases must run."""


def _vp_layers(case_id: str) -> int:
    """One layer per model chunk: PP x VP."""
    pp, vp = next((c[1], c[2]) for c in VP_CASES if c[0] == case_id)
    return pp * vp
PP3_TP2 = ("pp3_tp2", 3, 2, 1, False, 3, False, False)
"""The 6-rank case (Megatron-LM #4092: TP ranks of a middle stage), run after the 4-rank ones on all 6 ranks."""
NUM_PACKS = 5
NO_TARGET_PACK = 2


def _samples(seed: int = 11) -> list[list[dict]]:
    """NUM_PACKS packs of 2-4 samples; pack NO_TARGET_PACK has no target token, the last pack holds a
    2-token sample that leaves CP rank 1 of 2 with padding only (its 8 padded slots: rank 1 keeps 2..5)."""
    packs = random_packs(seed, NUM_PACKS, samples=(2, 5), length=(4, 20), no_target=(NO_TARGET_PACK,))
    packs[-1] = [{"input_ids": [5, 9, 2], "loss_mask": [0, 1, 1]}]
    return packs


def _config(pp: int, tp: int, cp: int, sp: bool, num_layers: int, fixed: bool, tied: bool, recompute: bool = False,
            vp=None):
    from megatron_pack.config.schema import (Config, DataConfig, ModelConfig, PackingConfig, ParallelConfig,
                                             TrainConfig)

    return Config(model=ModelConfig(attention_backend="torch", num_layers=num_layers,
                                    untie_embeddings_and_output_weights=not tied,
                                    recompute_granularity="full" if recompute else None),
                  train=TrainConfig(seed=1234), data=DataConfig(pad_to_max_length=fixed),
                  packing=PackingConfig(packed_sequence_size=PACK_SIZE, pad_cu_seqlens=fixed),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                                          context_parallel_size=cp, sequence_parallel=sp,
                                          virtual_pipeline_model_parallel_size=vp))


def _batches(packs, fixed: bool) -> list[dict]:
    from megatron_pack.data.batches.thd import collate_thd

    num_cu = max(len(p) for p in packs) + 2 if fixed else None
    return [collate_thd(p, pack_size=PACK_SIZE, pad_multiple=PAD_MULTIPLE, pad_to_max_length=fixed,
                        num_cu_seqlens=num_cu) for p in packs]


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


class _Seen:
    """In this process: megatron-core's schedule calls by name, and the shape exchanges of its stage links
    (``batch_isend_irecv``: the activations themselves go as plain isend / irecv, ``batch_p2p_comm=False``)."""

    schedules: dict = {}
    shape_exchanges = 0

    @classmethod
    def install(cls) -> None:
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import schedules

        from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda

        enable_cpu_compat_without_cuda()  # first: its wrappers go inside these counters
        for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                     "forward_backward_pipelining_with_interleaving"):
            setattr(schedules, name, cls._counted(name, getattr(schedules, name)))
        batch = dist.batch_isend_irecv

        def counted(ops):
            cls.shape_exchanges += 1
            return batch(ops)

        dist.batch_isend_irecv = counted

    @classmethod
    def _counted(cls, name, schedule):
        def run(*args, **kwargs):
            cls.schedules[name] = cls.schedules.get(name, 0) + 1
            return schedule(*args, **kwargs)

        return run


def _schedule(model_chunks, state, batches, forward_only=False):
    """``training.schedule.forward_backward`` over ``batches`` with ``forward_step``; returns its reports."""
    from megatron_pack.training.schedule import forward_backward
    from megatron_pack.training.step import forward_step

    return forward_backward(forward_step_func=forward_step, data_iterator=iter(batches), model_chunks=model_chunks,
                            num_microbatches=len(batches), state=state, seq_length=PACK_SIZE,
                            forward_only=forward_only)


def _target_tokens(reports) -> torch.Tensor:
    """The target tokens of this rank's reports (the last stage's; 0 elsewhere), as finalize_model_grads takes."""
    return torch.tensor(int(sum(float(r["lm loss"][1]) for r in reports)), dtype=torch.int32)


def _step(cfg, state, model, batches):
    """One pipelined step on this rank: 1F1B + finalize_model_grads; returns (loss, count) of the world."""
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    model.zero_grad_buffer()
    mine = batches[state.dp_rank::state.dp_size]
    reports = _schedule([model], state, mine)
    finalize_model_grads([model], num_tokens=_target_tokens(reports), pg_collection=state.pg_collection)
    outcome = torch.zeros(2, dtype=torch.float64)
    for report in reports:
        outcome += report["lm loss"].double()
    dist.all_reduce(outcome)  # every rank: the last stages' sums over DP x CP (TP ranks hold copies)
    return outcome / state.tp_size


def _evaluate(model_chunks, state, batches) -> float:
    """``eval.evaluate`` as the trainer calls it (the training schedule's forwards, the last stage's sums)."""
    from functools import partial

    from megatron_pack.training.eval import evaluate
    from megatron_pack.training.schedule import forward_backward
    from megatron_pack.training.step import forward_step

    return evaluate(model_chunks, batches, forward_step_func=forward_step, group=state.pg_collection.dp_cp,
                    schedule=partial(forward_backward, state=state, seq_length=PACK_SIZE),
                    pp_group=state.pp_group).loss


def _stage_outputs(cfg, state, model, batch) -> torch.Tensor:
    """The activation stage 1 (a middle stage at PP=4) sends on for ``batch``, forward only."""
    from megatron_pack.training.schedule import forward_backward
    from megatron_pack.training.step import forward_step

    captured = []

    def capture(data_iterator, model):
        output, loss_fn = forward_step(data_iterator, model)
        captured.append(output.detach())
        return output, loss_fn

    with torch.no_grad():
        forward_backward(forward_step_func=capture, data_iterator=iter([batch]), model_chunks=[model],
                         num_microbatches=1, state=state, seq_length=PACK_SIZE, forward_only=True)
    return captured[0]


def _boundaries_seen(model) -> tuple[list, object]:
    """Record the ``PackedSeqParams`` every core attention of this rank's stage receives (a hook each)."""
    seen = []

    def hook(module, args, kwargs):
        p = kwargs.get("packed_seq_params")
        seen.append(None if p is None else (p.qkv_format, p.cu_seqlens_q.tolist(),
                                            None if p.cu_seqlens_q_padded is None else p.cu_seqlens_q_padded.tolist(),
                                            int(p.max_seqlen_q)))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
               if type(m).__name__ == "ThdCoreAttention"]
    return seen, handles


def _trap(cfg, state, model, packs) -> dict:
    """#2952 / #4092: middle-stage rows of a pack == each sample alone on every TP rank (and the leaky
    attention differs); every rank's attention layers got the pack's own boundaries."""
    from megatron_pack.model.builder import build_model

    batch = _batches([packs[0]], False)[0]
    alone = [_batches([[s]], False)[0] for s in packs[0]]
    seen, handles = _boundaries_seen(model)
    packed = _stage_outputs(cfg, state, model, batch)
    for h in handles:
        h.remove()
    want = ("thd", batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist(), int(batch["max_seqlen"]))
    out = {"trap_num_params_seen": len(seen), "trap_params_equal": all(p == want for p in seen),
           "trap_num_layers_here": cfg.model.num_layers // state.pp_size}
    solo = [_stage_outputs(cfg, state, model, a) for a in alone]
    leaky_model = build_model(cfg, state, attention_mode="pack_causal")
    leaky_model.load_state_dict(model.state_dict())
    leaky = _stage_outputs(cfg, state, leaky_model, batch)
    if leaky_model.post_process:  # the last stage's outputs are losses, not activations
        return out
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    worst = worst_leaky = 0.0
    rows = 0
    for i, s in enumerate(solo):
        start, n = cu_pad[i], cu[i + 1] - cu[i]
        worst = max(worst, float((packed[start:start + n] - s[:n]).abs().max()))
        worst_leaky = max(worst_leaky, float((leaky[start:start + n] - s[:n]).abs().max()))
        rows += n
    return {**out, "trap_diff": worst, "trap_leaky_diff": worst_leaky, "trap_rows": rows}


def _run_case(case, rank: int, packs) -> dict:
    from megatron_pack.model.builder import build_model, stage_of
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.chunks import wrap_ddp

    case_id, pp, tp, cp, sp, num_layers, fixed, tied = case
    cfg = _config(pp, tp, cp, sp, num_layers, fixed, tied, recompute="recompute" in case_id)
    state = initialize_parallel(cfg)
    stage = stage_of(cfg, state)
    model = build_model(cfg, state)
    out = {}
    if pp >= 3:  # stage 1 is a middle stage
        out.update(_trap(cfg, state, model, packs))
    params = _whole_model({n: full_param(p, p, state) for n, p in model.named_parameters()},
                          stage.layer_offset, state)
    mine = _batches(packs, fixed)[state.dp_rank::state.dp_size]
    out["eval_loss"] = _evaluate([model], state, mine)  # before the step: the reference's weights
    ddp = wrap_ddp(cfg, model, state)
    exchanges, runs = _Seen.shape_exchanges, _Seen.schedules.get(ONE_F_ONE_B, 0)
    outcome = _step(cfg, state, ddp, _batches(packs, fixed))
    grads = _whole_model({n: full_param(p.main_grad, p, state) for n, p in model.named_parameters()},
                         stage.layer_offset, state)
    out.update({"loss": float(outcome[0] / outcome[1]), "count": float(outcome[1]),
                "shape_exchanges": _Seen.shape_exchanges - exchanges, "pp_rank": stage.pp_rank,
                "core_schedule_runs": _Seen.schedules.get(ONE_F_ONE_B, 0) - runs})
    if rank == 0:
        out.update(_against_reference(params, grads, packs, num_layers, tied))
    return out


def _against_reference(params: dict, grads: dict, packs, num_layers: int, tied: bool) -> dict:
    """The float64 reference's loss, and the largest relative gradient difference (every tensor)."""
    ref_loss, ref_grads = _reference(params, packs, num_layers, tied)
    if tied:  # megatron-core keeps the embedding's gradient on both stages, summed: compare it once
        grads.pop("output_layer.weight", None)  # (PP=1 has no second copy)
        ref_grads.pop("output_layer.weight")
    return {"ref_loss": ref_loss, "num_params": len(params),
            "grad_rel": max(float((grads[n] - ref_grads[n].float()).abs().max()) /
                            max(float(ref_grads[n].abs().max()), 1e-30) for n in ref_grads),
            "num_grads": sum(1 for n in ref_grads if n in grads and float(ref_grads[n].abs().max()) > 0)}


def _vp_packs(num: int = 6) -> list[list[dict]]:
    """The 5 packs of ``_samples`` and ``num - 5`` more with targets (6 to 10 micro-batches: a multiple of PP)."""
    return _samples() + _samples(seed=12)[:num - 5]


def _chunk_names(chunks, layouts, tensor_of, state) -> dict:
    """Every chunk's (TP-gathered) tensors under their global layer names."""
    named = {}
    for chunk, layout in zip(chunks, layouts):
        named.update({_global_name(n, layout.layer_offset): full_param(tensor_of(p), p, state)
                      for n, p in chunk.named_parameters()})
    return _whole_model(named, 0, state)


def _run_vp_case(case, rank: int, packs) -> dict:
    """Virtual stages: two chunks per rank, one interleaved 1F1B step, the float64 reference."""
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from megatron_pack.model.builder import build_model, stage_of
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.chunks import wrap_ddp

    case_id, pp, vp, cp, split = case
    layers = pp * vp
    cfg = _config(pp, 1, cp, False, layers, False, False, vp=vp)
    state = initialize_parallel(cfg)
    layouts = [stage_of(cfg, state, v) for v in range(vp)]
    chunks = [build_model(cfg, state, vp_stage=v) for v in range(vp)]
    out = {"pp_rank": state.pp_rank, "layers": np.array([layer.layer_number - 1 for c in chunks
                                                         for layer in c.decoder.layers])}
    params = _chunk_names(chunks, layouts, lambda p: p, state)
    mine = [_batches(packs, False)[i] for i in split[state.dp_rank]]
    out["eval_loss"] = _evaluate(chunks, state, mine)
    ddps = [wrap_ddp(cfg, chunk, state) for chunk in chunks]
    ddps[0].module.config.no_sync_func = [ddp.no_sync for ddp in ddps]  # as chunks.build_model_chunks
    for ddp in ddps:
        ddp.zero_grad_buffer()
    exchanges, runs = _Seen.shape_exchanges, _Seen.schedules.get(INTERLEAVED, 0)
    reports = _schedule(ddps, state, mine)
    finalize_model_grads(ddps, num_tokens=_target_tokens(reports), pg_collection=state.pg_collection)
    outcome = torch.zeros(2, dtype=torch.float64)
    for report in reports:
        outcome += report["lm loss"].double()
    dist.all_reduce(outcome)
    grads = _chunk_names(chunks, layouts, lambda p: p.main_grad, state)
    out.update({"loss": float(outcome[0] / outcome[1]), "count": float(outcome[1]),
                "num_reports": len(reports), "shape_exchanges": _Seen.shape_exchanges - exchanges,
                "core_schedule_runs": _Seen.schedules.get(INTERLEAVED, 0) - runs})
    if rank == 0:
        out.update(_against_reference(params, grads, packs, layers, False))
    return out


def _hf_samples() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 300, size=n).tolist() + [2] for n in (9, 17, 6)]


def _hf_case(rank: int, folder: str, vp=None) -> dict:
    """HF load at PP=2 x TP=2 (tied Llama, vocabulary 301 padded to 302): each stage reads its own
    layers' tensors; the last stage's logits of one pack of 3 samples, reassembled over TP. With ``vp``
    (a 4-layer folder) each of the rank's chunks reads its own layers and the packs run through the
    interleaved schedule's forwards."""
    import torch.distributed as dist

    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.parallel.groups import gather_full_logits, initialize_parallel
    from megatron_pack.training.chunks import core_model
    from megatron_pack.training.schedule import forward_backward
    from megatron_pack.training.step import get_packed_seq_params

    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=64),
                                  parallel=ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                                                          virtual_pipeline_model_parallel_size=vp)),
                           [])
    state = initialize_parallel(cfg)
    chunks = [build_model(cfg, state, vp_stage=v) for v in range(vp or 1)]
    read = [" ".join(chunk.pretrained_report.hf_names) for chunk in chunks]
    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _hf_samples()], pack_size=64,
                        pad_multiple=8)
    captured = []

    def logits_step(data_iterator, chunk):
        b = next(data_iterator)
        core = core_model(chunk)
        local = slice_thd_batch(b, 1, 0)
        out = chunk(local["tokens"] if core.pre_process else None, local["position_ids"], None,
                    packed_seq_params=get_packed_seq_params(b))
        if core.post_process:
            captured.append(out)
        return out, lambda o: (o.sum() * 0, torch.zeros((), dtype=torch.int32), {"lm loss": torch.zeros(2)})

    with torch.no_grad():  # one pack: the interleaved schedule repeats it to fill its group of PP, once more
        forward_backward(forward_step_func=logits_step, data_iterator=iter([batch]), model_chunks=chunks,
                         num_microbatches=1, state=state, seq_length=64, forward_only=True)
    key = "hf" if vp is None else "hfvp"
    out = {f"{key}/pp_rank": state.pp_rank, f"{key}/read": read[0],
           **{f"{key}/read{v}": names for v, names in enumerate(read)}}
    if state.is_last_stage:
        assert len(captured) == (2 if vp else 1)  # the output layer's chunk (VP: the pack and its repeat)
        logits = gather_full_logits(captured[0], batch["cu_seqlens_padded"], state)[0]
        cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
        for i in range(len(cu) - 1):
            out[f"{key}/logits{i}"] = logits[cu_pad[i]:cu_pad[i] + cu[i + 1] - cu[i], :301].numpy()
    dist.barrier()
    return out


VERIFY_CASES = [  # (id, pp, vp, tp, cp, 4-layer folder, verify.tolerance)
    ("verify_pp2_tp2", 2, None, 2, 1, False, 1e-4),
    ("verify_pp2_tp2_fails", 2, None, 2, 1, False, 1e-12),  # float32 rounding exceeds it: every rank FAILs
    ("verify_pp2_vp2_cp2", 2, 2, 1, 2, True, 1e-4),
]


def _verify_case(case, rank: int, folder: str) -> dict:
    """``megatron-pack verify verify.reference=transformers`` (``cli.verify.run_verify``) at a pipeline layout
    of this 4-rank world: its exit code, the lines this rank printed, and the schedules and shape exchanges
    it ran (the guard that the stages were really two, linked by megatron-core's P2P)."""
    from _hf import MemoryPacks

    from megatron_pack.cli.verify import run_verify
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig, VerifyConfig

    name, pp, vp, tp, cp, _, tol = case
    rng = np.random.default_rng(5)
    packs = [[rng.integers(3, 300, size=n).tolist() + [2] for n in lengths] for lengths in ((9, 17, 6), (20, 11))]
    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=64),
                                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, context_parallel_size=cp,
                                                          tensor_model_parallel_size=tp,
                                                          virtual_pipeline_model_parallel_size=vp),
                                  verify=VerifyConfig(reference="transformers", num_packs=2, tolerance=tol)), [])
    lines: list[str] = []
    before, exchanges = dict(_Seen.schedules), _Seen.shape_exchanges
    rc = run_verify(cfg, dataset=MemoryPacks(packs, pack_size=64, pad_multiple=2 * cp if cp > 1 else 1),
                    out=lines.append)
    ran = {k: v - before.get(k, 0) for k, v in _Seen.schedules.items() if v > before.get(k, 0)}
    return {f"{name}/rc": rc, f"{name}/out": "\n".join(lines), f"{name}/schedules": repr(sorted(ran.items())),
            f"{name}/shape_exchanges": _Seen.shape_exchanges - exchanges}


def _world_worker(rank: int, world_size: int, hf_folder: str, hf_folder4: str, root: str) -> dict:
    """The 4-rank layouts (pipeline and virtual stages, HF loads, the trainer's resumes) on ranks 0..3
    (``sub_world``), then PP=3 x TP=2 on all 6."""
    from megatron_pack.parallel.groups import destroy_parallel

    packs = _samples()
    out = {}
    _Seen.install()
    with sub_world(rank, WORLD_SIZE, root, "four") as member:
        if member:
            for case in CASES:
                for key, value in _run_case(case, rank, packs).items():
                    out[f"{case[0]}/{key}"] = value
                destroy_parallel()
            for case in VP_CASES:
                num_packs = sum(len(s) for s in case[4])
                for key, value in _run_vp_case(case, rank, _vp_packs(num_packs)).items():
                    out[f"{case[0]}/{key}"] = value
                destroy_parallel()
            out.update(_hf_case(rank, hf_folder))
            destroy_parallel()
            out.update(_hf_case(rank, hf_folder4, vp=2))
            destroy_parallel()
            for case in VERIFY_CASES:
                out.update(_verify_case(case, rank, hf_folder4 if case[5] else hf_folder))
            out.update(_resume_chain(rank, f"{root}/ckpt"))
            out.update(_trainer_cases(rank, root))
    out.update({f"pp3_tp2/{k}": v for k, v in _run_case(PP3_TP2, rank, packs).items()})
    destroy_parallel()
    return out


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    from _hf import make_family

    return str(make_family(tmp_path_factory.mktemp("hf"), "llama_tied"))


@pytest.fixture(scope="module")
def hf_folder4(tmp_path_factory) -> str:
    """The tied Llama with 4 layers (PP=2 x VP=2 chunks of one layer)."""
    from _hf import make_family

    return str(make_family(tmp_path_factory.mktemp("hf4"), "llama_tied", num_layers=4))


@pytest.fixture(scope="module")
def world6(tmp_path_factory, hf_folder, hf_folder4) -> list[dict]:
    """Every rank's results: 6 ranks, the first WORLD_SIZE of which also ran the 4-rank layouts."""
    root = tmp_path_factory.mktemp("pipeline_parallel")
    return spawn_world(_world_worker, 6, root, hf_folder, hf_folder4, str(root))


@pytest.fixture(scope="module")
def world(world6) -> list[dict]:
    return world6[:WORLD_SIZE]


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
    assert all(int(r[f"{case}/core_schedule_runs"]) == 1 for r in world)  # megatron-core's 1F1B ran the step
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


@pytest.mark.parametrize("case", VP_CASE_IDS)
def test_virtual_stages_loss_and_gradients_equal_float64_reference(world, case):
    rank0 = world[0]
    num_params = 3 + 6 * _vp_layers(case)
    assert int(rank0[f"{case}/num_params"]) == num_params  # every chunk's tensors were gathered
    assert int(rank0[f"{case}/num_grads"]) >= num_params - 1  # ... and compared
    ref = float(rank0[f"{case}/ref_loss"])
    assert abs(float(rank0[f"{case}/loss"]) - ref) <= 1e-5 * ref
    assert float(rank0[f"{case}/grad_rel"]) <= 1e-5
    assert all(abs(float(r[f"{case}/eval_loss"]) - ref) <= 1e-5 * ref for r in world)  # forward only, every rank
    assert len({(float(r[f"{case}/loss"]), float(r[f"{case}/count"])) for r in world}) == 1
    assert all(int(r[f"{case}/shape_exchanges"]) > 0 for r in world)  # the ring carried variable shapes
    assert all(int(r[f"{case}/core_schedule_runs"]) == 1 for r in world)  # megatron-core's interleaved 1F1B


@pytest.mark.parametrize("case", VP_CASE_IDS)
def test_virtual_stages_hold_megatron_cores_interleaved_layers(world, case):
    """Rank r's chunk v holds layer block v * PP + r (megatron-core's offset with vp_stage); the loss
    (one report per micro-batch) is on the last rank only."""
    pp, vp, split = next((c[1], c[2], c[4]) for c in VP_CASES if c[0] == case)
    per = _vp_layers(case) // (pp * vp)
    for r in world:
        rank = int(r[f"{case}/pp_rank"])
        want = [(v * pp + rank) * per + i for v in range(vp) for i in range(per)]
        assert r[f"{case}/layers"].tolist() == want
        assert int(r[f"{case}/num_reports"]) in ({len(s) for s in split} if rank == pp - 1 else {0})


def test_hf_load_at_virtual_stages_streams_each_chunk_and_equals_transformers(world, hf_folder4):
    """PP=2 x VP=2 x TP=2: chunk v of rank r reads HF layer v * 2 + r only; the last chunk's logits
    (through the interleaved schedule's forwards) equal transformers'."""
    from _hf import hf_logits

    for r in world:
        stage = int(r["hfvp/pp_rank"])
        for v in range(2):
            read = str(r[f"hfvp/read{v}"]).split()
            layers = {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")}
            assert layers == {v * 2 + stage}
            assert ("model.embed_tokens.weight" in read) == ((stage, v) in ((0, 0), (1, 1)))  # tied: the last too
            assert ("model.norm.weight" in read) == ((stage, v) == (1, 1))
    last = [r for r in world if int(r["hfvp/pp_rank"]) == 1]
    assert len(last) == 2
    want = hf_logits(hf_folder4, [ids[:-1] for ids in _hf_samples()])
    for r in last:
        for i, ref in enumerate(want):
            got = torch.from_numpy(r[f"hfvp/logits{i}"])
            assert got.shape == ref.shape and got.shape[0] > 4
            assert float((got - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max()))
    _assert_every_rank_saw_the_boundaries(world, "pp4")


def _assert_every_rank_saw_the_boundaries(ranks: list[dict], case: str) -> None:
    """Every core attention of every rank (every stage, every TP rank) got the pack's own boundaries."""
    for r in ranks:
        assert int(r[f"{case}/trap_num_params_seen"]) == int(r[f"{case}/trap_num_layers_here"]) >= 1
        assert bool(r[f"{case}/trap_params_equal"])


# ----- checkpoints across PP x TP x CP: the same 4 ranks, the trainer (AdamW, clipping) ---------------

RESUME_STEPS, RESUME_PACKS_PER_STEP = 3, 4
RESUME_LAYOUTS = {"a": (1, 2, 2), "b": (2, 1, 2), "d": (2, 2, 1), "e": (1, 2, 2), "f": (2, 1, 2), "g": (2, 1, 2, 2),
                  "h": (1, 2, 2)}
"""(pp, tp, cp[, vp]) of each trainer of ``_resume_chain``; dp = 1 in each, so every step trains the same 4 packs."""
RESUME_LAYERS = 4
"""PP x VP = 4 chunks of one layer for G; 2 layers per stage at PP=2."""


def _trainer(name: str, distributed_optimizer: bool = False):
    from megatron_pack.config.schema import Config, DDPConfig, ModelConfig, ParallelConfig, TrainConfig
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.loop import build_trainer

    pp, tp, cp, vp = (*RESUME_LAYOUTS[name], None)[:4]
    cfg = Config(model=ModelConfig(attention_backend="torch", untie_embeddings_and_output_weights=False,
                                   num_layers=RESUME_LAYERS),
                 ddp=DDPConfig(use_distributed_optimizer=distributed_optimizer),
                 train=TrainConfig(seed=1234, lr=3e-3, global_batch_size=RESUME_PACKS_PER_STEP,
                                   train_iters=RESUME_STEPS, lr_warmup_iters=0, clip_grad=0.05),
                 parallel=ParallelConfig(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                                         context_parallel_size=cp, virtual_pipeline_model_parallel_size=vp))
    packs = [collate_thd(p, pack_size=64, pad_multiple=8)
             for p in random_packs(5, RESUME_STEPS * RESUME_PACKS_PER_STEP, samples=(2, 4), length=(5, 20))]
    return build_trainer(cfg, initialize_parallel(cfg), ListLoader(packs))


def _resume_chain(rank: int, root: str) -> dict:
    """Five trainers over the same 12 packs, 4 per step (the embeddings tied: at PP>1 the last stage
    holds a copy of the first stage's, kept equal by megatron-core's embedding-group all-reduce):

    * A, PP=1 x TP=2 x CP=2: saves before its first step, runs 3 steps uninterrupted (the reference);
    * B, PP=2 x CP=2, distributed optimizer: resumes A's step 0 (PP=1 -> PP=2), saves, runs step 1, saves;
    * D, PP=2 x TP=2: resumes B's step 1 (PP=2 -> PP=2 x TP=2), runs step 2, saves;
    * E, PP=1 x TP=2 x CP=2 and F, PP=2 x CP=2: each resume D's step 2 (PP=2 x TP=2 -> PP=1 and
      -> PP=2) and run step 3;
    * G, PP=2 x VP=2 x CP=2 (two model chunks per rank, the interleaved 1F1B) with the distributed
      optimizer (one AdamW over both chunks): resumes A's step 0 (PP=1 -> PP=2 x VP=2), saves, runs
      steps 1 and 2, saves; H, PP=1 x TP=2 x CP=2, resumes it (PP=2 x VP=2 -> PP=1) for step 3.
    """
    from megatron_pack.parallel.groups import destroy_parallel

    def steps(trainer, num):
        return np.array([(m.lm_loss, m.grad_norm) for m in (trainer.train_step() for _ in range(num))])

    out = {}
    a = _trainer("a")
    a_start = a.save(f"{root}/a")
    out["resume/a"] = steps(a, RESUME_STEPS)
    destroy_parallel()
    b = _trainer("b", distributed_optimizer=True)
    b.load(a_start)
    b_start = b.save(f"{root}/b")  # A's step-0 weights, written by the two stages
    exchanges = _Seen.shape_exchanges
    out["resume/b"] = steps(b, 1)
    out["resume/b_exchanges"] = _Seen.shape_exchanges - exchanges
    saved = {"b": b.save(f"{root}/b")}
    destroy_parallel()
    for name, source in (("d", "b"), ("e", "d"), ("f", "d")):
        trainer = _trainer(name)
        trainer.load(saved[source])
        out[f"resume/{name}"] = steps(trainer, 1)
        out[f"resume/{name}_step"] = trainer.step
        if name == "d":
            saved["d"] = trainer.save(f"{root}/d")
        destroy_parallel()
    g = _trainer("g", distributed_optimizer=True)
    g.load(a_start)
    g_start = g.save(f"{root}/g")  # A's step-0 weights, written by two chunks on each of the two stages
    exchanges = _Seen.shape_exchanges
    out["resume/g"] = steps(g, 2)
    out["resume/g_step"], out["resume/g_chunks"] = g.step, len(g.model_chunks)
    out["resume/g_exchanges"] = _Seen.shape_exchanges - exchanges
    g_end = g.save(f"{root}/g")
    destroy_parallel()
    h = _trainer("h")
    h.load(g_end)
    out["resume/h"] = steps(h, 1)
    out["resume/h_step"] = h.step
    destroy_parallel()
    if rank == 0:  # what export reads: the whole model of the PP=2 (x VP=2) checkpoints against the PP=1 one
        from megatron_pack.training.checkpoint import read_full_model

        pp1 = read_full_model(a_start)
        out["resume/export_num_tensors"] = len(pp1)
        for key, path in (("export", b_start), ("vp_export", g_start)):
            other = read_full_model(path)
            out[f"resume/{key}_same_names"] = sorted(pp1) == sorted(other)
            out[f"resume/{key}_equal"] = all(torch.equal(pp1[n], other[n]) for n in pp1)
    return out


TRAINER_LAYOUTS = {  # id -> (world size, PP, EP, distributed optimizer); DP = world / PP
    "world1": (1, 1, 1, False),
    "world1_distributed": (1, 1, 1, True),
    "pp2_dp2": (4, 2, 1, False),
    "ep2_dp2": (2, 1, 2, False),
}
"""build_trainer's layouts checked against the float64 reference: megatron-core's optimizer (its distributed one
when asked), the objects a GPU run builds, on every device; EP=2 trains a MoE model (4 experts, top 2) whose
experts are split over the 2 DP ranks."""
TRAINER_STEPS, TRAINER_PACKS_PER_STEP, TRAINER_LAYERS, TRAINER_EXPERTS = 2, 4, 2, 4


def _global_expert(name: str, state, num_local: int) -> str:
    """``...local_experts.<local e>...`` -> ``...local_experts.<global e>...`` (this EP rank's experts)."""
    marker = "mlp.experts.local_experts."
    if marker not in name:
        return name
    head, rest = name.split(marker)
    index, tail = rest.split(".", 1)
    return f"{head}{marker}{state.ep_rank * num_local + int(index)}.{tail}"


def _trainer_case(rank: int, world: int, pp: int, ep: int, distributed: bool) -> dict:
    """``build_trainer`` (megatron-core's schedule, DDP, optimizer, tied embeddings) takes ``TRAINER_STEPS``
    steps; before each, the float64 reference's loss and gradients on the weights every stage holds then
    (gathered), against the step's logged loss and ``main_grad`` after it."""
    from megatron_pack.config.schema import Config, DDPConfig, ModelConfig, ParallelConfig, TrainConfig
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.loop import build_trainer

    moe = {"num_experts": TRAINER_EXPERTS, "moe_ffn_hidden_size": 32, "moe_router_topk": 2} if ep > 1 else {}
    cfg = Config(model=ModelConfig(attention_backend="torch", num_layers=TRAINER_LAYERS,
                                   untie_embeddings_and_output_weights=False, **moe),
                 train=TrainConfig(seed=1234, lr=3e-3, global_batch_size=TRAINER_PACKS_PER_STEP,
                                   train_iters=TRAINER_STEPS, lr_warmup_iters=0, clip_grad=1e9),
                 ddp=DDPConfig(use_distributed_optimizer=distributed),
                 parallel=ParallelConfig(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep))
    packs = random_packs(7, TRAINER_STEPS * TRAINER_PACKS_PER_STEP, samples=(1, 4), length=(5, 20))
    state = initialize_parallel(cfg)
    per_step = [packs[s * TRAINER_PACKS_PER_STEP:(s + 1) * TRAINER_PACKS_PER_STEP] for s in range(TRAINER_STEPS)]
    mine = [p for step in per_step for p in step[state.dp_rank::state.dp_size]]  # this DP rank's share of each step
    loader = ListLoader([collate_thd(p, pack_size=64, pad_multiple=8) for p in mine])
    trainer = build_trainer(cfg, state, loader)
    out = _trainer_steps(rank, trainer, cfg, state, per_step, ep)
    out["chained"] = ",".join(sorted({type(o).__name__ for o in trainer.optimizer.parts}))
    return out


def _trainer_steps(rank: int, trainer, cfg, state, per_step: list, ep: int) -> dict:
    """``TRAINER_STEPS`` steps of ``trainer``, each against the float64 reference on the weights before it."""
    from megatron_pack.model.builder import stage_of

    offset = stage_of(cfg, state).layer_offset
    num_local = TRAINER_EXPERTS // ep
    named = [(_global_expert(n, state, num_local), p) for n, p in trainer.model.module.named_parameters()]
    out = {"dp_size": state.dp_size, "pp_size": state.pp_size, "ep_size": state.pg_collection.ep.size(),
           "optimizer": type(trainer.optimizer).__name__}
    for step in range(TRAINER_STEPS):
        params = _whole_model({n: full_param(p.detach(), p, state) for n, p in named}, offset, state)
        metrics = trainer.train_step()
        grads = _whole_model({n: full_param(p.main_grad, p, state) for n, p in named}, offset, state)
        out[f"loss{step}"] = metrics.lm_loss
        if rank == 0:  # the global batch: every DP rank's packs of the step
            ref = _against_reference(params, grads, per_step[step], TRAINER_LAYERS, True)
            out.update({f"{k}{step}": v for k, v in ref.items()})
    return out


def _trainer_cases(rank: int, root: str) -> dict:
    """``_trainer_case`` at each of ``TRAINER_LAYOUTS`` (a smaller world: ``sub_world`` of the 4 ranks)."""
    from megatron_pack.parallel.groups import destroy_parallel

    out = {}
    for name, (world, pp, ep, distributed) in TRAINER_LAYOUTS.items():
        with sub_world(rank, world, root, f"trainer_{name}") as member:
            if member:
                out.update({f"trainer_{name}/{k}": v
                            for k, v in _trainer_case(rank, world, pp, ep, distributed).items()})
                destroy_parallel()
    return out


@pytest.mark.parametrize("name", list(TRAINER_LAYOUTS))
def test_trainer_steps_equal_float64_reference(world, name):
    """The trainer ``megatron-pack train`` builds (megatron-core's schedule and P2P, DDP, its optimizer plain and
    distributed, the MoE dispatcher) at world 1, PP=2 x DP=2 and EP=2 x DP=2: each step's loss and every gradient
    equal the float64 reference of each sample alone on the weights before that step (relative 1e-5); every rank
    logs the same loss."""
    rank0 = world[0]
    size, pp, ep, distributed = TRAINER_LAYOUTS[name]
    key = f"trainer_{name}/"
    assert (int(rank0[key + "pp_size"]), int(rank0[key + "dp_size"]), int(rank0[key + "ep_size"])) == \
        (pp, size // pp, ep)
    assert rank0[key + "optimizer"] == "TrainOptimizer"
    assert rank0[key + "chained"] == ("DistributedOptimizer" if distributed else "FP32Optimizer")
    per_layer = 6 if ep == 1 else 5 + 2 * TRAINER_EXPERTS  # MoE: a router and each expert's two linears
    num_params = 2 + per_layer * TRAINER_LAYERS  # tied: no output layer
    for step in range(TRAINER_STEPS):
        assert int(rank0[f"{key}num_params{step}"]) == num_params + int(pp > 1)  # the last stage's tied copy
        assert int(rank0[f"{key}num_grads{step}"]) >= num_params - 1 - (ep > 1) * TRAINER_LAYERS  # guard
        ref = float(rank0[f"{key}ref_loss{step}"])
        members = [r for r in world if f"{key}loss{step}" in r]
        assert len(members) == size
        assert all(abs(float(r[f"{key}loss{step}"]) - ref) <= 1e-5 * ref for r in members)
        assert float(rank0[f"{key}grad_rel{step}"]) <= 1e-5
    assert float(rank0[key + "loss0"]) != float(rank0[key + "loss1"])  # the step moved


def _rel(got, want) -> float:
    return float(np.max(np.abs(got - want) / np.abs(want)))


def test_pp2_resumed_from_pp1_takes_the_same_step(world):
    for r in world:
        a = r["resume/a"]
        assert a.shape == (RESUME_STEPS, 2) and np.all(a > 0) and len({tuple(x) for x in a}) == RESUME_STEPS
        assert _rel(r["resume/b"], a[:1]) <= 1e-5  # loss and gradient norm
        assert int(r["resume/b_exchanges"]) > 0  # the stages exchanged shapes: the pipeline schedule ran


@pytest.mark.parametrize("name,step", [("d", 2), ("e", 3), ("f", 3)],
                         ids=["pp2_to_pp2_tp2", "pp2_tp2_to_pp1", "pp2_tp2_to_pp2"])
def test_resumed_across_pp_tp_takes_the_same_step(world, name, step):
    """D resumes a PP=2 checkpoint at PP=2 x TP=2; E and F resume D's at PP=1 and PP=2: each resumed
    step's loss and gradient norm equal the uninterrupted run's (relative 1e-5) on every rank."""
    for r in world:
        assert int(r[f"resume/{name}_step"]) == step
        assert _rel(r[f"resume/{name}"], r["resume/a"][step - 1:step]) <= 1e-5
    assert len({tuple(r[f"resume/{name}"].ravel()) for r in world}) == 1  # the same outcome on every rank


def test_pp2_checkpoint_holds_the_pp1_model_for_export(world):
    """Export reads a checkpoint's whole model (``checkpoint.read_full_model``): the same weights saved
    by the two stages at PP=2 and by PP=1 x TP=2 x CP=2 give every tensor under the same name, bit for bit."""
    assert bool(world[0]["resume/export_same_names"]) and int(world[0]["resume/export_num_tensors"]) == 2 + 6 * 4
    assert bool(world[0]["resume/export_equal"])  # tied: no output layer


def test_vp_resumed_from_pp1_takes_the_same_steps_and_pp1_resumes_it(world):
    """PP=1 -> PP=2 x VP=2 (two chunks per rank, the interleaved schedule, the distributed optimizer over
    both chunks) gives A's losses and norms for steps 1-2, and PP=1 resuming its checkpoint A's step 3."""
    for r in world:
        assert int(r["resume/g_chunks"]) == 2 and int(r["resume/g_step"]) == 2 and int(r["resume/h_step"]) == 3
        assert r["resume/g"].shape == (2, 2) and _rel(r["resume/g"], r["resume/a"][:2]) <= 1e-5
        assert _rel(r["resume/h"], r["resume/a"][2:]) <= 1e-5
        assert int(r["resume/g_exchanges"]) > 0  # the ring carried each pack's shape
    assert len({tuple(r["resume/g"].ravel()) for r in world}) == 1  # every rank: the same step outcome


def test_vp_checkpoint_holds_the_pp1_model_for_export(world):
    """The chunks of PP=2 x VP=2 write every tensor under its global name: export reads the PP=1 model."""
    assert bool(world[0]["resume/vp_export_same_names"]) and bool(world[0]["resume/vp_export_equal"])


# ----- the #4092 trap: PP=3 with TP=2 on every stage, 6 ranks ------------------------------------------

def test_pp3_tp2_middle_stage_tp_ranks_equal_each_sample_alone(world6):
    """Megatron-LM #4092: both TP ranks of the middle stage of 3 honour the pack's boundaries."""
    middle = [r for r in world6 if int(r["pp3_tp2/pp_rank"]) == 1]
    assert len(middle) == 2  # the middle stage's two TP ranks
    for r in middle:
        assert int(r["pp3_tp2/trap_rows"]) >= 10
        assert float(r["pp3_tp2/trap_leaky_diff"]) > 1e-3
        assert float(r["pp3_tp2/trap_diff"]) <= 1e-5
    _assert_every_rank_saw_the_boundaries(world6, "pp3_tp2")


def test_pp3_tp2_step_equals_float64_reference_on_every_rank(world6):
    rank0 = world6[0]
    assert int(rank0["pp3_tp2/num_params"]) == 3 + 6 * 3
    assert int(rank0["pp3_tp2/num_grads"]) >= 3 + 6 * 3 - 1
    ref = float(rank0["pp3_tp2/ref_loss"])
    assert abs(float(rank0["pp3_tp2/loss"]) - ref) <= 1e-5 * ref
    assert float(rank0["pp3_tp2/grad_rel"]) <= 1e-5
    assert len({(float(r["pp3_tp2/loss"]), float(r["pp3_tp2/count"])) for r in world6}) == 1
    assert all(abs(float(r["pp3_tp2/eval_loss"]) - ref) <= 1e-5 * ref for r in world6)
    assert sorted(int(r["pp3_tp2/pp_rank"]) for r in world6) == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("case", [c[0] for c in VERIFY_CASES])
def test_verify_against_transformers_through_the_pipeline(world, case):
    """verify at PP=2 x TP=2 and PP=2 x VP=2 x CP=2: one rank (the last stage's first TP / CP rank) compares
    and prints, every rank returns its verdict; both stages ran megatron-core's schedule over P2P."""
    vp = next(c[2] for c in VERIFY_CASES if c[0] == case)
    fails = case.endswith("_fails")
    assert [int(r[f"{case}/rc"]) for r in world] == [int(fails)] * WORLD_SIZE
    printing = [i for i, r in enumerate(world) if str(r[f"{case}/out"])]
    assert printing == [2]  # the last stage's first TP / CP rank (stages are ranks 0-1 and 2-3)
    text = str(world[2][f"{case}/out"])
    assert f"at PP=2{' x VP=2' if vp else ''} " in text.splitlines()[0]
    packs = [line for line in text.splitlines() if line.startswith("pack ")]
    assert [line.split(":")[1].split(",")[0].strip() for line in packs] == ["3 samples", "2 samples"]
    assert all(line.endswith("FAIL" if fails else "PASS") for line in packs), text
    assert text.splitlines()[-1].endswith(": FAIL" if fails else ": PASS")
    schedule = INTERLEAVED if vp else ONE_F_ONE_B
    for r in world:  # two stages: every rank ran the pipelined schedule, once per pack, and exchanged shapes
        assert str(r[f"{case}/schedules"]) == repr([(schedule, 2)])
        assert int(r[f"{case}/shape_exchanges"]) > 0
