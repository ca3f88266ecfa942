"""Benchmark: `prepare` end to end on the synthetic set (tokenize -> token store -> plan -> report).

Each measurement runs in a fresh process (clean peak RSS). Printed: samples/s, tokens/s, peak RSS
of the main process and of the largest worker, and ratios against baselines measured in the
same run: one tokenize worker on the first 100k samples, and re-planning the finished store at
another seed (which must not re-tokenize). Target: peak RSS < 2 GB for 1M samples.

    .venv/bin/python bench/prepare.py [--num-samples 1000000] [--pack-size 4096] [--workdir DIR]

``--chat`` measures a local Hugging Face chat tokenizer instead (a byte-level BPE with an 8,000
token vocabulary and a ChatML template with ``{% generation %}`` markers, trained here: no
download) on ``--chat-records`` (default 20,000) chat records of 1-3 turns, against transformers'
own per-sample ``apply_chat_template(..., return_assistant_tokens_mask=True)`` loop, measured in
the same run and interleaved (``--repeats`` rounds). Printed per round: the loop's seconds, the
tokenizing seconds of ``prepare`` at default settings (``tokenize_seconds`` in the store metadata),
its fixed cost (a 100-record file, whole command) and peak RSS at two input sizes (memory flat);
wall and CPU seconds both, since a shared machine's wall clock is noisy. Also per round: the
rendered texts' Rust encode alone on one thread, which both paths run, and the ceiling it puts on
any speed-up (loop seconds / (encode seconds / cores)).

    .venv/bin/python bench/prepare.py --chat [--chat-records 20000] [--repeats 3]

``--real`` runs ``bench/prepare_real.py``: real tokenizers (Mistral's SentencePiece and Tekken,
from the installed ``mistral-common``) against transformers' loop and TRL's preparation
(``pip install -e ".[bench]"`` first; see that file and docs/benchmarks.md).

    .venv/bin/python bench/prepare.py --real [--sizes 20000,200000] [--repeats 2] [--repeats-large 1]
    .venv/bin/python bench/prepare.py --real --paired --workdir DIR [--records 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(args) -> None:
    from megatron_pack.config import Config, DataConfig, PackingConfig
    from megatron_pack.data.store.atomic import read_json
    from megatron_pack.data.prepare import prepare

    cfg = Config(data=DataConfig(source="synthetic", synthetic_num_samples=args.num_samples,
                                 dataset_dir=args.dataset_dir, tokenize_workers=args.workers),
                 packing=PackingConfig(packed_sequence_size=args.pack_size, seed=args.seed))
    start = time.perf_counter()
    plan_dir = prepare(cfg, progress=False)
    seconds = time.perf_counter() - start
    store = read_json(Path(args.dataset_dir) / "metadata.json")
    plan = read_json(plan_dir / "metadata.json")
    print(json.dumps({"seconds": seconds, "num_samples": store["num_samples"], "num_tokens": store["num_tokens"],
                      "tokenize_seconds": store["tokenize_seconds"], "workers": store["num_tokenize_workers"],
                      "packs": plan["num_bins"], "lower_bound": plan["lower_bound_bins"],
                      "efficiency": plan["packing_efficiency"],
                      "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))


def run(num_samples: int, dataset_dir: Path, workers: int, pack_size: int, seed: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", "--num-samples", str(num_samples), "--dataset-dir", str(dataset_dir),
           "--workers", str(workers), "--pack-size", str(pack_size), "--seed", str(seed)]
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["wall_seconds"] = time.perf_counter() - start
    return result


CHATML_MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
                 "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_chat_inputs(work: Path, num_records: int) -> tuple[Path, Path, Path]:
    """A local chat tokenizer and two chat JSONL files (``num_records`` and 100 records)."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(rng.integers(2, 9)))) for _ in range(3000)]
    zipf = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    zipf /= zipf.sum()

    def text(n: int) -> str:
        return " ".join(rng.choice(words, size=n, p=zipf))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text(200) for _ in range(3000)], trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<pad>", "<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = CHATML_MARKED
    fast.save_pretrained(work / "tokenizer")
    with open(work / "chat.jsonl", "w") as big, open(work / "chat100.jsonl", "w") as small:
        for i in range(num_records):
            messages = [{"role": "system", "content": text(10)}] if i % 3 == 0 else []
            for _ in range(int(rng.integers(1, 4))):
                messages += [{"role": "user", "content": text(int(rng.integers(5, 60)))},
                             {"role": "assistant", "content": text(int(rng.integers(5, 120)))}]
            line = json.dumps({"messages": messages}) + "\n"
            big.write(line)
            if i < 100:
                small.write(line)
    return work / "tokenizer", work / "chat.jsonl", work / "chat100.jsonl"


