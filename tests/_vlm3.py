"""Tiny random Qwen3.5 and Qwen3-VL vision-language folders (no network), and the packs built from them.

``make_folder(root, family)`` builds transformers' ``Qwen3_5ForConditionalGeneration`` /
``Qwen3VLForConditionalGeneration`` (and their MoE twins) from a small config with a fixed seed and saves it with
``save_pretrained`` (transformers' module names: ``model.language_model.*``, ``model.visual.*``, as the Hub's
folders), beside ``_vlm.py``'s tokenizer and chat template and a ``Qwen2VLImageProcessor`` of patch 16 for tiny
images (32x32 .. 128x128).

| family        | language model                                                                             |
|---------------|--------------------------------------------------------------------------------------------|
| qwen3_5       | 2 layers [linear_attention, full_attention], hidden 64, 4 heads / 2 KV of 32, partial RoPE  |
|               | 0.5 (16 rotary dims: 8 frequencies, interleaved M-RoPE sections [3, 3, 2]), Gated DeltaNet  |
|               | 2 key / 4 value heads of 8                                                                  |
| qwen3_vl      | 4 layers, hidden 64, 4 heads / 2 KV of 16, QK norm, interleaved M-RoPE [2, 3, 3], DeepStack |
|               | from vision blocks [0, 1] added after decoder layers 0 and 1                                |
| *_moe         | the same with 4 experts, top 2, expert FFN 32 (Qwen3.5-MoE: a gated shared expert of 32;     |
|               | Qwen3-VL-MoE: expert FFN 16, stacked experts; ``hub_orientation`` gives the Hub's layout)     |

Vision tower (each family's own class): depth 2, hidden 32, 2 heads, patch 16, merge 2, temporal patch 2, a 4x4
learned position grid, merger out 64. Vocabulary 301 (TP=2 pads it to 302). Norms, biases, the Gated DeltaNet's
decays and every norm of the tower are drawn away from their init, so a mapping that drops one is seen.

``encode(folder, parts)`` and ``reference_pack(samples)`` are the test's own (transformers' processor and
``get_rope_index`` per sample; no code of megatron_pack's collate).
"""

from __future__ import annotations

from pathlib import Path

import torch

import _vlm as V

VOCAB = V.VOCAB
PATCH = 16
PIXEL_WIDTH = 3 * 2 * PATCH * PATCH
FAMILIES = ("qwen3_5", "qwen3_vl", "qwen3_5_moe", "qwen3_vl_moe")
CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
           "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def hf_config(family: str, **text_changes):
    """The tiny config of ``family`` (module table); ``text_changes`` override text_config keys."""
    import transformers as T

    ids = V.special_ids()
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=False)
    if family.startswith("qwen3_5"):
        text.update(num_hidden_layers=2, head_dim=32, layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [3, 3, 2], "mrope_interleaved": True})
        if family == "qwen3_5_moe":
            text.update(_MOE, shared_expert_intermediate_size=32)
            text.pop("intermediate_size")
    else:
        text.update(num_hidden_layers=4, head_dim=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                     "mrope_interleaved": True})
        vision["deepstack_visual_indexes"] = [0, 1]
        if family == "qwen3_vl_moe":  # expert FFN 16: the stacked experts' orientations differ in shape (2F != H)
            text.update(_MOE, moe_intermediate_size=16)
    text.update(text_changes)
    config_class = {"qwen3_5": T.Qwen3_5Config, "qwen3_vl": T.Qwen3VLConfig, "qwen3_5_moe": T.Qwen3_5MoeConfig,
                    "qwen3_vl_moe": T.Qwen3VLMoeConfig}[family]
    return config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def _randomise(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.3 * torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight") or ("visual" in name and "norm" in name and "weight" in name):
                p.copy_(1.0 + noise)  # plain norms (scale w)
            elif "norm" in name and name.endswith("weight") and "qwen3_5" in type(model).__module__:
                p.copy_(noise)  # Qwen3.5's norms scale by 1 + w
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + noise)
            elif name.endswith(("bias", "dt_bias", "A_log")):
                p.add_(0.7 * noise)


def image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=128 * 128, patch_size=PATCH, merge_size=2,
                                    temporal_patch_size=2)


