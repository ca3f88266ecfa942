"""Per-source loss, per-source target share and per-bucket tokens in the training metrics, on real
gloo ranks: world 1 and CP2 give the same numbers (1e-5), the per-source losses weighted by their
target counts give the lm loss, and the counts equal what the packs hold (read from the dataset,
not from the batch's token_source).

The same runs evaluate the held-out validation packs (``data.validation_fraction``) at their last
step: the validation loss per source equals a per-sample reference (each validation sample alone
through the trained model, losses summed per source in float64, sources read from the dataset),
and world 1 and CP2 agree (1e-5)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from _dist import spawn_world

PACK, STEPS, GBS = 64, 2, 2
VALIDATION_FRACTION = 0.2
NAMES = ("chat", "code")


def _records(n, seed, char):
    rng = np.random.default_rng(seed)
    return [{"prompt": "q" * int(rng.integers(1, 10)), "completion": char * int(rng.integers(5, 50))} for _ in range(n)]


def make_config(tmp: str, cp: int = 1):
    from megatron_pack.config import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, PackingConfig,
                                      ParallelConfig, TrainConfig)

    sources = [{"name": name, "input": f"{tmp}/{name}.jsonl", "weight": w} for name, w in (("chat", 0.7), ("code", 0.3))]
    return Config(data=DataConfig(source="files", sources=sources, dataset_dir=f"{tmp}/ds", tokenize_workers=1,
                                  validation_fraction=VALIDATION_FRACTION),
                  packing=PackingConfig(packed_sequence_size=PACK, pad_seq_to_mult=4, buckets=[24],
                                        bucket_order="sequential"),
                  model=ModelConfig(seq_length=PACK), parallel=ParallelConfig(context_parallel_size=cp),
                  train=TrainConfig(global_batch_size=GBS, train_iters=STEPS, output_dir=f"{tmp}/run{cp}", lr=1e-3,
                                    lr_warmup_iters=1),
                  checkpoint=CheckpointConfig(enabled=False), logging=LoggingConfig(tensorboard=False))


def _train(rank: int, world_size: int, tmp: str) -> dict:
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.data.batches.opening import open_validation
    from megatron_pack.training.eval import build_validation_loader
    from megatron_pack.training.loop import build_loader, run_training

    enable_cpu_compat_without_cuda()
    cfg = make_config(tmp, cp=world_size)
    state = initialize_parallel(cfg)
    dataset = PackedSFTDataset.from_config(cfg)
    loader = build_loader(cfg, state, dataset)
    order = loader.planner.epoch_order(0)[:STEPS * GBS]
    validation = build_validation_loader(cfg, state, open_validation(cfg, dataset))
    trainer = run_training(cfg, state, loader, validation=validation)
    last = trainer.history[-1]  # every run evaluates at its last step
    out = {"lm_loss": np.array([m.lm_loss for m in trainer.history]),
           "target_tokens": np.array([m.target_tokens for m in trainer.history]),
           "source_loss": np.array([[m.source_loss[n] for n in NAMES] for m in trainer.history]),
           "source_share": np.array([[m.source_target_share[n] for n in NAMES] for m in trainer.history]),
           "bucket_tokens": np.array([m.bucket_real_tokens for m in trainer.history]), "order": order,
           "buckets_of_order": np.array([dataset.pack_bucket(int(i)) for i in order]),
           "val_loss": np.array(last.val_loss),
           "val_source_loss": np.array([last.val_source_loss[n] for n in NAMES]),
           "val_source_tokens": np.array([last.val_source_target_tokens[n] for n in NAMES])}
    if world_size == 1:
        out.update(_per_sample_reference(trainer.model, validation))
    destroy_parallel()
    return out


def _per_sample_reference(model, validation) -> dict:
    """Each validation sample of the evaluated packs alone (a one-sample pack) through the trained
    model; loss sums and target counts per source (the dataset's ``source``) in float64."""
    import torch

    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.training.step import get_packed_seq_params

    while hasattr(model, "module"):
        model = model.module
    model.eval()
    sums, counts = np.zeros(len(NAMES)), np.zeros(len(NAMES))
    with torch.no_grad():
        for i in range(validation.num_packs):
            for sample in validation.dataset[i]:
                batch = collate_thd([sample], pack_size=PACK, pad_multiple=4)
                losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                               packed_seq_params=get_packed_seq_params(batch))
                mask = batch["loss_mask"] != 0
                sums[sample["source"]] += float(losses.double()[mask].sum())
                counts[sample["source"]] += int(mask.sum())
    return {"reference_val_sums": sums, "reference_val_counts": counts}


