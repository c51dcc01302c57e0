"""A node's accelerators and their memory: read by the node, carried in heartbeats, kept by the tracker, shown in
status, node listings and /metrics. Fake device lists throughout (a stub backend's `devices`): no GPU needed."""

from __future__ import annotations

import logging

import attrs
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from dgr.backends.base import LayerRange
from dgr.backends.placement import Placement
from dgr.backends.stub import StubBackend, StubSpec
from dgr.metrics import render
from dgr.node.accounting import DEVICE_READ_S
from dgr.node.membership import heartbeat_body, registration
from dgr.node.service import NodeService
from dgr.seam.types import MAX_DEVICE_DESCRIPTION, MAX_DEVICE_NAME, MAX_DEVICES, DeviceMemory
from dgr.seam.wire import NODE_HEADER
from dgr.testing.inproc import InProcRoute, asgi_client
from dgr.tracker.app import make_tracker_app
from dgr.tracker.registration import read_heartbeat

GIB = 1 << 30
H100 = DeviceMemory(name="CUDA0", description="NVIDIA H100 80GB HBM3", memory_free=70 * GIB, memory_total=80 * GIB)
SECOND = DeviceMemory(name="CUDA1", description="NVIDIA H100 80GB HBM3", memory_free=80 * GIB, memory_total=80 * GIB)


@attrs.define
class _Counted(StubBackend):
    """A stub whose device readings are counted, and fail with `fail` when set."""

    reads: int = 0
    fail: str | None = None

    def device_memory(self) -> list[DeviceMemory]:
        self.reads += 1
        if self.fail is not None:
            raise OSError(self.fail)
        return list(self.devices)


def _node(devices: tuple[DeviceMemory, ...] = ()) -> NodeService:
    backend = _Counted(spec=StubSpec(), layers=LayerRange(0, 15), devices=devices)
    return NodeService(backend=backend, node_id="n0")


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


# -- the heartbeat record -----------------------------------------------------------------------------------


def test_a_gpu_nodes_heartbeat_carries_its_devices_and_the_tracker_reads_them_back() -> None:
    node = _node((H100, SECOND))
    body = heartbeat_body(node)
    assert body["devices"] == [
        {"name": "CUDA0", "description": "NVIDIA H100 80GB HBM3", "memory_free": 70 * GIB, "memory_total": 80 * GIB},
        {"name": "CUDA1", "description": "NVIDIA H100 80GB HBM3", "memory_free": 80 * GIB, "memory_total": 80 * GIB}]
    beat = read_heartbeat(body)
    assert beat.devices == (H100, SECOND) and beat.devices_dropped is None
    assert beat.devices[0].memory_used == 10 * GIB


def test_a_cpu_nodes_heartbeat_carries_no_devices() -> None:
    """Not even an empty list: a CPU node's heartbeat is as it was before devices were reported."""
    node = _node()
    assert node.devices == ()
    body = heartbeat_body(node)
    assert "devices" not in body
    beat = read_heartbeat(body)
    assert beat.devices == () and beat.devices_dropped is None


def test_a_cpu_placement_uses_no_device_whatever_the_build_sees() -> None:
    """A llama.cpp node that offloads nothing reports no device, without asking ggml (no library loaded)."""
    assert Placement().devices_used() == []


_GOOD = H100.to_json()
_MALFORMED = [
    ("all", "a list"),
    ({"name": "CUDA0"}, "a list"),
    ([_GOOD] * (MAX_DEVICES + 1), f"at most {MAX_DEVICES}"),
    ([1], "an object"),
    ([None], "an object"),
    ([{**_GOOD, "name": ""}], "name"),
    ([{**_GOOD, "name": "x" * (MAX_DEVICE_NAME + 1)}], "name"),
    ([{**_GOOD, "name": "CUDA0\nfake_metric 1"}], "name"),
    ([{**_GOOD, "name": 7}], "name"),
    ([{k: v for k, v in _GOOD.items() if k != "name"}], "name"),
    ([{**_GOOD, "description": "y" * (MAX_DEVICE_DESCRIPTION + 1)}], "description"),
    ([{**_GOOD, "description": None}], "description"),
    ([{**_GOOD, "memory_free": "1"}], "memory_free"),
    ([{**_GOOD, "memory_free": -1}], "memory_free"),
    ([{**_GOOD, "memory_free": True}], "memory_free"),
    ([{**_GOOD, "memory_total": 1.5}], "memory_total"),
    ([{**_GOOD, "memory_total": 2 ** 63}], "memory_total"),
    ([{**_GOOD, "memory_free": 81 * GIB}], "exceeds"),
    ([_GOOD, _GOOD], "unique"),
]


