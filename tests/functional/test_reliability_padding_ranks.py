"""A CP rank whose slice holds only padding: the step completes and its gradients are right.

Every collective of the step (K/V all-gather and its backward reduce-scatter, the loss
all-reduce, ``finalize_model_grads``) must be entered by every CP rank, whatever its slice holds.
A rank with no real query row used to return attention outputs that did not depend on the
gathered K/V, so its backward skipped the reduce-scatter its peers waited in: the step hung.

One spawned world of 4 gloo ranks (with a deadline: a hang fails the test instead of blocking
CI) runs each pack of ``CASES`` through the real step (``Trainer.compute_gradients``: forward,
backward, ``finalize_model_grads``) under its CP layout, and under DP=4 with the same pack on
every rank, which gives that pack's gradient without CP. Packs use ``pad_to_max_length`` (a
zero-length padding tail) and, for CP=4, ``pad_cu_seqlens``-style fixed cu_seqlens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import ListLoader, spawn_world

WORLD_SIZE = 4
CASES = {  # id -> (cp, pad multiple, THD lengths of the samples, pack size, cp ranks holding only padding)
    "cp2-one-rank-padding": (2, 4, [1, 1, 1, 1], 20, [1]),  # the repro: four 2-id samples
    "cp2-one-rank-padding-long-pack": (2, 4, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 48, [1]),
    "cp4-one-rank-padding": (4, 8, [3, 3, 2, 3], 40, [3]),
    "cp4-all-ranks-but-one-padding": (4, 8, [1, 1, 1], 32, [1, 2, 3]),
}
"""Real THD lengths below L / (2*CP) per chunk put every real token in the early chunks."""


def make_pack(case: str) -> dict:
    from megatron_pack.data.batches.thd import collate_thd

    cp, multiple, lengths, pack_size, _ = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    samples = []
    for i, n in enumerate(lengths):
        ids = rng.integers(3, 380, size=n + 1)
        ids[-1] = 2
        samples.append({"input_ids": ids.tolist(), "loss_mask": [0] + [1] * n, "sample_id": i})
    return collate_thd(samples, pack_size=pack_size, pad_multiple=multiple, pad_to_max_length=True,
                       num_cu_seqlens=len(lengths) + 3 if cp == 4 else None)


def real_tokens_per_rank(pack: dict, cp: int) -> list[int]:
    """How many real (non-padding) tokens each CP rank's slice holds (from cu_seqlens, not token values)."""
    from megatron_pack.parallel.cp import thd_partition_indices

    cu, cu_pad = pack["cu_seqlens"].tolist(), pack["cu_seqlens_padded"].tolist()
    real = torch.zeros(cu_pad[-1], dtype=torch.bool)
    for i in range(len(cu) - 1):
        real[cu_pad[i]:cu_pad[i] + cu[i + 1] - cu[i]] = True
    return [int(real[thd_partition_indices(pack["cu_seqlens_padded"], cp, r)].sum()) for r in range(cp)]


def _gradients(tmp: str, cp: int, pack: dict) -> dict:
    """main_grad after one real step on ``pack`` (every DP rank reads the same pack)."""
    from megatron_pack.config.schema import CheckpointConfig, Config, LoggingConfig, ParallelConfig, TrainConfig
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    dp = WORLD_SIZE // cp
    cfg = Config(parallel=ParallelConfig(context_parallel_size=cp),
                 train=TrainConfig(global_batch_size=dp, train_iters=1, output_dir=tmp),
                 checkpoint=CheckpointConfig(enabled=False), logging=LoggingConfig(tensorboard=False))
    state = initialize_parallel(cfg)
    trainer = build_trainer(cfg, state, ListLoader([pack]))
    total, _ = trainer.compute_gradients()
    out = {f"grad.{n}": p.main_grad.detach().clone() for n, p in trainer.model.module.named_parameters()}
    out.update(loss=total.lm_loss(), target_tokens=total.target_tokens)
    destroy_parallel()
    return out


def _world(rank: int, world_size: int, tmp: str) -> dict:
    out = {}
    for case, (cp, *_rest) in CASES.items():
        pack = make_pack(case)
        out.update({f"{case}.cp.{k}": v for k, v in _gradients(f"{tmp}/{case}-cp", cp, pack).items()})
        out.update({f"{case}.ref.{k}": v for k, v in _gradients(f"{tmp}/{case}-ref", 1, pack).items()})
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("padding_ranks")
    return spawn_world(_world, WORLD_SIZE, tmp, str(tmp), timeout_s=240)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_padding_only_cp_rank_designs(case):
    """Guard: the packs really put only padding on the ranks the case names (the others hold real tokens)."""
    cp, _, lengths, pack_size, padding_ranks = CASES[case]
    pack = make_pack(case)
    assert pack["tokens"].shape[-1] == pack_size and int(pack["cu_seqlens"][-1]) == sum(lengths)
    counts = real_tokens_per_rank(pack, cp)
    assert [r for r, n in enumerate(counts) if n == 0] == padding_ranks, counts


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_padding_only_cp_rank_step_completes_with_reference_gradients(ranks, case):
    cp = CASES[case][0]
    names = [k[len(f"{case}.ref."):] for k in ranks[0] if k.startswith(f"{case}.ref.grad.")]
    assert len(names) >= 10
    for r, result in enumerate(ranks):  # every rank, the padding-only ones included, finished the step
        got = {k[len(f"{case}.cp."):]: v for k, v in result.items() if k.startswith(f"{case}.cp.")}
        ref = {k[len(f"{case}.ref."):]: v for k, v in ranks[0].items() if k.startswith(f"{case}.ref.")}
        # every DP rank reads the same pack: the global count is DP times the pack's targets
        assert int(got["target_tokens"]) == (WORLD_SIZE // cp) * sum(CASES[case][2])
        assert int(ref["target_tokens"]) == WORLD_SIZE * sum(CASES[case][2])
        assert np.isfinite(got["loss"]) and float(got["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-6)
        for name in names:
            want = ref[name]
            err = float(np.abs(got[name] - want).max()) / max(float(np.abs(want).max()), 1e-30)
            assert err <= 1e-5, f"{case} rank {r} (cp rank {r % cp}) {name}: relative error {err:.2e}"
    assert max(float(np.abs(ranks[0][f"{case}.ref.{n}"]).max()) for n in names) > 0  # gradients really move
