"""megatron-core shards -> a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` loads.

Sources (one process, whatever layout wrote them):

* a training checkpoint: the whole model, each tensor by its global identity whatever layout wrote it
  (read by ``megatron_pack.cli.export`` through ``training.model_reader``), mapped back per the family table
  (``mapping.export_tensors``); a pipeline stage's chunk is written under
  its global layer names (``hf_tensors(..., placement=)``);
* a pretrained folder: its tensors put through the load transforms first (a round trip that
  proves the mapping on the user's own model).

What is written (``write_hf_folder``): ``model.safetensors`` or, above ``export.max_shard_size``,
``model-0000k-of-0000N.safetensors`` with ``model.safetensors.index.json``; the source's
``config.json`` (its dtype field set to the exported dtype), ``generation_config.json`` when the
source had one, and the tokenizer files. A training run from ``model.pretrained`` keeps these in
``<checkpoint.save>/hf_source/`` (``save_hf_source``), so a checkpoint exports on its own.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor

from megatron_pack.config.hf_config import family_of, read_hf_config
from megatron_pack.model.hf.load import SafetensorsFolder
from megatron_pack.config.hf_config.record import export_hf_name, stacked_part
from megatron_pack.model.hf.mapping import export_tensors, load_shard
from megatron_pack.model.hf.transforms import Dims
from megatron_pack.model.hf.rules import OUTPUT, TE_ALIASES, Placement, rules_for

HF_SOURCE = "hf_source"
SOURCE_JSON = "source.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
"""The tokenizer's files, and a vision-language model's processor files (image / video preprocessing)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def save_hf_source(pretrained: str | Path, save_dir: str | Path, *, tokenizer: Optional[str | Path] = None,
                   chat_template: Optional[str] = None, vocab_size: Optional[int] = None) -> Path:
    """Copy config.json, generation_config.json and the tokenizer files of ``pretrained`` (those of
    ``tokenizer``, the folder the training data was tokenized with, when given) into ``save_dir/hf_source``
    with ``source.json`` (its path and tensor dtype); ``chat_template`` (the template the data was
    rendered with, ``data.chat_template``) replaces the tokenizer's; ``vocab_size`` (the model's, grown by
    ``model.resize_vocab``) replaces config.json's when it differs. Returns that folder."""
    src, dst = Path(pretrained), Path(save_dir) / HF_SOURCE
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    config = json.loads((dst / "config.json").read_text(encoding="utf-8"))
    if vocab_size is not None and config.get("vocab_size") != vocab_size:  # the checkpoint's model, not the folder's
        config["vocab_size"] = vocab_size
        (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
    tok = Path(tokenizer) if tokenizer is not None and Path(tokenizer).is_dir() else src
    for name in TOKENIZER_FILES:
        if (tok / name).is_file():
            shutil.copyfile(tok / name, dst / name)
    if chat_template is not None:
        set_chat_template(dst, chat_template)
    with SafetensorsFolder(src) as folder:
        dtype = folder.dtype(next(iter(folder.weight_map)))
    (dst / SOURCE_JSON).write_text(json.dumps({"pretrained": str(src.resolve()), "dtype": DTYPE_NAMES[dtype]},
                                              indent=2), encoding="utf-8")
    return dst


def set_chat_template(folder: str | Path, text: str) -> bool:
    """Make ``text`` the chat template of the tokenizer in ``folder``: ``tokenizer_config.json``'s
    ``chat_template`` and ``chat_template.jinja`` (which transformers reads first) both hold it.
    False (nothing written) when ``folder`` holds no tokenizer_config.json."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = text
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    (folder / "chat_template.jinja").write_text(text, encoding="utf-8")
    return True


def source_dtype(folder: str | Path) -> torch.dtype:
    """The tensor dtype of a HF folder (its safetensors), or of an ``hf_source`` copy (source.json)."""
    folder = Path(folder)
    if (folder / SOURCE_JSON).is_file():
        return DTYPES[json.loads((folder / SOURCE_JSON).read_text(encoding="utf-8"))["dtype"]]
    with SafetensorsFolder(folder) as source:
        return source.dtype(next(iter(source.weight_map)))


def shards_from_pretrained(folder: str | Path, model_cfg, tp: int, *,
                           placement: Optional[Placement] = None) -> list[dict[str, Tensor]]:
    """Every TP rank's megatron-core state of a HF folder (of the chunk at ``placement``, by default
    the whole model), through the load transforms; an expert's weight split alike (expert TP = TP,
    megatron-core's default)."""
    hf = read_hf_config(folder)
    dims = Dims.from_model_config(model_cfg, tp)
    tied = not model_cfg.untie_embeddings_and_output_weights
    placement = Placement.whole(model_cfg) if placement is None else placement
    out: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    tower = family_of(hf["model_type"]).vision
    with SafetensorsFolder(folder) as source:
        for rule, mcore, hf_names in rules_for(hf["model_type"], tied=tied, placement=placement):
            for rank in range(tp):
                out[rank][mcore] = load_shard(rule, hf_names, source, dims, rank, etp_rank=rank)
        if tower is not None and placement.pre_process:  # replicated: the same tensor on every rank
            for name in (n for n in source.weight_map if n.startswith(tower.hf_prefix)):
                tensor = source.read(name)
                for rank in range(tp):
                    out[rank][tower.mcore_prefix + name[len(tower.hf_prefix):]] = tensor
    return out


