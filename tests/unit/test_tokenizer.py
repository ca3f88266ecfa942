"""Tokenizers: the byte tokenizer's masks token by token, and a tiny Hugging Face tokenizer built here."""

import json

import numpy as np
import pytest

from megatron_pack.data.formats.chat import RecordError, SampleSchema
from megatron_pack.data.formats.tokenizer import ByteTokenizer, build_tokenizer

BYTE = ByteTokenizer()
PC = SampleSchema("prompt_completion")
CHAT = SampleSchema("chat")
AUTO = SampleSchema("auto")
B, E = BYTE.bos_id, BYTE.eos_id
U, A, S = BYTE.role_ids["user"], BYTE.role_ids["assistant"], BYTE.role_ids["system"]

BYTE_CASES = [
    ({"prompt": "ab", "completion": "c"}, PC, True, [B, 97, 98, 99, E], [0, 0, 0, 1, 1]),
    ({"prompt": "ab", "completion": "c"}, PC, False, [B, 97, 98, 99, E], [1, 1, 1, 1, 1]),
    ({"prompt": "", "completion": "é"}, PC, True, [B, 0xC3, 0xA9, E], [0, 1, 1, 1]),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, CHAT, True,
     [B, U, 104, 105, E, A, 121, 111, E], [0, 0, 0, 0, 0, 0, 1, 1, 1]),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"},
                   {"role": "assistant", "content": "b"}]}, AUTO, True,
     [B, S, 115, E, U, 113, E, A, 97, E, U, 114, E, A, 98, E], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]),
    ({"prompt": "x", "completion": "y"}, AUTO, True, [B, 120, 121, E], [0, 0, 1, 1]),
]


@pytest.mark.parametrize("record,schema,answer_only,ids,mask", BYTE_CASES,
                         ids=["pc", "pc-all-tokens", "pc-utf8", "chat", "chat-multi-turn-auto", "pc-auto"])
def test_byte_token_by_token(record, schema, answer_only, ids, mask):
    got_ids, got_mask = BYTE.encode_sample(record, schema, answer_only_loss=answer_only)
    assert got_ids.tolist() == ids
    assert got_mask.tolist() == mask
    assert got_ids[-1] == BYTE.eos_id


@pytest.mark.parametrize("record,schema,match", [
    ({"prompt": "a"}, PC, "missing key 'completion'"),
    ({"prompt": 1, "completion": "b"}, PC, "must be a string, got int"),
    ({"messages": "hi"}, CHAT, "non-empty list"),
    ({"messages": [{"role": "bot", "content": "x"}]}, CHAT, "role"),
    ({"messages": [{"role": "user", "content": 3}]}, CHAT, "string 'content'"),
    ({"text": "x"}, AUTO, "neither 'messages'"),
], ids=["missing-key", "wrong-type", "messages-not-list", "bad-role", "content-not-str", "auto-unknown"])
def test_byte_bad_records(record, schema, match):
    with pytest.raises(RecordError, match=match):
        BYTE.encode_sample(record, schema)


def test_byte_roundtrip_and_identity():
    text = "héllo, wörld ✓"
    assert BYTE.decode(BYTE.encode(text)) == text
    assert BYTE.decode([B, 104, E]) == "<bos>h<eos>"
    ident = BYTE.identity()
    assert ident == build_tokenizer("byte").identity()
    assert ident["special_ids"] == {"bos": B, "eos": E, "pad": BYTE.pad_id} and ident["vocab_size"] == 263


def test_build_tokenizer_rejects_unknown_name(tmp_path):
    with pytest.raises(ValueError, match=r"data.tokenizer \(.*nope\) does not exist .*, or set data.tokenizer=byte"):
        build_tokenizer(str(tmp_path / "nope"))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
                 "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Two tiny local HF tokenizers (same BPE vocab; chat template without / with generation markers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["hello world", "what is two plus two", "four", "the answer is", "system user assistant"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    dirs = {}
    for name, template in (("plain", CHATML), ("marked", CHATML_MARKED)):
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                       pad_token="<pad>")
        fast.chat_template = template
        path = tmp_path_factory.mktemp(f"hf_{name}")
        fast.save_pretrained(path)
        dirs[name] = str(path)
    return dirs


