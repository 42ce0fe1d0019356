"""The static backend: TPU VMs (or any hosts) that already exist, reached over SSH - the same
engine launcher as the Cloud TPU backend, no cloud API.

Each entry of ``hosts:`` in the cluster config is one slot for one vPod: a name, its address
(and, for a multi-host slice, every worker's address), its chip version and topology. Creating a
vPod takes a free slot of the spec's chip version with at least its chips (the exact topology
first, then the smallest); none free is a :class:`QuotaError` (the controller fails over to
another chip version). What runs where is recorded on the hosts themselves (the launcher's
``record.json`` beside each engine), so a restarted controller lists it again; nothing is
created or deleted but engine processes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dse.vpod import VPodState

from .base import (Backend, BackendError, ConfigError, QuotaError, VPodInfo, VPodSpec,
                   await_launch)

log = logging.getLogger("neuscale.backends.static")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class StaticHost:
    name: str
    address: str
    chip: str
    topology: str
    num_chips: int
    workers: tuple[str, ...]            # every worker's address; workers[0] == address
    engine_port: int | None = None      # this slot's engine port (default engine.port)

    @classmethod
    def from_mapping(cls, d: Any, i: int, catalog) -> "StaticHost":
        what = f"hosts[{i}]"
        if not isinstance(d, Mapping):
            raise ConfigError(f"{what} must be a mapping (name, address, chip, topology)")
        known = {"name", "address", "chip", "topology", "workers", "engine_port"}
        for k in d:
            if k not in known:
                raise ConfigError(f"{what}: unknown setting {k!r}; known: "
                                  f"{', '.join(sorted(known))}")
        for k in ("address", "chip", "topology"):
            if not isinstance(d.get(k), str) or not d[k].strip():
                raise ConfigError(f"{what}.{k} must be a non-empty string")
        from dse.errors import NeuScaleError
        from dse.vpod import VPodConfig
        try:
            chip = catalog.get(d["chip"])
            vp = VPodConfig.make(chip, d["topology"], catalog)
        except NeuScaleError as e:
            raise ConfigError(f"{what}: {e}") from None
        name = d.get("name", f"host{i}")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{what}.name must be 1-63 letters, digits, '.', '_' or '-'")
        workers = d.get("workers") or [d["address"]]
        if not isinstance(workers, (list, tuple)) or \
                not all(isinstance(w, str) and w for w in workers):
            raise ConfigError(f"{what}.workers must be a list of addresses")
        if workers[0] != d["address"]:
            workers = [d["address"], *[w for w in workers if w != d["address"]]]
        port = d.get("engine_port")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 1 <= port <= 65535):
            raise ConfigError(f"{what}.engine_port must be 1-65535")
        return cls(name, d["address"], chip.name, str(vp.topology), vp.num_chips,
                   tuple(workers), port)


def parse_hosts(items: Any, catalog) -> list[StaticHost]:
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError("the static backend needs 'hosts:', a list of {name, address, chip, "
                          "topology}")
    hosts = [StaticHost.from_mapping(d, i, catalog) for i, d in enumerate(items)]
    names = [h.name for h in hosts]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"hosts: duplicate names {', '.join(sorted(dup))}")
    return hosts


class StaticBackend(Backend):
    """vPods on a fixed list of hosts; engines through ``remote``
    (:class:`backends.remote.RemoteEngines`)."""

    continuation = "text"                    # plain vLLM: no KV connector between engines

    @property
    def engine_api_key(self) -> str | None:
        return self.remote.api_key

    def __init__(self, hosts: Sequence[StaticHost], remote, catalog):
        self.hosts = {h.name: h for h in hosts}
        self.remote = remote
        self.catalog = catalog
        self._where: dict[str, str] = {}             # vPod id -> host name
        self._specs: dict[str, VPodSpec] = {}
        self._created: dict[str, float] = {}
        self._launch: dict[str, asyncio.Task] = {}
        self._ready: dict[str, VPodInfo] = {}
        self._scanned = False
        self._lock = asyncio.Lock()

    async def _scan(self, force: bool = False) -> None:
        """What runs on the hosts (their engine records), once per backend or on demand."""
        if self._scanned and not force:
            return
        addresses = sorted({h.address for h in self.hosts.values()})
        found = await asyncio.gather(*(self.remote.records(a) for a in addresses),
                                     return_exceptions=True)
        for addr, recs in zip(addresses, found):
            if isinstance(recs, BaseException):
                if isinstance(recs, ConfigError):
                    raise recs
                log.warning("listing engines on %s: %s", addr, recs)
                continue
            for r in recs:
                try:
                    spec = VPodSpec.from_json(r["spec"])
                except (ConfigError, KeyError, TypeError):
                    continue
                host = r.get("host")
                if host not in self.hosts or self.hosts[host].address != addr:
                    continue
                if r.get("status") == "exited" and spec.id not in self._specs:
                    continue
                self._where[spec.id] = host
                self._specs[spec.id] = spec
                self._created.setdefault(spec.id, float(r.get("created_s") or time.time()))
        self._scanned = True

    def _free(self, spec: VPodSpec) -> StaticHost | None:
        busy = set(self._where.values())
        fits = [h for h in self.hosts.values() if h.name not in busy and h.chip == spec.chip
                and h.num_chips >= spec.num_chips]
        if not fits:
            return None
        fits.sort(key=lambda h: (h.topology != spec.topology, h.num_chips, h.name))
        return fits[0]

    async def create(self, spec: VPodSpec) -> VPodInfo:
        p = spec.problems()
        if p:
            raise ConfigError("; ".join(p))
        async with self._lock:
            await self._scan()
            have = self._specs.get(spec.id)
            if have is not None:
                if have != spec:
                    raise ConfigError(f"vPod {spec.id} exists with another spec")
            else:
                host = self._free(spec)
                if host is None:
                    n = sum(1 for h in self.hosts.values() if h.chip == spec.chip)
                    raise QuotaError(f"no free static {spec.chip} host with >= "
                                     f"{spec.num_chips} chips ({n} configured, all busy or "
                                     "smaller)", chip=spec.chip)
                self._where[spec.id] = host.name
                self._specs[spec.id] = spec
                self._created[spec.id] = time.time()
            self._ensure_launch(spec)
            return self._info(spec.id)

    def _ensure_launch(self, spec: VPodSpec) -> None:
        t = self._launch.get(spec.id)
        if t is not None and not (t.done() and (t.cancelled() or t.exception())):
            return
        self._launch[spec.id] = asyncio.ensure_future(self._start(spec))

    async def _start(self, spec: VPodSpec) -> VPodInfo:
        h = self.hosts[self._where[spec.id]]
        url = await self.remote.launch(spec, list(h.workers), port=h.engine_port,
                                       record={"host": h.name,
                                               "created_s": self._created[spec.id]})
        info = VPodInfo(spec, VPodState.READY, url, self._created[spec.id], time.time(),
                        f"on {h.name}")
        self._ready[spec.id] = info
        return info

    def _info(self, vid: str) -> VPodInfo:
        if vid in self._ready:
            return self._ready[vid]
        spec = self._specs[vid]
        return VPodInfo(spec, VPodState.STARTING, None, self._created[vid], None,
                        f"on {self._where[vid]}")

    async def wait_ready(self, vpod_id: str, timeout_s: float) -> VPodInfo:
        if vpod_id in self._ready:
            return self._ready[vpod_id]
        await self._scan()
        spec = self._specs.get(vpod_id)
        if spec is None:
            raise BackendError(f"vPod {vpod_id} does not exist")
        self._ensure_launch(spec)
        return await await_launch(self._launch, vpod_id, timeout_s)

    async def get(self, vpod_id: str) -> VPodInfo | None:
        await self._scan()
        return self._info(vpod_id) if vpod_id in self._specs else None

    async def list(self, labels: Mapping[str, str] = {}) -> list[VPodInfo]:
        await self._scan()
        return [self._info(v) for v, s in self._specs.items() if s.matches(labels)]

    async def delete(self, vpod_id: str) -> None:
        await self._scan()
        t = self._launch.pop(vpod_id, None)
        if t is not None and not t.done():
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
        spec = self._specs.get(vpod_id)
        if spec is None:
            return
        h = self.hosts[self._where[vpod_id]]
        await self.remote.stop(spec, list(h.workers))
        self._ready.pop(vpod_id, None)
        self._specs.pop(vpod_id, None)
        self._where.pop(vpod_id, None)
        log.info("stopped %s on %s", vpod_id, h.name)

    async def logs(self, vpod_id: str, lines: int = 200) -> str:
        await self._scan()
        spec = self._specs.get(vpod_id)
        if spec is None:
            raise BackendError(f"vPod {vpod_id} runs on none of the configured hosts")
        h = self.hosts[self._where[vpod_id]]
        return await self.remote.logs(spec, list(h.workers), lines=lines)

    async def close(self) -> None:
        for t in self._launch.values():
            t.cancel()
        await asyncio.gather(*self._launch.values(), return_exceptions=True)
        self._launch.clear()
        await self.remote.close()


__all__ = ["StaticHost", "StaticBackend", "parse_hosts"]