@pytest.mark.timeout(300)
def test_breakdowns_match_across_cp_and_the_packs(tmp_path):
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.prepare import prepare

    for name, seed, char in (("chat", 0, "a"), ("code", 1, "b")):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(60, seed, char)))
    cfg = make_config(str(tmp_path))
    prepare(cfg, progress=False)
    one = spawn_world(_train, 1, tmp_path / "w1", str(tmp_path))[0]
    cp2 = spawn_world(_train, 2, tmp_path / "w2", str(tmp_path))
    for key in ("lm_loss", "source_loss", "source_share"):
        np.testing.assert_allclose(cp2[0][key], one[key], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cp2[1][key], one[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cp2[0]["bucket_tokens"], one["bucket_tokens"])

    # the per-source losses, weighted by their target counts, are the lm loss
    weighted = (one["source_loss"] * one["source_share"]).sum(axis=1)
    np.testing.assert_allclose(weighted, one["lm_loss"], rtol=1e-6)

    # counts from the packs themselves (dataset samples and their sources), step by step
    ds = PackedSFTDataset.from_config(cfg)
    num_buckets = len(ds.metadata["buckets"]["per_bucket"])
    assert num_buckets == 2 and one["bucket_tokens"].shape == (STEPS, num_buckets)
    for step in range(STEPS):
        targets, bucket_tokens = np.zeros(2), np.zeros(num_buckets)
        for pack in one["order"][step * GBS:(step + 1) * GBS]:
            for s in ds[int(pack)]:
                targets[s["source"]] += s["loss_mask"][1:].sum()
                bucket_tokens[ds.pack_bucket(int(pack))] += len(s["input_ids"]) - 1
        assert targets.sum() == one["target_tokens"][step] > 0
        np.testing.assert_allclose(one["source_share"][step], targets / targets.sum(), rtol=1e-9)
        np.testing.assert_array_equal(one["bucket_tokens"][step], bucket_tokens)
    # bucket_order=sequential: the epoch reads bucket 0's packs before bucket 1's
    assert np.all(np.diff(one["buckets_of_order"]) >= 0)
    records = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    assert set(records[0]["source_loss"]) == {"chat", "code"} and len(records[0]["bucket_real_tokens"]) == 2

    # the validation plan holds every held-out sample once (not mixed: no repeats, none left out)
    from megatron_pack.data.batches.opening import open_validation

    validation = open_validation(cfg, ds)
    held = [s["sample_id"] for i in range(len(validation)) for s in validation[i]]
    assert len(held) == len(set(held)) == validation.metadata["split"]["num_samples_held_out"] == 24
    assert "mixture" not in validation.metadata and validation.source_names == list(NAMES)

    # validation per source: a per-sample reference, the same at CP2, and in metrics.jsonl
    sums, counts = one["reference_val_sums"], one["reference_val_counts"]
    assert np.all(counts > 20)  # guard: both sources hold validation targets
    np.testing.assert_array_equal(one["val_source_tokens"], counts)
    np.testing.assert_allclose(one["val_source_loss"], sums / counts, rtol=1e-5)
    np.testing.assert_allclose(one["val_loss"], sums.sum() / counts.sum(), rtol=1e-5)
    assert abs(one["val_source_loss"][0] - one["val_source_loss"][1]) > 1e-3  # the sources really differ
    for rank in cp2:
        np.testing.assert_allclose(rank["val_source_loss"], one["val_source_loss"], rtol=1e-5)
        np.testing.assert_allclose(rank["val_loss"], one["val_loss"], rtol=1e-5)
        np.testing.assert_array_equal(rank["val_source_tokens"], one["val_source_tokens"])
    assert "val_source_loss" not in records[0] and records[0]["val_loss"] is None
    last = records[-1]
    assert last["val_source_loss"] == pytest.approx(dict(zip(NAMES, one["val_source_loss"].tolist())), rel=1e-12)
    assert last["val_source_target_tokens"] == dict(zip(NAMES, counts.astype(int).tolist()))
    assert last["val_source_target_share"] == pytest.approx(dict(zip(NAMES, (counts / counts.sum()).tolist())))
