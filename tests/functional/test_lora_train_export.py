"""LoRA end to end: train under torchrun, export in the peft format and merged, resume.

`experiment=pretrained_tiny peft=lora` (a tiny random Llama in models/tiny-llama, CP=2 on two CPU
ranks, adapter dropout 0.1 so the resumed RNG state matters), 3 steps, a checkpoint every step:

1. the checkpoint holds only adapters (and optimizer / data state) and records the base path;
   the start of the run reports trainable vs total parameters;
2. `megatron-pack export ... export.adapter=true` loads with `PeftModel.from_pretrained` onto the
   HF base, and peft's logits equal ours from the same checkpoint (<= 1e-4); the adapters trained
   (the logits moved away from the base's);
3. `export.merge=true` loads with transformers and its logits equal peft's applied adapter (<= 1e-4);
4. `verify` with the adapters active passes (packed == alone);
5. a run stopped after 2 steps (`train.exit_after_iters=2`) and resumed reproduces the uninterrupted
   run: the same step-3 loss and bit-identical adapters;
6. other layouts (``LAYOUT_RUNS``, one torchrun world, dropout 0): a step at TP=2 and one at PP=2 (2
   pipeline stages, adapters on both), each resumed at CP=2, continue the uninterrupted CP=2 run;
   the PP=2 checkpoint's peft export loads with ``PeftModel`` and gives our logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _hf import cli, make_family, packed_logits, prepare_in, torchrun_train_cases

LORA = ["experiment=pretrained_tiny", "data.synthetic_num_samples=24", "logging.log_interval=1", "peft=lora",
        "peft.dim=8", "peft.alpha=16", "peft.dropout=0.1", "checkpoint.save_interval=1", "checkpoint.keep_last=5"]
FULL_RUN, SPLIT_RUN = "runs/lora_full", "runs/lora_split"


LAYOUT_RUNS = {  # (run, extra arguments); dropout 0: other layouts differ only by the summation order
    "cp2": ["train.output_dir=runs/lora_cp2"],
    "tp2_step1": ["train.output_dir=runs/lora_tp2", "parallel.tensor_model_parallel_size=2",
                  "parallel.context_parallel_size=1", "train.exit_after_iters=1"],
    "tp2_resumed": ["train.output_dir=runs/lora_tp2"],  # at the preset's CP=2
    "pp2_step1": ["train.output_dir=runs/lora_pp2", "parallel.pipeline_model_parallel_size=2",
                  "parallel.context_parallel_size=1", "train.exit_after_iters=1"],
    "pp2_resumed": ["train.output_dir=runs/lora_pp2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The runs of items 1-5 and of ``LAYOUT_RUNS`` (item 6), in that order, in one torchrun world of 2
    processes (``torchrun_train_cases``: the train entry per run, the start-up paid once); each run's output."""
    root = tmp_path_factory.mktemp("lora_train")
    make_family(root / "models", "llama_rope", name="tiny-llama")
    prepare_in(root, LORA)
    cases = {"full": [*LORA, f"train.output_dir={FULL_RUN}"],
             "split1": [*LORA, f"train.output_dir={SPLIT_RUN}", "train.exit_after_iters=2"],
             "split2": [*LORA, f"train.output_dir={SPLIT_RUN}"]}
    cases.update({name: [*LORA, "peft.dropout=0", *extra] for name, extra in LAYOUT_RUNS.items()})
    return {"root": root, "logs": torchrun_train_cases(root, cases)}


def _cli(root: Path, *args: str) -> tuple[int, str]:
    return cli(root, *args)


def _step_dir(root: Path, run: str, step: int) -> Path:
    return root / run / "checkpoints" / f"step_{step:08d}"


def _samples() -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(9)
    return [rng.integers(3, 301, size=n).tolist() + [2] for n in (13, 29, 7)]


def _ours(root: Path, step_dir: Path, samples: list[list[int]]) -> list[torch.Tensor]:
    """Our packed logits from the checkpoint's adapters on the base (TP=1, peft=lora)."""
    return packed_logits(root, LORA, step_dir, samples)


def _hf_logits(model, samples) -> list[torch.Tensor]:
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([s[:-1]])).logits[0].float() for s in samples]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))




@pytest.fixture(scope="module")
def layout_runs(runs) -> str:
    """The output of the runs of ``LAYOUT_RUNS`` (trained with the others in ``runs``)."""
    log = "".join(runs["logs"][name] for name in LAYOUT_RUNS)
    assert log.count("resumed from") == 2, log[-5000:]  # tp2_resumed and pp2_resumed
    return log


