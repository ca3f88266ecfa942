"""``bench/prepare.py --real --paired``: the work per token, measured so a shared machine's load
cannot fake it.

On a machine where other jobs take the cores, wall and even CPU seconds of one run swing by 2x
(contention stretches every instruction). Here each path runs on the same 1,000 records in
one process, alternately, ``--rounds`` times, and the minimum CPU seconds of each is kept (load
only ever adds): transformers' per-sample loop (``apply_chat_template`` per record; the prefix
rule without markers), ``prepare``'s tokenizing of the same records (``tokenize_chunk`` on the
raw JSONL chunks: JSON parsing, record checks, rendering, encoding, masks, arrays) and, inside
it, the Rust ``encode_batch`` alone (the floor: both paths encode the same texts). Then the
fixed cost: the whole ``prepare`` command on 100 records, minimum over rounds, wall and CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    sys.path.insert(0, str(HERE))
    from prepare_real import _prefix_rule
    from real_inputs import make_records, make_tokenizers
    from transformers import AutoTokenizer

    from megatron_pack.data.formats import fast_chat
    from megatron_pack.data.formats.sources import iter_chunks
    from megatron_pack.data.formats.chat import SampleSchema
    from megatron_pack.data.store import token_store as ts

    work = Path(args.workdir)
    folders = make_tokenizers(work)
    raw = work / f"paired_{args.records}.jsonl"
    plain = make_records(raw, args.records, seed=7)
    conversations = [json.loads(line)["messages"] for line in open(plain)]
    small = work / "records_100.jsonl"
    if not small.is_file():
        make_records(small, 100, seed=1)
    print(f"work per token, minimum CPU over {args.rounds} alternating rounds on {args.records:,} records, one "
          f"process; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'tokenizer':<16} {'tokens':>8} {'loop us/tok':>11} {'prepare us/tok':>14} {'encode us/tok':>13} "
          f"{'rest us/tok':>11} {'prep/loop':>9} {'fixed wall s':>12} {'fixed cpu s':>11} "
          f"{'cpu/loop 20k':>12} {'cpu/loop 200k':>13}")
    encode_cpu = [0.0]
    real_backend = fast_chat._backend

    class Timed:  # the Rust encode's CPU inside prepare's own path
        def __init__(self, inner):
            self.inner = inner

        def encode_batch(self, texts, **kwargs):
            start = time.process_time()
            out = self.inner.encode_batch(texts, **kwargs)
            encode_cpu[0] += time.process_time() - start
            return out

        def __getattr__(self, name):
            return getattr(self.inner, name)

    fast_chat._backend = lambda tok: Timed(real_backend(tok))
    for key, folder in folders.items():
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        marked = "{% generation %}" in hf.chat_template
        ts.init_worker(str(folder), SampleSchema("auto"), True)
        chunks = list(iter_chunks([raw], 512))
        best = {"loop": 1e9, "prepare": 1e9, "encode": 1e9}
        num_tokens = 0
        for _ in range(args.rounds):
            start = time.process_time()
            for messages in conversations:
                if marked:
                    hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                else:
                    _prefix_rule(hf, messages)
            best["loop"] = min(best["loop"], time.process_time() - start)
            encode_cpu[0] = 0.0
            start = time.process_time()
            num_tokens = sum(int(ts.tokenize_chunk(c).num_ids.sum()) for c in chunks)
            best["prepare"] = min(best["prepare"], time.process_time() - start)
            best["encode"] = min(best["encode"], encode_cpu[0])
        fixed_wall, fixed_cpu = _fixed(folder, small, work, args.rounds)
        per = {k: v / num_tokens * 1e6 for k, v in best.items()}
        per_record = num_tokens / args.records
        ratio = {n: (fixed_cpu + best["prepare"] / num_tokens * t) / (best["loop"] / num_tokens * t)
                 for n, t in (("20k", per_record * 20_000), ("200k", per_record * 200_000))}
        print(f"{key:<16} {num_tokens:>8,} {per['loop']:>11.2f} {per['prepare']:>14.2f} {per['encode']:>13.2f} "
              f"{per['prepare'] - per['encode']:>11.2f} {per['prepare'] / per['loop']:>9.2f} {fixed_wall:>12.2f} "
              f"{fixed_cpu:>11.2f} {ratio['20k']:>12.2f} {ratio['200k']:>13.2f}", flush=True)
    print("cpu/loop at 20k / 200k records: (fixed CPU + prepare CPU per token x tokens) / (loop CPU per token x "
          "tokens), at this slice's tokens per record")


def _fixed(folder: Path, small: Path, work: Path, rounds: int) -> tuple[float, float]:
    """Minimum wall and CPU seconds (the command and its children) of ``prepare`` on 100 records."""
    import resource
    import shutil

    best_wall = best_cpu = 1e9
    for _ in range(rounds):
        out = work / "ds_paired_fixed"
        shutil.rmtree(out, ignore_errors=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "megatron_pack.cli.main", "prepare", f"tokenizer={folder}",
                        f"input={small}", f"output={out}", "packing.packed_sequence_size=4096"], check=True,
                       capture_output=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
    return best_wall, best_cpu


if __name__ == "__main__":
    main(sys.argv[1:])
