"""Mixture-of-experts models on packed THD batches, proved against transformers (tests share no code with ours).

One spawned gloo world of 2 ranks runs three tiny MoE folders (2 layers, hidden 32, 4 experts, top-2):
Qwen3-MoE with ``norm_topk_prob`` true and false (megatron-core's pre_softmax False / True) and Mixtral,
at the layouts of ``LAYOUTS`` (DP=2, CP=2, EP=2 over DP, EP=2 over CP, TP=2 with expert TP 2, TP=2 x EP=2 with
expert TP 1; ``WORLDS`` lists which folder runs where):

1. logits of a pack with several samples and padding equal transformers' forward of each sample
   alone (<= 1e-4 on every real token), and so do those of each sample packed alone;
2. a pack that is 90% padding routes exactly its real tokens: tokens per expert per layer equal
   the experts transformers' router picks for the sample alone; at CP=2 rank 1's slice is only
   padding and the step finishes (the world has a deadline);
3. one training step (our forward_step: padding mask and pack boundaries from the metadata) gives
   the LM loss, the per-sample load-balancing and z-losses and every gradient of a float64 transformers reference
   that runs each sample alone: ``sum CE / M + (a sum_s n_s L_s + z sum_s n_s Z_s) / N`` with ``n_s`` a sample's
   real tokens, ``M`` and ``N`` the global batch's target and real tokens (docs/training.md), relative 1e-5 (at
   DP=2 the two ranks' packs differ in target per real token, so a per-rank normalisation fails);
4. LoRA on a MoE model, proved through peft (``target_parameters`` on transformers 5's 3D experts):
   random (non-zero) adapters on the attention alone and on the attention and every expert's linear_fc1 /
   linear_fc2 (Qwen2-MoE: and its shared expert), exported in the peft format, load with
   ``PeftModel.from_pretrained`` with every adapter tensor equal and logits equal ours; and two training
   steps from the initial adapters at world 1 (in-process) and in the spawned world at EP=2, at TP=2 SP x
   EP=2 with whole experts and at TP=2 SP with expert TP 2 (``LORA_LAYOUTS``): the checkpoint's
   ``export.adapter`` loads in peft with logits equal ours after the steps (which differ from the base's),
   its ``export.merge`` loads in transformers with logits equal peft's, every exported tensor is the same
   at every layout, and each EP=2 checkpoint resumes at EP=1 with every (expert) adapter equal;
5. the user's path: ``prepare``, ``train`` (torchrun, CP=2 with EP=2 over the CP ranks, validation), a resume
   of its checkpoint at EP=1 with pipeline stages (``parallel=pp2``: the layout-free checkpoint reshards the experts
   over stages), and ``export`` of a Qwen3-MoE
   folder as the
   docs write them; the step line and metrics.jsonl carry the auxiliary losses and the expert loads,
   the export has the source's per-expert layout, loads in transformers with changed weights, and an
   export of the untrained folder is bit-identical to it; ``verify verify.reference=transformers`` on the
   prepared packs PASSes and routes exactly each pack's real tokens in every layer;
6. the distributed optimizer at DP=2 x EP=2 (dense state sharded over DP, experts over expert-DP) takes the plain
   optimizer's steps (losses, gradient norms, load-balancing losses, weights), and checkpoints cross it both ways.
7. pipeline stages: one global batch at PP=2 (one MoE layer a stage), with and without full recompute, trains as
   at PP=1 x DP=2 (losses, gradient norms, auxiliary losses, every layer's expert loads), and its checkpoint resumes
   at PP=1 with the same weights.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from _dist import num_threads, spawn_world
from _hf import cli, prepare_in, save_tokenizer, torchrun_train

FOLDERS = ("qwen3_moe", "qwen3_moe_raw", "mixtral", "qwen2_moe")
"""qwen3_moe: norm_topk_prob true; qwen3_moe_raw: false (softmax, top-k, no renormalisation); qwen2_moe: QKV bias
and a shared expert behind a sigmoid gate."""
VOCAB, NUM_EXPERTS, TOPK = 97, 4, 2
AUX, ZLOSS = 0.1, 0.01
LENGTHS = (9, 6, 12, 7)
PACK_SIZE, PAD_MULTIPLE = 64, 4
LAYOUTS = {"dp2": (1, 1, 1, None), "cp2": (2, 1, 1, None), "ep2": (1, 2, 1, None), "ep2_cp2": (2, 2, 1, None),
           "tp2": (1, 1, 2, None), "tp2_etp1_ep2": (1, 2, 2, 1), "ep2_cp2_recompute": (2, 2, 1, None)}
"""layout -> (CP, EP, TP, expert TP) on 2 ranks; DP = 2 / (CP * TP). ep2: each rank holds 2 of the 4 experts,
tokens all-gathered over DP; ep2_cp2: the same over the two CP ranks of one pack (rank 1 holds only padding of the
90%-padding pack); tp2: sequence parallel, experts split over TP (expert TP 2); tp2_etp1_ep2: attention TP 2, each
rank 2 whole experts (expert TP 1, EP 2; validate() refuses expert TP 1 < TP at EP 1, docs/training.md);
ep2_cp2_recompute: with model.recompute_granularity=full (the aux losses attach once, in the recomputed forward)."""
WORLDS = {2: [("qwen3_moe", layout) for layout in LAYOUTS] + [("qwen3_moe_raw", "dp2")]
          + [("mixtral", layout) for layout in ("dp2", "cp2", "ep2")] + [("qwen2_moe", "ep2_cp2")]}
"""world size -> the (folder, layout) cases it runs: the router mappings need one layout each, the layouts one family."""


def _hf_model(family: str, vocab: int = VOCAB):
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=TOPK, eos_token_id=2)
    if family == "mixtral":
        config = T.MixtralConfig(**common, num_local_experts=NUM_EXPERTS, sliding_window=None)
    elif family == "qwen2_moe":
        config = T.Qwen2MoeConfig(**common, num_experts=NUM_EXPERTS, moe_intermediate_size=24,
                                  shared_expert_intermediate_size=36, norm_topk_prob=False)
    else:
        config = T.Qwen3MoeConfig(**common, num_experts=NUM_EXPERTS, moe_intermediate_size=24, head_dim=8,
                                  norm_topk_prob=family == "qwen3_moe")
    torch.manual_seed(3)
    model = T.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # routers and norms far from their init, so routing and q/k norms matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight") or (name.endswith(".bias") and "proj" in name):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def _samples() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, VOCAB, size=n).tolist() + [2] for n in LENGTHS]


def _mask(ids: list[int]) -> list[int]:
    """Answer-only style: the first two ids are prompt, so a sample's target count differs from its length."""
    return [0, 0] + [1] * (len(ids) - 2)


