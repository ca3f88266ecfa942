"""Images in SFT records: where they are, how many tokens each takes, and the placeholders expanded.

``prepare`` does no pixel work. For every image it reads the file's header (Pillow's ``Image.open`` reads
the size and mode only) and ``verify()``s the file (structure and checksums, no decoding), hashes its
bytes, and computes the patch grid from the stored size with the processor's resize rule
(``smart_resize``, written here from the rule, tested equal to ``Qwen2VLImageProcessor`` on real pixels)::

    (height, width) -> smart_resize -> (H, W), multiples of patch_size * merge_size
    grid (t, h, w) = (1, H / patch_size, W / patch_size)
    <|image_pad|> tokens = t * h * w / merge_size**2

Example, patch 14, merge 2, min 28*28, max 112*112 pixels: a 100 x 60 (w x h) image resizes to 112 x 56,
grid (1, 4, 8), 8 tokens.

The families: Qwen2.5-VL, Qwen3-VL (``qwen3_vl``, ``qwen3_vl_moe``) and Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``) all
load transformers' ``Qwen2VLImageProcessor`` (its auto mapping), so one rule serves them; only the settings differ
(Qwen3-VL / Qwen3.5 folders: patch 16, merge 2, ``size: {shortest_edge, longest_edge}`` in pixels, no top-level
``min_pixels`` / ``max_pixels``). The settings are read where ``AutoImageProcessor`` reads them: the
``image_processor`` entry of ``processor_config.json`` (what transformers 5's processor ``save_pretrained``
writes) first, else ``preprocessor_config.json``.

Video is refused: a ``{"type": "video"}`` part, a record's non-empty ``videos`` column, or a rendered
``<|video_pad|>`` token is a bad record (``non_text_part``), never a silently dropped clip.

Record shapes (``stage_images``), each turned into chat content parts with ``{"type": "image",
"image_index": k}`` (k: the image's index in the record) for the chat template to render:

* TRL / Hugging Face messages: content parts ``{"type": "image", "image": <ref>}``; a part without
  ``"image"`` takes the next entry of the record's ``data.images_key`` list;
* LLaMA-Factory / ShareGPT: ``<image>`` placeholders in string contents, filled in order from the
  record's ``data.images_key`` list (as many placeholders as images, or the record is refused);
* a reference is a path (relative to ``data.image_root``, default the data file's folder), raw bytes,
  or Parquet's image struct ``{"bytes": ..., "path": ...}`` (bytes win when both are set).

Modes: 8-bit modes (RGB, RGBA, L, LA, P, PA, CMYK, YCbCr, 1) are kept as stored and converted to RGB by
the processor's own ``do_convert_rgb`` when the loader decodes them, as inference does; a folder whose
processor has ``do_convert_rgb: false`` gets only RGB images. Modes of more than 8 bits per channel
(I, I;16, F) are refused: converting them to RGB clips every value above 255, a silently white image.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megatron_pack.data.formats.chat import SHAREGPT, RecordError, SampleSchema, record_kind

IMAGE_PLACEHOLDER = "<image>"
"""LLaMA-Factory / ShareGPT's image placeholder in message text."""
IMAGE_INDEX_KEY = "image_index"
"""Key of the content parts ``stage_images`` makes (``{"type": "image", "image_index": k}``)."""
CONVERTED_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1")
"""Modes the processor's ``do_convert_rgb`` turns into RGB without loss of range."""
IMAGE_TOKENS = {"image": "<|image_pad|>", "start": "<|vision_start|>", "end": "<|vision_end|>"}
VIDEO_TOKEN = "<|video_pad|>"
VIDEO_KEY = "videos"
"""LLaMA-Factory's video column (``<video>`` placeholders); a record with videos is refused."""
PROCESSOR_FILE = "preprocessor_config.json"
NESTED_PROCESSOR_FILE = "processor_config.json"
"""transformers 5's processor file: every sub-processor's settings under its name (``image_processor``)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule: both sides multiples of ``factor``, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible. ``(60, 100)`` with factor 28, 784 .. 12544 -> ``(56, 112)``."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageSpec:
    """The resize rule of a folder's ``preprocessor_config.json`` and the vision token ids."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    do_convert_rgb: bool
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    video_token_id: Optional[int] = None
    """``<|video_pad|>``'s id where the tokenizer has it (a record rendering it is refused); not in ``identity``."""

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patches of an image of ``height`` x ``width`` pixels, as the processor returns it."""
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.merge_size ** 2

    def identity(self) -> dict:
        return {"patch_size": self.patch_size, "merge_size": self.merge_size,
                "temporal_patch_size": self.temporal_patch_size, "min_pixels": self.min_pixels,
                "max_pixels": self.max_pixels, "do_convert_rgb": self.do_convert_rgb,
                "image_token_id": self.image_token_id, "vision_start_id": self.vision_start_id,
                "vision_end_id": self.vision_end_id}


def processor_settings(folder: str) -> Optional[tuple[Path, dict]]:
    """``(file, settings)`` of the folder's image processor, read where ``AutoImageProcessor`` reads them:
    ``processor_config.json``'s ``image_processor`` entry first, else ``preprocessor_config.json``; None for a
    folder without an image processor (a text folder)."""
    from megatron_pack.data.formats.sources import DataError

    if folder == "byte":
        return None
    for name, entry in ((NESTED_PROCESSOR_FILE, "image_processor"), (PROCESSOR_FILE, None)):
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text())
        except ValueError as exc:
            raise DataError(f"{path} is not valid JSON ({exc}); save it again with the processor's save_pretrained.")
        if entry is None:
            return path, config
        if isinstance(config, dict) and isinstance(config.get(entry), dict):
            return path, config[entry]
    return None


def image_spec(folder: str, tokenizer) -> Optional[ImageSpec]:
    """The ``ImageSpec`` of a tokenizer folder with an image processor (``processor_settings``; None: a text
    folder)."""
    found = processor_settings(folder)
    if found is None:
        return None
    from megatron_pack.data.formats.sources import DataError

    path, config = found
    size = config.get("size") or {}
    ids = {name: tokenizer.tok.convert_tokens_to_ids(text) for name, text in IMAGE_TOKENS.items()}
    unknown = [IMAGE_TOKENS[n] for n, i in ids.items() if i is None or i == tokenizer.tok.unk_token_id]
    if unknown:
        raise DataError(f"data.tokenizer ({folder}) has {path.name} but no token(s) {unknown}; a Qwen2-VL, Qwen3-VL "
                        "or Qwen3.5 folder's tokenizer has them: point data.tokenizer at the full model folder.")
    video = tokenizer.tok.convert_tokens_to_ids(VIDEO_TOKEN)
    return ImageSpec(patch_size=int(config.get("patch_size", 14)), merge_size=int(config.get("merge_size", 2)),
                     temporal_patch_size=int(config.get("temporal_patch_size", 2)),
                     min_pixels=int(_pixels(config, size, "min_pixels", "shortest_edge", 56 * 56)),
                     max_pixels=int(_pixels(config, size, "max_pixels", "longest_edge", 28 * 28 * 1280)),
                     do_convert_rgb=bool(config.get("do_convert_rgb", True)), image_token_id=int(ids["image"]),
                     vision_start_id=int(ids["start"]), vision_end_id=int(ids["end"]),
                     video_token_id=None if video is None or video == tokenizer.tok.unk_token_id else int(video))


def _pixels(config: dict, size: dict, key: str, edge: str, default: int) -> int:
    """``min_pixels`` / ``max_pixels`` as the processor reads its config: the top-level key (Qwen2.5-VL's
    published folders have both) overrides ``size``'s edge, which overrides the class default."""
    if config.get(key) is not None:
        return config[key]
    return size.get(edge, default)


