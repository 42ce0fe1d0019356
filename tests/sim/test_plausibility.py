"""The chip model and engine against published TPU serving figures (tests/data)."""
from pathlib import Path

import pytest

from sim.plausibility import evaluate, load

ROWS = load(Path(__file__).resolve().parents[1] / "data" / "public_measurements.csv")


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_within_a_factor_of_three_of_public_measurements(row):
    """Not fitted to these numbers (the chip model's constants are generic, see
    sim/hardware.py); a factor of 3 either way would mean a modelling error, not noise."""
    r = evaluate(row)
    assert row["source"] and row["assumptions"]
    assert 1 / 3 <= r["model_over_measured"] <= 3, r
