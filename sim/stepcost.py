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

Tables are cached on disk (``.npz``) under a key of everything that decides their numbers (model
fingerprint, chip spec, allocation, grids and the source of every module the chip model runs).
A cached table is checked when read (shapes, finite positive values, and a few grid points
recomputed with the chip model); a damaged one is rebuilt, a cache that cannot be written is run
without (one warning each).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import math
import os
import re
import stat
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dse.cache import say_once
from dse.files import MiB, write_atomic

from .chip import ChipModel

# PCIe 4.0 x16 between HBM and host memory: 24 GB/s per chip (paper Table 3, weight loading)
HOST_BW_BYTES_PER_S_PER_CHIP = 24e9

# every module whose code decides a table's numbers: the chip model and what it runs
_KEY_MODULES = ("sim.chip", "sim.hardware", "sim.stepcost", "dse.catalog", "dse.models",
                "dse.parallel", "dse.torus", "dse.vpod", "dse.xla_cost", "dse.stacks")
MAX_TABLE_BYTES = 256 * MiB


@functools.lru_cache(maxsize=None)
def _source_digest() -> bytes:
    h = hashlib.sha256()
    for name in _KEY_MODULES:
        h.update(Path(importlib.import_module(name).__file__).read_bytes())
    return h.digest()


class _Damaged(Exception):
    """A cached table that must not be used (the message says why)."""


def _grid(lo: float, hi: float, per_octave: int = 4, small_ints: int = 16) -> np.ndarray:
    """Log-spaced points plus the small integers (where ceil() effects are sharpest)."""
    n = int(math.ceil(math.log2(hi / lo) * per_octave)) + 1
    return np.unique(np.concatenate([np.geomspace(lo, hi, n),
                                     np.arange(1, small_ints + 1, dtype=np.float64)]))


def _interp1(lg: np.ndarray, lt: np.ndarray, x) -> np.ndarray:
    """Linear interpolation in log-log space; ``lg``/``lt`` are the logs of grid and table."""
    lx = np.clip(np.log(np.maximum(x, 1e-300)), lg[0], lg[-1])
    return np.exp(np.interp(lx, lg, lt))


def _interp2(lgx: np.ndarray, lgy: np.ndarray, lt: np.ndarray, x, y) -> np.ndarray:
    lx = np.clip(np.log(np.maximum(x, 1e-300)), lgx[0], lgx[-1])
    ly = np.clip(np.log(np.maximum(y, 1e-300)), lgy[0], lgy[-1])
    i = np.clip(np.searchsorted(lgx, lx) - 1, 0, len(lgx) - 2)
    j = np.clip(np.searchsorted(lgy, ly) - 1, 0, len(lgy) - 2)
    fx = (lx - lgx[i]) / (lgx[i + 1] - lgx[i])
    fy = (ly - lgy[j]) / (lgy[j + 1] - lgy[j])
    v = ((1 - fx) * (1 - fy) * lt[i, j] + fx * (1 - fy) * lt[i + 1, j]
         + (1 - fx) * fy * lt[i, j + 1] + fx * fy * lt[i + 1, j + 1])
    return np.exp(v)


_TINY = 1e-30   # tables hold log values: a zero cost becomes a negligible positive one


def _interp1_scalar(lg: list[float], lt: list[float], le: list[float], x: float
                    ) -> tuple[float, float]:
    """Two tables on one grid (latency and energy) at ``x``, log-log."""
    lx = min(max(math.log(x), lg[0]), lg[-1])
    i = min(max(bisect_right(lg, lx) - 1, 0), len(lg) - 2)
    f = (lx - lg[i]) / (lg[i + 1] - lg[i])
    return (math.exp(lt[i] + f * (lt[i + 1] - lt[i])),
            math.exp(le[i] + f * (le[i + 1] - le[i])))


