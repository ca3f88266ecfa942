"""`megatron-pack verify`: the unpacked replay, as one command.

Loads the packed dataset at ``data.dataset_dir`` (its only plan, or ``data.plan``; pack size, pad
multiple, tokenizer and vocab size as prepare recorded them unless given), builds the model
from ``model.*`` (the weights of ``model.pretrained`` when set, else a random init with ``train.seed``;
``verify.checkpoint`` loads a training checkpoint's over them), and
for the first ``verify.num_packs`` packs runs the pack once (THD, as training does) and each of
its samples alone (a pack of one, no padding). For every pack it prints the largest absolute
logit difference over the real tokens, each sample's mean answer-token loss packed and alone,
and PASS when both the largest logit difference and the largest loss difference are within
``verify.tolerance``. Exit code 0 only when every pack passes.

``verify.reference=transformers`` (with ``model.pretrained``) compares our packed forward, at any
TP / CP under torchrun, with transformers' forward of each sample alone (docs/models.md).

A ``packing.algorithm=wrapped`` plan with ``packing.wrapped_attention=cross`` lets attention
cross documents on purpose: verify still measures the difference per piece, prints ``LEAKS BY
DESIGN (cross)`` for every pack instead of PASS, and exits 1. With ``wrapped_attention=document``
(and split pieces) each piece is compared with itself alone, as any other sample.

A mixture-of-experts model routes as training does: the pack's padding (from its boundaries, never
token ids) is excluded from routing (``model.moe.set_pack``), and each pack line adds ``routed N/N
real tokens``: the real tokens routed (top-k) in every MoE layer of the packed forward; a pack whose
count differs from its real tokens in any layer FAILs.

``verify.attention=pack_causal`` builds the model with plain causal attention over the whole
pack (samples see the samples before them): the broken setting verify exists to catch; it FAILs.

Against itself it runs in one process (a world of one: TP = CP = 1, whatever ``parallel.*`` says). Example::

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
    """Load a training checkpoint's model weights (either format, any layout) into a TP=1 model; returns
    its path. ``checkpoint`` is a checkpoint directory (``step_00000010``) or the ``checkpoint.save``
    root, whose newest intact checkpoint is used (``training.model_reader``, the reader train and export use)."""
    from megatron_pack.training.model_reader import CheckpointModel

    reader = CheckpointModel.open(checkpoint, "verify.checkpoint")
    reader.load_into(model)
    return reader.path


def _forward(model, batch: dict, local: dict, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """This rank's logits of ``local`` (its CP slice of the THD ``batch``); a MoE model's routers read the
    pack's boundaries and padding is not routed, as in training (``model.moe.set_pack``)."""
    from megatron_pack.model.moe import set_pack
    from megatron_pack.training.step import get_packed_seq_params

    params = get_packed_seq_params(batch, device=device)
    padding_mask = set_pack(model, batch, cp_size, cp_rank, device)
    extra = {} if padding_mask is None else {"padding_mask": padding_mask}
    with torch.no_grad():
        if getattr(model, "vision_language", False):  # images into the whole pack, then the CP slice (model/vlm.py)
            from megatron_pack.model.vlm import mrope_positions, vlm_decoder_input

            return model(None, mrope_positions(batch, device), None, packed_seq_params=params,
                         decoder_input=vlm_decoder_input(model, batch, cp_size, cp_rank, device))
        return model(local["tokens"].to(device), local["position_ids"].to(device), None, packed_seq_params=params,
                     **extra)


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


def _logits(model, batch: dict, device: torch.device) -> torch.Tensor:
    """[T, V] float32 logits of a THD batch (TP = CP = 1)."""
    return _forward(model, batch, batch, 1, 0, device)[0].float()


def _mean_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> Optional[float]:
    if float(mask.sum()) == 0:
        return None
    losses = F.cross_entropy(logits.double(), labels.to(logits.device), reduction="none")
    return float((losses * mask.to(losses)).sum() / mask.sum())


