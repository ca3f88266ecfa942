"""LoRA adapters of a ``peft=lora`` checkpoint -> the peft format, or merged into a full HF model.

The mapping is the family record's rules (``model/hf/mapping.py``): an adapter's split tensor follows
its base weight's rule (A when the base transform splits columns, B when it splits rows), the other
one is replicated. Shapes for H=64, 4 query heads in 2 groups of head dim 16, FFN 96, r=8, TP=2:

| target     | base rule | A (linear_in)                      | B (linear_out)                                   |
|------------|-----------|------------------------------------|--------------------------------------------------|
| linear_qkv | qkv       | [8, 64] replicated -> q/k/v lora_A | [64, 8] per rank -> qkv transform -> q [64, 8], k [32, 8], v [32, 8] |
| linear_fc1 | gate_up   | [8, 64] replicated -> gate/up lora_A | [96, 8] per rank = [gate_r; up_r] -> gate [96, 8], up [96, 8] |
| linear_proj| row       | [8, 32] per rank -> cat -> o lora_A [8, 64] | [64, 8] replicated -> o lora_B          |
| linear_fc2 | row       | [8, 48] per rank -> down lora_A [8, 96] | [64, 8] replicated -> down lora_B            |

A fused linear has one A for its parts, so q, k and v (gate and up) get the same lora_A and
their own rows of B: ``B_q A`` is exactly the q rows of ``B_qkv A``. Keys are peft's:
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.

Experts of a MoE layer: transformers 5 keeps them as 3D parameters, ``mlp.experts.gate_up_proj``
[E, 2F, H] (rows [gate; up], our linear_fc1) and ``mlp.experts.down_proj`` [E, H, F] (linear_fc2), which
peft adapts through ``target_parameters`` (its ``ParamWrapper``): one rank-r adapter per expert, laid out
as ``lora_A`` [E r, in] (expert e's A is rows [e r, (e + 1) r)) and ``lora_B`` [out, r E] (expert e's B is
columns e, e + E, e + 2E, ...: ``B.reshape(out, r, E)[:, :, e]``), delta ``(alpha / r) B_e A_e`` for
expert e. E=4, r=2, H=32, F=24: gate_up_proj's lora_A [8, 32], lora_B [48, 8]; down_proj's [8, 24], [32, 8].
peft nests one wrapper per targeted parameter in the module's parameter order, so with both targeted
gate_up_proj's keys are ``...mlp.experts.base_layer.lora_A.weight`` and down_proj's ``...mlp.experts.lora_A.weight``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from megatron_pack.config.hf_config import family_of
from megatron_pack.config.hf_config.record import Rule
from megatron_pack.model.hf.mapping import export_tensors
from megatron_pack.model.hf.transforms import Dims, transform
from megatron_pack.model.hf.rules import Placement, rules_for
from megatron_pack.model.peft.lora import is_vocab_param, merged_shards

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
IN, OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"


EXPERT_PARAMETERS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
"""Our expert linear -> the 3D parameter of transformers 5's experts module (``model.layers.<i>.mlp.experts``)
that qwen3_moe, mixtral and qwen2_moe share, in the module's parameter order (peft's nesting order)."""
EXPERTS_MODULE = "model.layers.{layer}.mlp.experts"


def adapter_targets(model_type: str, targets, *, num_layers: Optional[int] = None,
                    placement: Optional[Placement] = None):
    """(base rule, megatron prefix, HF prefixes) of every adapted dense linear of the model (or of the
    chunk at ``placement``), from the family table; the experts' are ``expert_targets``."""
    out = []
    vision = family_of(model_type).vision is not None
    for rule, mcore, hf_names in rules_for(model_type, tied=False, num_layers=num_layers, placement=placement):
        leaf = mcore.removesuffix(".weight").rsplit(".", 1)[-1]
        if mcore.endswith(".weight") and leaf in targets and not rule.per_expert:
            out.append((rule, mcore.removesuffix(".weight"),
                        tuple(_module_path(h.removesuffix(".weight"), vision) for h in hf_names)))
    return out


def _module_path(name: str, vision: bool) -> str:
    """The HF module that peft adapts: a vision-language model's language model sits under
    ``model.language_model.`` in transformers 5's module tree (``model.layers.0.self_attn.q_proj`` ->
    ``model.language_model.layers.0.self_attn.q_proj``), which is where peft looks for the adapter."""
    return "model.language_model." + name[len("model."):] if vision and name.startswith("model.") else name


