"""The first minutes with the command line (issue 21 item 6), each through the real CLI:

- ``--cfg job`` prints the config before the dataset is prepared, naming the values the dataset will set;
- a value typo gets the nearest value as its fix (``sharegtp`` -> ``sharegpt``, ``trunc`` -> ``truncate``);
- ``verify`` with ``model.pretrained`` runs on that folder's weights (and says so);
- the step line keeps to about 160 characters (loss, lr, tokens/s, padding, step time, ETA); the rest is
  in metrics.jsonl and TensorBoard;
- every warning is printed once, by rank 0.

The resolved config in the run folder with a one-line console summary, and warnings once per run under
torchrun, are checked on real 2-process runs in tests/functional/test_user_path_matrix.py.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _user_path import chat, ok, refused, write_jsonl  # noqa: E402


@pytest.mark.parametrize("command", ["train", "verify"])
def test_cfg_job_before_the_dataset_is_prepared(tmp_path, command):
    """`train --cfg job` failed when the dataset was not prepared yet."""
    out = ok(tmp_path, command, "--cfg", "job", "experiment=quickstart", "data.dataset_dir=not_yet",
             "train.lr=1e-4")
    resolved = yaml.safe_load(out.split("\n" + "data.dataset_dir (not_yet) is not prepared yet", 1)[0])
    assert resolved["train"]["lr"] == 1e-4 and resolved["data"]["dataset_dir"] == "not_yet"
    assert "is not prepared yet" in out and "packing.packed_sequence_size" in out and "data.tokenizer" in out
    assert "train.lr" not in out.split("is not prepared yet", 1)[1]  # set here: it does not come from the dataset
    assert not (tmp_path / "not_yet").exists() and not (tmp_path / "runs").exists()


TYPOS = [  # (override, the fix the message must name)
    ("data.format=sharegtp", "set data.format=sharegpt"),
    ("packing.on_overflow=trunc", "set packing.on_overflow=truncate"),
    ("packing.algorithm=bdf", "set packing.algorithm=bfd"),
    ("packing.algorithm=wraped", "set packing.algorithm=wrapped"),
    ("data.on_bad_record=skp", "set data.on_bad_record=skip"),
]


@pytest.mark.parametrize("override,fix", TYPOS, ids=[t[0] for t in TYPOS])
def test_a_value_typo_suggests_the_nearest_value(tmp_path, override, fix):
    out = refused(tmp_path, "prepare", "--cfg", "job", override)
    assert fix in out, out


def test_verify_runs_on_the_pretrained_weights(tmp_path):
    """verify with model.pretrained said (and looked like) a random init."""
    import torch
    from _hf import make_family
    from transformers import AutoModelForCausalLM

    model = make_family(tmp_path, "llama_tied", name="model")
    write_jsonl(tmp_path / "t.jsonl", [chat(i, 4) for i in range(8)])
    ok(tmp_path, "prepare", "data=files", "data.input=t.jsonl", f"data.tokenizer={model}", "data.dataset_dir=ds",
       "packing.packed_sequence_size=128", "data.tokenize_workers=1")
    out = ok(tmp_path, "verify", "data.dataset_dir=ds", f"model.pretrained={model}", "verify.num_packs=1")
    assert f"weights model.pretrained ({model})" in out and "random init" not in out
    # our packed loss of the first sample equals transformers' loss on the same weights (not a random model's)
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("sample "))
    sample_id, packed = int(line.split()[1].rstrip(":")), float(line.split("loss packed ")[1].split()[0])
    from megatron_pack.data.batches.dataset import PackedSFTDataset

    sample = next(s for s in PackedSFTDataset(tmp_path / "ds")[0] if s["sample_id"] == sample_id)
    ids, mask = torch.tensor(sample["input_ids"]), torch.tensor(sample["loss_mask"])
    logits = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(ids[None, :-1]).logits[0]
    losses = torch.nn.functional.cross_entropy(logits.double(), ids[1:], reduction="none")
    assert packed == pytest.approx(float((losses * mask[1:]).sum() / mask[1:].sum()), abs=1e-4)


def test_the_step_line_keeps_to_about_160_characters():
    """Step lines ran to 350-800 characters; the breakdowns stay in metrics.jsonl and TensorBoard."""
    from megatron_pack.training.metrics import StepMetrics

    m = StepMetrics(step=12345, lm_loss=12.3456789, target_tokens=123456, real_tokens=1234567, slots=1300000,
                    samples=999, grad_norm=1.0, lr=3e-4, step_time_s=12.345, epoch=1.25, consumed_samples=10**7,
                    consumed_target_tokens=10**9, elapsed_s=36000.0, eta_s=360000.0, val_loss=2.345678,
                    imbalance_before=1.3, imbalance_after=1.01, bucket_real_tokens=[100, 2000, 30000, 400000],
                    source_loss={f"source{i}": 1.0 for i in range(8)},
                    source_target_share={f"source{i}": 0.125 for i in range(8)},
                    val_source_loss={f"source{i}": 1.0 for i in range(8)},
                    val_source_target_share={f"source{i}": 0.125 for i in range(8)},
                    model_tflops_per_device=412.345, mfu=0.41694)
    line = m.line(100000)
    assert len(line) <= 160, (len(line), line)
    for fragment in ("step 12345/100000", "loss 12.345679", "val loss 2.345678", "lr 3.00e-04", "tok/s",
                     "412 TFLOP/s/dev (MFU 41.7%)", "padding 5.0%", "12345 ms", "ETA 100h00m00s"):
        assert fragment in line, (fragment, line)
    record = m.record()  # nothing left out of the record
    assert record["source_loss"]["source7"] == 1.0 and record["consumed_target_tokens"] == 10**9


@pytest.mark.parametrize("rank,shown", [("0", 1), ("1", 0)])
def test_each_warning_once_by_rank_0(rank, shown, capsys):
    """megatron-core warns its TE / Apex fallback from several modules, on every rank (4 lines on 2 ranks)."""
    from megatron_pack.cli.main import warn_once_on_rank_0

    with warnings.catch_warnings():
        warnings.simplefilter("default")  # as outside pytest (pyproject ignores UserWarning in tests)
        warn_once_on_rank_0(rank)
        for i in range(3):  # three modules, one message each
            warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, f"m{i}.py", 1)
            warnings.warn_explicit("Transformer Engine is not installed. Falling back to Megatron Local",
                                   UserWarning, f"m{i}.py", 2)
        warnings.warn_explicit("a FutureWarning of another library", FutureWarning, "m0.py", 3)
        warnings.warn_explicit("a FutureWarning of another library", FutureWarning, "m1.py", 3)
    err = capsys.readouterr().err
    # the fallback family is one line (issue 34 item 12), each other warning one line, without its source line
    assert err.count("not installed") == shown and err.count("a FutureWarning of another library") == shown, err
    assert len(err.splitlines()) == 2 * shown and "warnings.warn" not in err, err
