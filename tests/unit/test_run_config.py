"""train/verify complete the config from what prepare recorded (issue 11 items 3 and 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_pack.cli.main import main
from megatron_pack.cli.run_config import load_run_config
from megatron_pack.config import ConfigError
from megatron_pack.data.formats.sources import DataError

SMALL = ["data.synthetic_num_samples=120", "data.tokenize_workers=1"]


def prepare(ds: Path, *args: str, data=("data=synthetic",)) -> Path:
    assert main(["prepare", *data, f"data.dataset_dir={ds}", *args, *(SMALL if "data=synthetic" in data else
                                                                         ["data.tokenize_workers=1"])]) == 0
    return ds


@pytest.fixture(scope="module")
def cp2_dataset(tmp_path_factory):
    """The README's CP=2 prepare (pack 512, pad multiple 4), small."""
    return prepare(tmp_path_factory.mktemp("cp2") / "ds", "packing.packed_sequence_size=512",
                   "parallel.context_parallel_size=2")


def write_records(path: Path, num: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"question {i} " * (i % 7), "completion": f"answer {i}"}) + "\n"
                            for i in range(num)))
    return path


@pytest.fixture(scope="module")
def two_plans(tmp_path_factory):
    """One token store, two plans (the synthetic set is clipped to the pack, so it uses files)."""
    root = tmp_path_factory.mktemp("two")
    data = ("data=files", f"data.input={write_records(root / 'train.jsonl', 60)}")
    prepare(root / "ds", "packing.packed_sequence_size=256", data=data)
    return prepare(root / "ds", "packing.packed_sequence_size=128", data=data)


RECORDED = [  # (id, overrides besides data.dataset_dir, expected (key, value) in the resolved config)
    ("readme-verify", [], {"packing.packed_sequence_size": 512, "model.seq_length": 512,
                           "packing.pad_seq_to_mult": 4, "packing.on_overflow": "error", "data.tokenizer": "byte"}),
    ("cp2-layout-fits", ["parallel=cp2"], {"packing.pad_seq_to_mult": 4, "parallel.context_parallel_size": 2}),
    ("given-key-wins", ["packing.algorithm=bfd", "train.lr=1e-4"], {"train.lr": 1e-4, "packing.algorithm": "bfd"}),
]


@pytest.mark.parametrize("extra,expected", [c[1:] for c in RECORDED], ids=[c[0] for c in RECORDED])
def test_recorded_settings_fill_the_config(cp2_dataset, extra, expected):
    run = load_run_config([f"data.dataset_dir={cp2_dataset}", *extra], world_size=None)
    for key, value in expected.items():
        group, name = key.split(".")
        assert getattr(getattr(run.cfg, group), name) == value, key
    assert len(run.dataset) > 0 and run.dataset.metadata["pad_seq_to_mult"] == 4


def test_readme_verify_right_after_cp2_prepare_passes(cp2_dataset, capsys):
    """issue 11 item 3: `verify data.dataset_dir=D` after the README's CP=2 prepare (was: no plan, then
    a tokenizer error, then an IndexError)."""
    assert main(["verify", f"data.dataset_dir={cp2_dataset}", "verify.num_packs=2"]) == 0
    out = capsys.readouterr().out
    assert "packing.pad_seq_to_mult=4 (was null)" in out and "2/2 packs PASS" in out


def test_pack_size_is_read_from_the_plan(two_plans):
    run = load_run_config([f"data.dataset_dir={two_plans}", "packing.packed_sequence_size=128"])
    assert run.cfg.model.seq_length == 128 and run.dataset.metadata["pack_size"] == 128
    run = load_run_config([f"data.dataset_dir={two_plans}", "model.seq_length=256"])
    assert run.cfg.packing.packed_sequence_size == 256 and run.dataset.metadata["pack_size"] == 256


def test_several_plans_are_named_with_the_key_that_picks_one(two_plans):
    with pytest.raises(DataError) as info:
        load_run_config([f"data.dataset_dir={two_plans}"])
    names = sorted(p.name for p in (two_plans / "plans").iterdir())
    text = str(info.value)
    assert all(n in text for n in names) and "data.plan=<name>" in text
    run = load_run_config([f"data.dataset_dir={two_plans}", f"data.plan={names[0]}"])
    assert run.dataset.plan_dir.name == names[0] and run.cfg.model.seq_length == run.dataset.metadata["pack_size"]


MISMATCHES = [  # (id, overrides, message); each message names the fix
    ("layout-needs-other-pad", ["parallel=cp4"], "needs a multiple of 8; run `megatron-pack prepare"),
    ("no-plan-with-given-size", ["packing.packed_sequence_size=1024"], "no plan in"),
    ("unknown-plan-name", ["data.plan=nope"], "data.plan (nope) is not a plan"),
]


