"""Serving-stack profiles: the software costs a chip model cannot know.

A vPod's step time is what its chips do (the roofline, :mod:`sim.chip`) plus what the serving
stack around them adds. A profile names those additions for one stack; the DSE (``dse build
--stack``), the chip model, the step-cost tables, the simulated engines and ``orchestrator sim
bench`` all take one, and a best-fit database records the profile it was built for.

Fields (SI units):

* ``step_s`` - host/framework time per engine step on the critical path: the scheduler, input
  preparation, dispatch of the jitted step, the device-to-host copy of the sampled tokens.
* ``per_seq_s`` - host time per sequence in a step (scheduler bookkeeping, output processing,
  detokenisation when it is not overlapped with the next step) and on-device sampling.
* ``request_s`` - per request, before it reaches the engine and not occupying it: HTTP, chat
  template, tokenisation, admission. It adds to the client's TTFT (``sim bench``), not to the
  engine's busy time.
* ``overlap`` - the host prepares step n+1 while the device runs step n (vLLM's async
  scheduling, sglang's overlap scheduler): a step takes the longer of device and host time
  instead of their sum.
* ``mixed_prefill`` - a step may carry prompt chunks and decodes together (vLLM's chunked
  prefill). Off: a step prefills or decodes, never both, and waiting prompts go first (sglang's
  default scheduler, JetStream's interleaving) - every decoding request stalls for each prefill
  step. Only engines that serve both phases (``sim bench``) see it.
* ``pad_tokens`` - the step's prompt tokens are padded as sglang-jax pads them to its
  precompiled shapes: every data-parallel attention rank runs the busiest rank's token count
  and the total is rounded up to a power of two of at least ``pad_tokens`` (0: no padding).
  The padding runs through every matmul and the MoE, not through attention.
* ``moe_dispatch`` - how routed tokens reach their experts: ``"a2a"`` (all-to-all of each
  token to its experts' chips) or ``"allgather"`` (every token to every chip of the expert
  group, partial outputs summed by an all-reduce: sglang-jax's EPMoE).
* ``moe_layouts`` - the mixture-of-experts stage layouts (:mod:`dse.parallel`) the stack can
  launch; the DSE enumerates no other. vLLM and sglang-jax run ``"tp"`` and ``"hybrid"``: their
  expert-parallel group spans every rank of a stage, so the ``"dp"`` layout's TP inside
  ``ep`` expert groups (``tp >= 2``, ``ep >= 2``) is not theirs.
* ``attn_decode_eff`` / ``attn_prefill_eff`` - the attention kernels' achieved fraction of what
  the chip model's kernels reach (ragged paged attention: page gathers, padding of ragged
  batches, grid overheads). The chip model's attention operators take ``time / eff``.

Every constant cites the measurement it is derived from (``sources``); the derivations are in
the README ("Serving-stack profiles"). ``none`` is the bare chip model (no stack at all), for
checks that must see the hardware alone.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import numpy as np

from .errors import NeuScaleError
from .parallel import ATTN_LAYOUTS


MOE_DISPATCH = ("a2a", "allgather")


@dataclass(frozen=True)
class StackProfile:
    name: str
    step_s: float
    per_seq_s: float
    request_s: float
    attn_decode_eff: float = 1.0
    attn_prefill_eff: float = 1.0
    overlap: bool = False
    mixed_prefill: bool = True
    pad_tokens: int = 0
    moe_dispatch: str = "a2a"
    moe_layouts: tuple[str, ...] = ATTN_LAYOUTS
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for k in ("step_s", "per_seq_s", "request_s"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and 0 <= v < 10):
                raise NeuScaleError(f"stack {self.name!r}: {k} must be in [0, 10) s (got {v!r})")
        for k in ("attn_decode_eff", "attn_prefill_eff"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise NeuScaleError(f"stack {self.name!r}: {k} must be in (0, 1] (got {v!r})")
        for k in ("overlap", "mixed_prefill"):
            if not isinstance(getattr(self, k), bool):
                raise NeuScaleError(f"stack {self.name!r}: {k} must be true or false")
        v = self.pad_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 1 << 20 \
                or (v and v & (v - 1)):
            raise NeuScaleError(f"stack {self.name!r}: pad_tokens must be 0 or a power of two "
                                f"up to {1 << 20:,} (got {v!r})")
        lay = self.moe_layouts
        if isinstance(lay, str) or not isinstance(lay, (tuple, list)) or not lay \
                or any(x not in ATTN_LAYOUTS for x in lay) or len(set(lay)) != len(lay):
            raise NeuScaleError(f"stack {self.name!r}: moe_layouts must be a non-empty list of "
                                f"distinct layouts out of {', '.join(ATTN_LAYOUTS)} "
                                f"(got {lay!r})")
        object.__setattr__(self, "moe_layouts", tuple(lay))
        if self.moe_dispatch not in MOE_DISPATCH:
            raise NeuScaleError(f"stack {self.name!r}: moe_dispatch must be one of "
                                f"{', '.join(MOE_DISPATCH)} (got {self.moe_dispatch!r})")

    def padded_prefill(self, tokens, ranks: int = 1):
        """Prompt tokens each data-parallel attention rank runs in a step of ``tokens`` prompt
        tokens (the whole step's; per rank without padding: ``tokens / ranks``). With
        ``pad_tokens``: the busiest rank holds them all (one prompt per step, what a
        closed-loop client sees most; a step of prompts on several ranks is priced as if on
        one), every rank runs as many, and the total is a power of two of at least
        ``pad_tokens``. Floats or numpy arrays; 0 stays 0."""
        t = np.asarray(tokens, dtype=np.float64)
        if not self.pad_tokens:
            out = t / ranks
        else:
            tot = np.maximum(t * ranks, self.pad_tokens)
            out = np.where(t > 0, np.exp2(np.ceil(np.log2(np.maximum(tot, 1.0)))) / ranks, 0.0)
        return float(out) if np.ndim(tokens) == 0 else out

    def step_overhead_s(self, seqs: float) -> float:
        """Host time of one engine step that schedules ``seqs`` sequences."""
        return self.step_s + self.per_seq_s * seqs

    def step_time_s(self, device_s, seqs):
        """A step's wall time from its device time: plus the host time, or with ``overlap``
        (async scheduling: the host prepares step n+1 while the device runs step n) the
        longer of the two. Floats or numpy arrays (the roofline's grids)."""
        host = self.step_overhead_s(seqs)
        if not self.overlap:
            return device_s + host
        return np.maximum(device_s, host) if isinstance(device_s, np.ndarray) or \
            isinstance(host, np.ndarray) else max(device_s, host)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("sources")
        d.pop("description")
        d["moe_layouts"] = list(self.moe_layouts)    # as JSON holds it (a database's record)
        return d

    def key(self) -> str:
        """What decides the numbers (cache keys, a database's record)."""
        return json.dumps(self.to_json(), sort_keys=True)


# ---- the built-in profiles --------------------------------------------------------------------
# Each number is derived in the README ("Serving-stack profiles") from the measurement cited.

NONE = StackProfile("none", 0.0, 0.0, 0.0, description="the bare chip model: no software cost")

# vLLM on TPU (tpu-inference, JAX backend), what the tpu backend launches.
VLLM_TPU = StackProfile(
    "vllm-tpu",
    # host time per step: vLLM TPU (V1, synchronous scheduler) Llama3.1-8B on one v6e,
    # 1000 x 1799/<=128 tokens, max-num-batched-tokens 512: mean TPOT 32.89 ms against the
    # chip model's 27.4 ms device time -> 5.5 ms (tpu-inference PR #47 / pytorch/xla PR #9376)
    step_s=5.5e-3,
    per_seq_s=0.0,      # V1 detokenises in the API-server process, off the engine's step
    # TTFT beyond the engine: Llama3.3-70B on v6e-8, 64 clients, 999/1000 tokens, median TTFT
    # 198.8 ms (tpu-recipes Llama3.x README, vllm-tpu v0.12.0) where the engine alone gives
    # ~150 ms; includes the async scheduler's one-step delay of the first token
    request_s=0.045,
    # ragged paged attention: up to 86 % of HBM bandwidth in decode (arXiv 2604.15464, Llama3
    # 8B on TPU7x) against the chip model's 90 % streaming efficiency
    attn_decode_eff=0.96,
    # --async-scheduling (tpu-recipes' command line; tpu-inference PR #924: +39 % req/s on
    # Llama3.2-1B): host work overlaps the device step - the 70B rows show no exposed host time
    overlap=True,
    # vLLM: "By default, expert layers form a tensor parallel group of size DP x TP"; with
    # --enable-expert-parallel they are expert-parallel over the same ranks, whole experts
    # (docs.vllm.ai "Data Parallel Deployment"). Neither puts TP inside an expert group of
    # a DP vPod (the "dp" layout with tp, ep >= 2).
    moe_layouts=("tp", "hybrid"),
    description="vLLM TPU (tpu-inference, JAX; async scheduling, ragged paged attention)",
    sources={"step_s": "tpu-inference PR #47 (Llama3.1-8B, v6e-1, TPOT 32.89 ms)",
             "request_s": "tpu-recipes Llama3.x README (Llama3.3-70B v6e-8, TTFT p50 198.8 ms)",
             "attn_decode_eff": "arXiv 2604.15464 (RPA: up to 86 % MBU in decode)",
             "overlap": "tpu-inference PR #924 (async scheduler)",
             "moe_layouts": "docs.vllm.ai Data Parallel Deployment (experts over DP x TP ranks)"})

# JetStream (MaxText engine): prefill and generate steps interleaved, no chunking.
JETSTREAM = StackProfile(
    "jetstream",
    # Llama3-8B bf16 on v5e-8, batch 128: 8249 tok/s = 15.5 ms per decode step against the
    # chip model's 10.5 ms device time at KV 1024 (AI-Hypercomputer/JetStream benchmarks)
    step_s=5.0e-3, per_seq_s=0.0,
    request_s=0.0,      # no published TTFT to derive it from: not modelled
    # prefill and generate steps interleave; a prompt is never chunked into a decode step
    mixed_prefill=False,
    description="JetStream with the MaxText engine (no published TTFT: request_s 0)",
    sources={"step_s": "JetStream benchmarks (Llama3-8B v5e-8 batch 128: 8249 tok/s)",
             "mixed_prefill": "JetStream README (interleaved prefill and generate)"})

# sglang-jax: overlap scheduler on by default, ragged paged attention.
SGLANG_JAX = StackProfile(
    "sglang-jax",
    # Llama3.1-8B on v6e-4 (TP 4), 16 clients, lengths uniform 1-512: mean TPOT 9.94 ms where
    # the chip model's device step is ~5 ms - with the overlap scheduler the step is the
    # host's 9.9 ms (sglang-jax cookbook Llama3.1.md, build 0.1.0)
    step_s=9.9e-3, per_seq_s=0.0,
    # the same run's mean TTFT 35.3 ms
    request_s=0.010,
    attn_decode_eff=0.96,   # the same ragged paged attention kernel as vLLM TPU
    overlap=True,
    # scheduler.py get_next_batch_to_run: "Run prefill first if possible"; mixing prefill
    # into decode batches needs --enable-mixed-chunk (server_args.py: default False)
    mixed_prefill=False,
    # schedule_batch.py _compute_global_padding_sizes: pad_to_bucket(max_tokens_per_dp *
    # dp_size, token_paddings), token paddings 64 ... 8192 (common_utils.py
    # PRECOMPILE_DEFAULT_TOKEN_PADDINGS = [1 << i for i in range(6, 14)])
    pad_tokens=64,
    # layers/moe.py EPMoE: reshard(hidden_states, P(None)) (every token to every chip),
    # combine jax.lax.psum over "expert"; xprof: the all-gather is 40 % of an EXTEND step at
    # T = 8192 on DeepSeek-V3 v6e-64 (sglang-jax issue #1318)
    moe_dispatch="allgather",
    # DeepSeek-V3 cookbook: --tp-size 64 --dp-size 8 --ep-size 64 (DP attention of TP 8,
    # experts over all 64 chips) or without --dp-size (attention TP over them)
    moe_layouts=("tp", "hybrid"),
    description="sglang-jax (overlap scheduler, ragged paged attention, prefill-first "
                "scheduling, padded shapes, EPMoE)",
    sources={"step_s": "sglang-jax cookbook Llama3.1.md (8B v6e-4: TPOT 9.94 ms)",
             "request_s": "sglang-jax cookbook Llama3.1.md (8B v6e-4: TTFT 35.3 ms)",
             "attn_decode_eff": "arXiv 2604.15464 (RPA: up to 86 % MBU in decode)",
             "mixed_prefill": "sglang-jax scheduler.py, server_args.py (enable_mixed_chunk)",
             "pad_tokens": "sglang-jax schedule_batch.py _compute_global_padding_sizes",
             "moe_dispatch": "sglang-jax layers/moe.py EPMoE; issue #1318 (xprof)",
             "moe_layouts": "sglang-jax DeepSeek-V3 cookbook (--dp-size, --ep-size)"})

PROFILES: dict[str, StackProfile] = {p.name: p for p in (VLLM_TPU, JETSTREAM, SGLANG_JAX, NONE)}
DEFAULT_STACK = "vllm-tpu"


def stack_names() -> list[str]:
    return list(PROFILES)


def get_stack(name: "str | StackProfile | None" = None) -> StackProfile:
    """The profile named ``name`` (``None``: the default, ``vllm-tpu``); one clear error for an
    unknown name."""
    if isinstance(name, StackProfile):
        return name
    key = DEFAULT_STACK if name is None else str(name).strip().lower()
    try:
        return PROFILES[key]
    except KeyError:
        raise NeuScaleError(f"unknown serving stack {name!r}: choose one of "
                            f"{', '.join(PROFILES)}") from None


def stack_of(meta: dict[str, Any]) -> StackProfile:
    """The profile a best-fit database (its ``meta``) was built for. A database from before
    profiles, or built with other values under the same name, is refused: its latencies,
    SLOs and best fits hold another stack's software time."""
    rec = meta.get("stack")
    if not isinstance(rec, dict) or not isinstance(rec.get("name"), str):
        raise NeuScaleError("the best-fit database records no serving stack (it was built by an "
                            "older NeuScale): rebuild it with `orchestrator dse build`")
    p = get_stack(rec["name"])
    if p.to_json() != rec:
        raise NeuScaleError(f"the best-fit database was built with other values of the "
                            f"{p.name!r} serving-stack profile than this NeuScale has: rebuild "
                            "it with `orchestrator dse build`")
    return p


def parse_stack(text: "str | StackProfile | None") -> StackProfile:
    """A profile by name, or a whole profile as a JSON object (``{"name": "slow", "step_s":
    0.02, ...}``: every field of :class:`StackProfile` but ``sources``/``description``; what
    a test or a what-if passes to the simulated engines). One clear error for anything else."""
    if text is None or isinstance(text, StackProfile):
        return get_stack(text)
    t = str(text).strip()
    if not t.startswith("{"):
        return get_stack(t)
    try:
        d = json.loads(t)
    except ValueError as e:
        raise NeuScaleError(f"stack profile {t[:60]!r} is not valid JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise NeuScaleError("a stack profile given as JSON must be an object with a \"name\"")
    known = {f.name for f in fields(StackProfile)} - {"sources", "description"}
    extra = set(d) - known
    if extra:
        raise NeuScaleError(f"stack profile {d['name']!r}: unknown field(s) {sorted(extra)}; "
                            f"known: {', '.join(sorted(known))}")
    missing = {f.name for f in fields(StackProfile)
               if f.default is MISSING and f.default_factory is MISSING} - set(d)
    if missing:
        raise NeuScaleError(f"stack profile {d['name']!r}: missing {', '.join(sorted(missing))}")
    try:
        return StackProfile(**d)
    except TypeError as e:
        raise NeuScaleError(f"stack profile {d['name']!r}: {e}") from None
