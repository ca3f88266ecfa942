"""Which class transformers' ``AutoTokenizer`` loads a local folder with, decided from the folder's files without
importing transformers (``tokenizer.load_hf_tokenizer`` and ``folder_tokenizer.load_folder_tokenizer`` both ask).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_DIRECT_CLASSES = {"PreTrainedTokenizerFast": "PreTrainedTokenizerFast", "TokenizersBackend": "PreTrainedTokenizerFast",
                   "LlamaTokenizer": "LlamaTokenizer", "LlamaTokenizerFast": "LlamaTokenizer",
                   "Qwen2Tokenizer": "Qwen2Tokenizer", "Qwen2TokenizerFast": "Qwen2Tokenizer"}
"""``tokenizer_class`` of a tokenizer-only folder -> the transformers class ``AutoTokenizer`` loads it with."""


_REGISTERED_CLASSES = {"llama": None, "qwen2": "Qwen2Tokenizer", "qwen2_moe": "Qwen2Tokenizer",
                       "qwen3": "Qwen2Tokenizer", "qwen3_moe": "Qwen2Tokenizer",
                       "mistral": "TokenizersBackend", "mixtral": "TokenizersBackend"}
"""``model_type`` of a model folder's ``config.json`` -> the tokenizer class ``AutoTokenizer`` registers for it
(None: none, so the folder's ``tokenizer_class`` decides). ``AutoTokenizer`` reads ``config.json`` only to
replace a declared class by the registered one when they differ: a Mistral or Mixtral folder's
``LlamaTokenizer`` loads as the generic ``TokenizersBackend`` (``MistralCommonBackend`` instead where the
mistral-common package is installed: then ``AutoTokenizer`` loads it). For these types the model folder loads
with the class ``AutoTokenizer`` would pick (tests/unit/test_tokenizer.py compares the two, and this table with
transformers' own)."""

_MISTRAL_COMMON_TYPES = ("mistral", "mixtral")
"""Types whose registered class is ``MistralCommonBackend`` where mistral-common is installed."""


def _class_for_folder(folder: Path, class_name: str) -> str | None:
    """The class ``AutoTokenizer`` loads a folder declaring ``class_name`` with: ``class_name`` without a
    ``config.json`` or for a type that registers none or the same; the registered generic backend for a type
    that swaps to it; None where ``AutoTokenizer`` must decide (an unknown type, mistral-common installed)."""
    config_file = folder / "config.json"
    if not config_file.exists():
        return class_name
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if model_type not in _REGISTERED_CLASSES:
        return None
    registered = _REGISTERED_CLASSES[model_type]
    if registered is None or registered == class_name:
        return class_name
    if registered == "TokenizersBackend" and not (model_type in _MISTRAL_COMMON_TYPES
                                                  and importlib.util.find_spec("mistral_common") is not None):
        return "PreTrainedTokenizerFast"
    return None


_MODEL_IDS: list = []


def _auto_backend_model_ids() -> list[str] | None:
    """``AutoTokenizer``'s ``MODEL_IDS_TO_TOKENIZERS_BACKEND`` read from its source (importing that
    module imports torch); None when it cannot be read (then ``AutoTokenizer`` decides). Read once per process;
    transformers' folder is found without importing it (``find_spec`` of a top-level package imports nothing)."""
    if _MODEL_IDS:
        return _MODEL_IDS[0]
    import ast

    found = None
    try:  # the file itself: finding its module spec would import transformers.models.auto (1 s or more)
        spec = importlib.util.find_spec("transformers")
        source = (Path(spec.origin).parent / "models" / "auto" / "tokenization_auto.py").read_text()
        for node in ast.parse(source).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(getattr(t, "id", None) == "MODEL_IDS_TO_TOKENIZERS_BACKEND" for t in targets):
                    found = list(ast.literal_eval(node.value))
                    break
    except (AttributeError, OSError, SyntaxError, TypeError, ValueError):
        pass
    _MODEL_IDS.append(found)
    return found
