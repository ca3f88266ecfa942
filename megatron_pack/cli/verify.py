"""`megatron-pack verify`: the unpacked replay, as one command.

Loads the packed dataset at ``data.dataset_dir`` (its only plan, or ``data.plan``; pack size, pad
multiple, tokenizer and vocab size as prepare recorded them unless given), builds the model
from ``model.*`` (the weights of ``model.pretrained`` when set, else a random init with ``train.seed``;
``verify.checkpoint`` loads a training checkpoint's over them), and
for the first ``verify.num_packs`` packs runs the pack once (THD, as training does) and each of
its samples alone (a pack of one, padded only to the pad multiple). For every pack it prints the largest absolute
logit difference over the real tokens, each sample's mean answer-token loss packed and alone,
and PASS when both the largest logit difference and the largest loss difference are within
``verify.tolerance``. Exit code 0 only when every pack passes.

``verify.reference=transformers`` (with ``model.pretrained``) compares our packed forward, at any
layout under torchrun, with transformers' forward of each sample alone (docs/models.md).

A ``packing.algorithm=wrapped`` plan with ``packing.wrapped_attention=cross`` lets attention
cross documents on purpose: verify still measures the difference per piece, prints ``LEAKS BY
DESIGN (cross)`` for every pack instead of PASS, and exits 1. With ``wrapped_attention=document``
(and split pieces) each piece is compared with itself alone, as any other sample.

A mixture-of-experts model routes as training does: the pack's padding (from its boundaries, never
token ids) is excluded from routing (``model.moe.routing_index``), and each pack line adds ``routed N/N
real tokens``: the real tokens routed (top-k) in every MoE layer of the packed forward; a pack whose
count differs from its real tokens in any layer FAILs.

``verify.attention=pack_causal`` builds the model with plain causal attention over the whole
pack (samples see the samples before them): the broken setting verify exists to catch; it FAILs.

Launched by torchrun, verify runs at the layout train would (pipeline and virtual stages, TP, CP, EP, DP):
the packs go through megatron-core's forward-only schedule, the training step's; the last stage gathers the
logits over TP and CP, its first rank of DP rank 0 compares and prints, and every rank returns its verdict.
Without torchrun it runs in one process (a world of one: TP = CP = 1, whatever ``parallel.*`` says). Example::

    megatron-pack verify data.dataset_dir=data/synthetic verify.num_packs=4
    pack 0: 5 samples, 497 real tokens  max |logit diff| 2.4e-07  max |loss diff| 1.2e-07  PASS
    ...
    verify: 4/4 packs PASS (tolerance 0.0001, attention thd)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F


@dataclass
class SampleResult:
    """One sample of a pack: its answer-token mean loss packed and alone (None without targets)."""

    sample_id: int
    num_tokens: int
    max_logit_diff: float
    loss_packed: Optional[float]
    loss_alone: Optional[float]

    @property
    def loss_diff(self) -> float:
        if self.loss_packed is None or self.loss_alone is None:
            return 0.0
        return abs(self.loss_packed - self.loss_alone)


@dataclass
class PackResult:
    """What verify found for one pack."""

    index: int
    samples: list[SampleResult] = field(default_factory=list)
    routed_tokens: Optional[list[int]] = None
    """A MoE model's real tokens routed in each MoE layer of the packed forward (None: dense)."""
    real_tokens: int = 0
    """The pack's real tokens (``cu_seqlens[-1]``)."""

    @property
    def routed_ok(self) -> bool:
        return self.routed_tokens is None or all(n == self.real_tokens for n in self.routed_tokens)

    @property
    def max_logit_diff(self) -> float:
        return max((s.max_logit_diff for s in self.samples), default=0.0)

    @property
    def max_loss_diff(self) -> float:
        return max((s.loss_diff for s in self.samples), default=0.0)

    def passed(self, tolerance: float) -> bool:
        return self.max_logit_diff <= tolerance and self.max_loss_diff <= tolerance and self.routed_ok


