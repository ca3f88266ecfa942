"""Security: no pickle on any load path, nothing from a config is executed.

1. A static scan (AST, not grep: aliases such as ``import pickle as p`` are resolved) of every
   module under ``megatron_pack/`` fails on: ``allow_pickle=True``; an ``np.load`` without an
   explicit ``allow_pickle=False``; a bare ``pickle.load`` / ``pickle.loads`` / ``Unpickler``
   (or dill / marshal / shelve / ``pandas.read_pickle``); ``torch.load`` without
   ``weights_only=True``; ``eval`` / ``exec`` / ``__import__``; ``shell=True``, ``os.system``,
   ``os.popen``; ``yaml.load`` / ``yaml.unsafe_load``; ``trust_remote_code=True``; Hydra's
   ``instantiate`` / ``call`` / ``get_method`` / ``get_class`` (which import and call whatever a
   config names); a plain DCP ``FileSystemReader`` or a ``dcp.load`` without our
   ``checkpoint_reader`` (torch unpickles ``.metadata`` with plain ``pickle.load``). The scanner is itself tested on a snippet holding every violation, so a
   broken scanner cannot pass vacuously.
2. Poisoned files carrying a pickle payload (a checkpoint's per-rank file, its DCP
   ``.metadata``, a token-store array) are refused without running the payload.
3. Config values that look like shell or Python (``$(...)``, backticks, ``__import__``) are
   treated as paths: they fail with a clear message and run nothing.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import textwrap
from pathlib import Path

import numpy as np
import pytest

import megatron_pack

PACKAGE_DIR = Path(megatron_pack.__file__).resolve().parent
PICKLE_MODULES = ("pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "cloudpickle", "joblib")
PICKLE_LOADERS = ("load", "loads", "Unpickler", "open")
DCP_READERS = ("torch.distributed.checkpoint.FileSystemReader",
               "torch.distributed.checkpoint.filesystem.FileSystemReader")
DCP_LOADS = ("torch.distributed.checkpoint.load", "torch.distributed.checkpoint.state_dict_loader.load")
BANNED_CALLS = {
    "eval": "eval() on a value", "exec": "exec() on a value", "__import__": "__import__() of a name",
    "os.system": "os.system (a shell)", "os.popen": "os.popen (a shell)",
    "yaml.load": "yaml.load (use yaml.safe_load)", "yaml.unsafe_load": "yaml.unsafe_load",
    "pandas.read_pickle": "pandas.read_pickle",
    "hydra.utils.instantiate": "hydra instantiate (calls what a config names)",
    "hydra.utils.call": "hydra call (calls what a config names)",
    "hydra.utils.get_method": "hydra get_method", "hydra.utils.get_class": "hydra get_class",
}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted origin, from every import in the module (any nesting level)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(func: ast.expr, aliases: dict[str, str]) -> str:
    """``np.load`` -> ``numpy.load`` (through the import aliases); '' for anything else."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return ""
    parts.append(aliases.get(func.id, func.id))
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str):
    """The constant value of keyword ``name`` ('missing' when absent, 'dynamic' when not a constant)."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value.value if isinstance(kw.value, ast.Constant) else "dynamic"
    return "missing"


def _call_problems(call: ast.Call, name: str) -> list[str]:
    problems = []
    for flag, bad in (("allow_pickle", True), ("shell", True), ("trust_remote_code", True)):
        if _kw(call, flag) is bad:
            problems.append(f"{flag}=True")
    head, _, tail = name.rpartition(".")
    if name in ("numpy.load",) and _kw(call, "allow_pickle") is not False:
        problems.append("np.load without allow_pickle=False")
    if name == "torch.load" and _kw(call, "weights_only") is not True:
        problems.append("torch.load without weights_only=True")
    if name in DCP_READERS:
        problems.append(f"{name.rsplit('.', 1)[1]} reads DCP .metadata with plain pickle (use checkpoint_reader)")
    if name in DCP_LOADS and _kw(call, "storage_reader") == "missing":
        problems.append("dcp.load without storage_reader=checkpoint_reader(...) (plain pickle of .metadata)")
    if head.split(".")[0] in PICKLE_MODULES and tail in PICKLE_LOADERS:
        problems.append(f"bare {name}")
    if name in BANNED_CALLS:
        problems.append(BANNED_CALLS[name])
    return problems


def scan_source(source: str, filename: str = "<string>") -> tuple[list[str], dict[str, int]]:
    """(problems as 'file:line: what', counts of the safe loads seen) for one module's source."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    problems, counts = [], {"numpy.load": 0, "torch.load": 0}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        counts[name] = counts.get(name, 0) + 1
        problems += [f"{filename}:{node.lineno}: {p}" for p in _call_problems(node, name)]
    return problems, counts


