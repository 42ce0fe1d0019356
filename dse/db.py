"""The best-fit database: one versioned JSON file per (model, metric), and its query API.

``BestFitDB.load(path).lookup(phase, seq_len, chip=None)`` returns the :class:`Entry` of the
bucket holding ``seq_len``; ``chip=None`` gives the best entry across chip versions (SLO-compliant
first, then most efficient). Lookups are a bisect plus a dict/tuple index: ~1 us.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .buckets import MAX_SEQ_LEN, SEQ_BUCKETS
from .errors import NeuScaleError
from .files import read_text, write_atomic
from .parallel import ATTN_LAYOUTS, Parallelism
from .vpod import ICITopology, VPodConfig

DB_FORMAT = "neuscale-bestfit"
DB_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Entry:
    """Best-fit allocation of one (phase, sequence bucket, chip version)."""

    phase: str
    seq_len: int                 # the bucket's upper edge
    chip: str
    topology: str
    num_chips: int
    tp: int
    pp: int
    ep: int
    max_batch: int
    latency_s: float             # TTFT (prefill) / TPOT (decode) at max_batch
    throughput_tok_per_s: float
    energy_j_per_token: float
    usd_per_token: float
    efficiency: float            # tokens/J (metric energy) or tokens/USD (metric cost)
    slo_s: float
    meets_slo: bool
    bound: str                   # compute | memory | ici
    accelerator_type: str
    hbm_bytes_per_chip: float    # memory the allocation uses per chip
    feasible: bool = True        # False: no vPod of this chip fits this bucket
    # MoE stage layout (dse.parallel.Parallelism.attn): "dp" attention data-parallel over the
    # ep groups, "tp" attention tensor-parallel over tp*ep chips with whole experts; databases
    # written before the field existed hold "dp" allocations
    attn: str = "dp"

    @property
    def vpod(self) -> VPodConfig:
        return VPodConfig(self.chip, ICITopology.parse(self.topology), self.num_chips)

    @property
    def parallelism(self) -> "Parallelism":
        return Parallelism(self.tp, self.pp, self.ep, self.attn)

    @property
    def alloc_key(self) -> tuple[str, str, int, int, int, str]:
        """(chip, topology, tp, pp, ep, attn): the allocation, as every table keys it."""
        return (self.chip, self.topology, self.tp, self.pp, self.ep, self.attn)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_ENTRY_FIELDS = [f.name for f in fields(Entry)]
_ENTRY_TYPES = {f.name: f.type for f in fields(Entry)}
_NON_FINITE = ("latency_s", "energy_j_per_token", "usd_per_token")   # inf when infeasible
_OPTIONAL = {"feasible": True, "attn": "dp"}    # fields older databases may lack: defaults
MAX_DB_BYTES = 256 << 20          # real databases are 1-3 MB


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in d.items()}


class _Bad(Exception):
    pass


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise _Bad(what)


def _number(v: Any, where: str, positive: bool = False) -> float:
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v),
          f"{where} must be a number (got {v!r})")
    _need(not positive or v > 0, f"{where} must be > 0 (got {v!r})")
    return float(v)


def _check(data: dict[str, Any]) -> list[Entry]:
    """The file's structure and every field the tools read (type and range); the entries."""
    for key, kind in (("entries", list), ("pareto", dict), ("explain", dict), ("chips", list),
                      ("slo_s", dict), ("model_arch", dict), ("model", str), ("metric", str)):
        _need(isinstance(data.get(key), kind), f"{key!r} is missing or not a {kind.__name__}")
    chips = data["chips"]
    _need(bool(chips) and all(isinstance(c, str) and c for c in chips),
          "'chips' must be a non-empty list of chip names")
    _need(data["metric"] in ("energy", "cost"), f"metric {data['metric']!r} is not energy/cost")
    edges = data.get("buckets", list(SEQ_BUCKETS))
    _need(isinstance(edges, list) and bool(edges) and
          all(type(x) is int and x > 0 for x in edges) and edges == sorted(set(edges)),
          "'buckets' must be increasing positive integers")
    for ph in ("prefill", "decode"):
        slo = data["slo_s"].get(ph)
        _need(isinstance(slo, list) and len(slo) == len(edges),
              f"slo_s.{ph} must list one SLO per bucket ({len(edges)})")
        for i, v in enumerate(slo):
            _number(v, f"slo_s.{ph}[{i}]", positive=True)
    return [_entry(e, i, set(chips), set(edges)) for i, e in enumerate(data["entries"])]


