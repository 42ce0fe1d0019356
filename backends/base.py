"""The backend interface: how the controller creates, finds, waits for and deletes vPods.

A backend turns a :class:`VPodSpec` (an allocation the policy chose, plus the engine's batch and
context limits and the labels that mark it as ours) into a running engine that serves vLLM's
OpenAI HTTP surface at :attr:`VPodInfo.endpoint`. Implementations: :mod:`backends.sim` (a
simulated cloud on 127.0.0.1); Cloud TPU and static hosts later.

Contract (every implementation):

* :meth:`Backend.create` is idempotent by ``spec.id``: the same id with the same spec returns
  the existing vPod; the same id with another spec is a :class:`ConfigError`.
* :meth:`Backend.delete` is idempotent (an unknown or already deleted id is not an error); the
  caller drains the vPod first.
* :meth:`Backend.list` finds vPods by labels, so a restarted controller reconciles with what
  exists instead of leaking or duplicating resources.
* Errors are typed: :class:`TransientError` (try again: :func:`with_retries` backs off
  exponentially with jitter), :class:`QuotaError` (this chip version has no room: fail over to
  another), :class:`ConfigError` (the request itself is wrong: one clear message, no retry).
"""

from __future__ import annotations

import asyncio
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from dse.parallel import ATTN_LAYOUTS
from dse.vpod import VPodState

PHASES = ("prefill", "decode")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


# ---- errors ----------------------------------------------------------------------------------

class BackendError(Exception):
    """Anything a backend call can fail with."""


class TransientError(BackendError):
    """Try again later (network trouble, the provider is busy, 5xx): :func:`with_retries`."""


class QuotaError(BackendError):
    """The chip version ``chip`` has no quota left: fail over to another version."""

    def __init__(self, message: str, chip: str | None = None):
        super().__init__(message)
        self.chip = chip


class ConfigError(BackendError):
    """The request is wrong (unknown chip, a model that does not fit, a conflicting spec):
    retrying cannot help; the message says what to change."""


# ---- values ----------------------------------------------------------------------------------

