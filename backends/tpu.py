"""The Cloud TPU backend: a vPod is one TPU VM slice (paper §3.2, §4), made through the Cloud
TPU API (``google-cloud-tpu``, ``tpu_v2``), its engine started over SSH (:mod:`backends.remote`).

* **Mapping.** chip version + topology -> ``AcceleratorConfig(type, topology)`` (v4/v5p 3-D
  shapes such as ``2x2x2``, v5e/v6e 2-D such as ``2x4``); a vPod smaller than the smallest slice
  Cloud TPU sells (v4/v5p: 4 chips; v5e/v6e: 1, 4 or 8 chips on one host) gets the smallest
  slice that holds it, and its engine uses the vPod's chips (the rest idle, and paid for:
  ``--dry-run`` says so). Runtime version per generation, network, service account, spot /
  reserved, labels ``neuscale-cluster`` / ``neuscale-vpod`` / ``neuscale-group`` /
  ``neuscale-phase`` (+ the config's), and the whole spec in the node's metadata
  (``neuscale-spec``), so a restarted controller finds what every node is for.
* **Creation** through TPU nodes (``CreateNode``) or queued resources
  (``CreateQueuedResource``, ``provisioning: queued``), chosen in the config; the long-running
  operation (or the queued resource's state) is awaited with a timeout. Zones of a chip version
  are tried in order; a stockout or quota error in all of them is a :class:`QuotaError` (the
  controller fails over to another chip version).
* **Idempotent by vPod id** (the node id): creating an existing vPod returns it; the same id
  with another spec is a :class:`ConfigError`. :meth:`TpuBackend.list` lists the labelled nodes
  of every configured zone (unlabelled nodes are never touched).
* **Errors are decisions**: RESOURCE_EXHAUSTED / stockout -> QuotaError; UNAVAILABLE, INTERNAL,
  DEADLINE_EXCEEDED, ABORTED, rate limits -> TransientError (the controller retries with
  backoff and jitter); PERMISSION_DENIED, UNAUTHENTICATED, INVALID_ARGUMENT, a missing project
  or zone -> ConfigError naming the setting to fix.
* **Deletion**: the controller drains first; then the engine is stopped and the node (or its
  queued resource) deleted, awaiting the operation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from dse.vpod import VPodState

from .base import (Backend, BackendError, ConfigError, QuotaError, TransientError, VPodInfo,
                   VPodSpec, await_launch, label_value)
from .engine import EngineSettings

log = logging.getLogger("neuscale.backends.tpu")

# Cloud TPU docs, "TPU software versions": the TPU VM image per generation
DEFAULT_RUNTIME_VERSIONS = {
    "v4": "tpu-ubuntu2204-base",
    "v5e": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}
# Cloud TPU docs, "TPU versions" (v4, v5e, v5p, v6e pages): AcceleratorConfig types
_TYPE_NAMES = {"v4": "V4", "v5e": "V5LITE_POD", "v5p": "V5P", "v6e": "V6E"}
SPEC_KEY = "neuscale-spec"
PROVISIONING = ("node", "queued")
_NODE_ID = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


class NotFound(BackendError):
    """The API has no such node / queued resource."""


class AlreadyExists(ConfigError):
    """The id is taken (a retried create that had landed, or someone else's resource)."""


# ---- settings --------------------------------------------------------------------------------

@dataclass(frozen=True)
class TpuSettings:
    """The ``tpu:`` section of the cluster config."""

    project: str
    zones: Mapping[str, tuple[str, ...]]          # chip version -> zones, in preference order
    runtime_versions: Mapping[str, str] = field(default_factory=dict)
    provisioning: str = "node"                     # node | queued
    spot: bool = False
    reserved: bool = False
    network: str | None = None
    subnetwork: str | None = None
    enable_external_ips: bool = False
    use_external_ips: bool = False                 # reach the VMs at their external IP
    service_account: str | None = None
    scopes: tuple[str, ...] = ("https://www.googleapis.com/auth/cloud-platform",)
    labels: Mapping[str, str] = field(default_factory=dict)
    tags: tuple[str, ...] = ("neuscale-engine",)   # network tags (firewall rules)
    host_keys: str = "guest-attributes"            # guest-attributes | known-hosts
    create_timeout_s: float = 1800.0
    queued_timeout_s: float = 3600.0               # wait for capacity, then fail over
    delete_timeout_s: float = 900.0
    poll_s: float = 10.0
    startup_script: str | None = None              # a file run at every VM's boot
    api_endpoint: str | None = None                # host:port of the TPU API (default Google's)
    insecure_channel: bool = False                 # plain-text gRPC (a local emulator)

    def runtime_version(self, chip: str) -> str:
        v = self.runtime_versions.get(chip) or DEFAULT_RUNTIME_VERSIONS.get(chip)
        if not v:
            raise ConfigError(f"tpu.runtime_versions has no entry for chip {chip!r}")
        return v

    def zones_of(self, chip: str) -> tuple[str, ...]:
        z = self.zones.get(chip)
        if not z:
            raise ConfigError(f"tpu.zones has no zone for chip version {chip!r} (have: "
                              f"{', '.join(sorted(self.zones)) or 'none'})")
        return z

    def all_zones(self) -> list[str]:
        out: list[str] = []
        for zs in self.zones.values():
            out += [z for z in zs if z not in out]
        return out

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> "TpuSettings":
        if not isinstance(d, Mapping):
            raise ConfigError("the cluster config needs a 'tpu:' section (project, zones, ...)")
        d = {str(k).replace("-", "_"): v for k, v in d.items()}
        known = set(cls.__dataclass_fields__)
        for k in d:
            if k not in known:
                raise ConfigError(f"tpu: unknown setting {k!r}; known: "
                                  f"{', '.join(sorted(known))}")
        if not isinstance(d.get("project"), str) or not d["project"].strip():
            raise ConfigError("tpu.project must name the Google Cloud project")
        zones = d.get("zones")
        if not isinstance(zones, Mapping) or not zones:
            raise ConfigError("tpu.zones must map each chip version to its zones, e.g. "
                              "{v6e: [us-east5-b], v5p: [us-east5-a]}")
        zz: dict[str, tuple[str, ...]] = {}
        for chip, zs in zones.items():
            if isinstance(zs, str):
                zs = [zs]
            if not isinstance(zs, (list, tuple)) or not zs or \
                    not all(isinstance(z, str) and re.match(r"^[a-z]+-[a-z]+\d+-[a-z]$", z)
                            for z in zs):
                raise ConfigError(f"tpu.zones.{chip}: expected zone names like us-east5-b "
                                  f"(got {zs!r})")
            zz[str(chip)] = tuple(zs)
        d["zones"] = zz
        for name in ("runtime_versions", "labels"):
            v = d.get(name, {})
            if not isinstance(v, Mapping) or not all(isinstance(x, str) for x in v.values()):
                raise ConfigError(f"tpu.{name} must be a mapping of strings")
            d[name] = {str(k): x for k, x in v.items()}
        for k, v in d["labels"].items():
            if not re.match(r"^[a-z][a-z0-9_-]{0,62}$", k) or \
                    not re.match(r"^[a-z0-9_-]{0,63}$", v):
                raise ConfigError(f"tpu.labels: {k}={v!r} is not a valid Cloud label "
                                  "(lowercase letters, digits, '_' and '-', at most 63)")
            if k.startswith("neuscale-"):
                raise ConfigError(f"tpu.labels: {k} is NeuScale's own label")
        for name in ("scopes", "tags"):
            v = d.get(name)
            if v is not None:
                if isinstance(v, str):
                    v = [v]
                if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
                    raise ConfigError(f"tpu.{name} must be a list of strings")
                d[name] = tuple(v)
        for name in ("spot", "reserved", "enable_external_ips", "use_external_ips",
                     "insecure_channel"):
            if name in d and not isinstance(d[name], bool):
                raise ConfigError(f"tpu.{name} must be true or false (got {d[name]!r})")
        for name in ("create_timeout_s", "queued_timeout_s", "delete_timeout_s", "poll_s"):
            v = d.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not v > 0):
                raise ConfigError(f"tpu.{name} must be a number of seconds > 0 (got {v!r})")
        ss = d.get("startup_script")
        if ss is not None:
            from pathlib import Path
            if not isinstance(ss, str) or not Path(ss).expanduser().is_file():
                raise ConfigError(f"tpu.startup_script: no file at {ss!r}")
            d["startup_script"] = str(Path(ss).expanduser())
        for name in ("network", "subnetwork", "service_account", "api_endpoint"):
            v = d.get(name)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"tpu.{name} must be a string (got {v!r})")
        s = cls(**d)
        if s.provisioning not in PROVISIONING:
            raise ConfigError(f"tpu.provisioning must be node or queued (got "
                              f"{s.provisioning!r})")
        if s.spot and s.reserved:
            raise ConfigError("tpu.spot and tpu.reserved exclude each other")
        if s.host_keys not in ("guest-attributes", "known-hosts"):
            raise ConfigError("tpu.host_keys must be guest-attributes or known-hosts (got "
                              f"{s.host_keys!r})")
        for chip in s.zones:
            if chip not in _TYPE_NAMES:
                raise ConfigError(f"tpu.zones: unknown chip version {chip!r} (Cloud TPU has "
                                  f"{', '.join(_TYPE_NAMES)})")
        return s


