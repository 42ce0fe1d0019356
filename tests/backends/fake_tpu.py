"""A test-only fake of the Cloud TPU v2 API that the real ``google-cloud-tpu`` client talks to.

:class:`FakeTpuServer` runs a gRPC server on ``127.0.0.1:<free port>`` serving
``google.cloud.tpu.v2.Tpu`` (nodes, queued resources, guest attributes) and
``google.longrunning.Operations`` (which the client's ``operation.result()`` polls on the same
channel). Connect the real client with :func:`make_client` (or :func:`make_async_client`)::

    with FakeTpuServer() as server:
        client = make_client(server.address)
        op = client.create_node(parent=..., node_id="n1", node=tpu_v2.Node(...))
        node = op.result(timeout=10, polling=FAST_POLLING)

Nothing leaves 127.0.0.1 and no credentials are involved (the channel is insecure).

Model of time
    State changes are timed events checked whenever the fake is read (every RPC and every
    test-side accessor runs due events first), so no timer threads exist. A node is CREATING
    for ``create_delay_s`` and then READY (or its create operation fails, see stock-outs);
    DeleteNode makes it DELETING for ``delete_delay_s``, then it is gone. A queued resource is
    ACCEPTED for ``queued_delay_s``, then PROVISIONING (its nodes exist, CREATING) for
    ``create_delay_s``, then ACTIVE with READY nodes.

Slice shape (workers = hosts = ``network_endpoints``), see :func:`slice_shape`
    * From ``accelerator_config`` (type + topology): chips = product of the topology.
      v2/v3/v4/v5p: 4 chips per host (v4/v5p ``2x2x1`` = one host, ``2x2x4`` = 4 hosts).
      v5e (V5LITE_POD)/v6e: a slice of <= 8 chips is one host (1x1, 2x2, 2x4), larger slices
      have 8 chips per host (4x4 -> 2 hosts, 16x16 -> 32), as in Google's v5e/v6e tables.
    * From ``accelerator_type`` "GEN-N": for v2/v3/v4/v5p N counts TensorCores (2 per chip,
      chips = N/2: "v5p-16" = 8 chips = 2 hosts); for "v5litepod-N" and "v6e-N" N is chips.
    * Topology dimensions: 3 for v4/v5p, 2 for v2/v3/v5e/v6e. Anything else is rejected with
      INVALID_ARGUMENT. The fields are stored as given (nothing is derived into the node).

Fault injection (attributes on the server, safe to set from a test while RPCs run)
    ``stockout``             set of generations ("v4", "v5e", "v5p", "v6e") with no capacity:
                             CreateNode's operation fails with RESOURCE_EXHAUSTED after
                             ``create_delay_s`` (the node disappears); queued resources wait in
                             WAITING_FOR_RESOURCES until the generation leaves the set.
    ``stockout_immediate``   fail the CreateNode RPC itself with RESOURCE_EXHAUSTED instead.
    ``stockout_fails_queued`` a stocked-out queued resource goes FAILED (failed_data.error).
    ``quota_chips``          {generation: chips}: a create (node or queued resource) beyond the
                             sum of chips held by existing nodes of that generation (any state,
                             also DELETING/PREEMPTED, plus queued resources not yet provisioned)
                             fails the RPC with RESOURCE_EXHAUSTED. Global, not per zone.
    ``fail_next(method, code, n=1)``  the next n calls of a gRPC method (e.g. "CreateNode",
                             "GetOperation") abort with that ``grpc.StatusCode``.
    ``preempt(node_name)``   node -> PREEMPTED with no endpoints (its queued resource, if any,
                             -> SUSPENDED).

Records: ``calls`` (gRPC method names in arrival order, failed ones included),
``requests`` ([(method, request)]), ``call_count(method)``.

Guest attributes: ``set_host_keys(node, worker, {"ssh-ed25519": "AAAA..."})`` publishes keys
under namespace "hostkeys" (``set_guest_attribute`` for any namespace). They are kept per node
name (they may be set before the node exists) and dropped when the node is deleted.
GetGuestAttributes returns one ``GuestAttributes`` per requested worker, in worker order (the
v2 message has no worker id field); ``query_path`` "" = all, "ns/" = a namespace, "ns/key" =
one key.

Not served (the client gets UNIMPLEMENTED): StopNode, StartNode, UpdateNode,
ResetQueuedResource, accelerator types, runtime versions, service identity, locations.
"""
from __future__ import annotations

import base64
import heapq
import itertools
import re
import threading
import time
import traceback
import uuid
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Iterable

import grpc
from google.api_core.future import polling
from google.cloud import tpu_v2
from google.cloud.tpu_v2 import TpuAsyncClient, TpuClient
from google.cloud.tpu_v2.services.tpu.transports import (TpuGrpcAsyncIOTransport,
                                                         TpuGrpcTransport)
