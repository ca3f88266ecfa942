"""Every shell command in README.md and docs/*.md runs (issue 21 item 3), at tiny sizes, from a fresh copy
of the repository, in the order the documents give them (README first).

The commands are read from the documents' ``bash`` / ``console`` code blocks, so the documents cannot
drift from what works; an untagged block that holds a command fails the test (tag it), and so does a
command that no row of ``RULES`` covers, or a row that covers nothing. Two tables say, reviewed, what the
test changes and why:

* ``STAND_INS``: text replaced in a command before it runs (a tiny tokenizer, model or file for the
  documents' placeholders, a smaller pack for a 1B model's recipe, two steps instead of fifty).
* ``RULES``: how each command runs (the first row whose pattern matches it):
  ``run`` as written (``megatron-pack`` through the console script's function, in this process);
  ``train``: a training run whose checkpoint a later command reads, run for real on the session's torchrun
  world of 2 processes (tests/_train_world.py: the train entry torchrun starts, in the work folder), then the
  commands that read them (``after``), before the next command of another kind; ``check``: a launch (torchrun, the
  launch scripts, sbatch) checked as a run of its world size would be (``megatron-pack train --check``,
  what the launch scripts run before torchrun; the launch scripts themselves run for real in
  tests/functional/test_launch.py and test_slurm.py); ``cfg``: a GPU-sized recipe printed with
  ``--cfg job``; ``covered``: run by the test named (checked to exist and to run it); ``synopsis``: a
  usage line with placeholders, not a command; ``bench``: a benchmark, run for real with the interpreter
  running the tests (``.venv/bin/python`` of the documents) at the stand-in size; ``flags``: a benchmark that
  needs packages CI never installs, its command line checked against the script's ``--help``; ``network``: a
  script that downloads from PyPI (CI must not depend on downloads), checked to parse (``bash -n``);
  ``history``: a command that needs the repository's git history, which the fresh copy has none of. A
  command a document repeats from another (the same text) runs once.

A command in an indented (four-space) code block fails the test too: fence it, so it is run.

``console`` blocks show a command (``$ ...``) and its output: the output lines must appear in what it prints.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _user_path import copy_tree, run_cli, write_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")
LOOKS_LIKE_A_COMMAND = re.compile(r"^\s*(\$ |megatron-pack (?!\w+: )|bash (launch|scripts|tests)/|torchrun |sbatch |"
                                  r"(python3?|\.venv/bin/python) (-m |bench/))")
"""A line of a command; ``megatron-pack train: stopped by ...`` (a command's own message, shown as output) is not."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STAND_INS = [  # (text in a document, what runs instead, why)
    ("/path/to/hf_tokenizer", "tok", "a local Hugging Face tokenizer: the tiny BPE one (tests/_hf.py) with a chat template"),
    ("/models/llama3-tokenizer", "tok", "the same tiny tokenizer"),
    ("/models/llama3", "tok", "the same tiny tokenizer"),
    ("/models/tok", "tok", "the same tiny tokenizer"),
    ("/models/Llama-3.2-1B-Instruct", "tiny-model", "a tiny random Llama folder with that tokenizer (tests/_hf.py)"),
    ("/data/train.jsonl", "train.jsonl", "a small JSONL file written here"),
    ("/team/configs", "team_configs", "a preset folder written here ($HOME is home/ in the work folder: the copy's "
                                      "own configs/ are the shipped presets)"),
    ("packing.packed_sequence_size=4096 model.seq_length=4096 parallel=cp2",
     "packing.packed_sequence_size=256 model.seq_length=256 parallel=cp2", "a 1B model's pack, for the tiny Llama"),
    ("[export=bridge]", "export=bridge", "the optional argument, run"),
    ("--repeats 4 --compare /tmp/before", "--repeats 1 --workdir startup_work",
     "one round of the start-up benchmark, without a past commit's tree to compare (the bench-baseline-tree row), "
     "its files in the work folder"),
    ("--gigabytes 1 --repeats 3", "--gigabytes 0.25 --repeats 1",
     "the smallest state bench/checkpoint_manifest.py writes (two 128 MB tensors), one round"),
    (" [verify.checkpoint=runs/x/checkpoints] [verify.attention=thd|pack_causal]", "",
     "optional arguments left out (no runs/x here; pack_causal is run in tests/functional/test_model_verify.py)"),
]
HOME = "home"
"""What ``$HOME`` stands for, under the work folder (whose configs/ is the repository's, the shipped presets)."""
TRAIN_STEPS = ["train.train_iters=2", "train.global_batch_size=2", "checkpoint.save_interval=0"]
"""Appended to a real training run without its own short schedule (the documents' runs train 50+ steps)."""

