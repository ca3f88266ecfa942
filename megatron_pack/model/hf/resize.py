"""A pretrained folder's vocabulary grown to the tokenizer's (``model.resize_vocab``), as transformers grows it.

transformers' ``resize_token_embeddings(n, mean_resizing=True)`` keeps rows ``[0, V)`` and draws each new row
from a normal distribution with the old rows' mean and ``1e-9`` times their covariance (the mean alone when
that covariance is not positive definite); the output layer (``lm_head``, when untied) grows the same way from
its own rows. ``GrownVocab`` is a reader (``transforms.Reader``) over the folder that shows the vocabulary
tensors at ``V_new`` rows, so the loader, its shape checks and the TP split (``Vocab`` pads to a multiple of
TP after ``V_new``) see a folder of the new size.

Example: embed_tokens [256, 64] grown to 301 at TP=2 reads as [301, 64] (rows 256-300 drawn), is built as
302 rows (one TP pad row, masked) and exported as [301, 64] with ``vocab_size: 301`` in config.json.

The draw uses ``torch.Generator().manual_seed(SEED + k)`` (k: the tensor's place in ``names``), so every rank,
every layout and a resumed run draw the same rows; transformers draws from the global RNG after initialising
the new layer, so the two agree to within the draw's spread (about 1e-6 for weights of std 0.02), not bit for
bit (tests/unit/test_issue43_vocab_resume.py). The mean and covariance are summed in row chunks, so the whole
old tensor is never held in float32 at once; each rank reads the old rows once more for them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_pack.model.hf.transforms import Reader, Vocab, transform

EPSILON = 1e-9
"""transformers' scale of the old rows' covariance for the new rows' draw."""
SEED = 20_241
"""The generator seed of the first grown tensor (the embedding); the output layer's is the next."""
CHUNK_ROWS = 4096
"""Rows read at a time for the mean and covariance."""


def mean_rows(old: Reader, name: str, num_old: int, num_new: int, *, seed: int) -> Tensor:
    """The ``num_new - num_old`` rows transformers' mean resizing adds to tensor ``name`` of ``old`` (float32)."""
    hidden = old.shape(name)[1]
    total = torch.zeros(hidden, dtype=torch.float64)
    for a in range(0, num_old, CHUNK_ROWS):
        total += old.read(name, slice(a, min(a + CHUNK_ROWS, num_old))).double().sum(0)
    mean = (total / num_old).float()
    covariance = torch.zeros(hidden, hidden, dtype=torch.float32)
    for a in range(0, num_old, CHUNK_ROWS):
        centered = old.read(name, slice(a, min(a + CHUNK_ROWS, num_old))).float() - mean
        covariance += centered.T @ centered
    covariance /= num_old
    added = num_new - num_old
    scale_tril, info = torch.linalg.cholesky_ex(EPSILON * covariance)
    if int(info) != 0:  # not positive definite: transformers takes the mean
        return mean[None, :].repeat(added, 1)
    noise = torch.randn(added, hidden, generator=torch.Generator().manual_seed(seed))
    return mean + noise @ scale_tril.T


class GrownVocab:
    """``source`` with the tensors ``names`` shown at ``num_new`` rows (rows from ``num_old`` on: ``mean_rows``)."""

    def __init__(self, source, names: tuple[str, ...], num_new: int):
        self.source, self.num_new = source, num_new
        self.names = {name: k for k, name in enumerate(names)}
        self._added: dict[str, Tensor] = {}

    def __getattr__(self, attr):  # weight_map, dtype, bytes_read, ...: the folder's own
        return getattr(self.source, attr)

    def _num_old(self, name: str) -> int:
        return self.source.shape(name)[0]

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.source.shape(name))
        return (self.num_new,) + shape[1:] if name in self.names else shape

    def added(self, name: str) -> Tensor:
        if name not in self._added:
            self._added[name] = mean_rows(self.source, name, self._num_old(name), self.num_new,
                                          seed=SEED + self.names[name])
        return self._added[name]

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> Tensor:
        if name not in self.names:
            return self.source.read(name, rows, cols)
        assert cols is None, "vocabulary tensors are split by rows"
        start, stop, _ = (rows or slice(None)).indices(self.num_new)
        num_old = self._num_old(name)
        parts = []
        if start < num_old:
            parts.append(self.source.read(name, slice(start, min(stop, num_old))))
        if stop > num_old:
            dtype = parts[0].dtype if parts else self.source.dtype(name)
            parts.append(self.added(name)[max(start, num_old) - num_old:stop - num_old].to(dtype))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def __enter__(self) -> "GrownVocab":
        return self

    def __exit__(self, *exc) -> None:
        self.source.close()


def vocab_names(rules) -> tuple[str, ...]:
    """The HF names the vocabulary rules of ``rules`` (``rules_for``'s triples) read: embed_tokens, lm_head."""
    return tuple(name for rule, _, names in rules if isinstance(transform(rule.kind), Vocab) for name in names)



def grow_reference(reference, source, num_new: int) -> None:
    """transformers' model of the folder ``source`` reads (a ``load.SafetensorsFolder``) grown to ``num_new`` rows
    as ``load_pretrained`` grows ours (``resize_token_embeddings``, then our drawn rows copied in), so
    ``verify.reference=transformers`` compares the same weights; nothing when it has ``num_new`` rows or more."""
    num_old = reference.get_input_embeddings().weight.shape[0]
    if num_new <= num_old:
        return
    reference.resize_token_embeddings(num_new, mean_resizing=False)
    layers = {"model.embed_tokens.weight": reference.get_input_embeddings()}
    output = reference.get_output_embeddings()
    if output is not None and output.weight is not layers["model.embed_tokens.weight"].weight:
        layers["lm_head.weight"] = output
    names = tuple(n for n in layers if n in source.weight_map)
    grown = GrownVocab(source, names, num_new)
    with torch.no_grad():
        for name in names:
            layers[name].weight[num_old:] = grown.added(name).to(layers[name].weight.dtype)
