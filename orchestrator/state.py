"""The controller's state in SQLite: vPods, the routing tables, the policy's state, the plan
history and the served-request log.

Written so that a ``kill -9`` at any instant leaves a state a restarted controller can
reconcile with what the backend lists: a vPod is recorded (``starting``) *before* the backend
is asked to create it, so every vPod the backend has under this cluster's label is either in
the table (adopted on restart) or an orphan of a crash between the two (deleted after a grace
period); a vPod in the table that the backend does not have was never created, or is gone.
Every write is its own transaction (WAL journal, so readers never block the writer).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from dse.errors import NeuScaleError
from dse.vpod import VPodState

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS vpods (
    id TEXT PRIMARY KEY, grp TEXT NOT NULL, phase TEXT NOT NULL, chip TEXT NOT NULL,
    topology TEXT NOT NULL, num_chips INTEGER NOT NULL, tp INTEGER NOT NULL, pp INTEGER NOT NULL,
    ep INTEGER NOT NULL, max_batch INTEGER NOT NULL, max_model_len INTEGER NOT NULL,
    throughput_tok_per_s REAL NOT NULL, failover INTEGER NOT NULL, state TEXT NOT NULL,
    endpoint TEXT, created_at REAL NOT NULL, ready_at REAL, released_at REAL,
    reason TEXT NOT NULL DEFAULT '', attn TEXT NOT NULL DEFAULT 'dp');
CREATE INDEX IF NOT EXISTS vpods_state ON vpods (state);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS plans (
    id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, phase TEXT NOT NULL,
    actions TEXT NOT NULL, target TEXT NOT NULL, rates TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY, t REAL NOT NULL, endpoint TEXT NOT NULL, status INTEGER NOT NULL,
    prompt_tokens INTEGER, output_tokens INTEGER, predicted_tokens INTEGER,
    prefill_group TEXT, decode_group TEXT, migrations INTEGER, ttft_s REAL, tpot_s REAL,
    e2e_s REAL, finish_reason TEXT, prompt TEXT);
"""


@dataclass
class VPodRow:
    """A vPod as the controller keeps it (what the backend was asked for, and where it is)."""
    id: str
    grp: str
    phase: str
    chip: str
    topology: str
    num_chips: int
    tp: int
    pp: int
    ep: int
    max_batch: int
    max_model_len: int
    throughput_tok_per_s: float
    failover: bool
    state: str
    endpoint: str | None
    created_at: float
    ready_at: float | None = None
    released_at: float | None = None
    reason: str = ""
    attn: str = "dp"          # MoE stage layout (dse.parallel.Parallelism.attn)


_VPOD_COLS = [f for f in VPodRow.__dataclass_fields__]


class StateStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            if self.path.parent and not self.path.parent.exists():
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.path), isolation_level=None,
                                      check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
            cols = {r[1] for r in self.db.execute("PRAGMA table_info(vpods)")}
            if "attn" not in cols:     # written before the MoE layout column: all "dp"
                self.db.execute("ALTER TABLE vpods ADD COLUMN attn TEXT NOT NULL DEFAULT 'dp'")
        except sqlite3.DatabaseError as e:
            raise NeuScaleError(f"state database {str(self.path)!r} is not usable: {e} "
                                "(pass another --state path)") from None
        except OSError as e:
            raise NeuScaleError(f"cannot create the state database {str(self.path)!r}: "
                                f"{e.strerror or e}") from None
        have = self.get_meta("schema_version")
        if have is None:
            self.set_meta("schema_version", str(SCHEMA_VERSION))
        elif have != str(SCHEMA_VERSION):
            raise NeuScaleError(f"state database {str(self.path)!r} has schema version {have}; "
                                f"this tool writes {SCHEMA_VERSION}: pass another --state path")

    def close(self) -> None:
        self.db.close()

    # ---- meta and small values ----------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def check_identity(self, **facts: str) -> None:
        """The state belongs to one cluster, model and database: refuse to reuse it for
        another (a restarted controller must not adopt someone else's vPods)."""
        for k, v in facts.items():
            have = self.get_meta(k)
            if have is None:
                self.set_meta(k, v)
            elif have != v:
                raise NeuScaleError(f"state database {str(self.path)!r} belongs to {k} "
                                    f"{have!r}, not {v!r}: pass another --state path or the "
                                    f"same {k}")

    def get_json(self, key: str) -> Any:
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def set_json(self, key: str, value: Any) -> None:
        self.db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)",
                        (key, json.dumps(value)))

    # ---- vPods --------------------------------------------------------------------------------
    def add_vpod(self, v: VPodRow) -> None:
        d = asdict(v)
        d["failover"] = int(v.failover)
        self.db.execute(f"INSERT INTO vpods ({', '.join(_VPOD_COLS)}) VALUES "
                        f"({', '.join('?' for _ in _VPOD_COLS)})", [d[c] for c in _VPOD_COLS])

    def update_vpod(self, vpod_id: str, **fields: Any) -> None:
        if not fields:
            return
        bad = set(fields) - set(_VPOD_COLS)
        if bad:
            raise ValueError(f"unknown vPod fields {bad}")
        cols = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE vpods SET {cols} WHERE id = ?", [*fields.values(), vpod_id])

    def vpods(self, states: Iterable[str] | None = None) -> list[VPodRow]:
        q = f"SELECT {', '.join(_VPOD_COLS)} FROM vpods"
        args: list[Any] = []
        if states is not None:
            states = list(states)
            q += f" WHERE state IN ({', '.join('?' for _ in states)})"
            args = states
        rows = self.db.execute(q + " ORDER BY created_at, id", args).fetchall()
        out = []
        for r in rows:
            d = dict(zip(_VPOD_COLS, r))
            d["failover"] = bool(d["failover"])
            out.append(VPodRow(**d))
        return out

    def live_vpods(self) -> list[VPodRow]:
        return self.vpods([VPodState.STARTING, VPodState.READY, VPodState.DRAINING])

    # ---- plans and requests -------------------------------------------------------------------
    def add_plan(self, t: float, phase: str, actions: list[dict], target: dict,
                 rates: dict) -> None:
        self.db.execute("INSERT INTO plans (t, phase, actions, target, rates) VALUES "
                        "(?, ?, ?, ?, ?)", (t, phase, json.dumps(actions), json.dumps(target),
                                            json.dumps(rates)))

    def recent_plans(self, n: int = 10) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT t, phase, actions, target, rates FROM plans "
                               "ORDER BY id DESC LIMIT ?", (n,)).fetchall()
        return [{"t": t, "phase": ph, "actions": json.loads(a), "target": json.loads(tg),
                 "rates_tok_per_s": json.loads(r)} for t, ph, a, tg, r in rows]

    def log_requests(self, records: list[dict[str, Any]]) -> None:
        """The served-request log (predictor training data; the prompt only when the caller
        enabled it)."""
        if not records:
            return
        cols = ["id", "t", "endpoint", "status", "prompt_tokens", "output_tokens",
                "predicted_tokens", "prefill_group", "decode_group", "migrations", "ttft_s",
                "tpot_s", "e2e_s", "finish_reason", "prompt"]
        self.db.execute("BEGIN")
        try:
            self.db.executemany(
                f"INSERT OR REPLACE INTO requests ({', '.join(cols)}) VALUES "
                f"({', '.join('?' for _ in cols)})", [[r.get(c) for c in cols] for r in records])
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def request_count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]


def now() -> float:
    return time.time()
