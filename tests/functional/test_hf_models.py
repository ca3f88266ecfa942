"""Pretrained Hugging Face models through megatron-core, proved against transformers.

One spawned world of 4 gloo ranks runs every family (tests/_hf.py: Llama with llama3 rope scaling
and GQA, Llama tied, Qwen2 QKV bias, Qwen3 QK norm, Mistral) at every layout (tp1_cp1, tp2_cp1,
tp1_cp2, tp2_cp2_sp), loading the weights with our streamed TP-sliced loader:

1. logits: our packed THD forward (TP vocab shards + CP zigzag chunks gathered back) against
   transformers' forward of each sample alone, max abs diff <= 1e-4 on every real token;
2. loss: our per-token loss sum (padded vocabulary masked) against cross entropy of
   transformers' logits (float64), relative <= 1e-5;
3. round trip: at TP=2 both ranks' shards exported back to HF names equal the source
   safetensors bit for bit (same keys, same dtypes); and through a training checkpoint written
   at tp2_cp2_sp (every rank calls ``save_checkpoint`` as the trainer does), exported in one
   process by ``megatron-pack export checkpoint=...``.

The same world runs a Qwen3-MoE folder (test_moe.py's) at CP=2 x DP=2 with EP=2 (so the expert-data-parallel
group has 2 ranks, which the 2-rank worlds of test_moe.py never reach): logits of a padded pack of several
samples, and of each sample packed alone, against transformers (<= 1e-4); and at DP=4 x EP=2 (expert-DP 2) two
training steps with the distributed optimizer equal the plain optimizer's.

The reference (transformers) is computed in the parent process, which shares no code with ours.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import spawn_world
from _hf import FAMILIES, VOCAB, hf_logits, make_family

WORLD_SIZE = 4
LAYOUTS = [("tp1_cp1", 1, 1, False), ("tp2_cp1", 2, 1, False), ("tp1_cp2", 1, 2, False), ("tp2_cp2_sp", 2, 2, True)]
LAYOUT_IDS = [c[0] for c in LAYOUTS]
PACK_SIZE, PAD_MULTIPLE = 96, 4
CASES = [f"{family}/{layout}" for family in FAMILIES for layout in LAYOUT_IDS]


def _samples() -> list[list[int]]:
    """One pack of 4 samples of mixed lengths (ids end with eos=2)."""
    rng = np.random.default_rng(5)
    return [rng.integers(3, VOCAB, size=n).tolist() + [2] for n in (11, 23, 6, 30)]


def _config(folder: str, tp: int, cp: int, sp: bool):
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig

    cfg = Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=PACK_SIZE),
                 parallel=ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp))
    return apply_pretrained(cfg, [])


def _full_logits(logits, batch, pg):
    from megatron_pack.parallel.groups import gather_full_logits

    return gather_full_logits(logits, batch["cu_seqlens_padded"], pg)[0]


def _round_trip(model, cfg, pg, folder: str) -> tuple[bool, int]:
    """Export both TP ranks' shards back to HF names; (bit-identical to the source?, tensors compared)."""
    import glob

    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_pack.config.hf_config import read_hf_config
    from megatron_pack.model.hf.export import hf_tensors

    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    shards = [None] * pg.tp_size
    dist.all_gather_object(shards, mine, group=pg.tp_group)
    exported = hf_tensors(shards, read_hf_config(folder)["model_type"], cfg.model)
    source = {}
    for file in sorted(glob.glob(f"{folder}/*.safetensors")):
        source.update(load_file(file))
    same = sorted(exported) == sorted(source) and all(
        exported[k].dtype == source[k].dtype and torch.equal(exported[k], source[k]) for k in source)
    return same, len(source)


def _save_checkpoint(model, pg, folder: str, rank: int) -> None:
    """The trainer's checkpoint (``resharding.sharded_state`` through ``save_checkpoint``, every rank, with the
    layout the trainer records) plus hf_source, next to the folder."""
    from megatron_pack.model.hf.export import save_hf_source
    from megatron_pack.training.checkpoint import save_checkpoint
    from megatron_pack.training.resharding import sharded_state
    from megatron_pack.training.trainer_checkpoint import layout

    root = f"{folder}_ckpt"
    if rank == 0:
        save_hf_source(folder, root)
    save_checkpoint(root, 1, sharded_state=sharded_state(model, {}), rank_state={}, meta=layout(pg))


