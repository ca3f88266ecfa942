"""`megatron-pack verify` and `inspect` on split, bucketed and wrapped plans: document-isolated plans
PASS (each piece equals itself alone), a wrapped_attention=cross plan is reported as leaking by
design (not PASS, exit 1), and inspect shows the strategy of each plan."""

from __future__ import annotations

import re

import pytest

PACK_LINE = re.compile(r"^pack \d+: (\d+) samples, .* max \|logit diff\| (\S+)  max \|loss diff\| \S+  (.+)$")
BASE = ["data=synthetic", "data.synthetic_num_samples=40", "packing.packed_sequence_size=64", "model.seq_length=64",
        "verify.num_packs=3"]
CASES = [
    ("split", ["packing.on_overflow=split", "packing.split_overlap=4", "packing.buckets=[24]"], 0, "PASS"),
    ("wrapped-document", ["packing.algorithm=wrapped", "packing.on_overflow=split"], 0, "PASS"),
    ("wrapped-cross", ["packing.algorithm=wrapped", "packing.on_overflow=split", "packing.wrapped_attention=cross",
                       "data.answer_only_loss=false"], 1, "LEAKS BY DESIGN (cross)"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides,code,verdict", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_verify_and_inspect_strategies(tmp_path, capsys, overrides, code, verdict):
    from megatron_pack.cli.inspect import main as inspect_main
    from megatron_pack.cli.prepare import main as prepare_main
    from megatron_pack.cli.verify import main as verify_main

    args = BASE + overrides + [f"data.dataset_dir={tmp_path / 'ds'}"]
    assert prepare_main([a for a in args if not a.startswith("verify.")]) == 0
    capsys.readouterr()
    assert verify_main(args) == code
    out = capsys.readouterr().out
    packs = [PACK_LINE.match(line) for line in out.splitlines()]
    packs = [m for m in packs if m]
    assert len(packs) == 3 and all(m[3] == verdict for m in packs)
    assert sum(int(m[1]) for m in packs) > 3  # some pack held several samples / pieces
    diffs = [float(m[2]) for m in packs]
    if verdict == "PASS":
        assert max(diffs) <= 1e-5
    else:
        assert max(diffs) > 1e-3  # the leak is real and measured, not just labelled
        assert "LEAKS BY DESIGN (not PASS)" in out
    assert inspect_main([str(tmp_path / "ds")]) == 0
    shown = capsys.readouterr().out
    if "wrapped" in overrides[0]:
        attention = "cross" if "cross" in verdict else "document"
        assert f"wrapped ({attention})" in shown and f"wrapped_attention={attention}" in shown
    else:
        assert "bucket 0 (0, 24]" in shown and "split with overlap 4" in shown
