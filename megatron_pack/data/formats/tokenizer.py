"""Tokenizers: the embedded byte-level tokenizer (default, no download) and local Hugging Face ones.

Both turn one record into ``(ids, answer_mask)`` with ``encode_sample``: ``ids`` end with eos and
the answer mask is 1 on completion / assistant tokens and their eos (or everywhere when
``answer_only_loss`` is off). Sequence boundaries are never found from token values: the
caller keeps one record per sample.

Byte tokenizer layout (ids 0-255 are the UTF-8 bytes)::

    prompt/completion:  <bos> prompt-bytes completion-bytes <eos>
    answer mask:          0      0 ... 0    1 ... 1          1
    chat:               <bos> <|user|> text <eos> <|assistant|> text <eos> ...
    answer mask:          0      0      0    0          0       1 ... 1  1
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np

from megatron_pack.data.formats.chat import (ROLES, THINKING_KEY, RecordError, SampleSchema, chat_messages,  # noqa: F401
                                             drop_untrained_turns, plain_messages, read_chat_template, record_kind,
                                             untrained_turns)
from megatron_pack.data.formats.tokenizer_class import _DIRECT_CLASSES, _auto_backend_model_ids, _class_for_folder

BYTE_SPECIALS = ("<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")


def _text(record: dict, key: str) -> str:
    if key not in record:
        raise RecordError(f"missing key {key!r} (keys present: {sorted(record)}); "
                          f"set data.prompt_key / data.completion_key / data.messages_key to the right column",
                          "missing_key")
    value = record[key]
    if not isinstance(value, str):
        raise RecordError(f"key {key!r} must be a string, got {type(value).__name__} ({value!r:.40}); store text "
                          f"there, or point data.prompt_key / data.completion_key at the text columns", "wrong_type")
    return value


def _prompt_completion(record: dict, schema: SampleSchema) -> tuple[str, str]:
    """The prompt and completion strings; both empty is an empty sample, an error."""
    prompt, completion = _text(record, schema.prompt_key), _text(record, schema.completion_key)
    if not prompt and not completion:
        raise RecordError(f"the sample is empty: {schema.prompt_key!r} and {schema.completion_key!r} are both "
                          "empty strings; remove the record or fill it in", "empty_sample")
    return prompt, completion


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255) plus special tokens; needs no files and no download."""

    name = "byte"

    def __init__(self):
        self.specials = {tok: 256 + i for i, tok in enumerate(BYTE_SPECIALS)}
        self.vocab_size = 256 + len(BYTE_SPECIALS)
        self.pad_id = self.specials["<pad>"]
        self.bos_id = self.specials["<bos>"]
        self.eos_id = self.specials["<eos>"]
        self.role_ids = {role: self.specials[f"<|{role}|>"] for role in ROLES}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        names = {v: k for k, v in self.specials.items()}
        out, run = [], bytearray()
        for i in (int(x) for x in ids):
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(names.get(i, f"<unk:{i}>"))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def identity(self) -> dict:
        return _identity(self.name, {"bytes": 256, "specials": self.specials}, self)

    def encode_sample(self, record: dict, schema: SampleSchema, *, answer_only_loss: bool = True):
        """``(ids, answer_mask)`` as int32 / uint8 arrays; see the module docstring for the layout."""
        if record_kind(record, schema) == "prompt_completion":
            prompt, completion = (t.encode("utf-8") for t in _prompt_completion(record, schema))
            pieces = [([self.bos_id], 0), (prompt, 0), (completion, 1), ([self.eos_id], 1)]
        else:
            pieces = [([self.bos_id], 0)]
            messages, first_trained = chat_messages(record, schema)
            if any(THINKING_KEY in m for m in messages):
                raise RecordError(f"an assistant turn has '{THINKING_KEY}' (reasoning), which data.tokenizer=byte has no "
                                  "place for; set data.tokenizer to a folder whose chat template renders it (gpt-oss) "
                                  "or drop the field", "template_refused", fatal=True)
            for i, message in enumerate(messages):
                answer = int(message["role"] == "assistant" and i >= first_trained and message.get("weight", 1) != 0)
                pieces += [([self.role_ids[message["role"]]], 0), (message["content"].encode("utf-8"), answer),
                           ([self.eos_id], answer)]
        return _join(pieces, answer_only_loss)


