"""Refusals a user meets on the command line (issue 34): made before launch, one line each, every problem
at once, and every suggested fix accepted when applied.

Every case runs the real command line (``megatron-pack ...`` through ``tests/_user_path.run_cli``) as a user
types it; none trains (``train --check`` and ``prepare`` only), so the file stays cheap.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _user_path import ok, refused, run_cli  # noqa: E402

CPU_HOST = {"CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
"""A CPU host wherever the test runs (the host probe sees no GPU), and a run of one rank."""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder holding ``ds``: the synthetic set prepared at the defaults (pack 512, CP 1)."""
    root = tmp_path_factory.mktemp("refusals")
    ok(root, "prepare", "data.dataset_dir=ds", "data.synthetic_num_samples=64")
    return root


def _check(work: Path, *overrides: str, world_size: int = 1) -> tuple[int, str]:
    env = {**CPU_HOST, "WORLD_SIZE": str(world_size)}
    return run_cli(work, "train", "--check", "data.dataset_dir=ds", *overrides, env=env)


def _refused_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("megatron-pack train:")]


HOST_REFUSALS = [  # (id, overrides, the key refused): settings this CPU host cannot run, refused by train --check
    ("fp8-delayed", ["model.fp8=delayed"], "model.fp8 (delayed) needs CUDA"),
    ("fp8-cpu-explicit", ["model.fp8=current", "train.device=cpu"], "model.fp8 (current) needs CUDA"),
    ("nccl", ["parallel.backend=nccl"], "parallel.backend (nccl) needs CUDA"),
    ("te-attention", ["model.attention_backend=te"], "model.attention_backend (te) needs CUDA"),
]


def test_a_gpu_config_is_checked_for_its_gpu_host_but_refused_for_a_run_here(work):
    """`train --check train.device=cuda` on a laptop checks the config for the GPU host it names (so a cluster's
    recipe can be checked anywhere) and says so; the launch scripts' check (MEGATRON_PACK_CHECK_HOST=here) and
    `train` itself refuse it here."""
    status, text = _check(work, "train.device=cuda")
    assert status == 0 and "checked for the GPU host train.device=cuda names" in text, text
    status, text = run_cli(work, "train", "--check", "data.dataset_dir=ds", "train.device=cuda",
                           env={**CPU_HOST, "MEGATRON_PACK_CHECK_HOST": "here"})
    assert status == 2 and "train.device (cuda) needs a GPU" in text, text


@pytest.mark.parametrize("overrides,expected", [c[1:] for c in HOST_REFUSALS], ids=[c[0] for c in HOST_REFUSALS])
def test_what_this_host_cannot_run_is_refused_by_train_check(work, overrides, expected):
    """Before: `train --check model.fp8=delayed` said "config ok" here (after a re-prepare it suggested), and every
    rank then failed inside torchrun. Now the check refuses it (exit 2, one line), and says nothing of re-preparing."""
    status, text = _check(work, *overrides)
    assert status == 2, text
    assert "Traceback" not in text and expected in text, text
    assert "prepare" not in text.split("(prepare accepts", 1)[0], text  # no re-prepare for a run that cannot start
    assert len(_refused_lines(text)) == 1, text


def test_every_problem_is_listed_when_one_value_has_the_wrong_type(work):
    """Before: `train.lr=abc model.num_layers=-1` reported only train.lr; the other overrides are still checked."""
    status, text = _check(work, "train.lr=abc", "model.num_layers=-1", "train.train_iters=x")
    assert status == 2, text
    for fragment in ("train.lr=abc: Value 'abc'", "train.train_iters=x: Value 'x'", "model.num_layers (-1) must be"):
        assert fragment in text, text
    assert "3 config problem(s)" in text, text


