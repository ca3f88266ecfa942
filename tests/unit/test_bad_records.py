"""Bad records (issue 21 item 5): ``data.on_bad_record=error`` (default) stops ``prepare`` at the first bad
line in file order; ``skip`` counts every bad record by reason and lists the first 10 with their lines in the
summary and the store's metadata. ShareGPT turns with ``weight: 0`` get no loss.

Every case runs ``megatron-pack prepare`` as typed (tests/_user_path.py); the file mixes good records with
one bad record per reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _user_path import ok, refused, write_jsonl  # noqa: E402

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
REASONS = [  # (reason, the bad JSONL line, a fragment of its one-line message)
    ("malformed_json", '{"messages": [', "malformed JSON"),
    ("empty_conversation", json.dumps({"messages": []}), "must be a non-empty list"),
    ("empty_conversation", json.dumps({"messages": None}), "must be a non-empty list"),
    ("empty_conversation", json.dumps({"conversation": "x"}), "missing key 'messages'"),
    ("turn_without_content", json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}),
     "has no content"),
    ("turn_without_content", json.dumps({"messages": [{"role": "user", "content": "q"},
                                                      {"role": "assistant", "content": ""}]}), "has no content"),
    ("unknown_role", json.dumps({"messages": [{"role": "robot", "content": "q"}]}), "must be one of"),
    ("wrong_role_order", json.dumps({"messages": [{"role": "assistant", "content": "a"}]}), "out of order"),
    ("wrong_role_order", json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
     "out of order"),
]
PREPARE = ["data=files", "data.input=t.jsonl", "packing.packed_sequence_size=64", "data.tokenize_workers=1",
           "data.schema=chat"]


@pytest.mark.parametrize("reason,line,fragment", REASONS, ids=[f"{r[0]}-{i}" for i, r in enumerate(REASONS)])
def test_each_reason_is_an_error_by_default(tmp_path, reason, line, fragment):
    write_jsonl(tmp_path / "t.jsonl", [GOOD, GOOD, line, GOOD])
    out = refused(tmp_path, "prepare", *PREPARE, "data.dataset_dir=ds")
    assert "t.jsonl: line 3:" in out and fragment in out and not (tmp_path / "ds").exists()
    from megatron_pack.data.formats.chat import BAD_RECORD_REASONS

    assert reason in BAD_RECORD_REASONS


def test_skip_counts_every_reason_and_lists_each_with_its_line(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [GOOD] + [line for _, line, _ in REASONS] + [GOOD])
    out = ok(tmp_path, "prepare", *PREPARE, "data.dataset_dir=ds", "data.on_bad_record=skip")
    store = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    assert store["num_samples"] == 2
    bad = store["bad_records"]
    expected = {}
    for reason, _, _ in REASONS:
        expected[reason] = expected.get(reason, 0) + 1
    assert bad["policy"] == "skip" and bad["num_skipped"] == len(REASONS) and bad["by_reason"] == dict(sorted(
        expected.items()))
    counts = ", ".join(f"{r} {n}" for r, n in sorted(expected.items()))
    assert f"skipped {len(REASONS)} bad record(s): {counts}" in out
    for i, (reason, _, fragment) in enumerate(REASONS):  # line i + 2: each with its reason and its one line
        listed = bad["first"][i]
        assert listed["where"].endswith(f"t.jsonl: line {i + 2}") and listed["reason"] == reason
        assert fragment in listed["message"] and f"t.jsonl: line {i + 2}:" in out


def test_error_names_the_first_bad_line_in_file_order(tmp_path):
    """The line reported was 502 (malformed JSON, found while reading) while line 69 (a record the tokenizer
    refuses) came first."""
    lines = [GOOD] * 600
    lines[68] = {"messages": [{"role": "robot", "content": "q"}]}
    lines[501] = '{"messages": ['
    write_jsonl(tmp_path / "t.jsonl", lines)
    out = refused(tmp_path, "prepare", *PREPARE, "data.dataset_dir=ds")
    assert "t.jsonl: line 69:" in out and "line 502" not in out


def test_skip_lists_the_first_ten_and_counts_all(tmp_path):
    lines = [GOOD] * 40
    for i in range(3, 40, 3):
        lines[i] = REASONS[i % len(REASONS)][1]
    write_jsonl(tmp_path / "t.jsonl", lines)
    out = ok(tmp_path, "prepare", *PREPARE, "data.dataset_dir=ds", "data.on_bad_record=skip")
    store = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    bad = store["bad_records"]
    assert bad["num_skipped"] == 13 and sum(bad["by_reason"].values()) == 13 and len(bad["first"]) == 10
    assert [b["where"].rsplit(" ", 1)[1] for b in bad["first"]] == [str(i + 1) for i in range(3, 31, 3)]
    assert store["num_samples"] == 40 - 13 and "skipped 13 bad record(s)" in out and "line 31" in out
    plan = json.loads(next((tmp_path / "ds" / "plans").glob("*/metadata.json")).read_text())
    assert plan["accounting"]["num_records_skipped"] == 13  # read = packed + dropped, and the skipped beside them


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_forked_workers_keep_the_policy_and_the_file_order(tmp_path, policy):
    """Two forked tokenize workers (chunks of 512 lines) decide as one process does: skip gives the same store and
    the same bad records in file order; error names the first bad line although a later chunk also holds one."""
    lines = [GOOD] * 1200
    for i, at in enumerate((70, 600, 1100)):  # one bad record in each of the three chunks
        lines[at] = REASONS[3 * i][1]
    write_jsonl(tmp_path / "t.jsonl", lines)
    stores = {}
    for workers in (1, 2):
        args = ["prepare", "data=files", "data.input=t.jsonl", "packing.packed_sequence_size=64", "data.schema=chat",
                f"data.tokenize_workers={workers}", f"data.dataset_dir=ds{workers}", f"data.on_bad_record={policy}"]
        if policy == "error":
            out = refused(tmp_path, *args)
            assert "t.jsonl: line 71:" in out and "line 601" not in out and "line 1101" not in out
            continue
        ok(tmp_path, *args)
        meta = json.loads((tmp_path / f"ds{workers}" / "metadata.json").read_text())
        assert meta["num_tokenize_workers"] == workers
        stores[workers] = (meta["bad_records"], np.load(tmp_path / f"ds{workers}" / "tokens.npy"),
                           np.load(tmp_path / f"ds{workers}" / "source_line.npy"))
    if policy == "skip":
        (bad, tokens, where), (bad2, tokens2, where2) = stores[1], stores[2]
        assert bad == bad2 and bad["num_skipped"] == 3 and [b["where"].rsplit(" ", 1)[1] for b in bad["first"]] == [
            "71", "601", "1101"]
        assert np.array_equal(tokens, tokens2) and np.array_equal(where, where2) and len(where) == 1197


def test_skip_is_part_of_the_store_identity(tmp_path):
    """A store made with skip holds fewer samples than the file: it must not be reused as the error policy's."""
    from megatron_pack.config import load_config
    from megatron_pack.data.formats.tokenizer import ByteTokenizer
    from megatron_pack.data.prepare import fingerprint, store_inputs

    write_jsonl(tmp_path / "t.jsonl", [GOOD, GOOD])
    prints = {policy: fingerprint(store_inputs(load_config(["data=files", f"data.input={tmp_path / 't.jsonl'}",
                                                             f"data.on_bad_record={policy}"]), ByteTokenizer()))
              for policy in ("error", "skip")}
    assert prints["error"] != prints["skip"]


