"""Every data feature composes on the command line (issue 21 item 2), run as a user types the commands.

The matrix: {plain BFD, length buckets, split with overlap, wrapped (document), mixing of 3 sources}
x {no validation, ``data.validation_fraction``, ``data.validation=FILE``} x {the tokenizer's chat
template, ``data.chat_template=FILE``}: 30 cases on a tiny random Llama folder (its own tiny BPE tokenizer
and template) and chat files, CP=2.

* Cheap steps, every case: ``prepare`` (several plans share a dataset folder: one folder per template
  and input kind), then ``inspect``, ``verify``, ``train --check`` (world size 2) and ``export`` (a round
  trip of the model folder) with only ``data.dataset_dir`` and ``data.plan`` (the folders hold several
  plans), the model, and the layout. Run through the console script's function in this process
  (tests/_user_path.py), which shares the imports; a refused command fails the test.
* Training, pairwise: 15 cases cover every pair of factors (the template alternates with strategy +
  validation), each trained 2 steps with CP=2 (5 of them, pairing with every factor, with 2 pipeline
  stages, ``parallel=pp2``) on 2 real processes, validated at the end when it has a validation set,
  all on the session's torchrun world of 2 ranks (``tests/_train_world.py``: each case is ``megatron-pack
  train``'s entry, process groups made and destroyed per case). Each checkpoint is then exported and loaded with
  transformers; its tokenizer carries the template the data was rendered with. One more case in the
  same world trains with virtual pipeline stages (``parallel=pp2_vp2``, a 4-layer copy of the model:
  two stages of two chunks), validated, exported and loaded the same way. Three more in the same world, each
  on its own path: a tiny Qwen3-MoE folder at DP=2 x EP=2 (``parallel=cp1
  parallel.expert_model_parallel_size=2``) on packs of different lengths (the two ranks' packs of a step
  differ, which the MoE token dispatcher exchanges); online packing (``packing.mode=online``) from a dataset
  prepared with ``data.validation_fraction``, which trains on the other samples and validates on the held-out
  ones at the end; and the same store online with ``data.validation_fraction=0`` (no plan read, no validation).
  Six of the 15 pairwise cases train in bf16 (``train.bf16=true``: every factor and both layouts among them), and
  the MoE case steps megatron-core's distributed optimizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf import CHAT_TEMPLATE, make_family, torchrun_train_cases  # noqa: E402
from _user_path import CUSTOM_TEMPLATE, chat, ok, write_jsonl  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SOURCES = ("data.sources=[{name: chat, input: a.jsonl, weight: 0.5}, {name: pc, input: b.jsonl, weight: 0.3}, "
           "{name: share, input: c.jsonl, weight: 0.2, format: sharegpt}]")
STRATEGIES = {
    "bfd": ["data.input=train.jsonl", "packing.on_overflow=drop"],
    "buckets": ["data.input=train.jsonl", "packing.on_overflow=drop", "packing.buckets=[48,96]"],
    "split": ["data.input=train.jsonl", "packing.on_overflow=split", "packing.split_overlap=8"],
    "wrapped": ["data.input=train.jsonl", "packing.algorithm=wrapped", "packing.on_overflow=split"],
    "mixing": [SOURCES, "packing.on_overflow=truncate"],
}
VALIDATIONS = {"none": [], "fraction": ["data.validation_fraction=0.2"], "file": ["data.validation=valid.jsonl"]}
TEMPLATES = {"own": [], "file": ["data.chat_template=custom.jinja"]}
CASES = [(s, v, t) for s in STRATEGIES for v in VALIDATIONS for t in TEMPLATES]
TRAINED = [(s, v, list(TEMPLATES)[(i + j) % 2]) for i, s in enumerate(STRATEGIES) for j, v in enumerate(VALIDATIONS)]
"""15 cases holding every pair of factors: (strategy, validation) all 15, and the template alternating makes
every (strategy, template) and (validation, template) pair appear."""
PIPELINED = {(s, v, t) for i, (s, v, t) in enumerate(TRAINED) if i // len(VALIDATIONS) % len(VALIDATIONS) ==
             i % len(VALIDATIONS)}
"""The 5 trained cases (one per strategy, each validation and template among them) trained at ``parallel=pp2``
(2 pipeline stages) instead of ``parallel=cp2``: the layout pairs with every other factor."""
BF16 = {c for k, c in enumerate(TRAINED) if k % 5 in (0, 2)}
"""The 6 trained cases that train with ``train.bf16=true`` (bf16 weights, megatron-core's optimizer with fp32 main
params, as every GPU recipe): every strategy, validation, template and layout among them."""
RUN = ["model.pretrained=model", "parallel=cp2"]
VIRTUAL = ("bfd", "fraction", "own")
"""The prepared case the virtual-stage run trains on (with a validation set)."""
VIRTUAL_RUN = ["model.pretrained=model4", "parallel=pp2_vp2", "train.global_batch_size=4"]
"""4 micro-batches: with 2 megatron-core's interleaved schedule runs all in its warm-up (refused by validate())."""
MOE_RUN = ["model.pretrained=moe", "parallel=cp1", "parallel.expert_model_parallel_size=2", "data.dataset_dir=ds_moe",
           "ddp.use_distributed_optimizer=true"]
