"""Workload traces for the trace-driven cluster simulator (paper §5.1 Table 4, §5.3).

A :class:`Trace` is a time-sorted set of requests held as three parallel numpy arrays:
``arrival_s`` (float64, seconds from the trace's origin t = 0), ``input_tokens`` and
``output_tokens`` (int64, >= 1). There are no per-request Python objects. int64 rather than
int32 because the token sums of a full day (~6e9 for the Azure day) overflow int32. The arrays
are read-only views, so traces can be shared (and the file cache below is safe).

Time origin. ``t = 0`` is the start of the trace, not necessarily its first request: CSV files
with an ``arrival_s`` column keep their times as written (the synthesised Azure 2024 day counts
from 00:00, its first request is at 0.015 s; the ServeGen day's first is at 3.845 s); the Azure
2023 files count from their first (earliest) row; Mooncake counts from its ``timestamp`` 0.
``duration_s`` is the time from the origin to the last arrival, and rates are per that span.

File formats (detected from the header line; gzip from the magic bytes, any extension):

* ``arrival_s,input_tokens,output_tokens`` - the synthesised Azure 2024 day (plain or ``.gz``);
* ``TIMESTAMP,ContextTokens,GeneratedTokens`` - Azure LLM inference 2023; ``TIMESTAMP`` is an
  ISO datetime such as ``2023-11-16 18:15:46.6805900``, parsed as ``datetime64[ns]``;
* ``arrival_s,client_idx,input_tokens,output_tokens,reason_ratio`` - ServeGen sampled requests
  (the extra columns are dropped);
* JSON lines with ``timestamp`` (ms), ``input_length``, ``output_length`` - Mooncake (other keys,
  e.g. ``hash_ids``, are ignored).

CSV files are parsed by one ``np.loadtxt`` call with a structured dtype (float64 arrival, int64
lengths: integer columns parse much faster than float ones); the 2.48 M-row Azure day loads in
about 2 s. Rows out of time order are stably sorted. A missing file, an unknown header, a bad row
(wrong column count, a non-number, a non-integer length, a negative or non-finite arrival, a
length < 1) or an empty file raise :class:`~dse.errors.NeuScaleError` naming the file and, for
a bad row, its line number. Parsed files of 1 MB or more are cached (keyed by path, size and
mtime; a few entries, see :func:`clear_cache`).

Synthesised workloads (their ``Trace.note`` starts with ``SYNTHESISED``):

* ``lveval`` / ``openthoughts`` - no per-request data exists offline, so, as in §5.1, the
  arrival times are the Azure 2024 code day's (``azure-code``) uniformly thinned (a seeded
  random subset of exactly ``round(rate * duration_min)`` requests, which keeps the daily
  pattern) to Table 4's mean rate, and input and output lengths are drawn independently from
  truncated log-normals fitted to Table 4's min/avg/max (:class:`TruncatedLogNormal`):
  support [min, max]; ``sigma = ln(max / min) / (2 * 3.09)``, i.e. [min, max] would be the
  central 99.8 % of the untruncated distribution (the table publishes no spread, this is an
  assumption); ``mu`` solved by bisection on the closed-form truncated mean so the mean equals
  the table's average. Sampling is stratified inverse-CDF (one uniform per equal-probability
  stratum, randomly permuted over the requests), so a full-day sample's mean is within a small
  fraction of a percent of the target; lengths are rounded to integers and clipped to
  [min, max].
* ``bursty`` (§5.3) - Poisson arrivals at 30 req/min for 30 min, 80 req/min for a 45-min burst,
  30 req/min for 45 min (2 h); mean input/output 2000/128 tokens outside the burst and
  100000/5000 inside, log-normal (sigma 0.5, an assumption) around those means, >= 1 token.
  See :func:`synth_bursty` for the knobs.

Rates. ``Trace.scale_rate(x)`` divides every arrival time by ``x`` (``x > 1``: more requests per
second; lengths unchanged). §5.1 scales each workload so its tokens per minute are comparable
to Azure; that is the explicit :func:`match_tokens_per_minute`, never applied implicitly.

Entry point::

    from sim.traces import load_trace, PRESETS
    tr = load_trace("azure-code", start="12:00", hours=1)      # a preset, a 1-h window
    tr = load_trace("/path/to/trace.csv.gz", rate_scale=2.0)   # a file, twice the rate
"""

from __future__ import annotations

import codecs
import functools
import gzip
import io
import json
import math
import os
import re
import sys
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import numpy as np
import numpy.typing as npt

from dse.errors import NeuScaleError

