"""Inputs of ``bench/prepare.py --real``: real tokenizers from the installed ``mistral-common``
package, Mistral-style chat templates with and without ``{% generation %}`` markers, and chat
records of every kind the tests have (system prompts, multi-turn, empty turns, content parts,
tool turns) written from Python's own docstrings (real English and code, no download).

Install once (never in CI; torch stays as it is): ``pip install -e ".[bench]"``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

GEN, END = "{% generation %}", "{% endgeneration %}"

MISTRAL_V1 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}" + GEN + "{{- ' ' + message['content'] + eos_token }}" + END +
    "{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS] ' + message['content'] + ' [/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user, assistant and tool roles are supported') }}{%- endif %}"
    "{%- endfor %}")
"""Mistral 7B Instruct v0.1's format ("<s>[INST] q [/INST] a</s>"), the system prompt in front of
the first user turn, tool results in [TOOL_RESULTS] (plain text for this SentencePiece vocabulary)."""

TEKKEN = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- endif %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}" + GEN + "{{- message['content'] + eos_token }}" + END +
    "{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user, assistant and tool roles are supported') }}{%- endif %}"
    "{%- endfor %}")
"""Mistral's Tekken format ("<s>[INST]q[/INST]a</s>"), whose [INST], [/INST], [SYSTEM_PROMPT] and
[TOOL_RESULTS] are control tokens of the vocabulary."""


def unmarked(template: str) -> str:
    return template.replace(GEN, "").replace(END, "")


def mistral_data() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data"


def make_tokenizers(work: Path) -> dict[str, Path]:
    """Four folders: ``{sp, tekken} x {marked, unmarked}``; built once per work dir (Tekken's
    conversion takes seconds)."""
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    data, out = mistral_data(), {}
    base = {}
    src = work / "sp_src"
    if not (work / "sp_marked").is_dir():
        src.mkdir(parents=True, exist_ok=True)
        shutil.copy(data / "tokenizer.model.v1", src / "tokenizer.model")
        base["sp"] = LlamaTokenizer.from_pretrained(str(src))  # SentencePiece -> tokenizers BPE (byte fallback)
    if not (work / "tekken_marked").is_dir():
        from transformers.integrations.mistral.tokenizer import MistralConverter

        backend = MistralConverter(str(data / "tekken_240911.json")).converted()
        base["tekken"] = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                 unk_token="<unk>", pad_token="<pad>")
    for name, template in (("sp", MISTRAL_V1), ("tekken", TEKKEN)):
        for style, text in (("marked", template), ("unmarked", unmarked(template))):
            folder = work / f"{name}_{style}"
            if not folder.is_dir():
                tok = base[name]
                tok.chat_template = text
                tok.save_pretrained(folder)
                if name == "sp":
                    shutil.copy(data / "tokenizer.model.v1", folder / "tokenizer.model")
            out[f"{name}_{style}"] = folder
    return out


def _paragraphs() -> list[str]:
    import importlib
    import warnings

    names = ["os", "re", "json", "collections", "itertools", "functools", "argparse", "subprocess", "typing",
             "pathlib", "string", "textwrap", "logging", "unittest", "email", "http.client", "urllib.request",
             "asyncio", "dataclasses", "decimal", "fractions", "statistics", "random", "socket", "threading",
             "multiprocessing", "sqlite3", "csv", "zipfile", "tarfile", "shutil", "tempfile", "inspect", "ast",
             "pickle", "copy", "heapq", "bisect", "datetime", "calendar", "codecs", "difflib", "pprint", "enum",
             "contextlib", "abc", "io", "queue", "selectors", "struct", "array", "weakref", "types", "operator",
             "math", "hashlib", "hmac", "base64", "html", "uuid", "ipaddress", "configparser", "platform",
             "warnings", "traceback", "timeit", "pdb", "doctest"]
    found = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            module = importlib.import_module(name)
            for attr in dir(module):
                doc = getattr(getattr(module, attr, None), "__doc__", None)
                if isinstance(doc, str):
                    found.update(p.strip() for p in doc.split("\n\n") if len(p.strip()) > 20)
    return sorted(found)


def make_records(path: Path, num_records: int, seed: int = 0) -> Path:
    """``num_records`` chat records, every kind mixed in, at ``path``; and beside it (returned) the
    same conversations with content parts joined, for transformers and TRL."""
    import numpy as np

    rng = np.random.default_rng(seed)
    paragraphs = _paragraphs()
    systems = [paragraphs[i] for i in rng.choice(len(paragraphs), 12, replace=False)]

    def text(max_paragraphs: int = 1) -> str:
        picked = [paragraphs[i] for i in rng.integers(0, len(paragraphs), int(rng.integers(1, max_paragraphs + 1)))]
        return "\n\n".join(picked)

    plain_path = path.with_name(path.stem + "_plain.jsonl")
    with open(path, "w") as f, open(plain_path, "w") as plain:
        for i in range(num_records):
            messages = [{"role": "system", "content": systems[i % len(systems)]}] if i % 3 == 0 else []
            for turn in range(int(rng.integers(1, 4))):
                messages.append({"role": "user", "content": "" if i % 97 == 5 and turn else text()})
                answer = "" if i % 53 == 7 else text(3)
                messages.append({"role": "assistant", "content": answer})
                if i % 10 == 3 and turn == 0:  # a tool call and its result, then the assistant again
                    messages += [{"role": "tool", "content": json.dumps({"result": text()[:200]})},
                                 {"role": "assistant", "content": text()}]
            if i % 9 == 4:  # OpenAI-style content parts
                for m in messages:
                    c = m["content"]
                    m["content"] = [{"type": "text", "text": c[:len(c) // 2]}, {"type": "text", "text": c[len(c) // 2:]}]
            f.write(json.dumps({"messages": messages}) + "\n")
            plain.write(json.dumps({"messages": plain_messages({"messages": messages})}) + "\n")
    return plain_path


def plain_messages(record: dict) -> list[dict]:
    """The record's messages with content parts joined: what transformers and TRL are given."""
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in record["messages"]]
