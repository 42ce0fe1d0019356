"""``orchestrator sim ...``: the per-operator NPU chip model (paper §4), one step at a time.

    sim step --model M --chip C --tp T ... | --from-csv IN --out OUT
"""

from __future__ import annotations

import argparse

from dse.costmodel import HBM_USABLE_FRACTION
from dse.errors import NeuScaleError

from .common import add_common, catalog, check_out_file, positive_int, print_json
from .dse import add_parallelism


def _chip_model(cat, model: str, chip: str, num_chips: int | None, topology: str | None,
                tp: int, pp: int, ep: int):
    from dse.allocation import parse_allocation
    from sim.chip import ChipModel
    return ChipModel(*parse_allocation(cat, model, chip, num_chips, topology, tp, pp, ep))


def cmd_sim_step(args: argparse.Namespace) -> int:
    cat = catalog(args)
    if args.from_csv:
        return _sim_step_csv(args, cat)
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "chip", "tp", "phase", "batch",
                                                   "seq_len") if getattr(args, k) is None]
    if missing:
        raise NeuScaleError(f"sim step needs {', '.join(missing)} (or --from-csv IN --out OUT)")
    cm = _chip_model(cat, args.model, args.chip, args.num_chips, args.topology, args.tp,
                     args.pp, args.ep)
    r = cm.step(args.phase, args.batch, args.seq_len)
    out = {"model": cm.arch.name, "vpod": f"{cm.chip.name}:{cm.topo}", "tp": cm.par.tp,
           "pp": cm.par.pp, "ep": cm.par.ep, "phase": args.phase, "batch": args.batch,
           "seq_len": args.seq_len, **r.to_json(ops=args.ops),
           "memory_bytes_per_chip": r.hbm_bytes_per_chip,
           "fits": r.hbm_bytes_per_chip <= HBM_USABLE_FRACTION * cm.chip.hbm_bytes}
    if args.json:
        print_json(out)
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
    check_out_file(args.out)
    try:
        with open(args.from_csv, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as e:
        raise NeuScaleError(f"cannot read {args.from_csv!r}: {e.strerror}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise NeuScaleError(f"{args.from_csv!r} is not a UTF-8 CSV file ({e})") from None
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
                cm = _chip_model(cat, row["model"], row["chip"], ints["num_chips"], None,
                                 ints["tp"], ints["pp"], ints["ep"])
                r = cm.step(row["phase"].strip(), ints["batch"], ints["seq_len"])
                out.update(latency_s=f"{r.latency_s:.9g}", energy_j=f"{r.energy_j:.9g}",
                           bound=r.bound)
                if r.hbm_bytes_per_chip > HBM_USABLE_FRACTION * cm.chip.hbm_bytes:
                    out["error"] = "does not fit in HBM"
            except (NeuScaleError, ValueError, KeyError, TypeError) as e:
                out["error"] = str(e).replace("\n", " ")
                n_err += 1
            w.writerow(out)
    msg = {"rows": len(rows), "errors": n_err, "out": args.out}
    print_json(msg) if args.json else print(f"wrote {args.out}: {len(rows)} rows, {n_err} errors")
    return 0


def add_parser(sub) -> None:
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
    st.add_argument("--num-chips", type=positive_int("--num-chips"), help="chips in the vPod "
                    "(default tp*pp*ep)")
    add_parallelism(st, required=False)
    st.add_argument("--phase", choices=["prefill", "decode"])
    st.add_argument("--batch", type=positive_int("--batch"))
    st.add_argument("--seq-len", type=positive_int("--seq-len"))
    st.add_argument("--ops", action="store_true", help="per-operator breakdown")
    st.add_argument("--from-csv", metavar="IN.csv",
                    help="rows model,chip,num_chips,tp,pp,ep,phase,batch,seq_len")
    st.add_argument("--out", metavar="OUT.csv", help="with --from-csv: results CSV")
    add_common(st)
    st.set_defaults(func=cmd_sim_step)
