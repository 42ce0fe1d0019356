"""``orchestrator simulate``: replay a trace through the autoscaling policies on simulated TPUs
(paper §5) and report energy, dollars and SLO attainment per policy and phase."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

from dse.errors import NeuScaleError

from .common import (add_common, add_stack, catalog, check_out_dir, chip_list, clean_json, fraction,
                     json_default,
                     number, positive_float, print_json, progress_bar)
from .dse import warn_if_no_slo_met

CHIP_MIXES = {"expert": {"prefill": ("v6e",), "decode": ("v5p",)}}


def parse_quota(cat, text: str | None) -> dict[str, int]:
    """``v5p=256,V6E=512`` -> chips per version (names resolved through the catalog)."""
    out: dict[str, int] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        chip, sep, n = part.partition("=")
        if not sep or not n.strip().isdigit():
            raise NeuScaleError(f"--quota {text!r}: expected CHIP=CHIPS[,CHIP=CHIPS] "
                                "(e.g. v5p=256,v6e=512)")
        name = cat.get(chip).name
        if name in out:
            raise NeuScaleError(f"--quota {text!r} sets {name} twice")
        out[name] = int(n)
    return out


def parse_chip_mix(cat, text: str | None) -> dict[str, tuple[str, ...] | None]:
    """``--chip-mix``: ``v5p,v6e`` (both phases), ``prefill=v6e,decode=v5p`` (per phase) or a
    named mix (``expert``: prefill on v6e, decode on v5p, §5.4); names through the catalog."""
    if not text:
        return {"prefill": None, "decode": None}
    if text in CHIP_MIXES:
        return dict(CHIP_MIXES[text])
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not any("=" in p for p in parts):
        both = chip_list(cat, text, "--chip-mix")
        return {"prefill": both, "decode": both}
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for p in parts:
        ph, sep, chip = p.partition("=")
        if not sep or ph not in out or not chip:
            raise NeuScaleError(f"--chip-mix {text!r}: expected CHIP[,CHIP], PHASE=CHIP[,...] "
                                f"with PHASE prefill or decode, or one of {list(CHIP_MIXES)}")
        out[ph].append(chip)
    return {ph: chip_list(cat, ",".join(cs), "--chip-mix") if cs else None
            for ph, cs in out.items()}


def cmd_simulate(args: argparse.Namespace) -> int:
    import numpy as np

    from dse.models import load_model
    from orchestrator.registry import parse_policy_names
    from sim.traces import load_trace

    from ..cluster import ratios_vs_base
    cat = catalog(args)
    arch = load_model(args.model)
    names = parse_policy_names(args.policy)
    quotas = parse_quota(cat, args.quota)
    phase_chips = parse_chip_mix(cat, args.chip_mix)
    failover = chip_list(cat, args.failover_chips, "--failover-chips")
    if args.out:
        check_out_dir(args.out)
    tr = load_trace(args.trace, hours=args.hours, start=args.start, rate_scale=args.rate_scale,
                    seed=args.seed)
    db = _database(args, arch, cat)
    for ph, chips in phase_chips.items():
        missing = [c for c in chips or () if c not in db.chips]
        if missing:
            raise NeuScaleError(f"--chip-mix: the best-fit database has no {', '.join(missing)} "
                                f"(it has {', '.join(db.chips)})")
    args.confusion, prediction = _prediction(args, db)
    out: dict = {"model": arch.name, "metric": db.meta["metric"], "trace": tr.summary(),
                 "trace_note": tr.note, "prediction": prediction, "policies": {}}
    trace = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens), np.asarray(tr.output_tokens))
    runs = {}
    for name in names:
        runs[name] = _run_policy(args, name, arch, db, cat, trace, quotas, phase_chips,
                                 failover, tr.duration_s)
        out["policies"][name] = runs[name][0]
    if "base" in out["policies"]:
        out["ratios_vs_base"] = ratios_vs_base(out["policies"])
    if args.out:
        _write_outputs(Path(args.out), out, runs, db)
    if args.json:
        print_json(out)
    else:
        _print_table(args, arch.name, out)
    return 0


def _prediction(args, db):
    """(the Confusion to replay or None, how output lengths are predicted, in words)."""
    import numpy as np

    from ..cluster import ClusterConfig, Confusion
    if args.predictor is None:
        if args.accuracy is None:
            args.accuracy = ClusterConfig.accuracy
        return None, f"accuracy {args.accuracy:g}"
    if args.accuracy is not None:
        raise NeuScaleError("--predictor replays a trained model's measured accuracy; drop "
                            "--accuracy (or --predictor)")
    from predictor.model import LengthModel
    from predictor.train import confusion_matrix
    m = LengthModel.load(None if args.predictor == "default" else args.predictor,
                         edges=tuple(db.edges))
    ev = m.manifest.get("eval") or {}
    mat = confusion_matrix(ev, len(m.edges))
    if mat.sum() == 0:
        raise NeuScaleError(f"the predictor at {args.predictor!r} has no held-out evaluation "
                            "(confusion matrix); retrain it with test data")
    args.accuracy = ClusterConfig.accuracy         # unused in this mode
    acc = float(np.trace(mat) / mat.sum())
    label = (f"predictor {args.predictor} (held-out bucket accuracy {acc:.1%} on "
             f"{int(mat.sum()):,} answers)")
    return Confusion.from_counts(m.edges, mat, m.bucket_median, label), label


def _database(args, arch, cat):
    """``--db`` (checked: built for this model and these chip specs, and not contradicting an
    explicit --metric or --slo-scale) or the default verified database."""
    from dse.builder import BuildOptions
    from dse.db import BestFitDB
    if not args.db:
        from sim.verified import verified_db
        d = BuildOptions(workers=1)
        db = verified_db(arch, args.metric or d.metric,
                         args.slo_scale if args.slo_scale is not None else d.slo_scale, None,
                         cat, progress=None if not args.json else False,
                         stack=args.stack or d.stack)
        warn_if_no_slo_met(db)
        return db
    db = BestFitDB.load(args.db)
    db.check_built_for(arch, cat)
    if args.metric is not None and args.metric != db.meta.get("metric"):
        raise NeuScaleError(f"--metric {args.metric} contradicts --db, which was built for "
                            f"{db.meta.get('metric')}: drop --metric or pass a database built "
                            f"for {args.metric}")
    if args.slo_scale is not None and args.slo_scale != db.meta.get("slo_scale"):
        raise NeuScaleError(f"--slo-scale {args.slo_scale:g} contradicts --db, whose SLOs are "
                            f"{db.meta.get('slo_scale')} x the reference latency: drop "
                            "--slo-scale or build a database with it")
    if args.stack is not None and args.stack != db.stack.name:
        raise NeuScaleError(f"--stack {args.stack} contradicts --db, which was built for the "
                            f"{db.stack.name} serving stack: drop --stack or build a database "
                            f"with `orchestrator dse build --stack {args.stack}`")
    return db


def _run_policy(args, name: str, arch, db, cat, trace, quotas, phase_chips, failover,
                duration_s: float):
    """(report JSON, per-request arrays, SimResult or None) of one policy on the trace."""
    from orchestrator.policy import PolicyConfig
    from orchestrator.pricing import ChipModelPricer
    from orchestrator.registry import make_policies

    from ..cluster import ClusterConfig, ClusterSim, ideal_at_load_report, ideal_report
    arr, inp, out_t = trace
    pricer = ChipModelPricer(arch, cat, db.stack)
    if name in ("ideal", "ideal-at-load"):
        extra: dict = {}
        if name == "ideal":
            rep = ideal_report(arch, db, arr, inp, out_t, cat, per_request=extra)
        else:
            rep = ideal_at_load_report(arch, db, arr, inp, out_t, pricer, per_request=extra)
        return {ph: r.to_json() for ph, r in rep.items()}, extra, None
    pcfg = PolicyConfig(failover_chips=failover)
    cfg = ClusterConfig(policy=pcfg, accuracy=args.accuracy, quotas=quotas, seed=args.seed,
                        confusion=args.confusion,
                        observe_routed=args.observe == "routed",
                        max_span_s=args.max_span * 3600.0)
    sim = ClusterSim(arch, db, make_policies(name, db, pcfg, inp, out_t, phase_chips, cat,
                                             pricer), cfg, cat)
    bar = progress_bar(not args.json, float(duration_s), f"{name} (simulated s)", "s")
    last = [0.0]

    def progress(t: float) -> None:
        if bar is not None:
            bar.update(max(0.0, min(t, duration_s) - last[0]))
            last[0] = min(t, duration_s)
    res = sim.run(arr, inp, out_t, progress=progress)
    if bar is not None:
        bar.close()
    return res.to_json(), res.per_request(), res


def _write_outputs(out_dir: Path, out: dict, runs: dict, db) -> None:
    """summary.json, per-policy timelines and minutes (CSV) and the plots."""
    from ..cluster.report import plot_report
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, (_, _, res) in runs.items():
        if res is not None:
            stem = name.replace(':', '-')
            write_timeline(out_dir / f"timeline_{stem}.csv", res.timeline)
            write_minutes(out_dir / f"minutes_{stem}.csv", res.minutes)
    timelines = {n: r[2].timeline for n, r in runs.items() if r[2] is not None}
    minutes = {n: r[2].minutes for n, r in runs.items() if r[2] is not None}
    per_request = {n: r[1] for n, r in runs.items()}
    out["plots"] = [str(p) for p in plot_report(out, timelines, out_dir, minutes=minutes,
                                                per_request=per_request, db=db)]
    (out_dir / "summary.json").write_text(json.dumps(clean_json(out), indent=2,
                                                     default=json_default))


def _print_table(args, model: str, out: dict) -> None:
    s = out["trace"]
    print(f"{model} on {args.trace}: {s['requests']:,} requests over "
          f"{s['duration_s'] / 3600:.2f} h, metric {out['metric']}")
    print(f"  {'policy':12} {'phase':7} {'tokens/J':>10} {'tokens/USD':>12} {'SLO rate':>9} "
          f"{'vs base (eff, SLO)':>20}")
    for n, v in out["policies"].items():
        for ph in ("prefill", "decode"):
            r = v[ph]
            ratio = out.get("ratios_vs_base", {}).get(n, {}).get(ph)
            key = "tokens_per_j" if out["metric"] == "energy" else "tokens_per_usd"
            rs = f"{ratio[key]:.2f}x, {ratio['slo_rate']:.2f}x" if ratio and ratio[key] else ""
            print(f"  {n:12} {ph:7} {r['tokens_per_j']:10.3g} {r['tokens_per_usd']:12.4g} "
                  f"{r['slo_rate']:9.1%} {rs:>20}")


def write_minutes(path: Path, rows: list[dict[str, Any]]) -> None:
    """Per minute and phase: a ``*`` row (ready vPods, energy used, requests finished, SLO
    rate) and one row per group (its ready vPods)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["t_s", "phase", "group", "vpods", "energy_j", "finished", "slo_rate"])
        for r in rows:
            slo = "" if r.get("slo_rate") is None else f"{r['slo_rate']:.4f}"
            w.writerow([f"{r['t_s']:.0f}", r["phase"], "*", sum(r["vpods"].values()),
                        f"{r['energy_j']:.1f}", r.get("finished", 0), slo])
            for g, n in sorted(r["vpods"].items()):
                w.writerow([f"{r['t_s']:.0f}", r["phase"], g, n, "", "", ""])