def _interp2_scalar(lgx: list[float], lgy: list[float], lt: list[list[float]],
                    le: list[list[float]], x: float, y: float) -> tuple[float, float]:
    lx = min(max(math.log(x), lgx[0]), lgx[-1])
    ly = min(max(math.log(y), lgy[0]), lgy[-1])
    i = min(max(bisect_right(lgx, lx) - 1, 0), len(lgx) - 2)
    j = min(max(bisect_right(lgy, ly) - 1, 0), len(lgy) - 2)
    fx = (lx - lgx[i]) / (lgx[i + 1] - lgx[i])
    fy = (ly - lgy[j]) / (lgy[j + 1] - lgy[j])
    gx, gy = 1 - fx, 1 - fy
    a, b = lt[i], lt[i + 1]
    c, d = le[i], le[i + 1]
    return (math.exp(gx * (gy * a[j] + fy * a[j + 1]) + fx * (gy * b[j] + fy * b[j + 1])),
            math.exp(gx * (gy * c[j] + fy * c[j + 1]) + fx * (gy * d[j] + fy * d[j + 1])))


@dataclass
class StepCostTable:
    """Tabulated step cost of one allocation (engine step-cost protocol)."""

    model: ChipModel
    max_tokens: int = 1 << 17
    max_seqs: int = 2048
    max_kv_per_seq: int = 1 << 20
    cache_dir: Path | None = None     # tables are reused across runs from here (npz per key)

    def __post_init__(self) -> None:
        cm = self.model
        ep = cm.par.dp          # attention data-parallel groups (1 under tensor-parallel attention)
        self.num_chips = cm.par.chips
        self.static_power_w = cm.hw.static_power_w
        self.kv_capacity_tokens = cm.kv_capacity_tokens()
        self.kv_bytes_per_token = cm.arch.kv_bytes_per_token()
        self.host_bw_bytes_per_s = HOST_BW_BYTES_PER_S_PER_CHIP * cm.par.chips
        # prefill tokens are shared by the EP data-parallel groups: a chip may see 1/ep of one
        self.g_tok = _grid(1.0 / ep, self.max_tokens)
        self.g_seq = _grid(1, self.max_seqs)
        self.g_ctx = _grid(1, self.max_kv_per_seq, 2, small_ints=0)
        # the 2-D (attention) tables are smooth in the token/sequence axis: a coarser grid
        self.g_tok2 = _grid(1.0 / ep, self.max_tokens, 2, small_ints=8)
        self.g_seq2 = _grid(1, self.max_seqs, 2, small_ints=8)

        arrays = self._load()
        if arrays is None:
            arrays = self._tabulate()
            self._save(arrays)
        (self.t_tok, self.e_tok, self.t_head, self.e_head, self.t_pre, self.e_pre, self.t_dec,
         self.e_dec) = arrays
        # logs of grids and tables, as arrays (vector path) and Python lists (scalar path)
        self._v = tuple(np.log(a) for a in (self.g_tok, self.g_seq, self.g_ctx, self.t_tok,
                                            self.e_tok, self.t_head, self.e_head, self.t_pre,
                                            self.e_pre, self.t_dec, self.e_dec, self.g_tok2,
                                            self.g_seq2))
        self._s = tuple(a.tolist() for a in self._v)
        self._rows: dict[float, tuple] = {}      # decode-only steps by batch size
        # prefill-only steps by (tokens, context): a batch-1 prefill vPod prices each prompt
        # length once (2.5 M prompts on the Azure coding day, far fewer distinct lengths)
        self._prefill_memo: dict[tuple[float, float], tuple[float, float]] = {}
        self._ep = ep
        self._heads: dict[int, tuple[float, float]] = {}
        # the serving stack's software time per step and per scheduled sequence
        self._oh_step, self._oh_seq = cm.stack.step_s, cm.stack.per_seq_s
        self._overlap = cm.stack.overlap
        # the stack's padding of prompt tokens (what the matmuls and the MoE run), or None
        self._pad = cm.stack.padded_prefill if cm.stack.pad_tokens else None
        # the measured maximum power bounds every step's energy (dse.catalog.ChipSpec)
        mp = cm.chip.measured_max_power_w
        self._pmax_w = math.inf if mp is None else mp * self.num_chips

    def _cell(self, table: str, i: int, j: int = 0) -> tuple[float, float]:
        """(latency, dynamic energy) of one grid cell of a table, from the chip model."""
        cm, ep = self.model, self.model.par.dp
        if table == "tok":
            t = self.g_tok[i]
            kw = dict(nd_loc=t, stage_tokens=t * ep)
        elif table == "head":
            kw = dict(logits=self.g_seq[i])
        elif table == "pre":
            p = self.g_tok2[i]
            kw = dict(p_loc=p, c_loc=p * self.g_ctx[j])
        else:
            n = self.g_seq2[i]
            kw = dict(nd_loc=n, kv_loc=n * self.g_ctx[j])
        name = {"tok": "tok", "head": "head", "pre": "prefill_attn", "dec": "decode_attn"}[table]
        v = cm.parts_local(**{"p_loc": 0.0, "c_loc": 0.0, "nd_loc": 0.0, "kv_loc": 0.0,
                              "logits": 0.0, "stage_tokens": 0.0, **kw})[name]
        return max(v[0], _TINY), max(v[1], _TINY)

    def _tabulate(self) -> tuple[np.ndarray, ...]:
        """Evaluate the chip model on the grids (0.1-3 s; cached on disk when ``cache_dir``)."""
        tok = [self._cell("tok", i) for i in range(len(self.g_tok))]
        head = [self._cell("head", i) for i in range(len(self.g_seq))]
        pre = [[self._cell("pre", i, j) for j in range(len(self.g_ctx))]
               for i in range(len(self.g_tok2))]
        dec = [[self._cell("dec", i, j) for j in range(len(self.g_ctx))]
               for i in range(len(self.g_seq2))]
        t_tok, e_tok = (np.array(x) for x in zip(*tok))
        t_head, e_head = (np.array(x) for x in zip(*head))
        return (t_tok, e_tok, t_head, e_head,
                np.array([[x[0] for x in row] for row in pre]),
                np.array([[x[1] for x in row] for row in pre]),
                np.array([[x[0] for x in row] for row in dec]),
                np.array([[x[1] for x in row] for row in dec]))

    def cache_key(self) -> str:
        """Model fingerprint, chip spec (every field: ``repr``), allocation, grids and the source
        of every module the chip model runs (:data:`_KEY_MODULES`)."""
        cm = self.model
        h = hashlib.sha256()
        for part in (cm.arch.fingerprint(), repr(cm.chip), str(cm.topo), repr(cm.par),
                     cm.stack.key(), repr((self.max_tokens, self.max_seqs, self.max_kv_per_seq))):
            h.update(part.encode())
        h.update(_source_digest())
        return h.hexdigest()[:24]

    def _path(self) -> Path | None:
        if self.cache_dir is None:
            return None
        cm = self.model
        name = re.sub(r"[^A-Za-z0-9._+-]", "_", f"{cm.arch.name}")[:64]
        return Path(self.cache_dir) / (f"{name}-{cm.chip.name}-{cm.topo}-tp{cm.par.tp}"
                                       f"pp{cm.par.pp}ep{cm.par.ep}{cm.par.attn}-"
                                       f"{self.cache_key()}.npz")

    _NAMES = ("t_tok", "e_tok", "t_head", "e_head", "t_pre", "e_pre", "t_dec", "e_dec")

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        nt, ns, nc = len(self.g_tok), len(self.g_seq), len(self.g_ctx)
        n2, s2 = len(self.g_tok2), len(self.g_seq2)
        return {"t_tok": (nt,), "e_tok": (nt,), "t_head": (ns,), "e_head": (ns,),
                "t_pre": (n2, nc), "e_pre": (n2, nc), "t_dec": (s2, nc), "e_dec": (s2, nc)}

    def _load(self):
        """The cached arrays, or None (no cache, no entry, or a damaged one: said once)."""
        p = self._path()
        if p is None:
            return None
        try:
            st = os.stat(p)
        except (OSError, ValueError):
            return None
        try:
            if not stat.S_ISREG(st.st_mode):
                raise _Damaged("not a regular file")
            if st.st_size > MAX_TABLE_BYTES:
                raise _Damaged(f"{st.st_size / MiB:,.0f} MiB")
            with open(p, "rb") as fh:
                blob = fh.read(MAX_TABLE_BYTES + 1)
            try:
                with np.load(io.BytesIO(blob)) as z:
                    arrays = {k: z[k] for k in self._NAMES}
            except Exception as e:  # noqa: BLE001 - truncated, empty, not a zip, no such array
                raise _Damaged(f"unreadable: {type(e).__name__}: {e}") from None
            return self._checked(arrays)
        except (OSError, _Damaged) as e:
            say_once(f"note: the cached step-cost table {str(p)!r} is damaged ({e}); rebuilding "
                     "it", key=f"damaged:{p}")
            return None

    def _checked(self, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        """``arrays`` if they are sound: the right shapes, finite and positive, and equal to the
        chip model at a few grid points of every table (corners, middle and ten more, the same
        every time: ~50 chip-model calls), which a NaN, a negative value or a table scaled x1000
        cannot be; else :class:`_Damaged`."""
        for k, shape in self._shapes().items():
            a = arrays[k]
            if a.dtype != np.float64 or a.shape != shape:
                raise _Damaged(f"{k} is {a.dtype}{list(a.shape)}, expected float64{list(shape)}")
            if not np.all(np.isfinite(a) & (a > 0)):
                raise _Damaged(f"{k} holds NaN, infinite, zero or negative values")
        for table, (t, e) in (("tok", ("t_tok", "e_tok")), ("head", ("t_head", "e_head")),
                              ("pre", ("t_pre", "e_pre")), ("dec", ("t_dec", "e_dec"))):
            shape = arrays[t].shape
            n, m = shape[0], (shape[1] if len(shape) == 2 else 1)
            rng = np.random.default_rng(len(table))
            spots = {(0, 0), (n - 1, m - 1), (n // 2, m // 2)}
            spots.update(zip(rng.integers(0, n, 10).tolist(), rng.integers(0, m, 10).tolist()))
            for i, j in sorted(spots):
                idx = (i, j) if len(shape) == 2 else (i,)
                lat, en = self._cell(table, i, j)
                if not (math.isclose(arrays[t][idx], lat, rel_tol=1e-9)
                        and math.isclose(arrays[e][idx], en, rel_tol=1e-9)):
                    raise _Damaged(f"{t}/{e} at grid point {idx} differ from the chip model")
        return tuple(arrays[k] for k in self._NAMES)

    def _save(self, arrays) -> None:
        """Write the table; a cache that cannot be written is run without (one warning)."""
        p = self._path()
        if p is None:
            return
        buf = io.BytesIO()
        np.savez(buf, **dict(zip(self._NAMES, arrays)))
        try:
            write_atomic(p, buf.getvalue(), prefix=".tmp-")
        except OSError as e:
            say_once(f"warning: cannot write the step-cost cache in {str(p.parent)!r} "
                     f"({e.strerror or e}); running uncached (tables are rebuilt on every run)",
                     key=f"unwritable:{p.parent}")

    def _local(self, prefill_tokens, prefill_ctx, n_decode, decode_kv):
        """Per-rank (DP attention group) quantities of a step: prompt tokens (attention's),
        context, decoding sequences, their KV, logits."""
        ep = self.model.par.dp
        p = np.asarray(prefill_tokens, dtype=np.float64) / ep
        ctx = np.asarray(prefill_ctx, dtype=np.float64) / ep
        nd_glob = np.asarray(n_decode, dtype=np.float64)
        nd = np.ceil(nd_glob / ep)
        kv = np.where(nd_glob > 0, np.asarray(decode_kv, dtype=np.float64) * nd
                      / np.maximum(nd_glob, 1), 0.0)
        logits = np.ceil((nd_glob + (p > 0)) / ep)
        return p, ctx, nd, kv, logits

    def step(self, prefill_tokens, prefill_ctx, n_decode, decode_kv):
        """Latency (s) and energy (J, whole vPod) of engine steps, vectorised (a single step
        takes a scalar path: the engine prices many steps one at a time)."""
        if all(np.ndim(x) == 0 for x in (prefill_tokens, prefill_ctx, n_decode, decode_kv)):
            return self._step_scalar(float(prefill_tokens), float(prefill_ctx),
                                     float(n_decode), float(decode_kv))
        if (np.ndim(prefill_tokens) == 0 and prefill_tokens == 0 and np.ndim(n_decode) == 0
                and n_decode > 0):
            return self._decode_run(float(n_decode), np.asarray(decode_kv, dtype=np.float64))
        p, ctx, nd, kv, logits = self._local(prefill_tokens, prefill_ctx, n_decode, decode_kv)
        gt, gs, gc, tt, et, th, eh, tp, ep_, td, ed, gt2, gs2 = self._v
        t = (self._pad(prefill_tokens, self._ep) if self._pad else p) + nd
        has_p, has_d = p > 0, nd > 0
        per_p = np.where(has_p, ctx / np.maximum(p, 1e-9), 1.0)
        per_d = np.where(has_d, kv / np.maximum(nd, 1e-9), 1.0)
        lat = np.where(t > 0, _interp1(gt, tt, t), 0.0)
        dyn = np.where(t > 0, _interp1(gt, et, t), 0.0)
        lat = lat + np.where(logits > 0, _interp1(gs, th, logits), 0.0)
        dyn = dyn + np.where(logits > 0, _interp1(gs, eh, logits), 0.0)
        lat = lat + np.where(has_p, _interp2(gt2, gc, tp, p, per_p), 0.0)
        dyn = dyn + np.where(has_p, _interp2(gt2, gc, ep_, p, per_p), 0.0)
        lat = lat + np.where(has_d, _interp2(gs2, gc, td, nd, per_d), 0.0)
        dyn = dyn + np.where(has_d, _interp2(gs2, gc, ed, nd, per_d), 0.0)
        return self._with_host_v(lat, dyn, np.asarray(n_decode, dtype=np.float64) + has_p)

    def step1(self, prefill_tokens: float, prefill_ctx: float, n_decode: float,
              decode_kv: float) -> tuple[float, float]:
        """One step from Python floats (the event-driven engines' path, no numpy)."""
        return self._step_scalar(prefill_tokens, prefill_ctx, n_decode, decode_kv)

    def decode_line(self, n: float, kv0: float, kv1: float) -> tuple[float, float, float, float]:
        """Latency and energy of decode-only steps of ``n`` sequences at summed KV ``kv0`` and
        ``kv1``, in one call (the event-driven decode engine's phase endpoints)."""
        row = self._rows.get(n) or self._decode_row(n)
        gc = self._s[2]
        lo, hi, last = gc[0], gc[-1], len(gc) - 2
        lr, er = row[2], row[3]
        out = []
        for kv in (kv0, kv1):
            ly = min(max(math.log(kv / n), lo), hi)
            j = min(max(bisect_right(gc, ly) - 1, 0), last)
            f = (ly - gc[j]) / (gc[j + 1] - gc[j])
            out += self._with_host(row[0] + math.exp(lr[j] + f * (lr[j + 1] - lr[j])),
                                   row[1] + math.exp(er[j] + f * (er[j + 1] - er[j])), n)
        return out[0], out[1], out[2], out[3]

    def _decode_run(self, nd_glob: float, kv: np.ndarray):
        """A run of decode-only steps of one batch (the engine's vectorised phase): every term
        but decode attention is one scalar; attention is a 1-D interpolation along KV."""
        lat0, dyn0 = self._device_scalar(0.0, 0.0, nd_glob, 0.0)   # without attention
        gt, gs, gc, tt, et, th, eh, tp, ep_, td, ed, gt2, gs2 = self._v
        ep = self.model.par.dp
        nd = math.ceil(nd_glob / ep)
        per = np.maximum(kv * (nd / nd_glob) / nd, 1e-300)
        lx = min(max(math.log(nd), gs2[0]), gs2[-1])
        i = min(max(int(np.searchsorted(gs2, lx)) - 1, 0), len(gs2) - 2)
        fx = (lx - gs2[i]) / (gs2[i + 1] - gs2[i])
        ly = np.minimum(np.maximum(np.log(per), gc[0]), gc[-1])
        lat_row = (1 - fx) * td[i] + fx * td[i + 1]
        dyn_row = (1 - fx) * ed[i] + fx * ed[i + 1]
        att = np.exp(np.interp(ly, gc, lat_row))
        att_e = np.exp(np.interp(ly, gc, dyn_row))
        return self._with_host_v(lat0 + att, dyn0 + att_e, nd_glob)

    def _decode_row(self, nd_glob: float) -> tuple:
        """Everything of a decode-only step of ``nd_glob`` sequences but the KV length: the
        constant terms and the attention row interpolated at the batch size."""
        gt, gs, gc, tt, et, th, eh, tp, ep_, td, ed, gt2, gs2 = self._s
        lat0, dyn0 = self._device_scalar(0.0, 0.0, nd_glob, 0.0)
        nd = math.ceil(nd_glob / self.model.par.dp)
        lx = min(max(math.log(nd), gs2[0]), gs2[-1])
        i = min(max(bisect_right(gs2, lx) - 1, 0), len(gs2) - 2)
        fx = (lx - gs2[i]) / (gs2[i + 1] - gs2[i])
        lrow = [(1 - fx) * a + fx * b for a, b in zip(td[i], td[i + 1])]
        erow = [(1 - fx) * a + fx * b for a, b in zip(ed[i], ed[i + 1])]
        row = (lat0, dyn0, lrow, erow)
        self._rows[nd_glob] = row
        return row

    def _head(self, logits: int) -> tuple[float, float]:
        s = self._s
        v = self._heads[logits] = _interp1_scalar(s[1], s[5], s[6], logits)
        return v

    def _with_host(self, dev: float, dyn: float, seqs: float) -> tuple[float, float]:
        """A step's latency and energy from its device time and dynamic energy: the stack's
        host time added, or (``overlap``: the host prepares the next step while this one runs)
        the longer of the two; static power over the whole step; the energy bounded by the
        chip's measured maximum power. Python floats (the engines' scalar paths)."""
        host = self._oh_step + self._oh_seq * seqs
        lat = (dev if dev > host else host) if self._overlap else dev + host
        e = dyn + self.static_power_w * self.num_chips * lat
        return lat, (e if e < self._pmax_w * lat else self._pmax_w * lat)

    def _with_host_v(self, dev, dyn, seqs):
        """:meth:`_with_host` on arrays (the vectorised paths)."""
        host = self._oh_step + self._oh_seq * seqs
        lat = np.maximum(dev, host) if self._overlap else dev + host
        return lat, np.minimum(dyn + self.static_power_w * self.num_chips * lat,
                               self._pmax_w * lat)

    def _step_scalar(self, p: float, ctx: float, nd_glob: float, kv: float):
        if p == 0.0 and nd_glob > 0.0 and kv > 0.0:      # decode-only: the common case
            row = self._rows.get(nd_glob) or self._decode_row(nd_glob)
            gc = self._s[2]
            ly = min(max(math.log(kv / nd_glob), gc[0]), gc[-1])
            j = min(max(bisect_right(gc, ly) - 1, 0), len(gc) - 2)
            f = (ly - gc[j]) / (gc[j + 1] - gc[j])
            lr, er = row[2], row[3]
            return self._with_host(row[0] + math.exp(lr[j] + f * (lr[j + 1] - lr[j])),
                                   row[1] + math.exp(er[j] + f * (er[j + 1] - er[j])), nd_glob)
        if nd_glob == 0.0 and p > 0.0:                  # prefill-only (P/D prefill vPods)
            got = self._prefill_memo.get((p, ctx))
            if got is not None:
                return got
            if len(self._prefill_memo) > 1 << 18:
                self._prefill_memo.clear()
            key = (p, ctx)
            s, ep = self._s, self._ep
            p_tok = self._pad(p, ep) if self._pad else p / ep
            p, ctx = p / ep, ctx / ep
            lat, dyn = _interp1_scalar(s[0], s[3], s[4], p_tok)
            x, y = self._heads.get(1) or self._head(1)
            u, v = _interp2_scalar(s[11], s[2], s[7], s[8], p, ctx / p)
            got = self._prefill_memo[key] = self._with_host(lat + x + u, dyn + y + v, 1.0)
            return got
        dev, dyn = self._device_scalar(p, ctx, nd_glob, kv)
        return self._with_host(dev, dyn, nd_glob + (p > 0))

    def _device_scalar(self, p: float, ctx: float, nd_glob: float, kv: float
                       ) -> tuple[float, float]:
        """Device time and dynamic energy of a step (no host time, no static power)."""
        gt, gs, gc, tt, et, th, eh, tp, ep_, td, ed, gt2, gs2 = self._s
        ep = self._ep
        p_tok = self._pad(p, ep) if self._pad else p / ep
        p, ctx = p / ep, ctx / ep
        nd = math.ceil(nd_glob / ep)
        kv = kv * nd / nd_glob if nd_glob > 0 else 0.0
        logits = math.ceil((nd_glob + (p > 0)) / ep)
        lat = dyn = 0.0
        t = p_tok + nd
        if t > 0:
            x, y = _interp1_scalar(gt, tt, et, t)
            lat += x
            dyn += y
        if logits > 0:
            x, y = self._heads.get(logits) or self._head(logits)
            lat += x
            dyn += y
        if p > 0:
            x, y = _interp2_scalar(gt2, gc, tp, ep_, p, ctx / p)
            lat += x
            dyn += y
        if nd > 0 and kv > 0:
            x, y = _interp2_scalar(gs2, gc, td, ed, nd, kv / nd)
            lat += x
            dyn += y
        return lat, dyn

    def detailed(self, prefill_tokens: float, prefill_ctx: float, n_decode: float,
                 decode_kv: float) -> tuple[float, float]:
        """The same step on the detailed model (reference for :meth:`fit_error`)."""
        p, ctx, nd, kv, logits = (float(x) for x in self._local(prefill_tokens, prefill_ctx,
                                                                n_decode, decode_kv))
        ep = self.model.par.dp
        p_tok = self._pad(float(prefill_tokens), ep) if self._pad else p
        parts = self.model.parts_local(p, ctx, nd, kv, logits, (p_tok + nd) * ep,
                                       p_tok if self._pad else None)
        return self._with_host(sum(v[0] for v in parts.values()),
                               sum(v[1] for v in parts.values()),
                               float(n_decode) + (p > 0))

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


class PipelineShare:
    """One of the ``depth`` virtual engines of a pipeline-parallel vPod.

    vLLM runs a PP=d vPod as d virtual engines whose micro-batches are staggered by one stage:
    each micro-batch still takes the full pass through every stage (its latency), but d of them
    are in flight, so the vPod's throughput is d times one engine's (the DSE's pipelined
    steady state). Each share sees the table's step latency, 1/d of the KV cache and of the host
    bandwidth, and 1/d of the static power (so the d shares together pay it once)."""

    def __init__(self, table: StepCostTable, depth: int):
        self.table, self.depth = table, depth
        self.num_chips = table.num_chips
        self.static_power_w = table.static_power_w / depth
        self.kv_capacity_tokens = table.kv_capacity_tokens // depth
        self.kv_bytes_per_token = table.kv_bytes_per_token
        self.host_bw_bytes_per_s = table.host_bw_bytes_per_s / depth
        self._static_shed = table.static_power_w * self.num_chips * (1 - 1 / depth)

    def step(self, prefill_tokens, prefill_ctx, n_decode, decode_kv):
        lat, en = self.table.step(prefill_tokens, prefill_ctx, n_decode, decode_kv)
        static = self.table.static_power_w * self.num_chips * lat
        return lat, en - static + static / self.depth

    def step1(self, prefill_tokens: float, prefill_ctx: float, n_decode: float,
              decode_kv: float) -> tuple[float, float]:
        lat, en = self.table._step_scalar(prefill_tokens, prefill_ctx, n_decode, decode_kv)
        return lat, en - self._static_shed * lat

    def decode_line(self, n: float, kv0: float, kv1: float) -> tuple[float, float, float, float]:
        a, ea, b, eb = self.table.decode_line(n, kv0, kv1)
        shed = self._static_shed
        return a, ea - shed * a, b, eb - shed * b
