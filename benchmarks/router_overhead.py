"""What the NeuScale gateway adds on the request path, against calling an engine directly and
against vllm-router (vLLM's Rust router) in front of the same engines, in one run.

Issue targets: at concurrency 1, <= 1 ms p50 and <= 5 ms p99 added over a direct call (the
paper's prototype routes in 45.9 ms, Table 3); at 100 concurrent streams, at least half of
vllm-router's requests/s.

Set-up, all on 127.0.0.1, every server its own process (the load generator here is one asyncio
process with aiohttp keep-alive connections):

* 2 simulated vLLM engine servers (``python -m backends.sim.engine_server``; llama3-8b on one
  v6e chip, tp1, ``--max-num-seqs 1024``: a small step latency and room for 1000 streams);
* the NeuScale gateway (``router.gateway.Gateway``) in mixed mode - a "decode" routing table
  only, one group holding both engines, so each request goes whole to the least-loaded engine -
  started by this script re-invoking itself (``--serve-gateway``);
* ``vllm-router --worker-urls E1 E2 --policy round_robin`` (``--vllm-router-policy``).

Requests: ``/v1/completions``, 5-word prompts, ``max_tokens`` 4, ``ignore_eos``.

1. Latency at concurrency 1, non-streaming: warm-up, then rounds of one request per target
   (direct, gateway, vllm-router; the order rotates per round, direct calls alternate between
   the two engines). p50/p99 per target; added = router's percentile - direct's.
2. Requests/s with C = 1, 100, 1000 concurrent clients (each sends its next streaming request
   when [DONE] arrives; a request counts when its [DONE] arrives inside the measured window),
   for a fixed duration after a ramp-up, against: one engine directly (the baseline), both
   engines directly (client-side round robin: what a free router would give), the gateway and
   vllm-router. Printed as req/s and as ratios to the one-engine baseline, with the CPU time
   each router process spent per request.

Every process shares this machine's cores (the engines' Python and the load generator's too),
so a router that burns CPU also slows the engines: read requests/s as the whole system's.

    python benchmarks/router_overhead.py            # ~2.7 min
    python benchmarks/router_overhead.py --quick    # ~1 min: fewer requests, shorter windows
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "llama3-8b"
HEADERS = {"Content-Type": "application/json"}


# ---- the gateway's own process (this script re-invoked with --serve-gateway) --------------------

async def serve_gateway(engines: list[str], url_file: Path, model: str, max_batch: int) -> None:
    """A Gateway in front of ``engines``: one decode group, no prefill table (mixed mode)."""
    import logging

    from dse.buckets import SEQ_BUCKETS
    from dse.files import write_atomic
    from router.gateway import Endpoint, Gateway
    from router.routing import RoutingTable

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    gw = Gateway(model, SEQ_BUCKETS, max_context=8192)
    # one group serves every bucket (sized for the longest: never a migration target)
    table = RoutingTable.build({len(SEQ_BUCKETS) - 1: "all"}, SEQ_BUCKETS)
    gw.set_targets({"decode": table},
                   {("decode", "all"): [Endpoint(f"engine-{i}", u, max_batch=max_batch)
                                        for i, u in enumerate(engines)]})
    url = await gw.start("127.0.0.1", 0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    write_atomic(url_file, url + "\n")
    await stop.wait()
    await gw.stop()


# ---- child processes -----------------------------------------------------------------------------

class Children:
    """The servers this run started; :meth:`close` stops them all (SIGTERM, then SIGKILL)."""

    def __init__(self, workdir: Path):
        self.dir = workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        with open(self.dir / f"{name}.log", "wb") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        self.procs.append((name, p))
        return p

    def log_tail(self, name: str, n: int = 20) -> str:
        try:
            lines = (self.dir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def fail(self, name: str, why: str) -> None:
        raise RuntimeError(f"{name}: {why}\n--- last lines of its log ---\n{self.log_tail(name)}")

    def close(self) -> None:
        live = [(n, p) for n, p in self.procs if p.poll() is None]
        for _, p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        for _, p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_file(ch: Children, name: str, p: subprocess.Popen, path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if p.poll() is not None:
            ch.fail(name, f"exited with status {p.returncode} before it listened")
        if time.monotonic() > deadline:
            ch.fail(name, f"not listening after {timeout:.0f} s")
        time.sleep(0.05)
    return path.read_text().strip()


def wait_http(ch: Children, name: str, p: subprocess.Popen, url: str, timeout: float) -> None:
    import http.client
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        if p.poll() is not None:
            ch.fail(name, f"exited with status {p.returncode}")
        try:
            c = http.client.HTTPConnection(host, int(port), timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                c.close()
                return
            c.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            ch.fail(name, f"/health not answering 200 after {timeout:.0f} s")
        time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def listen_overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):
            if head.startswith("TcpExt:"):
                return int(dict(zip(head.split(), vals.split()))["ListenOverflows"])
    except (OSError, KeyError, ValueError):
        pass
    return 0


# ---- load generation -----------------------------------------------------------------------------

def bodies(n: int, max_tokens: int, stream: bool) -> list[bytes]:
    import json
    out = []
    for i in range(n):
        b = {"model": MODEL, "prompt": f"Request {i} tells a story", "max_tokens": max_tokens,
             "ignore_eos": True, "temperature": 0}
        if stream:
            b["stream"] = True
        out.append(json.dumps(b).encode())
    return out


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (linear interpolation between the samples), in ms."""
    if len(xs) < 2:
        return xs[0] * 1e3 if xs else float("nan")
    return statistics.quantiles(xs, n=1000, method="inclusive")[round(q * 1000) - 1] * 1e3