WORLD = r"(?P<world>\d+)"
RULES = [  # (id, pattern, how it runs, why)
    ("ci-suite", r"^bash scripts/test\.sh$", "covered:.ci/run", "the test suite itself: CI runs it"),
    ("quickstart-script", r"^bash scripts/quickstart\.sh$",
     "covered:tests/functional/test_train_resume_quickstart.py::test_quickstart_script_shortened",
     "50 steps on 2 processes; run there shortened to 3 steps"),
    ("synopsis", r"^.*(NPROC_PER_NODE|NNODES NODE_RANK)", "synopsis", "a usage line: placeholders, not a command"),
    ("sbatch-gpu", r"^sbatch (--nodes (?P<nodes>\d+) )?(--gpus-per-node (?P<gpus>\d+) )?launch/slurm\.sbatch (?P<args>.*)$",
     "check", "a GPU cluster job (default 2 nodes x 8 GPUs): checked for its world size"),
    ("sbatch-cpu", r"^sbatch (--signal=USR1@\d+ )?--wait --nodes (?P<nodes>\d+) --gpus-per-node=0 "
                   r"--cpus-per-task=(?P<gpus>\d+) launch/slurm\.sbatch (?P<args>.*)$",
     "check", "submitted to a real slurmctld by tests/functional/test_slurm.py (the --signal=USR1@120 one too, "
              "signalled there); checked here"),
    ("multi-node", r"^bash launch/multi_node\.sh (?P<nodes>\d+) \d+ \S+ (?P<gpus>\d+) (?P<args>.*?)( &)?$", "check",
     "one node's agent of a multi-node world (both nodes run in tests/functional/test_launch.py): checked"),
    ("train-for-export", rf"^bash launch/single_node\.sh {WORLD} (?P<args>(model=pretrained|experiment=pretrained_tiny "
                         r"peft=lora).*)$", "train", "later commands export and verify its checkpoint"),
    ("torchrun-same-run", rf"^torchrun --nproc-per-node {WORLD} -m megatron_pack\.train "
                          r"(?P<args>experiment=pretrained_tiny peft=lora)$", "check",
     "README.md's `bash launch/single_node.sh 2 experiment=pretrained_tiny peft=lora`, trained above into the same "
     "output folder (torchrun would resume it, finished); checked, and its checkpoint is there"),
    ("single-node", rf"^bash launch/single_node\.sh {WORLD} (?P<args>.*)$", "check",
     "a training launch: checked for its world size (trained for real in the tests of each feature)"),
    ("torchrun", rf"^torchrun (--standalone )?--nproc-per-node {WORLD} -m megatron_pack\.train (?P<args>.*)$", "check",
     "a training launch: checked for its world size"),
    ("gpu-verify-torchrun", rf"^torchrun --nproc-per-node {WORLD} -m megatron_pack\.cli\.main (?P<args>verify .*)$",
     "cfg", "an 8B bfloat16 CUDA recipe at TP=2 x CP=2 (the same verify runs at every layout on a tiny model in "
            "tests/functional/test_hf_models.py)"),
    ("gpu-verify", r"^megatron-pack (?P<args>verify experiment=llama3_8b_sft .*)$", "cfg",
     "an 8B bfloat16 CUDA recipe (train.device=cuda)"),
    ("gpu-export", r"^megatron-pack (?P<args>export checkpoint=runs/llama3_8b_sft/.*)$", "cfg",
     "the checkpoint of an 8-GPU run"),
    ("export-trained", r"^megatron-pack (?P<args>export checkpoint=runs/.*)$", "after",
     "reads a checkpoint of a run above; docs/peft.md repeats the README's two LoRA exports into the same folders "
     "(export never overwrites), so a repeat is checked to have run already"),
    ("verify-trained", r"^megatron-pack (?P<args>verify .*verify\.checkpoint=runs/.*)$", "after",
     "reads a checkpoint of a run above"),
    ("config-dir", r"^MEGATRON_PACK_CONFIG_DIR=(?P<env>\S+) megatron-pack (?P<args>.*)$", "run", "as written"),
    ("megatron-pack", r"^megatron-pack (?P<args>(prepare|inspect|verify|export|train --cfg job) .*)$", "run", "as written"),
    ("megatron-pack-console", r"^\$ megatron-pack (?P<args>.*)$", "console", "as written; its output is compared"),
    ("gpu-checks", r"^bash tests/gpu/run\.sh$",
     "covered:tests/unit/test_gpu_run_script.py::test_run_sh_on_cpu_skips_every_check_and_exits_0",
     "the GPU checks: on a CPU every one is skipped with its reason and the script exits 0, as CI runs it there"),
    ("gpu-wheels", r"^bash (?P<args>tests/gpu/download_wheels\.sh)$", "network",
     "downloads megatron-core and Hydra wheels from PyPI for a GPU machine without network; CI must not depend "
     "on a download, so only its syntax is checked here (run where a GPU is lent: tests/gpu/run.sh installs them)"),
    ("bench-baseline-tree", r"^mkdir -p /tmp/before && git archive \w+ \| tar -x -C /tmp/before$", "history",
     "exports a past commit (git archive) for bench/startup.py --compare; the fresh copy has no git history, so "
     "the start-up benchmark below runs without --compare"),
    ("bench-real", r"^\.venv/bin/python (?P<args>bench/prepare\.py --real .*)$", "flags",
     "needs the bench extra (pip install -e '.[bench]': trl, datasets, mistral-common from PyPI, never in CI) "
     "and minutes a round: its command line is checked against the script's --help"),
    ("bench", r"^\.venv/bin/python (?P<args>bench/\S+\.py.*)$", "bench",
     "a benchmark, run for real (one round, the stand-in size) with the interpreter running the tests"),
]


