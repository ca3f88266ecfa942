"""Chat formats users have: ShareGPT (by keys and by preset), TRL conversational prompt/completion,
content as text parts, a chat-template file, a tokenizer without a template, and no second
end-of-turn token. Masks are checked by decoding, and against transformers' own
``apply_chat_template(return_assistant_tokens_mask=True)`` (code we did not write)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_pack.config import Config, DataConfig, PackingConfig
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.formats.chat import RecordError, SampleSchema, chat_messages, schema_from_config
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.formats.tokenizer import ByteTokenizer, build_tokenizer
from megatron_pack.data.prepare import prepare

BYTE = ByteTokenizer()
CHAT = SampleSchema("chat")
AUTO = SampleSchema("auto")
SHAREGPT = schema_from_config(DataConfig(format="sharegpt"))
PLAIN = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"},
         {"role": "assistant", "content": "four"}, {"role": "user", "content": "hello"},
         {"role": "assistant", "content": "hello world"}]
SHARE = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                            "value": m["content"]} for m in PLAIN]}
PARTS = {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"][:2]},
                                                      {"type": "text", "text": m["content"][2:]}]} for m in PLAIN]}
TRL = {"prompt": PLAIN[:2], "completion": PLAIN[2:3]}

# (id, record, schema): each normalises to the messages of the plain record (TRL: its first three)
SAME_AS_PLAIN = [
    ("sharegpt-preset", SHARE, SHAREGPT),
    ("sharegpt-by-keys", SHARE, SampleSchema("auto", messages_key="conversations", role_key="from",
                                             content_key="value", role_aliases=(("gpt", "assistant"),
                                                                                ("human", "user")))),
    ("content-parts", PARTS, AUTO),
    ("trl-conversational", TRL, AUTO),
]


@pytest.mark.parametrize("record,schema", [c[1:] for c in SAME_AS_PLAIN], ids=[c[0] for c in SAME_AS_PLAIN])
def test_formats_normalise_to_plain_messages(record, schema):
    messages, first_trained = chat_messages(record, schema)
    expected = PLAIN[:3] if "prompt" in record else PLAIN
    assert messages == expected
    assert first_trained == (2 if "prompt" in record else 0)
    ids, mask = BYTE.encode_sample(record, schema)
    ref_ids, ref_mask = BYTE.encode_sample({"messages": expected}, CHAT)
    assert ids.tolist() == ref_ids.tolist() and mask.tolist() == ref_mask.tolist()
    assert BYTE.decode(ids[mask == 1]).count("<eos>") == sum(m["role"] == "assistant" for m in expected) > 0


def test_trl_prompt_assistant_turns_are_context():
    record = {"prompt": PLAIN[:4], "completion": PLAIN[4:]}  # few-shot: 'four' is inside the prompt
    ids, mask = BYTE.encode_sample(record, AUTO)
    assert BYTE.decode(ids[mask == 1]) == "hello world<eos>"
    _, chat_mask = BYTE.encode_sample({"messages": PLAIN}, CHAT)
    assert chat_mask.sum() > mask.sum() > 0  # the same conversation as chat trains both turns


BAD = [
    ("image-part", {"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]},
                                 {"role": "assistant", "content": "a"}]}, AUTO, "messages[0].content[0] is a 'image' part"),
    ("unknown-role-hint", {"conversations": [{"from": "bot", "value": "x"}]},
     SampleSchema("chat", messages_key="conversations", role_key="from", content_key="value"),
     "data.role_aliases={bot: user}"),
    ("sharegpt-without-keys", SHARE, AUTO, "data.format=sharegpt"),
    ("trl-empty-completion", {"prompt": PLAIN[:2], "completion": []}, AUTO, "key 'completion' must be a non-empty"),
]


@pytest.mark.parametrize("record,schema,match", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_formats_name_the_fix(record, schema, match):
    with pytest.raises(RecordError, match=match.replace("[", r"\[").replace("{", r"\{")):
        BYTE.encode_sample(record, schema)


# --- Hugging Face tokenizers --------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
                 "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_LIKE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eot_id|>{% endgeneration %}"
              "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TEMPLATES = {"chatml": CHATML, "chatml_marked": CHATML_MARKED, "llama_like": LLAMA_LIKE, "none": None}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny local HF tokenizers sharing one BPE vocabulary, one per chat-template style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["hello world", "what is two plus two", "four", "be brief", "system user assistant"] * 20
    specials = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    dirs = {}
    for name, template in TEMPLATES.items():
        eos = "<|eot_id|>" if name == "llama_like" else "<|im_end|>"
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=eos, pad_token="<pad>")
        if template is not None:
            fast.chat_template = template
        path = tmp_path_factory.mktemp(f"hf_{name}")
        fast.save_pretrained(path)
        dirs[name] = str(path)
    (tmp_path_factory.getbasetemp() / "chatml.jinja").write_text(CHATML_MARKED)
    dirs["template_file"] = str(tmp_path_factory.getbasetemp() / "chatml.jinja")
    return dirs


ANSWERS = {"chatml": ["four<|im_end|>\n", "hello world<|im_end|>"],  # prefix mask: the turn ends with "\n"
           "chatml_marked": ["four<|im_end|>", "hello world<|im_end|>"],
           "llama_like": ["four<|eot_id|>", "hello world<|eot_id|>"]}


@pytest.mark.parametrize("style", list(ANSWERS))
@pytest.mark.parametrize("case", [c[0] for c in SAME_AS_PLAIN])
def test_hf_formats_mask_decodes_to_the_answers(hf_dirs, style, case):
    record, schema = {c[0]: c[1:] for c in SAME_AS_PLAIN}[case]
    tok = build_tokenizer(hf_dirs[style])
    ids, mask = tok.encode_sample(record, schema)
    answers = ANSWERS[style][:1] if case == "trl-conversational" else ANSWERS[style]
    assert tok.decode(ids[mask == 1]) == "".join(answers).rstrip("\n")  # the last turn ends at its eos
    assert ids[-1] == tok.eos_id and mask[-1] == 1
    eos_text = tok.decode([tok.eos_id])
    assert not tok.decode(ids).endswith(eos_text + "\n" + eos_text)  # no second end-of-turn token


@pytest.mark.parametrize("style", ["chatml_marked", "llama_like"])
def test_hf_ids_and_mask_match_transformers(hf_dirs, style):
    """transformers' own assistant mask on the same conversation; ours differs only by the eos contract."""
    tok = build_tokenizer(hf_dirs[style])
    ids, mask = tok.encode_sample(SHARE, SHAREGPT)
    ref = tok.tok.apply_chat_template(PLAIN, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ref_ids, ref_mask = list(ref["input_ids"]), list(ref["assistant_masks"])
    if ref_ids[-1] != tok.eos_id:  # ChatML's trailing "\n" after <|im_end|> is cut, never followed by eos
        assert tok.decode(ref_ids[len(ids):]).strip() == ""
        ref_ids, ref_mask = ref_ids[:len(ids)], ref_mask[:len(ids)]
    assert ids.tolist() == ref_ids and mask.tolist() == ref_mask
    assert sum(ref_mask) > 2


def _cfg(tmp_path, **data) -> Config:
    data = {"source": "files", "input": str(tmp_path / "train.jsonl"), "dataset_dir": str(tmp_path / "ds"),
            "tokenize_workers": 1, **data}
    return Config(data=DataConfig(**data), packing=PackingConfig(packed_sequence_size=256),
                  model=Config().model.__class__(seq_length=256))


def _write(tmp_path, records):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


PREPARE_CASES = [
    ("sharegpt", [SHARE] * 3, {"format": "sharegpt"}, 2),
    ("trl", [TRL] * 3, {}, 1),
    ("parts", [PARTS] * 3, {}, 2),
]


@pytest.mark.parametrize("records,data,num_turns", [c[1:] for c in PREPARE_CASES], ids=[c[0] for c in PREPARE_CASES])
def test_formats_prepare_end_to_end(tmp_path, hf_dirs, records, data, num_turns):
    _write(tmp_path, records)
    cfg = _cfg(tmp_path, tokenizer=hf_dirs["chatml_marked"], **data)
    ds = PackedSFTDataset(cfg.data.dataset_dir, prepare(cfg, progress=False))
    tok = build_tokenizer(hf_dirs["chatml_marked"])
    samples = [s for i in range(len(ds)) for s in ds[i]]
    assert len(samples) == 3
    for s in samples:
        assert tok.decode(s["input_ids"][s["loss_mask"] == 1]) == "".join(ANSWERS["chatml_marked"][:num_turns])


def test_chat_template_file_overrides_and_missing_template_is_one_line(tmp_path, hf_dirs, capsys):
    from megatron_pack.cli.prepare import main

    _write(tmp_path, [{"messages": PLAIN}] * 2)
    args = [f"data.input={tmp_path / 'train.jsonl'}", "data.source=files", f"data.tokenizer={hf_dirs['none']}",
            f"data.dataset_dir={tmp_path / 'ds'}", "data.tokenize_workers=1", "packing.packed_sequence_size=256"]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if "megatron-pack prepare:" in line]
    assert len(lines) == 1 and "Traceback" not in err  # (the rest of stderr is the progress bar)
    err = lines[0]
    assert f"{tmp_path / 'train.jsonl'}: line 1:" in err and "has no chat template" in err
    assert "data.chat_template=" in err
    assert main(args + [f"data.chat_template={hf_dirs['template_file']}"]) == 0
    cfg = _cfg(tmp_path, tokenizer=hf_dirs["none"], chat_template=hf_dirs["template_file"])
    ds = PackedSFTDataset.from_config(cfg)  # the train-time tokenizer check honours the override
    tok = build_tokenizer(hf_dirs["none"])
    s = ds[0][0]
    assert tok.decode(s["input_ids"][s["loss_mask"] == 1]) == "".join(ANSWERS["chatml_marked"])
    assert main(args + [f"data.chat_template={tmp_path / 'missing.jinja'}"]) == 2
    assert "data.chat_template" in capsys.readouterr().err


