"""What an allocation costs at a given load (paper §3.3-3.4; the load-aware choice).

A best fit is the most efficient allocation *at full batch*. At a light load a group runs far
below that batch and its energy (or dollars) is mostly the static power (or price) of however
many vPods are up, so the cheapest allocation depends on the load. :class:`ChipModelPricer`
prices an allocation (a Pareto point: chip, pod shape, TP/PP/EP, batch) at a sequence length on
the chip model (the same step-cost tables the simulated engines run on, so a pick is verified
where it will run):

* ``latency_s`` - TTFT of the batch (prefill) or TPOT (decode) at that length, the DSE's
  definition (pipeline-parallel micro-batches included);
* ``throughput_tok_per_s`` - the whole vPod at that batch in steady state;
* ``dyn_j_per_token`` - the energy of those steps beyond static power, per token;
* ``static_w`` and ``usd_per_s`` - the vPod's static power and price, paid whether busy or not;
* ``startup_s`` - Table 3's creation + engine start + weight download and load (the time a new
  vPod costs static power before it serves).

:func:`cost_per_s` turns these into the cost of serving a load: ``N`` vPods
(:func:`servers_for_window` over the window's demand in vPods: tokens/s over the throughput at
each bucket's length) paying static cost, plus the dynamic energy of the tokens.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol, Sequence

import numpy as np
from scipy.special import gammaln, pdtr

from dse.catalog import Catalog
from dse.models import ModelArch
from dse.parallel import max_weights_bytes
from sim.chip import ChipModel
from sim.lifecycle import CREATE_S, ENGINE_START_S, LOAD_BW_BYTES_PER_S
from sim.vpod import gated_depth as vpod_gated_depth


@dataclass(frozen=True)
class Alloc:
    """An allocation a group may run: a Pareto point of the DSE."""
    chip: str
    topology: str
    num_chips: int
    tp: int
    pp: int
    ep: int
    batch: int
    attn: str = "dp"     # MoE stage layout (dse.parallel.Parallelism.attn)

    @property
    def key(self) -> tuple[str, str, int, int, int, str]:
        return (self.chip, self.topology, self.tp, self.pp, self.ep, self.attn)


@dataclass(frozen=True)
class PointCost:
    latency_s: float
    throughput_tok_per_s: float
    dyn_j_per_token: float
    static_w: float
    usd_per_s: float
    startup_s: float
    # batches a vPod holds at once: its latency over its cycle (the interval at which it takes
    # the next batch) - a pipeline's stages each hold one, so ~pp for a batch-1 PP vPod; 1
    # without a pipeline (a step takes what waits when it starts)
    in_flight: float = 1.0
    # the batch the vPod runs at this length: its max batch, or as many sequences as its KV
    # cache holds (``ChipModel.batch_at``) - an allocation built for shorter sequences serves
    # a longer bucket at the batch its engine admits (the simulated engine's KV blocks, vLLM's
    # scheduler), not at the one it was built for; ``fits``: at least one sequence
    batch: int = 1
    fits: bool = True


class Pricer(Protocol):
    def cost(self, alloc: Alloc, phase: str, length: int) -> PointCost: ...


class ChipModelPricer:
    """Prices allocations on the per-operator chip model (what ``dse verify`` runs; memoised
    per allocation, phase and length): the DSE's pipelined view of a batch - latency of the
    batch, steady-state cycle, energy per cycle."""

    def __init__(self, arch: ModelArch, catalog: Catalog, stack=None):
        """``stack``: the serving-stack profile of the engines (the database's: ``db.stack``)."""
        self.arch, self.catalog, self.stack = arch, catalog, stack
        self._models: dict[tuple, ChipModel] = {}
        self._memo: dict[tuple, PointCost] = {}

    def cost(self, alloc: Alloc, phase: str, length: int) -> PointCost:
        key = (alloc, phase, int(length))
        c = self._memo.get(key)
        if c is None:
            c = self._memo[key] = self._price(alloc, phase, int(length))
        return c

    def _price(self, a: Alloc, phase: str, n: int) -> PointCost:
        cm = self._models.get(a.key)
        if cm is None:
            cm = self._models[a.key] = ChipModel.of(self.arch, self.catalog, *a.key[:5],
                                                    stack=self.stack, attn=a.attn)
        held = min(a.batch, cm.batch_at(n))
        r = cm.step(phase, max(1, held), n)
        static_w = cm.hw.static_power_w * cm.par.chips
        chip = self.catalog.get(a.chip)
        shard = max_weights_bytes(self.arch, cm.par)
        startup = (sum(CREATE_S) / 2 + ENGINE_START_S + shard / chip.dcn_bw_bytes_per_s
                   + shard / LOAD_BW_BYTES_PER_S)
        return PointCost(latency_s=r.latency_s, throughput_tok_per_s=r.throughput_tok_per_s,
                         dyn_j_per_token=max(0.0, r.energy_j - static_w * r.cycle_s) / r.tokens,
                         static_w=static_w, usd_per_s=chip.vpod_usd(a.num_chips, 1.0),
                         startup_s=startup, in_flight=r.latency_s / r.cycle_s,
                         batch=max(1, held), fits=held >= 1)


class CalibratedPricer:
    """A pricer whose latencies and throughputs carry the live correction factors of
    :class:`orchestrator.calibration.Calibration` (latency x f, throughput / f; the dynamic
    energy per token is the same work). ``version`` changes with the factors, so a policy
    knows when its cached fronts are stale."""

    def __init__(self, base: Pricer, calibration):
        self.base, self.calibration = base, calibration

    @property
    def version(self) -> int:
        return self.calibration.version

    def factor(self, alloc: Alloc, phase: str) -> float:
        return self.calibration.factor((*alloc.key, phase))

    def cost(self, alloc: Alloc, phase: str, length: int) -> PointCost:
        c = self.base.cost(alloc, phase, length)
        f = self.factor(alloc, phase)
        if f == 1.0:
            return c
        return replace(c, latency_s=c.latency_s * f, throughput_tok_per_s=c.throughput_tok_per_s / f)


@dataclass(frozen=True)
class LoadCost:
    """A candidate's cost of serving a load."""
    vpods: int                  # servers_for_window over the window's demand
    per_s: float                # J/s (energy) or $/s (cost)
    per_token: float            # per served token at the mean load
    demand_peak: float          # vPods' worth of work at the peak


# servers up to which Erlang B's recursion (n steps) is cheaper than its closed form, for one
# load (a grid of loads takes the closed form at every n: :func:`_erlang_c_grid`)
_RECURSE_UP_TO = 32


def erlang_c(n: int, a: float) -> float:
    """Probability that an arrival waits in an M/M/n queue with offered load ``a`` (< n)."""
    if n > _RECURSE_UP_TO:
        return float(_erlang_c_vec(n, np.array([float(a)]))[0])
    b = 1.0
    for k in range(1, n + 1):                      # Erlang B by the stable recursion
        b = a * b / (k + a * b)
    return n * b / (n - a * (1.0 - b))


def gated_depth(a: "Alloc") -> int:
    """The virtual engines of a prefill vPod of allocation ``a`` whose first stage admits one
    prompt at a time (:func:`sim.vpod.gated_depth`), else 1."""
    return vpod_gated_depth(a.batch, a.pp)


# one bucket's prompt lengths spread over it: uniform over the upper half of a doubling, a
# cycle proportional to the length: cv^2 = (1/12)(1/2)^2 / (3/4)^2 = 1/27
WITHIN_BUCKET_CV2 = 1.0 / 27.0
_CV2_GRID = (0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def pipeline_throughput(cycle_s, in_flight, depth: int) -> float:
    """Prompts per second a batch-1 pipeline of ``depth`` virtual engines passes when it is
    never short of prompts (in order; ``cycle_s[i]``: prompt i's first-stage time, ``in_flight``
    its latency over that): it starts a prompt when its first stage is free and one of its
    engines has finished the prompt it held for the whole pass (``sim.vpod.VPodEngines``)."""
    free = [0.0] * depth
    stage = first = None
    n = 0
    for c, m in zip(cycle_s, in_flight):
        n += 1
        f = heapq.heappop(free)
        start = f if stage is None else max(f, stage)
        if first is None:
            first = start
        stage = start + c
        heapq.heappush(free, start + m * c)
    return n / (stage - first) if stage is not None and stage > first else math.inf


@lru_cache(maxsize=256)
def _efficiency_at(depth: int, cv2: float) -> float:
    if cv2 <= 0.0 or depth <= 1:
        return 1.0
    rng = np.random.default_rng(depth)            # fixed: the same answer every call
    c = rng.gamma(1.0 / cv2, cv2, 4000)
    return min(1.0, pipeline_throughput(c.tolist(), [float(depth)] * len(c), depth)
               * float(c.mean()))


def pipeline_efficiency(depth: int, cv2: float) -> float:
    """A batch-1 pipeline's saturation throughput over its nominal one (``depth`` prompts per
    latency) for first-stage times of squared coefficient of variation ``cv2`` (gamma
    distributed; interpolated on a grid): identical prompts lose nothing (a prompt enters as
    the one ``depth`` back leaves), mixed ones lose what a long prompt holding its engine for
    the whole pass leaves the stage idle - 0.82-0.87 for depth 2-16 at the Azure coding
    prompts' cv^2 of 0.75 (the same recursion over those prompts on Llama3-70B TP 2 PP 4:
    0.823, gamma 0.825)."""
    if depth <= 1:
        return 1.0
    x = min(max(cv2, 0.0), _CV2_GRID[-1])
    k = next(i for i in range(1, len(_CV2_GRID)) if _CV2_GRID[i] >= x)
    lo, hi = _CV2_GRID[k - 1], _CV2_GRID[k]
    f = (x - lo) / (hi - lo)
    return (1 - f) * _efficiency_at(depth, lo) + f * _efficiency_at(depth, hi)


def mix_slack(latency_s, cycle_s, slo_s, requests, depth: int = 1) -> tuple:
    """A prefill group's queue over the mix of its buckets: each bucket's share of the
    requests (``requests``: a rate or count per bucket; none at all counts them alike) and its
    slack, the time its SLO leaves beyond its latency in units of the mix's mean cycle times
    Allen-Cunneen's (1 + c_s^2) - a wait in an M/G/k queue decays with time over
    E[S] (1 + c_s^2) / 2, so that slack is what the M/D/k test of :func:`servers_needed`
    takes. E[S] (1 + c_s^2) = E[S^2] / E[S], so a short prompt queued behind the mix's long
    ones has less slack than in its own cycles (what the tightest bucket's slack in its own
    cycles, the rule before, assumed), and a long one more. One bucket: the rule before.

    Third: the share of its nominal throughput the vPod passes - for a batch-1 pipeline
    (``depth`` > 1, :func:`gated_depth`) :func:`pipeline_efficiency` at the mix's cv^2 (the
    buckets' own spread, :data:`WITHIN_BUCKET_CV2`, added), else 1."""
    lat, cyc, slo = (np.asarray(x, dtype=np.float64) for x in (latency_s, cycle_s, slo_s))
    q = np.maximum(np.asarray(requests, dtype=np.float64), 0.0)
    w = q / q.sum() if q.sum() > 0 else np.full(len(q), 1.0 / max(1, len(q)))
    m1, m2 = float(w @ cyc), float(w @ (cyc * cyc))
    s = np.maximum(slo - lat, 0.0) * (m1 / m2 if m2 > 0 else 0.0)
    eta = (pipeline_efficiency(depth, (m2 / (m1 * m1) - 1.0 if m1 > 0 else 0.0)
                               + WITHIN_BUCKET_CV2) if depth > 1 else 1.0)
    return w, s, eta


def servers_needed(a: float, slack, per_vpod: int = 1, pooled: bool = True,
                   miss: float = 0.05, cap: int = 4096) -> int:
    """vPods for ``a`` vPods' worth of work, each vPod ``per_vpod`` servers (the requests it
    holds at once: its batch, pipeline stages included), when a request may wait ``slack``
    service times (its SLO over its latency, minus 1): the fewest vPods for which the
    probability of waiting longer is at most ``miss``.

    Waits are M/M/k's (Erlang C: C(k, b) exp(-(k - b) t) for k servers, b busy on average)
    scaled for deterministic service by Allen-Cunneen's (c_a^2 + c_s^2) / 2 = 1/2 (Poisson
    arrivals; work of a given length takes a given time): C(k, b) exp(-2 (k - b) slack).
    ``pooled``: the vPods share one queue (k = n x per_vpod: requests routed to the vPod with
    the least outstanding work, as prefill is); else every vPod is a queue of its own with a /
    n of the load (a decoding request holds its slot to the end and cannot move).
    ``slack = inf``: ``ceil(a)``, the paper's N = R / T. ``slack`` may also be a mix
    ``(weights, slacks[, efficiency])`` (:func:`mix_slack`): then the share of the requests that
    wait past their own slack is at most ``miss``, C(k, b) sum_i w_i exp(-2 (k - b) slack_i),
    the work ``a`` counted at the share of the nominal throughput the vPods pass."""
    if a <= 0:
        return 0
    w, sl, eta = _queue_of(slack, pooled)
    a = a / eta
    slack = float(sl.min())
    n_vpods = max(1, math.ceil(a - 1e-9))
    if math.isinf(slack):
        return n_vpods
    k = max(1, int(per_vpod))
    s = max(slack, 0.0)
    if not pooled:
        # every vPod is the same k-server queue: the busiest it may run is a constant of
        # (k, slack, miss), so n is the fewest vPods that keep each below it
        b_max = _max_busy(k, round(s, 6), miss)
        return min(cap, max(n_vpods, math.ceil(a * k / b_max - 1e-9)))
    busy = a * k                        # one pooled queue of n_vpods x k servers
    while n_vpods < cap:
        servers = n_vpods * k
        if busy < servers:
            late = (math.exp(-2.0 * (servers - busy) * s) if w is None
                    else float(w @ np.exp(-2.0 * (servers - busy) * sl)))
            if erlang_c(servers, busy) * late <= miss:
                break
        n_vpods += 1
    return n_vpods


def _queue_of(slack, pooled: bool) -> tuple[np.ndarray | None, np.ndarray, float]:
    """:func:`servers_needed`'s ``slack`` argument as (class weights, or None for one class
    or queues of their own - then the tightest slack counts; the classes' slacks, at least 0;
    the share of nominal throughput the vPods pass)."""
    if not isinstance(slack, tuple):
        return None, np.array([max(float(slack), 0.0)]), 1.0
    eta = max(slack[2], 1e-3) if len(slack) > 2 else 1.0
    w, sl = (np.asarray(x, dtype=np.float64) for x in slack[:2])
    sl = np.maximum(sl, 0.0)
    if len(sl) < 2 or not pooled:
        return None, np.array([float(sl.min()) if len(sl) else math.inf]), eta
    return w, sl, eta


def _levels(demand, bins: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """A window's demand samples as at most ``bins`` levels and their shares of the window's
    requests (a sample's share is its demand: requests are work here): the samples sorted and
    cut into runs of equal count, each run at its highest sample (rounding up, so the miss it
    gives is an upper bound of the samples')."""
    a = np.sort(np.maximum(np.asarray(demand, dtype=np.float64).ravel(), 0.0))
    if len(a) > bins:
        cuts = _cuts(len(a), bins)
        lv, wt = a[cuts[1:] - 1], np.add.reduceat(a, cuts[:-1])
    else:
        lv, wt = a, a.copy()
    keep = wt > 0
    lv, wt = lv[keep], wt[keep]
    total = float(wt.sum())
    return lv, (wt / total if total > 0 else wt)


@lru_cache(maxsize=256)
def _cuts(n: int, bins: int) -> np.ndarray:
    return np.unique(np.linspace(0, n, bins + 1).astype(np.int64))


def _erlang_c_vec(n: int, a: np.ndarray) -> np.ndarray:
    """:func:`erlang_c` for many offered loads at once (1 where ``a >= n``)."""
    return _erlang_c_grid(np.array([n]), a)[0]


@lru_cache(maxsize=4096)
def _miss_curve(k: int, slack: float) -> np.ndarray:
    """A k-server queue's share of requests that wait past ``slack`` service times
    (:func:`servers_needed`'s test) at utilisations 0, 1/512, ..., 1."""
    rho = np.linspace(0.0, 1.0, 513)
    b = rho * k
    return np.where(rho < 1.0, _erlang_c_vec(k, b) * np.exp(-2.0 * (k - b) * slack), 1.0)


def window_miss(n_vpods: int, levels: np.ndarray, shares: np.ndarray, slack, per_vpod: int = 1,
                pooled: bool = True) -> float:
    """The share of a window's requests that wait past their slack on ``n_vpods`` vPods, the
    window's load quasi-static (each level a steady state of its own: a level's queue settles
    within seconds of prefill or a decode slot's stay, well inside the 10-s samples it
    stands for); a level at or above the vPods' capacity misses for all its requests.
    ``slack``: as :func:`servers_needed` (a number, or a mix ``(weights, slacks[, eta])``,
    whose efficiency the caller has already divided the levels by)."""
    return float(window_misses(np.array([n_vpods]), levels, shares, slack, per_vpod,
                               pooled)[0])


def window_misses(n_vpods: np.ndarray, levels: np.ndarray, shares: np.ndarray, slack,
                  per_vpod: int = 1, pooled: bool = True) -> np.ndarray:
    """:func:`window_miss` for several vPod counts at once (one Erlang pass for all)."""
    ns = np.asarray(n_vpods, dtype=np.int64)
    levels = np.asarray(levels, dtype=np.float64)
    if not len(levels):
        return np.zeros(len(ns))
    k = max(1, int(per_vpod))
    w, sl, _ = _queue_of(slack, pooled)
    w = np.ones(1) if w is None else np.maximum(w, 0.0)
    pos = np.maximum(ns, 1)
    if not pooled:                  # every vPod its own k-server queue at levels / n
        rho = np.minimum(levels[None, :] / pos[:, None], 1.0)
        curve = _miss_curve(k, round(float(sl.min()), 6))
        m = curve[np.minimum(np.ceil(rho * 512 - 1e-9).astype(int), 512)]   # rounded up
    else:
        servers = (pos * k).astype(np.float64)[:, None]
        busy = (levels * k)[None, :]
        late = np.exp(-2.0 * np.maximum(servers - busy, 0.0)[:, :, None] * sl) @ (w / w.sum())
        m = np.where(busy < servers, _erlang_c_grid(pos * k, levels * k) * late, 1.0)
    return np.where(ns > 0, np.minimum(m, 1.0) @ shares, 1.0)


def _erlang_c_grid(servers: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Erlang C for server counts ``servers`` (rows) and offered loads ``a`` (columns; 1
    where ``a >= n``). Erlang B is a Poisson(a) variable's P(X = n) / P(X <= n): in closed
    form a few array operations whatever n, where the textbook recursion takes n of them
    (pools of hundreds of servers are sized thousands of times a plan). For a grid the closed
    form is the cheaper at every n (8 counts x 24 loads: ~45 us against the recursion's
    70-130 us at 8-32 servers) and agrees with the recursion to 1e-14; the scalar
    :func:`erlang_c` keeps the recursion up to ``_RECURSE_UP_TO``."""
    n = np.asarray(servers, dtype=np.int64)
    if n.ndim == 1 and (n.size < 2 or bool(np.all(n[1:] > n[:-1]))):   # sorted, distinct
        uniq, row = n, slice(None)
    else:
        uniq, row = np.unique(n, return_inverse=True)
    a = np.asarray(a, dtype=np.float64)
    s = uniq.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        b_at = np.exp(s * np.log(a) - a - gammaln(s + 1.0)) / pdtr(s, a)
        c = s * b_at / (s - a * (1.0 - b_at))
    return np.where(a < s, np.clip(np.where(a > 0, c, 0.0), 0.0, 1.0), 1.0)[row]


def rising(demand, sigmas: float = 2.0) -> float:
    """The growth per sample of a demand series that its noise does not explain: the
    least-squares slope less ``sigmas`` standard errors, or 0. A light load's 10-s samples
    scatter +-20 % and more, so only a long or steep rise passes; a heavy one's a few per
    cent, so its ramps count. The standard error is the residuals' with their lag-1
    autocorrelation rho counted (AR(1): the variance x (1 + rho) / (1 - rho)): decode's
    samples are tokens of requests that run for minutes, so a slow swell of them looks like a
    trend to independent-noise arithmetic."""
    a = np.asarray(demand, dtype=np.float64).ravel()
    n = a.size
    if n < 8:
        return 0.0
    t = np.arange(n, dtype=np.float64) - (n - 1) / 2.0
    stt = float(t @ t)
    slope = float(t @ a) / stt
    resid = a - float(a.mean()) - slope * t
    ss = float(resid @ resid)
    rho = min(max(float(resid[1:] @ resid[:-1]) / ss, 0.0), 0.95) if ss > 0 else 0.0
    se = math.sqrt(ss / (n - 2) / stt * (1.0 + rho) / (1.0 - rho))
    return max(0.0, slope - sigmas * se)


def servers_for_window(demand, slack, per_vpod: int = 1, pooled: bool = True,
                       miss: float = 0.05, cap: int = 4096, recent: int = 0,
                       ahead: float = 0.0) -> int:
    """The fewest vPods for which at most ``miss`` of a window's requests wait past their
    slack (:func:`window_miss` over the window's demand samples, in vPods), where
    :func:`servers_needed` holds every sample to it: the SLO is a share of requests, and a
    10-s sample's peak above the window's level is mostly the Poisson noise the queue model
    already counts (a chat load of ~2 prompts/s: ~20 a sample, +-22 %). Never more than
    the peak sample's answer, but for ``ahead``; ``slack = inf``: that answer (the paper's
    N = R / T).
    ``recent``: the target holds over the last ``recent`` samples too (a rising load's last
    epoch is what the next one resembles, not the window's average). ``ahead``: samples from
    the window's end to when a larger allocation ordered at the next plan could serve (an
    epoch and a start-up): those last samples are taken at the level the window's rise
    (:func:`rising`, 0 without a significant one) reaches by then - what is sized now serves
    until then (a load rising 50 % over the window and on: sized for the window, the next
    40 samples' requests missed 1.6-14.7 % in an FCFS queue, carried 0-0.7 %;
    ``tests/orchestrator/test_queue_model.py``)."""
    a = np.maximum(np.asarray(demand, dtype=np.float64).ravel(), 0.0)
    if 0 < recent < a.size:
        tail = a[-recent:]
        g = rising(a) if ahead > 0 else 0.0
        if g > 0:
            tail = tail + g * (ahead + np.arange(recent, 0, -1, dtype=np.float64))
        return max(servers_for_window(a, slack, per_vpod, pooled, miss, cap),
                   servers_for_window(tail, slack, per_vpod, pooled, miss, cap))
    if not a.size or float(a.max()) <= 0.0:
        return 0
    if not isinstance(slack, tuple) and math.isinf(slack):
        return servers_needed(float(a.max()), slack, per_vpod, pooled, miss, cap)
    lv, sh = _levels(a / _queue_of(slack, pooled)[2])
    # fewer than (1 - miss) x the mean leaves at least ``miss`` of the work above capacity;
    # the miss only falls with more vPods, and the peak sample's answer passes (every level
    # is at most the peak): the first count from the bound up that passes, tried in batches
    lo, width = max(1, math.ceil((1.0 - miss) * float(a.mean()) - 1e-9)), 8
    if not pooled:                  # the peak's answer is a constant's multiple: one pass
        hi = servers_needed(float(a.max()), slack, per_vpod, pooled, miss, cap)
        width = max(hi - lo + 1, 1)
    while lo < cap:
        ns = np.arange(lo, min(cap, lo + width - 1) + 1)
        ok = np.nonzero(window_misses(ns, lv, sh, slack, per_vpod, pooled) <= miss)[0]
        if ok.size:
            return int(ns[ok[0]])
        lo, width = int(ns[-1]) + 1, width * 2
    return cap


@lru_cache(maxsize=4096)
def _max_busy(k: int, slack: float, miss: float) -> float:
    """The largest mean number of busy servers ``b`` of a k-server queue for which a request
    waits longer than ``slack`` service times with probability at most ``miss``
    (:func:`servers_needed`'s test, which only grows with ``b``): bisection to 1e-9 of k."""
    def ok(b: float) -> bool:
        return erlang_c(k, b) * math.exp(-2.0 * (k - b) * slack) <= miss
    lo, hi = 0.0, float(k)
    while hi - lo > 1e-9 * k:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return max(lo, 1e-9)


def static_per_s(c: PointCost, metric: str) -> float:
    """What a vPod of this allocation costs per second whether busy or not: its static power
    (metric energy, W) or its price (metric cost, $/s)."""
    return c.static_w if metric == "energy" else c.usd_per_s


def cost_per_s(costs: Sequence[PointCost], peak_rates: np.ndarray, mean_rates: Sequence[float],
               metric: str, slack: float = math.inf, per_vpod: int = 1,
               pooled: bool = True, recent: int = 0, ahead: float = 0.0) -> LoadCost:
    """Serving per-bucket token rates with one allocation (``costs[k]``: its numbers at bucket
    ``k``'s length). ``peak_rates``: samples x buckets (the window), sizing the vPods
    (:func:`servers_for_window` with the allocation's ``slack``, the last ``recent`` samples
    too, projected ``ahead`` samples on a significant rise); ``mean_rates``: tokens/s per
    bucket, paying the dynamic energy."""
    inv_t = np.array([1.0 / c.throughput_tok_per_s for c in costs])
    demand = np.asarray(peak_rates, dtype=np.float64) @ inv_t if len(inv_t) else np.zeros(1)
    peak = float(demand.max()) if demand.size else 0.0
    n = servers_for_window(demand, slack, per_vpod, pooled, recent=recent, ahead=ahead)
    per_s = n * static_per_s(costs[0], metric)
    if metric == "energy":
        per_s += sum(r * c.dyn_j_per_token for r, c in zip(mean_rates, costs))
    total = float(sum(mean_rates))
    return LoadCost(n, per_s, per_s / total if total > 0 else math.inf, peak)


def startup_cost(c: PointCost, vpods: int, metric: str) -> float:
    """What starting ``vpods`` new vPods costs before they serve (Table 3's start-up at static
    power or price)."""
    return vpods * c.startup_s * static_per_s(c, metric)


__all__ = ["Alloc", "ChipModelPricer", "LoadCost", "PointCost", "Pricer", "cost_per_s",
           "erlang_c", "gated_depth", "mix_slack", "pipeline_efficiency",
           "pipeline_throughput", "rising", "servers_for_window", "servers_needed", "startup_cost",
           "static_per_s", "window_miss", "window_misses"]