def expert_targets(model_type: str, targets, placement: Placement) -> list[tuple[str, list[str]]]:
    """(peft key stem, megatron prefixes of the chunk's local experts in order) of every adapted 3D expert
    parameter. Example, qwen3_moe, both linears, 4 experts on 2 EP ranks, rank 1, layer 0's linear_fc1:
    ``("base_model.model.model.layers.0.mlp.experts.base_layer.",
    ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1", "...local_experts.1.linear_fc1"])``
    (global experts 2 and 3); a vision-language model's under ``model.language_model.layers.0.mlp.experts``."""
    adapted = [leaf for leaf in EXPERT_PARAMETERS if leaf in targets]
    vision = family_of(model_type).vision is not None
    grouped: dict[tuple[int, str], list[str]] = {}
    for rule, mcore, _ in rules_for(model_type, tied=False, placement=placement):
        leaf = mcore.removesuffix(".weight").rsplit(".", 1)[-1]
        if rule.per_expert and mcore.endswith(".weight") and leaf in adapted:
            layer = int(mcore.split(".")[2]) + placement.layer_offset
            grouped.setdefault((layer, leaf), []).append(mcore.removesuffix(".weight"))
    out = []
    for (layer, leaf), prefixes in sorted(grouped.items(), key=lambda kv: (kv[0][0], adapted.index(kv[0][1]))):
        nesting = "base_layer." * (len(adapted) - 1 - adapted.index(leaf))  # wrapped first = innermost
        module = _module_path(EXPERTS_MODULE.format(layer=layer), vision)
        out.append((f"{PEFT_PREFIX}{module}.{nesting}", prefixes))
    return out


def hf_module_names(model_type: str, targets) -> list[str]:
    """peft's ``target_modules`` for our megatron-core targets: linear_qkv -> q_proj, k_proj, v_proj, ..."""
    names = []
    # two layers, one of each kind of a hybrid stack (a rule with a layer_type binds to one of them)
    for _, _, hf in adapter_targets(model_type, targets, placement=Placement(2, num_experts=1, linear_layers=(0,))):
        names += [h.rsplit(".", 1)[-1] for h in hf]
    return list(dict.fromkeys(names))


def hf_parameter_names(model_type: str, targets) -> list[str]:
    """peft's ``target_parameters`` for our expert targets: linear_fc1 -> mlp.experts.gate_up_proj, ..."""
    if not expert_targets(model_type, targets, Placement(1, num_experts=1)):
        return []
    return [f"mlp.experts.{EXPERT_PARAMETERS[leaf]}" for leaf in EXPERT_PARAMETERS if leaf in targets]


def _expert_transform(model_type: str, prefix: str):
    """The transform of the family rule for an expert linear's weight (``...local_experts.0.linear_fc1``)."""
    from megatron_pack.model.hf.transforms import transform

    leaf = "." + prefix.rsplit(".", 1)[-1] + ".weight"
    return transform(next(r.kind for r in family_of(model_type).rules if r.per_expert and r.mcore.endswith(leaf)))


