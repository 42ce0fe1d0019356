"""The gateway in front of the REAL simulated engine servers (backends.sim.engine_server) on
127.0.0.1, driven by the official ``openai`` client: chat and completions, streaming and not,
usage; P/D hand-off; short and long requests in different groups; a forced migration; an engine
killed mid-stream; bad input; the API key; client disconnects.

The engines simulate a tiny Llama (2 layers, 512 wide) on one v6e chip so that a few hundred
tokens take well under a second of wall clock; everything else is the production code path."""

import asyncio
import json
import logging
import re
import time

import openai
import pytest

from dse.buckets import SEQ_BUCKETS
from dse.catalog import default_catalog
from dse.models import load_model
from dse.tokens import count_tokens
from router.gateway import Endpoint, Gateway
from router.routing import RoutingTable

from backends.sim import engine_server
from gateway_fakes import LoopThread, http, metric_sum

MODEL = "tiny"
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}
PROMPT = "Write a short story about a fox who learns to sail across the northern sea."
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def lt():
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    arch = load_model(str(path))
    table = engine_server.step_cost_table(arch, default_catalog(), "v6e", "1x1", 1)
    return arch, table


class Rig:
    """Engine servers (one per vPod) and a gateway on the loop thread."""

    def __init__(self, lt, sim, **gw_kw):
        self.lt, self.sim = lt, sim
        self.servers: dict[str, engine_server.EngineServer] = {}
        gw_kw.setdefault("upstream_timeout_s", 10.0)
        self.gw = Gateway(MODEL, SEQ_BUCKETS, 8192, **gw_kw)
        self.url = lt.run(self.gw.start())
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=gw_kw.get("api_key")
                                    or "none", max_retries=0, timeout=30)

    def server(self, vid: str, phase: str = "decode") -> engine_server.EngineServer:
        arch, table = self.sim
        s = engine_server.EngineServer(served_model=MODEL, arch=arch, table=table, phase=phase,
                                       max_batch=64, max_model_len=8192, vpod_id=vid)
        self.lt.run(s.start())
        self.servers[vid] = s
        return s

    def targets(self, decode_table: RoutingTable, decode: dict[str, list[str]],
                prefill: list[str] | None = None) -> None:
        tables = {"decode": decode_table}
        eps = {("decode", g): [Endpoint(v, self.servers[v].url) for v in vs]
               for g, vs in decode.items()}
        if prefill:
            tables["prefill"] = RoutingTable.build({0: "P"})
            eps[("prefill", "P")] = [Endpoint(v, self.servers[v].url) for v in prefill]
        self.lt.call(self.gw.set_targets, tables, eps)

    def direct(self, vid: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.servers[vid].url + "/v1", api_key="none",
                             max_retries=0, timeout=30)

    def metric(self, name: str, url: str | None = None) -> float:
        _, _, text = self.lt.run(http("GET", (url or self.url) + "/metrics"))
        return metric_sum(text, name)

    def close(self) -> None:
        self.lt.run(self.gw.stop())
        for s in self.servers.values():
            if not s.dead:
                self.lt.run(s.stop())


@pytest.fixture
def rig(lt, sim):
    made = []

    def make(**kw):
        r = Rig(lt, sim, **kw)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


# S serves up to 768 tokens (best-fit 512), L the rest (best-fit 1536)
TWO_GROUPS = RoutingTable.build({3: "S", 9: "L"})


@pytest.fixture
def pd(rig):
    """P/D: one prefill vPod, decode groups S (two vPods) and L (one)."""
    r = rig()
    for v in ("s0", "s1", "l0"):
        r.server(v)
    r.server("p0", "prefill")
    r.targets(TWO_GROUPS, {"S": ["s0", "s1"], "L": ["l0"]}, prefill=["p0"])
    return r


