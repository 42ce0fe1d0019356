"""Event-driven engines for the cluster simulator: the ``prefill`` and ``decode`` modes of
:class:`sim.engine.Engine` (same scheduling rules, same step-cost protocol) with work per
*request* instead of per step or per batch member.

:class:`sim.engine.Engine` is the reference: one readable scheduler, stepped one step at a time
(``exact=True``) or in vectorised runs of decode steps. Its runs still touch every running
sequence at every arrival and finish, which costs O(batch) Python work per event; a day of
production traffic (2.5 M requests) needs less. These two engines keep the same rules and state
in a form that changes in O(1) or O(log n) per event:

*Decode* (P/D disaggregation, decode side). With ``D`` decode steps done, a running request's
KV length is ``o + D`` and its output count ``g + D`` for offsets fixed at admission, so it
finishes at step ``output - g`` (a heap of finish steps), the step's summed KV is
``sum(o) + n*D`` and the sequences needing a new KV block at step ``D`` are those with
``(o + D) % block_tokens == 0``: a count per residue class (``block_tokens`` counters) gives the
blocks a run of steps takes and the step at which they run out, in O(block_tokens). Between
events (an admission, a finish, blocks running out, an arrival that could join) the batch is
constant and only the KV grows by ``n`` per step, so the step latency is ``a + b*s`` for the
``s``-th step (the step-cost table linearised between the run's first and last step; the
tables are smooth in KV, see ``tests/sim/test_fastengine.py`` for the agreement with the
reference) and the time of any step is a closed-form quadratic (:class:`_DecodeRun`): decode is
never stepped token by token. Preemption (swap the newest admission to host when blocks run
out) walks the running list as the reference does; it is rare.

*Prefill* (prefill side). Every step is a scheduling point (chunks of up to
``max_batched_tokens`` prompt tokens, FCFS admission while ``max_batch``, the token budget and
the prompt's KV blocks allow); a request is handed off at the end of the step that processes its
last prompt token. Work per step is O(requests in the step).

*Abort* (a client went away: :meth:`PrefillEngine.abort`, :meth:`DecodeEngine.abort`) is rare
and does its work itself, O(requests in the engine): the request leaves the queue, or the batch
at the engine's clock (its blocks and counts given back), and the planned step or run of steps
is planned again from the clock; nothing on the stepping paths looks for aborted requests.

Times, energy and the idle accounting follow :class:`sim.engine.Engine` (static power over idle
time, swap time charged to the step that swaps); both engines satisfy
:class:`sim.engine.SimEngine` and share its counters, stats and KV-block accounting
(:class:`sim.engine.EngineBase`). Speed: the hot loops keep engine attributes in locals and
update ``free`` in place; :meth:`~sim.kvcache.KVBlocks.blocks_for` is called per request (at
submission, admission, finish, preemption), never per step of a run.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Hashable

from .engine import EngineBase, EngineStats, RequestTimes, max_run_steps_arg


class FastRequest(RequestTimes):
    """One request's progress (times in engine virtual seconds)."""

    __slots__ = ("req_id", "arrival_s", "prompt_tokens", "output_tokens", "first_token_s",
                 "finish_s", "preemptions", "kv", "gen", "o", "g", "tag", "swapped", "left",
                 "done_tokens", "energy_j", "e0", "prefill_done", "blocks")

    def __init__(self, req_id, arrival_s: float, prompt: int, output: int):
        self.req_id = req_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt
        self.output_tokens = output
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.preemptions = 0
        self.kv = 0            # KV tokens while not running (decode)
        self.gen = 0           # output tokens so far while not running (decode)
        self.o = 0             # running: KV = o + D (decode); this step's chunk (prefill)
        self.g = 0             # running: generated = g + D
        self.tag = 0           # admission tag (stale finish-heap entries)
        self.swapped = False
        self.left = 0          # prefill: prompt tokens still to process
        self.done_tokens = 0   # prefill: prompt tokens processed
        self.energy_j = 0.0    # its share of the energy of the steps it was in
        self.e0 = 0.0          # decode: per-sequence energy integral when it was admitted
        self.prefill_done = False  # prefill: handed off after its first token
        self.blocks = 0        # prefill: KV blocks of its prompt