def single_process_config(cfg):
    """``cfg`` with TP = CP = 1 and no sequence parallelism (verify runs in one process)."""
    from megatron_pack.config.schema import ParallelConfig

    return dataclasses.replace(cfg, parallel=ParallelConfig(backend=cfg.parallel.backend))


def load_model_weights(model: torch.nn.Module, checkpoint: str | Path) -> Path:
    """Load a training checkpoint's model weights (any layout) into a TP=1 model; returns
    its path. ``checkpoint`` is a checkpoint directory (``step_00000010``) or the ``checkpoint.save``
    root, whose newest intact checkpoint is used (``training.model_reader``, the reader train and export use)."""
    from megatron_pack.training.model_reader import CheckpointModel

    reader = CheckpointModel.open(checkpoint, "verify.checkpoint")
    reader.load_into(model)
    return reader.path


def routed_tokens(model, cp_group=None) -> Optional[list[int]]:
    """Real tokens routed in each MoE layer by the last forward (summed over ``cp_group``, whose ranks all call
    it); None for a dense model."""
    from megatron_pack.model.moe import pack_routing
    from megatron_pack.parallel.comm import all_reduce

    routing = pack_routing(model)
    if routing is None or not routing.load:
        return None
    load = torch.stack([routing.load[i] for i in sorted(routing.load)]).sum(-1)
    if cp_group is not None:
        all_reduce(load, group=cp_group)
    return [int(round(float(n) / model.config.moe_router_topk)) for n in load]


def _no_loss(output_tensor: torch.Tensor):
    """The schedule's loss function for a forward that only wants the logits (nothing backpropagates)."""
    return output_tensor.sum() * 0, torch.zeros((), dtype=torch.int32), {"lm loss": torch.zeros(2)}


def schedule_logits(chunks: list, batches: list[dict], state, seq_length: int
                    ) -> tuple[Optional[list[torch.Tensor]], Optional[list[int]]]:
    """Every batch through megatron-core's forward-only schedule (the training step's, at this rank's layout:
    pipeline and virtual stages, TP, CP, EP), one micro-batch each. Returns, on the last stage, each batch's
    whole logits [T, V_padded] float32 (gathered over TP and CP; None on the other stages), and a MoE model's
    real tokens routed in each MoE layer of every stage by the first batch's forward (None for a dense model).
    A MoE model's routers read each pack's boundaries and padding is not routed, as in training
    (``model.moe.routing_index``). Every rank of the world calls it with the same batches."""
    from megatron_pack.parallel.comm import all_gather_object
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.training.chunks import core_model
    from megatron_pack.training.schedule import forward_backward
    from megatron_pack.training.step import get_packed_seq_params, model_inputs

    captured, routed = [], {}

    def step(data_iterator, model):
        batch = next(data_iterator)
        core, device = core_model(model), state.device
        local = slice_thd_batch(batch, state.cp_size, state.cp_rank)
        params = get_packed_seq_params(batch, device=device)
        tokens, position_ids, extra = model_inputs(core, batch, local, state.cp_size, state.cp_rank, device)
        output = model(tokens, position_ids, None, packed_seq_params=params, **extra)
        counts = routed_tokens(core, state.cp_group)  # every CP rank of the stage runs the same forwards
        if batch is batches[0]:
            routed.setdefault(id(core), counts)
        if core.post_process:
            captured.append(output)
        return output, _no_loss

    with torch.no_grad():
        forward_backward(forward_step_func=step, data_iterator=iter(batches), model_chunks=chunks,
                         num_microbatches=len(batches), state=state, seq_length=seq_length, forward_only=True)
    layers = [n for counts in routed.values() if counts is not None for n in counts]
    if state.pp_size > 1:  # each stage routed its own layers
        layers = [n for part in all_gather_object(layers, group=state.pp_group) for n in part]
    logits = [_full_logits(out.cpu(), b, state) for out, b in zip(captured, batches)] if state.is_last_stage else None
    return logits, layers or None


