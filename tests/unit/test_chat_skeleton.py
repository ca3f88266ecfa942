"""Chat templates as fixed patterns, and the batched chat paths built on them, against code we did
not write: transformers' ``render_jinja_template`` (text and generation spans) and
``apply_chat_template`` (ids and masks, directly for marked templates, through the per-record
prefix rule for unmarked ones), on every record kind: system prompts, multi-turn, empty turns (bad
records since issue 21: refused alike by both paths), content parts, tool turns, contents that look like
template text, each template style, and two tokenizer kinds (byte-level BPE, SentencePiece-style BPE with byte fallback) built offline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_pack.data.formats.chat import RecordError, SampleSchema, chat_messages
from megatron_pack.data.formats.chat_skeleton import analyse
from megatron_pack.data.formats.tokenizer import build_tokenizer

AUTO = SampleSchema("auto")

CHATML_MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
                 "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>model\n"
              "{% generation %}{{ m['content'] | trim }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>"
              "{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>model\n{% endif %}")
MISTRAL_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content']"
    " + ' [/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{% generation %}{{- ' ' + message['content'] + eos_token }}"
    "{% endgeneration %}{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS] ' + message['content'] + "
    "' [/TOOL_RESULTS]' }}{%- else %}{{- raise_exception('Only user, assistant and tool roles') }}{%- endif %}"
    "{%- endfor %}")
PARTS_AWARE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
               "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{% for c in m['content'] %}{{ c['text'] }}"
               "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")
PLAIN_TEXT = ("{% for m in messages %}{% if m['role'] == 'assistant' %}Assistant: {% generation %}{{ m['content'] }}"
              "{{ eos_token }}{% endgeneration %}\n{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}")


def unmarked(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


FIXED = [("chatml_marked", CHATML_MARKED), ("gemma_like_trim", GEMMA_LIKE), ("mistral_like_set_slice", MISTRAL_LIKE),
         ("parts_aware_is_string", PARTS_AWARE), ("plain_text", PLAIN_TEXT),
         ("namespace", "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
                       "{{ m.role }}{{ m.content }}{% endfor %}")]
NOT_FIXED = [
    ("branches_on_content", "{% for m in messages %}{% if m['content'] %}{{ m['content'] }}{% endif %}{% endfor %}",
     "an if reads"),
    ("whole_message_json", "{% for m in messages %}{{ m | tojson }}{% endfor %}", "tojson"),
    ("slices_content", "{% for m in messages %}{{ m['content'][:10] }}{% endfor %}", "indexed"),
    ("content_length", "{% for m in messages %}{{ m['content'] | length }}{% endfor %}", "length"),
    ("content_method", "{% for m in messages %}{{ m['content'].split('x') }}{% endfor %}", "a call"),
    ("content_in_test", "{% for m in messages %}{% if 'x' in m['content'] %}x{% endif %}{% endfor %}", "reads"),
    ("previtem", "{% for m in messages %}{{ loop.previtem }}{% endfor %}", "previtem"),
    ("content_in_namespace", "{% set ns = namespace(c='') %}{% for m in messages %}{% set ns.c = m['content'] %}"
                             "{% endfor %}{{ ns.c }}", "namespace"),
    ("macro", "{% macro f(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ f(m['content']) }}{% endfor %}", "Macro"),
    ("prints_messages", "{{ messages }}", "printed whole"),
    ("trim_of_joined", "{% for m in messages %}{{ ('a' + m['content']) | trim }}{% endfor %}", "trim"),
]


@pytest.mark.parametrize("template", [t for _, t in FIXED], ids=[n for n, _ in FIXED])
def test_analyse_proves_fixed_patterns(template):
    assert analyse(template).fixed, analyse(template).reason


@pytest.mark.parametrize("template,reason", [c[1:] for c in NOT_FIXED], ids=[c[0] for c in NOT_FIXED])
def test_analyse_refuses_templates_that_read_contents(template, reason):
    shape = analyse(template)
    assert not shape.fixed and reason in shape.reason


def _text(rng, words, k):
    return "".join(rng.choice(words, size=k)) if k else ""


WORDS = ["hello", " world", " what", " is", " two", "plus", " four", "\n", "é", "✓", "  x ", " [INST]", "<|im_end|>",
         "{{ x }}", "\u3000", " \t", "tool", "</s>", "[/INST]"]


def records(n: int, seed: int = 0) -> list[dict]:
    """Every record kind: system prompts, 1-3 turns, empty turns, content parts, tool turns, contents
    holding template text, special tokens and edge whitespace."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": _text(rng, WORDS, 3)}] if i % 3 == 0 else []
        for turn in range(int(rng.integers(1, 4))):
            messages.append({"role": "user", "content": "" if i % 11 == 5 and turn else _text(rng, WORDS, 4)})
            messages.append({"role": "assistant", "content": "" if i % 7 == 2 else _text(rng, WORDS, 5)})
            if i % 5 == 1 and turn == 0:
                messages += [{"role": "tool", "content": json.dumps({"r": _text(rng, WORDS, 2)})},
                             {"role": "assistant", "content": _text(rng, WORDS, 3)}]
        if i % 4 == 3:
            messages = [{"role": m["role"], "content": [{"type": "text", "text": m["content"][:3]},
                                                          {"type": "text", "text": m["content"][3:]}]}
                        for m in messages]
        out.append({"messages": messages})
    return out


