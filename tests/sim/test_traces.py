"""Workload traces (sim.traces): file formats on the real data, windowing and rate scaling on
tiny hand-checkable files, the Table 4 / §5.3 synthesisers, and one clear error per bad input.

Expected numbers come from the data README (``/work/shared/data/README.md``) and paper Table 4.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest

from dse.errors import NeuScaleError
from sim.traces import (PRESETS, TABLE4, Trace, TruncatedLogNormal, data_dir, load_trace,
                        match_tokens_per_minute, synth_bursty)

SYNTH_HEADER = "arrival_s,input_tokens,output_tokens"
# arrival_s, input_tokens, output_tokens; all times exact in binary floating point
TINY_ROWS = [(0.0, 100, 10), (30.0, 200, 20), (60.0, 300, 30), (90.5, 400, 40)]


def _write(path: Path, text: str, gz: bool = False) -> Path:
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _tiny_csv(tmp_path: Path, rows: list[tuple[float, int, int]], name: str = "tiny.csv",
              gz: bool = False) -> Path:
    lines = [SYNTH_HEADER] + [f"{a},{i},{o}" for a, i, o in rows]
    return _write(tmp_path / name, "\n".join(lines) + "\n", gz)


@pytest.fixture(scope="module")
def data() -> Path:
    try:
        d = data_dir()
    except NeuScaleError as e:
        pytest.skip(f"shared trace data not available: {e}")
    return d


@pytest.fixture(scope="module")
def azure_day(data: Path) -> Trace:
    return load_trace("azure-code")


def _assert_well_formed(tr: Trace) -> None:
    assert tr.arrival_s.dtype == np.float64 and tr.input_tokens.dtype == np.int64
    assert tr.output_tokens.dtype == np.int64
    assert tr.arrival_s[0] >= 0 and np.all(np.diff(tr.arrival_s) >= 0)
    assert tr.input_tokens.min() >= 1 and tr.output_tokens.min() >= 1


# ---------------------------------------------------------------------------- synthesised CSV

@pytest.mark.parametrize("gz", [False, True])
def test_synth_csv_plain_and_gzip(tmp_path: Path, gz: bool) -> None:
    tr = load_trace(str(_tiny_csv(tmp_path, TINY_ROWS, "t.csv.gz" if gz else "t.csv", gz)))
    assert tr.name == "t" and len(tr) == 4 and tr.note == ""
    np.testing.assert_array_equal(tr.arrival_s, [0.0, 30.0, 60.0, 90.5])
    np.testing.assert_array_equal(tr.input_tokens, [100, 200, 300, 400])
    np.testing.assert_array_equal(tr.output_tokens, [10, 20, 30, 40])
    assert tr.duration_s == 90.5
    s = tr.summary()
    assert s["requests"] == 4 and s["duration_s"] == 90.5
    assert s["req_per_min"] == pytest.approx(4 * 60 / 90.5)
    assert (s["input_min"], s["input_mean"], s["input_max"]) == (100, 250.0, 400)
    assert (s["output_min"], s["output_mean"], s["output_max"]) == (10, 25.0, 40)
    # (1000 input + 100 output tokens) over 90.5 s
    assert tr.tokens_per_minute() == pytest.approx(1100 * 60 / 90.5)


def test_gzip_detected_by_content_and_rows_sorted(tmp_path: Path) -> None:
    path = _tiny_csv(tmp_path, [(2.0, 5, 1), (1.0, 6, 2), (1.0, 7, 3)], "no_gz_suffix", gz=True)
    tr = load_trace(str(path))
    np.testing.assert_array_equal(tr.arrival_s, [1.0, 1.0, 2.0])
    np.testing.assert_array_equal(tr.input_tokens, [6, 7, 5])      # stable sort


def test_trace_arrays_are_read_only_and_invariants_checked() -> None:
    tr = Trace("x", np.array([0.0, 1.0]), np.array([1, 2]), np.array([3, 4]))
    with pytest.raises(ValueError):
        tr.arrival_s[0] = 5.0
    with pytest.raises(NeuScaleError, match=r"sorted"):
        Trace("x", np.array([1.0, 0.0]), np.array([1, 2]), np.array([3, 4]))
    with pytest.raises(NeuScaleError, match=r">= 1"):
        Trace("x", np.array([0.0, 1.0]), np.array([1, 0]), np.array([3, 4]))
    with pytest.raises(NeuScaleError, match=r"one length"):
        Trace("x", np.array([0.0, 1.0]), np.array([1]), np.array([3, 4]))


# ------------------------------------------------------------------------- real data files

@pytest.mark.parametrize("preset, rows, req_per_min, inp, out, second_arrival_s", [
    # data README: 154 req/min; input 3/2048/7437, output 6/27.9/1899; rows 2 - 1 = 0.052 s
    ("azure-code-2023", 8_819, 154, (3, 2048, 7437), (6, 27.9, 1899), 0.052),
    # 332 req/min; input 2/1155/14050, output 7/211/1000; 18:15:50.9951690 - 18:15:46.6805900
    ("azure-conv-2023", 19_366, 332, (2, 1155, 14050), (7, 211, 1000), 4.314579),
    # Mooncake: 204 req/min; input 891/12035/126195, output 1/343/2000; timestamps 0, 0 ms
    ("mooncake", 12_031, 204, (891, 12035, 126195), (1, 343, 2000), 0.0),
])
def test_real_traces_match_data_readme(data: Path, preset: str, rows: int, req_per_min: int,
                                       inp: tuple[int, float, int], out: tuple[int, float, int],
                                       second_arrival_s: float) -> None:
    tr = load_trace(preset)
    _assert_well_formed(tr)
    assert len(tr) == rows
    assert tr.arrival_s[0] == 0.0
    assert tr.arrival_s[1] == pytest.approx(second_arrival_s, abs=1e-9)
    assert tr.duration_s < 3600
    s = tr.summary()
    assert round(s["req_per_min"]) == req_per_min
    assert (s["input_min"], round(s["input_mean"]), s["input_max"]) == (inp[0], inp[1], inp[2])
    assert (s["output_min"], s["output_max"]) == (out[0], out[2])
    assert s["output_mean"] == pytest.approx(out[1], abs=0.5)


def test_servegen_r1(data: Path) -> None:
    tr = load_trace("servegen-r1")
    _assert_well_formed(tr)
    assert len(tr) == 19_748
    # arrival_s files keep their time origin (the start of the day): first row 3.845, last
    # 86399.243
    assert tr.arrival_s[0] == 3.845 and tr.duration_s == 86399.243
    assert (tr.input_tokens[0], tr.output_tokens[0]) == (11, 26)
    assert tr.output_tokens.max() == 32_768                  # README: max 32,768
    assert tr.output_tokens.mean() == pytest.approx(1527, rel=0.03)   # README PMF mean 1527
    assert "SYNTH" in tr.note


def test_azure_code_full_day(azure_day: Trace) -> None:
    tr = azure_day
    _assert_well_formed(tr)
    assert len(tr) == 2_481_066
    assert tr.arrival_s[0] == 0.015 and tr.duration_s < 86_400       # the day from 00:00
    s = tr.summary()
    assert s["input_max"] <= 7691 and s["output_min"] >= 1          # Table 4 Azure ranges
    assert s["input_mean"] == pytest.approx(2502, rel=0.01)          # README: mean ~2502
    assert s["output_max"] == 1899                                   # resampled from 2023 code
    assert s["req_per_min"] == pytest.approx(2_481_066 / (tr.duration_s / 60))
    assert "SYNTH" in tr.note


def test_azure_day_window_by_clock(azure_day: Trace) -> None:
    tr = load_trace("azure-code", start="12:00", hours=1)
    a = azure_day.arrival_s
    inside = (a >= 12 * 3600) & (a < 13 * 3600)
    assert len(tr) == int(inside.sum())
    np.testing.assert_array_equal(tr.arrival_s, a[inside] - 12 * 3600)
    np.testing.assert_array_equal(tr.input_tokens, azure_day.input_tokens[inside])


def test_azure_2023_and_mooncake_formats_on_tiny_files(tmp_path: Path) -> None:
    az = _write(tmp_path / "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.1805900,396,109\n"
                "2023-11-16 18:16:46.6805900,5,1\n")
    tr = load_trace(str(az))
    np.testing.assert_allclose(tr.arrival_s, [0.0, 0.5, 60.0], rtol=0, atol=1e-9)
    np.testing.assert_array_equal(tr.input_tokens, [374, 396, 5])
    mc = _write(tmp_path / "mc.jsonl",
                '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
                '{"timestamp": 1500, "input_length": 20, "output_length": 3, "hash_ids": []}\n')
    tr = load_trace(str(mc))
    np.testing.assert_array_equal(tr.arrival_s, [0.0, 1.5])
    np.testing.assert_array_equal(tr.output_tokens, [2, 3])


# -------------------------------------------------------------- windowing, rates, matching

WINDOW_ROWS = [(0.0, 1, 1), (59.5, 2, 1), (60.0, 3, 1), (61.0, 4, 1), (3659.5, 5, 1),
               (3660.0, 6, 1), (7200.0, 7, 1)]


def test_start_hours_window_is_half_open_and_rebased(tmp_path: Path) -> None:
    path = str(_tiny_csv(tmp_path, WINDOW_ROWS))
    tr = load_trace(path, start="00:01", hours=1)             # [60 s, 3660 s)
    np.testing.assert_array_equal(tr.arrival_s, [0.0, 1.0, 3599.5])
    np.testing.assert_array_equal(tr.input_tokens, [3, 4, 5])
    tr = load_trace(path, start="01:01")                       # [3660 s, end)
    np.testing.assert_array_equal(tr.arrival_s, [0.0, 3540.0])
    tr = load_trace(path, hours=1 / 60)                        # [0, 60 s)
    np.testing.assert_array_equal(tr.input_tokens, [1, 2])
    full = load_trace(path)
    np.testing.assert_array_equal(full.slice(60.0, 3660.0).arrival_s, [0.0, 1.0, 3599.5])
    np.testing.assert_array_equal(full.head(2).input_tokens, [1, 2])
    assert len(full.head(100)) == 7 and len(full) == 7 and full.duration_s == 7200.0


def test_rate_scale_divides_arrivals_after_the_window(tmp_path: Path) -> None:
    path = str(_tiny_csv(tmp_path, WINDOW_ROWS))
    tr = load_trace(path, start="00:01", hours=1, rate_scale=2.0)
    np.testing.assert_array_equal(tr.arrival_s, [0.0, 0.5, 1799.75])
    np.testing.assert_array_equal(tr.input_tokens, [3, 4, 5])
    full = load_trace(path)
    slow = full.scale_rate(0.5)
    np.testing.assert_array_equal(slow.arrival_s, full.arrival_s * 2)
    assert slow.summary()["req_per_min"] == pytest.approx(full.summary()["req_per_min"] / 2)
    assert full.scale_rate(4.0).tokens_per_minute() == pytest.approx(
        4 * full.tokens_per_minute())


def test_match_tokens_per_minute(tmp_path: Path) -> None:
    ref = load_trace(str(_tiny_csv(tmp_path, TINY_ROWS, "ref.csv")))   # 1100 tokens / 90.5 s
    other = load_trace(str(_tiny_csv(tmp_path, [(0.0, 50, 5), (10.0, 40, 5)], "o.csv")))
    assert other.tokens_per_minute() == 100 * 60 / 10.0                # 600 tokens/min
    m = match_tokens_per_minute(other, ref)
    assert m.tokens_per_minute() == pytest.approx(ref.tokens_per_minute(), rel=1e-12)
    # factor = (1100/90.5)/(100/10): arrivals divided by it, lengths unchanged
    np.testing.assert_allclose(m.arrival_s, [0.0, 10.0 / ((1100 / 90.5) / 10.0)])
    np.testing.assert_array_equal(m.input_tokens, other.input_tokens)


# ------------------------------------------------------------------------------ synthesisers

def test_truncated_lognormal_fit_hand_checkable() -> None:
    # support [1, inf) with sigma 0.5 around mean 100: truncation is 9 sigma away, so
    # mu = ln(100) - sigma^2 / 2 as for a plain log-normal
    d = TruncatedLogNormal.fit(1, 100, math.inf, sigma=0.5)
    assert d.mu == pytest.approx(math.log(100) - 0.125, abs=1e-9)
    # default sigma: [min, max] is the central 99.8 % (+-3.09 sigma) of the untruncated law
    d = TruncatedLogNormal.fit(*TABLE4["lveval"].input_tokens)
    assert d.sigma == pytest.approx(math.log(431_000 / 8_800) / (2 * 3.0902323), rel=1e-6)
    assert d.mean() == pytest.approx(105_000, rel=1e-9)
    x = d.sample(10_000, np.random.default_rng(3))
    assert x.min() >= 8_800 and x.max() <= 431_000
    assert x.mean() == pytest.approx(105_000, rel=0.01)


@pytest.mark.parametrize("preset", ["lveval", "openthoughts"])
def test_table4_synthesisers(azure_day: Trace, preset: str) -> None:
    stats = TABLE4[preset]
    tr = load_trace(preset, seed=0)
    _assert_well_formed(tr)
    assert tr.note.startswith("SYNTHESISED") and "Table 4" in tr.note
    s = tr.summary()
    assert s["req_per_min"] == pytest.approx(stats.req_per_min, rel=0.005)
    assert len(tr) == round(stats.req_per_min * azure_day.duration_s / 60)
    for key, (lo, mean, hi) in (("input", stats.input_tokens), ("output", stats.output_tokens)):
        assert s[f"{key}_mean"] == pytest.approx(mean, rel=0.02)
        assert lo <= s[f"{key}_min"] and s[f"{key}_max"] <= hi
    assert np.all(np.isin(tr.arrival_s, azure_day.arrival_s))      # Azure's own timestamps
    again = load_trace(preset, seed=0)
    np.testing.assert_array_equal(again.arrival_s, tr.arrival_s)
    np.testing.assert_array_equal(again.input_tokens, tr.input_tokens)
    np.testing.assert_array_equal(again.output_tokens, tr.output_tokens)
    other = load_trace(preset, seed=1)
    assert not np.array_equal(other.input_tokens, tr.input_tokens)


def test_lveval_rate_is_tokens_per_minute_matched_to_azure(azure_day: Trace) -> None:
    # §5.1 scaled LVEval's rate to Azure's tokens/min: 41 req/min x ~105K tokens is ~Azure's
    lv = load_trace("lveval")
    assert lv.tokens_per_minute() == pytest.approx(azure_day.tokens_per_minute(), rel=0.03)
    m = match_tokens_per_minute(lv, azure_day)
    assert m.tokens_per_minute() == pytest.approx(azure_day.tokens_per_minute(), rel=1e-12)


def test_bursty_rates_and_lengths_inside_and_outside_the_burst() -> None:
    tr = load_trace("bursty", seed=0)
    _assert_well_formed(tr)
    assert tr.note.startswith("SYNTHESISED") and tr.duration_s < 7200
    # (window, req/min, mean input, mean output): 30 min calm, 45 min burst, 45 min calm
    for (a_s, b_s), rate, inp, out in (((0, 1800), 30, 2_000, 128),
                                       ((1800, 4500), 80, 100_000, 5_000),
                                       ((4500, 7200), 30, 2_000, 128)):
        seg = tr.slice(a_s, b_s)
        assert len(seg) * 60 / (b_s - a_s) == pytest.approx(rate, rel=0.1)   # Poisson count
        assert seg.input_tokens.mean() == pytest.approx(inp, rel=0.05)
        assert seg.output_tokens.mean() == pytest.approx(out, rel=0.05)
    again = synth_bursty(seed=0)
    np.testing.assert_array_equal(again.arrival_s, tr.arrival_s)
    np.testing.assert_array_equal(again.input_tokens, tr.input_tokens)
    short = synth_bursty(seed=2, calm_before_min=0, burst_min=10, calm_after_min=0)
    assert short.duration_s < 600 and short.input_tokens.mean() == pytest.approx(1e5, rel=0.1)


# ------------------------------------------------------------------------------- bad inputs

def test_presets_listed() -> None:
    assert set(PRESETS) == {"azure-code", "azure-code-2023", "azure-conv-2023", "mooncake",
                            "servegen-r1", "lveval", "openthoughts", "bursty"}
    assert all(d and "\n" not in d for d in PRESETS.values())


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(NeuScaleError, match=r"trace file not found: .*nope.csv"):
        load_trace(str(tmp_path / "nope.csv"))


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(NeuScaleError, match=r"unknown trace preset 'azure'") as e:
        load_trace("azure")
    assert all(name in str(e.value) for name in PRESETS)


@pytest.mark.parametrize("content, match", [
    ("a,b,c\n1,2,3\n", r"bad\.csv has an unknown header 'a,b,c'; known formats"),
    (SYNTH_HEADER + "\n0.5,10,2\n1.0,x,3\n", r"bad\.csv line 3: input_tokens 'x' is not an int"),
    (SYNTH_HEADER + "\n0.5,10,2\n1.0,4.5,3\n", r"line 3: input_tokens '4\.5' is not an integer"),
    (SYNTH_HEADER + "\n0.5,10,2\n1.0,3\n", r"line 3: expected 3 comma-separated fields"),
    (SYNTH_HEADER + "\n0.5,10,2\n\n1.0,0,3\n", r"line 4: input length is < 1"),
    (SYNTH_HEADER + "\n-1,10,2\n", r"line 2: arrival time is negative or not finite"),
    (SYNTH_HEADER + "\n", r"bad\.csv has no requests"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:1x:46,3,4\n",
     r"line 2: TIMESTAMP '2023-11-16 18:1x:46' is not an ISO datetime"),
])
def test_bad_csv_files(tmp_path: Path, content: str, match: str) -> None:
    with pytest.raises(NeuScaleError, match=match):
        load_trace(str(_write(tmp_path / "bad.csv", content)))


@pytest.mark.parametrize("content, match", [
    ('{"timestamp": 0, "input_length": 5, "output_length": 2}\nnope\n',
     r"line 2: not valid JSON"),
    ('{"timestamp": 0, "input_length": 5}\n', r"line 1: 'output_length' is missing"),
])
def test_bad_jsonl_files(tmp_path: Path, content: str, match: str) -> None:
    with pytest.raises(NeuScaleError, match=match):
        load_trace(str(_write(tmp_path / "bad.jsonl", content)))


def test_fake_gzip(tmp_path: Path) -> None:
    with pytest.raises(NeuScaleError, match=r"ends in .gz but is not gzip-compressed"):
        load_trace(str(_write(tmp_path / "x.csv.gz", SYNTH_HEADER + "\n0,1,1\n")))


@pytest.mark.parametrize("kwargs, match", [
    ({"start": "1:75"}, "start must be 'HH:MM'"),
    ({"hours": 0}, "hours must be a number > 0"),
    ({"rate_scale": -1.0}, "rate scale must be a finite number > 0"),
    ({"start": "05:00"}, "holds no requests"),
])
def test_bad_load_arguments(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(NeuScaleError, match=match):
        load_trace(str(_tiny_csv(tmp_path, TINY_ROWS)), **kwargs)  # type: ignore[arg-type]


def test_data_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUSCALE_DATA_DIR", str(tmp_path / "absent"))
    with pytest.raises(NeuScaleError, match=r"NEUSCALE_DATA_DIR=.*absent is not a directory"):
        load_trace("mooncake")
    monkeypatch.setenv("NEUSCALE_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path
    with pytest.raises(NeuScaleError, match=r"preset 'mooncake': data file .* not found"):
        load_trace("mooncake")
