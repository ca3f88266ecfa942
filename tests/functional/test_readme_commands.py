"""The README's commands, as written, from a wheel installed in another folder (issue 11, "Done when").

The commands are read from README.md's "## Commands" block, so the README cannot drift from what
works. Stand-ins, each named: ``train.jsonl`` and ``/path/to/hf_tokenizer`` are a small JSONL file
and a tiny local tokenizer written here; the optional ``[export=bridge]`` is run; the 8-rank GPU
line (Llama 3 8B) is skipped; training runs 2 steps instead of 50 (``train.train_iters=2``), which
is the only override added, and the README's consecutive training runs share one torchrun world (the wheel's
train entry run after run, ``tests/functional/_train_cases.py``; the launch scripts are run by
tests/functional/test_launch.py and the documents' commands by test_docs_commands.py). Every command of README.md and docs/*.md, from a fresh copy of the
repository, is run by tests/functional/test_docs_commands.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _session_checks import changes, snapshot  # noqa: E402
from _user_path import copy_tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PY = Path(sys.executable)
CHEAP_TRAIN = ["train.train_iters=2", "checkpoint.save_interval=0"]
TRAINING_RUNS = ("quickstart", "online", "balanced", "in_batch")
"""The README's training runs on CPU, in its order: each names its own train.output_dir, so none resumes another."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def readme_commands() -> list[list[str]]:
    """Each command line of README.md's '## Commands' bash block, continuation lines joined, then the training
    variants the section's prose gives in backticks (in-batch packing): in the README's order, one folder."""
    section = (ROOT / "README.md").read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    block, prose = section.split("```bash", 1)[1].split("```", 1)
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return commands + [shlex.split(c) for c in re.findall(r"`(bash launch/single_node\.sh [^`]+)`", prose)]


def _stand_ins(argv: list[str], work: Path, tokenizer: Path) -> list[str] | None:
    """The command with the README's placeholders filled, or None for the GPU-only line."""
    if any("llama3_8b" in a for a in argv):
        return None
    out = []
    for arg in argv:
        if arg.startswith("[") and arg.endswith("]"):
            arg = arg[1:-1]  # an optional argument: run it
        out.append(arg.replace("/path/to/hf_tokenizer", str(tokenizer)))
    if out[:2] == ["bash", "launch/single_node.sh"] or "megatron_pack.train" in out:
        out += CHEAP_TRAIN
    return out


