"""Tokenizers: the byte tokenizer's masks token by token, and a tiny Hugging Face tokenizer built here."""

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