# (id, what the user types, the key we answer, a fragment of how the meaning differs or None: the same)
FOREIGN = [
    ("model_name_or_path", "model_name_or_path=/models/llama", "model.pretrained", "local Hugging Face folder"),
    ("learning_rate", "learning_rate=1e-4", "train.lr", None),
    ("dotted-learning_rate", "train.learning_rate=1e-4", "train.lr", None),
    ("num_train_epochs", "num_train_epochs=2", "train.num_epochs", "whole number of passes"),
    ("per_device_train_batch_size", "per_device_train_batch_size=4", "train.micro_batch_size", "stays 1"),
    ("gradient_accumulation_steps", "gradient_accumulation_steps=8", "train.global_batch_size",
     "set train.global_batch_size=<data-parallel size * gradient_accumulation_steps>"),
    ("max_seq_length", "max_seq_length=2048", "packing.packed_sequence_size", "tokens of a pack"),
    ("eval_steps", "eval_steps=50", "train.eval_interval", None),
    ("save_steps", "save_steps=500", "checkpoint.save_interval", None),
    ("warmup_ratio", "warmup_ratio=0.03", "train.lr_warmup_iters", "<warmup_ratio * train.train_iters>"),
    ("lr_scheduler_type", "lr_scheduler_type=cosine", "train.lr_decay_style", "cosine, linear or constant"),
    ("max_grad_norm", "max_grad_norm=1.0", "train.clip_grad", None),
    ("gradient_checkpointing", "gradient_checkpointing=true", "model.recompute_granularity", "full"),
    ("lora_r", "lora_r=16", "peft.dim", None),
]


@pytest.mark.parametrize("typed,key,differs", [c[1:] for c in FOREIGN], ids=[c[0] for c in FOREIGN])
def test_a_name_from_another_trainer_is_answered_with_ours(work, typed, key, differs):
    """Before: model_name_or_path= suggested model.name, eval_steps train.eval_iters; save_steps,
    gradient_accumulation_steps and warmup_ratio got nothing."""
    text = refused(work, "train", "--check", "data.dataset_dir=ds", typed)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"- {typed}:"))
    assert f"did you mean '{key}'?" in line, line
    if differs is None:
        assert line.rstrip().endswith(f"did you mean '{key}'?"), line
    else:
        assert differs in line, line


MEGATRON_FLAGS = [  # (id, argv, the override we answer)
    ("tensor-model-parallel-size", ["--tensor-model-parallel-size", "2"], "parallel.tensor_model_parallel_size=2"),
    ("context-parallel-size", ["--context-parallel-size=2"], "parallel.context_parallel_size=2"),
    ("micro-batch-size", ["--micro-batch-size", "1"], "train.micro_batch_size=1"),
    ("lr", ["--lr", "3e-4"], "train.lr=3e-4"),
    ("seq-length", ["--seq-length", "4096"], "model.seq_length=4096"),
    ("sequence-parallel", ["--sequence-parallel"], "parallel.sequence_parallel=true"),
]


@pytest.mark.parametrize("argv,override", [c[1:] for c in MEGATRON_FLAGS], ids=[c[0] for c in MEGATRON_FLAGS])
def test_a_megatron_lm_flag_is_answered_with_its_override(work, argv, override):
    text = refused(work, "train", "--check", "data.dataset_dir=ds", *argv)
    assert f"is a Megatron-LM flag; write {override} instead" in text, text
    assert len(text.strip().splitlines()) == 1, text


def test_every_answer_names_a_real_key_and_the_docs_show_the_table():
    from megatron_pack.config.foreign_names import FOREIGN_NAMES, markdown_table
    from megatron_pack.config.loader import _all_keys

    keys = set(_all_keys())
    assert len(FOREIGN_NAMES) >= 40 and not [f.key for f in FOREIGN_NAMES if f.key not in keys]
    assert len({f.name for f in FOREIGN_NAMES}) == len(FOREIGN_NAMES)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert markdown_table() in doc, "docs/configuration.md's 'Names from other tools' table differs from the code's"