@dataclass(frozen=True)
class ImageRef:
    """One image of a record: a file (``path``, absolute) or stored bytes (``data``)."""

    path: Optional[str] = None
    data: Optional[bytes] = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        return Path(self.path).read_bytes()

    def name(self) -> str:
        return self.path if self.path is not None else f"<{len(self.data)} stored bytes>"


@dataclass(frozen=True)
class ImageInfo:
    """What the token store records for one image."""

    ref: ImageRef
    sha256: bytes
    grid: tuple[int, int, int]
    num_tokens: int


def _reference(value: Any, base_dir: Path, where: str) -> ImageRef:
    if isinstance(value, dict) and value.get("bytes") is not None:  # Parquet / datasets' Image struct
        value = value["bytes"]
    elif isinstance(value, dict) and isinstance(value.get("path"), str):
        value = value["path"]
    if isinstance(value, (bytes, bytearray)):
        return ImageRef(data=bytes(value))
    if isinstance(value, str) and value:
        return ImageRef(path=str((base_dir / value).resolve()))
    raise RecordError(f"{where} ({value!r:.60}) is not an image reference; give a path (relative to the data file's "
                      "folder, or data.image_root), the image's bytes, or {bytes: ..., path: ...}", "wrong_type")


def _message_lists(record: dict, schema: SampleSchema) -> list[tuple[str, list]]:
    keys = (schema.messages_key, schema.prompt_key, schema.completion_key)
    return [(k, record[k]) for k in keys if isinstance(record.get(k), list)]