@dataclass
class Command:
    document: str
    line: int
    text: str
    """The command as the document writes it (continuation lines joined, comment dropped)."""
    expected: list[str] = field(default_factory=list)
    """console blocks: the output lines shown after it."""


def code_blocks(document: str) -> list[tuple[int, str, str]]:
    """``(line, language, body)`` of every fenced code block."""
    blocks, text = [], (ROOT / document).read_text(encoding="utf-8")
    for match in re.finditer(r"^```([\w+-]*)[ \t]*\n(.*?)^```", text, re.S | re.M):
        blocks.append((text[:match.start()].count("\n") + 1, match.group(1), match.group(2)))
    return blocks


def _strip_comment(line: str) -> str:
    """The line without its shell comment (a ``#`` after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _shell_lines(body: str) -> list[str]:
    """Command lines of a bash block: backslash continuations joined, and lines joined while a quote is open
    (a quoted list written over several lines)."""
    lines, pending = [], ""
    for ln in re.sub(r"\\\n\s*", " ", body).splitlines():
        pending = f"{pending} {ln.strip()}" if pending else _strip_comment(ln.strip())  # no comment inside a quote
        if pending.count("'") % 2 == 0 and pending.count('"') % 2 == 0:
            lines.append(pending)
            pending = ""
    assert not pending, f"an unclosed quote in {pending!r}"
    return lines


def _indented_commands(document: str) -> list[str]:
    """Command lines of indented (four-space) code blocks, outside fenced blocks: they must be fenced."""
    found, fenced, blank = [], False, True
    for line in (ROOT / document).read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("    ") and LOOKS_LIKE_A_COMMAND.match(line) and blank:
            found.append(line.strip())
        blank = not line.strip() or (blank and line.startswith("    "))
    return found


def document_commands() -> list[Command]:
    """Every command of every shell block, in document order; an untagged or indented block holding one fails."""
    commands = []
    for document in DOCUMENTS:
        indented = _indented_commands(document)
        assert not indented, (f"{document}: an indented code block holds a command ({indented[0]!r}); fence it "
                              "with ```bash so this test runs it")
        for line, language, body in code_blocks(document):
            if language not in SHELL:
                offenders = [ln for ln in body.splitlines() if LOOKS_LIKE_A_COMMAND.match(ln)]
                assert not offenders or language not in ("", "text"), (
                    f"{document}:{line}: an untagged code block holds commands ({offenders[0]!r}); tag it ```bash "
                    "(or ```console with $ and its output) so this test runs it")
                continue
            if language == "console":
                for ln in body.splitlines():
                    if ln.startswith("$ "):
                        commands.append(Command(document, line, ln.strip()))
                    elif ln.strip() and commands and commands[-1].document == document:
                        commands[-1].expected.append(ln.strip())
                continue
            for text in _shell_lines(body):
                if text:
                    commands.append(Command(document, line, re.sub(r"\s+", " ", text)))
    return commands


def substituted(text: str) -> str:
    for placeholder, stand_in, _ in STAND_INS:
        text = text.replace(placeholder, stand_in)
    return text


def rule_for(text: str) -> tuple[str, re.Match, str]:
    for rule_id, pattern, how, _ in RULES:
        match = re.match(pattern, text)
        if match:
            return rule_id, match, how
    raise AssertionError(f"no row of RULES covers the command {text!r}; add one (say how it runs and why)")


def test_every_command_is_covered_and_every_rule_and_stand_in_is_used():
    """The tables are reviewed, not silent: each command has its row, each row and stand-in its commands."""
    commands = document_commands()
    assert len(commands) > 40 and {c.document for c in commands} >= {"README.md", "docs/data.md", "docs/peft.md"}
    used = {rule_for(substituted(c.text))[0] for c in commands}
    assert used == {r[0] for r in RULES}, f"rows that cover no command: {sorted({r[0] for r in RULES} - used)}"
    texts = " ".join(c.text for c in commands)
    assert all(placeholder in texts for placeholder, _, _ in STAND_INS), [p for p, _, _ in STAND_INS if p not in texts]
    for _, _, how, _ in RULES:
        if how.startswith("covered:"):
            path, _, name = how.split(":", 1)[1].partition("::")
            assert (ROOT / path).is_file() and (not name or f"def {name}(" in (ROOT / path).read_text())


# ----- the work folder ------------------------------------------------------------------------------

def _stand_in_files(work: Path) -> None:
    """The files and folders the stand-ins and the recipes name."""
    import shutil

    from _hf import docs_tiny_llama, make_family, save_tokenizer

    save_tokenizer(work / "tok")
    model = make_family(work, "llama_tied", name="tiny-model")
    docs_tiny_llama(work)  # pretrained_tiny's folder, as docs/models.md builds it (its tokenizer, its corpus)
    shutil.copytree(model, work / "models/Llama-3.1-8B-Instruct")  # llama3_8b_sft
    records = [{"prompt": f"what is {i} plus {i}", "completion": f"{2 * i}"} for i in range(200)]
    for name in ("train.jsonl", "big.jsonl", "data/sft.jsonl", "code/code.jsonl"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(work / name, records)
    write_jsonl(work / "chat.jsonl", [{"conversations": [{"from": "human", "value": f"hi {i}"},
                                                         {"from": "gpt", "value": "hello"}]} for i in range(60)])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records[:60]), work / "math.parquet")
    # docs/data.md's datasets folder: a DatasetDict (train, test) that the datasets package wrote
    shutil.copytree(ROOT / "tests/fixtures/hf_datasets/pc_dict", work / "hf_dataset")
    run = "# @package _global_\ndefaults:\n  - override /model: tiny\ntrain:\n  train_iters: 3\n"
    (work / "my_configs" / "experiment").mkdir(parents=True)
    (work / "my_configs" / "experiment" / "my_run.yaml").write_text(run)
    (work / "my_run.yaml").write_text(run)
    (work / "team_configs" / "model").mkdir(parents=True)
    (work / HOME / "configs" / "model").mkdir(parents=True)
    (work / HOME / "configs" / "model" / "my_model.yaml").write_text("name: my_model\nnum_layers: 3\n")


# ----- running --------------------------------------------------------------------------------------

def _check(work: Path, args: str, world: int) -> tuple[int, str]:
    return run_cli(work, "train", "--check", *shlex.split(args), env={"WORLD_SIZE": str(world), "RANK": "0"})


def _run(work: Path, command: Command, log: list[str], deferred: list, trained: list, *, now: bool = False) -> None:
    """Run ``command`` by its rule; a training run and what reads its checkpoint wait in ``trained`` /
    ``deferred`` (``now``: run a deferred one)."""
    text = substituted(command.text)
    rule_id, match, how = rule_for(text)
    how = "run" if now and how == "after" else how
    if how == "run" and rule_id == "export-trained" and any(line.startswith(f"$ {text}  ") for line in log):
        log.append(f"[{rule_id}] {text}: ran above (the same command, the same output folder)")
        return
    groups = match.groupdict()
    args = groups.get("args") or ""
    if how in ("covered", "synopsis", "history") or how.startswith("covered:"):
        log.append(f"[{rule_id}] {text}: not run here ({how})")
        return
    if how == "train":
        trained.append((f"{command.document}:{command.line}", shlex.split(args)))
        return
    if how == "after":
        deferred.append(command)
        return
    if how == "check":
        world = int(groups.get("world") or 0) or int(groups.get("nodes") or 2) * int(groups.get("gpus") or 8)
        status, out = _check(work, args, world)
    elif how == "cfg":
        command_name, *rest = shlex.split(args)
        env = {"WORLD_SIZE": groups["world"], "RANK": "0"} if groups.get("world") else None
        status, out = run_cli(work, command_name, "--cfg", "job", *rest, env=env)
    elif how == "network":  # a download: parsed, never run (CI depends on no download)
        status, out = _process(work, ["bash", "-n", *shlex.split(args)])
    elif how == "bench":
        status, out = _process(work, [sys.executable, *shlex.split(args)], timeout=300)
    elif how == "flags":
        status, out = _bench_flags(work, shlex.split(args))
    elif how == "console":
        status, out = run_cli(work, *shlex.split(args))
        missing = [line for line in command.expected if line not in out]
        assert not missing, f"{command.document}:{command.line}: `{text}` printed\n{out}\nnot\n{missing}"
        log.append(f"$ {text}  [{rule_id}]\n{out}")
        return
    else:  # run
        env = {"MEGATRON_PACK_CONFIG_DIR": groups["env"].replace("$HOME", str(work / HOME))} if groups.get("env") else None
        status, out = run_cli(work, *shlex.split(args), env=env)
    log.append(f"$ {text}  [{rule_id}, {how}]\n{out}")
    assert status == 0, f"{command.document}:{command.line}: `{text}` ({rule_id}) exited {status}:\n{out[-6000:]}"


def _process(work: Path, argv: list[str], *, timeout: float = 120) -> tuple[int, str]:
    """A command in its own process, from the work folder (the fresh copy), with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONPATH": str(work), "PYTHON": sys.executable}
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _bench_flags(work: Path, argv: list[str]) -> tuple[int, str]:
    """``SCRIPT --help`` after the options the script dispatches on (``"--real" in sys.argv``): exit 0, and
    every other option of the command listed in that help."""
    script, options = argv[0], [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")]
    source = (work / script).read_text(encoding="utf-8")
    dispatch = [o for o in options if f'"{o}" in sys.argv' in source]
    status, out = _process(work, [sys.executable, script, *dispatch, "--help"])
    missing = [o for o in options if o not in dispatch and o not in out]
    assert dispatch and not missing, f"{' '.join(argv)}: options {missing} are not in its --help:\n{out}"
    return status, out


def _train_for_real(work: Path, trained: list, log: list[str]) -> None:
    """The queued training runs, in order, on the session's torchrun world of 2 ranks (tests/_train_world.py)."""
    from _train_world import run_in_world

    cases = {name: ["train", *(argv if any(a.startswith("experiment=pretrained_tiny") for a in argv)
                               else argv + TRAIN_STEPS)] for name, argv in trained}
    outputs = run_in_world(work, cases)
    log += [f"$ torchrun --nproc-per-node 2 -m megatron_pack.train {shlex.join(argv[1:])}  [{name}, world]\n"
            f"{outputs[name]}" for name, argv in cases.items()]


def test_every_documented_command_runs(tmp_path):
    work = copy_tree(tmp_path / "megatron_pack", ROOT)
    _stand_in_files(work)
    log: list[str] = []
    trained: list = []
    deferred: list[Command] = []
    worlds = 0
    for command in document_commands():
        how = rule_for(substituted(command.text))[2]
        if how not in ("train", "after") and (trained or deferred):  # the runs, then what reads them
            worlds += _flush(work, trained, deferred, log)
        _run(work, command, log, deferred, trained)
    worlds += _flush(work, trained, deferred, log)
    assert worlds == 2, worlds  # the README's fine-tune (read by its export) and its LoRA run (by 4 commands)
    text = "\n".join(log)
    # what the documents promise, seen in what ran
    assert "verify: 4/4 packs PASS" in text and "packing.pad_seq_to_mult=4 (was null)" in text
    assert list((work / "data" / "mine" / "plans").glob("*/training_4096.idx.parquet"))  # export=bridge ran
    assert (work / "exports" / "lora" / "adapter_config.json").is_file()
    assert (work / "exports" / "llama-sft" / "config.json").is_file()
    assert (work / "exports" / "roundtrip" / "config.json").is_file()
    assert (work / "runs" / "pretrained_tiny" / "checkpoints" / "latest").is_file()  # the run peft.md checks


def _flush(work: Path, trained: list, deferred: list, log: list[str]) -> int:
    """Train the queued runs on the session's world, then run the deferred commands; 1 when runs were trained."""
    started = 0
    if trained:
        _train_for_real(work, trained, log)
        started = 1
    for command in deferred:
        _run(work, command, log, [], [], now=True)
    trained.clear()
    deferred.clear()
    return started
