"""Training and evaluation pairs for the output-length predictor: (prompt, output tokens).

Two sources:

* JSONL files of real prompt/answer pairs (``../shared/data/prompts/``, see its README): one
  object per line with at least ``prompt``, ``prompt_tokens`` and ``response_tokens``;
  ``prompt_sha1``, ``source``, ``model`` and ``near_length_cap`` are used when present (a
  missing ``prompt_sha1`` is computed). ``near_length_cap`` marks an answer probably cut by a
  generation limit: its length is a lower bound (*censored*), not the answer's length.
* The router's served-request log (``orchestrator serve --state STATE.db --log-prompts``):
  requests that ended on their own (``finish_reason = 'stop'``) with their prompt text;
  ``length`` endings are censored at the tokens generated.

Train and test are split by ``prompt_sha1`` (the same prompt appears once per answering model
in the arena set): a prompt is in the test split when the first 8 hex digits of its SHA-1 modulo
100 are below ``test_percent`` — the same split on every machine and every run.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from dse.errors import NeuScaleError
from dse.files import read_text

MAX_DATA_BYTES = 512 << 20

# serving-model families the head may be conditioned on (a model name's first match wins);
# "reasoning" models answer far longer than the rest (../shared/data/README.md)
FAMILIES = (
    ("reasoning", re.compile(r"o1|o3|o4|sky-t1|deepseek-r1|qwq|reason", re.I)),
    ("gpt-4", re.compile(r"gpt-4", re.I)),
    ("gpt-3.5", re.compile(r"gpt-3\.5", re.I)),
    ("claude", re.compile(r"claude", re.I)),
    ("llama", re.compile(r"llama|vicuna|wizardlm", re.I)),
    ("mistral", re.compile(r"mistral|mixtral|openchat|starling", re.I)),
    ("palm", re.compile(r"palm|bison|gemini", re.I)),
    ("deepseek", re.compile(r"deepseek", re.I)),
)
FAMILY_NAMES = tuple(n for n, _ in FAMILIES)


def family_of(model: str | None) -> str | None:
    """The family of a serving model's name (``llama3-8b`` -> ``llama``), None when unknown."""
    if not model:
        return None
    for name, rx in FAMILIES:
        if rx.search(model):
            return name
    return None


@dataclass(frozen=True)
class Pair:
    prompt: str
    prompt_tokens: int
    output_tokens: int
    censored: bool = False        # output_tokens is a lower bound (cut by a length cap)
    source: str = ""
    model: str = ""
    prompt_sha1: str = ""

    @property
    def family(self) -> str | None:
        return family_of(self.model)


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


def _int_field(obj: dict, key: str, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 \
            or (isinstance(v, float) and not v.is_integer()):
        raise NeuScaleError(f"{where}: {key!r} must be a non-negative integer, got {v!r}")
    return int(v)


def load_jsonl(path: str | Path) -> list[Pair]:
    """The pairs of one JSONL file (NeuScaleError naming the file and line on bad input)."""
    p = Path(path)
    text = read_text(p, "prompt data file", max_bytes=MAX_DATA_BYTES)
    out: list[Pair] = []
    for i, line in enumerate(text.split("\n"), 1):   # not splitlines(): U+2028 is text
        if not line.strip():
            continue
        where = f"{p}:{i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise NeuScaleError(f"{where}: not JSON ({e.msg}); expected one object per line "
                                "with prompt, prompt_tokens and response_tokens") from None
        if not isinstance(obj, dict):
            raise NeuScaleError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise NeuScaleError(f"{where}: no 'prompt' string (is this a prompt/answer file? "
                                "see ../shared/data/README.md)")
        out_tok = _int_field(obj, "response_tokens" if "response_tokens" in obj
                             else "output_tokens", where)
        if out_tok < 1:
            continue                                # an empty answer says nothing of length
        out.append(Pair(prompt=prompt, prompt_tokens=max(1, _int_field(obj, "prompt_tokens",
                                                                          where)),
                        output_tokens=out_tok, censored=bool(obj.get("near_length_cap", False)),
                        source=str(obj.get("source") or p.stem), model=str(obj.get("model") or ""),
                        prompt_sha1=str(obj.get("prompt_sha1") or sha1(prompt))))
    if not out:
        raise NeuScaleError(f"{p}: no prompt/answer pairs in it")
    return out


def load_log(path: str | Path, *, model: str = "") -> list[Pair]:
    """Pairs from the router's served-request log (SQLite ``requests`` table)."""
    p = Path(path)
    if not p.is_file():
        raise NeuScaleError(f"no served-request log at {str(p)!r} (the --state file of "
                            "`orchestrator serve`)")
    try:
        con = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
        try:
            rows = con.execute(
                "SELECT prompt, prompt_tokens, output_tokens, finish_reason FROM requests "
                "WHERE prompt IS NOT NULL AND status = 200 AND output_tokens > 0 "
                "AND finish_reason IN ('stop', 'length')").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise NeuScaleError(f"{str(p)!r} is not a served-request log ({e}); pass the --state "
                            "file of `orchestrator serve`") from None
    out = [Pair(prompt=str(pr), prompt_tokens=max(1, int(pt or 1)), output_tokens=int(ot),
                censored=(fr == "length"), source="served-log", model=model,
                prompt_sha1=sha1(str(pr)))
           for pr, pt, ot, fr in rows]
    if not out:
        raise NeuScaleError(f"{str(p)!r} holds no served requests with their prompt text "
                            "(start `orchestrator serve` with --log-prompts to keep them)")
    return out


def load_sources(data: str | None = None, from_log: str | None = None) -> list[Pair]:
    """``data``: comma-separated JSONL files; ``from_log``: a served-request log."""
    pairs: list[Pair] = []
    for f in (x.strip() for x in (data or "").split(",")):
        if f:
            pairs.extend(load_jsonl(f))
    if from_log:
        pairs.extend(load_log(from_log))
    if not pairs:
        raise NeuScaleError("no training data: pass --data FILE.jsonl[,FILE2] and/or "
                            "--from-log STATE.db")
    return pairs


def in_test(prompt_sha1: str, test_percent: int = 20) -> bool:
    try:
        return int(prompt_sha1[:8], 16) % 100 < test_percent
    except ValueError:
        return int(sha1(prompt_sha1)[:8], 16) % 100 < test_percent


def split(pairs: list[Pair], test_percent: int = 20) -> tuple[list[Pair], list[Pair]]:
    """(train, test), split by prompt (see the module docstring)."""
    train, test = [], []
    for x in pairs:
        (test if in_test(x.prompt_sha1, test_percent) else train).append(x)
    return train, test
