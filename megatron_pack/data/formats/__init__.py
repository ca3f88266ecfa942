"""Raw records in: sources (JSONL / Parquet files, the synthetic generator), record schemas and
tokenizers (prompt/completion and chat messages). Nothing here knows about packs."""