class _FastBase(EngineBase):
    """The event-driven engines' common part: float start time and the cost's scalar path."""

    __slots__ = ("_step",)

    def __init__(self, cost, max_batch: int, max_batched_tokens: int, block_tokens: int,
                 start_s: float):
        super().__init__(cost, max_batch, max_batched_tokens, block_tokens, float(start_s))
        # Python floats in and out: the table's scalar path when it has one
        self._step = getattr(cost, "step1", None) or (
            lambda *a: tuple(float(x) for x in cost.step(*a)))

    @property
    def clock(self) -> float:
        """The engine's clock (``now_s``)."""
        return self._clock_s


class PrefillEngine(_FastBase):
    """Prefill-only engine (hand-off after the first token); see the module docstring."""

    __slots__ = ("_next",)

    def __init__(self, cost, max_batch: int = 256, max_batched_tokens: int = 8192,
                 block_tokens: int = 16, start_s: float = 0.0):
        super().__init__(cost, max_batch, max_batched_tokens, block_tokens, start_s)
        self._running: list[FastRequest] = []
        # the step starting at the clock, once planned by next_event_time():
        # (end, latency, energy, prompt tokens, requests in it, admissions, blocks they take)
        self._next: tuple | None = None

    def submit(self, req_id: Hashable, arrival_s: float, prompt_tokens: int,
               output_tokens: int = 1, not_before_s: float | None = None) -> FastRequest:
        """Queue a prompt arriving at ``arrival_s``. ``not_before_s``: the engine may not start
        it earlier (a pipeline's first stage busy with another virtual engine's micro-batch:
        :class:`sim.vpod.VPodEngines`); its times still count from ``arrival_s``."""
        r = FastRequest(req_id, float(arrival_s), int(prompt_tokens), int(output_tokens))
        r.blocks = self._check_request(req_id, r.arrival_s, r.prompt_tokens, r.output_tokens,
                                       "prefill")
        r.left = r.prompt_tokens
        due = r.arrival_s if not_before_s is None else max(r.arrival_s, float(not_before_s))
        heapq.heappush(self._pending, (due, self._n_submitted, r))
        self._n_submitted += 1
        if self._next is not None and due <= self._clock_s:
            self._next = None                  # it may join the step planned at the clock
        return r

    def lone_prompt_s(self, prompt_tokens: int) -> float:
        """How long a prompt alone takes on this engine: its chunks of at most the batched-token
        budget, each a step priced as :meth:`_plan_step` prices it."""
        budget, done, t = max(1, self.max_batched_tokens), 0, 0.0
        while done < prompt_tokens:
            c = min(budget, prompt_tokens - done)
            t += self._step(float(c), c * done + c * (c + 1) * 0.5, 0.0, 0.0)[0]
            done += c
        return t

    def batched_prompt_s(self, prompt_tokens: int) -> float:
        """A prompt's share of a step full of prompts of its length: ``k`` = as many as the
        batch and the batched-token budget take (one step of ``k`` x its tokens, over ``k``);
        a prompt longer than the budget shares no step (:meth:`lone_prompt_s`). What a prompt
        queued behind others adds to a busy engine's work: it joins the next step with them."""
        L = max(1, int(prompt_tokens))
        budget = max(1, self.max_batched_tokens)
        k = min(self.max_batch, budget // L)
        if k <= 1:
            return self.lone_prompt_s(L)
        return self._step(float(k * L), k * (L * (L + 1) * 0.5), 0.0, 0.0)[0] / k

    def tokens_out(self, r: FastRequest, t_s: float | None = None) -> int:
        """Output tokens of ``r`` that exist at engine time ``t_s`` (default: the clock): 1 once
        the step that processes its last prompt token has ended, else 0. A wall-clock driver
        that called ``advance_to(now)`` passes ``now``: the step in progress then (it ends at
        the clock) has not made its token yet. O(1)."""
        f = r.finish_s
        return 1 if f is not None and (t_s is None or f <= t_s) else 0

    def abort(self, r: FastRequest) -> bool:
        """Take ``r`` out of the engine at its clock (a client went away; see
        :meth:`sim.engine.SimEngine.abort`). Waiting or not yet arrived: it leaves the queue.
        Running (part of its prompt done): it leaves the batch after the step that ended at the
        clock, giving back the blocks of its prompt; the chunks it got stay counted (tokens,
        its energy share). The step planned at the clock is planned again (its chunks and
        admissions may change). False when ``r`` is not in the engine. O(requests in it)."""
        if r.finish_s is not None:
            return False
        run = self._running
        for i, x in enumerate(run):
            if x is r:
                del run[i]                       # FCFS order of the others is kept
                self.free += r.blocks
                break
        else:
            if self._drop_queued(r) is None:
                return False
        self._next = None
        return True

    def stats(self) -> EngineStats:
        """Counters (every cost call prices one step: ``cost_points`` is ``cost_calls``)."""
        return dataclasses.replace(super().stats(), cost_points=self.cost_calls)

    def next_event_time(self) -> float | None:
        """The end of the step starting at the clock, else the next arrival, else None."""
        self._next = st = self._next or self._plan_step()
        return self._event_time(None if st is None else st[0])

    def _plan_step(self) -> tuple | None:
        """Compose and price the step starting at the clock (None when idle). Mutates only the
        arrival of due requests into the waiting queue and the requests' chunk sizes (``o``):
        admissions are applied when the step runs."""
        now = self._clock_s
        pend, run, wait = self._pending, self._running, self._waiting
        while pend and pend[0][0] <= now:       # _move_arrivals(), inline: once per step
            wait.append(heapq.heappop(pend)[2])
        if not run and not wait:
            return None
        left = self.max_batched_tokens
        ptok = 0
        ctx = 0.0
        stepped = []
        for r in run:
            if left <= 0:
                break
            c = r.left if r.left < left else left
            r.o = c                              # this step's chunk
            ptok += c
            ctx += c * r.done_tokens + c * (c + 1) * 0.5
            left -= c
            stepped.append(r)
        nseq, mb = len(run), self.max_batch
        free = self.free
        admits = 0
        for r in wait:                           # FCFS while slots, budget and blocks allow
            if nseq >= mb or left <= 0 or r.blocks > free:
                break
            free -= r.blocks
            nseq += 1
            admits += 1
            c = r.left if r.left < left else left
            r.o = c
            ptok += c
            ctx += c * (c + 1) * 0.5
            left -= c
            stepped.append(r)
        if not stepped:
            raise RuntimeError("engine stalled: work queued but nothing schedulable")
        lat, en = self._step(float(ptok), ctx, 0.0, 0.0)
        self.cost_calls += 1
        return now + lat, lat, en, ptok, stepped, admits, self.free - free

    def advance_to(self, t_s: float) -> list[FastRequest]:
        """Run every step that starts before ``t_s``; returns the requests handed off since
        the previous call."""
        wait, out = self._waiting, self._unreported
        # counters kept in locals while stepping (same sums, same order), stored on the way out
        steps, ptoks, busy, energy, reported = 0, 0, self.busy_s, self.step_energy_j, len(out)
        while self._clock_s < t_s:
            st = self._next or self._plan_step()
            if st is None:                       # idle: jump to the next arrival or to t_s
                pend = self._pending
                if pend and pend[0][0] < t_s:
                    self._clock_s = pend[0][0]
                    continue
                if t_s != math.inf:
                    self._clock_s = t_s
                break
            self._next = None
            end, lat, en, ptok, stepped, admits, taken = st
            run = self._running
            for _ in range(admits):
                run.append(wait.popleft())
            self.free -= taken
            self._clock_s = end
            busy += lat
            energy += en
            steps += 1
            ptoks += ptok
            freed = nfin = 0
            per_tok = en / ptok
            for r in stepped:
                c = r.o
                r.left -= c
                r.done_tokens += c
                r.energy_j += per_tok * c
                if r.left == 0:                  # handed off (_finish(), inline)
                    r.first_token_s = r.finish_s = end
                    r.prefill_done = True
                    freed += r.blocks
                    nfin += 1
                    out.append(r)
            if nfin:
                # FCFS chunks: every request in the step gets all it has left but the last one,
                # so the finished ones are the head of the running list
                self.free += freed
                del run[:nfin]
        self.busy_s, self.step_energy_j = busy, energy
        self.steps += steps
        self.iterations += steps
        self.prefill_tokens += ptoks
        self.n_finished += len(out) - reported
        return self._report()


class _DecodeRun:
    """``k`` decode steps of an unchanging batch planned at ``t0``: ``sw`` seconds of swap,
    then step ``s`` (0-based) takes ``a + b*s`` seconds and ``ea + eb*s`` joules, so the first
    ``m`` steps end at ``end_of(m) = t0 + sw + m*a + b*m*(m-1)/2`` and take
    ``energy_of(m) = m*ea + eb*m*(m-1)/2`` joules. These closed forms are spelled inline where
    they are used (always in this order of operations: the results are bit-identical), since
    they run for nearly every event of the cluster simulation."""

    __slots__ = ("t0", "sw", "a", "b", "ea", "eb", "k", "done", "sensitive", "room",
                 "blocked_from", "end", "undo")

    def __init__(self, t0: float, sw: float, a: float, b: float, ea: float, eb: float, k: int):
        self.t0, self.sw, self.a, self.b, self.ea, self.eb = t0, sw, a, b, ea, eb
        self.k = k                         # steps (may shrink when a request is submitted)
        self.done = 0                      # steps applied to the engine state
        self.sensitive = False             # an arrival before blocked_from could join
        self.room = 0                      # (sensitive) free blocks an arrival could take
        self.blocked_from = math.inf       # arrivals from here on queue behind a blocked one
        self.end = t0 + sw + k * a + b * k * (k - 1) * 0.5   # end_of(k)
        self.undo = None                   # (swap owed, last tag, victims) before planning

    def cut(self, k: int) -> None:
        """Keep only the first ``k`` steps."""
        self.k = k
        self.end = self.t0 + self.sw + k * self.a + self.b * k * (k - 1) * 0.5

    def count_before(self, t: float) -> int:
        """Steps of the run starting strictly before ``t``."""
        t0, sw, a, b, k = self.t0, self.sw, self.a, self.b, self.k
        if t <= t0:
            return 0
        if t > self.end:                   # after the last step starts: the whole run
            # end_of(k - 1): the start of the last step
            if k == 1 or t > t0 + sw + (k - 1) * a + b * (k - 1) * (k - 2) * 0.5:
                return k
        x = t - t0 - sw
        if x <= 0.0:
            return 1
        if abs(b) * k < 1e-9 * a:
            m = int(x / a)
        else:
            bb = a - 0.5 * b
            disc = bb * bb + 2.0 * b * x
            m = int((-bb + math.sqrt(disc)) / b) if disc > 0 else k
        m = max(0, min(m, k))
        # the float estimate is exact to a step or so: walk to the last step starting before
        # t (the first m steps take end_of(m) - t0 - sw = m*a + b*m*(m-1)/2)
        while m + 1 < k and (m + 1) * a + b * (m + 1) * m * 0.5 < x:
            m += 1
        while m >= 1 and m * a + b * m * (m - 1) * 0.5 >= x:
            m -= 1
        return min(k, m + 1)


class DecodeEngine(_FastBase):
    """Decode-only engine (requests arrive with their prompt KV and first token); see the
    module docstring. ``max_run_steps`` (old name ``max_phase_steps``) bounds the steps priced
    by one linearisation."""

    __slots__ = ("max_run_steps", "D", "_e_seq", "n", "sum_o", "cnt", "_fin", "_tag", "_sw",
                 "_step_run", "_line")

    def __init__(self, cost, max_batch: int = 256, max_batched_tokens: int = 8192,
                 block_tokens: int = 16, start_s: float = 0.0, max_run_steps: int = 256, *,
                 max_phase_steps: int | None = None):
        super().__init__(cost, max_batch, max_batched_tokens, block_tokens, start_s)
        self.max_run_steps = max(1, int(max_run_steps_arg(max_run_steps, max_phase_steps)))
        self.D = 0                          # decode steps done
        self._e_seq = 0.0                   # sum over steps of step energy / batch size
        self.n = 0                          # running sequences
        self.sum_o = 0
        self.cnt = [0] * block_tokens       # running sequences per residue of o
        self._running: dict[int, FastRequest] = {}   # admission order
        self._fin: list = []                # (finish step, tag, request)
        self._tag = 0
        self._sw = 0.0                      # swap time owed by the next step
        self._step_run: _DecodeRun | None = None
        step = self._step
        self._line = getattr(cost, "decode_line", None) or (
            lambda n, k0, k1: step(0.0, 0.0, n, k0) + step(0.0, 0.0, n, k1))

    def full_batch_step_s(self, kv_tokens: float) -> float:
        """One decode step of a full batch, every sequence at ``kv_tokens`` of KV: the
        longest a step of sequences that short takes (what a router projecting when a slot
        frees may assume; :meth:`sim.vpod.VPodEngines._slot_at`)."""
        b = float(self.max_batch)
        return self._step(0.0, 0.0, b, b * float(kv_tokens))[0]

    def submit(self, req_id: Hashable, arrival_s: float, prompt_tokens: int,
               output_tokens: int) -> FastRequest:
        """A request whose prompt KV and first token arrive at ``arrival_s``."""
        r = FastRequest(req_id, float(arrival_s), int(prompt_tokens), int(output_tokens))
        self._check_request(req_id, r.arrival_s, r.prompt_tokens, r.output_tokens, "decode")
        r.kv, r.gen, r.first_token_s = r.prompt_tokens, 1, r.arrival_s
        heapq.heappush(self._pending, (r.arrival_s, self._n_submitted, r))
        self._n_submitted += 1
        run = self._step_run
        if run is not None and run.sensitive and r.arrival_s < run.blocked_from:
            self._arrival_during(run, r)
        return r

    def _arrival_during(self, run: _DecodeRun, r: FastRequest) -> None:
        """``r`` arrives during ``run``, which it could join: cut the run before the first step
        that sees it; or, when its blocks do not fit, let it (and all after it) wait, as
        :meth:`_build_run` does with an arrival submitted before the run was planned."""
        if -(-(r.kv + 1) // self.bt) > run.room:   # blocks_for(), inline: per submission
            run.blocked_from = r.arrival_s
            return
        k = max(run.done, run.count_before(r.arrival_s))
        if k == run.done:
            self._step_run = None
            if k == 0:
                self._sw += run.sw                # the swap is still owed by the next step
        else:
            run.cut(k)

    def tokens_out(self, r: FastRequest, t_s: float | None = None) -> int:
        """Output tokens of ``r`` that exist at engine time ``t_s`` (default: the clock), the
        first one (which came with the request) included: ``output_tokens`` once finished,
        ``g + D`` while running, ``gen`` while waiting, swapped out or not yet arrived. The
        last step applied ends at the clock: a ``t_s`` before it (a wall-clock driver that
        called ``advance_to(now)`` passes ``now``) does not see that step's token yet. (A
        request preempted at the clock counts the token of the step in progress.) O(1)."""
        late = t_s is not None and t_s < self._clock_s
        if r.finish_s is not None:
            if late and r.finish_s > t_s:
                return max(r.output_tokens - 1, 1)
            return r.output_tokens
        if r.tag:                                # running: admitted at step gen - g
            n = r.g + self.D
            return n - 1 if late and n > r.gen else n
        return r.gen

    def abort(self, r: FastRequest) -> bool:
        """Take ``r`` out of the engine at its clock (a client went away; see
        :meth:`sim.engine.SimEngine.abort`); False when ``r`` is not in the engine.

        Running: it leaves the batch at step D (the steps applied so far stay, with its tokens
        and its share of their energy): :meth:`_stop_r` gives back its blocks (KV ``o + D``) and
        takes it out of the residue counts ``cnt``, ``sum_o`` and ``n``, its finish-heap entry
        goes stale as a preempted request's does. Waiting (swapped out or not) or not yet
        arrived: it leaves the queue. The cached run of steps is then cut where it no longer
        holds (:meth:`_drop_run`): always after a running request left (its remaining steps
        were priced for the larger batch); after a waiting one when it headed the queue (the
        next may fit now) or when nothing of the run has been applied yet; after a future
        arrival only when it cut or blocked an arrival-sensitive run. O(requests in it)."""
        if r.finish_s is not None:
            return False
        run = self._step_run
        if r.tag and self._running.get(r.tag) is r:
            r.gen = r.g + self.D                 # what tokens_out() says from now on
            r.kv = self._stop_r(r)
            replan = True
        else:
            wait = self._waiting
            head = bool(wait) and wait[0] is r
            where = self._drop_queued(r)
            if where is None:
                return False
            if run is None:
                return True
            if where == "waiting":
                replan = head or run.done == 0
            else:
                replan = (run.sensitive and r.arrival_s <= run.blocked_from
                          and r.arrival_s <= run.end)
        if replan and run is not None:
            self._drop_run(run, r)
        return True

    def _drop_run(self, run: _DecodeRun, gone: FastRequest) -> None:
        """Forget the cached ``run``: the next step (at the clock, step D) is planned again.
        When none of its steps has been applied yet, what its planning did at the clock is
        taken back first (``run.undo``), so that the new plan is the one the engine would have
        made without ``gone``: the swap time owed then is owed again, the requests admitted
        (the newest tags) go back to the head of the queue (swapped out if they were) and the
        victims of a preemption go back to the end of the batch in their order with the same
        KV (their finish-heap entries are renewed, the old ones go stale), their preemptions
        uncounted. ``gone`` (just aborted; it may be one of those) stays out. The step at the
        clock is then planned again at once (the engine stays planned, as it was); a run
        already under way is planned again when the engine next needs it."""
        self._step_run = None
        if run.done:
            return                               # its first step paid the swap
        if run.undo is None:                     # planning changed nothing but the swap owed
            self._sw += run.sw
            self._plan()
            return
        sw0, tag0, victims = run.undo
        wait, D = self._waiting, self.D
        for tag in reversed(list(self._running)):   # admission order: newest last
            if tag <= tag0:
                break
            v = self._running[tag]
            v.gen = v.g + D
            v.kv = self._stop_r(v)
            v.swapped = v.preemptions > 0        # a preempted request waits swapped out
            wait.appendleft(v)
        for v in reversed(victims or ()):        # oldest first: they head the queue
            v.swapped = False
            v.preemptions -= 1
            self.preemptions -= 1
            if v is not gone:                    # (gone has left the queue already)
                wait.popleft()
                self._run_r(v)
        self._sw = sw0
        self._plan()

    def next_event_time(self) -> float | None:
        """The end of the current run of steps (planning it if needed), else the next arrival,
        else None."""
        run = self._step_run or self._plan()
        return self._event_time(None if run is None else run.end)

    def advance_to(self, t_s: float) -> list[FastRequest]:
        """Run every step that starts before ``t_s``; returns the requests finished since the
        previous call."""
        while self._clock_s < t_s:
            run = self._step_run or self._plan()
            if run is None:                      # idle: jump to the next arrival or to t_s
                pend = self._pending
                if pend and pend[0][0] < t_s:
                    self._clock_s = max(self._clock_s, pend[0][0])
                    continue
                if t_s != math.inf:
                    self._clock_s = t_s
                break
            upto = run.count_before(t_s) if t_s != math.inf else run.k
            self._consume(run, max(upto, run.done + 1))
        return self._report()

    # ---- residue-class block arithmetic ----------------------------------------------------
    def _blocks_over(self, d0: int, m: int) -> int:
        """KV blocks the running batch takes in steps d0 .. d0+m-1."""
        bt, cnt = self.bt, self.cnt
        full, rem = divmod(m, bt)
        s = full * self.n
        for j in range(rem):
            s += cnt[(-(d0 + j)) % bt]
        return s

    def _first_failing(self) -> int:
        """Index (from step D) of the first step whose new blocks do not fit: the ``free``-th
        (0-based) block request in time order (a full cycle of ``bt`` steps takes ``n``)."""
        n, bt, cnt, D = self.n, self.bt, self.cnt, self.D
        c, r = divmod(self.free, n)
        acc = 0
        for j in range(bt):
            acc += cnt[(-(D + j)) % bt]
            if acc > r:
                return c * bt + j
        return c * bt + bt      # unreachable: a full cycle takes n > r blocks

    # ---- the running batch -----------------------------------------------------------------
    def _run_r(self, r: FastRequest) -> None:
        """Put ``r`` (KV ``r.kv``, ``r.gen`` tokens) into the running batch at step D."""
        D = self.D
        r.o, r.g = r.kv - D, r.gen - D
        self._tag += 1
        r.tag = self._tag
        r.e0 = self._e_seq
        self._running[self._tag] = r
        heapq.heappush(self._fin, (r.output_tokens - r.g, self._tag, r))
        self.cnt[r.o % self.bt] += 1
        self.sum_o += r.o
        self.n += 1
        self.free -= -(-r.kv // self.bt)        # take(blocks_for(kv)), inline: per admission

    def _stop_r(self, r: FastRequest) -> int:
        """Take ``r`` out of the running batch; returns its KV length."""
        del self._running[r.tag]
        r.tag = 0
        r.energy_j += self._e_seq - r.e0
        self.cnt[r.o % self.bt] -= 1
        self.sum_o -= r.o
        self.n -= 1
        kv = r.o + self.D
        self.free += -(-kv // self.bt)          # give(blocks_for(kv)), inline: per finish
        return kv

    # ---- scheduling ------------------------------------------------------------------------
    def _plan(self) -> _DecodeRun | None:
        """Decide the step at D (preemption or admissions) and plan the run from it. (The
        calls are skipped when there is nothing for them to do: this runs once per run.)"""
        pend = self._pending
        if pend and pend[0][0] <= self._clock_s:
            self._move_arrivals(self._clock_s)
        if not self.n and not self._waiting:
            return None
        need = self.cnt[(-self.D) % self.bt] if self.n else 0   # new blocks of step D
        undo = None                  # what planning does at the clock, for abort() (_drop_run)
        if need > self.free:
            sw0, tag0 = self._sw, self._tag
            undo = (sw0, tag0, self._preempt())
        elif self._waiting:
            sw0, tag0 = self._sw, self._tag
            self._admit(self.free - need)
            if self._tag != tag0:
                undo = (sw0, tag0, None)
        if not self.n:
            if self._waiting:
                raise RuntimeError("engine stalled: work queued but nothing schedulable")
            return None
        if undo is None:
            return self._build_run(self._run_length(), need)
        run = self._build_run(self._run_length() if undo[2] is None else 1, need)
        run.undo = undo
        return run

    def _preempt(self) -> list[FastRequest]:
        """The blocks of step D do not fit: walking the batch oldest first, swap out the newest
        admissions (possibly the sequence needing the block) until every remaining sequence
        gets the block its token needs, as the reference engine does. Returns the victims,
        newest first (they head the waiting queue oldest first)."""
        D, bt = self.D, self.bt
        alive = list(self._running.values())
        free = self.free
        vict = []
        i = 0
        while i < len(alive):
            r = alive[i]
            nr = 1 if (r.o + D) % bt == 0 else 0
            while nr > free and alive[-1] is not r:
                v = alive.pop()
                vict.append(v)
                free += self.blocks_for(v.o + D)
            if nr > free:
                alive.pop()
                vict.append(r)
                break
            free -= nr
            i += 1
        for v in vict:                           # newest first; the oldest ends up first
            v.gen = v.g + D
            v.kv = self._stop_r(v)
            v.swapped = True
            v.preemptions += 1
            self.preemptions += 1
            self._sw += v.kv * self._swap_s_per_token
            self._waiting.appendleft(v)
        return vict

    def _admit(self, free: int) -> None:
        """Admit waiting requests FCFS while the batch, the token budget and ``free`` blocks
        allow (a request needs the blocks of its KV plus the token it writes next)."""
        wait = self._waiting
        n, mb = self.n, self.max_batch
        tokens_left = self.max_batched_tokens - n
        while wait and n < mb and tokens_left > 0:
            r = wait[0]
            nb = -(-(r.kv + 1) // self.bt)      # blocks_for(), inline: per admission
            if nb > free:
                break
            wait.popleft()
            free -= nb
            tokens_left -= 1
            if r.swapped:
                self._sw += r.kv * self._swap_s_per_token
                r.swapped = False
            self._run_r(r)
            n += 1

    def _run_length(self) -> int:
        """Steps from D while the batch cannot change: to the earliest finish, at most
        ``max_run_steps``, and short of the first step whose new blocks do not fit."""
        fin = self._fin
        while fin[0][2].tag != fin[0][1]:        # stale entries of preempted requests
            heapq.heappop(fin)
        k = fin[0][0] - self.D
        if k > self.max_run_steps:
            k = self.max_run_steps
        if self.free < self.n * (k // self.bt + 2):   # blocks may run out within k steps
            k = min(k, self._first_failing())
        return k if k >= 1 else 1

    def _build_run(self, k: int, need: int) -> _DecodeRun:
        """Price ``k`` steps of the current batch (linearised between the first and the last)
        and cut the run at the first step an arrival could join."""
        n = self.n
        K0 = self.sum_o + n * (self.D + 1)
        self.cost_calls += 1
        if k > 1:
            a, ea, a2, ea2 = self._line(float(n), float(K0), float(K0 + n * (k - 1)))
            b = (a2 - a) / (k - 1)
            eb = (ea2 - ea) / (k - 1)
            self.cost_points += 2
        else:
            a, ea = self._step(0.0, 0.0, float(n), float(K0))
            b = eb = 0.0
            self.cost_points += 1
        run = _DecodeRun(self._clock_s, self._sw, a, b, ea, eb, k)
        self._sw = 0.0
        if not self._waiting and n < self.max_batch and n < self.max_batched_tokens:
            run.sensitive = True                  # an arrival could join the batch
            run.room = self.free - need
            pend = self._pending
            if pend:
                head_s, _, head = pend[0]
                if -(-(head.kv + 1) // self.bt) > run.room:   # blocks_for(), inline
                    run.blocked_from = head_s     # it will wait, and everyone behind it too
                elif head_s < run.end:
                    run.cut(max(1, run.count_before(head_s)))
        self._step_run = run
        return run

    def _consume(self, run: _DecodeRun, upto: int) -> None:
        """Apply steps ``run.done .. upto-1`` (O(block_tokens) plus the finishes). The hottest
        function of the cluster simulation: the run's closed forms (``end_of``, ``energy_of``,
        see :class:`_DecodeRun`) and, for fewer than ``bt`` steps, ``_blocks_over`` are spelled
        inline."""
        done = run.done
        m = upto - done
        if m <= 0:
            return
        t0, sw, a, b, ea, eb = run.t0, run.sw, run.a, run.b, run.ea, run.eb
        end = t0 + sw + upto * a + b * upto * (upto - 1) * 0.5
        e = upto * ea + eb * upto * (upto - 1) * 0.5
        if done == 0:
            start = t0
            e += self._static_w * sw
            self.swap_s += sw
        else:
            start = t0 + sw + done * a + b * done * (done - 1) * 0.5
            e -= done * ea + eb * done * (done - 1) * 0.5
        bt, D = self.bt, self.D
        if m >= bt:
            self.free -= self._blocks_over(D, m)
        else:
            cnt = self.cnt
            taken = 0
            for j in range(m):
                taken += cnt[(-(D + j)) % bt]
            self.free -= taken
        self.D = D = D + m
        run.done = upto
        self._clock_s = end
        self.busy_s += end - start
        self.step_energy_j += e
        n = self.n
        self._e_seq += e / n
        self.steps += m
        self.decode_tokens += m * n
        self.iterations += 1
        fin = self._fin
        if fin and fin[0][0] <= D:
            out = self._unreported
            while fin and fin[0][0] <= D:
                F, tag, r = heapq.heappop(fin)
                if r.tag != tag:
                    continue
                self._stop_r(r)
                r.finish_s = end                 # _finish(), inline: per request
                out.append(r)
                self.n_finished += 1
            self._step_run = None
        elif upto >= run.k:
            self._step_run = None
