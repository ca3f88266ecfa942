"""The token store, the metadata format of a prepared dataset (``metadata``) and atomic writes
(``atomic``).
"""
