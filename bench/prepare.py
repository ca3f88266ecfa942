"""Benchmark: `prepare` end to end on the synthetic set (tokenize -> token store -> plan -> report).

Each measurement runs in a fresh process (clean peak RSS). Printed: samples/s, tokens/s, peak RSS
of the main process and of the largest worker, and ratios against baselines measured in the
same run: one tokenize worker on the first 100k samples, and re-planning the finished store at
another seed (which must not re-tokenize). Target: peak RSS < 2 GB for 1M samples.

    .venv/bin/python bench/prepare.py [--num-samples 1000000] [--pack-size 4096] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(args) -> None:
    from megatron_pack.config import Config, DataConfig, PackingConfig
    from megatron_pack.data.store.atomic import read_json
    from megatron_pack.data.prepare import prepare

    cfg = Config(data=DataConfig(source="synthetic", synthetic_num_samples=args.num_samples,
                                 dataset_dir=args.dataset_dir, tokenize_workers=args.workers),
                 packing=PackingConfig(packed_sequence_size=args.pack_size, seed=args.seed))
    start = time.perf_counter()
    plan_dir = prepare(cfg, progress=False)
    seconds = time.perf_counter() - start
    store = read_json(Path(args.dataset_dir) / "metadata.json")
    plan = read_json(plan_dir / "metadata.json")
    print(json.dumps({"seconds": seconds, "num_samples": store["num_samples"], "num_tokens": store["num_tokens"],
                      "tokenize_seconds": store["tokenize_seconds"], "workers": store["num_tokenize_workers"],
                      "packs": plan["num_bins"], "lower_bound": plan["lower_bound_bins"],
                      "efficiency": plan["packing_efficiency"],
                      "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))


def run(num_samples: int, dataset_dir: Path, workers: int, pack_size: int, seed: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", "--num-samples", str(num_samples), "--dataset-dir", str(dataset_dir),
           "--workers", str(workers), "--pack-size", str(pack_size), "--seed", str(seed)]
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["wall_seconds"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=1_000_000)
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--dataset-dir")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.child:
        return child(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_prepare_"))
    base_n = min(100_000, args.num_samples)
    base = run(base_n, work / "baseline", 1, args.pack_size)
    full = run(args.num_samples, work / "full", 0, args.pack_size)
    replan = run(args.num_samples, work / "full", 0, args.pack_size, seed=1)
    print(f"synthetic set, pack size {args.pack_size}, {full['workers']} tokenize workers, work dir {work}")
    print(f"{'run':<34} {'samples':>10} {'seconds':>8} {'samples/s':>10} {'tokens/s':>11} {'RSS main':>9} {'RSS worker':>10}")
    for name, r in (("baseline: 1 worker", base), ("prepare (all workers)", full), ("re-plan, seed 1 (same store)", replan)):
        print(f"{name:<34} {r['num_samples']:>10,} {r['seconds']:>8.1f} {r['num_samples'] / r['seconds']:>10,.0f} "
              f"{r['num_tokens'] / r['seconds']:>11,.0f} {r['rss_main_mb']:>7.0f}MB {r['rss_worker_mb']:>8.0f}MB")
    speed = (full["num_samples"] / full["seconds"]) / (base["num_samples"] / base["seconds"])
    print(f"throughput vs 1 worker: {speed:.2f}x; tokenize share of prepare: {full['tokenize_seconds'] / full['seconds']:.0%}")
    print(f"re-plan at a new seed: {replan['seconds']:.2f} s = {full['seconds'] / replan['seconds']:.0f}x faster than "
          f"the full prepare (no re-tokenization); packs {full['packs']:,} (lower bound {full['lower_bound']:,}), "
          f"efficiency {full['efficiency']}%")
    peak = max(full["rss_main_mb"], full["rss_worker_mb"])
    print(f"peak RSS {peak:.0f} MB per process (target < 2048 MB): {'OK' if peak < 2048 else 'OVER'}")


if __name__ == "__main__":
    main()
