"""Machines on one LAN: a tracker and four nodes, each in its own network namespace, joined by one bridge.

What a user with several machines does (docs/deploy.md), with real
processes on dgr.testing.lan's hosts: every node binds 0.0.0.0 and is not
told its address (the tracker records the source address it saw), and
joins with a join token read from a file (mode 600). Every link is TLS, as
off loopback it is by default, with no certificate given to any process:
each serves the one made from its own key, and nodes demand their tracker's
member certificates from their callers (spec/security.md). The first node has the
whole GGUF file; every node states only a memory budget (`--memory`, no
`--layers`) and the tracker assigns its range. The others start with no
weights (`--manifest M --fetch`) and fetch over the bridge only the pieces
of their layers, from the nodes already seeding them.

Checked: the assigned ranges tile the model; nodes and seeds are recorded at
their LAN addresses; each fetcher holds exactly its layers' pieces; greedy
answers through the route equal the whole model's in one llama.cpp (what a
single whole-model node answers: tests/test_e2e_llama.py), text and token
count; a node that joins once the model is covered gets the range of a
running node (a replica), and when that node is killed (SIGKILL) new
sessions go through the replica and still answer the same.

The budget: SmolLM2-135M at the nodes' default context (4096 x 8
sessions), where a third of the model's KV is what sets a node's share;
the test finds a budget, with the tracker's own pricing, at which three
nodes tile the model. Skipped without root or `ip netns`; every namespace
and link is gone afterwards, pass or fail.
"""

from __future__ import annotations

import os
import signal
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dgr.artifact.constants import GlobalNeed
from dgr.artifact.manifest import Manifest
from dgr.backends.base import LayerRange
from dgr.bench.netns import clean_env, prerequisites
from dgr.testing.namespaces import leftovers
from dgr.models import default_model_path
from dgr.plan import PlanParams
from dgr.plan.sources import layout_from_manifest
from dgr.procs import WatchedChild, dgr_command
from dgr.security.certs import LinkCert, identity_cert
from dgr.security.identity import Identity
from dgr.security.tls import TlsTrust
from dgr.security.secrets import JOIN_ENV, new_secret
from dgr.testing.lan import Lan
from dgr.tracker.assign import assign_layers

pytestmark = [pytest.mark.llama, pytest.mark.serial]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPTS = ("The three primary colors are", "Paris is the capital of France. Berlin is the capital of")
MAX_TOKENS = 24
CTX, SESSIONS = 4096, 8  # the nodes' defaults, priced by the tracker at assignment
TRACKER_PORT, NODE_PORT = 8000, 9000  # every host has its own ports, as machines do
READY_S = 90.0  # bounds on a loaded 2-core machine, not timing claims
DEAD_AFTER_S = 2.0


def _tiling_budget(manifest: Manifest) -> int:
    """A memory budget at which three nodes joining one by one are assigned ranges that tile the model.

    Found with the tracker's own function, so the test follows the cost model rather than a number
    typed in here.
    """
    layout = layout_from_manifest(manifest.to_json())
    params = PlanParams(context=CTX, sessions=SESSIONS)
    fits = []
    for mib in range(256, 2048):
        counts = [0] * layout.n_layers
        for _ in range(3):
            got = assign_layers(layout, params, mib * 2**20, counts).layers
            counts[got.start:got.stop] = [c + 1 for c in counts[got.start:got.stop]]
        if counts == [1] * layout.n_layers:
            fits.append(mib)
        elif fits:
            break  # the first window of budgets that tile: take its middle
    assert fits, "no budget splits the model over exactly three nodes"
    return fits[len(fits) // 2] * 2**20


def _whole_model_answers() -> dict[str, tuple[str, int]]:
    """Greedy answers of the whole model in one llama.cpp, in this process: text and token count.

    What a single whole-model `llama` node answers (tests/test_e2e_llama.py holds the two equal, on these
    prompts), without a tracker and a node to start.
    """
    import llama_cpp

    whole = llama_cpp.Llama(str(default_model_path()), n_ctx=512, n_threads=1, n_threads_batch=1, n_batch=512,
                            verbose=False, seed=0)
    try:
        outs = {p: whole.create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0, top_k=1) for p in PROMPTS}
    finally:
        whole.close()
    return {p: (o["choices"][0]["text"], o["usage"]["completion_tokens"]) for p, o in outs.items()}