def test_chat_and_completions_streaming_and_not_match_the_engine(pd):
    ref = pd.direct("l0")           # a plain request on one vPod (no P/D): the reference
    want = ref.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, seed=7)
    got = pd.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, seed=7)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage == want.usage and got.usage.prompt_tokens == count_tokens(PROMPT)
    assert got.id.startswith("cmpl-") and got.model == MODEL

    chunks = list(pd.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60,
                                               seed=7, stream=True,
                                               stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != got.id
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == want.usage
    assert all(c.usage is None for c in chunks[:-1])    # usage only where asked

    cwant = ref.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, seed=3)
    cgot = pd.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, seed=3)
    assert cgot.choices[0].message.content == cwant.choices[0].message.content
    assert cgot.choices[0].message.role == "assistant" and cgot.usage == cwant.usage
    cchunks = list(pd.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, seed=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert cchunks[0].choices[0].delta.role == "assistant"
    assert sum(c.choices[0].delta.role == "assistant" for c in cchunks if c.choices) == 1
    assert "".join(c.choices[0].delta.content or "" for c in cchunks if c.choices) == \
        cwant.choices[0].message.content
    counts = [c.usage.completion_tokens for c in cchunks]      # continuous usage, as asked
    assert counts == sorted(counts) and cchunks[-1].usage == cwant.usage
    assert [c.choices[0].finish_reason for c in cchunks if c.choices][-1] == \
        cwant.choices[0].finish_reason
    # every request was prefilled on p0 and decoded in S
    assert pd.metric('neuscale_routed_total{group="P",phase="prefill"}') == 4
    assert pd.metric('neuscale_routed_total{group="S",phase="decode"}') == 4
    assert pd.metric("vllm:prompt_tokens_total", pd.servers["p0"].url) > 0
    assert pd.metric("neuscale_ttft_seconds_count") == 4
    # nothing left in flight (the last chunk reaches the client before the handler's cleanup
    # runs on the gateway's loop: wait for it, bounded)
    for _ in range(250):
        if pd.lt.call(lambda: pd.gw.outstanding("s0") + pd.gw.outstanding("p0")) == 0:
            break
        time.sleep(0.02)
    assert pd.lt.call(lambda: pd.gw.outstanding("s0") + pd.gw.outstanding("p0")) == 0


def test_short_and_long_requests_land_in_different_groups(pd):
    long_prompt = " ".join(["the river runs by the old stone field"] * 100)   # 900 tokens
    assert count_tokens(long_prompt) > 768
    pd.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    out = pd.client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=8)
    assert out.usage.prompt_tokens == count_tokens(long_prompt)
    pd.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=900,
                                 extra_body={"ignore_eos": True})   # long by its output
    assert pd.metric('neuscale_routed_total{group="S",phase="decode"}') == 1
    assert pd.metric('neuscale_routed_total{group="L",phase="decode"}') == 2
    gen = {v: pd.metric("vllm:generation_tokens_total", pd.servers[v].url)
           for v in ("s0", "s1", "l0")}
    assert gen["s0"] + gen["s1"] == 7 and gen["l0"] == 7 + 899
    s = pd.lt.call(pd.gw.take_samples)
    assert s.requests == 3 and s.tokens["prefill"].sum() == 2 * count_tokens(PROMPT) + \
        count_tokens(long_prompt)
    assert s.tokens["decode"][pd.gw._bucket(count_tokens(PROMPT) + 900)] == 900
    # how long a request stayed on each decode group (from its first token to its last: how
    # long the group's vPods take to drain), for the controller's observation window
    assert set(s.longest_s) == {("decode", "S"), ("decode", "L")}
    assert s.longest_s[("decode", "L")] > s.longest_s[("decode", "S")] > 0
    # and, per decode bucket the load was counted at, the requests' stays (how long a slot is
    # held: the controller averages a bucket's load over it)
    long_b = pd.gw._bucket(count_tokens(PROMPT) + 900)
    dec = {b: v for (ph, b), v in s.stay_s.items() if ph == "decode"}
    pre = {b: v for (ph, b), v in s.stay_s.items() if ph == "prefill"}
    assert sum(n for _, n in dec.values()) == 3 and dec[long_b][1] == 1
    assert dec[long_b][0] == pytest.approx(s.longest_s[("decode", "L")])
    # each prefill call's time, at the prompt's bucket
    assert pre[pd.gw._bucket(count_tokens(PROMPT))][1] == 2
    assert pre[pd.gw._bucket(count_tokens(long_prompt))][1] == 1
    assert all(x > 0 for x, _ in s.stay_s.values())
    again = pd.lt.call(pd.gw.take_samples)
    assert again.longest_s == {} and again.stay_s == {}     # reset with the sample


def test_forced_migration_is_one_uninterrupted_stream(rig):
    r = rig()
    for v in ("a0", "b0", "ref"):
        r.server(v)
    # group A serves everything up to 1024 tokens but its best-fit length is tiny (16): a
    # stream passing 128 tokens (the first bucket boundary) is beyond 2 x 16 and moves to B
    tiny_a = RoutingTable(SEQ_BUCKETS, ("A",) * 8 + ("B",) * (len(SEQ_BUCKETS) - 8),
                          {"A": 16, "B": SEQ_BUCKETS[-1]})
    r.targets(tiny_a, {"A": ["a0"], "B": ["b0"]})
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=300, seed=11,
              extra_body={"ignore_eos": True})
    want = r.direct("ref").completions.create(**kw)
    chunks = list(r.client.completions.create(stream=True, stream_options={
        "include_usage": True}, **kw))
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    assert chunks[-1].usage == want.usage and want.usage.completion_tokens == 300
    assert [c.choices[0].finish_reason for c in chunks if c.choices].count("length") == 1
    assert r.metric("neuscale_migrations_total") == 1
    # a0 made the first part (then its request was cancelled), b0 the rest from there on
    assert r.metric('vllm:request_success_total{finished_reason="abort"}',
                    r.servers["a0"].url) == 1
    rest = r.metric("vllm:generation_tokens_total", r.servers["b0"].url)
    assert 0 < rest <= 300 - (128 - count_tokens(PROMPT))
    # a non-streaming chat request migrates the same way
    cw = r.direct("ref").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200,
                                                 seed=5, extra_body={"ignore_eos": True})
    cg = r.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, seed=5,
                                          extra_body={"ignore_eos": True})
    assert cg.choices[0].message.content == cw.choices[0].message.content
    assert cg.usage == cw.usage and r.metric("neuscale_migrations_total") == 2


