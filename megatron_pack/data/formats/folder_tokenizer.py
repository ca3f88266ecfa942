"""A generic fast tokenizer folder loaded with the ``tokenizers`` library alone, where transformers would add nothing.

``AutoTokenizer`` loads a folder whose class resolves to the generic fast class (``PreTrainedTokenizerFast`` /
``TokenizersBackend``: a Llama 3 folder, a Mistral or Mixtral model folder whose ``LlamaTokenizer`` it swaps for
the generic class, most folders written by ``save_pretrained``) by reading ``tokenizer.json`` into a Rust
tokenizer and then, in ``TokenizersBackend.__init__``, possibly changing it: adding the special and added tokens
of ``tokenizer_config.json`` (and the legacy ``special_tokens_map.json`` / ``added_tokens.json``) that
``tokenizer.json`` lacks, turning on ``split_special_tokens``, rebuilding a missing post-processor, re-applying
its truncation and padding, patching Mistral's pre-tokenizer regex (vocabularies over 100,000 ids).
``load_folder_tokenizer`` reads the same files and returns a ``FolderTokenizer`` only where none of that
applies (every check below), so its Rust tokenizer is the one transformers would hold; anywhere else it returns
None and the caller loads with transformers as before.

Why: ``import transformers`` is about 0.7 s of ``prepare``'s fixed cost (issue 43 item 12), and ``prepare``
needs of the tokenizer only its Rust backend, its special tokens, its vocabulary and its chat template (rendered
by ``chat_render``). What else a caller asks of it (``apply_chat_template``, ``encode`` with special tokens: the
per-record path of the records the batch cannot take) is answered by transformers' own tokenizer, loaded on
first use. tests/unit/test_folder_tokenizer.py holds the two equal (backend JSON, vocabulary, special tokens,
ids and masks of a table of records) and checks that each refused folder is refused.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                             "mask_token")
"""transformers' ``PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES`` (the named special tokens)."""

_MISTRAL_REGEX_VOCAB = 100_000
"""transformers patches the pre-tokenizer of a larger vocabulary (``_patch_mistral_regex``): left to it."""


