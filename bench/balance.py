"""Benchmark: packs balanced over data-parallel ranks (``packing.balance=dp``).

1. ``--fit``: the cost model. Forward + backward of the tiny model (CPU, float32, one thread) on
   packs of 512 tokens cut into sub-sequences of 16 .. 512 tokens, and on partly filled packs;
   least squares ``time = c + a * real + b * sum(len^2)`` gives ``b / a`` (the default
   ``packing.cost_b`` with ``cost_a = 1``).
2. Simulation at DP 8, 64 and 512 (8 packs per rank per step), lognormal and bimodal length
   mixes packed by BFD into 4096-token packs: max/mean per-rank cost before (round-robin) and
   after balancing, and the projected step-time saving ``1 - max_after / max_before`` (the step
   waits for the slowest rank); and at PP 4 and 8 the slowest rank's pipelined cost
   ``(sum + (PP-1) * largest pack) / PP`` of the deal balanced by sums and by that cost.
3. On this machine, DP=2: the per-rank compute time of each step's packs (tiny model, measured
   one rank after the other in one process, interleaved with and without balancing, best of
   ``--repeats``), and the spread max/mean of the two ranks' times.

    .venv/bin/python bench/balance.py [--fit] [--steps 20] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

from megatron_pack.data.packing.algorithms import plan_packing
from megatron_pack.data.packing.balance import assign_balanced, pack_cost, rank_loads, round_robin

PACK = 4096


def mix(name: str, rng: np.random.Generator, n: int) -> np.ndarray:
    if name == "lognormal":  # SFT-like: median ~300, a long tail to the pack size
        x = rng.lognormal(np.log(300), 1.2, n)
    else:  # bimodal: 80% short chat turns (~150), 20% long documents (~2500)
        x = np.where(rng.random(n) < 0.8, rng.normal(150, 40, n), rng.normal(2500, 700, n))
    return np.clip(x, 8, PACK).astype(np.int64)


def _pack_costs(dp: int, mix_name: str, steps: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    num_packs = 8 * dp * steps
    lengths = mix(mix_name, rng, int(num_packs * PACK / 500))
    bins = plan_packing(lengths, PACK, "bfd", seed=seed).bins()[:num_packs]
    return np.array([pack_cost(lengths[b]) for b in bins])


def simulate_pipelined(dp: int, pp: int, mix_name: str, steps: int, seed: int = 0) -> dict:
    """At ``pp`` stages: the largest per-rank pipelined cost, (sum + (pp-1) * max) / pp, summed over
    steps, of round-robin, the deal balanced by plain sums and the deal balanced on the pipelined cost."""
    costs = _pack_costs(dp, mix_name, steps, seed)
    total = {"round-robin": 0.0, "sums": 0.0, "pipelined": 0.0}
    for s in range(len(costs) // (8 * dp)):
        c = costs[s * 8 * dp:(s + 1) * 8 * dp]
        for name, deal in (("round-robin", round_robin(len(c), dp)), ("sums", assign_balanced(c, dp)),
                           ("pipelined", assign_balanced(c, dp, pp))):
            total[name] += rank_loads(c, deal, pp).max()
    return {"vs_round_robin": 1 - total["pipelined"] / total["round-robin"],
            "vs_sums": 1 - total["pipelined"] / total["sums"], "sums_vs_round_robin": 1 - total["sums"] / total["round-robin"]}


def simulate(dp: int, mix_name: str, steps: int, seed: int = 0) -> dict:
    costs = _pack_costs(dp, mix_name, steps, seed)
    before, after, max_b, max_a = [], [], [], []
    for s in range(len(costs) // (8 * dp)):
        c = costs[s * 8 * dp:(s + 1) * 8 * dp]
        lb, la = rank_loads(c, round_robin(len(c), dp)), rank_loads(c, assign_balanced(c, dp))
        before.append(lb.max() / lb.mean())
        after.append(la.max() / la.mean())
        max_b.append(lb.max())
        max_a.append(la.max())
    return {"dp": dp, "mix": mix_name, "before": float(np.mean(before)), "after": float(np.mean(after)),
            "worst_after": float(np.max(after)), "saving": 1 - float(np.sum(max_a) / np.sum(max_b))}


def _model():
    from megatron_pack.config import load_config
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import initialize_parallel

    enable_cpu_compat_without_cuda()
    cfg = load_config(["experiment=quickstart", "parallel=cp1"])
    return build_model(cfg, initialize_parallel(cfg))


def _pack(seqlens: list[int], rng: np.random.Generator) -> dict:
    from megatron_pack.data.batches.thd import collate_thd

    samples = [{"input_ids": rng.integers(1, 250, n + 1).tolist(), "loss_mask": [1] * (n + 1), "sample_id": i}
               for i, n in enumerate(seqlens)]
    return collate_thd(samples, pack_size=max(512, sum(seqlens)), pad_multiple=1)


def _fb_time(model, packs: list[dict], repeats: int) -> float:
    from megatron_pack.training.step import get_packed_seq_params

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for b in packs:
            out = model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                        packed_seq_params=get_packed_seq_params(b))
            (out * b["loss_mask"]).sum().backward()
        model.zero_grad(set_to_none=True)
        best = min(best, time.perf_counter() - start)
    return best


def fit(model, repeats: int) -> tuple[float, float]:
    """Least squares over pack shapes, each timed as the best of ``repeats`` rounds that visit every
    shape once (interleaved, so a burst of load on the shared machine hits all shapes alike)."""
    rng = np.random.default_rng(0)
    shapes = [[L] * (512 // L) for L in (16, 32, 64, 128, 256, 512)] + [[128], [256], [384], [64] * 3, [32] * 12]
    packs = [_pack(seqlens, rng) for seqlens in shapes]
    _fb_time(model, packs[:2], 1)
    best = np.full(len(shapes), np.inf)
    for _ in range(repeats):
        for i, pack in enumerate(packs):
            best[i] = min(best[i], _fb_time(model, [pack], 1))
    rows = np.array([[1.0, sum(q), sum(n * n for n in q)] for q in shapes])
    for seqlens, t in zip(shapes, best):
        print(f"  {len(seqlens):3d} x {seqlens[0]:3d} tokens: {1000 * t:7.2f} ms")
    (c, a, b), *_ = np.linalg.lstsq(rows, best, rcond=None)
    print(f"fit: time = {1000 * c:.3f} ms + {1e6 * a:.3f} us * real + {1e9 * b:.4f} ns * sum(len^2) "
          f"-> cost_b / cost_a = {b / a:.6f} (1/{a / b:.0f})")
    return a, b


def dp2_spread(model, steps: int, repeats: int) -> None:
    """Per-rank compute time of DP=2 steps (4 packs each) of the quickstart synthetic set."""
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.batches.steps import pack_stats
    from megatron_pack.data.batches.thd import make_collate_fn
    from megatron_pack.data.prepare import prepare

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(["experiment=quickstart", "data.synthetic_num_samples=1500", f"data.dataset_dir={tmp}/ds"])
        prepare(cfg, progress=False)
        ds = PackedSFTDataset.from_config(cfg)
        stats = pack_stats(ds)
        costs = stats.cost(cfg.packing.cost_a, cfg.packing.cost_b)
        collate = make_collate_fn(ds.metadata)
        order = np.random.default_rng(0).permutation(len(ds))
        spread = {"round-robin": [], "balanced": []}
        step_time = {"round-robin": [], "balanced": []}
        for s in range(min(steps, len(ds) // 8)):
            packs = order[s * 8:(s + 1) * 8]
            batches = {int(p): collate(ds[int(p)]) for p in packs}
            for name, deal in (("round-robin", round_robin(8, 2)), ("balanced", assign_balanced(costs[packs], 2))):
                t = [_fb_time(model, [batches[int(p)] for p in packs[d]], repeats) for d in deal]
                spread[name].append(max(t) / np.mean(t))
                step_time[name].append(max(t))
        for name in spread:
            print(f"  DP=2 {name:11s}: per-rank time max/mean {np.mean(spread[name]):.3f} (worst "
                  f"{np.max(spread[name]):.3f}), slowest rank {1000 * np.mean(step_time[name]):.1f} ms/step")
        print(f"  step time balanced / round-robin: "
              f"{np.sum(step_time['balanced']) / np.sum(step_time['round-robin']):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fit", action="store_true", help="measure the cost model first")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-measure", action="store_true", help="the simulation only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("simulation: 8 packs of 4096 per rank per step, max/mean rank cost, mean over steps")
    for mix_name in ("lognormal", "bimodal"):
        for dp in (8, 64, 512):
            r = simulate(dp, mix_name, steps=max(2, args.steps // (dp // 8)))
            print(f"  {mix_name:9s} DP={dp:3d}: round-robin {r['before']:.3f} -> balanced {r['after']:.4f} "
                  f"(worst {r['worst_after']:.4f}); projected step-time saving {100 * r['saving']:.1f}%")
    print("with pipeline stages: slowest rank's (sum + (PP-1) * largest pack) / PP, summed over steps")
    for mix_name in ("lognormal", "bimodal"):
        for dp, pp in ((8, 4), (64, 4), (8, 8)):
            r = simulate_pipelined(dp, pp, mix_name, steps=max(2, args.steps // (dp // 8)))
            print(f"  {mix_name:9s} DP={dp:3d} PP={pp}: saving vs round-robin: balanced by sums "
                  f"{100 * r['sums_vs_round_robin']:.1f}%, by the pipelined cost {100 * r['vs_round_robin']:.1f}% "
                  f"({100 * r['vs_sums']:.2f}% over the sums' deal)")
    if args.no_measure:
        return
    model = _model()
    if args.fit:
        fit(model, args.repeats)
    dp2_spread(model, args.steps, args.repeats)


if __name__ == "__main__":
    main()