def _run(folder: str, tp: int, cp: int, sp: bool, batch, refs, rank: int) -> dict:
    import torch.distributed as dist

    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cfg = _config(folder, tp, cp, sp)
    pg = initialize_parallel(cfg)
    try:
        model = build_model(cfg, pg)
        model.eval()
        local = slice_thd_batch(batch, pg.cp_size, pg.cp_rank)
        params = get_packed_seq_params(batch)
        with torch.no_grad():
            logits = _full_logits(model(local["tokens"], local["position_ids"], None, packed_seq_params=params),
                                  batch, pg)
            losses = model(local["tokens"], local["position_ids"], None, packed_seq_params=params,
                           labels=local["labels"])
        loss_sum = (losses.double() * local["loss_mask"].double()).sum().reshape(1)
        dist.all_reduce(loss_sum, group=pg.cp_group)
        out = {"padded_vocab": logits.shape[-1]}
        cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
        diffs = [float((logits[cu_pad[i]:cu_pad[i] + len(ref), :VOCAB] - ref).abs().max()) for i, ref in enumerate(refs)]
        out["max_diff"], out["num_tokens"] = max(diffs), sum(len(r) for r in refs)
        out["pad_logits_masked"] = bool(torch.isinf(logits[:, VOCAB:]).all()) if logits.shape[-1] > VOCAB else True
        out["loss_sum"] = float(loss_sum)
        if tp == 2 and cp == 1:
            out["round_trip"], out["num_round_trip"] = _round_trip(model, cfg, pg, folder)
        if sp:
            _save_checkpoint(model, pg, folder, rank)
        return out if rank == 0 else {}
    finally:
        destroy_parallel()


def _worker(rank: int, world_size: int, folders: dict, refs: dict) -> dict:
    from megatron_pack.data.batches.thd import collate_thd

    samples = _samples()
    batch = collate_thd([{"input_ids": s, "loss_mask": [1] * len(s)} for s in samples], pack_size=PACK_SIZE,
                        pad_multiple=PAD_MULTIPLE)
    out = {}
    for family in FAMILIES:
        for layout, tp, cp, sp in LAYOUTS:
            result = _run(folders[family], tp, cp, sp, batch, refs[family], rank)
            out.update({f"{family}/{layout}/{k}": v for k, v in result.items()})
    out.update(_moe_run(folders["moe"], refs["moe"]))
    out.update(_moe_verify(folders["moe"]))
    out.update(_moe_distributed_optimizer(folders["moe"], rank))
    return out


def _moe_distributed_optimizer(folder: str, rank: int) -> dict:
    """DP=4 x EP=2 (expert-DP 2: each rank's experts sharded over 2 ranks): 2 steps with and without
    ``ddp.use_distributed_optimizer``, each rank its own pack per step; (loss, grad norm, lb) per step and weights."""
    from test_moe import _pack, _trainer

    from megatron_pack.parallel.groups import destroy_parallel
    from megatron_pack.training.chunks import core_model

    rng = np.random.default_rng(21 + rank)
    packs = [_pack([rng.integers(3, 97, size=int(n)).tolist() + [2] for n in rng.integers(4, 14, size=2)])
             for _ in range(2)]
    out, weights = {}, {}
    for name, flag in (("plain", False), ("distopt", True)):
        trainer = _trainer(folder, 2, packs, flag)
        steps = [trainer.train_step() for _ in range(2)]
        out[f"moe/dp4_ep2/{name}"] = np.array([[m.lm_loss, m.grad_norm, m.moe["load_balancing_loss"]] for m in steps])
        weights[name] = {n: p.detach().clone() for n, p in core_model(trainer.model).named_parameters()}
        if flag:  # the experts' buffer is sharded over the 2 expert-DP ranks
            out["moe/dp4_ep2/expert_shard_ranks"] = np.array([part.data_parallel_group.size() for part in trainer.optimizer.parts])
        destroy_parallel()
    out["moe/dp4_ep2/num_expert_weights"] = sum(".local_experts." in n for n in weights["plain"])
    out["moe/dp4_ep2/weights_diff"] = max(float((weights["distopt"][n] - w).abs().max())
                                          for n, w in weights["plain"].items())
    return out


