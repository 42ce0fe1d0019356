"""``orchestrator sim ...``: the per-operator NPU chip model (paper §4), one step at a time.

    sim step --model M --chip C --tp T ... | --from-csv IN --out OUT
    sim bench --model M --chip C --tp T --workload closed:16 ... | --from-csv IN --out OUT
"""

from __future__ import annotations

import argparse

from dse.costmodel import HBM_USABLE_FRACTION
from dse.errors import NeuScaleError

from .common import (add_common, add_stack, catalog, check_out_file, number, positive_int,
                     print_json, progress_bar)
from .dse import add_parallelism


def _chip_model(cat, model: str, chip: str, num_chips: int | None, topology: str | None,
                tp: int, pp: int, ep: int, stack: str | None = None, attn: str = "dp"):
    from dse.allocation import parse_allocation
    from sim.chip import ChipModel
    return ChipModel(*parse_allocation(cat, model, chip, num_chips, topology, tp, pp, ep, attn),
                     stack)


def cmd_sim_step(args: argparse.Namespace) -> int:
    cat = catalog(args)
    if args.from_csv:
        return _sim_step_csv(args, cat)
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "chip", "tp", "phase", "batch",
                                                   "seq_len") if getattr(args, k) is None]
    if missing:
        raise NeuScaleError(f"sim step needs {', '.join(missing)} (or --from-csv IN --out OUT)")
    cm = _chip_model(cat, args.model, args.chip, args.num_chips, args.topology, args.tp,
                     args.pp, args.ep, args.stack, args.attn)
    r = cm.step(args.phase, args.batch, args.seq_len)
    out = {"model": cm.arch.name, "vpod": f"{cm.chip.name}:{cm.topo}", "tp": cm.par.tp,
           "pp": cm.par.pp, "ep": cm.par.ep, "attn": cm.par.attn, "phase": args.phase,
           "batch": args.batch,
           "seq_len": args.seq_len, **r.to_json(ops=args.ops),
           "memory_bytes_per_chip": r.hbm_bytes_per_chip,
           "fits": r.hbm_bytes_per_chip <= HBM_USABLE_FRACTION * cm.chip.hbm_bytes}
    if args.json:
        print_json(out)
        return 0
    what = "TTFT" if args.phase == "prefill" else "TPOT"
    print(f"{cm.arch.name} {args.phase} batch {args.batch} x {args.seq_len} on {out['vpod']} "
          f"{cm.par}: {what} {r.latency_s * 1e3:.3f} ms, "
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


def _read_csv(args: argparse.Namespace) -> tuple[list[dict[str, str]], list[str]]:
    """``--from-csv`` rows and columns (``--out`` checked first); one error line on a bad file."""
    import csv
    if not args.out:
        raise NeuScaleError("--from-csv needs --out OUT.csv")
    check_out_file(args.out)
    try:
        with open(args.from_csv, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            return rows, list(reader.fieldnames or [])
    except OSError as e:
        raise NeuScaleError(f"cannot read {args.from_csv!r}: {e.strerror}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise NeuScaleError(f"{args.from_csv!r} is not a UTF-8 CSV file ({e})") from None


def _sim_step_csv(args: argparse.Namespace, cat) -> int:
    import csv
    rows, _ = _read_csv(args)
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
                                 ints["tp"], ints["pp"], ints["ep"], args.stack,
                                 (row.get("attn") or "dp").strip())
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
    add_stack(st, what="the serving stack whose host time the step pays")
    add_common(st)
    st.set_defaults(func=cmd_sim_step)
    add_bench_parser(ssub)


# ---- sim bench ----------------------------------------------------------------------------------

BENCH_IN = ["model", "chip", "topology", "tp", "pp", "ep", "stack", "max_num_seqs",
            "max_batched_tokens", "workload", "requests", "input_tokens", "output_tokens"]
# how the bench's summary line names a MoE layout (the "dp" one goes unsaid)
LAYOUT_NOTE = {"tp": " (attention TP over tp*ep)", "hybrid": " (DP attention, experts over tp*ep)"}
BENCH_OPTIONAL = ["num_chips", "chunked_prefill", "trace", "seed", "attn"]


def cmd_sim_bench(args: argparse.Namespace) -> int:
    from sim.bench import bench_config, run
    cat = catalog(args)
    if args.from_csv:
        return _sim_bench_csv(args, cat)
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "chip", "tp")
               if getattr(args, k) is None]
    if missing:
        raise NeuScaleError(f"sim bench needs {', '.join(missing)} (or --from-csv IN --out OUT)")
    vals = {"model": args.model, "chip": args.chip, "tp": args.tp, "topology": args.topology,
            "num_chips": args.num_chips, "pp": args.pp, "ep": args.ep, "attn": args.attn,
            "stack": args.stack,
            "max_num_seqs": args.max_num_seqs, "max_batched_tokens": args.max_batched_tokens,
            "chunked_prefill": "false" if args.no_chunked_prefill else "true",
            "workload": args.workload, "requests": args.requests,
            "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
            "trace": args.trace, "seed": args.seed}
    r = run(bench_config(vals.get), cat)
    if args.json:
        print_json(r)
        return 0

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.2f} ms"
    print(f"{r['model']} on {r['chip']}:{r['topology']} tp={r['tp']} pp={r['pp']} ep={r['ep']}"
          + LAYOUT_NOTE.get(r["attn"], "") + ", "
          f"stack {r['stack']}, max_num_seqs {r['max_num_seqs']}, max_batched_tokens "
          f"{r['max_batched_tokens']}{'' if r['chunked_prefill'] else ', no chunked prefill'}")
    print(f"workload {r['workload']}, {r['requests']} requests, input {r['input_tokens']}, "
          f"output {r['output_tokens']} tokens: makespan {r['makespan_s']:.2f} s")
    print(f"  throughput  {r['req_per_s']:.3f} req/s, {r['output_tok_per_s']:,.0f} output tok/s, "
          f"{r['total_tok_per_s']:,.0f} total tok/s")
    print(f"  TTFT        mean {ms(r['ttft_mean_s'])}, p50 {ms(r['ttft_p50_s'])}, "
          f"p99 {ms(r['ttft_p99_s'])}")
    print(f"  TPOT        mean {ms(r['tpot_mean_s'])}, p50 {ms(r['tpot_p50_s'])}, "
          f"p99 {ms(r['tpot_p99_s'])}")
    print(f"  cost        {r['j_per_token']:.4g} J/output token, "
          f"${r['usd_per_mtoken']:.4g}/M output tokens"
          + (f"; {r['preemptions']} preemptions" if r["preemptions"] else ""))
    return 0


