"""LoRA on packed THD batches across TP / CP / SP, proved against peft.

One spawned world of 4 gloo ranks trains the same adapters (random A and B, so every gradient
is non-zero, written in the peft format and read into each layout by ``load_adapter``) on a tiny
random Llama (GQA, llama3 rope scaling, vocabulary 301 padded at TP=2) at tp1_cp1 (DP=4),
tp1_cp2, tp2_cp1 (DP=2) and tp2_cp2_sp (DP=1), four packs per step:

1. step 1's loss and every adapter gradient (exported to peft names with the export mapping)
   equal across the four layouts, relative <= 1e-5;
2. both equal peft's on transformers (each sample alone, token-weighted mean loss), the
   reference that shares no code with ours: a fused lora_A's gradient is the sum of its parts';
3. after 3 optimizer steps every base parameter is bit-for-bit what was loaded, no base parameter
   has a gradient buffer, and the AdamW state holds exactly one exp_avg / exp_avg_sq element per
   adapter parameter on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import ListLoader, spawn_world
from _hf import VOCAB, make_family

WORLD_SIZE, GLOBAL_BATCH, NUM_STEPS, DIM, ALPHA, PAD_MULTIPLE = 4, 4, 3, 4, 8.0, 4
LAYOUTS = [("tp1_cp1", 1, 1, False), ("tp1_cp2", 1, 2, False), ("tp2_cp1", 2, 1, False), ("tp2_cp2_sp", 2, 2, True)]
LAYOUT_IDS = [c[0] for c in LAYOUTS]
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _packs() -> list[dict]:
    """GLOBAL_BATCH THD packs of 1-3 samples (lengths 6-30), prompts masked, eos = 2."""
    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(3)
    packs = []
    for _ in range(GLOBAL_BATCH):
        samples = []
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(6, 31))
            samples.append({"input_ids": rng.integers(3, VOCAB, size=n - 1).tolist() + [2],
                            "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)})
        packs.append(collate_thd(samples, pack_size=96, pad_multiple=PAD_MULTIPLE))
    return packs


def _samples_of(pack: dict) -> list[tuple[list[int], list[int], list[float]]]:
    """(tokens, labels, loss_mask) of each real sample of a THD pack."""
    cu = pack["cu_seqlens"].tolist()
    cu_pad = pack["cu_seqlens_padded"].tolist()
    out = []
    for i in range(len(cu) - 1):
        n, start = cu[i + 1] - cu[i], cu_pad[i]
        if n:
            out.append((pack["tokens"][0, start:start + n].tolist(), pack["labels"][0, start:start + n].tolist(),
                        pack["loss_mask"][0, start:start + n].tolist()))
    return out


def _write_random_adapter(folder: str, out: str) -> None:
    """A peft adapter folder with random A and B (shared lora_A for q/k/v and gate/up, as ours)."""
    from megatron_pack.config.hf_config import read_hf_config
    from megatron_pack.model.peft.export import adapter_config, adapter_targets, write_adapter_folder

    hf = read_hf_config(folder)
    gen = torch.Generator().manual_seed(11)
    tensors = {}
    for _, _, names in adapter_targets(hf["model_type"], TARGETS, num_layers=hf["num_hidden_layers"]):
        shapes = {name: _WEIGHT_SHAPES[name.rsplit(".", 1)[-1]] for name in names}
        a = 0.2 * torch.randn(DIM, shapes[names[0]][1], generator=gen)
        for name in names:
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = 0.2 * torch.randn(shapes[name][0], DIM, generator=gen)
    meta = {"dim": DIM, "alpha": ALPHA, "dropout": 0.0, "target_modules": TARGETS}
    write_adapter_folder(out, tensors, adapter_config(meta, hf["model_type"], folder), dtype=torch.float32)


_WEIGHT_SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
                  "gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96)}
"""[out, in] of the tiny families' linears (hidden 64, 4 heads of 16 in 2 groups, FFN 96)."""


