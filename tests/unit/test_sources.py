"""Bad input gives an error naming the file and the line (or row); good input streams in order."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_pack.data.formats.sources import DataError, iter_chunks, parse_chunk, resolve_inputs
from megatron_pack.data.store.token_store import init_worker, tokenize_chunk
from megatron_pack.data.formats.chat import SampleSchema

GOOD = json.dumps({"prompt": "p", "completion": "c"})


def _tokenize_all(path, schema="prompt_completion"):
    init_worker("byte", SampleSchema(schema), True)
    return [tokenize_chunk(c) for c in iter_chunks([path], chunk_size=2)]


BAD_JSONL = [
    ("malformed", [GOOD, GOOD, '{"prompt": "p", "completion": '], 3, "malformed JSON"),
    ("missing-key", [GOOD, json.dumps({"prompt": "p"})], 2, "missing key 'completion'"),
    ("wrong-type", [GOOD, GOOD, GOOD, json.dumps({"prompt": "p", "completion": 7})], 4, "must be a string, got int"),
    ("not-an-object", [json.dumps([1, 2])], 1, "expected a JSON object, got list"),
]


@pytest.mark.parametrize("lines,line_no,match", [c[1:] for c in BAD_JSONL], ids=[c[0] for c in BAD_JSONL])
def test_bad_jsonl_names_file_and_line(tmp_path, lines, line_no, match):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=match) as err:
        _tokenize_all(path)
    assert f"{path}: line {line_no}:" in str(err.value)


def test_non_utf8_names_file_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + '{"prompt": "caf\xe9", "completion": "x"}'.encode("latin-1") + b"\n")
    with pytest.raises(DataError, match=r"latin1.jsonl: line 2: not valid UTF-8 \(byte 0xe9"):
        _tokenize_all(path)


@pytest.mark.parametrize("content", [b"", b"\n  \n"], ids=["zero-bytes", "blank-lines"])
def test_empty_file_names_file_and_line(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=r"empty.jsonl: line 1: the file is empty"):
        _tokenize_all(path)


def test_parquet_rows_and_errors(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "completion": ["x", "y", None]}), path)
    with pytest.raises(DataError, match=r"train.parquet: row 2: key 'completion' must be a string, got NoneType"):
        _tokenize_all(path)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match=r"empty.parquet: row 0: the file is empty"):
        _tokenize_all(empty)


def test_positions_and_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n\n{GOOD}\n{GOOD}\n", encoding="utf-8")
    results = _tokenize_all(path)
    assert [r.positions.tolist() for r in results] == [[1], [3, 4]]
    assert sum(r.num_blank for r in results) == 1
    chunk = next(iter_chunks([path], chunk_size=10))
    assert [pos for pos, _ in parse_chunk(chunk)] == [1, 3, 4]


def test_resolve_inputs_file_dir_glob(tmp_path):
    for name in ("b.jsonl", "a.parquet", "notes.txt"):
        (tmp_path / name).write_text("x")
    assert [p.name for p in resolve_inputs(str(tmp_path))] == ["a.parquet", "b.jsonl"]
    assert [p.name for p in resolve_inputs(str(tmp_path / "*.jsonl"))] == ["b.jsonl"]
    assert [p.name for p in resolve_inputs(str(tmp_path / "b.jsonl"))] == ["b.jsonl"]
    with pytest.raises(DataError, match="matches no .jsonl"):
        resolve_inputs(str(tmp_path / "missing*.jsonl"))
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        resolve_inputs(str(tmp_path / "notes.txt"))
