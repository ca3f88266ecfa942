"""Is ``data.tokenizer`` a folder a tokenizer loads from? Checked before loading (torch-free, no transformers).

transformers answers a missing folder, a Hub id without network, or a folder without the files
its ``tokenizer_config.json`` class needs with a long traceback (and, for the last, advice to
install a package that is installed). :func:`tokenizer_folder_problem` answers in one line naming
the folder, what is missing and the fix; ``prepare``, ``verify`` and ``train`` call it before any
tokenizer is built. The files each class reads:

| tokenizer_config.json ``tokenizer_class``       | reads                                      |
|-------------------------------------------------|--------------------------------------------|
| any                                             | ``tokenizer.json`` (the fast tokenizer)    |
| LlamaTokenizer, CodeLlama, Gemma, T5 (+ Fast)   | or ``tokenizer.model`` (sentencepiece)     |
| Qwen2Tokenizer, GPT2Tokenizer (+ Fast)          | or ``vocab.json`` + ``merges.txt``         |
| PreTrainedTokenizerFast, TokenizersBackend      | ``tokenizer.json`` only                    |
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

from megatron_pack.config.hf_config import hub_id_problem

FAST_FILE = "tokenizer.json"
SENTENCEPIECE = ("tokenizer.model",)
BPE = ("vocab.json", "merges.txt")
CLASS_FILES: dict[str, tuple[tuple[str, ...], ...]] = {
    **{name: (SENTENCEPIECE,) for name in ("LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer",
                                           "CodeLlamaTokenizerFast", "GemmaTokenizer", "GemmaTokenizerFast",
                                           "T5Tokenizer", "T5TokenizerFast")},
    **{name: (BPE,) for name in ("Qwen2Tokenizer", "Qwen2TokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast")},
    "PreTrainedTokenizerFast": (), "TokenizersBackend": (),
}
"""tokenizer_class -> the file sets it reads besides ``tokenizer.json``."""


def tokenizer_folder_problem(value: str, key: str = "data.tokenizer") -> Optional[str]:
    """Why ``value`` (``byte`` or a local folder) is not a tokenizer a run can load, in one line; None when it is."""
    if value == "byte":
        return None
    missing = hub_id_problem(value, key)
    if missing:
        return f"{missing[:-1]}, or set {key}=byte."
    folder = Path(value)
    if not folder.exists():
        return (f"{key} ({value}) does not exist (nothing at {folder.absolute()}); point {key} at a local folder, "
                f"or set {key}=byte.")
    if not folder.is_dir():
        return f"{key} ({value}) is a file; point it at the folder holding tokenizer.json / tokenizer_config.json."
    names = sorted(p.name for p in folder.iterdir())
    tokenizer_class = None
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            tokenizer_class = json.loads(config_file.read_text(encoding="utf-8")).get("tokenizer_class")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            return f"{config_file}: not a valid tokenizer_config.json ({exc}); copy it again from the model's download."
    elif FAST_FILE not in names:
        return (f"{key} ({value}) holds no tokenizer files (tokenizer.json, tokenizer_config.json; it has: "
                f"{_listing(names)}); point {key} at the folder the model was downloaded to, or set {key}=byte.")
    return _class_files_problem(folder, names, tokenizer_class, key)


def _class_files_problem(folder: Path, names: list[str], tokenizer_class: Optional[str], key: str) -> Optional[str]:
    if FAST_FILE in names:
        return None
    sets = CLASS_FILES.get(tokenizer_class, (SENTENCEPIECE, BPE)) if tokenizer_class else (SENTENCEPIECE, BPE)
    have = [s for s in sets if all(n in names for n in s)]
    named = f"tokenizer_config.json names {tokenizer_class}" if tokenizer_class else "tokenizer_config.json names no class"
    wanted = " or ".join([FAST_FILE] + [" + ".join(s) for s in sets])
    if not have:
        return (f"{key} ({folder}): {named}, which reads {wanted}; the folder has none of them (it has: "
                f"{_listing(names)}); copy the tokenizer files from the model's download into it.")
    if have == [SENTENCEPIECE] and importlib.util.find_spec("sentencepiece") is None:
        return (f"{key} ({folder}): {named} and has tokenizer.model but no tokenizer.json; reading tokenizer.model "
                "needs the sentencepiece package: pip install sentencepiece, or copy tokenizer.json from the model's "
                "download.")
    return None


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} files)" if len(names) > 8 else "")
    return shown or "nothing"