MESSAGES = [
    [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "again"},
     {"role": "assistant", "content": "the answer is four"}],
]


@pytest.mark.parametrize("messages", MESSAGES, ids=["one-turn", "multi-turn-with-system"])
def test_hf_prefix_mask_matches_generation_markers(hf_dirs, messages):
    plain, marked = build_tokenizer(hf_dirs["plain"]), build_tokenizer(hf_dirs["marked"])
    ids_p, mask_p = plain.chat_ids_and_mask(messages)
    ids_m, mask_m = marked.chat_ids_and_mask(messages, use_generation_markers=True)
    assert ids_p == ids_m
    assert mask_p == mask_m
    assert sum(mask_p) > len([m for m in messages if m["role"] == "assistant"])  # spans, not single tokens
    ids_prefix_on_marked, mask_prefix_on_marked = marked.chat_ids_and_mask(messages, use_generation_markers=False)
    assert mask_prefix_on_marked == mask_m


def test_hf_chat_mask_token_by_token(hf_dirs):
    tok = build_tokenizer(hf_dirs["plain"])
    ids, mask = tok.encode_sample({"messages": MESSAGES[0]}, CHAT)
    text_answer = tok.decode(ids[mask == 1])
    assert text_answer == "four<|im_end|>"  # the template's turn end is the sample's eos: no second one
    assert tok.decode(ids[mask == 0]).startswith("<|im_start|>user\nwhat is two plus two<|im_end|>")
    assert ids[-1] == tok.eos_id and mask[-1] == 1  # template ends with "<|im_end|>\n": cut after the eos
    _, all_mask = tok.encode_sample({"messages": MESSAGES[0]}, CHAT, answer_only_loss=False)
    assert all_mask.all()


def test_hf_prompt_completion_and_identity(hf_dirs):
    tok = build_tokenizer(hf_dirs["plain"])
    ids, mask = tok.encode_sample({"prompt": "hello", "completion": " world"}, PC)
    assert ids[-1] == tok.eos_id and mask[-1] == 1
    assert tok.decode(ids[mask == 1]) == " world<|im_end|>"
    assert tok.decode(ids[mask == 0]) == "hello"
    ident, other = tok.identity(), build_tokenizer(hf_dirs["marked"]).identity()
    assert ident["vocab_hash"] != other["vocab_hash"]  # the chat template is part of the identity
    assert ident["special_ids"]["eos"] == tok.eos_id and tok.pad_id == ident["special_ids"]["pad"]
    assert isinstance(ids, np.ndarray)


# ----- a full model folder loads as its tokenizer-only copy does (issue 34 item 13) ---------------------

MODEL_FOLDERS = [  # (id, config.json model_type, tokenizer_config class, pre-tokenizer, loaded without AutoTokenizer)
    ("llama-generic-fast", "llama", "TokenizersBackend", "byte_level", True),
    ("llama-LlamaTokenizer-metaspace", "llama", "LlamaTokenizer", "metaspace", True),
    ("llama-LlamaTokenizer-byte-level", "llama", "LlamaTokenizer", "byte_level", False),  # AutoTokenizer swaps it
    ("qwen3-Qwen2Tokenizer", "qwen3", "Qwen2Tokenizer", "byte_level", True),
    ("qwen3_moe-generic-fast", "qwen3_moe", "PreTrainedTokenizerFast", "byte_level", False),  # registered: Qwen2
    ("mistral-LlamaTokenizer", "mistral", "LlamaTokenizer", "metaspace", True),  # swapped to the generic backend
    ("mixtral-LlamaTokenizer", "mixtral", "LlamaTokenizer", "metaspace", True),
    ("phi3-LlamaTokenizer", "phi3", "LlamaTokenizer", "metaspace", False),  # a type the table does not know
]
TEXTS = ["hello world", " what is two plus two?", "the answer is four\n", "<s>system user</s> assistant"]