SHAREGPT = {"conversations": [{"from": "human", "value": "aa"}, {"from": "gpt", "value": "bb", "weight": 0},
                              {"from": "human", "value": "cc"}, {"from": "gpt", "value": "dd", "weight": 1}]}


def _store_sample(ds: Path, i: int = 0) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.load(ds / "offsets.npy")
    tokens, mask = np.load(ds / "tokens.npy"), np.load(ds / "answer_mask.npy")
    return tokens[offsets[i]:offsets[i + 1]], mask[offsets[i]:offsets[i + 1]]


def test_sharegpt_weight_zero_turns_get_no_loss(tmp_path):
    """ShareGPT `weight: 0` turns were trained."""
    write_jsonl(tmp_path / "t.jsonl", [SHAREGPT])
    ok(tmp_path, "prepare", "data=files", "data.input=t.jsonl", "data.format=sharegpt", "data.dataset_dir=ds",
       "packing.packed_sequence_size=64", "data.tokenize_workers=1")
    from megatron_pack.data.formats.tokenizer import ByteTokenizer

    tokens, mask = _store_sample(tmp_path / "ds")
    tok = ByteTokenizer()
    trained = tok.decode(tokens[mask == 1])
    assert trained == "dd<eos>", trained  # the weight-0 answer "bb" and its eos carry no loss
    assert "bb" in tok.decode(tokens)  # ... but stay in the context


