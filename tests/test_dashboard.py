"""The route dashboard at GET / in a real headless browser, over a real stub route.

Chromium (Debian's /usr/bin/chromium) driven by Playwright loads the page the
tracker serves, and the page must show what the tracker's JSON says: three
nodes with layer bars laid out over [0, n_layers), a live Route Session whose
token count grows, then, after a node is SIGKILLed, that node marked down and
the failure with its reason. Without the browser the test skips, unless
DGR_REQUIRE_CHROMIUM is set (.ci/run sets it: CI installs Chromium, so a
missing one there is a failure, not a skip). The node table's device column
is checked on its own, against canned tracker answers (no route: a stub node
has no GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import httpx
import pytest
from playwright import sync_api  # a test dependency (pyproject [test]): missing, it fails loudly

from dgr.testing.harness import LocalRoute, sse_events

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = 10_000  # every browser-side wait; the page polls every 500 ms

if not CHROMIUM.exists():
    if os.environ.get("DGR_REQUIRE_CHROMIUM"):
        raise RuntimeError("DGR_REQUIRE_CHROMIUM is set but /usr/bin/chromium is missing (apt-get install -y chromium)")
    pytestmark = pytest.mark.skip(reason="no /usr/bin/chromium (apt-get install -y chromium)")


class _Stream:
    """A long streaming completion in a thread; keeps its session id and the error it ended with."""

    def __init__(self, route: LocalRoute, max_tokens: int) -> None:
        self.route = route
        self.max_tokens = max_tokens
        self.sid: str | None = None
        self.error: dict | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": "stub", "prompt": "watch me", "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True}
        try:
            with httpx.stream("POST", f"{self.route.api}/completions", json=body, timeout=30) as r:
                self.sid = r.headers["x-dgr-route-session"]
                self.started.set()
                for kind, data in sse_events(r):
                    if kind == "data" and isinstance(data, dict) and "error" in data:
                        self.error = data["error"]
        except httpx.HTTPError:
            pass  # the route is torn down at the end of a failing test
        finally:
            self.started.set()


@contextlib.contextmanager
def _page(height: int) -> Iterator[tuple[sync_api.Page, list[str]]]:
    """A Chromium page 1280 wide, and the page errors and console errors it logs (a test ends with none)."""
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True, timeout=30_000)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": height})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
            page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
            yield page, errors
        finally:
            browser.close()


def _fill_geometry(page, node: str) -> tuple[float, float]:
    """The layer fill's left edge and width as fractions of its track, measured from layout.

    One evaluate call, because the page redraws its tables on every poll.
    """
    return tuple(page.evaluate(
        """node => {
            const row = document.querySelector(`#nodes tr[data-node='${node}']`);
            const t = row.querySelector('.layer-track').getBoundingClientRect();
            const f = row.querySelector('.layer-fill').getBoundingClientRect();
            return [(f.left - t.left) / t.width, f.width / t.width];
        }""", node))


def test_dashboard_shows_nodes_live_session_and_node_loss(tmp_path: Path) -> None:
    expect = sync_api.expect
    with LocalRoute(backend="stub", nodes=3, extra=("--stub-delay", "0.004")) as route:
        index = httpx.get(f"{route.url}/", timeout=5)
        assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
        assert b'id="nodes"' in index.content

        with _page(1000) as (page, errors):
            page.goto(f"{route.url}/", timeout=WAIT_MS)

            # three live nodes, each bar drawn where its layers are
            rows = page.locator("#nodes tr[data-node]")
            expect(rows).to_have_count(3, timeout=WAIT_MS)
            expect(page.locator('#conn[data-state="live"]')).to_have_count(1, timeout=WAIT_MS)
            for name, (a, b) in {"node0": (0, 10), "node1": (10, 20), "node2": (20, 30)}.items():
                row = page.locator(f'#nodes tr[data-node="{name}"]')
                expect(row).to_have_attribute("data-alive", "true", timeout=WAIT_MS)
                expect(row).to_have_attribute("data-layers", f"{a}:{b}")
                expect(row).to_contain_text("alive")
                left, width = _fill_geometry(page, name)
                assert left == pytest.approx(a / 30, abs=0.01) and width == pytest.approx((b - a) / 30, abs=0.01)
            expect(page.locator('#coverage [data-complete="true"]')).to_have_count(1, timeout=WAIT_MS)

            # a long completion appears as a live session whose token count grows
            stream = _Stream(route, max_tokens=2000)
            stream.thread.start()
            assert stream.started.wait(15) and stream.sid, "the streaming completion did not start"
            session = page.locator(f'#sessions tr[data-session="{stream.sid}"]')
            expect(session).to_have_attribute("data-phase", "decode", timeout=WAIT_MS)
            page.wait_for_function(
                "sid => { const r = document.querySelector(`#sessions tr[data-session='${sid}']`);"
                " return r && Number(r.dataset.tokens) >= 5; }", arg=stream.sid, timeout=WAIT_MS)
            first = int(session.get_attribute("data-tokens"))
            page.wait_for_function(
                "a => { const r = document.querySelector(`#sessions tr[data-session='${a[0]}']`);"
                " return r && Number(r.dataset.tokens) > a[1]; }", arg=[stream.sid, first], timeout=WAIT_MS)
            expect(session).to_contain_text("decode")
            expect(session).to_contain_text("node1 [10:20]")
            prefill_total = int(session.get_attribute("data-prefill-total"))
            assert prefill_total > 0 and int(session.get_attribute("data-prefill-done")) == prefill_total
            page.screenshot(path=str(tmp_path / "dashboard-live.png"), full_page=True)

            # kill a node mid-decode: it goes down, the session fails with the reason, the gap shows
            route.kill("node1")
            expect(page.locator('#nodes tr[data-node="node1"]')).to_have_attribute(
                "data-alive", "false", timeout=WAIT_MS)
            expect(page.locator('#nodes tr[data-node="node1"]')).to_contain_text("down")
            failure = page.locator(f'#failures li[data-failure-session="{stream.sid}"]')
            expect(failure).to_have_attribute("data-reason", "route_node_lost", timeout=WAIT_MS)
            expect(failure).to_have_attribute("data-failed-node", "node1")
            expect(failure).to_have_attribute("data-failed-phase", "decode")
            expect(failure).to_contain_text("route_node_lost")
            expect(session).to_have_count(0, timeout=WAIT_MS)
            expect(page.locator(f'#recent tr[data-session="{stream.sid}"]')).to_have_attribute(
                "data-reason", "route_node_lost", timeout=WAIT_MS)
            expect(page.locator('#failure-counts [data-reason-count="route_node_lost"]')).to_have_text("1")
            expect(page.locator('#coverage [data-complete="false"]')).to_have_attribute("data-missing", "10:20")
            for name in ("node0", "node2"):
                expect(page.locator(f'#nodes tr[data-node="{name}"]')).to_have_attribute("data-alive", "true")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert not errors, errors

        stream.thread.join(timeout=10)
        assert not stream.thread.is_alive(), "the stream did not end after the node was killed"
        assert stream.error is not None and stream.error["code"] == "route_node_lost"


GIB = 1 << 30


def _listed(node: str, layers: str, **kw) -> dict:
    """A node as GET /v1/nodes lists it, with what the page reads."""
    return {"node": node, "url": f"http://{node}.test:1", "layers": layers, "backend": "llama_shard",
            "model": "m", "n_layers": 30, "capacity": 4, "limit": 4, "sessions": 1, "kv_bytes": 3 * 1024 * 1024,
            "alive": True, "heartbeat_age_s": 0.2, "devices": [], "devices_dropped": None, **kw}


def test_dashboard_shows_each_nodes_device_and_vram_used_of_total() -> None:
    """The page served from the package's file, its polls answered with canned JSON: a GPU node shows its device
    (name and description) and VRAM used / total (used: total less free) with a bar; a CPU node says CPU; a node
    whose devices the tracker dropped says so, with the reason on hover."""
    expect = sync_api.expect
    gpu = [{"name": "CUDA0", "description": "NVIDIA H100 80GB HBM3", "memory_free": 70 * GIB,
            "memory_total": 80 * GIB},
           {"name": "CUDA1", "description": "NVIDIA H100 80GB HBM3", "memory_free": 4 * GIB,
            "memory_total": 80 * GIB}]
    answers = {
        "/": (resources.files("dgr.tracker").joinpath("dashboard.html").read_bytes(), "text/html"),
        "/v1/nodes": (json.dumps({"nodes": [
            _listed("g0", "0:10", devices=gpu), _listed("c1", "10:20"),
            _listed("x2", "20:30", devices_dropped="devices must be a list of at most 16 objects")]}).encode(),
            "application/json"),
        "/v1/route-sessions": (b'{"active": [], "recent": []}', "application/json"),
        "/v1/stats": (b'{"sessions": {}, "failures": {}, "recent_failures": [], "hops": {}}', "application/json"),
    }

    def answer(route) -> None:
        path = route.request.url.removeprefix("http://dashboard.test").split("?")[0]
        body, kind = answers[path]
        route.fulfill(status=200, body=body, content_type=kind)

    with _page(800) as (page, errors):
        page.route("http://dashboard.test/**", answer)
        page.goto("http://dashboard.test/", timeout=WAIT_MS)
        expect(page.locator("#nodes tr[data-node]")).to_have_count(3, timeout=WAIT_MS)
        expect(page.locator("#nodes th")).to_contain_text(["Device · VRAM"])

        first = page.locator('#nodes tr[data-node="g0"] .device[data-device="CUDA0"]')
        expect(first).to_have_attribute("data-memory-used", str(10 * GIB))
        expect(first).to_have_attribute("data-memory-total", str(80 * GIB))
        expect(first).to_contain_text("CUDA0 NVIDIA H100 80GB HBM3")
        expect(first).to_contain_text("10.0 GiB / 80.0 GiB")
        expect(first).to_have_attribute("title", "CUDA0: 70.0 GiB free")
        full = page.locator('#nodes tr[data-node="g0"] .device[data-device="CUDA1"]')
        expect(full).to_contain_text("76.0 GiB / 80.0 GiB")
        expect(full.locator(".bar.hot")).to_have_count(1)  # past 90% used
        widths = page.evaluate("""() => [...document.querySelectorAll("#nodes tr[data-node='g0'] .device")]
            .map(d => d.querySelector('.bar').getBoundingClientRect().width
                      / d.querySelector('.track').getBoundingClientRect().width)""")
        assert widths == pytest.approx([10 / 80, 76 / 80], abs=0.01)

        cpu = page.locator('#nodes tr[data-node="c1"]')
        expect(cpu.locator(".device")).to_have_count(0)
        expect(cpu).to_contain_text("CPU")
        dropped = page.locator('#nodes tr[data-node="x2"] .pill.warn')
        expect(dropped).to_have_text("devices unreadable")
        expect(dropped).to_have_attribute("title", "devices must be a list of at most 16 objects")
        assert not errors, errors
