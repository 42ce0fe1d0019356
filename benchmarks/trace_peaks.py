"""How bursty each evaluation trace is at the policy's two time scales: per 5-minute epoch,
the peak 10-s token rate within the epoch and within the 30-minute window ending with it, over
the epoch's mean rate (the load Ideal-at-load prices an epoch at). Medians over the epochs with
traffic. The README's "Why Ideal-at-load stays out of reach" cites these.

    python benchmarks/trace_peaks.py                 # the three traces of the grid, 24 h
    python benchmarks/trace_peaks.py --hours 2 --start 12:00
"""

from __future__ import annotations

import argparse

import numpy as np

from orchestrator.policy import PolicyConfig
from sim.traces import load_trace

TRACES = ("azure-code", "lveval", "openthoughts")


def ratios(arrival_s: np.ndarray, tokens: np.ndarray, cfg: PolicyConfig) -> tuple[float, float]:
    """(epoch peak / epoch mean, window peak / epoch mean), medians over epochs with traffic;
    ``tokens`` counted at arrival, as the gateway counts them."""
    per = int(round(cfg.epoch_s / cfg.sample_s))
    win = int(round(cfg.window_s / cfg.epoch_s))
    s = np.bincount((arrival_s // cfg.sample_s).astype(np.int64), weights=tokens) / cfg.sample_s
    s = s[:len(s) // per * per].reshape(-1, per)
    mean, peak = s.mean(axis=1), s.max(axis=1)
    wpeak = np.array([peak[max(0, i - win + 1):i + 1].max() for i in range(len(peak))])
    ok = mean > 0
    return float(np.median(peak[ok] / mean[ok])), float(np.median(wpeak[ok] / mean[ok]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--start", default="00:00")
    args = ap.parse_args()
    if not 0 < args.hours <= 24:
        ap.error(f"--hours must be in (0, 24] (got {args.hours:g})")
    from dse.errors import NeuScaleError
    from sim.traces import _parse_start
    try:
        _parse_start(args.start)
    except NeuScaleError as e:
        ap.error(f"--start: {e}")
    cfg = PolicyConfig()
    print("trace         phase    epoch peak / mean   window peak / epoch mean")
    for name in TRACES:
        tr = load_trace(name, hours=args.hours, start=args.start)
        arr = np.asarray(tr.arrival_s, dtype=np.float64)
        for phase, tok in (("prefill", tr.input_tokens), ("decode", tr.output_tokens)):
            e, w = ratios(arr, np.asarray(tok, dtype=np.float64), cfg)
            print(f"{name:13s} {phase:8s} {e:17.2f}x {w:23.2f}x")


if __name__ == "__main__":
    main()
