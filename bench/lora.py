"""Peak memory per rank and step time: full fine-tuning against LoRA (peft=lora), TP=2 on CPU.

A random Llama-shaped folder (hidden 1024, 8 layers, FFN 2816, GQA 16/4, vocabulary 32,000,
untied: 155M parameters, 0.62 GB in float32) is written once (``megatron_pack.model.hf.synthetic``).
Each case then runs in two fresh gloo processes (TP=2, float32, the trainer of ``megatron-pack
train``: megatron-core DDP + AdamW), on the same 1024-token packs (4 samples each):

- baseline, in the same run: full fine-tuning (every parameter trains);
- LoRA: ``peft=lora`` at Megatron-Bridge's default (rank 32, alpha 32, all four linears).

Per rank: the peak RSS above the process baseline taken after imports (VmHWM, reset through
/proc/self/clear_refs), from building the model through the timed steps; the bytes of gradient
buffers and optimizer state; the median step time of the timed steps (after one warm-up step).
Prints LoRA / full ratios. Run: ``.venv/bin/python bench/lora.py [--steps 3] [--keep]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
          "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "hidden_act": "silu"}
PACK, TP = 1024, 2


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _packs(num: int) -> list[dict]:
    import numpy as np

    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(0)
    packs = []
    for _ in range(num):
        samples = [{"input_ids": rng.integers(3, 32000, size=250).tolist() + [2], "loss_mask": [0] * 50 + [1] * 201}
                   for _ in range(4)]
        packs.append(collate_thd(samples, pack_size=PACK, pad_multiple=4))
    return packs


def _rank(rank: int, folder: str, mode: str, steps: int, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(TP), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, TP), rank=rank, world_size=TP)
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import (CheckpointConfig, Config, LoggingConfig, ModelConfig, ParallelConfig,
                                             PeftConfig, TrainConfig)
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.data.batches.protocol import BatchList
    from megatron_pack.training.loop import build_trainer

    enable_cpu_compat_without_cuda()
    cfg = apply_pretrained(Config(
        model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=PACK, params_dtype="float32"),
        parallel=ParallelConfig(tensor_model_parallel_size=TP),
        train=TrainConfig(global_batch_size=1, train_iters=steps + 1, lr=1e-4, min_lr=1e-5, lr_warmup_iters=0,
                          output_dir=str(Path(out).parent)),
        checkpoint=CheckpointConfig(enabled=False), logging=LoggingConfig(tensorboard=False),
        peft=PeftConfig(method="lora" if mode == "lora" else "none")), [])
    state = initialize_parallel(cfg)
    import gc

    gc.collect()
    baseline = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    trainer = build_trainer(cfg, state, BatchList(_packs(steps + 1)))
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        trainer.train_step()
        if i:
            times.append(time.perf_counter() - start)
    model = trainer.model.module
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in model.parameters()
                if getattr(p, "main_grad", None) is not None)
    optim = sum(v.numel() * v.element_size() for s in trainer.optimizer.states
                for v in s.values() if torch.is_tensor(v))
    result = {"peak_mb": (_kib("VmHWM") - baseline) / 1024, "step_s": statistics.median(times),
              "params_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "grads_mb": grads / 2**20, "optim_mb": optim / 2**20, "loss": trainer.history[-1].lm_loss}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _case(folder: str, mode: str, steps: int, tmp: Path) -> list[dict]:
    import torch.multiprocessing as mp

    store, out = tmp / f"store_{mode}", tmp / f"result_{mode}"
    mp.start_processes(_rank, args=(folder, mode, steps, str(store), str(out)), nprocs=TP, join=True,
                       start_method="spawn")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(TP)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the random folder")
    args = parser.parse_args()
    from megatron_pack.model.hf.synthetic import write_random_folder

    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    folder = tmp / "model"
    try:
        size = write_random_folder(folder, CONFIG)
        (folder / "config.json").write_text(json.dumps(CONFIG))
        print(f"model: random Llama, {size / 1e9:.2f} GB float32, TP={TP}, packs of {PACK} tokens, "
              f"{args.steps} timed steps after 1 warm-up, 2 CPU ranks")
        results = {mode: _case(str(folder), mode, args.steps, tmp) for mode in ("full", "lora")}
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'case':<6} {'rank':>4} {'peak RSS MB':>12} {'params MB':>10} {'grad buf MB':>12} {'optim MB':>9} "
          f"{'trainable':>12} {'step s':>8}")
    for mode, ranks in results.items():
        for r, res in enumerate(ranks):
            print(f"{mode:<6} {r:>4} {res['peak_mb']:>12.0f} {res['params_mb']:>10.0f} {res['grads_mb']:>12.1f} "
                  f"{res['optim_mb']:>9.1f} {res['trainable']:>12,} {res['step_s']:>8.2f}")
    for r in range(TP):
        full, lora = results["full"][r], results["lora"][r]
        print(f"rank {r}: LoRA / full: peak RSS {lora['peak_mb'] / full['peak_mb']:.2f}x, "
              f"step time {lora['step_s'] / full['step_s']:.2f}x, gradient buffers "
              f"{lora['grads_mb'] / full['grads_mb']:.4f}x, optimizer state {lora['optim_mb'] / full['optim_mb']:.4f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
