"""Fast step-cost model: the chip model tabulated once, evaluated vectorised in microseconds.

A simulated engine asks for the cost of a step millions of times. The detailed model
(:class:`sim.chip.ChipModel`) costs ~0.3 ms a call; this table answers a whole numpy array of
steps in one call. It is exact in structure, approximate only by interpolation: every operator of
the detailed model depends on one group of step variables (:func:`sim.chip.category`), so

    latency = tok(t) + prefill_attn(p, ctx/p) + decode_attn(n, kv/n) + head(n_logits) + overhead

with ``t = p + n`` tokens on the busiest chip, each term tabulated on a log grid (1-D for tok and
head, 2-D for the attention terms) and interpolated linearly in log-log space; dynamic energy the
same way, static power x latency on top. :meth:`StepCostTable.fit_error` reports the error
against the detailed model on random mixed steps.

The table implements the engine's step-cost protocol (:class:`sim.engine.StepCost`):
``step(prefill_tokens, prefill_ctx, n_decode, decode_kv) -> (latency_s, energy_j)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .chip import ChipModel
from .hardware import STEP_OVERHEAD_S

# PCIe 4.0 x16 between HBM and host memory: 24 GB/s per chip (paper Table 3, weight loading)
HOST_BW_BYTES_PER_S_PER_CHIP = 24e9


def _grid(lo: float, hi: float, per_octave: int = 4) -> np.ndarray:
    """Log-spaced points plus the small integers (where ceil() effects are sharpest)."""
    n = int(math.ceil(math.log2(hi / lo) * per_octave)) + 1
    return np.unique(np.concatenate([np.geomspace(lo, hi, n), np.arange(1, 17)]))


def _interp1(grid: np.ndarray, table: np.ndarray, x: np.ndarray) -> np.ndarray:
    lx = np.log(np.clip(x, grid[0], grid[-1]))
    return np.exp(np.interp(lx, np.log(grid), np.log(table)))


def _interp2(gx: np.ndarray, gy: np.ndarray, table: np.ndarray, x, y) -> np.ndarray:
    lgx, lgy = np.log(gx), np.log(gy)
    lx = np.log(np.clip(x, gx[0], gx[-1]))
    ly = np.log(np.clip(y, gy[0], gy[-1]))
    i = np.clip(np.searchsorted(lgx, lx) - 1, 0, len(gx) - 2)
    j = np.clip(np.searchsorted(lgy, ly) - 1, 0, len(gy) - 2)
    fx = (lx - lgx[i]) / (lgx[i + 1] - lgx[i])
    fy = (ly - lgy[j]) / (lgy[j + 1] - lgy[j])
    lt = np.log(table)
    v = ((1 - fx) * (1 - fy) * lt[i, j] + fx * (1 - fy) * lt[i + 1, j]
         + (1 - fx) * fy * lt[i, j + 1] + fx * fy * lt[i + 1, j + 1])
    return np.exp(v)


_TINY = 1e-30   # tables hold log values: a zero cost becomes a negligible positive one


@dataclass
class StepCostTable:
    """Tabulated step cost of one allocation (engine step-cost protocol)."""

    model: ChipModel
    max_tokens: int = 1 << 17
    max_seqs: int = 2048
    max_kv_per_seq: int = 1 << 20

    def __post_init__(self) -> None:
        cm = self.model
        ep = cm.par.ep
        self.num_chips = cm.par.chips
        self.static_power_w = cm.hw.static_power_w
        self.kv_capacity_tokens = cm.kv_capacity_tokens()
        self.kv_bytes_per_token = cm.arch.kv_bytes_per_token()
        self.host_bw_bytes_per_s = HOST_BW_BYTES_PER_S_PER_CHIP * cm.par.chips
        # prefill tokens are shared by the EP data-parallel groups: a chip may see 1/ep of one
        self.g_tok = _grid(1.0 / ep, self.max_tokens)
        self.g_seq = _grid(1, self.max_seqs)
        self.g_ctx = _grid(1, self.max_kv_per_seq, 2)

        def part(name, **kw):
            v = cm.parts_local(**{"p_loc": 0.0, "c_loc": 0.0, "nd_loc": 0.0, "kv_loc": 0.0,
                                  "logits": 0.0, "stage_tokens": 0.0, **kw})[name]
            return max(v[0], _TINY), max(v[1], _TINY)

        tok = [part("tok", nd_loc=t, stage_tokens=t * ep) for t in self.g_tok]
        head = [part("head", logits=n) for n in self.g_seq]
        pre = [[part("prefill_attn", p_loc=p, c_loc=p * c) for c in self.g_ctx]
               for p in self.g_tok]
        dec = [[part("decode_attn", nd_loc=n, kv_loc=n * L) for L in self.g_ctx]
               for n in self.g_seq]
        self.t_tok, self.e_tok = (np.array(x) for x in zip(*tok))
        self.t_head, self.e_head = (np.array(x) for x in zip(*head))
        self.t_pre = np.array([[x[0] for x in row] for row in pre])
        self.e_pre = np.array([[x[1] for x in row] for row in pre])
        self.t_dec = np.array([[x[0] for x in row] for row in dec])
        self.e_dec = np.array([[x[1] for x in row] for row in dec])

    def _local(self, prefill_tokens, prefill_ctx, n_decode, decode_kv):
        ep = self.model.par.ep
        p = np.asarray(prefill_tokens, dtype=np.float64) / ep
        ctx = np.asarray(prefill_ctx, dtype=np.float64) / ep
        nd_glob = np.asarray(n_decode, dtype=np.float64)
        nd = np.ceil(nd_glob / ep)
        kv = np.where(nd_glob > 0, np.asarray(decode_kv, dtype=np.float64) * nd
                      / np.maximum(nd_glob, 1), 0.0)
        logits = np.ceil((nd_glob + (p > 0)) / ep)
        return p, ctx, nd, kv, logits

    def step(self, prefill_tokens, prefill_ctx, n_decode, decode_kv):
        """Latency (s) and energy (J, whole vPod) of engine steps, vectorised."""
        p, ctx, nd, kv, logits = self._local(prefill_tokens, prefill_ctx, n_decode, decode_kv)
        t = p + nd
        has_p, has_d = p > 0, nd > 0
        per_p = np.where(has_p, ctx / np.maximum(p, 1e-9), 1.0)
        per_d = np.where(has_d, kv / np.maximum(nd, 1e-9), 1.0)
        lat = np.where(t > 0, _interp1(self.g_tok, self.t_tok, t), 0.0)
        dyn = np.where(t > 0, _interp1(self.g_tok, self.e_tok, t), 0.0)
        lat = lat + np.where(logits > 0, _interp1(self.g_seq, self.t_head, np.maximum(logits, 1)),
                             0.0)
        dyn = dyn + np.where(logits > 0, _interp1(self.g_seq, self.e_head,
                                                  np.maximum(logits, 1)), 0.0)
        lat = lat + np.where(has_p, _interp2(self.g_tok, self.g_ctx, self.t_pre, p, per_p), 0.0)
        dyn = dyn + np.where(has_p, _interp2(self.g_tok, self.g_ctx, self.e_pre, p, per_p), 0.0)
        lat = lat + np.where(has_d, _interp2(self.g_seq, self.g_ctx, self.t_dec, nd, per_d), 0.0)
        dyn = dyn + np.where(has_d, _interp2(self.g_seq, self.g_ctx, self.e_dec, nd, per_d), 0.0)
        lat = lat + STEP_OVERHEAD_S
        return lat, dyn + self.static_power_w * self.num_chips * lat

    def detailed(self, prefill_tokens: float, prefill_ctx: float, n_decode: float,
                 decode_kv: float) -> tuple[float, float]:
        """The same step on the detailed model (reference for :meth:`fit_error`)."""
        p, ctx, nd, kv, logits = (float(x) for x in self._local(prefill_tokens, prefill_ctx,
                                                                n_decode, decode_kv))
        parts = self.model.parts_local(p, ctx, nd, kv, logits,
                                       (p + nd) * self.model.par.ep)
        lat = sum(v[0] for v in parts.values()) + STEP_OVERHEAD_S
        dyn = sum(v[1] for v in parts.values())
        return lat, dyn + self.static_power_w * self.num_chips * lat

    def fit_error(self, n: int = 300, seed: int = 0) -> dict[str, float]:
        """Max and mean relative error of latency and energy on random mixed steps."""
        rng = np.random.default_rng(seed)
        nd = np.where(rng.random(n) < 0.7, np.floor(np.exp(rng.uniform(0, 6, n))), 0)
        kv = nd * np.exp(rng.uniform(np.log(16), np.log(65536), n))
        p = np.where((rng.random(n) < 0.5) | (nd == 0), np.floor(np.exp(rng.uniform(0, 9, n))),
                     0)
        ctx = p * np.exp(rng.uniform(0, np.log(32768), n))
        lat, en = self.step(p, ctx, nd, kv)
        ref = np.array([self.detailed(*x) for x in zip(p, ctx, nd, kv)])
        el = np.abs(lat / ref[:, 0] - 1)
        ee = np.abs(en / ref[:, 1] - 1)
        return {"latency_max_rel_err": float(el.max()), "latency_mean_rel_err": float(el.mean()),
                "energy_max_rel_err": float(ee.max()), "energy_mean_rel_err": float(ee.mean()),
                "points": n}
