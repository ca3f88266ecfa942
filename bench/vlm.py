"""Vision-language packing: prepare throughput with images, packed vs padded training, the vision tower's share.

On the tiny Qwen2.5-VL of docs/models.md ("A tiny folder for `experiment=vlm_tiny`", its snippet run as
written into a temporary folder), CPU, float32, one process, one torch thread, measured in one run:

1. **prepare with images.** ``megatron-pack prepare`` of ``--records`` TRL chat records, each with one image
   part referring to one of 200 PNG files of random sizes (28..112 px a side), against the same records
   without their image parts (the baseline), one tokenize worker each. Prepare reads each image's header, checks
   its structure, hashes it and computes its token count from its size (no pixel work), so this is the cost
   of images at prepare. Prints records/s of both and the ratio.
2. **Packed vs padded.** The ``vlm_tiny`` synthetic set (colour-image questions mixed with text-only samples):
   the offline plan's packs against the same samples in dataset order batched [B, S] and padded to the batch's
   longest (B * S <= the pack size; laid out as THD rows whose every sub-sequence is padded to S, so the linear
   layers compute every padded slot), both through the VLM step (vision tower, features into the embeddings,
   M-RoPE, forward and backward). Prints real tokens/s of both, the ratio, and the ideal ratio (padded slots /
   packed slots).
3. **The vision tower's share** of the packed step: the tower's forward and backward on each pack's images
   against the whole step.

Run: ``.venv/bin/python bench/vlm.py [--records 10000] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def tiny_vlm(work: Path) -> Path:
    """models/tiny-vlm in ``work``, by docs/models.md's snippet as written."""
    doc = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", doc.split("## A tiny folder for `experiment=vlm_tiny`", 1)[1], re.S)
    cwd = os.getcwd()
    try:
        os.chdir(work)
        torch.manual_seed(0)
        exec(compile(code.group(1), "docs/models.md", "exec"), {})
    finally:
        os.chdir(cwd)
    return work / "models" / "tiny-vlm"


def _records(work: Path, num_records: int, images: bool) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    (work / "img").mkdir(exist_ok=True)
    for k in range(200):
        path = work / "img" / f"{k}.png"
        if not path.exists():
            w, h = (int(x) for x in rng.integers(28, 113, size=2))
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    lines = []
    for i in range(num_records):
        question = [{"type": "text", "text": f"what colour is it {i}"}]
        parts = [{"type": "image", "image": f"img/{i % 200}.png"}] + question if images else question
        lines.append(json.dumps({"messages": [{"role": "user", "content": parts},
                                              {"role": "assistant", "content": "a red square"}]}))
    path = work / ("images.jsonl" if images else "text.jsonl")
    path.write_text("\n".join(lines) + "\n")
    return path


def prepare_throughput(work: Path, folder: Path, num_records: int) -> dict:
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    out = {}
    for name, images in (("text", False), ("images", True)):
        data = _records(work, num_records, images)
        cfg = load_config(["data=files", f"data.input={data}", f"data.tokenizer={folder}",
                           f"data.dataset_dir={work}/ds_{name}", "packing.packed_sequence_size=256",
                           "model.seq_length=256", "data.tokenize_workers=1"])
        start = time.perf_counter()
        prepare(cfg, progress=False)
        out[name] = num_records / (time.perf_counter() - start)
    return out


def _setup_training(work: Path):
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.prepare import prepare
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import initialize_parallel

    overrides = ["experiment=vlm_tiny", f"model.pretrained={work}/models/tiny-vlm", f"data.dataset_dir={work}/vlm",
                 "data.synthetic_num_samples=256"]
    cfg = load_config(overrides)
    prepare(cfg, progress=False)
    one = load_config(overrides + ["parallel=cp1"])
    state = initialize_parallel(one)
    return cfg, PackedSFTDataset.from_config(cfg), build_model(one, state), state


