"""Issue 43, items 1, 4 and 5, at the unit level (the command lines as typed are in
tests/functional/test_vocab_resize.py and below).

1. The vocabulary rule (``config.validate.tokenizer_vocab_problems``) and the recorded model.vocab_size
   (``recorded._vocab_setting``): a pretrained folder's vocabulary never grows without ``model.resize_vocab``;
   with it, the new rows are transformers' mean resizing (``model.hf.resize``), checked against
   ``resize_token_embeddings(mean_resizing=True)`` itself.
4. A ShareGPT record with images read without data.format=sharegpt names the preset, as the text record does.
5. ``checkpoint.load`` takes one checkpoint folder (``step_*``) as well as a folder of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf import make_family  # noqa: E402
from _user_path import refused  # noqa: E402

from megatron_pack.config import load_config  # noqa: E402
from megatron_pack.config.schema import ConfigError  # noqa: E402


# ---------------------------------------------------------------- 1. the vocabulary rule

def _model(vocab: int, pretrained: bool, resize: bool):
    from dataclasses import replace

    cfg = load_config([])
    model = replace(cfg.model, vocab_size=vocab, pretrained="models/llama" if pretrained else None,
                    resize_vocab=resize)
    return replace(cfg, model=model)


# (id, model rows, pretrained, resize_vocab, tokenizer ids, None (accepted) or fragments of the refusal)
RULE_CASES = [
    ("pretrained-larger-tokenizer", 256, True, False, 32000,
     ["has 32000 ids", "has 256 embedding rows", "data.tokenizer=models/llama", "model.resize_vocab=true"]),
    ("pretrained-resize", 256, True, True, 32000, None),
    ("pretrained-smaller-tokenizer", 32000, True, False, 256, None),
    ("pretrained-same-size", 301, True, False, 301, None),
    ("built-larger-tokenizer", 384, False, False, 512, ["model.vocab_size (384)", "model.vocab_size=512"]),
    ("built-fits", 512, False, False, 384, None),
]


@pytest.mark.parametrize("vocab,pretrained,resize,tokenizer,fragments", [c[1:] for c in RULE_CASES],
                         ids=[c[0] for c in RULE_CASES])
def test_the_vocabulary_rule(vocab, pretrained, resize, tokenizer, fragments):
    from megatron_pack.config.validate import tokenizer_vocab_problems

    problems = tokenizer_vocab_problems(_model(vocab, pretrained, resize), tokenizer, "where")
    if fragments is None:
        assert problems == []
    else:
        assert len(problems) == 1 and "\n" not in problems[0], problems
        assert all(f in problems[0] for f in fragments), problems[0]


# (id, model rows, pretrained, resize_vocab, tokenizer ids, model.vocab_size recorded or None)
SETTING_CASES = [
    ("pretrained-never-grows", 256, True, False, 32000, None),
    ("pretrained-resize-to-the-tokenizer", 256, True, True, 300, 300),
    ("pretrained-resize-never-shrinks", 32000, True, True, 300, None),
    ("built-grows-to-128", 384, False, False, 500, 512),
    ("built-fits", 512, False, False, 500, None),
]


@pytest.mark.parametrize("vocab,pretrained,resize,tokenizer,expected", [c[1:] for c in SETTING_CASES],
                         ids=[c[0] for c in SETTING_CASES])
def test_the_plan_sets_model_vocab_size_only_where_allowed(vocab, pretrained, resize, tokenizer, expected):
    from megatron_pack.data.store.recorded import _vocab_setting

    setting = _vocab_setting(_model(vocab, pretrained, resize), tokenizer, set())
    assert setting == ({} if expected is None else {"model.vocab_size": expected})


def test_resize_vocab_without_a_pretrained_folder_is_refused():
    with pytest.raises(ConfigError, match="model.resize_vocab .True. grows a pretrained"):
        load_config(["model.resize_vocab=true"])


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("resize")
    return {f: make_family(root, f) for f in ("llama_rope", "llama_tied")}


@pytest.mark.parametrize("family", ["llama_rope", "llama_tied"])
def test_new_rows_are_transformers_mean_resizing(families, family):
    """Rows [0, V) are the folder's; the new ones equal transformers' draw from N(mean, 1e-9 cov) of the old
    rows to within the draw's spread (about 1e-6 here), far below the distance of the mean from zero."""
    import transformers as T

    from megatron_pack.model.hf.load import SafetensorsFolder
    from megatron_pack.model.hf.resize import GrownVocab

    folder, new = families[family], 360
    tied = family == "llama_tied"
    names = ("model.embed_tokens.weight",) + (() if tied else ("lm_head.weight",))
    reference = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    old = {n: reference.get_parameter(n).detach().clone() for n in names}
    torch.manual_seed(0)
    reference.resize_token_embeddings(new, mean_resizing=True)
    grown = GrownVocab(SafetensorsFolder(folder), names, new)
    for name in names:
        want = reference.get_parameter(name).detach()
        ours = grown.read(name)
        assert ours.shape == want.shape == (new, 64)
        assert torch.equal(ours[:301], old[name])
        assert torch.allclose(ours[301:], want[301:], atol=1e-5, rtol=0), (ours[301:] - want[301:]).abs().max()
        assert want[301:].abs().mean() > 1e-4  # guard: the mean is far from zero at this tolerance
        assert torch.equal(grown.read(name, slice(290, 310)), ours[290:310])  # a slice across the old end
    assert reference.config.vocab_size == new


