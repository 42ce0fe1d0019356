"""The gateway against fault-injecting engines (tests/router/gateway_fakes.py): fail-over on
5xx, on a reset and on a stall (timeout), no vPod left, waiting for starting vPods and 503s,
a failing predictor, the controller's counters (take_samples, outstanding), /metrics,
/admin/status."""

import asyncio
import json
import time

import openai
import pytest

from router.gateway import Endpoint, Gateway
from router.routing import RoutingTable

from gateway_fakes import FakeEngine, LoopThread, direct_text, http, metric_sum

PROMPT = "tell me a story about a fox"


@pytest.fixture(scope="module")
def lt():
    loop = LoopThread()
    yield loop
    loop.close()


class Rig:
    """A gateway and fake engines on the loop thread."""

    def __init__(self, lt, **gw_kw):
        self.lt = lt
        self.gw = Gateway("m", max_context=8192, **gw_kw)
        self.url = lt.run(self.gw.start())
        self.engines: list[FakeEngine] = []
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0,
                                    timeout=20)

    def engine(self, vid, **kw) -> FakeEngine:
        e = FakeEngine(vid, **kw)
        self.lt.run(e.start())
        self.engines.append(e)
        return e

    def targets(self, decode: dict, prefill: dict | None = None, starting=(),
                table=None) -> None:
        tables = {"decode": table or RoutingTable.build({i: g for i, g in
                                                         enumerate(sorted(decode))})}
        eps = {("decode", g): [Endpoint(e.vpod_id, e.url) for e in lst]
               for g, lst in decode.items()}
        if prefill is not None:
            tables["prefill"] = RoutingTable.build({0: "P"})
            eps[("prefill", "P")] = [Endpoint(e.vpod_id, e.url) for e in prefill]
        self.lt.call(self.gw.set_targets, tables, eps, set(starting))

    def close(self):
        for e in self.engines:
            self.lt.run(e.kill())
        self.lt.run(self.gw.stop())


@pytest.fixture
def rig(lt):
    rigs = []

    def make(**kw):
        r = Rig(lt, **kw)
        rigs.append(r)
        return r
    yield make
    for r in rigs:
        r.close()