def holds_logits(state) -> bool:
    """The rank that compares: the last pipeline stage's first TP and CP rank of DP rank 0 (every DP rank runs
    the same packs; the last stage holds the logits, gathered over TP and CP)."""
    return state.is_last_stage and state.tp_rank == 0 and state.cp_rank == 0 and state.dp_rank == 0


def _holder_rank(state) -> int:
    """The global rank of ``holds_logits`` (one all-reduce over the world)."""
    from megatron_pack.parallel.comm import all_reduce

    rank = torch.tensor([state.rank if holds_logits(state) else -1], dtype=torch.int64)
    return int(all_reduce(rank, op="max").item())


def build_chunks(cfg, state, **kwargs) -> list:
    """This rank's model chunks (``parallel.num_model_chunks``; one without virtual stages), in eval mode."""
    from megatron_pack.model.builder import build_model

    chunks = [build_model(cfg, state, vp_stage=v, **kwargs) for v in range(cfg.parallel.num_model_chunks)]
    for chunk in chunks:
        chunk.eval()
    return chunks


def _layout(state, num_chunks: int) -> str:
    vp = f" x VP={num_chunks}" if num_chunks > 1 else ""
    return (f"PP={state.pp_size}{vp} TP={state.tp_size} CP={state.cp_size} EP={state.pg_collection.ep.size()} "
            f"DP={state.dp_size}")


def _mean_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> Optional[float]:
    if float(mask.sum()) == 0:
        return None
    losses = F.cross_entropy(logits.double(), labels.to(logits.device), reduction="none")
    return float((losses * mask.to(losses)).sum() / mask.sum())


def alone_batches(samples: list[dict], batch: dict, *, pack_size: int, pad_id: int, pad_multiple: int,
                  fixed: bool, vision: Optional[tuple[int, int]] = None) -> list[dict]:
    """Each sample of a pack as a pack of one (THD, padded to ``pad_multiple`` for the CP slices; with ``fixed``
    shapes to the pack's size and cu_seqlens length, so pipeline stages exchange one shape). ``vision``
    (image token id, merge size): a vision-language pack, each sample cut from it with its own images."""
    from megatron_pack.data.batches.thd import collate_thd

    num_cu = len(batch["cu_seqlens"]) if fixed else None
    if vision is not None:
        return [_vlm_alone(batch, i, vision, pad_multiple=pad_multiple, pad_id=pad_id,
                           total=pack_size if fixed else None, num_cu=num_cu) for i in range(len(samples))]
    return [collate_thd([sample], pack_size=pack_size, pad_id=pad_id, pad_multiple=pad_multiple,
                        pad_to_max_length=fixed, num_cu_seqlens=num_cu) for sample in samples]


def _vlm_alone(batch: dict, index: int, vision: tuple[int, int], *, pad_multiple: int, pad_id: int,
               total: Optional[int], num_cu: Optional[int]) -> dict:
    """Sub-sequence ``index`` of a VLM pack with its images (``model.vlm.sample_alone``), padded as the collate
    pads a pack of one: to ``pad_multiple``, then (``total``: fixed shapes) a zero-length tail sub-sequence up
    to ``total`` tokens and ``num_cu`` cu_seqlens entries. Padding continues the M-RoPE positions.

    Example: 5 tokens, pad multiple 4, total 16 -> 8 + a tail of 8; cu_seqlens [0, 5, 5],
    cu_seqlens_padded [0, 8, 16]."""
    from megatron_pack.model.vlm import sample_alone

    alone = sample_alone(batch, index, *vision)
    n = alone["tokens"].shape[-1]
    padded = -(-n // pad_multiple) * pad_multiple
    size = max(total or padded, padded)
    grow = size - n

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((1, grow), value, dtype=t.dtype)], dim=-1)

    mrope = alone["mrope_position_ids"]
    start = int(mrope.max()) + 1 if n else 0
    tail = torch.arange(start, start + grow, dtype=mrope.dtype).expand(3, grow)
    real, physical = [0, n], [0, padded]
    if size > padded:
        real, physical = real + [n], physical + [size]
    if num_cu is not None:
        real, physical = (c + [c[-1]] * (num_cu - len(c)) for c in (real, physical))
    alone.update(tokens=pad(alone["tokens"], pad_id), labels=pad(alone["labels"], pad_id),
                 loss_mask=pad(alone["loss_mask"], 0), position_ids=torch.arange(size)[None],
                 mrope_position_ids=torch.cat([mrope, tail], dim=1), max_seqlen=max(padded, size - padded),
                 cu_seqlens=torch.tensor(real, dtype=torch.int32),
                 cu_seqlens_padded=torch.tensor(physical, dtype=torch.int32), num_pad_tokens=size - n)
    return alone


