"""Qwen2.5-VL through megatron-core on 4 gloo ranks, proved against transformers (tests/_vlm.py's tiny folder).

The parent process builds the folder and four VLM THD packs from transformers' image processor and
``get_rope_index`` per sample (``_vlm.reference_pack``, no code of ours), and transformers' logits of every
sample alone. One spawned world of 4 ranks then runs each layout (tp1_cp1 = DP 4, tp1_cp2 = DP 2,
tp2_cp1_sp = DP 2 with sequence parallelism), loading the folder with our streamed loader:

1. logits: the packed forward (vision tower -> features at the image tokens -> CP slice -> SP scatter ->
   GPTModel with M-RoPE), TP vocab shards and CP chunks gathered back, against transformers' forward of each
   sample alone, max abs diff <= 1e-4 on every position of every sample;
2. loss and gradients: ``forward_step`` (the trainer's) under megatron-core DDP + ``finalize_model_grads``
   over this DP rank's packs, every parameter's full gradient (the vision tower's included, with
   ``model.freeze_vision=false``) against rank 0's world-1 run of all packs, relative <= 1e-5. A DP rank gets
   a text-only pack and a CP rank's slice holds no image token (both guarded): their tower gradients are
   zero, not missing;
3. the trainer (schedule, DDP, optimizer) at CP=2 x DP=2: a step, its checkpoint exported and loaded by
   transformers (the frozen tower unchanged, the merger trained); at PP=2 x DP=2 (the tower on stage 0 only)
   the same first-step loss;
4. the default ``model.freeze_vision``: only the merger of the tower trains; a pack whose image-token count
   differs from its images' features is refused naming its sample ids;
5. ``megatron-pack verify``'s comparisons at each layout, through its forward-only schedule: its transformers
   reference per sample alone (images cut from the pack) PASSes, and packed equals each sample alone, its
   images with it and padded for the layout's CP slices (<= 1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pathlib import Path

from _dist import full_param, spawn_world

WORLD_SIZE = 4
PAD_MULTIPLE = 4  # 2*CP for cp2 (CP*TP = 2 for tp2_cp1_sp)
LAYOUTS = [("tp1_cp1", 1, 1, False), ("tp1_cp2", 1, 2, False), ("tp2_cp1_sp", 2, 1, True)]
LAYOUT_IDS = [c[0] for c in LAYOUTS]


def _packs(folder) -> tuple[list[dict], list[list[dict]]]:
    """Four packs (images in packs 0, 1, 3; none in pack 2) and their encoded samples."""
    import _vlm as V

    mixed = V.mixed_samples(folder)
    middle = V.encode_sample(folder, ["the answer is the answer is hello", V.make_image(28, 56, 4),
                                      "the answer is the answer is hello world"])
    text = V.encode_sample(folder, ["hello world what colour"])
    groups = [mixed, [mixed[1], mixed[2]], [text, mixed[1]], [middle]]
    return [V.reference_pack(g, PAD_MULTIPLE) for g in groups], groups


def _config(folder: str, tp: int, cp: int, sp: bool, freeze: bool = False):
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig

    cfg = Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=128, freeze_vision=freeze),
                 parallel=ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp))
    return apply_pretrained(cfg, [])


def _logits(model, batch, pg) -> torch.Tensor:
    """The whole pack's logits [T, V] (the path forward_step runs, without labels)."""
    from megatron_pack.model.vlm import mrope_positions, vlm_decoder_input
    from megatron_pack.parallel.groups import gather_full_logits
    from megatron_pack.training.step import get_packed_seq_params

    with torch.no_grad():
        decoder_input = vlm_decoder_input(model, batch, pg.cp_size, pg.cp_rank, torch.device("cpu"))
        logits = model(None, mrope_positions(batch, "cpu"), None, decoder_input=decoder_input,
                       packed_seq_params=get_packed_seq_params(batch))
    return gather_full_logits(logits, batch["cu_seqlens_padded"], pg)[0]


def _local_image_tokens(batch, pg, image_token_id: int) -> int:
    from megatron_pack.parallel.cp import slice_thd_batch

    return int((slice_thd_batch(batch, pg.cp_size, pg.cp_rank)["tokens"] == image_token_id).sum())


