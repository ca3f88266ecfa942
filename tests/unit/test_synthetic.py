"""The embedded synthetic set: deterministic, long-tailed but capped, correct answers, both schemas."""

import numpy as np
import pytest

from megatron_pack.data.formats.synthetic import TASKS, _byte_thd_length, synthetic_record, synthetic_records


def _answer_is_right(record) -> bool:
    if "messages" in record:
        prompt, answer = record["messages"][-2]["content"], record["messages"][-1]["content"]
    else:
        prompt, answer = record["prompt"], record["completion"]
    task, body = prompt.split(": ", 1)
    if task == "copy":
        return answer == body.rstrip("\n")
    if task == "reverse":
        return answer == body.rstrip("\n")[::-1]
    if task == "sort":
        return answer.split() == sorted(body.split(), key=int)
    if task == "add":
        a, b = body.rstrip("=").split("+")
        return int(answer) == int(a) + int(b)
    table, key = body.rsplit("\n", 1)
    return dict(kv.split("=") for kv in table.split("; "))[key.rstrip("?")] == answer


@pytest.mark.parametrize("max_length", [128, 512, 4096], ids=lambda m: f"cap{m}")
def test_lengths_capped_with_a_long_tail(max_length):
    records = synthetic_records(0, 0, 3000, max_length)
    lengths = np.array([_byte_thd_length(r) for r in records])
    assert lengths.max() <= max_length
    assert lengths.min() >= 10
    assert np.median(lengths) < max(120, max_length // 8)           # most samples are short ...
    assert (lengths >= 0.8 * max_length).sum() >= 5                 # ... and the tail reaches the cap
    if max_length == 4096:
        assert lengths.max() > 2000                                   # several thousand bytes


def test_deterministic_and_seeded():
    a = synthetic_records(3, 100, 200, 512)
    assert a == synthetic_records(3, 100, 200, 512) == [synthetic_record(3, i, 512) for i in range(100, 200)]
    assert a != synthetic_records(4, 100, 200, 512)


def test_tasks_schemas_and_answers():
    records = synthetic_records(0, 0, 1000, 512)
    assert {r["task"] for r in records} == set(TASKS)
    num_chat = sum("messages" in r for r in records)
    assert 300 < num_chat < 700
    wrong = [r for r in records if not _answer_is_right(r)]
    assert wrong == []


def test_rejects_tiny_cap():
    with pytest.raises(ValueError, match="max length >= 64"):
        synthetic_record(0, 0, 32)