def compare_pack(model, samples: list[dict], collate, *, pack_size: int, pad_id: int, device: torch.device,
                 index: int = 0) -> PackResult:
    """Run one pack packed and each of its samples alone; the differences per sample."""
    from megatron_pack.data.batches.thd import collate_thd

    batch = collate(samples)
    packed = _logits(model, batch, device)
    result = PackResult(index=index, routed_tokens=routed_tokens(model), real_tokens=int(batch["cu_seqlens"][-1]))
    lengths = [len(s["input_ids"]) - 1 for s in samples]
    if len(batch["cu_seqlens"]) - 1 < len(samples):  # a wrapped_attention=cross row: pieces laid end to end
        starts = [sum(lengths[:i]) for i in range(len(samples))]
    else:
        starts = batch["cu_seqlens_padded"].tolist()[:len(samples)]
    for i, sample in enumerate(samples):
        start, num_tokens = starts[i], lengths[i]
        alone_batch = _alone(model, batch, i) if getattr(model, "vision_language", False) else \
            collate_thd([sample], pack_size=pack_size, pad_id=pad_id)
        alone = _logits(model, alone_batch, device)[:num_tokens]
        rows = slice(start, start + num_tokens)
        result.samples.append(SampleResult(
            sample_id=int(sample.get("sample_id", -1)), num_tokens=num_tokens,
            max_logit_diff=float((packed[rows] - alone).abs().max()) if num_tokens else 0.0,
            loss_packed=_mean_loss(packed[rows], batch["labels"][0, rows], batch["loss_mask"][0, rows]),
            loss_alone=_mean_loss(alone, alone_batch["labels"][0, :num_tokens], alone_batch["loss_mask"][0, :num_tokens])))
    return result


def _alone(model, batch: dict, index: int) -> dict:
    """A VLM pack's sub-sequence ``index`` alone, its images with it (``model.vlm.sample_alone``)."""
    from megatron_pack.model.vlm import sample_alone

    return sample_alone(batch, index, model.image_token_id, model.vision_model.spatial_merge_size)


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


def describe_weights(cfg, model) -> str:
    """Load ``verify.checkpoint`` when set; say which weights the model runs on (build_model already read
    ``model.pretrained``'s, when set: the default is the folder's weights, never a random init)."""
    if cfg.verify.checkpoint:
        base = f" on model.pretrained ({cfg.model.pretrained})" if cfg.model.pretrained else ""
        return f"checkpoint {load_model_weights(model, cfg.verify.checkpoint)}{base}"
    if cfg.model.pretrained:
        return f"model.pretrained ({cfg.model.pretrained})"
    return f"random init (train.seed={cfg.train.seed})"