def _grads(model, pg, batches, *, ddp: bool) -> tuple[dict, float, list[int]]:
    """forward_step over this DP rank's packs (all packs without DDP); full grads / global count, loss."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_pack.training.step import forward_step

    mine = batches[pg.dp_rank::pg.dp_size] if ddp else batches
    run = model
    if ddp:
        run = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, average_in_collective=False, overlap_grad_reduce=False), model,
            pg_collection=pg.pg_collection)
        run.zero_grad_buffer()
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in mine:
        output, loss_fn = forward_step(iter([batch]), run)
        loss_sum, count, _ = loss_fn(output)
        loss_sum.backward()
        totals += torch.tensor([loss_sum.item(), float(count)], dtype=torch.float64)
    if ddp:
        finalize_model_grads([run], num_tokens=totals[1:].to(torch.float32).clone(), pg_collection=pg.pg_collection)
        dist.all_reduce(totals, group=pg.dp_cp_group)
        grads = {n: _gate_up_order(n, full_param(p.main_grad, p, pg), pg.tp_size) for n, p in model.named_parameters()}
    else:
        grads = {n: p.grad.detach() / totals[1].item() for n, p in model.named_parameters()}
    images = [_local_image_tokens(b, pg, model.image_token_id) for b in mine]
    return grads, float(totals[0] / totals[1]), images


def _gate_up_order(name: str, full: torch.Tensor, tp: int) -> torch.Tensor:
    """A TP-gathered linear_fc1 is [gate_0; up_0; gate_1; up_1] (each rank holds [gate_r; up_r]): put it back
    in the unsplit model's [gate; up] order."""
    if tp == 1 or not name.endswith("linear_fc1.weight"):
        return full
    halves = [shard.chunk(2, dim=0) for shard in full.chunk(tp, dim=0)]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def _vocab_rows(grad: torch.Tensor, shape) -> torch.Tensor:
    """The rows of a vocabulary-padded gradient that the unpadded model has."""
    return grad[: shape[0]] if grad.dim() and grad.shape[1:] == shape[1:] else grad


def _checks_at_default(folder, batches, pg) -> dict:
    """The default freeze, and the refusal of a count mismatch (rank 0, world-1 groups)."""
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.vlm import vlm_decoder_input

    model = build_model(_config(folder, 1, 1, False, freeze=True), pg)
    tower = model.vision_model
    trainable = sorted({n.split(".")[0] for n, p in tower.named_parameters() if p.requires_grad})
    broken = dict(batches[3], image_grid_thw=batches[3]["image_grid_thw"] * torch.tensor([1, 2, 1]),
                  pixel_values=torch.cat([batches[3]["pixel_values"]] * 2))
    try:
        vlm_decoder_input(model, broken, 1, 0, torch.device("cpu"))
        refusal = ""
    except ValueError as exc:
        refusal = str(exc)
    return {"trainable_tower": ",".join(trainable), "refusal": refusal,
            "num_language_trainable": sum(p.requires_grad for n, p in model.named_parameters()
                                          if not n.startswith("vision_model."))}


def _verify(model, pg, batches, reference, case_id: str, rank: int, image_token_id: int, merge: int) -> dict:
    """``megatron-pack verify``'s comparisons on the packs at this layout (megatron-core's forward-only schedule,
    ``schedule_logits``): against transformers (its reference per sample alone, images included) and packed
    against each sample alone in our model (``alone_batches``: the samples' images cut from the pack)."""
    from megatron_pack.cli.verify import alone_batches, compare_pack, compare_with_transformers, schedule_logits
    from megatron_pack.config.layout import pad_multiple

    multiple = pad_multiple(pg.cp_size, pg.tp_size, model.config.sequence_parallel)
    out, worst, passed, alone_worst, num_alone = {}, 0.0, 0, 0.0, 0
    for i, batch in enumerate(batches):
        cu = batch["cu_seqlens"].tolist()
        samples = [{"input_ids": [0] * (b - a + 1)} for a, b in zip(cu, cu[1:])]
        alone = alone_batches(samples, batch, pack_size=0, pad_id=0, pad_multiple=multiple, fixed=False,
                              vision=(image_token_id, merge))
        logits, _ = schedule_logits([model], [batch, *alone], pg, int(batch["tokens"].shape[-1]))
        if rank == 0:
            result = compare_with_transformers(logits[0], batch, reference, 301, i)
            worst, passed = max(worst, result.max_logit_diff), passed + result.passed(1e-4)
            self_result = compare_pack(logits[0], logits[1:], samples, batch, alone, index=i)
            alone_worst = max(alone_worst, self_result.max_logit_diff)
            num_alone += len(self_result.samples)
    if rank == 0:
        out[f"{case_id}/verify_transformers"], out[f"{case_id}/verify_passed"] = worst, passed
        out[f"{case_id}/verify_self"], out[f"{case_id}/verify_self_samples"] = alone_worst, num_alone
    return out