def stage_images(record: dict, schema: SampleSchema, base_dir: Path) -> tuple[dict, list[ImageRef]]:
    """``(record, refs)``: the record with every image as a ``{"type": "image", "image_index": k}`` content
    part and the images in order of appearance. A record without images comes back as it is, with ``[]``."""
    videos = record.get(VIDEO_KEY)
    if videos:
        raise RecordError(f"the record lists {VIDEO_KEY} ({videos!r:.60}); video is not supported (images only): "
                          "drop the videos and their <video> placeholders, or the record", "non_text_part")
    listed = record.get(schema.images_key)
    if listed is not None and not isinstance(listed, list):
        raise RecordError(f"{schema.images_key!r} ({listed!r:.60}) must be a list of images; write "
                          f"{schema.images_key}: [a.png, ...] or set data.images_key", "wrong_type")
    listed = listed or []
    refs: list[ImageRef] = []
    num_from_list = 0
    staged = dict(record)
    for key, messages in _message_lists(record, schema):
        new_messages = []
        for i, message in enumerate(messages):
            content = message.get(schema.content_key) if isinstance(message, dict) else None
            parts, num_from_list = _stage_content(content, f"{key}[{i}].{schema.content_key}", listed, num_from_list,
                                                  refs, base_dir)
            new_messages.append(message if parts is None else {**message, schema.content_key: parts})
        staged[key] = new_messages
    if num_from_list != len(listed):
        if not _message_lists(record, schema):  # no messages to hold placeholders: the text record's refusal
            record_kind(record, schema)
        raise RecordError(f"the record has {num_from_list} image placeholder(s) ({IMAGE_PLACEHOLDER} or image parts "
                          f"without an 'image') but {schema.images_key!r} lists {len(listed)} image(s); give one "
                          f"image per placeholder{_sharegpt_hint(record, schema)}", "image_count_mismatch")
    if not refs:
        return record, []
    return staged, refs


def _sharegpt_hint(record: dict, schema: SampleSchema) -> str:
    """A ShareGPT record read with the default keys finds no placeholders: name the preset, as the text case does."""
    key = SHAREGPT["messages_key"]
    if key in record and schema.messages_key != key:
        return f" (the record's {key!r} are ShareGPT turns, read only with data.format=sharegpt)"
    return ""


def _stage_content(content, where: str, listed: list, num_from_list: int, refs: list, base_dir: Path):
    """``(parts or None when unchanged, images taken from the list so far)``."""
    if isinstance(content, str):
        if IMAGE_PLACEHOLDER not in content:
            return None, num_from_list
        parts = []
        for k, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if k:
                num_from_list = _take_listed(listed, num_from_list, refs, base_dir, parts)
            if text:
                parts.append({"type": "text", "text": text})
        return parts, num_from_list
    if not isinstance(content, list):
        return None, num_from_list
    for j, part in enumerate(content):
        if isinstance(part, dict) and (part.get("type") == "video" or "video" in part):
            raise RecordError(f"{where}[{j}] is a video part; video is not supported (images only): remove the part "
                              "or the record", "non_text_part")
    if not any(isinstance(p, dict) and p.get("type") == "image" for p in content):
        return None, num_from_list
    parts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "image"):
            parts.append(part)
        elif part.get("image") is None:
            num_from_list = _take_listed(listed, num_from_list, refs, base_dir, parts)
        else:
            refs.append(_reference(part["image"], base_dir, f"{where}[{j}].image"))
            parts.append({"type": "image", IMAGE_INDEX_KEY: len(refs) - 1})
    return parts, num_from_list


