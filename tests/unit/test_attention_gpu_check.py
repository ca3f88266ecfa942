"""tests/gpu/check_te_thd.py imports and runs its CPU helpers without CUDA or Transformer Engine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "check_te_thd.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("check_te_thd", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("pack_size,num_seqs,pad_multiple", [(64, 3, 8), (8192, 12, 8), (100, 7, 1)],
                         ids=["small", "default", "no_pad"])
def test_make_pack_fills_the_pack(script, pack_size, num_seqs, pad_multiple):
    cu, cu_pad = script.make_pack(pack_size, num_seqs, pad_multiple)
    assert cu_pad[-1] == pack_size and len(cu) == len(cu_pad) == num_seqs + 1
    for i in range(num_seqs):
        padded, real = cu_pad[i + 1] - cu_pad[i], cu[i + 1] - cu[i]
        assert padded % pad_multiple == 0 and 0 < real <= padded and padded - real < pad_multiple
    assert script.real_rows(cu, cu_pad).numel() == cu[-1]


def test_main_without_gpu_explains_and_exits_2(script, capsys):
    assert script.main([]) == 2
    assert "needs one GPU with Transformer Engine" in capsys.readouterr().err


@pytest.mark.parametrize("argv,window,sink", [([], None, None), (["--window", "127"], (127, 0), None),
                                              (["--window", "7", "--softmax-type", "learnable", "--heads", "4"],
                                               (7, 0), [-1.0, -1 / 3, 1 / 3, 1.0]),
                                              (["--softmax-type", "off-by-one", "--heads", "2"], None, [0.0, 0.0])],
                         ids=["plain", "window", "window_learnable", "off_by_one"])
def test_window_and_sink_options(script, argv, window, sink):
    import argparse

    assert script.window_and_sink(argparse.Namespace(heads=4)) == (None, None)  # checks.py's args name neither
    args = argparse.Namespace(window=-1, softmax_type="vanilla", heads=32)
    for key, value in zip(argv[::2], argv[1::2]):
        name = key.lstrip("-").replace("-", "_")
        setattr(args, name, int(value) if name in ("window", "heads") else value)
    got_window, got_sink = script.window_and_sink(args)
    assert got_window == window
    assert (got_sink is None) == (sink is None) and (sink is None or got_sink.tolist() == pytest.approx(sink))
