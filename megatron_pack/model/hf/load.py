"""Stream a Hugging Face safetensors folder into this rank's megatron-core ``GPTModel`` shard.

Each parameter is filled from ``safe_open(...).get_slice(name)[rows, cols]``: only the rows (or
columns) this TP rank holds are read, one tensor at a time, so a rank never holds more than its
own shard plus one slice in flight (``tests/functional/test_hf_memory.py`` measures it).

A model chunk (a pipeline stage, an expert-parallel rank) reads only its own layers' and experts'
tensors, named globally (``rules.Placement``; by default the one megatron-core's ``layer_number``
and ``pre_process`` / ``post_process`` give the chunk). Nothing is dropped silently: an HF tensor
no rule of the whole model reads, or a parameter no rule fills, is an error naming it. Only
``*.safetensors`` is read; a folder with only ``pytorch_model.bin`` (a pickle) is refused with the
conversion command.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from megatron_pack.config.hf_config import derive_model_keys, family_of, read_hf_config
from megatron_pack.config.hf_config.record import canonical_hf_name, shape_matches, stacked_part
from megatron_pack.model.hf.folder_check import INDEX, MXFP4_PARTS, SINGLE
from megatron_pack.model.hf.mapping import load_shard_into, shard_shape
from megatron_pack.model.hf.transforms import Dims
from megatron_pack.model.hf.rules import TE_ALIASES, Placement, linear_layers, rule_hf_shapes, rules_for

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class SafetensorsFolder:
    """The tensors of a HF folder by name (``model.safetensors`` or the sharded index), read lazily.

    >>> folder = SafetensorsFolder("llama_dir")
    >>> folder.shape("model.embed_tokens.weight"), folder.read("model.embed_tokens.weight", slice(0, 8)).shape
    ((301, 64), torch.Size([8, 64]))
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.weight_map = self._weight_map()
        self.bytes_read = 0

    def _weight_map(self) -> dict[str, str]:
        """Tensor name (the Hub spelling the rules use) -> file; ``self.stored`` keeps the name in the file."""
        mapping = self._stored_weight_map()
        self.stored = {canonical_hf_name(name): name for name in mapping}
        names = {canonical_hf_name(name): file for name, file in mapping.items()}
        blocks, scales = MXFP4_PARTS
        self.mxfp4 = {n[:-len(blocks)]: (n, n[:-len(blocks)] + scales) for n in names
                      if n.endswith(blocks) and n[:-len(blocks)] + scales in names}
        self.pair_files = {n: names[n] for pair in self.mxfp4.values() for n in pair}
        for base, pair in self.mxfp4.items():  # one tensor X for the pair (folder_check.mxfp4_tensors)
            names[base] = names[pair[0]]
            del names[pair[0]], names[pair[1]]
        return names

    def _stored_weight_map(self) -> dict[str, str]:
        from safetensors import safe_open

        if (self.root / INDEX).is_file():
            index = json.loads((self.root / INDEX).read_text(encoding="utf-8"))
            weight_map = dict(index.get("weight_map", {}))
            missing = sorted({f for f in weight_map.values() if not (self.root / f).is_file()})
            if missing:
                raise FileNotFoundError(f"model.pretrained ({self.root}): {INDEX} names {missing[0]}, which is not in "
                                        "the folder; finish the download (all shards) or fix the index.")
            return weight_map
        if (self.root / SINGLE).is_file():
            with safe_open(self.root / SINGLE, framework="pt") as f:
                return {name: SINGLE for name in f.keys()}
        from megatron_pack.model.hf.folder_check import pickle_only_message

        raise FileNotFoundError(pickle_only_message(self.root, f"model.pretrained ({self.root})"))

    @contextlib.contextmanager
    def _slice(self, name: str):
        """``get_slice(name)`` of a file opened for this one access: closing it unmaps the file, so the
        pages a read touched leave this process's RSS at once (a shard file can hold gigabytes)."""
        from safetensors import safe_open

        file = self.weight_map.get(name) if name not in self.pair_files else self.pair_files[name]
        if file is None:
            raise KeyError(f"model.pretrained ({self.root}) has no tensor {name!r}; the folder does not match its "
                           "config.json (re-download it).")
        with safe_open(self.root / file, framework="pt") as handle:
            yield handle.get_slice(self.stored[name])

    def shape(self, name: str) -> tuple[int, ...]:
        stacked = stacked_part(name)
        base = stacked[0] if stacked else name
        if base in self.mxfp4:
            with self._slice(self.mxfp4[base][0]) as part:
                experts, rows, groups, width = part.get_shape()
            whole = (experts, groups * width * 2, rows)
        else:
            with self._slice(base) as part:
                whole = tuple(part.get_shape())
        return whole[1:] if stacked else whole

    def dtype(self, name: str) -> torch.dtype:
        stacked = stacked_part(name)
        base = stacked[0] if stacked else name
        if base in self.mxfp4:
            return torch.float32  # dequantised exactly (FP4 code x power of two)
        with self._slice(base) as part:
            return _DTYPES[part.get_dtype()]

    def _mxfp4(self, base: str, experts: slice) -> Tensor:
        """Experts ``experts`` of the MXFP4 pair of ``base`` in float32, [n, in, out] (x @ W), by transformers'
        ``convert_moe_packed_tensors`` (its own dequantisation, the one from_pretrained runs)."""
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        blocks, scales = (self._read_stored(n, experts) for n in self.mxfp4[base])
        return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)

    def _read_stored(self, name: str, rows: slice) -> Tensor:
        with self._slice(name) as part:
            tensor = part[rows]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> Tensor:
        """The tensor ``name`` (rows, columns of it); ``<tensor>[k]`` is slice k of a stacked tensor
        (``record.stacked_part``), read alone."""
        stacked = stacked_part(name)
        if stacked is not None and stacked[0] in self.mxfp4:
            base, k = stacked
            tensor = self._mxfp4(base, slice(k, k + 1))[0]
            return tensor[rows or slice(None)][:, cols] if cols is not None else tensor[rows or slice(None)]
        if stacked is not None:
            base, k = stacked
            with self._slice(base) as part:
                index = (slice(k, k + 1),) + ((rows or slice(None),) if rows is not None or cols is not None else ())
                tensor = part[index + ((cols,) if cols is not None else ())][0]
            self.bytes_read += tensor.numel() * tensor.element_size()
            return tensor
        with self._slice(name) as part:
            if cols is not None:
                tensor = part[rows or slice(None), cols]
            elif rows is not None:
                tensor = part[rows]
            else:
                tensor = part[:]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        """Nothing stays open between reads; kept so the folder works as a context manager."""

    def __enter__(self) -> "SafetensorsFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class LoadReport:
    """What ``load_pretrained`` read."""

    num_tensors: int
    bytes_read: int
    seconds: float
    source_dtype: torch.dtype
    hf_names: tuple[str, ...] = ()
    """The HF tensors read, in load order (a pipeline stage's are its own layers')."""