async def latency_rounds(targets: dict[str, list[str]], rounds: int, warm: int,
                         max_tokens: int) -> dict[str, list[float]]:
    """Non-streaming requests one at a time, interleaved over the targets (order rotating per
    round); seconds per request, warm-up rounds left out."""
    import json

    import aiohttp
    names = list(targets)
    lat: dict[str, list[float]] = {n: [] for n in names}
    bs = bodies(64, max_tokens, stream=False)
    perf = time.perf_counter
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        for i in range(warm + rounds):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                urls = targets[name]
                url = urls[i % len(urls)] + "/v1/completions"
                body = bs[i % len(bs)]
                t = perf()
                async with s.post(url, data=body, headers=HEADERS) as r:
                    raw = await r.read()
                dt = perf() - t
                if r.status != 200:
                    raise RuntimeError(f"{name}: HTTP {r.status}: {raw[:300]!r}")
                got = json.loads(raw)["usage"]["completion_tokens"]
                if got != max_tokens:
                    raise RuntimeError(f"{name}: {got} tokens instead of {max_tokens}")
                if i >= warm:
                    lat[name].append(dt)
    return lat


async def load_run(urls: list[str], clients: int, ramp_s: float, duration_s: float,
                   max_tokens: int, cpu_pids: dict[str, list[int]]) -> dict:
    """``clients`` closed-loop streaming clients; requests whose [DONE] arrives in
    [ramp end, ramp end + duration) count. Returns req/s, latency, errors, CPU per process."""
    import aiohttp
    bs = bodies(64, max_tokens, stream=True)
    perf = time.perf_counter
    stop = False
    done: list[tuple[float, float, int]] = []   # ([DONE] time, latency, client)
    errors: list[str] = []

    async def client(k: int, s: aiohttp.ClientSession) -> None:
        url = urls[k % len(urls)] + "/v1/completions"
        j = k
        while not stop:
            body = bs[j % len(bs)]
            j += 1
            t = perf()
            t_done = None
            try:
                async with s.post(url, data=body, headers=HEADERS) as r:
                    if r.status != 200:
                        errors.append(f"HTTP {r.status}: {(await r.read())[:200]!r}")
                        await asyncio.sleep(0.05)
                        continue
                    async for line in r.content:          # to the end: keep-alive reuse
                        if line.startswith(b"data: [DONE]"):
                            t_done = perf()
                        elif line.startswith(b"data: {\"error"):
                            errors.append(line[:200].decode(errors="replace"))
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                errors.append(repr(e)[:200])
                await asyncio.sleep(0.05)
                continue
            if t_done is None:
                errors.append("stream ended without [DONE]")
            else:
                done.append((t_done, t_done - t, k))

    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=60)) as s:
        tasks = []
        # clients start evenly over 2/3 of the ramp-up: a burst of 1000 connects would
        # overflow a listen backlog (aiohttp's is 128), and a dropped SYN retries after 1-3 s
        spread = ramp_s * 2 / 3
        t_start = perf()
        drops0 = listen_overflows()
        while len(tasks) < clients:
            due = min(clients, 1 + int(clients * (perf() - t_start) / spread))
            tasks += [asyncio.ensure_future(client(i, s)) for i in range(len(tasks), due)]
            await asyncio.sleep(0.01)
        await asyncio.sleep(max(0.0, ramp_s - (perf() - t_start)))
        cpu0 = {n: sum(cpu_seconds(p) for p in ps) for n, ps in cpu_pids.items()}
        ru0 = time.process_time()
        t0 = perf()
        await asyncio.sleep(duration_s)
        t1 = perf()
        cpu1 = {n: sum(cpu_seconds(p) for p in ps) for n, ps in cpu_pids.items()}
        ru1 = time.process_time()
        stop = True
        # let the requests in flight finish (the sim engines cannot abort a request)
        _, pending = await asyncio.wait(tasks, timeout=30)
        for t in pending:
            t.cancel()
    inside = [lat for tt, lat, _ in done if t0 <= tt < t1]
    active = len({k for tt, _, k in done if t0 <= tt < t1})
    n = len(inside)
    cpu = {name: (cpu1[name] - cpu0[name]) / (t1 - t0) for name in cpu0}
    cpu["load generator"] = (ru1 - ru0) / (t1 - t0)
    return {"rps": n / (t1 - t0), "n": n, "p50_ms": pct(inside, 0.5),
            "errors": errors, "cpu": cpu, "syn_drops": listen_overflows() - drops0,
            "active": active}


