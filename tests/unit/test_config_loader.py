"""load_config: Hydra composition, presets, typo suggestions, read-only result."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config import Config, ConfigError, DataConfig, ModelConfig, load_config
from megatron_pack.config.loader import config_dir, config_to_yaml
from megatron_pack.config.search_path import presets
from megatron_pack.parallel.dims import ParallelDims

TYPOS = [
    ("key", ["packing.packed_sequnce_size=8"], "unknown key 'packing.packed_sequnce_size'",
     "did you mean 'packing.packed_sequence_size'?"),
    ("group-of-key", ["modle.num_layers=2"], "unknown key 'modle.num_layers'", "did you mean 'model.num_layers'?"),
    ("bare-field", ["num_layers=3"], "unknown key 'num_layers'", "did you mean 'model.num_layers'?"),
    ("added-key", ["+train.lrr=0.1"], "unknown key 'train.lrr'", "did you mean 'train.lr'?"),
    ("preset", ["data=synthtic"], "no preset 'synthtic' in data/", "did you mean 'synthetic'?"),
    ("group", ["paralel=cp2"], "unknown key 'paralel'", "did you mean 'parallel'?"),
    ("experiment", ["experiment=quickstrat"], "no preset 'quickstrat'", "did you mean 'quickstart'?"),
    ("no-presets", ["packing=big"], "'packing' has no presets", "packing.packed_sequence_size=<value>"),
    ("type", ["model.num_layers=abc"], "model.num_layers=abc", "set model.num_layers to a value of type int"),
    ("not-key-value", ["model.num_layers"], "not a key=value override", "group.key=value"),
    # issue 11 item 2: bare keys with no close match crashed the checker with an IndexError
    ("bare-lr", ["lr=1e-4"], "unknown key 'lr'", "did you mean 'train.lr'?"),
    ("bare-no-match", ["foo=1"], "unknown key 'foo'", "with a group among checkpoint, data"),
    ("bare-empty-value", ["output="], "unknown key 'output'", "did you mean 'data.dataset_dir'?"),
    ("synonym", ["train.learning_rate=1e-4"], "unknown key 'train.learning_rate'", "did you mean 'train.lr'?"),
    ("synonym-hf", ["max_steps=10"], "unknown key 'max_steps'", "did you mean 'train.train_iters'?"),
    ("group-no-close-field", ["train.foo=1"], "unknown key 'train.foo'", "keys of train: micro_batch_size"),
    ("unknown-group", ["xyz.abc=1"], "unknown key 'xyz.abc'", "with a group among"),
    # issue 23 item 5: packing.mode is the one packing switch; the old keys name it
    ("retired-in-batch", ["packing.in_batch=true"], "unknown key 'packing.in_batch'",
     "did you mean 'packing.mode=in_batch'? packing.in_batch was replaced by packing.mode"),
    ("retired-in-batch-off", ["packing.in_batch=false"], "unknown key 'packing.in_batch'",
     "did you mean 'packing.mode=offline'?"),
    ("pack-size-0-is-no-switch", ["packing.packed_sequence_size=0"], "packing.packed_sequence_size (0) no longer turns",
     "set packing.mode=in_batch"),
]


@pytest.mark.parametrize("overrides,problem,fix", [t[1:] for t in TYPOS], ids=[t[0] for t in TYPOS])
def test_typo_fails_with_suggestion(overrides, problem, fix):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert len(info.value.problems) == 1
    assert problem in info.value.problems[0] and fix in info.value.problems[0]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.0123456789", min_size=1, max_size=30))
def test_suggestion_never_raises_whatever_the_key(key):
    from megatron_pack.config.loader import _all_keys, _unknown_key

    message = _unknown_key(f"{key}=1", key, _all_keys(), ["model", "data", "experiment"])
    assert message.startswith(f"{key}=1: unknown key '{key}'") and ("did you mean" in message or "keys " in message)


def test_retired_key_in_a_yaml_file_names_the_new_spelling(tmp_path):
    (tmp_path / "run.yaml").write_text("packing:\n  in_batch: true\n")
    with pytest.raises(ConfigError) as info:
        load_config([f"experiment={tmp_path / 'run.yaml'}"])
    assert len(info.value.problems) == 1 and "\n" not in info.value.problems[0]
    assert "did you mean 'packing.mode=in_batch'?" in info.value.problems[0]


def test_min_lr_defaults_to_a_tenth_of_lr():
    """issue 11 item 8: ``train.lr=2e-5`` alone validates; an explicit min_lr still wins and is checked."""
    assert load_config(["train.lr=2e-5"]).train.min_lr == pytest.approx(2e-6, rel=1e-12)
    assert load_config([]).train.min_lr == pytest.approx(3e-4, rel=1e-12)
    assert load_config(["train.lr=2e-5", "train.min_lr=0"]).train.min_lr == 0.0
    with pytest.raises(ConfigError, match=r"train.min_lr \(0.1\) must be in \[0, train.lr=2e-05\]"):
        load_config(["train.lr=2e-5", "train.min_lr=0.1"])


def test_every_typo_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(["modle.num_layers=2", "data=synthtic", "train.lr=fast", "train.bf16=maybe"])
    text = str(info.value)
    assert len(info.value.problems) == 4
    for part in ("'model.num_layers'", "'synthetic'", "train.lr=fast", "train.bf16=maybe"):
        assert part in text


def test_field_problems_collected_from_every_group():
    with pytest.raises(ConfigError) as info:
        load_config(["model.num_layers=0", "train.lr=-1", "parallel.cp_comm_type=ring", "data.num_workers=-1"])
    text = str(info.value)
    assert len(info.value.problems) == 4
    for part in ("model.num_layers (0)", "train.lr (-1.0)", "parallel.cp_comm_type ('ring')", "data.num_workers (-1)"):
        assert part in text


PRESETS = [  # (overrides, world size, tp, cp, sp, dp, pad multiple)
    ([], 1, 1, 1, False, 1, 1),
    (["parallel=cp2"], 2, 1, 2, False, 1, 4),
    (["parallel=cp4"], 8, 1, 4, False, 2, 8),
    (["parallel=tp2"], 4, 2, 1, False, 2, 1),
    (["parallel=tp2_cp2"], 4, 2, 2, False, 1, 4),
    (["model=tiny", "parallel=tp2_cp2_sp", "data=synthetic"], 8, 2, 2, True, 2, 4),
    (["experiment=quickstart"], 2, 1, 2, False, 1, 4),
    (["+experiment=quickstart"], 4, 1, 2, False, 2, 4),
    (["experiment=quickstart", "parallel=tp2_cp2_sp"], 4, 2, 2, True, 1, 4),
    (["experiment=llama3_8b_tp2_cp2", "data.input=/data/train.jsonl"], 16, 2, 2, True, 4, 4),
    (["experiment=quickstart", "parallel=pp2"], 4, 1, 1, False, 2, 1),
    (["experiment=quickstart", "parallel=pp2_tp2"], 8, 2, 1, False, 2, 1),
    (["experiment=quickstart", "parallel=pp2_vp2", "model.num_layers=4"], 4, 1, 1, False, 2, 1),
]


@pytest.mark.parametrize("overrides,world,tp,cp,sp,dp,pad", PRESETS, ids=[" ".join(p[0]) or "defaults" for p in PRESETS])
def test_preset_composition(overrides, world, tp, cp, sp, dp, pad):
    cfg = load_config(overrides, world_size=world)
    dims = ParallelDims.from_config(cfg, world)
    assert (dims.tp, dims.cp, dims.sp, dims.dp, dims.pad_multiple) == (tp, cp, sp, dp, pad)


def test_every_parallel_preset_is_covered():
    selected = {o.split("=")[1] for p in PRESETS for o in p[0] if o.startswith("parallel=")}
    assert selected | {"cp1"} == set(presets(config_dir())["parallel"])


def test_experiment_quickstart_values():
    cfg = load_config(["experiment=quickstart"])
    assert (cfg.data.source, cfg.model.name, cfg.parallel.context_parallel_size) == ("synthetic", "tiny", 2)
    assert cfg.train.train_iters == 50 and cfg.packing.packed_sequence_size == 512
    later = load_config(["experiment=quickstart", "train.train_iters=3"])
    assert later.train.train_iters == 3


def test_llama_preset_is_real_size():
    cfg = load_config(["experiment=llama3_8b_tp2_cp2", "data.input=/data/train.jsonl"], world_size=8)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.vocab_size) == (32, 4096, 128256)
    assert cfg.model.seq_length == cfg.packing.packed_sequence_size == 8192


def test_tiny_yaml_matches_schema_defaults():
    tiny = yaml.safe_load((config_dir() / "model" / "tiny.yaml").read_text())
    defaults = dataclasses.asdict(ModelConfig())
    assert len(tiny) >= 15
    assert {k: defaults[k] for k in tiny} == tiny
    assert load_config(["model=tiny"]).model == ModelConfig()
    assert load_config([]).data == DataConfig()


def test_result_is_read_only():
    cfg = load_config(["parallel=cp2"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.context_parallel_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = cfg.train
    changed = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context_parallel_size=4))
    assert changed.parallel.context_parallel_size == 4 and cfg.parallel.context_parallel_size == 2


def test_validation_runs_with_world_size_and_meta():
    with pytest.raises(ConfigError, match=r"world size \(3\)"):
        load_config(["parallel=cp2"], world_size=3)
    with pytest.raises(ConfigError, match="pack_size=1024"):
        load_config([], dataset_meta={"pack_size": 1024})


def test_config_to_yaml_round_trips():
    cfg = load_config(["parallel=tp2_cp2_sp", "train.lr=0.001"])
    text = config_to_yaml(cfg)
    assert "context_parallel_size: 2" in text
    loaded = yaml.safe_load(text)
    assert Config(**{k: type(getattr(cfg, k))(**v) for k, v in loaded.items()}) == cfg


def test_presets_are_the_configs_folder_of_the_checkout():
    """issue 23 item 6: the presets live in configs/ at the top of the repository (DESIGN.md's layout), apart
    from library code; a wheel carries them as package data (tests/functional/test_readme_commands.py)."""
    import megatron_pack

    root = Path(megatron_pack.__file__).resolve().parents[1]
    assert config_dir() == root / "configs"
    assert not (root / "megatron_pack" / "config" / "presets").exists()
    assert {"model", "data", "parallel", "experiment"} <= set(presets(config_dir()))
    assert (config_dir() / "config.yaml").is_file() and "quickstart" in presets(config_dir())["experiment"]


def _user_dir(tmp_path) -> Path:
    user = tmp_path / "mine"
    (user / "parallel").mkdir(parents=True)
    (user / "parallel" / "cp8.yaml").write_text("context_parallel_size: 8\n")
    (user / "experiment").mkdir()
    (user / "experiment" / "my_run.yaml").write_text("# @package _global_\ntrain:\n  lr: 0.0123\n")
    return user


USER_DIRS = [  # how a user folder is named: the environment variable, --config-dir, or both
    ("env", "env"), ("flag", "flag"), ("env-with-separator", "env2"),
]


@pytest.mark.parametrize("how", [c[1] for c in USER_DIRS], ids=[c[0] for c in USER_DIRS])
def test_user_config_folder_is_searched_after_the_shipped_presets(tmp_path, monkeypatch, how):
    user = _user_dir(tmp_path)
    dirs = []
    if how == "flag":
        dirs = [str(user)]
    else:
        other = tmp_path / "other"
        other.mkdir()
        monkeypatch.setenv("MEGATRON_PACK_CONFIG_DIR", str(user) if how == "env" else f"{other}{os.pathsep}{user}")
    cfg = load_config(["parallel=cp8", "experiment=my_run"], config_dirs=dirs)
    assert cfg.parallel.context_parallel_size == 8 and cfg.train.lr == 0.0123
    assert load_config(["model=tiny"], config_dirs=dirs).model.name == "tiny"  # shipped presets still there


def test_a_repeated_composition_is_reused_until_a_preset_changes(tmp_path, monkeypatch):
    """Hydra composes each (overrides, search folders, their files' bytes) once per process (0.25 CPU-s a time);
    a preset rewritten in place, even to the same size at once, is composed anew."""
    from megatron_pack.config import loader

    user = _user_dir(tmp_path)
    calls = []
    real = loader._compose_with_hydra
    monkeypatch.setattr(loader, "_compose_with_hydra", lambda *a: calls.append(a) or real(*a))
    first = load_config(["experiment=my_run", "train.lr_warmup_iters=3"], config_dirs=[str(user)])
    again = load_config(["experiment=my_run", "train.lr_warmup_iters=3"], config_dirs=[str(user)])
    assert len(calls) == 1 and first == again and again.train.lr == 0.0123
    (user / "experiment" / "my_run.yaml").write_text("# @package _global_\ntrain:\n  lr: 0.0456\n")  # same size
    assert load_config(["experiment=my_run", "train.lr_warmup_iters=3"], config_dirs=[str(user)]).train.lr == 0.0456
    assert len(calls) == 2
    changed = load_config(["experiment=my_run", "train.lr_warmup_iters=4"], config_dirs=[str(user)])
    assert changed.train.lr == 0.0456 and changed.train.lr_warmup_iters == 4
    assert len(calls) == 2  # another value of a key: the same composition, the value applied as Hydra applies it


SOURCES = ("data.sources=[{name: chat, input: a.jsonl, weight: 0.5}, {name: share, input: c.jsonl, weight: 0.5, "
           "format: sharegpt}]")
REUSED = [  # (id, overrides): the reused composition + Hydra's value step must equal Hydra's whole composition
    ("values-on-defaults", ["train.lr=0.5", "packing.packed_sequence_size=1024"]),
    ("values-after-experiment", ["experiment=quickstart", "train.train_iters=3", "parallel.context_parallel_size=4"]),
    ("value-before-its-experiment", ["train.train_iters=7", "experiment=quickstart"]),
    ("repeated-key-last-wins", ["train.lr=0.1", "parallel=cp2", "train.lr=0.3"]),
    ("list-of-mappings", ["data=files", SOURCES, "packing.buckets=[48,96]"]),
    ("null-and-bool", ["train.min_lr=null", "packing.pad_cu_seqlens=true", "peft=lora"]),
    ("interpolation-kept", ["train.min_lr=${train.lr}"]),
    ("force-add-and-delete-stay-with-hydra", ["++train.lr=0.25", "~train.min_lr"]),
    ("selections-only", ["parallel=tp2_cp2", "model=tiny"]),
]


def _whole_and_reused(overrides: list[str], *, fresh: bool = True):
    """Hydra's whole composition of ``overrides`` and ``load_config``'s (``fresh``: composed anew, else reusing
    what earlier cases composed for the same selections)."""
    from megatron_pack.config import loader

    def outcome(compose):
        try:
            return OmegaConf.to_container(compose(overrides, []), resolve=False)
        except ConfigError as exc:
            return exc.problems

    if fresh:
        loader._COMPOSED.clear()
    return outcome(loader._compose_with_hydra), outcome(loader._compose)


@pytest.mark.parametrize("overrides", [c[1] for c in REUSED], ids=[c[0] for c in REUSED])
def test_a_reused_composition_with_the_values_applied_equals_hydras_own(overrides):
    """Only preset selections (and ``+``/``++``/``~``, sweeps) key the reused composition; plain ``group.key=value``
    overrides are applied to a copy by the function Hydra applies them with, after its defaults list, in order."""
    from megatron_pack.config import loader

    whole, reused = _whole_and_reused(overrides)
    assert whole == reused
    selections, values = loader._split_values(overrides, [loader.PRESETS_DIR])
    assert [v.input_line for v in values] == [o for o in overrides if o not in selections]
    assert len(REUSED) == 9 and any(len(loader._split_values(c, [loader.PRESETS_DIR])[1]) > 1 for _, c in REUSED)


REFUSED_VALUES = [  # (id, overrides): the value step's refusals read as Hydra's
    ("not-a-number", ["train.lr=abc"]),
    ("unknown-field", ["experiment=quickstart", "train.learning_rat=1"]),
    ("list-for-a-number", ["packing.packed_sequence_size=[1,2]"]),
]


@pytest.mark.parametrize("overrides", [c[1] for c in REFUSED_VALUES], ids=[c[0] for c in REFUSED_VALUES])
def test_a_refused_value_reads_as_hydras_refusal(overrides):
    whole, reused = _whole_and_reused(overrides)
    assert isinstance(whole, list) and whole and whole == reused


VALUE_POOL = ["train.lr=0.01", "train.lr=0.02", "train.train_iters=9", "packing.packed_sequence_size=256",
              "parallel.context_parallel_size=2", "packing.pad_seq_to_mult=8", "train.global_batch_size=16",
              "data.synthetic_num_samples=40", "model.num_layers=3"]
SELECTION_POOL = ["experiment=quickstart", "parallel=cp2", "parallel=tp2", "peft=lora", "model=tiny"]


@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from(VALUE_POOL + SELECTION_POOL), max_size=6))
def test_any_mix_of_selections_and_values_composes_as_hydra_does(overrides):
    whole, reused = _whole_and_reused(overrides, fresh=False)  # the examples reuse each other's compositions
    assert whole == reused


def test_experiment_file_by_path_needs_no_folder(tmp_path, monkeypatch):
    run = tmp_path / "quickstart.yaml"  # even the name of a shipped preset, and without a package line
    run.write_text("train:\n  lr: 0.05\nparallel:\n  context_parallel_size: 2\n")
    monkeypatch.chdir(tmp_path)
    for spelling in (str(run), "quickstart.yaml", "+experiment=quickstart.yaml"):
        text = spelling if spelling.startswith("+") else f"experiment={spelling}"
        cfg = load_config([text])
        assert cfg.train.lr == 0.05 and cfg.parallel.context_parallel_size == 2, text
    assert not list(Path(tempfile.gettempdir()).glob("megatron_pack_experiment_*"))  # scratch removed


USER_DIR_ERRORS = [
    ("missing-flag", lambda t: ([], [str(t / "missing")], None), "--config-dir"),
    ("missing-env", lambda t: ([], [], str(t / "missing")), "MEGATRON_PACK_CONFIG_DIR"),
    ("missing-file", lambda t: ([f"experiment={t / 'nope.yaml'}"], [], None), "no such file"),
    ("shadows-shipped", lambda t: ([], [str(t / "mine")], None), "has the name of the shipped preset model=tiny"),
    ("unknown-preset", lambda t: (["parallel=cp9"], [str(t / "mine")], None), "Available: cp1, cp2, cp4, cp8"),
]


@pytest.mark.parametrize("build,message", [c[1:] for c in USER_DIR_ERRORS], ids=[c[0] for c in USER_DIR_ERRORS])
def test_user_config_folder_mistakes_name_the_fix(tmp_path, monkeypatch, build, message):
    user = _user_dir(tmp_path)
    (user / "model").mkdir()
    overrides, dirs, env = build(tmp_path)
    if "shipped preset" in message:
        (user / "model" / "tiny.yaml").write_text("num_layers: 7\n")
    if env:
        monkeypatch.setenv("MEGATRON_PACK_CONFIG_DIR", env)
    with pytest.raises(ConfigError) as info:
        load_config(overrides, config_dirs=dirs)
    assert len(info.value.problems) == 1 and message in info.value.problems[0], info.value.problems


def test_unknown_key_inside_a_yaml_file_fails(tmp_path):
    user = tmp_path / "mine"
    (user / "model").mkdir(parents=True)
    (user / "model" / "bad.yaml").write_text("num_layer: 2\n")
    with pytest.raises(ConfigError, match="num_layer"):
        load_config(["model=bad"], config_dirs=[user])


def test_virtual_pipeline_key_from_preset_and_override():
    cfg = load_config(["experiment=quickstart", "parallel=pp2_vp2", "model.num_layers=4"], world_size=4)
    assert (cfg.parallel.virtual_pipeline_model_parallel_size, cfg.parallel.num_model_chunks) == (2, 2)
    cfg = load_config(["experiment=quickstart", "parallel=pp2", "model.num_layers=8",
                       "parallel.virtual_pipeline_model_parallel_size=4"], world_size=2)
    assert cfg.parallel.num_model_chunks == 4
    assert load_config(["experiment=quickstart"], world_size=2).parallel.num_model_chunks == 1
