"""A tiny random Qwen2.5-VL folder for the vision-language tests (no network), and the packs built from it.

``make_vlm(root)`` builds ``Qwen2_5_VLForConditionalGeneration`` from a small config with a fixed
seed and saves it with ``save_pretrained`` beside what a Hub download also holds: a ``tokenizers``
BPE tokenizer with the vision special tokens and a chat template that renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>``, a generation config, and the
``Qwen2VLImageProcessor``'s ``preprocessor_config.json`` sized for tiny images (28x28 .. 112x112).

| part          | size                                                                               |
|---------------|------------------------------------------------------------------------------------|
| language      | 2 layers, hidden 64, 4 heads / 2 KV heads of 16, FFN 128, M-RoPE sections [2, 3, 3] |
| vision        | depth 2, hidden 32, 2 heads, patch 14, merge 2, temporal patch 2, window 56,        |
|               | full attention in block 1, merger out 64 (the language hidden size)                 |
| vocabulary    | 301 (odd on purpose: TP=2 pads it to 302)                                           |

``reference_pack(folder, samples)`` is the test's own THD pack of samples (each a list of text
pieces and PIL images), built from transformers' processor and ``get_rope_index`` per sample: it
shares no code with megatron_pack's collate. Biases and norm weights are randomised, as in
``_hf.py``, so a mapping that drops or swaps one is seen.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 301
SPECIAL = ["<pad>", "<s>", "</s>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112


def special_ids() -> dict[str, int]:
    """Token ids of the special tokens: the BPE trainer puts them first, in ``SPECIAL`` order."""
    return {token: i for i, token in enumerate(SPECIAL)}


def vlm_config():
    """The tiny ``Qwen2_5_VLConfig`` (see the module table)."""
    import transformers as T

    ids = special_ids()
    return T.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1],
                           window_size=56),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def _randomise(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen) if ("norm" in name or "ln_q" in name)
                        else 0.2 * torch.randn(p.shape, generator=gen))


def save_tokenizer(path: Path) -> None:
    from _hf import bpe_tokenizer

    fast = bpe_tokenizer(path, ["describe the picture", "a red square and a blue circle", "what colour is it",
                                "the answer is", "system user assistant", "hello world"],
                         SPECIAL, VOCAB - 10, CHAT_TEMPLATE, bos="<s>", eos="</s>", pad="<pad>")
    assert all(fast.convert_tokens_to_ids(t) == i for t, i in special_ids().items())


def image_processor():
    from transformers import Qwen2VLImageProcessorPil  # the Pillow backend (no torchvision here)

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2,
                                 temporal_patch_size=2)


def make_vlm(root: Path | str, *, seed: int = 0, name: str = "tiny-vlm", max_shard_size: str = "80KB") -> Path:
    """A saved tiny Qwen2.5-VL folder ``root/name`` (safetensors shards + index, tokenizer, preprocessor)."""
    import transformers as T

    path = Path(root) / name
    torch.manual_seed(seed)
    model = T.Qwen2_5_VLForConditionalGeneration(vlm_config()).to(torch.float32)
    _randomise(model, seed + 1)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    T.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    save_tokenizer(path)
    image_processor().save_pretrained(path)
    return path


def make_image(width: int, height: int, seed: int):
    """A random RGB PIL image (Pillow, no files)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), mode="RGB")


def encode_sample(folder: Path | str, parts: list) -> dict:
    """One sample: text pieces (str) and PIL images in order -> ids with the image placeholders
    expanded, the processor's pixel values and grids, and transformers' ``get_rope_index`` for it alone."""
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(folder)
    proc = image_processor()
    images = [p for p in parts if not isinstance(p, str)]
    out = proc(images=images, return_tensors="pt") if images else None
    grids = out["image_grid_thw"] if images else torch.zeros(0, 3, dtype=torch.int64)
    ids, k = [1], 0
    for part in parts:
        if isinstance(part, str):
            ids += tok(part, add_special_tokens=False)["input_ids"]
        else:
            n = int(grids[k].prod()) // 4
            ids += [special_ids()["<|vision_start|>"]] + [special_ids()["<|image_pad|>"]] * n + \
                [special_ids()["<|vision_end|>"]]
            k += 1
    ids.append(2)
    return {"input_ids": ids, "pixel_values": out["pixel_values"] if images else torch.zeros(0, 1176),
            "image_grid_thw": grids, "mrope": rope_index(folder, ids, grids)}