# ---- the benchmark -------------------------------------------------------------------------------

def start_servers(ch: Children, a: argparse.Namespace) -> dict:
    py = sys.executable
    engines = []
    for i in range(2):
        f = ch.dir / f"engine{i}.url"
        p = ch.start(f"engine{i}", [
            py, "-m", "backends.sim.engine_server", "--model", MODEL, "--chip", a.chip,
            "--topology", a.topology, "--tp", "1", "--pp", "1", "--ep", "1",
            "--phase", "decode", "--max-num-seqs", str(a.max_num_seqs), "--url-file", str(f)])
        engines.append((f"engine{i}", p, f))
    urls = [wait_file(ch, n, p, f, 180) for n, p, f in engines]
    pids = {"engines": [p.pid for _, p, _ in engines]}

    f = ch.dir / "gateway.url"
    gp = ch.start("gateway", [py, str(Path(__file__).resolve()), "--serve-gateway", *urls,
                              "--url-file", str(f), "--max-num-seqs", str(a.max_num_seqs)])
    gw_url = wait_file(ch, "gateway", gp, f, 60)
    wait_http(ch, "gateway", gp, gw_url, 30)

    # the console script beside this interpreter (not a pyenv shim: its pid is the router's)
    exe = Path(py).parent / "vllm-router"
    argv = [str(exe)] if exe.exists() else [py, "-m", "vllm_router.launch_router"]
    port = free_port()
    vr_url = f"http://127.0.0.1:{port}"
    vp = ch.start("vllm-router", argv + [
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
        "--policy", a.vllm_router_policy,
        # its metrics server listens on 29000 unless told: a free port, not a clash
        "--prometheus-port", str(free_port()),
        # it polls the workers' /health before serving, every 30 s by default
        "--worker-startup-check-interval", "1"],
        # --log-level does not reach its Rust logger; RUST_LOG does (power_of_two logs every
        # request at INFO)
        env={"RUST_LOG": "warn"})
    wait_http(ch, "vllm-router", vp, vr_url, 60)
    pids["gateway"] = [gp.pid]
    pids["vllm-router"] = [vp.pid]
    return {"engines": urls, "gateway": gw_url, "vllm-router": vr_url, "pids": pids}