def find_param(params: dict[str, torch.nn.Parameter], name: str) -> tuple[str, torch.nn.Parameter]:
    """The model parameter for a table name, trying the Transformer Engine spelling too."""
    if name in params:
        return name, params[name]
    for local, te in TE_ALIASES.items():
        if name.endswith(local) and name[: -len(local)] + te in params:
            alias = name[: -len(local)] + te
            return alias, params[alias]
    raise KeyError(name)


def placement_of(model) -> Placement:
    """The part of the model a megatron-core ``GPTModel`` chunk holds: its layers (megatron-core's
    ``layer_number`` is global and 1-based), the embedding on the first stage, the output on the last."""
    layers = model.decoder.layers
    moe = getattr(layers[0], "mlp", None) if len(layers) else None
    moe = moe if hasattr(moe, "local_expert_indices") else None
    return Placement(len(layers), layer_offset=layers[0].layer_number - 1 if len(layers) else 0,
                     pre_process=model.pre_process, post_process=model.post_process,
                     num_experts=moe.num_local_experts if moe is not None else 0,
                     expert_offset=moe.local_expert_indices[0] if moe is not None else 0,
                     linear_layers=tuple(layer.layer_number - 1 for layer in layers
                                         if isinstance(getattr(layer, "self_attention", None), _linear_attention_class())))


def _linear_attention_class() -> type:
    from megatron_pack.model.linear_attention import PackedGatedDeltaNet

    return PackedGatedDeltaNet


def load_pretrained(model: torch.nn.Module, folder: str | Path, model_cfg, *, tp_rank: int, tp_size: int,
                    placement: Optional[Placement] = None, etp_rank: int = 0,
                    dims: Optional[Dims] = None) -> LoadReport:
    """Fill every parameter of ``model`` (this rank's shard of its chunk) from the HF folder.

    ``placement`` None reads it from the model (``placement_of``); ``dims`` None builds it from
    ``model_cfg`` and ``tp_size`` (give it for expert parallelism: ``Dims(..., ep=, etp=, num_experts=)``).
    Returns what was read.
    """
    start = time.perf_counter()
    hf = read_hf_config(folder)
    dims = Dims.from_model_config(model_cfg, tp_size) if dims is None else dims
    placement = placement_of(model) if placement is None else placement
    tied = not model_cfg.untie_embeddings_and_output_weights
    params = dict(model.named_parameters())
    filled: set[str] = set()
    used: dict[str, None] = {}  # the HF names read, in order
    with _reader(folder, hf, model_cfg, tied) as source, torch.no_grad():
        for rule, mcore, hf_names in rules_for(hf["model_type"], tied=tied, placement=placement):
            try:
                name, param = find_param(params, mcore)
            except KeyError:
                raise ValueError(f"model has no parameter {mcore} for {hf_names[0]} of {folder}; the model was built "
                                 "with other model.* settings than config.json gives.") from None
            _check_shapes(folder, rule, hf_names, source, dims, name, param, tp_rank, family_of(hf["model_type"]))
            load_shard_into(rule, hf_names, source, dims, tp_rank, param.data, etp_rank=etp_rank)
            filled.add(name)
            used.update(dict.fromkeys(hf_names))
        tower = family_of(hf["model_type"]).vision
        if tower is not None:
            used.update(dict.fromkeys(_load_vision(params, tower, source, folder, filled)))
        _check_coverage(folder, source, params, filled, _whole_model_names(hf, dims, tied, source),
                        family_of(hf["model_type"]).ignored, tied)
        source_dtype = source.dtype(next(iter(used)))
        bytes_read = source.bytes_read
    return LoadReport(num_tensors=len(filled), bytes_read=bytes_read, seconds=time.perf_counter() - start,
                      source_dtype=source_dtype, hf_names=tuple(used))


