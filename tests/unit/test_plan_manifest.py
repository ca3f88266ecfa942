"""A prepared dataset describes itself (issue 21 item 1): every plan carries a manifest of the settings
that shaped it, and train / verify / inspect take the plan by ``data.plan`` or by the keys given on the
command line, never by a default the user did not type.

Every case runs the real command line (``megatron-pack ...``, tests/_user_path.py) as a user types it.
The ids name the failure the issue reported before the fix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf import save_tokenizer  # noqa: E402
from _user_path import CUSTOM_TEMPLATE, chat, ok, plan_names, refused, run_cli, write_jsonl  # noqa: E402

PACK = ["packing.packed_sequence_size=128", "data.tokenize_workers=1"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("manifest")
    write_jsonl(root / "a.jsonl", [chat(i, 4) for i in range(40)])
    write_jsonl(root / "b.jsonl", [{"prompt": f"say {i}", "completion": "ok " * (i % 9)} for i in range(40)])
    write_jsonl(root / "c.jsonl", [chat(i, 30) for i in range(30)])
    write_jsonl(root / "valid.jsonl", [chat(i, 5) for i in range(12)])
    save_tokenizer(root / "tok")
    (root / "custom.jinja").write_text(CUSTOM_TEMPLATE)
    return root


SOURCES = ("data.sources=[{name: a, input: a.jsonl, weight: 0.5}, {name: b, input: b.jsonl, weight: 0.3}, "
           "{name: c, input: c.jsonl, weight: 0.2}]")
PLANS = [  # (id, the prepare command's keys): each was refused by `train --check` / `verify` as damaged
    ("split-with-overlap", ["data=files", "data.input=c.jsonl", "packing.on_overflow=split", "packing.split_overlap=4",
                            "packing.packed_sequence_size=64"]),
    ("buckets", ["data=files", "data.input=a.jsonl", "packing.buckets=[16,32]"]),
    ("validation-fraction", ["data=files", "data.input=a.jsonl", "data.validation_fraction=0.2"]),
    ("sources", ["data.source=files", SOURCES, "packing.on_overflow=truncate"]),
    ("wrapped-document", ["data=files", "data.input=a.jsonl", "packing.algorithm=wrapped", "packing.on_overflow=split"]),
]


@pytest.mark.parametrize("args", [c[1] for c in PLANS], ids=[c[0] for c in PLANS])
def test_every_plan_trains_and_verifies_with_only_its_folder(work, tmp_path, args):
    ds = tmp_path / "ds"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, *args)
    (name,) = plan_names(ds)
    out = ok(work, "train", "--check", f"data.dataset_dir={ds}")  # the only plan
    assert "config ok" in out and name in out and "memory per rank (est.): params 0.00" in out
    out = ok(work, "verify", f"data.dataset_dir={ds}", "verify.num_packs=1", f"data.plan={name}")
    assert "1/1 packs PASS" in out
    assert name in ok(work, "inspect", str(ds))


def test_mixing_prepares_from_the_command_line(work, tmp_path):
    """`prepare data.source=files 'data.sources=[...]'` (docs/data.md) was refused: data.input is required."""
    ds = tmp_path / "mix"
    out = ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data.source=files", SOURCES, "packing.on_overflow=drop")
    manifest = json.loads((ds / "plans" / plan_names(ds)[0] / "metadata.json").read_text())["manifest"]
    assert [(s["name"], s["weight"]) for s in manifest["data.sources"]] == [("a", 0.5), ("b", 0.3), ("c", 0.2)]
    assert "source a" in ok(work, "inspect", str(ds)) and "packs:" in out
    # and trains with only the folder: the sources come from the manifest
    check = ok(work, "train", "--cfg", "job", f"data.dataset_dir={ds}")
    assert "name: c" in check and "data.sources" in check


def test_validation_fraction_on_the_command_line_picks_the_plan_with_it(work, tmp_path):
    """A plain plan and a held-out one side by side: `data.validation_fraction=0.2` gave '2 plans fit' and
    suggested the plan without validation."""
    ds = tmp_path / "ds"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl")
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl",
       "data.validation_fraction=0.2")
    held_out = next(n for n in plan_names(ds) if "_val0.2" in n)
    out = ok(work, "train", "--check", f"data.dataset_dir={ds}", "data.validation_fraction=0.2")
    assert held_out in out and "validation" in out
    both = refused(work, "train", "--check", f"data.dataset_dir={ds}")
    assert "2 plans" in both and "data.validation_fraction=0.2" in both and "data.validation_fraction=0.0" in both
    assert all(name in both for name in plan_names(ds))


def test_validation_file_is_found_without_repeating_it(work, tmp_path):
    """`prepare data.validation=FILE`: train did not find the validation set unless the key was repeated."""
    ds = tmp_path / "ds"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl",
       "data.validation=valid.jsonl")
    out = ok(work, "train", "--check", f"data.dataset_dir={ds}")
    assert "validation" in out and "valid.jsonl" in out and "packs" in out


def test_custom_template_trains_with_its_validation_split(work, tmp_path):
    """`data.chat_template=FILE` + a validation fraction: the validation plan was opened with data.tokenizer alone
    and refused (the tokenizer hash differed and the message never named the template)."""
    ds = tmp_path / "ds"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl", "data.tokenizer=tok",
       "data.chat_template=custom.jinja", "data.validation_fraction=0.2")
    out = ok(work, "train", "--check", f"data.dataset_dir={ds}")
    assert "config ok" in out and "validation" in out
    manifest = json.loads((ds / "plans" / plan_names(ds)[0] / "metadata.json").read_text())["manifest"]
    assert manifest["data.chat_template"]["text"] == CUSTOM_TEMPLATE
    (work / "other.jinja").write_text(CUSTOM_TEMPLATE.replace("[", "<"))
    other = refused(work, "train", "--check", f"data.dataset_dir={ds}", "data.chat_template=other.jinja")
    assert "data.chat_template" in other and "custom.jinja" in other


def test_a_key_given_that_no_plan_has_names_what_the_plans_have(work, tmp_path):
    ds = tmp_path / "ds"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl")
    out = refused(work, "train", "--check", f"data.dataset_dir={ds}", "packing.seed=7")
    assert "packing.seed=7" in out and "packing.seed=0" in out and plan_names(ds)[0] in out


def test_several_plans_are_listed_with_the_keys_that_tell_them_apart(work, tmp_path):
    ds = tmp_path / "ds"
    for seed in (0, 3):
        ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl", f"packing.seed={seed}")
    out = refused(work, "verify", f"data.dataset_dir={ds}")
    assert "packing.seed=0" in out and "packing.seed=3" in out and "data.plan=" in out
    assert "packing.packed_sequence_size" not in out.split("tell them apart", 1)[-1]  # only the keys that differ
    ok(work, "train", "--check", f"data.dataset_dir={ds}", "packing.seed=3")


def test_a_plan_folder_without_a_readable_manifest_is_listed_not_a_crash(work, tmp_path):
    """A folder under plans/ whose metadata.json does not parse stands beside a good plan: the message lists both
    (its rows as null), one line, no traceback; naming the good plan trains."""
    from megatron_pack.data.store.manifest import ENTRIES

    assert all(e.text(None) == f"{e.key}=null" for e in ENTRIES)  # every row prints a missing value
    ds = tmp_path / "ds"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl")
    (good,) = plan_names(ds)
    (ds / "plans" / "pack128_broken").mkdir()
    (ds / "plans" / "pack128_broken" / "metadata.json").write_text("{not json")
    out = refused(work, "train", "--check", f"data.dataset_dir={ds}")
    assert good in out and "pack128_broken" in out and "data.plan=" in out and len(out.strip().splitlines()) == 1
    ok(work, "train", "--check", f"data.dataset_dir={ds}", f"data.plan={good}")


def test_a_plan_is_damaged_only_when_its_checksums_fail(work, tmp_path):
    ds = tmp_path / "ds"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl")
    plan = ds / "plans" / plan_names(ds)[0]
    meta = json.loads((plan / "metadata.json").read_text())
    meta["manifest"]["packing.seed"] = 5  # an edited manifest no longer hashes to the fingerprint in the name
    (plan / "metadata.json").write_text(json.dumps(meta))
    out = refused(work, "train", "--check", f"data.dataset_dir={ds}")
    assert "is damaged" in out and "fingerprint" in out


def test_export_writes_the_template_the_plan_was_prepared_with(work, tmp_path):
    """The export of a run prepared with data.chat_template had no template (apply_chat_template raised)."""
    from _hf import make_family
    from transformers import AutoTokenizer

    model = make_family(tmp_path, "llama_tied", name="model")
    ds = tmp_path / "ds"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl", f"data.tokenizer={model}",
       "data.chat_template=custom.jinja")
    out = ok(work, "export", f"model.pretrained={model}", f"output={tmp_path / 'exported'}", f"data.dataset_dir={ds}")
    assert "chat template" in out
    tok = AutoTokenizer.from_pretrained(tmp_path / "exported")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert tok.chat_template == CUSTOM_TEMPLATE and text == "<s>[user] hi</s>"
    assert json.loads((tmp_path / "exported" / "tokenizer_config.json").read_text())["chat_template"] == CUSTOM_TEMPLATE


def test_inspect_shows_the_plans_the_keys_pick(work, tmp_path):
    ds = tmp_path / "ds"
    for seed in (0, 3):
        ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl", f"packing.seed={seed}")
    both = ok(work, "inspect", str(ds))
    assert all(name in both for name in plan_names(ds)) and "tell the plans apart" in both and "packing.seed=3" in both
    one = ok(work, "inspect", str(ds), "packing.seed=3")
    (seed3,) = [n for n in plan_names(ds) if "seed3" in n]
    assert seed3 in one and "seed0" not in one and "settings (manifest):" in one and "data.tokenizer=byte" in one
    assert "no plan in" in refused(work, "inspect", f"data.dataset_dir={ds}", "packing.seed=9")


def test_the_prepare_hint_pasted_as_written_adds_a_plan_and_keeps_the_store(work, tmp_path):
    """Issue 34 item 3: train's hint names only the pack size and layout; pasted, prepare takes every other
    setting (the files, the tokenizer) from the folder, adds a plan beside the first and leaves the store as it was
    (it used to replace the user's store with the synthetic demo set)."""
    import shlex

    ds = tmp_path / "chat"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl")
    store, first = (ds / "metadata.json").read_text(), plan_names(ds)
    two_ranks = {"WORLD_SIZE": "2", "RANK": "0"}
    run = ["train", "--check", f"data.dataset_dir={ds}", "packing.packed_sequence_size=256",
           "parallel.context_parallel_size=2"]
    status, out = run_cli(work, *run, env=two_ranks)
    assert status == 2 and "`megatron-pack prepare " in out, out
    hint = shlex.split(out.split("`megatron-pack prepare ", 1)[1].split("`", 1)[0])
    out = ok(work, "prepare", *hint)
    assert "settings from the dataset" in out and "a.jsonl" in out
    assert (ds / "metadata.json").read_text() == store
    assert set(first) < set(plan_names(ds)) and len(plan_names(ds)) == 2
    assert "config ok for 2 rank(s)" in ok(work, *run, env=two_ranks)


def test_replacing_a_store_built_from_other_inputs_needs_data_overwrite(work, tmp_path):
    ds = tmp_path / "ds"
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=a.jsonl")
    store, plans = (ds / "metadata.json").read_text(), plan_names(ds)
    out = refused(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=b.jsonl")
    assert "a.jsonl -> b.jsonl" in out and "data.overwrite=true" in out
    assert (ds / "metadata.json").read_text() == store and plan_names(ds) == plans  # nothing touched
    out = refused(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=synthetic")
    assert "a.jsonl -> the synthetic set" in out
    ok(work, "prepare", f"data.dataset_dir={ds}", *PACK, "data=files", "data.input=b.jsonl", "data.overwrite=true")
    files = json.loads((ds / "metadata.json").read_text())["sources"]["files"]
    assert [Path(f["path"]).name for f in files] == ["b.jsonl"] and len(plan_names(ds)) == 1