def _vision(cfg) -> Optional[tuple[int, int]]:
    """(image token id, spatial merge size) of a vision-language ``model.pretrained``, else None."""
    if cfg.model.image_token_id is None:
        return None
    from megatron_pack.config.hf_config import read_hf_config

    return cfg.model.image_token_id, int(read_hf_config(cfg.model.pretrained)["vision_config"]["spatial_merge_size"])


def compare_pack(packed: torch.Tensor, alone: list[torch.Tensor], samples: list[dict], batch: dict,
                 alone_batches: list[dict], *, index: int = 0) -> PackResult:
    """One pack's logits [T, V] packed against each of its samples' logits alone; the differences per sample."""
    result = PackResult(index=index, real_tokens=int(batch["cu_seqlens"][-1]))
    lengths = [len(s["input_ids"]) - 1 for s in samples]
    if len(batch["cu_seqlens"]) - 1 < len(samples):  # a wrapped_attention=cross row: pieces laid end to end
        starts = [sum(lengths[:i]) for i in range(len(samples))]
    else:
        starts = batch["cu_seqlens_padded"].tolist()[:len(samples)]
    for i, sample in enumerate(samples):
        start, num_tokens = starts[i], lengths[i]
        logits, labels = alone[i][:num_tokens], alone_batches[i]["labels"][0, :num_tokens]
        rows = slice(start, start + num_tokens)
        result.samples.append(SampleResult(
            sample_id=int(sample.get("sample_id", -1)), num_tokens=num_tokens,
            max_logit_diff=float((packed[rows] - logits).abs().max()) if num_tokens else 0.0,
            loss_packed=_mean_loss(packed[rows], batch["labels"][0, rows], batch["loss_mask"][0, rows]),
            loss_alone=_mean_loss(logits, labels, alone_batches[i]["loss_mask"][0, :num_tokens])))
    return result


def _fmt_loss(value: Optional[float]) -> str:
    return "n/a (no targets)" if value is None else f"{value:.6f}"


def _fmt_routed(result: PackResult) -> str:
    if result.routed_tokens is None:
        return ""
    worst = min(result.routed_tokens, key=lambda n: (n == result.real_tokens, n))
    return f"  routed {worst}/{result.real_tokens} real tokens"


def format_pack(result: PackResult, tolerance: float, *, leaks_by_design: bool = False) -> str:
    """The lines verify prints for one pack (``leaks_by_design``: a wrapped_attention=cross row)."""
    verdict = "LEAKS BY DESIGN (cross)" if leaks_by_design else "PASS" if result.passed(tolerance) else "FAIL"
    lines = [f"pack {result.index}: {len(result.samples)} samples, {sum(s.num_tokens for s in result.samples)} "
             f"real tokens  max |logit diff| {result.max_logit_diff:.3e}  max |loss diff| "
             f"{result.max_loss_diff:.3e}{_fmt_routed(result)}  {verdict}"]
    for s in result.samples:
        lines.append(f"    sample {s.sample_id}: {s.num_tokens} tokens  max |logit diff| {s.max_logit_diff:.3e}  "
                     f"loss packed {_fmt_loss(s.loss_packed)} alone {_fmt_loss(s.loss_alone)}  "
                     f"diff {s.loss_diff:.3e}")
    return "\n".join(lines)