def run_verify(cfg, *, dataset=None, out=print) -> int:
    """Verify ``cfg.verify.num_packs`` packs of ``dataset`` (default: the plan of ``cfg.data.dataset_dir``
    matching ``cfg``); 0 when all pass, else 1."""
    if cfg.verify.reference == "transformers":  # against transformers' forward (below)
        return run_verify_transformers(cfg, out=out)
    from megatron_pack.data.batches.loader import collate_from_config
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    dataset = dataset if dataset is not None else open_dataset(cfg)
    if cfg.packing.mode == "online":  # no plan: the first packs a single-rank run would make
        dataset = dataset.first_packs(cfg.verify.num_packs)
    meta = dataset.metadata
    collate = collate_from_config(cfg, meta)
    import torch.distributed as dist

    local_cfg = single_process_config(cfg)
    owns_process_group = not dist.is_initialized()
    enable_cpu_compat_without_cuda()
    state = initialize_parallel(local_cfg)
    try:
        model = build_model(local_cfg, state, attention_mode=cfg.verify.attention)
        weights = describe_weights(cfg, model)
        if cfg.peft.method == "lora":
            weights += (f", LoRA active (dim {cfg.peft.dim}, alpha {cfg.peft.alpha}, "
                        f"{getattr(model, 'num_adapters', 0)} adapters on {','.join(cfg.peft.target_modules)})")
        model.eval()
        num_packs = min(cfg.verify.num_packs, len(dataset))
        out(f"verify: {dataset.plan_dir} ({len(dataset)} packs, checking {num_packs}); model {cfg.model.name}, "
            f"{model.attention_backend} attention backend, attention {cfg.verify.attention}, weights {weights}")
        tol, num_passed = cfg.verify.tolerance, 0
        cross = meta.get("wrapped_attention") == "cross"
        for i in range(num_packs):
            result = compare_pack(model, dataset[i], collate, pack_size=int(meta["pack_size"]),
                                  pad_id=int(meta.get("pad_id", 0)), device=state.device, index=i)
            out(format_pack(result, tol, leaks_by_design=cross))
            num_passed += result.passed(tol) and not cross
    finally:
        destroy_parallel(destroy_process_group=owns_process_group)
    if cross:
        out(f"verify: {num_packs} packs of a packing.wrapped_attention=cross plan: attention crosses documents by "
            "design, so packed != alone is expected: LEAKS BY DESIGN (not PASS); use wrapped_attention=document "
            "or another packing.algorithm for isolated samples")
        return 1
    verdict = "PASS" if num_passed == num_packs else "FAIL"
    out(f"verify: {num_passed}/{num_packs} packs PASS (tolerance {tol}, attention {cfg.verify.attention}): {verdict}")
    return 0 if num_packs and num_passed == num_packs else 1


# ----- verify.reference=transformers -------------------------------------------------------
# `megatron-pack verify model.pretrained=DIR verify.reference=transformers`: our packed THD forward of
# the model loaded from DIR (at the configured TP / CP when launched by torchrun, else TP = CP = 1)
# against transformers' ``AutoModelForCausalLM.from_pretrained(DIR)`` forward of each sample alone,
# float32, no remote code. Per pack: the largest logit difference over every real token (the real
# vocabulary; TP padding columns excluded), each sample's mean answer-token loss both ways, PASS /
# FAIL against ``verify.tolerance``. Rank 0 runs transformers and prints; every rank runs our forward
# (its TP / CP collectives need them all). Example::
#
#     torchrun --nproc-per-node 4 -m megatron_pack.cli.main verify model.pretrained=models/Llama-3.2-1B \
#         verify.reference=transformers parallel=tp2_cp2_sp data.dataset_dir=data/llama
#     pack 0: 7 samples, 3981 real tokens  max |logit diff| 3.1e-05  max |loss diff| 2.0e-07  PASS


def _full_logits(logits: torch.Tensor, batch: dict, state) -> torch.Tensor:
    """[T, V_padded] from this rank's [1, T/CP, V/TP] (float32)."""
    from megatron_pack.parallel.groups import gather_full_logits

    return gather_full_logits(logits.float(), batch["cu_seqlens_padded"], state)[0]


def _ours(model, batch: dict, state) -> tuple[torch.Tensor, Optional[list[int]]]:
    """Our full packed logits [T, V'] and a MoE model's routed real tokens per layer (every rank calls it)."""
    from megatron_pack.parallel.cp import slice_thd_batch

    local = slice_thd_batch(batch, state.cp_size, state.cp_rank)
    logits = _forward(model, batch, local, state.cp_size, state.cp_rank, state.device)
    return _full_logits(logits.cpu(), batch, state), routed_tokens(model, state.cp_group)


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


def _load_reference(path: str):
    """(transformers' float32 model of ``path``, transformers' version)."""
    try:
        import transformers
    except ImportError:
        raise ValueError("verify.reference=transformers needs the transformers package; install "
                         "megatron_pack[hf] (or set verify.reference=self).") from None
    from megatron_pack.config.hf_config import read_hf_config

    vision = "vision_config" in read_hf_config(path)  # a vision-language model: images in, logits out
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    reference = auto.from_pretrained(path, dtype=torch.float32, local_files_only=True, trust_remote_code=False)
    return reference.eval(), transformers.__version__