def stream_text(client, **kw):
    chunks = list(client.completions.create(model="m", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len({c.id for c in chunks}) == 1
    return text, chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices]


def metric(rig, name):
    _, _, text = rig.lt.run(http("GET", rig.url + "/metrics"))
    return metric_sum(text, name)


def test_5xx_fails_over_and_the_vpod_is_quarantined(rig):
    r = rig()
    bad, good = r.engine("bad", fail="500"), r.engine("good")
    r.targets({"A": [bad, good]})
    text, usage, fins = stream_text(r.client, max_tokens=30, seed=1,
                                    extra_body={"ignore_eos": True})
    assert text == direct_text(PROMPT, 1, 30) and usage.completion_tokens == 30
    assert fins[-1] == "length" and len(bad.bodies) == 1
    r.client.completions.create(model="m", prompt=PROMPT, max_tokens=5)
    assert len(bad.bodies) == 1                   # quarantined: the next one skips it
    assert metric(r, "neuscale_failovers_total") == 1
    assert metric(r, 'neuscale_errors_total{kind="upstream_status"}') == 1
    # the same for a prefill vPod (a non-streaming call)
    pbad, pgood = r.engine("pbad", fail="500"), r.engine("pgood")
    r.targets({"A": [good]}, prefill=[pbad, pgood])
    out = r.client.completions.create(model="m", prompt=PROMPT, max_tokens=12, seed=1,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].text == direct_text(PROMPT, 1, 12)
    assert len(pbad.bodies) == len(pgood.bodies) == 1
    assert good.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "pgood"


def drained(r, *vpods: str, timeout_s: float = 5.0) -> bool:
    """Every vPod's in-flight count is back to 0. The client has its last chunk before the
    handler's cleanup has run on the gateway's loop, so this waits (bounded) for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(r.lt.call(r.gw.outstanding, v) == 0 for v in vpods):
            return True
        time.sleep(0.02)
    return False


def test_reset_mid_stream_continues_on_another_vpod_with_the_same_text(rig):
    r = rig()
    flaky, good = r.engine("flaky", fail=("reset", 10)), r.engine("good")
    pre = r.engine("pre")
    r.targets({"A": [flaky, good]}, prefill=[pre])
    text, usage, fins = stream_text(r.client, max_tokens=40, seed=4,
                                    extra_body={"ignore_eos": True})
    assert text == direct_text(PROMPT, 4, 40)
    assert usage.completion_tokens == 40 and fins[-1] == "length"
    kv = good.bodies[-1]["kv_transfer_params"]
    assert kv["generated_tokens"] >= 10 and "do_remote_prefill" not in kv   # KV recomputed
    assert pre.bodies[0]["max_tokens"] == 1
    assert pre.bodies[0]["kv_transfer_params"] == {"do_remote_decode": True}
    assert flaky.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "pre"
    assert flaky.bodies[0]["kv_transfer_params"]["generated_tokens"] == 1
    assert drained(r, "flaky", "good")


def test_a_stalled_vpod_times_out_and_the_request_moves(rig):
    r = rig(upstream_timeout_s=0.3)
    stall, good = r.engine("stall", fail=("stall", 6)), r.engine("good")
    r.targets({"A": [stall, good]})
    out = r.client.completions.create(model="m", prompt=PROMPT, max_tokens=20, seed=2,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].text == direct_text(PROMPT, 2, 20)
    assert out.usage.completion_tokens == 20
    assert metric(r, 'neuscale_errors_total{kind="upstream_timeout"}') == 1


def test_when_no_vpod_is_left_the_client_gets_an_error_not_silence(rig):
    r = rig()
    only = r.engine("only", fail=("reset", 6))
    r.targets({"A": [only]})
    with pytest.raises(openai.APIError):
        stream_text(r.client, max_tokens=30, extra_body={"ignore_eos": True})
    with pytest.raises(openai.InternalServerError) as e:     # not streaming: 503 at once
        r.client.completions.create(model="m", prompt=PROMPT, max_tokens=30,
                                    extra_body={"ignore_eos": True})
    assert e.value.status_code == 503


def test_waits_for_a_starting_vpod_else_503_with_retry_after(rig, lt):
    r = rig(wait_for_vpod_s=5.0, retry_after_s=7)
    e = r.engine("late")
    r.targets({"A": []}, starting={("decode", "A")})
    body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 4}).encode()
    fut = asyncio.run_coroutine_threadsafe(
        http("POST", r.url + "/v1/completions", body, {"Content-Type": "application/json"}),
        lt.loop)
    for _ in range(200):                                # the request waits at the gateway
        if lt.call(lambda: r.gw._waiting.get(("decode", "A"), 0)) == 1:
            break
        lt.run(asyncio.sleep(0.01))
    s = lt.call(r.gw.take_samples)
    assert s.waiting == {("decode", "A"): 1} and s.requests == 1
    r.targets({"A": [e]})                               # the vPod is ready: the waiter goes
    status, _, out = fut.result(10)
    assert status == 200 and out["usage"]["completion_tokens"] == 4
    r.targets({"A": []})                                # nothing starting: 503 at once
    status, headers, out = lt.run(http("POST", r.url + "/v1/completions", body,
                                       {"Content-Type": "application/json"}))
    assert status == 503 and headers["Retry-After"] == "7"
    assert out["error"]["code"] == "no_vpod_available"
    r.gw.wait_for_vpod_s = 0.2                          # starting, but not in time: 503
    r.targets({"A": []}, starting={("decode", "A")})
    status, headers, _ = lt.run(http("POST", r.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"}))
    assert status == 503 and "Retry-After" in headers


def test_a_decode_request_whose_group_is_starting_runs_on_a_ready_group_that_holds_it(rig, lt):
    """The predicted length's group (L, the longer buckets) is still starting; the short
    group S is up and holds the request's tokens so far: the request starts on S at once
    instead of waiting for L (routing.ready_group), and stays there while L has nothing up."""
    r = rig(wait_for_vpod_s=30.0)
    s_eng = r.engine("s1", per_tick=50)
    table = RoutingTable.build({0: "S", 11: "L"})      # S: up to 128 tokens, L: up to 2048
    assert table.group_for_length(8 + 800) == "L"
    r.targets({"S": [s_eng], "L": []}, starting={("decode", "L")}, table=table)
    out = r.client.completions.create(model="m", prompt=PROMPT, max_tokens=800,
                                      extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 800
    assert len(s_eng.bodies) >= 1
    assert lt.call(lambda: r.gw._waiting.get(("decode", "L"), 0)) == 0
    # nothing up that holds it (S too short for a 300-token prompt): it waits for L as before
    r.gw.wait_for_vpod_s = 0.2
    long_prompt = " ".join(["fox"] * 300)
    with pytest.raises(openai.InternalServerError):
        r.client.completions.create(model="m", prompt=long_prompt, max_tokens=800,
                                    extra_body={"ignore_eos": True})


def test_a_decode_request_goes_to_a_vpod_with_a_free_slot(rig, lt):
    """Two decode vPods of 2 slots: b holds one long answer, a two short ones (full). The
    least load (work in seconds plus the share of slots held) picks a; the gateway sends the
    next answer to b, which has a slot free (routing.free_slot_first) - it waits only when
    every vPod of the group is full, the queue the load-aware policy sizes decode by."""
    import threading

    r = rig()
    a = r.engine("a", tick_s=0.05, per_tick=1)     # slow: its short answers stay in flight
    b = r.engine("b", tick_s=0.005, per_tick=2)
    eps = {("decode", "A"): [Endpoint("b", b.url, max_batch=2), Endpoint("a", a.url,
                                                                          max_batch=2)]}
    lt.call(r.gw.set_targets, {"decode": RoutingTable.build({0: "A"})}, eps, set())

    def ask(n):
        r.client.completions.create(model="m", prompt=PROMPT, max_tokens=n,
                                    extra_body={"ignore_eos": True})

    def until(cond):
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < 10
            time.sleep(0.01)

    threads = [threading.Thread(target=ask, args=(2000,))]
    threads[0].start()
    until(lambda: b.running == 1)                   # ties: the first endpoint
    for _ in range(2):
        threads.append(threading.Thread(target=ask, args=(100,)))   # ~5 s each on a
        threads[-1].start()
    until(lambda: a.running == 2)
    ep_a, ep_b = eps[("decode", "A")][1], eps[("decode", "A")][0]
    assert lt.call(r.gw._load_of, ep_a) < lt.call(r.gw._load_of, ep_b)   # a looks lighter
    ask(50)
    assert len(b.bodies) == 2 and len(a.bodies) == 2
    for t in threads:
        t.join()


class Broken:
    def predict(self, prompt, prompt_tokens):
        raise RuntimeError("model not loaded")

    def repredict(self, prompt, prompt_tokens, generated):
        return float("nan")

    def observe(self, prompt_tokens, output_tokens):
        raise RuntimeError("read-only")


class Slow:
    """An asynchronous predictor (awaited by the gateway)."""

    async def predict(self, prompt, prompt_tokens):
        await asyncio.sleep(0.01)
        return 3000

    async def repredict(self, prompt, prompt_tokens, generated):
        return 3000

    def observe(self, prompt_tokens, output_tokens):
        pass


def test_predictor_fallbacks_samples_and_status(rig, lt):
    r = rig(predictor=Broken())
    a, b = r.engine("a"), r.engine("b")
    pre = r.engine("pre")
    r.targets({"A": [a], "B": [b]}, prefill=[pre],
              table=RoutingTable.build({0: "A", 12: "B"}))      # A: <= 128 tokens
    out = r.client.completions.create(model="m", prompt=PROMPT, max_tokens=200, seed=9)
    assert out.usage.completion_tokens >= 20
    assert metric(r, "neuscale_predictor_fallbacks_total") >= 1
    s = lt.call(r.gw.take_samples)
    p = out.usage.prompt_tokens
    assert s.tokens["prefill"][0] == p and s.tokens["prefill"].sum() == p
    assert s.tokens["decode"][1] == 128          # the default's prior: bucket of p + 128
    assert s.requests == 1 and s.interval_s > 0
    assert lt.call(r.gw.take_samples).tokens["decode"].sum() == 0
    status, _, st = lt.run(http("GET", r.url + "/admin/status"))
    assert status == 200 and st["gateway"]["groups"]["decode/A"] == ["a"]
    r.gw.status_provider = lambda: {"controller": {"epoch": 3}}
    assert lt.run(http("GET", r.url + "/admin/status"))[2]["controller"] == {"epoch": 3}

    r2 = rig(predictor=Slow())                       # predicts long: routed to B
    a2, b2 = r2.engine("a2"), r2.engine("b2")
    r2.targets({"A": [a2], "B": [b2]}, table=RoutingTable.build({0: "A", 12: "B"}))
    r2.client.completions.create(model="m", prompt=PROMPT, max_tokens=5000, seed=9)
    assert len(b2.bodies) == 1 and not a2.bodies
    assert metric(r2, 'neuscale_routed_total{group="B",phase="decode"}') == 1


def test_an_engine_400_passes_through_before_any_output(rig):
    r = rig()
    small = r.engine("small", max_model_len=100)
    r.targets({"A": [small]})
    with pytest.raises(openai.BadRequestError) as e:
        r.client.completions.create(model="m", prompt=PROMPT, max_tokens=200)
    assert e.value.code == "context_length_exceeded"


def test_client_disconnect_cancels_the_upstream_request(rig, lt):
    r = rig()
    e = r.engine("slow", tick_s=0.05, per_tick=1)
    r.targets({"A": [e]})
    s = r.client.completions.create(model="m", prompt=PROMPT, max_tokens=500, stream=True,
                                    extra_body={"ignore_eos": True})
    it = iter(s)
    next(it)
    next(it)
    assert e.running == 1 and r.gw.outstanding("slow") == 1
    s.close()
    for _ in range(100):
        if e.running == 0:
            break
        lt.run(asyncio.sleep(0.02))
    assert e.running == 0 and e.aborted == 1 and r.gw.outstanding("slow") == 0
    assert metric(r, 'neuscale_errors_total{kind="client_disconnect"}') == 1


def test_disconnect_is_noticed_without_handler_cancellation(lt):
    """The lead may run the app under a runner of his own: the next upstream chunk tells."""
    from aiohttp import web
    gw = Gateway("m")
    e = FakeEngine("slow", tick_s=0.03, per_tick=1)

    async def up():
        await e.start()
        runner = web.AppRunner(gw.app(), handler_cancellation=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
    runner, url = lt.run(up())
    lt.call(gw.set_targets, {"decode": RoutingTable.build({0: "A"})},
            {("decode", "A"): [Endpoint("slow", e.url)]})
    c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=0.3)
    for stream in (True, False):
        if stream:
            s = c.completions.create(model="m", prompt=PROMPT, max_tokens=500, stream=True,
                                     extra_body={"ignore_eos": True})
            next(iter(s))
            s.close()
        else:
            with pytest.raises(openai.APITimeoutError):
                c.completions.create(model="m", prompt=PROMPT, max_tokens=500,
                                     extra_body={"ignore_eos": True})
        for _ in range(100):
            if e.running == 0:
                break
            lt.run(asyncio.sleep(0.02))
        assert e.running == 0 and gw.outstanding("slow") == 0
    assert e.aborted == 2
    lt.run(e.kill())
    lt.run(runner.cleanup())


def test_fails_over_to_the_longer_group_when_its_own_has_no_vpod_left(rig):
    r = rig()
    bad, good = r.engine("bad", fail=("reset", 4)), r.engine("good")
    r.targets({"A": [bad], "B": [good]}, table=RoutingTable.build({0: "A", 12: "B"}))
    text, usage, _ = stream_text(r.client, max_tokens=30, seed=8,
                                 extra_body={"ignore_eos": True})
    assert text == direct_text(PROMPT, 8, 30) and usage.completion_tokens == 30
    assert len(good.bodies) == 1
    assert metric(r, 'neuscale_routed_total{group="B",phase="decode"}') == 1
    assert metric(r, "neuscale_tpot_seconds_count") == 1
    assert metric(r, "neuscale_e2e_seconds_count") == 1


def test_the_largest_bucket_bounds_a_request_too(lt):
    gw = Gateway("m", (128, 256, 512), max_context=8192)
    url = lt.run(gw.start())
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="m", prompt=PROMPT, max_tokens=510)
        assert e.value.code == "context_length_exceeded" and "512" in e.value.message
        with pytest.raises(openai.InternalServerError) as e:   # fits, but no routing yet
            c.completions.create(model="m", prompt=PROMPT, max_tokens=10)
        assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "5"
        m = c.models.list().data[0]
        assert m.id == "m" and m.max_model_len == 512
    finally:
        lt.run(gw.stop())


def test_stand_alone_command_builds_its_gateway(tmp_path, monkeypatch):
    from router.gateway import _parser, gateway_from_args
    from dse import NeuScaleError
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setenv("GW_KEY", "k1")
    args = _parser().parse_args(["--model", "m", "--decode", "http://127.0.0.1:1/",
                                 "--prefill", "http://127.0.0.1:2", "--tokenizer",
                                 str(tmp_path), "--api-key-env", "GW_KEY"])
    gw = gateway_from_args(args)
    assert gw._count("a a b") == 3 and gw._api_key == b"k1"
    assert set(gw._targets.tables) == {"prefill", "decode"}
    assert gw._targets.endpoints[("decode", "decode")][0].url == "http://127.0.0.1:1"
    monkeypatch.delenv("GW_KEY")
    with pytest.raises(NeuScaleError, match="GW_KEY"):
        gateway_from_args(args)


def test_a_bug_still_answers_500_or_an_error_event(rig):
    r = rig()
    e = r.engine("e")
    r.targets({"A": [e]})

    async def boom(*a):
        raise RuntimeError("bug")
    r.gw._check_boundary = boom
    with pytest.raises(openai.InternalServerError):
        r.client.completions.create(model="m", prompt=PROMPT, max_tokens=30,
                                    extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError, match="server had an error"):
        stream_text(r.client, max_tokens=30, extra_body={"ignore_eos": True})
    assert metric(r, 'neuscale_errors_total{kind="internal"}') == 2
    assert drained(r, "e")


def test_text_continuation_for_engines_without_a_kv_connector(rig):
    """continuation="text" (real vLLM without a KV connector ignores kv_transfer_params): the
    decode call after the prefill, and the call after a fail-over, carry the prompt plus the
    text so far and the rest of the budget; the client sees every token once and the usage is
    summed across the calls."""
    r = rig(continuation="text")
    p = r.engine("p")
    d = r.engine("d")
    r.targets({"A": [d]}, prefill=[p])
    out = r.client.completions.create(model="m", prompt=PROMPT, max_tokens=12, seed=3,
                                      extra_body={"ignore_eos": True})
    first = direct_text(PROMPT, 3, 1)
    assert "kv_transfer_params" not in p.bodies[-1] and "kv_transfer_params" not in d.bodies[-1]
    assert d.bodies[-1]["prompt"] == PROMPT + first and d.bodies[-1]["max_tokens"] == 11
    assert out.choices[0].text == first + direct_text(PROMPT + first, 3, 11)
    assert out.usage.completion_tokens == 12
    # a decode vPod that breaks after 4 tokens: the next one continues from the text so far
    bad = r.engine("bad", fail=("reset", 4))
    good = r.engine("good")
    r.targets({"A": [bad, good]})
    text, usage, fins = stream_text(r.client, max_tokens=20, seed=5,
                                    extra_body={"ignore_eos": True})
    assert usage.completion_tokens == 20 and fins[-1] == "length"
    assert len(bad.bodies) == 1                      # the tie goes to the first vPod
    sent = direct_text(PROMPT, 5, 4)
    assert good.bodies[-1]["prompt"] == PROMPT + sent
    assert good.bodies[-1]["max_tokens"] == 16
    assert text == sent + direct_text(PROMPT + sent, 5, 16)
    # chat: the partial answer goes back as a final assistant message to continue
    r.targets({"A": [d]}, prefill=[p])
    r.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=6, extra_body={"ignore_eos": True})
    body = d.bodies[-1]
    assert body["messages"][-1]["role"] == "assistant" and body["messages"][-1]["content"]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
