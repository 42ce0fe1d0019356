"""Event-driven engines for the cluster simulator: the ``prefill`` and ``decode`` modes of
:class:`sim.engine.Engine` (same scheduling rules, same step-cost protocol) with work per
*request* instead of per step or per batch member.

:class:`sim.engine.Engine` is the reference: one readable scheduler, stepped one step at a time
(``exact=True``) or in vectorised decode phases. Its phases still touch every running sequence
at every arrival and finish, which costs O(batch) Python work per event; a day of production
traffic (2.5 M requests) needs less. These two engines keep the same rules and state in a form
that changes in O(1) or O(log n) per event:

*Decode* (P/D disaggregation, decode side). With ``D`` decode steps done, a running request's
KV length is ``o + D`` and its output count ``g + D`` for offsets fixed at admission, so it
finishes at step ``output - g`` (a heap of finish steps), the step's summed KV is
``sum(o) + n*D`` and the sequences needing a new KV block at step ``D`` are those with
``(o + D) % block_tokens == 0``: a count per residue class (``block_tokens`` counters) gives the
blocks a run of steps takes and the step at which they run out, in O(block_tokens). Between
events (an admission, a finish, blocks running out, an arrival that could join) the batch is
constant and only the KV grows by ``n`` per step, so the step latency is ``a + b*s`` for the
``s``-th step (the step-cost table linearised between the phase's first and last step; the
tables are smooth in KV, see ``tests/sim/test_fastengine.py`` for the agreement with the
reference) and the time of any step is a closed-form quadratic: decode is never stepped token
by token. Preemption (swap the newest admission to host when blocks run out) walks the running
list as the reference does; it is rare.

*Prefill* (prefill side). Every step is a scheduling point (chunks of up to
``max_batched_tokens`` prompt tokens, FCFS admission while ``max_batch``, the token budget and
the prompt's KV blocks allow); a request is handed off at the end of the step that processes its
last prompt token. Work per step is O(requests in the step).

Times, energy and the idle accounting follow :class:`sim.engine.Engine` (static power over idle
time, swap time charged to the step that swaps).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable

from .engine import RequestTimes, check_engine_config, check_request


class FastRequest(RequestTimes):
    """One request's progress (times in engine virtual seconds)."""

    __slots__ = ("req_id", "arrival_s", "prompt_tokens", "output_tokens", "first_token_s",
                 "finish_s", "preemptions", "kv", "gen", "o", "g", "tag", "swapped", "left",
                 "done_tokens", "energy_j", "e0", "prefill_done")

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
        self.o = 0             # running: KV = o + D
        self.g = 0             # running: generated = g + D
        self.tag = 0           # admission tag (stale finish-heap entries)
        self.swapped = False
        self.left = 0          # prefill: prompt tokens still to process
        self.done_tokens = 0   # prefill: prompt tokens processed
        self.energy_j = 0.0    # its share of the energy of the steps it was in
        self.e0 = 0.0          # decode: per-sequence energy integral when it was admitted
        self.prefill_done = False  # prefill: handed off after its first token


class _Base:
    def __init__(self, cost, max_batch: int, max_batched_tokens: int, block_tokens: int,
                 start_s: float):
        check_engine_config(cost, max_batch, max_batched_tokens, block_tokens)
        self.cost = cost
        # Python floats in and out: the table's scalar path when it has one
        self._step = getattr(cost, "step1", None) or (
            lambda *a: tuple(float(x) for x in cost.step(*a)))
        self.max_batch = max_batch
        self.max_batched_tokens = max_batched_tokens
        self.bt = block_tokens
        self.total_blocks = cost.kv_capacity_tokens // block_tokens
        self.free = self.total_blocks
        self._static_w = float(cost.static_power_w) * cost.num_chips
        self._start_s = float(start_s)
        self.clock = float(start_s)
        self._pending: list = []          # (arrival_s, seq, request)
        self._waiting: deque = deque()
        self._seq = 0
        self._out: list[FastRequest] = []
        self.busy_s = 0.0
        self.step_energy_j = 0.0
        self.steps = 0
        self.cost_calls = 0
        self.preemptions = 0
        self.n_finished = 0

    @property
    def now_s(self) -> float:
        return self.clock

    def energy_j(self) -> float:
        """Step energy plus static power over the idle time since ``start_s``."""
        idle = max(0.0, self.clock - self._start_s - self.busy_s)
        return self.step_energy_j + self._static_w * idle

    def run_until_idle(self) -> list[FastRequest]:
        return self.advance_to(math.inf)


