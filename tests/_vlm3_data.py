"""The data side of tiny Qwen3-VL / Qwen3.5 folders (no network, no weights): ``config.json`` as transformers'
``Qwen3VLConfig`` / ``Qwen3VLMoeConfig`` / ``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` ``save_pretrained`` writes it
(tiny sub-configs, the tokenizer's vision token ids), a byte-level BPE tokenizer with the vision and video special
tokens and a chat template that renders image and video parts as Qwen3-VL's does, and the image processor these
families load (``Qwen2VLImageProcessor``) with their settings: patch 16, merge 2, ``size`` as
``{shortest_edge, longest_edge}`` pixel bounds (here 32*32 .. 128*128, so an image takes 1 to 16 pad tokens).

``make_qwen3_data_folder(root, model_type, nested=False)`` writes ``root/<model_type>``; ``nested=True`` stores the
image processor the way transformers 5's ``ProcessorMixin.save_pretrained`` does, inside ``processor_config.json``
(``{"image_processor": {...}, "processor_class": "Qwen3VLProcessor"}``), with no ``preprocessor_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS)
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 32 * 32, 128 * 128

QWEN3_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen3-VL's template reduced to what the tests need: ChatML turns, an image part as one pad token between the
vision start and end tokens, a video part as one video pad token between them (as the published template)."""


def save_tokenizer(path: Path):
    from _hf import bpe_tokenizer

    return bpe_tokenizer(path, ["describe the image", "a red square", "what color is it", "two pictures",
                                "user assistant"], list(SPECIAL_TOKENS), 300, QWEN3_VL_TEMPLATE,
                         eos="<|im_end|>", pad="<|endoftext|>")


def image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """The families' image processor (transformers maps qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe to
    ``Qwen2VLImageProcessor``; the Pillow backend here, as no torchvision is installed) with their settings."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
                                    size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def family_config(model_type: str, tokenizer):
    """The tiny transformers config of ``model_type`` with the tokenizer's vision token ids."""
    import transformers

    names = {"qwen3_vl": "Qwen3VLConfig", "qwen3_vl_moe": "Qwen3VLMoeConfig", "qwen3_5": "Qwen3_5Config",
             "qwen3_5_moe": "Qwen3_5MoeConfig"}
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    # interleaved M-RoPE as the published folders have it, sections summing to the rotary half: head_dim 8 for
    # Qwen3-VL; head_dim 16 with Qwen3.5's partial rotary (0.5 here) -> 8 rotary dims
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rope_parameters": rope}
    if "moe" in model_type:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    if model_type.startswith("qwen3_5"):
        text.update(head_dim=16, rope_parameters={**rope, "partial_rotary_factor": 0.5},
                    layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
              "patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
              "num_position_embeddings": 64}
    if model_type.startswith("qwen3_vl"):
        vision["deepstack_visual_indexes"] = [0]
    return getattr(transformers, names[model_type])(text_config=text, vision_config=vision, **ids)


def make_qwen3_data_folder(root: Path | str, model_type: str, *, nested: bool = False, name: str | None = None,
                           **pixels) -> Path:
    """``root/<name or model_type>`` with config.json, the tokenizer and the image processor's config."""
    path = Path(root) / (name or model_type)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(path)
    family_config(model_type, tokenizer).save_pretrained(path)
    processor = image_processor(**pixels)
    if nested:  # transformers 5's ProcessorMixin.to_json_file: every sub-processor's dict under its attribute
        (path / "processor_config.json").write_text(json.dumps(
            {"image_processor": processor.to_dict(), "processor_class": "Qwen3VLProcessor"}, indent=2))
    else:
        processor.save_pretrained(path)
    return path