def stack_experts(a_experts: list[Tensor], b_experts: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Every expert's A [r, in] and B [out, r] (global order) -> peft's lora_A [E r, in], lora_B [out, r E]."""
    return torch.cat(a_experts, 0), torch.stack(b_experts, -1).reshape(b_experts[0].shape[0], -1)


def unstack_expert(lora_a: Tensor, lora_b: Tensor, expert: int, num_experts: int) -> tuple[Tensor, Tensor]:
    """Expert ``expert``'s (A [r, in], B [out, r]) of peft's lora_A [E r, in], lora_B [out, r E]."""
    r = lora_a.shape[0] // num_experts
    return lora_a[expert * r:(expert + 1) * r], lora_b.reshape(lora_b.shape[0], r, num_experts)[:, :, expert]


def expert_tp_shard(prefix: str, a: Tensor, b: Tensor, etp_rank: int, etp_size: int) -> tuple[Tensor, Tensor]:
    """This expert-TP rank's part of an expert's whole (A, B), split like the expert's weight: linear_fc1's B
    rows as [gate_r; up_r] (B [2F, r] -> [2F / etp, r]), linear_fc2's A columns (A [r, F] -> [r, F / etp])."""
    if etp_size == 1:
        return a, b
    if prefix.endswith("linear_fc1"):
        return a, torch.cat([half.chunk(etp_size, 0)[etp_rank] for half in b.chunk(2, 0)], 0)
    return a.chunk(etp_size, 1)[etp_rank], b


def _splits_a(rule: Rule) -> bool:
    """A is split like the base weight when the base splits its columns (row-parallel), else B its rows."""
    return transform(rule.kind).split_dim == 1


def peft_tensors(shards: list[dict[str, Tensor]], model_type: str, model_cfg, targets, *,
                 placement: Optional[Placement] = None) -> dict[str, Tensor]:
    """peft key -> tensor from every TP rank's adapter tensors (rank order) of the model (or of the
    chunk at ``placement``, under global layer names)."""
    dims = Dims.from_model_config(model_cfg, len(shards))
    shards = [_plain(shard) for shard in shards]
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    placement = Placement.whole(model_cfg) if placement is None else placement
    for rule, prefix, hf in adapter_targets(model_type, targets, placement=placement):
        missing = [r for r, s in enumerate(shards) if prefix + IN not in s or prefix + OUT not in s]
        if missing:
            raise ValueError(f"the checkpoint has no adapter for {prefix} on TP rank {missing[0]}; it was written "
                             "with other peft.target_modules (or without peft=lora).")
        a_shards, b_shards = [s[prefix + IN] for s in shards], [s[prefix + OUT] for s in shards]
        if _splits_a(rule):
            a_parts, b_parts = export_tensors(rule, a_shards, dims), [b_shards[0]]
        else:
            a_parts, b_parts = [a_shards[0]] * len(hf), export_tensors(rule, b_shards, dims)
        for name, a, b in zip(hf, a_parts, b_parts):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b
        used.update({prefix + IN, prefix + OUT})
    for stem, prefixes in expert_targets(model_type, targets, placement):
        missing = [p for p in prefixes if p + IN not in shards[0]]
        if missing:
            raise ValueError(f"the checkpoint has no adapter for {missing[0]}; it was written with other "
                             "peft.target_modules (or without peft=lora).")
        rows = _expert_transform(model_type, prefixes[0])  # gpt-oss: gate / up rows interleaved in HF's order
        a, b = stack_experts([shards[0][p + IN] for p in prefixes],
                             [rows.lora_b_to_hf(shards[0][p + OUT]) for p in prefixes])
        out[f"{stem}lora_A.weight"], out[f"{stem}lora_B.weight"] = a, b
        used.update(p + suffix for p in prefixes for suffix in (IN, OUT))
    out.update(_vocab_tensors(shards, model_type, model_cfg, used))
    extra = sorted(set(shards[0]) - used)
    if extra:
        raise ValueError(f"checkpoint tensors {extra[:3]} are not adapters of {list(targets)}; export.adapter reads "
                         "a peft=lora checkpoint (nothing is dropped silently).")
    return out


def _vocab_tensors(shards: list[dict[str, Tensor]], model_type: str, model_cfg, used: set[str]) -> dict[str, Tensor]:
    """A ``model.resize_vocab`` run's vocabulary layers (``lora.VOCAB_PARAMS``, trained whole) under peft's key
    of a ``modules_to_save`` module (``base_model.model.model.embed_tokens.weight``: peft adds
    ``modules_to_save.<adapter>`` on load), TP pad rows dropped: embedding [Vp, H] per rank -> [V, H]."""
    from megatron_pack.model.peft.lora import VOCAB_PARAMS

    if not set(VOCAB_PARAMS) & set(shards[0]):
        return {}
    dims = Dims.from_model_config(model_cfg, len(shards))
    tied = not model_cfg.untie_embeddings_and_output_weights
    out = {}
    for rule, mcore, hf in rules_for(model_type, tied=tied, placement=Placement.whole(model_cfg)):
        if mcore in VOCAB_PARAMS and mcore in shards[0]:
            out[f"{PEFT_PREFIX}{hf[0]}"] = export_tensors(rule, [s[mcore] for s in shards], dims)[0]
            used.add(mcore)
    return out


def adapter_config(peft_meta: dict, model_type: str, base: Optional[str]) -> dict:
    """adapter_config.json as ``peft.LoraConfig`` writes it (fields peft does not need take its defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": int(peft_meta["dim"]), "lora_alpha": float(peft_meta["alpha"]),
            "lora_dropout": float(peft_meta["dropout"]), "bias": "none", "fan_in_fan_out": False,
            "target_modules": _target_modules(model_type, hf_module_names(model_type, peft_meta["target_modules"])),
            "target_parameters": hf_parameter_names(model_type, peft_meta["target_modules"]) or None,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": peft_meta.get("modules_to_save"), "layers_to_transform": None}


def _target_modules(model_type: str, names: list[str]):
    """peft's ``target_modules``: the module names, or for a vision-language model a regex over the language
    model's modules only (the vision tower's MLP has gate_proj / up_proj / down_proj too, which must stay bare)."""
    if not names or family_of(model_type).vision is None:
        return names or None
    return rf".*language_model\.layers\.\d+\..*\.({'|'.join(names)})"


def write_adapter_folder(output: str | Path, tensors: dict[str, Tensor], config: dict, *, dtype: torch.dtype,
                         source: Optional[str | Path] = None) -> list[str]:
    """adapter_model.safetensors + adapter_config.json (+ the source's tokenizer files), written atomically."""
    from safetensors.torch import save_file

    from megatron_pack.model.hf.export import TOKENIZER_FILES, new_output_folder

    output = Path(output)
    with new_output_folder(output) as tmp:
        save_file({k: v.to(dtype).contiguous().clone() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        for name in TOKENIZER_FILES if source is not None else ():
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, tmp / name)
    return sorted(p.name for p in output.iterdir())


def export_adapter(*, output: str | Path, shards: list[dict[str, Tensor]], peft: dict, source: str | Path, model_cfg,
                   dtype: Optional[str] = None) -> tuple[list[str], torch.dtype]:
    """A peft=lora checkpoint's adapter tensors (whole, by global identity) and its ``peft``
    meta -> a peft adapter folder; returns (files, dtype written)."""
    from megatron_pack.config.hf_config import read_hf_config
    from megatron_pack.model.hf.export import DTYPES

    model_type = read_hf_config(source)["model_type"]
    tensors = peft_tensors(shards, model_type, model_cfg, peft["target_modules"])
    out_dtype = DTYPES[dtype] if dtype else next(iter(tensors.values())).dtype
    files = write_adapter_folder(output, tensors, adapter_config(peft, model_type, peft.get("base_model")),
                                 dtype=out_dtype, source=source)
    return files, out_dtype


def base_folder(peft: dict, given: Optional[str | Path]) -> Path:
    """The base model's HF folder (with weights): ``given`` when it holds safetensors, else the checkpoint's."""
    from megatron_pack.model.hf.load import INDEX, SINGLE

    for candidate in (given, peft.get("base_model")):
        if candidate and ((Path(candidate) / SINGLE).is_file() or (Path(candidate) / INDEX).is_file()):
            return Path(candidate)
    raise FileNotFoundError(f"export.merge needs the base model's weights: the checkpoint names "
                            f"{peft.get('base_model')!r}, which holds no safetensors; pass model.pretrained=<the "
                            "Hugging Face folder it was trained from>.")


def export_merged(*, output: str | Path, shards: list[dict[str, Tensor]], peft: dict, source: str | Path,
                  base: str | Path, model_cfg, dtype: Optional[str] = None,
                  max_shard_bytes: int = 5 * 10**9) -> tuple[list[str], torch.dtype]:
    """The base with ``(alpha / r) B A`` added to every adapted weight, as a HF folder; ``shards`` are the
    checkpoint's adapter tensors of every TP rank."""
    from megatron_pack.config.hf_config import read_hf_config
    from megatron_pack.model.hf.export import DTYPES, hf_tensors, shards_from_pretrained, source_dtype, write_hf_folder

    adapters = [_plain(shard) for shard in shards]
    bases = shards_from_pretrained(base, model_cfg, tp=len(adapters))
    scale = float(peft["alpha"]) / int(peft["dim"])
    merged = [{**merged_shards(b, a, scale), **{n: t for n, t in a.items() if is_vocab_param(n)}}  # trained whole
              for b, a in zip(bases, adapters)]
    out_dtype = DTYPES[dtype] if dtype else source_dtype(base)
    files = write_hf_folder(output, hf_tensors(merged, read_hf_config(source)["model_type"], model_cfg), source,
                            dtype=out_dtype, max_shard_bytes=max_shard_bytes)
    return files, out_dtype


def _plain(shard: dict[str, Tensor]) -> dict[str, Tensor]:
    """Names without the ``module.`` prefix of megatron-core's Float16Module (a bf16 run's checkpoint)."""
    return {name.removeprefix("module."): tensor for name, tensor in shard.items()}


class _TensorReader:
    """``mapping.Reader`` over tensors in memory (an adapter file is small)."""

    def __init__(self, tensors: dict[str, Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> Tensor:
        t = self.tensors[name]
        t = t[rows] if rows is not None else t
        return t[:, cols] if cols is not None else t


def shards_from_peft(tensors: dict[str, Tensor], model_type: str, model_cfg, targets, *, tp_rank: int,
                     tp_size: int, where: str = "the adapter", placement: Optional[Placement] = None,
                     etp_rank: int = 0, etp_size: int = 1) -> dict[str, Tensor]:
    """This TP rank's adapter tensors (megatron names) of the model (or of the chunk at ``placement``)
    from peft-format tensors: the inverse of ``peft_tensors``. A fused linear's parts must share
    lora_A (as our export writes them)."""
    from megatron_pack.model.hf.mapping import load_shard

    reader, dims = _TensorReader(tensors), Dims.from_model_config(model_cfg, tp_size)
    out: dict[str, Tensor] = {}
    placement = Placement.whole(model_cfg) if placement is None else placement
    for rule, prefix, hf in adapter_targets(model_type, targets, placement=placement):
        a_names = tuple(f"{PEFT_PREFIX}{h}.lora_A.weight" for h in hf)
        b_names = tuple(f"{PEFT_PREFIX}{h}.lora_B.weight" for h in hf)
        missing = [n for n in a_names + b_names if n not in tensors]
        if missing:
            raise ValueError(f"{where} has no {missing[0]}; it was not written for these peft.target_modules.")
        if _splits_a(rule):
            out[prefix + IN], out[prefix + OUT] = load_shard(rule, a_names, reader, dims, tp_rank), tensors[b_names[0]]
        else:
            if any(not torch.equal(tensors[n], tensors[a_names[0]]) for n in a_names):
                raise ValueError(f"{where}: {', '.join(a_names)} differ; the fused {prefix} has one lora_A for its "
                                 "parts, so they must be equal.")
            out[prefix + IN], out[prefix + OUT] = tensors[a_names[0]], load_shard(rule, b_names, reader, dims, tp_rank)
    for stem, prefixes in expert_targets(model_type, targets, placement):
        a_name, b_name = f"{stem}lora_A.weight", f"{stem}lora_B.weight"
        if a_name not in tensors or b_name not in tensors:
            raise ValueError(f"{where} has no {a_name if a_name not in tensors else b_name}; it was not written for "
                             "these peft.target_modules.")
        rows = _expert_transform(model_type, prefixes[0])
        for local, prefix in enumerate(prefixes):
            a, b = unstack_expert(tensors[a_name], tensors[b_name], placement.expert_offset + local,
                                  model_cfg.num_experts)
            out[prefix + IN], out[prefix + OUT] = expert_tp_shard(prefix, a, rows.lora_b_from_hf(b), etp_rank, etp_size)
    return out


def load_adapter(model: torch.nn.Module, folder: str | Path, model_type: str, model_cfg, targets, *,
                 tp_rank: int, tp_size: int, ep_rank: int = 0, ep_size: int = 1, etp_rank: int = 0,
                 etp_size: int = 1) -> int:
    """Fill this TP (and EP) rank's adapters of ``model`` (built with peft=lora) from a peft adapter folder
    written by ``export.adapter`` (or with the same shared lora_A); returns the number filled."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    placement = Placement.whole(model_cfg)
    if placement.num_experts:
        placement = placement.with_experts(Dims.from_model_config(model_cfg, tp_size, ep=ep_size), ep_rank)
    mine = shards_from_peft(tensors, model_type, model_cfg, targets, tp_rank=tp_rank, tp_size=tp_size,
                            where=f"{folder}/{ADAPTER_WEIGHTS}", placement=placement, etp_rank=etp_rank,
                            etp_size=etp_size)
    params = {name.removeprefix("module."): p for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, tensor in mine.items():
            params[name].copy_(tensor)
    return len(mine) // 2