__all__ = ["PRESETS", "TABLE4", "Trace", "TruncatedLogNormal", "WorkloadStats", "clear_cache",
           "data_dir", "load_trace", "match_tokens_per_minute", "synth_bursty",
           "synth_from_stats"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def _frozen(a: npt.ArrayLike, dtype: type) -> Any:
    """A read-only view of ``a`` as ``dtype`` (copies only if the dtype differs)."""
    v = np.asarray(a, dtype=dtype).view()
    v.flags.writeable = False
    return v


# ------------------------------------------------------------------------------------- Trace

@dataclass(frozen=True, eq=False)
class Trace:
    """A time-sorted set of requests (see the module docstring for the time origin).

    Invariants, checked on construction: 1-D arrays of equal length, ``arrival_s`` finite,
    >= 0 and non-decreasing, token counts >= 1. The arrays are read-only views.
    """

    name: str
    arrival_s: FloatArray
    input_tokens: IntArray
    output_tokens: IntArray
    note: str = ""

    def __post_init__(self) -> None:
        arr = _frozen(self.arrival_s, np.float64)
        inp = _frozen(self.input_tokens, np.int64)
        out = _frozen(self.output_tokens, np.int64)
        if arr.ndim != 1 or inp.shape != arr.shape or out.shape != arr.shape:
            raise NeuScaleError(f"trace {self.name!r}: arrival_s, input_tokens and output_tokens "
                                f"must be 1-D arrays of one length (got shapes {arr.shape}, "
                                f"{inp.shape}, {out.shape})")
        if arr.size:
            if not np.all(np.isfinite(arr)) or arr.min() < 0:
                raise NeuScaleError(f"trace {self.name!r}: arrival times must be finite and >= 0")
            if np.any(arr[1:] < arr[:-1]):
                raise NeuScaleError(f"trace {self.name!r}: arrival times must be sorted")
            if inp.min() < 1 or out.min() < 1:
                raise NeuScaleError(f"trace {self.name!r}: token counts must be >= 1")
        object.__setattr__(self, "arrival_s", arr)
        object.__setattr__(self, "input_tokens", inp)
        object.__setattr__(self, "output_tokens", out)

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    def __repr__(self) -> str:
        return (f"Trace(name={self.name!r}, requests={len(self)}, "
                f"duration_s={self.duration_s:.3f})")

    @property
    def duration_s(self) -> float:
        """Seconds from the origin (t = 0) to the last arrival; 0.0 for an empty trace."""
        return float(self.arrival_s[-1]) if self.arrival_s.size else 0.0

    def _with(self, arrival_s: FloatArray, input_tokens: IntArray, output_tokens: IntArray,
              note: str | None = None) -> Trace:
        return Trace(self.name, arrival_s, input_tokens, output_tokens,
                     self.note if note is None else note)

    def slice(self, start_s: float, end_s: float) -> Trace:
        """The requests with ``start_s <= arrival_s < end_s``, re-based so ``start_s`` is 0."""
        if not (math.isfinite(start_s) and start_s >= 0 and end_s > start_s):
            raise NeuScaleError(f"slice needs 0 <= start_s < end_s (got {start_s}, {end_s})")
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s], side="left")
        return self._with(self.arrival_s[lo:hi] - start_s, self.input_tokens[lo:hi],
                          self.output_tokens[lo:hi])

    def scale_rate(self, factor: float) -> Trace:
        """The same requests at ``factor`` times the request rate: every arrival time is divided
        by ``factor`` (so ``factor > 1`` compresses time: more requests per second; the temporal
        pattern and the lengths are kept). ``duration_s`` shrinks by ``factor``."""
        if not (math.isfinite(factor) and factor > 0):
            raise NeuScaleError(f"rate scale must be a finite number > 0 (got {factor})")
        if factor == 1.0:
            return self
        note = f"{self.note}; " if self.note else ""
        return self._with(self.arrival_s / factor, self.input_tokens, self.output_tokens,
                          f"{note}rate x{factor:.6g}")

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (all of them if the trace is shorter)."""
        if n < 0:
            raise NeuScaleError(f"head needs n >= 0 (got {n})")
        return self._with(self.arrival_s[:n], self.input_tokens[:n], self.output_tokens[:n])

    def tokens_per_minute(self) -> float:
        """Mean (input + output) tokens per minute: all tokens / (``duration_s`` / 60).
        NaN if the trace spans no time (empty, or every request at t = 0)."""
        if self.duration_s <= 0:
            return math.nan
        total = int(self.input_tokens.sum()) + int(self.output_tokens.sum())
        return total * 60.0 / self.duration_s

    def summary(self) -> dict[str, float | int]:
        """Request count, duration, mean request rate and min/mean/max input and output lengths
        (plain Python numbers; rates NaN, lengths 0 for an empty trace)."""
        n = len(self)
        out: dict[str, float | int] = {
            "requests": n,
            "duration_s": self.duration_s,
            "req_per_min": n * 60.0 / self.duration_s if self.duration_s > 0 else math.nan,
            "tokens_per_min": self.tokens_per_minute(),
        }
        for key, a in (("input", self.input_tokens), ("output", self.output_tokens)):
            out[f"{key}_min"] = int(a.min()) if n else 0
            out[f"{key}_mean"] = float(a.mean()) if n else 0.0
            out[f"{key}_max"] = int(a.max()) if n else 0
        return out


def match_tokens_per_minute(trace: Trace, reference: Trace) -> Trace:
    """``trace`` with its request rate scaled (:meth:`Trace.scale_rate`) so that its mean
    (input + output) tokens per minute equal ``reference``'s, as §5.1 does to make workloads
    comparable to Azure. Explicit: nothing else applies it."""
    mine, ref = trace.tokens_per_minute(), reference.tokens_per_minute()
    if not (math.isfinite(mine) and mine > 0 and math.isfinite(ref) and ref > 0):
        raise NeuScaleError(f"cannot match tokens per minute: {trace.name!r} has {mine} and "
                            f"reference {reference.name!r} has {ref} (both need > 1 request "
                            f"spread over time)")
    return trace.scale_rate(ref / mine)


# ------------------------------------------------------------------------------- file parsing

_Kind = Literal["float", "int", "datetime"]


@dataclass(frozen=True)
class _CsvFormat:
    label: str
    columns: tuple[str, ...]
    kinds: tuple[_Kind, ...]
    arrival: str
    inp: str
    out: str


_CSV_FORMATS = (
    _CsvFormat("synthesised Azure day", ("arrival_s", "input_tokens", "output_tokens"),
               ("float", "int", "int"), "arrival_s", "input_tokens", "output_tokens"),
    _CsvFormat("Azure 2023", ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
               ("datetime", "int", "int"), "TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    _CsvFormat("ServeGen sampled requests",
               ("arrival_s", "client_idx", "input_tokens", "output_tokens", "reason_ratio"),
               ("float", "int", "int", "int", "float"), "arrival_s", "input_tokens",
               "output_tokens"),
)
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
_NP_KIND = {"float": "f8", "int": "i8", "datetime": "M8[ns]"}

_Arrays = tuple[FloatArray, IntArray, IntArray]


def _known_formats() -> str:
    csvs = "; ".join(f"{','.join(f.columns)} ({f.label})" for f in _CSV_FORMATS)
    return f"{csvs}; or JSON lines with {', '.join(_MOONCAKE_KEYS)} (Mooncake)"


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise NeuScaleError(f"cannot read trace file {path}: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise NeuScaleError(f"trace file {path} is not a valid gzip file: {e}") from None
    elif path.suffix == ".gz":
        raise NeuScaleError(f"trace file {path} ends in .gz but is not gzip-compressed")
    return raw


def _data_lines(raw: bytes, header: bool = True) -> list[tuple[int, str]]:
    """(1-based file line number, line) of the non-empty data lines (after the header, if
    ``header``): as np.loadtxt skips empty lines, row ``k`` of the parsed arrays is element
    ``k``."""
    first = 1 if header else 0
    text = raw.decode("utf-8", errors="replace")
    lines = (s.rstrip("\r") for s in text.split("\n"))
    return [(i + 1, s) for i, s in enumerate(lines) if i >= first and s]


def _check_field(value: str, kind: _Kind) -> str | None:
    """Why ``value`` is not a valid ``kind`` field (None if it is), mirroring np.loadtxt."""
    try:
        if kind == "int":
            int(value)
        elif kind == "float":
            float(value)
        else:
            np.datetime64(value.strip(), "ns")
    except ValueError:
        return {"int": "not an integer", "float": "not a number",
                "datetime": "not an ISO datetime"}[kind]
    return None


def _bad_csv_row(path: Path, raw: bytes, fmt: _CsvFormat) -> str | None:
    """Slow path, after np.loadtxt failed: the first bad row, described."""
    for line_no, line in _data_lines(raw):
        fields = line.split(",")
        if len(fields) != len(fmt.columns):
            return (f"trace file {path} line {line_no}: expected {len(fmt.columns)} "
                    f"comma-separated fields ({','.join(fmt.columns)}), got {len(fields)}: "
                    f"{line[:80]!r}")
        for name, kind, value in zip(fmt.columns, fmt.kinds, fields):
            why = _check_field(value, kind)
            if why:
                return (f"trace file {path} line {line_no}: {name} {value.strip()[:40]!r} is "
                        f"{why}: {line[:80]!r}")
    return None


def _parse_csv(path: Path, raw: bytes, fmt: _CsvFormat) -> _Arrays:
    nl = raw.find(b"\n")
    body = raw[nl + 1:] if nl >= 0 else b""
    dtype = [(name, _NP_KIND[kind]) for name, kind in zip(fmt.columns, fmt.kinds)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # "input contained no data"; timezone notes
            rows = np.loadtxt(io.BytesIO(body), delimiter=",", dtype=dtype, comments=None,
                              ndmin=1, encoding="utf-8")
    except ValueError as e:
        raise NeuScaleError(_bad_csv_row(path, raw, fmt)
                            or f"trace file {path}: bad row ({e})") from None
    if fmt.kinds[fmt.columns.index(fmt.arrival)] == "datetime":
        ts = rows[fmt.arrival]
        bad = np.flatnonzero(np.isnat(ts))
        if bad.size:
            _raise_bad_value(path, _data_lines(raw), int(bad[0]), f"{fmt.arrival} is NaT")
        ns = ts.astype(np.int64)
        arrival = (ns - ns.min()).astype(np.float64) / 1e9 if ns.size else ns.astype(float)
    else:
        arrival = np.ascontiguousarray(rows[fmt.arrival])
    # contiguous copies: the structured array's fields are strided views
    return arrival, np.ascontiguousarray(rows[fmt.inp]), np.ascontiguousarray(rows[fmt.out])


def _parse_jsonl(path: Path, raw: bytes) -> _Arrays:
    lines = _data_lines(raw, header=False)
    n = len(lines)
    ts = np.empty(n, np.float64)
    inp = np.empty(n, np.int64)
    out = np.empty(n, np.int64)
    for k, (line_no, line) in enumerate(lines):
        where = f"trace file {path} line {line_no}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise NeuScaleError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise NeuScaleError(f"{where}: expected a JSON object, got {line[:80]!r}")
        vals = []
        for key, want_int in zip(_MOONCAKE_KEYS, (False, True, True)):
            v = rec.get(key)
            ok = isinstance(v, int) if want_int else isinstance(v, (int, float))
            if v is None or isinstance(v, bool) or not ok:
                what = "missing" if v is None else f"not {'an integer' if want_int else 'a number'}"
                raise NeuScaleError(f"{where}: {key!r} is {what}: {line[:80]!r}")
            vals.append(v)
        try:
            ts[k], inp[k], out[k] = vals
        except OverflowError:
            raise NeuScaleError(f"{where}: a value is out of range: {line[:80]!r}") from None
    return ts / 1000.0, inp, out


def _raise_bad_value(path: Path, lines: list[tuple[int, str]], row: int, why: str) -> NoReturn:
    line_no, line = lines[row] if row < len(lines) else (0, "")
    raise NeuScaleError(f"trace file {path} line {line_no}: {why}: {line[:80]!r}")


def _parse_file(path: Path) -> _Arrays:
    raw = _read_bytes(path)
    raw = raw.removeprefix(codecs.BOM_UTF8)
    if raw[:4096].lstrip()[:1] == b"{":
        arrival, inp, out = _parse_jsonl(path, raw)
        jsonl = True
    else:
        header_line = raw[:4096].split(b"\n", 1)[0].decode("utf-8", errors="replace")
        header = tuple(h.strip() for h in header_line.strip().split(","))
        fmt = next((f for f in _CSV_FORMATS if f.columns == header), None)
        if fmt is None:
            raise NeuScaleError(f"trace file {path} has an unknown header {header_line[:120]!r};"
                                f" known formats: {_known_formats()}")
        arrival, inp, out = _parse_csv(path, raw, fmt)
        jsonl = False
    if arrival.size == 0:
        raise NeuScaleError(f"trace file {path} has no requests")
    checks = ((~np.isfinite(arrival) | (arrival < 0), "arrival time is negative or not finite"),
              (inp < 1, "input length is < 1"), (out < 1, "output length is < 1"))
    for bad, why in checks:
        if np.any(bad):
            _raise_bad_value(path, _data_lines(raw, header=not jsonl), int(np.argmax(bad)), why)
    if np.any(arrival[1:] < arrival[:-1]):
        order = np.argsort(arrival, kind="stable")
        arrival, inp, out = arrival[order], inp[order], out[order]
    return _frozen(arrival, np.float64), _frozen(inp, np.int64), _frozen(out, np.int64)


# A file's first arrival later than this (1 day) is taken for an absolute timestamp (Unix
# seconds: ~1.7e9): its times are rebased to start at 0 instead of simulating the idle decades.
ABSOLUTE_AFTER_S = 86400.0
_CACHE_MIN_BYTES = 1 << 20     # smaller files parse in milliseconds: not worth a cache slot


@functools.lru_cache(maxsize=4)
def _parse_file_cached(path: str, size: int, mtime_ns: int) -> _Arrays:
    return _parse_file(Path(path))


def clear_cache() -> None:
    """Forget the parsed files (the cache keeps the 4 most recently loaded files of >= 1 MB;
    the Azure day takes ~60 MB)."""
    _parse_file_cached.cache_clear()


def _load_file(path: Path, name: str | None = None, note: str = "") -> Trace:
    try:
        st = path.stat()
    except OSError:
        raise NeuScaleError(f"trace file not found: {path}") from None
    if not path.is_file():
        raise NeuScaleError(f"trace path is not a file: {path}")
    if st.st_size >= _CACHE_MIN_BYTES:
        arrival, inp, out = _parse_file_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)
    else:
        arrival, inp, out = _parse_file(path)
    first = float(arrival[0])
    if first > ABSOLUTE_AFTER_S:      # absolute timestamps (Unix time): the trace starts at 0
        arrival = arrival - first
        msg = (f"arrival times start at {first:.6g} s, which looks like absolute time: "
               "rebased so the first request arrives at t = 0")
        print(f"note: trace {path.name}: {msg}", file=sys.stderr)
        note = f"{note}; {msg}" if note else msg
    return Trace(name or path.name.split(".")[0], arrival, inp, out, note)


# -------------------------------------------------------------------------------- synthesis

_SQRT2 = math.sqrt(2.0)
_Z999 = 3.090232306167813          # standard normal 99.9th percentile


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / _SQRT2)


def _sf(x: float) -> float:
    return 0.5 * math.erfc(x / _SQRT2)


def _mass(a: float, b: float) -> float:
    """P(a < Z < b) for a standard normal Z, accurate in either tail."""
    return _sf(a) - _sf(b) if a > 0 else _cdf(b) - _cdf(a)


# Acklam's rational approximation of the inverse normal CDF (relative error < 1.2e-9).
_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
      1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
      6.680131188771972e+01, -1.328068155288572e+01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
      -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
      3.754408661907416e+00)


def _ndtri(p: FloatArray) -> FloatArray:
    """Inverse standard normal CDF, vectorised (p in (0, 1); 0 and 1 give -inf and +inf)."""
    p = np.asarray(p, dtype=np.float64)
    x = np.empty_like(p)
    lo = p < 0.02425
    hi = p > 1 - 0.02425
    mid = ~(lo | hi)
    q = p[mid] - 0.5
    r = q * q
    x[mid] = (((((_A[0] * r + _A[1]) * r + _A[2]) * r + _A[3]) * r + _A[4]) * r + _A[5]) * q / \
        (((((_B[0] * r + _B[1]) * r + _B[2]) * r + _B[3]) * r + _B[4]) * r + 1)
    for mask, sign, tail in ((lo, 1.0, p[lo]), (hi, -1.0, 1 - p[hi])):
        with np.errstate(divide="ignore"):
            q = np.sqrt(-2 * np.log(tail))
        num = ((((_C[0] * q + _C[1]) * q + _C[2]) * q + _C[3]) * q + _C[4]) * q + _C[5]
        den = (((_D[0] * q + _D[1]) * q + _D[2]) * q + _D[3]) * q + 1
        with np.errstate(invalid="ignore"):
            x[mask] = sign * np.where(np.isinf(q), -np.inf, num / den)
    return x


@dataclass(frozen=True)
class TruncatedLogNormal:
    """A log-normal (``ln X ~ N(mu, sigma^2)``) truncated to ``[min_tokens, max_tokens]``
    (``max_tokens`` may be ``inf``), sampled as integers."""

    mu: float
    sigma: float
    min_tokens: float
    max_tokens: float

    def _ab(self, mu: float | None = None) -> tuple[float, float]:
        m = self.mu if mu is None else mu
        a = (math.log(self.min_tokens) - m) / self.sigma
        b = (math.log(self.max_tokens) - m) / self.sigma if math.isfinite(self.max_tokens) \
            else math.inf
        return a, b

    def mean(self, mu: float | None = None) -> float:
        """The closed-form mean of the continuous truncated distribution."""
        a, b = self._ab(mu)
        m = self.mu if mu is None else mu
        s = self.sigma
        return math.exp(m + s * s / 2) * _mass(a - s, b - s) / _mass(a, b)

    @classmethod
    def fit(cls, min_tokens: float, mean_tokens: float, max_tokens: float = math.inf,
            sigma: float | None = None) -> TruncatedLogNormal:
        """The truncated log-normal on ``[min_tokens, max_tokens]`` whose mean is
        ``mean_tokens``: ``mu`` by bisection (the truncated mean increases with ``mu``).
        ``sigma`` defaults to ``ln(max/min) / (2 * 3.09)`` (needs a finite max)."""
        if not (0 < min_tokens < mean_tokens < max_tokens):
            raise NeuScaleError(f"need 0 < min < mean < max (got {min_tokens}, {mean_tokens}, "
                                f"{max_tokens})")
        if sigma is None:
            if not math.isfinite(max_tokens):
                raise NeuScaleError("a log-normal without an upper bound needs an explicit sigma")
            sigma = math.log(max_tokens / min_tokens) / (2 * _Z999)
        if not sigma > 0:
            raise NeuScaleError(f"sigma must be > 0 (got {sigma})")
        d = cls(0.0, sigma, float(min_tokens), float(max_tokens))
        top = math.log(max_tokens) if math.isfinite(max_tokens) else math.log(mean_tokens)
        lo, hi = math.log(min_tokens) - 10 * sigma, top + 10 * sigma
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if d.mean(mid) < mean_tokens:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-13:
                break
        return cls(0.5 * (lo + hi), sigma, float(min_tokens), float(max_tokens))

    def sample(self, n: int, rng: np.random.Generator) -> IntArray:
        """``n`` integer lengths: stratified inverse-CDF draws (one uniform in each of ``n``
        equal-probability strata, randomly permuted), rounded and clipped to the support."""
        u = rng.permutation((np.arange(n) + rng.random(n)) / n)
        a, b = self._ab()
        if a > 0:    # support entirely in the upper tail: work with survival probabilities
            sa, sb = _sf(a), _sf(b)
            z = -_ndtri(sb + u * (sa - sb))
        else:
            ca, cb = _cdf(a), _cdf(b)
            z = _ndtri(ca + u * (cb - ca))
        x = np.exp(self.mu + self.sigma * z)
        upper = math.floor(self.max_tokens) if math.isfinite(self.max_tokens) else None
        return np.clip(np.rint(x), math.ceil(self.min_tokens), upper).astype(np.int64)


@dataclass(frozen=True)
class WorkloadStats:
    """Published statistics of a workload (paper Table 4): mean request rate and min/avg/max
    input and output lengths (tokens; "8.8K" read as 8800)."""

    name: str
    req_per_min: float
    input_tokens: tuple[int, float, int]
    output_tokens: tuple[int, float, int]
    source: str


TABLE4: dict[str, WorkloadStats] = {
    "lveval": WorkloadStats("lveval", 41.0, (8_800, 105_000, 431_000), (1, 17, 278),
                            "LV-Eval long-context QA (Yuan et al., 2024)"),
    "openthoughts": WorkloadStats("openthoughts", 27.0, (5, 246, 12_000),
                                  (531, 11_600, 16_800),
                                  "OpenThoughts reasoning (Guha et al., 2025)"),
}


def synth_from_stats(stats: WorkloadStats, arrivals_from: Trace, *, seed: int = 0) -> Trace:
    """A synthesised trace: ``arrivals_from``'s arrival times uniformly thinned to
    ``stats.req_per_min`` (a seeded random subset of ``round(rate * duration_min)``
    requests), lengths from :meth:`TruncatedLogNormal.fit` of the min/avg/max (input and
    output independent). Deterministic for a seed."""
    n = round(stats.req_per_min * arrivals_from.duration_s / 60.0)
    if not 0 < n <= len(arrivals_from):
        raise NeuScaleError(f"cannot thin {arrivals_from.name!r} ({len(arrivals_from)} requests"
                            f" over {arrivals_from.duration_s:.0f} s) to {stats.req_per_min} "
                            f"req/min ({n} requests)")
    rng = np.random.default_rng(seed)
    keep = np.sort(rng.choice(len(arrivals_from), size=n, replace=False))
    d_in = TruncatedLogNormal.fit(*stats.input_tokens)
    d_out = TruncatedLogNormal.fit(*stats.output_tokens)
    (i0, i1, i2), (o0, o1, o2) = stats.input_tokens, stats.output_tokens
    note = (f"SYNTHESISED, not a real trace: {stats.source} has no per-request data offline. "
            f"Lengths drawn from truncated log-normals fitted to paper Table 4 min/avg/max "
            f"(input {i0}/{i1:g}/{i2}: mu={d_in.mu:.4f} sigma={d_in.sigma:.4f}; output "
            f"{o0}/{o1:g}/{o2}: mu={d_out.mu:.4f} sigma={d_out.sigma:.4f}); arrivals = "
            f"{arrivals_from.name!r} uniformly thinned to {stats.req_per_min:g} req/min; "
            f"seed={seed}")
    return Trace(stats.name, arrivals_from.arrival_s[keep], d_in.sample(n, rng),
                 d_out.sample(n, rng), note)


def synth_bursty(*, seed: int = 0, calm_before_min: float = 30.0, burst_min: float = 45.0,
                 calm_after_min: float = 45.0, calm_req_per_min: float = 30.0,
                 burst_req_per_min: float = 80.0, calm_input_mean_tokens: float = 2_000,
                 calm_output_mean_tokens: float = 128, burst_input_mean_tokens: float = 100_000,
                 burst_output_mean_tokens: float = 5_000, length_sigma: float = 0.5) -> Trace:
    """The §5.3 bursty trace: calm / burst / calm segments, Poisson arrivals at each segment's
    rate (a Poisson count, uniform sorted times), lengths log-normal with ``length_sigma``
    around each segment's means (truncated to >= 1 token, stratified as in
    :meth:`TruncatedLogNormal.sample`). Deterministic for a seed."""
    segments = ((calm_before_min, calm_req_per_min, calm_input_mean_tokens,
                 calm_output_mean_tokens),
                (burst_min, burst_req_per_min, burst_input_mean_tokens, burst_output_mean_tokens),
                (calm_after_min, calm_req_per_min, calm_input_mean_tokens,
                 calm_output_mean_tokens))
    if burst_min <= 0 or calm_before_min < 0 or calm_after_min < 0:
        raise NeuScaleError("bursty trace needs burst_min > 0 and calm periods >= 0")
    rng = np.random.default_rng(seed)
    parts: list[tuple[FloatArray, IntArray, IntArray]] = []
    t0_s = 0.0
    for minutes, rate, in_mean, out_mean in segments:
        if minutes > 0:
            if rate <= 0:
                raise NeuScaleError(f"bursty trace rates must be > 0 (got {rate})")
            n = int(rng.poisson(rate * minutes))
            t = t0_s + np.sort(rng.uniform(0.0, minutes * 60.0, n))
            d_in = TruncatedLogNormal.fit(1, in_mean, math.inf, length_sigma)
            d_out = TruncatedLogNormal.fit(1, out_mean, math.inf, length_sigma)
            parts.append((t, d_in.sample(n, rng), d_out.sample(n, rng)))
        t0_s += minutes * 60.0
    note = (f"SYNTHESISED bursty trace (paper §5.3): {calm_before_min:g} min at "
            f"{calm_req_per_min:g} req/min, {burst_min:g}-min burst at {burst_req_per_min:g} "
            f"req/min, {calm_after_min:g} min at {calm_req_per_min:g} req/min (Poisson); mean "
            f"input/output {calm_input_mean_tokens:g}/{calm_output_mean_tokens:g} tokens -> "
            f"{burst_input_mean_tokens:g}/{burst_output_mean_tokens:g} in the burst "
            f"(log-normal, sigma={length_sigma:g}, >= 1); seed={seed}")
    return Trace("bursty", np.concatenate([p[0] for p in parts]),
                 np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]),
                 note)


# ------------------------------------------------------------------------- presets, loading

_REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """The shared data directory: ``$NEUSCALE_DATA_DIR``, else ``../shared/data`` next to the
    repository root, else ``/work/shared/data``."""
    env = os.environ.get("NEUSCALE_DATA_DIR")
    if env:
        p = Path(env).expanduser()
        if not p.is_dir():
            raise NeuScaleError(f"NEUSCALE_DATA_DIR={env} is not a directory")
        return p
    tried = [_REPO_ROOT.parent / "shared" / "data", Path("/work/shared/data")]
    for p in tried:
        if p.is_dir():
            return p
    raise NeuScaleError(f"trace data directory not found (tried {', '.join(map(str, tried))});"
                        f" set NEUSCALE_DATA_DIR to the directory holding the data README")


_AZURE_DAY = "azure2024/azure2024_code_synth_2024-05-10_scale1.csv.gz"

# name -> (relative file or None for a synthesiser, one-line description)
_PRESET_FILES: dict[str, tuple[str | None, str]] = {
    "azure-code": (_AZURE_DAY, ("Azure 2024 coding, Friday 2024-05-10 at full scale (24 h, "
                                "2.48 M requests; SYNTH from the digitized rate curve and "
                                "length histogram)")),
    "azure-code-2023": ("azure2023/AzureLLMInferenceTrace_code.csv",
                        "Azure 2023 coding service, real, 1 h (8,819 requests)"),
    "azure-conv-2023": ("azure2023/AzureLLMInferenceTrace_conv.csv",
                        "Azure 2023 conversation service, real, 1 h (19,366 requests)"),
    "mooncake": ("mooncake/conversation_trace.jsonl",
                 "Kimi/Mooncake conversation, real, 1 h (12,031 requests, long context)"),
    "servegen-r1": ("servegen/deepseek-r1_sampled_requests.csv",
                    ("DeepSeek-R1 on Alibaba Bailian, 1 day sampled from ServeGen's "
                     "distributions (19,748 requests, long output)")),
    "lveval": (None, ("LV-Eval long-context QA, SYNTHESISED from Table 4 (41 req/min on "
                      "Azure 2024 timestamps; input 8.8K/105K/431K, output 1/17/278)")),
    "openthoughts": (None, ("OpenThoughts reasoning, SYNTHESISED from Table 4 (27 req/min on "
                            "Azure 2024 timestamps; input 5/246/12K, output 531/11.6K/16.8K)")),
    "bursty": (None, ("SYNTHESISED §5.3 burst: 30 min calm, 45 min burst, 45 min calm; "
                      "30 -> 80 req/min, mean input/output 2K/128 -> 100K/5K")),
}

_PRESET_NOTES = {
    "azure-code": "SYNTH day from the data README: Poisson arrivals per minute from the "
                  "digitized 2024 rate curve, inputs from its histogram, outputs resampled from "
                  "the 2023 code trace",
    "servegen-r1": "SYNTH day from the data README: requests drawn from ServeGen's published "
                   "DeepSeek-R1 rate and length distributions",
}

PRESETS: dict[str, str] = {k: v[1] for k, v in _PRESET_FILES.items()}
"""Preset name -> one-line description (for ``--help``)."""


def _preset_file(name: str) -> Path:
    rel = _PRESET_FILES[name][0]
    assert rel is not None
    path = data_dir() / rel
    if not path.is_file():
        raise NeuScaleError(f"preset {name!r}: data file {path} not found in the data directory")
    return path


def _load_preset(name: str, seed: int) -> Trace:
    if name in TABLE4:
        day = _load_file(_preset_file("azure-code"), "azure-code")
        return synth_from_stats(TABLE4[name], day, seed=seed)
    if name == "bursty":
        return synth_bursty(seed=seed)
    return _load_file(_preset_file(name), name, _PRESET_NOTES.get(name, ""))


_HHMM = re.compile(r"^\s*(\d{1,3}):([0-5]\d)(?::([0-5]\d(?:\.\d*)?))?\s*$")


def _parse_start(start: str) -> float:
    m = _HHMM.match(start)
    if not m:
        raise NeuScaleError(f"start must be 'HH:MM' (or 'HH:MM:SS'), got {start!r}")
    return int(m[1]) * 3600.0 + int(m[2]) * 60.0 + (float(m[3]) if m[3] else 0.0)


def load_trace(spec: str, *, hours: float | None = None, start: str | None = None,
               rate_scale: float = 1.0, seed: int = 0) -> Trace:
    """Load a preset (see :data:`PRESETS`) or a trace file (format from its header).

    ``start="HH:MM"`` and ``hours`` cut the window ``[start, start + hours)`` (offsets from
    the trace's t = 0, which for the Azure day is 00:00; either may be omitted: from 0 / to the
    end), re-based so the window starts at 0. Then ``rate_scale`` multiplies the request rate
    (:meth:`Trace.scale_rate`). ``seed`` only affects the synthesised presets.
    """
    t0_s = _parse_start(start) if start is not None else 0.0
    if hours is not None and not (math.isfinite(hours) and hours > 0):
        raise NeuScaleError(f"hours must be a number > 0 (got {hours})")
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise NeuScaleError(f"rate scale must be a finite number > 0 (got {rate_scale})")
    if spec in _PRESET_FILES:
        trace = _load_preset(spec, seed)
    else:
        path = Path(spec).expanduser()
        if not path.exists() and os.sep not in spec and "." not in spec:
            raise NeuScaleError(f"unknown trace preset {spec!r}; presets: "
                                f"{', '.join(PRESETS)} (or give a trace file path)")
        if not path.exists():
            raise NeuScaleError(f"trace file not found: {path} (presets: {', '.join(PRESETS)})")
        trace = _load_file(path)
    if start is not None or hours is not None:
        t1_s = t0_s + hours * 3600.0 if hours is not None else math.inf
        window = trace.slice(t0_s, t1_s)
        if not len(window):
            raise NeuScaleError(f"window [{t0_s:g} s, {t1_s:g} s) of trace {trace.name!r} holds "
                                f"no requests (it spans 0-{trace.duration_s:.0f} s)")
        trace = window
    return trace.scale_rate(rate_scale)

