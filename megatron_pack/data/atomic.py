"""Old import path of ``megatron_pack.data.store.atomic`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.store.atomic import (  # noqa: F401
    sha256_file, remove_stale_temporaries, atomic_directory, write_json, read_json,
)

__all__ = ['sha256_file', 'remove_stale_temporaries', 'atomic_directory', 'write_json', 'read_json']
