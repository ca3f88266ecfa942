"""Qwen3.5 text (the hybrid stack) on CPU: packed THD against padded batches, and the linear-attention layers' share.

A tiny random Qwen3.5 dense text stack (transformers' ``Qwen3_5ForCausalLM`` config: 4 layers, three Gated DeltaNet
linear-attention layers to one gated full attention, hidden 128, FFN 256, Gated DeltaNet 4 key / 8 value heads of
32, vocabulary 1024), saved to a temporary folder and built by ``model.pretrained`` (float32, one process, one torch
thread). Random SFT samples of 32-512 tokens; measured in one run, interleaved (best of ``--repeats``):

1. **Packed vs padded.** The same samples trained (forward + backward, summed token loss) two ways, each with at most
   ``--pack-size`` token slots per micro-batch: the baseline batches them in dataset order as [B, S] rows padded to
   the batch's longest (B x S <= pack size; each row one sequence: the Gated DeltaNet runs a row whole, the full
   attention causally), ours packs them (best-fit decreasing) into THD packs with ``cu_seqlens``. Prints real tokens/s
   of both and the ratio, and the ideal ratio (padded slots / real tokens).
2. **Linear-attention share.** In the packed run, the seconds spent inside the Gated DeltaNet mixers (forward:
   forward hooks; backward: the module's backward hooks, one thread so nothing overlaps) and inside the full
   attention, as shares of the step.

Run: ``.venv/bin/python bench/qwen3_5.py [--num-samples 96] [--pack-size 2048] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import padded_batches  # noqa: E402  (the same baseline as the tiny GPT's)

VOCAB = 1024
LENGTHS = (32, 512)


def _folder(root: str) -> str:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    Qwen3_5ForCausalLM(config).save_pretrained(f"{root}/qwen3_5")
    return f"{root}/qwen3_5"


def _model(folder: str):
    from megatron_pack.config import load_config
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import initialize_parallel

    cfg = load_config([f"model.pretrained={folder}", "train.device=cpu", "data.tokenizer=byte"])
    return build_model(cfg, initialize_parallel(cfg))


def _samples(num: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        n = int(torch.randint(LENGTHS[0], LENGTHS[1] + 1, (1,), generator=gen))
        ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist() + [2]
        out.append({"input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2 + 1), "sample_id": i})
    return out


def _packs(samples: list[dict], pack_size: int) -> list[dict]:
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.data.packing.algorithms import plan_packing

    plan = plan_packing([len(s["input_ids"]) - 1 for s in samples], pack_size)
    return [collate_thd([samples[i] for i in b], pack_size=pack_size) for b in plan.bins()]


class MixerClock:
    """Seconds spent inside modules of the given kinds, forward and backward (CPU, one thread: nothing overlaps)."""

    def __init__(self, model, kinds: dict[str, type]):
        self.seconds = {name: 0.0 for name in kinds}
        self._start: dict[int, float] = {}
        for module in model.modules():
            for name, kind in kinds.items():
                if isinstance(module, kind):
                    self._hook(module, name)

    def _hook(self, module, name: str) -> None:
        def begin(*_):
            self._start[id(module)] = time.perf_counter()

        def end(*_):
            self.seconds[name] += time.perf_counter() - self._start.pop(id(module))

        module.register_forward_pre_hook(begin)
        module.register_forward_hook(end)
        module.register_full_backward_pre_hook(begin)
        module.register_full_backward_hook(end)

    def reset(self) -> None:
        self.seconds = {name: 0.0 for name in self.seconds}


def _step(model, batch: dict, packed: bool) -> None:
    from megatron_pack.training.step import get_packed_seq_params

    params = get_packed_seq_params(batch) if packed else None
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)
    (losses * batch["loss_mask"]).sum().backward()


def measure(model, runs: dict[str, list[dict]], repeats: int, clock: MixerClock) -> dict[str, dict]:
    """Best seconds of each run over ``repeats`` (the runs interleaved), and the mixers' seconds of that best."""
    best = {name: (float("inf"), {}) for name in runs}
    for name, batches in runs.items():  # warm-up
        _step(model, batches[0], name == "packed")
    for _ in range(repeats):
        for name, batches in runs.items():
            clock.reset()
            start = time.perf_counter()
            for batch in batches:
                _step(model, batch, name == "packed")
            model.zero_grad(set_to_none=True)
            took = time.perf_counter() - start
            if took < best[name][0]:
                best[name] = (took, dict(clock.seconds))
    return {name: {"seconds": s, "mixers": m} for name, (s, m) in best.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=96)
    parser.add_argument("--pack-size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from megatron_pack.model.cpu_compat import eager_jit_fuser_without_cuda

    eager_jit_fuser_without_cuda()  # as the package's entries do: megatron-core's fused kernels eager on a CPU host
    from megatron.core.transformer.attention import SelfAttention

    from megatron_pack.model.linear_attention import PackedGatedDeltaNet

    with tempfile.TemporaryDirectory() as tmp:
        model = _model(_folder(tmp))
    samples = _samples(args.num_samples)
    runs = {"padded": padded_batches(samples, args.pack_size, 0), "packed": _packs(samples, args.pack_size)}
    real = sum(len(s["input_ids"]) - 1 for s in samples)
    slots = {name: sum(b["tokens"].numel() for b in batches) for name, batches in runs.items()}
    clock = MixerClock(model, {"linear attention": PackedGatedDeltaNet, "full attention": SelfAttention})
    timed = measure(model, runs, args.repeats, clock)
    print(f"Qwen3.5 tiny (4 layers: 3 Gated DeltaNet + 1 full attention, hidden 128), CPU float32, 1 thread; "
          f"{len(samples)} samples of {LENGTHS[0]}-{LENGTHS[1]} tokens, {real} real tokens, "
          f"<= {args.pack_size} slots per micro-batch, best of {args.repeats}")
    print(f"{'run':>7} {'batches':>8} {'slots':>7} {'step s':>8} {'real tok/s':>11} {'ratio':>6} "
          f"{'linear-attn share':>18} {'full-attn share':>16}")
    for name in ("padded", "packed"):
        t = timed[name]
        share = {k: v / t["seconds"] for k, v in t["mixers"].items()}
        print(f"{name:>7} {len(runs[name]):>8} {slots[name]:>7} {t['seconds']:>8.3f} {real / t['seconds']:>11,.0f} "
              f"{timed['padded']['seconds'] / t['seconds']:>5.2f}x {100 * share['linear attention']:>17.1f}% "
              f"{100 * share['full attention']:>15.1f}%")
    print(f"ideal ratio (padded slots / real tokens): {slots['padded'] / real:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
