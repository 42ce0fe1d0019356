"""What runs on a vPod's hosts: the vLLM command lines for a :class:`~backends.base.VPodSpec`.

Pure functions of the spec and :class:`EngineSettings` (no I/O), shared by the Cloud TPU and
static backends (which run them over SSH through :mod:`backends.launcher`) and by
``orchestrator serve --dry-run`` (which prints them).

The mapping of a vPod onto vLLM's flags:

* ``--tensor-parallel-size tp`` and ``--pipeline-parallel-size pp``: the allocation's parallelism;
* experts (``ep > 1``), each MoE layout exactly as the DSE prices it (README, "Three layouts
  of a DeepSeek-V3 stage"): ``hybrid`` (and ``dp`` at ``tp = 1``, the same split) -
  ``--data-parallel-size ep --enable-expert-parallel``: attention data-parallel over ep groups
  of TP tp, the routed experts whole over all tp x ep chips; ``tp`` -
  ``--tensor-parallel-size tp*ep --enable-expert-parallel``. ``dp`` with ``tp, ep >= 2`` (TP
  inside each expert group) is not something vLLM launches (without the flag its experts
  are TP over all DP x TP ranks instead): a :class:`ConfigError`; the ``vllm-tpu`` stack
  profile does not enumerate it. vLLM's ``--max-num-seqs`` is per data-parallel rank, so it
  gets ``ceil(max_batch / ep)``;
* ``--max-num-seqs`` = the DB's max batch (the batch the allocation was priced and verified at);
* ``--max-model-len`` = the context the controller gives every engine (a request is routed by
  length, not refused by a short group: it migrates);
* ``--served-model-name`` = the name the gateway serves, so requests pass through unchanged;
* the API key reaches vLLM through ``VLLM_API_KEY`` in a 0600 environment file, never argv;
* XLA's compilation cache (``VLLM_XLA_CACHE_PATH``) persists on the VM's disk, so a restarted
  engine skips most of the ~minutes of TPU compilation;
* a slice with several hosts (workers) runs one vLLM through Ray, as vLLM runs multi-host on
  TPU: ``ray start --head`` on worker 0, ``ray start --address`` on the others, then
  ``vllm serve ... --distributed-executor-backend ray`` on worker 0.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from dse.parallel import Parallelism, runs_on
from dse.stacks import get_stack

from .base import ConfigError, VPodSpec

# vLLM reads its API key from this variable as well as from --api-key (vLLM docs, "OpenAI-
# compatible server": --api-key, "If provided, the server will require this key"; env
# VLLM_API_KEY) - the variable keeps the key out of the process list
VLLM_API_KEY_VAR = "VLLM_API_KEY"
# vLLM on TPU keeps compiled XLA graphs here when set (vLLM docs, TPU installation/"XLA
# compilation cache", VLLM_XLA_CACHE_PATH)
VLLM_XLA_CACHE_VAR = "VLLM_XLA_CACHE_PATH"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class EngineSettings:
    """How engines are installed and started on a host (``engine:`` in the cluster config)."""

    model: str = ""                      # HF id, gs://bucket/path, or a directory on the host
    served_model_name: str = ""          # the gateway's model name (set by serve)
    command: tuple[str, ...] = ("vllm", "serve")   # how vLLM starts; its first argument is
    # the model. Tests (and CPU hosts) use ("python", "-m", "vllm.entrypoints.openai.api_server",
    # "--model")
    check: str = "python3 -c 'import vllm'"          # shell: exit 0 when vLLM is installed
    # shell, run when `check` fails (vLLM docs, "Installation - Google TPU": the vllm-tpu
    # package); runs as the SSH user
    install: str = "python3 -m pip install --user --quiet vllm-tpu"
    workdir: str = "~/.neuscale"         # engine directories, weights and caches on the host
    port: int = 8000
    listen: str = "0.0.0.0"              # the engine's listen address; "worker": the host's
    # own address (several engines on one machine, each on its own address)
    api_key_env: str | None = None       # controller's variable holding the engines' API key
    hf_token_env: str | None = "HF_TOKEN"   # controller's variable with a Hugging Face token
    extra_args: tuple[str, ...] = ()     # appended to every vllm command line
    env: Mapping[str, str] = field(default_factory=dict)   # non-secret env for the engine
    ready_timeout_s: float = 1800.0      # install + weights + start + compile, per vPod
    ray_port: int = 6379
    dtype: str | None = None             # --dtype (None: the model's)
    # --max-num-batched-tokens: the step's token budget the simulated engines and the DB's
    # step-cost tables assume (orchestrator.cluster.ClusterConfig.max_batched_tokens); left to
    # vLLM, it picks its own per platform and usage context, and the engines would not serve
    # what the policy priced
    max_num_batched_tokens: int = 8192

    def problems(self) -> list[str]:
        p = []
        if not self.command or not all(isinstance(c, str) and c for c in self.command):
            p.append("engine.command must be a non-empty list of strings")
        if not 1 <= self.port <= 65535:
            p.append(f"engine.port must be 1-65535 (got {self.port})")
        if not 1 <= self.ray_port <= 65535:
            p.append(f"engine.ray_port must be 1-65535 (got {self.ray_port})")
        if not self.ready_timeout_s > 0:
            p.append("engine.ready_timeout_s must be > 0")
        if not self.max_num_batched_tokens >= 1:
            p.append("engine.max_num_batched_tokens must be >= 1 (got "
                     f"{self.max_num_batched_tokens})")
        for name in ("api_key_env", "hf_token_env"):
            v = getattr(self, name)
            if v is not None and not _NAME.match(v):
                p.append(f"engine.{name} must be an environment variable name (got {v!r})")
        for k in self.env:
            if not _NAME.match(str(k)):
                p.append(f"engine.env: {k!r} is not an environment variable name")
            if str(k) in (VLLM_API_KEY_VAR, "HF_TOKEN"):
                p.append(f"engine.env: {k} is a secret; name the controller's variable in "
                         "engine.api_key_env / engine.hf_token_env instead")
        if not self.workdir.strip():
            p.append("engine.workdir must not be empty")
        return p

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None, **overrides: Any) -> "EngineSettings":
        """Settings from the config's ``engine:`` section; one :class:`ConfigError` naming the
        first bad field."""
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        for k in d:
            if k.replace("-", "_") not in known:
                raise ConfigError(f"engine: unknown setting {k!r}; known: "
                                  f"{', '.join(sorted(known))}")
        vals: dict[str, Any] = {k.replace("-", "_"): v for k, v in d.items()}
        vals.update({k: v for k, v in overrides.items() if v is not None})
        for name in ("command", "extra_args"):
            v = vals.get(name)
            if isinstance(v, str):
                vals[name] = tuple(shlex.split(v))
            elif isinstance(v, (list, tuple)):
                if not all(isinstance(x, (str, int, float)) for x in v):
                    raise ConfigError(f"engine.{name} must be a list of strings")
                vals[name] = tuple(str(x) for x in v)
            elif v is not None:
                raise ConfigError(f"engine.{name} must be a list of strings or one string")
        for name, kind in (("port", int), ("ray_port", int), ("ready_timeout_s", (int, float)),
                           ("max_num_batched_tokens", int)):
            v = vals.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, kind)):
                raise ConfigError(f"engine.{name} must be a number (got {v!r})")
        for name in ("model", "served_model_name", "check", "install", "workdir", "listen",
                     "api_key_env", "hf_token_env", "dtype"):
            v = vals.get(name)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"engine.{name} must be a string (got {v!r})")
        env = vals.get("env")
        if env is not None:
            if not isinstance(env, Mapping):
                raise ConfigError("engine.env must be a mapping of NAME: value")
            vals["env"] = {str(k): str(v) for k, v in env.items()}
        s = cls(**vals)
        p = s.problems()
        if p:
            raise ConfigError("; ".join(p))
        return s


def weights_path(settings: EngineSettings) -> str:
    """Where the model's weights are on the host: a gs:// model is copied under the workdir;
    a Hugging Face id is given to vLLM as it is (it downloads into ``--download-dir``); a
    path is used in place."""
    m = settings.model
    if m.startswith("gs://"):
        return f"{settings.workdir}/weights/{_slug(m)}"
    return m


def fetch_weights_script(settings: EngineSettings) -> str | None:
    """Shell that makes the weights present on a host (None: vLLM fetches them itself). A
    gs:// path is copied once with the VM's service account (``gcloud storage``, preinstalled
    on TPU VM images); a marker file makes a repeat a no-op."""
    m = settings.model
    if not m.startswith("gs://"):
        return None
    dst = weights_path(settings)
    q_dst, q_src = _sh_path(dst), shlex.quote(m.rstrip("/") + "/*")
    return (f"test -e {q_dst}/.complete || {{ mkdir -p {q_dst} && "
            f"gcloud storage cp -r {q_src} {q_dst}/ && touch {q_dst}/.complete; }}")


def vllm_argv(spec: VPodSpec, settings: EngineSettings, *, multi_host: bool = False,
              worker: str | None = None) -> list[str]:
    """The engine's command line for ``spec`` (no secrets: those go in the environment)."""
    if not settings.model:
        raise ConfigError("engine.model must name the weights: a Hugging Face id, a gs:// "
                          "path or a directory on the hosts")
    argv = [*settings.command, weights_path(settings)]
    # "tp" layout: one rank of TP tp*ep, the experts expert-parallel over the same chips;
    # "hybrid": ep data-parallel attention ranks of TP tp, the experts expert-parallel over
    # all of them (vLLM's EP group spans DP x TP ranks). vLLM has no TP inside an expert
    # group of a data-parallel vPod, so the "dp" layout with tp, ep >= 2 is refused (the
    # vllm-tpu stack profile does not enumerate it); with tp = 1 it is the hybrid's launch.
    if not runs_on(Parallelism(spec.tp, spec.pp, spec.ep, spec.attn),
                   get_stack("vllm-tpu").moe_layouts):
        raise ConfigError(f"vPod {spec.id}: the dp MoE layout with tp={spec.tp} and ep={spec.ep} "
                          "(TP inside each expert group) is not a layout vLLM can launch; "
                          "rebuild the best-fit database with the vllm-tpu stack profile, "
                          "whose splits are tp or hybrid")
    tpattn = spec.attn == "tp"
    dp = 1 if tpattn else spec.ep
    tp = spec.tp * spec.ep if tpattn else spec.tp
    per_rank = math.ceil(spec.max_batch / dp)
    argv += ["--served-model-name", settings.served_model_name or spec.model,
             "--host", worker if settings.listen == "worker" and worker else settings.listen,
             "--port", str(settings.port),
             "--tensor-parallel-size", str(tp),
             "--pipeline-parallel-size", str(spec.pp),
             "--max-num-seqs", str(per_rank),
             "--max-num-batched-tokens", str(max(settings.max_num_batched_tokens, per_rank)),
             "--max-model-len", str(spec.max_model_len)]
    if tpattn:
        argv += ["--enable-expert-parallel"]
    elif spec.ep > 1:
        argv += ["--data-parallel-size", str(spec.ep), "--enable-expert-parallel"]
    if not settings.model.startswith("gs://") and not settings.model.startswith("/") \
            and not settings.model.startswith("~"):
        argv += ["--download-dir", f"{settings.workdir}/hf"]
    if settings.dtype:
        argv += ["--dtype", settings.dtype]
    if multi_host:
        argv += ["--distributed-executor-backend", "ray"]
    argv += list(settings.extra_args)
    return argv


