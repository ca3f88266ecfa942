"""Lost data is visible (issue 21 item 4): the prepare summary, ``inspect``, report.json and report.png show,
per plan, the tokens and answer targets kept and lost by the overflow policy and by dropped records, as
counts and shares; prepare warns on one line when more than 5% of the answer targets are lost to the policy.

Hand-computed on the byte tokenizer (``<bos> prompt completion <eos>``; a sample of ``n`` ids has ``n - 1``
positions, its targets are the completion and eos), pack 16, pad multiple 1:

| line | record | ids n | positions | targets | truncate: kept positions / targets | split: kept |
|---|---|---|---|---|---|---|
| 1 | ab -> cd | 6 | 5 | 3 | 5 / 3 (fits) | 5 / 3 |
| 2 | abcdefghij -> klmnopqrst | 22 | 21 | 11 | 16 / 6 (cut after 6 answer tokens) | 21 / 11 (2 pieces) |
| 3 | x * 20 -> y | 23 | 22 | 2 | 0 / 0 (no answer after the cut: dropped) | 6 / 2 (its first piece has no answer) |
| 4 | chat, user turn only | 5 | 4 | 0 | 0 / 0 (no answer tokens: a dropped record) | 0 / 0 |
| 5 | malformed JSON | - | - | - | skipped (data.on_bad_record=skip) | skipped |

truncate: kept 21 of 52 positions, 9 of 16 targets; lost to the policy 5 + 22 = 27 positions and 5 + 2 = 7
targets (43.75% > 5%: the warning); lost to dropped records 4 positions, 0 targets; 1 record skipped.
split: kept 32 of 52 positions (the 16 positions of line 3's first piece are lost), every target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _user_path import ok, plan_names, write_jsonl  # noqa: E402

RECORDS = [{"prompt": "ab", "completion": "cd"}, {"prompt": "abcdefghij", "completion": "klmnopqrst"},
           {"prompt": "x" * 20, "completion": "y"}, {"messages": [{"role": "user", "content": "hi"}]},
           '{"prompt": ']
CASES = [  # (policy, tokens (read, kept, lost to the policy, lost to dropped records), targets (the same), warns)
    ("truncate", (52, 21, 27, 4), (16, 9, 7, 0), True),
    ("split", (52, 32, 16, 4), (16, 16, 0, 0), False),
    ("drop", (52, 5, 43, 4), (16, 3, 13, 0), True),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lost")
    write_jsonl(root / "t.jsonl", RECORDS)
    return root


@pytest.mark.parametrize("policy,tokens,targets,warns", CASES, ids=[c[0] for c in CASES])
def test_kept_and_lost_tokens_and_targets_by_hand(work, policy, tokens, targets, warns):
    ds = work / f"ds_{policy}"
    out = ok(work, "prepare", "data=files", "data.input=t.jsonl", f"data.dataset_dir={ds}",
             "packing.packed_sequence_size=16", f"packing.on_overflow={policy}", "data.on_bad_record=skip",
             "data.tokenize_workers=1")
    (name,) = plan_names(ds)
    lost = json.loads((ds / "plans" / name / "metadata.json").read_text())["lost_data"]
    for what, numbers in (("tokens", tokens), ("answer_targets", targets)):
        read, kept, by_policy, by_records = numbers
        assert lost[what] == {"read": read, "kept": kept, "lost_to_overflow": by_policy,
                              "lost_to_dropped_records": by_records}, what
        assert read == kept + by_policy + by_records  # nothing unaccounted
    assert lost["num_records_skipped"] == 1 and lost["on_overflow"] == policy
    kept_line = (f"kept {tokens[1]} of {tokens[0]} tokens ({tokens[1] / tokens[0]:.1%}) and {targets[1]} of "
                 f"{targets[0]} answer targets ({targets[1] / targets[0]:.1%})")
    assert kept_line in out
    assert (f"lost to packing.on_overflow={policy}: {tokens[2]} tokens ({tokens[2] / tokens[0]:.1%}), {targets[2]} "
            f"answer targets ({targets[2] / targets[0]:.1%})") in out
    assert (f"lost to dropped records: {tokens[3]} tokens ({tokens[3] / tokens[0]:.1%}), {targets[3]} answer targets "
            f"(0.0%); 1 bad record skipped") in out
    warning = [line for line in out.splitlines() if "of the answer targets" in line and "WARNING" in line]
    assert len(warning) == int(warns), out
    if warns:
        assert f"packing.on_overflow={policy} loses {targets[2] / targets[0]:.1%}" in warning[0]
        assert "packing.on_overflow=split" in warning[0] and "packing.packed_sequence_size=22" in warning[0]
    shown = ok(work, "inspect", str(ds))
    assert kept_line in shown
    report = json.loads((ds / "plans" / name / "report.json").read_text())
    assert report["lost_data"] == lost
    from megatron_pack.data.packing.report import report_figure

    figure = report_figure(report)
    assert kept_line in figure.suptitle  # the lines over the panels, joined


def test_nothing_lost_says_so(work, tmp_path):
    write_jsonl(tmp_path / "t.jsonl", RECORDS[:1] * 3)
    out = ok(tmp_path, "prepare", "data=files", "data.input=t.jsonl", "data.dataset_dir=ds",
             "packing.packed_sequence_size=16", "data.tokenize_workers=1")
    assert "kept 15 of 15 tokens (100.0%) and 9 of 9 answer targets (100.0%); nothing lost" in out
    assert "WARNING" not in out
