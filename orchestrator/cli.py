"""The ``orchestrator`` command line.

    orchestrator dse build  --model M [--chips ...] [--metric energy|cost] [--slo-scale 5] [--out PATH]
    orchestrator dse query  --db PATH --phase prefill|decode --seq-len N [--chip C] [--explain] [--json]
    orchestrator dse cost   --model M --chip C --tp T [--pp P] [--ep E] --phase P --batch B --seq-len N
    orchestrator dse show   --db PATH
    orchestrator dse plot   --db PATH --out DIR

Every error a user can cause ends in one line ``error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from dse.errors import NeuScaleError


def _number(name: str, cast=float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False):
    """argparse type: ``cast`` of the text within [lo, hi] (``lo_open``: lo excluded)."""
    what = "an integer" if cast is int else "a number"

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {what} (got {text!r})") from None
        if not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) \
                or (hi is not None and v > hi):
            rng = (f"between {lo:g} and {hi:g}" if hi is not None
                   else f"{'>' if lo_open else '>='} {lo:g}")
            raise argparse.ArgumentTypeError(f"{name} must be {rng} (got {text})")
        return v
    return parse


def _positive_int(name: str):
    return _number(name, int, lo=1)


def _positive_float(name: str):
    return _number(name, float, lo=0, lo_open=True)


def _fraction(name: str):
    return _number(name, float, lo=0, hi=1)


def _catalog(args: argparse.Namespace):
    from dse.catalog import default_catalog
    return default_catalog(args.chip_file or [])


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=_json_default))


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


# ---- dse build ------------------------------------------------------------------------------

def cmd_dse_build(args: argparse.Namespace) -> int:
    from dse.builder import BuildOptions, build, default_db_path
    from dse.models import load_model
    arch = load_model(args.model)
    opts = BuildOptions(metric=args.metric, slo_scale=args.slo_scale,
                        chips=tuple(c for c in args.chips.split(",") if c.strip())
                        if args.chips else None,
                        workers=args.workers, ray_address=args.ray, max_chips=args.max_chips,
                        progress=None if not args.json else False)
    log = (lambda s: print(s, file=sys.stderr)) if not args.json else None
    db = build(arch, opts, catalog=_catalog(args), log=log)
    out = Path(args.out) if args.out else default_db_path(arch.name, args.metric)
    db.save(out)
    n = len(db.entries)
    if args.json:
        _print_json({"db": str(out), "entries": n, "model": arch.name, "metric": args.metric,
                     "chips": db.chips, "build_seconds": db.meta["build_seconds"],
                     "fit_quality": db.meta["fit_quality"]})
    else:
        fq = db.meta["fit_quality"]
        print(f"wrote {out}: {n} entries ({len(db.edges)} buckets x 2 phases x "
              f"{len(db.chips)} chips), metric {args.metric}, {db.meta['build_seconds']:.1f}s; "
              f"XLA fits {fq['fits']}, held-out max rel. error {fq['heldout_max_rel_err']:.1e}, "
              f"vs analytic matmul count {fq['analytic_max_rel_diff']:.1%}")
    return 0


# ---- dse query ------------------------------------------------------------------------------

def cmd_dse_query(args: argparse.Namespace) -> int:
    from dse.db import BestFitDB
    db = BestFitDB.load(args.db)
    e = db.lookup(args.phase, args.seq_len, args.chip)
    out: dict[str, Any] = {"query": {"phase": args.phase, "seq_len": args.seq_len,
                                     "chip": args.chip},
                           "entry": e.to_json()}
    if args.explain:
        out["explain"] = db.explain_for(args.phase, args.seq_len, e.chip)
        out["pareto"] = db.pareto_for(args.phase, args.seq_len, e.chip)
    if args.json:
        _print_json(out)
        return 0
    unit = db.meta["efficiency_unit"]
    print(f"{args.phase} {args.seq_len} tokens -> bucket <= {e.seq_len}: {e.chip}:{e.topology} "
          f"({e.accelerator_type}, {e.num_chips} chips) tp={e.tp} pp={e.pp} ep={e.ep} "
          f"max_batch={e.max_batch}")
    print(f"  latency {e.latency_s * 1e3:.2f} ms (SLO {e.slo_s * 1e3:.2f} ms, "
          f"{'met' if e.meets_slo else 'NOT met: lowest-latency allocation'}), {e.bound}-bound")
    print(f"  {e.throughput_tok_per_s:,.0f} tok/s, {e.energy_j_per_token:.4g} J/token, "
          f"{e.usd_per_token:.3g} USD/token, efficiency {e.efficiency:.4g} {unit}")
    if args.explain:
        ex = out["explain"]
        print(f"  candidates {ex.get('candidates')}, feasible {ex.get('feasible')}, "
              f"rejected for memory {ex.get('infeasible')}, over SLO {ex.get('slo_violations')}")
        if ex.get("example"):
            print(f"  e.g. {ex['example']}")
        print(f"  Pareto front ({len(out['pareto'])} points):")
        for p in out["pareto"]:
            print(f"    {e.chip}:{p['topology']} tp{p['tp']} pp{p['pp']} ep{p['ep']} "
                  f"batch {p['batch']}: {p['latency_s'] * 1e3:.2f} ms, {p['efficiency']:.4g} {unit}")
    return 0


# ---- dse cost -------------------------------------------------------------------------------

def cmd_dse_cost(args: argparse.Namespace) -> int:
    import numpy as np

    from dse.buckets import MAX_SEQ_LEN
    from dse.builder import DSE, Candidate
    from dse.costmodel import BOUNDS, infeasible_message
    from dse.vpod import VPodConfig
    from dse.xla_cost import components_for, fit_key

    if args.seq_len > MAX_SEQ_LEN:
        raise NeuScaleError(f"--seq-len {args.seq_len} exceeds the largest bucket ({MAX_SEQ_LEN})")
    cat = _catalog(args)
    arch, chip, topo, par = _allocation(cat, args.model, args.chip, None, args.topology,
                                        args.tp, args.pp, args.ep)
    vpod = VPodConfig.make(chip, topo, cat)
    dse = DSE(arch, cat)
    dse.ensure_fits([par], workers=1, progress=None if not args.json else False)
    r = dse.evaluate(Candidate(chip, topo, par), args.phase, np.asarray([args.batch]),
                     np.asarray([args.seq_len]))
    fits = [dse.fits.fits[fit_key(c, par.tp, par.ep)] for c in components_for(arch, args.phase)]
    i = (0, 0)
    out = {
        "model": arch.name, "vpod": str(vpod), "accelerator_type": vpod.accelerator_type(cat),
        "num_chips": vpod.num_chips, "tp": par.tp, "pp": par.pp, "ep": par.ep,
        "phase": args.phase, "batch": args.batch, "seq_len": args.seq_len,
        "scope": "flops/hbm_bytes/ici_bytes: per chip, slowest pipeline stage, one micro-batch "
                 "step; latency_s: TTFT (prefill) or TPOT (decode); energy_j/cost_usd: whole vPod "
                 "for that batch (prefill) or decode iteration",
        "flops": float(r.flops[i]), "hbm_bytes": float(r.hbm_bytes[i]),
        "ici_bytes": float(r.ici_bytes[i]),
        "flops_source": "xla-hlo-cost-analysis (lowered per-chip JAX graph, polynomial fit)",
        "xla_bytes_accessed_unfused": float(r.xla_bytes[i]),
        "fit_heldout_max_rel_err": max((f.heldout_max_rel_err for f in fits), default=0.0),
        "latency_s": float(r.latency_s[i]), "throughput_tok_per_s":
            float(r.throughput_tok_per_s[i]),
        "energy_j": float(r.energy_j[i]), "cost_usd": float(r.cost_usd[i]),
        "energy_j_per_token": float(r.energy_j_per_token[i]),
        "usd_per_token": float(r.usd_per_token[i]), "bound": BOUNDS[int(r.bound[i])],
        "hbm_bytes_per_chip_used": float(r.mem_bytes[i]), "feasible": bool(r.feasible[i]),
    }
    if not r.feasible[i]:
        out["infeasible_reason"] = infeasible_message(r, chip, i)
    if args.json:
        _print_json(out)
        return 0
    print(f"{arch.name} {args.phase} batch {args.batch} x {args.seq_len} tokens on {vpod} "
          f"({out['accelerator_type']}) tp={par.tp} pp={par.pp} ep={par.ep}")
    print(f"  per chip: {out['flops'] / 1e12:.4g} TFLOP (XLA), {out['hbm_bytes'] / 1e9:.4g} GB HBM "
          f"(fused model; XLA unfused {out['xla_bytes_accessed_unfused'] / 1e9:.4g} GB), "
          f"{out['ici_bytes'] / 1e9:.4g} GB ICI")
    print(f"  latency {out['latency_s'] * 1e3:.3f} ms ({out['bound']}-bound), "
          f"{out['throughput_tok_per_s']:,.0f} tok/s, {out['energy_j']:.4g} J, "
          f"{out['cost_usd']:.4g} USD")
    if not r.feasible[i]:
        print(f"  does NOT fit: {out['infeasible_reason']}")
    return 0


def _compact_topology(chip, n: int):
    """The most cube-like power-of-two shape with ``n`` chips."""
    from dse.vpod import ICITopology, is_pow2
    if not is_pow2(n):
        raise NeuScaleError(f"tp*pp*ep = {n} chips is not a power of two")
    dims = [1] * chip.torus_dims
    k = 0
    while math.prod(dims) < n:
        dims[k % len(dims)] *= 2
        k += 1
    return ICITopology(tuple(sorted(dims, reverse=True))).for_chip(chip)


# ---- dse show / plot ------------------------------------------------------------------------

def cmd_dse_show(args: argparse.Namespace) -> int:
    from dse.db import BestFitDB
    db = BestFitDB.load(args.db)
    m = db.meta
    if args.json:
        _print_json({"meta": {k: m[k] for k in ("model", "metric", "slo_scale", "chips",
                                                "tool_version", "catalog_hash", "model_hash",
                                                "jax_version", "created_utc")},
                     "best": {p: [e.to_json() for e in db.entries_for(p)] for p in
                              ("prefill", "decode")}})
        return 0
    print(f"{m['model']}  metric={m['metric']} ({m['efficiency_unit']})  SLO={m['slo_scale']}x  "
          f"chips={','.join(db.chips)}  built {m['created_utc'][:19]} by neuscale "
          f"{m['tool_version']} (jax {m['jax_version']})")
    hdr = (f"{'phase':7} {'bucket':>8} {'best vPod':16} {'acc.type':14} {'tp':>3} {'pp':>3} "
           f"{'ep':>3} {'batch':>5} {'lat ms':>9} {'SLO ms':>9} {'ok':2} {'efficiency':>10} "
           f"{'bound':7} " + " ".join(f"{c:>9}" for c in db.chips))
    print(hdr)
    print("-" * len(hdr))
    for phase in ("prefill", "decode"):
        for i, s in enumerate(db.edges):
            e = db.entry_at(phase, i)
            per_chip = []
            for c in db.chips:
                ce = db.entry_at(phase, i, c)
                per_chip.append(f"{ce.efficiency:9.3g}" if ce and ce.feasible else f"{'-':>9}")
            if e is None:
                print(f"{phase:7} {s:>8} (nothing fits)")
                continue
            print(f"{phase:7} {s:>8} {e.chip + ':' + e.topology:16} {e.accelerator_type:14} "
                  f"{e.tp:>3} {e.pp:>3} {e.ep:>3} {e.max_batch:>5} {e.latency_s * 1e3:9.2f} "
                  f"{e.slo_s * 1e3:9.2f} {'y' if e.meets_slo else 'N':2} {e.efficiency:10.4g} "
                  f"{e.bound:7} " + " ".join(per_chip))
    return 0


def cmd_dse_plot(args: argparse.Namespace) -> int:
    from dse.db import BestFitDB
    from dse.plot import plot_db
    db = BestFitDB.load(args.db)
    paths = plot_db(db, args.out)
    if args.json:
        _print_json({"plots": [str(p) for p in paths]})
    else:
        for p in paths:
            print(p)
    return 0


# ---- dse validate ---------------------------------------------------------------------------

def cmd_dse_validate(args: argparse.Namespace) -> int:
    from dse.models import load_model
    from sim.validate import Validator, plot_validation
    v = Validator(load_model(args.model), _catalog(args), args.metric,
                  args.chips.split(",") if args.chips else None)
    res = v.validate(args.phase, args.seq_len, args.max_candidates, args.seed)
    out = res.to_json()
    if args.plot:
        out["plots"] = [str(p) for p in plot_validation(res, args.plot)]
    if args.allocation_accuracy:
        rows = v.allocation_accuracy(args.phase, slo_scale=args.slo_scale,
                                     max_candidates=min(args.max_candidates, 600), seed=args.seed)
        out["allocation_accuracy"] = {
            "rows": rows, "mean_ratio": sum(r["ratio"] for r in rows) / len(rows),
            "buckets_at_least_0.9": sum(r["ratio"] >= 0.9 for r in rows)}
    if args.json:
        _print_json(out)
        return 0
    print(f"{out['model']} {out['phase']} bucket {out['seq_len']} ({out['metric']}): "
          f"{out['candidates_evaluated']} of {out['candidates_feasible']} feasible allocations "
          f"simulated")
    print(f"  latency:    Spearman rho {out['latency']['spearman_rho']:.3f}, "
          f"Pearson r {out['latency']['pearson_r']:.3f}; chip model / roofline median "
          f"{out['sim_over_roofline_latency_median']:.2f}x")
    print(f"  efficiency: Spearman rho {out['efficiency']['spearman_rho']:.3f}, "
          f"Pearson r {out['efficiency']['pearson_r']:.3f}")
    pa = out["pareto"]
    print(f"  Pareto: predicted front ({pa['predicted_points']} points) contains "
          f"{pa['true_points_covered']} of the {pa['true_points']} true Pareto points "
          f"({pa['coverage']:.0%})")
    if args.allocation_accuracy:
        aa = out["allocation_accuracy"]
        print(f"  allocation accuracy (Fig. 11): mean {aa['mean_ratio']:.3f} of the oracle, "
              f">= 0.9 in {aa['buckets_at_least_0.9']} of {len(aa['rows'])} buckets")
        for r in aa["rows"]:
            print(f"    {r['seq_len']:>8}: {r['ratio']:.3f}  predicted {r['predicted_best']}"
                  f"{'' if r['predicted_meets_sim_slo'] else ' (misses SLO on chip model)'}"
                  f"  oracle {r['oracle_best']}")
    for p in out.get("plots", []):
        print(f"  wrote {p}")
    return 0


# ---- simulate -------------------------------------------------------------------------------

def _quota(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        chip, sep, n = part.partition("=")
        if not sep or not n.strip().isdigit():
            raise NeuScaleError(f"--quota {text!r}: expected CHIP=CHIPS[,CHIP=CHIPS] "
                                "(e.g. v5p=256,v6e=512)")
        out[chip.strip()] = int(n)
    return out


CHIP_MIXES = {"expert": {"prefill": ("v6e",), "decode": ("v5p",)}}


def _chip_mix(text: str | None) -> dict[str, tuple[str, ...] | None]:
    """``--chips``: ``v5p,v6e`` (both phases), ``prefill=v6e,decode=v5p`` (per phase) or a
    named mix (``expert``: prefill on v6e, decode on v5p, §5.4)."""
    if not text:
        return {"prefill": None, "decode": None}
    if text in CHIP_MIXES:
        return dict(CHIP_MIXES[text])
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not any("=" in p for p in parts):
        return {"prefill": tuple(parts), "decode": tuple(parts)}
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for p in parts:
        ph, sep, chip = p.partition("=")
        if not sep or ph not in out or not chip:
            raise NeuScaleError(f"--chips {text!r}: expected CHIP[,CHIP], PHASE=CHIP[,...] "
                                f"with PHASE prefill or decode, or one of {list(CHIP_MIXES)}")
        out[ph].append(chip)
    return {ph: tuple(cs) if cs else None for ph, cs in out.items()}


def cmd_simulate(args: argparse.Namespace) -> int:
    import numpy as np

    from dse.db import BestFitDB
    from dse.models import load_model
    from orchestrator.policy import PolicyConfig
    from sim.cluster import ClusterConfig, ClusterSim, ideal_report, make_policies
    from sim.traces import load_trace

    cat = _catalog(args)
    arch = load_model(args.model)
    names = [p.strip() for p in args.policy.split(",") if p.strip()]
    for n in names:
        if n not in ("neuscale", "base", "ideal") and not n.startswith("multipool:"):
            raise NeuScaleError(f"unknown policy {n!r}; known: neuscale, base, ideal, "
                                "multipool:K")
    quotas = _quota(args.quota)
    for c in quotas:
        cat.get(c)
    phase_chips = _chip_mix(args.chips)
    for cs in phase_chips.values():
        for c in cs or ():
            cat.get(c)
    if args.db:
        db = BestFitDB.load(args.db)
    else:
        from sim.cluster import verified_db
        db = verified_db(arch, args.metric, args.slo_scale, None, cat,
                         progress=None if not args.json else False)
    tr = load_trace(args.trace, hours=args.hours, start=args.start, rate_scale=args.rate_scale,
                    seed=args.seed)
    fo = tuple(c for c in args.failover_chips.split(",") if c.strip()) \
        if args.failover_chips else None
    pcfg = PolicyConfig(failover_chips=fo)
    cfg = ClusterConfig(policy=pcfg, accuracy=args.accuracy, quotas=quotas, seed=args.seed)
    out: dict = {"model": arch.name, "metric": db.meta["metric"], "trace": tr.summary(),
                 "trace_note": tr.note, "policies": {}}
    arr, inp, out_t = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens),
                       np.asarray(tr.output_tokens))
    timelines: dict[str, list] = {}
    minutes: dict[str, list] = {}
    per_request: dict[str, dict] = {}
    for name in names:
        if name == "ideal":
            extra: dict = {}
            rep = ideal_report(arch, db, arr, inp, out_t, cat, per_request=extra)
            per_request[name] = extra
        else:
            sim = ClusterSim(arch, db, make_policies(name, db, pcfg, inp, out_t, phase_chips),
                             cfg, cat)
            bar = None
            if sys.stderr.isatty() and not args.json:
                from tqdm import tqdm
                bar = tqdm(total=float(tr.duration_s), desc=f"{name} (simulated s)",
                           unit="s", file=sys.stderr, leave=False)
            last = [0.0]

            def progress(t: float) -> None:
                if bar is not None:
                    bar.update(max(0.0, min(t, tr.duration_s) - last[0]))
                    last[0] = min(t, tr.duration_s)
            rep = sim.run(arr, inp, out_t, progress=progress)
            if bar is not None:
                bar.close()
            timelines[name] = sim.timeline
            minutes[name] = sim.minutes
            a, i_, o_ = sim.requests
            per_request[name] = {"input": i_, "output": o_, "ttft_s": sim.ttft,
                                 "tpot_s": sim.tpot, **{f"{ph}_energy_j": e for ph, e in
                                                        sim.request_energy_j.items()}}
            if args.out:
                stem = name.replace(':', '-')
                _write_timeline(Path(args.out) / f"timeline_{stem}.csv", sim.timeline)
                _write_minutes(Path(args.out) / f"minutes_{stem}.csv", sim.minutes)
        out["policies"][name] = {ph: r.to_json() for ph, r in rep.items()}
    if "base" in out["policies"]:
        b = out["policies"]["base"]
        out["ratios_vs_base"] = {
            n: {ph: {k: (v[ph][k] / b[ph][k] if b[ph][k] else None)
                     for k in ("tokens_per_j", "tokens_per_usd", "slo_rate")}
                for ph in ("prefill", "decode")} for n, v in out["policies"].items()}
    if args.out:
        from sim.report import plot_report
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out["plots"] = [str(p) for p in plot_report(out, timelines, args.out, minutes=minutes,
                                                    per_request=per_request, db=db)]
        (Path(args.out) / "summary.json").write_text(json.dumps(out, indent=2,
                                                                default=_json_default))
    if args.json:
        _print_json(out)
        return 0
    s = out["trace"]
    print(f"{arch.name} on {args.trace}: {s['requests']:,} requests over "
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
    return 0


def _write_minutes(path: Path, rows: list[dict]) -> None:
    """Per minute and phase: a ``*`` row (ready vPods, energy used, requests finished, SLO
    rate) and one row per group (its ready vPods)."""
    import csv
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


def _write_timeline(path: Path, timeline: list[dict]) -> None:
    import csv
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["t_s", "phase", "group", "vpods_target"])
        for row in timeline:
            for g, n in sorted(row["target"].items()):
                w.writerow([f"{row['t_s']:.0f}", row["phase"], g, n])


# ---- dse verify -----------------------------------------------------------------------------

def cmd_dse_verify(args: argparse.Namespace) -> int:
    from dse.db import BestFitDB
    from dse.models import ModelArch
    from sim.validate import verify_db
    db = BestFitDB.load(args.db)
    arch = ModelArch(**db.meta["model_arch"])
    out = verify_db(db, arch, _catalog(args))
    out.save(args.out)
    alloc = lambda e: (e.topology, e.tp, e.pp, e.ep, e.max_batch)  # noqa: E731
    changed = sum(alloc(a) != alloc(b) for a, b in zip(db.entries, out.entries))
    ok_before = sum(e.meets_slo for e in db.entries if e.feasible)
    ok_after = sum(e.meets_slo for e in out.entries if e.feasible)
    res = {"db": args.out, "entries": len(out.entries), "changed": changed,
           "meets_slo_roofline": ok_before, "meets_slo_chip_model": ok_after}
    if args.json:
        _print_json(res)
    else:
        print(f"wrote {args.out}: {changed} of {len(out.entries)} best fits re-chosen on the chip "
              f"model; {ok_after} meet their SLO on it ({ok_before} did on the roofline)")
    return 0


# ---- sim step -------------------------------------------------------------------------------

def _allocation(cat, model: str, chip_name: str, num_chips: int | None, topology: str | None,
                tp: int, pp: int, ep: int):
    """(arch, chip, topology, parallelism) of an allocation named on the command line."""
    from dse.costmodel import Parallelism, validate_parallelism
    from dse.models import load_model
    from dse.vpod import ICITopology
    arch = load_model(model)
    chip = cat.get(chip_name)
    par = Parallelism(tp, pp, ep)
    validate_parallelism(arch, par)
    n = num_chips or par.chips
    if n != par.chips:
        raise NeuScaleError(f"--chips {n} does not equal tp*pp*ep = {par.chips}")
    topo = (ICITopology.parse(topology).for_chip(chip) if topology
            else _compact_topology(chip, n))
    if topo.num_chips != par.chips:
        raise NeuScaleError(f"{par} uses {par.chips} chips but topology {topo} has "
                            f"{topo.num_chips}")
    return arch, chip, topo, par


def _sim_allocation(cat, model: str, chip_name: str, num_chips: int | None, topology: str | None,
                    tp: int, pp: int, ep: int):
    from sim.chip import ChipModel
    return ChipModel(*_allocation(cat, model, chip_name, num_chips, topology, tp, pp, ep))


def cmd_sim_step(args: argparse.Namespace) -> int:
    cat = _catalog(args)
    if args.from_csv:
        return _sim_step_csv(args, cat)
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "chip", "tp", "phase", "batch",
                                                   "seq_len") if getattr(args, k) is None]
    if missing:
        raise NeuScaleError(f"sim step needs {', '.join(missing)} (or --from-csv IN --out OUT)")
    cm = _sim_allocation(cat, args.model, args.chip, args.chips, args.topology, args.tp,
                         args.pp, args.ep)
    r = cm.step(args.phase, args.batch, args.seq_len)
    out = {"model": cm.arch.name, "vpod": f"{cm.chip.name}:{cm.topo}", "tp": cm.par.tp,
           "pp": cm.par.pp, "ep": cm.par.ep, "phase": args.phase, "batch": args.batch,
           "seq_len": args.seq_len, **r.to_json(ops=args.ops),
           "memory_bytes_per_chip": r.hbm_bytes_per_chip,
           "fits": r.hbm_bytes_per_chip <= 0.9 * cm.chip.hbm_bytes}
    if args.json:
        _print_json(out)
        return 0
    what = "TTFT" if args.phase == "prefill" else "TPOT"
    print(f"{cm.arch.name} {args.phase} batch {args.batch} x {args.seq_len} on {out['vpod']} "
          f"tp={cm.par.tp} pp={cm.par.pp} ep={cm.par.ep}: {what} {r.latency_s * 1e3:.3f} ms, "
          f"{r.throughput_tok_per_s:,.0f} tok/s, {r.energy_j_per_token:.4g} J/token, "
          f"{r.bound}-bound" + ("" if out["fits"] else "  (does NOT fit in HBM)"))
    if args.ops:
        print(f"  {'operator':24} {'unit':4} {'count':>5} {'time us':>10} {'GFLOP':>9} "
              f"{'HBM MB':>9} {'ICI MB':>8}")
        for o in sorted(r.ops, key=lambda o: -o.time_s * o.count):
            print(f"  {o.name:24} {o.unit:4} {o.count:5d} {o.time_s * o.count * 1e6:10.1f} "
                  f"{(o.sa_flops + o.vu_flops) * o.count / 1e9:9.3f} "
                  f"{o.hbm_bytes * o.count / 1e6:9.2f} {o.ici_bytes * o.count / 1e6:8.2f}")
    return 0


CSV_IN = ["model", "chip", "num_chips", "tp", "pp", "ep", "phase", "batch", "seq_len"]


def _sim_step_csv(args: argparse.Namespace, cat) -> int:
    import csv
    if not args.out:
        raise NeuScaleError("--from-csv needs --out OUT.csv")
    try:
        fh = open(args.from_csv, newline="")
    except OSError as e:
        raise NeuScaleError(f"cannot read {args.from_csv!r}: {e.strerror}") from None
    with fh:
        rows = list(csv.DictReader(fh))
        if rows and set(CSV_IN) - set(rows[0]):
            raise NeuScaleError(f"{args.from_csv}: missing column(s) "
                                f"{sorted(set(CSV_IN) - set(rows[0]))}; need {','.join(CSV_IN)}")
    cols = CSV_IN + ["latency_s", "energy_j", "bound", "error"]
    n_err = 0
    with open(args.out, "w", newline="") as oh:
        w = csv.DictWriter(oh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            out = {k: row.get(k, "") for k in CSV_IN}
            try:
                ints = {k: int(row[k]) for k in ("num_chips", "tp", "pp", "ep", "batch",
                                                 "seq_len")}
                cm = _sim_allocation(cat, row["model"], row["chip"], ints["num_chips"], None,
                                     ints["tp"], ints["pp"], ints["ep"])
                r = cm.step(row["phase"].strip(), ints["batch"], ints["seq_len"])
                out.update(latency_s=f"{r.latency_s:.9g}", energy_j=f"{r.energy_j:.9g}",
                           bound=r.bound)
                if r.hbm_bytes_per_chip > 0.9 * cm.chip.hbm_bytes:
                    out["error"] = "does not fit in HBM"
            except (NeuScaleError, ValueError, KeyError, TypeError) as e:
                out["error"] = str(e).replace("\n", " ")
                n_err += 1
            w.writerow(out)
    msg = {"rows": len(rows), "errors": n_err, "out": args.out}
    _print_json(msg) if args.json else print(f"wrote {args.out}: {len(rows)} rows, {n_err} errors")
    return 0


# ---- parser ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orchestrator",
        description="NeuScale: serve LLMs on heterogeneous Cloud TPU pools (v4, v5e, v5p, v6e). "
                    "`dse` learns offline which vPod (chip x pod shape x parallelism x batch) "
                    "serves each sequence-length bucket best.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    dse = sub.add_parser("dse", help="offline best-fit vPod database (paper §3.3)",
                         description="Build and query the best-fit vPod database.")
    dsub = dse.add_subparsers(dest="dse_command", metavar="ACTION")
    dsub.required = True

    def common(sp: argparse.ArgumentParser, json_flag: bool = True) -> None:
        sp.add_argument("--chip-file", action="append", metavar="FILE",
                        help="add chips from a JSON/YAML file (ChipSpec fields); repeatable")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="machine-readable output")

    from dse.models import PRESETS
    from dse.xla_cost import default_workers
    b = dsub.add_parser("build", help="run the DSE and write the database",
                        description="Enumerate vPods x parallelism x batch for every sequence "
                                    "bucket and chip, cost them with XLA + roofline, and write "
                                    "the best-fit database (one file per model and metric).")
    b.add_argument("--model", required=True,
                   help=f"preset ({', '.join(PRESETS)}) or path to a Hugging Face config.json")
    b.add_argument("--chips", help="comma-separated chip versions (default: all in the catalog)")
    b.add_argument("--metric", choices=["energy", "cost"], default="energy",
                   help="optimise tokens per joule (energy) or per dollar (cost); default energy")
    b.add_argument("--slo-scale", type=_positive_float("--slo-scale"), default=5.0,
                   help="SLO = this x batch-1 latency on the smallest v5p/v6e vPod (default 5)")
    b.add_argument("--out", help="database path (default ./bestfit-MODEL-METRIC.json)")
    b.add_argument("--max-chips", type=_positive_int("--max-chips"), default=1024,
                   help="largest vPod considered, in chips (default 1024, paper §3.3)")
    b.add_argument("--workers", type=_positive_int("--workers"), default=default_workers(),
                   help="local processes lowering XLA graphs (default: CPU count, at most 4)")
    b.add_argument("--ray", metavar="ADDRESS",
                   help="lower on a Ray cluster at ADDRESS ('local' starts one); needs "
                        "pip install 'neuscale[ray]'")
    common(b)
    b.set_defaults(func=cmd_dse_build)

    q = dsub.add_parser("query", help="look up the best-fit vPod for a phase and length")
    q.add_argument("--db", required=True, help="database file from `dse build`")
    q.add_argument("--phase", required=True, choices=["prefill", "decode"])
    q.add_argument("--seq-len", required=True, type=_positive_int("--seq-len"),
                   help="prefill: input tokens; decode: input + output tokens")
    q.add_argument("--chip", help="restrict to one chip version (default: best across chips)")
    q.add_argument("--explain", action="store_true",
                   help="also show rejected candidates by reason and the Pareto front")
    common(q)
    q.set_defaults(func=cmd_dse_query)

    c = dsub.add_parser("cost", help="cost one allocation (FLOPs, bytes, latency, energy, $)")
    c.add_argument("--model", required=True, help="preset or path to config.json")
    c.add_argument("--chip", required=True, help="chip version (v4, v5e, v5p, v6e or alias)")
    c.add_argument("--tp", type=_positive_int("--tp"), required=True)
    c.add_argument("--pp", type=_positive_int("--pp"), default=1)
    c.add_argument("--ep", type=_positive_int("--ep"), default=1)
    c.add_argument("--topology", help="pod shape, e.g. 2x2x1 (default: most compact)")
    c.add_argument("--phase", required=True, choices=["prefill", "decode"])
    c.add_argument("--batch", required=True, type=_positive_int("--batch"))
    c.add_argument("--seq-len", required=True, type=_positive_int("--seq-len"),
                   help="prefill: input length; decode: KV length")
    common(c)
    c.set_defaults(func=cmd_dse_cost)

    s = dsub.add_parser("show", help="print the database as a table")
    s.add_argument("--db", required=True)
    common(s)
    s.set_defaults(func=cmd_dse_show)

    pl = dsub.add_parser("plot", help="write PNG plots (rooflines, Pareto fronts, best chip)")
    pl.add_argument("--db", required=True)
    pl.add_argument("--out", required=True, help="output directory")
    common(pl)
    pl.set_defaults(func=cmd_dse_plot)

    va = dsub.add_parser("validate", help="roofline vs chip model: correlation, Pareto coverage",
                         description="For every allocation of a bucket, the roofline prediction "
                                     "against the per-operator chip model (paper Figs. 9-11).")
    va.add_argument("--model", required=True, help="preset or path to config.json")
    va.add_argument("--phase", required=True, choices=["prefill", "decode"])
    va.add_argument("--seq-len", required=True, type=_positive_int("--seq-len"))
    va.add_argument("--metric", choices=["energy", "cost"], default="energy")
    va.add_argument("--chips", help="comma-separated chip versions (default: all)")
    va.add_argument("--max-candidates", type=_positive_int("--max-candidates"), default=3000,
                    help="simulate at most this many allocations (a seeded sample that always "
                         "holds the predicted Pareto front); default 3000")
    va.add_argument("--seed", type=int, default=0)
    va.add_argument("--slo-scale", type=_positive_float("--slo-scale"), default=5.0)
    va.add_argument("--allocation-accuracy", action="store_true",
                    help="also Fig. 11: per bucket, chip-model efficiency of the roofline's best "
                         "fit over the chip model's own best (all 48 buckets; minutes)")
    va.add_argument("--plot", metavar="DIR", help="write the Fig. 9/10 PNGs here")
    common(va)
    va.set_defaults(func=cmd_dse_validate)

    from sim.traces import PRESETS as TRACE_PRESETS
    sm = sub.add_parser("simulate", help="replay a trace through the autoscaler (paper §5)",
                        description="Trace-driven cluster simulation: the production policy and "
                                    "routing drive simulated engines; energy, dollars and SLO "
                                    "attainment per policy and phase. Trace presets: "
                                    + "; ".join(f"{k}: {v}" for k, v in TRACE_PRESETS.items()))
    sm.add_argument("--model", required=True)
    sm.add_argument("--trace", required=True, help="preset name or a trace file (CSV "
                    "arrival_s,input_tokens,output_tokens [.gz], Azure CSV, Mooncake JSONL)")
    sm.add_argument("--policy", default="neuscale,base,ideal",
                    help="comma-separated: neuscale, base, ideal, multipool:K "
                         "(default neuscale,base,ideal)")
    sm.add_argument("--db", help="best-fit database (default: built and verified on the chip "
                    "model on first use, then cached)")
    sm.add_argument("--hours", type=_positive_float("--hours"))
    sm.add_argument("--start", metavar="HH:MM")
    sm.add_argument("--rate-scale", type=_positive_float("--rate-scale"), default=1.0)
    sm.add_argument("--metric", choices=["energy", "cost"], default="energy")
    sm.add_argument("--chips", help="chip versions the cluster has: v5p,v6e (both phases), "
                    "prefill=v6e,decode=v5p (per phase) or 'expert' (that mix, §5.4); "
                    "default all. The SLOs stay those of the full database")
    sm.add_argument("--quota", help="chips per version, e.g. v5p=256,v6e=512")
    sm.add_argument("--failover-chips", help="chip versions fail-over may use (default: all)")
    sm.add_argument("--accuracy", type=_fraction("--accuracy"), default=0.6,
                    help="output-length prediction accuracy (default 0.6, §5.1)")
    sm.add_argument("--slo-scale", type=_positive_float("--slo-scale"), default=5.0)
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--out", metavar="DIR",
                    help="write summary.json, timelines (CSV) and plots (PNG) here")
    common(sm)
    sm.set_defaults(func=cmd_simulate)

    vf = dsub.add_parser("verify", help="re-check every best fit on the chip model",
                         description="Walk each Pareto front from the most efficient point down "
                                     "and keep the first allocation that meets the SLO on the "
                                     "chip model (paper §3.3: test a few Pareto-optimal "
                                     "allocations before deployment).")
    vf.add_argument("--db", required=True)
    vf.add_argument("--out", required=True, help="path of the verified database")
    common(vf)
    vf.set_defaults(func=cmd_dse_verify)

    sim = sub.add_parser("sim", help="the per-operator NPU chip model (paper §4)",
                         description="Simulate one step of a sharded LLM on a vPod, operator by "
                                     "operator (SA/VU/SRAM/HBM/ICI, energy per component).")
    ssub = sim.add_subparsers(dest="sim_command", metavar="ACTION")
    ssub.required = True
    st = ssub.add_parser("step", help="latency, energy and per-operator breakdown of one step",
                         description="One prefill batch (TTFT) or one decode iteration (TPOT) "
                                     "at KV length --seq-len; or a CSV of such rows.")
    st.add_argument("--model", help="preset or path to config.json")
    st.add_argument("--chip", help="chip version (v4, v5e, v5p, v6e or alias)")
    st.add_argument("--chips", type=_positive_int("--chips"), help="chips in the vPod "
                    "(default tp*pp*ep)")
    st.add_argument("--topology", help="pod shape, e.g. 2x2x1 (default: most compact)")
    st.add_argument("--tp", type=_positive_int("--tp"))
    st.add_argument("--pp", type=_positive_int("--pp"), default=1)
    st.add_argument("--ep", type=_positive_int("--ep"), default=1)
    st.add_argument("--phase", choices=["prefill", "decode"])
    st.add_argument("--batch", type=_positive_int("--batch"))
    st.add_argument("--seq-len", type=_positive_int("--seq-len"))
    st.add_argument("--ops", action="store_true", help="per-operator breakdown")
    st.add_argument("--from-csv", metavar="IN.csv",
                    help="rows model,chip,num_chips,tp,pp,ep,phase,batch,seq_len")
    st.add_argument("--out", metavar="OUT.csv", help="with --from-csv: results CSV")
    common(st)
    st.set_defaults(func=cmd_sim_step)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except NeuScaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
