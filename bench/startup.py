"""Benchmark: start-up time, from the command to step 1, against a bare ``python -c "import torch"``.

Measured in one run, interleaved over ``--repeats`` rounds (the machine is shared: the ratio to
the ``import torch`` of the same round is the number to compare), each from a fresh process:

- ``import torch``: the baseline;
- ``train --check``: the check the launch scripts run before torchrun (``WORLD_SIZE=2``);
- quickstart: ``bash launch/single_node.sh 2 experiment=quickstart`` (the README's first command,
  1 step, no checkpoint) until its ``step 1/`` line; target: within 15 s on this machine;
- pretrained_tiny: the same with ``experiment=pretrained_tiny`` (a random 2-layer Llama folder,
  config.json + safetensors written here, and a tokenizer trained here: no download);
- no-op prepare: ``megatron-pack prepare`` again on a small JSONL with a tokenizer-only folder whose
  tokenizer_config.json names ``LlamaTokenizer`` (as Mistral 7B v0.1 / Llama 2 folders do); target
  under 2 s. Also the first, full prepare of it (its fixed cost, for reference).

``--compare DIR`` also runs another checkout's launch scripts and package with this interpreter
(e.g. the commit before these changes, ``git archive <commit> | tar -x -C DIR``), each case of
each round once per checkout, interleaved, for before / after numbers under the same load.

    .venv/bin/python bench/startup.py [--repeats 3] [--compare DIR] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False, "hidden_act": "silu"}


def _env(repo: Path) -> dict:
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
            "PYTHONPATH": str(repo), "PYTHONWARNINGS": "ignore"}


def _seconds_to(cmd: list[str], fragment: str | None, *, cwd: Path, env: dict) -> float:
    """Seconds from starting ``cmd`` to the first output line holding ``fragment`` (None: to its exit)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if seen is None and fragment is not None and fragment in line:
            seen = time.perf_counter() - start
    proc.wait()
    if proc.returncode != 0 or (fragment is not None and seen is None):
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{''.join(lines)[-3000:]}")
    return seen if fragment is not None else time.perf_counter() - start


def _tokenizer(folder: Path, tokenizer_class: str) -> None:
    """A byte-level BPE trained here (tokenizers library), saved with ``tokenizer_class`` named."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["what is two plus two", "the answer is four", "hello world", "system user assistant"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=290, special_tokens=["<pad>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": 512, "chat_template": template}))


def setup(work: Path, repo: Path, env: dict) -> None:
    """The quickstart dataset, the tiny Llama folder and its dataset (prepared by ``repo``), the
    LlamaTokenizer folder and its JSONL."""
    from megatron_pack.model.hf.synthetic import write_random_folder

    cli = [sys.executable, "-m", "megatron_pack.cli.main"]
    _seconds_to([*cli, "prepare", "experiment=quickstart"], None, cwd=work, env=env)
    write_random_folder(work / "models" / "tiny-llama", TINY_LLAMA)
    _tokenizer(work / "models" / "tiny-llama", "PreTrainedTokenizerFast")
    _seconds_to([*cli, "prepare", "experiment=pretrained_tiny"], None, cwd=work, env=env)
    _tokenizer(work / "llama_tokenizer", "LlamaTokenizer")
    with open(work / "sft.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"prompt": f"what is {i} plus two", "completion": f"the answer is {i + 2}"}) + "\n")


def _cases(repo: Path) -> dict[str, tuple[list[str], str | None]]:
    launch = ["bash", str(repo / "launch" / "single_node.sh"), "2"]
    short = ["train.train_iters=1", "checkpoint.enabled=false", "logging.tensorboard=false"]
    return {
        "import torch": ([sys.executable, "-c", "import torch"], None),
        "train --check": (["env", "WORLD_SIZE=2", sys.executable, "-m", "megatron_pack.train", "--check",
                           "experiment=quickstart"], "config ok"),
        "quickstart to step 1": ([*launch, "experiment=quickstart", *short], "step 1/"),
        "pretrained_tiny to step 1": ([*launch, "experiment=pretrained_tiny", *short], "step 1/"),
    }


def _round(repo: Path, work: Path, times: dict[str, list[float]], r: int) -> None:
    env = _env(repo)
    for name, (cmd, fragment) in _cases(repo).items():
        extra = [f"train.output_dir=runs/{r}"] if "step 1" in name else []
        times[name].append(_seconds_to(cmd + extra, fragment, cwd=work, env=env))
    prep = [sys.executable, "-m", "megatron_pack.cli.main", "prepare", "input=sft.jsonl", "tokenizer=llama_tokenizer",
            "packing.packed_sequence_size=256", f"output=data/llama_{r}"]
    times["prepare (first)"].append(_seconds_to(prep, None, cwd=work, env=env))
    times["prepare (no-op)"].append(_seconds_to(prep, None, cwd=work, env=env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", default=None, help="another checkout, run interleaved with this one")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    repos = [HERE] + ([Path(args.compare).resolve()] if args.compare else [])
    root = Path(args.workdir or tempfile.mkdtemp(prefix="startup_"))
    works = {repo: root / f"repo{i}" for i, repo in enumerate(repos)}
    for repo, work in works.items():
        work.mkdir(parents=True, exist_ok=True)
        setup(work, repo, _env(repo))
    names = [*_cases(HERE), "prepare (first)", "prepare (no-op)"]
    times = {repo: {name: [] for name in names} for repo in repos}
    for r in range(args.repeats):
        for repo in repos:
            _round(repo, works[repo], times[repo], r)
    for repo in repos:
        base = statistics.median(times[repo]["import torch"])
        print(f"start-up of {repo}, {args.repeats} rounds interleaved, median seconds:")
        for name, values in times[repo].items():
            med = statistics.median(values)
            print(f"  {name:<28} {med:6.2f} s  x{med / base:5.2f} of import torch   "
                  f"[{', '.join(f'{v:.2f}' for v in values)}]")


if __name__ == "__main__":
    main()