def _render_reference(tok, messages, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    marked = "{% generation %}" in tok.chat_template
    text, spans = render_jinja_template(conversations=[messages], tools=None, documents=None,
                                        chat_template=tok.get_chat_template(), return_assistant_tokens_mask=marked,
                                        continue_final_message=False, add_generation_prompt=add_generation_prompt,
                                        **tok.special_tokens_map)
    return text[0], (list(spans[0]) if spans else [])


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory):
    """Two tokenizer kinds, each saved with every template style (marked and unmarked)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    corpus = ["hello world what is two plus four", "be brief tool result", "é ✓ x [INST] [/INST]"] * 30
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    sp = Tokenizer(models.BPE(unk_token="<unk>"))  # trained SentencePiece-style: words split at the space
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    sp.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", *specials]))
    spec = json.loads(sp.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    styles = {"chatml": CHATML_MARKED, "gemma_like": GEMMA_LIKE, "mistral_like": MISTRAL_LIKE,
              "plain_text": PLAIN_TEXT}
    dirs = {}
    for kind in ("byte_level", "sentencepiece"):
        for style, template in styles.items():
            for marked in (True, False):
                if kind == "byte_level":
                    tok = PreTrainedTokenizerFast(tokenizer_object=byte_level, bos_token="<s>", eos_token="</s>",
                                                  pad_token="<pad>")
                    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
                else:
                    tok = LlamaTokenizer(vocab=vocab, merges=merges, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>", pad_token="<pad>")
                    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
                tok.chat_template = template if marked else unmarked(template)
                path = tmp_path_factory.mktemp(f"{kind}_{style}_{'marked' if marked else 'unmarked'}")
                tok.save_pretrained(path)
                dirs[(kind, style, marked)] = str(path)
    return dirs


CASES = [(k, s, m) for k in ("byte_level", "sentencepiece") for s in ("chatml", "gemma_like", "mistral_like",
                                                                       "plain_text") for m in (True, False)]


def _id(case):
    return f"{case[0]}-{case[1]}-{'marked' if case[2] else 'unmarked'}"


@pytest.mark.parametrize("case", [c for c in CASES if c[2]], ids=[_id(c) for c in CASES if c[2]])
def test_skeleton_render_equals_transformers(tokenizers_, case):
    from megatron_pack.data.formats.fast_chat import renderer_for

    tok = build_tokenizer(tokenizers_[case]).tok
    renderer = renderer_for(tok)
    assert renderer.shape.fixed  # guard: the pattern path, not Jinja, is under test
    num_spans, num_refused = 0, 0
    for record in records(40, seed=1):
        messages = _conversation(record)
        if messages is None:  # an empty user or assistant turn: a bad record, never rendered
            num_refused += 1
            continue
        for gen in (False, True):
            assert renderer.render(messages, gen) == _render_reference(tok, messages, gen)
        num_spans += len(renderer.render(messages)[1])
    assert num_spans > 40 and any(s is not None for s in renderer._skeletons.values())
    assert 0 < num_refused < 20  # guard: both kinds were met


def _conversation(record: dict) -> list[dict] | None:
    """The record's messages, or None when it is a bad record for an empty turn (data.on_bad_record's
    ``turn_without_content``: only a system prompt may be empty)."""
    try:
        return chat_messages(record, AUTO)[0]
    except RecordError as exc:
        assert exc.reason == "turn_without_content", exc
        return None


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_batched_ids_and_masks_equal_per_record(tokenizers_, case):
    """encode_samples (skeleton render, one encode per chunk, offsets or cut points) == the per-record
    path (apply_chat_template per record; growing prefixes without markers), record by record; the
    marked ones also == transformers' own assistant mask."""
    from megatron_pack.data.formats import fast_chat

    tok = build_tokenizer(tokenizers_[case])
    batch = records(50, seed=2)
    conversations = [_conversation(r) for r in batch]
    if not case[2]:
        fast = fast_chat.encode_by_prefixes(tok.tok, [c for c in conversations if c is not None])
        accepted = sum(not isinstance(tok._encode_or_error(r, AUTO, True), RecordError) for r in batch)
        assert accepted >= 15 and sum(f is not None for f in fast) >= accepted - 2  # guard: the batch rule decides
        assert fast_chat.space_cuts(tok.tok) == (case[0] == "sentencepiece")
    got = tok.encode_samples(batch, AUTO)
    num_answer = 0
    for record, messages, result in zip(batch, conversations, got):
        try:
            ids, mask = tok.encode_sample(record, AUTO)
        except RecordError as exc:
            assert isinstance(result, RecordError) and str(result) == str(exc)
            continue
        assert result[0].tolist() == ids.tolist() and result[1].tolist() == mask.tolist()
        num_answer += int(mask.sum())
        if case[2]:
            ref = tok.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
            n = min(len(ids), len(ref["input_ids"]))  # ours differs only by the eos contract at the end
            assert ref["input_ids"][:n] == ids.tolist()[:n] and ref["assistant_masks"][:n] == mask.tolist()[:n]
            assert len(ids) - len(ref["input_ids"]) in (-1, 0, 1)
    assert num_answer > 200


