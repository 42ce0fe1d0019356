"""The engines of one simulated vPod, as vLLM runs them: one engine, or ``pp`` pipeline virtual
engines (:class:`sim.stepcost.PipelineShare`) for a pipeline-parallel vPod, each taking
``ceil(B / min(B, pp))`` sequences (the DSE's micro-batch). The cluster simulator and the
simulated backend both build a vPod's engines here."""

from __future__ import annotations

import bisect
import heapq

from .fastengine import DecodeEngine, PrefillEngine
from .stepcost import PipelineShare, StepCostTable


class VPodEngines:
    """The engines of one vPod. A prompt goes to the prefill engine that can start it first
    (each engine's projected free time: :meth:`backlog_s`); a decoding request to the decode
    engine with a batch slot free at its arrival, else the one whose slot frees first, by the
    projected ends of what each was given (:meth:`_slot_at`; ties: the fewest unfinished
    requests, then the least unfinished output tokens, then the first). Without an arrival
    time (:meth:`choose` alone), the least unfinished output tokens.

    A prefill engine serves its prompts one step after another, first come first served, so
    when it is free is known at every arrival from what it was given: the later of its free
    time and the arrival, plus the prompt's own step(s) on its step-cost table - exact for the
    batch-1 engines a pipelined prefill vPod runs (one per stage in flight), an upper bound
    where prompts share a step. Choosing by the work given within a 10-s slice instead (the
    rule below, before) is round-robin over a PP vPod's virtual engines whichever is free:
    23 Llama3-70B TP 2 PP 4 vPods at 86 % busy met 69.8 % of TTFT SLOs, 99.1 % by free time
    (``benchmarks/prefill_routing.py``).

    vLLM gives a new request to the virtual engine with the fewest unfinished requests, counted
    when it arrives. A driver that advances the engines in slices (the cluster simulator: 10 s)
    only learns of finishes at a slice's end, and a count that only grows within the slice
    turns that rule into round-robin: on a PP vPod's batch-1 virtual engines a short answer
    then waits behind a long one that vLLM would have steered around (DeepSeek-V3 on v5e-128
    PP16, 5 req/s: TPOT p99 0.38 s by count, 25 ms by work, 27 ms with counts exact at every
    arrival). The work a request brings (the rule after that) kept a light load near the exact
    choice but not a busy one; the projected ends of what each engine was given do
    (:meth:`_slot_at`; ``benchmarks/decode_slots.py``)."""

    def __init__(self, engines: list, depth: int = 1):
        """``depth``: the pipeline's stages when ``engines`` are a PP vPod's batch-1 prefill
        virtual engines (see :meth:`submit`), else 1. Batched virtual engines are not gated:
        their steps carry several prompts through the first stage as one micro-batch, whose
        stage time is not the sum of the prompts' lone ones (the weight reads are shared),
        and their projected free times are estimates (a prompt queued behind a step is
        projected at its share of a full one) that a gate would enforce - both would
        serialise them (DeepSeek-V3 at 64x the Azure load: a v5p TP 8 PP 2 batch-8
        short-prompt group so gated met 18 % of its TTFT SLOs, the median TTFT 108 s)."""
        self.engines = engines
        self.depth = max(1, int(depth))
        self.loads = [0] * len(engines)          # unfinished requests per engine
        self.work = [0] * len(engines)           # their tokens (see the class docstring)
        self._prefill = bool(engines) and isinstance(engines[0], PrefillEngine)
        # prefill: when each engine will have served what it was given (projected)
        self.free_at = [max(e.now_s for e in engines) if engines else 0.0] * len(engines)
        self._service: dict[int, float] = {}
        self._batched: dict[int, float] = {}
        # prefill, depth > 1: the first stage's reservations (start, end), by start - a
        # prompt's first chunk holds it once its engine is free, in whatever order those come.
        # Back-to-back reservations are one block: a busy stage is one interval, however many
        # prompts wait for it (a search is then over its gaps, not its prompts)
        self._stage: list[tuple[float, float]] = []
        self._soon: tuple[float, float, float] | None = None   # soonest_start(), until a submit
        # decode: each engine's unfinished requests' projected ends (a min-heap per engine;
        # :meth:`_slot_at`, :meth:`held_share` - which pop the passed ones inline, a hot
        # path), and the full micro-batch's step time by KV length class
        # (:meth:`_decode_step_s`)
        self._ends: list[list[float]] | None = None if self._prefill else [[] for _ in engines]
        self._step: dict[int, float] = {}
        self._cap = engines[0].max_batch if engines else 1      # one engine's batch slots
        self.slots = self._cap * len(engines)                   # the vPod's

    def _work_of(self, r) -> int:
        return r.prompt_tokens if self._prefill else r.output_tokens

    def service_s(self, prompt: int) -> float:
        """A prefill engine's time for a lone prompt (:meth:`PrefillEngine.lone_prompt_s`),
        memoised per length."""
        got = self._service.get(prompt)
        if got is None:
            got = self.engines[0].lone_prompt_s(prompt)
            if len(self._service) > 65536:
                self._service.clear()
            self._service[prompt] = got
        return got

    def batched_s(self, prompt: int) -> float:
        """A prefill engine's time for a prompt that joins a busy engine's queue
        (:meth:`PrefillEngine.batched_prompt_s`: its share of a full step), memoised per
        length."""
        got = self._batched.get(prompt)
        if got is None:
            got = self.engines[0].batched_prompt_s(prompt)
            if len(self._batched) > 65536:
                self._batched.clear()
            self._batched[prompt] = got
        return got

    def stage_s(self, prompt: int) -> float:
        """How long a prompt's first chunk holds a pipeline's first stage: its lone step time
        over the stages (the DSE's stage time; 0 for an unpipelined vPod)."""
        if self.depth == 1:
            return 0.0
        first = min(prompt, max(1, self.engines[0].max_batched_tokens))
        return self.service_s(first) / self.depth

    @property
    def stage_free_s(self) -> float:
        """When the first stage has passed every first chunk reserved on it (0: none): the
        last block's end (blocks are disjoint and by start)."""
        return self._stage[-1][1] if self._stage else 0.0

    def _stage_slot(self, t_s: float, dur_s: float) -> float:
        """The earliest start at or after ``t_s`` at which the first stage is free for
        ``dur_s``."""
        st = self._stage
        for k in range(max(0, bisect.bisect_right(st, t_s, key=_start) - 1), len(st)):
            a, b = st[k]
            if b <= t_s:
                continue
            if a >= t_s + dur_s:
                break
            t_s = b
        return t_s

    def _reserve(self, a: float, b: float) -> None:
        """Hold the first stage over [a, b) (free there: :meth:`_stage_slot`), merged with the
        blocks it touches - within a nanosecond, the rounding of a stage time summed against
        a pass: no slot (:meth:`backlog_s` asks for a nanosecond) fits a shorter gap, so the
        schedule is the same."""
        st = self._stage
        i = bisect.bisect_left(st, a, key=_start)
        if i > 0 and st[i - 1][1] >= a - _TOUCH_S:
            i -= 1
            a, b = st[i][0], max(b, st[i][1])
            del st[i]
        while i < len(st) and st[i][0] <= b + _TOUCH_S:
            b = max(b, st[i][1])
            del st[i]
        st.insert(i, (a, b))

    def soonest_start(self) -> tuple[float, float, float]:
        """Prefill: (when the first engine is free, when the vPod can start a prompt then -
        pipelined, once the first stage is free too -, when every engine and the stage are
        free). They change only when a prompt is submitted, so they are kept until then: a
        router asks every vPod at every arrival."""
        got = self._soon
        if got is None:
            m = min(self.free_at)
            got = self._soon = (m, m if self.depth == 1 else self._stage_slot(m, _TOUCH_S),
                                max(max(self.free_at), self.stage_free_s))
        return got

    def backlog_s(self, at_s: float) -> tuple[float, float]:
        """Prefill, at ``at_s``: how long until the vPod can start a prompt (an engine free
        and, pipelined, the first stage free), then the work its engines hold (seconds per
        engine) - what a router that knows each vPod's in-flight work at every arrival
        compares (a vPod that can start it now first)."""
        return self.wait_s(at_s), self.work_s(at_s)

    def wait_s(self, at_s: float) -> float:
        """:meth:`backlog_s`'s first: how long until the vPod can start a prompt."""
        m, first, idle_from = self.soonest_start()
        if at_s >= idle_from:                   # nothing held: no wait
            return 0.0
        if at_s > m and self.depth > 1:         # an engine idle: the stage from now
            first = self._stage_slot(at_s, _TOUCH_S)
        return first - at_s if first > at_s else 0.0

    def work_s(self, at_s: float) -> float:
        """:meth:`backlog_s`'s second: the work the engines hold, seconds per engine."""
        f = self.free_at
        if len(f) == 1:
            x = f[0]
            return x - at_s if x > at_s else 0.0
        if at_s >= self.soonest_start()[2]:
            return 0.0
        return sum(x - at_s for x in f if x > at_s) / len(f)

    def choose(self, prompt: int, output: int, arrival_s: float | None = None) -> int:
        """The engine :meth:`submit` gives a request to (its index)."""
        if len(self.engines) == 1:
            return 0
        loads = self.loads
        if self._prefill and arrival_s is not None:
            f = self.free_at
            return min(range(len(f)), key=lambda k: (max(f[k], arrival_s), loads[k]))
        work = self.work
        ends = self._ends
        if arrival_s is not None and ends is not None:
            # decode: an engine with a free slot at this arrival (the fewest unfinished
            # requests, then the least work), else the one whose slot frees first
            # (:meth:`_slot_at`)
            cap, best, pick = self._cap, None, -1
            for k, h in enumerate(ends):
                while h and h[0] <= arrival_s:
                    _heappop(h)
                if len(h) < cap and (best is None or (len(h), work[k]) < best):
                    best, pick = (len(h), work[k]), k
            if pick >= 0:
                return pick
            return min(range(len(work)),
                       key=lambda k: (self._slot_at(k, arrival_s), len(ends[k]), work[k]))
        return min(range(len(work)), key=lambda k: (work[k], loads[k]))

    def _slot_at(self, k: int, at_s: float) -> float:
        """Decode: when engine ``k`` has a batch slot for a request
        arriving at ``at_s`` - at once if it holds fewer unfinished requests than its batch,
        else when the first of those ahead finishes, by their projected ends (each admitted
        at its own slot, then ``output - 1`` steps at the full micro-batch's step time).

        vLLM V1 schedules a PP vPod's micro-batches from one pool of running requests, so a
        decoding request waits only when every slot is taken (V0 gave a new request to the
        virtual engine with the fewest unfinished requests, counted when it arrives: the same
        wait). The engines here are pinned, and a driver that advances them in slices learns
        of finishes only at a slice's end, so the work counted since then (the rule before)
        sent short answers to full engines while others had slots free: DeepSeek-V3 on the
        Azure day, a v6e-64 PP 4 batch-16 group (4 engines of 4) and a v5e-128 PP 16 batch-16
        group (16 of 1), 6-8 % of TPOTs missed - 10 % of 5-10-token answers - where the
        policy's queue (a vPod's slots pooled) allows 5 % waits. The projection is at the
        full micro-batch, an upper bound: an engine looks busier than it is, never freer."""
        h = self._ends[k]
        while h and h[0] <= at_s:
            _heappop(h)
        n, cap = len(h), self._cap
        return at_s if n < cap else heapq.nsmallest(n - cap + 1, h)[-1]

    def held_share(self, at_s: float) -> float:
        """Decode: the share of the vPod's batch slots that the projected ends of what its
        engines were given (:meth:`_slot_at`) hold at ``at_s`` (above 1 with a queue) - what
        a router that knows each vPod's unfinished requests at every arrival compares."""
        n = 0
        for h in self._ends:
            while h and h[0] <= at_s:
                _heappop(h)
            n += len(h)
        return n / self.slots

    def _decode_step_s(self, kv: int) -> float:
        """A decode engine's step at its full micro-batch with every sequence at ``kv``
        tokens rounded up to a power of two (memoised by that class)."""
        c = max(1, int(kv)).bit_length()
        got = self._step.get(c)
        if got is None:
            got = self._step[c] = self.engines[0].full_batch_step_s(1 << c)
        return got

    def submit(self, req_id, arrival_s: float, prompt: int, output: int):
        """Give a request to the engine :meth:`choose` picks; its record.

        Prefill on a pipelined vPod (``depth`` > 1): each virtual engine runs a prompt's chunks
        one after another, each through every stage (vLLM V1 does not schedule a request
        already in an in-flight micro-batch), and the first stage takes one micro-batch per
        stage time - so a prompt starts when its engine is free and the first stage has a
        slot for its first chunk (a prompt given to a busy engine reserves the stage for when
        that engine frees, not from now). Without that gate ``depth`` prompts arriving
        together would all start at once, ``depth`` times what the first stage passes."""
        return self.submit_to(self.choose(prompt, output, arrival_s), req_id, arrival_s,
                              prompt, output)

    def submit_to(self, k: int, req_id, arrival_s: float, prompt: int, output: int):
        """:meth:`submit` to engine ``k`` (a router that picks the engine itself)."""
        gate = None
        if self._prefill:
            self._soon = None
            start = max(self.free_at[k], arrival_s)
            if self.depth > 1:
                st = self._stage
                while st and st[0][1] <= arrival_s:   # passed before this arrival: done with
                    st.pop(0)
                dur = self.stage_s(prompt)
                start = gate = self._stage_slot(start, dur)
                self._reserve(start, start + dur)
            # an idle engine starts the prompt alone; a busy one batches it with the prompts
            # queued behind its step (a batch-1 engine: the same). Projected at its lone time
            # either way, a batched engine's free time ran ahead of the engine by up to its
            # batch x: a vPod that came up then took every prompt until its projection caught
            # up with the others' (DeepSeek-V3 at 64x the Azure load: a queue of 9,382 prompts
            # on the new vPod of a batch-4 group while the other five idled)
            self.free_at[k] = start + (self.batched_s(prompt) if start > arrival_s
                                       else self.service_s(prompt))
        elif self._ends is not None:
            start = self._slot_at(k, arrival_s)
            heapq.heappush(self._ends[k], start + max(0, output - 1)
                           * self._decode_step_s(prompt + output // 2))
        r = self.engines[k].submit(req_id, arrival_s, prompt, output,
                                   **({} if gate is None else {"not_before_s": gate}))
        self.loads[k] += 1
        self.work[k] += self._work_of(r)
        return r

    def advance_to(self, t_s: float) -> list:
        out = []
        for k, e in enumerate(self.engines):
            done = e.advance_to(t_s)
            if done:
                self.loads[k] -= len(done)
                self.work[k] -= sum(self._work_of(r) for r in done)
                out += done
        return out

    def abort(self, r) -> bool:
        """Abort ``r`` (a record :meth:`submit` returned) in the engine that holds it (see
        :meth:`sim.engine.SimEngine.abort`); False when none does (finished, aborted before)."""
        for k, e in enumerate(self.engines):
            if e.abort(r):
                self.loads[k] -= 1
                self.work[k] -= self._work_of(r)
                return True
        return False

    def next_event_time(self) -> float | None:
        times = [t for e in self.engines if (t := e.next_event_time()) is not None]
        return min(times) if times else None

    @property
    def idle(self) -> bool:
        return all(e.idle for e in self.engines)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    @property
    def now_s(self) -> float:
        return max(e.now_s for e in self.engines)

    def energy_j(self) -> float:
        return sum(e.energy_j() for e in self.engines)


def engine_batch(max_batch: int, pp: int) -> int:
    """Sequences per virtual engine of a PP vPod: the DSE splits a batch of B into
    m = min(B, pp) micro-batches (``dse.costmodel``), one per virtual engine."""
    return -(-max_batch // min(max_batch, pp))


def gated_depth(max_batch: int, pp: int) -> int:
    """The stages whose first one admits a PP vPod's prefill prompts one at a time: ``pp`` when
    each virtual engine's micro-batch is one prompt (``engine_batch`` 1: batch <= PP), else 1
    (see :class:`VPodEngines`)."""
    return pp if pp > 1 and engine_batch(max_batch, pp) == 1 else 1


def vpod_engines(table: StepCostTable, phase: str, max_batch: int, pp: int,
                 max_batched_tokens: int, start_s: float) -> VPodEngines:
    """A vPod's prefill or decode engines on its allocation's step-cost table, up at
    ``start_s``."""
    cost = table if pp == 1 else PipelineShare(table, pp)
    cls = PrefillEngine if phase == "prefill" else DecodeEngine
    return VPodEngines([cls(cost, max_batch=engine_batch(max_batch, pp),
                            max_batched_tokens=max(max_batched_tokens, max_batch),
                            start_s=start_s) for _ in range(pp)],
                       depth=gated_depth(max_batch, pp) if phase == "prefill" else 1)


class TableCache:
    """Step-cost tables by allocation ``(chip, topology, tp, pp, ep, attn)`` for one model
    (``attn``, the MoE stage layout of :class:`dse.parallel.Parallelism`, may be left off:
    ``"dp"``), built on first use (from the chip model) and kept in memory and, with
    ``on_disk``, in the ``stepcost`` cache."""

    def __init__(self, arch, catalog, on_disk: bool = True, stack=None):
        """``stack``: the serving-stack profile the engines run (default ``vllm-tpu``)."""
        self.arch, self.catalog, self.on_disk, self.stack = arch, catalog, on_disk, stack
        self._tables: dict[tuple, StepCostTable] = {}

    def __call__(self, alloc: tuple) -> StepCostTable:
        if len(alloc) == 5:
            alloc = (*alloc, "dp")
        t = self._tables.get(alloc)
        if t is None:
            from dse.cache import cache_path

            from .chip import ChipModel
            chip, topo, tp, pp, ep, attn = alloc
            cm = ChipModel.of(self.arch, self.catalog, chip, topo, tp, pp, ep, stack=self.stack,
                              attn=attn)
            t = self._tables[alloc] = StepCostTable(
                cm, cache_dir=cache_path("stepcost") if self.on_disk else None)
        return t

    def __len__(self) -> int:
        return len(self._tables)


_heappop = heapq.heappop
_TOUCH_S = 1e-9      # reservations closer than this are one block (VPodEngines._reserve)


def _start(iv: tuple[float, float]) -> float:
    return iv[0]
