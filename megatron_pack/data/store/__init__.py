"""The token store, the metadata format of a prepared dataset (``metadata``) and atomic writes
(``atomic``).

The token store's names are re-exported here (``megatron_pack.data.store.TokenStore`` was a
module path before the split).
"""

from megatron_pack.data.store.token_store import (  # noqa: F401
    STORE_FORMAT, STORE_FORMAT_VERSION, STORE_ARRAYS, NpyAppender, ChunkResult, init_worker, tokenize_chunk,
    tokenize_stream, write_store, token_dtype_for, store_statistics, TokenStore, default_num_workers,
    usable_cpus, bad_record, BadRecords, NUM_BAD_RECORDS_LISTED,
)

__all__ = ['STORE_FORMAT', 'STORE_FORMAT_VERSION', 'STORE_ARRAYS', 'NpyAppender', 'ChunkResult', 'init_worker', 'tokenize_chunk', 'tokenize_stream', 'write_store', 'token_dtype_for', 'store_statistics', 'TokenStore', 'default_num_workers', 'usable_cpus', 'bad_record', 'BadRecords', 'NUM_BAD_RECORDS_LISTED']
