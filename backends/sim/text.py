"""Synthetic, deterministic output for the simulated engines.

A simulated engine has no model weights, but what it returns must behave like vLLM's output:
token counts, ``max_tokens``, ``min_tokens``, ``ignore_eos``, ``stop`` strings, finish reasons
and usage. Everything here is a pure function of the request, so a request continued on another
vPod (P/D hand-off, migration, fail-over) produces exactly what the first vPod would have:

* output token ``i`` is a word picked from :data:`VOCAB` by a hash of (prompt text, seed, i).
  Every word is one token by :func:`dse.tokens.count_tokens` (at most 6 letters, or one
  punctuation mark, with a leading space), so ``count_tokens(text)`` of ``n`` tokens is ``n``;
* the request's *intrinsic* length (where it would emit EOS) is a deterministic function of
  (prompt text, seed): log-normal with median :data:`MEDIAN_TOKENS` and sigma :data:`SIGMA`;
* :func:`plan_output` applies vLLM's rules on top: ``ignore_eos`` drops the EOS, ``min_tokens``
  floors it (and holds back stop strings until then), ``max_tokens`` caps the output
  (``"length"``), a stop string ends it at the token that completes it, the text cut before the
  stop string (``"stop"``, ``stop_reason`` = the string), as vLLM does without
  ``include_stop_str_in_output``. The EOS itself is not a token of the output here.
"""

from __future__ import annotations

import hashlib
import math
from statistics import NormalDist
from typing import Sequence

MEDIAN_TOKENS = 120          # median intrinsic output length
SIGMA = 0.9                  # log-normal shape: ~ 5 % of requests beyond 530 tokens

_M = (1 << 64) - 1

# 160 short words and two punctuation marks, each with its leading space: one token apiece
_WORDS = """the of and to in is was for on are with as by at from his that it an be this
have or had not but what all were when we there can more one so if will out up about into
them she her than then its time only new some could these two may first any like now my
over such our man me even most made after also did many off before must well back through
years much where your way down should because each just those people how too little state
good very make world still own see men work long here both under never same last might great
old year come since take being use used each three house power made life few next end set
put read point city play small number large home again hand high land water light night
north south east west river stone field paper music voice plan level order early""".split()
_PUNCT = (" ,", " .")              # picked for ~8 % of the tokens (see _word)
_WORDS_SP = tuple(dict.fromkeys(" " + w for w in _WORDS if w.isalpha() and len(w) <= 6))
_N_WORDS = len(_WORDS_SP)
VOCAB: tuple[str, ...] = _WORDS_SP + _PUNCT

_ND = NormalDist()


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit hash of a 64-bit integer."""
    z = (x + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def request_key(prompt: str, seed: int | None) -> int:
    """64-bit key of (prompt text, seed): what the output depends on."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"%d\0" % (0 if seed is None else seed))
    h.update(prompt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def _word(key: int, i: int) -> str:
    z = _mix(key ^ ((i + 1) * 0xD1B54A32D192ED03 & _M))
    if z % 100 < 8:
        return _PUNCT[(z >> 8) & 1]
    return _WORDS_SP[(z >> 16) % _N_WORDS]


def words(key: int, start: int, stop: int) -> list[str]:
    """Output tokens ``start .. stop-1`` of the request with key ``key``."""
    return [_word(key, i) for i in range(start, stop)]


def intrinsic_length(key: int) -> int:
    """Where the request would emit EOS (>= 1 token): log-normal, median
    :data:`MEDIAN_TOKENS`, a deterministic function of the key."""
    u = ((_mix(key ^ 0x5EED5EED5EED5EED) >> 11) + 0.5) / float(1 << 53)
    z = _ND.inv_cdf(u)
    return max(1, int(round(MEDIAN_TOKENS * math.exp(SIGMA * z))))


class OutputPlan:
    """A request's whole output, decided before it runs: ``total`` tokens, ``finish_reason``
    (``"stop"`` or ``"length"``), ``stop_reason`` (the stop string that ended it, or None) and
    the text of any range of tokens (:meth:`text`), cut where a stop string begins."""

    __slots__ = ("key", "total", "finish_reason", "stop_reason", "_final", "_cum")

    def __init__(self, key: int, total: int, finish_reason: str, stop_reason: str | None,
                 final: str | None, cum: list[int] | None):
        self.key = key
        self.total = total
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self._final = final          # the whole text when stop strings were scanned
        self._cum = cum              # characters of the first m tokens (m = 0..total)

    def text(self, a: int, b: int) -> str:
        """The text that tokens ``a .. b-1`` add to the output (``0 <= a <= b <= total``)."""
        b = min(b, self.total)
        if a >= b:
            return ""
        if self._final is None:
            return "".join(words(self.key, a, b))
        n = len(self._final)
        return self._final[min(self._cum[a], n):min(self._cum[b], n)]

    def full_text(self) -> str:
        return self.text(0, self.total)


def plan_output(prompt: str, *, max_tokens: int, min_tokens: int = 0, ignore_eos: bool = False,
                stop: Sequence[str] = (), seed: int | None = None) -> OutputPlan:
    """The output of a request with this prompt text and these sampling parameters (see the
    module docstring). ``max_tokens >= 1``."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    key = request_key(prompt, seed)
    min_tokens = min(max(0, min_tokens), max_tokens)
    if ignore_eos:
        n, reason = max_tokens, "length"
    else:
        eos = max(intrinsic_length(key), min_tokens)
        n, reason = (eos, "stop") if eos <= max_tokens else (max_tokens, "length")
    stops = [s for s in stop if s]
    if not stops:
        return OutputPlan(key, n, reason, None, None, None)
    longest = max(len(s) for s in stops)
    parts: list[str] = []
    cum = [0]
    text = ""
    for j in range(n):
        w = _word(key, j)
        parts.append(w)
        text += w
        cum.append(len(text))
        if j + 1 < min_tokens:
            continue                     # vLLM checks stop strings only from min_tokens on
        lo = max(0, len(text) - len(w) - longest + 1)
        best = None
        for s in stops:
            i = text.find(s, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            return OutputPlan(key, j + 1, "stop", best[1], text[:best[0]], cum)
    return OutputPlan(key, n, reason, None, text, cum)


__all__ = ["VOCAB", "MEDIAN_TOKENS", "SIGMA", "request_key", "words", "intrinsic_length",
           "OutputPlan", "plan_output"]