def _pack(samples, *, pack_size=PACK_SIZE, pad_multiple=PAD_MULTIPLE, pad_to_max_length=True):
    from megatron_pack.data.batches.thd import collate_thd

    return collate_thd([{"input_ids": s, "loss_mask": _mask(s)} for s in samples], pack_size=pack_size,
                       pad_multiple=pad_multiple, pad_to_max_length=pad_to_max_length)


def _config(folder: str, cp: int, ep: int, tp: int = 1, etp=None, recompute=None):
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig

    cfg = Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=PACK_SIZE,
                                   moe_aux_loss_coeff=AUX, moe_z_loss_coeff=ZLOSS, recompute_granularity=recompute),
                 parallel=ParallelConfig(context_parallel_size=cp, expert_model_parallel_size=ep,
                                         tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                         expert_tensor_parallel_size=etp))
    return apply_pretrained(cfg, [])


def _sample_logits(model, pg, batch) -> list[torch.Tensor]:
    """Our logits [len - 1, VOCAB] of each sample of ``batch`` (the whole pack's, gathered over CP / TP)."""
    from megatron_pack.model.moe import begin_micro_batch
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.parallel.groups import gather_full_logits
    from megatron_pack.training.step import get_packed_seq_params

    local = slice_thd_batch(batch, pg.cp_size, pg.cp_rank)
    index = begin_micro_batch(model, batch, pg.cp_size, pg.cp_rank, "cpu")
    with torch.no_grad():
        logits = model(local["tokens"], local["position_ids"], None, packed_seq_params=get_packed_seq_params(batch),
                       padding_mask=index)
    full = gather_full_logits(logits, batch["cu_seqlens_padded"], pg)[0]
    starts, cu = batch["cu_seqlens_padded"].tolist(), batch["cu_seqlens"].tolist()
    return [full[starts[i]:starts[i] + cu[i + 1] - cu[i], :VOCAB] for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]


def _logit_diffs(model, pg, batch, refs) -> float:
    ours = _sample_logits(model, pg, batch)
    return max(float((mine - ref).abs().max()) for mine, ref in zip(ours, refs, strict=True))


def _gather_experts(grads: dict, ep_group) -> dict:
    """Every EP rank's expert gradients under global expert names (rank r's local expert e is r * E / EP + e)."""
    import torch.distributed as dist

    parts = [None] * ep_group.size()
    dist.all_gather_object(parts, {n: g for n, g in grads.items() if ".local_experts." in n}, group=ep_group)
    out = {}
    for rank, part in enumerate(parts):
        for name, grad in part.items():
            head, tail = name.split(".local_experts.")
            local, rest = tail.split(".", 1)
            out[f"{head}.local_experts.{rank * NUM_EXPERTS // ep_group.size() + int(local)}.{rest}"] = grad
    return out


def _train_step(model, pg, cfg, batch) -> dict:
    """The trainer's step on this rank's pack: DDP, forward_step, backward, finalize_model_grads (grads summed
    over DP x CP, experts over expert-DP, scaled by 1 / global target count); every rank's grads under HF names."""
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from megatron_pack.model.hf.export import hf_tensors
    from megatron_pack.model.moe import set_step_tokens, stage_moe_reports, step_moe_metrics
    from megatron_pack.training.chunks import wrap_ddp
    from megatron_pack.training.step import forward_step

    model.train()
    ddp = wrap_ddp(cfg, model, pg)
    ddp.zero_grad_buffer()
    _, real_tokens = set_step_tokens(ddp, [batch], pg.dp_group)
    output, loss_fn = forward_step(iter([batch]), ddp)
    loss_sum, num_tokens, _ = loss_fn(output)
    loss_sum.backward()
    counts = torch.stack([loss_sum.detach().double(), num_tokens.double()])
    dist.all_reduce(counts, group=pg.dp_cp_group)
    finalize_model_grads([ddp], num_tokens=num_tokens.clone(), pg_collection=pg.pg_collection)
    from megatron_pack.model.cpu_compat import CudaAsCpu
    from megatron_pack.training.optim import build_optimizer

    optimizer = build_optimizer(cfg, [ddp]).optimizer  # the trainer's norm (clipping): every EP rank's experts, once
    with CudaAsCpu():
        optimizer.prepare_grads()
        norm = float(optimizer.get_grad_norm())
    grads = {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}
    grads.update(_gather_experts(grads, pg.pg_collection.ep))
    shards = [None] * pg.tp_size
    dist.all_gather_object(shards, grads, group=pg.tp_group)
    from megatron_pack.config.hf_config import read_hf_config

    model_type = read_hf_config(cfg.model.pretrained)["model_type"]
    hf_grads = hf_tensors(shards, model_type, cfg.model, etp=cfg.parallel.expert_tensor_parallel_size)
    moe_reports = {k: torch.tensor(v, dtype=torch.float64) for k, v in stage_moe_reports([ddp]).items()}
    assert sorted(moe_reports) == ["moe layer 1", "moe layer 2"]  # guard: every layer recorded once
    for value in moe_reports.values():  # the sum the trainer's step outcome takes over DP x CP
        dist.all_reduce(value, group=pg.dp_cp_group)
    moe = step_moe_metrics({k: v.tolist() for k, v in moe_reports.items()}, real_tokens, NUM_EXPERTS)
    return {"lm_loss": float(counts[0] / counts[1]), "lb": moe["load_balancing_loss"], "z": moe["z_loss"],
            "grad_norm": norm,
            **{f"grad/{k}": v.numpy() for k, v in hf_grads.items()}}