def _reference(folder: str, adapter: str, packs: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """peft on transformers: token-weighted mean loss over every sample alone, and its lora gradients."""
    import transformers as T
    from peft import PeftModel

    model = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), adapter,
                                      is_trainable=True)
    model.train()
    total, count = torch.zeros((), dtype=torch.float64), 0.0
    for pack in packs:
        for tokens, labels, mask in _samples_of(pack):
            logits = model(torch.tensor([tokens])).logits[0].double()
            losses = torch.nn.functional.cross_entropy(logits, torch.tensor(labels), reduction="none")
            total = total + (losses * torch.tensor(mask, dtype=torch.float64)).sum()
            count += sum(mask)
    loss = total / count
    loss.backward()
    grads = {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return float(loss), grads


def _config(folder: str, tmp: str, tp: int, cp: int, sp: bool):
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import (CheckpointConfig, Config, LoggingConfig, ModelConfig, ParallelConfig,
                                             PeftConfig, TrainConfig)

    cfg = Config(model=ModelConfig(pretrained=folder, attention_backend="torch", seq_length=96),
                 parallel=ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp),
                 train=TrainConfig(global_batch_size=GLOBAL_BATCH, train_iters=NUM_STEPS, lr=1e-3, min_lr=1e-4,
                                   lr_warmup_iters=1, output_dir=tmp, adam_eps=1e-4),
                 checkpoint=CheckpointConfig(enabled=False), logging=LoggingConfig(tensorboard=False),
                 peft=PeftConfig(method="lora", dim=DIM, alpha=ALPHA, target_modules=TARGETS))
    return apply_pretrained(cfg, [])


def _peft_grads(trainer, model_type: str) -> dict[str, torch.Tensor]:
    """Every adapter's main_grad, all TP ranks', in peft names (the export mapping)."""
    import torch.distributed as dist

    from megatron_pack.model.peft.export import peft_tensors
    from megatron_pack.model.peft.lora import adapter_state

    mine = {n: p.main_grad.detach().clone() for n, p in adapter_state(trainer.model.module).items()}
    shards = [None] * trainer.state.tp_size
    dist.all_gather_object(shards, mine, group=trainer.state.tp_group)
    return peft_tensors(shards, model_type, trainer.cfg.model, TARGETS)


def _run(folder: str, adapter: str, tmp: str, tp: int, cp: int, sp: bool, packs: list[dict]) -> dict:
    import torch.distributed as dist

    from megatron_pack.config.hf_config import read_hf_config
    from megatron_pack.model.peft.export import load_adapter
    from megatron_pack.model.peft.lora import adapter_state, is_adapter_param
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    cfg = _config(folder, tmp, tp, cp, sp)
    state = initialize_parallel(cfg)
    try:
        per = GLOBAL_BATCH // state.dp_size
        mine = [packs[state.dp_rank * per + i] for i in range(per)] * NUM_STEPS
        trainer = build_trainer(cfg, state, ListLoader(mine))
        model = trainer.model.module
        model_type = read_hf_config(folder)["model_type"]
        load_adapter(model, adapter, model_type, cfg.model, TARGETS, tp_rank=state.tp_rank, tp_size=state.tp_size)
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_param(n)}
        counts, _ = trainer.compute_gradients()
        grads = _peft_grads(trainer, model_type)
        trainer.optimizer.step(trainer.schedule.next_lr())
        trainer.step += 1
        for _ in range(NUM_STEPS - 1):
            trainer.train_step()
        params = dict(model.named_parameters())
        adapters = adapter_state(model)
        num_adapter = sum(p.numel() for p in adapters.values())
        moments = [v for s in trainer.optimizer.states for k, v in s.items() if k == "exp_avg"]
        checks = torch.tensor([
            all(torch.equal(params[n], t) for n, t in base.items()),  # base bit for bit
            all(getattr(params[n], "main_grad", None) is None and not params[n].requires_grad for n in base),
            sum(m.numel() for m in moments) == num_adapter and len(moments) == len(adapters),
            all(p.main_grad is not None for p in adapters.values()),
            len(base) > 10 and num_adapter > 0,  # guard: the checks above saw real parameters
        ], dtype=torch.int64)
        dist.all_reduce(checks, op=dist.ReduceOp.MIN)
        out = {"loss": counts.lm_loss(), "checks": checks, "num_base": len(base),
               "losses": np.array([counts.lm_loss()] + [m.lm_loss for m in trainer.history])}
        out.update({f"grad/{k}": v for k, v in grads.items()})
        return out if state.rank == 0 else {}
    finally:
        destroy_parallel()


