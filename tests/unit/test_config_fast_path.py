"""The config step without Hydra on the common path (issue 43 item 12): plain ``key=value`` overrides are read as
Hydra's parser reads them (a table and random words compared with it; anything else is left to it), and Hydra's
composition of the presets is kept on disk between processes, keyed by everything that shapes it."""

from __future__ import annotations

import math
import random

import pytest

from megatron_pack.config import load_config, loader

VALUES = ["1000", "1e-4", "1.", ".5", "-inf", "+inf", "NaN", "True", "tRuE", "false", "null", "NULL", "0x10", "007",
          "00", "+3", "-0", "-0.0", "1.5e+3", "1E3", "1e", "e5", "1-2", "1.2.3", "a.b", "/tmp/x.jsonl", "./x", "..",
          "-", "+", "@x", "x@y", "a%b", "a:b", "http://x", "_1", "nul", "none", "None", "true1", "infinity", "a+b",
          "bfd", "files"]
DECLINED = ["1_000", "1e1_0", "~/x", "${train.lr}", "[1,2]", "a b", "'q'", "x,y", "", "a=b", "*", "{a: 1}", "\\x"]


_PARSER: list = []


def _hydra(text: str):
    if not _PARSER:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        _PARSER.append(OverridesParser.create())
    override = _PARSER[0].parse_override(text)
    return override.key_or_group, override.value()


def _same(a, b) -> bool:
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


@pytest.mark.parametrize("value", VALUES)
def test_plain_values_read_as_hydra_reads_them(value):
    for key in ("data.input", "packing.algorithm", "data"):
        plain = loader.plain_override(f"{key}={value}")
        assert plain is not None and plain.input_line == f"{key}={value}"
        hydra_key, hydra_value = _hydra(f"{key}={value}")
        assert plain.key_or_group == hydra_key and _same(plain.value(), hydra_value), (value, plain.value())


@pytest.mark.parametrize("text", [f"data.input={v}" for v in DECLINED] + ["+train.lr=1", "++train.lr=1",
                                                                             "~train.min_lr", "data@x=files", "a..b=1"])
def test_other_overrides_are_left_to_hydra(text):
    assert loader.plain_override(text) is None


def test_random_words_read_as_hydra_reads_them():
    """Words over an alphabet of every character Hydra treats specially: each one the plain reader accepts reads
    as Hydra reads it (guard: hundreds accepted, strings and numbers)."""
    from hydra.errors import HydraException

    rng = random.Random(0)
    alphabet = "abeEnNuUlLtTrRfFsSiI0123456789_./:@%+-~$*?[]'\"\\,= {}"
    kinds, accepted = set(), 0
    for _ in range(2500):
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
        plain = loader.plain_override(f"data.input={word}")
        if plain is None:
            continue
        accepted += 1
        try:
            _, value = _hydra(f"data.input={word}")
        except HydraException as exc:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"{word!r}: accepted here, refused by Hydra ({exc})")
        assert _same(plain.value(), value), (word, plain.value(), value)
        kinds.add(type(value).__name__)
    assert accepted > 800 and kinds >= {"str", "int", "float"}  # bool and None: the table


def test_stored_composition_is_reused_in_a_new_process_and_rewritten_when_damaged(tmp_path, monkeypatch):
    """The first composition of a selection is written to the store; a process that starts later reads it instead
    of composing (here: the in-process memo cleared, Hydra made to fail) and gets the same config; a damaged file
    is composed anew and rewritten; ``off`` stores nothing."""
    monkeypatch.setenv(loader.COMPOSITION_STORE_ENV, str(tmp_path / "store"))
    overrides = ["experiment=quickstart", "train.lr=0.002", "data.input=/tmp/x.jsonl"]
    loader._COMPOSED.clear()
    first = load_config(overrides)
    files = list((tmp_path / "store" / "compositions").glob("*.pkl"))
    assert len(files) == 1
    loader._COMPOSED.clear()
    calls = []
    monkeypatch.setattr(loader, "_compose_with_hydra", lambda *a: calls.append(a) or pytest.fail("composed again"))
    assert load_config(overrides) == first and first.train.lr == 0.002 and not calls
    assert load_config(["experiment=quickstart", "train.lr=0.003"]).train.lr == 0.003  # values: same composition
    files[0].write_bytes(b"train: [not, a mapping")
    loader._COMPOSED.clear()
    monkeypatch.undo()
    monkeypatch.setenv(loader.COMPOSITION_STORE_ENV, str(tmp_path / "store"))
    assert load_config(overrides) == first
    assert files[0].read_bytes() != b"train: [not, a mapping"
    monkeypatch.setenv(loader.COMPOSITION_STORE_ENV, "off")
    assert loader.composition_file(("any",)) is None


@pytest.mark.parametrize("selections", [[], ["experiment=quickstart"], ["experiment=vlm_tiny"], ["model=pretrained"],
                                        ["experiment=qwen3_5_text_sft"]],
                         ids=["defaults", "quickstart", "vlm_tiny", "pretrained", "qwen3_5_text_sft"])
def test_a_stored_composition_reads_back_as_hydra_composed_it(tmp_path, monkeypatch, selections):
    """A stored composition (a pickle read through an allowlist, tests/unit/test_security.py) read back is Hydra's
    composition again: the same YAML, the same node types and struct flags, the same refusal of a wrong value."""
    from omegaconf import OmegaConf

    from megatron_pack.config.loader import ConfigError

    monkeypatch.setenv(loader.COMPOSITION_STORE_ENV, str(tmp_path / "store"))
    composed = loader._compose_with_hydra(selections, [])
    key = (tuple(selections), (), ("test",))
    loader._write_composition(loader.composition_file(key), composed)
    monkeypatch.setattr(loader, "_compose_with_hydra", lambda *a: pytest.fail("composed again"))
    stored = loader._stored_composition(key, selections, [])
    assert OmegaConf.to_yaml(stored) == OmegaConf.to_yaml(composed) and len(OmegaConf.to_yaml(stored)) > 1000
    assert OmegaConf.is_struct(stored) and not OmegaConf.is_struct(stored.data.sources)
    for group in loader.GROUPS:
        assert OmegaConf.get_type(stored[group]) is OmegaConf.get_type(composed[group]), group
    for bad in ("train.lr=fast", "train.no_such_key=1"):
        messages = []
        for base in (composed, stored):
            loader._COMPOSED.clear()
            monkeypatch.setattr(loader, "_stored_composition", lambda *a, _b=base: _b)
            with pytest.raises(ConfigError) as refused:
                load_config([*selections, bad])
            messages.append(str(refused.value))
        assert messages[0] == messages[1] and bad.split("=")[0].split(".")[1] in messages[0], messages
    loader._COMPOSED.clear()
