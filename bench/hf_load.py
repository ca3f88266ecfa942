"""Load time and peak RSS per rank: our streamed TP-sliced loader against transformers' from_pretrained.

A random folder of a ~0.5B-parameter Qwen2.5-0.5B-shaped model (24 layers, hidden 896, vocab
151,936, tied embeddings; bfloat16, 500 MB shards) is written once
(``megatron_pack.model.hf.synthetic``), then each case runs in fresh processes:

- baseline, in the same run: ``transformers.AutoModelForCausalLM.from_pretrained(folder)``
  (its default: the checkpoint's bfloat16, the whole model in one process);
- ours TP=1: ``build_model`` with ``model.pretrained`` (megatron-core GPTModel, bfloat16 params);
- ours TP=2: the same on 2 gloo ranks, each reading only its TP slices.

Per rank: seconds from the call to a loaded model, and the peak RSS above the process baseline
taken after imports (VmHWM, reset through /proc/self/clear_refs). transformers 5 can leave
weights as views of the mmapped files, so its peak is taken after touching every weight once (what
the first forward does; the untouched figure is printed too). Prints ratios against transformers. Run: ``.venv/bin/python bench/hf_load.py [--folder DIR] [--keep]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
          "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
          "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None}


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _start_measure() -> int:
    import gc

    gc.collect()
    baseline = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    return baseline


def _transformers(folder: str) -> dict:
    import torch
    import transformers

    baseline = _start_measure()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    seconds = time.perf_counter() - start
    lazy_peak = (_kib("VmHWM") - baseline) / 1024
    # transformers 5 may keep weights as views of the mmapped safetensors: touch every weight
    # once (as the first forward would) so its peak counts the pages it really needs
    checksum = sum(float(p.float().abs().sum()) for p in model.parameters())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert next(model.parameters()).dtype == torch.bfloat16 and checksum > 0
    return {"seconds": seconds, "peak_mb": (_kib("VmHWM") - baseline) / 1024, "param_mb": params / 2**20,
            "lazy_peak_mb": lazy_peak}


def _ours(rank: int, world_size: int, folder: str, out: str) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    if world_size > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        dist.init_process_group("gloo", store=dist.FileStore(out + ".store", world_size), rank=rank,
                                world_size=world_size)
    import megatron.core.models.gpt.gpt_model  # noqa: F401  (imports are not loading cost)
    import safetensors.torch  # noqa: F401

    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=4096,
                                                    params_dtype="bfloat16"),
                                  parallel=ParallelConfig(tensor_model_parallel_size=world_size)), [])
    pg = initialize_parallel(cfg)
    baseline = _start_measure()
    start = time.perf_counter()
    model = build_model(cfg, pg)
    seconds = time.perf_counter() - start
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"seconds": seconds, "peak_mb": (_kib("VmHWM") - baseline) / 1024, "param_mb": params / 2**20}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    destroy_parallel(destroy_process_group=world_size > 1)


def _run_case(case: str, folder: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, case)
    cmd = [sys.executable, __file__, "--worker", case, "--folder", folder, "--out", out]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    ranks = 2 if case == "ours_tp2" else 1
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]


def _worker(case: str, folder: str, out: str) -> None:
    if case == "transformers":
        Path(f"{out}.rank0.json").write_text(json.dumps(_transformers(folder)))
    elif case == "ours_tp1":
        _ours(0, 1, folder, out)
    else:
        import torch.multiprocessing as mp

        mp.start_processes(_ours, args=(2, folder, out), nprocs=2, join=True, start_method="spawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", help="an existing HF folder to load (default: write the random 0.5B one)")
    parser.add_argument("--keep", action="store_true", help="keep the random folder")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.folder, args.out)
        return
    tmp = tempfile.mkdtemp(prefix="hf_load_")
    folder = args.folder
    try:
        if folder is None:
            import torch

            from megatron_pack.model.hf.synthetic import write_random_folder

            folder = os.path.join(tmp, "qwen2.5-0.5b-random")
            total = write_random_folder(folder, CONFIG, dtype=torch.bfloat16, max_shard_bytes=500 * 10**6)
            print(f"folder: {folder} ({total / 2**20:.0f} MiB bfloat16, "
                  f"{len(list(Path(folder).glob('*.safetensors')))} shards)")
        results = {case: _run_case(case, folder, tmp) for case in ("transformers", "ours_tp1", "ours_tp2")}
        base = results["transformers"][0]
        print(f"{'case':<14}{'rank':>5}{'seconds':>10}{'peak MiB':>10}{'params MiB':>12}{'time ratio':>12}"
              f"{'peak ratio':>12}")
        for case, ranks in results.items():
            for rank, r in enumerate(ranks):
                print(f"{case:<14}{rank:>5}{r['seconds']:>10.2f}{r['peak_mb']:>10.0f}{r['param_mb']:>12.0f}"
                      f"{base['seconds'] / r['seconds']:>11.2f}x{r['peak_mb'] / base['peak_mb']:>11.2f}x")
        print(f"transformers peak right after from_pretrained (weights not yet touched): {base['lazy_peak_mb']:.0f} MiB")
        print("time ratio = transformers seconds / ours (higher is faster); peak ratio = ours / transformers "
              "(lower is less memory); peak = VmHWM above the process baseline after imports")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


if __name__ == "__main__":
    main()