# ---- mapping ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Slice:
    """The Cloud TPU slice a vPod runs on."""

    chip: str
    type_name: str             # AcceleratorConfig.Type name
    topology: str              # the API's topology string
    num_chips: int             # chips of the slice (>= the vPod's)
    hosts: int


# The slice shapes Cloud TPU sells (Cloud TPU docs, "TPU v4" / "TPU v5p" / "TPU v5e" / "TPU
# v6e": supported topologies): v4/v5p 3-D, v5e/v6e 2-D
_TOPOLOGIES_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8",
                  "8x8x12", "8x8x16", "8x16x16", "16x16x16", "16x16x24")
_TOPOLOGIES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")


def slice_for(chip: str, topology: str, num_chips: int, chips_per_host: int) -> Slice:
    """The Cloud TPU slice a vPod of ``num_chips`` ``chip`` chips shaped ``topology`` runs on:
    its own shape when Cloud TPU sells it, else the smallest sold shape with at least as many
    chips (a sub-host vPod, e.g. 1 chip of v5p, gets the 4-chip 2x2x1 VM and sees only its
    chips; a shape Cloud TPU does not sell, e.g. v5p 4x2x1, runs on 2x2x2 - same chips, a
    different ICI wiring than the DSE priced)."""
    if chip not in _TYPE_NAMES:
        raise ConfigError(f"chip version {chip!r} is not a Cloud TPU generation "
                          f"({', '.join(_TYPE_NAMES)})")
    table = _TOPOLOGIES_2D if chip in ("v5e", "v6e") else _TOPOLOGIES_3D
    dims = sorted(int(x) for x in topology.lower().split("x"))
    ones = [d for d in dims if d == 1]
    own = "x".join(str(d) for d in [d for d in dims if d > 1] + ones)
    if own in table:
        topo = own
    else:
        fits = [t for t in table if _chips(t) >= num_chips]
        if not fits:
            raise ConfigError(f"no {chip} slice holds {num_chips} chips")
        topo = fits[0]
    n = _chips(topo)
    # hosts: chips / chips per host (Cloud TPU docs, "TPU v5e" supported slice shapes: 4x4 = 2
    # hosts, 16x16 = 32; v4/v5p 4 chips per host); a slice below one host's chips is 1 VM
    return Slice(chip, _TYPE_NAMES[chip], topo, n, max(1, -(-n // chips_per_host)))


def _chips(topology: str) -> int:
    n = 1
    for x in topology.split("x"):
        n *= int(x)
    return n


def node_id_ok(vpod_id: str) -> bool:
    return bool(_NODE_ID.match(vpod_id))


# ---- the backend -----------------------------------------------------------------------------

class TpuBackend(Backend):
    """vPods as Cloud TPU slices; engines through ``remote`` (:class:`RemoteEngines`)."""

    continuation = "text"                    # plain vLLM: no KV connector between engines

    @property
    def engine_api_key(self) -> str | None:
        return self.remote.api_key

    def __init__(self, settings: TpuSettings, engine: EngineSettings, remote, catalog,
                 client=None):
        self.settings = settings
        self.engine = engine
        self.remote = remote                 # backends.remote.RemoteEngines
        self.catalog = catalog
        self._client = client
        self._zone_of: dict[str, str] = {}
        self._launch: dict[str, asyncio.Task] = {}
        self._ready: dict[str, VPodInfo] = {}
        self._closed = False

    # ---- the API client ---------------------------------------------------------------------
    def client(self):
        if self._client is None:
            self._client = make_client(self.settings)
        return self._client

    async def _call(self, what: str, fn: Callable[[], Any], chip: str | None = None) -> Any:
        """Run a blocking client call in a thread; cloud errors become backend errors."""
        try:
            return await asyncio.to_thread(fn)
        except BackendError:
            raise
        except Exception as e:          # google.api_core.exceptions.* and grpc errors
            raise cloud_error(e, what, chip, self.settings) from None

    def _parent(self, zone: str) -> str:
        return f"projects/{self.settings.project}/locations/{zone}"

    def _name(self, zone: str, vpod_id: str) -> str:
        return f"{self._parent(zone)}/nodes/{vpod_id}"

    # ---- Backend ----------------------------------------------------------------------------
    async def create(self, spec: VPodSpec) -> VPodInfo:
        p = spec.problems()
        if not node_id_ok(spec.id):
            p.append(f"id {spec.id!r} is not a valid TPU node id (lowercase letters, digits "
                     "and '-', starting with a letter): use a lowercase cluster name")
        if p:
            raise ConfigError("; ".join(p))
        chip = self.catalog.get(spec.chip)
        zones = self.settings.zones_of(chip.name)
        node = await self._find(spec.id, zones)
        if node is not None:
            have = _spec_of(node)
            if have is not None and have != spec:
                raise ConfigError(f"vPod {spec.id} exists with another spec")
            info = self._info(node, spec)
            if info.state == VPodState.RELEASED:
                raise BackendError(f"vPod {spec.id} exists but is {node.state.name}")
            self._ensure_launch(spec, node)
            return info
        sl = slice_for(chip.name, spec.topology, spec.num_chips, chip.chips_per_host)
        last: Exception | None = None
        for zone in zones:
            try:
                node = await self._create_in(zone, spec, sl)
            except QuotaError as e:
                log.warning("no %s capacity in %s for %s: %s", chip.name, zone, spec.id, e)
                last = e
                continue
            self._zone_of[spec.id] = zone
            self._ensure_launch(spec, node)
            return self._info(node, spec)
        raise QuotaError(f"no {chip.name} capacity for {sl.type_name} {sl.topology} in "
                         f"{', '.join(zones)}: {last}", chip=chip.name)

    async def _create_in(self, zone: str, spec: VPodSpec, sl: Slice):
        from google.cloud import tpu_v2
        s = self.settings
        labels = {**s.labels, **{k: label_value(v) for k, v in spec.labels.items()}}
        node = tpu_v2.Node(
            accelerator_config=tpu_v2.AcceleratorConfig(
                type_=tpu_v2.AcceleratorConfig.Type[sl.type_name], topology=sl.topology),
            runtime_version=s.runtime_version(spec.chip),
            labels=labels,
            metadata=self._metadata(spec),
            tags=list(s.tags),
            network_config=tpu_v2.NetworkConfig(
                network=s.network or "", subnetwork=s.subnetwork or "",
                enable_external_ips=s.enable_external_ips),
            scheduling_config=tpu_v2.SchedulingConfig(spot=s.spot, reserved=s.reserved),
            description=f"NeuScale vPod {spec.id} ({spec.phase}, group {spec.group})")
        if s.service_account:
            node.service_account = tpu_v2.ServiceAccount(email=s.service_account,
                                                         scope=list(s.scopes))
        parent = self._parent(zone)
        log.info("creating %s: %s %s in %s (%s)", spec.id, sl.type_name, sl.topology, zone,
                 s.provisioning)
        if s.provisioning == "queued":
            return await self._create_queued(zone, spec, node)
        cl = self.client()
        try:
            op = await self._call(f"create node {spec.id}", lambda: cl.create_node(
                parent=parent, node_id=spec.id, node=node), spec.chip)
        except AlreadyExists:
            found = await self._get_node(zone, spec.id)   # a retried call that had landed
            if found is None:
                raise
            return found
        return await self._call(f"create node {spec.id}",
                                lambda: op.result(timeout=s.create_timeout_s), spec.chip)

    def _metadata(self, spec: VPodSpec) -> dict[str, str]:
        md = {SPEC_KEY: json.dumps(spec.to_json(), separators=(",", ":"), sort_keys=True)}
        if self.settings.startup_script:
            with open(self.settings.startup_script, encoding="utf-8") as f:
                md["startup-script"] = f.read()        # GCE's boot-time script key
        return md

    async def _create_queued(self, zone: str, spec: VPodSpec, node):
        from google.cloud import tpu_v2
        s = self.settings
        qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[
            tpu_v2.QueuedResource.Tpu.NodeSpec(parent=self._parent(zone), node_id=spec.id,
                                               node=node)]))
        if s.spot:
            qr.spot = tpu_v2.QueuedResource.Spot()
        elif s.reserved:
            qr.guaranteed = tpu_v2.QueuedResource.Guaranteed()
        cl = self.client()
        name = f"{self._parent(zone)}/queuedResources/{spec.id}"
        try:
            await self._call(f"create queued resource {spec.id}",
                             lambda: cl.create_queued_resource(
                                 parent=self._parent(zone), queued_resource_id=spec.id,
                                 queued_resource=qr), spec.chip)
        except AlreadyExists:                   # a retried call that had landed
            pass
        deadline = time.monotonic() + s.queued_timeout_s
        State = tpu_v2.QueuedResourceState.State
        while True:
            q = await self._call(f"get queued resource {spec.id}",
                                 lambda: cl.get_queued_resource(name=name), spec.chip)
            st = q.state.state
            if st == State.ACTIVE:
                node = await self._get_node(zone, spec.id)
                if node is not None and node.state == tpu_v2.Node.State.READY:
                    return node
            elif st == State.FAILED:
                why = _failed_reason(q)
                await self._delete_queued(name, spec.id)
                if _capacity_words(why):
                    raise QuotaError(f"queued resource {spec.id} failed: {why}",
                                     chip=spec.chip)
                raise BackendError(f"queued resource {spec.id} failed: {why}")
            if time.monotonic() > deadline:
                await self._delete_queued(name, spec.id)
                raise QuotaError(f"queued resource {spec.id} waited {s.queued_timeout_s:g} s "
                                 f"for capacity ({st.name}): tpu.queued_timeout_s",
                                 chip=spec.chip)
            await asyncio.sleep(s.poll_s)

    async def _delete_queued(self, name: str, vid: str) -> None:
        cl = self.client()
        try:
            op = await self._call(f"delete queued resource {vid}",
                                  lambda: cl.delete_queued_resource(
                                      request={"name": name, "force": True}))
            await self._call(f"delete queued resource {vid}",
                             lambda: op.result(timeout=self.settings.delete_timeout_s))
        except NotFound:
            pass

    def _ensure_launch(self, spec: VPodSpec, node) -> None:
        t = self._launch.get(spec.id)
        if t is not None and not (t.done() and (t.cancelled() or t.exception())):
            return
        self._launch[spec.id] = asyncio.ensure_future(self._start_engine(spec, node))

    async def _start_engine(self, spec: VPodSpec, node) -> VPodInfo:
        from google.cloud import tpu_v2
        if node.state != tpu_v2.Node.State.READY:
            node = await self._wait_node_ready(spec, node)
        workers = self._workers(node)
        trusted = await self._host_keys(node, workers)
        chip = self.catalog.get(spec.chip)
        sl = slice_for(chip.name, spec.topology, spec.num_chips, chip.chips_per_host)
        endpoint = await self.remote.launch(spec, workers, trusted=trusted,
                                            slice_chips=sl.num_chips)
        info = VPodInfo(spec, VPodState.READY, endpoint, _created_s(node), time.time())
        self._ready[spec.id] = info
        return info

    async def _wait_node_ready(self, spec: VPodSpec, node):
        from google.cloud import tpu_v2
        zone = self._zone_of.get(spec.id) or _zone_of_name(node.name)
        deadline = time.monotonic() + self.settings.create_timeout_s
        while node.state != tpu_v2.Node.State.READY:
            if _released(node):
                raise BackendError(f"vPod {spec.id}: node is {node.state.name}")
            if time.monotonic() > deadline:
                raise TransientError(f"vPod {spec.id}: node not READY after "
                                     f"{self.settings.create_timeout_s:g} s")
            await asyncio.sleep(self.settings.poll_s)
            n = await self._get_node(zone, spec.id)
            if n is None:
                raise BackendError(f"vPod {spec.id}: node deleted while starting")
            node = n
        return node

    def _workers(self, node) -> list[str]:
        out = []
        for ep in node.network_endpoints:
            ip = ep.access_config.external_ip if self.settings.use_external_ips and \
                ep.access_config else ep.ip_address
            if ip:
                out.append(ip)
        if not out:
            raise TransientError(f"node {node.name} has no network endpoints yet")
        return out

    async def _host_keys(self, node, workers: Sequence[str]) -> dict[str, list[str]] | None:
        """Host keys the VMs published in their guest attributes (``hostkeys/``), as trusted
        known_hosts lines per worker address; None when the config says known-hosts."""
        if self.settings.host_keys != "guest-attributes":
            return None
        cl = self.client()
        resp = await self._call(f"guest attributes of {node.name}",
                                lambda: cl.get_guest_attributes(
                                    request={"name": node.name, "query_path": "hostkeys/"}))
        out: dict[str, list[str]] = {}
        # one GuestAttributes per worker, in worker order (the v2 message has no worker id)
        for w, ga in enumerate(list(resp.guest_attributes)[:len(workers)]):
            for item in ga.query_value.items:
                if item.namespace == "hostkeys" and item.key and item.value:
                    v = item.value.strip()       # "TYPE BASE64 [comment]" or just BASE64
                    out.setdefault(workers[w], []).append(v if " " in v else f"{item.key} {v}")
        missing = [w for w in workers if w not in out]
        if missing:
            raise TransientError(f"node {node.name}: no host keys published yet for "
                                 f"{', '.join(missing)} (guest attributes hostkeys/)")
        return out

    async def wait_ready(self, vpod_id: str, timeout_s: float) -> VPodInfo:
        if vpod_id in self._ready:
            return self._ready[vpod_id]
        if vpod_id not in self._launch:
            node, spec = await self._node_and_spec(vpod_id)
            self._ensure_launch(spec, node)
        return await await_launch(self._launch, vpod_id, timeout_s)

    async def _node_and_spec(self, vpod_id: str):
        node = await self._find(vpod_id)
        if node is None:
            raise BackendError(f"vPod {vpod_id} does not exist")
        spec = _spec_of(node)
        if spec is None:
            raise BackendError(f"node {vpod_id} carries no NeuScale spec")
        return node, spec

    async def get(self, vpod_id: str) -> VPodInfo | None:
        node = await self._find(vpod_id)
        if node is None:
            return None
        spec = _spec_of(node)
        return None if spec is None else self._info(node, spec)

    async def list(self, labels: Mapping[str, str] = {}) -> list[VPodInfo]:
        want = {k: label_value(v) for k, v in labels.items()}
        out = []
        for zone in self.settings.all_zones():
            for node in await self._list_zone(zone):
                if not all(node.labels.get(k) == v for k, v in want.items()):
                    continue
                spec = _spec_of(node)
                if spec is None:
                    continue
                self._zone_of[spec.id] = zone
                info = self._info(node, spec)
                if info.state != VPodState.RELEASED:
                    out.append(info)
        return out

    async def delete(self, vpod_id: str) -> None:
        node = await self._find(vpod_id)
        t = self._launch.pop(vpod_id, None)
        if t is not None and not t.done():
            t.cancel()
        self._ready.pop(vpod_id, None)
        if node is None:
            return
        spec = _spec_of(node)
        try:
            workers = self._workers(node)
        except TransientError:
            workers = []
        if spec is not None and workers:
            try:
                await asyncio.wait_for(self.remote.stop(spec, workers), 60.0)
            except (BackendError, asyncio.TimeoutError, OSError) as e:
                log.info("stopping the engine of %s before deleting it: %s", vpod_id, e)
        cl = self.client()
        qr = node.queued_resource
        if qr:
            await self._delete_queued(qr, vpod_id)
            return
        try:
            op = await self._call(f"delete node {vpod_id}",
                                  lambda: cl.delete_node(name=node.name))
            await self._call(f"delete node {vpod_id}",
                             lambda: op.result(timeout=self.settings.delete_timeout_s))
        except NotFound:
            return
        log.info("deleted %s", vpod_id)

    async def close(self) -> None:
        self._closed = True
        for t in self._launch.values():
            t.cancel()
        await asyncio.gather(*self._launch.values(), return_exceptions=True)
        self._launch.clear()
        await self.remote.close()
        c, self._client = self._client, None
        if c is not None:
            try:
                c.transport.close()
            except Exception:                 # already closed
                pass

    async def delete_pending(self, labels: Mapping[str, str]) -> list[str]:
        """Delete the queued resources whose node carries ``labels`` (those still waiting for
        capacity or failed have no node ``list`` shows): ``orchestrator down`` leaves nothing
        queued."""
        want = {k: label_value(v) for k, v in labels.items()}
        cl = self.client()
        out = []
        for zone in self.settings.all_zones():
            qrs = await self._call(f"list queued resources in {zone}", lambda: list(
                cl.list_queued_resources(parent=self._parent(zone))))
            for q in qrs:
                specs = list(q.tpu.node_spec) if q.tpu else []
                if not specs or not all(all(ns.node.labels.get(k) == v
                                            for k, v in want.items()) for ns in specs):
                    continue
                await self._delete_queued(q.name, q.name.rsplit("/", 1)[-1])
                out.append(q.name)
        return out

    async def logs(self, vpod_id: str, lines: int = 200) -> str:
        node, spec = await self._node_and_spec(vpod_id)
        workers = self._workers(node)
        trusted = await self._host_keys(node, workers)
        return await self.remote.logs(spec, workers, lines=lines, trusted=trusted)

    # ---- lookups ----------------------------------------------------------------------------
    async def _get_node(self, zone: str, vpod_id: str):
        cl = self.client()
        try:
            return await self._call(f"get node {vpod_id}",
                                    lambda: cl.get_node(name=self._name(zone, vpod_id)))
        except NotFound:
            return None

    async def _find(self, vpod_id: str, zones: Sequence[str] | None = None):
        if not node_id_ok(vpod_id):
            return None
        z = self._zone_of.get(vpod_id)
        order = ([z] if z else []) + [x for x in (zones or self.settings.all_zones()) if x != z]
        for zone in order:
            node = await self._get_node(zone, vpod_id)
            if node is not None:
                self._zone_of[vpod_id] = zone
                return node
        return None

    async def _list_zone(self, zone: str) -> list:
        cl = self.client()
        return await self._call(f"list nodes in {zone}",
                                lambda: list(cl.list_nodes(parent=self._parent(zone))))

    def _info(self, node, spec: VPodSpec) -> VPodInfo:
        from google.cloud import tpu_v2
        S = tpu_v2.Node.State
        ready = self._ready.get(spec.id)
        if _released(node):
            return VPodInfo(spec, VPodState.RELEASED, None, _created_s(node), None,
                            f"node {node.state.name}")
        if node.state in (S.DELETING, S.STOPPING, S.STOPPED, S.HIDING, S.HIDDEN):
            return VPodInfo(spec, VPodState.DRAINING, None, _created_s(node), None,
                            f"node {node.state.name}")
        if node.state == S.READY and ready is not None:
            return ready
        return VPodInfo(spec, VPodState.STARTING, None, _created_s(node), None,
                        f"node {node.state.name}")


# ---- helpers ---------------------------------------------------------------------------------

def make_client(settings: TpuSettings):
    """The real TPU API client: Google's endpoint with application-default credentials, or
    ``api_endpoint`` (with ``insecure_channel`` for a plain-text local emulator)."""
    try:
        from google.cloud import tpu_v2
        from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport
    except ImportError:
        raise ConfigError("the tpu backend needs google-cloud-tpu: pip install "
                          "'neuscale[tpu]'") from None
    if settings.api_endpoint and settings.insecure_channel:
        import grpc
        return tpu_v2.TpuClient(transport=TpuGrpcTransport(
            channel=grpc.insecure_channel(settings.api_endpoint)))
    opts = {"api_endpoint": settings.api_endpoint} if settings.api_endpoint else None
    try:
        return tpu_v2.TpuClient(client_options=opts)
    except Exception as e:          # google.auth.exceptions.DefaultCredentialsError
        raise ConfigError(f"no Google Cloud credentials for the TPU API ({e}): run `gcloud "
                          "auth application-default login` or run the controller as a "
                          "service account (deploy/gcp/README.md)") from None


def cloud_error(e: Exception, what: str, chip: str | None,
                settings: TpuSettings | None = None) -> BackendError:
    """A cloud API error as a backend decision (see the module docstring)."""
    from google.api_core import exceptions as gx
    msg = f"{what}: {getattr(e, 'message', None) or e}"
    if isinstance(e, gx.ResourceExhausted):
        low = msg.lower()
        if "rate" in low and "quota" in low and "request" in low:
            return TransientError(msg + " (API rate limit)")
        return QuotaError(msg, chip=chip)
    if isinstance(e, (gx.ServiceUnavailable, gx.InternalServerError, gx.DeadlineExceeded,
                      gx.Aborted, gx.TooManyRequests, gx.GatewayTimeout, gx.BadGateway,
                      gx.RetryError)):
        return TransientError(msg)
    if isinstance(e, gx.PermissionDenied):
        return ConfigError(msg + " - the controller's service account needs roles/tpu.admin "
                           "on tpu.project (and roles/iam.serviceAccountUser on "
                           "tpu.service_account); see deploy/gcp/README.md")
    if isinstance(e, gx.Unauthenticated):
        return ConfigError(msg + " - the controller's credentials were refused: run `gcloud "
                           "auth application-default login` or fix the service account")
    if isinstance(e, gx.InvalidArgument):
        return ConfigError(msg + " - check tpu.runtime_versions, tpu.zones (does the zone "
                           "offer this chip version?) and tpu.network")
    if isinstance(e, gx.AlreadyExists):
        return AlreadyExists(msg + " (already exists)")
    if isinstance(e, gx.NotFound):
        return NotFound(msg + " (not found)")
    if isinstance(e, gx.FailedPrecondition):
        return BackendError(msg)
    if isinstance(e, TimeoutError) or type(e).__name__ == "TimeoutError":
        return TransientError(msg + " (operation timed out)")
    if isinstance(e, gx.GoogleAPICallError):
        return TransientError(msg)
    return BackendError(msg)


def _spec_of(node) -> VPodSpec | None:
    raw = node.metadata.get(SPEC_KEY) if node.metadata else None
    if not raw:
        return None
    try:
        return VPodSpec.from_json(json.loads(raw))
    except (ValueError, ConfigError):
        log.warning("node %s: unreadable %s metadata; ignored", node.name, SPEC_KEY)
        return None


def _released(node) -> bool:
    from google.cloud import tpu_v2
    S = tpu_v2.Node.State
    return node.state in (S.PREEMPTED, S.TERMINATED)


def _created_s(node) -> float:
    ct = node.create_time
    try:
        return ct.timestamp() if ct else time.time()
    except (AttributeError, ValueError, OSError):
        return time.time()


def _zone_of_name(name: str) -> str:
    parts = name.split("/")
    return parts[3] if len(parts) > 3 else ""


def _failed_reason(q) -> str:
    fd = q.state.failed_data
    err = getattr(fd, "error", None) if fd else None
    return (getattr(err, "message", "") or "no reason given") if err else "no reason given"


def _capacity_words(text: str) -> bool:
    low = text.lower()
    return any(w in low for w in ("capacity", "stockout", "resource_exhausted", "quota",
                                  "exhausted", "insufficient"))


__all__ = ["TpuSettings", "TpuBackend", "Slice", "slice_for", "make_client", "cloud_error",
           "DEFAULT_RUNTIME_VERSIONS", "SPEC_KEY"]