def hf_loop_child(args) -> None:
    """transformers' per-sample loop, the baseline: one apply_chat_template call per record."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    records = [json.loads(line)["messages"] for line in open(args.input)]
    start, cpu = time.perf_counter(), time.process_time()
    num_tokens = 0
    for messages in records:
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        num_tokens += len(out["input_ids"])
    print(json.dumps({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
                      "num_tokens": num_tokens}))


def encode_only_child(args) -> None:
    """The floor under any tokenize path: the Rust encode of the rendered texts alone, one thread.

    transformers' loop and ``prepare`` both run this same ``encode_batch`` on the same texts, so
    on ``cores`` cores no path can beat ``loop / (encode_one_thread / cores)``.
    """
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import AutoTokenizer
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    records = [json.loads(line)["messages"] for line in open(args.input)]
    start = time.perf_counter()
    rendered, _ = render_jinja_template(conversations=records, tools=None, documents=None,
                                        chat_template=tok.get_chat_template(), return_assistant_tokens_mask=True,
                                        continue_final_message=False, add_generation_prompt=False,
                                        **tok.special_tokens_map)
    render = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(rendered), 512):
        tok.backend_tokenizer.encode_batch(rendered[i:i + 512], add_special_tokens=False)
    print(json.dumps({"render_seconds": render, "encode_seconds": time.perf_counter() - start,
                      "encode_cpu_seconds": time.process_time() - cpu}))


def _timed(cmd: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds (this child and its children) of a command, and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return time.perf_counter() - start, cpu, out


def run_chat(args) -> None:
    import shutil

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_prepare_chat_"))
    tokenizer, big, small = make_chat_inputs(work, args.chat_records)
    half = work / "chat_half.jsonl"
    half.write_text("".join(open(big).readlines()[: args.chat_records // 2]))
    cli = [sys.executable, "-m", "megatron_pack.cli.main", "prepare", f"tokenizer={tokenizer}",
           "packing.packed_sequence_size=4096", "packing.on_overflow=drop"]
    print(f"chat records: {args.chat_records:,} (1-3 turns), tokenizer {tokenizer} (fast BPE, 8k vocab, "
          f"ChatML with generation markers), {os.cpu_count()} cores, work dir {work}")
    print(f"{'round':>5} {'hf loop s':>9} {'cpu':>6} {'prepare tok s':>13} {'cpu':>6} {'wall x':>6} {'cpu x':>6} "
          f"{'fixed s':>8} {'cpu':>6} {'RSS full':>9} {'RSS half':>9}")
    ratios, fixed, floors = [], [], []
    for r in range(args.repeats):
        loop = json.loads(_timed([sys.executable, __file__, "--hf-loop-child", "--tokenizer", str(tokenizer),
                                  "--input", str(big)])[2].strip().splitlines()[-1])
        floor = json.loads(_timed([sys.executable, __file__, "--encode-only-child", "--tokenizer", str(tokenizer),
                                   "--input", str(big)])[2].strip().splitlines()[-1])
        floors.append(loop["seconds"] / (floor["encode_seconds"] / (os.cpu_count() or 1)))
        print(f"      encode alone, one thread: {floor['encode_seconds']:.2f} s ({floor['encode_seconds'] / loop['seconds']:.0%}"
              f" of the loop), render alone {floor['render_seconds']:.2f} s: no path can beat "
              f"{floors[-1]:.2f}x the loop on {os.cpu_count()} cores")
        rows = {}
        for name, path in (("full", big), ("half", half), ("fixed", small)):
            out_dir = work / f"ds_{name}"
            shutil.rmtree(out_dir, ignore_errors=True)
            wall, cpu, _ = _timed([*cli, f"input={path}", f"output={out_dir}"])
            meta = json.loads((out_dir / "metadata.json").read_text())
            rss = _child_peak_rss(cli + [f"input={path}", f"output={work / f'rss_{name}'}"]) if name != "fixed" else 0
            rows[name] = {"wall": wall, "cpu": cpu, "tokenize_seconds": meta["tokenize_seconds"],
                          "tokenize_cpu": meta.get("tokenize_cpu_seconds", float("nan")), "rss": rss}
        ratio = loop["seconds"] / rows["full"]["tokenize_seconds"]
        cpu_ratio = loop["cpu_seconds"] / rows["full"]["tokenize_cpu"]
        ratios.append((ratio, cpu_ratio))
        fixed.append((rows["fixed"]["wall"], rows["fixed"]["cpu"]))
        print(f"{r:>5} {loop['seconds']:>9.2f} {loop['cpu_seconds']:>6.1f} {rows['full']['tokenize_seconds']:>13.2f} "
              f"{rows['full']['tokenize_cpu']:>6.1f} {ratio:>5.2f}x {cpu_ratio:>5.2f}x {rows['fixed']['wall']:>8.2f} "
              f"{rows['fixed']['cpu']:>6.1f} {rows['full']['rss']:>7.0f}MB {rows['half']['rss']:>7.0f}MB")
    mid = len(ratios) // 2
    print(f"prepare tokenizing vs transformers' per-sample loop: median {sorted(r[0] for r in ratios)[mid]:.2f}x wall, "
          f"{sorted(r[1] for r in ratios)[mid]:.2f}x CPU (goal >= 3x); fixed cost median "
          f"{sorted(f[0] for f in fixed)[mid]:.2f} s wall, {sorted(f[1] for f in fixed)[mid]:.2f} s CPU (goal < 5 s); "
          f"ceiling set by the encode alone: {sorted(floors)[mid]:.2f}x")


def _child_peak_rss(cmd: list[str]) -> float:
    """Peak RSS in MB of a command run in a fresh process (its own getrusage, not this process's)."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    return float(subprocess.run([sys.executable, "-c", code, *cmd], check=True, capture_output=True,
                                text=True).stdout.strip())


