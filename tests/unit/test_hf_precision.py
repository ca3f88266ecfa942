"""Weights load in the folder's dtype into model.params_dtype; nothing else changes them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf import make_family  # noqa: E402

CASES = [  # (id, folder dtype, model.params_dtype)
    ("bf16-folder-into-fp32", torch.bfloat16, "float32"),
    ("fp32-folder-into-bf16", torch.float32, "bfloat16"),
    ("fp32-folder-into-fp32", torch.float32, "float32"),
]


@pytest.mark.parametrize("folder_dtype,params_dtype", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_params_hold_the_folder_weights_in_params_dtype(tmp_path, folder_dtype, params_dtype):
    from safetensors.torch import load_file

    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.hf.export import hf_tensors
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    folder = make_family(tmp_path, "qwen3_qknorm", seed=7, dtype=folder_dtype)
    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=str(folder), attention_backend="torch",
                                                    params_dtype=params_dtype)), [])
    state = initialize_parallel(cfg)
    try:
        model = build_model(cfg, state)
    finally:
        destroy_parallel(destroy_process_group=True)
    want = getattr(torch, params_dtype)
    assert {p.dtype for p in model.parameters()} == {want}
    assert model.pretrained_report.source_dtype == folder_dtype
    ours = hf_tensors([{n: p.detach() for n, p in model.named_parameters()}], "qwen3", cfg.model)
    source = {}
    for file in folder.glob("*.safetensors"):
        source.update(load_file(file))
    assert len(source) >= 15 and sorted(ours) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(ours[name], tensor.to(want)), name
