"""Fuzz: whatever a JSONL file holds, `megatron-pack prepare` never crashes with a traceback.

Hypothesis writes files mixing valid prompt/completion and chat records with arbitrary JSON
values, records whose known keys hold arbitrary values, raw bytes, blank lines and strings with
unpaired surrogate escapes (``"\\ud800"``, valid JSON but not valid Unicode). Every run must end
in exactly one of two ways:

* exit 2 with one clear message naming this file and a line (``<file>: line N: ...``), the
  first bad line in the file; nothing is left at ``data.dataset_dir``; or
* exit 0 with the accounting balanced against the input: ``read`` = the non-blank lines,
  ``read = packed + dropped by reason``.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)
TEXT = st.text(max_size=30)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "bot", None])


def _good_pc():
    return st.builds(lambda p, c: json.dumps({"prompt": p, "completion": c}), TEXT, TEXT.filter(bool))


def _good_chat():
    return st.builds(lambda u, a: json.dumps({"messages": [{"role": "user", "content": u},
                                                           {"role": "assistant", "content": a}]}), TEXT, TEXT)


def _wild_known_keys():
    return st.builds(lambda key, value: json.dumps({key: value}), st.sampled_from(["prompt", "completion", "messages"]),
                     JSON_VALUES) | st.builds(
        lambda roles, contents: json.dumps({"messages": [{"role": r, "content": c} for r, c in zip(roles, contents)]}),
        st.lists(ROLES, max_size=4), st.lists(JSON_VALUES | TEXT, max_size=4))


LINES = st.one_of(
    _good_pc(), _good_chat(), _wild_known_keys(),
    JSON_VALUES.map(json.dumps),
    st.builds(lambda p: '{"prompt": "' + p + '\\ud800", "completion": "x"}', st.text("abc", max_size=3)),
    st.binary(max_size=20).map(lambda b: b.replace(b"\n", b" ").decode("latin-1")),
    st.just(""),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LINES, min_size=1, max_size=8))
@example([json.dumps({"prompt": "q", "completion": "a"}), "", json.dumps({"messages": [{"role": "user"}]})])
@example([json.dumps({"prompt": "q", "completion": "a"}), '{"prompt": "\\ud800", "completion": "x"}'])
@example([json.dumps({"prompt": "q", "completion": "a"}), "", json.dumps({"prompt": "p", "completion": "c"})])
def test_prepare_never_crashes_on_any_jsonl(lines):
    from megatron_pack.cli.prepare import main as prepare_main

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.jsonl"
        # json.dumps output is ASCII; only the raw-bytes lines are not, and latin-1 gives their bytes back
        raw_lines = [line.encode("latin-1") for line in lines]
        path.write_bytes(b"\n".join(raw_lines) + b"\n")
        argv = [f"input={path}", f"data.dataset_dir={tmp}/ds", "data.tokenize_workers=1",
                "packing.packed_sequence_size=256", "model.seq_length=256", "packing.on_overflow=drop"]
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = prepare_main(argv)  # any exception here is the bug this test hunts
        message = err.getvalue()
        if code == 2:
            located = re.search(re.escape(str(path)) + r": line (\d+): ", message)
            everything_dropped = "is left to pack" in message
            assert located or everything_dropped, message
            assert not (Path(tmp) / "ds" / "plans").exists() or everything_dropped
            return
        assert code == 0, message
        non_blank = sum(1 for r in raw_lines if r.strip())
        read = int(re.search(r"samples read (\d+)", out.getvalue()).group(1))
        assert read == non_blank
