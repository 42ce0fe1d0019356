import numpy as np
import pytest

from dse.pareto import best_fit, pareto_front


def brute_front(lat, eff):
    out = []
    for i in range(len(lat)):
        dominated = any((lat[j] <= lat[i] and eff[j] >= eff[i]) and
                        (lat[j] < lat[i] or eff[j] > eff[i]) for j in range(len(lat)))
        if not dominated:
            out.append(i)
    return out


def test_hand_made_front():
    lat = [1.0, 2.0, 2.0, 3.0, 4.0, 0.5]
    eff = [5.0, 6.0, 4.0, 6.0, 9.0, 1.0]
    # 5 (fastest), 0, 1, 4 are optimal; 2 and 3 are dominated by 1
    assert list(pareto_front(lat, eff)) == [5, 0, 1, 4]


def test_duplicates_keep_one_and_ties_in_latency():
    lat = [1.0, 1.0, 1.0, 2.0]
    eff = [3.0, 5.0, 5.0, 5.0]
    f = list(pareto_front(lat, eff))
    assert len(f) == 1 and f[0] in (1, 2)


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    lat = rng.integers(1, 20, 200).astype(float)
    eff = rng.integers(1, 20, 200).astype(float)
    got = set(pareto_front(lat, eff).tolist())
    want = brute_front(lat, eff)
    # same set of (lat, eff) values (duplicates may pick a different representative)
    assert {(lat[i], eff[i]) for i in got} == {(lat[i], eff[i]) for i in want}
    assert len(got) == len({(lat[i], eff[i]) for i in want})


def test_best_fit_prefers_efficiency_within_slo_else_fastest():
    lat = np.array([1.0, 2.0, 3.0, 4.0])
    eff = np.array([1.0, 3.0, 3.0, 9.0])
    assert best_fit(lat, eff, 3.5) == (1, True)     # ties on eff: lower latency
    assert best_fit(lat, eff, 10) == (3, True)
    assert best_fit(lat, eff, 0.5) == (0, False)    # none meets: lowest latency, flagged
