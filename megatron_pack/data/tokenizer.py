"""Old import path of ``megatron_pack.data.formats.tokenizer`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.formats.tokenizer import (  # noqa: F401
    ROLES, BYTE_SPECIALS, SampleSchema, record_kind, RecordError, ByteTokenizer, HFTokenizer,
    build_tokenizer,
)

__all__ = ['ROLES', 'BYTE_SPECIALS', 'SampleSchema', 'record_kind', 'RecordError', 'ByteTokenizer', 'HFTokenizer', 'build_tokenizer']