def _sim_bench_csv(args: argparse.Namespace, cat) -> int:
    import csv

    from sim.bench import RESULT_COLUMNS, bench_config, run
    rows, cols = _read_csv(args)
    need = {"model", "chip", "tp"}
    if not cols or need - set(cols):
        raise NeuScaleError(f"{args.from_csv}: missing column(s) {sorted(need - set(cols))}; "
                            f"columns: {','.join(BENCH_IN)} (optional: "
                            f"{','.join(BENCH_OPTIONAL)}; others are copied through)")
    out_cols = cols + [c for c in RESULT_COLUMNS + ["error"] if c not in cols]
    n_err = 0
    bar = progress_bar(not args.json and len(rows) > 1, len(rows), "sim bench", "row")
    with open(args.out, "w", newline="") as oh:
        w = csv.DictWriter(oh, fieldnames=out_cols, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            out = {k: row.get(k, "") for k in cols}
            out.update({k: "" for k in RESULT_COLUMNS}, error="")
            try:
                r = run(bench_config(row.get), cat)
                out.update({k: "" if r[k] is None else f"{r[k]:.6g}" for k in RESULT_COLUMNS})
            except (NeuScaleError, ValueError, KeyError, TypeError, OverflowError) as e:
                out["error"] = str(e).replace("\n", " ")
                n_err += 1
            w.writerow(out)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    msg = {"rows": len(rows), "errors": n_err, "out": args.out}
    print_json(msg) if args.json else print(f"wrote {args.out}: {len(rows)} rows, {n_err} errors")
    return 0


def add_bench_parser(ssub) -> None:
    from dse.stacks import DEFAULT_STACK
    bp = ssub.add_parser(
        "bench", help="throughput, TTFT and TPOT of a workload on one allocation",
        description="Run a workload on the simulated engine of one allocation (chip model "
                    "step costs + a serving-stack profile + the engine's limits) and report "
                    "request/s, output and total tokens/s, TTFT and TPOT (mean, p50, p99), "
                    "J and $ per output token. Workloads: burst (all requests at t=0), "
                    "closed:C (C clients, each sending its next request when its answer is "
                    "complete), poisson:R (R requests/s). Or a CSV of such rows: columns "
                    + ",".join(BENCH_IN) + " (optional " + ",".join(BENCH_OPTIONAL)
                    + "; other columns are copied through; a bad row gets an error entry).")
    bp.add_argument("--model", help="preset or path to config.json")
    bp.add_argument("--chip", help="chip version (v4, v5e, v5p, v6e or alias)")
    bp.add_argument("--num-chips", type=positive_int("--num-chips"),
                    help="chips in the vPod (default tp*pp*ep)")
    add_parallelism(bp, required=False)
    add_stack(bp, default=DEFAULT_STACK, what="the serving stack the engine runs")
    bp.add_argument("--max-num-seqs", type=positive_int("--max-num-seqs"), default=256,
                    help="sequences per step, as vLLM's --max-num-seqs (default 256)")
    bp.add_argument("--max-batched-tokens", type=positive_int("--max-batched-tokens"),
                    default=8192, help="tokens per step, as vLLM's --max-num-batched-tokens "
                    "(default 8192)")
    bp.add_argument("--no-chunked-prefill", action="store_true",
                    help="prefill whole prompts in prefill-only steps (vLLM without chunked "
                         "prefill, JetStream's interleaving)")
    bp.add_argument("--workload", default="burst",
                    help="burst | closed:C | poisson:R (default burst)")
    bp.add_argument("--requests", type=positive_int("--requests"), default=100,
                    help="requests to send (default 100)")
    bp.add_argument("--input-tokens", default="1024",
                    help="prompt length: N or A-B (integers uniform in [A, B]); default 1024")
    bp.add_argument("--output-tokens", default="128",
                    help="answer length: N or A-B; default 128")
    bp.add_argument("--trace", help="draw (input, output) pairs from this trace (preset or "
                                    "file) instead of --input-tokens/--output-tokens")
    bp.add_argument("--seed", type=number("--seed", int, lo=0), default=0)
    bp.add_argument("--from-csv", metavar="IN.csv", help="one bench per row (see above)")
    bp.add_argument("--out", metavar="OUT.csv", help="with --from-csv: results CSV")
    add_common(bp)
    bp.set_defaults(func=cmd_sim_bench)