def _trainer_export(folder: str, batches: list[dict], root: str, rank: int) -> dict:
    """The trainer ``megatron-pack train`` builds (schedule, DDP, optimizer) at CP=2 x DP=2 takes one step on
    the 4 packs and saves its checkpoint; rank 0 exports it with ``megatron-pack export checkpoint=...``: the
    frozen tower leaves as it came, the merger and the language model as trained, and transformers loads it."""
    import dataclasses

    import torch.distributed as dist

    from _dist import ListLoader
    from megatron_pack.config.schema import TrainConfig
    from megatron_pack.model.hf.export import save_hf_source
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    cfg = _config(folder, 1, 2, False, freeze=True)
    cfg = dataclasses.replace(cfg, train=TrainConfig(seed=3, lr=1e-3, global_batch_size=4, train_iters=1,
                                                     lr_warmup_iters=0))
    state = initialize_parallel(cfg)
    trainer = build_trainer(cfg, state, ListLoader(batches[state.dp_rank::state.dp_size]))
    loss = trainer.train_step().lm_loss
    trained = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    if rank == 0:
        save_hf_source(folder, f"{root}/ckpt")
    dist.barrier()
    trainer.save(f"{root}/ckpt")
    destroy_parallel()
    if rank != 0:
        return {}
    import transformers as T
    from safetensors.torch import load_file

    from megatron_pack.cli.export import main

    assert main([f"checkpoint={root}/ckpt", f"output={root}/exported"]) == 0
    exported = {k: v for f in sorted(Path(root, "exported").glob("*.safetensors")) for k, v in load_file(f).items()}
    source = {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}
    tower = [k for k in source if k.startswith("visual.")]
    frozen = [k for k in tower if not k.startswith("visual.merger.")]
    T.Qwen2_5_VLForConditionalGeneration.from_pretrained(f"{root}/exported")  # loads, every tensor used
    return {"trainer/loss": loss, "trainer/num_tower": len(tower),
            "trainer/frozen_same": all(torch.equal(exported[k], source[k]) for k in frozen),
            "trainer/merger_trained": all(torch.equal(exported[k], trained["vision_model." + k[len("visual."):]])
                                          and not torch.equal(exported[k], source[k])
                                          for k in tower if k.startswith("visual.merger.")),
            "trainer/processor_kept": (Path(root, "exported", "preprocessor_config.json")).is_file()}


