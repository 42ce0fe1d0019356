"""A row of the results table as the row benchmarks name it (``model:trace:metric:phase``):
checking the name and loading what a replay of it needs (``copies`` x its users, as the load
sweep replays them). Shared by ``headroom.py``, ``seed_noise.py``, ``handoff_order.py``,
``move_when_up.py``, ``hold_scale_in.py``, ``emergency.py`` and ``paper_eval.py`` (the sweep's
copies)."""

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


def replicate(arr, inp, out, copies: int, span_s: float, seed: int = 0):
    """``copies`` x the users of a window ``span_s`` long: the window's requests ``copies``
    times, each copy rotated within the window by its own random offset under a minute (a
    request shifted past the window's end comes round to its start), in arrival order. Unlike
    ``--rate-scale`` (which divides arrival times, so a 16x rate also runs the day's ramps 16x
    faster) this keeps the window's dynamics: a policy sees 16x the load changing as fast as
    the real load does. Rotated, not only shifted: shifted copies leave the first minute
    carrying half of them on average (a copy contributes nothing before its offset), a ramp
    from 1x to ``copies`` x that a running service - which the simulator's warm start is -
    does not see (Llama3-70B decode at 64x: the warm start sized on the first epoch's mean,
    ~10 % under the load after it, and one group of one vPod met ~70 % of TPOTs until the
    next epoch's scale-out was up)."""
    if not span_s > 0:
        raise ValueError(f"span_s must be > 0, not {span_s!r}")
    rng = np.random.default_rng(seed)
    shifts = np.repeat(rng.uniform(0.0, 60.0, copies), len(arr))
    a = np.mod(np.tile(arr, copies) + shifts, span_s)
    order = np.argsort(a, kind="stable")
    return a[order], np.tile(inp, copies)[order], np.tile(out, copies)[order]


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


def load_row(row: str, start: str, hours: float, copies: int = 1) -> Row:
    """The model, its verified database for the row's metric and the trace window (``copies``
    times its users, :func:`replicate`)."""
    model, trace, metric, phase = row.split(":")
    arch = load_model(model)
    db = verified_db(arch, progress=False, metric=metric)
    tr = load_trace(trace, start=start, hours=hours)
    arr, inp, out = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens),
                     np.asarray(tr.output_tokens))
    if copies != 1:
        arr, inp, out = replicate(arr, inp, out, copies, hours * 3600.0)
    return Row(arch, db, arr, inp, out, metric, phase)


def row_args(doc: str, row: str, policies: str, start: str, hours: float,
             copies: int = 1) -> tuple[argparse.Namespace, list[str]]:
    """The command line of a benchmark that replays one row under a few policies (``--row``,
    ``--policies``, ``--start``, ``--hours``, ``--copies``; the defaults are the benchmark's
    own), checked: the parsed arguments and the policies as a list."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--row", default=row, help="model:trace:metric:phase")
    ap.add_argument("--policies", default=policies)
    ap.add_argument("--start", default=start)
    ap.add_argument("--hours", type=float, default=hours)
    ap.add_argument("--copies", type=int, default=copies,
                    help="replay this many copies of the window's users (the load sweep's x)")
    args = ap.parse_args()
    check_rows(ap, [args.row], args.hours, "--row")
    if args.copies < 1:
        ap.error("--copies must be a whole number >= 1")
    return args, [p for p in args.policies.split(",") if p]


def before_after_main(doc: str, run, row: str, policies: str, start: str,
                      hours: float, copies: int = 1) -> None:
    """The command line of a benchmark that replays a row with a fix patched out
    (``run(row, start, hours, True, policy, copies)``) and as shipped (``before=False``), and
    prints per policy the efficiency and SLO rate of both and their ratio. The defaults are the
    benchmark's own row, window and copies. Shared by ``handoff_order.py``, ``move_when_up.py``
    and ``hold_scale_in.py``."""
    from dse.errors import NeuScaleError
    args, pols = row_args(doc, row, policies, start, hours, copies)
    x = f", {args.copies}x" if args.copies != 1 else ""
    print(f"| {args.row} ({args.hours:g} h from {args.start}{x}) | as-before: efficiency | SLO | "
          "as-shipped: efficiency | SLO | shipped / before |")
    print("|---|---|---|---|---|---|")
    for pol in pols:
        try:
            e0, s0 = run(args.row, args.start, args.hours, True, pol, args.copies)
            e1, s1 = run(args.row, args.start, args.hours, False, pol, args.copies)
        except NeuScaleError as e:
            sys.exit(f"error: {e}")
        print(f"| {pol} | {e0:.4g} | {s0:.1%} | {e1:.4g} | {s1:.1%} | {e1 / e0:.2f}x |",
              flush=True)