def test_an_engine_killed_mid_stream_and_the_request_completes_elsewhere(rig, lt):
    r = rig()
    for v in ("s0", "s1", "ref"):
        r.server(v)
    r.server("p0", "prefill")
    r.targets(RoutingTable.build({0: "S"}), {"S": ["s0", "s1"]}, prefill=["p0"])
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=400, seed=2,
              extra_body={"ignore_eos": True})
    want = r.direct("ref").completions.create(**kw).choices[0].text
    stream = r.client.completions.create(stream=True, stream_options={"include_usage": True},
                                         **kw)
    it = iter(stream)
    got = [next(it).choices[0].text for _ in range(4)]     # the first token + 3 decode chunks
    victim = next(v for v in ("s0", "s1") if lt.call(r.gw.outstanding, v))
    lt.call(r.servers[victim].kill)
    rest = list(it)
    got += [c.choices[0].text for c in rest if c.choices]
    assert "".join(got) == want
    assert rest[-1].usage.completion_tokens == 400
    assert r.metric("neuscale_failovers_total") == 1
    assert r.metric('neuscale_errors_total{kind="upstream_broken"}') == 1
    survivor = "s1" if victim == "s0" else "s0"
    assert r.metric("vllm:generation_tokens_total", r.servers[survivor].url) > 0


def test_bad_input_gets_its_4xx(pd, lt):
    c = pd.client
    post = lambda path, body: lt.run(http(       # noqa: E731
        "POST", pd.url + path, body if isinstance(body, bytes) else json.dumps(body).encode(),
        {"Content-Type": "application/json"}))
    status, _, out = post("/v1/completions", b"{oops")
    assert status == 400 and out["error"]["type"] == "invalid_request_error"
    status, _, out = post("/v1/chat/completions", {"model": MODEL})
    assert status == 400 and out["error"]["param"] == "messages"
    for kw, param in ((dict(max_tokens=0), "max_tokens"), (dict(n=2), "n"),
                      (dict(temperature=5), "temperature"),
                      (dict(extra_body={"max_tokens": "ten"}), "max_tokens"),
                      (dict(stop=[1, 2]), "stop"),
                      (dict(stream_options={"include_usage": True}), "stream_options")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt=PROMPT, **kw)
        assert e.value.status_code == 400 and e.value.param == param, kw
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=4)
    assert e.value.code == "model_not_found"
    huge = "word " * 9000
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": huge}])
    assert e.value.code == "context_length_exceeded" and "8192" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8190)
    assert e.value.code == "context_length_exceeded"
    ok = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                              extra_body={"frobnicate": True, "user": "x"})   # ignored
    assert ok.usage.completion_tokens == 3
    assert pd.metric('neuscale_requests_total{endpoint="completions",status="400"}') == 8
    assert pd.metric('neuscale_errors_total{kind="context_length"}') == 2
    # nothing reached an engine but the one good request
    assert pd.metric("vllm:request_success_total", pd.servers["p0"].url) == 1


def test_api_key_is_required_and_never_logged(rig, lt, caplog):
    caplog.set_level(logging.DEBUG)
    r = rig(api_key="s3cret-key")
    r.server("d0")
    r.targets(RoutingTable.build({0: "S"}), {"S": ["d0"]})
    bad = openai.OpenAI(base_url=r.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    status, _, out = lt.run(http("POST", r.url + "/v1/completions",
                                 json.dumps({"model": MODEL, "prompt": "x"}).encode()))
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    assert lt.run(http("GET", r.url + "/v1/models"))[0] == 401
    assert lt.run(http("GET", r.url + "/health"))[0] == 200       # no key needed
    assert r.client.completions.create(model=MODEL, prompt=PROMPT,
                                       max_tokens=2).usage.completion_tokens == 2
    models = r.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    # without P/D: the decode vPod's own role chunk opens the stream
    want = r.direct("d0").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30,
                                                  seed=1)
    chunks = list(r.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30,
                                                   seed=1, stream=True))
    assert [c.choices[0].delta.role for c in chunks][:2] == ["assistant", None]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        want.choices[0].message.content
    assert "s3cret-key" not in caplog.text


def test_client_disconnect_cancels_the_upstream_request(rig, lt):
    r = rig()
    d = r.server("d0")
    r.targets(RoutingTable.build({0: "S"}), {"S": ["d0"]})
    stream = r.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5000,
                                         stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    next(it)
    assert lt.call(r.gw.outstanding, "d0") == 1
    assert r.metric("vllm:num_requests_running", d.url) == 1
    stream.close()
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    for _ in range(100):
        if r.metric(aborted, d.url) == 1:
            break
        lt.run(asyncio.sleep(0.02))
    assert r.metric(aborted, d.url) == 1                      # the engine saw the cancel
    assert lt.call(r.gw.outstanding, "d0") == 0
    assert r.metric('neuscale_errors_total{kind="client_disconnect"}') == 1
    assert re.search(r'neuscale_requests_total\{endpoint="completions",status="499"\} 1',
                     lt.run(http("GET", r.url + "/metrics"))[2])