def _tiny_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["what is two plus two", "four", "hello world"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>").save_pretrained(path)
    return path


def _run_all(work: Path, env: dict, tokenizer: Path, console: list[str], launch) -> str:
    """Run the README's commands in ``work``; ``megatron-pack`` is ``console``; consecutive ``bash
    launch/single_node.sh ARGS`` lines become one ``launch([ARGS, ...])`` (one torchrun world for the runs)."""
    (work / "train.jsonl").write_text("".join(
        json.dumps({"prompt": f"what is {i} plus {i}", "completion": f"{2 * i}"}) + "\n" for i in range(200)))
    log = []
    commands = [_stand_ins(c, work, tokenizer) for c in readme_commands()]
    assert sum(c is not None for c in commands) >= 5, commands  # the block was found and read
    runs: list[list[str]] = []

    def run(argv: list[str]) -> None:
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        log.append(f"$ {shlex.join(argv)}\n{done.stdout}{done.stderr}")
        assert done.returncode == 0, "\n".join(log)[-8000:]

    for argv in filter(None, commands):
        if argv[:2] == ["bash", "launch/single_node.sh"]:
            runs.append(argv[2:])
            continue
        if runs:
            run(launch(runs, work))
            runs = []
        run(console + argv[1:] if argv[0] == "megatron-pack" else argv)
    if runs:
        run(launch(runs, work))
    return "\n".join(log)


def _check_outputs(work: Path, log: str) -> None:
    assert (work / "data" / "synthetic" / "metadata.json").is_file() and (work / "data" / "mine" / "plans").is_dir()
    assert "verify: 4/4 packs PASS" in log and "packing.pad_seq_to_mult=4 (was null)" in log
    assert list((work / "data" / "mine" / "plans").glob("*/training_4096.idx.parquet"))  # export=bridge ran
    for run in TRAINING_RUNS:  # the quickstart and each documented variant after it: its own run, 2 fresh steps
        metrics = [json.loads(line) for line in (work / "runs" / run / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2] and all(m["lm_loss"] > 0 for m in metrics), run


def _test_command_after(work: Path) -> None:
    """The README's test command (``bash scripts/test.sh``: pytest over tests/unit and tests/functional) after its
    commands, from the folder holding their ``runs/`` and ``data/``: the session works in a scratch folder
    (tests/conftest.py), shown by the test that checks it, and leaves ``runs/`` and ``data/`` as they were."""
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "pytest" in (ROOT / "scripts" / "test.sh").read_text()
    before = snapshot(work)
    assert any(path.startswith("runs/quickstart/") for path in before) and any(p.startswith("data/") for p in before)
    probe = f"{ROOT / 'tests/unit/test_session_checks.py'}::test_the_session_runs_in_a_scratch_working_folder"
    done = subprocess.run([str(PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", probe], cwd=work,
                          env=_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith(". "), done.stdout + done.stderr  # one test, passed
    assert changes(before, snapshot(work)) == []


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", **extra}


def test_readme_commands_from_a_wheel_in_another_folder(tmp_path):
    """A non-editable install: the presets (configs/ of the repository) must come from inside the package."""
    build = copy_tree(tmp_path / "src", ROOT)
    subprocess.run([str(PY), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(build)], check=True, capture_output=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("megatron_pack-*.whl"))
    with zipfile.ZipFile(wheel) as built:  # every preset of configs/ is package data of the wheel
        shipped = {n.split("megatron_pack/config/presets/", 1)[1] for n in built.namelist()
                   if n.startswith("megatron_pack/config/presets/")}
    assert shipped == {str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").glob("**/*.yaml")}
    assert len(shipped) >= 15 and "config.yaml" in shipped
    venv = tmp_path / "venv"
    base = subprocess.run([str(PY), "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True,
                          check=True).stdout.strip()
    subprocess.run([f"{base}/bin/python3", "-m", "venv", str(venv)], check=True, timeout=300)
    # env without PYTHONPATH: a repository on it (with its egg-info) would make pip think the wheel is installed
    subprocess.run([str(venv / "bin" / "pip"), "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=300, env=_env())
    site = next(venv.glob("lib/python3*/site-packages"))
    shared = subprocess.run([str(PY), "-c", "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    # torch, megatron-core, hydra from the shared environment; a plain path entry, so its editable
    # install of megatron_pack (a .pth finder there) is not activated
    (site / "zz_shared_deps.pth").write_text(shared + "\n")
    vpy, work = venv / "bin" / "python", tmp_path / "elsewhere"
    work.mkdir()
    proc = subprocess.run([str(vpy), "-c", "import megatron_pack; print(megatron_pack.__file__)"], cwd=work,
                          env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    where = proc.stdout
    assert where.startswith(str(site)), where  # the wheel's copy, not the repository's
    assert (site / "megatron_pack/config/presets/experiment/quickstart.yaml").is_file()
    tokenizer = _tiny_tokenizer(tmp_path / "hf_tokenizer")

    def launch(runs, where):  # a wheel user has no launch/: torchrun of the train entry (docs/launch.md), the
        # consecutive runs in one world (tests/functional/_train_cases.py: the wheel's train entry, run after run)
        assert {args[0] for args in runs} == {"2"}, runs
        listing = where / f"runs_{len(list(where.glob('runs_*.json')))}.json"
        listing.write_text(json.dumps([[f"run{i}", ["parallel.backend=gloo", *args[1:]]] for i, args in enumerate(runs)]))
        return [str(vpy), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(ROOT / "tests" / "functional" / "_train_cases.py"), str(listing)]

    log = _run_all(work, _env(), tokenizer, [str(venv / "bin" / "megatron-pack")], launch)
    _check_outputs(work, log)
    _test_command_after(work)
