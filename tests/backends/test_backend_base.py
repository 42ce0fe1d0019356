"""The backend interface's values and retry rule (backends/base.py)."""
from __future__ import annotations

import asyncio
import random

import pytest

from backends.base import (BackendError, ConfigError, QuotaError, TransientError, VPodInfo,
                           VPodSpec, with_retries)
from dse.vpod import VPodState


def spec(**kw) -> VPodSpec:
    d = dict(id="c-d0001-ab12", group="g1024", phase="decode", model="llama3-8b", chip="v6e",
             topology="1x1", num_chips=1, tp=1, pp=1, ep=1, max_batch=64, max_model_len=8192,
             labels={"neuscale-cluster": "c", "neuscale-phase": "decode"})
    d.update(kw)
    return VPodSpec(**d)


def test_spec_and_info_round_trip_through_json():
    s = spec()
    assert VPodSpec.from_json(s.to_json()) == s
    assert hash(VPodSpec.from_json(s.to_json())) == hash(s)
    info = VPodInfo(s, VPodState.READY, "http://127.0.0.1:1234", 1.0, 2.5, "ok")
    assert VPodInfo.from_json(info.to_json()) == info
    assert s.matches({"neuscale-cluster": "c"}) and not s.matches({"neuscale-cluster": "d"})
    assert s.matches({})


@pytest.mark.parametrize("bad, word", [
    (dict(tp=2), "tp*pp*ep"), (dict(phase="mixed"), "phase"), (dict(id="-x"), "id"),
    (dict(max_batch=0), "max_batch"), (dict(max_model_len=1), "max_model_len"),
    (dict(labels={"bad key!": "x"}), "label key")])
def test_spec_problems_name_the_field(bad, word):
    probs = spec(**bad).problems()
    assert probs and any(word in p for p in probs), probs
    assert spec().problems() == []


@pytest.mark.parametrize("body, word", [
    ([], "object"), ({"id": "x"}, "missing field 'group'"),
    ({**spec().to_json(), "tp": "1"}, "'tp' must be int"),
    ({**spec().to_json(), "tp": True}, "'tp' must be int"),
    ({**spec().to_json(), "labels": {"a": 1}}, "labels")])
def test_spec_from_bad_json_is_a_config_error(body, word):
    with pytest.raises(ConfigError, match=word):
        VPodSpec.from_json(body)


def test_malformed_info_is_transient():
    with pytest.raises(TransientError):
        VPodInfo.from_json({"spec": spec().to_json(), "state": "bogus", "created_s": 0})


def test_quota_error_names_the_chip_and_errors_are_backend_errors():
    e = QuotaError("no room", chip="v6e")
    assert e.chip == "v6e"
    for cls in (TransientError, QuotaError, ConfigError):
        assert issubclass(cls, BackendError)


def test_with_retries_backs_off_exponentially_with_full_jitter():
    sleeps: list[float] = []
    calls = 0

    async def sleep(s):
        sleeps.append(s)

    async def flaky():
        nonlocal calls
        calls += 1
        if calls < 4:
            raise TransientError("busy")
        return "done"

    class Top(random.Random):          # jitter at its top: the cap of each backoff
        def uniform(self, a, b):
            return b

    got = asyncio.run(with_retries(flaky, attempts=5, base_s=0.5, max_s=1.5, sleep=sleep,
                                   rng=Top()))
    assert got == "done" and calls == 4
    assert sleeps == [0.5, 1.0, 1.5]           # 0.5 * 2**i, capped at max_s

    rng = random.Random(7)
    sleeps.clear()
    calls = 0
    asyncio.run(with_retries(flaky, attempts=5, base_s=0.5, sleep=sleep, rng=rng))
    assert len(sleeps) == 3 and all(0 <= s <= 0.5 * 2 ** i for i, s in enumerate(sleeps))
    assert len(set(sleeps)) == 3                # jittered, not the same delay each time


def test_with_retries_gives_up_and_never_retries_other_errors():
    calls = 0

    async def sleep(s):
        pass

    async def always(exc):
        nonlocal calls
        calls += 1
        raise exc

    with pytest.raises(TransientError):
        asyncio.run(with_retries(lambda: always(TransientError("x")), attempts=3, sleep=sleep))
    assert calls == 3
    for exc in (QuotaError("q", "v6e"), ConfigError("c"), ValueError("v")):
        calls = 0
        with pytest.raises(type(exc)):
            asyncio.run(with_retries(lambda: always(exc), attempts=3, sleep=sleep))
        assert calls == 1