def _reader(folder, hf: dict, model_cfg, tied: bool):
    """The folder's tensors; with ``model.resize_vocab`` and a model.vocab_size above config.json's, its
    vocabulary tensors grown to model.vocab_size (``resize.GrownVocab``: transformers' mean resizing)."""
    source = SafetensorsFolder(folder)
    if not getattr(model_cfg, "resize_vocab", False) or model_cfg.vocab_size <= int(hf["vocab_size"]):
        return source
    from megatron_pack.model.hf.resize import GrownVocab, vocab_names

    whole = Placement(derive_model_keys(hf)["num_layers"])
    return GrownVocab(source, vocab_names(rules_for(hf["model_type"], tied=tied, placement=whole)),
                      model_cfg.vocab_size)


def _load_vision(params: dict, tower, source: SafetensorsFolder, folder, filled: set[str]) -> list[str]:
    """Fill the vision tower's parameters (a first pipeline stage's; replicated: the whole tensor on every
    rank, one read each) from the folder's tensors of the same transformers name; returns the HF names read."""
    names = []
    for name, param in params.items():
        if not name.startswith(tower.mcore_prefix):
            continue
        hf_name = tower.hf_prefix + name[len(tower.mcore_prefix):]
        if hf_name not in source.weight_map:
            raise ValueError(f"{folder} has no tensor {hf_name} for the vision tower's {name}; the folder does not "
                             "match its config.json's vision_config (re-download it).")
        shape = source.shape(hf_name)
        if tuple(shape) != tuple(param.shape):
            raise ValueError(f"{folder}: {hf_name} {tuple(shape)} does not give {name} {tuple(param.shape)}; the "
                             "safetensors do not match config.json's vision_config.")
        param.data.copy_(source.read(hf_name))
        filled.add(name)
        names.append(hf_name)
    return names


def stored_name(name: str) -> str:
    """The tensor a folder stores ``name`` in: a stacked tensor for ``<tensor>[k]``, else ``name``."""
    stacked = stacked_part(name)
    return stacked[0] if stacked else name


def _whole_model_names(hf: dict, dims: Dims, tied: bool, source: SafetensorsFolder) -> set[str]:
    """Every HF tensor some chunk of the model reads (a stage's folder check is the whole model's): the
    rules' names, and a vision tower's tensors (the first stage's, whichever stage this is)."""
    keys = derive_model_keys(hf)
    whole = Placement(keys["num_layers"], num_experts=dims.num_experts,
                      linear_layers=linear_layers(keys["num_layers"], keys["full_attention_interval"]))
    names = {stored_name(n) for _, _, names in rules_for(hf["model_type"], tied=tied, placement=whole) for n in names}
    tower = family_of(hf["model_type"]).vision
    if tower is not None:
        names |= {n for n in source.weight_map if n.startswith(tower.hf_prefix)}
    return names


def _check_shapes(folder, rule, hf_names, source: SafetensorsFolder, dims: Dims, name: str, param, tp_rank: int,
                  family) -> None:
    """The file's shapes must be the ones config.json implies and give exactly this parameter's shard."""
    shapes = [source.shape(n) for n in hf_names]
    as_implied = all(shape_matches(family, stored_name(n), got, want)  # Qwen3-VL-MoE's experts: either orientation
                     for n, got, want in zip(hf_names, shapes, rule_hf_shapes(rule, dims)))
    if not as_implied or tuple(shard_shape(rule, hf_names, source, dims)) != tuple(param.shape):
        raise ValueError(f"{folder}: {', '.join(f'{n} {s}' for n, s in zip(hf_names, shapes))} do not give "
                         f"{name} {tuple(param.shape)} on TP rank {tp_rank}; the safetensors do not match config.json.")


def _check_coverage(folder, source: SafetensorsFolder, params: dict, filled: set[str], known: set[str],
                    ignored: tuple[str, ...], tied: bool) -> None:
    unfilled = sorted(set(params) - filled)
    if unfilled:
        raise ValueError(f"{folder}: no Hugging Face tensor maps to {unfilled[:3]} (model.* settings differ from "
                         "config.json?); nothing was left at random init silently.")
    extra = sorted(n for n in set(source.weight_map) - known
                   if not n.endswith(ignored) and not (tied and n == "lm_head.weight"))
    if extra:
        raise ValueError(f"{folder}: tensors {extra[:3]} ({len(extra)} in all) map to no megatron-core parameter; "
                         "the folder holds more than its config.json describes (an unsupported variant).")