def _token_text(value):
    """A special token as ``tokenizer_config.json`` writes it (a string, or an ``AddedToken`` dict) -> its text."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def refusal(folder: Path, config: dict, backend) -> str | None:
    """Why transformers could load ``folder`` into something other than ``backend`` (None: it cannot).

    ``config`` is its ``tokenizer_config.json``; ``backend`` its ``tokenizer.json`` as ``tokenizers`` reads it."""
    if config.get("split_special_tokens"):
        return "split_special_tokens"
    if "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output" in config:
        return "clean-up flag"
    if "fast_tokenizer_files" in config:
        return "fast_tokenizer_files"
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if not isinstance(extra, list):
        return "named extra special tokens"
    if any(key.endswith("_token") and key not in SPECIAL_TOKENS_ATTRIBUTES and isinstance(value, (str, dict))
           for key, value in config.items()):
        return "model-specific special tokens"
    if not isinstance(config.get("chat_template", ""), (str, type(None))) or (folder / "additional_chat_templates").is_dir():
        return "several chat templates"
    if backend.truncation is not None or backend.padding is not None:
        return "truncation or padding in tokenizer.json"
    if backend.post_processor is None:
        return "no post-processor"
    if backend.get_vocab_size(with_added_tokens=True) > _MISTRAL_REGEX_VOCAB and backend.pre_tokenizer is not None:
        return "vocabulary over 100,000 ids"
    added = backend.get_added_tokens_decoder()
    if "added_tokens_decoder" in config:
        from tokenizers import AddedToken

        for index, entry in config["added_tokens_decoder"].items():
            if not isinstance(entry, dict) or int(index) not in added:
                return f"added token {index} missing from tokenizer.json"
            fields = {k: v for k, v in entry.items() if k != "__type"}
            try:
                if repr(AddedToken(**fields)) != repr(added[int(index)]):
                    return f"added token {index} differs from tokenizer.json's"
            except TypeError:
                return f"added token {index} unreadable"
    elif (folder / "special_tokens_map.json").exists() or (folder / "added_tokens.json").exists():
        return "legacy special_tokens_map.json / added_tokens.json"
    contents = {t.content for t in added.values()}
    for value in [config.get(k) for k in SPECIAL_TOKENS_ATTRIBUTES] + list(extra):
        text = _token_text(value)
        if text is not None and text not in contents:
            return f"special token {text!r} not an added token of tokenizer.json"
    return None


class FolderTokenizer:
    """What ``prepare`` uses of transformers' generic fast tokenizer of a folder, without transformers: the Rust
    ``backend_tokenizer``, ``chat_template`` (settable), ``special_tokens_map``, the special ids, ``len``,
    ``get_vocab``, ``convert_tokens_to_ids``, ``encode``, ``decode``; any other attribute is transformers' tokenizer's (loaded
    on first use, with this object's chat template)."""

    is_fast = True

    def __init__(self, path: str, backend, config: dict, chat_template: str | None):
        self.name_or_path = path
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self._special = {k: _token_text(config[k]) for k in SPECIAL_TOKENS_ATTRIBUTES if config.get(k) is not None}
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        self._transformers = None
        self.source_sha256: str | None = None
        """sha256 of the ``tokenizer.json`` bytes ``backend`` was parsed from (set by ``load_folder_tokenizer``):
        with the ``tokenizers`` version, it determines ``get_vocab()``."""

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                             "template argument was passed!")
        return self.chat_template

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            index = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def _special_id(self, name: str):
        token = self._special.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)  # every one is an added token

    @property
    def bos_token_id(self):
        return self._special_id("bos_token")

    @property
    def eos_token_id(self):
        return self._special_id("eos_token")

    @property
    def pad_token_id(self):
        return self._special_id("pad_token")

    @property
    def unk_token_id(self):
        return self._special_id("unk_token")

    def encode(self, text, add_special_tokens: bool = True, **kwargs) -> list[int]:
        """transformers' ``encode`` of one string (its post-processor is tokenizer.json's: ``refusal``); any other
        argument is transformers' to answer."""
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        """transformers' ``decode`` of a fast tokenizer (its clean-up skipped for BPE models, as there)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self.backend_tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=skip_special_tokens)
        if self._clean_up and type(self.backend_tokenizer.model).__name__ != "BPE":
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def transformers_tokenizer(self):
        """transformers' tokenizer of the same folder (loaded once), with this object's chat template: the generic
        fast class, what ``tokenizer.load_hf_tokenizer`` loads for every folder ``load_folder_tokenizer`` accepts
        (its class decided as ``PreTrainedTokenizerFast``, no special-cased model id)."""
        if self._transformers is None:
            from transformers import PreTrainedTokenizerFast

            self._transformers = PreTrainedTokenizerFast.from_pretrained(self.name_or_path, local_files_only=True)
        self._transformers.chat_template = self.chat_template
        return self._transformers

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_transformers", "_special", "_clean_up", "backend_tokenizer",
                                             "chat_template", "name_or_path", "source_sha256"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)


def load_folder_tokenizer(path: str, model_ids: list[str] | None) -> FolderTokenizer | None:
    """``path``'s generic fast tokenizer without transformers, or None where transformers must load it (see the
    module docstring). ``model_ids``: ``AutoTokenizer``'s special-cased model id patterns (None: unknown, so
    refused)."""
    from megatron_pack.data.formats.tokenizer_class import _DIRECT_CLASSES, _class_for_folder

    folder = Path(path)
    config_file, tokenizer_file = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "auto_map" in config:
        return None
    name = _DIRECT_CLASSES.get(config.get("tokenizer_class"))
    if name is None or _class_for_folder(folder, name) != "PreTrainedTokenizerFast":
        return None
    if model_ids is None or any(fnmatch.fnmatch(str(path).lower(), p) for p in model_ids):
        return None
    import hashlib

    from tokenizers import Tokenizer

    try:
        raw = tokenizer_file.read_bytes()  # parsed from these bytes, so their hash names this vocabulary
        backend = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception:  # noqa: BLE001 - transformers reports an unreadable tokenizer.json in its own words
        return None
    if refusal(folder, config, backend) is not None:
        return None
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    tok = FolderTokenizer(str(path), backend, config, template)
    tok.source_sha256 = hashlib.sha256(raw).hexdigest()
    return tok