def agree_on_reference(load: Callable[[], Any], *, rank: int, what: str) -> Any:
    """Rank 0 runs ``load`` (transformers' model of ``what``); every rank of the world learns whether it
    worked (one all-reduce of an ok flag), so a failure ends every rank at once, with one line from rank 0,
    instead of leaving the others in the logits all-gather until the process-group timeout. Returns
    rank 0's result (None on the other ranks); raises ``VerifyStopped`` on every rank when it failed."""
    from megatron_pack.parallel.comm import all_reduce

    loaded, problem = None, None
    if rank == 0:
        try:
            loaded = load()
        except Exception as exc:  # ImportError, OSError (a folder transformers cannot read), ValueError, ...
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            problem = text if isinstance(exc, ValueError) and text.startswith("verify.") else (
                f"verify.reference=transformers: transformers could not load {what} ({type(exc).__name__}: {text}); "
                "fix the folder, or set verify.reference=self to compare packed with unpacked in our model alone.")
    ok = all_reduce(torch.tensor([0 if problem else 1], dtype=torch.int64), op="min")
    if not int(ok.item()):
        raise VerifyStopped(problem if rank == 0 else None)
    return loaded


def run_verify_transformers(cfg, *, out=print) -> int:
    """Verify against transformers; 0 when every pack passes, else 1 (rank 0 decides, all ranks return it).
    ``VerifyStopped`` on every rank when rank 0 cannot load the reference."""
    import torch.distributed as dist

    from megatron_pack.parallel.comm import broadcast

    from megatron_pack.data.batches.loader import collate_from_config
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    dataset = open_dataset(cfg)
    collate = collate_from_config(cfg, dataset.metadata)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    run_cfg = cfg if launched else single_process_config(cfg)
    owns_process_group = not dist.is_initialized()
    enable_cpu_compat_without_cuda()  # megatron-core's CUDA assumptions, answered on a CPU host
    state = initialize_parallel(run_cfg)
    tol, num_packs = cfg.verify.tolerance, min(cfg.verify.num_packs, len(dataset))
    try:
        model = build_model(run_cfg, state)
        model.eval()
        loaded = agree_on_reference(lambda: _load_reference(cfg.model.pretrained), rank=state.rank,
                                    what=f"model.pretrained ({cfg.model.pretrained})")
        reference, version = loaded if loaded is not None else (None, None)
        if state.rank == 0:
            out(f"verify: {dataset.plan_dir} ({len(dataset)} packs, checking {num_packs}); ours: {cfg.model.pretrained} "
                f"at TP={state.tp_size} CP={state.cp_size} ({model.attention_backend} attention, "
                f"{cfg.model.params_dtype}); reference: transformers {version} float32, each sample alone")
        num_passed = 0
        for i in range(num_packs):
            batch = collate(dataset[i])
            packed, routed = _ours(model, batch, state)
            if state.rank == 0:
                result = compare_with_transformers(packed, batch, reference, cfg.model.vocab_size, i)
                result.routed_tokens = routed
                out(format_pack(result, tol))
                num_passed += result.passed(tol)
        verdict = broadcast(torch.tensor([int(num_packs > 0 and num_passed == num_packs)]), src=0)
    finally:
        destroy_parallel(destroy_process_group=owns_process_group)
    if state.rank == 0:
        out(f"verify: {num_passed}/{num_packs} packs PASS (tolerance {tol}, reference transformers): "
            f"{'PASS' if verdict.item() else 'FAIL'}")
    return 0 if verdict.item() else 1


def main(argv: list[str]) -> int:
    from megatron_pack.cli.args import parse_command_line, print_resolved
    from megatron_pack.cli.preflight import check_weights_folder
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
        from megatron_pack.cli.launch import hide_gpus_for_cpu_run

        hide_gpus_for_cpu_run(run.cfg.train.device)  # before anything starts CUDA
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
