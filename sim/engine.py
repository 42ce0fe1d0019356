"""A simulated vLLM-like inference engine on one vPod (paper §4, "Simulator").

The engine never sleeps and never reads a clock: time is always passed in. A discrete-event
cluster simulator drives it in virtual time (``next_event_time()`` then ``advance_to(t)``); an
HTTP backend can drive it in real time by calling ``advance_to(now)`` from its event loop.

Model
-----
*Hardware.* The engine's only dependency on hardware is a :class:`StepCost`: the latency (s) and
energy (J, whole vPod, static power during the step included) of one engine step, plus the
vPod's KV-cache capacity and host-swap bandwidth. :class:`AffineStepCost` is a hand-checkable
two-term roofline; the chip-model-backed cost model implements the same protocol.

*Requests.* A request has ``prompt_tokens`` and ``output_tokens``. ``kv_ready_tokens`` prompt
tokens already have their KV on the vPod (prefix hit); at least the last prompt token is always
recomputed, as vLLM does. The step that processes a request's last prompt token emits its first
output token; every later step in which it is scheduled emits one more.

*Modes.* ``"mixed"`` prefills and decodes. ``"prefill"`` (P/D disaggregation, prefill side): a
request is finished, with ``prefill_done=True``, as soon as its first token exists; its KV
leaves the vPod (the transfer is the cluster's business). ``"decode"``: the request arrives with
its whole prompt KV (``kv_ready_tokens`` is taken to be ``prompt_tokens``) and its first output
token (made by the prefill vPod; ``first_token_s`` is set to ``arrival_s``); the engine decodes
the remaining ``output_tokens - 1`` tokens.

*Scheduling* (continuous batching with chunked prefill, vLLM v0 style), at the start of a step:

1. arrivals up to now join the tail of the waiting queue;
2. every running request that is decoding gets one token, oldest admission first. Its KV grows
   by one token (the previous output token is written); when that crosses a block boundary it
   needs a new KV block of ``block_tokens``. If no block is free, the **most recently admitted**
   running request (possibly itself) is preempted by swapping its KV to host memory: it costs
   ``kv_tokens * kv_bytes_per_token / host_bw_bytes_per_s`` seconds, added to this step, and
   the request goes back to the front of the waiting queue;
3. running requests still prefilling get prompt chunks, oldest first, from the token budget
   ``max_batched_tokens`` left after the decodes;
4. unless step 2 preempted, waiting requests are admitted strictly FCFS while the batch has
   fewer than ``max_batch`` sequences, the token budget is not exhausted and their KV blocks
   fit. Admission allocates the blocks of the whole prompt (a request that is decoding:
   of its KV plus the token it writes next). A swapped-out request pays the same swap time
   again to come back. An admitted request is scheduled in the same step (a prompt chunk, or
   one decode token).

A step's latency is ``cost.step(prefill_tokens, prefill_ctx, n_decode, decode_kv)`` plus its
swap time. ``prefill_ctx`` sums, over the step's prompt tokens, the number of keys each one
attends to (a chunk of ``n`` tokens at position ``p``: ``n*p + n*(n+1)/2``); ``decode_kv`` sums
the KV lengths of the decoding sequences, the token written in this step included.

*Fast path.* While a batch only decodes and nothing can change it (no request can be admitted,
none finishes, no block allocation fails), consecutive steps differ only in ``decode_kv``,
which grows by ``n_decode`` per step. The engine then plans a whole *run* of ``k`` steps at
once: ``k`` is the smallest of the earliest finish, the step at which the KV blocks run out
(closed form below) and, when the waiting queue is empty, the first step starting at or after
the next pending arrival (unless that arrival's blocks do not fit: it and every later arrival
will wait for the run to end). A request submitted while a run is planned is treated the same
way, so when a request is submitted does not matter as long as it is before the engine's clock
passes its arrival: slices, ``next_event_time()`` driving and up-front submission give the same
schedule, bit for bit. One vectorised ``cost.step`` call prices all ``k`` steps; a cumulative
sum gives their end times; consuming any number of them is O(number of running requests).
Block exhaustion: sequence ``i`` with KV ``kv_i`` holding ``b_i`` blocks needs a new block at
steps ``s_i + m*block_tokens`` (``s_i = b_i*block_tokens - kv_i``, ``m = 0, 1, ...``); with
``F`` free blocks the first failing step is the ``F``-th (0-based) of these events in time
order, ``sorted(s)[F % n] + (F // n) * block_tokens``. ``exact=True`` runs the same schedule one
step per Python iteration (the reference the fast path is tested against).

*Abort.* ``abort(record)`` takes a request out at the engine's clock (a client went away, as
vLLM aborts it): out of the queue, or out of the batch with its KV blocks freed; the steps
already run stay (its tokens and their energy are counted), the steps from the clock on are
planned without it, and it is never reported as finished.

*Accounting.* Energy = the steps' energies + static power x chips over swap time and idle time.
Chip-seconds = chips x elapsed time since ``start_s`` (the time the vPod came up, default 0;
``None``: the first request's arrival). Busy time includes swap time.

*One protocol.* :class:`Engine` and the event-driven :class:`sim.fastengine.PrefillEngine` and
:class:`sim.fastengine.DecodeEngine` all satisfy :class:`SimEngine`, the interface a driver
(the cluster simulator, a wall-clock server, a router or a metrics endpoint) uses. They share
:class:`EngineBase`: the configuration checks, the arrival heap and waiting queue, the counters
behind :meth:`EngineBase.energy_j` and :class:`EngineStats`, and the KV-block accountant
(:class:`sim.kvcache.KVBlocks`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike

from .kvcache import KVBlocks

Mode = Literal["mixed", "prefill", "decode"]
_MODES = ("mixed", "prefill", "decode")


class StepCost(Protocol):
    """Latency and energy of engine steps on one vPod (the engine's only hardware model)."""

    num_chips: int
    static_power_w: float       # per chip, burnt also while idle
    kv_capacity_tokens: int     # KV-cache tokens the vPod can hold (HBM left after weights)
    kv_bytes_per_token: float   # for the swap cost
    host_bw_bytes_per_s: float  # HBM <-> host swap bandwidth (PCIe)

    def step(self, prefill_tokens: ArrayLike, prefill_ctx: ArrayLike, n_decode: ArrayLike,
             decode_kv: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Latency (s) and energy (J, whole vPod, static power included) of ONE engine step.

        All arguments broadcast together; results have the broadcast shape.
        prefill_tokens: new prompt tokens processed in the step (summed over its chunks);
        prefill_ctx: sum over those tokens of the attention context each one sees;
        n_decode: sequences decoding one token; decode_kv: sum of their KV lengths.
        """
        ...


@dataclass(frozen=True)
class AffineStepCost:
    """A two-term roofline step cost, affine in the step's work (hand-checkable).

    ``latency_s = max(c0_s + c_tok_s*prefill_tokens + c_ctx_s*prefill_ctx + c_seq_s*n_decode,
    m0_s + m_kv_s*decode_kv + m_seq_s*n_decode + m_tok_s*prefill_tokens)`` -- compute time
    (fixed overhead, per-token matmuls, attention over the context, per-sequence work) against
    memory time (weights read once per step, KV-cache reads, per-sequence and per-token
    activation traffic).

    ``energy_j = latency_s*static_power_w*num_chips + e_tok_j*prefill_tokens + e_ctx_j*prefill_ctx
    + e_seq_j*n_decode + e_kv_j*decode_kv``.

    The ``c*``/``m*`` coefficients are seconds per unit, the ``e*`` ones joules per unit.
    """

    num_chips: int
    static_power_w: float
    kv_capacity_tokens: int
    kv_bytes_per_token: float
    host_bw_bytes_per_s: float
    c0_s: float = 0.0
    c_tok_s: float = 0.0
    c_ctx_s: float = 0.0
    c_seq_s: float = 0.0
    m0_s: float = 0.0
    m_kv_s: float = 0.0
    m_seq_s: float = 0.0
    m_tok_s: float = 0.0
    e_tok_j: float = 0.0
    e_ctx_j: float = 0.0
    e_seq_j: float = 0.0
    e_kv_j: float = 0.0

    def step(self, prefill_tokens: ArrayLike, prefill_ctx: ArrayLike, n_decode: ArrayLike,
             decode_kv: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Latency (s) and energy (J) of one step; see the class docstring."""
        pt = np.asarray(prefill_tokens, dtype=np.float64)
        pc = np.asarray(prefill_ctx, dtype=np.float64)
        nd = np.asarray(n_decode, dtype=np.float64)
        kv = np.asarray(decode_kv, dtype=np.float64)
        compute_s = self.c0_s + self.c_tok_s * pt + self.c_ctx_s * pc + self.c_seq_s * nd
        memory_s = self.m0_s + self.m_kv_s * kv + self.m_seq_s * nd + self.m_tok_s * pt
        latency_s = np.maximum(compute_s, memory_s)
        energy_j = (latency_s * (self.static_power_w * self.num_chips) + self.e_tok_j * pt
                    + self.e_ctx_j * pc + self.e_seq_j * nd + self.e_kv_j * kv)
        return latency_s, energy_j


def check_engine_config(cost: StepCost, max_batch: int, max_batched_tokens: int,
                        block_tokens: int) -> None:
    """The engine arguments every engine implementation needs (ValueError naming the bad
    one)."""
    if max_batch < 1 or block_tokens < 1:
        raise ValueError("max_batch and block_tokens must be >= 1")
    if max_batched_tokens < max_batch:
        raise ValueError("max_batched_tokens must be >= max_batch")
    if cost.kv_capacity_tokens < block_tokens:
        raise ValueError("kv_capacity_tokens holds no KV block")
    if cost.host_bw_bytes_per_s <= 0:
        raise ValueError("host_bw_bytes_per_s must be > 0")


def max_run_steps_arg(max_run_steps: int, max_phase_steps: int | None) -> int:
    """``max_phase_steps`` is the old name of ``max_run_steps``; it wins when given."""
    return max_run_steps if max_phase_steps is None else max_phase_steps


class RequestTimes:
    """Times derived from a request's arrival, first token and finish (shared by
    :class:`Request` and the event-driven engines' :class:`sim.fastengine.FastRequest`)."""

    __slots__ = ()

    @property
    def finished(self) -> bool:
        return self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (0 in decode mode: the token came with the request)."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(finish - first token) / (output_tokens - 1), for decoded requests with >1 token."""
        if self.finish_s is None or self.first_token_s is None or self.prefill_done:
            return None
        if self.output_tokens <= 1:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def latency_s(self) -> float | None:
        """End-to-end time on this engine: finish - arrival."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(eq=False)
class Request(RequestTimes):
    """One request and its progress on the engine (times in engine virtual seconds)."""

    req_id: Hashable
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kv_ready_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    prefill_done: bool = False      # finished by hand-off after its first token (prefill mode)
    generated_tokens: int = 0       # output tokens emitted so far (decode mode: counts the first)
    kv_tokens: int = 0              # KV tokens it owns (on chip, or on host while swapped)
    prefill_left: int = 0           # prompt tokens still to prefill
    blocks: int = field(default=0, repr=False)       # KV blocks held on chip
    swapped: bool = field(default=False, repr=False)  # KV lives on host memory


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's counters (:meth:`EngineBase.stats`, every engine).

    The event-driven engines (:mod:`sim.fastengine`) fill every field; what they count
    differently: ``iterations`` is steps run (prefill side) or slices of decode runs consumed
    (decode side); ``cost_points`` counts a decode run priced by its two end points as 2 (the
    reference engine counts every step of a vectorised run) and equals ``cost_calls`` on the
    prefill side. Fields a mode cannot move stay 0: ``decode_tokens`` on the prefill side,
    ``prefill_tokens`` on the decode side, ``swap_s`` and ``preemptions`` in
    :class:`sim.fastengine.PrefillEngine` (it allocates a prompt's blocks whole at admission and
    never preempts)."""

    now_s: float
    elapsed_s: float          # since start_s
    busy_s: float             # stepping, swap time included
    idle_s: float
    swap_s: float
    energy_j: float           # steps + static power over swap and idle time
    chip_s: float             # num_chips x elapsed_s
    prefill_tokens: int
    decode_tokens: int
    steps: int                # engine steps (identical in exact and fast mode)
    preemptions: int
    cost_calls: int           # cost.step invocations
    cost_points: int          # step evaluations inside them (sum of vector lengths)
    iterations: int           # Python-level scheduler iterations (step runs consumed)
    running: int
    waiting: int
    finished: int


@runtime_checkable
class SimEngine(Protocol):
    """What drives, routes to or watches a simulated engine may use; :class:`Engine`,
    :class:`sim.fastengine.PrefillEngine` and :class:`sim.fastengine.DecodeEngine` all satisfy
    it. Time is only ever passed in: a discrete-event simulator alternates
    ``t = next_event_time()`` and ``advance_to(t)``; a wall-clock server calls ``advance_to(now)``
    and sleeps until ``next_event_time()`` or the next request."""

    def submit(self, req_id: Hashable, arrival_s: float, prompt_tokens: int,
               output_tokens: int) -> RequestTimes:
        """Queue a request arriving at ``arrival_s``; returns its live record."""
        ...

    def advance_to(self, t_s: float) -> Sequence[RequestTimes]:
        """Run every step that starts before ``t_s``; the requests finished since the last
        call."""
        ...

    def next_event_time(self) -> float | None:
        """When the state next changes (end of the current step or run of steps, else the next
        arrival, else None); ``advance_to`` of it always makes progress and skips no finish."""
        ...

    def run_until_idle(self) -> Sequence[RequestTimes]:
        ...

    def abort(self, r: RequestTimes) -> bool:
        """Take ``r`` (a record ``submit`` returned) out of the engine at its clock, as vLLM
        aborts a request whose client went away: it leaves the arrival heap, the waiting queue
        or the running batch (its KV blocks freed), the steps from the clock on are planned
        without it, and it is never reported as finished. False when ``r`` is not in the
        engine (finished, aborted before, or another engine's)."""
        ...

    @property
    def idle(self) -> bool:
        ...

    @property
    def num_waiting(self) -> int:
        ...

    @property
    def num_running(self) -> int:
        ...

    @property
    def now_s(self) -> float | None:
        ...

    @property
    def free_kv_tokens(self) -> int:
        ...

    @property
    def kv_capacity_tokens(self) -> int:
        ...

    def energy_j(self) -> float:
        ...

    def stats(self) -> EngineStats:
        ...


class EngineBase(KVBlocks):
    """What every engine shares: the configuration checks, the KV-block accountant, the arrival
    heap and FCFS waiting queue, the counters and what is derived from them (``energy_j()``,
    ``stats()``). A subclass keeps its running batch in ``_running`` (any sized container)
    and implements ``submit``, ``advance_to`` and ``next_event_time``. Attributes live in
    slots: the event-driven engines read them in their hot loops."""

    __slots__ = ("cost", "max_batch", "max_batched_tokens", "_static_w", "_swap_s_per_token",
                 "_start_s", "_clock_s", "_running", "_pending", "_waiting", "_n_submitted",
                 "_unreported", "busy_s", "swap_s", "step_energy_j", "prefill_tokens",
                 "decode_tokens", "steps", "preemptions", "cost_calls", "cost_points",
                 "iterations", "n_finished")

    def __init__(self, cost: StepCost, max_batch: int, max_batched_tokens: int,
                 block_tokens: int, start_s: float | None) -> None:
        check_engine_config(cost, max_batch, max_batched_tokens, block_tokens)
        super().__init__(cost.kv_capacity_tokens, block_tokens)
        self.cost = cost
        self.max_batch = max_batch
        self.max_batched_tokens = max_batched_tokens
        self._static_w = float(cost.static_power_w) * cost.num_chips
        self._swap_s_per_token = cost.kv_bytes_per_token / cost.host_bw_bytes_per_s
        self._start_s = start_s
        self._clock_s = start_s
        self._running: Any = []
        # future arrivals: a heap of (arrival_s, submission number, request)
        self._pending: list[tuple[float, int, Any]] = []
        self._waiting: deque[Any] = deque()
        self._n_submitted = 0
        self._unreported: list[Any] = []       # finished, not returned by advance_to yet
        # counters (EngineStats)
        self.busy_s = 0.0
        self.swap_s = 0.0
        self.step_energy_j = 0.0               # static power during steps and swaps included
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.steps = 0
        self.preemptions = 0
        self.cost_calls = 0
        self.cost_points = 0
        self.iterations = 0
        self.n_finished = 0

    # ---- the protocol's read-only part

    @property
    def now_s(self) -> float | None:
        """The engine's clock (None before the first request when ``start_s=None``)."""
        return self._clock_s

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Arrived (or arriving) requests not admitted yet, swapped-out ones included."""
        return len(self._waiting) + len(self._pending)

    @property
    def idle(self) -> bool:
        return not (self._running or self._waiting or self._pending)

    def run_until_idle(self) -> list:
        """Run until every submitted request has finished; returns those finished since the
        previous call. The clock stays at the last step's end."""
        return self.advance_to(math.inf)

    def _times(self) -> tuple[float, float, float]:
        """(now, elapsed since start_s, idle time)."""
        now_s = self._clock_s if self._clock_s is not None else 0.0
        start_s = self._start_s if self._start_s is not None else now_s
        elapsed_s = max(0.0, now_s - start_s)
        return now_s, elapsed_s, max(0.0, elapsed_s - self.busy_s)

    def energy_j(self) -> float:
        """Step energy (swaps included) plus static power over the idle time since
        ``start_s``."""
        return self.step_energy_j + self._static_w * self._times()[2]

    def stats(self) -> EngineStats:
        """Counters; energy and chip-seconds cover ``[start_s, now_s]``."""
        now_s, elapsed_s, idle_s = self._times()
        return EngineStats(
            now_s=now_s, elapsed_s=elapsed_s, busy_s=self.busy_s, idle_s=idle_s,
            swap_s=self.swap_s, energy_j=self.step_energy_j + self._static_w * idle_s,
            chip_s=self.cost.num_chips * elapsed_s, prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens, steps=self.steps, preemptions=self.preemptions,
            cost_calls=self.cost_calls, cost_points=self.cost_points,
            iterations=self.iterations, running=self.num_running, waiting=self.num_waiting,
            finished=self.n_finished)

    # ---- shared mechanics

    def _check_request(self, req_id: Hashable, arrival_s: float, prompt_tokens: int,
                       output_tokens: int, mode: str) -> int:
        """A request an engine in ``mode`` can take: positive lengths, a finite arrival and a
        KV footprint (the prompt in prefill mode, prompt + output - 1 otherwise) within the
        cache. Returns the blocks of that footprint."""
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("need prompt_tokens >= 1 and output_tokens >= 1")
        if not math.isfinite(arrival_s):
            raise ValueError("arrival_s must be finite")
        max_kv = prompt_tokens if mode == "prefill" else prompt_tokens + output_tokens - 1
        blocks = -(-max_kv // self.bt)          # blocks_for(), inline: once per submission
        if blocks > self.total_blocks:
            raise ValueError(f"request {req_id!r} needs {max_kv} KV tokens, more than the "
                             f"vPod's {self.kv_capacity_tokens}")
        return blocks

    def _move_arrivals(self, now_s: float) -> None:
        """Arrivals up to ``now_s`` join the tail of the waiting queue; one with nothing left
        to do finishes at its arrival: in decode mode a request comes with its first token, so
        one that wants a single token is done."""
        pend, wait = self._pending, self._waiting
        while pend and pend[0][0] <= now_s:
            r = heapq.heappop(pend)[2]
            if r.output_tokens == 1 and r.first_token_s is not None:
                self._finish(r, r.arrival_s)
            else:
                wait.append(r)

    def _drop_queued(self, r: Any) -> str | None:
        """Take ``r`` out of the waiting queue (``"waiting"``) or the arrival heap
        (``"pending"``); None when it is in neither. O(queued requests): for aborts only."""
        wait = self._waiting
        for i, x in enumerate(wait):
            if x is r:
                del wait[i]
                return "waiting"
        pend = self._pending
        for i, e in enumerate(pend):
            if e[2] is r:
                last = pend.pop()
                if i < len(pend):
                    pend[i] = last
                    heapq.heapify(pend)
                return "pending"
        return None

    def _finish(self, r: Any, now_s: float) -> None:
        """``r`` finished at ``now_s``: report it (its KV blocks are the caller's business)."""
        r.finish_s = now_s
        self._unreported.append(r)
        self.n_finished += 1

    def _event_time(self, planned_end_s: float | None) -> float | None:
        """``next_event_time()`` once the engine has planned what starts at its clock
        (``planned_end_s``: when that ends; None when idle): the clock itself while requests
        that finished on arrival wait to be returned by ``advance_to``, else the planned end,
        else the next arrival, else None."""
        if self._unreported:
            return self._clock_s
        if planned_end_s is not None:
            return planned_end_s
        return self._pending[0][0] if self._pending else None

    def _report(self) -> list:
        """The requests finished since the previous call."""
        out, self._unreported = self._unreported, []
        return out


@dataclass
class _StepPlan:
    """One general step as the scheduler decided it (side-effect free until executed)."""

    victims: list[Request]                 # preempted, newest admission first
    admits: list[tuple[Request, int]]      # (request, blocks allocated), FCFS order
    decode: list[tuple[Request, int]]      # (request, new blocks for its next token)
    prefill: list[tuple[Request, int]]     # (request, chunk tokens)
    prefill_tokens: int
    prefill_ctx: float
    decode_kv: int
    swap_s: float

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass
class _StepRun:
    """Planned steps starting at ``start_s``: one general step, or ``k`` pure decode steps."""

    start_s: float
    ends_s: np.ndarray             # absolute end time of each step
    cum_energy_j: np.ndarray       # cumulative step energy (static power during steps included)
    k: int                         # steps in the run (may shrink when a request is submitted)
    plan: _StepPlan | None = None  # general step; None for a run of pure decode steps
    seqs: list[Request] = field(default_factory=list)
    arrival_sensitive: bool = False  # an arrival before blocked_from_s could join the batch
    room: int = 0                  # (arrival_sensitive) free blocks an arrival could take
    blocked_from_s: float = math.inf  # arrivals from here on queue behind a blocked request
    done: int = 0                  # steps already applied to the engine state

    def steps_starting_before(self, t_s: float) -> int:
        """How many of the run's k steps start strictly before ``t_s``."""
        if t_s <= self.start_s:
            return 0
        return min(self.k, 1 + int(np.searchsorted(self.ends_s[: self.k - 1], t_s, "left")))


class Engine(EngineBase):
    """A vLLM-like engine on one vPod, advanced explicitly in (virtual or real) time."""

    def __init__(self, cost: StepCost, mode: Mode = "mixed", max_batch: int = 256,
                 max_batched_tokens: int = 8192, block_tokens: int = 16, exact: bool = False,
                 *, start_s: float | None = 0.0, max_run_steps: int = 4096,
                 max_phase_steps: int | None = None, chunked_prefill: bool = True,
                 mixed_prefill: bool = True) -> None:
        """``start_s``: when the vPod came up (idle energy and chip-seconds count from there;
        ``None``: from the first request's arrival). ``max_run_steps`` (old name
        ``max_phase_steps``) caps the length of a vectorised run of decode steps.
        ``chunked_prefill=False``: the scheduler of vLLM without chunked prefill (and of
        JetStream's interleaved mode) - a prompt is prefilled whole in one step, and a step
        that prefills runs no decodes (prefill first whenever a waiting prompt fits); a
        prompt longer than ``max_batched_tokens`` is refused at submission.
        ``mixed_prefill=False`` (with chunked prefill): sglang's default scheduler - a step
        carries prompt chunks or decodes, never both, and prompts go first: whenever a prompt
        is being prefilled or one waiting can be admitted, the step prefills (chunks of up to
        ``max_batched_tokens`` in all, running prompts first, then admissions FCFS) and every
        decoding request waits (:meth:`dse.stacks.StackProfile.mixed_prefill`)."""
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        max_run_steps = max_run_steps_arg(max_run_steps, max_phase_steps)
        if max_run_steps < 1:
            raise ValueError("max_run_steps must be >= 1")
        super().__init__(cost, max_batch, max_batched_tokens, block_tokens, start_s)
        self.mode: Mode = mode
        self.exact = exact
        self.max_run_steps = max_run_steps
        self.chunked_prefill = bool(chunked_prefill)
        self.mixed_prefill = bool(mixed_prefill)
        self._running: list[Request] = []          # admission order
        self._requests: dict[Hashable, Request] = {}
        self._finished: list[Request] = []
        self._step_run: _StepRun | None = None

    # ------------------------------------------------------------------ public API

    def submit(self, req_id: Hashable, arrival_s: float, prompt_tokens: int, output_tokens: int,
               kv_ready_tokens: int = 0) -> Request:
        """Queue a request arriving at ``arrival_s`` (may be in the past or the future)."""
        if req_id in self._requests:
            raise ValueError(f"duplicate request id {req_id!r}")
        if kv_ready_tokens < 0:
            raise ValueError("need kv_ready_tokens >= 0")
        self._check_request(req_id, arrival_s, prompt_tokens, output_tokens, self.mode)
        if (not self.chunked_prefill and self.mode != "decode"
                and prompt_tokens - min(kv_ready_tokens, prompt_tokens - 1)
                > self.max_batched_tokens):
            raise ValueError(f"request {req_id!r}: a prompt of {prompt_tokens} tokens needs "
                             f"max_batched_tokens >= {prompt_tokens} without chunked prefill "
                             f"(it is {self.max_batched_tokens})")
        r = Request(req_id, float(arrival_s), int(prompt_tokens), int(output_tokens),
                    int(kv_ready_tokens))
        if self.mode == "decode":
            r.kv_ready_tokens = r.prompt_tokens
            r.kv_tokens = r.prompt_tokens
            r.generated_tokens = 1
            r.first_token_s = r.arrival_s
        else:
            r.kv_tokens = min(r.kv_ready_tokens, r.prompt_tokens - 1)
            r.prefill_left = r.prompt_tokens - r.kv_tokens
        self._requests[req_id] = r
        if self._clock_s is None:
            self._clock_s = r.arrival_s
            self._start_s = r.arrival_s
        heapq.heappush(self._pending, (r.arrival_s, self._n_submitted, r))
        self._n_submitted += 1
        self._on_submit(r)
        return r

    def advance_to(self, t_s: float) -> list[Request]:
        """Run every step that starts before ``t_s``; the clock ends at ``max(t_s, end of the
        last step run)``. Returns the requests finished since the previous call."""
        if self._clock_s is not None:
            self._advance(t_s)
        return self._report()

    def next_event_time(self) -> float | None:
        """When the engine's state next changes: the end of the current step run (one step, or
        a vectorised run of decode steps), else the next pending arrival, else None (see
        :meth:`EngineBase._event_time`)."""
        run = self._current_run() if self._clock_s is not None else None
        return self._event_time(None if run is None else float(run.ends_s[run.k - 1]))

    def abort(self, r: Request) -> bool:
        """Take ``r`` out of the engine at its clock (see :meth:`SimEngine.abort`): a running
        request gives back its KV blocks; the cached step run is dropped (plans are side-effect
        free, and steps already applied stay), so the next step is planned at the clock without
        it. It stays in :attr:`requests`, unfinished. O(requests in the engine)."""
        if r.finish_s is not None or self._requests.get(r.req_id) is not r:
            return False
        run = self._running
        for i, x in enumerate(run):
            if x is r:
                del run[i]
                self._release(r)
                break
        else:
            if self._drop_queued(r) is None:
                return False
        self._step_run = None
        return True

    @property
    def requests(self) -> dict[Hashable, Request]:
        """Every submitted request by id."""
        return self._requests

    @property
    def finished(self) -> list[Request]:
        """Finished requests in finishing order."""
        return self._finished

    # ------------------------------------------------------------------ main loop

    def _advance(self, t_s: float) -> None:
        while self._clock_s < t_s:
            run = self._current_run()
            if run is None:                      # idle: jump to the next arrival or to t_s
                nxt_s = self._pending[0][0] if self._pending else None
                if nxt_s is not None and nxt_s < t_s:
                    self._clock_s = max(self._clock_s, nxt_s)
                    continue
                if math.isfinite(t_s):
                    self._clock_s = t_s
                return
            self.iterations += 1
            if run.plan is not None:
                self._step_run = None
                self._execute(run.plan, float(run.ends_s[0]) - run.start_s,
                              float(run.cum_energy_j[0]))
            else:
                self._consume_decode(run, run.steps_starting_before(t_s))

    def _current_run(self) -> _StepRun | None:
        """The cached step run, or a newly planned one starting now (None when idle)."""
        if self._step_run is not None:
            return self._step_run
        plan = self._plan_step()
        if plan.empty:
            if self._running or self._waiting:
                raise RuntimeError("engine stalled: work queued but nothing schedulable")
            return None
        now_s = self._clock_s
        pure = (not plan.victims and not plan.admits and not plan.prefill
                and len(plan.decode) == len(self._running))
        if pure and not self.exact:
            self._step_run = self._plan_decode_run(plan)
        else:
            lat, en = self.cost.step(float(plan.prefill_tokens), float(plan.prefill_ctx),
                                     float(len(plan.decode)), float(plan.decode_kv))
            self.cost_calls += 1
            self.cost_points += 1
            end_s = now_s + (float(lat) + plan.swap_s)
            self._step_run = _StepRun(start_s=now_s, ends_s=np.array([end_s]),
                                      cum_energy_j=np.array([float(en)]), k=1, plan=plan)
        return self._step_run

    def _on_submit(self, r: Request) -> None:
        """Keep the cached step run valid: cut it before the first step that could see the
        new arrival; or, when its blocks do not fit, let it (and all after it) wait, as
        :meth:`_plan_decode_run` does with an arrival submitted before the run was planned."""
        run = self._step_run
        if run is None:
            return
        arrival_s = r.arrival_s
        if run.plan is not None:
            if arrival_s <= run.start_s:
                self._step_run = None
            return
        if not run.arrival_sensitive or arrival_s >= run.blocked_from_s:
            return
        if self._admit_blocks(r) > run.room:
            run.blocked_from_s = arrival_s
            return
        k = max(run.done, run.steps_starting_before(arrival_s))
        if k == run.done:
            self._step_run = None
        else:
            run.k = k

    # ------------------------------------------------------------------ scheduling

    def _admit_blocks(self, r: Request) -> int:
        """Blocks ``r`` needs to be admitted: its whole prompt, or (decoding) its KV plus the
        token it writes next."""
        if r.prefill_left > 0:
            return self.blocks_for(r.prompt_tokens)
        return self.blocks_for(r.kv_tokens + 1)

    def _plan_decodes(self) -> tuple[list[Request], list[Request],
                                     list[tuple[Request, int]], int]:
        """Step 2 of the schedule: a token for every decoding request, oldest first, each with
        the new block it needs; the newest admissions are preempted while a block is missing.
        Returns (still running, victims newest first, decodes, free blocks left)."""
        free = self.free
        alive = list(self._running)
        victims: list[Request] = []
        decode: list[tuple[Request, int]] = []
        i = 0
        while i < len(alive):
            r = alive[i]
            if r.prefill_left == 0:
                need = max(0, self.blocks_for(r.kv_tokens + 1) - r.blocks)
                while need > free and alive[-1] is not r:
                    v = alive.pop()
                    victims.append(v)
                    free += v.blocks
                if need > free:                  # only itself left to preempt
                    alive.pop()
                    victims.append(r)
                    free += r.blocks
                    break
                free -= need
                decode.append((r, need))
            i += 1
        return alive, victims, decode, free

    def _plan_step(self) -> _StepPlan:
        """Decide the step starting now (see the module docstring); mutates nothing but the
        arrival of due requests into the waiting queue."""
        self._move_arrivals(self._clock_s)
        if not self.chunked_prefill:
            whole = self._plan_whole_prefill()
            if whole is not None:
                return whole
        elif not self.mixed_prefill:
            first = self._plan_prefill_first()
            if first is not None:
                return first
        return self._fill(*self._plan_decodes())

    def _fill(self, alive: list[Request], victims: list[Request],
              decode: list[tuple[Request, int]], free: int, prompts_only: bool = False
              ) -> _StepPlan:
        """The rest of a step after its decodes: the running prompts' next chunks, then
        waiting requests admitted FCFS within the sequence, token and block limits (none after
        a preemption). ``prompts_only`` (unmixed prefill): admission stops at a request that
        would decode - a swapped-out decode resumes in a decode step."""
        tokens_left = self.max_batched_tokens - len(decode)
        prefill: list[tuple[Request, int]] = []
        for r in alive:
            if r.prefill_left > 0 and tokens_left > 0:
                c = min(r.prefill_left, tokens_left)
                prefill.append((r, c))
                tokens_left -= c
        admits: list[tuple[Request, int]] = []
        swap_tokens = sum(v.kv_tokens for v in victims)
        if not victims:
            n_seqs = len(alive)
            for r in self._waiting:
                if n_seqs >= self.max_batch or tokens_left <= 0:
                    break
                if prompts_only and r.prefill_left == 0:
                    break
                if r.prefill_left > 0 and not prompts_only \
                        and not (self.chunked_prefill and self.mixed_prefill):
                    break                       # prompts go in a prefill step of their own
                need = self._admit_blocks(r)
                if need > free:
                    break
                free -= need
                n_seqs += 1
                admits.append((r, need))
                if r.swapped:
                    swap_tokens += r.kv_tokens
                if r.prefill_left == 0:
                    decode.append((r, 0))
                    tokens_left -= 1
                else:
                    c = min(r.prefill_left, tokens_left)
                    prefill.append((r, c))
                    tokens_left -= c
        prefill_tokens = sum(c for _, c in prefill)
        prefill_ctx = float(sum(c * r.kv_tokens + c * (c + 1) / 2 for r, c in prefill))
        decode_kv = sum(r.kv_tokens + 1 for r, _ in decode)
        return _StepPlan(victims, admits, decode, prefill, prefill_tokens, prefill_ctx,
                         decode_kv, swap_tokens * self._swap_s_per_token)

    def _plan_prefill_first(self) -> _StepPlan | None:
        """Unmixed chunked prefill: a step of prompt chunks (:meth:`_fill` with no decodes)
        and no decodes; None when there is nothing to prefill."""
        plan = self._fill(self._running, [], [], self.free, prompts_only=True)
        return plan if plan.prefill else None

    def _plan_whole_prefill(self) -> _StepPlan | None:
        """Without chunked prefill: a step prefilling whole prompts from the head of the queue
        (FCFS, within the sequence, token and block limits), no decodes; None when the head
        is not a prompt that fits now."""
        free, tokens_left, n_seqs = self.free, self.max_batched_tokens, len(self._running)
        admits: list[tuple[Request, int]] = []
        swap_tokens = 0
        for r in self._waiting:
            if r.prefill_left == 0 or n_seqs >= self.max_batch or r.prefill_left > tokens_left:
                break
            need = self._admit_blocks(r)
            if need > free:
                break
            free -= need
            n_seqs += 1
            tokens_left -= r.prefill_left
            admits.append((r, need))
            if r.swapped:
                swap_tokens += r.kv_tokens
        if not admits:
            return None
        prefill = [(r, r.prefill_left) for r, _ in admits]
        return _StepPlan([], admits, [], prefill, sum(c for _, c in prefill),
                         float(sum(c * r.kv_tokens + c * (c + 1) / 2 for r, c in prefill)), 0,
                         swap_tokens * self._swap_s_per_token)

    def _execute(self, plan: _StepPlan, latency_s: float, energy_j: float) -> None:
        """Apply one general step of ``latency_s`` (swap time included) to the state."""
        for v in plan.victims:
            self._release(v)
            v.swapped = True
            v.preemptions += 1
            self.preemptions += 1
            self._waiting.appendleft(v)          # the oldest victim ends up first
        for r, need in plan.admits:
            head = self._waiting.popleft()
            assert head is r
            r.blocks = need
            r.swapped = False
            self.take(need)
        if plan.victims:
            gone = {id(v) for v in plan.victims}
            self._running = [r for r in self._running if id(r) not in gone]
        self._running.extend(r for r, _ in plan.admits)
        self._clock_s += latency_s
        now_s = self._clock_s
        self.busy_s += latency_s
        self.swap_s += plan.swap_s
        self.step_energy_j += energy_j + self._static_w * plan.swap_s
        self.steps += 1
        done: list[Request] = []
        for r, nb in plan.decode:             # per sequence: take() inline
            r.blocks += nb
            self.free -= nb
            r.kv_tokens += 1
            r.generated_tokens += 1
            if r.generated_tokens >= r.output_tokens:
                done.append(r)
        self.decode_tokens += len(plan.decode)
        for r, c in plan.prefill:
            r.kv_tokens += c
            r.prefill_left -= c
            if r.prefill_left == 0:
                r.first_token_s = now_s
                r.generated_tokens = 1
                if self.mode == "prefill":
                    r.prefill_done = True
                    done.append(r)
                elif r.output_tokens == 1:
                    done.append(r)
        self.prefill_tokens += plan.prefill_tokens
        self._retire(done, now_s)

    def _plan_decode_run(self, plan: _StepPlan) -> _StepRun:
        """Price, in one vectorised call, the run of pure decode steps starting now."""
        seqs = [r for r, _ in plan.decode]
        n = len(seqs)
        bt = self.bt
        kv = np.fromiter((r.kv_tokens for r in seqs), dtype=np.int64, count=n)
        blk = np.fromiter((r.blocks for r in seqs), dtype=np.int64, count=n)
        k_finish = min(r.output_tokens - r.generated_tokens for r in seqs)
        slack = np.sort(blk * bt - kv)           # step of each sequence's next new block
        free = self.free
        k_blocks = int(slack[free % n]) + (free // n) * bt
        k = max(1, min(k_finish, k_blocks, self.max_run_steps))
        decode_kv = float(kv.sum() + n) + float(n) * np.arange(k, dtype=np.float64)
        lat, en = self.cost.step(0.0, 0.0, float(n), decode_kv)
        self.cost_calls += 1
        self.cost_points += k
        lat = np.broadcast_to(np.asarray(lat, dtype=np.float64), (k,))
        en = np.broadcast_to(np.asarray(en, dtype=np.float64), (k,))
        now_s = self._clock_s
        # Only an arrival into an empty waiting queue can change the batch; whether the batch
        # has a free slot, token budget or blocks for it can only get worse during the run.
        sensitive = (not self._waiting and n < self.max_batch
                     and n < self.max_batched_tokens)
        run = _StepRun(start_s=now_s, ends_s=now_s + np.cumsum(lat),
                       cum_energy_j=np.cumsum(en), k=k, seqs=seqs, arrival_sensitive=sensitive,
                       room=free)
        if sensitive and self._pending:
            head_s, _, head = self._pending[0]
            if self._admit_blocks(head) > free:
                run.blocked_from_s = head_s      # it will wait, and everyone behind it too
            else:
                run.k = max(1, run.steps_starting_before(head_s))
        return run

    def _consume_decode(self, run: _StepRun, upto: int) -> None:
        """Apply steps ``run.done .. upto-1`` of a run of pure decode steps (O(running))."""
        m = upto - run.done
        if m <= 0:
            return
        prev_end_s = run.start_s if run.done == 0 else float(run.ends_s[run.done - 1])
        prev_en_j = 0.0 if run.done == 0 else float(run.cum_energy_j[run.done - 1])
        run.done = upto
        now_s = float(run.ends_s[upto - 1])
        self._clock_s = now_s
        self.busy_s += now_s - prev_end_s
        self.step_energy_j += float(run.cum_energy_j[upto - 1]) - prev_en_j
        self.steps += m
        self.decode_tokens += m * len(run.seqs)
        bt = self.bt
        done: list[Request] = []
        for r in run.seqs:
            r.kv_tokens += m
            r.generated_tokens += m
            # blocks_for() inline: this loop runs per sequence per consumed run
            nb = -(-r.kv_tokens // bt)
            if nb > r.blocks:
                self.free -= nb - r.blocks
                r.blocks = nb
            if r.generated_tokens >= r.output_tokens:
                done.append(r)
        if run.done >= run.k:
            self._step_run = None
        self._retire(done, now_s)

    def _retire(self, done: list[Request], now_s: float) -> None:
        if not done:
            return
        gone = {id(r) for r in done}
        self._running = [r for r in self._running if id(r) not in gone]
        for r in done:
            self._finish(r, now_s)

    def _release(self, r: Request) -> None:
        """``r`` gives back every KV block it holds on chip."""
        self.give(r.blocks)
        r.blocks = 0

    def _finish(self, r: Request, now_s: float) -> None:
        self._release(r)
        self._finished.append(r)
        super()._finish(r, now_s)
