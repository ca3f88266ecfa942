"""Bad-input campaign, end to end through `megatron-pack prepare`.

Every bad input either stops ``prepare`` with exit code 2 and a message naming the file, the
line (JSONL, 1-based) or row (Parquet, 0-based) and the fix, leaving nothing at
``data.dataset_dir``; or becomes a counted drop under the configured policy. For the drops the
accounting invariant is checked against the input itself, line by line: every non-blank line
is either packed (found through the store's ``source_line``) or in exactly one drop reason, and
``read = packed + dropped by reason``. Nothing is lost silently.

Cases proven elsewhere are listed in docs/reliability.md (e.g. the small over-long samples under
each policy: tests/unit/test_prepare.py::test_overflow_policies_and_accounting).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_pack.cli.prepare import main as prepare_main

GOOD = {"prompt": "What is 2+2?", "completion": "4"}
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _jsonl(path: Path, lines: list) -> Path:
    """Write ``lines`` (dicts as JSON, str/bytes verbatim) one per line."""
    raw = [json.dumps(x).encode() if isinstance(x, dict) else (x.encode() if isinstance(x, str) else x)
           for x in lines]
    path.write_bytes(b"".join(r + b"\n" for r in raw))
    return path


def _parquet(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


# id, file name, writer(path), schema, where ("line N" / "row N"), message fragment, fix fragment
ERROR_CASES = [
    ("malformed-json", "t.jsonl", lambda p: _jsonl(p, [GOOD, GOOD, '{"prompt": "a", "completion": ']), "auto",
     "line 3", "malformed JSON", "each line must be one JSON object"),
    ("unterminated-string", "t.jsonl", lambda p: _jsonl(p, [GOOD, '{"prompt": "a, "completion": "b"}']), "auto",  # "at at"
     "line 2", "malformed JSON (Expecting ',' delimiter at column 17)", "each line must be one JSON object"),
    ("unterminated-string-at-end", "t.jsonl",  # the last line, without a newline (json: "... starting at")
     lambda p: p.write_bytes(_jsonl(p, [GOOD]).read_bytes() + b'{"prompt": "a'), "auto",
     "line 2", "malformed JSON (Unterminated string starting at column 12)", "each line must be one JSON object"),
    ("missing-key", "t.jsonl", lambda p: _jsonl(p, [GOOD, {"prompt": "only a prompt"}]), "prompt_completion",
     "line 2", "missing key 'completion'", "set data.prompt_key / data.completion_key"),
    ("renamed-keys", "t.jsonl", lambda p: _jsonl(p, [GOOD, GOOD, {"question": "q", "answer": "a"}]), "auto",
     "line 3", "neither 'messages' (chat) nor 'prompt'+'completion'", "set data.schema"),
    ("number-as-content", "t.jsonl",
     lambda p: _jsonl(p, [CHAT, {"messages": [{"role": "user", "content": 42}]}]), "auto",
     "line 2", "messages[0].content must hold a string 'content' or a list of {type: text, text} parts",
     "store the message text there"),
    ("number-as-completion", "t.jsonl", lambda p: _jsonl(p, [{"prompt": "p", "completion": 7}]), "auto",
     "line 1", "key 'completion' must be a string, got int (7)", "point data.prompt_key / data.completion_key"),
    ("null-messages", "t.jsonl", lambda p: _jsonl(p, [CHAT, CHAT, {"messages": None}]), "auto",
     "line 3", "key 'messages' must be a non-empty list", "write the conversation as a list of messages"),
    ("non-utf8", "t.jsonl", lambda p: _jsonl(p, [GOOD, b'{"prompt": "caf\xe9", "completion": "x"}']), "auto",
     "line 2", "not valid UTF-8 (byte 0xe9 at column 16)", "re-encode the file as UTF-8"),
    ("empty-file", "t.jsonl", lambda p: p.write_bytes(b""), "auto",
     "line 1", "the file is empty", "remove it from data.input"),
    ("empty-sample", "t.jsonl", lambda p: _jsonl(p, [GOOD, {"prompt": "", "completion": ""}]), "auto",
     "line 2", "the sample is empty", "remove the record or fill it in"),
    ("empty-chat", "t.jsonl", lambda p: _jsonl(p, [GOOD, {"messages": []}]), "auto",
     "line 2", "must be a non-empty list", "remove the record"),
    ("roles-out-of-order", "t.jsonl", lambda p: _jsonl(p, [CHAT, {"messages": [
        {"role": "assistant", "content": "answer first"}, {"role": "user", "content": "then the question"}]}]),
     "auto", "line 2", "messages[0].role ('assistant') is out of order as the first message", "fix the record's order"),
    ("user-after-user", "t.jsonl", lambda p: _jsonl(p, [{"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"}]}]),
     "auto", "line 1", "messages[2].role ('user') is out of order after 'user'", "alternating"),
    ("parquet-wrong-schema", "t.parquet", lambda p: _parquet(p, {"question": ["q1", "q2"], "answer": ["a", "b"]}),
     "prompt_completion", "row 0", "missing key 'prompt' (keys present: ['answer', 'question'])",
     "set data.prompt_key"),
    ("parquet-wrong-type", "t.parquet", lambda p: _parquet(p, {"prompt": ["a", "b", "c"], "completion": [1, 2, 3]}),
     "prompt_completion", "row 0", "key 'completion' must be a string, got int (1)", "store text there"),
    ("parquet-null-cell", "t.parquet", lambda p: _parquet(p, {"prompt": ["a", "b", "c"], "completion": ["x", "y", None]}),
     "prompt_completion", "row 2", "key 'completion' must be a string, got NoneType (None)", "store text there"),
    ("pretty-printed-json-array", "t.json",
     lambda p: p.write_text(json.dumps([GOOD, GOOD], indent=2), encoding="utf-8"), "auto",
     "line 1", "malformed JSON", "each line must be one JSON object"),
    ("one-line-json-array", "t.jsonl", lambda p: p.write_text(json.dumps([GOOD, GOOD]) + "\n"), "auto",
     "line 1", "expected a JSON object, got list", "write one record object per line (JSONL)"),
    ("not-parquet", "t.parquet", lambda p: p.write_bytes(b"PAR1 this is not parquet"), "auto",
     "row 0", "not a readable Parquet file", "Parquet"),
]


def _argv(tmp_path: Path, path: Path, schema: str = "auto", *extra: str) -> list[str]:
    return [f"input={path}", f"data.schema={schema}", f"data.dataset_dir={tmp_path / 'ds'}", "data.tokenize_workers=1",
            "packing.packed_sequence_size=64", "model.seq_length=64", *extra]


@pytest.mark.parametrize("name,writer,schema,where,message,fix", [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_bad_input_is_a_clear_error(tmp_path, capsys, name, writer, schema, where, message, fix):
    path = tmp_path / name
    writer(path)
    code = prepare_main(_argv(tmp_path, path, schema))
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{path}: {where}: " in err, err
    assert message in err and fix in err, err
    # nothing half-written is left where training would look, nor any hidden temporary
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds*")), sorted(tmp_path.iterdir())


def _accounting(dataset_dir: Path, plan_dir: Path) -> tuple[dict, set[int]]:
    """The plan's accounting and the input lines it packed (through the store's source_line)."""
    meta = json.loads((plan_dir / "metadata.json").read_text())
    source_line = np.load(dataset_dir / "source_line.npy", allow_pickle=False)
    order = np.load(plan_dir / "sample_order.npy", allow_pickle=False)
    packed = source_line[order].tolist()
    assert len(packed) == len(set(packed)), "a sample is packed twice"
    return meta["accounting"], set(packed)


def assert_accounted(dataset_dir: Path, plan_dir: Path, lines: set[int], dropped: dict[str, set[int]],
                     num_truncated: int = 0) -> None:
    """read = packed + dropped by reason, checked count by count and line by line."""
    acc, packed = _accounting(dataset_dir, plan_dir)
    expected_packed = lines - set().union(*dropped.values())
    assert packed == expected_packed
    assert acc["num_samples_read"] == len(lines) == acc["num_samples_packed"] + sum(acc["num_samples_dropped"].values())
    assert acc["num_samples_packed"] == len(packed)
    assert {k: v for k, v in acc["num_samples_dropped"].items() if v} == {k: len(v) for k, v in dropped.items() if v}
    assert acc["num_samples_truncated"] == num_truncated


def _drop_mix(path: Path) -> tuple[set[int], dict[str, set[int]]]:
    """Good samples, blank lines, samples with nothing to learn and over-long ones; the lines of each."""
    long_answer = {"prompt": "p", "completion": "y" * 200}       # answer survives truncation
    long_prompt = {"prompt": "p" * 200, "completion": "y"}       # truncation cuts the answer away
    no_answer = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "no reply"}]}
    lines = [GOOD, CHAT, no_answer, "", GOOD, long_answer, "   ", long_prompt, no_answer, GOOD]
    _jsonl(path, lines)
    non_blank = {i + 1 for i, x in enumerate(lines) if x not in ("", "   ")}
    return non_blank, {"no_answer_tokens": {3, 9}, "too_long": {6, 8}}


@pytest.mark.parametrize("policy", ["drop", "truncate"], ids=["drop", "truncate"])
def test_counted_drops_balance_line_by_line(tmp_path, capsys, policy):
    path = tmp_path / "mix.jsonl"
    lines, dropped = _drop_mix(path)
    assert prepare_main(_argv(tmp_path, path, "auto", f"packing.on_overflow={policy}")) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    plan_dir = Path(out.split("plan:")[1].split()[0])
    if policy == "truncate":  # line 6 is cut and kept; line 8 loses its answer to the cut and is counted
        dropped = {"no_answer_tokens": {3, 9}, "no_answer_tokens_after_truncation": {8}}
    assert_accounted(tmp_path / "ds", plan_dir, lines, dropped, num_truncated=int(policy == "truncate"))
    store = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    assert store["num_blank_lines_skipped"] == 2 and store["num_samples"] == len(lines)
    assert f"samples read {len(lines)}" in out  # the CLI prints the accounting


def test_50mb_single_line_under_each_overflow_policy(tmp_path, capsys):
    """One 50 MB JSONL line among small ones: one token store, then one plan per policy."""
    path = tmp_path / "big.jsonl"
    big = {"prompt": "summarise: ", "completion": "z" * 50_000_000}
    _jsonl(path, [GOOD, big, CHAT])
    assert path.stat().st_size > 50_000_000
    assert prepare_main(_argv(tmp_path, path)) == 2
    err = capsys.readouterr().err
    assert f"1 sample(s) are longer than the pack allows" in err and f"{path}: line 2: THD length 50000012" in err
    assert "packing.on_overflow=drop" in err and "packing.on_overflow=truncate" in err
    assert not (tmp_path / "ds" / "plans").exists()  # the store is kept for the next plan; no plan was written
    for policy, dropped, num_truncated in (("drop", {"too_long": {2}}, 0), ("truncate", {}, 1)):
        assert prepare_main(_argv(tmp_path, path, "auto", f"packing.on_overflow={policy}")) == 0
        plan_dir = Path(capsys.readouterr().out.split("plan:")[1].split()[0])
        assert_accounted(tmp_path / "ds", plan_dir, {1, 2, 3}, dropped, num_truncated)
        sizes = np.load(plan_dir / "sample_num_ids.npy", allow_pickle=False)
        assert sizes.max() <= 65  # a truncated sample fits the 64-token pack: 64 positions + 1


def test_chat_template_refusal_names_file_and_line(tmp_path, capsys):
    """A Hugging Face chat template that raises (as Gemma's does for a system message) is a clear error."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "hi", "hello", "be", "brief"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                          "{{ raise_exception('System role not supported') }}{% endif %}"
                          "{{ m['content'] }}{{ eos_token }}{% endfor %}")
    fast.save_pretrained(tmp_path / "hf")
    system_chat = {"messages": [{"role": "system", "content": "be brief"}] + CHAT["messages"]}
    path = _jsonl(tmp_path / "t.jsonl", [CHAT, system_chat])
    assert prepare_main(_argv(tmp_path, path, "auto", f"data.tokenizer={tmp_path / 'hf'}")) == 2
    err = capsys.readouterr().err
    assert f"{path}: line 2: the chat template of {tmp_path / 'hf'} refuses this conversation" in err, err
    assert "System role not supported" in err and "use another data.tokenizer" in err
    assert not (tmp_path / "ds").exists()


def test_bad_input_is_a_clear_error_from_worker_processes(tmp_path, capsys):
    """With a tokenize pool (data.tokenize_workers=2) the worker's error reaches the user unchanged."""
    path = _jsonl(tmp_path / "t.jsonl", [GOOD] * 600 + [{"prompt": 3, "completion": "x"}])  # line 601: 2nd chunk
    argv = [a for a in _argv(tmp_path, path) if not a.startswith("data.tokenize_workers=")]
    assert prepare_main(argv + ["data.tokenize_workers=2"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: line 601: key 'prompt' must be a string, got int (3)" in err, err
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds*"))
