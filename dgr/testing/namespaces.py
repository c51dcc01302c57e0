"""The network namespaces dgr's benches and tests make, and what they leave behind.

Both `dgr bench --rtt` (dgr.bench.netns: a route whose nodes each live in a
namespace) and the LAN test route (dgr.testing.lan) name their namespaces
`dgrb-<pid>-<name>` and their root-namespace links `dgrb<pid>r<k>` or
`dgrb<pid>n<k>`, so one sweep finds what a crashed run left (`remove_stale`)
and a test can check that its own run left nothing (`leftovers`). Their
addresses come from a 10.213.S.0/24 that nothing routed here overlaps
(`free_subnet`). Every command goes through `run_tool`.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess

from dgr.errors import CallerError, Reason

__all__ = ["free_subnet", "leftovers", "remove_stale", "root_links", "run_tool"]

_NS = re.compile(r"^dgrb-(\d+)-\w+$")
_DEV = re.compile(r"^dgrb(\d+)[rn]\d+$")


def run_tool(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run one iproute2/tc command.

    Raises:
        CallerError(INVALID_REQUEST): it failed and `check` is set (this machine cannot build the topology).
    """
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise CallerError(Reason.INVALID_REQUEST, f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.returncode}")
    return r


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    r = run_tool(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def root_links() -> list[str]:
    r = run_tool(["ip", "-o", "link", "show"], check=False)
    # "6: dgrb12r0@if5: <...>": the name ends at '@' (veth peer) or ':'
    return [line.split(":")[1].strip().split("@")[0] for line in r.stdout.splitlines() if ":" in line]


def _ours(pid: int) -> tuple[list[str], list[str]]:
    ns = [n for n in _netns_names() if (m := _NS.match(n)) and int(m.group(1)) == pid]
    devs = [d for d in root_links() if (m := _DEV.match(d)) and int(m.group(1)) == pid]
    return ns, devs


def leftovers(pid: int | None = None) -> list[str]:
    """Namespaces and root-namespace links this process (or `pid`) made that still exist."""
    ns, devs = _ours(os.getpid() if pid is None else pid)
    return ns + devs


def remove_stale() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone; returns what was removed."""
    removed = []
    for name in _netns_names():
        m = _NS.match(name)
        if m and not _alive(int(m.group(1))):
            # a crashed run's nodes keep its namespace alive; they are this tool's processes
            for pid in run_tool(["ip", "netns", "pids", name], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run_tool(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for dev in root_links():
        m = _DEV.match(dev)
        if m and not _alive(int(m.group(1))):
            run_tool(["ip", "link", "del", dev], check=False)
            removed.append(dev)
    return removed


def free_subnet() -> int:
    """S such that 10.213.S.0/24 overlaps no address or route of the root namespace."""
    used = []
    for cmd in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for line in run_tool(cmd, check=False).stdout.split("\n"):
            for token in line.split():
                try:
                    net = ipaddress.ip_network(token, strict=False)
                except ValueError:
                    continue
                if net.prefixlen > 0:
                    used.append(net)
    for i in range(256):
        s = (os.getpid() + i) % 256
        net = ipaddress.ip_network(f"10.213.{s}.0/24")
        if not any(net.overlaps(u) for u in used):
            return s
    raise CallerError(Reason.INVALID_REQUEST, "no free 10.213.S.0/24 subnet on this machine")