"""DP=2 x EP=2 over the two DP ranks: each rank holds 2 of the 4 experts and trains its own packs; megatron-core's
distributed optimizer shards the dense state over DP."""
ONLINE = ("bfd", "fraction", "own")
"""The prepared case (a validation_fraction plan) the online runs read the store of."""
TRAIN = ["train.train_iters=2", "train.global_batch_size=2", "train.lr_warmup_iters=1", "logging.tensorboard=false",
         "train.device=cpu", "model.attention_backend=torch"]


def _id(case) -> str:
    return "-".join(case)


def _dataset(case) -> str:
    strategy, _, template = case
    return f"ds_{template}_{'mix' if strategy == 'mixing' else 'single'}"


def _write_data(root: Path) -> None:
    long_chats = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}"},
                                {"role": "assistant", "content": "the answer is four " * (12 + i % 9)}]}
                  for i in range(6)]  # longer than a 128-token pack: split, truncated or dropped
    write_jsonl(root / "train.jsonl", [chat(i, 12, system=i % 4 == 0) for i in range(44)] + long_chats)
    write_jsonl(root / "a.jsonl", [chat(i, 10) for i in range(30)])
    write_jsonl(root / "b.jsonl", [{"prompt": f"hello world {i}", "completion": "four " * (1 + i % 7)}
                                   for i in range(30)])
    write_jsonl(root / "c.jsonl", [{"conversations": [
        {"from": "human", "value": "what is two plus two"}, {"from": "gpt", "value": "five", "weight": 0},
        {"from": "human", "value": f"and {i}?"}, {"from": "gpt", "value": "four " * (1 + i % 5)}]} for i in range(30)])
    write_jsonl(root / "valid.jsonl", [chat(i, 6) for i in range(12)])
    (root / "custom.jinja").write_text(CUSTOM_TEMPLATE)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The model, the files and every case prepared: ``(root, {case: plan name})``."""
    root = tmp_path_factory.mktemp("user_path")
    make_family(root, "llama_tied", name="model")
    make_family(root, "llama_tied", name="model4", num_layers=4)  # PP=2 x VP=2: one layer per chunk
    _write_data(root)
    plans = {}
    for case in CASES:
        strategy, validation, template = case
        source = ["data.source=files"] if strategy == "mixing" else ["data=files"]
        out = ok(root, "prepare", *RUN, *source, *STRATEGIES[strategy], *VALIDATIONS[validation], *TEMPLATES[template],
                 f"data.dataset_dir={_dataset(case)}", "packing.packed_sequence_size=128", "data.tokenize_workers=1")
        plans[case] = Path(next(ln for ln in out.splitlines() if ln.startswith("plan:")).split()[1]).name
    assert len(set(plans.values())) == len(CASES)  # 30 plans, several in each folder
    make_family(root, "qwen3_moe", name="moe")
    ok(root, "prepare", *MOE_RUN, "data=files", "data.input=train.jsonl", "packing.on_overflow=drop",
       "packing.packed_sequence_size=128", "data.tokenize_workers=1")
    return root, plans


def _expected_template(template: str) -> str:
    return CUSTOM_TEMPLATE if template == "file" else CHAT_TEMPLATE


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_every_case_inspects_verifies_checks_and_exports_with_only_its_folder(world, case):
    from transformers import AutoTokenizer

    root, plans = world
    strategy, validation, template = case
    ds, plan = _dataset(case), plans[case]
    where = [f"data.dataset_dir={ds}", f"data.plan={plan}"]
    shown = ok(root, "inspect", *where)
    assert plan in shown and "settings (manifest):" in shown and "kept " in shown
    manifest = json.loads((root / ds / "plans" / plan / "metadata.json").read_text())["manifest"]
    assert (manifest["data.chat_template"] or {}).get("text") == (CUSTOM_TEMPLATE if template == "file" else None)
    assert "1/1 packs PASS" in ok(root, "verify", *where, *RUN[:1], "verify.num_packs=1")
    check = ok(root, "train", "--check", *where, *RUN, env={"WORLD_SIZE": "2", "RANK": "0"})
    assert "config ok for 2 rank(s)" in check and plan in check
    assert ("validation" in check) == (validation != "none")
    if validation == "file":
        assert "valid.jsonl" in check
    out = root / "exports" / f"roundtrip-{_id(case)}"
    ok(root, "export", *where, *RUN[:1], f"output={out}")
    assert AutoTokenizer.from_pretrained(out).chat_template == _expected_template(template)


def _layout(case) -> list[str]:
    precision = ["train.bf16=true"] if case in BF16 else []
    return ([RUN[0], "parallel=pp2"] if case in PIPELINED else RUN) + precision


def test_pipelined_cases_pair_with_every_factor():
    assert len(PIPELINED) == len(STRATEGIES)
    for k, factor in enumerate((STRATEGIES, VALIDATIONS, TEMPLATES)):
        for value in factor:  # every value trained at both layouts
            assert {c in PIPELINED for c in TRAINED if c[k] == value} == {True, False}, value


def test_bf16_cases_pair_with_every_factor():
    assert len(BF16) == 6
    for k, factor in enumerate((STRATEGIES, VALIDATIONS, TEMPLATES)):
        assert {c[k] for c in BF16} == set(factor)
    assert {c in PIPELINED for c in BF16} == {True, False}  # at both layouts


def test_pairwise_training_then_export(world):
    """15 cases trained (CP=2, or PP=2 for ``PIPELINED``; 2 processes, 2 steps, validation when present),
    each exported from its checkpoint and loaded with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, plans = world
    cases = [[_id(c), [f"data.dataset_dir={_dataset(c)}", f"data.plan={plans[c]}", *_layout(c), *TRAIN,
                       f"train.output_dir=runs/{_id(c)}"]] for c in TRAINED]
    cases.append(["virtual-stages", [f"data.dataset_dir={_dataset(VIRTUAL)}", f"data.plan={plans[VIRTUAL]}",
                                     *TRAIN, *VIRTUAL_RUN, "train.output_dir=runs/virtual-stages"]])
    cases.append(["moe-ep2", [*MOE_RUN, *TRAIN, "train.output_dir=runs/moe-ep2"]])
    online = [f"data.dataset_dir={_dataset(ONLINE)}", *RUN, "packing.mode=online", "packing.buffer_size=16", *TRAIN]
    cases.append(["online-held-out", [*online, f"data.plan={plans[ONLINE]}", "train.output_dir=runs/online-held-out"]])
    cases.append(["online-no-validation", [*online, "data.validation_fraction=0",
                                           "train.output_dir=runs/online-no-validation"]])
    outputs = torchrun_train_cases(root, dict(cases))
    log = "".join(outputs.values())
    for case in TRAINED:
        strategy, validation, template = case
        run = root / "runs" / _id(case)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2] and all(r["lm_loss"] > 0 for r in records), _id(case)
        assert (records[-1].get("val_loss") is not None) == (validation != "none"), _id(case)
        if strategy == "mixing":
            assert set(records[-1]["source_loss"]) == {"chat", "pc", "share"}
            assert ("val_source_loss" in records[-1]) == (validation == "fraction")  # one file has no sources
        written = (run / "config.yaml").read_text()
        if case in PIPELINED:
            assert "pipeline_model_parallel_size: 2" in written and "context_parallel_size: 1" in written
        else:
            assert "context_parallel_size: 2" in written
        assert ("bf16: true" in written) == (case in BF16), _id(case)
        out = root / "exports" / f"trained-{_id(case)}"
        ok(root, "export", f"checkpoint=runs/{_id(case)}/checkpoints", f"output={out}")
        tokenizer = AutoTokenizer.from_pretrained(out)
        assert tokenizer.chat_template == _expected_template(template), _id(case)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=True)
        logits = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(
            torch.tensor([ids["input_ids"]])).logits
        assert torch.isfinite(logits).all()
    _check_virtual_stages(root)
    _check_moe(root)
    _check_online(root)
    _check_console(log, len(cases))


