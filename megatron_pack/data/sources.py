"""Old import path of ``megatron_pack.data.formats.sources`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.formats.sources import (  # noqa: F401
    SUFFIXES, DataError, Chunk, resolve_inputs, iter_chunks, parse_chunk,
)

__all__ = ['SUFFIXES', 'DataError', 'Chunk', 'resolve_inputs', 'iter_chunks', 'parse_chunk']
