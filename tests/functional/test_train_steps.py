"""Planned steps and online packing through the real loop, on 2 gloo ranks (DP=2), CPU, float32.

1. ``packing.balance=dp`` moves packs between the DP ranks but trains the same global batch, so the
   per-step losses equal the round-robin run's (1e-5; only the gradient summation order differs);
   offline, and online with a global token budget on the stream source (moved packs carry their
   tokenized samples; the ranks train unequal numbers of micro-batches in some steps).
2. A token-budget run (``train.global_batch_tokens``, balanced) and an online run (store source,
   global token budget, balanced, 2 DataLoader workers per rank) killed after step 2 and resumed
   from their step-2 checkpoint give the uninterrupted run's losses and packs at steps 3-4, bit for bit.
4. Online packing through 2 pipeline stages (PP=2, DP=1) trains the packs of PP=1 on one rank with its
   losses and gradient norms (1e-5), on both stages, both starting from one checkpoint's weights.
3. The online step selection over the real gloo DP group, on hand-made packs: the global budget
   met round-robin within one pack, the balanced deal, packs moved between the ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

from _dist import spawn_world, sub_world

DATA = ["experiment=quickstart", "data.synthetic_num_samples=240", "parallel.context_parallel_size=1"]


@pytest.fixture(scope="module")
def prepared_dataset(tmp_path_factory) -> str:
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    dataset_dir = str(tmp_path_factory.mktemp("steps_data") / "synthetic")
    prepare(load_config(DATA + [f"data.dataset_dir={dataset_dir}"]), progress=False)
    return dataset_dir


def _run(dataset_dir: str, out: str, *extra: str, world_size: int = 2):
    from megatron_pack.config import load_config, validate
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_loader, run_training

    cfg = load_config(DATA + [f"data.dataset_dir={dataset_dir}", f"train.output_dir={out}", "train.train_iters=4",
                              "train.global_batch_size=4", "checkpoint.save_interval=2", "logging.tensorboard=false",
                              "train.adam_eps=1e-4", *extra], world_size=world_size)
    dataset = open_dataset(cfg)
    validate(cfg, world_size=world_size, dataset_meta=dict(dataset.metadata))
    state = initialize_parallel(cfg)
    trainer = run_training(cfg, state, build_loader(cfg, state, dataset))
    destroy_parallel()
    return trainer


def _packs(trainer) -> np.ndarray:
    return np.array([";".join(",".join(map(str, ids)) for ids in step) for step in trainer.pack_log])


class _HandFeed:
    """Rank ``r``'s ready packs with the given target tokens (cost = tokens), labelled ``"r:j"``."""

    def __init__(self, rank: int, tokens: list[int]):
        self.dp_rank, self.dp_size, self.num_shards, self.tokens = rank, 2, 1, tokens

    def start(self, states, next_worker):
        from megatron_pack.data.batches.online_feed import ReadyPack

        for j, t in enumerate(self.tokens):
            yield ReadyPack(batch={"label": f"{self.dp_rank}:{j}"}, pack=[(100 * self.dp_rank + j, t + 1)],
                            samples=None, target_tokens=t, real_tokens=t, cost=float(t), worker=0,
                            state={"finished_epochs": [], "epoch": 0})


HAND_TOKENS = [[5, 4, 9, 2, 8], [1, 3, 9, 7, 8]]
"""Budget 12. Step 1: 5 + 1 + 4 = 10, + 3 = 13 -> packs [2, 2]; costs (5, 1 | 4, 3) owned 9 / 4, balanced
{5, 1} / {4, 3}: rank 1's first pack moves to rank 0, rank 0's second to rank 1. Step 2: 9 + 9 -> [1, 1], no
move. Step 3: 2 + 7 = 9, + 8 = 17 -> [2, 1]; owned {2, 8} / {7}, balanced {7, 2} / {8}."""
HAND_EXPECTED = {"labels": [[["0:0", "1:0"], ["0:2"], ["1:3", "0:3"]], [["0:1", "1:1"], ["1:2"], ["0:4"]]],
                 "tokens": [13, 18, 17], "imbalance": [[9 / 6.5, 7 / 6.5], [1.0, 1.0], [10 / 8.5, 9 / 8.5]]}