def rope_index(folder, ids: list[int], grids: torch.Tensor) -> torch.Tensor:
    """transformers' ``get_rope_index`` for one sample alone: [3, len(ids)]."""
    model = _reference_model(str(folder))
    input_ids = torch.tensor([ids])
    image = special_ids()["<|image_pad|>"]
    types = (input_ids == image).to(torch.int32)
    if grids.shape[0] == 0:
        return torch.arange(len(ids)).expand(3, -1).clone()
    pos, _ = model.model.get_rope_index(input_ids, types, image_grid_thw=grids)
    return pos[:, 0]


_MODELS: dict[str, object] = {}


def _reference_model(folder: str):
    import transformers as T

    if folder not in _MODELS:
        model = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
        _MODELS[folder] = model.eval()
    return _MODELS[folder]


def reference_logits(folder: Path | str, sample: dict) -> torch.Tensor:
    """transformers' float32 logits [n, V] of one encoded sample run alone (the reference)."""
    model = _reference_model(str(folder))
    kwargs = {}
    if sample["image_grid_thw"].shape[0]:
        kwargs = {"pixel_values": sample["pixel_values"], "image_grid_thw": sample["image_grid_thw"]}
    ids = torch.tensor([sample["input_ids"]])
    types = (ids == special_ids()["<|image_pad|>"]).to(torch.int32)  # what the processor returns
    with torch.no_grad():
        return model(input_ids=ids, mm_token_type_ids=types, **kwargs).logits[0].float()


def reference_pack(samples: list[dict], pad_multiple: int = 1) -> dict:
    """The VLM THD batch (docs/models.md, the VLM batch) of encoded samples, built here from the
    samples alone: each sub-sequence is ``ids[:-1]`` padded to ``pad_multiple``, its M-RoPE rows
    continued by +1 on the padding, every target counted."""
    tokens, labels, mask, pos, mrope, cu, cu_pad = [], [], [], [], [], [0], [0]
    for s in samples:
        ids = s["input_ids"]
        n = len(ids) - 1
        padded = -(-n // pad_multiple) * pad_multiple
        tokens += ids[:-1] + [0] * (padded - n)
        labels += ids[1:] + [0] * (padded - n)
        mask += [1.0] * n + [0.0] * (padded - n)
        pos += list(range(padded))
        m = s["mrope"][:, :n]
        tail = m[:, -1:].max() + 1 + torch.arange(padded - n)
        mrope.append(torch.cat([m, tail.expand(3, -1)], dim=1))
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + padded)
    images = [s for s in samples if s["image_grid_thw"].shape[0]]
    return {
        "tokens": torch.tensor([tokens]), "labels": torch.tensor([labels]), "loss_mask": torch.tensor([mask]),
        "position_ids": torch.tensor([pos]), "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32),
        "max_seqlen": max(b - a for a, b in zip(cu_pad, cu_pad[1:])),
        "sample_ids": torch.arange(len(samples)),
        "pixel_values": torch.cat([s["pixel_values"] for s in images]) if images else torch.zeros(0, 1176),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in images]) if images
        else torch.zeros(0, 3, dtype=torch.int64),
        "mrope_position_ids": torch.cat(mrope, dim=1).to(torch.int64),
    }


def mixed_samples(folder: Path | str) -> list[dict]:
    """Three samples: two images in one, none in the next, one image in the last."""
    return [
        encode_sample(folder, ["describe the picture", make_image(56, 84, 1), "and", make_image(28, 56, 2),
                               "a red square"]),
        encode_sample(folder, ["what colour is it the answer is hello world"]),
        encode_sample(folder, [make_image(84, 56, 3), "a blue circle"]),
    ]