def _canonical(name: str) -> str:
    """A checkpoint parameter name as the tables spell it (no Float16Module prefix, local-spec norms)."""
    name = name.removeprefix("module.")
    for local, te in TE_ALIASES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def hf_tensors(shards: list[dict[str, Tensor]], model_type: str, model_cfg, *,
               placement: Optional[Placement] = None, etp: Optional[int] = None) -> dict[str, Tensor]:
    """HF name -> tensor, in table order, from every TP rank's megatron-core state of the chunk at
    ``placement`` (by default the whole model): a pipeline stage's tensors under their global names.
    A last stage's copy of tied embeddings is read but not written (the first stage writes it).
    ``etp`` is the expert tensor-parallel degree the experts' shards were split over (None: TP)."""
    dims = Dims.from_model_config(model_cfg, len(shards), etp=etp)
    tied = not model_cfg.untie_embeddings_and_output_weights
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    shards = [{_canonical(name): tensor for name, tensor in shard.items()} for shard in shards]
    placement = Placement.whole(model_cfg) if placement is None else placement
    for rule, mcore, hf_names in rules_for(model_type, tied=tied, placement=placement):
        missing = [r for r, shard in enumerate(shards) if mcore not in shard]
        if missing:
            raise ValueError(f"the checkpoint has no {mcore} on TP rank {missing[0]}: it was not written for this "
                             "model (config.json of the export source); pass the model.pretrained it was trained from.")
        used.add(mcore)
        if tied and mcore == OUTPUT:
            continue
        out.update(zip(hf_names, export_tensors(rule, [shard[mcore] for shard in shards], dims)))
    tower = family_of(model_type).vision
    if tower is not None:  # the vision tower: transformers' own names, replicated (rank 0's copy)
        for name in (n for n in shards[0] if n.startswith(tower.mcore_prefix)):
            out[tower.hf_prefix + name[len(tower.mcore_prefix):]] = shards[0][name]
            used.add(name)
    extra = sorted(set(shards[0]) - used)
    if extra:
        raise ValueError(f"checkpoint tensors {extra[:3]} have no Hugging Face name in the {model_type} table; "
                         "nothing is dropped silently (was it trained with another model?).")
    family = family_of(model_type)  # the names the family's folders store (Qwen3-VL: transformers' module names)
    return {export_hf_name(name, family): tensor for name, tensor in stack_tensors(out).items()}


