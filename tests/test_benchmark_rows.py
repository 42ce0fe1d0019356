"""The load sweep's copies (``benchmarks/rows.replicate``): N x the users of a window, loaded
from its first minute as a running service's are."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from rows import replicate  # noqa: E402


def test_copies_are_rotated_within_the_window_so_its_first_minute_is_fully_loaded():
    rng = np.random.default_rng(1)
    span_s = 900.0
    arr = np.sort(rng.uniform(0.0, span_s, 3000))          # a steady load
    inp = rng.integers(1, 4000, arr.size)
    out = rng.integers(1, 500, arr.size)
    a, i, o = replicate(arr, inp, out, 64, span_s)
    assert a.size == 64 * arr.size
    assert np.all(np.diff(a) >= 0) and a.min() >= 0.0 and a.max() < span_s
    # every request kept with its own lengths (the copies are the same users)
    assert sorted(zip(i.tolist(), o.tolist())) == sorted(zip(np.tile(inp, 64).tolist(),
                                                              np.tile(out, 64).tolist()))
    per_min = np.bincount((a // 60).astype(int), minlength=15)
    # shifted without rotation, the first minute held about half a minute's copies
    assert per_min[0] > 0.9 * np.median(per_min)
    with pytest.raises(ValueError):
        replicate(arr, inp, out, 2, 0.0)
