"""A Hugging Face model folder, checked before anything is launched (torch-free).

``prepare``, ``verify``, ``export`` and ``train`` (``--check`` in the launch scripts, and every
rank before its process group) call :func:`folder_problems` on ``model.pretrained``: each
problem is one line naming the file and the fix, so a broken download is refused before torchrun
starts instead of as a traceback per rank. What is read is only what the safetensors format puts
up front (https://github.com/huggingface/safetensors, "Format"):

    8 bytes   N, little-endian u64: the length of the JSON header
    N bytes   {"__metadata__": {...}, "<tensor>": {"dtype": "BF16", "shape": [4096, 4096],
               "data_offsets": [begin, end]}, ...}     offsets into the data after the header
    ...       the tensor bytes, covering [0, last end) exactly

so a truncated file (its header describes more bytes than follow it), a broken header, a tensor
the mapping needs but no file holds, a shape config.json contradicts and a dtype the loader does
not read are found from the headers and the file lengths alone. No pickle file is ever opened:
a folder with only ``pytorch_model.bin`` is refused with the conversion command.

:func:`nonfinite_problems` reads the tensor bytes too (memory-mapped, chunked, integer bit tests
that work for F32, BF16 and F16 alike): NaN or Inf anywhere in a weight the mapping loads is
refused naming the tensor. ``train --check`` runs it (``model.check_pretrained_values``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_pack.config.hf_config import derive_model_keys, family_of, read_hf_config
from megatron_pack.config.hf_config.record import canonical_hf_name, shape_matches
from megatron_pack.model.hf.rules import hf_shapes

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
LOADED_DTYPES = ("F32", "BF16", "F16")
"""The dtypes loaded as they are; MXFP4, a pair of tensors (``mxfp4_tensors``), is dequantised on load by transformers'
own code."""
MXFP4_PARTS = ("_blocks", "_scales")
"""An MXFP4 tensor ``X`` is stored as ``X_blocks`` (uint8 [..., out, in / 32, 16]: two FP4 values a byte) and
``X_scales`` (uint8 [..., out, in / 32]: a power-of-two exponent + 127 per block of 32) (gpt-oss's experts)."""
"""safetensors dtypes ``model.hf.load`` reads (as torch float32 / bfloat16 / float16)."""
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
MAX_HEADER_BYTES = 100_000_000
"""The safetensors format's own limit on the JSON header."""
_EXPONENT = {"F32": ("<u4", 0x7F800000, 0x007FFFFF), "BF16": ("<u2", 0x7F80, 0x007F), "F16": ("<u2", 0x7C00, 0x03FF)}
"""dtype -> (integer view, exponent mask, mantissa mask): all exponent bits set is Inf (mantissa 0) or NaN."""
REDOWNLOAD = "re-download it (huggingface-cli download <repo> --local-dir DIR) or copy it again"


class FolderProblem(ValueError):
    """One problem with a file of a model folder; the message is one line naming the file and the fix."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset of the tensor's data in the file."""
    end: int


def read_header(path: Path, where: str) -> dict[str, TensorEntry]:
    """The tensors of the safetensors file ``path`` by name; ``FolderProblem`` for a truncated file
    or a broken header (``where`` names the folder's config key in the message)."""
    size = path.stat().st_size
    broken = f"{where}: {path.name} has a broken safetensors header"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FolderProblem(f"{where}: {path.name} is truncated ({size} bytes, less than a safetensors header); "
                                f"{REDOWNLOAD}.")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise FolderProblem(f"{broken} (it says {length:,} header bytes follow, the file has {size:,} bytes in "
                                f"all); the file is damaged or not safetensors: {REDOWNLOAD}.")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FolderProblem(f"{broken} (not valid JSON: {exc}); {REDOWNLOAD}.") from None
    if not isinstance(header, dict):
        raise FolderProblem(f"{broken} (a JSON {type(header).__name__}, not an object); {REDOWNLOAD}.")
    entries = {name: _entry(name, spec, path.name, 8 + length, broken) for name, spec in header.items()
               if name != "__metadata__"}
    _check_coverage(entries, size - 8 - length, path.name, where, broken)
    return entries


def _entry(name: str, spec: Any, file: str, data_start: int, broken: str) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = spec["dtype"], tuple(int(n) for n in spec["shape"]), spec["data_offsets"]
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise FolderProblem(f"{broken} (tensor {name!r}: {str(spec)[:80]} is not {{dtype, shape, data_offsets: "
                            f"[begin, end]}}); {REDOWNLOAD}.") from None
    if dtype not in DTYPE_BYTES:
        raise FolderProblem(f"{broken} (tensor {name!r} has dtype {dtype!r}, not a safetensors dtype); {REDOWNLOAD}.")
    numel = 1
    for n in shape:
        numel *= n
    if min(shape, default=0) < 0 or end - begin != numel * DTYPE_BYTES[dtype] or begin < 0:
        raise FolderProblem(f"{broken} (tensor {name!r}: {dtype} {list(shape)} needs {numel * DTYPE_BYTES[dtype]:,} "
                            f"bytes, its data_offsets [{begin}, {end}] give {end - begin:,}); {REDOWNLOAD}.")
    return TensorEntry(name, file, dtype, shape, data_start + begin, data_start + end)


def _check_coverage(entries: dict[str, TensorEntry], data_bytes: int, file: str, where: str, broken: str) -> None:
    """The tensors cover the data exactly, as safetensors requires: no hole, no overlap, nothing after."""
    spans = sorted((e.begin, e.end, e.name) for e in entries.values())
    start = spans[0][0] if spans else 0
    described = max((end for _, end, _ in spans), default=start) - start
    if described > data_bytes:
        raise FolderProblem(f"{where}: {file} is truncated: its header describes {described:,} bytes of tensor data, "
                            f"the file holds {data_bytes:,} (the download was cut); {REDOWNLOAD}.")
    position = start
    for begin, end, name in spans:
        if begin != position:
            raise FolderProblem(f"{broken} (tensor {name!r} starts at byte {begin - start:,} of the data, the tensor "
                                f"before it ends at {position - start:,}); {REDOWNLOAD}.")
        position = end
    if described < data_bytes:
        raise FolderProblem(f"{broken} ({data_bytes - described:,} bytes follow its last tensor); {REDOWNLOAD}.")


def pickle_only_message(folder: Path, where: str) -> str:
    """The refusal of a folder without safetensors (with the conversion command when it holds a pickle)."""
    pickles = sorted(p.name for p in Path(folder).glob("pytorch_model*.bin"))
    hint = (f" It holds {pickles[0]} (a pickle, never loaded here): convert it once with transformers "
            "(AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)).") if pickles \
        else " Download the weights (*.safetensors) into it."
    return f"{where} has no {SINGLE} or {INDEX}.{hint}"


def weight_map(folder: Path, where: str) -> dict[str, str]:
    """tensor name -> file, from the index (``model.safetensors.index.json``) or ``model.safetensors``'s header."""
    if (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text(encoding="utf-8"))
            mapping = dict(index["weight_map"])
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise FolderProblem(f"{where}: {INDEX} is not a safetensors index ({type(exc).__name__}: {exc}); "
                                f"{REDOWNLOAD}.") from None
        missing = sorted({f for f in mapping.values() if not (folder / f).is_file()})
        if missing:
            raise FolderProblem(f"{where}: {INDEX} names {missing[0]}, which is not in the folder; finish the "
                                "download (all shards) or fix the index.")
        return mapping
    if (folder / SINGLE).is_file():
        return {name: SINGLE for name in read_header(folder / SINGLE, where)}
    raise FolderProblem(pickle_only_message(folder, where))


def read_tensors(folder: str | Path, where: str) -> dict[str, TensorEntry]:
    """Every tensor of the folder by name (the Hub spelling, ``record.canonical_hf_name``), each header read
    once; ``FolderProblem`` on the first bad file."""
    folder = Path(folder)
    mapping = weight_map(folder, where)
    headers = {file: read_header(folder / file, where) for file in sorted(set(mapping.values()))}
    out = {}
    for name, file in mapping.items():
        if name not in headers[file]:
            raise FolderProblem(f"{where}: {INDEX} places {name} in {file}, whose header does not hold it; "
                                f"the folder is incomplete: {REDOWNLOAD}.")
        out[canonical_hf_name(name)] = headers[file][name]
    return mxfp4_tensors(out)


def mxfp4_tensors(entries: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """``entries`` with each MXFP4 pair ``X_blocks`` / ``X_scales`` (``MXFP4_PARTS``) as one entry ``X`` of dtype
    MXFP4 and the shape transformers dequantises it to: blocks [E, out, G, 16] -> [E, G * 32, out] (x @ W).

    >>> e = lambda n, dtype, *shape: TensorEntry(n, "f", dtype, shape, 0, 0)
    >>> mxfp4_tensors({"w_blocks": e("w_blocks", "U8", 4, 96, 2, 16), "w_scales": e("w_scales", "U8", 4, 96, 2)})["w"].shape
    (4, 64, 96)
    """
    out = dict(entries)
    for name, blocks in entries.items():
        base = name[:-len(MXFP4_PARTS[0])]
        if not name.endswith(MXFP4_PARTS[0]) or base + MXFP4_PARTS[1] not in entries:
            continue
        *prefix, rows, groups, width = blocks.shape
        out[base] = TensorEntry(base, blocks.file, "MXFP4", (*prefix[:1], groups * width * 2, rows, *prefix[1:]),
                                blocks.begin, blocks.end)
        del out[name], out[base + MXFP4_PARTS[1]]
    return out


def folder_problems(folder: str | Path, *, where: Optional[str] = None, hf: Optional[dict] = None) -> list[str]:
    """What stops ``folder`` from loading, one line each (empty: it loads). config.json must already
    be supported (``load_config`` refuses it otherwise); ``hf`` is its parsed content when at hand."""
    folder = Path(folder)
    where = where or f"model.pretrained ({folder})"
    hf = hf if hf is not None else read_hf_config(folder)
    try:
        tensors = read_tensors(folder, where)
    except FolderProblem as exc:
        return [str(exc)]
    problems = []
    expected = hf_shapes(hf)
    for name, shape in expected.items():
        entry = tensors.get(name)
        if entry is None:
            problems.append(f"{where} has no tensor {name}, which the {hf['model_type']} mapping needs "
                            f"(config.json: {derive_model_keys(hf)['num_layers']} layers); the folder is incomplete "
                            f"or does not match its config.json: {REDOWNLOAD}.")
        elif not shape_matches(family_of(hf["model_type"]), name, entry.shape, shape):
            problems.append(f"{where}: {entry.file} holds {name} with shape {list(entry.shape)}, config.json gives "
                            f"{list(shape)}; the weights do not match config.json: {REDOWNLOAD}.")
        elif entry.dtype not in LOADED_DTYPES + ("MXFP4",):
            problems.append(f"{where}: {entry.file} holds {name} as {entry.dtype}, which megatron_pack does not load "
                            f"({', '.join(LOADED_DTYPES)}); save the folder again in one of those (transformers: "
                            "from_pretrained(dir, dtype=torch.bfloat16).save_pretrained(dir)).")
    tied = bool(hf.get("tie_word_embeddings", False))
    family = family_of(hf["model_type"])
    tower = family.vision.hf_prefix if family.vision is not None else None
    if tower is not None and not any(n.startswith(tower) for n in tensors):
        problems.append(f"{where} has no {tower}* tensors (the vision tower of {hf['model_type']}); the folder is "
                        f"incomplete: {REDOWNLOAD}.")
    extra = sorted(n for n in set(tensors) - set(expected)
                   if not n.endswith(family.ignored) and not (tied and n == "lm_head.weight")
                   and not (tower is not None and n.startswith(tower)))
    if extra:
        problems.append(f"{where}: tensors {extra[:3]} ({len(extra)} in all) map to no megatron-core parameter; the "
                        "folder holds more than its config.json describes (an unsupported variant).")
    return problems


def nonfinite_problems(folder: str | Path, *, where: Optional[str] = None, hf: Optional[dict] = None,
                       chunk_elements: int = 1 << 22) -> list[str]:
    """One line per weight the mapping loads that holds NaN or Inf (the folder must pass
    :func:`folder_problems` first). Reads every byte of those tensors once."""
    import numpy as np

    folder = Path(folder)
    where = where or f"model.pretrained ({folder})"
    hf = hf if hf is not None else read_hf_config(folder)
    tensors = read_tensors(folder, where)
    tower = family_of(hf["model_type"]).vision
    expected = list(hf_shapes(hf)) + ([n for n in tensors if n.startswith(tower.hf_prefix)] if tower else [])
    problems = []
    for file in sorted({tensors[n].file for n in expected}):
        data = np.memmap(folder / file, dtype=np.uint8, mode="r")
        for name in (n for n in expected if tensors[n].file == file):
            entry = tensors[name]
            if entry.dtype == "MXFP4":  # FP4 codes and power-of-two scales: every code is a finite value
                continue
            view, exponent, mantissa = _EXPONENT[entry.dtype]
            values = data[entry.begin:entry.end].view(view)
            num_nan = num_inf = 0
            for start in range(0, values.size, chunk_elements):
                part = values[start:start + chunk_elements]
                special = part[(part & exponent) == exponent]
                if special.size:
                    nan = int(np.count_nonzero(special & mantissa))
                    num_nan, num_inf = num_nan + nan, num_inf + special.size - nan
            if num_nan or num_inf:
                problems.append(f"{where}: {file} holds {name} with {num_nan} NaN and {num_inf} Inf values; the "
                                f"weights are damaged (not the data): {REDOWNLOAD}.")
        del data
    return problems