def _need(d: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    if key not in d:
        raise ConfigError(f"{what}: missing field {key!r}")
    v = d[key]
    if kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    else:
        ok = isinstance(v, kind)
    if not ok:
        raise ConfigError(f"{what}: field {key!r} must be {kind.__name__}, not "
                          f"{type(v).__name__}")
    return v


@dataclass(frozen=True)
class VPodSpec:
    """What to create. ``id`` is chosen by the caller and is the idempotency key."""

    id: str
    group: str
    phase: str                 # "prefill" | "decode"
    model: str                 # preset name or config path the engine serves
    chip: str
    topology: str
    num_chips: int
    tp: int
    pp: int
    ep: int
    max_batch: int             # vLLM --max-num-seqs
    max_model_len: int         # vLLM --max-model-len
    labels: Mapping[str, str] = field(default_factory=dict)
    # MoE stage layout (dse.parallel.Parallelism.attn): "dp" attention data-parallel over the
    # ep groups with TP inside each expert group, "tp" attention TP over tp*ep chips, "hybrid"
    # attention as "dp", whole experts over all tp*ep chips (vLLM --data-parallel-size ep)
    attn: str = "dp"

    def __post_init__(self) -> None:
        # a plain dict (hashable, comparable) whatever mapping was passed
        object.__setattr__(self, "labels", dict(self.labels))

    def __hash__(self) -> int:
        return hash((self.id, self.group, self.phase, self.model, self.chip, self.topology,
                     self.num_chips, self.tp, self.pp, self.ep, self.max_batch,
                     self.max_model_len, tuple(sorted(self.labels.items())), self.attn))

    def problems(self) -> list[str]:
        """What is wrong with the spec's values on their own (the backend checks the rest:
        chip, model, memory, quota)."""
        p = []
        if not _ID.match(self.id):
            p.append(f"id {self.id!r} must be 1-63 letters, digits, '.', '_' or '-', starting "
                     "with a letter or digit")
        if self.phase not in PHASES:
            p.append(f"phase {self.phase!r} must be 'prefill' or 'decode'")
        for name in ("model", "chip", "topology", "group"):
            if not getattr(self, name).strip():
                p.append(f"{name} must not be empty")
        for name in ("num_chips", "tp", "pp", "ep", "max_batch"):
            if getattr(self, name) < 1:
                p.append(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.attn not in ATTN_LAYOUTS:
            p.append(f"attn {self.attn!r} must be 'dp' (attention data-parallel over ep), "
                     "'tp' (attention tensor-parallel over tp*ep) or 'hybrid' (attention "
                     "data-parallel, experts over tp*ep)")
        if self.max_model_len < 2:
            p.append(f"max_model_len must be >= 2, not {self.max_model_len}")
        if self.tp * self.pp * self.ep != self.num_chips:
            p.append(f"tp*pp*ep = {self.tp * self.pp * self.ep} must equal num_chips = "
                     f"{self.num_chips}")
        for k, v in self.labels.items():
            if not isinstance(k, str) or not _LABEL.match(k):
                p.append(f"label key {k!r} must be 1-63 letters, digits, '.', '_', '/' or '-'")
            if not isinstance(v, str) or len(v) > 63:
                p.append(f"label {k!r}: value must be a string of at most 63 characters")
        return p

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "group": self.group, "phase": self.phase, "model": self.model,
                "chip": self.chip, "topology": self.topology, "num_chips": self.num_chips,
                "tp": self.tp, "pp": self.pp, "ep": self.ep, "max_batch": self.max_batch,
                "max_model_len": self.max_model_len, "labels": dict(self.labels),
                "attn": self.attn}

    @classmethod
    def from_json(cls, d: Any) -> "VPodSpec":
        """A spec from its JSON form; :class:`ConfigError` naming the first bad field."""
        if not isinstance(d, Mapping):
            raise ConfigError("a vPod spec must be a JSON object")
        w = "vPod spec"
        labels = d.get("labels", {})
        if not isinstance(labels, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise ConfigError(f"{w}: labels must be an object of strings")
        return cls(id=_need(d, "id", str, w), group=_need(d, "group", str, w),
                   phase=_need(d, "phase", str, w), model=_need(d, "model", str, w),
                   chip=_need(d, "chip", str, w), topology=_need(d, "topology", str, w),
                   num_chips=_need(d, "num_chips", int, w), tp=_need(d, "tp", int, w),
                   pp=_need(d, "pp", int, w), ep=_need(d, "ep", int, w),
                   max_batch=_need(d, "max_batch", int, w),
                   max_model_len=_need(d, "max_model_len", int, w), labels=dict(labels),
                   attn=_need(d, "attn", str, w) if "attn" in d else "dp")

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether every label of ``labels`` is on this spec with that value."""
        return all(self.labels.get(k) == v for k, v in labels.items())


@dataclass(frozen=True)
class VPodInfo:
    """What a backend knows of one vPod."""

    spec: VPodSpec
    state: VPodState           # STARTING, READY, DRAINING (being deleted), RELEASED
    endpoint: str | None       # "http://127.0.0.1:PORT" once READY
    created_s: float           # wall clock (time.time())
    ready_s: float | None
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec.to_json(), "state": self.state.value,
                "endpoint": self.endpoint, "created_s": self.created_s,
                "ready_s": self.ready_s, "message": self.message}

    @classmethod
    def from_json(cls, d: Any) -> "VPodInfo":
        if not isinstance(d, Mapping):
            raise TransientError("malformed vPod record from the backend (not an object)")
        try:
            return cls(spec=VPodSpec.from_json(d["spec"]), state=VPodState(d["state"]),
                       endpoint=d.get("endpoint"), created_s=float(d["created_s"]),
                       ready_s=None if d.get("ready_s") is None else float(d["ready_s"]),
                       message=str(d.get("message") or ""))
        except (KeyError, ValueError, TypeError, ConfigError) as e:
            raise TransientError(f"malformed vPod record from the backend: {e}") from None


# ---- the interface ---------------------------------------------------------------------------

def label_value(text: str) -> str:
    """``text`` as a Cloud label value (lowercase letters, digits, '-' and '_', at most 63)."""
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in str(text).lower())[:63]


class Backend(ABC):
    """Creates, lists, waits for and deletes vPods (see the module docstring). Coroutines run
    on the caller's event loop.

    ``continuation`` says how the gateway continues a request on another of this backend's
    engines (``router.gateway.Gateway``): ``"kv"`` - they take ``kv_transfer_params`` (the sim
    engines); ``"text"`` - they are plain vLLM, the text so far is resent. ``engine_api_key``:
    the key the engines require (None: none)."""

    continuation = "kv"
    engine_api_key: str | None = None

    @abstractmethod
    async def create(self, spec: VPodSpec) -> VPodInfo:
        """Order a vPod (idempotent by ``spec.id``); returns at once, usually STARTING."""

    @abstractmethod
    async def delete(self, vpod_id: str) -> None:
        """Delete a vPod (idempotent; the caller has drained it)."""

    @abstractmethod
    async def list(self, labels: Mapping[str, str] = {}) -> list[VPodInfo]:
        """The vPods that carry every label of ``labels`` (released ones left out)."""

    @abstractmethod
    async def get(self, vpod_id: str) -> VPodInfo | None:
        """One vPod, or None when the backend has never heard of it."""

    @abstractmethod
    async def wait_ready(self, vpod_id: str, timeout_s: float) -> VPodInfo:
        """Wait until the vPod is READY; :class:`TransientError` after ``timeout_s``,
        :class:`BackendError` when it is deleted or unknown meanwhile."""

    async def delete_pending(self, labels: Mapping[str, str]) -> list[str]:
        """Delete what carries ``labels`` but is not a vPod yet (e.g. Cloud TPU queued
        resources still waiting for capacity); what was deleted. Default: nothing pending."""
        return []

    async def logs(self, vpod_id: str, lines: int = 200) -> str:
        """The tail of the vPod's engine log."""
        raise BackendError(f"this backend keeps no engine logs ({vpod_id})")

    @abstractmethod
    async def close(self) -> None:
        """Release the client's resources (the vPods stay)."""


T = TypeVar("T")


async def with_retries(fn: Callable[[], Awaitable[T]], *, attempts: int = 5,
                       base_s: float = 0.5, max_s: float = 10.0,
                       sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                       rng: random.Random | None = None) -> T:
    """``await fn()``, retrying on :class:`TransientError` only: up to ``attempts`` calls in
    all, sleeping ``uniform(0, min(max_s, base_s * 2**i))`` before retry ``i + 1`` ("full
    jitter": callers that failed together do not retry together). Other errors, and the last
    TransientError, propagate."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    r = rng or random
    for i in range(attempts):
        try:
            return await fn()
        except TransientError:
            if i == attempts - 1:
                raise
            await sleep(r.uniform(0.0, min(max_s, base_s * (2 ** i))))
    raise AssertionError("unreachable")


async def await_launch(launches: dict[str, "asyncio.Task"], vpod_id: str,
                       timeout_s: float) -> T:
    """Wait for a vPod's launch task (shielded: a timeout leaves it running); a failed launch
    is forgotten so that the next call starts it again."""
    try:
        return await asyncio.wait_for(asyncio.shield(launches[vpod_id]), timeout_s)
    except asyncio.TimeoutError:
        raise TransientError(f"vPod {vpod_id} not ready after {timeout_s:g} s") from None
    except BackendError:
        launches.pop(vpod_id, None)
        raise


__all__ = ["await_launch", "label_value", "PHASES", "BackendError", "TransientError", "QuotaError", "ConfigError", "VPodSpec",
           "VPodInfo", "Backend", "with_retries"]
