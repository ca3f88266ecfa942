"""A family's name rules applied to one model chunk, and the HF shapes they imply (torch-free).

The rules themselves are the family records' (``megatron_pack.config.hf_config.families``); this
module turns them into the (rule, megatron-core name, HF names) of what one model chunk holds:

* a ``Placement`` says which part: layers [k, k + n) (a pipeline stage's local layer i is HF
  layer k + i), whether it holds the embedding (first stage) and the final norm and output layer
  (last stage), and which experts (an expert-parallel rank's local expert e is HF expert o + e);
* ``rules_for`` lists that chunk's names, in load order;
* ``hf_shapes`` gives every HF tensor's shape config.json implies, through each rule's transform
  (``megatron_pack.model.hf.folder_check`` checks a folder with it before launch, without torch).

Example: Llama with 4 layers, the stage holding layers [2, 4) of a 2-stage pipeline::

    >>> stage = Placement(2, layer_offset=2, pre_process=False)
    >>> [(m, h[0]) for _, m, h in rules_for("llama", tied=False, placement=stage)][:1]
    [('decoder.layers.0.input_layernorm.weight', 'model.layers.2.input_layernorm.weight')]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, NamedTuple, Optional

from megatron_pack.config.hf_config import derive_model_keys, family_of
from megatron_pack.config.hf_config.record import Family, Rule, stacked_part
from megatron_pack.model.hf.transforms import Dims, transform

__all__ = ["Binding", "IGNORED_HF", "Placement", "TE_ALIASES", "hf_shapes", "rule_hf_shapes", "rules_for", "shapes_for"]

TE_ALIASES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
"""local-spec suffix -> Transformer Engine spec suffix of the same tensor."""
IGNORED_HF = ("rotary_emb.inv_freq",)
"""HF tensors that are buffers recomputed from config.json (the records' default ``ignored``)."""
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
_LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")
"""megatron-core names outside the layers that only the last pipeline stage holds."""


def linear_layers(num_layers: int, full_attention_interval: Optional[int]) -> tuple[int, ...]:
    """The linear-attention layers (from 0) of ``num_layers`` with every N-th full attention (None: none).

    >>> linear_layers(8, 4), linear_layers(8, None)
    ((0, 1, 2, 4, 5, 6), ())
    """
    if full_attention_interval is None:
        return ()
    return tuple(i for i in range(num_layers) if (i + 1) % full_attention_interval)


@dataclass(frozen=True)
class Placement:
    """The part of the model one chunk holds, and where it sits in Hugging Face's global numbering.

    A pipeline stage holding layers [k, k + n) of N is ``Placement(n, layer_offset=k,
    pre_process=k == 0, post_process=k + n == N)``; ``with_experts`` adds an expert-parallel rank's
    experts. The default, ``Placement(N)``, is the whole dense model.
    """

    num_layers: int
    """Transformer layers in the chunk (megatron-core's local layers 0 .. num_layers - 1)."""
    layer_offset: int = 0
    """Global index of the chunk's first layer (its local layer 0)."""
    pre_process: bool = True
    """Holds the embedding (the first pipeline stage)."""
    post_process: bool = True
    """Holds the final norm and the output layer (the last pipeline stage)."""
    num_experts: int = 0
    """Experts of every MoE layer the chunk holds (0: a dense model)."""
    expert_offset: int = 0
    """Global index of the chunk's first expert (its local expert 0)."""
    linear_layers: tuple[int, ...] = ()
    """Global indices of the linear-attention layers of a hybrid stack (Qwen3.5): a rule with ``layer_type``
    'linear_attention' binds to these layers only, one with 'full_attention' to the others."""

    @classmethod
    def whole(cls, model_cfg) -> "Placement":
        """The whole model of ``model.*`` (every layer, and every expert of a MoE model)."""
        return cls(model_cfg.num_layers, num_experts=getattr(model_cfg, "num_experts", None) or 0,
                   linear_layers=linear_layers(model_cfg.num_layers, getattr(model_cfg, "full_attention_interval", None)))

    def layer_holds(self, rule: Rule, layer: int) -> bool:
        """Whether local ``layer`` of the chunk has ``rule``'s tensor (its layer type's)."""
        if rule.layer_type is None:
            return True
        return (layer + self.layer_offset in self.linear_layers) == (rule.layer_type == "linear_attention")

    def with_experts(self, dims: Dims, ep_rank: int) -> "Placement":
        """This chunk on expert-parallel rank ``ep_rank``: experts [r * E / EP, (r + 1) * E / EP) of each layer."""
        return replace(self, num_experts=dims.num_local_experts, expert_offset=dims.expert_offset(ep_rank))


class Binding(NamedTuple):
    """One rule applied to one layer and expert of a chunk."""

    rule: Rule
    mcore: str
    """megatron-core name in the chunk (local layer and expert)."""
    hf: tuple[str, ...]
    """Hugging Face names (global layer and expert)."""


def _holds(rule: Rule, placement: Placement) -> bool:
    if rule.per_layer:
        return placement.num_layers > 0
    if rule.mcore.startswith(_LAST_STAGE):
        return placement.post_process
    if rule.mcore.startswith("embedding."):
        return placement.pre_process
    raise ValueError(f"rule {rule.mcore}: outside embedding, decoder layers, final norm and output layer; "
                     "no pipeline stage would hold it.")


def rules_for(model_type: str, *, tied: bool, num_layers: Optional[int] = None,
              placement: Optional[Placement] = None) -> list[Binding]:
    """Every (rule, megatron-core name, HF names) of the chunk at ``placement`` (the whole model of
    ``num_layers`` when not given), in load order. No output layer when tied, except on a last
    stage without the embedding: there megatron-core keeps a copy, filled from the embedding's tensor."""
    family = family_of(model_type)
    placement = _placement(num_layers, placement)
    out = []
    for rule in family.rules:
        if not _holds(rule, placement) or (tied and rule.mcore == OUTPUT):
            continue
        if rule.per_expert and placement.num_experts == 0:
            raise ValueError(f"rule {rule.mcore} of {model_type} is per expert, but the placement holds no experts; "
                             "give Placement.with_experts(dims, ep_rank).")
        for layer in (range(placement.num_layers) if rule.per_layer else [None]):
            if layer is not None and not placement.layer_holds(rule, layer):
                continue
            for expert in (range(placement.num_experts) if rule.per_expert else [None]):
                mcore, hf = rule.names(layer, expert, layer_offset=placement.layer_offset,
                                       expert_offset=placement.expert_offset)
                out.append(Binding(rule, mcore, hf))
    if tied and placement.post_process and not placement.pre_process:
        embedding = next(rule for rule in family.rules if rule.mcore == EMBEDDING)
        out.append(Binding(embedding, OUTPUT, embedding.hf))
    return sorted(out, key=lambda binding: _order(binding.mcore))


def _placement(num_layers: Optional[int], placement: Optional[Placement]) -> Placement:
    if (num_layers is None) == (placement is None):
        raise TypeError("rules_for needs num_layers (the whole model) or placement (one chunk), not both.")
    return placement if placement is not None else Placement(num_layers)


def _order(name: str) -> tuple:
    if name.startswith("embedding"):
        return (0,)
    if name.startswith("decoder.layers."):
        return (1, int(name.split(".")[2]))
    return (2, name)


def rule_hf_shapes(rule: Rule, dims: Dims) -> list[tuple[int, ...]]:
    """The shapes of ``rule``'s HF tensors that ``dims`` implies, by its transform."""
    if rule.shape is None:
        raise ValueError(f"rule {rule.mcore} has no shape; give the HF tensors' shape in Dims size names.")
    return transform(rule.kind).hf_shapes(tuple(dims.size(s) for s in rule.shape), len(rule.hf), dims)


def shapes_for(family: Family, dims: Dims, *, tied: bool, placement: Placement) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for the chunk at ``placement``, in load order."""
    shapes = {}
    for rule, _, names in rules_for(family.model_type, tied=tied, placement=placement):
        shapes.update(zip(names, rule_hf_shapes(rule, dims)))
    return shapes


def hf_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a supported config.json (the whole model), in load order.

    Example: Llama with hidden 64, 4 heads of 16 in 2 groups, FFN 96, vocabulary 301 gives
    ``model.embed_tokens.weight (301, 64)``, ``...self_attn.k_proj.weight (32, 64)``,
    ``...mlp.gate_proj.weight (96, 64)``, ``model.norm.weight (64,)``.
    """
    keys = derive_model_keys(hf)
    dims = Dims.from_model_config(SimpleNamespace(**keys), tp=1)
    return stack_shapes(shapes_for(family_of(hf["model_type"]), dims, tied=not keys["untie_embeddings_and_output_weights"],
                                   placement=Placement.whole(SimpleNamespace(**keys))))


def stack_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Shapes by stored tensor: the slices ``<tensor>[0..E-1]`` of shape s (``record.stacked_part``) as one
    ``<tensor>`` of shape (E,) + s.

    >>> stack_shapes({"a[0]": (3,), "a[1]": (3,), "b": (2,)})
    {'a': (2, 3), 'b': (2,)}
    """
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        stacked = stacked_part(name)
        if stacked is None:
            out[name] = shape
        else:
            out[stacked[0]] = (max(stacked[1] + 1, out.get(stacked[0], (0,))[0]),) + tuple(shape)
    return out
