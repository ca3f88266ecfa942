"""Qwen2.5-VL out: ``megatron-pack export`` of a ``qwen2_5_vl`` folder, read back by transformers.

1. the round trip with no checkpoint is bit-exact (every tensor, the vision tower's included), from the Hub's
   key layout and from transformers' module layout (``model.language_model.*`` / ``model.visual.*``), and
   the folder keeps what the processor needs (preprocessor_config.json, the chat template, the tokenizer);
2. ``Qwen2_5_VLForConditionalGeneration`` loads the export and generates from an image with the exported
   image processor and chat template the same tokens as from the source folder (the processor class itself
   needs torchvision for its video part, not installed here: its image processor and tokenizer are used);
3. LoRA on the language model: adapters exported in the peft format load on the HF VLM class.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _vlm as V  # noqa: E402


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return V.make_vlm(tmp_path_factory.mktemp("vlm_export"))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _module_layout(src: Path, dst: Path) -> Path:
    """``src`` re-saved under transformers' module names, as some transformers 5 tools write it."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in _tensors(src).items()}
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("layout", ["hub", "transformers_modules"])
def test_round_trip_is_bit_exact_and_keeps_the_processor(vlm, tmp_path, layout, capsys):
    from megatron_pack.cli.export import main

    src = vlm if layout == "hub" else _module_layout(vlm, tmp_path / "modules")
    out = tmp_path / "out"
    assert main([f"model.pretrained={src}", f"output={out}"]) == 0
    assert "AutoModelForImageTextToText" in capsys.readouterr().out
    source, exported = _tensors(vlm), _tensors(out)
    assert sum(k.startswith("visual.") for k in source) == 30 and len(source) == 57
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[k], source[k]) for k in source)
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (vlm / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text())["vision_config"]["depth"] == 2


def _generate(folder: Path) -> list[int]:
    """Greedy tokens from an image and a question, prepared with the folder's own image processor and chat
    template (what the processor does: one <|image_pad|> per merged patch)."""
    import transformers as T

    tok, proc = T.AutoTokenizer.from_pretrained(folder), T.AutoImageProcessor.from_pretrained(folder)
    model = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    image = V.make_image(56, 84, 9)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}],
                                   tokenize=False, add_generation_prompt=True)
    pixels = proc(images=[image], return_tensors="pt")
    text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(pixels["image_grid_thw"][0].prod()) // 4))
    ids = tok(text, return_tensors="pt")["input_ids"]
    types = (ids == V.special_ids()["<|image_pad|>"]).to(torch.int32)
    with torch.no_grad():
        out = model.generate(input_ids=ids, mm_token_type_ids=types, pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"], max_new_tokens=4, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_transformers_generates_from_the_export(vlm, tmp_path):
    from megatron_pack.cli.export import main

    out = tmp_path / "gen"
    assert main([f"model.pretrained={vlm}", f"output={out}"]) == 0
    tokens = _generate(out)
    assert len(tokens) == 4 and tokens == _generate(vlm)


LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
_SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64), "gate_proj": (128, 64),
           "up_proj": (128, 64), "down_proj": (64, 128)}
"""[out, in] of the tiny VLM's language-model linears (hidden 64, 4 heads of 16 in 2 groups, FFN 128)."""