def test_non_text_part_names_file_and_line(tmp_path):
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                        {"role": "assistant", "content": "a"}]}
    _write(tmp_path, [{"messages": PLAIN}, bad])
    with pytest.raises(DataError, match=r"train.jsonl: line 2: messages\[0\].content\[0\] is a 'image_url' part"):
        prepare(_cfg(tmp_path), progress=False)


def test_schema_identity_keeps_old_fingerprints():
    assert set(SampleSchema("auto").identity()) == {"kind", "prompt_key", "completion_key", "messages_key"}
    assert SHAREGPT.identity()["role_key"] == "from"
    assert np.all([SHAREGPT.messages_key == "conversations", SHAREGPT.content_key == "value"])


# --- batched chat tokenization: the same ids and masks as one record at a time --------------------

GEMMA_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>model\n"
              "{% generation %}{{ m['content'] | trim }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>"
              "{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endif %}{% endfor %}")
BATCH_STYLES = {"chatml_marked": CHATML_MARKED, "llama_like": LLAMA_LIKE, "gemma_like_trailing_newline": GEMMA_LIKE}


@pytest.fixture(scope="module")
def batch_dirs(hf_dirs, tmp_path_factory):
    from transformers import AutoTokenizer

    dirs = {}
    for name, template in BATCH_STYLES.items():
        tok = AutoTokenizer.from_pretrained(hf_dirs["chatml_marked"])
        tok.chat_template = template
        if name == "llama_like":
            tok.eos_token = "<|eot_id|>"
        path = tmp_path_factory.mktemp(f"batch_{name}")
        tok.save_pretrained(path)
        dirs[name] = str(path)
    return dirs