def engine_env(spec: VPodSpec, settings: EngineSettings, slice_chips: int | None = None
               ) -> dict[str, str]:
    """Non-secret environment of the engine. A vPod smaller than its host's chips (the paper's
    sub-host vPods, e.g. 1 chip of a 4-chip v5p VM) sees only its own chips: libtpu's
    ``TPU_VISIBLE_CHIPS`` / ``TPU_CHIPS_PER_PROCESS_BOUNDS`` / ``TPU_PROCESS_BOUNDS`` (Cloud TPU
    docs, "Run multiple processes on a TPU VM")."""
    env = {VLLM_XLA_CACHE_VAR: f"{settings.workdir}/xla-cache",
           "NEUSCALE_VPOD": spec.id, "NEUSCALE_CHIP": spec.chip,
           "NEUSCALE_TOPOLOGY": spec.topology, "NEUSCALE_PHASE": spec.phase}
    if slice_chips is not None and spec.num_chips < slice_chips:
        dims = [int(x) for x in spec.topology.lower().split("x")]
        dims += [1] * (3 - len(dims))
        env["TPU_VISIBLE_CHIPS"] = ",".join(str(i) for i in range(spec.num_chips))
        env["TPU_CHIPS_PER_PROCESS_BOUNDS"] = ",".join(str(d) for d in dims[:3])
        env["TPU_PROCESS_BOUNDS"] = "1,1,1"
    env.update(settings.env)
    return env


