"""``orchestrator sim bench``: what a capacity planner asks - "what throughput, TTFT and TPOT
would my workload get on this allocation?" - answered by running the simulated engine.

One allocation (model x chip x topology x TP/PP/EP) runs one vLLM-like engine
(:class:`sim.engine.Engine`, mixed prefill and decode) on its step-cost table under a serving-stack
profile (:mod:`dse.stacks`) and the engine limits a deployment sets (``max_num_seqs``,
``max_batched_tokens``, chunked prefill). Workloads:

* ``burst`` - every request at t = 0 (offline throughput);
* ``closed:C`` - C clients, each sending its next request when its previous answer is complete;
* ``poisson:R`` - arrivals at R requests/s (exponential gaps, seeded).

Lengths are fixed (``1024``), integers uniform in a range (``512-1536``) or drawn from a trace
(``trace=NAME``: pairs of the trace's input/output lengths, seeded). A pipeline-parallel vPod
runs ``pp`` virtual engines (vLLM's pipeline virtual engines), requests dealt round-robin.

What is measured, as a benchmark client sees it: a request is *sent* at its arrival, reaches the
engine ``request_s`` later (the profile's HTTP/tokenisation time), and its TTFT and end-to-end
times count from the send. TPOT = (finish - first token) / (output tokens - 1) over requests with
two or more tokens. Throughputs divide by the makespan (first send to last finish). Energy is the
engines' (steps plus idle static power over the makespan); ``j_per_token`` and
``usd_per_mtoken`` are per *output* token.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dse.catalog import Catalog, default_catalog
from dse.errors import NeuScaleError
from dse.stacks import StackProfile, get_stack

#: output columns of one bench row (CSV order)
RESULT_COLUMNS = ["req_per_s", "output_tok_per_s", "total_tok_per_s", "ttft_mean_s",
                  "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p50_s", "tpot_p99_s",
                  "j_per_token", "usd_per_mtoken"]
MAX_REQUESTS = 1_000_000


@dataclass(frozen=True)
class Workload:
    kind: str                 # burst | closed | poisson
    value: float = 0.0        # clients (closed) or requests/s (poisson)

    @classmethod
    def parse(cls, text: str) -> "Workload":
        t = str(text).strip().lower()
        if t == "burst":
            return cls("burst")
        m = re.fullmatch(r"(closed|poisson):\s*([0-9.eE+-]+)", t)
        if not m:
            raise NeuScaleError(f"workload must be burst, closed:C or poisson:R (got {text!r})")
        try:
            v = float(m.group(2))
        except ValueError:
            v = float("nan")
        if m.group(1) == "closed":
            if not (math.isfinite(v) and v >= 1 and v == int(v)):
                raise NeuScaleError(f"closed:C needs a whole number of clients >= 1 (got {text!r})")
        elif not (math.isfinite(v) and v > 0):
            raise NeuScaleError(f"poisson:R needs a rate > 0 requests/s (got {text!r})")
        return cls(m.group(1), v)

    def __str__(self) -> str:
        return "burst" if self.kind == "burst" else f"{self.kind}:{self.value:g}"


@dataclass(frozen=True)
class Lengths:
    """A length distribution: integers uniform in [lo, hi] (lo == hi: fixed)."""
    lo: int
    hi: int

    @classmethod
    def parse(cls, text: Any, what: str) -> "Lengths":
        t = str(text).strip()
        m = re.fullmatch(r"(\d+)\s*(?:-\s*(\d+))?", t)
        if not m:
            raise NeuScaleError(f"{what} must be a number of tokens or a range A-B (got {text!r})")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if lo < 1 or hi < lo:
            raise NeuScaleError(f"{what} must be >= 1 and a range A-B needs A <= B (got {text!r})")
        return cls(lo, hi)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.lo == self.hi:
            return np.full(n, self.lo, dtype=np.int64)
        return rng.integers(self.lo, self.hi + 1, size=n)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


@dataclass
class BenchConfig:
    model: str
    chip: str
    tp: int
    topology: str | None = None
    num_chips: int | None = None
    pp: int = 1
    ep: int = 1
    attn: str = "dp"                  # MoE stage layout (dse.parallel.Parallelism.attn)
    stack: str | StackProfile | None = None
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    chunked_prefill: bool = True
    workload: Workload = field(default_factory=lambda: Workload("burst"))
    requests: int = 100
    input_tokens: Lengths = field(default_factory=lambda: Lengths(1024, 1024))
    output_tokens: Lengths = field(default_factory=lambda: Lengths(128, 128))
    trace: str | None = None          # lengths from this trace instead (preset or file)
    seed: int = 0


def bench_config(get) -> BenchConfig:
    """A :class:`BenchConfig` from ``get(name) -> text or None`` (a CLI argument or a CSV
    cell; blank or missing: the default). One clear error per bad value."""
    defaults = BenchConfig(model="", chip="", tp=1)

    def integer(k: str, default):
        v = get(k)
        if v is None or str(v).strip() == "":
            return default
        try:
            return int(str(v).strip())
        except ValueError:
            raise NeuScaleError(f"{k} must be an integer (got {v!r})") from None

    def text(k: str, default):
        v = get(k)
        return default if v is None or str(v).strip() == "" else str(v).strip()

    chunked = text("chunked_prefill", "true").lower()
    if chunked not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise NeuScaleError(f"chunked_prefill must be true or false (got {chunked!r})")
    for k in ("model", "chip", "tp"):
        if text(k, None) is None:
            raise NeuScaleError(f"{k} is required")
    return BenchConfig(
        model=text("model", None), chip=text("chip", None), tp=integer("tp", None),
        topology=text("topology", None), num_chips=integer("num_chips", None),
        pp=integer("pp", 1), ep=integer("ep", 1), attn=text("attn", "dp"),
        stack=text("stack", defaults.stack),
        max_num_seqs=integer("max_num_seqs", defaults.max_num_seqs),
        max_batched_tokens=integer("max_batched_tokens", defaults.max_batched_tokens),
        chunked_prefill=chunked in ("true", "1", "yes", "on"),
        workload=Workload.parse(text("workload", "burst")),
        requests=integer("requests", defaults.requests),
        input_tokens=Lengths.parse(text("input_tokens", str(defaults.input_tokens)),
                                   "input_tokens"),
        output_tokens=Lengths.parse(text("output_tokens", str(defaults.output_tokens)),
                                    "output_tokens"),
        trace=text("trace", None), seed=integer("seed", 0))


def _lengths(cfg: BenchConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = cfg.requests
    if cfg.trace:
        from .traces import load_trace
        tr = load_trace(cfg.trace)
        inp, out = np.asarray(tr.input_tokens), np.asarray(tr.output_tokens)
        if len(inp) == 0:
            raise NeuScaleError(f"trace {cfg.trace!r} has no requests")
        idx = rng.integers(0, len(inp), size=n)
        return np.maximum(inp[idx], 1).astype(np.int64), np.maximum(out[idx], 1).astype(np.int64)
    return cfg.input_tokens.draw(rng, n), cfg.output_tokens.draw(rng, n)


def _pct(x: np.ndarray, q: float) -> float | None:
    return float(np.percentile(x, q)) if len(x) else None


def run(cfg: BenchConfig, catalog: Catalog | None = None) -> dict[str, Any]:
    """Run the workload on the allocation; the result row (``RESULT_COLUMNS`` and context)."""
    from dse.allocation import parse_allocation

    from .chip import ChipModel
    from .engine import Engine
    from .stepcost import PipelineShare, StepCostTable

    if not 1 <= cfg.requests <= MAX_REQUESTS:
        raise NeuScaleError(f"requests must be between 1 and {MAX_REQUESTS:,} (got "
                            f"{cfg.requests})")
    for k in ("max_num_seqs", "max_batched_tokens"):
        if getattr(cfg, k) < 1:
            raise NeuScaleError(f"{k} must be >= 1 (got {getattr(cfg, k)})")
    catalog = catalog or default_catalog()
    stack = get_stack(cfg.stack)
    arch, chip, topo, par = parse_allocation(catalog, cfg.model, cfg.chip, cfg.num_chips,
                                             cfg.topology, cfg.tp, cfg.pp, cfg.ep, cfg.attn)
    cm = ChipModel(arch, chip, topo, par, stack)
    if cm.kv_capacity_tokens() <= 0:
        raise NeuScaleError(f"{arch.name} does not fit on {par.chips} {chip.name} chip(s) with "
                            f"{par}: {cm.weights_bytes() / 1e9:.1f} GB of weights per chip, "
                            f"{chip.hbm_bytes / 1e9:.1f} GB of HBM")
    from dse.cache import cache_path
    table = StepCostTable(cm, cache_dir=cache_path("stepcost"))
    cost = table if par.pp == 1 else PipelineShare(table, par.pp)
    per_engine = max(1, math.ceil(cfg.max_num_seqs / par.pp))
    engines = [Engine(cost, "mixed", max_batch=per_engine,
                      max_batched_tokens=max(cfg.max_batched_tokens, per_engine),
                      chunked_prefill=cfg.chunked_prefill, mixed_prefill=stack.mixed_prefill,
                      start_s=0.0) for _ in range(par.pp)]

    rng = np.random.default_rng(cfg.seed)
    inp, out = _lengths(cfg, rng)
    n = cfg.requests
    delay = stack.request_s
    sent = np.zeros(n)
    wl = cfg.workload

    def submit(i: int, t_s: float) -> None:
        sent[i] = t_s
        try:
            engines[i % par.pp].submit(i, t_s + delay, int(inp[i]), int(out[i]))
        except ValueError as e:
            raise NeuScaleError(str(e)) from None

    if wl.kind in ("burst", "poisson"):
        if wl.kind == "burst":
            times = np.zeros(n)
        else:
            times = np.cumsum(rng.exponential(1.0 / wl.value, size=n))
            times -= times[0]
        for i in range(n):
            submit(i, float(times[i]))
        for e in engines:
            e.run_until_idle()
    else:                                   # closed loop: the next request on each answer
        nxt = 0
        for _ in range(min(int(wl.value), n)):
            submit(nxt, 0.0)
            nxt += 1
        while True:
            ts = [(t, e) for e in engines if (t := e.next_event_time()) is not None]
            if not ts:
                break
            t, e = min(ts, key=lambda x: x[0])
            for r in e.advance_to(t):
                if nxt < n:
                    submit(nxt, r.finish_s)
                    nxt += 1

    reqs = [r for e in engines for r in e.finished]
    if len(reqs) != n:                       # every request finishes: the engine never drops
        raise NeuScaleError(f"only {len(reqs)} of {n} requests finished")
    reqs.sort(key=lambda r: r.req_id)
    first = np.array([r.first_token_s for r in reqs])
    fin = np.array([r.finish_s for r in reqs])
    ttft = first - sent
    multi = out > 1
    tpot = (fin[multi] - first[multi]) / (out[multi] - 1)
    span = float(fin.max() - sent.min())
    span = span if span > 0 else float("nan")
    for e in engines:
        e.advance_to(float(fin.max()))       # idle static power to the common end
    energy = sum(e.energy_j() for e in engines)
    n_out, n_in = int(out.sum()), int(inp.sum())
    usd = chip.vpod_usd(par.chips, span)
    return {
        "model": arch.name, "chip": chip.name, "topology": str(topo), "num_chips": par.chips,
        "tp": par.tp, "pp": par.pp, "ep": par.ep, "attn": par.attn, "stack": stack.name,
        "max_num_seqs": cfg.max_num_seqs, "max_batched_tokens": cfg.max_batched_tokens,
        "chunked_prefill": cfg.chunked_prefill, "workload": str(wl), "requests": n,
        "input_tokens": cfg.trace and f"trace={cfg.trace}" or str(cfg.input_tokens),
        "output_tokens": cfg.trace and f"trace={cfg.trace}" or str(cfg.output_tokens),
        "makespan_s": span,
        "req_per_s": n / span, "output_tok_per_s": n_out / span,
        "total_tok_per_s": (n_in + n_out) / span,
        "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_mean_s": float(tpot.mean()) if len(tpot) else None,
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "j_per_token": energy / n_out, "usd_per_mtoken": usd / n_out * 1e6,
        "preemptions": sum(e.preemptions for e in engines),
        "kv_capacity_tokens": table.kv_capacity_tokens,
    }
