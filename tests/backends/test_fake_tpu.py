"""The fake Cloud TPU v2 API (fake_tpu.py) driven only through the real google-cloud-tpu client
over gRPC on 127.0.0.1: node and queued-resource life cycles, slice shapes, pagination, LRO
results and errors, fault injection (stock-outs, quotas, injected status codes, preemption),
guest-attribute host keys, the operations service, and the asyncio client."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import grpc
import pytest

pytest.importorskip("google.cloud.tpu_v2")

from google.api_core import exceptions as gexc                      # noqa: E402
from google.cloud import tpu_v2                                     # noqa: E402
from google.longrunning import operations_pb2                       # noqa: E402
from google.protobuf import empty_pb2                               # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from fake_tpu import (FAST_POLLING, FakeTpuServer, make_async_client,  # noqa: E402
                      make_client)

P = "projects/proj/locations/us-east5-b"
OTHER_ZONE = "projects/proj/locations/us-central2-b"
T = tpu_v2.AcceleratorConfig.Type
State = tpu_v2.Node.State
QRState = tpu_v2.QueuedResourceState.State


def node_spec(type_=T.V6E, topology="2x4", accelerator_type="", **kw) -> tpu_v2.Node:
    if accelerator_type:
        return tpu_v2.Node(accelerator_type=accelerator_type, runtime_version="v2-alpha-tpuv6e",
                           **kw)
    return tpu_v2.Node(accelerator_config=tpu_v2.AcceleratorConfig(type_=type_,
                                                                   topology=topology),
                       runtime_version="v2-alpha-tpuv6e", **kw)


def create(client, node_id, node=None, parent=P, timeout=10):
    op = client.create_node(parent=parent, node_id=node_id, node=node or node_spec())
    return op.result(timeout=timeout, polling=FAST_POLLING)


def wait_for(fn, timeout=5.0, every=0.01):
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(every)


@pytest.fixture
def server():
    with FakeTpuServer(create_delay_s=0.05, delete_delay_s=0.03, queued_delay_s=0.03) as s:
        yield s


@pytest.fixture
def client(server):
    c = make_client(server.address)
    yield c
    c.transport.close()


# -- nodes ----------------------------------------------------------------------------------

def test_create_v6e_2x4_goes_creating_then_ready_with_one_endpoint():
    with FakeTpuServer() as server:                     # the default 0.2 s creation
        client = make_client(server.address)
        t0 = time.monotonic()
        op = client.create_node(parent=P, node_id="n1", node=node_spec(
            labels={"neuscale-pool": "p1"}, metadata={"startup-script": "echo hi"},
            scheduling_config=tpu_v2.SchedulingConfig(spot=True)))
        assert not op.done(retry=None)
        early = client.get_node(name=f"{P}/nodes/n1")
        assert early.state == State.CREATING and not early.network_endpoints
        node = op.result(timeout=10, polling=FAST_POLLING)
        assert time.monotonic() - t0 >= 0.2
        assert node.name == f"{P}/nodes/n1"
        assert node.state == State.READY
        assert [(e.ip_address, e.port) for e in node.network_endpoints] == [("127.0.0.1", 8470)]
        assert node.labels["neuscale-pool"] == "p1"
        assert node.metadata["startup-script"] == "echo hi"
        assert node.scheduling_config.spot
        assert node.accelerator_config.topology == "2x4"
        assert node.runtime_version == "v2-alpha-tpuv6e"
        assert node.create_time.year >= 2024 and node.id
        assert op.metadata.verb == "create" and op.metadata.target == node.name
        assert client.get_node(name=node.name) == node
        client.transport.close()


@pytest.mark.parametrize("kw, workers", [
    (dict(type_=T.V5P, topology="2x2x4"), 4),           # 16 chips, 4 per host
    (dict(type_=T.V5P, topology="2x2x1"), 1),
    (dict(type_=T.V4, topology="2x2x2"), 2),
    (dict(type_=T.V5LITE_POD, topology="2x2"), 1),
    (dict(type_=T.V6E, topology="1x1"), 1),
    (dict(type_=T.V6E, topology="4x4"), 2),             # > 8 chips: 8 per host
    (dict(type_=T.V6E, topology="16x16"), 32),
    (dict(accelerator_type="v5p-16"), 2),               # 16 TensorCores = 8 chips
    (dict(accelerator_type="v4-8"), 1),
    (dict(accelerator_type="v5litepod-8"), 1),
    (dict(accelerator_type="v5litepod-16"), 2),
    (dict(accelerator_type="v6e-64"), 8),
])
def test_workers_per_slice(server, client, kw, workers):
    server.create_delay_s = 0
    server.worker_ips = lambda name, n: [f"10.0.0.{i + 1}" for i in range(n)]
    node = create(client, "n1", node_spec(**kw))
    assert [e.ip_address for e in node.network_endpoints] == [
        f"10.0.0.{i + 1}" for i in range(workers)]
    assert {e.port for e in node.network_endpoints} == {8470}


@pytest.mark.parametrize("node", [
    tpu_v2.Node(accelerator_type="v6e-8"),                                  # no runtime
    tpu_v2.Node(runtime_version="r"),                                       # no accelerator
    tpu_v2.Node(accelerator_type="v7x-8", runtime_version="r"),
    tpu_v2.Node(accelerator_config=tpu_v2.AcceleratorConfig(type_=T.V5P, topology="2x2"),
                runtime_version="r"),                                       # v5p is 3-D
])
def test_bad_create_requests_are_invalid_argument(server, client, node):
    with pytest.raises(gexc.InvalidArgument):
        client.create_node(parent=P, node_id="n1", node=node)
    with pytest.raises(gexc.InvalidArgument):
        client.create_node(parent=P, node_id="Bad_Id", node=node_spec())
    assert server.node_names() == []


def test_get_list_paginate_delete(server, client):
    for i in range(5):
        create(client, f"n{i}")
    create(client, "far", parent=OTHER_ZONE)
    pager = client.list_nodes(request=tpu_v2.ListNodesRequest(parent=P, page_size=2))
    assert [n.name.rsplit("/", 1)[1] for n in pager] == ["n0", "n1", "n2", "n3", "n4"]
    assert server.call_count("ListNodes") == 3                  # pages of 2, 2, 1
    assert [n.name for n in client.list_nodes(parent=OTHER_ZONE)] == [f"{OTHER_ZONE}/nodes/far"]
    assert len(list(client.list_nodes(parent="projects/proj/locations/-"))) == 6
    assert list(client.list_nodes(parent="projects/other/locations/-")) == []

    op = client.delete_node(name=f"{P}/nodes/n2")
    assert client.get_node(name=f"{P}/nodes/n2").state == State.DELETING
    assert op.result(timeout=10, polling=FAST_POLLING) == empty_pb2.Empty()
    assert op.metadata.verb == "delete"
    with pytest.raises(gexc.NotFound):
        client.get_node(name=f"{P}/nodes/n2")
    with pytest.raises(gexc.NotFound):
        client.delete_node(name=f"{P}/nodes/n2")
    assert [n.name.rsplit("/", 1)[1] for n in client.list_nodes(parent=P)] == [
        "n0", "n1", "n3", "n4"]


def test_duplicate_node_id_is_already_exists(server, client):
    create(client, "n1")
    with pytest.raises(gexc.AlreadyExists):
        client.create_node(parent=P, node_id="n1", node=node_spec())
    assert server.call_count("CreateNode") == 2
    assert server.node_names() == [f"{P}/nodes/n1"]


# -- fault injection --------------------------------------------------------------------------

def test_stockout_fails_the_operation_with_resource_exhausted(server, client):
    server.stockout = {"v5p"}
    op = client.create_node(parent=P, node_id="n1", node=node_spec(T.V5P, "2x2x1"))
    with pytest.raises(gexc.ResourceExhausted) as e:
        op.result(timeout=10, polling=FAST_POLLING)
    assert e.value.grpc_status_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.code == 429
    assert 'no more capacity in the zone "us-east5-b"' in e.value.message
    assert op.operation.error.code == 8
    assert server.node(f"{P}/nodes/n1") is None
    create(client, "n2", node_spec(T.V6E, "2x4"))               # other generations unaffected

    server.stockout_immediate = True
    with pytest.raises(gexc.ResourceExhausted, match="no more capacity"):
        client.create_node(parent=P, node_id="n3", node=node_spec(accelerator_type="v5p-8"))
    server.stockout = set()
    assert create(client, "n3", node_spec(accelerator_type="v5p-8")).state == State.READY


def test_quota_chips_counts_live_nodes(server, client):
    server.quota_chips = {"v6e": 8}
    create(client, "a", node_spec(T.V6E, "2x2"))
    create(client, "b", node_spec(T.V6E, "2x2"))
    with pytest.raises(gexc.ResourceExhausted, match="Quota"):
        client.create_node(parent=P, node_id="c", node=node_spec(T.V6E, "1x1"))
    create(client, "v5e", node_spec(T.V5LITE_POD, "2x4"))       # other generation: no quota
    client.delete_node(name=f"{P}/nodes/a").result(timeout=10, polling=FAST_POLLING)
    assert create(client, "c", node_spec(T.V6E, "2x2")).state == State.READY
    assert server.chips_in_use("v6e") == 8


@pytest.mark.parametrize("code, exc", [
    (grpc.StatusCode.UNAVAILABLE, gexc.ServiceUnavailable),
    (grpc.StatusCode.INTERNAL, gexc.InternalServerError),
    (grpc.StatusCode.PERMISSION_DENIED, gexc.PermissionDenied),
    (grpc.StatusCode.DEADLINE_EXCEEDED, gexc.DeadlineExceeded),
])
def test_injected_errors_surface_unretried(server, client, code, exc):
    """TpuClient's generated methods carry no default retry: one injected failure = one
    exception, one call on the wire."""
    create(client, "n1")
    name = f"{P}/nodes/n1"
    calls = {
        "GetNode": lambda: client.get_node(name=name),
        "ListNodes": lambda: list(client.list_nodes(parent=P)),
        "CreateNode": lambda: client.create_node(parent=P, node_id="n2", node=node_spec()),
        "DeleteNode": lambda: client.delete_node(name=name),
    }
    for method, call in calls.items():
        before = server.call_count(method)
        server.fail_next(method, code)
        with pytest.raises(exc):
            call()
        assert server.call_count(method) == before + 1, method
    assert server.node_names() == [name]                        # the failed calls did nothing
    assert client.get_node(name=name).state == State.READY      # and the next call works


def test_lro_polling_retries_unavailable_but_not_internal(server, client):
    op = client.create_node(parent=P, node_id="n1", node=node_spec())
    server.fail_next("GetOperation", grpc.StatusCode.UNAVAILABLE, n=2)
    assert op.result(timeout=10, polling=FAST_POLLING).state == State.READY
    assert server.call_count("GetOperation") >= 3

    op = client.create_node(parent=P, node_id="n2", node=node_spec())
    server.fail_next("GetOperation", grpc.StatusCode.INTERNAL)
    with pytest.raises(gexc.InternalServerError):
        op.result(timeout=10, polling=FAST_POLLING)


def test_preempt_spot_node(server, client):
    node = create(client, "n1", node_spec(scheduling_config=tpu_v2.SchedulingConfig(spot=True)))
    server.preempt(node.name)
    got = client.get_node(name=node.name)
    assert got.state == State.PREEMPTED and not got.network_endpoints
    client.delete_node(name=node.name).result(timeout=10, polling=FAST_POLLING)
    assert server.node_names() == []


def test_a_node_that_stops_running_is_reported_once_it_is_gone(client, server):
    """``on_gone``: a preempted node at once, a deleted one when its deletion is done (not
    while it is DELETING) - what stops the processes a test ran on the "VM"."""
    gone = []
    server.on_gone = gone.append
    a = create(client, "n1", node_spec(scheduling_config=tpu_v2.SchedulingConfig(spot=True)))
    b = create(client, "n2", node_spec())
    server.preempt(a.name)
    assert gone == [a.name]
    op = client.delete_node(name=b.name)
    assert client.get_node(name=b.name).state == State.DELETING and gone == [a.name]
    op.result(timeout=10, polling=FAST_POLLING)
    assert server.node_names() == [a.name] and gone == [a.name, b.name]


# -- queued resources ---------------------------------------------------------------------------

def qr_request(qr_id="qr1", node_id="qn1", node=None, **kw):
    return tpu_v2.CreateQueuedResourceRequest(
        parent=P, queued_resource_id=qr_id,
        queued_resource=tpu_v2.QueuedResource(
            tpu=tpu_v2.QueuedResource.Tpu(node_spec=[tpu_v2.QueuedResource.Tpu.NodeSpec(
                parent=P, node_id=node_id, node=node or node_spec())]), **kw))


def test_queued_resource_lifecycle(server, client):
    name = f"{P}/queuedResources/qr1"
    node_name = f"{P}/nodes/qn1"
    op = client.create_queued_resource(request=qr_request(spot=tpu_v2.QueuedResource.Spot()))
    qr = op.result(timeout=10, polling=FAST_POLLING)
    assert qr.name == name and qr.state.state == QRState.ACCEPTED and "spot" in qr

    seen = set()

    def active():
        s = client.get_queued_resource(name=name).state.state
        seen.add(s)
        return s == QRState.ACTIVE
    wait_for(active)
    assert QRState.PROVISIONING in seen or QRState.ACCEPTED in seen
    node = client.get_node(name=node_name)
    assert node.state == State.READY and node.queued_resource == name
    assert node.scheduling_config.spot and len(node.network_endpoints) == 1
    assert [q.name for q in client.list_queued_resources(parent=P)] == [name]
    with pytest.raises(gexc.AlreadyExists):
        client.create_queued_resource(request=qr_request())

    with pytest.raises(gexc.FailedPrecondition):
        client.delete_queued_resource(name=name)
    op = client.delete_queued_resource(request=tpu_v2.DeleteQueuedResourceRequest(
        name=name, force=True))
    assert client.get_queued_resource(name=name).state.state == QRState.DELETING
    assert client.get_node(name=node_name).state == State.DELETING
    op.result(timeout=10, polling=FAST_POLLING)
    with pytest.raises(gexc.NotFound):
        client.get_queued_resource(name=name)
    with pytest.raises(gexc.NotFound):
        client.get_node(name=node_name)


def test_queued_resource_without_nodes_deletes_without_force(server, client):
    name = f"{P}/queuedResources/qr1"
    client.create_queued_resource(request=qr_request()).result(timeout=10, polling=FAST_POLLING)
    wait_for(lambda: client.get_queued_resource(name=name).state.state == QRState.ACTIVE)
    client.delete_node(name=f"{P}/nodes/qn1").result(timeout=10, polling=FAST_POLLING)
    assert client.get_queued_resource(name=name).state.state == QRState.SUSPENDED
    client.delete_queued_resource(name=name).result(timeout=10, polling=FAST_POLLING)
    assert list(client.list_queued_resources(parent=P)) == []


def test_queued_resource_waits_out_a_stockout(server, client):
    server.stockout = {"v5p"}
    name = f"{P}/queuedResources/qr1"
    client.create_queued_resource(request=qr_request(node=node_spec(T.V5P, "2x2x2"))).result(
        timeout=10, polling=FAST_POLLING)
    wait_for(lambda: client.get_queued_resource(name=name).state.state
             == QRState.WAITING_FOR_RESOURCES)
    time.sleep(0.1)
    assert client.get_queued_resource(name=name).state.state == QRState.WAITING_FOR_RESOURCES
    with pytest.raises(gexc.NotFound):
        client.get_node(name=f"{P}/nodes/qn1")
    server.stockout = set()
    wait_for(lambda: client.get_queued_resource(name=name).state.state == QRState.ACTIVE)
    assert len(client.get_node(name=f"{P}/nodes/qn1").network_endpoints) == 2


def test_queued_resource_stockout_can_fail(server, client):
    server.stockout = {"v6e"}
    server.stockout_fails_queued = True
    name = f"{P}/queuedResources/qr1"
    client.create_queued_resource(request=qr_request()).result(timeout=10, polling=FAST_POLLING)
    qr = wait_for(lambda: (q := client.get_queued_resource(name=name)).state.state
                  == QRState.FAILED and q)
    assert qr.state.failed_data.error.code == 8
    assert "no more capacity" in qr.state.failed_data.error.message
    client.delete_queued_resource(name=name).result(timeout=10, polling=FAST_POLLING)


# -- guest attributes -----------------------------------------------------------------------------

def test_guest_attributes_serve_host_keys_per_worker(server, client):
    node = create(client, "n1", node_spec(T.V6E, "4x4"))        # 2 workers
    server.set_host_keys(node.name, 0, {"ssh-ed25519": "AAAA0", "ssh-rsa": "BBBB0"})
    server.set_host_keys(node.name, 1, {"ssh-ed25519": "AAAA1"})
    server.set_guest_attribute(node.name, 0, "testing", "k", "v")

    resp = client.get_guest_attributes(request=tpu_v2.GetGuestAttributesRequest(
        name=node.name, query_path="hostkeys/"))
    got = [{(e.namespace, e.key): e.value for e in ga.query_value.items}
           for ga in resp.guest_attributes]
    assert got == [{("hostkeys", "ssh-ed25519"): "AAAA0", ("hostkeys", "ssh-rsa"): "BBBB0"},
                   {("hostkeys", "ssh-ed25519"): "AAAA1"}]
    assert all(ga.query_path == "hostkeys/" for ga in resp.guest_attributes)

    one = client.get_guest_attributes(request=tpu_v2.GetGuestAttributesRequest(
        name=node.name, query_path="hostkeys/ssh-ed25519", worker_ids=["1"]))
    assert [[e.value for e in ga.query_value.items] for ga in one.guest_attributes] == [
        ["AAAA1"]]
    everything = client.get_guest_attributes(request={"name": node.name})  # no flattening
    assert len(everything.guest_attributes[0].query_value.items) == 3
    with pytest.raises(gexc.InvalidArgument):
        client.get_guest_attributes(request=tpu_v2.GetGuestAttributesRequest(
            name=node.name, worker_ids=["2"]))
    with pytest.raises(gexc.NotFound):
        client.get_guest_attributes(request={"name": f"{P}/nodes/nope"})


# -- operations service ----------------------------------------------------------------------------

def test_operations_service_get_list_cancel(server, client):
    server.create_delay_s = 5
    op = client.create_node(parent=P, node_id="n1", node=node_spec())
    name = op.operation.name
    assert name.startswith(f"{P}/operations/operation-")
    got = client.get_operation(request=operations_pb2.GetOperationRequest(name=name))
    assert got.name == name and not got.done
    listed = client.list_operations(request=operations_pb2.ListOperationsRequest(name=P))
    assert [o.name for o in listed.operations] == [name]
    op.cancel()
    assert op.cancelled()
    assert server.node_names() == []
    client.delete_operation(request=operations_pb2.DeleteOperationRequest(name=name))
    with pytest.raises(gexc.NotFound):
        client.get_operation(request=operations_pb2.GetOperationRequest(name=name))


# -- the asyncio client --------------------------------------------------------------------------

def test_async_client(server):
    # AsyncOperation.result() has no polling argument and re-polls after up to 1 s (jittered):
    # with no creation delay its first, immediate poll already finds the operation done.
    server.create_delay_s = 0

    async def main():
        client = make_async_client(server.address)
        try:
            op = await client.create_node(parent=P, node_id="n1",
                                          node=node_spec(T.V5P, "2x2x2"))
            node = await op.result(timeout=10)
            assert node.state == State.READY and len(node.network_endpoints) == 2
            assert [n.name async for n in await client.list_nodes(parent=P)] == [node.name]
            server.fail_next("GetNode", grpc.StatusCode.UNAVAILABLE)
            with pytest.raises(gexc.ServiceUnavailable):
                await client.get_node(name=node.name)
            server.stockout = {"v6e"}
            op = await client.create_node(parent=P, node_id="n2", node=node_spec())
            # api_core's AsyncOperation raises the bare GoogleAPICallError for an LRO error
            # (the sync Operation maps the code to ResourceExhausted); the code is in .errors.
            with pytest.raises(gexc.GoogleAPICallError) as e:
                await op.result(timeout=10)
            assert not isinstance(e.value, gexc.ResourceExhausted)
            assert e.value.errors[0].code == 8
            server.stockout = set()
            # AsyncOperation's polling retry is the reverse of the sync one: it retries
            # INTERNAL / RESOURCE_EXHAUSTED / BAD_GATEWAY but not UNAVAILABLE.
            op = await client.create_node(parent=P, node_id="n3", node=node_spec())
            server.fail_next("GetOperation", grpc.StatusCode.UNAVAILABLE)
            with pytest.raises(gexc.ServiceUnavailable):
                await op.result(timeout=10)
            op = await client.create_node(parent=P, node_id="n4", node=node_spec())
            server.fail_next("GetOperation", grpc.StatusCode.INTERNAL)
            assert (await op.result(timeout=10)).state == State.READY
        finally:
            await client.transport.close()
    asyncio.run(main())