def _moe_run(folder: str, refs: list) -> dict:
    """A MoE model at CP=2 x DP=2, EP=2: the largest logit difference against transformers, packed and alone."""
    from test_moe import _config, _logit_diffs, _pack
    from test_moe import _samples as moe_samples

    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    pg = initialize_parallel(_config(folder, cp=2, ep=2))
    try:
        model = build_model(_config(folder, cp=2, ep=2), pg).eval()
        samples = moe_samples()
        return {"moe/ep2_cp2_dp2/groups": np.array([pg.dp_size, pg.cp_size, pg.pg_collection.ep.size(),
                                                    pg.pg_collection.expt_dp.size(),
                                                    len(model.decoder.layers[0].mlp.experts.local_experts)]),
                "moe/ep2_cp2_dp2/packed": _logit_diffs(model, pg, _pack(samples), refs),
                "moe/ep2_cp2_dp2/alone": max(_logit_diffs(model, pg, _pack([s]), [r]) for s, r in zip(samples, refs))}
    finally:
        destroy_parallel()


def _moe_verify(folder: str) -> dict:
    """``megatron-pack verify verify.reference=transformers`` (``cli.verify.run_verify``) at EP=2 x CP=2 x DP=2:
    its exit code and the lines this rank printed."""
    import dataclasses

    from _hf import MemoryPacks
    from test_moe import PACK_SIZE as MOE_PACK_SIZE
    from test_moe import _config
    from test_moe import _samples as moe_samples

    from megatron_pack.cli.verify import run_verify
    from megatron_pack.config.schema import VerifyConfig

    samples = moe_samples()
    cfg = dataclasses.replace(_config(folder, cp=2, ep=2), verify=VerifyConfig(reference="transformers", num_packs=2))
    lines: list[str] = []
    rc = run_verify(cfg, dataset=MemoryPacks([samples[:2], samples[2:]], pack_size=MOE_PACK_SIZE, pad_multiple=4),
                    out=lines.append)
    return {"verify_ep2/rc": rc, "verify_ep2/out": "\n".join(lines)}