def test_prefix_windows_and_unstable_prefixes(tmp_path, monkeypatch):
    """Turns that open with plain text (no split token at the cut): the prefix rule is checked on
    windows (a second encode); a template whose prefix tokens merge across the cut ("\\nA" alone vs
    "\\nA:" in the whole text, one word for this pre-tokenizer) is refused exactly as the
    per-record rule refuses it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_pack.data.formats import fast_chat

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    backend.train_from_iterator(["Q: hello\nA: world ok\nA: hello world"] * 50, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "</s>"]))
    stable = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n{% else %}"
              "A: {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    unstable = stable.replace("{% if add_generation_prompt %}A:{% endif %}", "{% if add_generation_prompt %}A{% endif %}")
    convs = [[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
              {"role": "user", "content": "ok"}, {"role": "assistant", "content": "hello world"}]] * 3
    calls = []
    real_backend = fast_chat._backend

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def encode_batch(self, texts, **kwargs):
            calls.append(len(texts))
            return self.inner.encode_batch(texts, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(fast_chat, "_backend", lambda tok: Counting(real_backend(tok)))
    for template, decided in ((stable, True), (unstable, False)):
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
        tok.chat_template = template
        folder = tmp_path / str(decided)
        tok.save_pretrained(folder)
        hf = build_tokenizer(str(folder))
        calls.clear()
        fast = fast_chat.encode_by_prefixes(hf.tok, convs)
        assert all((f is not None) == decided for f in fast)
        assert calls == [3, 6]  # guard: the whole texts, then one window per turn start
        got = hf.encode_samples([{"messages": c} for c in convs], AUTO)
        for messages, result in zip(convs, got):
            try:
                ids, mask = hf.encode_sample({"messages": messages}, AUTO)
                assert decided and mask.sum() > 2
                assert result[0].tolist() == ids.tolist() and result[1].tolist() == mask.tolist()
            except RecordError as exc:
                assert not decided and str(result) == str(exc) and "prefix-stable" in str(exc)


def test_direct_loading_equals_auto_tokenizer_without_torch(tokenizers_, tmp_path):
    """LlamaTokenizer, Qwen2Tokenizer and generic fast folders load with their class, as AutoTokenizer
    loads them (class, pipeline, specials, template, encodings), and without importing torch."""
    from transformers import AutoTokenizer, Qwen2Tokenizer

    from megatron_pack.data.formats.tokenizer import load_hf_tokenizer

    byte_dir = tokenizers_[("byte_level", "chatml", True)]
    base = AutoTokenizer.from_pretrained(byte_dir)
    merges = [tuple(m) for m in json.loads(base.backend_tokenizer.to_str())["model"]["merges"]]
    qwen = Qwen2Tokenizer(vocab=base.get_vocab(), merges=merges,
                          eos_token="</s>", pad_token="<pad>", bos_token=None, unk_token=None)
    qwen.chat_template = CHATML_MARKED
    qwen.save_pretrained(tmp_path / "qwen2")
    folders = {"LlamaTokenizer": tokenizers_[("sentencepiece", "mistral_like", True)],
               "Qwen2Tokenizer": str(tmp_path / "qwen2"), "TokenizersBackend": byte_dir}
    for declared, folder in folders.items():
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] in (declared, "PreTrainedTokenizerFast")  # guard: the direct path
        assert not (Path(folder) / "config.json").exists()
        ours, auto = load_hf_tokenizer(folder), AutoTokenizer.from_pretrained(folder, local_files_only=True)
        assert type(ours) is type(auto)
        assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
        assert ours.special_tokens_map == auto.special_tokens_map and ours.chat_template == auto.chat_template
        assert len(ours) == len(auto) and ours.eos_token_id == auto.eos_token_id
        text = "hello world <|im_end|> é ✓ [INST]"
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
    code = ("import sys; from megatron_pack.data.formats.tokenizer import load_hf_tokenizer; "
            f"[load_hf_tokenizer(f) for f in {list(folders.values())!r}]; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