def _entry(e: Any, i: int, chips: set[str], edges: set[int]) -> Entry:
    where = f"entries[{i}]"
    _need(isinstance(e, dict), f"{where} is not an object")
    missing = [k for k in _ENTRY_FIELDS if k not in e and k not in _OPTIONAL]
    _need(not missing, f"{where} lacks {', '.join(missing)}")
    kw: dict[str, Any] = {}
    for k in _ENTRY_FIELDS:
        v, typ, at = e.get(k, _OPTIONAL.get(k)), _ENTRY_TYPES[k], f"{where}.{k}"
        if typ == "str":
            _need(isinstance(v, str), f"{at} must be a string (got {v!r})")
        elif typ == "int":     # an infeasible entry (no vPod fits) has zeros
            lo = 1 if e.get("feasible", True) is True or k == "seq_len" else 0
            _need(type(v) is int and v >= lo, f"{at} must be an integer >= {lo} (got {v!r})")
        elif typ == "bool":
            _need(isinstance(v, bool), f"{at} must be true or false (got {v!r})")
        elif v is None and k in _NON_FINITE:
            v = math.inf
        else:
            v = _number(v, at)
            _need(v >= 0, f"{at} must be >= 0 (got {v!r})")
        kw[k] = v
    _need(kw["phase"] in ("prefill", "decode"), f"{where}.phase {kw['phase']!r}")
    _need(kw["attn"] in ATTN_LAYOUTS,
          f"{where}.attn {kw['attn']!r} is not one of {', '.join(ATTN_LAYOUTS)}")
    _need(kw["chip"] in chips, f"{where}.chip {kw['chip']!r} is not in 'chips'")
    _need(kw["seq_len"] in edges, f"{where}.seq_len {kw['seq_len']} is not a bucket edge")
    return Entry(**kw)