def describe_weights(cfg, chunks: list) -> str:
    """Load ``verify.checkpoint`` when set (into the whole model of one rank: TP = PP = EP = 1, a rule of
    ``config.validate``); say which weights the model runs on (build_model already read
    ``model.pretrained``'s, when set: the default is the folder's weights, never a random init)."""
    if cfg.verify.checkpoint:
        base = f" on model.pretrained ({cfg.model.pretrained})" if cfg.model.pretrained else ""
        (model,) = chunks
        return f"checkpoint {load_model_weights(model, cfg.verify.checkpoint)}{base}"
    if cfg.model.pretrained:
        return f"model.pretrained ({cfg.model.pretrained})"
    return f"random init (train.seed={cfg.train.seed})"


def launched_config(cfg):
    """``cfg`` under torchrun (its layout: every parallel.* setting train accepts), else a world of one."""
    return cfg if int(os.environ.get("WORLD_SIZE", "1")) > 1 else single_process_config(cfg)


def run_verify(cfg, *, dataset=None, out=print) -> int:
    """Verify ``cfg.verify.num_packs`` packs of ``dataset`` (default: the plan of ``cfg.data.dataset_dir``
    matching ``cfg``) at the launched layout; 0 when all pass, else 1 (the same on every rank)."""
    if cfg.verify.reference == "transformers":  # against transformers' forward (below)
        return run_verify_transformers(cfg, dataset=dataset, out=out)
    from megatron_pack.data.batches.loader import dataset_collate
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.model.builder import fixed_pack_shapes
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    dataset = dataset if dataset is not None else open_dataset(cfg)
    if cfg.packing.mode == "online":  # no plan: the first packs a single-rank run would make
        dataset = dataset.first_packs(cfg.verify.num_packs)
    meta = dataset.metadata
    collate = dataset_collate(cfg, dataset)  # with a store's images, their pixels and M-RoPE positions
    import torch.distributed as dist

    run_cfg = launched_config(cfg)
    owns_process_group = not dist.is_initialized()
    enable_cpu_compat_without_cuda()
    state = initialize_parallel(run_cfg)
    holder, cross = holds_logits(state), meta.get("wrapped_attention") == "cross"
    pack_size, pad_id = int(meta["pack_size"]), int(meta.get("pad_id", 0))
    tol, num_passed = cfg.verify.tolerance, 0
    try:
        chunks = build_chunks(run_cfg, state, attention_mode=cfg.verify.attention)
        weights = describe_weights(cfg, chunks)
        if cfg.peft.method == "lora":
            weights += (f", LoRA active (dim {cfg.peft.dim}, alpha {cfg.peft.alpha}, "
                        f"{sum(getattr(c, 'num_adapters', 0) for c in chunks)} adapters on "
                        f"{','.join(cfg.peft.target_modules)})")
        num_packs = min(cfg.verify.num_packs, len(dataset))
        src = _holder_rank(state)
        if holder:
            out(f"verify: {dataset.plan_dir} ({len(dataset)} packs, checking {num_packs}); model {cfg.model.name} "
                f"at {_layout(state, len(chunks))}, {chunks[0].attention_backend} attention backend, attention "
                f"{cfg.verify.attention}, weights {weights}")
        for i in range(num_packs):
            samples = dataset[i]
            batch = collate(samples)
            alone = alone_batches(samples, batch, pack_size=pack_size, pad_id=pad_id,
                                  pad_multiple=int(meta.get("pad_seq_to_mult", 1)), fixed=fixed_pack_shapes(cfg),
                                  vision=_vision(run_cfg))
            logits, routed = schedule_logits(chunks, [batch, *alone], state, pack_size)
            if holder:
                result = compare_pack(logits[0], logits[1:], samples, batch, alone, index=i)
                result.routed_tokens = routed
                out(format_pack(result, tol, leaks_by_design=cross))
                num_passed += result.passed(tol) and not cross
        passed = agree_on_verdict(num_packs > 0 and num_passed == num_packs, src)
    finally:
        destroy_parallel(destroy_process_group=owns_process_group)
    if cross:
        if holder:
            out(f"verify: {num_packs} packs of a packing.wrapped_attention=cross plan: attention crosses documents "
                "by design, so packed != alone is expected: LEAKS BY DESIGN (not PASS); use "
                "wrapped_attention=document or another packing.algorithm for isolated samples")
        return 1
    if holder:
        out(f"verify: {num_passed}/{num_packs} packs PASS (tolerance {tol}, attention {cfg.verify.attention}): "
            f"{'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


def agree_on_verdict(passed: bool, src: int) -> bool:
    """The comparing rank's (global rank ``src``) PASS / FAIL on every rank of the world."""
    from megatron_pack.parallel.comm import broadcast

    return bool(broadcast(torch.tensor([int(passed)], dtype=torch.int64), src=src).item())


# ----- verify.reference=transformers -------------------------------------------------------
# `megatron-pack verify model.pretrained=DIR verify.reference=transformers`: our packed THD forward of
# the model loaded from DIR (at the configured layout when launched by torchrun, else a world of one)
# against transformers' ``AutoModelForCausalLM.from_pretrained(DIR)`` forward of each sample alone,
# float32, no remote code. Per pack: the largest logit difference over every real token (the real
# vocabulary; TP padding columns excluded), each sample's mean answer-token loss both ways, PASS /
# FAIL against ``verify.tolerance``. The rank holding the logits runs transformers and prints; every rank
# runs our forward (the schedule and its TP / CP / EP collectives need them all). Example::
#
#     torchrun --nproc-per-node 4 -m megatron_pack.cli.main verify model.pretrained=models/Llama-3.2-1B \
#         verify.reference=transformers parallel=tp2_cp2_sp data.dataset_dir=data/llama
#     pack 0: 7 samples, 3981 real tokens  max |logit diff| 3.1e-05  max |loss diff| 2.0e-07  PASS


def _full_logits(logits: torch.Tensor, batch: dict, state) -> torch.Tensor:
    """[T, V_padded] from this rank's [1, T/CP, V/TP] (float32)."""
    from megatron_pack.parallel.groups import gather_full_logits

    return gather_full_logits(logits.float(), batch["cu_seqlens_padded"], state)[0]


def compare_with_transformers(packed: torch.Tensor, batch: dict, reference, vocab: int, index: int):
    """One pack: our packed logits [T, V'] against transformers on each sample alone."""
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    ids = batch.get("sample_ids", torch.full((len(cu) - 1,), -1)).tolist()
    result = PackResult(index=index, real_tokens=cu[-1])
    for i in range(len(cu) - 1):
        start, num_tokens = cu_pad[i], cu[i + 1] - cu[i]
        if num_tokens == 0:  # a pad_to_max_length tail: no sample
            continue
        rows = slice(start, start + num_tokens)
        with torch.no_grad():
            theirs = reference(batch["tokens"][:, rows], **_reference_images(reference, batch, i)).logits[0].float()
        ours = packed[rows, :vocab]
        labels, mask = batch["labels"][0, rows], batch["loss_mask"][0, rows]
        result.samples.append(SampleResult(
            sample_id=int(ids[i]) if i < len(ids) else -1, num_tokens=num_tokens,
            max_logit_diff=float((ours - theirs).abs().max()),
            loss_packed=_mean_loss(ours, labels, mask), loss_alone=_mean_loss(theirs, labels, mask)))
    return result


def _reference_images(reference, batch: dict, index: int) -> dict:
    """transformers' image inputs of sub-sequence ``index`` of a VLM pack (nothing for a text batch): its
    pixel values and grids, and the token types its processor would return (1 on the image tokens)."""
    if "pixel_values" not in batch:
        return {}
    from megatron_pack.model.vlm import sample_alone

    config = reference.config
    alone = sample_alone(batch, index, config.image_token_id, config.vision_config.spatial_merge_size)
    images = {"pixel_values": alone["pixel_values"], "image_grid_thw": alone["image_grid_thw"]} \
        if alone["image_grid_thw"].shape[0] else {}
    return {"mm_token_type_ids": (alone["tokens"] == config.image_token_id).to(torch.int32), **images}


class VerifyStopped(Exception):
    """Every rank stops verify together; ``line`` is what rank 0 prints (None on the other ranks: one line)."""

    def __init__(self, line: Optional[str]):
        super().__init__(line or "stopped with rank 0")
        self.line = line


def _load_reference(path: str, vocab_size: Optional[int] = None):
    """(transformers' float32 model of ``path``, grown to ``vocab_size`` rows when given, transformers' version)."""
    try:
        import transformers
    except ImportError:
        raise ValueError("verify.reference=transformers needs the transformers package; install "
                         "megatron_pack[hf] (or set verify.reference=self).") from None
    from megatron_pack.config.hf_config import read_hf_config

    vision = "vision_config" in read_hf_config(path)  # a vision-language model: images in, logits out
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    reference = auto.from_pretrained(path, dtype=torch.float32, local_files_only=True, trust_remote_code=False)
    if vocab_size is not None:  # model.resize_vocab: the reference grows as ours did (model/hf/resize.py)
        from megatron_pack.model.hf.load import SafetensorsFolder
        from megatron_pack.model.hf.resize import grow_reference

        grow_reference(reference, SafetensorsFolder(path), vocab_size)
    return reference.eval(), transformers.__version__


def agree_on_reference(load: Callable[[], Any], *, holder: bool, what: str) -> Any:
    """The comparing rank (``holder``: the one that holds the logits) runs ``load`` (transformers' model of
    ``what``); every rank of the world learns whether it worked (``stop_together``), so a failure ends every
    rank at once, with one line from the holder, instead of leaving the others in the schedule or the logits
    gather until the process-group timeout. Returns the holder's result (None on the other ranks)."""
    loaded, problem = None, None
    if holder:
        try:
            loaded = load()
        except Exception as exc:  # ImportError, OSError (a folder transformers cannot read), ValueError, ...
            text = _first_line(exc)
            problem = text if isinstance(exc, ValueError) and text.startswith("verify.") else (
                f"verify.reference=transformers: transformers could not load {what} ({type(exc).__name__}: {text}); "
                "fix the folder, or set verify.reference=self to compare packed with unpacked in our model alone.")
    stop_together(problem)
    return loaded


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def stop_together(problem: Optional[str]) -> None:
    """One all-reduce of an ok flag over the world: ``VerifyStopped`` on every rank when any rank has a
    ``problem`` (its line kept where it arose, None elsewhere: one line)."""
    from megatron_pack.parallel.comm import all_reduce

    ok = all_reduce(torch.tensor([0 if problem else 1], dtype=torch.int64), op="min")
    if not int(ok.item()):
        raise VerifyStopped(problem)


def run_verify_transformers(cfg, *, dataset=None, out=print) -> int:
    """Verify against transformers at the launched layout; 0 when every pack passes, else 1 (the comparing
    rank decides, every rank returns it). ``VerifyStopped`` on every rank when the comparing rank cannot load
    the reference or compare."""
    import torch.distributed as dist

    from megatron_pack.data.batches.loader import dataset_collate
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    dataset = dataset if dataset is not None else open_dataset(cfg)
    collate = dataset_collate(cfg, dataset)
    run_cfg = launched_config(cfg)
    owns_process_group = not dist.is_initialized()
    enable_cpu_compat_without_cuda()  # megatron-core's CUDA assumptions, answered on a CPU host
    state = initialize_parallel(run_cfg)
    holder = holds_logits(state)
    tol, num_packs = cfg.verify.tolerance, min(cfg.verify.num_packs, len(dataset))
    num_passed = 0
    try:
        chunks = build_chunks(run_cfg, state)
        src = _holder_rank(state)
        loaded = agree_on_reference(lambda: _load_reference(cfg.model.pretrained, cfg.model.vocab_size if cfg.model.resize_vocab else None), holder=holder,
                                    what=f"model.pretrained ({cfg.model.pretrained})")
        reference, version = loaded if loaded is not None else (None, None)
        if holder:
            out(f"verify: {dataset.plan_dir} ({len(dataset)} packs, checking {num_packs}); ours: "
                f"{cfg.model.pretrained} at {_layout(state, len(chunks))} ({chunks[0].attention_backend} attention, "
                f"{cfg.model.params_dtype}); reference: transformers {version} float32, each sample alone")
        for i in range(num_packs):
            batch = collate(dataset[i])
            logits, routed = schedule_logits(chunks, [batch], state, int(dataset.metadata["pack_size"]))
            problem = None
            if holder:
                try:
                    result = compare_with_transformers(logits[0], batch, reference, cfg.model.vocab_size, i)
                except Exception as exc:  # transformers' forward: every rank stops with this line
                    problem = (f"verify.reference=transformers: transformers' forward of pack {i} failed "
                               f"({type(exc).__name__}: {_first_line(exc)})")
                else:
                    result.routed_tokens = routed
                    out(format_pack(result, tol))
                    num_passed += result.passed(tol)
            stop_together(problem)
        passed = agree_on_verdict(num_packs > 0 and num_passed == num_packs, src)
    finally:
        destroy_parallel(destroy_process_group=owns_process_group)
    if holder:
        out(f"verify: {num_passed}/{num_packs} packs PASS (tolerance {tol}, reference transformers): "
            f"{'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


def main(argv: list[str]) -> int:
    from megatron_pack.cli.args import parse_command_line, print_resolved
    from megatron_pack.cli.preflight import check_images, check_weights_folder
    from megatron_pack.cli.run_config import load_run_config
    from megatron_pack.config.host import Host
    from megatron_pack.config.schema import ConfigError
    from megatron_pack.data.formats.sources import DataError

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    line = parse_command_line("verify", argv)
    if isinstance(line, int):
        return line
    try:
        launched = "WORLD_SIZE" in os.environ  # under torchrun (verify.reference=transformers runs at TP/CP)
        run = load_run_config(line.overrides, config_dirs=line.config_dirs, open_data=not line.print_config,
                              world_size=int(os.environ["WORLD_SIZE"]) if launched else None,
                              host=Host.probe(checks_declared_gpu=line.print_config), command="verify")
        if line.print_config:
            return print_resolved(run.cfg, "\n".join(run.notes) or None)
        check_weights_folder(run.cfg.model.pretrained)  # one line per bad file, before any model exists
        check_images(run.dataset)  # every image file the packs use, as prepare recorded it
        from megatron_pack.cli.launch import hide_gpus_for_cpu_run

        hide_gpus_for_cpu_run(run.cfg.train.device)  # before anything starts CUDA
        from megatron_pack.model.cpu_compat import eager_jit_fuser_without_cuda

        eager_jit_fuser_without_cuda()  # before megatron-core's first import: no torch.compile machinery on CPU
        for note in run.notes:
            print(note)
        return run_verify(run.cfg, dataset=run.dataset)
    except VerifyStopped as exc:  # every rank stopped together; rank 0 says why
        if exc.line:
            print(f"megatron-pack verify: {exc.line}", file=sys.stderr)
        return 2
    except (ConfigError, DataError, FileNotFoundError, ValueError) as exc:
        print(f"megatron-pack verify: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
