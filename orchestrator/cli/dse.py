"""``orchestrator dse ...``: the offline best-fit vPod database (paper §3.3) and the checks of
the roofline against the chip model (§4, Figs. 9-11).

    dse build | query | cost | show | plot | validate | verify
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dse.errors import NeuScaleError
from dse.parallel import ATTN_LAYOUTS

from .common import (add_common, add_stack, catalog, check_out_dir, check_out_file, chip_list,
                     number, positive_float, positive_int, print_json, workers)


def warn_if_no_slo_met(db) -> None:
    """A database in which no allocation meets its SLO is legal but almost surely not what was
    meant (an --slo-scale far below 1): say so."""
    if not any(e.meets_slo for e in db.entries if e.feasible):
        print(f"warning: no allocation meets its SLO at --slo-scale "
              f"{db.meta['slo_scale']:g} (the SLO is that multiple of a reference batch-1 "
              "latency); every bucket falls back to its fastest allocation", file=sys.stderr)


def cmd_dse_build(args: argparse.Namespace) -> int:
    from dse.builder import BuildOptions, build, default_db_path
    from dse.models import load_model
    arch = load_model(args.model)
    cat = catalog(args)
    out = check_out_file(args.out or default_db_path(arch.name, args.metric))
    opts = BuildOptions(metric=args.metric, slo_scale=args.slo_scale,
                        chips=chip_list(cat, args.chips, "--chips"),
                        workers=workers(args.workers), ray_address=args.ray,
                        max_chips=args.max_chips, progress=None if not args.json else False,
                        stack=args.stack)
    log = (lambda s: print(s, file=sys.stderr)) if not args.json else None
    db = build(arch, opts, catalog=cat, log=log)
    warn_if_no_slo_met(db)
    db.save(out)
    n = len(db.entries)
    if args.json:
        print_json({"db": str(out), "entries": n, "model": arch.name, "metric": args.metric,
                     "chips": db.chips, "build_seconds": db.meta["build_seconds"],
                     "fit_quality": db.meta["fit_quality"]})
    else:
        fq = db.meta["fit_quality"]
        print(f"wrote {out}: {n} entries ({len(db.edges)} buckets x 2 phases x "
              f"{len(db.chips)} chips), metric {args.metric}, {db.meta['build_seconds']:.1f}s; "
              f"XLA fits {fq['fits']}, held-out max rel. error {fq['heldout_max_rel_err']:.1e}, "
              f"vs analytic matmul count {fq['analytic_max_rel_diff']:.1%}")
    return 0


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
        print_json(out)
        return 0
    unit = db.meta["efficiency_unit"]
    print(f"{args.phase} {args.seq_len} tokens -> bucket <= {e.seq_len}: {e.chip}:{e.topology} "
          f"({e.accelerator_type}, {e.num_chips} chips) tp={e.tp} pp={e.pp} ep={e.ep} "
          + ("(attention TP over tp*ep) " if e.attn == "tp" else "")
          + f"max_batch={e.max_batch}")
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
                  + ("tpattn " if p["attn"] == "tp" else "")
                  + f"batch {p['batch']}: {p['latency_s'] * 1e3:.2f} ms, "
                  f"{p['efficiency']:.4g} {unit}")
    return 0


def cmd_dse_cost(args: argparse.Namespace) -> int:
    import numpy as np

    from dse.allocation import parse_allocation
    from dse.buckets import MAX_SEQ_LEN
    from dse.builder import DSE, Candidate
    from dse.costmodel import BOUNDS, infeasible_message
    from dse.vpod import VPodConfig
    from dse.xla_cost import components_for

    if args.seq_len > MAX_SEQ_LEN:
        raise NeuScaleError(f"--seq-len {args.seq_len} exceeds the largest bucket ({MAX_SEQ_LEN})")
    cat = catalog(args)
    arch, chip, topo, par = parse_allocation(cat, args.model, args.chip, None, args.topology,
                                             args.tp, args.pp, args.ep, args.attn)
    vpod = VPodConfig.make(chip, topo, cat)
    dse = DSE(arch, cat)
    dse.ensure_fits([par], workers=1, progress=None if not args.json else False)
    r = dse.evaluate(Candidate(chip, topo, par), args.phase, np.asarray([args.batch]),
                     np.asarray([args.seq_len]))
    fits = [dse.fits.fits[par.fit_key(c)] for c in components_for(arch, args.phase)]
    i = (0, 0)
    out = {
        "model": arch.name, "vpod": str(vpod), "accelerator_type": vpod.accelerator_type(cat),
        "num_chips": vpod.num_chips, "tp": par.tp, "pp": par.pp, "ep": par.ep, "attn": par.attn,
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
        print_json(out)
        return 0
    print(f"{arch.name} {args.phase} batch {args.batch} x {args.seq_len} tokens on {vpod} "
          f"({out['accelerator_type']}) {par}")
    print(f"  per chip: {out['flops'] / 1e12:.4g} TFLOP (XLA), {out['hbm_bytes'] / 1e9:.4g} GB HBM "
          f"(fused model; XLA unfused {out['xla_bytes_accessed_unfused'] / 1e9:.4g} GB), "
          f"{out['ici_bytes'] / 1e9:.4g} GB ICI")
    print(f"  latency {out['latency_s'] * 1e3:.3f} ms ({out['bound']}-bound), "
          f"{out['throughput_tok_per_s']:,.0f} tok/s, {out['energy_j']:.4g} J, "
          f"{out['cost_usd']:.4g} USD")
    if not r.feasible[i]:
        print(f"  does NOT fit: {out['infeasible_reason']}")
    return 0


def cmd_dse_show(args: argparse.Namespace) -> int:
    from dse.db import BestFitDB
    db = BestFitDB.load(args.db)
    m = db.meta
    if args.json:
        print_json({"meta": {k: m[k] for k in ("model", "metric", "slo_scale", "chips",
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
                  f"{e.tp:>3} {e.pp:>3} {str(e.ep) + ('t' if e.attn == 'tp' else ''):>3} "
                  f"{e.max_batch:>5} {e.latency_s * 1e3:9.2f} "
                  f"{e.slo_s * 1e3:9.2f} {'y' if e.meets_slo else 'N':2} {e.efficiency:10.4g} "
                  f"{e.bound:7} " + " ".join(per_chip))
    return 0


def cmd_dse_plot(args: argparse.Namespace) -> int:
    from dse.db import BestFitDB
    from dse.plot import plot_db
    out = check_out_dir(args.out)
    paths = plot_db(BestFitDB.load(args.db), out)
    if args.json:
        print_json({"plots": [str(p) for p in paths]})
    else:
        for p in paths:
            print(p)
    return 0


def cmd_dse_validate(args: argparse.Namespace) -> int:
    from dse.models import load_model
    from sim.validate import Validator, plot_validation
    if args.plot:
        check_out_dir(args.plot, "--plot")
    cat = catalog(args)
    v = Validator(load_model(args.model), cat, args.metric, chip_list(cat, args.chips, "--chips"),
                  stack=args.stack)
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
        print_json(out)
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


def cmd_dse_verify(args: argparse.Namespace) -> int:
    from dse.db import BestFitDB
    from dse.models import ModelArch
    from sim.validate import verify_db
    check_out_file(args.out)
    db = BestFitDB.load(args.db)
    arch = ModelArch(**db.meta["model_arch"])
    out = verify_db(db, arch, catalog(args))
    out.save(args.out)
    alloc = lambda e: (e.topology, e.tp, e.pp, e.ep, e.attn, e.max_batch)  # noqa: E731
    changed = sum(alloc(a) != alloc(b) for a, b in zip(db.entries, out.entries))
    ok_before = sum(e.meets_slo for e in db.entries if e.feasible)
    ok_after = sum(e.meets_slo for e in out.entries if e.feasible)
    points = [r[-1] for rows in out.pareto.values() for r in rows]
    res = {"db": args.out, "entries": len(out.entries), "changed": changed,
           "meets_slo_roofline": ok_before, "meets_slo_chip_model": ok_after,
           "pareto_points": len(points), "pareto_points_meet_slo_chip_model": sum(points)}
    if args.json:
        print_json(res)
    else:
        print(f"wrote {args.out}: {changed} of {len(out.entries)} best fits re-chosen on the chip "
              f"model; {ok_after} meet their SLO on it ({ok_before} did on the roofline); "
              f"{sum(points)} of {len(points)} Pareto points (what a load-aware policy may "
              "pick) meet their bucket's SLO on the chip model")
    return 0


def add_parser(sub) -> None:
    from dse.builder import BuildOptions
    from dse.models import PRESETS
    from dse.xla_cost import default_workers
    defaults = BuildOptions(workers=1)
    dse = sub.add_parser("dse", help="offline best-fit vPod database (paper §3.3)",
                         description="Build and query the best-fit vPod database.")
    dsub = dse.add_subparsers(dest="dse_command", metavar="ACTION")
    dsub.required = True

    b = dsub.add_parser("build", help="run the DSE and write the database",
                        description="Enumerate vPods x parallelism x batch for every sequence "
                                    "bucket and chip, cost them with XLA + roofline, and write "
                                    "the best-fit database (one file per model and metric).")
    b.add_argument("--model", required=True,
                   help=f"preset ({', '.join(PRESETS)}) or path to a Hugging Face config.json")
    b.add_argument("--chips", help="comma-separated chip versions (default: all in the catalog)")
    _metric_slo(b, defaults)
    b.add_argument("--out", help="database path (default ./bestfit-MODEL-METRIC.json)")
    b.add_argument("--max-chips", type=positive_int("--max-chips"), default=defaults.max_chips,
                   help=f"largest vPod considered, in chips (default {defaults.max_chips}, "
                        "paper §3.3)")
    b.add_argument("--workers", type=positive_int("--workers"), default=default_workers(),
                   help="local processes lowering XLA graphs (default: CPU count, at most 4)")
    b.add_argument("--ray", metavar="ADDRESS",
                   help="lower on a Ray cluster at ADDRESS ('local' starts one); needs "
                        "pip install 'neuscale[ray]'")
    add_stack(b)
    add_common(b)
    b.set_defaults(func=cmd_dse_build)

    q = dsub.add_parser("query", help="look up the best-fit vPod for a phase and length")
    q.add_argument("--db", required=True, help="database file from `dse build`")
    q.add_argument("--phase", required=True, choices=["prefill", "decode"])
    q.add_argument("--seq-len", required=True, type=positive_int("--seq-len"),
                   help="prefill: input tokens; decode: input + output tokens")
    q.add_argument("--chip", help="restrict to one chip version (default: best across chips)")
    q.add_argument("--explain", action="store_true",
                   help="also show rejected candidates by reason and the Pareto front")
    add_common(q)
    q.set_defaults(func=cmd_dse_query)

    c = dsub.add_parser("cost", help="cost one allocation (FLOPs, bytes, latency, energy, $)")
    c.add_argument("--model", required=True, help="preset or path to config.json")
    c.add_argument("--chip", required=True, help="chip version (v4, v5e, v5p, v6e or alias)")
    add_parallelism(c)
    c.add_argument("--phase", required=True, choices=["prefill", "decode"])
    c.add_argument("--batch", required=True, type=positive_int("--batch"))
    c.add_argument("--seq-len", required=True, type=positive_int("--seq-len"),
                   help="prefill: input length; decode: KV length")
    add_common(c)
    c.set_defaults(func=cmd_dse_cost)

    s = dsub.add_parser("show", help="print the database as a table")
    s.add_argument("--db", required=True)
    add_common(s)
    s.set_defaults(func=cmd_dse_show)

    pl = dsub.add_parser("plot", help="write PNG plots (rooflines, Pareto fronts, best chip)")
    pl.add_argument("--db", required=True)
    pl.add_argument("--out", required=True, help="output directory")
    add_common(pl)
    pl.set_defaults(func=cmd_dse_plot)

    _add_validate(dsub, defaults)

    vf = dsub.add_parser("verify", help="re-check every best fit on the chip model",
                         description="Walk each Pareto front from the most efficient point down "
                                     "and keep the first allocation that meets the SLO on the "
                                     "chip model (paper §3.3: test a few Pareto-optimal "
                                     "allocations before deployment).")
    vf.add_argument("--db", required=True)
    vf.add_argument("--out", required=True, help="path of the verified database")
    add_common(vf)
    vf.set_defaults(func=cmd_dse_verify)


def _metric_slo(p: argparse.ArgumentParser, defaults) -> None:
    p.add_argument("--metric", choices=["energy", "cost"], default=defaults.metric,
                   help="optimise tokens per joule (energy) or per dollar (cost); default "
                        f"{defaults.metric}")
    p.add_argument("--slo-scale", type=positive_float("--slo-scale"), default=defaults.slo_scale,
                   help=f"SLO = this x batch-1 latency on the smallest v5p/v6e vPod (default "
                        f"{defaults.slo_scale:g})")


def add_parallelism(p: argparse.ArgumentParser, required: bool = True) -> None:
    """--tp/--pp/--ep/--topology of one allocation (``dse cost``, ``sim step``)."""
    p.add_argument("--tp", type=positive_int("--tp"), required=required)
    p.add_argument("--pp", type=positive_int("--pp"), default=1)
    p.add_argument("--ep", type=positive_int("--ep"), default=1)
    p.add_argument("--attn", choices=list(ATTN_LAYOUTS), default="dp",
                   help="MoE stage layout: dp = attention data-parallel over the ep groups "
                        "(experts TP tp inside each), tp = attention tensor-parallel over tp*ep "
                        "chips with whole experts expert-parallel over them, hybrid = attention "
                        "as dp, experts as tp (what vLLM runs for --data-parallel-size ep "
                        "--enable-expert-parallel; default dp)")
    p.add_argument("--topology", help="pod shape, e.g. 2x2x1 (default: most compact)")


def _add_validate(dsub, defaults) -> None:
    va = dsub.add_parser("validate", help="roofline vs chip model: correlation, Pareto coverage",
                         description="For every allocation of a bucket, the roofline prediction "
                                     "against the per-operator chip model (paper Figs. 9-11).")
    va.add_argument("--model", required=True, help="preset or path to config.json")
    va.add_argument("--phase", required=True, choices=["prefill", "decode"])
    va.add_argument("--seq-len", required=True, type=positive_int("--seq-len"))
    va.add_argument("--chips", help="comma-separated chip versions (default: all)")
    va.add_argument("--max-candidates", type=positive_int("--max-candidates"), default=3000,
                    help="simulate at most this many allocations (a seeded sample that always "
                         "holds the predicted Pareto front); default 3000")
    va.add_argument("--seed", type=number("--seed", int, lo=0), default=0)
    _metric_slo(va, defaults)
    va.add_argument("--allocation-accuracy", action="store_true",
                    help="also Fig. 11: per bucket, chip-model efficiency of the roofline's best "
                         "fit over the chip model's own best (all 48 buckets; minutes)")
    va.add_argument("--plot", metavar="DIR", help="write the Fig. 9/10 PNGs here")
    add_stack(va)
    add_common(va)
    va.set_defaults(func=cmd_dse_validate)
