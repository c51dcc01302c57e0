"""The artifact plane wired into real processes: advertise, prove, fetch, route.

A loopback swarm on the default model: a tracker that knows the model's
manifest, two `llama_shard` nodes serving layers 0:10 and 20:30 from the
whole file (and seeding it), and a node with no weights that fetches layers
10:20 (`--fetch`) from them, derives its shard from the sparse partial file,
proves its layers and is routed. The only route is 0:10 -> 10:20 -> 20:30,
so every answer goes through the fetched layers, and it must equal a
single whole-model `llama` node token for token.

Then the ways a claim fails: a node claiming 0:30 that holds 10:20, a node
whose file is corrupt (it refuses to start), a node whose file rots while it
serves (caught when it registers again), and a tracker that requires proofs
(a node without a manifest is not routed). Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from dgr.artifact.constants import GlobalNeed
from dgr.artifact.build import build_manifest
from dgr.artifact.manifest import Manifest
from dgr.backends.base import LayerRange
from dgr.seam.types import ModelInfo
from dgr.seam.wire import NODE_HEADER
from dgr.errors import PeerError, Reason
from dgr.models import default_model_path
from dgr.procs import WatchedChild, dgr_command
from dgr.security.auth import Signer
from dgr.security.identity import Identity
from dgr.testing.harness import LocalRoute
from dgr.fsm.proof import ProofState, ProofStatus
from dgr.tracker.registry import NodeEntry
from dgr.tracker.routing import choose_route

pytestmark = pytest.mark.serial  # llama.cpp routes of several nodes: one at a time under make test (tests/conftest.py)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
FETCHED = LayerRange(10, 20)
PROMPTS = [
    "The three primary colors are",
    "Paris is the capital of France. Berlin is the capital of",
]
# no busy polling beside another test (dgr.testing.harness.LocalRoute.busy_poll_ms)
NODE_ARGS = ("--backend", "llama_shard", "--threads", "1", "--busy-poll-ms", "0", "--ctx", "2048",
             "--max-sessions", "2")


# -- processes ----------------------------------------------------------------------


@attrs.define
class Proc(WatchedChild):
    """A dgr child process: stdout read for its ready line (dgr.procs), stderr kept in a file."""

    log: Path | None = None

    @classmethod
    def start(cls, name: str, args: list[str], logs: Path, env: dict[str, str] | None = None) -> Proc:
        log = logs / f"{name}.err"
        return cls.spawn(name, dgr_command(*args), env={**os.environ, **(env or {})}, stderr=log.open("w"), log=log)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def output_tail(self) -> str:
        return self.stderr()[-3000:]

    def stop(self, grace_s: float = 15.0) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        super().stop(grace_s)


def _nodes(tracker: str) -> dict[str, dict[str, Any]]:
    return {n["node"]: n for n in httpx.get(f"{tracker}/v1/nodes", timeout=5).json()["nodes"]}


def _wait_for(predicate, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _complete(api: str, prompt: str, n: int = 40) -> tuple[str, list[dict[str, Any]]]:
    """Greedy completion; returns its text and the route the session took."""
    r = httpx.post(f"{api}/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    sid = r.headers["x-dgr-route-session"]
    route = httpx.get(f"{api}/route-sessions/{sid}", timeout=5).json()["route"]
    return r.json()["choices"][0]["text"], route


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifest_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("manifest") / "smollm2.manifest.json"
    build_manifest(default_model_path()).save(path)
    return path


@pytest.fixture(scope="module")
def manifest(manifest_path: Path) -> Manifest:
    return Manifest.load(manifest_path)


@attrs.define
class Swarm:
    tracker: Proc
    url: str
    procs: dict[str, Proc]
    model_dir: Path
    logs: Path

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def node_url(self, name: str) -> str:
        return _nodes(self.url)[name]["url"]

    def artifact(self, name: str) -> dict[str, Any]:
        return httpx.get(f"{self.node_url(name)}/v1/artifact", timeout=5).json()


@pytest.fixture(scope="module")
def swarm(manifest_path: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("swarm")
    logs = root / "logs"
    logs.mkdir()
    m = str(manifest_path)
    procs: dict[str, Proc] = {}
    tracker = Proc.start("tracker", ["tracker", "--port", "0", "--manifest", m, "--prefill-chunk", "512"],
                         logs)
    try:
        url = tracker.wait_ready(60)["url"]
        for name, layers in (("seed-a", "0:10"), ("seed-b", "20:30")):
            procs[name] = Proc.start(name, ["node", "--tracker", url, "--layers", layers, "--manifest", m,
                                            "--name", name, *NODE_ARGS], logs)
        # A fetch uses the peers listed when it starts: start it once both seeders are proven.
        for p in procs.values():
            p.wait_ready(240)
        # Its own shard cache, so its shard is derived from the fetched partial file here.
        procs["fetcher"] = Proc.start(
            "fetcher",
            ["node", "--tracker", url, "--layers", str(FETCHED), "--manifest", m, "--fetch",
             "--model-dir", str(root / "fetched"), "--fetch-timeout", "120", "--name", "fetcher", *NODE_ARGS],
            logs, env={"DGR_CACHE_DIR": str(root / "cache")},
        )
        procs["fetcher"].wait_ready(240)
        yield Swarm(tracker, url, procs, root / "fetched", logs)
    finally:
        for p in procs.values():
            p.stop()
        tracker.stop()


@pytest.fixture(scope="module")
def single():
    with LocalRoute(backend="llama", nodes=1, extra=("--ctx", "2048", "--prefill-chunk", "512", "--threads", "1"),
                    ready_timeout_s=240) as r:
        yield r


# -- (a) fetch, prove, route ------------------------------------------------------------


# the globals of the head (input) and the tail (output); a middle range loads none of them
_STAGE_GLOBALS = {"token_embd.weight", "output_norm.weight", "output.weight"}


def _expected_pieces(m: Manifest, layers: LayerRange) -> set[int]:
    """Header, the layers' tensors and the globals every layer uses, rounded out to pieces: for a middle
    range, from tensor offsets alone (the layer-range API loads no head or tail tensor there)."""
    assert 0 < layers.start and layers.stop < m.model.block_count
    p = m.torrent.piece_length
    spans = [(0, m.header.length)] + [
        (t.offset, t.end) for t in m.tensors
        if (t.layer is None and t.name not in _STAGE_GLOBALS) or (t.layer is not None and layers.start <= t.layer < layers.stop)
    ]
    return {i for start, end in spans for i in range(start // p, (end - 1) // p + 1)}


def _data_extents(path: Path) -> list[tuple[int, int]]:
    """[start, end) runs of a sparse file that hold data (SEEK_DATA / SEEK_HOLE)."""
    out, size = [], path.stat().st_size
    with path.open("rb") as f:
        fd, pos = f.fileno(), 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, end))
            pos = end
    return out


@pytest.mark.llama
def test_fetcher_downloads_only_its_layers_pieces(swarm: Swarm, manifest: Manifest) -> None:
    art = swarm.artifact("fetcher")
    fetch = art["fetch"]
    want = _expected_pieces(manifest, FETCHED)
    assert want == set(manifest.needed_pieces(FETCHED, GlobalNeed.COMPUTE))
    assert set(fetch["pieces_fetched"]) == want
    assert set(fetch["pieces_have"]) == want  # nothing else arrived
    plen = manifest.torrent.piece_length
    want_bytes = sum(min(plen, manifest.file.size - i * plen) for i in want)
    # Payload counts protocol-level redundancy (a piece requested from two peers at the end).
    assert want_bytes <= fetch["payload_bytes"] <= want_bytes * 1.05 + 4 * plen
    other_layers = {i for layer in manifest.layers if not FETCHED.start <= layer.index < FETCHED.stop
                    for a, b in layer.pieces for i in range(a, b)} - want
    assert len(other_layers) > 300  # the 20 layers it does not serve stayed behind
    # On disk: data only inside wanted pieces (the file is sparse, holes elsewhere).
    path = swarm.model_dir / manifest.file.name
    assert path.stat().st_size == manifest.file.size
    for start, end in _data_extents(path):
        assert set(range(start // plen, (end - 1) // plen + 1)) <= want, (start, end)
    assert path.stat().st_blocks * 512 < 0.7 * manifest.file.size
    # From several peers: both seeders sent a share.
    assert sorted(fetch["peers"]) == ["seed-a", "seed-b"]
    uploads = {n: swarm.artifact(n)["seed_status"]["payload_up"] for n in ("seed-a", "seed-b")}
    assert all(u > 0 for u in uploads.values()), uploads
    assert art["partial"] and art["verify"]["ok"] and art["verify"]["layers"] == str(FETCHED)
    t = art["timings"]
    print(
        f"\nfetch: {len(want)} of {manifest.torrent.piece_count} pieces, {fetch['payload_bytes'] / 1e6:.1f} MB "
        f"payload ({want_bytes / 1e6:.1f} MB wanted, file {manifest.file.size / 1e6:.1f} MB), from {uploads}; "
        f"transfer {fetch['transfer_s']:.2f} s, fetch+verify {t['fetch_s']:.2f} s, waited for peers "
        f"{t['peer_wait_s']:.2f} s, shard+load {t['load_s']:.2f} s, proven {t['proved_after_s']:.2f} s after start; "
        f"process start to ready {swarm.procs['fetcher'].ready_at - swarm.procs['fetcher'].started_at:.2f} s"
    )


@pytest.mark.llama
def test_every_node_is_proven_and_advertised(swarm: Swarm, manifest: Manifest) -> None:
    nodes = _nodes(swarm.url)
    for name in ("seed-a", "seed-b", "fetcher"):
        n = nodes[name]
        assert n["manifest_id"] == manifest.id
        assert n["proof"]["state"] == "passed" and n["proof"]["challenges"] == 8, n["proof"]
        assert n["routable"]
        # The sparse file's digest is the artifact's: nothing hashed its holes.
        assert n["digest"] == manifest.file.sha256
    peers = httpx.get(f"{swarm.api}/artifacts/{manifest.id}/peers", timeout=5).json()["peers"]
    assert {p["node"]: p["layers"] for p in peers} == {"seed-a": "0:10", "seed-b": "20:30", "fetcher": "10:20"}
    assert all(p["seed"].startswith("127.0.0.1:") for p in peers)
    assert httpx.get(f"{swarm.api}/artifacts/{'0' * 64}/peers", timeout=5).status_code == 404
    # The fetcher seeds what it holds, and only that.
    assert swarm.artifact("fetcher")["seed_status"]["pieces"] == len(manifest.needed_pieces(FETCHED, GlobalNeed.COMPUTE))
    for line in ("fetching layers 10:20", "fetched and verified layers 10:20", "seeding", "proven to the tracker"):
        assert line in swarm.procs["fetcher"].stderr(), line


@pytest.mark.llama
def test_route_through_fetched_layers_equals_single_node(swarm: Swarm, single: LocalRoute) -> None:
    for prompt in PROMPTS:
        want, _ = _complete(single.api, prompt)
        got, route = _complete(swarm.api, prompt)
        assert [(h["node"], h["layers"]) for h in route] == [("seed-a", "0:10"), ("fetcher", "10:20"),
                                                             ("seed-b", "20:30")]
        assert got == want
        assert len(got) > 20


# -- (b) claims that fail ---------------------------------------------------------------


def _post_signed(url: str, path: str, data: dict[str, Any], identity: Identity) -> httpx.Response:
    """A membership message signed with `identity` (this loopback tracker admits any key)."""
    body = json.dumps(data).encode()
    headers = {"Content-Type": "application/json", NODE_HEADER: str(data.get("node")),
               **Signer(identity).headers("POST", path, body, time.time())}
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=5)


@attrs.define
class Heartbeat:
    """Keep a registry entry alive from the test: the claim's only other part is its registration."""

    url: str
    node: str
    identity: Identity  # the key the entry was registered with: only it may heartbeat for it
    _stop: threading.Event = attrs.field(factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(0.2):
            _post_signed(self.url, "/v1/nodes/heartbeat", {"node": self.node, "sessions": 0}, self.identity)

    def __enter__(self) -> Heartbeat:
        threading.Thread(target=self.run, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


@pytest.mark.llama
def test_claiming_layers_through_another_nodes_address_fails_and_is_never_routed(swarm: Swarm,
                                                                                 manifest: Manifest) -> None:
    """A node with no weights claims all 30 layers at the fetcher's address, to have the fetcher answer for it.

    Before node identities the fetcher answered any challenge (and its partial file failed the blocks
    outside 10:20); now it refuses a challenge addressed to another node, so the claim fails at the first.
    """
    fetcher = _nodes(swarm.url)["fetcher"]
    greedy = Identity.generate()
    claim = {
        "node": "greedy", "url": fetcher["url"], "pid": None, "layers": [0, 30], "backend": "llama_shard",
        "model": manifest.model_info(MODEL).to_json(), "capacity": 4, "describe": {},
        "artifact": {"manifest_id": manifest.id, "seed": None},
    }
    r = _post_signed(swarm.url, "/v1/nodes/register", claim, greedy)
    assert r.status_code == 200 and r.json()["proof"]["state"] == "pending"
    with Heartbeat(swarm.url, "greedy", greedy):
        proof = _wait_for(lambda: _nodes(swarm.url)["greedy"]["proof"]["state"] != "pending"
                          and _nodes(swarm.url)["greedy"]["proof"], 10, "the greedy claim's verdict")
        print(f"\ngreedy claim: {json.dumps(proof)}")
        assert proof["state"] == "failed" and proof["challenges"] == 0
        assert proof["reason"] == "proof_failed" and "verdict" not in proof
        assert "HTTP 403" in proof["message"] and "addressed to 'greedy', not fetcher" in proof["message"]
        entry = _nodes(swarm.url)["greedy"]
        assert entry["alive"] and not entry["routable"]
        # One hop over all 30 layers would win every route if it were routable.
        for prompt in PROMPTS[:1]:
            _, route = _complete(swarm.api, prompt, n=4)
            assert "greedy" not in [h["node"] for h in route]
        models = httpx.get(f"{swarm.api}/models", timeout=5).json()["data"][0]["dgr"]["nodes"]
        assert "greedy" not in [n["node"] for n in models]


@pytest.mark.llama
def test_claim_of_another_file_fails_without_a_challenge(swarm: Swarm, manifest: Manifest) -> None:
    info = manifest.model_info(MODEL)
    other = ModelInfo(**{**info.to_json(), "digest": "ab" * 32})
    claim = {
        "node": "other-file", "url": "http://127.0.0.1:9", "layers": [0, 10], "backend": "llama_shard",
        "model": other.to_json(), "capacity": 4, "artifact": {"manifest_id": manifest.id, "seed": None},
    }
    _post_signed(swarm.url, "/v1/nodes/register", claim, Identity.generate()).raise_for_status()
    proof = _wait_for(lambda: _nodes(swarm.url)["other-file"]["proof"]["state"] == "failed"
                      and _nodes(swarm.url)["other-file"]["proof"], 5, "the other file's verdict")
    assert proof["reason"] == "artifact_mismatch" and proof["challenges"] == 0
    assert "file digest abababababab" in proof["message"]


@pytest.mark.llama
def test_node_with_corrupt_layers_refuses_to_start(manifest_path: Path, manifest: Manifest, tmp_path: Path) -> None:
    bad = tmp_path / manifest.file.name
    shutil.copyfile(default_model_path(), bad)
    victim = manifest.tensor("blk.12.ffn_down.weight")
    with bad.open("r+b") as f:
        f.seek(victim.offset + victim.size // 2)
        f.write(b"\xff" * 4096)
    r = subprocess.run(
        dgr_command("node", "--layers", "10:20", "--manifest", str(manifest_path), "--model", str(bad), *NODE_ARGS),
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "differs from manifest" in r.stderr and "layer 12: blk.12.ffn_down.weight" in r.stderr
    assert "dgr-ready" not in r.stdout  # never served, never registered


@pytest.mark.llama
def test_rotten_file_is_caught_when_the_node_registers_again(swarm: Swarm, manifest: Manifest) -> None:
    """Last: breaks the fetcher. Its file loses layers 10:20 while it serves; the next registration is challenged."""
    fetcher = swarm.procs["fetcher"]
    path = swarm.model_dir / manifest.file.name
    with path.open("r+b") as f:
        for layer in manifest.layers[FETCHED.start : FETCHED.stop]:
            for start, end in layer.ranges:
                f.seek(start)
                f.write(b"\0" * (end - start))
    # Silence it past the tracker's dead-after (1 s): it is declared dead, and registers again on waking.
    os.kill(fetcher.popen.pid, signal.SIGSTOP)
    try:
        _wait_for(lambda: not _nodes(swarm.url)["fetcher"]["alive"], 10, "the fetcher declared dead")
    finally:
        os.kill(fetcher.popen.pid, signal.SIGCONT)
    proof = _wait_for(lambda: (n := _nodes(swarm.url)["fetcher"])["alive"] and n["proof"]["state"] == "failed"
                      and n["proof"], 15, "the re-registered fetcher's verdict")
    assert proof["verdict"] == "hash_mismatch" and proof["challenges"] == 0
    r = httpx.post(f"{swarm.api}/completions", timeout=30, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "no_route" and "10:20" in err["message"] and "fetcher (failed)" in err["message"]
    _wait_for(lambda: "refused the layer proof" in fetcher.stderr(), 5, "the fetcher saying it was refused")


# -- proof policy, with the stub backend and in process ---------------------------------------


@pytest.mark.parametrize("why", ["--require-proof", "a manifest (proofs are on by default then)"])
def test_require_proof_leaves_nodes_without_a_manifest_unrouted(why: str, tmp_path: Path, request) -> None:
    flags = [why] if why.startswith("--") else ["--manifest", str(request.getfixturevalue("manifest_path"))]
    tracker = Proc.start("tracker", ["tracker", "--port", "0", *flags], tmp_path)
    node = None
    try:
        url = tracker.wait_ready(60)["url"]
        node = Proc.start("stub", ["node", "--tracker", url, "--backend", "stub", "--name", "stub"], tmp_path)
        node.wait_ready(30)
        entry = _nodes(url)["stub"]
        assert entry["proof"]["state"] == "failed" and "--manifest" in entry["proof"]["message"]
        assert entry["alive"] and not entry["routable"]
        r = httpx.post(f"{url}/v1/completions", timeout=10,
                       json={"model": entry["model"], "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_route" and "stub (failed)" in r.json()["error"]["message"]
    finally:
        if node is not None:
            node.stop()
        tracker.stop()


def _entry(node: str, start: int, stop: int, manifest_id: str | None, state: ProofState) -> NodeEntry:
    info = ModelInfo(name="m", architecture="llama", n_layers=30, hidden_size=8, seam_width=8, vocab_size=10,
                     context_length=64, digest="d" * 64)
    return NodeEntry(node_id=node, url=f"http://{node}", start=start, stop=stop, backend="stub", model=info,
                     capacity=4, describe={}, registered_at=0.0, last_seen=0.0, manifest_id=manifest_id,
                     proof=ProofStatus(state))


def test_routes_never_mix_manifests_or_use_unproven_nodes() -> None:
    passed, pending, failed = ProofState.PASSED, ProofState.PENDING, ProofState.FAILED
    nodes = [
        _entry("a1", 0, 15, "A", passed), _entry("a2", 15, 30, "A", passed),
        _entry("b1", 0, 30, "B", pending),  # one hop, but not proven yet
        _entry("c1", 0, 30, "C", failed),
    ]
    choice = choose_route(nodes, "m")
    assert [n.node_id for n in choice.nodes] == ["a1", "a2"] and choice.manifest_id == "A"
    # Same digest, other manifest: a1 + x2 would cover the model, but they are never mixed.
    mixed = [_entry("a1", 0, 15, "A", passed), _entry("x2", 15, 30, "X", passed)]
    with pytest.raises(PeerError) as raised:
        choose_route(mixed, "m")
    assert raised.value.reason is Reason.NO_ROUTE
    # Unclaimed nodes (no manifest) stay routable, as before, but only among themselves.
    plain = [_entry("p1", 0, 15, None, ProofState.UNCLAIMED), _entry("p2", 15, 30, None, ProofState.UNCLAIMED)]
    assert [n.node_id for n in choose_route(plain + mixed, "m").nodes] == ["p1", "p2"]
    with pytest.raises(PeerError) as raised:
        choose_route([_entry("b1", 0, 30, "B", pending)], "m")
    assert raised.value.reason is Reason.NO_ROUTE and "b1 (pending)" in raised.value.message