def _take_listed(listed: list, taken: int, refs: list, base_dir: Path, parts: list) -> int:
    if taken < len(listed):
        refs.append(_reference(listed[taken], base_dir, f"images[{taken}]"))
    else:
        refs.append(None)  # counted, refused once every placeholder is known
    parts.append({"type": "image", IMAGE_INDEX_KEY: len(refs) - 1})
    return taken + 1


HIGH_BIT_MODES = ("I", "F", "I;16", "I;16B", "I;16L", "I;16N")


def inspect_image(ref: ImageRef, spec: ImageSpec, where: str) -> ImageInfo:
    """Header, structure and checksum of one image (no decoding); a bad one raises its ``RecordError``."""
    from PIL import Image, UnidentifiedImageError

    try:
        data = ref.read()
    except FileNotFoundError:
        raise RecordError(f"{where}: image file {ref.path} does not exist; fix the path (relative paths start at the "
                          "data file's folder, or data.image_root) or remove the record", "image_missing") from None
    except OSError as exc:
        raise RecordError(f"{where}: image file {ref.path} cannot be read ({exc.strerror}); fix its permissions or "
                          "remove the record", "image_unreadable") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height, mode = image.width, image.height, image.mode
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise RecordError(f"{where}: image {ref.name()} is not a readable image ({exc}); replace the file with a "
                          "valid PNG/JPEG or remove the record", "image_unreadable") from None
    if mode in HIGH_BIT_MODES or (mode != "RGB" and (not spec.do_convert_rgb or mode not in CONVERTED_MODES)):
        why = ("converting it to RGB would clip every value above 255" if mode in HIGH_BIT_MODES
               else "the processor's do_convert_rgb is off" if not spec.do_convert_rgb else "it has no RGB conversion")
        raise RecordError(f"{where}: image {ref.name()} has mode {mode!r}, which is refused ({why}); save it as 8-bit "
                          "RGB (PIL: image.convert('RGB') after scaling to 0..255) or remove the record", "image_mode")
    try:
        grid = spec.grid(height, width)
    except ValueError as exc:
        raise RecordError(f"{where}: image {ref.name()} ({width}x{height}) cannot be resized by the processor ({exc}); "
                          "crop it or remove the record", "image_unreadable") from None
    return ImageInfo(ref, hashlib.sha256(data).digest(), grid, spec.num_tokens(grid))


def expand_images(ids: np.ndarray, mask: np.ndarray, images: list[ImageInfo], spec: ImageSpec):
    """``(ids, mask, starts)``: each rendered ``<|image_pad|>`` repeated to its image's token count (the mask
    value repeated with it), and the first pad position of every image. The template must render one pad per
    image, in order; any other count refuses the record, as does a rendered ``<|video_pad|>``. A record without
    images comes through too (``images`` empty): a pad token in its text is refused.

    Example, one image of 3 tokens: ids ``[S, P, E, x]`` -> ``[S, P, P, P, E, x]``, starts ``[1]``."""
    if spec.video_token_id is not None and np.any(np.asarray(ids) == spec.video_token_id):
        raise RecordError("the chat template rendered <|video_pad|> (the text holds the token itself); video is not "
                          "supported (images only): remove the token from the text or the record", "non_text_part")
    where = np.flatnonzero(np.asarray(ids) == spec.image_token_id)
    if len(where) != len(images):
        raise RecordError(f"the chat template rendered {len(where)} <|image_pad|> token(s) for {len(images)} image(s) "
                          "(the text holds the token itself, or the template drops image parts); remove the literal "
                          "token from the text or use a template that renders image parts", "image_count_mismatch")
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[where] = [info.num_tokens for info in images]
    starts = where + np.concatenate([[0], np.cumsum(repeats[where] - 1)[:-1]]).astype(np.int64) if len(where) else where
    return np.repeat(ids, repeats), np.repeat(mask, repeats), starts.astype(np.int64)

