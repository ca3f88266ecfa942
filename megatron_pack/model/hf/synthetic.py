"""Write a random Hugging Face model folder straight to safetensors, one shard at a time.

For benchmarks and memory tests of the loader (a 0.5B-parameter folder without ever holding the
model in memory) and for dry runs of a real layout without downloading weights. The folder has
the names and shapes transformers expects for the family (``mapping.rules_for``), so
``AutoModelForCausalLM.from_pretrained`` loads it too. No tokenizer is written.

    python -m megatron_pack.model.hf.synthetic OUT_DIR config.json [--dtype bfloat16] [--max-shard-size 2GB]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megatron_pack.model.hf.rules import hf_shapes


def write_random_folder(out: str | Path, hf: dict, *, dtype: torch.dtype = torch.float32,
                        max_shard_bytes: int = 2 * 10**9, seed: int = 0) -> int:
    """Write config.json and random sharded safetensors (+ index); returns the number of bytes written."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = hf_shapes(hf)
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups, size = groups + [[]], 0
        groups[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for k, names in enumerate(groups, start=1):
        file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: _random(n, shapes[n], gen).to(dtype) for n in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: file for n in names})
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")
    (out / "config.json").write_text(json.dumps({**hf, "torch_dtype": str(dtype).removeprefix("torch.")}, indent=2),
                                     encoding="utf-8")
    return total


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.1 * noise
    return 0.02 * noise


def main(argv: list[str]) -> int:
    from megatron_pack.config.schema import parse_size

    parser = argparse.ArgumentParser(prog="python -m megatron_pack.model.hf.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("config", help="a config.json of a supported family")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-shard-size", default="2GB")
    args = parser.parse_args(argv)
    hf = json.loads(Path(args.config).read_text(encoding="utf-8"))
    total = write_random_folder(args.out, hf, dtype=getattr(torch, args.dtype),
                                max_shard_bytes=parse_size(args.max_shard_size))
    print(f"wrote {args.out}: {total / 1e6:.1f} MB of random {args.dtype} weights")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