def _wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def lan() -> Iterator[Lan]:
    why = prerequisites()
    if why is not None:
        pytest.skip(why)
    with Lan(("tracker", "a", "b", "c", "d")) as net:
        yield net
    assert leftovers() == [], "namespaces or links left behind"


def _secret_file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def _nodes(url: str, headers: dict[str, str], verify: ssl.SSLContext) -> dict[str, dict[str, Any]]:
    return {n["node"]: n for n in httpx.get(f"{url}/v1/nodes", headers=headers, timeout=5,
                                             verify=verify).json()["nodes"]}


def _complete(api: str, prompt: str, headers: dict[str, str],
              verify: ssl.SSLContext) -> tuple[str, int, list[tuple[str, str]]]:
    """Greedy completion: its text, its token count and the route it took (node, layers)."""
    r = httpx.post(f"{api}/completions", headers=headers, timeout=120, verify=verify,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    route = [(h["node"], h["layers"]) for h in body["dgr"]["telemetry"]["route"]]
    return body["choices"][0]["text"], body["usage"]["completion_tokens"], route


def test_machines_on_one_lan_join_with_a_token_fetch_their_layers_and_serve(lan: Lan, manifest: Manifest,
                                                                           tmp_path: Path) -> None:
    started = time.monotonic()
    m = tmp_path / "m.json"
    manifest.save(m)
    budget = _tiling_budget(manifest)
    token = _secret_file(tmp_path / "join-token", new_secret())
    api_key = "dgr-lan-" + new_secret()[:24]
    headers = {"Authorization": f"Bearer {api_key}"}
    url = f"https://{lan.addr('tracker')}:{TRACKER_PORT}"  # links off loopback are encrypted by default
    env = {k: v for k, v in clean_env().items() if k != JOIN_ENV}  # the token comes from its file only
    procs: dict[str, WatchedChild] = {}

    def spawn(host: str, *args: str) -> WatchedChild:
        child_env = {**env, "DGR_CACHE_DIR": str(tmp_path / f"cache-{host}")}  # each machine its own shard cache
        procs[host] = WatchedChild.spawn(host, lan.command(host, dgr_command(*args)), env=child_env)
        return procs[host]

    def node(host: str, *source: str) -> WatchedChild:
        return spawn(host, "node", "--tracker", url, "--manifest", str(m), "--memory", str(budget), *source,
                     "--backend", "llama_shard", "--threads", "1", "--busy-poll-ms", "0",  # as LocalRoute.busy_poll_ms
                     "--host", "0.0.0.0", "--port", str(NODE_PORT),
                     "--join-token-file", str(token), "--identity", str(tmp_path / f"{host}.key"))

    def joined(host: str) -> dict[str, Any]:
        """The host's node, once ready, proven and routable at the tracker."""
        ready = procs[host].wait_ready(READY_S)
        return _wait_for(lambda: (e := _nodes(url, headers, trust).get(ready["node"])) and e["routable"] and e,
                         READY_S, f"{host}'s node to be proven and routable")

    try:
        spawn("tracker", "tracker", "--host", "0.0.0.0", "--port", str(TRACKER_PORT), "--manifest", str(m),
              "--join-token-file", str(token), "--api-key-file", str(_secret_file(tmp_path / "api-keys", api_key)),
              "--identity", str(tmp_path / "tracker.key"), "--dead-after", str(DEAD_AFTER_S),
              "--prefill-chunk", "512")
        procs["tracker"].wait_ready(READY_S)
        tracker_id = Identity.load(tmp_path / "tracker.key", create=False)
        trust = TlsTrust().context((tmp_path / "tracker.crt").read_text())  # what the tracker kept for its clients
        as_tracker = LinkCert(identity_cert(tracker_id, "tracker"), tracker_id.private)
        node("a", "--model", str(default_model_path()))  # the machine with the whole file
        want = _whole_model_answers()  # while the node loads
        entries = {"a": joined("a")}
        for host in ("b", "c"):  # one at a time: each is assigned with the others' claims counted
            node(host, "--fetch", "--model-dir", str(tmp_path / f"model-{host}"), "--fetch-timeout", "60")
            entries[host] = joined(host)
        ready_s = time.monotonic() - started

        # the tracker's ranges: what each node says it was assigned, contiguous, tiling the model
        ranges = {h: LayerRange.parse(e["layers"]) for h, e in entries.items()}
        for host, layers in ranges.items():
            assert procs[host].ready["layers"] == str(layers)
            assert any(f"the tracker assigned layers {layers}" in line for line in procs[host].lines), host
        tiles = sorted(ranges.values(), key=lambda r: r.start)
        assert tiles[0].start == 0 and tiles[-1].stop == len(manifest.layers)
        assert all(x.stop == y.start for x, y in zip(tiles, tiles[1:])), tiles
        assert len(set(ranges.values())) == 3

        # reached where the tracker saw them, not at 0.0.0.0: their HTTP and their seeds
        for host, e in entries.items():
            assert e["url"] == f"https://{lan.addr(host)}:{NODE_PORT}", e["url"]
            assert procs[host].ready["bound"] == f"https://0.0.0.0:{NODE_PORT}"
            assert e["key"] == procs[host].ready["key"]  # one spelling of a key (ed25519:...), as --allow-node takes
        peers = httpx.get(f"{url}/v1/artifacts/{manifest.id}/peers", headers=headers, timeout=5,
                          verify=trust).json()["peers"]
        by_node = {p["node"]: p["seed"] for p in peers}
        for host, e in entries.items():
            assert by_node[e["node"]].rpartition(":")[0] == lan.addr(host), by_node

        # each fetcher holds exactly its layers' pieces (with the header and the globals its range loads), from the seeders
        for host in ("b", "c"):
            # a node answers only its tracker's members and the tracker: here, as the tracker
            node_cert = identity_cert(Identity.load(tmp_path / f"{host}.key", create=False), "node")
            art = httpx.get(f"{entries[host]['url']}/v1/artifact", timeout=5,
                            verify=TlsTrust(client=as_tracker).context(node_cert)).json()
            need = set(manifest.needed_pieces(ranges[host], GlobalNeed.COMPUTE))
            assert set(art["fetch"]["pieces_fetched"]) == need and set(art["fetch"]["pieces_have"]) == need, host
            others = {i for layer in manifest.layers if layer.index not in range(ranges[host].start, ranges[host].stop)
                      for a, b in layer.pieces for i in range(a, b)} - need
            assert len(others) > 300  # the other layers' pieces stayed behind
            assert art["verify"]["ok"] and art["verify"]["layers"] == str(ranges[host])

        # greedy answers through the three machines equal the single node's
        order = [(entries[h]["node"], str(r)) for h, r in sorted(ranges.items(), key=lambda hr: hr[1].start)]
        for prompt in PROMPTS:
            text, n, route = _complete(f"{url}/v1", prompt, headers, trust)
            assert (text, n) == want[prompt] and n == MAX_TOKENS
            assert route == order

        # a fourth machine with the same budget, once the model is covered: a replica of a running range
        node("d", "--fetch", "--model-dir", str(tmp_path / "model-d"), "--fetch-timeout", "60")
        entries["d"] = joined("d")
        d_layers = LayerRange.parse(entries["d"]["layers"])
        twin = next(h for h in ("a", "b", "c") if ranges[h] == d_layers)
        assert any("(0 not served before)" in line for line in procs["d"].lines)

        # the twin dies without a word; once the tracker has seen it go, new sessions take the replica
        os.kill(procs[twin].popen.pid, signal.SIGKILL)
        twin_id = entries[twin]["node"]
        _wait_for(lambda: not _nodes(url, headers, trust)[twin_id]["alive"], 5 * DEAD_AFTER_S + 10, f"{twin} to be dead")
        for prompt in PROMPTS:
            text, n, route = _complete(f"{url}/v1", prompt, headers, trust)
            assert (text, n) == want[prompt]
            assert (entries["d"]["node"], str(d_layers)) in route and twin_id not in {h for h, _ in route}
        print(f"\nLAN: budget {budget / 2**20:.0f} MiB, ranges {', '.join(f'{h}={r}' for h, r in ranges.items())}, "
              f"replica d={d_layers} of {twin}; three nodes routable after {ready_s:.1f} s, "
              f"all done in {time.monotonic() - started:.1f} s")
    finally:
        for child in reversed(procs.values()):
            child.stop(10)
