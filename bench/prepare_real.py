"""``bench/prepare.py --real``: ``prepare`` against its peers with real tokenizers.

Tokenizers (from the installed ``mistral-common``, see ``real_inputs.py``): Mistral 7B v0.1's
SentencePiece model as a Hugging Face ``LlamaTokenizer`` folder, and Tekken
(``tekken_240911.json``) converted to a fast tokenizer; each with a Mistral-style chat template
with ``{% generation %}`` markers ("marked") and the same template without ("unmarked": the mask
comes from growing prefixes). Records: ``--sizes`` chat records of every kind.

Peers, measured in the same run, interleaved per round, each a fresh process:

* **loop**: transformers' per-sample loop, ``apply_chat_template(messages, tokenize=True,
  return_dict=True, return_assistant_tokens_mask=True)`` per record (marked); unmarked, the
  prefix rule from ``apply_chat_template`` calls on growing prefixes. Its ids and masks are
  written out and compared with the token store, record by record (must be identical);
* **TRL**: ``SFTTrainer``'s own dataset preparation (``_prepare_dataset``: ``datasets.map``
  tokenizing with ``assistant_only_loss``, labels, ``bfd`` packing at the same pack size) with
  ``dataset_num_proc`` equal to prepare's worker count, on ``load_dataset("json")`` of the same
  conversations, from process start until the packed dataset is ready (TRL needs the marked
  template; its work is the same for both rows of a tokenizer);
* **prepare**: ``megatron-pack prepare`` at default settings (one worker process per core),
  whole command until the packing plan and report are written; and with ``tokenize_workers=1``
  (the two-core scaling goal), and on a 100-record file (the fixed cost).

Printed per row: wall seconds (median and range over rounds), CPU seconds per million tokens
(whole command, fixed cost included), peak RSS of the largest process, and the goal ratios.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACK = 4096


def loop_child(args) -> None:
    """transformers' per-sample loop; writes ``tokens.npy`` / ``mask.npy`` / ``offsets.npy`` to ``--out``."""
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    records = [json.loads(line)["messages"] for line in open(args.input)]
    marked = "{% generation %}" in tok.chat_template
    start, cpu = time.perf_counter(), time.process_time()
    ids_all, masks_all, lengths = [], [], []
    for messages in records:
        if marked:
            out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids, mask = _prefix_rule(tok, messages)
        ids_all.append(np.asarray(ids, np.int64))
        masks_all.append(np.asarray(mask, np.uint8))
        lengths.append(len(ids))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tokens.npy", np.concatenate(ids_all))
    np.save(out / "mask.npy", np.concatenate(masks_all))
    np.save(out / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]))
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "num_tokens": int(sum(lengths))}))


def _prefix_rule(tok, messages):
    """Assistant turn i is what the template of messages[:i+1] adds after messages[:i] with the
    generation prompt, in tokens (the rule for a template without generation markers)."""
    def ids(m, gen=False):
        return list(tok.apply_chat_template(m, tokenize=True, return_dict=True, add_generation_prompt=gen)["input_ids"])

    full = ids(messages)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(ids(messages[:i], True)) if i else 0
            end = ids(messages[:i + 1])
            assert full[:len(end)] == end, "template not prefix-stable"
            mask[start:len(end)] = [1] * (len(end) - start)
    return full, mask


def trl_child(args) -> None:
    """TRL's SFTTrainer dataset preparation, from process start to the packed dataset."""
    from types import SimpleNamespace

    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    datasets.disable_caching()
    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    begin = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=args.input, split="train", cache_dir=args.out)
    config = SFTConfig(output_dir=args.out, assistant_only_loss=True, packing=True, packing_strategy="bfd",
                       max_length=PACK, dataset_num_proc=args.workers, report_to=[], use_cpu=True, bf16=False)
    trainer_state = SimpleNamespace(_tokenizer=tok, chat_template=None, completion_only_loss=False, padding_free=True)
    packed = SFTTrainer._prepare_dataset(trainer_state, dataset, tok, config, True, None, "train")
    num_tokens = sum(sum(x) for x in packed["seq_lengths"])
    print(json.dumps({"prepare_seconds": time.perf_counter() - begin, "num_packs": len(packed),
                      "num_tokens": int(num_tokens)}))