def scan_package(root: Path = PACKAGE_DIR) -> tuple[list[str], dict[str, int], int]:
    problems, totals, num_files = [], {}, 0
    for path in sorted(root.rglob("*.py")):
        found, counts = scan_source(path.read_text(encoding="utf-8"), str(path.relative_to(root.parent)))
        problems += found
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
        num_files += 1
    return problems, totals, num_files


BAD_SNIPPET = textwrap.dedent("""
    import pickle as pk
    import numpy as np
    import torch, subprocess, os, yaml
    from pickle import loads
    from hydra.utils import instantiate
    np.load("a.npy", allow_pickle=True)
    np.load("b.npy")
    pk.load(open("c", "rb"))
    loads(b"")
    pk.Unpickler(open("d", "rb")).load()
    torch.load("e.pt")
    torch.load("f.pt", weights_only=False)
    eval(cfg.data.input)
    exec("x = 1")
    subprocess.run(cmd, shell=True)
    os.system("ls")
    yaml.load(text)
    instantiate(cfg)
    AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    import torch.distributed.checkpoint as dcp
    dcp.FileSystemReader(path).read_metadata()
    dcp.load(state, checkpoint_id=path)
""")
EXPECTED = ["allow_pickle=True", "np.load without allow_pickle=False", "bare pickle.load", "bare pickle.loads",
            "bare pickle.Unpickler", "torch.load without weights_only=True", "eval() on a value",
            "exec() on a value", "shell=True", "os.system (a shell)", "yaml.load (use yaml.safe_load)",
            "hydra instantiate (calls what a config names)", "trust_remote_code=True",
            "FileSystemReader reads DCP .metadata with plain pickle (use checkpoint_reader)",
            "dcp.load without storage_reader=checkpoint_reader(...) (plain pickle of .metadata)"]


@pytest.mark.parametrize("what", EXPECTED, ids=[e.split(" ")[0] + f"-{i}" for i, e in enumerate(EXPECTED)])
def test_scanner_catches(what):
    problems, _ = scan_source(BAD_SNIPPET, "bad.py")
    assert any(p.endswith(f": {what}") for p in problems), problems


def test_scanner_accepts_safe_calls():
    safe = ("import numpy as np, torch, yaml\nnp.load('a', mmap_mode='r', allow_pickle=False)\n"
            "torch.load('b', weights_only=True)\nyaml.safe_load('x: 1')\n")
    assert scan_source(safe) == ([], {"numpy.load": 1, "torch.load": 1, "yaml.safe_load": 1})


def test_package_has_no_unsafe_load_or_exec():
    problems, counts, num_files = scan_package()
    assert num_files >= 30 and counts["numpy.load"] >= 8 and counts["torch.load"] >= 1  # the scan saw real code
    assert problems == [], "unsafe calls in megatron_pack/:\n" + "\n".join(problems)


