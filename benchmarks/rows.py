"""A row of the results table as the row benchmarks name it (``model:trace:metric:phase``):
checking the name and loading what a replay of it needs. Shared by ``headroom.py``,
``seed_noise.py`` and ``handoff_order.py``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse import load_model  # noqa: E402
from sim.traces import load_trace  # noqa: E402
from sim.verified import verified_db  # noqa: E402


def check_rows(ap: argparse.ArgumentParser, rows: list[str], hours: float,
               flag: str = "--rows") -> None:
    """One argparse error for a row that is not ``model:trace:{energy|cost}:{prefill|decode}``
    or a window (``--hours``) that is not positive."""
    if not hours > 0:
        ap.error("--hours must be > 0")
    for row in rows:
        parts = row.split(":")
        if len(parts) != 4 or parts[2] not in ("energy", "cost") \
                or parts[3] not in ("prefill", "decode"):
            ap.error(f"{flag}: {row!r} is not model:trace:{{energy|cost}}:{{prefill|decode}}")


@dataclass
class Row:
    arch: object
    db: object
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    metric: str
    phase: str

    @property
    def key(self) -> str:
        """The report's efficiency field for the row's metric."""
        return "tokens_per_j" if self.metric == "energy" else "tokens_per_usd"


def load_row(row: str, start: str, hours: float) -> Row:
    """The model, its verified database for the row's metric and the trace window."""
    model, trace, metric, phase = row.split(":")
    arch = load_model(model)
    db = verified_db(arch, progress=False, metric=metric)
    tr = load_trace(trace, start=start, hours=hours)
    return Row(arch, db, np.asarray(tr.arrival_s), np.asarray(tr.input_tokens),
               np.asarray(tr.output_tokens), metric, phase)