def _measured(cmd: list[str], env: dict | None = None) -> dict:
    """Wall seconds, CPU seconds (the command and its children) and the peak RSS (MB) of the
    largest process of ``cmd``, measured by a small wrapper process, and the command's last line."""
    code = ("import json, resource, subprocess, sys, time\n"
            "t = time.perf_counter()\n"
            "out = subprocess.run(sys.argv[1:], check=True, capture_output=True, text=True)\n"
            "wall = time.perf_counter() - t\n"
            "r = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "lines = out.stdout.strip().splitlines()\n"
            "print(json.dumps({'wall': wall, 'cpu': r.ru_utime + r.ru_stime, 'rss_mb': r.ru_maxrss / 1024,\n"
            "                  'last': lines[-1] if lines else ''}))\n")
    done = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prepare(tokenizer: Path, records: Path, out: Path, workers: int = 0) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "megatron_pack.cli.main", "prepare", f"tokenizer={tokenizer}", f"input={records}",
           f"output={out}", f"packing.packed_sequence_size={PACK}", "packing.on_overflow=drop",
           f"data.tokenize_workers={workers}"]
    result = _measured(cmd)
    meta = json.loads((out / "metadata.json").read_text())
    result.update(tokenize_seconds=meta["tokenize_seconds"], num_tokens=meta["num_tokens"],
                  workers=meta["num_tokenize_workers"])
    return result


def _same_as_loop(store: Path, loop_out: Path) -> tuple[int, int]:
    """(records whose ids or mask differ from the loop's, records compared)."""
    import numpy as np

    offsets = np.load(store / "offsets.npy")
    tokens, mask = np.load(store / "tokens.npy", mmap_mode="r"), np.load(store / "answer_mask.npy", mmap_mode="r")
    ref_offsets = np.load(loop_out / "offsets.npy")
    ref_tokens, ref_mask = np.load(loop_out / "tokens.npy", mmap_mode="r"), np.load(loop_out / "mask.npy", mmap_mode="r")
    if len(offsets) != len(ref_offsets):
        return max(len(offsets), len(ref_offsets)) - 1, len(ref_offsets) - 1
    bad = 0
    for i in range(len(offsets) - 1):
        a, b = slice(offsets[i], offsets[i + 1]), slice(ref_offsets[i], ref_offsets[i + 1])
        if not (np.array_equal(tokens[a].astype(np.int64), ref_tokens[b]) and np.array_equal(mask[a], ref_mask[b])):
            bad += 1
    return bad, len(offsets) - 1


