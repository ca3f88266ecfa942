"""Loading a pretrained folder at TP=2 never materialises the whole model on a rank.

A random Llama folder of about 300 MB (float32, 100 MB shards) is loaded by 2 gloo ranks at TP=2.
Each rank resets its RSS high-water mark (``/proc/self/clear_refs`` 5) after process-group setup,
builds the model and streams its shard in; the peak RSS above that baseline must stay below 1.5x
the rank's shard size (parameters only). Materialising the full model once would cost 2x.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _dist import spawn_world

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 768, "intermediate_size": 2048,
          "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "hidden_act": "silu"}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _worker(rank: int, world_size: int, folder: str) -> dict:
    import gc

    import torch

    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=256),
                                  parallel=ParallelConfig(tensor_model_parallel_size=2)), [])
    pg = initialize_parallel(cfg)
    # code imported on first use is not loading cost: import it before the baseline
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import safetensors.torch  # noqa: F401

    import megatron_pack.model.hf.load  # noqa: F401
    from megatron_pack.model.builder import local_block_spec, transformer_config_from

    local_block_spec(1, qk_layernorm=True)
    transformer_config_from(cfg)
    gc.collect()
    baseline = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    model = build_model(cfg, pg)
    peak = _rss_kib("VmHWM")
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    checksum = float(sum(p.double().abs().sum() for p in model.parameters()))
    destroy_parallel()
    return {"baseline_kib": baseline, "peak_kib": peak, "shard_bytes": shard,
            "bytes_read": model.pretrained_report.bytes_read, "checksum": checksum}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_load_peaks_below_one_and_a_half_shards(tmp_path):
    from megatron_pack.model.hf.synthetic import write_random_folder

    folder = tmp_path / "llama300m"
    total = write_random_folder(folder, CONFIG, max_shard_bytes=100 * 10**6)
    assert 250e6 < total < 400e6 and len(list(folder.glob("*.safetensors"))) >= 3
    # new processes: a pooled rank's heap may hold pages freed by earlier cases, which would hide a peak
    results = spawn_world(_worker, 2, tmp_path, str(folder), fresh=True)
    for rank, r in enumerate(results):
        shard, extra = int(r["shard_bytes"]), (int(r["peak_kib"]) - int(r["baseline_kib"])) * 1024
        assert 0.45 * total < shard < 0.55 * total  # a real half of the model
        assert int(r["bytes_read"]) >= 0.99 * shard and float(r["checksum"]) > 0  # the weights were read
        assert extra < 1.5 * shard, f"rank {rank}: peak {extra / 1e6:.0f} MB above baseline, shard {shard / 1e6:.0f} MB"
        print(f"rank {rank}: shard {shard / 1e6:.0f} MB, peak above baseline {extra / 1e6:.0f} MB "
              f"({extra / shard:.2f}x)")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