@pytest.fixture(scope="module")
def folders(work) -> Path:
    """``work`` plus a 2-layer Hugging Face folder ``model``, ``ds_model`` prepared for it, chat records with
    long answers, and ``ds256``: the synthetic set planned at pack 256 for CP 1 (and its copy ``ds256_cp2``, which the CP
    refusal's suggested prepare adds a plan to)."""
    from _hf import make_family
    from _user_path import chat, write_jsonl

    make_family(work, "llama_tied", name="model")
    write_jsonl(work / "chat.jsonl", [chat(i, 4) for i in range(24)])
    write_jsonl(work / "long.jsonl", [chat(i, 40) for i in range(24)])
    ok(work, "prepare", "model=pretrained", "model.pretrained=model", "input=chat.jsonl", "output=ds_model")
    ok(work, "prepare", "data.dataset_dir=ds256", "data.synthetic_num_samples=64", "packing.packed_sequence_size=256")
    import shutil

    shutil.copytree(work / "ds256", work / "ds256_cp2")  # the CP refusal's pasted prepare adds its plan here
    return work


def _apply(argv: list[str], fix: list[str], refused_key: str) -> list[str]:
    """``argv`` with each ``key=value`` of ``fix`` replacing the same key (or added); a key refused as unknown
    (``refused_key``) is replaced by the one suggested."""
    keys = {f.split("=", 1)[0] for f in fix} | {refused_key}
    return [a for a in argv if a.split("=", 1)[0] not in keys] + fix


