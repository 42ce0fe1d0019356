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
which grows by ``n_decode`` per step. The engine then plans a whole *phase* of ``k`` steps at
once: ``k`` is the smallest of the earliest finish, the step at which the KV blocks run out
(closed form below) and, when the waiting queue is empty, the first step starting at or after
the next pending arrival. One vectorised ``cost.step`` call prices all ``k`` steps; a cumulative
sum gives their end times; consuming any number of them is O(number of running requests).
Block exhaustion: sequence ``i`` with KV ``kv_i`` holding ``b_i`` blocks needs a new block at
steps ``s_i + m*block_tokens`` (``s_i = b_i*block_tokens - kv_i``, ``m = 0, 1, ...``); with
``F`` free blocks the first failing step is the ``F``-th (0-based) of these events in time
order, ``sorted(s)[F % n] + (F // n) * block_tokens``. ``exact=True`` runs the same schedule one
step per Python iteration (the reference the fast path is tested against).

*Accounting.* Energy = the steps' energies + static power x chips over swap time and idle time.
Chip-seconds = chips x elapsed time since ``start_s`` (the time the vPod came up, default 0;
``None``: the first request's arrival). Busy time includes swap time.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
from numpy.typing import ArrayLike

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


def check_request(req_id: Hashable, arrival_s: float, prompt_tokens: int, output_tokens: int,
                  mode: str, total_blocks: int, block_tokens: int) -> None:
    """A request an engine in ``mode`` can take: positive lengths, a finite arrival and a KV
    footprint (the prompt in prefill mode, prompt + output - 1 otherwise) within the cache."""
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("need prompt_tokens >= 1 and output_tokens >= 1")
    if not math.isfinite(arrival_s):
        raise ValueError("arrival_s must be finite")
    max_kv = prompt_tokens if mode == "prefill" else prompt_tokens + output_tokens - 1
    if -(-max_kv // block_tokens) > total_blocks:
        raise ValueError(f"request {req_id!r} needs {max_kv} KV tokens, more than the vPod's "
                         f"{total_blocks * block_tokens}")


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
    """A snapshot of the engine's counters (see :meth:`Engine.stats`)."""

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
    iterations: int           # Python-level scheduler iterations (phases consumed)
    running: int
    waiting: int
    finished: int


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
class _Phase:
    """Planned steps starting at ``start_s``: one general step, or ``k`` pure decode steps."""

    start_s: float
    ends_s: np.ndarray             # absolute end time of each step
    cum_energy_j: np.ndarray       # cumulative step energy (static power during steps included)
    k: int                         # steps in the phase (may shrink when a request is submitted)
    plan: _StepPlan | None = None  # general step; None for a pure decode phase
    seqs: list[Request] = field(default_factory=list)
    arrival_sensitive: bool = False  # an arrival before blocked_from_s could join the batch
    blocked_from_s: float = math.inf  # arrivals from here on queue behind a blocked request
    done: int = 0                  # steps already applied to the engine state

    def steps_starting_before(self, t_s: float) -> int:
        """How many of the phase's k steps start strictly before ``t_s``."""
        if t_s <= self.start_s:
            return 0
        return min(self.k, 1 + int(np.searchsorted(self.ends_s[: self.k - 1], t_s, "left")))


class Engine:
    """A vLLM-like engine on one vPod, advanced explicitly in (virtual or real) time."""

    def __init__(self, cost: StepCost, mode: Mode = "mixed", max_batch: int = 256,
                 max_batched_tokens: int = 8192, block_tokens: int = 16, exact: bool = False,
                 *, start_s: float | None = 0.0, max_phase_steps: int = 4096) -> None:
        """``start_s``: when the vPod came up (idle energy and chip-seconds count from there;
        ``None``: from the first request's arrival). ``max_phase_steps`` caps the length of a
        vectorised decode phase."""
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if max_phase_steps < 1:
            raise ValueError("max_phase_steps must be >= 1")
        check_engine_config(cost, max_batch, max_batched_tokens, block_tokens)
        self.cost = cost
        self.mode: Mode = mode
        self.max_batch = max_batch
        self.max_batched_tokens = max_batched_tokens
        self.block_tokens = block_tokens
        self.exact = exact
        self.max_phase_steps = max_phase_steps
        self.total_blocks = cost.kv_capacity_tokens // block_tokens
        self._static_w = float(cost.static_power_w) * cost.num_chips
        self._swap_s_per_token = cost.kv_bytes_per_token / cost.host_bw_bytes_per_s
        self._start_s = start_s
        self._clock_s: float | None = start_s
        self._free_blocks = self.total_blocks
        self._running: list[Request] = []          # admission order
        self._waiting: deque[Request] = deque()
        self._pending: list[tuple[float, int, Request]] = []   # future arrivals (heap)
        self._n_submitted = 0
        self._requests: dict[Hashable, Request] = {}
        self._finished: list[Request] = []
        self._unreported: list[Request] = []
        self._phase: _Phase | None = None
        # counters
        self._busy_s = 0.0
        self._swap_s = 0.0
        self._step_energy_j = 0.0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._steps = 0
        self._preemptions = 0
        self._cost_calls = 0
        self._cost_points = 0
        self._iterations = 0

    # ------------------------------------------------------------------ public API

    def submit(self, req_id: Hashable, arrival_s: float, prompt_tokens: int, output_tokens: int,
               kv_ready_tokens: int = 0) -> Request:
        """Queue a request arriving at ``arrival_s`` (may be in the past or the future)."""
        if req_id in self._requests:
            raise ValueError(f"duplicate request id {req_id!r}")
        if kv_ready_tokens < 0:
            raise ValueError("need kv_ready_tokens >= 0")
        check_request(req_id, arrival_s, prompt_tokens, output_tokens, self.mode,
                      self.total_blocks, self.block_tokens)
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
        self._on_submit(r.arrival_s)
        return r

    def advance_to(self, t_s: float) -> list[Request]:
        """Run every step that starts before ``t_s``; the clock ends at ``max(t_s, end of the
        last step run)``. Returns the requests finished since the previous call."""
        if self._clock_s is not None:
            self._run(t_s)
        out, self._unreported = self._unreported, []
        return out

    def run_until_idle(self) -> list[Request]:
        """Run until every submitted request has finished; returns those finished since the
        previous call. The clock stays at the last step's end."""
        return self.advance_to(math.inf)

    def next_event_time(self) -> float | None:
        """When the engine's state next changes: the end of the current batch phase (a step,
        or a vectorised run of decode steps), else the next pending arrival, else None."""
        if self._clock_s is not None:
            ph = self._current_phase()
            if ph is not None:
                return float(ph.ends_s[ph.k - 1])
        return self._pending[0][0] if self._pending else None

    @property
    def now_s(self) -> float | None:
        """The engine's clock (None before the first request when ``start_s=None``)."""
        return self._clock_s

    @property
    def requests(self) -> dict[Hashable, Request]:
        """Every submitted request by id."""
        return self._requests

    @property
    def finished(self) -> list[Request]:
        """Finished requests in finishing order."""
        return self._finished

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Arrived (or arriving) requests not admitted yet, swapped-out ones included."""
        return len(self._waiting) + len(self._pending)

    @property
    def free_kv_tokens(self) -> int:
        return self._free_blocks * self.block_tokens

    @property
    def idle(self) -> bool:
        return not (self._running or self._waiting or self._pending)

    def stats(self) -> EngineStats:
        """Counters; energy and chip-seconds cover ``[start_s, now_s]``."""
        now_s = self._clock_s if self._clock_s is not None else 0.0
        start_s = self._start_s if self._start_s is not None else now_s
        elapsed_s = max(0.0, now_s - start_s)
        idle_s = max(0.0, elapsed_s - self._busy_s)
        energy_j = self._step_energy_j + self._static_w * idle_s   # swap: in the steps
        return EngineStats(
            now_s=now_s, elapsed_s=elapsed_s, busy_s=self._busy_s, idle_s=idle_s,
            swap_s=self._swap_s, energy_j=energy_j, chip_s=self.cost.num_chips * elapsed_s,
            prefill_tokens=self._prefill_tokens, decode_tokens=self._decode_tokens,
            steps=self._steps, preemptions=self._preemptions, cost_calls=self._cost_calls,
            cost_points=self._cost_points, iterations=self._iterations,
            running=len(self._running), waiting=self.num_waiting,
            finished=len(self._finished))

    # ------------------------------------------------------------------ main loop

    def _run(self, t_s: float) -> None:
        while self._clock_s < t_s:
            ph = self._current_phase()
            if ph is None:                       # idle: jump to the next arrival or to t_s
                nxt_s = self._pending[0][0] if self._pending else None
                if nxt_s is not None and nxt_s < t_s:
                    self._clock_s = max(self._clock_s, nxt_s)
                    continue
                if math.isfinite(t_s):
                    self._clock_s = t_s
                return
            self._iterations += 1
            if ph.plan is not None:
                self._phase = None
                self._execute(ph.plan, float(ph.ends_s[0]) - ph.start_s,
                              float(ph.cum_energy_j[0]))
            else:
                self._consume_decode(ph, ph.steps_starting_before(t_s))

    def _current_phase(self) -> _Phase | None:
        """The cached phase, or a newly planned one starting now (None when idle)."""
        if self._phase is not None:
            return self._phase
        plan = self._plan_step()
        if plan.empty:
            if self._running or self._waiting:
                raise RuntimeError("engine stalled: work queued but nothing schedulable")
            return None
        now_s = self._clock_s
        pure = (not plan.victims and not plan.admits and not plan.prefill
                and len(plan.decode) == len(self._running))
        if pure and not self.exact:
            self._phase = self._plan_decode_phase(plan)
        else:
            lat, en = self.cost.step(float(plan.prefill_tokens), float(plan.prefill_ctx),
                                     float(len(plan.decode)), float(plan.decode_kv))
            self._cost_calls += 1
            self._cost_points += 1
            end_s = now_s + (float(lat) + plan.swap_s)
            self._phase = _Phase(start_s=now_s, ends_s=np.array([end_s]),
                                 cum_energy_j=np.array([float(en)]), k=1, plan=plan)
        return self._phase

    def _on_submit(self, arrival_s: float) -> None:
        """Keep the cached phase valid: cut it before the first step that could see the new
        arrival."""
        ph = self._phase
        if ph is None:
            return
        if ph.plan is not None:
            if arrival_s <= ph.start_s:
                self._phase = None
            return
        if not ph.arrival_sensitive or arrival_s >= ph.blocked_from_s:
            return
        k = max(ph.done, ph.steps_starting_before(arrival_s))
        if k == ph.done:
            self._phase = None
        else:
            ph.k = k

    # ------------------------------------------------------------------ scheduling

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def _admit_blocks(self, r: Request) -> int:
        if r.prefill_left > 0:
            return self._blocks_for(r.prompt_tokens)
        return self._blocks_for(r.kv_tokens + 1)

    def _move_arrivals(self, now_s: float) -> None:
        while self._pending and self._pending[0][0] <= now_s:
            r = heapq.heappop(self._pending)[2]
            if r.prefill_left == 0 and r.generated_tokens >= r.output_tokens:
                self._finish(r, r.arrival_s)     # decode mode, output 1: nothing left to do
            else:
                self._waiting.append(r)

    def _plan_step(self) -> _StepPlan:
        """Decide the step starting now (see the module docstring); mutates nothing but the
        arrival of due requests into the waiting queue."""
        self._move_arrivals(self._clock_s)
        free = self._free_blocks
        alive = list(self._running)
        victims: list[Request] = []
        decode: list[tuple[Request, int]] = []
        i = 0
        while i < len(alive):
            r = alive[i]
            if r.prefill_left == 0:
                need = max(0, self._blocks_for(r.kv_tokens + 1) - r.blocks)
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

    def _execute(self, plan: _StepPlan, latency_s: float, energy_j: float) -> None:
        """Apply one general step of ``latency_s`` (swap time included) to the state."""
        for v in plan.victims:
            self._free_blocks += v.blocks
            v.blocks = 0
            v.swapped = True
            v.preemptions += 1
            self._preemptions += 1
            self._waiting.appendleft(v)          # the oldest victim ends up first
        for r, need in plan.admits:
            head = self._waiting.popleft()
            assert head is r
            r.blocks = need
            r.swapped = False
            self._free_blocks -= need
        if plan.victims:
            gone = {id(v) for v in plan.victims}
            self._running = [r for r in self._running if id(r) not in gone]
        self._running.extend(r for r, _ in plan.admits)
        self._clock_s += latency_s
        now_s = self._clock_s
        self._busy_s += latency_s
        self._swap_s += plan.swap_s
        self._step_energy_j += energy_j + self._static_w * plan.swap_s
        self._steps += 1
        done: list[Request] = []
        for r, nb in plan.decode:
            r.blocks += nb
            self._free_blocks -= nb
            r.kv_tokens += 1
            r.generated_tokens += 1
            if r.generated_tokens >= r.output_tokens:
                done.append(r)
        self._decode_tokens += len(plan.decode)
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
        self._prefill_tokens += plan.prefill_tokens
        self._retire(done, now_s)

    def _plan_decode_phase(self, plan: _StepPlan) -> _Phase:
        """Price, in one vectorised call, the run of pure decode steps starting now."""
        seqs = [r for r, _ in plan.decode]
        n = len(seqs)
        bt = self.block_tokens
        kv = np.fromiter((r.kv_tokens for r in seqs), dtype=np.int64, count=n)
        blk = np.fromiter((r.blocks for r in seqs), dtype=np.int64, count=n)
        k_finish = min(r.output_tokens - r.generated_tokens for r in seqs)
        slack = np.sort(blk * bt - kv)           # step of each sequence's next new block
        free = self._free_blocks
        k_blocks = int(slack[free % n]) + (free // n) * bt
        k = max(1, min(k_finish, k_blocks, self.max_phase_steps))
        decode_kv = float(kv.sum() + n) + float(n) * np.arange(k, dtype=np.float64)
        lat, en = self.cost.step(0.0, 0.0, float(n), decode_kv)
        self._cost_calls += 1
        self._cost_points += k
        lat = np.broadcast_to(np.asarray(lat, dtype=np.float64), (k,))
        en = np.broadcast_to(np.asarray(en, dtype=np.float64), (k,))
        now_s = self._clock_s
        # Only an arrival into an empty waiting queue can change the batch; whether the batch
        # has a free slot, token budget or blocks for it can only get worse during the phase.
        sensitive = (not self._waiting and n < self.max_batch
                     and n < self.max_batched_tokens)
        ph = _Phase(start_s=now_s, ends_s=now_s + np.cumsum(lat), cum_energy_j=np.cumsum(en),
                    k=k, seqs=seqs, arrival_sensitive=sensitive)
        if sensitive and self._pending:
            head_s, _, head = self._pending[0]
            if self._admit_blocks(head) > free:
                ph.blocked_from_s = head_s       # it will wait, and everyone behind it too
            else:
                ph.k = max(1, ph.steps_starting_before(head_s))
        return ph

    def _consume_decode(self, ph: _Phase, upto: int) -> None:
        """Apply steps ``ph.done .. upto-1`` of a pure decode phase (O(running) work)."""
        m = upto - ph.done
        if m <= 0:
            return
        prev_end_s = ph.start_s if ph.done == 0 else float(ph.ends_s[ph.done - 1])
        prev_en_j = 0.0 if ph.done == 0 else float(ph.cum_energy_j[ph.done - 1])
        ph.done = upto
        now_s = float(ph.ends_s[upto - 1])
        self._clock_s = now_s
        self._busy_s += now_s - prev_end_s
        self._step_energy_j += float(ph.cum_energy_j[upto - 1]) - prev_en_j
        self._steps += m
        self._decode_tokens += m * len(ph.seqs)
        bt = self.block_tokens
        done: list[Request] = []
        for r in ph.seqs:
            r.kv_tokens += m
            r.generated_tokens += m
            nb = -(-r.kv_tokens // bt)
            if nb > r.blocks:
                self._free_blocks -= nb - r.blocks
                r.blocks = nb
            if r.generated_tokens >= r.output_tokens:
                done.append(r)
        if ph.done >= ph.k:
            self._phase = None
        self._retire(done, now_s)

    def _retire(self, done: list[Request], now_s: float) -> None:
        if not done:
            return
        gone = {id(r) for r in done}
        self._running = [r for r in self._running if id(r) not in gone]
        for r in done:
            self._finish(r, now_s)

    def _finish(self, r: Request, now_s: float) -> None:
        r.finish_s = now_s
        self._free_blocks += r.blocks
        r.blocks = 0
        self._finished.append(r)
        self._unreported.append(r)