def main() -> None:
    if "--real" in sys.argv:  # real tokenizers against transformers' loop and TRL: bench/prepare_real.py
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        rest = [a for a in sys.argv[1:] if a not in ("--real", "--paired", "--against-trl")]
        if "--against-trl" in sys.argv:  # fixed cost with a model folder, and end to end against TRL: prepare_trl.py
            from prepare_trl import main as against_trl_main

            return against_trl_main(rest)
        if "--paired" in sys.argv:  # the work per token, robust to a loaded machine: bench/real_paired.py
            from real_paired import main as paired_main

            return paired_main(rest)
        from prepare_real import main as real_main

        return real_main(rest)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=1_000_000)
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--dataset-dir")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true", help="the HF chat tokenizer case (see the docstring)")
    parser.add_argument("--chat-records", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-loop-child", action="store_true")
    parser.add_argument("--encode-only-child", action="store_true")
    parser.add_argument("--tokenizer")
    parser.add_argument("--input")
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.hf_loop_child:
        return hf_loop_child(args)
    if args.encode_only_child:
        return encode_only_child(args)
    if args.chat:
        return run_chat(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_prepare_"))
    base_n = min(100_000, args.num_samples)
    base = run(base_n, work / "baseline", 1, args.pack_size)
    full = run(args.num_samples, work / "full", 0, args.pack_size)
    replan = run(args.num_samples, work / "full", 0, args.pack_size, seed=1)
    print(f"synthetic set, pack size {args.pack_size}, {full['workers']} tokenize workers, work dir {work}")
    print(f"{'run':<34} {'samples':>10} {'seconds':>8} {'samples/s':>10} {'tokens/s':>11} {'RSS main':>9} {'RSS worker':>10}")
    for name, r in (("baseline: 1 worker", base), ("prepare (all workers)", full), ("re-plan, seed 1 (same store)", replan)):
        print(f"{name:<34} {r['num_samples']:>10,} {r['seconds']:>8.1f} {r['num_samples'] / r['seconds']:>10,.0f} "
              f"{r['num_tokens'] / r['seconds']:>11,.0f} {r['rss_main_mb']:>7.0f}MB {r['rss_worker_mb']:>8.0f}MB")
    speed = (full["num_samples"] / full["seconds"]) / (base["num_samples"] / base["seconds"])
    print(f"throughput vs 1 worker: {speed:.2f}x; tokenize share of prepare: {full['tokenize_seconds'] / full['seconds']:.0%}")
    print(f"re-plan at a new seed: {replan['seconds']:.2f} s = {full['seconds'] / replan['seconds']:.0f}x faster than "
          f"the full prepare (no re-tokenization); packs {full['packs']:,} (lower bound {full['lower_bound']:,}), "
          f"efficiency {full['efficiency']}%")
    peak = max(full["rss_main_mb"], full["rss_worker_mb"])
    print(f"peak RSS {peak:.0f} MB per process (target < 2048 MB): {'OK' if peak < 2048 else 'OVER'}")


if __name__ == "__main__":
    main()