def write_timeline(path: Path, timeline: list[dict[str, Any]]) -> None:
    """Per epoch, phase and group: the vPods the policy wanted and the lengths routed to it
    (the group id names its allocation: chip:topology/tp..pp..ep../b<batch>)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["t_s", "phase", "group", "vpods_target", "min_len", "max_len"])
        for row in timeline:
            lengths = row.get("lengths", {})
            for g in sorted(set(row["target"]) | set(lengths)):
                lo, hi = lengths.get(g, ("", ""))
                w.writerow([f"{row['t_s']:.0f}", row["phase"], g, row["target"].get(g, 0),
                            lo, hi])


def add_parser(sub) -> None:
    from dse.builder import BuildOptions
    from orchestrator.cluster import ClusterConfig
    from orchestrator.registry import POLICY_NAMES
    from sim.traces import PRESETS as TRACE_PRESETS
    build, cluster = BuildOptions(workers=1), ClusterConfig()
    sm = sub.add_parser("simulate", help="replay a trace through the autoscaler (paper §5)",
                        description="Trace-driven cluster simulation: the production policy and "
                                    "routing drive simulated engines; energy, dollars and SLO "
                                    "attainment per policy and phase. Trace presets: "
                                    + "; ".join(f"{k}: {v}" for k, v in TRACE_PRESETS.items()))
    sm.add_argument("--model", required=True)
    sm.add_argument("--trace", required=True, help="preset name or a trace file (CSV "
                    "arrival_s,input_tokens,output_tokens [.gz], Azure CSV, Mooncake JSONL)")
    sm.add_argument("--policy", default="neuscale,base,ideal",
                    help=f"comma-separated: {', '.join(POLICY_NAMES)} "
                         "(default neuscale,base,ideal)")
    sm.add_argument("--db", help="best-fit database (default: built and verified on the chip "
                    "model on first use, then cached)")
    sm.add_argument("--hours", type=positive_float("--hours"),
                    help="replay this many hours of the trace (default: all of it)")
    sm.add_argument("--start", metavar="HH:MM", help="where in the trace's day to start")
    sm.add_argument("--rate-scale", type=positive_float("--rate-scale"), default=1.0,
                    help="multiply the trace's request rate (default 1)")
    sm.add_argument("--metric", choices=["energy", "cost"],
                    help=f"of the default database (default {build.metric}); with --db the "
                         "database's own, which an explicit --metric must match")
    sm.add_argument("--chip-mix", help="chip versions the cluster has: v5p,v6e (both phases), "
                    "prefill=v6e,decode=v5p (per phase) or 'expert' (that mix, §5.4); "
                    "default all. The SLOs stay those of the full database")
    sm.add_argument("--quota", help="chips per version, e.g. v5p=256,v6e=512")
    sm.add_argument("--failover-chips", help="chip versions fail-over may use (default: all)")
    sm.add_argument("--observe", choices=["routed", "true-length"],
                    default="routed" if cluster.observe_routed else "true-length",
                    help="where the policy sees a mispredicted request's decode load: at the "
                    "length its group serves (routed, as the live gateway sees it) or at its "
                    "true length (how earlier versions observed) (default %(default)s)")
    sm.add_argument("--accuracy", type=fraction("--accuracy"), default=None,
                    help=f"output-length prediction accuracy (default {cluster.accuracy:g}, "
                         "§5.1)")
    sm.add_argument("--predictor", metavar="MODEL_DIR",
                    help="instead of --accuracy, replay a trained length predictor's confusion "
                         "matrix measured on held-out prompts (orchestrator predictor train "
                         "--out MODEL_DIR; 'default' for the shipped one): each request's "
                         "predicted bucket is drawn from the row of its true one")
    sm.add_argument("--slo-scale", type=positive_float("--slo-scale"),
                    help=f"of the default database (default {build.slo_scale:g}); with --db the "
                         "database's own, which an explicit --slo-scale must match")
    sm.add_argument("--seed", type=number("--seed", int, lo=0), default=cluster.seed,
                    help="fixes every random draw: the same seed gives the same report "
                         f"(default {cluster.seed})")
    sm.add_argument("--max-span", type=positive_float("--max-span"), metavar="HOURS",
                    default=cluster.max_span_s / 3600.0,
                    help="refuse a trace (after --rate-scale) longer than this "
                         f"(default {cluster.max_span_s / 3600:g} h)")
    sm.add_argument("--out", metavar="DIR",
                    help="write summary.json, timelines (CSV) and plots (PNG) here")
    add_stack(sm, default=None, what="of the default database and the engines (with --db the "
              "database's own, which an explicit --stack must match)")
    add_common(sm)
    sm.set_defaults(func=cmd_simulate)