from google.longrunning import operations_pb2
from google.protobuf import any_pb2, empty_pb2, timestamp_pb2
from google.rpc import status_pb2

TPU_SERVICE = "google.cloud.tpu.v2.Tpu"
OPERATIONS_SERVICE = "google.longrunning.Operations"
WORKER_PORT = 8470

# LRO polling for tests: the library's default first re-poll comes after up to 1 s (then up to
# 1.5 s, 2.25 s, ...). Pass ``op.result(timeout=..., polling=FAST_POLLING)`` to keep tests fast.
FAST_POLLING = polling.DEFAULT_POLLING.with_delay(initial=0.02, maximum=0.1, multiplier=1.5)

Node = tpu_v2.Node
QRState = tpu_v2.QueuedResourceState.State

_ID_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_PARENT_RE = re.compile(r"^projects/[^/]+/locations/[^/]+$")
_NODE_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+)/nodes/[^/]+$")
_QR_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+)/queuedResources/[^/]+$")
_OP_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+)/operations/[^/]+$")

_TYPE_GEN = {
    tpu_v2.AcceleratorConfig.Type.V2: "v2",
    tpu_v2.AcceleratorConfig.Type.V3: "v3",
    tpu_v2.AcceleratorConfig.Type.V4: "v4",
    tpu_v2.AcceleratorConfig.Type.V5LITE_POD: "v5e",
    tpu_v2.AcceleratorConfig.Type.V5P: "v5p",
    tpu_v2.AcceleratorConfig.Type.V6E: "v6e",
}
# accelerator_type prefix -> (generation, does N count TensorCores (2 per chip)?)
_PREFIX_GEN = {"v2": ("v2", True), "v3": ("v3", True), "v4": ("v4", True),
               "v5p": ("v5p", True), "v5litepod": ("v5e", False), "v6e": ("v6e", False)}