def _worker(rank: int, world_size: int, folder: str, adapter: str, tmp: str, packs: list[dict]) -> dict:
    out = {}
    for layout, tp, cp, sp in LAYOUTS:
        result = _run(folder, adapter, f"{tmp}/{layout}", tp, cp, sp, packs)
        out.update({f"{layout}/{k}": v for k, v in result.items()})
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[dict, float, dict]:
    root = tmp_path_factory.mktemp("lora_parallel")
    folder = str(make_family(root, "llama_rope"))
    adapter = str(root / "adapter")
    _write_random_adapter(folder, adapter)
    packs = _packs()
    ref_loss, ref_grads = _reference(folder, adapter, packs)
    out = spawn_world(_worker, WORLD_SIZE, root, folder, adapter, str(root), packs)[0]
    return out, ref_loss, ref_grads


def _grads(out: dict, layout: str) -> dict[str, np.ndarray]:
    return {k.split("/", 2)[2]: v for k, v in out.items() if k.startswith(f"{layout}/grad/")}


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUT_IDS[1:])
def test_loss_and_adapter_grads_equal_across_layouts(world, layout):
    out, _, _ = world
    base, mine = _grads(out, "tp1_cp1"), _grads(out, layout)
    assert len(base) == 2 * 7 * 2 and sorted(mine) == sorted(base)  # 7 HF linears x 2 layers, A and B each
    assert all(np.abs(g).max() > 0 for g in base.values())  # guard: no vacuous zero gradient
    assert _rel(out[f"{layout}/loss"], out["tp1_cp1/loss"]) <= 1e-5
    for name in base:
        assert _rel(mine[name], base[name]) <= 1e-5, name


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_loss_and_adapter_grads_equal_peft(world, layout):
    out, ref_loss, ref = world
    mine = _grads(out, layout)
    assert _rel(out[f"{layout}/loss"], ref_loss) <= 1e-5
    assert len(mine) == len(ref) == 28
    for name, grad in mine.items():
        assert _rel(grad, _peft_grad(ref, name)) <= 1e-4, name


_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _peft_grad(ref: dict, name: str) -> np.ndarray:
    """peft's gradient for one of our exported tensors: a fused linear has one lora_A for its parts
    (q/k/v, gate/up), so its gradient is the sum of peft's per-part lora_A gradients."""
    module = name.split(".lora_")[0].rsplit(".", 1)[-1]
    group = next((g for g in _FUSED if module in g), (module,))
    if ".lora_B." in name:
        group = (module,)
    return sum(ref[name.replace(f".{module}.", f".{p}.")].numpy() for p in group)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_base_frozen_and_optimizer_state_is_adapters_only(world, layout):
    out, _, _ = world
    names = ["base unchanged bit for bit", "no base grad buffer", "optimizer state == adapter params",
             "adapters have grad buffers", "guard"]
    checks = out[f"{layout}/checks"].tolist()
    assert checks == [1] * 5, [n for n, c in zip(names, checks) if not c]
    losses = out[f"{layout}/losses"]
    assert len(losses) == NUM_STEPS and losses[-1] < losses[0]  # the adapters did train