def _run(folder: str, layout: str, refs: dict, rank: int) -> dict:
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.moe import pack_routing
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    cp, ep, tp, etp = LAYOUTS[layout]
    cfg = _config(folder, cp, ep, tp, etp, "full" if layout.endswith("_recompute") else None)
    pg = initialize_parallel(cfg)
    try:
        model = build_model(cfg, pg)
        model.eval()
        samples = _samples()
        local_experts = [len(layer.mlp.experts.local_experts) for layer in model.decoder.layers]
        out = {"local_experts": np.array(local_experts),
               "packed": _logit_diffs(model, pg, _pack(samples), refs["logits"]),
               "alone": max(_logit_diffs(model, pg, _pack([s]), [r]) for s, r in zip(samples, refs["logits"]))}
        sparse = _pack([samples[0]], pack_size=PACK_SIZE, pad_multiple=PACK_SIZE)  # 9 real of 64: rank 1 pads only
        _logit_diffs(model, pg, sparse, refs["logits"][:1])
        load = torch.stack([pack_routing(model).load[i] for i in sorted(pack_routing(model).load)])
        torch.distributed.all_reduce(load, group=pg.cp_group)
        out["sparse_load"] = load.numpy()
        # at DP=2 the ranks' packs have different lengths (32 and 8 tokens, no pad_to_max_length), the normal
        # case of variable packs: EP=2 over DP exchanges unequal token counts in the MoE dispatcher
        step_samples = (samples[:3] if pg.dp_rank == 0 else samples[3:]) if pg.dp_size == 2 else samples
        step_pack = _pack(step_samples, pad_to_max_length=False)
        lengths = [None] * pg.dp_size
        torch.distributed.all_gather_object(lengths, int(step_pack["tokens"].shape[-1]), group=pg.dp_group)
        out["step_pack_lengths"] = np.array(lengths)
        out.update(_train_step(model, pg, cfg, step_pack))
        return {f"{layout}/{k}": v for k, v in out.items()} if rank == 0 else {}
    finally:
        destroy_parallel()


def _worker(rank: int, world_size: int, folders: dict, refs: dict, root: str) -> dict:
    import gc

    out = {}
    threads_before = num_threads(os.getpid())
    for family, layout in WORLDS[world_size]:
        out.update({f"{family}/{k}": v for k, v in _run(folders[family], layout, refs[family], rank).items()})
    for run, layout in LORA_LAYOUTS.items():
        out.update({f"{run}/{k}": v for k, v in _lora_train(folders["qwen3_moe"], f"{root}/{run}", *layout).items()})
    out.update(_distributed_optimizer(folders["qwen3_moe"], rank, root))
    out.update(_pipeline(folders["qwen3_moe"], rank, root))
    gc.collect()
    out[f"rank{rank}/threads"] = np.array([threads_before, num_threads(os.getpid())])
    return out


PIPELINE_LENGTHS = (9, 5, 13, 3, 11, 6, 10)
"""The samples of ``_pipeline``'s global batch (random tokens and an EOS each), in 4 packs of different lengths."""


def _pipeline(folder: str, rank: int, root: str) -> dict:
    """One global batch of 4 packs of different lengths, 2 steps, by trainers at PP=1 x DP=2 (2 packs a rank), at
    PP=2 (one MoE layer a stage; the 4 packs are 4 micro-batches of the one DP rank) and at PP=2 with
    ``model.recompute_granularity=full``: per step (lm loss, grad norm, lb, z) and the tokens routed per expert of
    each layer; the PP=2 run's checkpoint resumed at PP=1 x DP=2: its largest weight difference to the DP=2 run's.
    1F1B runs a later micro-batch's forward before an earlier one's backward, whose recomputed forward must route
    its own pack (it did not while the routers read the pack from an attribute set before each forward), and the
    first stage's layers must reach the step's MoE metrics (they did not: only the last stage's loss report
    carried them)."""
    import dataclasses

    from _dist import ListLoader
    from megatron_pack.config.schema import TrainConfig
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.chunks import core_model
    from megatron_pack.training.loop import build_trainer

    rng = np.random.default_rng(5)
    samples = [rng.integers(3, VOCAB, size=n).tolist() + [2] for n in PIPELINE_LENGTHS]
    packs = [_pack(group, pad_to_max_length=False) for group in (samples[0:2], samples[2:5], samples[5:6],
                                                                 samples[6:])]
    out = {"pack_lengths": np.array([int(p["tokens"].shape[-1]) for p in packs])}

    def trainer(pp: int, recompute=None):
        cfg = _config(folder, 1, 1, recompute=recompute)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_model_parallel_size=pp),
                                  train=TrainConfig(seed=1234, lr=3e-3, global_batch_size=4, train_iters=2,
                                                    lr_warmup_iters=0))
        state = initialize_parallel(cfg)
        return build_trainer(cfg, state, ListLoader(packs[state.dp_rank::state.dp_size] * 2))

    def weights(run):
        return {n: p.detach().clone() for n, p in core_model(run.model).named_parameters()}

    checkpoint = None
    for run, pp, recompute in (("dp2", 1, None), ("pp2", 2, None), ("pp2_recompute", 2, "full")):
        try:
            steps = trainer(pp, recompute)
            metrics = [steps.train_step() for _ in range(2)]
            if run == "dp2":
                trained = weights(steps)
            elif run == "pp2":
                checkpoint = steps.save(f"{root}/pipeline")
        finally:
            destroy_parallel()
        out[run] = np.array([[m.lm_loss, m.grad_norm, m.moe["load_balancing_loss"], m.moe["z_loss"]] for m in metrics])
        out[f"{run}/load"] = np.array([m.moe["tokens_per_expert"] for m in metrics])
    try:
        resumed = trainer(1)
        resumed.load(checkpoint)
        loaded = weights(resumed)
    finally:
        destroy_parallel()
    assert sorted(loaded) == sorted(trained)
    out["resumed_weights_diff"] = max(float((loaded[n] - w).abs().max()) for n, w in trained.items())
    return {f"rank{rank}/pipeline/{k}": v for k, v in out.items()}

LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA_DIM, LORA_ALPHA = 4, 8.0
LORA_LAYOUTS = {"lora_ep2": (2,), "lora_tp2_etp1_ep2": (2, 2, 1), "lora_tp2": (1, 2, None)}
"""The spawned world's LoRA runs: (EP, TP, expert TP): EP=2 over DP=2; TP=2 SP with whole experts, 2 per rank
(the layout of configs/experiment/qwen3_30b_a3b_sft.yaml); TP=2 SP with every expert split over expert TP 2
(its adapters too: the checkpoint's export, which merges the shards, equals world 1's)."""


def _lora_config(folder: str, tmp: str, ep: int, tp: int = 1, etp=None):
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import (CheckpointConfig, Config, LoggingConfig, ModelConfig, ParallelConfig,
                                             PeftConfig, TrainConfig)

    cfg = Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=PACK_SIZE,
                                   moe_aux_loss_coeff=AUX, moe_z_loss_coeff=ZLOSS),
                 parallel=ParallelConfig(expert_model_parallel_size=ep, tensor_model_parallel_size=tp,
                                         sequence_parallel=tp > 1, expert_tensor_parallel_size=etp),
                 # AdamW's step lr m / (sqrt(v) + eps) is about (lr / eps) g with a large eps (SGD-like), so the
                 # float32 rounding of a gradient summed in another order is not amplified to lr sign(g)
                 train=TrainConfig(global_batch_size=2, train_iters=2, lr=0.1, min_lr=0.1, lr_warmup_iters=0,
                                   output_dir=tmp, adam_eps=1e-2),
                 checkpoint=CheckpointConfig(enabled=False), logging=LoggingConfig(tensorboard=False),
                 peft=PeftConfig(method="lora", dim=LORA_DIM, alpha=LORA_ALPHA, target_modules=LORA_TARGETS))
    return apply_pretrained(cfg, [])


def _global_adapters(model, pg) -> dict[str, torch.Tensor]:
    """Every adapter of the model under global expert names (each EP rank's experts gathered)."""
    from megatron_pack.model.peft.lora import adapter_state

    mine = {n: p.detach().clone() for n, p in adapter_state(model).items()}
    return {**mine, **_gather_experts(mine, pg.pg_collection.ep)}