_TOPOLOGY_DIMS = {"v2": 2, "v3": 2, "v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}

# gRPC method name -> (request class, response serializer) of what is served.
_TPU_METHODS = ("CreateNode", "GetNode", "ListNodes", "DeleteNode", "GetGuestAttributes",
                "CreateQueuedResource", "GetQueuedResource", "ListQueuedResources",
                "DeleteQueuedResource")
_OPS_METHODS = ("GetOperation", "ListOperations", "DeleteOperation", "CancelOperation",
                "WaitOperation")
METHODS = _TPU_METHODS + _OPS_METHODS


@dataclass(frozen=True)
class SliceShape:
    generation: str     # "v2" "v3" "v4" "v5e" "v5p" "v6e"
    chips: int
    hosts: int          # = workers = network endpoints


def slice_shape(accelerator_type: str = "",
                accelerator_config: tpu_v2.AcceleratorConfig | None = None) -> SliceShape:
    """The shape of a slice from its accelerator_config (preferred when its type is set) or
    accelerator_type string. Raises ValueError when neither describes a slice."""
    if accelerator_config is not None and accelerator_config.type_:
        gen = _TYPE_GEN.get(accelerator_config.type_)
        if gen is None:
            raise ValueError(f"unsupported accelerator_config.type {accelerator_config.type_!r}")
        topo = accelerator_config.topology
        try:
            dims = [int(d) for d in topo.lower().split("x")]
        except ValueError:
            raise ValueError(f"bad topology {topo!r}") from None
        if len(dims) != _TOPOLOGY_DIMS[gen] or any(d < 1 for d in dims):
            raise ValueError(f"topology {topo!r} is not a {_TOPOLOGY_DIMS[gen]}-D topology "
                             f"of {gen}")
        chips = 1
        for d in dims:
            chips *= d
    elif accelerator_type:
        prefix, _, n = accelerator_type.rpartition("-")
        if prefix not in _PREFIX_GEN or not n.isdigit() or int(n) < 1:
            raise ValueError(f"unknown accelerator_type {accelerator_type!r}")
        gen, counts_cores = _PREFIX_GEN[prefix]
        n = int(n)
        if counts_cores and n % 2:
            raise ValueError(f"{accelerator_type!r}: {gen} counts TensorCores, 2 per chip")
        chips = n // 2 if counts_cores else n
    else:
        raise ValueError("node has neither accelerator_type nor accelerator_config")
    if gen in ("v5e", "v6e"):
        hosts = 1 if chips <= 8 else -(-chips // 8)
    else:
        hosts = -(-chips // 4)
    return SliceShape(gen, chips, hosts)


def make_client(address: str) -> TpuClient:
    """A real TpuClient on an insecure channel to ``address`` (no credentials, no TLS)."""
    return TpuClient(transport=TpuGrpcTransport(channel=grpc.insecure_channel(address)))


def make_async_client(address: str) -> TpuAsyncClient:
    """A real TpuAsyncClient on an insecure grpc.aio channel; call it inside a running loop."""
    return TpuAsyncClient(
        transport=TpuGrpcAsyncIOTransport(channel=grpc.aio.insecure_channel(address)))


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _copy(msg):
    return type(msg).deserialize(type(msg).serialize(msg))


def _now_ts() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(time.time_ns())
    return ts


def _pack(msg) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(type(msg).pb(msg) if hasattr(type(msg), "pb") else msg)
    return a


def _zone(name: str) -> str:
    return name.split("/")[3]


@dataclass
class _NodeRec:
    node: Node
    shape: SliceShape
    uid: str
    delete_due: float | None = None


@dataclass
class _QrRec:
    qr: tpu_v2.QueuedResource
    # (node name, node template, shape) per node the queued resource provisions
    specs: list
    delete_due: float | None = None

    @property
    def node_names(self) -> list[str]:
        return [name for name, _, _ in self.specs]


@dataclass
class _OpRec:
    pb: operations_pb2.Operation
    verb: str
    target: str
    uid: str = ""


class FakeTpuServer:
    """In-process fake Cloud TPU v2 API over gRPC on 127.0.0.1 (see the module docstring)."""

    def __init__(self, *, create_delay_s: float = 0.2, delete_delay_s: float = 0.1,
                 queued_delay_s: float = 0.05,
                 worker_ips: Callable[[str, int], list[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic, max_workers: int = 16,
                 on_gone: Callable[[str], None] | None = None):
        """``on_gone(node_name)``: called when a node stops running - deleted or preempted -
        so a test whose "VMs" run real processes on this machine can stop them, as a real
        deletion or preemption stops everything on the VM."""
        self.on_gone = on_gone
        self.create_delay_s = create_delay_s
        self.delete_delay_s = delete_delay_s
        self.queued_delay_s = queued_delay_s
        self.worker_ips = worker_ips or (lambda name, n: ["127.0.0.1"] * n)
        self.clock = clock
        self.stockout: set[str] = set()
        self.stockout_immediate = False
        self.stockout_fails_queued = False
        self.quota_chips: dict[str, int] = {}
        # host keys every node publishes when none were set for it: {"ssh-ed25519": "AAAA.."}
        self.default_host_keys: dict[str, str] = {}
        self.calls: list[str] = []
        self.requests: list[tuple[str, object]] = []

        self._lock = threading.RLock()
        self._nodes: dict[str, _NodeRec] = {}
        self._qrs: dict[str, _QrRec] = {}
        self._ops: dict[str, _OpRec] = {}
        self._guest: dict[str, dict[int, dict[tuple[str, str], str]]] = {}
        self._failures: dict[str, list[tuple[grpc.StatusCode, str]]] = {}
        self._events: list = []
        self._seq = itertools.count()
        self._ids = itertools.count(1000000000000000001)
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self.port: int | None = None

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("FakeTpuServer is not started")
        return f"127.0.0.1:{self.port}"

    def start(self) -> "FakeTpuServer":
        if self._server is not None:
            return self
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                                        thread_name_prefix="fake-tpu"))
        server.add_generic_rpc_handlers((self._tpu_handler(), self._ops_handler()))
        port = server.add_insecure_port("127.0.0.1:0")
        if not port:
            raise RuntimeError("could not bind 127.0.0.1:0")
        server.start()
        self._server, self.port = server, port
        return self

    def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    def __enter__(self) -> "FakeTpuServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- test-side controls and views -------------------------------------------------------

    def fail_next(self, method: str, code: grpc.StatusCode, n: int = 1,
                  message: str | None = None) -> None:
        """The next ``n`` calls of gRPC ``method`` (e.g. "CreateNode") abort with ``code``."""
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; served: {', '.join(METHODS)}")
        msg = message or f"injected {code.name} for {method}"
        with self._lock:
            self._failures.setdefault(method, []).extend([(code, msg)] * n)

    def call_count(self, method: str) -> int:
        with self._lock:
            return self.calls.count(method)

    def set_host_keys(self, node_name: str, worker_index: int, keys: dict[str, str]) -> None:
        """Publish SSH host keys {key type: key} of one worker under namespace "hostkeys"."""
        with self._lock:
            attrs = self._guest.setdefault(node_name, {}).setdefault(worker_index, {})
            for k in [k for k in attrs if k[0] == "hostkeys"]:
                del attrs[k]
            for key_type, value in keys.items():
                attrs[("hostkeys", key_type)] = value

    def set_guest_attribute(self, node_name: str, worker_index: int, namespace: str, key: str,
                            value: str) -> None:
        with self._lock:
            self._guest.setdefault(node_name, {}).setdefault(worker_index, {})[
                (namespace, key)] = value

    def preempt(self, node_name: str) -> None:
        """The node becomes PREEMPTED with no endpoints; its queued resource SUSPENDED."""
        with self._lock:
            self._advance()
            rec = self._nodes.get(node_name)
            if rec is None:
                raise KeyError(node_name)
            rec.node.state = Node.State.PREEMPTED
            rec.node.network_endpoints = []
            self._gone(node_name)
            qr = self._qrs.get(rec.node.queued_resource)
            if qr is not None and qr.delete_due is None:
                self._set_qr_state(qr, QRState.SUSPENDED, initiator="SERVICE")

    def node(self, name: str) -> Node | None:
        with self._lock:
            self._advance()
            rec = self._nodes.get(name)
            return _copy(rec.node) if rec else None

    def node_names(self) -> list[str]:
        with self._lock:
            self._advance()
            return sorted(self._nodes)

    def queued_resource(self, name: str) -> tpu_v2.QueuedResource | None:
        with self._lock:
            self._advance()
            rec = self._qrs.get(name)
            return _copy(rec.qr) if rec else None

    def operation(self, name: str) -> operations_pb2.Operation | None:
        with self._lock:
            self._advance()
            rec = self._ops.get(name)
            if rec is None:
                return None
            out = operations_pb2.Operation()
            out.CopyFrom(rec.pb)
            return out

    def chips_in_use(self, generation: str) -> int:
        with self._lock:
            self._advance()
            return self._chips_held(generation)

    # -- timed events -------------------------------------------------------------------------

    def _schedule(self, delay: float, fn: Callable[[], None]) -> float:
        due = self.clock() + delay
        heapq.heappush(self._events, (due, next(self._seq), fn))
        return due

    def _schedule_at(self, due: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (due, next(self._seq), fn))

    def _advance(self) -> None:
        """Run every due event (caller holds the lock)."""
        now = self.clock()
        while self._events and self._events[0][0] <= now:
            _, _, fn = heapq.heappop(self._events)
            fn()
        for rec in list(self._qrs.values()):
            if rec.qr.state.state == QRState.WAITING_FOR_RESOURCES:
                self._qr_try_provision(rec)

    # -- RPC plumbing -------------------------------------------------------------------------

    def _wrap(self, method: str, fn, locked: bool = True):
        def handler(request, context):
            with self._lock:
                self.calls.append(method)
                self.requests.append((method, request))
                queue = self._failures.get(method)
                injected = queue.pop(0) if queue else None
            if injected is not None:
                context.abort(*injected)
            try:
                if not locked:
                    return fn(request)
                with self._lock:
                    self._advance()
                    return fn(request)
            except _Abort as e:
                code, message = e.code, e.message
            except Exception:                   # a bug in the fake or a test callback
                code, message = grpc.StatusCode.INTERNAL, traceback.format_exc()
            context.abort(code, message)
        return handler

    def _tpu_handler(self) -> grpc.GenericRpcHandler:
        op_ser = operations_pb2.Operation.SerializeToString
        spec = {
            "CreateNode": (self._create_node, tpu_v2.CreateNodeRequest, op_ser),
            "GetNode": (self._get_node, tpu_v2.GetNodeRequest, Node.serialize),
            "ListNodes": (self._list_nodes, tpu_v2.ListNodesRequest,
                          tpu_v2.ListNodesResponse.serialize),
            "DeleteNode": (self._delete_node, tpu_v2.DeleteNodeRequest, op_ser),
            "GetGuestAttributes": (self._get_guest_attributes, tpu_v2.GetGuestAttributesRequest,
                                   tpu_v2.GetGuestAttributesResponse.serialize),
            "CreateQueuedResource": (self._create_qr, tpu_v2.CreateQueuedResourceRequest,
                                     op_ser),
            "GetQueuedResource": (self._get_qr, tpu_v2.GetQueuedResourceRequest,
                                  tpu_v2.QueuedResource.serialize),
            "ListQueuedResources": (self._list_qrs, tpu_v2.ListQueuedResourcesRequest,
                                    tpu_v2.ListQueuedResourcesResponse.serialize),
            "DeleteQueuedResource": (self._delete_qr, tpu_v2.DeleteQueuedResourceRequest,
                                     op_ser),
        }
        assert set(spec) == set(_TPU_METHODS)
        return grpc.method_handlers_generic_handler(TPU_SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(
                self._wrap(name, fn), request_deserializer=req.deserialize,
                response_serializer=ser)
            for name, (fn, req, ser) in spec.items()})

    def _ops_handler(self) -> grpc.GenericRpcHandler:
        op_ser = operations_pb2.Operation.SerializeToString
        empty_ser = empty_pb2.Empty.SerializeToString
        spec = {
            "GetOperation": (self._get_op, operations_pb2.GetOperationRequest, op_ser, True),
            "ListOperations": (self._list_ops, operations_pb2.ListOperationsRequest,
                               operations_pb2.ListOperationsResponse.SerializeToString, True),
            "DeleteOperation": (self._delete_op, operations_pb2.DeleteOperationRequest,
                                empty_ser, True),
            "CancelOperation": (self._cancel_op, operations_pb2.CancelOperationRequest,
                                empty_ser, True),
            "WaitOperation": (self._wait_op, operations_pb2.WaitOperationRequest, op_ser,
                              False),
        }
        assert set(spec) == set(_OPS_METHODS)
        return grpc.method_handlers_generic_handler(OPERATIONS_SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(
                self._wrap(name, fn, locked), request_deserializer=req.FromString,
                response_serializer=ser)
            for name, (fn, req, ser, locked) in spec.items()})

    # -- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _parent(parent: str, allow_wildcard: bool = False) -> str:
        if not _PARENT_RE.match(parent) or (_zone(parent) == "-" and not allow_wildcard):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"invalid parent {parent!r}: want projects/P/locations/ZONE")
        return parent

    @staticmethod
    def _check_id(kind: str, rid: str) -> None:
        if not _ID_RE.match(rid):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"invalid {kind} {rid!r}: lowercase letters, digits and hyphens, "
                         "starting with a letter, at most 63 characters")

    def _node_rec(self, name: str) -> _NodeRec:
        if not _NODE_RE.match(name):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid node name {name!r}")
        rec = self._nodes.get(name)
        if rec is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"Resource '{name}' was not found")
        return rec

    def _qr_rec(self, name: str) -> _QrRec:
        if not _QR_RE.match(name):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"invalid queued resource name {name!r}")
        rec = self._qrs.get(name)
        if rec is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"Resource '{name}' was not found")
        return rec

    @staticmethod
    def _shape(node: Node) -> SliceShape:
        cfg = node.accelerator_config if "accelerator_config" in node else None
        try:
            shape = slice_shape(node.accelerator_type, cfg)
        except ValueError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if not node.runtime_version:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "node.runtime_version is required")
        return shape

    def _chips_held(self, gen: str) -> int:
        held = sum(r.shape.chips for r in self._nodes.values() if r.shape.generation == gen)
        for q in self._qrs.values():
            if q.qr.state.state in (QRState.ACCEPTED, QRState.WAITING_FOR_RESOURCES):
                held += sum(s.chips for _, _, s in q.specs if s.generation == gen)
        return held

    def _check_quota(self, shapes: Iterable[SliceShape], zone: str) -> None:
        want: dict[str, int] = {}
        for s in shapes:
            want[s.generation] = want.get(s.generation, 0) + s.chips
        for gen, chips in want.items():
            limit = self.quota_chips.get(gen)
            if limit is not None and self._chips_held(gen) + chips > limit:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"Quota limit 'TPU{gen.upper()}ChipsPerProjectPerZone' has been "
                             f"exceeded. Limit: {limit} in zone {zone} (held "
                             f"{self._chips_held(gen)}, requested {chips}).")

    @staticmethod
    def _stockout_message(zone: str) -> str:
        return (f'There is no more capacity in the zone "{zone}"; you can try in another zone '
                "where Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/"
                f"regions) [EID: 0x{uuid.uuid4().hex[:16]}]")

    def _page(self, items: list, page_size: int, page_token: str) -> tuple[list, str]:
        """``items``: [(name, obj)] sorted by name. Tokens are the last name returned."""
        start = 0
        if page_token:
            try:
                after = base64.b64decode(page_token.encode(), altchars=b"-_",
                                         validate=True).decode()
            except Exception:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"invalid page_token {page_token!r}") from None
            start = next((i for i, (n, _) in enumerate(items) if n > after), len(items))
        if page_size <= 0:
            page_size = len(items) or 1
        chunk = items[start:start + page_size]
        more = start + page_size < len(items)
        token = base64.urlsafe_b64encode(chunk[-1][0].encode()).decode() if more else ""
        return [obj for _, obj in chunk], token

    def _list_under(self, table: dict, parent: str, kind: str) -> list:
        parent = self._parent(parent, allow_wildcard=True)
        project = parent.split("/")[1]
        out = []
        for name in sorted(table):
            p = name.split("/")
            if p[1] == project and p[4] == kind and _zone(parent) in ("-", p[3]):
                out.append((name, table[name]))
        return out

    # -- operations -------------------------------------------------------------------------

    def _new_op(self, location: str, verb: str, target: str, uid: str = "") -> _OpRec:
        name = (f"{location}/operations/operation-{time.time_ns() // 1000000}-"
                f"{uuid.uuid4().hex[:13]}-{uuid.uuid4().hex[:8]}-{uuid.uuid4().hex[:8]}")
        meta = tpu_v2.OperationMetadata(target=target, verb=verb, api_version="v2")
        meta.create_time = _now_ts()
        pb = operations_pb2.Operation(name=name, done=False, metadata=_pack(meta))
        rec = _OpRec(pb=pb, verb=verb, target=target, uid=uid)
        self._ops[name] = rec
        return rec

    def _finish_op(self, rec: _OpRec, response=None, code: int = 0, message: str = "") -> None:
        if rec.pb.done:
            return
        meta = tpu_v2.OperationMetadata()
        rec.pb.metadata.Unpack(tpu_v2.OperationMetadata.pb(meta))
        meta.end_time = _now_ts()
        rec.pb.metadata.CopyFrom(_pack(meta))
        rec.pb.done = True
        if code:
            rec.pb.error.CopyFrom(status_pb2.Status(code=code, message=message))
        else:
            rec.pb.response.CopyFrom(_pack(response if response is not None
                                           else empty_pb2.Empty()))

    @staticmethod
    def _op_out(rec: _OpRec) -> operations_pb2.Operation:
        out = operations_pb2.Operation()
        out.CopyFrom(rec.pb)
        return out

    def _op_rec(self, name: str) -> _OpRec:
        rec = self._ops.get(name)
        if rec is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"Operation '{name}' was not found")
        return rec

    def _get_op(self, req):
        return self._op_out(self._op_rec(req.name))

    def _list_ops(self, req):
        if not _PARENT_RE.match(req.name):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"invalid name {req.name!r}: want projects/P/locations/ZONE")
        prefix = req.name + "/operations/"
        items = [(n, self._op_out(r)) for n, r in sorted(self._ops.items())
                 if n.startswith(prefix)]
        ops, token = self._page(items, req.page_size, req.page_token)
        return operations_pb2.ListOperationsResponse(operations=ops, next_page_token=token)

    def _delete_op(self, req):
        self._op_rec(req.name)
        del self._ops[req.name]
        return empty_pb2.Empty()

    def _cancel_op(self, req):
        rec = self._op_rec(req.name)
        if rec.pb.done:
            return empty_pb2.Empty()
        meta = tpu_v2.OperationMetadata()
        rec.pb.metadata.Unpack(tpu_v2.OperationMetadata.pb(meta))
        meta.cancel_requested = True
        rec.pb.metadata.CopyFrom(_pack(meta))
        if rec.verb == "create":
            node = self._nodes.get(rec.target)
            if node is not None and node.uid == rec.uid and node.node.state == Node.State.CREATING:
                self._drop_node(rec.target)
        self._finish_op(rec, code=grpc.StatusCode.CANCELLED.value[0],
                        message="Operation was cancelled")
        return empty_pb2.Empty()

    def _wait_op(self, req):
        limit = req.timeout.ToTimedelta().total_seconds() if req.HasField("timeout") else 30.0
        deadline = time.monotonic() + min(limit, 30.0)
        while True:
            with self._lock:
                self._advance()
                rec = self._op_rec(req.name)
                if rec.pb.done or time.monotonic() >= deadline:
                    return self._op_out(rec)
            time.sleep(0.005)

    # -- nodes ------------------------------------------------------------------------------

    def _add_node(self, name: str, template: Node, shape: SliceShape,
                  queued_resource: str = "", spot: bool = False) -> _NodeRec:
        node = _copy(template)
        for f in ("state", "network_endpoints", "health", "id", "create_time", "symptoms",
                  "queued_resource", "health_description", "multislice_node"):
            node.__delattr__(f)
        node.name = name
        node.state = Node.State.CREATING
        node.create_time = _now_ts()
        node.id = str(next(self._ids))
        node.api_version = Node.ApiVersion.V2
        if queued_resource:
            node.queued_resource = queued_resource
        if spot:
            node.scheduling_config.spot = True
        rec = _NodeRec(node=node, shape=shape, uid=node.id)
        self._nodes[name] = rec
        return rec

    def _make_ready(self, name: str, uid: str) -> Node | None:
        """CREATING -> READY with endpoints; None when the node changed meanwhile."""
        rec = self._nodes.get(name)
        if rec is None or rec.uid != uid or rec.node.state != Node.State.CREATING:
            return None
        ips = list(self.worker_ips(name, rec.shape.hosts))
        if len(ips) != rec.shape.hosts:
            raise ValueError(f"worker_ips({name!r}, {rec.shape.hosts}) returned {len(ips)} "
                             "addresses")
        rec.node.network_endpoints = [tpu_v2.NetworkEndpoint(ip_address=ip, port=WORKER_PORT)
                                      for ip in ips]
        rec.node.state = Node.State.READY
        rec.node.health = Node.Health.HEALTHY
        return rec.node

    def _gone(self, name: str) -> None:
        if self.on_gone is not None:
            self.on_gone(name)

    def _drop_node(self, name: str) -> None:
        rec = self._nodes.pop(name, None)
        self._guest.pop(name, None)
        if rec is None:
            return
        self._gone(name)
        qr = self._qrs.get(rec.node.queued_resource)
        if qr is not None and qr.delete_due is None and qr.qr.state.state in (
                QRState.ACTIVE, QRState.PROVISIONING):
            self._set_qr_state(qr, QRState.SUSPENDED, initiator="USER")

    def _create_node(self, req):
        parent = self._parent(req.parent)
        self._check_id("node_id", req.node_id)
        name = f"{parent}/nodes/{req.node_id}"
        if name in self._nodes:
            raise _Abort(grpc.StatusCode.ALREADY_EXISTS, f"Resource '{name}' already exists")
        shape = self._shape(req.node)
        zone = _zone(parent)
        self._check_quota([shape], zone)
        stocked = shape.generation in self.stockout
        if stocked and self.stockout_immediate:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._stockout_message(zone))
        rec = self._add_node(name, req.node, shape)
        op = self._new_op(parent, "create", name, rec.uid)
        uid = rec.uid

        def finish():
            if stocked:
                cur = self._nodes.get(name)
                if cur is not None and cur.uid == uid:
                    self._drop_node(name)
                self._finish_op(op, code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                message=self._stockout_message(zone))
                return
            node = self._make_ready(name, uid)
            if node is None:
                self._finish_op(op, code=grpc.StatusCode.ABORTED.value[0],
                                message=f"Node '{name}' was deleted or changed while it was "
                                        "being created")
            else:
                self._finish_op(op, _copy(node))
        self._schedule(self.create_delay_s, finish)
        return self._op_out(op)

    def _get_node(self, req):
        return _copy(self._node_rec(req.name).node)

    def _list_nodes(self, req):
        items = [(n, _copy(r.node)) for n, r in self._list_under(self._nodes, req.parent,
                                                                  "nodes")]
        nodes, token = self._page(items, req.page_size, req.page_token)
        return tpu_v2.ListNodesResponse(nodes=nodes, next_page_token=token)

    def _delete_node(self, req):
        rec = self._node_rec(req.name)
        op = self._new_op(_NODE_RE.match(req.name).group(1), "delete", req.name, rec.uid)
        self._delete_node_rec(req.name, rec, lambda: self._finish_op(op))
        return self._op_out(op)

    def _delete_node_rec(self, name: str, rec: _NodeRec, then: Callable[[], None]) -> None:
        if rec.delete_due is None:
            rec.node.state = Node.State.DELETING
            uid = rec.uid

            def gone():
                cur = self._nodes.get(name)
                if cur is not None and cur.uid == uid:
                    self._drop_node(name)
            rec.delete_due = self._schedule(self.delete_delay_s, gone)
        self._schedule_at(rec.delete_due, then)

    def _get_guest_attributes(self, req):
        rec = self._node_rec(req.name)
        n = rec.shape.hosts
        if req.worker_ids:
            try:
                workers = [int(w) for w in req.worker_ids]
            except ValueError:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"invalid worker_ids {list(req.worker_ids)}") from None
            if any(not 0 <= w < n for w in workers):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"worker_ids {list(req.worker_ids)} out of range 0..{n - 1}")
        else:
            workers = list(range(n))
        ns, _, key = req.query_path.partition("/")
        per_node = self._guest.get(req.name, {})
        if not per_node and self.default_host_keys:
            # every VM of the fake boots with the same host keys (tests whose workers are
            # one local sshd)
            per_node = {w: {("hostkeys", t): v for t, v in self.default_host_keys.items()}
                        for w in workers}
        out = []
        for w in workers:
            items = [tpu_v2.GuestAttributesEntry(namespace=a, key=k, value=v)
                     for (a, k), v in sorted(per_node.get(w, {}).items())
                     if (not ns or a == ns) and (not key or k == key)]
            out.append(tpu_v2.GuestAttributes(
                query_path=req.query_path, query_value=tpu_v2.GuestAttributesValue(items=items)))
        return tpu_v2.GetGuestAttributesResponse(guest_attributes=out)

    # -- queued resources -----------------------------------------------------------------------

    def _set_qr_state(self, rec: _QrRec, state, initiator: str = "", error=None) -> None:
        st = tpu_v2.QueuedResourceState(state=state)
        field = {QRState.ACCEPTED: "accepted_data", QRState.PROVISIONING: "provisioning_data",
                 QRState.ACTIVE: "active_data", QRState.DELETING: "deleting_data",
                 QRState.SUSPENDED: "suspended_data", QRState.FAILED: "failed_data",
                 QRState.CREATING: "creating_data"}.get(state)
        if field == "failed_data":
            st.failed_data = tpu_v2.QueuedResourceState.FailedData(error=error)
        elif field:
            setattr(st, field, getattr(tpu_v2.QueuedResourceState,
                                       "".join(p.title() for p in field.split("_")))())
        if initiator:
            st.state_initiator = getattr(tpu_v2.QueuedResourceState.StateInitiator, initiator)
        rec.qr.state = st

    def _create_qr(self, req):
        parent = self._parent(req.parent)
        self._check_id("queued_resource_id", req.queued_resource_id)
        name = f"{parent}/queuedResources/{req.queued_resource_id}"
        if name in self._qrs:
            raise _Abort(grpc.StatusCode.ALREADY_EXISTS, f"Resource '{name}' already exists")
        if not req.queued_resource.tpu.node_spec:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         "queued_resource.tpu.node_spec is required")
        specs = []
        for spec in req.queued_resource.tpu.node_spec:
            sparent = self._parent(spec.parent)
            shape = self._shape(spec.node)
            if "multislice_params" in spec:
                prefix = spec.multislice_params.node_id_prefix or req.queued_resource_id
                ids = [f"{prefix}-{i}" for i in range(spec.multislice_params.node_count)]
            else:
                ids = [spec.node_id]
            for nid in ids:
                self._check_id("node_id", nid)
                nname = f"{sparent}/nodes/{nid}"
                if nname in self._nodes or any(nname == s[0] for s in specs):
                    raise _Abort(grpc.StatusCode.ALREADY_EXISTS,
                                 f"Resource '{nname}' already exists")
                specs.append((nname, spec.node, shape))
        self._check_quota([s for _, _, s in specs], _zone(parent))
        qr = _copy(req.queued_resource)
        qr.name = name
        qr.create_time = _now_ts()
        rec = _QrRec(qr=qr, specs=specs)
        self._set_qr_state(rec, QRState.ACCEPTED)
        self._qrs[name] = rec
        self._schedule(self.queued_delay_s, lambda: self._qr_try_provision(rec))
        op = self._new_op(parent, "create", name)
        self._finish_op(op, _copy(qr))
        return self._op_out(op)

    def _qr_try_provision(self, rec: _QrRec) -> None:
        if self._qrs.get(rec.qr.name) is not rec or rec.qr.state.state not in (
                QRState.ACCEPTED, QRState.WAITING_FOR_RESOURCES):
            return
        gens = {s.generation for _, _, s in rec.specs}
        if gens & self.stockout:
            if self.stockout_fails_queued:
                err = status_pb2.Status(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                        message=self._stockout_message(_zone(rec.qr.name)))
                self._set_qr_state(rec, QRState.FAILED, initiator="SERVICE", error=err)
            elif rec.qr.state.state != QRState.WAITING_FOR_RESOURCES:
                self._set_qr_state(rec, QRState.WAITING_FOR_RESOURCES)
            return
        if any(name in self._nodes for name, _, _ in rec.specs):
            err = status_pb2.Status(code=grpc.StatusCode.ALREADY_EXISTS.value[0],
                                    message="a node of this queued resource already exists")
            self._set_qr_state(rec, QRState.FAILED, initiator="SERVICE", error=err)
            return
        self._set_qr_state(rec, QRState.PROVISIONING)
        spot = "spot" in rec.qr
        made = [(name, self._add_node(name, tmpl, shape, rec.qr.name, spot).uid)
                for name, tmpl, shape in rec.specs]

        def ready():
            ok = [self._make_ready(name, uid) is not None for name, uid in made]
            if all(ok) and self._qrs.get(rec.qr.name) is rec and (
                    rec.qr.state.state == QRState.PROVISIONING):
                self._set_qr_state(rec, QRState.ACTIVE)
        self._schedule(self.create_delay_s, ready)

    def _get_qr(self, req):
        return _copy(self._qr_rec(req.name).qr)

    def _list_qrs(self, req):
        items = [(n, _copy(r.qr)) for n, r in self._list_under(self._qrs, req.parent,
                                                                "queuedResources")]
        qrs, token = self._page(items, req.page_size, req.page_token)
        return tpu_v2.ListQueuedResourcesResponse(queued_resources=qrs, next_page_token=token)

    def _delete_qr(self, req):
        rec = self._qr_rec(req.name)
        live = [n for n in rec.node_names
                if n in self._nodes and self._nodes[n].node.queued_resource == req.name]
        if live and not req.force and rec.delete_due is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"Queued resource '{req.name}' has nodes {live}; delete them first "
                         "or delete with force")
        op = self._new_op(_QR_RE.match(req.name).group(1), "delete", req.name)
        if rec.delete_due is None:
            self._set_qr_state(rec, QRState.DELETING, initiator="USER")
            for n in live:
                self._delete_node_rec(n, self._nodes[n], lambda: None)

            def gone():
                if self._qrs.get(req.name) is rec:
                    del self._qrs[req.name]
            rec.delete_due = self._schedule(self.delete_delay_s, gone)
        self._schedule_at(rec.delete_due, lambda: self._finish_op(op))
        return self._op_out(op)