@pytest.mark.parametrize("devices, why", _MALFORMED)
def test_malformed_devices_are_dropped_with_the_reason_and_the_rest_of_the_beat_read(devices, why) -> None:
    """The readings are for people: a bad list is dropped, never refuses the beat (that would cost the node its
    liveness), never crashes the tracker."""
    beat = read_heartbeat({"node": "n0", "sessions": 2, "kv_bytes": 4096, "devices": devices})
    assert beat.sessions == 2 and beat.kv_bytes == 4096
    assert beat.devices == () and beat.devices_dropped is not None and why in beat.devices_dropped
    assert len(beat.devices_dropped) <= 300


def test_the_wire_bounds_admit_what_they_name() -> None:
    """At the bounds exactly: MAX_DEVICES devices, the longest name and description, an empty description, a
    device full to the byte, unknown keys (a later node's) ignored."""
    devices = [{"name": f"D{i}".ljust(MAX_DEVICE_NAME, "x"), "description": "d" * MAX_DEVICE_DESCRIPTION,
                "memory_free": 0, "memory_total": 2 ** 63 - 1, "kind": "gpu"} for i in range(MAX_DEVICES - 1)]
    devices.append({"name": "Vulkan0", "description": "", "memory_free": 5, "memory_total": 5})
    beat = read_heartbeat({"node": "n0", "devices": devices})
    assert beat.devices_dropped is None and len(beat.devices) == MAX_DEVICES
    assert beat.devices[-1] == DeviceMemory("Vulkan0", "", 5, 5) and beat.devices[-1].memory_used == 0


def test_a_node_clips_a_long_description_to_the_wire_bound() -> None:
    """What a node reads from ggml always passes the tracker's check: a driver's long name is clipped."""
    d = DeviceMemory.from_ggml({"name": "Vulkan0", "kind": "gpu", "description": "z" * 1000,
                                "memory_free": 1, "memory_total": 2})
    assert len(d.description) == MAX_DEVICE_DESCRIPTION
    assert read_heartbeat({"node": "n0", "devices": [d.to_json()]}).devices == (d,)


# -- the tracker keeps them per node ------------------------------------------------------------------------


async def test_the_registry_keeps_each_nodes_devices_and_says_why_it_dropped_them(caplog) -> None:
    route = InProcRoute.stub(devices=((H100,),))
    route.register_all()
    gpu, cpu = route.heartbeat(0), route.heartbeat(1)
    assert gpu.devices == (H100,) and cpu.devices == ()
    listed = gpu.to_json(trio.current_time())
    assert listed["devices"] == [H100.to_json()] and listed["devices_dropped"] is None
    assert cpu.to_json(trio.current_time())["devices"] == []

    service = route.services[0]
    bad = {**heartbeat_body(service), "devices": [{**_GOOD, "memory_free": -5}]}
    with caplog.at_level(logging.WARNING, logger="dgr.registry"):
        for _ in range(3):
            entry = route.registry.heartbeat(bad, trio.current_time(), key=service.identity.public)
    assert entry.alive and entry.devices == () and "memory_free" in entry.devices_dropped
    said = [r.getMessage() for r in caplog.records if "devices were dropped" in r.getMessage()]
    assert len(said) == 1 and "n0" in said[0]  # once per new reason, not once a beat
    entry = route.heartbeat(0)
    assert entry.devices == (H100,) and entry.devices_dropped is None


async def test_the_node_listing_shows_devices_from_signed_heartbeats_and_a_bad_list_answers_200() -> None:
    route = InProcRoute.stub(devices=((H100, SECOND),))
    app = make_tracker_app(route.gateway)

    async def post(http, i: int, path: str, data):
        body, headers = route.signed(i, path, data)
        return await http.post(path, content=body, headers={**headers, NODE_HEADER: f"n{i}"})

    async with asgi_client(app, "http://127.0.0.1:8000") as http:
        for i, service in enumerate(route.services):
            assert (await post(http, i, "/v1/nodes/register", registration(service, route.urls[i]))).status_code == 200
            assert (await post(http, i, "/v1/nodes/heartbeat", heartbeat_body(service))).status_code == 200
        nodes = {n["node"]: n for n in (await http.get("/v1/nodes")).json()["nodes"]}
        assert nodes["n0"]["devices"] == [H100.to_json(), SECOND.to_json()] and nodes["n1"]["devices"] == []
        bad = {**heartbeat_body(route.services[0]), "devices": [{"name": "CUDA0"}] * 1000}
        r = await post(http, 0, "/v1/nodes/heartbeat", bad)
        assert r.status_code == 200, r.text
        n0 = next(n for n in (await http.get("/v1/nodes")).json()["nodes"] if n["node"] == "n0")
        assert n0["alive"] and n0["devices"] == [] and f"at most {MAX_DEVICES}" in n0["devices_dropped"]