# (id, world size, the command refused, the key refused, how its message writes the fix (None: as the overrides),
# the fix: overrides applied to the command; "prepare": the `megatron-pack prepare ...` it names, run as written;
# "overflow": the pack size and model.seq_length it names)
SUGGESTED = [
    ("pp2-vp2-on-a-2-layer-folder", 4, ["train", "--check", "data.dataset_dir=ds_model", "model=pretrained",
                                        "model.pretrained=model", "parallel=pp2_vp2"],
     "model.num_layers (2)", None, ["parallel.virtual_pipeline_model_parallel_size=null"]),
    ("overflow-with-the-readme-seq-length", 1, ["prepare", "input=long.jsonl", "output=ds_long",
                                                "packing.packed_sequence_size=64", "model.seq_length=64"],
     "sample(s) are longer than the pack allows", None, "overflow"),
    ("cp2-on-a-plan-made-at-256", 2, ["train", "--check", "data.dataset_dir=ds256_cp2", "parallel=cp2"],
     "needs a multiple of 4", "packing.packed_sequence_size=256 parallel.context_parallel_size=2", "prepare"),
    ("fp8-on-a-cpu-host", 1, ["train", "--check", "data.dataset_dir=ds", "model.fp8=delayed"],
     "model.fp8 (delayed)", None, ["model.fp8=none"]),
    ("seq-length-beside-the-pack-size", 1, ["prepare", "data.dataset_dir=ds_seq", "data.synthetic_num_samples=32",
                                            "packing.packed_sequence_size=256", "model.seq_length=512"],
     "model.seq_length (512)", None, ["model.seq_length=256"]),
    ("batch-over-3-ranks", 3, ["train", "--check", "data.dataset_dir=ds"], "train.global_batch_size (8)", None,
     ["train.global_batch_size=9"]),
    ("eval-without-validation", 1, ["train", "--check", "data.dataset_dir=ds", "train.eval_interval=5"],
     "train.eval_interval (5)", None, ["train.eval_interval=0"]),
    ("sequence-parallel-without-tp", 1, ["train", "--check", "data.dataset_dir=ds", "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel (True)", None, ["parallel.sequence_parallel=false"]),
    ("micro-batch-with-packs", 1, ["train", "--check", "data.dataset_dir=ds", "train.micro_batch_size=2"],
     "train.micro_batch_size (2)", None, ["train.micro_batch_size=1"]),
    ("pad-multiple-below-cp", 1, ["prepare", "data.dataset_dir=ds_pad", "data.synthetic_num_samples=32",
                                  "parallel=cp2", "packing.pad_seq_to_mult=2"],
     "packing.pad_seq_to_mult (2)", None, ["packing.pad_seq_to_mult=4"]),
    ("pp-over-an-odd-layer-count", 2, ["train", "--check", "data.dataset_dir=ds", "model.num_layers=3",
                                       "parallel.pipeline_model_parallel_size=2"],
     "model.num_layers (3)", "set parallel.pipeline_model_parallel_size to one of [3]", None),
    ("model_name_or_path", 1, ["train", "--check", "data.dataset_dir=ds_model", "model=pretrained",
                               "model_name_or_path=model"], "model_name_or_path", "did you mean 'model.pretrained'?",
     ["model.pretrained=model"]),
]
"""The pp-over-an-odd-layer-count fix needs 3 ranks (PP 3): its message is checked, and PP 3 below at world 3."""


def _suggested_prepare(message: str) -> list[str]:
    import re
    import shlex

    found = re.search(r"`megatron-pack (prepare [^`]+)`", message)
    assert found, f"no prepare command in: {message}"
    return shlex.split(found.group(1))


def _overflow_fix(message: str) -> list[str]:
    import re

    found = re.search(r"set (packing\.packed_sequence_size=\d+) (model\.seq_length=\d+)", message)
    assert found, f"no pack size fix in: {message}"
    return [found.group(1), found.group(2)]


@pytest.mark.parametrize("world,argv,refused_key,shown,fix", [c[1:] for c in SUGGESTED], ids=[c[0] for c in SUGGESTED])
def test_every_suggested_fix_is_accepted(folders, world, argv, refused_key, shown, fix):
    """A refusal's fix, applied as the message writes it, is accepted: never the same key refused back (before:
    pp2_vp2 on a 2-layer folder suggested model.num_layers=4, which config.json contradicts; the overflow fix
    gave a pack size beside the README's model.seq_length=512; a CP refusal re-prepared at pack 512, not 256)."""
    env = {**CPU_HOST, "WORLD_SIZE": str(world)}
    status, text = run_cli(folders, *argv, env=env)
    assert status == 2 and refused_key in text and "Traceback" not in text, text
    if shown is not None:
        assert shown in text, f"the message does not suggest {shown}:\n{text}"
    if fix is None:  # a fix needing another world size
        fix, env = ["parallel.pipeline_model_parallel_size=3"], {**env, "WORLD_SIZE": "3"}
    if fix == "prepare":
        ok(folders, *_suggested_prepare(text), env={**CPU_HOST})
        fixed = argv
    else:
        fix = _overflow_fix(text) if fix == "overflow" else fix
        assert shown is not None or all(f in text for f in fix), f"the message does not suggest {fix}:\n{text}"
        fixed = _apply(argv, fix, refused_key)
    status, after = run_cli(folders, *fixed, env=env)
    assert status == 0, f"the suggested fix {fix} was refused:\n{after}"


def test_prepare_of_a_pretrained_folder_needs_no_pack_size(folders):
    """Before: `prepare model=pretrained model.pretrained=DIR input=chat.jsonl` failed on model.seq_length 4096 (the
    preset's) vs the default pack 512; model.seq_length follows the pack size unless the command line sets it."""
    plans = sorted(p.name for p in (folders / "ds_model" / "plans").iterdir() if p.is_dir())
    assert plans and all(p.startswith("pack512_") for p in plans), plans
    out = ok(folders, "train", "--check", "data.dataset_dir=ds_model", "model=pretrained", "model.pretrained=model",
             env=CPU_HOST)
    assert "config ok" in out
    status, text = run_cli(folders, "prepare", "model=pretrained", "model.pretrained=model", "input=chat.jsonl",
                           "output=ds_model_1k", "model.seq_length=1024", "packing.packed_sequence_size=512")
    assert status == 2 and "model.seq_length (1024) must equal packing.packed_sequence_size (512)" in text, text


def test_the_seq_length_rule_names_the_packing_mode_it_runs_under(folders):
    """Before: "with offline packing" under packing.mode=online."""
    status, text = run_cli(folders, "train", "--check", "data.dataset_dir=ds256", "packing.mode=online",
                           "packing.packed_sequence_size=256", "model.seq_length=512", env=CPU_HOST)
    assert status == 2 and "with packing.mode=online (a pack is one sequence); set model.seq_length=256" in text, text


def test_train_check_speaks_plainly_on_this_host(folders):
    """Before: "0.00419e9 parameters", "fused GPU kernels" on a CPU host, no word on a warmup longer than the run,
    and "OnlineSource" for online packs."""
    out = ok(folders, "train", "--check", "data.dataset_dir=ds256", "train.train_iters=3", "train.lr_warmup_iters=5",
             env=CPU_HOST)
    assert "K parameters on this rank; activations of unfused CPU kernels" in out and "e9 parameters" not in out, out
    assert "warning: train.lr_warmup_iters (5) >= train.train_iters (3)" in out, out
    online = ok(folders, "train", "--check", "data.dataset_dir=ds256", "packing.mode=online", env=CPU_HOST)
    assert "online packs of 256 tokens from the token store ds256" in online and "OnlineSource" not in online, online


def test_train_help_names_the_keys_people_run_with():
    from megatron_pack.cli.args import help_text

    text = help_text("train", [])
    for key in ("model.pretrained", "peft.method", "parallel.pipeline_model_parallel_size",
                "parallel.expert_model_parallel_size", "packing.mode"):
        assert f"  {key}=" in text, key


def test_a_typo_in_an_experiment_file_names_the_file(work):
    (work / "my_run.yaml").write_text("train:\n  lrr: 1e-4\n")
    text = refused(work, "train", "--check", "data.dataset_dir=ds", "experiment=my_run.yaml")
    assert "In my_run.yaml (experiment=my_run.yaml)" in text and "did you mean 'train.lr'?" in text, text


def test_the_mixture_heading_says_mixture():
    from megatron_pack.cli.inspect import _details_title

    from pathlib import Path

    mixed = {"mixture": {"per_source": [{"name": "chat"}]}}
    plans = [Path("plans/a"), Path("plans/b")]
    assert _details_title(plans[:1], [mixed]) == "source mixture:"
    assert _details_title(plans, [mixed, {"on_overflow": "split"}]) == "split samples, source mixture:"


def test_a_quiet_run_shows_each_library_warning_at_most_once(folders):
    """Before: 14 of 44 lines of a 20-step run were library warnings (TE / Apex fallbacks from several modules,
    each with its source line, and the RerunStateMachine notices). A fresh `megatron-pack train` process."""
    import os
    import subprocess

    env = {**{k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")},
           "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": ""}  # one process, no torchrun: a world of one
    out = subprocess.run([sys.executable, "-m", "megatron_pack.cli.main", "train", "data.dataset_dir=ds256",
                          "train.train_iters=2", "train.lr_warmup_iters=1", "logging.tensorboard=false",
                          "checkpoint.enabled=false", "train.output_dir=runs/quiet"], cwd=folders, env=env,
                         capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    warned = [ln for ln in log.splitlines() if "Warning: " in ln]
    assert warned and all(warned.count(ln) == 1 for ln in warned), warned  # the fallback notice at least
    assert sum("not installed" in ln for ln in warned) == 1, warned
    assert "warnings.warn(" not in log and "Rerun" not in log, log
    assert len(warned) <= 3, warned


def test_the_documented_tiny_folder_prepares_and_checks_as_written(tmp_path):
    """Before: docs/models.md's tiny folder + `prepare experiment=pretrained_tiny` failed on a 259-token sample (the
    tests built that folder's tokenizer from another corpus, so they never saw it)."""
    from _hf import docs_tiny_llama

    assert (docs_tiny_llama(tmp_path) / "tokenizer.json").is_file()
    out = ok(tmp_path, "prepare", "experiment=pretrained_tiny")
    assert "truncated" in out
    checked = ok(tmp_path, "train", "--check", "experiment=pretrained_tiny", "peft=lora",
                 env={**CPU_HOST, "WORLD_SIZE": "2"})
    assert "config ok for 2 rank(s)" in checked


def test_the_launch_script_refuses_fp8_on_this_host_before_torchrun(work):
    """launch/single_node.sh runs `train --check` as a run of its world size: the host rules refuse there, once,
    exit 2, and torchrun never starts (before: every rank failed inside torchrun)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = {**{k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")},
           "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(root / "launch" / "single_node.sh"), "2", "data.dataset_dir=ds",
                           "model.fp8=delayed"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("model.fp8 (delayed) needs CUDA") == 1 and "[rank" not in proc.stdout + proc.stderr