def _check_moe(root: Path) -> None:
    """DP=2 x EP=2: two steps with the auxiliary losses and every real token routed, on packs of several lengths."""
    from megatron_pack.data.batches.dataset import PackedSFTDataset

    records = [json.loads(line) for line in (root / "runs/moe-ep2/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["lm_loss"] > 0 for r in records)
    for record in records:  # top-2 in each of the 2 layers
        assert [sum(layer) for layer in record["moe"]["tokens_per_expert"]] == [record["real_tokens"] * 2] * 2
    assert "expert_model_parallel_size: 2" in (root / "runs/moe-ep2/config.yaml").read_text()
    dataset = PackedSFTDataset(root / "ds_moe")
    lengths = [sum(len(s["input_ids"]) for s in dataset[i]) for i in range(len(dataset))]
    assert len(set(lengths)) > len(lengths) // 2, lengths  # most packs differ: the steps' two ranks' packs do


def _check_online(root: Path) -> None:
    """Online packing on a store prepared with a validation fraction: validated on the held-out plan at the end;
    with data.validation_fraction=0 no validation."""
    for run, validated in (("online-held-out", True), ("online-no-validation", False)):
        records = [json.loads(line) for line in (root / "runs" / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2] and all(r["lm_loss"] > 0 for r in records), run
        assert (records[-1].get("val_loss") is not None) == validated, run


def _check_virtual_stages(root: Path) -> None:
    """The PP=2 x VP=2 run: 2 steps, the validation loss at the end, the layout recorded, and an export
    transformers loads (4 layers)."""
    import torch
    from transformers import AutoModelForCausalLM

    run = root / "runs" / "virtual-stages"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["lm_loss"] > 0 for r in records)
    assert records[-1]["val_loss"] is not None
    config = (run / "config.yaml").read_text()
    assert "virtual_pipeline_model_parallel_size: 2" in config and "pipeline_model_parallel_size: 2" in config
    out = root / "exports" / "trained-virtual-stages"
    ok(root, "export", "checkpoint=runs/virtual-stages/checkpoints", f"output={out}")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.num_hidden_layers == 4
    assert torch.isfinite(model(torch.tensor([[5, 9, 2, 7]])).logits).all()


def _check_console(log: str, num_runs: int) -> None:
    """One summary line per run, no config dump, each warning once and only from rank 0: the runs share their two
    processes with every command the session's world ran before them (``tests/_train_world.py``), so a warning
    repeated per run or per rank shows up as a count above 1 in all that output."""
    from _train_world import world_output

    assert log.count("\nrun runs/") + log.startswith("run runs/") == num_runs
    assert "resolved config:\n" not in log and "\nmodel:\n" not in log
    everything = world_output()
    assert log in everything
    warned = [ln for ln in everything.splitlines() if "Warning: " in ln]
    assert warned and all(warned.count(ln) == 1 for ln in warned), warned  # the TE/Apex notices at least
    assert sum("Transformer Engine / Apex are not installed" in ln for ln in warned) == 1  # the family, once
    assert "warnings.warn(" not in everything and "Rerun State Machine" not in everything
    assert "RerunStateMachine" not in everything and "[rank 1]" not in log
    steps = [ln for ln in log.splitlines() if " | loss " in ln]
    assert len(steps) == 2 * num_runs and max(len(ln.split(" INFO ", 1)[-1]) for ln in steps) <= 160