def _model_folder(path, model_type: str, tokenizer_class: str, pre: str):
    """A tiny model folder as a hub download holds it: config.json + tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>" if pre == "metaspace" else None))
    if pre == "metaspace":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = []
    else:
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    corpus = ["hello world", "what is two plus two", "four", "the answer is", "system user assistant"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=alphabet))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHATML.replace("<|im_start|>", "<s>").replace("<|im_end|>", "</s>")
    fast.save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "tokenizer_class": tokenizer_class, "add_bos_token": True}))
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 300, "hidden_size": 8,
                                                  "num_hidden_layers": 1, "num_attention_heads": 2,
                                                  "bos_token_id": 1, "eos_token_id": 2}))
    return path


def _what_it_encodes(tok) -> dict:
    chat = [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}]
    return {"class": type(tok).__name__, "vocab": tok.get_vocab(), "len": len(tok),
            "special": (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id),
            "with_special": [tok.encode(t, add_special_tokens=True) for t in TEXTS],
            "without": [tok.encode(t, add_special_tokens=False) for t in TEXTS],
            "chat": list(tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]),
            "template": tok.chat_template}


@pytest.mark.parametrize("name,model_type,tokenizer_class,pre,direct", MODEL_FOLDERS, ids=[c[0] for c in MODEL_FOLDERS])
def test_a_model_folder_loads_as_auto_tokenizer_loads_it(tmp_path, monkeypatch, name, model_type, tokenizer_class,
                                                        pre, direct):
    """The same class, vocabulary, special ids, ids with and without special tokens and chat-template ids as
    ``AutoTokenizer`` (which reads config.json and imports torch); the folders of a Llama or Qwen model are loaded
    without it (``AutoTokenizer`` made to fail proves the direct path ran), the others through it."""
    import transformers

    from megatron_pack.data.formats.tokenizer import load_hf_tokenizer

    folder = _model_folder(tmp_path / name, model_type, tokenizer_class, pre)
    want = _what_it_encodes(transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    assert all(want["without"]) and len(want["chat"]) > 10 and want["special"][1] is not None  # something to compare

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer was used")

    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
        try:
            got = _what_it_encodes(load_hf_tokenizer(str(folder)))
            took_direct = True
        except AssertionError:
            took_direct = False
    assert took_direct == direct
    if not direct:
        got = _what_it_encodes(load_hf_tokenizer(str(folder)))
    assert got == want


def test_the_registered_classes_are_transformers_own():
    """``_REGISTERED_CLASSES`` says what transformers' table says for each model type (none for llama)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    import importlib.util

    from megatron_pack.data.formats.tokenizer_class import _MISTRAL_COMMON_TYPES, _REGISTERED_CLASSES

    assert len(_REGISTERED_CLASSES) >= 7
    mistral_common = importlib.util.find_spec("mistral_common") is not None
    for model_type, registered in _REGISTERED_CLASSES.items():
        theirs = TOKENIZER_MAPPING_NAMES.get(model_type)
        if mistral_common and model_type in _MISTRAL_COMMON_TYPES:  # then AutoTokenizer loads these folders
            registered = "MistralCommonBackend"
        assert (theirs.removesuffix("Fast") if theirs else None) == registered, model_type


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_prepare_with_a_model_folder_does_not_import_torch(tmp_path, model_type):
    """``prepare tokenizer=<model folder>`` spent 2 s importing torch through AutoTokenizer; now it loads the
    tokenizer as a tokenizer-only copy's (a Mistral folder's as the backend AutoTokenizer swaps in, issue 43
    item 12), and the process never imports torch (sys.modules at its end)."""
    import os
    import subprocess
    import sys

    folder = _model_folder(tmp_path / model_type, model_type, "LlamaTokenizer", "metaspace")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in MESSAGES * 4))
    code = ("import sys; from megatron_pack.cli.main import main; "
            f"rc = main(['prepare', 'input=t.jsonl', 'tokenizer={folder}', 'output=ds', "
            "'packing.packed_sequence_size=256', 'data.tokenize_workers=1']); "
            "assert rc == 0, rc; print('imported torch:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and (tmp_path / "ds" / "metadata.json").is_file(), out.stdout + out.stderr
    assert "imported torch: False" in out.stdout, out.stdout + out.stderr