def _lora_train(folder: str, tmp: str, ep: int, tp: int = 1, etp=None) -> dict:
    """Two training steps of LoRA on attention and experts (the trainer, initial adapters: B = 0) at EP=``ep``
    (TP=``tp``, expert TP ``etp``) over the world's ranks, a checkpoint, its export through ``megatron-pack
    export`` (rank 0), our logits after the steps; at EP=2 the checkpoint is resumed at EP=1 (TP=1) and every
    adapter (at TP > 1 every expert's, whole on its rank) compared with the saved ones."""
    import torch.distributed as dist

    from _dist import ListLoader

    from megatron_pack.cli.export import run_export
    from megatron_pack.model.peft.lora import count_parameters
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    packs = [_pack(_samples()[:2]), _pack(_samples()[2:])]  # the global batch of 2, on 1 or 2 DP ranks
    state = initialize_parallel(_lora_config(folder, tmp, ep, tp, etp))
    try:
        trainer = build_trainer(_lora_config(folder, tmp, ep, tp, etp), state,
                                ListLoader(packs[state.dp_rank::state.dp_size] * 2))
        model = trainer.model.module
        initial = _global_adapters(model, state)
        for _ in range(2):  # step 1 trains B only (B = 0 gives A no gradient), step 2 both
            trainer.train_step()
        path = trainer.save(f"{tmp}/checkpoints")
        # the "trainable parameters" line's counts: every EP (x expert TP) rank's experts and adapters summed
        counts = count_parameters(model, state.tp_group, state.pg_collection.tp_ep, state.pg_collection.ep)
        vocab_params = tp * sum(p.numel() for n, p in model.named_parameters()  # padded to a multiple of TP
                                if "word_embeddings" in n or "output_layer" in n)
        model.eval()
        out = {"logits": torch.cat(_sample_logits(model, state, _pack(_samples()))).numpy(),
               "counts": np.array([*counts, vocab_params], dtype=np.int64)}
        trained = _global_adapters(model, state)
        local = [len(layer.mlp.experts.local_experts) for layer in model.decoder.layers]
    finally:
        destroy_parallel()
    zero_b = [n for n in initial if n.endswith("linear_out.weight")]
    checks = [len(trained) == len(initial) == 4 * 2 + 2 * 2 * 2 * NUM_EXPERTS,  # guard: attention + every expert
              local == [NUM_EXPERTS // ep] * 2,
              all(not initial[n].any() for n in zero_b) and all(trained[n].any() for n in zero_b)
              and all(not torch.equal(trained[n], initial[n]) for n in initial)]
    if ep > 1:  # resume the EP=2 checkpoint at EP=1 (each rank all experts): every adapter as saved
        state = initialize_parallel(_lora_config(folder, f"{tmp}/resume", 1))
        try:
            trainer = build_trainer(_lora_config(folder, f"{tmp}/resume", 1), state, ListLoader(packs[:1]))
            trainer.load(path)
            resumed = _global_adapters(trainer.model.module, state)
            names = [n for n in trained if tp == 1 or ".local_experts." in n]
            checks.append(sorted(resumed) == sorted(trained) and len(names) >= 2 * 2 * 2 * NUM_EXPERTS
                          and all(torch.equal(resumed[n], trained[n]) for n in names))
        finally:
            destroy_parallel()
    rank = dist.get_rank() if dist.is_initialized() and dist.get_world_size() > 1 else 0
    if rank == 0:
        for kind in ("adapter", "merge"):
            rc = run_export([f"checkpoint={path}", f"output={tmp}/{kind}", f"export.{kind}=true",
                             f"model.pretrained={folder}"], out=lambda line: None)
            checks.append(rc == 0)
    out["checks"] = np.array(checks, dtype=np.int64)
    return out if rank == 0 else {}


def _trainer(folder: str, ep: int, packs: list, distributed_optimizer: bool):
    import dataclasses

    from _dist import ListLoader
    from megatron_pack.config.schema import DDPConfig, TrainConfig
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.loop import build_trainer

    cfg = dataclasses.replace(_config(folder, 1, ep), ddp=DDPConfig(use_distributed_optimizer=distributed_optimizer),
                              train=TrainConfig(seed=1234, lr=3e-3, global_batch_size=4, train_iters=3,
                                                lr_warmup_iters=0, clip_grad=0.05))
    return build_trainer(cfg, initialize_parallel(cfg), ListLoader(packs))


def _distributed_optimizer(folder: str, rank: int, root: str) -> dict:
    """Trainers at DP=2 x EP=2 (2 micro-batches per rank and step, each rank its own packs), with and without
    ``ddp.use_distributed_optimizer``, and resumes across it: A plain, 3 steps (checkpoint after step 1); B
    distributed, 2 steps from the start (checkpoint); C plain at EP=1 resumes B for step 3; D distributed resumes
    A's step-1 checkpoint for step 2. Returns (lm loss, grad norm, lb) per step and B's / A's weights after step 2."""
    from megatron_pack.parallel.groups import destroy_parallel
    from megatron_pack.training.chunks import core_model

    rng = np.random.default_rng(11 + rank)
    samples = [rng.integers(3, VOCAB, size=int(n)).tolist() + [2] for n in rng.integers(4, 14, size=12)]
    packs = [_pack(samples[i:i + 2]) for i in range(0, 12, 2)]

    def steps(trainer, num):
        return [[m.lm_loss, m.grad_norm, m.moe["load_balancing_loss"]] for m in (trainer.train_step() for _ in range(num))]

    def weights(trainer):
        return {n: p.detach().clone() for n, p in core_model(trainer.model).named_parameters()}

    a = _trainer(folder, 2, packs, False)
    run_a = steps(a, 1)
    a1 = a.save(f"{root}/a")
    run_a += steps(a, 1)
    a_weights = weights(a)
    run_a += steps(a, 1)
    destroy_parallel()
    b = _trainer(folder, 2, packs, True)
    run_b = steps(b, 2)
    num_trainable = sum(p.numel() for p in b.optimizer.names if p.requires_grad)  # a rank's moments: fewer
    sharded = b.optimizer.num_state_elements < 2 * num_trainable and \
        {type(part).__name__ for part in b.optimizer.parts} == {"DistributedOptimizer"}
    b_weights = weights(b)
    b2 = b.save(f"{root}/b")
    destroy_parallel()
    c = _trainer(folder, 1, packs, False)
    c.load(b2)
    run_c = steps(c, 1)
    destroy_parallel()
    d = _trainer(folder, 2, packs, True)
    d.load(a1)
    run_d = steps(d, 1)
    destroy_parallel()
    diff = max(float((b_weights[n] - w).abs().max()) for n, w in a_weights.items())
    return {f"distopt/{rank}/{k}": v for k, v in {"a": np.array(run_a), "b": np.array(run_b), "c": np.array(run_c),
                                                  "d": np.array(run_d), "weights_diff": diff, "sharded": sharded,
                                                  "num_experts_local": sum(".local_experts." in n for n in b_weights),
                                                  }.items()}


def _reference(folder: str) -> dict:
    """transformers in float64, each sample alone: logits, expert counts of sample 0, loss, aux losses, grads."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager")
    samples = _samples()
    with torch.no_grad():
        logits = [model(torch.tensor([s[:-1]])).logits[0].float() for s in samples]
        routers = model(torch.tensor([samples[0][:-1]]), output_router_logits=True).router_logits
    counts = [torch.bincount(r.topk(TOPK, dim=-1).indices.reshape(-1), minlength=NUM_EXPERTS) for r in routers]
    model.train()
    total_lm = total_lb = total_z = 0.0
    objective = 0.0
    num_targets = sum(sum(_mask(s)[1:]) for s in samples)
    num_real = sum(len(s) - 1 for s in samples)
    for ids in samples:
        out = model(torch.tensor([ids[:-1]]), output_router_logits=True)
        weight = torch.tensor(_mask(ids)[1:], dtype=torch.float64)
        ce = torch.nn.functional.cross_entropy(out.logits[0], torch.tensor(ids[1:]), reduction="none")
        lm = (ce * weight).sum()
        lb = z = 0.0
        for r in out.router_logits:  # the sample's own Switch loss and z-loss, per layer
            n = r.shape[0]
            probs = torch.softmax(r, dim=-1)
            chosen = torch.zeros_like(probs).scatter(1, r.topk(TOPK, dim=-1).indices, 1.0)
            lb = lb + NUM_EXPERTS / (TOPK * n * n) * (chosen.sum(0) * probs.sum(0)).sum()
            z = z + torch.logsumexp(r, dim=-1).square().mean()
        n = len(ids) - 1  # the sample's real tokens: the weight of its auxiliary losses
        objective = objective + lm / num_targets + (AUX * n * lb + ZLOSS * n * z) / num_real
        total_lm += float(lm) / num_targets
        total_lb += float(n * lb) / num_real / len(out.router_logits)
        total_z += float(n * z) / num_real / len(out.router_logits)
    objective.backward()
    grads = _checkpoint_names({n: p.grad.float() for n, p in model.named_parameters()}, "mixtral" in folder)
    return {"logits": logits, "counts": torch.stack(counts).numpy(), "lm": total_lm, "lb": total_lb, "z": total_z,
            "grads": grads}


def _checkpoint_names(grads: dict, mixtral: bool) -> dict:
    """transformers 5 keeps experts as 3D tensors in memory (gate_up_proj [E, 2F, H], down_proj [E, H, F]);
    name them as its checkpoints do (per expert; Mixtral: block_sparse_moe, w1 / w3 / w2)."""
    block, gate, up, down = ("block_sparse_moe", "w1", "w3", "w2") if mixtral else ("mlp", "gate_proj", "up_proj",
                                                                                   "down_proj")
    out = {}
    for name, grad in grads.items():
        name = name.replace(".mlp.", f".{block}.")
        if name.endswith("experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            for e, (g, u) in enumerate(t.chunk(2, dim=0) for t in grad):
                out[f"{stem}{e}.{gate}.weight"], out[f"{stem}{e}.{up}.weight"] = g, u
        elif name.endswith("experts.down_proj"):
            stem = name[: -len("down_proj")]
            out.update({f"{stem}{e}.{down}.weight": t for e, t in enumerate(grad)})
        else:
            out[name] = grad
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    folders, refs = {}, {}
    for family in FOLDERS:
        folders[family] = str(root / family)
        _hf_model(family).save_pretrained(folders[family], max_shard_size="40KB")
        refs[family] = _reference(folders[family])
    out = {}
    for world_size in WORLDS:
        for rank, ranks_out in enumerate(spawn_world(_worker, world_size, root / f"world{world_size}", folders,
                                                     {f: {"logits": r["logits"]} for f, r in refs.items()},
                                                     str(root), timeout_s=600)):
            out.update(ranks_out if rank == 0 else {k: v for k, v in ranks_out.items() if k.startswith("distopt/")})
            out.update({k: v for k, v in ranks_out.items() if k.startswith(f"rank{rank}/")})
    return {"out": out, "refs": refs, "folders": folders, "root": root}


CASES = [f"{family}/{layout}" for cases in WORLDS.values() for family, layout in cases]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(world, case):
    ep = LAYOUTS[case.split("/")[1]][1]
    assert world["out"][f"{case}/local_experts"].tolist() == [NUM_EXPERTS // ep] * 2  # EP=2: half the experts each
    assert float(world["out"][f"{case}/packed"]) <= 1e-4
    assert float(world["out"][f"{case}/alone"]) <= 1e-4


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", CASES)
def test_a_mostly_padding_pack_routes_exactly_its_real_tokens(world, case):
    load = world["out"][f"{case}/sparse_load"]
    want = world["refs"][case.split("/")[0]]["counts"]
    assert load.sum() == (LENGTHS[0]) * TOPK * 2  # 9 real tokens (of 64), top-2, 2 layers
    np.testing.assert_array_equal(load, want)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", CASES)
def test_loss_aux_losses_and_grads_equal_a_float64_reference_run_per_sample(world, case):
    out, ref = world["out"], world["refs"][case.split("/")[0]]
    cp, ep, tp, _ = LAYOUTS[case.split("/")[1]]
    if cp * tp == 1:  # DP=2: the two ranks' packs differ in length (EP=2: the dispatcher's unequal exchange)
        assert out[f"{case}/step_pack_lengths"].tolist() == [32, 8]
    norm = float(torch.sqrt(sum(g.double().square().sum() for g in ref["grads"].values())))
    for key, want in (("lm_loss", ref["lm"]), ("lb", ref["lb"]), ("z", ref["z"]), ("grad_norm", norm)):
        assert abs(float(out[f"{case}/{key}"]) - want) <= 1e-5 * abs(want), key
    names = [k for k in out if k.startswith(f"{case}/grad/")]
    assert len(names) == len(ref["grads"])  # every HF tensor's gradient compared
    for key in names:
        want = ref["grads"][key.split("/grad/")[1]]
        got = torch.from_numpy(out[key])
        assert float((got - want).abs().max()) <= 1e-5 * max(float(want.abs().max()), 1e-3), key


RUN = ["experiment=pretrained_tiny", "model.pretrained=models/tiny-moe", "data.synthetic_num_samples=12",
       "train.train_iters=3", "data.validation_fraction=0.25", "train.eval_interval=2",
       "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001", "logging.log_interval=1"]


@pytest.mark.timeout(900)
def test_train_and_export_a_moe_model_through_the_cli(tmp_path, monkeypatch, capsys):
    import json

    import transformers as T
    from safetensors.torch import load_file

    source = tmp_path / "models/tiny-moe"
    _hf_model("qwen3_moe", vocab=301).save_pretrained(source)
    save_tokenizer(source)
    prepare_in(tmp_path, RUN)
    from megatron_pack.cli.verify import main as verify_main

    monkeypatch.chdir(tmp_path)  # verify against transformers routes only real tokens, as training does
    rc = verify_main(RUN + ["verify.reference=transformers", "verify.num_packs=2"])
    text = capsys.readouterr().out
    routed = [line for line in text.splitlines() if line.startswith("pack ")]
    assert rc == 0 and len(routed) == 2 and all(" routed " in line and "PASS" in line for line in routed), text
    for line in routed:  # "pack 0: 3 samples, 70 real tokens ... routed 70/70 real tokens"
        real = line.split(" real tokens")[0].rsplit(" ", 1)[1]
        assert f"routed {real}/{real} real tokens" in line, line
    first = torchrun_train(tmp_path, RUN + ["parallel.expert_model_parallel_size=2", "train.exit_after_iters=2",
                                            "checkpoint.save_interval=2"])
    out = torchrun_train(tmp_path, RUN + ["parallel=pp2"])  # resumes the EP=2 checkpoint at EP=1, PP=2
    assert "resumed from" in out and "| lb " in first and "load max/mean" in out and "val loss" in first
    # one progress line per validation run, from rank 0 of the 2 (step 2 in the first run, step 3 at the end of
    # the second): validation no longer runs silently
    assert first.count("validation at step") == 1 and "validation at step 2: " in first, first
    assert out.count("validation at step") == 1 and "validation at step 3: " in out, out
    records = [json.loads(line) for line in (tmp_path / "runs/pretrained_tiny/metrics.jsonl").read_text().splitlines()]
    moe = [r["moe"] for r in records if "moe" in r]
    assert len(moe) == 3 and all(m["load_balancing_loss"] > 0 and m["z_loss"] > 0 for m in moe)
    # every real token routed top-2 in each layer, at PP=2 too (each stage brings its layer)
    for record, m in zip([r for r in records if "moe" in r], moe):
        assert [sum(layer) for layer in m["tokens_per_expert"]] == [record["real_tokens"] * TOPK] * 2
    rc, text = cli(tmp_path, "export", "checkpoint=runs/pretrained_tiny/checkpoints", "output=exports/moe")
    assert rc == 0, text
    from megatron_pack.config import load_config
    from megatron_pack.model.hf.export import export_folder

    export_folder(output=tmp_path / "exports/untrained", source=source,
                  model_cfg=load_config([f"model.pretrained={source}"]).model)
    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "exports/moe/model.safetensors")
    assert sorted(after) == sorted(before) and any("experts.3.down_proj" in k for k in after)
    untrained = load_file(tmp_path / "exports/untrained/model.safetensors")
    assert all(torch.equal(untrained[k], before[k]) for k in before)
    loaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "exports/moe")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(".experts." in k for k in changed) and any(".mlp.gate." in k for k in changed)
    assert loaded.config.model_type == "qwen3_moe"


def _peft_logits(folder, adapter, samples) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """peft's logits of each sample with the adapter folder loaded on the transformers model, without it, and
    peft's adapter tensors as loaded."""
    import transformers as T
    from peft import PeftModel, get_peft_model_state_dict

    model = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                      adapter).eval()
    with torch.no_grad():
        adapted = [model(torch.tensor([ids[:-1]])).logits[0] for ids in samples]
        with model.disable_adapter():
            base = [model(torch.tensor([ids[:-1]])).logits[0] for ids in samples]
    return adapted, base, get_peft_model_state_dict(model)


