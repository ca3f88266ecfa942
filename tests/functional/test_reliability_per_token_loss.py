"""Gradients at DP=2 against a float64 plain-torch reference, with per-token loss on and off.

``model.calculate_per_token_loss=false`` used to be accepted with packing and trained another
objective: at DP=2 every gradient came out at exactly 0.5x the token-weighted mean's
(megatron-core's DDP pre-scaled by 1/DP, then the loop still divided by the global token count).
``validate()`` now refuses it whenever packing is on (tests/unit/test_config_validate.py), and the
step passes ``num_tokens`` to ``finalize_model_grads`` only with per-token loss, as
megatron-core's schedules do, so the key does what it says on every path:

* on:  the gradient of sum(token losses) / (target tokens of the global batch);
* off: megatron-core's objective, the mean over the global batch's packs of each pack's mean.

One spawned world of 2 gloo ranks (DP=2, two packs of very different target counts per rank)
runs one real step (``Trainer.compute_gradients``) each way; the reference (tests/_float64_gpt.py)
runs every sample alone in float64 from the same initial weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import ListLoader, spawn_world
from _float64_gpt import TINY, logits, sample_loss, to_float64

DP, PACKS_PER_RANK = 2, 2


def make_samples(seed: int = 11) -> list[list[dict]]:
    """DP * PACKS_PER_RANK packs; pack k holds 1 + k samples, so target counts differ a lot."""
    rng = np.random.default_rng(seed)
    packs, sample_id = [], 0
    for k in range(DP * PACKS_PER_RANK):
        pack = []
        for _ in range(1 + 2 * k):
            n = int(rng.integers(6, 24))
            ids = rng.integers(3, 380, size=n)
            ids[-1] = 2
            mask = [0] * (n // 2) + [1] * (n - n // 2)
            pack.append({"input_ids": ids.tolist(), "loss_mask": mask, "sample_id": sample_id})
            sample_id += 1
        packs.append(pack)
    return packs


def rank_packs(dp_rank: int) -> list[list[dict]]:
    packs = make_samples()
    return packs[dp_rank * PACKS_PER_RANK:(dp_rank + 1) * PACKS_PER_RANK]


def _step(tmp: str, dp_rank: int, *, per_token: bool) -> tuple[dict, dict]:
    from megatron_pack.config.schema import (CheckpointConfig, Config, LoggingConfig, ModelConfig, TrainConfig)
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    cfg = Config(model=ModelConfig(calculate_per_token_loss=per_token),
                 train=TrainConfig(global_batch_size=DP * PACKS_PER_RANK, train_iters=1, output_dir=tmp),
                 checkpoint=CheckpointConfig(enabled=False), logging=LoggingConfig(tensorboard=False))
    state = initialize_parallel(cfg)
    batches = [collate_thd(p, pack_size=512) for p in rank_packs(dp_rank)]
    trainer = build_trainer(cfg, state, ListLoader(batches))
    params = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    trainer.compute_gradients()
    grads = {n: p.main_grad.detach().clone() for n, p in trainer.model.module.named_parameters()}
    destroy_parallel()
    return params, grads


def _alone_logits(tmp: str) -> torch.Tensor:
    """megatron-core's logits of the first sample run alone (checks the float64 reference itself)."""
    from megatron_pack.config.schema import Config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cfg = Config()
    state = initialize_parallel(cfg)
    model = build_model(cfg, state)
    batch = collate_thd(make_samples()[0][:1], pack_size=512)
    with torch.no_grad():
        out = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=get_packed_seq_params(batch))
    destroy_parallel()
    return out[0]


def _world(rank: int, world_size: int, tmp: str) -> dict:
    out = {}
    for tag, per_token in (("on", True), ("off", False)):
        params, grads = _step(f"{tmp}/{tag}", rank, per_token=per_token)
        out.update({f"{tag}.grad.{n}": g for n, g in grads.items()})
    out.update({f"param.{n}": p for n, p in params.items()})  # the same initial weights both ways (seeded)
    out["alone_logits"] = _alone_logits(f"{tmp}/alone")
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("per_token_loss")
    return spawn_world(_world, DP, tmp, str(tmp), timeout_s=240)


def _reference(params: dict, objective: str) -> dict[str, np.ndarray]:
    """float64 gradient of the global batch's token-weighted mean ('on') or mean of pack means ('off')."""
    p = to_float64(params)
    pack_sums, pack_counts = [], []
    for pack in make_samples():
        sums_counts = [sample_loss(p, s["input_ids"], s["loss_mask"]) for s in pack]
        pack_sums.append(sum(s for s, _ in sums_counts))
        pack_counts.append(sum(c for _, c in sums_counts))
    if objective == "on":
        loss = sum(pack_sums) / sum(pack_counts)
    else:
        loss = sum(s / c for s, c in zip(pack_sums, pack_counts)) / len(pack_sums)
    loss.backward()
    return {n: t.grad.numpy() for n, t in p.items()}


def _max_rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30)


@pytest.mark.slow
def test_float64_reference_matches_megatron_logits(ranks):
    """Guard: the reference is the same model (a wrong reference would make the next test meaningless)."""
    params = {k[len("param."):]: torch.from_numpy(v) for k, v in ranks[0].items() if k.startswith("param.")}
    sample = make_samples()[0][0]
    want = logits(to_float64(params), sample["input_ids"][:-1], TINY).detach().numpy()
    got = ranks[0]["alone_logits"]
    assert got.shape == want.shape and got.shape[0] == len(sample["input_ids"]) - 1
    assert _max_rel(got, want) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["on", "off"], ids=["per-token-loss", "no-per-token-loss"])
def test_dp2_gradients_match_float64_reference(ranks, objective):
    params = {k[len("param."):]: torch.from_numpy(v) for k, v in ranks[0].items() if k.startswith("param.")}
    counts = [sum(int(np.sum(s["loss_mask"][1:])) for s in pack) for pack in make_samples()]
    assert max(counts) >= 4 * min(counts) > 0  # the two objectives really differ
    ref = _reference(params, objective)
    other = _reference(params, "off" if objective == "on" else "on")
    assert len(ref) >= 10
    for rank in ranks:
        for name, want in ref.items():
            got = rank[f"{objective}.grad.{name}"]
            assert _max_rel(got, want) <= 1e-5, f"{objective} {name}: {_max_rel(got, want):.2e} " \
                                                f"(ratio of norms {np.linalg.norm(got) / np.linalg.norm(want):.3f})"
    differs = sum(_max_rel(other[n], ref[n]) > 1e-2 for n in ref)
    assert differs >= len(ref) // 2  # the check can tell the two objectives apart