def _conversations(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["hello", "world", "what", "is", "two", "plus", "four", "be", "brief", " ", "\n", "é", "✓", "  x "]
    text = lambda k: "".join(rng.choice(words, size=k)) if k else ""  # noqa: E731
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": text(3)}] if i % 3 == 0 else []
        for _ in range(int(rng.integers(1, 4))):
            messages += [{"role": "user", "content": text(int(rng.integers(1, 8)))},
                         {"role": "assistant", "content": text(int(rng.integers(1, 8)))}]  # "" is a bad turn
        out.append({"messages": messages} if i % 4 else {"messages": [{"role": m["role"], "content": [
            {"type": "text", "text": m["content"]}]} for m in messages]})
    return out


@pytest.mark.parametrize("style", list(BATCH_STYLES))
def test_batched_chat_equals_one_at_a_time(batch_dirs, style):
    from megatron_pack.data.formats.fast_chat import supports_batched_chat

    tok = build_tokenizer(batch_dirs[style])
    assert supports_batched_chat(tok.tok)  # guard: the batch path really runs
    records = _conversations(60)
    records.insert(7, TRL)  # conversational records go one at a time inside the same chunk
    batched = tok.encode_samples(records, AUTO)
    num_answer = 0
    for record, got in zip(records, batched):
        ids, mask = tok.encode_sample(record, AUTO)
        assert got[0].tolist() == ids.tolist() and got[1].tolist() == mask.tolist()
        num_answer += int(mask.sum())
    assert num_answer > 100
    for record, got in zip(records[:5], batched[:5]):  # and both equal transformers' own per-sample mask
        messages, _ = chat_messages(record, AUTO)
        ref = tok.tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        n = len(got[0]) if ref["input_ids"][-1] != tok.eos_id else len(ref["input_ids"])
        assert ref["input_ids"][:n] == got[0].tolist()[:n] and ref["assistant_masks"][:n] == got[1].tolist()[:n]


def test_batched_chat_names_the_bad_record(batch_dirs):
    tok = build_tokenizer(batch_dirs["chatml_marked"])
    records = _conversations(10)
    records[4] = {"messages": [{"role": "assistant", "content": "first"}]}
    results = tok.encode_samples(records, AUTO)
    assert isinstance(results[4], RecordError) and "out of order" in str(results[4])
    assert all(isinstance(r, tuple) for i, r in enumerate(results) if i != 4)


def test_assistant_mask_rule_by_hand():
    from megatron_pack.data.formats.fast_chat import assistant_mask

    offsets = np.array([[0, 2], [2, 4], [4, 6], [6, 8], [8, 8], [8, 10]])
    assert assistant_mask(offsets, [(3, 6)]).tolist() == [0, 1, 1, 0, 0, 0]
    assert assistant_mask(offsets, [(0, 2), (8, 10)]).tolist() == [1, 0, 0, 0, 0, 1]
    assert assistant_mask(offsets, []).tolist() == [0] * 6


@pytest.mark.parametrize("style", ["chatml_marked", "chatml_unmarked"])
def test_worker_processes_tokenize_equals_serial(batch_dirs, hf_dirs, tmp_path, style):
    """The default path tokenizes chunks in forked worker processes; the arrays must be the serial
    path's, in input order (chunks of 7 records, so many chunks are in flight)."""
    from pathlib import Path

    from megatron_pack.data.formats.sources import iter_chunks
    from megatron_pack.data.store import token_store as ts

    path = tmp_path / "chat.jsonl"
    records = _conversations(90, seed=3)
    for i in range(0, 90, 9):  # prompt/completion and TRL records go one at a time, in the same workers
        records.insert(i, {"prompt": f"what is {i} plus {i}", "completion": f"{2 * i}"} if i % 2 else TRL)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    folder = batch_dirs["chatml_marked"] if style == "chatml_marked" else hf_dirs["chatml"]
    chunks = list(iter_chunks([Path(path)], 7))
    assert len(chunks) > 10  # guard: more chunks than workers in flight
    kwargs = dict(tokenizer=folder, schema=AUTO, answer_only_loss=True)
    serial = list(ts.tokenize_stream(chunks, num_workers=1, **kwargs))
    pooled = list(ts.tokenize_stream(chunks, num_workers=2, **kwargs))
    for a, b in zip(serial, pooled, strict=True):
        assert a.ids.tolist() == b.ids.tolist() and a.mask.tolist() == b.mask.tolist()
        assert a.positions.tolist() == b.positions.tolist()
    assert sum(int(r.mask.sum()) for r in serial) > 100