def secret_env(settings: EngineSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """The engine's secrets, read from the controller's environment: the API key (as
    ``VLLM_API_KEY``) and a Hugging Face token. A named variable that is unset is an error."""
    out = {}
    for var, target in ((settings.api_key_env, VLLM_API_KEY_VAR),
                        (settings.hf_token_env, "HF_TOKEN")):
        if not var:
            continue
        v = environ.get(var)
        if v:
            out[target] = v
        elif var == settings.api_key_env:
            raise ConfigError(f"engine.api_key_env: the environment variable {var} is not set")
    return out


def ray_head_argv(settings: EngineSettings) -> list[str]:
    return ["ray", "start", "--head", f"--port={settings.ray_port}", "--block"]


def ray_worker_argv(head_ip: str, settings: EngineSettings) -> list[str]:
    return ["ray", "start", f"--address={head_ip}:{settings.ray_port}", "--block"]


def host_plan(spec: VPodSpec, workers: Sequence[str], settings: EngineSettings
              ) -> list[tuple[str, str, list[str]]]:
    """(worker address, process name, argv) for every process the vPod runs, in start order:
    the Ray workers of a multi-host slice, then the engine on worker 0."""
    if not workers:
        raise ConfigError(f"vPod {spec.id}: no host to run on")
    multi = len(workers) > 1
    out: list[tuple[str, str, list[str]]] = []
    if multi:
        out.append((workers[0], f"{spec.id[:55]}.ray", ray_head_argv(settings)))
        for w in workers[1:]:
            out.append((w, f"{spec.id[:55]}.ray", ray_worker_argv(workers[0], settings)))
    out.append((workers[0], spec.id, vllm_argv(spec, settings, multi_host=multi,
                                               worker=workers[0])))
    return out


def display(argv: Sequence[str], env: Mapping[str, str] = {}) -> str:
    """A command line as a shell would take it (what --dry-run prints)."""
    pre = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (pre + " " if pre else "") + shlex.join(list(argv))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.split("://", 1)[-1]).strip("_")[:120]


def _sh_path(path: str) -> str:
    """A path for a shell command: ``~/x`` keeps its tilde expansion, the rest is quoted."""
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


__all__ = ["EngineSettings", "vllm_argv", "engine_env", "secret_env", "host_plan",
           "fetch_weights_script", "weights_path", "display", "VLLM_API_KEY_VAR"]