@pytest.mark.parametrize("resize", [False, True], ids=["refused", "resize-vocab"])
def test_a_stream_run_checks_the_tokenizer_as_a_prepared_one(tmp_path, families, resize):
    """packing.online_source=stream reads nothing prepared: the rule reads the tokenizer itself before launch."""
    from _hf import larger_tokenizer

    from megatron_pack.cli.run_config import load_run_config

    larger_tokenizer(tmp_path / "big-tok", 361)
    argv = ["model=pretrained", f"model.pretrained={families['llama_rope']}", f"data.tokenizer={tmp_path}/big-tok",
            "packing.mode=online", "packing.online_source=stream", "train.train_iters=2",
            *(["model.resize_vocab=true"] if resize else [])]
    if resize:
        run = load_run_config(argv, world_size=1, open_data=False)
        assert run.cfg.model.vocab_size == 361 and any("model.vocab_size=361 (was 301)" in n for n in run.notes)
    else:
        with pytest.raises(ConfigError, match="has 361 ids .* has 301 embedding rows"):
            load_run_config(argv, world_size=1, open_data=False)


# (id, rows beyond config.json's 5 of vocabulary: None or their value, refused)
EXPORT_CASES = [("tp-pad-rows-zero", 0.0, False), ("grown-rows-trained", 0.5, True), ("no-extra-rows", None, False)]


@pytest.mark.parametrize("extra,is_refused", [c[1:] for c in EXPORT_CASES], ids=[c[0] for c in EXPORT_CASES])
def test_export_never_cuts_trained_vocabulary_rows(extra, is_refused):
    """An export against a folder of the old vocab_size (model.pretrained= the original on the export command line)
    would cut a resized model's rows: refused; TP pad rows (zeros) are dropped as before."""
    from megatron_pack.model.hf.transforms import Dims, transform

    dims = Dims(num_heads=1, num_groups=1, head_dim=2, ffn=2, vocab=5, tp=1, hidden=2)
    whole = torch.ones(5, 2) if extra is None else torch.cat([torch.ones(5, 2), torch.full((2, 2), extra)])
    if is_refused:
        with pytest.raises(ValueError, match="7 rows holding values beyond the 5"):
            transform("vocab").export([whole], dims)
    else:
        assert torch.equal(transform("vocab").export([whole], dims)[0], torch.ones(5, 2))


# ---------------------------------------------------------------- 4. ShareGPT with images

@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    from _vlm_data import make_vlm_data_folder

    return make_vlm_data_folder(tmp_path_factory.mktemp("vlm"))


@pytest.mark.parametrize("with_images", [False, True], ids=["text", "images"])
def test_sharegpt_records_without_the_preset_name_it(tmp_path, vlm_folder, with_images):
    from _vlm_data import make_image, write_jsonl

    record = {"conversations": [{"from": "human", "value": "<image>and <image>what?" if with_images else "what?"},
                                {"from": "gpt", "value": "a red square"}]}
    if with_images:
        make_image(tmp_path / "img" / "a.png", 40, 40)
        record["images"] = ["img/a.png", "img/a.png"]
    write_jsonl(tmp_path / "t.jsonl", [record])
    out = refused(tmp_path, "prepare", "data=files", "data.input=t.jsonl", f"data.tokenizer={vlm_folder}",
                  "data.dataset_dir=ds", "packing.packed_sequence_size=128", "model.seq_length=128",
                  "data.tokenize_workers=1")
    assert "data.format=sharegpt" in out and "t.jsonl: line 1:" in out, out
    assert "image placeholder" not in out and "Traceback" not in out, out


# ---------------------------------------------------------------- 5. checkpoint.load=<one step_* folder>

def _checkpoint(root: Path, step: int) -> Path:
    from megatron_pack.training.checkpoint_files import SHARDED_FORMAT, digest, write_manifest

    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "world_size": 2, "tensor_model_parallel_size": 1,
                                                "context_parallel_size": 2, "data_parallel_size": 1,
                                                "format": SHARDED_FORMAT}))
    (path / "weights.bin").write_bytes(b"x" * 16)
    write_manifest(path, {n: digest(path / n) for n in ("meta.json", "weights.bin")})
    (root / "latest").write_text(path.name)
    return path


# (id, checkpoint.load relative to the run folder, extra keys, step chosen or fragments of the refusal)
LOAD_CASES = [
    ("folder-of-them-newest", "old/checkpoints", [], 4),
    ("one-checkpoint", "old/checkpoints/step_00000002", [], 2),
    ("one-checkpoint-weights-only", "old/checkpoints/step_00000002", ["checkpoint.load_weights_only=true"], 2),
    ("one-damaged-checkpoint", "old/checkpoints/step_00000004:damaged", [],
     ["checkpoint.load (", "step_00000004", "refused", "step_00000002 beside it is intact"]),
    ("no-checkpoint", "old", [], ["holds no complete checkpoint"]),
]


@pytest.mark.parametrize("load,extra,expected", [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES])
def test_checkpoint_load_takes_one_checkpoint_or_a_folder_of_them(tmp_path, load, extra, expected):
    from megatron_pack.training.resume import resume_choice

    root = tmp_path / "old" / "checkpoints"
    steps = {s: _checkpoint(root, s) for s in (2, 4)}
    load, _, damaged = load.partition(":")
    if damaged:
        (steps[4] / "weights.bin").write_bytes(b"x" * 3)
    cfg = load_config([f"train.output_dir={tmp_path}/new", f"checkpoint.load={tmp_path / load}", *extra])
    if isinstance(expected, int):
        choice = resume_choice(cfg)
        assert choice.path == steps[expected] and not choice.skipped
        assert choice.kind == ("weights" if extra else "resume")
    else:
        with pytest.raises(ConfigError) as info:
            resume_choice(cfg)
        assert all(f in str(info.value) for f in expected), str(info.value)
