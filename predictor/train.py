"""Train and evaluate the length predictor (``orchestrator predictor train|eval``).

Training: embed every distinct prompt once (cached on disk per encoder), split the training
prompts again by hash into fit and validation (early stopping), blank the family feature on a
random 30 % of fitting rows (so the head also learns the prediction for an unknown serving
model), fit the head, then evaluate on the held-out test prompts and keep that evaluation —
confusion matrix included — in the manifest.

Evaluation (on answers that were not cut by a length cap; censored ones are reported apart):
bucket accuracy, accuracy within one bucket, MAE of the point estimate, Spearman's rank
correlation, a calibration table (the head's confidence in its bucket against how often it is
right), each against two baselines fitted on the same training rows — the global median and the
median per input-length bucket — overall and per source.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from dse.buckets import SEQ_BUCKETS

from .data import Pair, sha1, split
from .head import bucket_of, target_masks, train_head
from .model import LengthModel, features

BLANK_FAMILY = 0.3
CAL_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0001)


def _val(p: Pair) -> bool:
    return int(sha1(p.prompt_sha1)[:8], 16) % 10 == 0


def embed_pairs(enc, pairs: list[Pair], progress: bool = True) -> np.ndarray:
    from .encoder import EmbeddingCache
    cache = EmbeddingCache(enc)
    texts = [p.prompt for p in pairs]
    todo = cache.missing(texts)
    bar = None
    if progress and todo:
        from tqdm import tqdm
        bar = tqdm(total=todo, desc="encoding prompts", unit="prompt", leave=False)
    try:
        return cache.embed(texts, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()


def train_model(pairs: list[Pair], *, encoder=None, edges: tuple[int, ...] = SEQ_BUCKETS,
                epochs: int = 60, hidden: int = 128, seed: int = 0, test_percent: int = 20,
                progress: bool = True, sources: list[dict] | None = None
                ) -> tuple[LengthModel, dict[str, Any]]:
    from .encoder import Encoder
    enc = encoder or Encoder()
    train, test = split(pairs, test_percent)
    if not train:
        raise ValueError("every prompt fell in the test split: give more data")
    fit = [p for p in train if not _val(p)] or train
    val = [p for p in train if _val(p)]
    emb = embed_pairs(enc, fit + val + test, progress)
    e_fit, e_val, e_test = emb[:len(fit)], emb[len(fit):len(fit) + len(val)], \
        emb[len(fit) + len(val):]
    rng = np.random.default_rng(seed)
    fams = [None if rng.random() < BLANK_FAMILY else p.family for p in fit]
    x = features(e_fit, [p.prompt_tokens for p in fit], fams)
    m = target_masks(edges, np.array([p.output_tokens for p in fit]),
                     np.array([p.censored for p in fit]))
    xv = mv = None
    if val:
        xv = features(e_val, [p.prompt_tokens for p in val], [p.family for p in val])
        mv = target_masks(edges, np.array([p.output_tokens for p in val]),
                          np.array([p.censored for p in val]))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=epochs, desc="training the head", unit="epoch", leave=False)

    def tick(ep, tl, vl):
        if bar:
            bar.update(1)
            bar.set_postfix(train=f"{tl:.3f}", val="-" if vl is None else f"{vl:.3f}")

    try:
        head, hist = train_head(x, m, xv, mv, hidden=hidden, epochs=epochs, seed=seed,
                                progress=tick)
    finally:
        if bar:
            bar.close()
    med = np.full(len(edges), np.nan)
    by_b: dict[int, list[int]] = defaultdict(list)
    for p in fit + val:
        if not p.censored:
            by_b[bucket_of(edges, p.output_tokens)].append(p.output_tokens)
    for b, v in by_b.items():
        med[b] = float(np.median(v))
    model = LengthModel(head=head, edges=tuple(edges), encoder_name=enc.name,
                        max_tokens=enc.max_tokens, encoder=enc, bucket_median=med,
                        embed_dim=enc.dim)
    report = evaluate(model, test, train_pairs=train, emb=e_test) if test else {}
    model.manifest = {
        "trained_on": sources or [],
        "rows": {"fit": len(fit), "validation": len(val), "test": len(test)},
        "split": f"test: int(prompt_sha1[:8], 16) % 100 < {test_percent}",
        "epochs_run": len(hist), "hidden": hidden, "seed": seed,
        "history": hist[-3:],
        "eval": report,
    }
    return model, report


# ---- evaluation ------------------------------------------------------------------------------

def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) < 3:
        return float("nan")

    def rank(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        xs = x[order]
        i = 0
        while i < len(x):
            j = i
            while j + 1 < len(x) and xs[j + 1] == xs[i]:
                j += 1
            r[order[i:j + 1]] = (i + j) / 2.0
            i = j + 1
        return r

    ra, rb = rank(np.asarray(a, float)), rank(np.asarray(b, float))
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


class Baselines:
    """The two baselines, fitted on training answers (uncensored)."""

    def __init__(self, train: list[Pair], edges: tuple[int, ...]):
        outs = [p.output_tokens for p in train if not p.censored]
        self.edges = edges
        self.glob = int(np.median(outs)) if outs else 128
        per: dict[int, list[int]] = defaultdict(list)
        for p in train:
            if not p.censored:
                per[bucket_of(edges, p.prompt_tokens)].append(p.output_tokens)
        self.per = {b: int(np.median(v)) for b, v in per.items() if len(v) >= 5}

    def global_median(self, p: Pair) -> int:
        return self.glob

    def input_median(self, p: Pair) -> int:
        return self.per.get(bucket_of(self.edges, p.prompt_tokens), self.glob)


def _scores(edges, true: np.ndarray, point: np.ndarray, pred_b: np.ndarray) -> dict:
    tb = np.array([bucket_of(edges, t) for t in true])
    return {"n": int(len(true)),
            "bucket_accuracy": float(np.mean(pred_b == tb)) if len(true) else float("nan"),
            "within_1_bucket": float(np.mean(np.abs(pred_b - tb) <= 1)) if len(true)
            else float("nan"),
            "mae_tokens": float(np.mean(np.abs(point - true))) if len(true) else float("nan"),
            "spearman": _spearman(point, true)}


def evaluate(model: LengthModel, pairs: list[Pair], *, train_pairs: list[Pair] | None = None,
             emb: np.ndarray | None = None, progress: bool = False) -> dict[str, Any]:
    """Scores on ``pairs`` (held out), against the baselines fitted on ``train_pairs`` (default:
    the same rows, which flatters the baselines, never the model)."""
    edges = model.edges
    if emb is None:
        emb = embed_pairs(model.encoder, pairs, progress)
    base = Baselines(train_pairs if train_pairs else pairs, edges)
    res: dict[str, Any] = {}
    for cond in ("family", "no_family"):
        fams = [p.family for p in pairs] if cond == "family" else [None] * len(pairs)
        probs = model.distribution_from_emb(emb, [p.prompt_tokens for p in pairs], fams)
        res[cond] = probs
    probs = res["family"]
    unc = np.array([not p.censored for p in pairs])
    true = np.array([p.output_tokens for p in pairs], float)
    pred_b = probs.argmax(axis=1)
    point = np.array([model.point(q) for q in probs], float)
    pred_b_nf = res["no_family"].argmax(axis=1)
    point_nf = np.array([model.point(q) for q in res["no_family"]], float)
    gm = np.array([base.global_median(p) for p in pairs], float)
    im = np.array([base.input_median(p) for p in pairs], float)
    srcs = sorted({p.source for p in pairs})
    out: dict[str, Any] = {"edges_used": int(max(pred_b.max(initial=0),
                                                 max((bucket_of(edges, t) for t in true),
                                                     default=0))) + 1}

    def block(sel: np.ndarray) -> dict:
        sel = sel & unc
        b = {"model": _scores(edges, true[sel], point[sel], pred_b[sel]),
             "model_no_family": _scores(edges, true[sel], point_nf[sel], pred_b_nf[sel]),
             "global_median": _scores(edges, true[sel], gm[sel],
                                      np.array([bucket_of(edges, x) for x in gm[sel]])),
             "input_median": _scores(edges, true[sel], im[sel],
                                     np.array([bucket_of(edges, x) for x in im[sel]]))}
        return b

    out["all"] = block(np.ones(len(pairs), bool))
    out["per_source"] = {s: block(np.array([p.source == s for p in pairs])) for s in srcs}
    cens = ~unc
    out["censored"] = {"n": int(cens.sum()),
                       "point_at_or_above_cap": float(np.mean(point[cens] >= true[cens]))
                       if cens.any() else None}
    conf = probs.max(axis=1)
    tb = np.array([bucket_of(edges, t) for t in true])
    cal = []
    for lo, hi in zip(CAL_BINS, CAL_BINS[1:]):
        s = unc & (conf >= lo) & (conf < hi)
        cal.append({"confidence": f"{lo:.1f}-{min(hi, 1.0):.1f}", "n": int(s.sum()),
                    "mean_confidence": float(conf[s].mean()) if s.any() else None,
                    "accuracy": float(np.mean(pred_b[s] == tb[s])) if s.any() else None})
    out["calibration"] = cal
    K = len(edges)
    mat = np.zeros((K, K), dtype=np.int64)
    for t, p_ in zip(tb[unc], pred_b[unc]):
        mat[t, p_] += 1
    out["confusion"] = {"rows": "true output bucket", "cols": "predicted bucket",
                        "nonzero": [[int(i), int(j), int(mat[i, j])]
                                    for i, j in zip(*np.nonzero(mat))]}
    return out


def confusion_matrix(report: dict, K: int) -> np.ndarray:
    mat = np.zeros((K, K), dtype=np.int64)
    for i, j, c in report.get("confusion", {}).get("nonzero", []):
        if 0 <= i < K and 0 <= j < K:
            mat[i, j] += int(c)
    return mat


def format_report(rep: dict) -> str:
    lines = []

    def row(name, s):
        acc = s["bucket_accuracy"]
        return (f"| {name} | {s['n']:,} | {acc:.1%} | {s['within_1_bucket']:.1%} | "
                f"{s['mae_tokens']:,.0f} | {s['spearman']:.3f} |"
                if s["n"] and not math.isnan(acc) else f"| {name} | 0 | - | - | - | - |")

    for title, blk in [("all", rep["all"])] + [(f"source {k}", v)
                                              for k, v in rep.get("per_source", {}).items()]:
        lines.append(f"\n{title}:\n")
        lines.append("| predictor | rows | bucket accuracy | within ±1 bucket | MAE (tokens) "
                     "| Spearman |")
        lines.append("|---|---|---|---|---|---|")
        for k, name in (("model", "BERT head (family known)"),
                        ("model_no_family", "BERT head (family unknown)"),
                        ("global_median", "global median"),
                        ("input_median", "per-input-length median")):
            lines.append(row(name, blk[k]))
    c = rep.get("censored", {})
    if c.get("n"):
        lines.append(f"\ncensored answers (cut by a length cap): {c['n']:,}; point estimate at "
                     f"or above the cap for {c['point_at_or_above_cap']:.1%}")
    lines.append("\ncalibration (confidence in the predicted bucket):\n")
    lines.append("| confidence | rows | mean confidence | accuracy |")
    lines.append("|---|---|---|---|")
    for r in rep.get("calibration", []):
        if r["n"]:
            lines.append(f"| {r['confidence']} | {r['n']:,} | {r['mean_confidence']:.2f} | "
                         f"{r['accuracy']:.1%} |")
    return "\n".join(lines)