@pytest.fixture(scope="module")
def exported(runs) -> dict:
    root, step = runs["root"], _step_dir(runs["root"], FULL_RUN, 3)
    code, text = _cli(root, "export", f"checkpoint={root / FULL_RUN / 'checkpoints'}", "output=exports/adapter",
                      "export.adapter=true")
    assert code == 0, text
    code, text = _cli(root, "export", f"checkpoint={step}", "output=exports/merged", "export.merge=true")
    assert code == 0, text
    return {"adapter": root / "exports/adapter", "merged": root / "exports/merged", "step": step}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_holds_adapters_and_base_path(runs):
    from megatron_pack.training.checkpoint import SHARDED_FORMAT, checkpoint_reader
    from megatron_pack.training.checkpoint_files import read_meta

    root, step = runs["root"], _step_dir(runs["root"], FULL_RUN, 3)
    meta = read_meta(step)
    assert meta["peft"]["base_model"] == str((root / "models/tiny-llama").resolve())
    assert (meta["peft"]["dim"], meta["peft"]["alpha"], meta["peft"]["dropout"]) == (8, 16.0, 0.1)
    assert meta["format"] == SHARDED_FORMAT  # the layout-free format (issue 13), adapters only
    stored = checkpoint_reader(step).read_metadata().state_dict_metadata
    optim_keys = [k for k in stored if k.startswith("optimizer.") and k != "optimizer.step"]
    model_keys = [k for k in stored if not k.startswith("optimizer.")]
    # A and B of 4 linears, each stacked over the 2 layers by global identity; nothing of the base
    assert len(model_keys) == 4 * 2 and all(stored[k].size[0] == 2 for k in model_keys)
    assert all(".adapter.linear_" in k for k in model_keys + optim_keys)
    assert sorted(optim_keys) == sorted(f"optimizer.{s}.{k}" for k in model_keys for s in ("exp_avg", "exp_avg_sq"))
    # adapters: 2 layers x r=8 x (64+128 + 64+64 + 64+192 + 96+64); base: 2 x 301 x 64 (untied) + 2 x 30,848 + 64
    assert "trainable parameters: 11,776 of 112,064 (10.508%) in 8 adapters" in runs["logs"]["full"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_adapter_export_loads_in_peft_and_matches_our_logits(runs, exported):
    import transformers as T
    from peft import PeftModel

    files = sorted(p.name for p in exported["adapter"].iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    config = json.loads((exported["adapter"] / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])
    base_dir = runs["root"] / "models/tiny-llama"
    samples = _samples()
    base_logits = _hf_logits(T.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), samples)
    peft_model = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                           exported["adapter"])
    theirs = _hf_logits(peft_model, samples)
    ours = _ours(runs["root"], exported["step"], samples)
    assert _max_diff(theirs, base_logits) > 1e-3  # guard: the adapters trained away from B = 0
    assert _max_diff(ours, theirs) <= 1e-4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_merged_export_equals_peft_applied_adapter(runs, exported):
    import transformers as T
    from peft import PeftModel

    base_dir = runs["root"] / "models/tiny-llama"
    samples = _samples()
    merged, info = T.AutoModelForCausalLM.from_pretrained(exported["merged"], dtype=torch.float32,
                                                          output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    peft_model = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                           exported["adapter"])
    assert _max_diff(_hf_logits(merged, samples), _hf_logits(peft_model, samples)) <= 1e-4
    base = T.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, base[k])}
    assert changed and all(k.endswith(("_proj.weight",)) for k in changed)  # only adapted linears moved


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_with_adapters_passes(runs):
    code, text = _cli(runs["root"], "verify", *LORA, "verify.num_packs=2",
                      f"verify.checkpoint={runs['root'] / FULL_RUN / 'checkpoints'}")
    assert code == 0, text
    assert "LoRA active" in text and "2/2 packs PASS" in text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_reproduces_uninterrupted_run(runs):
    import torch.distributed.checkpoint as dcp

    from megatron_pack.training.checkpoint import checkpoint_reader
    from megatron_pack.training.metrics import read_metrics

    root = runs["root"]
    assert "resumed from" in runs["logs"]["split2"] and "step 2" in runs["logs"]["split2"]

    def tensors(step_dir: Path) -> dict[str, torch.Tensor]:
        stored = checkpoint_reader(step_dir).read_metadata().state_dict_metadata
        state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in stored.items()
                 if hasattr(m, "size")}  # adapters and their AdamW state (layout-free keys)
        dcp.load(state, storage_reader=checkpoint_reader(step_dir), no_dist=True)
        return state

    full, split = tensors(_step_dir(root, FULL_RUN, 3)), tensors(_step_dir(root, SPLIT_RUN, 3))
    assert sorted(full) == sorted(split) and len(full) == 8 * 3 + 1
    assert all(torch.equal(full[k], split[k]) for k in full), [k for k in full if not torch.equal(full[k], split[k])]
    losses = {r["step"]: r["lm_loss"] for r in read_metrics(root / FULL_RUN / "metrics.jsonl")}
    resumed = {r["step"]: r["lm_loss"] for r in read_metrics(root / SPLIT_RUN / "metrics.jsonl")}
    assert sorted(resumed) == [1, 2, 3] and resumed == losses


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp2_lora_checkpoint_is_layout_free(runs, layout_runs):
    """A LoRA checkpoint written at TP=2 (adapters split like their base, fc1's B as [gate; up]) holds
    the TP=1 adapters, and resumes at CP=2 (TP=1) continuing the run an uninterrupted CP=2 run makes
    (dropout 0: the same losses and adapters up to the summation order)."""
    from megatron_pack.training.checkpoint import read_full_model
    from megatron_pack.training.metrics import read_metrics

    root = runs["root"]  # LAYOUT_RUNS: cp2, then tp2 for one step, resumed at the preset's CP=2
    for step in (1, 3):
        want, got = (read_full_model(_step_dir(root, run, step)) for run in ("runs/lora_cp2", "runs/lora_tp2"))
        assert sorted(want) == sorted(got) and len(want) == 2 * 4 * 2
        assert any("linear_fc1.adapter.linear_out" in k for k in got)
        assert all(torch.allclose(want[k], got[k], atol=1e-5) for k in want), step
    want = {r["step"]: r["lm_loss"] for r in read_metrics(root / "runs/lora_cp2" / "metrics.jsonl")}
    got = {r["step"]: r["lm_loss"] for r in read_metrics(root / "runs/lora_tp2" / "metrics.jsonl")}
    assert sorted(got) == [1, 2, 3] and all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp2_lora_trains_like_cp2_resumes_and_exports_for_peft(runs, layout_runs):
    """LoRA with 2 pipeline stages: step 1 at PP=2 (adapters on both stages, drawn as at PP=1), its
    checkpoint resumed at the preset's CP=2 for steps 2-3: the losses and adapters of an uninterrupted
    CP=2 run (dropout 0, relative 1e-5); the PP=2 checkpoint's peft export, gathered from both stages,
    loads with ``PeftModel`` and gives our logits (<= 1e-4)."""
    import transformers as T
    from peft import PeftModel

    from megatron_pack.training.checkpoint import read_full_model
    from megatron_pack.training.checkpoint_files import read_meta
    from megatron_pack.training.metrics import read_metrics

    root = runs["root"]  # LAYOUT_RUNS: cp2, then pp2 for one step, resumed at the preset's CP=2
    first = _step_dir(root, "runs/lora_pp2", 1)
    meta = read_meta(first)  # 2 ranks of TP=1, CP=1, DP=1: written by 2 pipeline stages
    assert [meta[k] for k in ("world_size", "tensor_model_parallel_size", "context_parallel_size",
                              "data_parallel_size")] == [2, 1, 1, 1]
    for step in (1, 3):
        want, got = (read_full_model(_step_dir(root, run, step)) for run in ("runs/lora_cp2", "runs/lora_pp2"))
        assert sorted(want) == sorted(got) and len(want) == 2 * 4 * 2  # A and B of 4 linears x 2 layers
        assert all(torch.allclose(want[k], got[k], rtol=1e-5, atol=1e-6) for k in want), step
    want = {r["step"]: r["lm_loss"] for r in read_metrics(root / "runs/lora_cp2" / "metrics.jsonl")}
    got = {r["step"]: r["lm_loss"] for r in read_metrics(root / "runs/lora_pp2" / "metrics.jsonl")}
    assert sorted(got) == [1, 2, 3] and all(abs(got[s] - want[s]) <= 1e-5 * want[s] for s in got), (got, want)

    code, text = _cli(root, "export", f"checkpoint={first}", "output=exports/adapter_pp2", "export.adapter=true")
    assert code == 0, text
    base_dir, samples = root / "models/tiny-llama", _samples()
    base_logits = _hf_logits(T.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), samples)
    theirs = _hf_logits(PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                                  root / "exports/adapter_pp2"), samples)
    assert _max_diff(theirs, base_logits) > 1e-5  # guard: one step moved the adapters away from B = 0
    assert _max_diff(_ours(root, first, samples), theirs) <= 1e-4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_run_ends_naming_the_adapter_export(runs):
    """A finished peft=lora run names the adapter export and the merged one (issue 43, item 9); the adapter one, run
    as printed, writes the peft folder. A run stopped early (``split1``) names the resume instead."""
    from test_hf_train_export import next_step_commands

    root, ckpt = runs["root"], f"checkpoint={FULL_RUN}/checkpoints"
    commands = next_step_commands(runs["logs"]["full"])
    assert commands == [["megatron-pack", "export", ckpt, "output=exports/lora_full-adapter", "export.adapter=true"],
                        ["megatron-pack", "export", ckpt, "output=exports/lora_full-merged", "export.merge=true"]]
    assert next_step_commands(runs["logs"]["split1"]) == []
    code, text = cli(root, *commands[0][1:])
    assert code == 0 and (root / "exports/lora_full-adapter/adapter_config.json").is_file(), text