def _join(pieces, answer_only_loss: bool):
    ids = np.concatenate([np.frombuffer(p, dtype=np.uint8) if isinstance(p, bytes) else np.asarray(p)
                          for p, _ in pieces]).astype(np.int32)
    if answer_only_loss:
        mask = np.repeat(np.array([a for _, a in pieces], dtype=np.uint8), [len(p) for p, _ in pieces])
    else:
        mask = np.ones(len(ids), dtype=np.uint8)
    return ids, mask


def _vocab_hash(vocab) -> str:
    """sha256 of ``vocab`` as sorted JSON: every store's fingerprint depends on these bytes (never change them)."""
    return hashlib.sha256(json.dumps(vocab, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


VOCAB_HASHES = "vocab_hashes"
"""The folder of the cache (``config.loader.cache_root``) that keeps folders' vocabulary hashes."""


def _stored_vocab_hash(source_sha256: str, template: str | None, compute) -> str:
    """``compute()`` (the vocabulary hash of a tokenizer parsed from a ``tokenizer.json`` whose bytes hash to
    ``source_sha256``, with chat template ``template``), kept in the cache under a name made of exactly what
    determines it: those bytes' hash, the template, the ``tokenizers`` version that parsed them and this
    function's format. The same file and template give the same vocabulary, so the same hash (about 0.07 CPU-s
    of a 32k vocabulary's JSON saved a run); any other file, template or library version is another name. A
    missing, damaged or unwritable entry is computed again (and rewritten where it can be): never an error."""
    import os
    import tempfile

    import tokenizers

    from megatron_pack.config.loader import cache_root

    root = cache_root()
    if root is None:
        return compute()
    key = hashlib.sha256(json.dumps(["vocab_hash/1", source_sha256, template, tokenizers.__version__]).encode())
    path = root / VOCAB_HASHES / key.hexdigest()
    try:
        stored = path.read_text(encoding="ascii")
        if len(stored) == 64 and all(c in "0123456789abcdef" for c in stored):
            return stored
    except (OSError, UnicodeDecodeError):
        pass
    digest = compute()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".vocab-hash-")
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(digest)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return digest


def _identity(name: str, vocab, tok, digest: str | None = None) -> dict:
    """``vocab``: what is hashed (or a callable returning it, called only when ``digest`` is None)."""
    if digest is None:
        digest = _vocab_hash(vocab() if callable(vocab) else vocab)
    return {"name": name, "vocab_size": tok.vocab_size, "vocab_hash": digest,
            "special_ids": {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}}


def load_hf_tokenizer(path: str, *, folder_tokenizer: bool = False):
    """``AutoTokenizer.from_pretrained(path)``, without importing torch where the result is known.

    With ``folder_tokenizer``, a generic fast folder that transformers would load unchanged comes back as a
    ``folder_tokenizer.FolderTokenizer``, read by the ``tokenizers`` library without importing transformers
    (the Rust tokenizer, the special tokens and the template transformers' would hold; tested equal).

    A folder with ``tokenizer.json`` and ``tokenizer_config.json`` (no ``auto_map``) whose
    ``tokenizer_class`` is the generic fast class, ``LlamaTokenizer`` or ``Qwen2Tokenizer`` (Llama 2,
    Mistral, Qwen 2 and 3 and most folders saved by transformers) is what ``AutoTokenizer`` loads with
    that class, when the folder has no ``config.json`` (a tokenizer-only copy) or a model's whose type
    agrees with the class (``_REGISTERED_CLASSES``: a Llama or Qwen model folder). Loading it directly
    skips ``AutoTokenizer``'s config machinery, which imports torch (1.5-2 s of the time ``prepare``
    spends before its first record; tested equal). ``AutoTokenizer`` itself loads a ``LlamaTokenizer``
    folder whose ``tokenizer.json`` is byte-level as ``TokenizersBackend``, and a folder whose path
    matches a model id it special-cases the same way: those, and every other folder, go through it.
    """
    folder = Path(path)
    if folder_tokenizer:
        from megatron_pack.data.formats.folder_tokenizer import load_folder_tokenizer

        light = load_folder_tokenizer(path, _auto_backend_model_ids())
        if light is not None:
            return light
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file() and (folder / "tokenizer.json").is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError:
            config = {}
        name = _DIRECT_CLASSES.get(config.get("tokenizer_class"))
        name = None if name is None or "auto_map" in config else _class_for_folder(folder, name)
        if name is not None:
            import transformers

            cls = getattr(transformers, name)
            patterns = _auto_backend_model_ids()
            special = patterns is None or any(fnmatch.fnmatch(str(path).lower(), p) for p in patterns)
            byte_level_llama = name == "LlamaTokenizer" and transformers.TokenizersBackend._tokenizer_json_has_byte_level(
                str(path), local_files_only=True)
            if not special and not byte_level_llama:
                return cls.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (``pip install megatron_pack[hf]``).

    Chat records use the tokenizer's chat template. Assistant spans come from the template's
    ``{% generation %}`` markers when it has them; otherwise from growing prefixes: the
    assistant turn ``i`` is what ``template(messages[:i+1])`` adds after
    ``template(messages[:i], add_generation_prompt=True)``.
    """

    def __init__(self, path: str, chat_template: str | None = None):
        if importlib.util.find_spec("transformers") is None:  # found, not imported (0.7 s)
            raise ImportError(f"data.tokenizer={path!r} is a Hugging Face tokenizer, which needs transformers: "
                              "pip install 'megatron_pack[hf]', or use data.tokenizer=byte.")
        self.path = str(path)
        self.tok = load_hf_tokenizer(self.path, folder_tokenizer=True)
        if chat_template is not None:  # data.chat_template: part of the identity, so of the store fingerprint
            self.tok.chat_template = read_chat_template(chat_template)
        self.name = Path(self.path).name
        self.vocab_size = len(self.tok)
        if self.tok.eos_token_id is None:
            raise ValueError(f"tokenizer {self.path} has no eos token; set eos_token in its tokenizer_config.json.")
        self.eos_id = int(self.tok.eos_token_id)
        self.bos_id = None if self.tok.bos_token_id is None else int(self.tok.bos_token_id)
        self.pad_id = int(self.tok.pad_token_id) if self.tok.pad_token_id is not None else self.eos_id
        self._blank_tails: dict[tuple[int, ...], bool] = {}
        self._identity: tuple | None = None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def identity(self) -> dict:
        """Name, vocabulary size and hash (vocabulary and chat template), special ids; computed once per template
        (hashing a 32k-131k vocabulary's JSON takes 0.1-0.4 s, and the manifest and the store both ask), and for a
        folder read without transformers kept on disk between processes (``_stored_vocab_hash``)."""
        if self._identity is None or self._identity[0] != self.tok.chat_template:
            template = self.tok.chat_template
            vocab = lambda: {"vocab": self.tok.get_vocab(), "chat_template": template}  # noqa: E731
            from megatron_pack.data.formats.folder_tokenizer import FolderTokenizer

            source = self.tok.source_sha256 if isinstance(self.tok, FolderTokenizer) else None
            digest = _stored_vocab_hash(source, template, lambda: _vocab_hash(vocab())) if source else None
            self._identity = (template, _identity(self.name, vocab, self, digest))
        return dict(self._identity[1])

    def encode_sample(self, record: dict, schema: SampleSchema, *, answer_only_loss: bool = True):
        if record_kind(record, schema) == "prompt_completion":
            prompt_text, completion_text = _prompt_completion(record, schema)
            prompt = self.tok.encode(prompt_text, add_special_tokens=True)
            completion = self.encode(completion_text)
            pieces = [(prompt, 0), (completion, 1), ([self.eos_id], 1)]
            return _join(pieces, answer_only_loss)
        messages, first_trained = chat_messages(record, schema)
        if not self.tok.chat_template:
            raise RecordError(f"data.tokenizer ({self.path}) has no chat template, so chat records cannot be "
                              "rendered; set data.chat_template=/path/to/template.jinja (e.g. ChatML) or use a "
                              "tokenizer that ships one", "template_refused", fatal=True)
        from jinja2 import TemplateError

        plain = plain_messages(messages)
        if any(THINKING_KEY in m for m in plain) and THINKING_KEY not in self.tok.chat_template:
            raise RecordError(f"an assistant turn has '{THINKING_KEY}' (reasoning), which the chat template of "
                              f"{self.path} never reads (it would be dropped); use a template that renders it "
                              "(gpt-oss's harmony template) or drop the field", "template_refused", fatal=True)
        try:
            ids, mask = self.chat_ids_and_mask(plain)
            if first_trained:  # TRL conversational: assistant turns inside the prompt are context
                num_context = min(len(mask), len(self._template(plain[:first_trained], add_generation_prompt=True)))
                mask[:num_context] = [0] * num_context
        except TemplateError as exc:  # e.g. a template that raises for a system message
            raise RecordError(f"the chat template of {self.path} refuses this conversation ({exc}); change the "
                              "record's roles to what the template accepts, or use another data.tokenizer",
                              "template_refused") from None
        mask = drop_untrained_turns(mask, messages, first_trained)  # weight: 0 turns are context only
        ids, mask = self._end_with_eos(ids, mask)
        ids, mask = np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)
        return ids, (mask if answer_only_loss else np.ones_like(mask))

    def encode_samples(self, records: list[dict], schema: SampleSchema, *, answer_only_loss: bool = True) -> list:
        """``encode_sample`` for a chunk of records: one ``(ids, mask)`` or one ``RecordError`` per record.

        Chat records of a fast tokenizer go through ``fast_chat`` in one batch (``encode_chats`` for a
        template with generation markers, ``encode_by_prefixes`` without): the same ids and masks as
        one record at a time, tested. The others, a record the batch cannot prove, and any batch
        the template or the tokenizer refuses, go record by record, so an error still names its record.
        """
        from megatron_pack.data.formats.fast_chat import (encode_by_prefixes, encode_chats, has_generation_markers,
                                                          supports_batched_chat)

        results: list = [None] * len(records)
        batch, conversations = [], []
        fast = supports_batched_chat(self.tok)
        for i, record in enumerate(records):
            try:
                if fast and record_kind(record, schema) == "chat":
                    messages, first_trained = chat_messages(record, schema)
                    if first_trained == 0 and not untrained_turns(messages) and \
                            all(isinstance(m["content"], str) and THINKING_KEY not in m  # image parts, reasoning:
                                for m in messages):  # one at a time (the batch pastes contents only)
                        batch.append(i)
                        conversations.append(messages)
                        continue
                results[i] = self.encode_sample(record, schema, answer_only_loss=answer_only_loss)
            except (RecordError, UnicodeEncodeError) as exc:
                results[i] = exc
        encode = encode_chats if has_generation_markers(self.tok.chat_template) else encode_by_prefixes
        try:
            encoded = encode(self.tok, conversations) if conversations else []
        except Exception:  # a template error or bad text in one record: find it record by record
            encoded = [None] * len(batch)
        for i, got in zip(batch, encoded):
            if got is None:
                results[i] = self._encode_or_error(records[i], schema, answer_only_loss)
                continue
            ids, mask = self._end_with_eos_arrays(*got)
            results[i] = (ids, mask if answer_only_loss else np.ones_like(mask))
        return results

    def _encode_or_error(self, record: dict, schema: SampleSchema, answer_only_loss: bool):
        try:
            return self.encode_sample(record, schema, answer_only_loss=answer_only_loss)
        except (RecordError, UnicodeEncodeError) as exc:
            return exc

    def _end_with_eos(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        """The sample contract (ids end with eos) without a second end-of-turn token.

        A template that closes the turn with eos and then whitespace (ChatML: ``<|im_end|>\\n``)
        ends at that eos; the trailing whitespace is dropped rather than followed by another
        eos (which would train ``<|im_end|>\\n<|im_end|>``). Otherwise eos is appended, in the
        answer when the last token was.
        """
        if ids and ids[-1] == self.eos_id:
            return ids, mask
        last = len(ids) - 1 - ids[::-1].index(self.eos_id) if self.eos_id in ids else -1
        if last >= 0 and self._blank_tail(tuple(ids[last + 1:])):
            return ids[:last + 1], mask[:last + 1]
        return ids + [self.eos_id], mask + [mask[-1] if mask else 0]

    def _end_with_eos_arrays(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_end_with_eos`` on int32 / uint8 arrays (the batched chat path), same result."""
        if ids.size and ids[-1] == self.eos_id:
            return ids, mask
        where = np.flatnonzero(ids == self.eos_id)
        if where.size and self._blank_tail(tuple(ids[where[-1] + 1:].tolist())):
            return ids[:where[-1] + 1], mask[:where[-1] + 1]
        return np.append(ids, np.int32(self.eos_id)), np.append(mask, np.uint8(mask[-1] if mask.size else 0))

    def _blank_tail(self, tail: tuple[int, ...]) -> bool:
        """True when ``tail`` decodes to whitespace only; memoised (every ChatML record ends ``<|im_end|>\\n``)."""
        blank = self._blank_tails.get(tail)
        if blank is None:
            blank = self._blank_tails[tail] = not self.tok.decode(list(tail)).strip()
        return blank

    def _template(self, messages, add_generation_prompt=False) -> list[int]:
        out = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                           return_dict=True)
        return list(out["input_ids"])

    def chat_ids_and_mask(self, messages: list[dict], *, use_generation_markers: bool | None = None):
        """Template ids and the assistant mask (lists); markers when the template has them."""
        if use_generation_markers is None:
            from megatron_pack.data.formats.fast_chat import has_generation_markers

            use_generation_markers = has_generation_markers(self.tok.chat_template)
        if use_generation_markers:
            out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        return self._prefix_mask(messages)

    def _prefix_mask(self, messages: list[dict]):
        ids = self._template(messages)
        mask = [0] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = self._template(messages[:i], add_generation_prompt=True) if i else []
            end_ids = self._template(messages[:i + 1])
            start = len(prefix)
            if ids[:len(end_ids)] != end_ids or end_ids[:start] != prefix:
                raise RecordError(f"chat template of {self.path} is not prefix-stable at message {i}, so "
                                  "assistant spans cannot be found; add {% generation %} markers to the template",
                                  "template_refused")
            mask[start:len(end_ids)] = [1] * (len(end_ids) - start)
        return ids, mask


_BUILT: dict[tuple, "HFTokenizer"] = {}
"""Hugging Face tokenizers built in this process, keyed by directory, template file and their mtimes:
``prepare`` asks for the same tokenizer in several places, and loading one costs seconds."""


def _cache_key(path: str, chat_template: str | None) -> tuple:
    files = sorted(Path(path).iterdir())
    stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.is_file())
    template = (chat_template, Path(chat_template).stat().st_mtime_ns) if chat_template and Path(chat_template).is_file() \
        else (chat_template,)
    return (str(Path(path).resolve()), stamp, template)


def build_tokenizer(name_or_path: str, chat_template: str | None = None):
    """``'byte'`` -> ``ByteTokenizer``; a local directory -> ``HFTokenizer`` (with ``chat_template``,
    a Jinja file replacing the tokenizer's own, ``data.chat_template``), built once per process."""
    if name_or_path == "byte":
        if chat_template is not None:
            from megatron_pack.data.formats.sources import DataError

            raise DataError(f"data.chat_template ({chat_template}) needs a Hugging Face tokenizer, but "
                             "data.tokenizer=byte renders chats with its own role tokens; unset data.chat_template "
                             "or set data.tokenizer=/path/to/hf_tokenizer_dir.")
        return ByteTokenizer()
    from megatron_pack.data.formats.tokenizer_files import tokenizer_folder_problem

    problem = tokenizer_folder_problem(name_or_path)  # one line, before transformers sees the folder
    if problem:
        from megatron_pack.data.formats.sources import DataError

        raise DataError(problem)
    key = _cache_key(name_or_path, chat_template)
    if key not in _BUILT:
        _BUILT[key] = HFTokenizer(name_or_path, chat_template)
    return _BUILT[key]