class BestFitDB:
    def __init__(self, meta: dict[str, Any], entries: list[Entry],
                 pareto: dict[str, list[list[Any]]], explain: dict[str, dict[str, Any]]):
        self.meta = meta
        self.entries = entries
        self.pareto = pareto
        self.explain = explain
        self.edges: tuple[int, ...] = tuple(meta.get("buckets", SEQ_BUCKETS))
        self.chips: list[str] = list(meta["chips"])
        self._by: dict[tuple[str, int, str], Entry] = {}
        for e in entries:
            self._by[(e.phase, bisect_left(self.edges, e.seq_len), e.chip)] = e
        # per phase: tuple indexed by bucket -> best entry across chips; per chip likewise
        self._best: dict[str, tuple[Entry | None, ...]] = {}
        self._chip: dict[tuple[str, str], tuple[Entry | None, ...]] = {}
        for phase in ("prefill", "decode"):
            row = []
            for i in range(len(self.edges)):
                cands = [self._by[(phase, i, c)] for c in self.chips
                         if (phase, i, c) in self._by and self._by[(phase, i, c)].feasible]
                row.append(max(cands, key=lambda e: (e.meets_slo, e.efficiency, -e.latency_s))
                           if cands else None)
            self._best[phase] = tuple(row)
            for c in self.chips:
                self._chip[(phase, c.lower())] = tuple(
                    self._by.get((phase, i, c)) for i in range(len(self.edges)))
        aliases = meta.get("chip_aliases")
        self._aliases = {a.lower(): c for c, names in
                         (aliases.items() if isinstance(aliases, dict) else ())
                         if isinstance(c, str) and isinstance(names, list)
                         for a in [c, *names] if isinstance(a, str)}
        self._max = self.edges[-1] if self.edges else MAX_SEQ_LEN

    # ---- query ------------------------------------------------------------------------------
    def lookup(self, phase: str, seq_len: int, chip: str | None = None) -> Entry:
        if type(seq_len) is not int or seq_len < 1 or seq_len > self._max:
            self._bad_len(seq_len)
        i = bisect_left(self.edges, seq_len)
        try:
            row = self._best[phase] if chip is None else self._chip[(phase, chip.lower())]
        except KeyError:
            raise self._bad_key(phase, chip) from None
        e = row[i]
        if e is None or not e.feasible:
            raise NeuScaleError(f"no {chip or 'chip'} vPod fits {phase} at {seq_len} tokens "
                                f"for {self.meta['model']}")
        return e

    def _bad_len(self, seq_len: Any) -> None:
        if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > self._max:
            raise NeuScaleError(f"sequence length {seq_len} exceeds the largest bucket "
                                f"({self._max} tokens)")
        raise NeuScaleError(f"sequence length must be a positive integer (got {seq_len!r})")

    def _bad_key(self, phase: str, chip: str | None) -> NeuScaleError:
        if phase not in ("prefill", "decode"):
            return NeuScaleError(f"phase must be 'prefill' or 'decode' (got {phase!r})")
        real = self._aliases.get(str(chip).lower())
        if real is not None and real != chip:
            return NeuScaleError(f"use the chip's version name {real!r} instead of {chip!r}")
        return NeuScaleError(f"chip {chip!r} is not in this database (chips: "
                             f"{', '.join(self.chips)})")

    def bucket_index(self, seq_len: int) -> int:
        if type(seq_len) is not int or seq_len < 1 or seq_len > self._max:
            self._bad_len(seq_len)
        return bisect_left(self.edges, seq_len)

    def entry_at(self, phase: str, index: int, chip: str | None = None) -> Entry | None:
        """Entry of bucket ``index`` (best across chips when ``chip`` is None; may be None or
        infeasible for a chip that fits nothing there)."""
        row = self._best[phase] if chip is None else self._chip[(phase, chip.lower())]
        return row[index]

    def entries_for(self, phase: str, chip: str | None = None) -> list[Entry]:
        if chip is None:
            return [e for e in self._best[phase] if e is not None]
        return [e for e in self._chip[(phase, chip.lower())] if e is not None]

    def pareto_for(self, phase: str, seq_len: int, chip: str) -> list[dict[str, Any]]:
        """The Pareto front of a bucket, one dict per point (``attn`` is ``"dp"`` in databases
        written before the layout column existed)."""
        i = self.bucket_index(seq_len)
        cols = self.meta["pareto_columns"]
        return [{"attn": "dp", **dict(zip(cols, row))} for row in
                self.pareto.get(f"{phase}|{self.edges[i]}|{chip}", [])]

    def explain_for(self, phase: str, seq_len: int, chip: str) -> dict[str, Any]:
        i = self.bucket_index(seq_len)
        return self.explain.get(f"{phase}|{self.edges[i]}|{chip}", {})

    @property
    def stack(self):
        """The serving-stack profile the database was built for (:func:`dse.stacks.stack_of`)."""
        from .stacks import stack_of
        return stack_of(self.meta)

    def check_built_for(self, arch, catalog) -> None:
        """Refuse to use this database for another model or with other chip specs: its best
        fits, SLOs and prices were computed for the ones it records."""
        have = self.meta.get("model_hash")
        if have != arch.fingerprint():
            raise NeuScaleError(
                f"the best-fit database was built for model {self.meta.get('model')!r} "
                f"(fingerprint {have}), not for {arch.name!r} (fingerprint "
                f"{arch.fingerprint()}): pass the matching --model, or build a database for "
                f"it with `orchestrator dse build --model {arch.name}`")
        for spec in self.meta.get("catalog", []):
            name = spec.get("name") if isinstance(spec, dict) else None
            try:
                mine = catalog.get(name)
            except NeuScaleError:
                raise NeuScaleError(f"the best-fit database uses chip {name!r}, which this "
                                    "command's catalog lacks (pass its --chip-file)") from None
            if json.loads(json.dumps(mine.to_json(), default=str)) != \
                    json.loads(json.dumps(spec, default=str)):
                raise NeuScaleError(
                    f"the best-fit database was built with another spec of chip {name!r} "
                    f"(catalog hash {self.meta.get('catalog_hash')}, this command's "
                    f"{catalog.fingerprint()}): pass the same --chip-file as the build, or "
                    "rebuild the database")

    # ---- files ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The file's content. Strict JSON: an entry's infinite latency, J/token or $/token
        (a chip that fits nothing in the bucket, ``feasible: false``) is written as null."""
        return {**self.meta, "entries": [_finite(e.to_json()) for e in self.entries],
                "pareto": self.pareto, "explain": self.explain}

    def save(self, path: str | Path) -> Path:
        # dumps (C encoder) is several times faster than dump
        return write_atomic(path, json.dumps(self.to_json(), separators=(",", ":"),
                                             allow_nan=False), prefix=".tmp-db-")

    @classmethod
    def load(cls, path: str | Path) -> "BestFitDB":
        p = Path(path)
        if not p.exists():
            raise NeuScaleError(f"no best-fit database at {str(p)!r}; build one with "
                                "`orchestrator dse build --model MODEL --out PATH`")
        text = read_text(p, "best-fit database", MAX_DB_BYTES)
        try:
            data = json.loads(text)
        except ValueError as e:
            raise NeuScaleError(f"cannot read best-fit database {str(p)!r}: {e}") from None
        if not isinstance(data, dict) or data.get("format") != DB_FORMAT:
            raise NeuScaleError(f"{str(p)!r} is not a NeuScale best-fit database")
        version = data.get("format_version")
        if type(version) is not int:
            raise NeuScaleError(f"{str(p)!r}: format_version must be an integer (got "
                                f"{version!r})")
        if version != DB_FORMAT_VERSION:
            raise NeuScaleError(f"{str(p)!r} has database format version {version}; this tool "
                                f"reads version {DB_FORMAT_VERSION}: rebuild it with "
                                "`orchestrator dse build`")
        try:
            entries = _check(data)
        except _Bad as e:
            raise NeuScaleError(f"{str(p)!r} is not a valid best-fit database: {e}") from None
        pareto = data.pop("pareto")
        explain = data.pop("explain")
        data.pop("entries")
        return cls(data, entries, pareto, explain)
