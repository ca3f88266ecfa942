"""Mixing several sources by token share or token budget (``data.sources``).

Each source gets a target number of THD tokens: with weights, ``w_i / sum(w)`` of all the
tokens the sources hold (after the overflow policy); with ``tokens``, the budget as given. A
source meets its target by taking whole samples in a seeded random order, going round again
(up-sampling) when it holds fewer tokens than its target and stopping early (down-sampling)
when it holds more. It stops at the prefix whose token count is closest to the target, so the
achieved count is within one sample, hence within one pack, of the target.

Example: sources ``a`` (4 samples of 10 tokens) and ``b`` (2 samples of 10 tokens), weights
0.5/0.5: all tokens = 60, targets 30 and 30, so ``a`` takes 3 of its 4 samples (one left out,
counted as ``not_selected_by_mixture``) and ``b`` takes its 2 samples and 1 again (a repeat).

Samples are units: every piece of a split sample goes with it. Samples never selected are
dropped under the explicit ``not_selected_by_mixture`` count; repeats are counted too.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np


def source_targets(kind: str, values: list[float], available: np.ndarray) -> np.ndarray:
    """Target tokens per source: shares of all ``available`` tokens (``weight``) or budgets (``tokens``)."""
    values = np.asarray(values, dtype=np.float64)
    if kind == "tokens":
        return values
    return values / values.sum() * float(np.sum(available))


def choose_units(unit_tokens: np.ndarray, target: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of units (with repeats) whose token sum is closest to ``target``; a fresh seeded
    permutation per round, so an up-sampled source repeats every sample before any third time."""
    total = float(unit_tokens.sum())
    if total <= 0 or target <= 0:
        return np.zeros(0, dtype=np.int64)
    rounds = int(np.ceil(target / total)) + 1
    order = np.concatenate([rng.permutation(len(unit_tokens)) for _ in range(rounds)])
    cum = np.cumsum(unit_tokens[order])
    k = int(np.searchsorted(cum, target))  # cum[k] >= target; cum[k - 1] < target
    below = cum[k - 1] if k else 0.0
    take = k + 1 if cum[k] - target <= target - below else k
    return order[:take].astype(np.int64)


def mix_selection(selection, entry_source: np.ndarray, names: list[str], kind: str, values: list[float],
                  seed: int, max_piece: int):
    """Up/down-sample ``selection`` (a ``plan.Selection``) to the source targets.

    Returns ``(selection, entry_source, stats)``: the new entries (repeats included) with their
    source index, and one dict per source with target and achieved tokens and shares.
    """
    thd = selection.num_ids.astype(np.int64) - 1
    samples, first, count = np.unique(selection.kept, return_index=True, return_counts=True)
    if len(samples) and not np.all(np.diff(first) > 0):
        raise AssertionError("mix_selection needs the entries of each sample next to each other, samples in order")
    unit_tokens = np.add.reduceat(thd, first) if len(first) else np.zeros(0, np.int64)
    unit_source = entry_source[first]
    available = np.array([unit_tokens[unit_source == i].sum() for i in range(len(names))])
    targets = source_targets(kind, values, available)
    rng = np.random.default_rng([seed, 17])
    chosen, stats = [], []
    for i, name in enumerate(names):
        units = np.flatnonzero(unit_source == i)
        picked = units[choose_units(unit_tokens[units], targets[i], rng)]
        chosen.append(picked)
        stats.append({"name": name, "target_tokens": int(round(targets[i])),
                      "target_share": round(float(targets[i] / targets.sum()), 6),
                      "achieved_tokens": int(unit_tokens[picked].sum()), "available_tokens": int(available[i]),
                      "num_samples_available": int(units.size), "num_samples_selected": int(np.unique(picked).size),
                      "num_repeats": int(picked.size - np.unique(picked).size),
                      "within_one_pack": bool(abs(unit_tokens[picked].sum() - targets[i]) <= max_piece)})
    _add_shares(stats)
    units = np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)
    entries = _expand(first[units], count[units])
    num_left_out = int(len(samples) - np.unique(units).size)
    dropped = {**selection.dropped, "not_selected_by_mixture": num_left_out}
    mixed = replace(selection, kept=selection.kept[entries], num_ids=selection.num_ids[entries], dropped=dropped,
                    starts=None if selection.starts is None else selection.starts[entries],
                    pieces=None if selection.pieces is None else selection.pieces[entries])
    return mixed, entry_source[entries].astype(np.int32), stats


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without a Python loop."""
    if counts.size == 0:
        return np.zeros(0, np.int64)
    run_start = np.cumsum(counts) - counts
    return np.repeat(starts - run_start, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _add_shares(stats: list[dict]) -> None:
    achieved_total = sum(s["achieved_tokens"] for s in stats) or 1
    for s in stats:
        s["achieved_share"] = round(s["achieved_tokens"] / achieved_total, 6)
