"""``orchestrator serve``: the live stack in one asyncio process - the OpenAI gateway
(:mod:`router.gateway`) and the controller (:mod:`orchestrator.controller`) - over a backend.

With ``backend="sim"`` the backend is a simulated TPU cloud (:mod:`backends.sim.cloud`) in a
process of its own, started in its own session so that it outlives a killed controller (as a
real cloud does): its URL and pid are kept in the state database, and a restarted ``serve``
finds it again and reconciles. A clean stop (Ctrl-C, SIGTERM) deletes the simulated vPods and
stops the sim cloud; ``keep_vpods`` leaves both running for the next start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import aiohttp

from dse.errors import NeuScaleError
from dse.vpod import VPodState

log = logging.getLogger("neuscale.serve")


def default_state_path(cluster: str) -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "neuscale" / f"{cluster}.db"


@dataclass(frozen=True)
class ServeConfig:
    backend: str = "sim"
    model: str = "llama3-8b"
    db: str | None = None               # default: built, verified and cached on first run
    metric: str = "energy"
    slo_scale: float = 5.0
    host: str = "127.0.0.1"
    port: int = 8000
    time_scale: float = 60.0
    quotas: Mapping[str, int] = field(default_factory=dict)
    state: str | None = None            # default: $XDG_STATE_HOME/neuscale/CLUSTER.db
    api_key_env: str | None = None      # name of the environment variable holding the key
    sim_cloud: str | None = None        # URL of a running sim cloud (default: start one)
    tokenizer: str | None = None        # a local tokenizer.json
    log_prompts: bool = False           # keep prompt text in the served-request log
    cluster: str = "neuscale"
    keep_vpods: bool = False            # on a clean stop, leave the vPods (and sim cloud) up
    chip_files: tuple[str, ...] = ()
    wait_for_vpod_s: float = 30.0
    predictor: str = "auto"             # output-length predictor: auto | bert[:DIR] | median | fixed:N
    policy_name: str = "neuscale"       # neuscale (load-aware) | neuscale-paper
    policy: Mapping[str, Any] = field(default_factory=dict)   # PolicyConfig fields to override
    bootstrap: bool = True              # start one vPod per phase before the first request
    # online recalibration (orchestrator.calibration): measured vs modelled latency per
    # allocation corrects the load-aware policy's sizing and SLO checks
    recalibrate: bool = True
    engine_stack: str | None = None     # sim backend: the profile its engines run (default:
    #                                     the database's; a slower one tests recalibration)
    # the tpu and static backends (deploy/gcp/cluster.yaml documents every field)
    tpu: Mapping[str, Any] | None = None      # project, zones, runtime versions, ...
    hosts: tuple[Any, ...] = ()               # static: existing hosts and their chips
    ssh: Mapping[str, Any] | None = None      # user, key_path, known_hosts, ...
    engine: Mapping[str, Any] | None = None   # vLLM: model weights, command, install, port

    def sections(self) -> dict[str, Any]:
        return {"tpu": self.tpu, "hosts": list(self.hosts), "ssh": self.ssh,
                "engine": self.engine}


class Service:
    """The gateway and the controller over a backend; :meth:`start` then :meth:`stop`."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.url = ""
        self._serving = False
        self._cloud = None                   # the sim cloud we started (CloudProcess)
        self._run_task: asyncio.Task | None = None

    # ---- pieces -------------------------------------------------------------------------------
    def load(self):
        from dse.catalog import default_catalog
        from dse.db import BestFitDB
        from dse.models import load_model
        cfg = self.cfg
        self.catalog = default_catalog(list(cfg.chip_files))
        self.arch = load_model(cfg.model)
        if cfg.db:
            db = BestFitDB.load(cfg.db)
            db.check_built_for(self.arch, self.catalog)
        else:
            from sim.verified import verified_db
            db = verified_db(self.arch, cfg.metric, cfg.slo_scale, None, self.catalog,
                             progress=None)
        self.db = db
        for c in cfg.quotas:
            self.catalog.get(c)

    def _api_key(self) -> str | None:
        name = self.cfg.api_key_env
        if not name:
            return None
        key = os.environ.get(name)
        if not key:
            raise NeuScaleError(f"--api-key-env {name}: the environment variable {name} is not "
                                "set or empty")
        return key

    def _tokenizer(self):
        if not self.cfg.tokenizer:
            return None
        from dse.tokens import load_tokenizer
        return load_tokenizer(self.cfg.tokenizer)

    async def _sim_backend(self, state):
        from backends.base import BackendError
        from backends.sim.client import CloudProcess, SimBackend
        url = self.cfg.sim_cloud or state.get_meta("sim_cloud_url")
        if url and await _alive(url):
            log.info("using the sim cloud at %s", url)
            return SimBackend(url)
        if self.cfg.sim_cloud:
            raise NeuScaleError(f"--sim-cloud {self.cfg.sim_cloud}: nothing answers there")
        args = ["--model", self.cfg.model, "--time-scale", repr(self.cfg.time_scale)]
        if self.cfg.quotas:
            args += ["--quota", ",".join(f"{c}={n}" for c, n in self.cfg.quotas.items())]
        for f in self.cfg.chip_files:
            args += ["--chip-file", f]
        args += ["--stack", self.cfg.engine_stack or self.db.stack.name]
        log_path = Path(str(state.path) + ".cloud.log")
        with open(log_path, "ab") as logf:
            try:
                self._cloud = await asyncio.to_thread(CloudProcess.start, args, stderr=logf)
            except BackendError as e:
                raise NeuScaleError(f"{e} (see {log_path})") from None
        url = self._cloud.url
        state.set_meta("sim_cloud_url", url)
        state.set_meta("sim_cloud_pid", str(self._cloud.pid))
        return SimBackend(url)

    def _recalibrator(self):
        """The live correction factors (restored from the state) and what measures them; None
        when off or for the paper's rule (which prices with the database as published)."""
        if not self.cfg.recalibrate or self.cfg.policy_name != "neuscale":
            return None
        from sim.vpod import TableCache

        from .calibration import Calibration, Recalibrator
        tables = TableCache(self.arch, self.catalog, stack=self.db.stack)
        cal = Calibration.from_json(self.state.get_json("calibration"))
        return Recalibrator(lambda key: tables(key[:6]), cal)

    def max_context(self) -> int:
        return min(self.arch.max_context or self.db.edges[-1], self.db.edges[-1])

    def control(self, max_context: int, calibration=None):
        """The controller's settings and the policy per phase (after :meth:`load`); with
        ``calibration`` the load-aware policy prices allocations with its live factors."""
        from .controller import ControllerConfig
        from .policy import PolicyConfig
        from .registry import make_live_policies
        cfg = self.cfg
        try:
            pcfg = PolicyConfig(**dict(cfg.policy))
        except TypeError as e:
            raise NeuScaleError(f"policy settings: {e}; known: "
                                f"{', '.join(PolicyConfig.__dataclass_fields__)}") from None
        ccfg = ControllerConfig(policy=pcfg, time_scale=cfg.time_scale,
                                cluster=cfg.cluster, model=cfg.model, quotas=dict(cfg.quotas),
                                bootstrap=cfg.bootstrap, max_model_len=max_context)
        pricer = None
        if calibration is not None and cfg.policy_name == "neuscale":
            from .pricing import CalibratedPricer, ChipModelPricer
            pricer = CalibratedPricer(ChipModelPricer(self.arch, self.catalog, self.db.stack),
                                      calibration)
        return ccfg, make_live_policies(cfg.policy_name, self.db, pcfg, self.catalog, pricer)

    # ---- start / stop -------------------------------------------------------------------------
    async def start(self) -> str:
        from router.gateway import Gateway

        from .controller import Controller
        from .state import StateStore
        cfg = self.cfg
        if cfg.backend not in BACKENDS:
            raise NeuScaleError(f"--backend {cfg.backend!r}: expected one of "
                                f"{', '.join(BACKENDS)}")
        self.load()
        api_key = self._api_key()
        remote = None if cfg.backend == "sim" else remote_backend(cfg, self.catalog,
                                                                   self.arch.name)
        state_path = Path(cfg.state) if cfg.state else default_state_path(cfg.cluster)
        self.state = StateStore(state_path)
        self.state.check_identity(cluster=cfg.cluster, model=self.arch.name,
                                  model_hash=self.arch.fingerprint(), backend=cfg.backend)
        self.backend = remote or await self._sim_backend(self.state)
        max_context = self.max_context()
        from router.predict import make_predictor
        try:
            predictor = make_predictor(cfg.predictor, self.db.edges,
                                       serving_model=self.arch.name)
        except ValueError as e:
            raise NeuScaleError(f"--predictor: {e}") from None
        self.gateway = Gateway(self.arch.name, self.db.edges, max_context, api_key=api_key,
                               tokenizer=self._tokenizer(), predictor=predictor,
                               wait_for_vpod_s=cfg.wait_for_vpod_s,
                               continuation=self.backend.continuation,
                               upstream_api_key=self.backend.engine_api_key)
        recal = self._recalibrator()
        ccfg, policies = self.control(max_context, recal and recal.calibration)
        self.controller = Controller(self.db, self.backend, self.gateway, self.state, ccfg,
                                     policies, recalibrator=recal)
        self.gateway.status_provider = self.controller.status
        self.gateway.plans_on_demand = True
        self.gateway.on_vpod_failed = self.controller.vpod_failed
        self.gateway.on_request_done = self.controller.log_request if cfg.log_prompts else \
            _without_prompt(self.controller.log_request)
        try:
            self.url = await self.gateway.start(cfg.host, cfg.port)
        except OSError as e:
            raise NeuScaleError(f"cannot listen on {cfg.host}:{cfg.port}: "
                                f"{e.strerror or e} (pass another --port)") from None
        self._serving = True
        await self.controller.start()
        self._run_task = asyncio.ensure_future(self.controller.run())
        return self.url

    async def stop(self) -> None:
        if self._run_task is not None:
            await self.controller.stop()
            self._run_task.cancel()
            await asyncio.gather(self._run_task, return_exceptions=True)
        if self._serving:
            await self.gateway.stop()
        if hasattr(self, "backend") and not self.cfg.keep_vpods:
            await self._release_all()
        if hasattr(self, "backend"):
            await self.backend.close()
        if hasattr(self, "state"):
            self.state.close()

    async def _release_all(self) -> None:
        """A clean stop without ``keep_vpods``: delete every vPod of ours and, if we started
        the sim cloud, stop it."""
        live = self.state.live_vpods()
        await asyncio.gather(*(self._delete(v.id) for v in live), return_exceptions=True)
        for v in live:
            self.state.update_vpod(v.id, state=VPodState.RELEASED, released_at=time.time(),
                                   reason="service stopped")
        pid = self.state.get_meta("sim_cloud_pid")
        if self._cloud is not None:
            await asyncio.to_thread(self._cloud.stop)
        elif pid and not self.cfg.sim_cloud:         # started by an earlier serve of ours
            _terminate(int(pid))
            self.state.set_meta("sim_cloud_url", "")
            self.state.set_meta("sim_cloud_pid", "")

    async def _delete(self, vid: str) -> None:
        try:
            await asyncio.wait_for(self.backend.delete(vid), 10.0)
        except Exception as e:        # best effort: the cloud goes away next anyway
            log.warning("deleting %s at stop: %s", vid, e)


BACKENDS = ("sim", "tpu", "static")


def remote_backend(cfg: ServeConfig, catalog, served_model_name: str):
    """The tpu or static backend of ``cfg`` (a config mistake: one NeuScaleError)."""
    from backends.base import BackendError
    from backends.config import make_backend
    try:
        return make_backend(cfg.backend, cfg.sections(), catalog, served_model_name)
    except BackendError as e:
        raise NeuScaleError(str(e)) from None


async def _alive(url: str) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            async with s.get(url.rstrip("/") + "/health") as r:
                return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        pass


def _without_prompt(log_request):
    def hook(record: dict[str, Any]) -> None:
        log_request({k: v for k, v in record.items() if k != "prompt"})
    return hook


async def serve_forever(cfg: ServeConfig, announce=print) -> None:
    """Start, announce, run until SIGINT/SIGTERM, stop cleanly."""
    svc = Service(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await svc.start()
        announce(url, svc)
        await stop.wait()
    finally:
        await svc.stop()