def run(a: argparse.Namespace, ch: Children) -> None:
    t_all = time.perf_counter()
    srv = start_servers(ch, a)
    e = srv["engines"]
    vr_name = f"vllm-router ({a.vllm_router_policy})"
    print(f"2 sim engine servers ({MODEL}, {a.chip} {a.topology} tp1, max-num-seqs "
          f"{a.max_num_seqs}); requests: /v1/completions, 5-word prompts, max_tokens "
          f"{a.max_tokens}, ignore_eos; started in {time.perf_counter() - t_all:.1f} s",
          flush=True)

    # 1. latency at concurrency 1
    lat = asyncio.run(latency_rounds({"direct": e, "NeuScale gateway": [srv["gateway"]],
                                      vr_name: [srv["vllm-router"]]},
                                     a.requests, a.warmup, a.max_tokens))
    print(f"\nlatency, concurrency 1, non-streaming, {a.requests} interleaved requests per "
          f"target after {a.warmup} warm-up rounds (ms; direct alternates the two engines):")
    print(f"  {'target':28} {'p50':>7} {'p99':>7} {'added p50':>10} {'added p99':>10} "
          f"{'paired median':>14}")
    direct = lat["direct"]
    d50, d99 = pct(direct, 0.5), pct(direct, 0.99)
    for name, xs in lat.items():
        p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
        # the median of (this request - the direct request of the same round)
        paired = statistics.median(x - y for x, y in zip(xs, direct)) * 1e3
        add = "" if name == "direct" else \
            f"{p50 - d50:+10.2f} {p99 - d99:+10.2f} {paired:+14.2f}"
        print(f"  {name:28} {p50:7.2f} {p99:7.2f} {add}")
    print("  target: gateway added <= 1 ms p50, <= 5 ms p99 (paper's prototype: 45.9 ms)",
          flush=True)

    # 2. requests/s at each concurrency
    targets = {"direct, 1 engine": [e[0]], "direct, 2 engines (client RR)": e,
               "NeuScale gateway": [srv["gateway"]], vr_name: [srv["vllm-router"]]}
    procs = {"engines": srv["pids"]["engines"], "gateway": srv["pids"]["gateway"],
             "vllm-router": srv["pids"]["vllm-router"]}
    res: dict[str, dict[int, dict]] = {n: {} for n in targets}
    names = list(targets)
    print(f"\nrequests/s, streaming, closed loop: {a.ramp:g} s ramp-up then {a.duration:g} s "
          f"measured per point", flush=True)
    for j, c in enumerate(a.concurrency):
        for name in names[j % len(names):] + names[:j % len(names)]:
            r = asyncio.run(load_run(targets[name], c, a.ramp, a.duration, a.max_tokens, procs))
            res[name][c] = r
            cpu = ", ".join(f"{k} {v:.0%}" for k, v in r["cpu"].items() if v >= 0.005)
            err = f"; {len(r['errors'])} errors, e.g. {r['errors'][0]}" if r["errors"] else ""
            if r["syn_drops"]:
                err += f"; {r['syn_drops']} connects dropped by a full listen queue"
            if r["active"] < c:
                err += f"; only {r['active']} of {c} clients finished a request in the window"
            print(f"  C={c:<5} {name:30} {r['rps']:8.1f} req/s  p50 {r['p50_ms']:7.1f} ms  "
                  f"(CPU, % of a core: {cpu}){err}", flush=True)
            time.sleep(0.3)

    cs = a.concurrency
    base = "direct, 1 engine"
    print(f"\n  {'req/s (x direct, 1 engine)':30} " + " ".join(f"{'C=' + str(c):>17}" for c in cs))
    for name in names:
        cells = []
        for c in cs:
            r, b = res[name][c]["rps"], res[base][c]["rps"]
            cells.append(f"{r:8.1f} (x{r / b:5.2f})" if b else f"{r:8.1f} (   - )")
        print(f"  {name:30} " + " ".join(f"{x:>17}" for x in cells))
    # CPU per request of each router process (its share of the 2 cores, per request served)
    for name, key in (("NeuScale gateway", "gateway"), (vr_name, "vllm-router")):
        busy = [c for c in cs if c >= 100]      # at C=1 idle-loop time and 10-ms CPU ticks
        per = [res[name][c]["cpu"][key] / res[name][c]["rps"] * 1e6 if res[name][c]["rps"]
               else float("nan") for c in busy]
        if busy:
            print(f"  {name + ' CPU per request':42} " +
                  "  ".join(f"C={c}: {x:,.0f} us" for c, x in zip(busy, per)))
    if 100 in cs:
        g, v = res["NeuScale gateway"][100]["rps"], res[vr_name][100]["rps"]
        if v:
            print(f"\n  gateway / vllm-router requests/s at C=100: {g / v:.2f} "
                  f"(target >= 0.5)")
    bad = {n: sum(len(r["errors"]) for r in rr.values()) for n, rr in res.items()}
    if any(bad.values()):
        print("  errors: " + ", ".join(f"{n} {k}" for n, k in bad.items() if k))
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (~1 min)")
    ap.add_argument("--requests", type=int, default=300,
                    help="latency requests per target at concurrency 1")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up rounds before them")
    ap.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    ap.add_argument("--ramp", type=float, default=2.5, help="ramp-up seconds per point")
    ap.add_argument("--concurrency", default="1,100,1000")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--chip", default="v6e")
    ap.add_argument("--topology", default="1x1")
    ap.add_argument("--vllm-router-policy", default="round_robin",
                    choices=("round_robin", "power_of_two", "random"),
                    help="power_of_two: the lesser-loaded of two workers (in-flight requests)")
    ap.add_argument("--serve-gateway", nargs="+", metavar="ENGINE_URL", help=argparse.SUPPRESS)
    ap.add_argument("--url-file", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_gateway:
        asyncio.run(serve_gateway(a.serve_gateway, Path(a.url_file), MODEL, a.max_num_seqs))
        return
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    if a.quick:
        a.requests, a.warmup, a.duration, a.ramp = 60, 5, 2.0, 1.2
    # a SIGTERM ends the run as Ctrl-C does: through the finally below
    signal.signal(signal.SIGTERM, _interrupt)
    ch = Children(Path(tempfile.mkdtemp(prefix="router_overhead-")))
    try:
        run(a, ch)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        ch.close()
        shutil.rmtree(ch.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
