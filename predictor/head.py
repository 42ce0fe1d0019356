"""The length head: a one-hidden-layer network in NumPy from prompt features to a distribution
over output-length buckets (the DB's bucket edges), trained on frozen encoder embeddings.

Bucket ``k`` holds output lengths in ``(edges[k-1], edges[k]]`` (bucket 0: ``[1, edges[0]]``).
The loss is the negative log-likelihood of what is known of each answer: its bucket, or — for a
*censored* answer (cut by a generation limit, so its length is a lower bound ``y``) — any bucket
at or above ``y``'s: ``-log sum_{k >= bucket(y)} p_k``. Censored rows thus push mass upward
instead of teaching the head that long answers end at the cap.

Training: Adam, mini-batches, L2 on the weights, early stopping on a validation split of the
training prompts (by prompt hash, never a test prompt); deterministic for a seed.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def bucket_of(edges: tuple[int, ...], tokens: int) -> int:
    return min(bisect_left(edges, max(1, int(tokens))), len(edges) - 1)


def target_masks(edges: tuple[int, ...], tokens: np.ndarray, censored: np.ndarray) -> np.ndarray:
    """(n, K) 0/1: the buckets each answer may be in."""
    K = len(edges)
    b = np.array([bucket_of(edges, t) for t in tokens], dtype=np.int64)
    ks = np.arange(K)[None, :]
    exact = ks == b[:, None]
    above = ks >= b[:, None]
    return np.where(np.asarray(censored, bool)[:, None], above, exact).astype(np.float32)


@dataclass
class Head:
    """Weights of the head; ``probs(x)`` is the forward pass (float32, no framework)."""
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray
    mu: np.ndarray          # feature standardisation
    sd: np.ndarray

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = np.maximum((x - self.mu) / self.sd @ self.w1 + self.b1, 0.0)
        return h @ self.w2 + self.b2

    def probs(self, x: np.ndarray) -> np.ndarray:
        z = self.logits(np.asarray(x, dtype=np.float32))
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": self.b2, "mu": self.mu,
                "sd": self.sd}

    @classmethod
    def from_arrays(cls, z) -> "Head":
        h = cls(**{k: np.asarray(z[k], dtype=np.float32) for k in
                   ("w1", "b1", "w2", "b2", "mu", "sd")})
        d, hid = h.w1.shape
        if h.b1.shape != (hid,) or h.w2.shape[0] != hid or h.b2.shape != (h.w2.shape[1],) \
                or h.mu.shape != (d,) or h.sd.shape != (d,):
            raise ValueError("inconsistent head shapes")
        if not all(np.isfinite(a).all() for a in h.arrays().values()):
            raise ValueError("non-finite weights")
        return h


def _nll(z: np.ndarray, m: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean loss and its gradient wrt the logits."""
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    p = e / e.sum(axis=1, keepdims=True)
    pm = p * m
    s = np.maximum(pm.sum(axis=1, keepdims=True), 1e-30)
    loss = float(-np.log(s).mean())
    return loss, (p - pm / s) / len(z)


def train_head(x: np.ndarray, masks: np.ndarray, x_val: np.ndarray | None = None,
               m_val: np.ndarray | None = None, *, hidden: int = 256, epochs: int = 60,
               lr: float = 1e-3, l2: float = 1e-4, batch: int = 256, seed: int = 0,
               patience: int = 8, progress: Callable[[int, float, float | None], None] | None
               = None) -> tuple[Head, list[dict]]:
    """Fit a head; returns it (the epoch with the lowest validation loss, when there is a
    validation set) and the per-epoch history."""
    rng = np.random.default_rng(seed)
    x = np.asarray(x, np.float32)
    n, d = x.shape
    K = masks.shape[1]
    mu = x.mean(axis=0).astype(np.float32)
    sd = np.maximum(x.std(axis=0), 1e-3).astype(np.float32)
    xs = (x - mu) / sd
    xv = None if x_val is None or not len(x_val) else (np.asarray(x_val, np.float32) - mu) / sd
    # the output bias starts at the (smoothed) bucket frequencies: the head begins as the
    # global prior and learns what the prompt adds
    freq = masks.sum(axis=0) / np.maximum(masks.sum(axis=1, keepdims=True), 1).sum() + 1e-4
    params = {
        "w1": (rng.standard_normal((d, hidden)) * math.sqrt(2.0 / d)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, K)) * math.sqrt(1.0 / hidden) * 0.1
               ).astype(np.float32),
        "b2": np.log(freq / freq.sum()).astype(np.float32),
    }
    mom = {k: np.zeros_like(v) for k, v in params.items()}
    vel = {k: np.zeros_like(v) for k, v in params.items()}
    t = 0
    best, best_loss, bad = None, math.inf, 0
    hist: list[dict] = []
    for ep in range(epochs):
        order = rng.permutation(n)
        tot = 0.0
        for s in range(0, n, batch):
            idx = order[s:s + batch]
            xb, mb = xs[idx], masks[idx]
            a = xb @ params["w1"] + params["b1"]
            h = np.maximum(a, 0.0)
            z = h @ params["w2"] + params["b2"]
            loss, gz = _nll(z, mb)
            tot += loss * len(idx)
            grads = {"w2": h.T @ gz + l2 * params["w2"], "b2": gz.sum(0)}
            gh = (gz @ params["w2"].T) * (a > 0)
            grads["w1"] = xb.T @ gh + l2 * params["w1"]
            grads["b1"] = gh.sum(0)
            t += 1
            for k, g in grads.items():
                mom[k] = 0.9 * mom[k] + 0.1 * g
                vel[k] = 0.999 * vel[k] + 0.001 * g * g
                mh = mom[k] / (1 - 0.9 ** t)
                vh = vel[k] / (1 - 0.999 ** t)
                params[k] -= (lr * mh / (np.sqrt(vh) + 1e-8)).astype(np.float32)
        train_loss = tot / n
        val_loss = None
        if xv is not None:
            zv = np.maximum(xv @ params["w1"] + params["b1"], 0.0) @ params["w2"] + params["b2"]
            val_loss = _nll(zv, m_val)[0]
        hist.append({"epoch": ep + 1, "train_nll": train_loss, "val_nll": val_loss})
        if progress:
            progress(ep + 1, train_loss, val_loss)
        score = val_loss if val_loss is not None else train_loss
        if score < best_loss - 1e-5:
            best_loss, bad = score, 0
            best = {k: v.copy() for k, v in params.items()}
        else:
            bad += 1
            if xv is not None and bad >= patience:
                break
    p = best if best is not None else params
    return Head(p["w1"], p["b1"], p["w2"], p["b2"], mu, sd), hist