class PrefillEngine(_Base):
    """Prefill-only engine (hand-off after the first token); see the module docstring."""

    def __init__(self, cost, max_batch: int = 256, max_batched_tokens: int = 8192,
                 block_tokens: int = 16, start_s: float = 0.0):
        super().__init__(cost, max_batch, max_batched_tokens, block_tokens, start_s)
        self._running: list[FastRequest] = []

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._pending)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def idle(self) -> bool:
        return not (self._running or self._waiting or self._pending)

    def submit(self, req_id: Hashable, arrival_s: float, prompt_tokens: int,
               output_tokens: int = 1) -> FastRequest:
        check_request(req_id, arrival_s, prompt_tokens, output_tokens, "prefill",
                      self.total_blocks, self.bt)
        r = FastRequest(req_id, float(arrival_s), int(prompt_tokens), int(output_tokens))
        r.left = r.prompt_tokens
        heapq.heappush(self._pending, (r.arrival_s, self._seq, r))
        self._seq += 1
        return r

    def advance_to(self, t_s: float) -> list[FastRequest]:
        """Run every step that starts before ``t_s``; returns the requests handed off since
        the previous call."""
        pend, wait, run = self._pending, self._waiting, self._running
        mbt, bt = self.max_batched_tokens, self.bt
        step = self._step
        while self.clock < t_s:
            now = self.clock
            while pend and pend[0][0] <= now:
                wait.append(heapq.heappop(pend)[2])
            if not run and not wait:
                if pend and pend[0][0] < t_s:
                    self.clock = pend[0][0]
                    continue
                if t_s != math.inf:
                    self.clock = t_s
                break
            left = mbt
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
            nseq = len(run)
            while wait and nseq < self.max_batch and left > 0:
                r = wait[0]
                nb = -(-r.prompt_tokens // bt)
                if nb > self.free:
                    break
                wait.popleft()
                self.free -= nb
                run.append(r)
                nseq += 1
                c = r.left if r.left < left else left
                r.o = c
                ptok += c
                ctx += c * (c + 1) * 0.5
                left -= c
                stepped.append(r)
            if not stepped:
                raise RuntimeError("engine stalled: work queued but nothing schedulable")
            lat, en = step(float(ptok), ctx, 0.0, 0.0)
            self.cost_calls += 1
            self.steps += 1
            self.clock = end = now + lat
            self.busy_s += lat
            self.step_energy_j += en
            done = False
            per_tok = en / ptok
            for r in stepped:
                c = r.o
                r.left -= c
                r.done_tokens += c
                r.energy_j += per_tok * c
                if r.left == 0:
                    r.first_token_s = r.finish_s = end
                    r.prefill_done = True
                    self.free += -(-r.prompt_tokens // bt)
                    self._out.append(r)
                    self.n_finished += 1
                    done = True
            if done:
                self._running = run = [r for r in run if r.left > 0]
        out, self._out = self._out, []
        return out


class DecodeEngine(_Base):
    """Decode-only engine (requests arrive with their prompt KV and first token); see the
    module docstring. ``max_phase_steps`` bounds the steps priced by one linearisation."""

    def __init__(self, cost, max_batch: int = 256, max_batched_tokens: int = 8192,
                 block_tokens: int = 16, start_s: float = 0.0, max_phase_steps: int = 256):
        super().__init__(cost, max_batch, max_batched_tokens, block_tokens, start_s)
        self.max_phase_steps = max(1, int(max_phase_steps))
        self._swap_s_per_token = cost.kv_bytes_per_token / cost.host_bw_bytes_per_s
        self.D = 0                          # decode steps done
        self._e_seq = 0.0                   # sum over steps of step energy / batch size
        self.n = 0                          # running sequences
        self.sum_o = 0
        self.cnt = [0] * block_tokens       # running sequences per residue of o
        self._running: dict[int, FastRequest] = {}   # admission order
        self._fin: list = []                # (finish step, tag, request)
        self._tag = 0
        self._sw = 0.0                      # swap time owed by the next step
        self._ph: list | None = None
        # phase: [t0, sw, a, b, ea, eb, k, done, sensitive, blocked_from, end of step k-1]
        step = self._step
        self._line = getattr(cost, "decode_line", None) or (
            lambda n, k0, k1: step(0.0, 0.0, n, k0) + step(0.0, 0.0, n, k1))
        self.swap_s = 0.0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._pending)

    @property
    def num_running(self) -> int:
        return self.n

    @property
    def idle(self) -> bool:
        return not (self.n or self._waiting or self._pending)

    def submit(self, req_id: Hashable, arrival_s: float, prompt_tokens: int,
               output_tokens: int) -> FastRequest:
        """A request whose prompt KV and first token arrive at ``arrival_s``."""
        check_request(req_id, arrival_s, prompt_tokens, output_tokens, "decode",
                      self.total_blocks, self.bt)
        r = FastRequest(req_id, float(arrival_s), int(prompt_tokens), int(output_tokens))
        r.kv, r.gen, r.first_token_s = r.prompt_tokens, 1, r.arrival_s
        heapq.heappush(self._pending, (r.arrival_s, self._seq, r))
        self._seq += 1
        ph = self._ph
        if ph is not None and ph[8] and r.arrival_s < ph[9]:
            k = max(ph[7], self._count_before(ph, r.arrival_s))
            if k == ph[7]:
                self._ph = None
                if k == 0:
                    self._sw += ph[1]     # the swap is still owed by the next step
            else:
                self._cut(ph, k)
        return r

    # ---- phase arithmetic ------------------------------------------------------------------
    @staticmethod
    def _cut(ph, k: int) -> None:
        ph[6] = k
        ph[10] = ph[0] + ph[1] + k * ph[2] + ph[3] * k * (k - 1) * 0.5

    @staticmethod
    def _T(ph, m: int) -> float:
        """Latency of the phase's first m steps, swap time excluded."""
        return m * ph[2] + ph[3] * m * (m - 1) * 0.5

    def _count_before(self, ph, t: float) -> int:
        """Steps of the phase starting strictly before ``t``."""
        t0, sw, a, b, k = ph[0], ph[1], ph[2], ph[3], ph[6]
        if t <= t0:
            return 0
        if t > ph[10]:                     # after the last step starts: the whole phase
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
        T = self._T
        while m + 1 < k and T(ph, m + 1) < x:
            m += 1
        while m >= 1 and T(ph, m) >= x:
            m -= 1
        return min(k, m + 1)

    def _blocks_over(self, d0: int, m: int) -> int:
        """KV blocks the running batch takes in steps d0 .. d0+m-1."""
        bt, cnt = self.bt, self.cnt
        full, rem = divmod(m, bt)
        s = full * self.n
        for j in range(rem):
            s += cnt[(-(d0 + j)) % bt]
        return s

    def _first_failing(self) -> int:
        """Index (from step D) of the first step whose new blocks do not fit."""
        n, bt, cnt, D = self.n, self.bt, self.cnt, self.D
        c, r = divmod(self.free, n)
        acc = 0
        for j in range(bt):
            acc += cnt[(-(D + j)) % bt]
            if acc > r:
                return c * bt + j
        return c * bt + bt      # unreachable: a full cycle takes n > r blocks

    # ---- scheduling ------------------------------------------------------------------------
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
        self.free -= -(-r.kv // self.bt)

    def _stop_r(self, r: FastRequest) -> int:
        """Take ``r`` out of the running batch; returns its KV length."""
        del self._running[r.tag]
        r.tag = 0
        r.energy_j += self._e_seq - r.e0
        self.cnt[r.o % self.bt] -= 1
        self.sum_o -= r.o
        self.n -= 1
        kv = r.o + self.D
        self.free += -(-kv // self.bt)
        return kv

    def _plan(self):
        """Decide the step at D (preemption or admissions) and plan the phase from it."""
        now, D, bt = self.clock, self.D, self.bt
        pend, wait = self._pending, self._waiting
        while pend and pend[0][0] <= now:
            r = heapq.heappop(pend)[2]
            if r.gen >= r.output_tokens:          # output 1: nothing left to decode
                r.finish_s = r.arrival_s
                self._out.append(r)
                self.n_finished += 1
            else:
                wait.append(r)
        if not self.n and not wait:
            return None
        need = self.cnt[(-D) % bt] if self.n else 0
        victims = False
        if need > self.free:
            victims = True
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
                    free += -(-(v.o + D) // bt)
                if nr > free:
                    alive.pop()
                    vict.append(r)
                    break
                free -= nr
                i += 1
            for v in vict:                        # newest first; the oldest ends up first
                v.gen = v.g + D
                v.kv = self._stop_r(v)
                v.swapped = True
                v.preemptions += 1
                self.preemptions += 1
                self._sw += v.kv * self._swap_s_per_token
                wait.appendleft(v)
        else:
            free = self.free - need
            n, mb = self.n, self.max_batch
            tokens_left = self.max_batched_tokens - n
            while wait and n < mb and tokens_left > 0:
                r = wait[0]
                if -(-(r.kv + 1) // bt) > free:
                    break
                wait.popleft()
                free -= -(-(r.kv + 1) // bt)
                tokens_left -= 1
                if r.swapped:
                    self._sw += r.kv * self._swap_s_per_token
                    r.swapped = False
                self._run_r(r)
                n += 1
        n = self.n
        if not n:
            if wait:
                raise RuntimeError("engine stalled: work queued but nothing schedulable")
            return None
        if victims:
            k = 1
        else:
            fin = self._fin
            while fin[0][2].tag != fin[0][1]:        # stale entries of preempted requests
                heapq.heappop(fin)
            k = fin[0][0] - D
            if k > self.max_phase_steps:
                k = self.max_phase_steps
            if self.free < n * (k // bt + 2):     # blocks may run out within k steps
                k = min(k, self._first_failing())
            if k < 1:
                k = 1
        K0 = self.sum_o + n * (D + 1)
        self.cost_calls += 1
        if k > 1:
            a, ea, a2, ea2 = self._line(float(n), float(K0), float(K0 + n * (k - 1)))
            b = (a2 - a) / (k - 1)
            eb = (ea2 - ea) / (k - 1)
        else:
            a, ea = self._step(0.0, 0.0, float(n), float(K0))
            b = eb = 0.0
        sw = self._sw
        self._sw = 0.0
        end = now + sw + k * a + b * k * (k - 1) * 0.5
        ph = [now, sw, a, b, ea, eb, k, 0, False, math.inf, end]
        if not wait and n < self.max_batch and n < self.max_batched_tokens:
            ph[8] = True                          # an arrival could join the batch
            if pend:
                head_s, _, head = pend[0]
                if -(-(head.kv + 1) // bt) > self.free - need:
                    ph[9] = head_s
                elif head_s < end:
                    self._cut(ph, max(1, self._count_before(ph, head_s)))
        self._ph = ph
        return ph

    def _consume(self, ph, upto: int) -> None:
        done = ph[7]
        m = upto - done
        if m <= 0:
            return
        t0, sw, a, b, ea, eb = ph[0], ph[1], ph[2], ph[3], ph[4], ph[5]
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
            for j in range(m):
                self.free -= cnt[(-(D + j)) % bt]
        self.D = D = D + m
        ph[7] = upto
        self.clock = end
        self.busy_s += end - start
        self.step_energy_j += e
        self._e_seq += e / self.n
        self.steps += m
        fin = self._fin
        if fin and fin[0][0] <= D:
            out = self._out
            while fin and fin[0][0] <= D:
                F, tag, r = heapq.heappop(fin)
                if r.tag != tag:
                    continue
                self._stop_r(r)
                r.finish_s = end
                out.append(r)
                self.n_finished += 1
            self._ph = None
        elif upto >= ph[6]:
            self._ph = None

    def advance_to(self, t_s: float) -> list[FastRequest]:
        """Run every step that starts before ``t_s``; returns the requests finished since the
        previous call."""
        while self.clock < t_s:
            ph = self._ph or self._plan()
            if ph is None:
                pend = self._pending
                if pend and pend[0][0] < t_s:
                    self.clock = max(self.clock, pend[0][0])
                    continue
                if t_s != math.inf:
                    self.clock = t_s
                break
            upto = self._count_before(ph, t_s) if t_s != math.inf else ph[6]
            self._consume(ph, max(upto, ph[7] + 1))
        out, self._out = self._out, []
        return out