def _hand_steps(rank: int) -> dict:
    import torch.distributed as dist

    from megatron_pack.data.batches.online import OnlineLoader
    from megatron_pack.parallel.groups import gather_objects

    loader = OnlineLoader(_HandFeed(rank, HAND_TOKENS[rank]), lambda samples: {"label": samples[0]["label"]},
                          packs_per_step=1, budget_tokens=12, balance="dp", gather=gather_objects(dist.group.WORLD),
                          samples_of=lambda moved: [{"label": f"{moved[0][0] // 100}:{moved[0][0] % 100}"}])
    labels, tokens, imbalance = [], [], []
    for _ in range(3):
        info = loader.begin_step()
        labels.append(",".join(next(loader)["label"] for _ in range(info.num_microbatches)))
        tokens.append(info.tokens)
        imbalance.append([info.imbalance_before, info.imbalance_after])
    return {"hand_labels": labels, "hand_tokens": tokens, "hand_imbalance": imbalance}


ONLINE = ("packing.mode=online", "packing.buffer_size=64", "train.global_batch_tokens=1200")


def _worker(rank: int, world_size: int, dataset_dir: str, tmp: str) -> dict:
    import multiprocessing

    # DataLoader workers start as under torchrun (a fresh process: fork on Linux), not as the spawned
    # parent of this test rank (spawn: every worker would import torch again, ~4 s per loader)
    multiprocessing.set_start_method("fork", force=True)
    out = _hand_steps(rank)
    for name, extra in (("rr", ()), ("bal", ("packing.balance=dp",)),
                        ("onrr", (*ONLINE, "packing.online_source=stream")),
                        ("onbal", (*ONLINE, "packing.online_source=stream", "packing.balance=dp"))):
        t = _run(dataset_dir, f"{tmp}/{name}", "checkpoint.enabled=false", *extra)
        out[f"{name}_losses"] = [m.lm_loss for m in t.history]
        out[f"{name}_target"] = [m.target_tokens for m in t.history]
        out[f"{name}_packs"] = _packs(t)
        out[f"{name}_imbalance"] = [[m.imbalance_before or 0.0, m.imbalance_after or 0.0] for m in t.history]
        out[f"{name}_counts"] = [len(step) for step in t.pack_log]
    for name, extra in (("budget", ("train.global_batch_tokens=1200", "packing.balance=dp")),
                        ("online", (*ONLINE, "packing.balance=dp", "data.num_workers=2"))):
        full = _run(dataset_dir, f"{tmp}/{name}_full", *extra)
        _run(dataset_dir, f"{tmp}/{name}_killed", "train.exit_after_iters=2", *extra)
        resumed = _run(dataset_dir, f"{tmp}/{name}_killed", *extra)
        out[f"{name}_full_losses"] = [m.lm_loss for m in full.history]
        out[f"{name}_resumed_losses"] = [m.lm_loss for m in resumed.history]
        out[f"{name}_full_target"] = [m.target_tokens for m in full.history]
        out[f"{name}_full_packs"] = _packs(full)
        out[f"{name}_resumed_packs"] = _packs(resumed)
    # online packing through 2 pipeline stages (DP=1): PP=1 at DP=1 (rank 0 alone) trains the same packs;
    # both start from one step-1 checkpoint's weights (a random init depends on the stages, as megatron-core's)
    with sub_world(rank, 1, tmp, "init") as member:
        if member:
            _run(dataset_dir, f"{tmp}/init", "train.train_iters=1", world_size=1)
    start = [f"checkpoint.load={tmp}/init/checkpoints", "checkpoint.load_weights_only=true"]
    for name, extra, size in (("onpp", ("parallel.pipeline_model_parallel_size=2",), 2), ("on1", (), 1)):
        with sub_world(rank, size, tmp, name) as member:
            if member:
                t = _run(dataset_dir, f"{tmp}/{name}", "checkpoint.enabled=false", *ONLINE,
                         "packing.online_source=stream", *start, *extra, world_size=size)
                out[f"{name}_losses"], out[f"{name}_packs"] = [m.lm_loss for m in t.history], _packs(t)
                out[f"{name}_norms"] = [m.grad_norm for m in t.history]
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_balanced_same_losses_and_planned_steps_resume_exactly(prepared_dataset, tmp_path):
    ranks = spawn_world(_worker, 2, tmp_path, prepared_dataset, str(tmp_path), timeout_s=480)
    r0, r1 = ranks
    # 1. the same global batch, dealt differently: the same losses (offline, and online with a token budget)
    for plain, balanced in (("rr", "bal"), ("onrr", "onbal")):
        np.testing.assert_allclose(r0[f"{balanced}_losses"], r0[f"{plain}_losses"], rtol=1e-5)
        np.testing.assert_array_equal(r0[f"{balanced}_target"], r0[f"{plain}_target"])
        moved = [set(a.split(";")) != set(b.split(";")) for a, b in zip(r0[f"{balanced}_packs"], r0[f"{plain}_packs"])]
        assert any(moved), f"{balanced}: balancing moved no pack between ranks: the comparison would be vacuous"
        for step in range(4):  # the union over ranks is the same set of packs
            assert (set(r0[f"{balanced}_packs"][step].split(";")) | set(r1[f"{balanced}_packs"][step].split(";"))
                    == set(r0[f"{plain}_packs"][step].split(";")) | set(r1[f"{plain}_packs"][step].split(";")))
        before, after = np.asarray(r0[f"{balanced}_imbalance"]).T
        assert np.all(after <= before + 1e-12) and np.all(before >= 1.0) and np.any(after < before)
    # online: the global budget is met (a pack holds < 512 target tokens); ranks train unequal counts in some step
    assert np.all(r0["onrr_target"] >= 1200) and np.all(r0["onrr_target"] < 1200 + 512), r0["onrr_target"]
    assert np.any(r0["onrr_counts"] != r1["onrr_counts"]) and np.any(r0["onbal_counts"] != r1["onbal_counts"])
    # 2. kill after step 2, resume from its checkpoint: steps 3-4 as the uninterrupted run
    for name in ("budget", "online"):
        for r in ranks:
            assert len(r[f"{name}_full_losses"]) == 4 and len(set(np.round(r[f"{name}_full_losses"], 6))) == 4
            np.testing.assert_array_equal(r[f"{name}_resumed_losses"], r[f"{name}_full_losses"][2:])
            np.testing.assert_array_equal(r[f"{name}_resumed_packs"], r[f"{name}_full_packs"][2:])
    target = np.asarray(r0["budget_full_target"])
    assert np.all(target >= 1200) and np.ptp(target) < 1200, target
    # 4. online packing at PP=2: the packs and losses (and gradient norms) of PP=1, on both stages
    for r in ranks:
        assert len(r["onpp_losses"]) == 4 and len(set(np.round(r["onpp_losses"], 6))) == 4
        np.testing.assert_array_equal(r["onpp_packs"], r0["on1_packs"])
        np.testing.assert_allclose(r["onpp_losses"], r0["on1_losses"], rtol=1e-5)
        np.testing.assert_allclose(r["onpp_norms"], r0["on1_norms"], rtol=1e-5)
    # 3. the hand-made case over the real gloo group
    for r in range(2):
        np.testing.assert_array_equal(ranks[r]["hand_labels"], [",".join(s) for s in HAND_EXPECTED["labels"][r]])
        np.testing.assert_array_equal(ranks[r]["hand_tokens"], HAND_EXPECTED["tokens"])
        np.testing.assert_allclose(ranks[r]["hand_imbalance"], HAND_EXPECTED["imbalance"], rtol=1e-12)
