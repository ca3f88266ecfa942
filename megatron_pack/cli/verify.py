"""`megatron-pack verify`: the unpacked replay, as one command.

Loads the packed dataset at ``data.dataset_dir`` (the plan matching the config), builds the model
from ``model.*`` (random init with ``train.seed``, or the weights of ``verify.checkpoint``), and
for the first ``verify.num_packs`` packs runs the pack once (THD, as training does) and each of
its samples alone (a pack of one, no padding). For every pack it prints the largest absolute
logit difference over the real tokens, each sample's mean answer-token loss packed and alone,
and PASS when both the largest logit difference and the largest loss difference are within
``verify.tolerance``. Exit code 0 only when every pack passes.

``verify.attention=pack_causal`` builds the model with plain causal attention over the whole
pack (samples see the samples before them): the broken setting verify exists to catch; it FAILs.

Runs in one process (a world of one: TP = CP = 1, whatever ``parallel.*`` says). Example::

    megatron-pack verify data.dataset_dir=data/synthetic verify.num_packs=4
    pack 0: 5 samples, 497 real tokens  max |logit diff| 2.4e-07  max |loss diff| 1.2e-07  PASS
    ...
    verify: 4/4 packs PASS (tolerance 0.0001, attention thd)
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

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

    @property
    def max_logit_diff(self) -> float:
        return max((s.max_logit_diff for s in self.samples), default=0.0)

    @property
    def max_loss_diff(self) -> float:
        return max((s.loss_diff for s in self.samples), default=0.0)

    def passed(self, tolerance: float) -> bool:
        return self.max_logit_diff <= tolerance and self.max_loss_diff <= tolerance


def single_process_config(cfg):
    """``cfg`` with TP = CP = 1 and no sequence parallelism (verify runs in one process)."""
    from megatron_pack.config.schema import ParallelConfig

    return dataclasses.replace(cfg, parallel=ParallelConfig(backend=cfg.parallel.backend))


def _merge_tp_shards(shards: list[torch.Tensor], param: torch.nn.Parameter) -> torch.Tensor:
    """Full tensor from TP shards (rank order), honouring megatron's partition dim and stride."""
    if len(shards) == 1 or not getattr(param, "tensor_model_parallel", False):
        return shards[0]
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def load_model_weights(model: torch.nn.Module, checkpoint: str | Path) -> Path:
    """Load a training checkpoint's model weights (any TP size) into a TP=1 model; returns its path.

    ``checkpoint`` is a checkpoint directory (``step_00000010``) or the ``checkpoint.save`` root,
    whose ``latest`` is used. Keys are ``model/tp<r>/<parameter name>`` (megatron_pack.training).
    """
    import torch.distributed.checkpoint as dcp

    from megatron_pack.training.checkpoint import checkpoint_reader, find_latest, read_meta

    path = Path(checkpoint)
    if not (path / "meta.json").is_file():
        latest = find_latest(path)
        if latest is None:
            raise FileNotFoundError(f"verify.checkpoint ({checkpoint}) holds no complete checkpoint (no meta.json, "
                                    "no 'latest'); point it at checkpoint.save of a training run or a step_* folder.")
        path = latest
    tp = int(read_meta(path).get("tensor_model_parallel_size", 1))
    stored = checkpoint_reader(path).read_metadata().state_dict_metadata  # .metadata via the allowlist, not pickle
    state = {}
    for name, param in model.named_parameters():
        keys = [f"model/tp{r}/{name}" for r in range(tp)]
        missing = [k for k in keys if k not in stored]
        if missing:
            raise ValueError(f"checkpoint {path} has no {missing[0]}: it was written for another model; "
                             "use the same model.* settings as the training run.")
        state.update({k: torch.empty(tuple(stored[k].size), dtype=param.dtype) for k in keys})
    dcp.load(state, storage_reader=checkpoint_reader(path), no_dist=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = _merge_tp_shards([state[f"model/tp{r}/{name}"] for r in range(tp)], param)
            if full.shape != param.shape:
                raise ValueError(f"checkpoint {path}: {name} has shape {tuple(full.shape)}, the model expects "
                                 f"{tuple(param.shape)}; use the same model.* settings as the training run.")
            param.copy_(full)
    return path


def _logits(model, batch: dict, device: torch.device) -> torch.Tensor:
    """[T, V] float32 logits of a THD batch (TP = CP = 1)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_pack.training.step import get_packed_seq_params

    params = get_packed_seq_params(batch)
    params = PackedSeqParams(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in vars(params).items()})
    with torch.no_grad():
        logits = model(batch["tokens"].to(device), batch["position_ids"].to(device), None, packed_seq_params=params)
    return logits[0].float()


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
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    result = PackResult(index=index)
    for i, sample in enumerate(samples):
        start, num_tokens = cu_pad[i], cu[i + 1] - cu[i]
        alone_batch = collate_thd([sample], pack_size=pack_size, pad_id=pad_id)
        alone = _logits(model, alone_batch, device)[:num_tokens]
        rows = slice(start, start + num_tokens)
        result.samples.append(SampleResult(
            sample_id=int(sample.get("sample_id", -1)), num_tokens=num_tokens,
            max_logit_diff=float((packed[rows] - alone).abs().max()) if num_tokens else 0.0,
            loss_packed=_mean_loss(packed[rows], batch["labels"][0, rows], batch["loss_mask"][0, rows]),
            loss_alone=_mean_loss(alone, alone_batch["labels"][0, :num_tokens], alone_batch["loss_mask"][0, :num_tokens])))
    return result


def _fmt_loss(value: Optional[float]) -> str:
    return "n/a (no targets)" if value is None else f"{value:.6f}"


def format_pack(result: PackResult, tolerance: float) -> str:
    """The lines verify prints for one pack."""
    verdict = "PASS" if result.passed(tolerance) else "FAIL"
    lines = [f"pack {result.index}: {len(result.samples)} samples, {sum(s.num_tokens for s in result.samples)} "
             f"real tokens  max |logit diff| {result.max_logit_diff:.3e}  max |loss diff| "
             f"{result.max_loss_diff:.3e}  {verdict}"]
    for s in result.samples:
        lines.append(f"    sample {s.sample_id}: {s.num_tokens} tokens  max |logit diff| {s.max_logit_diff:.3e}  "
                     f"loss packed {_fmt_loss(s.loss_packed)} alone {_fmt_loss(s.loss_alone)}  "
                     f"diff {s.loss_diff:.3e}")
    return "\n".join(lines)


def run_verify(cfg, *, out=print) -> int:
    """Verify ``cfg.verify.num_packs`` packs of ``cfg.data.dataset_dir``; 0 when all pass, else 1."""
    if cfg.verify.reference == "transformers":  # against transformers' forward (cli/verify_reference.py)
        from megatron_pack.cli.verify_reference import run_verify_transformers

        return run_verify_transformers(cfg, out=out)
    from megatron_pack.data.batches.loader import collate_from_config, open_dataset
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    dataset = open_dataset(cfg)
    meta = dataset.metadata
    collate = collate_from_config(cfg, meta)
    import torch.distributed as dist

    local_cfg = single_process_config(cfg)
    owns_process_group = not dist.is_initialized()
    enable_cpu_compat_without_cuda()
    state = initialize_parallel(local_cfg)
    try:
        model = build_model(local_cfg, state, attention_mode=cfg.verify.attention)
        weights = (f"checkpoint {load_model_weights(model, cfg.verify.checkpoint)}" if cfg.verify.checkpoint
                   else f"random init (train.seed={cfg.train.seed})")
        model.eval()
        num_packs = min(cfg.verify.num_packs, len(dataset))
        out(f"verify: {dataset.plan_dir} ({len(dataset)} packs, checking {num_packs}); model {cfg.model.name}, "
            f"{model.attention_backend} attention backend, attention {cfg.verify.attention}, weights {weights}")
        tol, num_passed = cfg.verify.tolerance, 0
        for i in range(num_packs):
            result = compare_pack(model, dataset[i], collate, pack_size=int(meta["pack_size"]),
                                  pad_id=int(meta.get("pad_id", 0)), device=state.device, index=i)
            out(format_pack(result, tol))
            num_passed += result.passed(tol)
    finally:
        destroy_parallel(destroy_process_group=owns_process_group)
    verdict = "PASS" if num_passed == num_packs else "FAIL"
    out(f"verify: {num_passed}/{num_packs} packs PASS (tolerance {tol}, attention {cfg.verify.attention}): {verdict}")
    return 0 if num_packs and num_passed == num_packs else 1


def main(argv: list[str]) -> int:
    from megatron_pack.config import load_config
    from megatron_pack.config.schema import ConfigError
    from megatron_pack.data.formats.sources import DataError

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    try:
        import os

        launched = "WORLD_SIZE" in os.environ  # under torchrun (verify.reference=transformers runs at TP/CP)
        cfg = load_config(list(argv), world_size=int(os.environ["WORLD_SIZE"]) if launched else None)
        return run_verify(cfg)
    except (ConfigError, DataError, FileNotFoundError, ValueError) as exc:
        print(f"megatron-pack verify: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
