"""The torch-free model-folder and tokenizer-folder checks, on hand-written safetensors files.

Each file is written here byte by byte (8-byte header length, JSON header, tensor bytes), so a
case says exactly what is wrong; the functional tests (test_reliability_folders.py) run the same
checks through the commands on a real transformers folder.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.model.hf.folder_check import folder_problems, nonfinite_problems, read_header
from megatron_pack.model.hf.rules import hf_shapes

HF = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
      "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
      "tie_word_embeddings": False}


def _bits(values: np.ndarray, dtype: str) -> bytes:
    if dtype == "F32":
        return values.astype("<f4").tobytes()
    if dtype == "F16":
        return values.astype("<f2").tobytes()
    if dtype == "BF16":  # the upper 16 bits of float32
        return (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    return values.astype("<f8").tobytes()


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple, np.ndarray]], *, tail: bytes = b"",
                      header_patch=None) -> None:
    """``{name: (dtype, shape, values)}`` as a safetensors file; ``header_patch`` edits the header dict."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, values) in tensors.items():
        blob = _bits(np.asarray(values, dtype=np.float64).reshape(-1), dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if header_patch:
        header_patch(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs) + tail)


def model_folder(root: Path, *, dtype: str = "F32", edit=None, tail: bytes = b"", header_patch=None) -> Path:
    """A folder of the tiny Llama of ``HF`` in one ``model.safetensors`` (``edit`` changes the tensors)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(HF))
    rng = np.random.default_rng(0)
    tensors = {n: (dtype, s, rng.standard_normal(int(np.prod(s)))) for n, s in hf_shapes(HF).items()}
    if edit:
        edit(tensors)
    write_safetensors(root / "model.safetensors", tensors, tail=tail, header_patch=header_patch)
    return root


def _drop(name):
    return lambda t: t.pop(name)


def _reshape(name, shape):
    return lambda t: t.update({name: (t[name][0], shape, np.zeros(int(np.prod(shape))))})


def _retype(name, dtype):
    return lambda t: t.update({name: (dtype, t[name][1], t[name][2])})


def _extra(t):
    t["model.layers.0.mlp.extra_proj.weight"] = ("F32", (2,), np.zeros(2))


def _hole(header):
    name = next(iter(header))
    header[name]["data_offsets"] = [4, header[name]["data_offsets"][1] + 4]


UP = "model.layers.0.mlp.up_proj.weight"
# (id, how the folder is made, the fragment of the one problem)
CASES = [
    ("missing-tensor", dict(edit=_drop(UP)), f"has no tensor {UP}, which the llama mapping needs (config.json: 1 layers)"),
    ("wrong-shape", dict(edit=_reshape(UP, (13, 8))), f"holds {UP} with shape [13, 8], config.json gives [12, 8]"),
    ("f64-dtype", dict(edit=_retype(UP, "F64")), f"holds {UP} as F64, which megatron_pack does not load (F32, BF16, F16)"),
    ("extra-tensor", dict(edit=_extra), "tensors ['model.layers.0.mlp.extra_proj.weight'] (1 in all) map to no"),
    ("trailing-bytes", dict(tail=b"xx"), "has a broken safetensors header (2 bytes follow its last tensor)"),
    ("hole", dict(header_patch=_hole), "has a broken safetensors header (tensor"),
]


@pytest.mark.parametrize("make,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_folder_problems(tmp_path, make, fragment):
    problems = folder_problems(model_folder(tmp_path / "m", **make))
    assert len(problems) == 1 and fragment in problems[0], problems
    assert problems[0].startswith(f"model.pretrained ({tmp_path / 'm'})") and "\n" not in problems[0]


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16"])
def test_intact_folder_has_no_problem(tmp_path, dtype):
    folder = model_folder(tmp_path / "m", dtype=dtype)
    assert folder_problems(folder) == [] and nonfinite_problems(folder) == []
    assert len(read_header(folder / "model.safetensors", "x")) == len(hf_shapes(HF))  # guard: tensors were read


def test_truncated_header_length(tmp_path):
    folder = model_folder(tmp_path / "m")
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    problems = folder_problems(folder)
    assert len(problems) == 1 and "(it says" in problems[0] and "header bytes follow" in problems[0], problems


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(["F32", "BF16", "F16"]), num_nan=st.integers(0, 5), num_inf=st.integers(0, 5),
       seed=st.integers(0, 2**16))
def test_nonfinite_count_matches_numpy(tmp_path_factory, dtype, num_nan, num_inf, seed):
    """Bit tests on the raw bytes count exactly the NaN and Inf that numpy sees in the same values."""
    root = tmp_path_factory.mktemp("nan")
    rng = np.random.default_rng(seed)
    name = "model.layers.0.mlp.down_proj.weight"
    spots = rng.choice(int(np.prod(hf_shapes(HF)[name])), size=num_nan + num_inf, replace=False)

    def poison(tensors):
        values = np.array(tensors[name][2], dtype=np.float64)
        values[spots[:num_nan]] = np.nan
        values[spots[num_nan:]] = rng.choice([np.inf, -np.inf], size=num_inf)
        tensors[name] = (dtype, tensors[name][1], values)

    folder = model_folder(root / "m", dtype=dtype, edit=poison)
    problems = nonfinite_problems(folder, chunk_elements=7)  # several chunks per tensor
    if num_nan + num_inf == 0:
        assert problems == []
    else:
        assert len(problems) == 1 and f"holds {name} with {num_nan} NaN and {num_inf} Inf values" in problems[0]


def _tokenizer(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def _config(cls: str) -> str:
    return json.dumps({"tokenizer_class": cls, "eos_token": "</s>"})


# (id, files of the folder (None: no folder), problem fragment or None)
TOKENIZER_CASES = [
    ("fast-file-any-class", {"tokenizer.json": "{}", "tokenizer_config.json": _config("LlamaTokenizer")}, None),
    ("llama-no-files", {"tokenizer_config.json": _config("LlamaTokenizer")},
     "names LlamaTokenizer, which reads tokenizer.json or tokenizer.model; the folder has none of them"),
    ("qwen2-vocab-merges", {"vocab.json": "{}", "merges.txt": "", "tokenizer_config.json": _config("Qwen2Tokenizer")},
     None),
    ("qwen2-no-merges", {"vocab.json": "{}", "tokenizer_config.json": _config("Qwen2Tokenizer")},
     "names Qwen2Tokenizer, which reads tokenizer.json or vocab.json + merges.txt"),
    ("generic-fast-needs-json", {"tokenizer.model": "x", "tokenizer_config.json": _config("PreTrainedTokenizerFast")},
     "names PreTrainedTokenizerFast, which reads tokenizer.json; the folder has none"),
    ("no-tokenizer-files", {"config.json": "{}"}, "holds no tokenizer files (tokenizer.json, tokenizer_config.json"),
    ("bad-config-json", {"tokenizer_config.json": "{nope"}, "not a valid tokenizer_config.json"),
    ("missing-folder", None, "does not exist (nothing at"),
]


@pytest.mark.parametrize("files,fragment", [c[1:] for c in TOKENIZER_CASES], ids=[c[0] for c in TOKENIZER_CASES])
def test_tokenizer_folder_problem(tmp_path, files, fragment):
    from megatron_pack.data.formats.tokenizer_files import tokenizer_folder_problem

    folder = tmp_path / "tok" if files is None else _tokenizer(tmp_path / "tok", files)
    problem = tokenizer_folder_problem(str(folder))
    assert (problem is None) == (fragment is None), problem
    if fragment:
        assert fragment in problem and "\n" not in problem, problem


def test_hub_ids_and_paths(tmp_path, monkeypatch):
    """``org/name`` that is no local path is named a possible Hub id; a local path never is."""
    from megatron_pack.config.hf_config import hub_id_problem

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "llama").mkdir(parents=True)
    for value in ("mistralai/Mistral-7B-v0.1", "Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.1-8B"):
        assert "no network access to model hubs here" in hub_id_problem(value, "model.pretrained")
    for value in ("models/llama", "./org/name", "/abs/org/name", "a/b/c", "byte"):
        assert hub_id_problem(value, "model.pretrained") is None, value
