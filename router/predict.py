"""Output-length prediction for routing (paper §3.4): the interface the gateway calls and its
simple default.

A predictor answers two questions, in output tokens:

* ``predict(prompt, prompt_tokens)``: how long will the output of this new request be?
* ``repredict(prompt, prompt_tokens, generated)``: it has produced ``generated`` tokens so far;
  how long will the whole output be (>= ``generated``)? Asked whenever the request's length
  crosses a bucket boundary; the answer feeds :func:`router.routing.should_migrate`.

and learns from ``observe(prompt_tokens, output_tokens)`` after each request that ended on its
own (finish_reason ``stop``). Either method may return an awaitable (a model that runs off the
event loop, e.g. the BERT-family predictor of ``predictor/``); the gateway awaits it. When a
predictor raises or answers nonsense, the gateway counts a fallback
(``neuscale_predictor_fallbacks_total``) and asks :class:`MedianPredictor` instead. The gateway
caps every answer by the request's ``max_tokens`` (and uses ``max_tokens`` itself when the
request sets ``ignore_eos``).

:class:`MedianPredictor`, the default, keeps per input-length bucket the last ``window`` output
lengths of finished requests: a new request is predicted the bucket's median (``prior_tokens``
until the bucket has ``min_samples``); a running one, the median of the outputs in its bucket that
were longer than what it has produced (so a request that outlives most of its peers is expected
to go on like the ones that outlived them); when fewer than ``min_samples`` did, twice what it
has produced (the length it has reached is the best guess of the length still to come).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
import logging
from collections import deque
from typing import Any, Awaitable, Protocol, runtime_checkable

from dse.buckets import SEQ_BUCKETS

log = logging.getLogger("neuscale.router")


@runtime_checkable
class LengthPredictor(Protocol):
    def predict(self, prompt: str, prompt_tokens: int) -> int | Awaitable[int]: ...

    def repredict(self, prompt: str, prompt_tokens: int,
                  generated: int) -> int | Awaitable[int]: ...

    def observe(self, prompt_tokens: int, output_tokens: int) -> Any: ...


class MedianPredictor:
    """Per-input-bucket running median of served output lengths, with a prior."""

    name = "median"

    def __init__(self, edges: tuple[int, ...] = SEQ_BUCKETS, *, prior_tokens: int = 128,
                 window: int = 256, min_samples: int = 8):
        if prior_tokens < 1 or window < 1 or min_samples < 1:
            raise ValueError("prior_tokens, window and min_samples must be >= 1")
        self.edges = tuple(edges)
        self.prior_tokens = prior_tokens
        self.window = window
        self.min_samples = min_samples
        self._recent: dict[int, deque[int]] = {}
        self._sorted: dict[int, list[int]] = {}

    def _bucket(self, prompt_tokens: int) -> int:
        return min(bisect_left(self.edges, max(1, prompt_tokens)), len(self.edges) - 1)

    def predict(self, prompt: str, prompt_tokens: int) -> int:
        s = self._sorted.get(self._bucket(prompt_tokens))
        if not s or len(s) < self.min_samples:
            return self.prior_tokens
        return s[len(s) // 2]

    def repredict(self, prompt: str, prompt_tokens: int, generated: int) -> int:
        s = self._sorted.get(self._bucket(prompt_tokens)) or []
        i = bisect_right(s, generated)
        longer = len(s) - i
        if longer >= self.min_samples:
            return s[i + longer // 2]
        return max(2 * generated, self.prior_tokens, generated + 1)

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        if output_tokens < 1:
            return
        b = self._bucket(prompt_tokens)
        recent = self._recent.setdefault(b, deque())
        s = self._sorted.setdefault(b, [])
        recent.append(output_tokens)
        insort(s, output_tokens)
        if len(recent) > self.window:
            old = recent.popleft()
            del s[bisect_left(s, old)]


class FixedPredictor:
    """Every new request is predicted ``tokens`` long; a running one, one more token than it
    has (no information beyond its length). For experiments: ``--predictor fixed:N``."""

    name = "fixed"

    def __init__(self, tokens: int):
        if tokens < 1:
            raise ValueError("a fixed prediction must be >= 1 token")
        self.tokens = int(tokens)

    def predict(self, prompt: str, prompt_tokens: int) -> int:
        return self.tokens

    def repredict(self, prompt: str, prompt_tokens: int, generated: int) -> int:
        return max(self.tokens, generated + 1)

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        pass


PREDICTORS = ("auto", "bert", "bert:MODEL_DIR", "median", "fixed:N")


def make_predictor(spec: str, edges: tuple[int, ...] = SEQ_BUCKETS, *,
                   serving_model: str | None = None) -> LengthPredictor:
    """A predictor from its name:

    * ``bert`` / ``bert:MODEL_DIR``: the BERT-family predictor of ``predictor/`` (the model
      shipped in the package, or a trained directory); an error if it cannot load;
    * ``auto`` (the default of ``orchestrator serve``): ``bert`` when its dependencies and model
      load, else :class:`MedianPredictor` — the fallback is logged and shows in ``/metrics``
      (``neuscale_predictor_active{predictor="median",configured="bert"}``);
    * ``median``, ``fixed:N``.

    ValueError naming the choices (or why ``bert`` cannot load) otherwise."""
    raw = str(spec).strip()
    s = raw.lower()
    if s == "median":
        return MedianPredictor(edges)
    if s.startswith("fixed:"):
        try:
            return FixedPredictor(int(s.split(":", 1)[1]))
        except ValueError:
            pass
    if s in ("auto", "bert") or s.startswith("bert:"):
        model_dir = raw.split(":", 1)[1] if s.startswith("bert:") else None
        try:
            from predictor.service import BertPredictor
            return BertPredictor(model_dir=model_dir or None, edges=tuple(edges),
                                 serving_model=serving_model)
        except Exception as e:  # noqa: BLE001 - a missing dependency, model or encoder
            if s != "auto":
                raise ValueError(f"the BERT predictor cannot load: {e}") from None
            fb = MedianPredictor(edges)
            fb.configured = "bert"                # type: ignore[attr-defined]
            fb.fallback_reason = str(e)           # type: ignore[attr-defined]
            log.warning("output-length predictor: BERT unavailable (%s); using the per-input "
                        "median", e)
            return fb
    raise ValueError(f"unknown predictor {spec!r}; known: {', '.join(PREDICTORS)}")
