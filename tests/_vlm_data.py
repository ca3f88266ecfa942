"""The data side of the tiny vision-language fixture (no network): a tokenizer with the vision special
tokens and a chat template that renders image parts, a saved ``Qwen2VLImageProcessor`` config for tiny
images, and images made with Pillow.

``make_vlm_data_folder(root)`` writes ``root/tiny_vlm`` with ``tokenizer.json`` / ``tokenizer_config.json``
(ChatML roles, ``<|vision_start|><|image_pad|><|vision_end|>`` per image part, as Qwen2-VL's template) and
``preprocessor_config.json`` (patch 14, merge 2, temporal patch 2, 28x28 .. 112x112 pixels, so an image
takes 1 to 16 ``<|image_pad|>`` tokens). The model builder (tests/_vlm.py) saves its model beside these.
"""

from __future__ import annotations

import json
from pathlib import Path

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS)
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112

VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen2-VL's template reduced to what the tests need: ChatML turns, image parts as one pad token each."""


def save_vlm_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (vocabulary ~300) with the ChatML and vision special tokens."""
    from _hf import bpe_tokenizer

    bpe_tokenizer(path, ["describe the image", "a red square", "what color is it", "two pictures", "user assistant"],
                  list(SPECIAL_TOKENS), 300, VLM_CHAT_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")


def save_image_processor(path: Path, *, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> None:
    """``preprocessor_config.json`` as ``Qwen2VLImageProcessor.save_pretrained`` writes it (the Pillow backend
    writes the same file; transformers loads whichever backend is installed)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=PATCH_SIZE,
                             merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE).save_pretrained(path)


def make_vlm_data_folder(root: Path | str, name: str = "tiny_vlm", **processor) -> Path:
    """``root/name`` with the tokenizer and the image processor config."""
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    save_vlm_tokenizer(path)
    save_image_processor(path, **processor)
    return path


def make_image(path: Path | str, width: int, height: int, *, mode: str = "RGB", seed: int = 0,
               fmt: str | None = None) -> Path:
    """A random-pixel image of ``width`` x ``height`` in ``mode``, saved (PNG unless ``fmt`` or the suffix says)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    if mode in ("I;16", "I", "F"):  # more than 8 bits per value
        deep = Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
        image = deep if mode == "I;16" else deep.convert(mode)
    else:
        image = rgb.convert(mode)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=fmt)
    return path


def write_jsonl(path: Path | str, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


VLM_CHAT_RUN = ["experiment=vlm_tiny", "data=files", "data.input=chat.jsonl"]
"""``experiment=vlm_tiny`` on the chat file of ``vlm_chat_folder`` (images as files, not stored bytes)."""


def vlm_chat_folder(root: Path, num_records: int = 12) -> Path:
    """``root`` with the docs' tiny VLM folder, ``img<i>.png`` (56x28 pixels) and ``chat.jsonl``: the even records
    ask about an image, the odd ones are text only. Returns ``root``."""
    from _hf import docs_tiny_folder

    docs_tiny_folder(root, "vlm_tiny", "tiny-vlm")
    records = []
    for i in range(num_records):
        if i % 2 == 0:
            make_image(root / f"img{i}.png", 56, 28, seed=i)
            question = [{"type": "image", "image": f"img{i}.png"}, {"type": "text", "text": "what color is it"}]
        else:
            question = "describe the image " * (1 + i % 3)
        records.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": "a red square " * (1 + i % 4)}]})
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root