LORA_CASES = [("qwen3_moe", ["linear_qkv", "linear_proj"]), ("qwen3_moe", LORA_TARGETS), ("mixtral", LORA_TARGETS),
              ("qwen2_moe", LORA_TARGETS), ("qwen3_moe", ["linear_fc2"])]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,targets", LORA_CASES, ids=[f"{f}-{'-'.join(t)}" for f, t in LORA_CASES])
def test_random_adapters_export_in_peft_format(tmp_path, family, targets):
    from safetensors.torch import load_file

    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig, PeftConfig
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.peft.export import adapter_config, peft_tensors, shards_from_peft, write_adapter_folder
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    folder = tmp_path / family
    _hf_model(family).save_pretrained(folder)
    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=str(folder), attention_backend="torch",
                                                    seq_length=PACK_SIZE),
                                  peft=PeftConfig(method="lora", dim=LORA_DIM, alpha=LORA_ALPHA,
                                                  target_modules=targets)), [])
    try:
        pg = initialize_parallel(cfg)
        model = build_model(cfg, pg).eval()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # B starts at 0: random adapters so the check cannot pass on the base alone
            for name, p in model.named_parameters():
                if ".adapter." in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        shard = {n: p.detach().clone() for n, p in model.named_parameters() if ".adapter." in n}
        meta = {"dim": LORA_DIM, "alpha": LORA_ALPHA, "dropout": 0.0, "target_modules": targets}
        tensors = peft_tensors([shard], family, cfg.model, targets)
        write_adapter_folder(tmp_path / "adapter", tensors, adapter_config(meta, family, str(folder)),
                             dtype=torch.float32)
        ours = _sample_logits(model, pg, _pack(_samples()))
    finally:  # the world of one started in this process: later in-process tests expect none
        destroy_parallel(destroy_process_group=True)
    back = shards_from_peft(load_file(tmp_path / "adapter/adapter_model.safetensors"), family, cfg.model, targets,
                            tp_rank=0, tp_size=1)
    assert sorted(back) == sorted(shard) and all(torch.equal(back[n], shard[n]) for n in shard)  # the inverse
    experts = [n for n in shard if ".local_experts." in n]
    assert len(experts) == (2 * 2 * NUM_EXPERTS * sum(t in targets for t in ("linear_fc1", "linear_fc2")))
    adapted, base, loaded = _peft_logits(folder, tmp_path / "adapter", _samples())
    assert sorted(loaded) == sorted(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    for mine, theirs, plain in zip(ours, adapted, base, strict=True):
        assert float((mine - theirs).abs().max()) <= 1e-4
        assert float((mine - plain).abs().max()) > 1e-2  # the adapters matter


@pytest.fixture(scope="module")
def lora_world1(world) -> dict:
    """``_lora_train`` at world 1 in this process (the EP=2 run is in the spawned world)."""
    from megatron_pack.parallel.groups import destroy_parallel

    try:
        return _lora_train(world["folders"]["qwen3_moe"], str(world["root"] / "lora_world1"), 1)
    finally:
        destroy_parallel(destroy_process_group=True)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("run", ["lora_world1", *LORA_LAYOUTS])
def test_trained_expert_adapters_export_and_load_in_peft(world, lora_world1, run):
    from safetensors.torch import load_file

    out = lora_world1 if run == "lora_world1" else {k.split("/", 1)[1]: v for k, v in world["out"].items()
                                                    if k.startswith(f"{run}/")}
    assert out["checks"].tolist() == [1] * (5 if LORA_LAYOUTS.get(run, (1,))[0] == 1 else 6)
    folder, adapter = world["folders"]["qwen3_moe"], world["root"] / run / "adapter"
    config = __import__("json").loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    tensors = load_file(adapter / "adapter_model.safetensors")
    adapted, base, loaded = _peft_logits(folder, adapter, _samples())
    assert sorted(loaded) == sorted(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    ours = torch.from_numpy(out["logits"])
    assert float((ours - torch.cat(adapted)).abs().max()) <= 1e-4  # ours after the steps == peft's with the export
    assert float((ours - torch.cat(base)).abs().max()) > 1e-3  # training changed the logits (B no longer 0)
    assert float((torch.cat(base) - torch.cat(world["refs"]["qwen3_moe"]["logits"])).abs().max()) <= 1e-4
    import transformers as T

    merged = T.AutoModelForCausalLM.from_pretrained(world["root"] / run / "merge", dtype=torch.float32)
    with torch.no_grad():  # export.merge: the base with (alpha / r) B_e A_e added to each expert's weights
        merged_logits = torch.cat([merged(torch.tensor([ids[:-1]])).logits[0] for ids in _samples()])
    assert float((merged_logits - torch.cat(adapted)).abs().max()) <= 1e-4
    trainable, total, vocab = out["counts"].tolist()
    assert 0 < trainable < total and 0 < vocab < total
    if run != "lora_world1":  # every EP / TP rank's shards counted once: world 1's parameter counts (the
        single = lora_world1["counts"].tolist()  # embedding and output layer padded to a multiple of TP rows)
        assert trainable == single[0] and total - vocab == single[1] - single[2]
    if run != "lora_world1":  # the same step (the same global batch) at world 1: every adapter tensor equal
        single = load_file(world["root"] / "lora_world1/adapter/adapter_model.safetensors")
        assert sorted(single) == sorted(tensors)
        for key, tensor in tensors.items():
            assert float((tensor - single[key]).abs().max()) <= 1e-5 * max(float(single[key].abs().max()), 1e-3), key


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("rank", [0, 1])
def test_the_layouts_leave_their_models_and_groups_behind_them(world, rank):
    # megatron-core's all-to-all dispatcher keeps the last forward's probabilities, whose autograd graph reaches the
    # DDP hooks and so the model: a cycle the garbage collector cannot follow. Unbroken, every MoE layout's model
    # and 16 process groups stayed alive with 3 idle-waking threads each (about 780 threads a rank after this world,
    # and the pooled ranks run the session's later worlds); model.moe drops them at destroy_parallel
    before, after = out = world["out"][f"rank{rank}/threads"].tolist()
    assert after - before <= 100, out


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("rank", [0, 1])
def test_pipeline_stages_train_as_data_parallel_ranks_and_report_every_layer(world, rank):
    out = world["out"]
    lengths = out[f"rank{rank}/pipeline/pack_lengths"].tolist()
    assert len(set(lengths)) == len(lengths)  # guard: the micro-batches differ in length
    dp2, pp2 = out[f"rank{rank}/pipeline/dp2"], out[f"rank{rank}/pipeline/pp2"]
    assert dp2.shape == (2, 4) and not np.allclose(dp2[0], dp2[1])  # two steps that differ
    np.testing.assert_array_equal(out[f"rank{rank}/pipeline/pp2_recompute"], pp2)  # recomputed: the same forward
    np.testing.assert_allclose(pp2, dp2, rtol=1e-5, atol=0)
    loads = {run: out[f"rank{rank}/pipeline/{run}/load"] for run in ("pp2", "pp2_recompute", "dp2")}
    real = sum(PIPELINE_LENGTHS)  # a sample of n tokens and its EOS: n input tokens
    assert loads["dp2"].shape == (2, 2, NUM_EXPERTS) and loads["dp2"].sum(-1).tolist() == [[real * TOPK] * 2] * 2
    for run in ("pp2", "pp2_recompute"):  # both stages' layers, every real token routed top-2 in each
        np.testing.assert_array_equal(loads[run], loads["dp2"], err_msg=run)
    # the PP=2 checkpoint (each stage its layer's experts) resumes at PP=1 with the DP=2 run's weights
    assert float(out[f"rank{rank}/pipeline/resumed_weights_diff"]) <= 1e-5


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("rank", [0, 1])
def test_the_distributed_optimizer_with_experts_takes_the_plain_optimizers_steps(world, rank):
    """DP=2 x EP=2: the distributed optimizer (dense weights sharded over DP, each rank's experts over its
    expert-DP group) gives the plain optimizer's losses, gradient norms, load-balancing losses and weights
    (relative 1e-5), and checkpoints cross it both ways (C: distributed -> plain at EP=1; D: plain -> distributed)."""
    out = {k.split("/", 2)[2]: v for k, v in world["out"].items() if k.startswith(f"distopt/{rank}/")}
    a, b, c, d = out["a"], out["b"], out["c"], out["d"]
    assert a.shape == (3, 3) and np.all(a > 0) and bool(out["sharded"]) and int(out["num_experts_local"]) > 0
    assert not np.allclose(a[0], a[1], rtol=1e-3)  # the steps moved the model
    np.testing.assert_allclose(b, a[:2], rtol=1e-5, atol=0)
    np.testing.assert_allclose(d, a[1:2], rtol=1e-5, atol=0)
    np.testing.assert_allclose(c, a[2:], rtol=1e-5, atol=0)
    assert float(out["weights_diff"]) <= 1e-6
