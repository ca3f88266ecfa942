"""``bench/prepare.py --real --against-trl``: prepare's fixed cost with a full model folder, and prepare end to end
against TRL's SFT preparation, in one run (issue 43 item 12).

The model folder is Mistral 7B v0.1's as a hub download holds it: its real SentencePiece tokenizer
(``tokenizer.model.v1`` from the PyPI package mistral-common, ``mistral_common/data/``; as the Hugging Face
``LlamaTokenizer`` folder transformers converts it to) with a Mistral chat template with ``{% generation %}``
markers, the model's ``config.json`` (``model_type: mistral``) and ``generation_config.json``, and a weights file
(small here: prepare never reads weights). Records: ``--records`` chats of every kind (``real_inputs.make_records``:
system prompts, 1-3 turns, empty turns, content parts, tool turns).

Each round, in this order, each a fresh process, with the load average before and after:

* **bare**: ``python -c "import tokenizers, numpy, pyarrow"`` (the floor of any Python tokenizing path), the
  minimum of 3;
* **cold fixed**: the fixed command below with an empty cache (``MEGATRON_PACK_CACHE_DIR``: the first run after
  installing or changing the presets, which composes with Hydra, or with a new tokenizer folder, whose vocabulary
  hash is computed);
* **fixed**: ``megatron-pack prepare`` of 100 records with the model folder as ``tokenizer=`` (whole command: the
  store, the plan, report.json and report.png; the composition store warm, as for every later run); goal: <= 4x
  bare; with ``--before DIR`` (a ``git archive`` of an earlier commit) the same command from that tree too;
* **prepare**: the same on ``--records`` records (default workers: one per core);
* **TRL**: ``SFTTrainer._prepare_dataset`` (``bench/prepare_real.py``'s TRL child: ``datasets.map`` tokenizing with
  ``assistant_only_loss``, labels, ``bfd`` packing at 4096, ``dataset_num_proc`` = the cores) on the same
  conversations, whole process wall (imports, tokenizer load, dataset load, map, pack); goal: TRL / prepare >= 3.

Before the rounds each tree runs the fixed command once, unmeasured (its bytecode written, the cache filled); every
``prepare`` runs with Python's bytecode cache on (``PYTHONDONTWRITEBYTECODE`` removed from its environment), as an
installed package runs. Ratios are per round (both sides measured minutes apart at most, under the same load); the table gives each
round and the medians. Needs ``trl`` and ``datasets`` where the TRL child runs (``pip install -e ".[bench]"``, or
``--peer-path DIR`` holding them, added to that child's ``PYTHONPATH`` only) and mistral-common's data folder
(the installed package, or ``--mistral-data DIR``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACK = 4096
MISTRAL_7B_CONFIG = {  # Mistral-7B-v0.1's config.json
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}


def build_model_folder(work: Path, mistral_data: Path) -> Path:
    """The Mistral 7B v0.1 model folder (see the docstring), built once per work dir."""
    folder = work / "mistral-7b-v0.1"
    if (folder / "tokenizer.json").is_file():
        return folder
    import numpy as np
    from safetensors.numpy import save_file
    from transformers import LlamaTokenizer

    sys.path.insert(0, str(HERE))
    from real_inputs import MISTRAL_V1

    src = work / "sp_src"
    src.mkdir(parents=True, exist_ok=True)
    shutil.copy(mistral_data / "tokenizer.model.v1", src / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(str(src))
    tok.chat_template = MISTRAL_V1
    tok.save_pretrained(folder)
    shutil.copy(src / "tokenizer.model", folder / "tokenizer.model")
    (folder / "config.json").write_text(json.dumps(MISTRAL_7B_CONFIG, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file({"model.embed_tokens.weight": np.zeros((32000, 16), np.float16)}, str(folder / "model.safetensors"))
    return folder


def _measured(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> dict:
    """``prepare_real._measured`` (wall, CPU with children, peak RSS, last line) run in ``cwd``."""
    sys.path.insert(0, str(HERE))
    from prepare_real import _measured as measured

    here = os.getcwd()
    try:
        os.chdir(cwd or here)
        return measured(cmd, env)
    finally:
        os.chdir(here)


def _prepare(folder: Path, records: Path, out: Path, tree: str | None = None, store: Path | None = None) -> dict:
    """The whole ``megatron-pack prepare`` command; ``tree``: a source tree of another commit to run instead;
    ``store``: an empty folder as the config composition store (a first run's cost; the default store is warm)."""
    shutil.rmtree(out, ignore_errors=True)
    # bytecode cached, as an installed package runs (pip compiles it; a source tree writes __pycache__ on its first
    # run): with PYTHONDONTWRITEBYTECODE set, every run would compile megatron_pack's sources again (~0.15 CPU-s)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if tree:
        env["PYTHONPATH"] = tree
    if store is not None:
        shutil.rmtree(store, ignore_errors=True)
        env["MEGATRON_PACK_CACHE_DIR"] = str(store)
    # run from the work dir: `python -m` puts the current folder first on sys.path, before PYTHONPATH's tree
    return _measured([sys.executable, "-m", "megatron_pack.cli.main", "prepare", f"tokenizer={folder}",
                      f"input={records}", f"output={out}", f"packing.packed_sequence_size={PACK}",
                      "packing.on_overflow=drop", "data.on_bad_record=skip"], env, cwd=out.parent)


def _trl(folder: Path, plain: Path, out: Path, peer_path: str | None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    if peer_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (peer_path, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(HERE / "prepare_real.py"), "--trl-child", "--tokenizer", str(folder), "--input",
           str(plain), "--out", str(out), "--workers", str(len(os.sched_getaffinity(0)))]
    result = _measured(cmd, env)
    result.update(json.loads(result["last"]))
    return result


def _bare() -> tuple[float, float]:
    """Wall and CPU seconds of ``python -c "import tokenizers, numpy, pyarrow"``, each the minimum of 3."""
    runs = [_measured([sys.executable, "-c", "import tokenizers, numpy, pyarrow"]) for _ in range(3)]
    return min(r["wall"] for r in runs), min(r["cpu"] for r in runs)


def _opt(value, unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(args) -> None:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.mistral_data) if args.mistral_data else None
    if data is None:
        import mistral_common

        data = Path(mistral_common.__file__).parent / "data"
    folder = work / "mistral-7b-v0.1"
    if not (folder / "tokenizer.json").is_file():  # converting tokenizer.model needs sentencepiece: the peers' path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (args.peer_path, os.environ.get("PYTHONPATH"))
                                                           if p)}
        subprocess.run([sys.executable, __file__, "--build-folder", "--workdir", str(work), "--mistral-data",
                        str(data)], check=True, env=env)
    sys.path.insert(0, str(HERE))
    from real_inputs import make_records

    records, small = work / f"chat_{args.records}.jsonl", work / "chat_100.jsonl"
    if not records.is_file():
        make_records(records, args.records)
        make_records(small, 100)
    plain, rows = records.with_name(records.stem + "_plain.jsonl"), []
    print(f"model folder {folder} ({', '.join(sorted(p.name for p in folder.iterdir()))}); {args.records:,} records; "
          f"{len(os.sched_getaffinity(0))} cores")
    header = (f"{'round':>5} {'load before':>16} {'bare s':>7} {'fixed s':>8} {'fixed/bare':>10} {'bare cpu':>8} "
              f"{'fixed cpu s':>11} {'cpu/bare':>8} {'cold fixed s':>12} {'cold/bare':>10} {'before s':>8} "
              f"{'before/bare':>11} {'before cpu':>10} "
              f"{'prepare s':>9} {'TRL s':>7} {'TRL map+pack s':>14} {'TRL/prep':>8} {'prep cpu s':>10} {'TRL cpu s':>9} "
              f"{'load after':>16}")
    print(header)
    # one run of each tree before the rounds, not measured: writes its bytecode and fills the cache (the config
    # composition, the vocabulary hash) as every run after a first one finds them
    _prepare(folder, small, work / "ds_warm")
    if args.before:
        _prepare(folder, small, work / "ds_warm", args.before)
    for round_ in range(1, args.rounds + 1):
        before = _load()
        bare, bare_cpu = _bare()
        cold = _prepare(folder, small, work / "ds_fixed_cold", store=work / "empty_store")
        fixed = _prepare(folder, small, work / "ds_fixed")
        old = _prepare(folder, small, work / "ds_fixed_before", args.before) if args.before else None
        earlier = old["wall"] if old else None
        prep = _prepare(folder, records, work / "ds_full")
        trl = _trl(folder, plain, work / "trl_out", args.peer_path)
        row = {"round": round_, "load_before": before, "bare": bare, "fixed": fixed["wall"], "fixed_cpu": fixed["cpu"],
               "fixed_cold": cold["wall"], "fixed_cold_cpu": cold["cpu"], "prepare": prep["wall"], "prepare_cpu": prep["cpu"], "trl": trl["wall"], "trl_cpu": trl["cpu"],
               "trl_inner": trl["prepare_seconds"], "fixed_before": earlier, "fixed_before_cpu": old["cpu"] if old else None, "bare_cpu": bare_cpu, "load_after": _load()}
        rows.append(row)
        print(f"{round_:>5} {before:>16} {bare:>7.2f} {row['fixed']:>8.2f} {row['fixed'] / bare:>9.1f}x {bare_cpu:>8.2f} "
              f"{row['fixed_cpu']:>11.2f} {row['fixed_cpu'] / bare_cpu:>7.1f}x {row['fixed_cold']:>12.2f} "
              f"{row['fixed_cold'] / bare:>10.1f}x {_opt(earlier):>8} "
              f"{_opt(earlier and earlier / bare, 'x'):>11} {_opt(row['fixed_before_cpu']):>10} "
              f"{row['prepare']:>9.2f} {row['trl']:>7.2f} {row['trl_inner']:>14.2f} "
              f"{row['trl'] / row['prepare']:>7.2f}x {row['prepare_cpu']:>10.2f} {row['trl_cpu']:>9.2f} "
              f"{row['load_after']:>16}", flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in ("bare", "fixed", "fixed_cold", "prepare", "trl")}
    fixed_ratio = statistics.median(r["fixed"] / r["bare"] for r in rows)
    cpu_ratio = statistics.median(r["fixed_cpu"] / r["bare_cpu"] for r in rows)
    cold_ratio = statistics.median(r["fixed_cold"] / r["bare"] for r in rows)
    trl_cpu_ratio = statistics.median(r["trl_cpu"] / r["prepare_cpu"] for r in rows)
    trl_ratio = statistics.median(r["trl"] / r["prepare"] for r in rows)
    print(f"medians over {len(rows)} rounds: bare {med['bare']:.2f} s, fixed {med['fixed']:.2f} s "
          f"({fixed_ratio:.1f}x bare; goal <= 4x: {'met' if fixed_ratio <= 4 else 'NOT met'}; CPU {cpu_ratio:.1f}x; "
          f"cold store {med['fixed_cold']:.2f} s, {cold_ratio:.1f}x), prepare "
          f"{med['prepare']:.2f} s, TRL {med['trl']:.2f} s ({trl_ratio:.2f}x; goal >= 3x: "
          f"{'met' if trl_ratio >= 3 else 'NOT met'}; CPU {trl_cpu_ratio:.2f}x); load average {_load()}")
    (work / "results_against_trl.json").write_text(json.dumps(rows, indent=2))


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peer-path", help="a folder holding trl and datasets, for the TRL child's PYTHONPATH only")
    parser.add_argument("--mistral-data", help="mistral-common's data folder (default: the installed package's)")
    parser.add_argument("--before", help="a source tree of an earlier commit (git archive): its fixed cost too")
    parser.add_argument("--build-folder", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_folder:
        build_model_folder(Path(args.workdir), Path(args.mistral_data))
        return
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
