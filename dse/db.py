"""The best-fit database: one versioned JSON file per (model, metric), and its query API.

``BestFitDB.load(path).lookup(phase, seq_len, chip=None)`` returns the :class:`Entry` of the
bucket holding ``seq_len``; ``chip=None`` gives the best entry across chip versions (SLO-compliant
first, then most efficient). Lookups are a bisect plus a dict/tuple index: ~1 us.
"""

from __future__ import annotations

import json
import os
import tempfile
from bisect import bisect_left
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .buckets import MAX_SEQ_LEN, SEQ_BUCKETS
from .errors import NeuScaleError
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

    @property
    def vpod(self) -> VPodConfig:
        return VPodConfig(self.chip, ICITopology.parse(self.topology), self.num_chips)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_ENTRY_FIELDS = [f.name for f in fields(Entry)]


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
        self._aliases = {a.lower(): c for c, names in meta.get("chip_aliases", {}).items()
                         for a in [c, *names]}
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
        i = self.bucket_index(seq_len)
        cols = self.meta["pareto_columns"]
        return [dict(zip(cols, row)) for row in
                self.pareto.get(f"{phase}|{self.edges[i]}|{chip}", [])]

    def explain_for(self, phase: str, seq_len: int, chip: str) -> dict[str, Any]:
        i = self.bucket_index(seq_len)
        return self.explain.get(f"{phase}|{self.edges[i]}|{chip}", {})

    # ---- files ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {**self.meta, "entries": [e.to_json() for e in self.entries],
                "pareto": self.pareto, "explain": self.explain}

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-db-")
        with os.fdopen(fd, "w") as fh:  # dumps (C encoder) is several times faster than dump
            fh.write(json.dumps(self.to_json(), separators=(",", ":")))
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> "BestFitDB":
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise NeuScaleError(f"no best-fit database at {str(p)!r}; build one with "
                                "`orchestrator dse build --model MODEL --out PATH`") from None
        except (OSError, ValueError) as e:
            raise NeuScaleError(f"cannot read best-fit database {str(p)!r}: {e}") from None
        if not isinstance(data, dict) or data.get("format") != DB_FORMAT:
            raise NeuScaleError(f"{str(p)!r} is not a NeuScale best-fit database")
        if data.get("format_version") != DB_FORMAT_VERSION:
            raise NeuScaleError(f"{str(p)!r} has database format version "
                                f"{data.get('format_version')}; this tool reads version "
                                f"{DB_FORMAT_VERSION}: rebuild it with `orchestrator dse build`")
        entries = [Entry(**{k: e[k] for k in _ENTRY_FIELDS}) for e in data.pop("entries")]
        pareto = data.pop("pareto")
        explain = data.pop("explain")
        return cls(data, entries, pareto, explain)