def _step(model, batch: dict, state) -> None:
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.training.step import get_packed_seq_params, model_inputs

    local = slice_thd_batch(batch, 1, 0)
    tokens, positions, extra = model_inputs(model, batch, local, 1, 0, state.device)
    losses = model(tokens, positions, None, labels=local["labels"], packed_seq_params=get_packed_seq_params(batch),
                   **extra)
    (losses * local["loss_mask"]).sum().backward()


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def padded_groups(samples: list[dict], budget: int) -> list[list[dict]]:
    """Dataset-order groups of B samples whose [B, S] padded batch (S the longest) fits ``budget`` slots."""
    groups, group = [], []
    for sample in samples:
        width = max(len(s["input_ids"]) - 1 for s in group + [sample])
        if group and (len(group) + 1) * width > budget:
            groups.append(group)
            group = []
        group.append(sample)
    return groups + [group]


def packed_vs_padded(cfg, dataset, model, state, repeats: int) -> dict:
    from megatron_pack.data.batches.loader import dataset_collate
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.data.batches.vlm import with_images
    from megatron_pack.model.vlm import image_features

    collate = dataset_collate(cfg, dataset)
    packs = [dataset[i] for i in range(len(dataset))]
    packed = [collate(p) for p in packs]
    samples = sorted((s for p in packs for s in p), key=lambda s: s["sample_id"])
    images = dataset.store_metadata["images"]
    padded = []
    for group in padded_groups(samples, cfg.packing.packed_sequence_size):
        width = max(len(s["input_ids"]) - 1 for s in group)
        rows = len(group) * width
        padded.append(with_images(lambda g, w=width, n=rows: collate_thd(g, pack_size=n, pad_multiple=w), group,
                                  processor_dir=str(dataset.store_metadata["tokenizer_path"]),
                                  merge_size=int(images["merge_size"])))
    real = sum(int(b["cu_seqlens"][-1]) for b in packed)
    assert real == sum(int(b["cu_seqlens"][-1]) for b in padded)
    for b in packed[:2]:
        _step(model, b, state)  # warm-up
    t_packed = _best(lambda: [_step(model, b, state) for b in packed], repeats)
    t_padded = _best(lambda: [_step(model, b, state) for b in padded], repeats)

    def tower_only():
        for b in packed:
            features = image_features(model.vision_model, b, state.device)
            if features is not None:
                features.sum().backward()

    t_tower = _best(tower_only, repeats)
    model.zero_grad(set_to_none=True)
    return {"real": real, "num_samples": len(samples), "num_images": sum(int(b["image_grid_thw"].shape[0])
                                                                          for b in packed),
            "packed_slots": sum(b["tokens"].numel() for b in packed), "num_packed": len(packed),
            "padded_slots": sum(b["tokens"].numel() for b in padded), "num_padded": len(padded),
            "packed_tok_s": real / t_packed, "padded_tok_s": real / t_padded, "tower_share": t_tower / t_packed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda

    enable_cpu_compat_without_cuda()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = tiny_vlm(work)
        p = prepare_throughput(work, folder, args.records)
        print(f"prepare, {args.records} TRL chat records, one tokenize worker:")
        print(f"  text only:           {p['text']:,.0f} records/s")
        print(f"  one image each:      {p['images']:,.0f} records/s  ({p['images'] / p['text']:.2f}x the text rate; "
              "header, structure check, sha256 and token count per image, no pixel work)")
        cfg, dataset, model, state = _setup_training(work)
        t = packed_vs_padded(cfg, dataset, model, state, args.repeats)
        print(f"training step (tiny Qwen2.5-VL, CPU fp32, 1 thread, {t['num_samples']} samples, {t['num_images']} "
              f"images, {cfg.packing.packed_sequence_size}-slot micro-batches, forward + backward):")
        print(f"  padded [B, S]: {t['num_padded']} batches, {t['padded_slots']} slots, {t['padded_tok_s']:,.0f} real tok/s")
        print(f"  packed THD:    {t['num_packed']} packs,   {t['packed_slots']} slots, {t['packed_tok_s']:,.0f} real tok/s")
        print(f"  measured ratio {t['packed_tok_s'] / t['padded_tok_s']:.2f}x, ideal (padded slots / packed slots) "
              f"{t['padded_slots'] / t['packed_slots']:.2f}x")
        print(f"vision tower (forward + backward on each pack's images): {100 * t['tower_share']:.1f}% of the packed "
              "step")


if __name__ == "__main__":
    main()
