"""Training throughput of packed THD vs a padded baseline, CP load balance, data share of a step.

On the tiny model (CPU, float32, one process, one torch thread) and the synthetic SFT set of the
quickstart preset (prepared into a temporary directory), measured in one run:

1. **Throughput.** The same samples trained (forward + backward) two ways, both with at most
   ``packing.packed_sequence_size`` token slots per micro-batch:
   - baseline: samples in dataset order, batched [B, S] and padded to the batch maximum
     (B * S <= budget), plain causal attention over each padded row;
   - packed: the offline plan's packs through ``collate_thd`` and THD attention.
   Prints effective (target) tokens/s of both, the measured ratio and the ideal ratio
   (baseline slots / real tokens, i.e. what removing all padding would give if cost followed
   slots). Target: measured >= 0.8 x ideal.
2. **CP load balance.** Per-rank causal attention work (a real query at position p of its
   sub-sequence attends p + 1 keys) for every pack of the plan, CP in (2, 4, 8): max / mean over
   ranks under the zigzag split (``thd_partition_indices``) vs a contiguous split (rank r keeps
   the r-th of CP equal chunks of every sub-sequence). Target: zigzag <= 1.02.
3. **Data share.** ``collate_thd`` + ``slice_thd_batch`` (CP=2, rank 0) time per pack as a share
   of the packed training step time per pack. Target: < 2%.

Run: ``.venv/bin/python bench/train_throughput.py [--num-packs 64] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

OVERRIDES = ["experiment=quickstart", "data.synthetic_num_samples=600"]
"""The quickstart preset (CP=2, so packs are padded to 4); the model runs in one process (CP=1)."""


def _setup(dataset_dir: str):
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.prepare import prepare
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import initialize_parallel

    cfg = load_config(OVERRIDES + [f"data.dataset_dir={dataset_dir}"])
    prepare(cfg, progress=False)
    one_process = load_config(OVERRIDES + [f"data.dataset_dir={dataset_dir}", "parallel=cp1"])
    state = initialize_parallel(one_process)
    return cfg, PackedSFTDataset.from_config(cfg), build_model(one_process, state)


def padded_batches(samples: list[dict], budget: int, pad_id: int) -> list[dict]:
    """Dataset-order [B, S] batches padded to the batch maximum with B * S <= budget."""
    batches, group = [], []

    def flush():
        width = max(len(s["input_ids"]) - 1 for s in group)
        rows = {k: np.full((len(group), width), v, dtype=d) for k, v, d in
                (("tokens", pad_id, np.int64), ("labels", pad_id, np.int64), ("loss_mask", 0, np.float32))}
        for i, s in enumerate(group):
            ids, mask, n = np.asarray(s["input_ids"]), np.asarray(s["loss_mask"]), len(s["input_ids"]) - 1
            rows["tokens"][i, :n], rows["labels"][i, :n], rows["loss_mask"][i, :n] = ids[:-1], ids[1:], mask[1:]
        batch = {k: torch.from_numpy(v) for k, v in rows.items()}
        batch["position_ids"] = torch.arange(width).expand(len(group), width).contiguous()
        batch["real"] = sum(len(s["input_ids"]) - 1 for s in group)
        batches.append(batch)

    for sample in samples:
        width = max([len(s["input_ids"]) - 1 for s in group + [sample]])
        if group and (len(group) + 1) * width > budget:
            flush()
            group = []
        group.append(sample)
    flush()
    return batches


def _time(model, batches: list[dict], packed: bool, repeats: int) -> float:
    """Best-of-``repeats`` seconds for forward + backward over ``batches``."""
    from megatron_pack.training.step import get_packed_seq_params

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for b in batches:
            params = get_packed_seq_params(b) if packed else None
            losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"], packed_seq_params=params)
            (losses * b["loss_mask"]).sum().backward()
        model.zero_grad(set_to_none=True)
        best = min(best, time.perf_counter() - start)
    return best


def throughput(cfg, dataset, model, num_packs: int, repeats: int) -> tuple[dict, float]:
    from megatron_pack.data.batches.thd import make_collate_fn

    collate = make_collate_fn(dataset.metadata)
    packs = [dataset[i] for i in range(num_packs)]
    samples = sorted((s for p in packs for s in p), key=lambda s: s["sample_id"])  # dataset order
    packed = [collate(p) for p in packs]
    padded = padded_batches(samples, cfg.packing.packed_sequence_size, int(dataset.metadata.get("pad_id", 0)))
    target = sum(float(b["loss_mask"].sum()) for b in packed)
    assert target == sum(float(b["loss_mask"].sum()) for b in padded)
    real = sum(b["num_real_tokens"] for b in packed)
    slots_padded = sum(b["tokens"].numel() for b in padded)
    slots_packed = sum(b["tokens"].numel() for b in packed)
    _time(model, packed[:2], True, 1)  # warm-up
    t_packed, t_padded = _time(model, packed, True, repeats), _time(model, padded, False, repeats)
    row = {"samples": len(samples), "target": target, "real": real, "packed_slots": slots_packed,
           "padded_slots": slots_padded, "num_packed": len(packed), "num_padded": len(padded),
           "eff_packed": target / t_packed, "eff_padded": target / t_padded,
           "measured": t_padded / t_packed, "ideal": slots_padded / real}
    return row, t_packed / len(packed)


def causal_work(cu_real: np.ndarray, cu_padded: np.ndarray, index: np.ndarray, real_only: bool = True) -> float:
    """Causal attention work of the query rows ``index``: a query at position p does p + 1.

    ``real_only`` counts real queries only (a kernel that skips padding); otherwise every slot
    counts (a kernel that computes whole padded chunks)."""
    seq = np.searchsorted(cu_padded, index, side="right") - 1
    pos = index - cu_padded[seq]
    keep = pos < (cu_real[seq + 1] - cu_real[seq]) if real_only else np.ones_like(pos, dtype=bool)
    return float((pos[keep] + 1).sum())


def contiguous_index(cu_padded: np.ndarray, cp: int, rank: int) -> np.ndarray:
    starts, lengths = cu_padded[:-1], np.diff(cu_padded)
    return np.concatenate([s + np.arange(rank * n // cp, (rank + 1) * n // cp) for s, n in zip(starts, lengths)])


def load_balance(dataset, cp_sizes=(2, 4, 8), num_packs: int = 200) -> list[dict]:
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.parallel.cp import thd_partition_indices

    rows = []
    for cp in cp_sizes:
        ratios = {f"{split}_{count}": [] for split in ("zigzag", "contiguous") for count in ("real", "slots")}
        for i in range(min(num_packs, len(dataset))):
            # the plan's pack padded to 2*CP (pack_size only bounds the result here)
            b = collate_thd(dataset[i], pack_size=4 * int(dataset.metadata["pack_size"]), pad_multiple=2 * cp)
            cu_r, cu_p = b["cu_seqlens"].numpy().astype(np.int64), b["cu_seqlens_padded"].numpy().astype(np.int64)
            for name, index_of in (("zigzag", lambda r: thd_partition_indices(b["cu_seqlens_padded"], cp, r).numpy()),
                                   ("contiguous", lambda r: contiguous_index(cu_p, cp, r))):
                for count in ("real", "slots"):
                    work = [causal_work(cu_r, cu_p, index_of(r), count == "real") for r in range(cp)]
                    ratios[f"{name}_{count}"].append(max(work) / np.mean(work))
        rows.append({"cp": cp, **{f"{k}_mean": float(np.mean(v)) for k, v in ratios.items()},
                     **{f"{k}_worst": float(np.max(v)) for k, v in ratios.items()}})
    return rows


def data_share(dataset, step_s_per_pack: float, num_packs: int, repeats: int) -> dict:
    from megatron_pack.data.batches.thd import make_collate_fn
    from megatron_pack.parallel.cp import slice_thd_batch

    collate = make_collate_fn(dataset.metadata)
    packs = [dataset[i] for i in range(num_packs)]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for p in packs:
            slice_thd_batch(collate(p), 2, 0)
        best = min(best, time.perf_counter() - start)
    per_pack = best / num_packs
    return {"collate_slice_us": 1e6 * per_pack, "step_ms": 1e3 * step_s_per_pack, "share": per_pack / step_s_per_pack}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-packs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, dataset, model = _setup(tmp + "/synthetic")
        t, step_per_pack = throughput(cfg, dataset, model, args.num_packs, args.repeats)
        print(f"throughput (tiny model, CPU fp32, 1 thread, {t['samples']} samples, budget "
              f"{cfg.packing.packed_sequence_size} slots per micro-batch)")
        print(f"  padded baseline: {t['num_padded']} batches, {t['padded_slots']} slots, "
              f"{t['eff_padded']:,.0f} target tok/s")
        print(f"  packed THD:      {t['num_packed']} packs,   {t['packed_slots']} slots, "
              f"{t['eff_packed']:,.0f} target tok/s")
        print(f"  measured ratio {t['measured']:.2f}x, ideal ratio (padded slots / real tokens) {t['ideal']:.2f}x, "
              f"measured / ideal {t['measured'] / t['ideal']:.2f} (target >= 0.8)")
        print("CP load balance: per-rank causal attention work, max / mean over ranks, mean over 200 packs "
              "(worst pack); target zigzag <= 1.02")
        print("        work counted on:  real tokens (padding skipped)       every slot (padded chunks computed)")
        for r in load_balance(dataset):
            cells = [f"{r[f'{split}_{count}_mean']:.4f} ({r[f'{split}_{count}_worst']:.3f})"
                     for count in ("real", "slots") for split in ("zigzag", "contiguous")]
            print(f"  CP={r['cp']}:  zigzag {cells[0]}  contiguous {cells[1]}   "
                  f"zigzag {cells[2]}  contiguous {cells[3]}")
        d = data_share(dataset, step_per_pack, args.num_packs, args.repeats)
        print(f"data share: collate + CP slice {d['collate_slice_us']:.0f} us/pack vs packed step "
              f"{d['step_ms']:.1f} ms/pack = {100 * d['share']:.2f}% (target < 2%)")


if __name__ == "__main__":
    main()