@pytest.mark.parametrize("overrides,message", [c[1:] for c in MISMATCHES], ids=[c[0] for c in MISMATCHES])
def test_mismatches_name_the_fix(cp2_dataset, overrides, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_run_config([f"data.dataset_dir={cp2_dataset}", *overrides])


def test_the_prepare_command_a_layout_error_names_works(tmp_path):
    """The one fix the error gives, run as written, makes the same train config resolve."""
    import shlex

    data = ("data=files", f"data.input={write_records(tmp_path / 'train.jsonl', 40)}")
    ds = prepare(tmp_path / "ds", "packing.packed_sequence_size=256", data=data)
    with pytest.raises(DataError) as info:
        load_run_config([f"data.dataset_dir={ds}", "parallel=cp2"])
    command = str(info.value).split("`")[1]
    args = shlex.split(command)[2:]
    assert main(["prepare", *args, *data, "data.tokenize_workers=1"]) == 0
    assert load_run_config([f"data.dataset_dir={ds}", "parallel=cp2"]).cfg.packing.pad_seq_to_mult == 4


def test_vocab_size_rises_to_the_tokenizer(cp2_dataset, tmp_path):
    user = tmp_path / "mine" / "model"
    user.mkdir(parents=True)
    (user / "small_vocab.yaml").write_text("name: small_vocab\nvocab_size: 128\n")
    run = load_run_config([f"data.dataset_dir={cp2_dataset}", "model=small_vocab"], config_dirs=[str(user.parent)])
    vocab = json.loads((cp2_dataset / "metadata.json").read_text())["vocab_size"]
    assert vocab > 128 and run.cfg.model.vocab_size == 384 and any("model.vocab_size=384" in n for n in run.notes)
    with pytest.raises(ConfigError, match="model.vocab_size \\(128\\) is smaller than the tokenizer"):
        load_run_config([f"data.dataset_dir={cp2_dataset}", "model=small_vocab", "model.vocab_size=128"],
                        config_dirs=[str(user.parent)])


def test_hf_tokenizer_is_read_from_the_store_from_another_folder(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world", "four"] * 10, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<pad>", "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    work = tmp_path / "work"
    (work / "tok").mkdir(parents=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>").save_pretrained(work / "tok")
    (work / "train.jsonl").write_text("".join(json.dumps({"prompt": "hello", "completion": f"world {i}"}) + "\n"
                                              for i in range(20)))
    monkeypatch.chdir(work)  # prepare with relative paths, as the README does
    assert main(["prepare", "input=train.jsonl", "tokenizer=tok", "output=ds", "packing.packed_sequence_size=64",
                 "data.tokenize_workers=1"]) == 0
    monkeypatch.chdir(tmp_path)  # then train/verify from elsewhere
    run = load_run_config([f"data.dataset_dir={work / 'ds'}"])
    assert run.cfg.data.tokenizer == str((work / "tok").resolve()) and run.cfg.model.seq_length == 64
    with pytest.raises(DataError, match="was tokenized with tokenizer 'tok'"):
        load_run_config([f"data.dataset_dir={work / 'ds'}", "data.tokenizer=byte"])


@pytest.fixture(scope="module")
def files_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    data = write_records(root / "train.jsonl", 30)
    prepare(root / "ds", "packing.packed_sequence_size=128", data=("data=files", f"data.input={data}"))
    return root


INPUTS = [  # issue 11 item 6: (id, data.input at train time or None, message or None when accepted)
    ("unset", None, None),
    ("same-file", "train.jsonl", None),
    ("missing", "nope.jsonl", "matches no .jsonl/.json/.parquet/.arrow file or datasets folder"),
    ("other-content", "other.jsonl", "holds other files or other contents"),
]


@pytest.mark.parametrize("name,message", [c[1:] for c in INPUTS], ids=[c[0] for c in INPUTS])
def test_data_input_at_train_time_is_optional_and_checked(files_dataset, name, message):
    (files_dataset / "other.jsonl").write_text(json.dumps({"prompt": "x", "completion": "y"}) + "\n")
    argv = ["data=files", f"data.dataset_dir={files_dataset / 'ds'}"]
    if name:
        argv.append(f"data.input={files_dataset / name}")
    if message is None:
        assert len(load_run_config(argv).dataset) > 0
    else:
        with pytest.raises(ConfigError) as info:
            load_run_config(argv)
        assert message in str(info.value) and "drop data.input" in str(info.value)


def test_prepare_still_requires_data_input(tmp_path, capsys):
    assert main(["prepare", "data=files", f"data.dataset_dir={tmp_path / 'ds'}"]) == 2
    assert "data.input (None) is required by prepare when data.source=files" in capsys.readouterr().err