def _loads() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _med(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def run_real(args) -> None:
    sys.path.insert(0, str(HERE))
    from real_inputs import make_records, make_tokenizers

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_prepare_real_"))
    work.mkdir(parents=True, exist_ok=True)
    folders = make_tokenizers(work)
    sizes = [int(s) for s in args.sizes.split(",")]
    cores = len(os.sched_getaffinity(0))
    print(f"prepare vs peers with real tokenizers; {cores} cores; pack {PACK}; work dir {work}; {_loads()}")
    small = work / "records_100.jsonl"
    make_records(small, 100, seed=1)
    for size in sizes:
        raw = work / f"records_{size}.jsonl"
        plain = raw.with_name(raw.stem + "_plain.jsonl")
        if not plain.is_file():
            make_records(raw, size)
        repeats = args.repeats if size <= 50_000 else args.repeats_large
        full = size <= 50_000  # the unmarked loop and one-worker runs: at the small size only (per-token costs)
        rows: dict = {}
        for r in range(repeats):
            print(f"round {r} at {size:,} records ({_loads()})", flush=True)
            for name in ("sp", "tekken"):
                marked, unmarked_dir = folders[f"{name}_marked"], folders[f"{name}_unmarked"]
                for style, folder in (("marked", marked), ("unmarked", unmarked_dir)):
                    row = rows.setdefault((name, style), {})
                    store = work / f"ds_{name}_{style}"
                    p = _prepare(folder, raw, store)
                    row.setdefault("prepare", []).append(p)
                    if style == "marked" or full:
                        loop_out = work / f"loop_{name}_{style}"
                        lr = _measured([sys.executable, __file__, "--loop-child", "--tokenizer", str(folder),
                                        "--input", str(plain), "--out", str(loop_out)])
                        lr.update(json.loads(lr["last"]))
                        lr["mismatch"], lr["compared"] = _same_as_loop(store, loop_out)
                        row.setdefault("loop", []).append(lr)
                        shutil.rmtree(loop_out, ignore_errors=True)
                    if full:
                        row.setdefault("prepare1", []).append(_prepare(folder, raw, work / "ds_one", workers=1))
                        row.setdefault("fixed", []).append(_prepare(folder, small, work / "ds_small"))
                    if style == "marked":
                        trl_dir = work / "trl_cache"
                        shutil.rmtree(trl_dir, ignore_errors=True)
                        env = {**os.environ, "HF_DATASETS_CACHE": str(trl_dir), "TOKENIZERS_PARALLELISM": "false"}
                        t = _measured([sys.executable, __file__, "--trl-child", "--tokenizer", str(folder), "--input",
                                       str(plain), "--out", str(trl_dir), "--workers", str(p["workers"])], env=env)
                        t.update(json.loads(t["last"]))
                        rows.setdefault((name, "trl"), {}).setdefault("trl", []).append(t)
                        shutil.rmtree(trl_dir, ignore_errors=True)
                    _print_round(name, style, row, rows.get((name, "trl"), {}))
        _print_table(size, rows)
        (work / f"results_{size}.json").write_text(json.dumps({f"{k[0]}/{k[1]}": v for k, v in rows.items()}, indent=1))
    print(f"done ({_loads()})")


def _print_round(name, style, row, trl) -> None:
    p = row["prepare"][-1]
    parts = [f"  {name:6s} {style:8s} prepare {p['wall']:.2f} s (tokenize {p['tokenize_seconds']:.2f} s, "
             f"{p['workers']} workers, {p['num_tokens']:,} tokens, cpu {p['cpu']:.1f} s, rss {p['rss_mb']:.0f} MB)"]
    if row.get("loop") and len(row["loop"]) == len(row["prepare"]):
        lr = row["loop"][-1]
        parts.append(f"loop {lr['seconds']:.2f} s cpu {lr['cpu_seconds']:.1f} s, mismatching records "
                     f"{lr['mismatch']}/{lr['compared']}")
    if row.get("prepare1") and len(row["prepare1"]) == len(row["prepare"]):
        parts.append(f"1 worker tokenize {row['prepare1'][-1]['tokenize_seconds']:.2f} s; "
                     f"fixed {row['fixed'][-1]['wall']:.2f} s")
    if style == "marked" and trl.get("trl"):
        t = trl["trl"][-1]
        parts.append(f"TRL {t['wall']:.2f} s (prep {t['prepare_seconds']:.2f} s, {t['num_packs']} packs)")
    print("; ".join(parts), flush=True)


def _print_table(size: int, rows: dict) -> None:
    print(f"\n{size:,} records: medians [ranges] over rounds; goals: TRL/prepare >= 3, CPU/Mtok vs loop <= 0.85, "
          f"tokenize 2 workers / 1 worker <= 0.6, fixed < 3 s")
    head = (f"{'tokenizer':<9} {'template':<8} {'prepare s':>20} {'TRL s':>20} {'TRL/prep':>8} {'tokenize s':>20} "
            f"{'2w/1w':>6} {'fixed s':>18} {'prep cpu/Mtok':>13} {'loop cpu/Mtok':>13} {'ratio':>6} "
            f"{'RSS MB':>7} {'ids+masks':>12}")
    print(head)
    for (name, style), row in rows.items():
        if style == "trl":
            continue
        trl = rows[(name, "trl")]["trl"]
        prep = row["prepare"]
        mtok = prep[0]["num_tokens"] / 1e6
        ratio_trl = statistics.median(t["wall"] for t in trl) / statistics.median(p["wall"] for p in prep)
        two_one = (statistics.median(p["tokenize_seconds"] for p in prep)
                   / statistics.median(p["tokenize_seconds"] for p in row["prepare1"])) if row.get("prepare1") else None
        prep_cpu = statistics.median(p["cpu"] for p in prep) / mtok
        loop_cpu = statistics.median(lr["cpu_seconds"] for lr in row["loop"]) / mtok if row.get("loop") else None
        same = (f"{sum(lr['mismatch'] for lr in row['loop'])} differ of {sum(lr['compared'] for lr in row['loop'])}"
                if row.get("loop") else "-")
        print(f"{name:<9} {style:<8} {_med([p['wall'] for p in prep]):>20} {_med([t['wall'] for t in trl]):>20} "
              f"{ratio_trl:>7.2f}x {_med([p['tokenize_seconds'] for p in prep]):>20} "
              f"{'-' if two_one is None else f'{two_one:.2f}':>6} {_med([f['wall'] for f in row.get('fixed', [])]):>18} "
              f"{prep_cpu:>13.2f} {'-' if loop_cpu is None else f'{loop_cpu:.2f}':>13} "
              f"{'-' if loop_cpu is None else f'{prep_cpu / loop_cpu:.2f}':>6} "
              f"{max(p['rss_mb'] for p in prep):>7.0f} {same:>12}")
    print(flush=True)


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20000,200000")
    parser.add_argument("--repeats", type=int, default=2, help="rounds at sizes up to 50,000 records")
    parser.add_argument("--repeats-large", type=int, default=1, help="rounds above 50,000 records")
    parser.add_argument("--workdir")
    parser.add_argument("--loop-child", action="store_true")
    parser.add_argument("--trl-child", action="store_true")
    parser.add_argument("--tokenizer")
    parser.add_argument("--input")
    parser.add_argument("--out")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    if args.loop_child:
        return loop_child(args)
    if args.trl_child:
        return trl_child(args)
    return run_real(args)


if __name__ == "__main__":
    main(sys.argv[1:])