def _world_worker(rank: int, world_size: int, folder: str, batches: list[dict], refs: list[list[torch.Tensor]],
                  root: str) -> dict:
    import torch.distributed as dist

    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    from megatron_pack.cli.verify import _load_reference

    out, ref = {}, {}
    reference = _load_reference(folder)[0] if rank == 0 else None  # verify's own transformers reference
    for case_id, tp, cp, sp in LAYOUTS:
        pg = initialize_parallel(_config(folder, tp, cp, sp))
        if case_id == "tp1_cp1" and rank == 0:
            ref["grads"], ref["loss"], _ = _grads(build_model(_config(folder, 1, 1, False), pg), pg, batches,
                                                  ddp=False)
            out.update(_checks_at_default(folder, batches, pg))
        dist.barrier()
        model = build_model(_config(folder, tp, cp, sp), pg)
        diffs = []
        for batch, pack_refs in zip(batches, refs):
            logits, cu = _logits(model, batch, pg), batch["cu_seqlens_padded"].tolist()
            diffs += [float((logits[cu[i]:cu[i] + len(r) - 1, :r.shape[1]] - r[:-1]).abs().max())
                      for i, r in enumerate(pack_refs)]
        out.update(_verify(model, pg, batches, reference, case_id, rank, model.image_token_id,
                           model.vision_model.spatial_merge_size))
        grads, loss, images = _grads(model, pg, batches, ddp=True)
        flags = torch.tensor([int(any(n == 0 for n in images)), int(any(n > 0 for n in images))])
        dist.all_reduce(flags, group=pg.dp_cp_group)  # every rank's packs, over DP and CP
        if rank == 0:
            out[f"{case_id}/logits"] = max(diffs)
            out[f"{case_id}/num_compared"] = sum(len(r) - 1 for rs in refs for r in rs)
            out[f"{case_id}/loss_rel"] = abs(loss - ref["loss"]) / abs(ref["loss"])
            real = {n: _vocab_rows(grads[n], g.shape) for n, g in ref["grads"].items()}  # TP=2: 302 rows, 1 pad
            out[f"{case_id}/grad_rel"] = max(float((real[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                                             for n, g in ref["grads"].items())
            out[f"{case_id}/num_grads"] = sum(float(g.abs().max()) > 0 and real[n].shape == g.shape
                                              for n, g in ref["grads"].items())
            out[f"{case_id}/pad_grads"] = max(float(grads[n][g.shape[0]:].abs().sum()) for n, g in ref["grads"].items())
            out[f"{case_id}/num_vision_grads"] = sum(n.startswith("vision_model.") for n in grads)
            out[f"{case_id}/ranks_without_image"], out[f"{case_id}/ranks_with_image"] = flags.tolist()
        destroy_parallel()
    out.update(_trainer_export(folder, batches, root, rank))
    out.update(_pipeline_loss(folder, batches))
    return out


def _pipeline_loss(folder: str, batches: list[dict]) -> dict:
    """The trainer at PP=2 x DP=2 (the tower on stage 0, M-RoPE on both) logs the first step's loss of CP=2."""
    import dataclasses

    from _dist import ListLoader
    from megatron_pack.config.schema import ParallelConfig, TrainConfig
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    cfg = _config(folder, 1, 1, False, freeze=True)
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(pipeline_model_parallel_size=2),
                              train=TrainConfig(seed=3, lr=1e-3, global_batch_size=4, train_iters=1, lr_warmup_iters=0))
    state = initialize_parallel(cfg)
    trainer = build_trainer(cfg, state, ListLoader(batches[state.dp_rank::state.dp_size]))
    placed = torch.tensor([int(hasattr(trainer.model.module, "vision_model") == (state.pp_rank == 0))])
    torch.distributed.all_reduce(placed, op=torch.distributed.ReduceOp.MIN)  # every rank of both stages
    loss = trainer.train_step().lm_loss
    destroy_parallel()
    return {"pp2/loss": loss, "pp2/tower_on_stage0_only": bool(placed.item())}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    import _vlm as V

    root = tmp_path_factory.mktemp("vlm")
    folder = V.make_vlm(root)
    batches, groups = _packs(folder)
    refs = [[V.reference_logits(folder, s) for s in g] for g in groups]
    return spawn_world(_world_worker, WORLD_SIZE, root, str(folder), batches, refs, str(root))[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", LAYOUT_IDS)
def test_logits_equal_transformers(world, case):
    assert int(world[f"{case}/num_compared"]) > 150  # every text and image position of 4 packs
    assert float(world[f"{case}/logits"]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("case", LAYOUT_IDS)
def test_loss_and_gradients_unchanged_across_layouts(world, case):
    assert int(world[f"{case}/num_vision_grads"]) == 30  # patch embedding, 2 blocks x 12, merger 5
    assert int(world[f"{case}/num_grads"]) == int(world["tp1_cp1/num_grads"]) == 47  # every parameter, non-zero
    assert float(world[f"{case}/pad_grads"]) == 0.0  # the TP vocabulary padding rows learn nothing
    assert float(world[f"{case}/loss_rel"]) <= 1e-5
    assert float(world[f"{case}/grad_rel"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp1_cp1", "tp1_cp2"])
def test_a_rank_without_image_tokens_joins(world, case):
    # tp1_cp1: DP rank 2 trains the text-only pack; tp1_cp2: a CP rank's chunks miss the middle image
    assert int(world[f"{case}/ranks_without_image"]) >= 1 and int(world[f"{case}/ranks_with_image"]) >= 1


@pytest.mark.slow
def test_freeze_vision_default_and_count_refusal(world):
    assert world["trainable_tower"] == "merger"
    assert int(world["num_language_trainable"]) == 17  # 2 layers x 7 (QKV bias) + embedding, final norm, output
    assert "sample_ids [0]" in str(world["refusal"]) and "image tokens" in str(world["refusal"])


@pytest.mark.slow
@pytest.mark.parametrize("case", LAYOUT_IDS)
def test_verify_against_transformers_and_alone(world, case):
    assert int(world[f"{case}/verify_passed"]) == 4  # every pack PASSes verify's transformers comparison
    assert float(world[f"{case}/verify_transformers"]) <= 1e-4
    assert int(world[f"{case}/verify_self_samples"]) == 8 and float(world[f"{case}/verify_self"]) <= 1e-5


if __name__ == "__main__":  # print every number the tests assert on
    import tempfile
    from pathlib import Path

    import _vlm as V

    root = Path(tempfile.mkdtemp())
    folder = V.make_vlm(root)
    batches, groups = _packs(folder)
    refs = [[V.reference_logits(folder, s) for s in g] for g in groups]
    for key, value in sorted(spawn_world(_world_worker, WORLD_SIZE, root, str(folder), batches, refs,
                                         str(root))[0].items()):
        print(f"{key}: {value}")



@pytest.mark.slow
def test_trainer_checkpoint_exports_to_transformers(world):
    assert np.isfinite(float(world["trainer/loss"])) and int(world["trainer/num_tower"]) == 30
    assert bool(world["trainer/frozen_same"]) and bool(world["trainer/merger_trained"])
    assert bool(world["trainer/processor_kept"])


@pytest.mark.slow
def test_pipeline_stages_train_the_same_first_step(world):
    assert bool(world["pp2/tower_on_stage0_only"])
    assert abs(float(world["pp2/loss"]) - float(world["trainer/loss"])) <= 1e-5 * abs(float(world["trainer/loss"]))