class _Payload:
    """Unpickling this runs ``os.system('touch <marker>')``: proof that a loader executed code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_poisoned_checkpoint_rank_file_is_refused(tmp_path):
    import torch
    from _checkpoints import load, save, world_of_one

    from megatron_pack.training.checkpoint import read_rank_state

    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with world_of_one():
        path = save(tmp_path / "ckpt", 1, {"w": weight}, {}, rank_state={"step": 1}, meta={})
        assert torch.equal(load(path, {"w": torch.zeros(2, 3)}, {})[0]["w"], weight)
    marker = tmp_path / "pwned"
    with open(path / "rank_00000.pt", "wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only"):
        read_rank_state(path)  # what a resume reads of it (trainer_checkpoint.load_trainer)
    assert not marker.exists()


def test_poisoned_dcp_metadata_is_refused(tmp_path):
    """torch DCP reads ``.metadata`` with plain ``pickle.load``; ours goes through an allowlist."""
    import torch
    from _checkpoints import load, save, world_of_one

    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    marker = tmp_path / "pwned"
    with world_of_one():
        path = save(tmp_path / "ckpt", 1, {"w": weight}, {}, rank_state={"step": 1}, meta={})
        assert torch.equal(load(path, {"w": torch.zeros(2, 3)}, {})[0]["w"], weight)  # the allowlist reads a genuine one
        (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
        with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system|not allowed"):
            load(path, {"w": torch.zeros(2, 3)}, {})
    assert not marker.exists()


def test_poisoned_composition_store_file_is_refused_and_composed_anew(tmp_path, monkeypatch):
    """Hydra's compositions are pickled between processes (config/loader.py); a file of the store replaced by a
    payload is refused by the allowlist unpickler, never run, and the config is composed again."""
    from megatron_pack.config import load_config, loader

    monkeypatch.setenv(loader.COMPOSITION_STORE_ENV, str(tmp_path / "store"))
    loader._COMPOSED.clear()
    first = load_config(["experiment=quickstart"])
    (stored,) = (tmp_path / "store" / "compositions").glob("*.pkl")
    assert isinstance(loader._CompositionUnpickler.load(stored), loader.DictConfig)  # the allowlist reads a genuine one
    marker = tmp_path / "pwned"
    stored.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        loader._CompositionUnpickler.load(stored)
    loader._COMPOSED.clear()
    assert load_config(["experiment=quickstart"]) == first
    assert not marker.exists()
    assert stored.read_bytes() != pickle.dumps(_Payload(marker))  # rewritten by the composition
    loader._COMPOSED.clear()


def test_poisoned_store_array_is_refused(tmp_path):
    """An object array (a pickle inside .npy) with matching checksums still never unpickles."""
    from megatron_pack.config import Config, DataConfig, PackingConfig
    from megatron_pack.data.store.atomic import sha256_file
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.prepare import prepare

    cfg = Config(data=DataConfig(synthetic_num_samples=40, dataset_dir=str(tmp_path / "ds"), tokenize_workers=1),
                 packing=PackingConfig(packed_sequence_size=256))
    plan_dir = prepare(cfg, progress=False)
    marker = tmp_path / "pwned"
    tokens = tmp_path / "ds" / "tokens.npy"
    np.save(tokens, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    meta_path = tmp_path / "ds" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["tokens.npy"] = {"sha256": sha256_file(tokens), "size": tokens.stat().st_size}
    meta_path.write_text(json.dumps(meta))  # an attacker who also rewrites the checksums
    with pytest.raises(ValueError, match="Python objects|allow_pickle=False|Object arrays"):
        PackedSFTDataset(tmp_path / "ds", plan_dir)
    assert not marker.exists()


SHELL_LIKE = ["$(touch {m})", "`touch {m}`", "x; touch {m}", "__import__('os').system('touch {m}')"]


@pytest.mark.parametrize("template", SHELL_LIKE, ids=["dollar-paren", "backticks", "semicolon", "python"])
def test_config_paths_are_never_executed(tmp_path, template, capsys):
    from megatron_pack.cli.prepare import main as prepare_main

    marker = tmp_path / "pwned"
    value = template.format(m=marker)
    for override in (f"data.input={value}", f"data.tokenizer={value}"):
        argv = ["data.source=files", f"data.dataset_dir={tmp_path / 'ds'}", "data.tokenize_workers=1",
                f"data.input={tmp_path / 'missing.jsonl'}", override]
        code = prepare_main(argv)
        err = capsys.readouterr().err
        assert code == 2, err
        assert ("matches no .jsonl" in err or "data.tokenizer (" in err
                or "config problem" in err), err
    assert not marker.exists()
    assert not (tmp_path / "ds").exists()


def test_verify_refuses_a_poisoned_checkpoint(tmp_path):
    """`megatron-pack verify verify.checkpoint=...` reads the same .metadata through the allowlist."""
    import torch
    from _checkpoints import save, world_of_one

    from megatron_pack.cli.verify import load_model_weights
    from megatron_pack.training.checkpoint_files import DamagedCheckpoint, digest, write_manifest

    with world_of_one():
        path = save(tmp_path / "ckpt", 1, {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, {},
                    rank_state={"step": 1}, meta={})
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(DamagedCheckpoint, match=r"\.metadata has [0-9,]+ bytes, its manifest records"):  # the manifest first
        load_model_weights(torch.nn.Linear(2, 2), path)
    files = json.loads((path / "manifest.json").read_text())["files"]
    write_manifest(path, {**files, ".metadata": digest(path / ".metadata")})  # the manifest forged too
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        load_model_weights(torch.nn.Linear(2, 2), path)
    assert not marker.exists()