# -- /metrics -----------------------------------------------------------------------------------------------


async def test_the_trackers_metrics_carry_each_nodes_device_memory() -> None:
    route = InProcRoute.stub(devices=((H100, SECOND),))
    route.register_all()
    route.heartbeat(0)
    route.heartbeat(1)
    text = render(route.gateway.metrics.registry)
    m = _samples(text)

    def at(name: str, device: str, node: str = "n0") -> float:
        return m[(name, (("device", device), ("node", node)))]

    assert at("dgr_node_device_memory_total_bytes", "CUDA0") == 80 * GIB
    assert at("dgr_node_device_memory_free_bytes", "CUDA0") == 70 * GIB
    assert at("dgr_node_device_memory_used_bytes", "CUDA0") == 10 * GIB
    assert at("dgr_node_device_memory_used_bytes", "CUDA1") == 0
    assert m[("dgr_node_device_info", (("description", "NVIDIA H100 80GB HBM3"), ("device", "CUDA0"),
                                       ("node", "n0")))] == 1
    # the CPU node n1 has no series; the families are there all the same, as dgr_node_up's are
    assert not [k for k in m if k[0].startswith("dgr_node_device") and ("node", "n1") in k[1]]
    assert b'dgr_node_device_memory_free_bytes{device="CUDA0",node="n0"} 7.516192768e+10' in text


async def test_a_nodes_own_metrics_and_status_carry_its_devices_and_a_cpu_nodes_none() -> None:
    gpu, cpu = _node((H100,)), _node()
    m = _samples(render(gpu.metrics.registry))
    assert m[("dgr_node_device_memory_total_bytes", (("device", "CUDA0"),))] == 80 * GIB
    assert m[("dgr_node_device_memory_free_bytes", (("device", "CUDA0"),))] == 70 * GIB
    assert m[("dgr_node_device_memory_used_bytes", (("device", "CUDA0"),))] == 10 * GIB
    assert b"dgr_node_device" not in render(cpu.metrics.registry)
    # in the aggregate status too: a load balancer may place by free memory
    assert gpu.status(detail=False)["devices"] == [H100.to_json()]
    assert cpu.status(detail=True)["devices"] == []


# -- the node reads them again as they change ---------------------------------------------------------------


async def test_a_node_reads_its_devices_again_every_period_as_a_scheduler_job(autojump_clock, nursery) -> None:
    node = _node((H100,))
    node.scheduler.inline = True  # on the MockClock: no thread
    await nursery.start(node.run)
    fuller = attrs.evolve(H100, memory_free=1 * GIB)
    node.backend.devices = (fuller,)
    calls = node.scheduler.iterations
    await trio.sleep(DEVICE_READ_S * 0.9)
    assert node.devices == (H100,) and node.scheduler.iterations == calls  # not yet read
    await trio.sleep(DEVICE_READ_S * 0.2)
    assert node.devices == (fuller,) and node.scheduler.iterations == calls + 1
    assert heartbeat_body(node)["devices"][0]["memory_free"] == 1 * GIB
    assert _samples(render(node.metrics.registry))[
        ("dgr_node_device_memory_used_bytes", (("device", "CUDA0"),))] == 79 * GIB


async def test_a_failed_reading_keeps_the_last_and_is_said_once(autojump_clock, nursery, caplog) -> None:
    node = _node((H100,))
    node.scheduler.inline = True
    node.backend.fail = "the driver went away"
    with caplog.at_level(logging.WARNING, logger="dgr.node"):
        await nursery.start(node.run)
        await trio.sleep(DEVICE_READ_S * 3.5)
    assert node.backend.reads == 1 + 3 and node.devices == (H100,)
    said = [r.getMessage() for r in caplog.records if "devices' memory" in r.getMessage()]
    assert len(said) == 1 and "the driver went away" in said[0]
    node.backend.fail = None  # a later good reading replaces the last
    node.backend.devices = (SECOND,)
    await trio.sleep(DEVICE_READ_S)
    assert node.devices == (SECOND,)


async def test_a_cpu_node_never_reads_devices_again(autojump_clock, nursery) -> None:
    node = _node()
    node.scheduler.inline = True
    await nursery.start(node.run)
    await trio.sleep(DEVICE_READ_S * 5)
    assert node.backend.reads == 1 and node.devices == ()  # the one reading at start, before the scheduler owned it
