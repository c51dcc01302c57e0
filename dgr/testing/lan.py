"""Machines on one LAN, made of network namespaces: for tests and docs that need several hosts.

`Lan(("tracker", "a", "b"))` makes one namespace per host, each with one
veth link (`eth0`) into one Linux bridge, and gives each an address on one
/24. The bridge lives in a hub namespace of its own, so a host sees the
others the way machines on one Ethernet segment do (the same subnet, ARP,
no router), and nothing else: no default route, no other link. The process
that made the LAN joins it too, through a link in the root namespace, so
it can act as the client machine (an HTTP client in the test).

Unlike `dgr.bench.netns.NetnsRoute` (a tracker and a route of nodes over
delayable links), this only builds the network; what runs on each host is
the caller's, started with `Lan.command(host, argv)`.

Names follow dgr.testing.namespaces, so its `leftovers()` and `remove_stale()`
see them: namespaces `dgrb-<pid>-lan<host>` and `dgrb-<pid>-lanhub`, the
root link `dgrb<pid>r1`, addresses 10.213.S.0/24 with S chosen so that
nothing routed on the machine overlaps it (`free_subnet`). The client is
10.213.S.2 and host k is 10.213.S.(10 + k).

Cleanup: `close()` (and leaving the `with`) deletes the hub, every host
namespace and the root link; callers stop their processes first (a
process keeps its namespace alive, though not its name or its link into
the bridge). Needs root and `ip netns`: `prerequisites()` says why not.
"""

from __future__ import annotations

import os
import re

import attrs

from dgr.testing.namespaces import free_subnet, remove_stale, run_tool
from dgr.errors import CallerError, Reason

__all__ = ["Lan"]

_HOST = re.compile(r"^[a-z0-9]{1,16}$")


@attrs.define
class Lan:
    """Hosts on one bridge, each in its own network namespace (see the module docstring)."""

    hosts: tuple[str, ...]
    subnet: int = -1  # S of 10.213.S.0/24, chosen at start
    pid: int = attrs.field(factory=os.getpid)
    _made: list[str] = attrs.field(factory=list)  # namespaces made, in order
    _root_link: str | None = None

    def __attrs_post_init__(self) -> None:
        bad = [h for h in self.hosts if not _HOST.match(h)]
        if bad or len(set(self.hosts)) != len(self.hosts) or not 0 < len(self.hosts) <= 200:
            raise CallerError(Reason.INVALID_REQUEST, f"hosts must be 1 to 200 distinct [a-z0-9] names: {self.hosts}")

    @property
    def hub(self) -> str:
        return f"dgrb-{self.pid}-lanhub"

    @property
    def client_addr(self) -> str:
        """The address of the process that made the LAN (its root namespace's link)."""
        return f"10.213.{self.subnet}.2"

    def namespace(self, host: str) -> str:
        self._index(host)
        return f"dgrb-{self.pid}-lan{host}"

    def addr(self, host: str) -> str:
        return f"10.213.{self.subnet}.{10 + self._index(host)}"

    def command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` run on `host` (in its namespace)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def _index(self, host: str) -> int:
        try:
            return self.hosts.index(host)
        except ValueError:
            raise CallerError(Reason.INVALID_REQUEST, f"no host {host!r} on this LAN") from None

    def __enter__(self) -> Lan:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Make the hub's bridge, every host and the client's link.

        Raises:
            CallerError(INVALID_REQUEST): a command failed (no root, no `ip netns`, no free subnet).
        """
        remove_stale()
        self.subnet = free_subnet()
        try:
            self._add_ns(self.hub)
            run_tool(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            run_tool(["ip", "-n", self.hub, "link", "set", "br0", "up"])
            for k, host in enumerate(self.hosts):
                ns = self.namespace(host)
                self._add_ns(ns)
                self._plug(["ip", "link", "add", "eth0", "netns", ns], f"p{k}")
                run_tool(["ip", "-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0"])
                run_tool(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._root_link = f"dgrb{self.pid}r1"
            self._plug(["ip", "link", "add", self._root_link], "client")
            run_tool(["ip", "addr", "add", f"{self.client_addr}/24", "dev", self._root_link])
            run_tool(["ip", "link", "set", self._root_link, "up"])
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        run_tool(["ip", "netns", "add", ns])
        self._made.append(ns)
        run_tool(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _plug(self, add_end: list[str], port: str) -> None:
        """A veth pair: the end `add_end` names, and `port` on the hub's bridge."""
        run_tool([*add_end, "type", "veth", "peer", "name", port, "netns", self.hub])
        run_tool(["ip", "-n", self.hub, "link", "set", port, "master", "br0"])
        run_tool(["ip", "-n", self.hub, "link", "set", port, "up"])

    def close(self) -> None:
        """Delete the client's link, the hub and every host namespace (idempotent)."""
        if self._root_link is not None:
            run_tool(["ip", "link", "del", self._root_link], check=False)  # gone already if the hub went first
            self._root_link = None
        for ns in reversed(self._made):
            run_tool(["ip", "netns", "del", ns], check=False)
        self._made.clear()
