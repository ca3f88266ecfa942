"""prepare without transformers in its main process (issue 43 item 12): a generic fast folder read by `tokenizers`
alone (``folder_tokenizer``) and chat templates rendered by Jinja directly (``chat_render``) give exactly what
transformers gives: the Rust tokenizer, special tokens, vocabulary, ids and masks of a table of records, the
rendered texts and generation spans; every folder transformers would change is refused; and neither importing the
prepare command nor running it imports transformers or torch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from megatron_pack.data.formats.chat import SampleSchema

AUTO = SampleSchema("auto")
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content']"
    " + ' [/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{% generation %}{{- ' ' + message['content'] + eos_token }}"
    "{% endgeneration %}{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS] ' + message['content'] + "
    "' [/TOOL_RESULTS]' }}{%- else %}{{- raise_exception('Only user, assistant and tool roles') }}{%- endif %}"
    "{%- endfor %}")
CHATML = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
          "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n"
          "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["hello", " world", " what", " is", " two", "plus", " four", "\n", "é", "✓", "  x ", " [INST]", "<|im_end|>",
         "{{ x }}", "\u3000", " \t", "tool", "</s>", "[/INST]"]


def unmarked(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def records(n: int, seed: int) -> list[dict]:
    """System prompts, 1-3 turns, empty turns (bad records), tool turns, content parts (the per-record path),
    special tokens and template text inside contents."""
    rng = np.random.default_rng(seed)
    text = (lambda k: "".join(rng.choice(WORDS, size=k)))
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": text(3)}] if i % 3 == 0 else []
        for turn in range(int(rng.integers(1, 4))):
            messages += [{"role": "user", "content": "" if i % 11 == 5 and turn else text(4)},
                         {"role": "assistant", "content": text(5)}]
            if i % 5 == 1 and turn == 0:
                messages += [{"role": "tool", "content": json.dumps({"r": text(2)})},
                             {"role": "assistant", "content": text(3)}]
        if i % 6 == 4:
            messages[-1] = {"role": "assistant", "content": [{"type": "text", "text": messages[-1]["content"]}]}
        out.append({"prompt": text(6), "completion": text(4)} if i % 8 == 7 else {"messages": messages})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A Mistral 7B-style model folder (SentencePiece-style BPE with byte fallback, saved as ``LlamaTokenizer``,
    ``config.json`` of type mistral: loaded as the generic class) with and without markers, and a byte-level
    generic folder with extra special tokens and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    corpus = ["hello world what is two plus four", "be brief tool result", "é ✓ x [INST] [/INST]"] * 30
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    sp.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(sp.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = {}
    for name, template in (("mistral_marked", MISTRAL), ("mistral_unmarked", unmarked(MISTRAL)),
                           ("chatml_byte_level", CHATML)):
        if name.startswith("mistral"):
            tok = LlamaTokenizer(vocab=vocab, merges=merges, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
        else:
            tok = PreTrainedTokenizerFast(tokenizer_object=byte_level, bos_token="<s>", eos_token="<|im_end|>",
                                          pad_token="<pad>")
            tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = template
        path = tmp_path_factory.mktemp(name)
        tok.save_pretrained(path)
        if name.startswith("mistral"):
            (path / "config.json").write_text(json.dumps({"model_type": "mistral", "vocab_size": len(tok)}))
        out[name] = path
    return out


FOLDERS = ["mistral_marked", "mistral_unmarked", "chatml_byte_level"]


@pytest.mark.parametrize("name", FOLDERS)
def test_folder_tokenizer_equals_transformers(folders, name):
    """The folder's tokenizer read without transformers == transformers' (AutoTokenizer), field by field."""
    from transformers import AutoTokenizer

    from megatron_pack.data.formats.folder_tokenizer import FolderTokenizer
    from megatron_pack.data.formats.tokenizer import build_tokenizer

    ours, auto = build_tokenizer(str(folders[name])).tok, AutoTokenizer.from_pretrained(folders[name])
    assert type(ours) is FolderTokenizer and ours._transformers is None  # guard: the fast path, nothing delegated
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.special_tokens_map == auto.special_tokens_map and ours.chat_template == auto.chat_template
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, attr) == getattr(auto, attr), attr
    ids = auto("hello world <|im_end|> é ✓ [INST] \n\n ")["input_ids"] + [auto.eos_token_id]
    for cut in range(len(ids)):
        assert ours.decode(ids[cut:]) == auto.decode(ids[cut:])
    assert ours.convert_tokens_to_ids(["</s>", "nope"]) == auto.convert_tokens_to_ids(["</s>", "nope"])
    assert ours._transformers is None


@pytest.mark.parametrize("name", FOLDERS)
def test_prepare_tokens_and_masks_equal_transformers(folders, name):
    """prepare's encode_samples with the folder tokenizer == the same code on transformers' tokenizer object,
    record by record (ids, masks, refusals), and the marked templates == ``apply_chat_template(...,
    return_assistant_tokens_mask=True)`` (up to the eos contract at the end)."""
    from transformers import AutoTokenizer

    from megatron_pack.data.formats.folder_tokenizer import FolderTokenizer
    from megatron_pack.data.formats.tokenizer import HFTokenizer

    light = HFTokenizer(str(folders[name]))
    full = HFTokenizer(str(folders[name]))
    full.tok = AutoTokenizer.from_pretrained(folders[name])
    assert type(light.tok) is FolderTokenizer and type(full.tok) is not FolderTokenizer
    assert light.identity() == full.identity()
    batch = records(60, seed=3)
    got, want = light.encode_samples(batch, AUTO), full.encode_samples(batch, AUTO)
    num_answer, num_refused, num_parts, num_prompts = 0, 0, 0, 0
    for record, a, b in zip(batch, got, want):
        if isinstance(b, Exception):
            assert type(a) is type(b) and str(a) == str(b)
            num_refused += 1
            continue
        assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
        num_answer += int(a[1].sum())
        if "prompt" in record:
            num_prompts += 1
            continue
        num_parts += not isinstance(record["messages"][-1]["content"], str)
        if "unmarked" not in name and isinstance(record["messages"][-1]["content"], str):
            ref = full.tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            n = min(len(a[0]), len(ref["input_ids"]))
            assert ref["input_ids"][:n] == a[0].tolist()[:n] and ref["assistant_masks"][:n] == a[1].tolist()[:n]
    assert num_answer > 300 and 0 < num_refused < 15 and num_parts >= 4 and num_prompts >= 5  # guards: every path
    light.tok._transformers = None  # prompt/completion and plain chats need no transformers
    light.encode_samples([r for r in batch if "prompt" in r or isinstance(r["messages"][-1]["content"], str)], AUTO)
    assert light.tok._transformers is None


def test_render_equals_transformers_render():
    """``chat_render.render`` == transformers' ``render_jinja_template`` (text and spans), on templates that
    read contents (not a fixed pattern), use ``tojson``, ``namespace``, reasoning fields, and raise."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    from megatron_pack.data.formats.chat_render import render

    templates = {
        "mistral": MISTRAL, "chatml": CHATML,
        "reads_content": "{% for m in messages %}{% if m.content %}{% generation %}{{ m.content | upper }}"
                         "{% endgeneration %}{% endif %}{{ m | tojson }}{% endfor %}",
        "namespace_reasoning": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                               "{{ ns.n }}{{ m.role }}{{ m.thinking if m.thinking is defined else '' }}"
                               "{{ m.reasoning_content | default('-') }}{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ bos_token }}{% endif %}",
    }
    conversations = [
        [{"role": "user", "content": "hi é"}, {"role": "assistant", "content": "yo </s>"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": ""},
         {"role": "assistant", "content": "x", "reasoning": "because"}],
        [{"role": "user", "content": [{"type": "text", "text": "parts"}]}, {"role": "assistant", "content": "ok"}],
        [{"role": "bogus", "content": "raises in mistral"}],
    ]
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    num_compared = 0
    for name, template in templates.items():
        marked = "{% generation %}" in template
        for messages in conversations:
            for gen in (False, True):
                try:
                    text, spans = render_jinja_template(
                        conversations=[messages], tools=None, documents=None, chat_template=template,
                        return_assistant_tokens_mask=marked, continue_final_message=False,
                        add_generation_prompt=gen, **specials)
                    want = (text[0], list(spans[0]) if spans else [])
                except (TemplateError, TypeError) as exc:
                    with pytest.raises(type(exc), match="roles" if isinstance(exc, TemplateError) else None):
                        render(template, messages, gen, marked, **specials)
                    continue
                assert render(template, messages, gen, marked, **specials) == want, (name, messages, gen)
                num_compared += 1
    assert num_compared >= 25


REFUSED = [
    ("split_special_tokens", lambda p, c, t: c.update(split_special_tokens=True)),
    ("added_token_missing", lambda p, c, t: c.setdefault("added_tokens_decoder", {}).update(
        {"5000": {"content": "<new>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
                  "special": True}})),
    ("added_token_differs", lambda p, c, t: c.update(added_tokens_decoder={"0": {
        "content": "<unk>", "lstrip": True, "rstrip": False, "normalized": False, "single_word": False,
        "special": True}})),
    ("special_not_added", lambda p, c, t: c.update(pad_token="hello")),
    ("model_specific_token", lambda p, c, t: c.update(image_token="<s>")),
    ("named_extras", lambda p, c, t: c.update(extra_special_tokens={"tool_token": "</s>"})),
    ("padding_in_json", lambda p, c, t: t.update(padding={
        "strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 2, "pad_type_id": 0,
        "pad_token": "</s>"})),
    ("no_post_processor", lambda p, c, t: t.update(post_processor=None)),
    ("legacy_special_tokens_map", lambda p, c, t: (p / "special_tokens_map.json").write_text("{}")),
    ("several_templates", lambda p, c, t: (p / "additional_chat_templates").mkdir()),
    ("auto_map", lambda p, c, t: c.update(auto_map={"AutoTokenizer": ["x.X", None]})),
    ("llama_without_config_json", lambda p, c, t: (p / "config.json").unlink()),
    ("unknown_model_type", lambda p, c, t: (p / "config.json").write_text('{"model_type": "brand_new"}')),
]


@pytest.mark.parametrize("case", REFUSED, ids=[r[0] for r in REFUSED])
def test_folders_transformers_would_change_are_refused(folders, tmp_path, case):
    """Each folder that transformers would load into something else (or decide about) gets no FolderTokenizer;
    HFTokenizer then loads it with transformers, as before."""
    import shutil

    from megatron_pack.data.formats.folder_tokenizer import load_folder_tokenizer
    from megatron_pack.data.formats.tokenizer import _auto_backend_model_ids

    path = tmp_path / "folder"
    shutil.copytree(folders["mistral_marked"], path)
    assert load_folder_tokenizer(str(path), _auto_backend_model_ids()) is not None  # guard: accepted unchanged
    config, tok = (json.loads((path / f).read_text()) for f in ("tokenizer_config.json", "tokenizer.json"))
    case[1](path, config, tok)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(json.dumps(tok))
    assert load_folder_tokenizer(str(path), _auto_backend_model_ids()) is None
    assert load_folder_tokenizer(str(path), None) is None


def test_prepare_imports_neither_transformers_nor_torch(folders, tmp_path):
    """The fixed-cost guard: importing the prepare command imports none of transformers, matplotlib, hydra, torch;
    a whole prepare with a generic fast folder (store, plan, report) imports none of transformers, torch,
    matplotlib (report.png is drawn with Pillow, in this process: no process is forked for it)."""
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records(12, seed=4)) + "\n")
    code = ("import sys\nimport megatron_pack.cli.prepare as p\n"
            "print(sorted(m for m in ('transformers', 'matplotlib', 'hydra', 'torch') if m in sys.modules))\n"
            f"rc = p.main(['tokenizer={folders['mistral_marked']}', 'input={data}', 'output={tmp_path / 'ds'}', "
            "'packing.packed_sequence_size=256', 'data.on_bad_record=skip'])\n"
            "import multiprocessing\n"
            "print(rc, sorted(m for m in ('transformers', 'torch', 'matplotlib') if m in sys.modules), "
            "len(multiprocessing.active_children()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == "[]" and out.stdout.splitlines()[-1] == "0 [] 0", out.stdout
    assert next((tmp_path / "ds" / "plans").glob("*/report.png")).stat().st_size > 1000
    assert json.loads((tmp_path / "ds" / "metadata.json").read_text())["num_tokenize_workers"] == 1  # one chunk


def _computed_vocab_hash(tok) -> str:
    """The vocabulary hash as every store records it, computed here from the tokenizer object (no cache)."""
    import hashlib

    vocab = {"vocab": tok.tok.get_vocab(), "chat_template": tok.tok.chat_template}
    return hashlib.sha256(json.dumps(vocab, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def test_vocab_hash_is_kept_on_disk_named_by_what_determines_it(folders, tmp_path, monkeypatch):
    """A folder read without transformers keeps its vocabulary hash in the cache (issue 43 item 12: ~0.07 CPU-s of
    a 32k vocabulary's JSON a run): the same value the sorted-JSON hash gives (so every existing store's fingerprint
    stays valid), read back without computing it; another vocabulary (one token renamed), another template, a
    damaged entry or ``off`` computes it again; a copy of the same files elsewhere shares the entry."""
    import shutil

    from megatron_pack.data.formats import tokenizer as tokenizer_module
    from megatron_pack.data.formats.tokenizer import VOCAB_HASHES, HFTokenizer

    monkeypatch.setenv("MEGATRON_PACK_CACHE_DIR", str(tmp_path / "cache"))
    entries = lambda: sorted((tmp_path / "cache" / VOCAB_HASHES).glob("*"))  # noqa: E731
    first = HFTokenizer(str(folders["mistral_marked"]))
    digest = first.identity()["vocab_hash"]
    assert digest == _computed_vocab_hash(first) and len(entries()) == 1
    assert entries()[0].read_text() == digest
    computed = []
    real_hash = tokenizer_module._vocab_hash
    monkeypatch.setattr(tokenizer_module, "_vocab_hash", lambda vocab: computed.append(1) or real_hash(vocab))
    copy = tmp_path / "copy"
    shutil.copytree(folders["mistral_marked"], copy)
    for path in (folders["mistral_marked"], copy):  # read back, not computed; the folder's place is not in the name
        assert HFTokenizer(str(path)).identity()["vocab_hash"] == digest and computed == []
    renamed = tmp_path / "renamed"
    shutil.copytree(folders["mistral_marked"], renamed)
    spec = json.loads((renamed / "tokenizer.json").read_text())
    spec["model"]["vocab"]["<0x7F>z"] = spec["model"]["vocab"].pop("<0x7F>")  # in no merge: the file still loads
    (renamed / "tokenizer.json").write_text(json.dumps(spec))
    other = HFTokenizer(str(renamed))
    assert other.identity()["vocab_hash"] == _computed_vocab_hash(other) != digest and computed == [1]
    assert len(entries()) == 2
    other.tok.chat_template = CHATML  # data.chat_template=: another template, another hash
    assert other.identity()["vocab_hash"] == _computed_vocab_hash(other) != digest and computed == [1, 1]
    for entry in entries():
        entry.write_text("damaged")
    again = HFTokenizer(str(folders["mistral_marked"]))
    assert again.identity()["vocab_hash"] == digest and len(computed) == 3  # computed, rewritten
    assert digest in {e.read_text() for e in entries()}
    monkeypatch.setenv("MEGATRON_PACK_CACHE_DIR", "off")
    shutil.rmtree(tmp_path / "cache")
    assert HFTokenizer(str(copy)).identity()["vocab_hash"] == digest and len(computed) == 4
    assert not (tmp_path / "cache").exists()
