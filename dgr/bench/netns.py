"""Routes whose nodes each live in their own Linux network namespace, over links with a chosen RTT.

`dgr bench --rtt MS` needs the network between the tracker and its nodes to
cost something, so that a route's hop count shows up as latency the way it
would across machines. Loopback costs microseconds and hides it.

Topology: machines on one network. The tracker and the benchmark client stay
in the root namespace; node k runs in namespace `dgrb-<pid>-<k>`. Every
endpoint (the tracker and each node) has one link to a shared network, and
any two endpoints see the same RTT, node to node as well as tracker to node.
So a route's links cost what they would across machines: a ring (each node
forwards to the next, the tail sends each next step straight to the head)
pays N one-way trips a token on an N-node route. The client-tracker connection
is not delayed (the client is co-located with the gateway, as `dgr up`
users are).

Where the delay goes:
- `netem` links: a hub namespace `dgrb-<pid>-hub` forwards between the
  endpoints; each endpoint's link to it is a veth pair with
  `tc qdisc ... netem delay RTT/4` on both ends, so a packet between two
  endpoints crosses two delayed egresses (RTT/2 one way).
- `tun` links, for kernels built without sch_netem (CONFIG_NET_SCH_NETEM
  unset, as on some VM kernels): a TUN device per endpoint, and one
  user-space delay line process (`python -m dgr.bench.delayline`)
  that routes each IP packet to the TUN of its destination after RTT/2. The
  copy costs tens of microseconds per packet at every RTT, 0 ms included,
  so the 0 ms baseline carries it too.
`auto` picks netem when a probe namespace accepts a netem qdisc.

Network rules: only addresses on links made here are used, 10.213.S.0/24
with a /30 per link (endpoint j at .4j+2, the hub's side at .4j+1), S picked
so that nothing already routed on the machine overlaps it. Node namespaces
hold only their link and loopback, with a route to the /24 and no default
route, so nothing else is reachable from them. The tracker listens on its
own link's address only; that is not loopback, so it runs with a fresh
join token and API key, both passed in the environment, never in argv.

Cleanup: namespaces `dgrb-<pid>-<k>` and `dgrb-<pid>-hub`, and the root
namespace's link `dgrb<pid>r0` are removed in a `finally`; on start, those
left by a run whose pid is gone (a crashed run) are removed first.

Needs root and iproute2 with `ip netns` (and /dev/net/tun for `tun` links);
`prerequisites()` says why not, and callers skip with that message.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import attrs
import httpx

from dgr.backends.base import LayerRange
from dgr.errors import CallerError, PeerError, Reason
from dgr.procs import WatchedChild, dgr_command, ready_info
from dgr.security.secrets import API_KEYS_ENV, JOIN_ENV, new_secret
from dgr.testing.namespaces import free_subnet, remove_stale, root_links, run_tool

__all__ = [
    "LINK_KINDS",
    "Link",
    "NetnsRoute",
    "choose_link",
    "clean_env",
    "prerequisites",
]

LINK_KINDS = ("auto", "netem", "tun")
PLACEMENT = ("one network: any two endpoints (the tracker and each node) see the same RTT, "
             "RTT/2 each way, node to node as well as tracker to node")


def prerequisites() -> str | None:
    """None when this process can build namespaced routes, else why not (a skip message)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root: run `dgr bench --rtt` as root, or leave --rtt out"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    r = run_tool(["ip", "netns", "list"], check=False)
    if r.returncode != 0:
        return f"`ip netns` is unavailable: {r.stderr.strip()}"
    probe = f"dgrb-{os.getpid()}-probe"
    r = run_tool(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    run_tool(["ip", "netns", "del", probe], check=False)
    return None


def _netem_works() -> bool:
    if shutil.which("tc") is None:
        return False
    probe = f"dgrb-{os.getpid()}-probe"
    run_tool(["ip", "netns", "add", probe])
    try:
        return run_tool(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                    check=False).returncode == 0
    finally:
        run_tool(["ip", "netns", "del", probe], check=False)


def choose_link(requested: str = "auto") -> str:
    """'netem' or 'tun': the link kind to build here.

    Raises:
        CallerError(INVALID_REQUEST): an unknown kind, netem asked for on a kernel without it,
            or no kind possible.
    """
    if requested not in LINK_KINDS:
        raise CallerError(Reason.INVALID_REQUEST, f"link kind {requested!r} is not one of {LINK_KINDS}")
    if requested in ("auto", "netem") and _netem_works():
        return "netem"
    if requested == "netem":
        raise CallerError(Reason.INVALID_REQUEST, "this kernel has no netem qdisc (sch_netem): use --rtt-link tun")
    if not os.path.exists("/dev/net/tun"):
        raise CallerError(Reason.INVALID_REQUEST, "neither a netem qdisc nor /dev/net/tun is available")
    return "tun"


@attrs.frozen
class Link:
    """One endpoint's link to the shared network: the tracker's (index -1) or node k's (index k).

    `ns` is the endpoint's namespace ("" for the root namespace, the
    tracker's); `dev` and `addr` are its side; `hub_dev` and `hub_addr` are
    the hub's side (used by netem links only).
    """

    index: int
    ns: str
    dev: str
    addr: str
    hub_dev: str
    hub_addr: str
    subnet: str

    @classmethod
    def make(cls, pid: int, subnet: int, k: int) -> Link:
        """Node k's link, or the tracker's for k == -1."""
        if not -1 <= k < 62:
            raise CallerError(Reason.INVALID_REQUEST, "at most 62 namespaced nodes (a /30 each in one /24)")
        j = k + 1
        ns, dev = ("", f"dgrb{pid}r0") if k < 0 else (f"dgrb-{pid}-{k}", f"dgrb{pid}n{k}")
        return cls(k, ns, dev, f"10.213.{subnet}.{4 * j + 2}", f"dgrb{pid}h{j}", f"10.213.{subnet}.{4 * j + 1}",
                   f"10.213.{subnet}.0/24")

    def ip(self, *args: str) -> list[str]:
        """An `ip` command run in this endpoint's namespace."""
        return ["ip", *(["-n", self.ns] if self.ns else []), *args]

    def in_ns(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *cmd] if self.ns else list(cmd)


# -- child processes ------------------------------------------------------------------------
def _ready_or_plain(line: str) -> dict[str, Any] | None:
    """A `dgr-ready {json}` line, or the delay line's plain `ready`."""
    return {} if line == "ready" else ready_info(line)


@attrs.define
class _Child(WatchedChild):
    """A dgr process, or the delay line (plain `ready`, then `ok` after each command it is sent)."""

    is_ready: Callable[[str], dict[str, Any] | None] = _ready_or_plain

    @classmethod
    def spawn(cls, name: str, cmd: list[str], env: dict[str, str], *, stdin: bool = False) -> _Child:
        return super().spawn(name, cmd, env=env, stdin=stdin)

    def on_line(self, line: str) -> None:
        if line == "ok":
            self.event.set()

    def wait(self, deadline: float) -> dict[str, Any]:
        """Raises: PeerError(NODE_ERROR): it exited or was not ready by `deadline` (monotonic)."""
        return self.wait_ready(deadline - time.monotonic())

    def command(self, line: str, timeout_s: float = 5.0) -> None:
        """Send one line to the delay line and wait for its `ok`."""
        self.event.clear()
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        self.wait_ready(timeout_s)

    def stop(self, grace_s: float = 15.0) -> None:
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()  # the delay line exits on EOF
            except OSError:
                pass
        super().stop(grace_s)


def _splits(backend: str, nodes: int) -> list[LayerRange]:
    """The layer ranges `dgr up` would give `nodes` nodes of this backend's default model."""
    from dgr.backends.factory import model_layer_count, resolve_model
    from dgr.up import route_splits

    model = resolve_model(backend, None)
    return route_splits(model, model_layer_count(backend, model), nodes)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment for a namespaced child, without proxies or API keys, plus `extra`."""
    # nodes cannot reach any proxy from their namespace, and must not try
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and k != API_KEYS_ENV}
    return {**env, **extra}


# -- the route ------------------------------------------------------------------------------
@attrs.define
class NetnsRoute:
    """A tracker in the root namespace and `nodes` nodes, each in its own namespace, over delayable links."""

    backend: str = "stub"
    nodes: int = 2
    threads: int = 1
    ctx: int = 4096
    max_sessions: int = 8
    stub_delay: float = 0.0
    prefill_chunk: int = 512
    draft_model: str | None = None  # the tail's `--draft-model`
    draft_threads: int | None = None
    spec_allow: str | None = None  # the tracker's --spec-allow (None: its default)
    busy_poll_ms: float | None = None  # each node's --busy-poll-ms (None: the product's default)
    link: str = "auto"
    ready_timeout_s: float = 120.0
    kind: str = ""  # the link kind built: netem or tun
    rtt_ms: float = 0.0
    links: list[Link] = attrs.field(factory=list)  # one per node, node k's at index k
    tracker_link: Link | None = None
    hub: str = ""  # the hub namespace (netem links)
    url: str = ""
    secret: str = attrs.field(factory=new_secret)
    api_key: str = attrs.field(factory=lambda: "dgrb-" + secrets.token_hex(16))
    other_keys: tuple[str, ...] = ()  # more API keys the tracker takes: other scopes of kept prefixes
    _children: list[_Child] = attrs.field(factory=list)
    _delay_line: _Child | None = None
    _namespaces: list[str] = attrs.field(factory=list)

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def __enter__(self) -> NetnsRoute:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Build the links, start the tracker and the nodes, wait until every node is routable.

        Raises:
            CallerError(INVALID_REQUEST): the namespaces and links cannot be built here.
            PeerError(NODE_ERROR): the tracker or a node did not come up.
        """
        remove_stale()
        self.kind = choose_link(self.link)
        splits = _splits(self.backend, self.nodes)
        pid, subnet = os.getpid(), free_subnet()
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            self.tracker_link = Link.make(pid, subnet, -1)
            self.links = [Link.make(pid, subnet, k) for k in range(self.nodes)]
            self._build_links(pid)
            self._start_processes(splits, deadline)
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[Link]:
        return [self.tracker_link, *self.links] if self.tracker_link is not None else list(self.links)

    def _add_ns(self, ns: str) -> None:
        run_tool(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        run_tool(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build_links(self, pid: int) -> None:
        for ln in self.links:
            self._add_ns(ln.ns)
        if self.kind == "netem":
            self.hub = f"dgrb-{pid}-hub"
            self._add_ns(self.hub)
            run_tool(["ip", "netns", "exec", self.hub, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            for ln in self.endpoints:
                run_tool(["ip", "link", "add", ln.dev, *(["netns", ln.ns] if ln.ns else []),
                      "type", "veth", "peer", "name", ln.hub_dev, "netns", self.hub])
                run_tool(["ip", "-n", self.hub, "addr", "add", f"{ln.hub_addr}/30", "dev", ln.hub_dev])
                run_tool(["ip", "-n", self.hub, "link", "set", ln.hub_dev, "up"])
                run_tool(ln.ip("addr", "add", f"{ln.addr}/30", "dev", ln.dev))
                run_tool(ln.ip("link", "set", ln.dev, "up"))
                run_tool(ln.ip("route", "add", ln.subnet, "via", ln.hub_addr))
        else:
            # the delay line is the network: every endpoint's TUN holds the /24, and it routes by destination
            specs = [f"{ln.dev}:{ln.ns or '-'}:{ln.addr}" for ln in self.endpoints]
            self._delay_line = _Child.spawn("delay line", [sys.executable, "-m", "dgr.bench.delayline",
                                                            *specs], clean_env(), stdin=True)
            self._delay_line.wait(time.monotonic() + 30)
            for ln in self.endpoints:
                run_tool(ln.ip("addr", "add", f"{ln.addr}/24", "dev", ln.dev))
                run_tool(ln.ip("link", "set", ln.dev, "up"))
        self.set_rtt(0.0)

    def _start_processes(self, splits: list[LayerRange], deadline: float) -> None:
        from dgr.up import node_args, tracker_args

        targs = types.SimpleNamespace(port=0, prefill_chunk=self.prefill_chunk, step_deadline=10.0, seam_dtype="f32",
                                      spec_allow=self.spec_allow)
        # plain http between the namespaces, as every archived run measured it: encryption's own cost is
        # measured side by side on loopback (docs/perf/archive/tls)
        tracker = _Child.spawn("tracker", [*dgr_command(*tracker_args(targs)), "--host", self.tracker_link.addr,
                                           "--insecure"],
                               clean_env(**{JOIN_ENV: self.secret,
                                            API_KEYS_ENV: ",".join((self.api_key, *self.other_keys))}))
        self._children.append(tracker)
        self.url = tracker.wait(deadline)["url"]
        nargs = types.SimpleNamespace(backend=self.backend, ctx=self.ctx, max_sessions=self.max_sessions,
                                      stub_delay=self.stub_delay, stub_model="default", idle_timeout=120.0,
                                      model=None, manifest=None, draft_model=self.draft_model,
                                      draft_threads=self.draft_threads, busy_poll_ms=self.busy_poll_ms)
        for ln, layers in zip(self.links, splits):
            argv = node_args(nargs, layers, self.url, f"node{ln.index}", self.threads, tail=layers is splits[-1])
            cmd = ["ip", "netns", "exec", ln.ns, *dgr_command(*argv), "--host", ln.addr, "--insecure"]
            self._children.append(_Child.spawn(f"node{ln.index}", cmd, clean_env(**{JOIN_ENV: self.secret})))
        for child in self._children[1:]:
            child.wait(deadline)
        names = {f"node{ln.index}" for ln in self.links}
        while True:
            try:
                table = httpx.get(f"{self.url}/v1/nodes", headers=self.headers, timeout=5).json()["nodes"]
                if names <= {n["node"] for n in table if n["alive"]}:
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise PeerError(Reason.NODE_ERROR, f"nodes {sorted(names)} never all alive at the tracker")
            time.sleep(0.1)

    def set_rtt(self, rtt_ms: float) -> None:
        """Make the round trip between any two endpoints cost `rtt_ms` more (half each way)."""
        if rtt_ms < 0:
            raise CallerError(Reason.INVALID_REQUEST, f"RTT must be >= 0 ms, not {rtt_ms}")
        if self.kind == "tun":
            self._delay_line.command(f"{rtt_ms / 2e3:.9f}")
        else:
            quarter_us = f"{rtt_ms * 250:.0f}us"  # two delayed egresses between any two endpoints
            for ln in self.endpoints:
                for cmd, dev in ((ln.in_ns("tc"), ln.dev), (["ip", "netns", "exec", self.hub, "tc"], ln.hub_dev)):
                    if rtt_ms > 0:
                        run_tool([*cmd, "qdisc", "replace", "dev", dev, "root", "netem", "delay", quarter_us])
                    else:
                        run_tool([*cmd, "qdisc", "del", "dev", dev, "root"], check=False)
        self.rtt_ms = rtt_ms

    def model_id(self) -> str:
        return httpx.get(f"{self.api}/models", headers=self.headers, timeout=10).json()["data"][0]["id"]

    def close(self) -> None:
        """Stop every process, then delete every link and namespace this route made (idempotent)."""
        for child in reversed(self._children):  # nodes first: the tracker sees them leave
            child.stop()
        self._children.clear()
        if self._delay_line is not None:
            self._delay_line.stop()  # its TUN devices go with it
            self._delay_line = None
        if self.tracker_link is not None and self.tracker_link.dev in root_links():
            run_tool(["ip", "link", "del", self.tracker_link.dev], check=False)  # a veth pair goes as a whole
        for ns in self._namespaces:
            run_tool(["ip", "netns", "del", ns], check=False)
        self._namespaces.clear()