def make_folder(root: Path | str, family: str, *, seed: int = 0, **text_changes) -> Path:
    """The saved tiny folder ``root/family`` (safetensors, tokenizer with chat template, preprocessor)."""
    import transformers as T

    path = Path(root) / family
    torch.manual_seed(seed)
    model = getattr(T, CLASSES[family])(hf_config(family, **text_changes)).to(torch.float32)
    _randomise(model, seed + 1)
    model.save_pretrained(path)
    T.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    V.save_tokenizer(path)
    image_processor().save_pretrained(path)
    return path


_MODELS: dict[str, object] = {}


def reference_model(folder: Path | str):
    import transformers as T

    folder = str(folder)
    if folder not in _MODELS:
        family = T.AutoConfig.from_pretrained(folder).model_type
        _MODELS[folder] = getattr(T, CLASSES[family]).from_pretrained(folder, dtype=torch.float32).eval()
    return _MODELS[folder]


def encode(folder: Path | str, parts: list) -> dict:
    """One sample: text pieces and PIL images in order -> ids with the image placeholders expanded, the processor's
    pixels and grids, and transformers' ``get_rope_index`` of the sample alone ([3, n])."""
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(folder)
    images = [p for p in parts if not isinstance(p, str)]
    out = image_processor()(images=images, return_tensors="pt") if images else None
    grids = out["image_grid_thw"] if images else torch.zeros(0, 3, dtype=torch.int64)
    ids, k, s = [1], 0, V.special_ids()
    for part in parts:
        if isinstance(part, str):
            ids += tok(part, add_special_tokens=False)["input_ids"]
        else:
            ids += [s["<|vision_start|>"]] + [s["<|image_pad|>"]] * (int(grids[k].prod()) // 4) + [s["<|vision_end|>"]]
            k += 1
    ids.append(2)
    input_ids = torch.tensor([ids])
    types = (input_ids == s["<|image_pad|>"]).to(torch.int32)
    if images:
        rope = reference_model(folder).model.get_rope_index(input_ids, types, image_grid_thw=grids)[0][:, 0]
    else:
        rope = torch.arange(len(ids)).expand(3, -1).clone()
    return {"input_ids": ids, "pixel_values": out["pixel_values"] if images else torch.zeros(0, PIXEL_WIDTH),
            "image_grid_thw": grids, "mrope": rope}


def reference_logits(folder: Path | str, sample: dict, model=None) -> torch.Tensor:
    """transformers' float32 logits [n, V] of one encoded sample alone (its ids without the last)."""
    model = reference_model(folder) if model is None else model
    ids = torch.tensor([sample["input_ids"][:-1]])
    kwargs = {}
    if sample["image_grid_thw"].shape[0]:
        kwargs = {"pixel_values": sample["pixel_values"], "image_grid_thw": sample["image_grid_thw"],
                  "mm_token_type_ids": (ids == V.special_ids()["<|image_pad|>"]).to(torch.int32)}
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits[0].float()


def reference_pack(samples: list[dict], pad_multiple: int = 1) -> dict:
    """The VLM THD batch of encoded samples (as ``_vlm.reference_pack``, pixel rows of patch 16)."""
    pack = V.reference_pack([s if s["image_grid_thw"].shape[0] else {**s, "pixel_values": torch.zeros(0, 1176)}
                             for s in samples], pad_multiple)
    if pack["image_grid_thw"].shape[0] == 0:
        pack["pixel_values"] = torch.zeros(0, PIXEL_WIDTH)
    return pack


def samples(folder: Path | str) -> list[dict]:
    """Three samples: two images in the first, none in the second, one in the third."""
    return [
        encode(folder, ["describe the picture", V.make_image(64, 96, 1), "and", V.make_image(32, 64, 2),
                        "a red square"]),
        encode(folder, ["what colour is it the answer is hello world"]),
        encode(folder, [V.make_image(96, 64, 3), "a blue circle"]),
    ]


def hub_orientation(src: Path | str, dst: Path | str) -> Path:
    """A Qwen3-VL-MoE folder with its stacked experts as the Hub stores them (``gate_up_proj`` [E, H, 2F],
    ``down_proj`` [E, F, H]; transformers 5's ``save_pretrained`` writes its modules' [E, 2F, H] / [E, H, F])."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    hub = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
           for k, v in tensors.items()}
    save_file(hub, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