def _reference_loss(logits: list[torch.Tensor], samples: list[list[int]]) -> float:
    total = 0.0
    for lg, ids in zip(logits, samples):
        total += float(torch.nn.functional.cross_entropy(lg.double(), torch.tensor(ids[1:]), reduction="sum"))
    return total


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_models")
    folders = {f: str(make_family(root, f, seed=i)) for i, f in enumerate(FAMILIES)}
    samples = _samples()
    refs = {f: hf_logits(folders[f], [s[:-1] for s in samples]) for f in FAMILIES}
    from test_moe import _hf_model
    from test_moe import _samples as moe_samples

    folders["moe"] = str(root / "qwen3_moe")
    _hf_model("qwen3_moe").save_pretrained(folders["moe"])
    refs["moe"] = hf_logits(folders["moe"], [s[:-1] for s in moe_samples()])
    ranks = spawn_world(_worker, WORLD_SIZE, root, folders, refs)
    out = ranks[0]
    out["moe_distopt_ranks"] = [{k: v for k, v in r.items() if k.startswith("moe/dp4_ep2/")} for r in ranks]
    out["verify_ep2_ranks"] = [{k: v for k, v in r.items() if k.startswith("verify_ep2/")} for r in ranks]
    out["folders"] = folders
    out["ref_loss"] = {f: _reference_loss(refs[f], samples) for f in FAMILIES}
    for case in CASES:  # the numbers behind docs/models.md (pytest -s shows them)
        print(f"{case}: max |logit diff| vs transformers {float(out[f'{case}/max_diff']):.2e}")
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(world, case):
    assert int(world[f"{case}/num_tokens"]) == sum(len(s) - 1 for s in _samples())  # every real token compared
    assert float(world[f"{case}/max_diff"]) <= 1e-4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_logits_match_transformers_at_ep2_cp2_dp2(world):
    # DP 2, CP 2, EP 2, expert-DP 2, 2 of the 4 experts on each rank
    assert world["moe/ep2_cp2_dp2/groups"].tolist() == [2, 2, 2, 2, 2]
    assert float(world["moe/ep2_cp2_dp2/packed"]) <= 1e-4 and float(world["moe/ep2_cp2_dp2/alone"]) <= 1e-4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_verify_against_transformers_at_ep2_cp2_dp2(world):
    """verify at EP=2 x CP=2 x DP=2: rank 0 compares and prints (routing only the real tokens), every rank PASSes."""
    ranks = world["verify_ep2_ranks"]
    assert [int(r["verify_ep2/rc"]) for r in ranks] == [0] * WORLD_SIZE
    assert [bool(str(r["verify_ep2/out"])) for r in ranks] == [True, False, False, False]
    text = str(ranks[0]["verify_ep2/out"])
    assert "at PP=1 TP=1 CP=2 EP=2 DP=2 " in text.splitlines()[0]
    packs = [line for line in text.splitlines() if line.startswith("pack ")]
    assert len(packs) == 2 and all(line.endswith("PASS") for line in packs), text
    for line in packs:  # "pack 0: 2 samples, 30 real tokens ... routed 30/30 real tokens"
        real = line.split(" real tokens")[0].rsplit(" ", 1)[1]
        assert f"routed {real}/{real} real tokens" in line, line
    assert text.splitlines()[-1].endswith(": PASS")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_distributed_optimizer_shards_experts_over_expert_dp(world):
    """DP=4 x EP=2: the distributed optimizer (dense state over DP 4, experts over expert-DP 2) takes the plain
    optimizer's steps on every rank: losses, gradient norms, load-balancing losses (relative 1e-5), weights."""
    for r in world["moe_distopt_ranks"]:
        assert r["moe/dp4_ep2/expert_shard_ranks"].tolist() == [4, 2]
        plain, distopt = r["moe/dp4_ep2/plain"], r["moe/dp4_ep2/distopt"]
        assert plain.shape == (2, 3) and np.all(plain > 0) and not np.allclose(plain[0], plain[1], rtol=1e-3)
        np.testing.assert_allclose(distopt, plain, rtol=1e-5, atol=0)
        assert int(r["moe/dp4_ep2/num_expert_weights"]) > 0 and float(r["moe/dp4_ep2/weights_diff"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES)
def test_loss_matches_transformers_with_padded_vocab(world, case):
    tp = 2 if "/tp2" in case else 1
    assert int(world[f"{case}/padded_vocab"]) == -(-VOCAB // tp) * tp  # 302 at TP=2: the pad row exists
    assert bool(world[f"{case}/pad_logits_masked"])
    want = world["ref_loss"][case.split("/")[0]]
    assert abs(float(world[f"{case}/loss_sum"]) - want) / want <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_at_tp2_is_bit_exact(world, family):
    assert int(world[f"{family}/tp2_cp1/num_round_trip"]) >= 15  # every tensor of the folder compared
    assert bool(world[f"{family}/tp2_cp1/round_trip"])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
def test_export_of_a_tp2_cp2_checkpoint_is_bit_exact(world, family, tmp_path):
    import glob

    from safetensors.torch import load_file

    from megatron_pack.cli.export import main as export_main

    folder = world["folders"][family]
    assert export_main([f"checkpoint={folder}_ckpt", f"output={tmp_path / 'out'}"]) == 0

    def tensors(path):
        out = {}
        for file in sorted(glob.glob(f"{path}/*.safetensors")):
            out.update(load_file(file))
        return out

    source, exported = tensors(folder), tensors(tmp_path / "out")
    assert len(source) >= 15 and sorted(source) == sorted(exported)
    assert all(exported[k].dtype == source[k].dtype and torch.equal(exported[k], source[k]) for k in source)