def test_sharegpt_weight_zero_with_a_hugging_face_template(tmp_path):
    from _hf import save_tokenizer
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "t.jsonl", [SHAREGPT, {**SHAREGPT, "conversations": [
        {k: v for k, v in m.items() if k != "weight"} for m in SHAREGPT["conversations"]]}])
    ok(tmp_path, "prepare", "data=files", "data.input=t.jsonl", "data.format=sharegpt", "data.dataset_dir=ds",
       "data.tokenizer=tok", "packing.packed_sequence_size=128", "data.tokenize_workers=1")
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    tokens, mask = _store_sample(tmp_path / "ds", 0)
    all_tokens, all_mask = _store_sample(tmp_path / "ds", 1)
    assert tokens.tolist() == all_tokens.tolist()  # the weights change the mask only
    assert "bb" in hf.decode(all_tokens[all_mask == 1]) and "dd" in hf.decode(all_tokens[all_mask == 1])
    assert "bb" not in hf.decode(tokens[mask == 1]) and "dd" in hf.decode(tokens[mask == 1])


def test_a_weight_other_than_0_or_1_is_a_bad_record(tmp_path):
    bad = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b", "weight": 0.5}]}
    write_jsonl(tmp_path / "t.jsonl", [SHAREGPT, bad])
    out = refused(tmp_path, "prepare", "data=files", "data.input=t.jsonl", "data.format=sharegpt",
                  "data.dataset_dir=ds", "packing.packed_sequence_size=64", "data.tokenize_workers=1")
    assert "t.jsonl: line 2:" in out and "weight (0.5) must be 0 or 1" in out


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_online_stream_follows_the_same_policy(tmp_path, policy):
    """packing.online_source=stream tokenizes data.input while training: the same policy, counted in its
    per-epoch accounting (read = packed + dropped, bad_record among the reasons)."""
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.online import OnlineSource
    from megatron_pack.data.formats.sources import DataError

    write_jsonl(tmp_path / "t.jsonl", [GOOD, REASONS[0][1], GOOD, REASONS[6][1], GOOD])
    cfg = load_config(["data=files", f"data.input={tmp_path / 't.jsonl'}", "data.schema=chat", "packing.mode=online",
                       "packing.online_source=stream", "packing.packed_sequence_size=64", "model.seq_length=64",
                       "packing.buffer_size=8",
                       f"data.on_bad_record={policy}"])
    stream = OnlineSource(cfg).pack_stream(shard=0, num_shards=1)
    if policy == "error":
        with pytest.raises(DataError, match="t.jsonl: line 2: malformed JSON"):
            while not stream.finished_epochs:
                stream.next_pack()
        return
    packed = []
    while not stream.finished_epochs:
        packed += [s for s, _ in stream.next_pack()]
    epoch = stream.finished_epochs[0]
    assert sorted(packed) == [0, 2, 4] and epoch["num_samples_read"] == 5
    assert epoch["num_samples_dropped"]["bad_record"] == 2


def _prepare_process(cwd: Path, *argv: str) -> tuple[int, str]:
    """``megatron-pack prepare ARGV`` in a new process, as typed: exit status and stderr, bar and all."""
    import os
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "megatron_pack.cli.main", "prepare", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("workers", ["1", "2"], ids=["inline", "forked"])
def test_the_error_stands_on_its_own_line_after_the_bar(tmp_path, workers):
    """Issue 34 item 12: the bad-record error was written after the tokenize bar's carriage return, glued to it.
    It now starts a line of its own (column 0), one line; the bar above it counts records of a known total."""
    write_jsonl(tmp_path / "t.jsonl", [GOOD] * 600 + [REASONS[6][1]] + [GOOD] * 5)
    status, err = _prepare_process(tmp_path, *PREPARE[:3], f"data.tokenize_workers={workers}", "data.schema=chat",
                                   "data.dataset_dir=ds")
    assert status == 2 and "Traceback" not in err, err
    lines = err.split("\n")
    errors = [i for i, line in enumerate(lines) if "t.jsonl: line 601:" in line]
    assert len(errors) == 1, err  # one line
    assert lines[errors[0]].startswith("megatron-pack prepare: ") and "must be one of" in lines[errors[0]], err
    bars = [line for line in lines if "tokenize" in line]
    assert bars and "/606" in bars[-1], err  # a total: the file's 606 records