def stack_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The slices ``<tensor>[k]`` (``record.stacked_part``: one expert each) stacked along a new dim 0 as
    ``<tensor>``, in order of k; other tensors as they are (the order of first appearance kept)."""
    parts: dict[str, dict[int, Tensor]] = {}
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        stacked = stacked_part(name)
        if stacked is None:
            out[name] = tensor
        else:
            parts.setdefault(stacked[0], {})[stacked[1]] = tensor
            out.setdefault(stacked[0], None)
    for base, slices in parts.items():
        if sorted(slices) != list(range(len(slices))):
            raise ValueError(f"{base}: experts {sorted(slices)} exported, not 0..{len(slices) - 1}; export the whole "
                             "model (every expert-parallel rank's experts).")
        out[base] = torch.stack([slices[k] for k in range(len(slices))])
    return out


def _shard_groups(tensors: dict[str, Tensor], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_hf_folder(output: str | Path, tensors: dict[str, Tensor], source: str | Path, *,
                    dtype: torch.dtype, max_shard_bytes: int) -> list[str]:
    """Write the folder (into a temporary sibling, renamed at the end); returns the files written."""
    from safetensors.torch import save_file

    output = Path(output)
    with new_output_folder(output) as tmp:
        tensors = {k: v.to(dtype).contiguous().clone() for k, v in tensors.items()}
        groups = _shard_groups(tensors, max_shard_bytes)
        weight_map = {}
        for k, names in enumerate(groups, start=1):
            file = "model.safetensors" if len(groups) == 1 else f"model-{k:05d}-of-{len(groups):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, str(tmp / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in names})
        if len(groups) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")
        _copy_metadata(Path(source), tmp, dtype)
    return sorted(p.name for p in output.iterdir())


@contextmanager
def new_output_folder(output: Path) -> Iterator[Path]:
    """A temporary sibling of ``output`` to write into, renamed to ``output`` when the block succeeds.

    ``output`` may not exist yet or be empty (nothing is overwritten); a failed export leaves
    only the hidden ``.<name>.tmp`` folder, never a half-written ``output``.
    """
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"export.output ({output}) exists and is not empty; choose a new folder (nothing is "
                              "overwritten).")
    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    umask = os.umask(0)
    os.umask(umask)
    for file in tmp.rglob("*"):  # safetensors writes its files 0600; every file as a plain write would make it
        if file.is_file():
            file.chmod(0o666 & ~umask)
    if output.exists():
        output.rmdir()
    os.replace(tmp, output)


def _copy_metadata(source: Path, dst: Path, dtype: torch.dtype) -> None:
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config", None)  # the tensors written are dequantised (an MXFP4 gpt-oss source)
    config["torch_dtype" if "torch_dtype" in config or "dtype" not in config else "dtype"] = DTYPE_NAMES[dtype]
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
    for name in ("generation_config.json",) + TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dst / name)


def export_folder(*, output: str | Path, source: str | Path, model_cfg,
                  shards: Optional[list[dict[str, Tensor]]] = None, dtype: Optional[str] = None,
                  max_shard_bytes: int = 5 * 10**9) -> tuple[list[str], torch.dtype]:
    """Every TP rank's megatron-core tensors (or, without them, the ``source`` folder itself) -> a HF
    folder at ``output``.

    ``source`` is the HF folder whose config.json / tokenizer describe the model (the pretrained
    folder, or a checkpoint's ``hf_source``). Returns (files written, dtype written).
    """
    model_type = read_hf_config(source)["model_type"]
    if shards is None:
        shards = shards_from_pretrained(source, model_cfg, tp=1)
    out_dtype = DTYPES[dtype] if dtype else source_dtype(source)
    files = write_hf_folder(output, hf_tensors(shards, model_type, model_cfg), source, dtype=out_dtype,
                            max_shard_bytes=max_shard_bytes)
    return files, out_dtype