def _random_adapter(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    """A peft adapter folder of the language model (random A and B, lora_A shared by q/k/v and gate/up, as ours)."""
    from megatron_pack.model.peft.export import adapter_config, adapter_targets, write_adapter_folder

    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for _, _, names in adapter_targets("qwen2_5_vl", LORA_TARGETS, num_layers=2):
        a = 0.2 * torch.randn(4, _SHAPES[names[0].rsplit(".", 1)[-1]][1], generator=gen)
        for name in names:
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            b_rows = _SHAPES[name.rsplit(".", 1)[-1]][0]
            tensors[f"base_model.model.{name}.lora_B.weight"] = 0.2 * torch.randn(b_rows, 4, generator=gen)
    meta = {"dim": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": LORA_TARGETS}
    write_adapter_folder(out, tensors, adapter_config(meta, "qwen2_5_vl", str(folder)), dtype=torch.float32)
    return tensors


def _ours_with_adapter(folder: Path, adapter: Path, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Our VLM (world 1) with the adapter loaded: the pack's logits [T, V], and the adapters exported again."""
    import os

    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, PeftConfig
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.peft.export import load_adapter, peft_tensors
    from megatron_pack.model.vlm import mrope_positions, vlm_decoder_input
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=str(folder), attention_backend="torch", seq_length=128),
                                  peft=PeftConfig(method="lora", dim=4, alpha=8.0, target_modules=LORA_TARGETS)), [])
    env = dict(os.environ)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    state = initialize_parallel(cfg)
    try:
        model = build_model(cfg, state).eval()
        assert load_adapter(model, adapter, "qwen2_5_vl", cfg.model, LORA_TARGETS, tp_rank=0, tp_size=1) == 8
        with torch.no_grad():
            logits = model(None, mrope_positions(batch, "cpu"), None, packed_seq_params=get_packed_seq_params(batch),
                           decoder_input=vlm_decoder_input(model, batch, 1, 0, torch.device("cpu")))[0]
        shard = {n: p.detach() for n, p in model.named_parameters() if ".adapter." in n}
        return logits, peft_tensors([shard], "qwen2_5_vl", cfg.model, LORA_TARGETS)
    finally:
        destroy_parallel(destroy_process_group=True)
        os.environ.clear()
        os.environ.update(env)


def test_lora_adapter_exports_in_the_peft_format_of_the_vlm_class(vlm, tmp_path):
    import transformers as T
    from peft import PeftModel

    adapter = tmp_path / "adapter"
    written = _random_adapter(vlm, adapter)
    samples = [V.encode_sample(vlm, ["describe the picture", V.make_image(56, 28, 7), "a blue circle"]),
               V.encode_sample(vlm, ["what colour is it"])]
    logits, exported = _ours_with_adapter(vlm, adapter, V.reference_pack(samples))
    # our adapters, exported again, are the adapter folder's tensors bit for bit
    assert len(written) == 2 * 2 * 7 and sorted(exported) == sorted(written)
    assert all(torch.equal(exported[k], written[k]) for k in written)
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in written)
    # peft loads the folder on the HF VLM class, adapting the language model only, and its logits are ours
    model = PeftModel.from_pretrained(T.Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm, dtype=torch.float32),
                                      adapter).eval()
    adapted = {n.split(".lora_")[0] for n, _ in model.named_parameters() if "lora_" in n}
    assert len(adapted) == 14 and not any("visual" in n for n in adapted)
    start, max_diff = 0, 0.0
    for s in samples:
        ids = torch.tensor([s["input_ids"]])
        kwargs = {"pixel_values": s["pixel_values"], "image_grid_thw": s["image_grid_thw"]} \
            if s["image_grid_thw"].shape[0] else {}
        with torch.no_grad():
            ref = model(input_ids=ids, mm_token_type_ids=(ids == V.special_ids()["<|image_pad|>"]).to(torch.int32),
                        **kwargs).logits[0]
        n = ids.shape[1] - 1
        max_diff = max(max_diff, float((logits[start:start + n, :V.VOCAB] - ref[:n]).abs().max()))
        start += n
    assert max_diff <= 1e-4
    with torch.no_grad():  # the adapter changes the output: the comparison above is not vacuous
        base = model.get_base_model()
        with model.disable_adapter():
            plain = base(input_ids=torch.tensor([samples[1]["input_ids"]])).logits[0]
    assert float((plain - ref).abs().max()) > 1e-3


def test_a_nan_in_the_vision_tower_is_refused_before_launch(vlm, tmp_path):
    """train --check reads every weight the model loads, the tower's too (folder_check.nonfinite_problems)."""
    from safetensors.torch import save_file

    from megatron_pack.model.hf.folder_check import folder_problems, nonfinite_problems

    broken = _module_layout(vlm, tmp_path / "nan")  # one file, transformers' module names
    tensors = _tensors(broken)
    tensors["model.visual.blocks.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    assert folder_problems(broken) == [] and nonfinite_problems(vlm) == []
    problems = nonfinite_problems(broken)
    assert len(problems) == 1 and "visual.blocks.1.mlp.down_proj.weight with 1 NaN" in problems[0], problems
