"""Fuzzing the two loaders the simulator reads user files with: the best-fit database and the
trace files. Random bytes, random JSON values in every field of a real database, mangled trace
rows: each input gives a NeuScaleError or a sound result - never another exception, never more
than a couple of seconds (hypothesis' deadline)."""
import json
import math
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dse import BestFitDB, NeuScaleError
from sim.traces import load_trace

FUZZ = settings(max_examples=50, deadline=timedelta(seconds=3), derandomize=True,
                database=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.function_scoped_fixture])
scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3)
                      | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)


@pytest.fixture(scope="module")
def db_json(llama8b_db):
    return json.loads(llama8b_db[1].read_text())


def sound_db(db: BestFitDB) -> None:
    assert db.entries and db.chips
    for e in db.entries[:50]:
        assert e.phase in ("prefill", "decode") and e.chip in db.chips
        assert not math.isnan(e.latency_s)
    db.lookup("decode", 1000) if db.entry_at("decode", 3) else None


@FUZZ
@given(data=st.data())
def test_database_with_random_fields(db_json, tmp_path_factory, data):
    d = json.loads(json.dumps(db_json))
    keys = data.draw(st.lists(st.sampled_from(sorted(d)), max_size=3, unique=True))
    for k in keys:
        if data.draw(st.booleans()):
            del d[k]
        else:
            d[k] = data.draw(values)
    for _ in range(data.draw(st.integers(0, 3))):          # damage some entries
        i = data.draw(st.integers(0, len(d.get("entries", [0])) - 1)) \
            if isinstance(d.get("entries"), list) and d["entries"] else None
        if i is not None and isinstance(d["entries"][i], dict):
            e = d["entries"][i]
            f = data.draw(st.sampled_from(sorted(e)))
            e[f] = data.draw(values)
    p = tmp_path_factory.mktemp("fz") / "db.json"
    p.write_text(json.dumps(d, allow_nan=True))
    try:
        db = BestFitDB.load(p)
    except NeuScaleError:
        return
    except ValueError as e:          # only NeuScaleError (a ValueError) is allowed
        raise AssertionError(f"not a NeuScaleError: {e!r}") from e
    try:
        sound_db(db)
    except NeuScaleError:
        pass


@FUZZ
@given(blob=st.binary(max_size=600))
def test_database_from_random_bytes(tmp_path_factory, blob):
    p = tmp_path_factory.mktemp("fz") / "db.json"
    p.write_bytes(blob)
    with pytest.raises(NeuScaleError):
        BestFitDB.load(p)


@FUZZ
@given(rows=st.lists(st.tuples(values, values, values), min_size=0, max_size=8),
       header=st.sampled_from(["arrival_s,input_tokens,output_tokens",
                               "TIMESTAMP,ContextTokens,GeneratedTokens", "a,b,c", ""]),
       jsonl=st.booleans())
def test_trace_files_with_random_rows(tmp_path_factory, rows, header, jsonl):
    p = tmp_path_factory.mktemp("fz") / ("t.jsonl" if jsonl else "t.csv")
    if jsonl:
        p.write_text("\n".join(json.dumps({"timestamp": a, "input_length": b,
                                           "output_length": c}, allow_nan=True)
                               for a, b, c in rows))
    else:
        p.write_text(header + "\n" + "\n".join(",".join(str(x) for x in r) for r in rows))
    try:
        tr = load_trace(str(p))
    except NeuScaleError:
        return
    assert len(tr) >= 1 and np.all(np.isfinite(tr.arrival_s)) and tr.input_tokens.min() >= 1


@FUZZ
@given(blob=st.binary(max_size=400), gz=st.booleans())
def test_trace_from_random_bytes(tmp_path_factory, blob, gz):
    p = tmp_path_factory.mktemp("fz") / ("t.csv.gz" if gz else "t.csv")
    p.write_bytes(blob)
    try:
        tr = load_trace(str(p))
    except NeuScaleError:
        return
    assert len(tr) >= 1


def test_devices_and_directories_are_refused_at_once(tmp_path):
    for path in ("/dev/zero", str(tmp_path)):
        with pytest.raises(NeuScaleError):
            BestFitDB.load(path)
        with pytest.raises(NeuScaleError):
            load_trace(path)
