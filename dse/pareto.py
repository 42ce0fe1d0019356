"""Pareto fronts of (latency: lower is better, efficiency: higher is better) and best-fit choice."""

from __future__ import annotations

import numpy as np


def pareto_front(latency: np.ndarray, efficiency: np.ndarray) -> np.ndarray:
    """Indices of the Pareto-optimal points, ordered by increasing latency.

    A point is on the front when no other point has latency <= and efficiency >= with at least
    one strict. Among exact duplicates one representative is kept.
    """
    lat = np.asarray(latency, dtype=np.float64)
    eff = np.asarray(efficiency, dtype=np.float64)
    if lat.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(lat, kind="stable")   # one float key: much faster than lexsort
    e_sorted = eff[order]
    best_before = np.maximum.accumulate(np.concatenate(([-np.inf], e_sorted[:-1])))
    front = order[e_sorted > best_before]
    # equal latencies: a later kept point is strictly more efficient, so drop the earlier one
    same_as_next = np.concatenate((lat[front][:-1] == lat[front][1:], [False]))
    return front[~same_as_next]


def best_fit(latency: np.ndarray, efficiency: np.ndarray, slo_s: float) -> tuple[int, bool]:
    """Index of the most efficient point meeting ``latency <= slo_s`` (ties: lower latency).

    If none meets the SLO, the lowest-latency point, flagged ``False``.
    """
    lat = np.asarray(latency, dtype=np.float64)
    eff = np.asarray(efficiency, dtype=np.float64)
    if lat.size == 0:
        raise ValueError("no candidates")
    ok = lat <= slo_s
    if ok.any():
        idx = np.flatnonzero(ok)
        cand = idx[np.lexsort((lat[idx], -eff[idx]))]
        return int(cand[0]), True
    idx = np.lexsort((-eff, lat))
    return int(idx[0]), False
