"""The user-space delay line of `tun` links: IP packets between endpoints' TUN devices, each after a delay.

    python -m dgr.bench.delayline DEV:NAMESPACE:ADDR ...

One job: be the wire where the kernel has no sch_netem (CONFIG_NET_SCH_NETEM
unset, as on some VM kernels). dgr.bench.netns.NetnsRoute starts it as a
child process with one DEV:NAMESPACE:ADDR per endpoint and sends it each new
one-way delay on stdin. Rules: a packet goes to the TUN of the endpoint that
holds its IPv4 destination, after the delay current when it was read;
packets to one endpoint keep their order; one for nobody is dropped, and one
that cannot be written (a link going down) is lost, as on a wire. Its TUN
devices are non-persistent: they vanish when the process exits.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import ipaddress
import os
import select
import struct
import sys
import time

__all__ = ["delay_line", "main"]

_NETNS_DIRS = ("/run/netns", "/var/run/netns")
_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_PR_SET_TIMERSLACK = 29


def _setns(libc, fd: int) -> None:
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def _netns_path(ns: str) -> str:
    for d in _NETNS_DIRS:
        if os.path.exists(f"{d}/{ns}"):
            return f"{d}/{ns}"
    raise FileNotFoundError(ns)


def delay_line(specs: list[str]) -> int:
    """Route IP packets between endpoints' TUN devices, each one after the current one-way delay.

    `specs` are DEV:NAMESPACE:ADDR, NAMESPACE `-` for this process's own.
    Each TUN is made inside its namespace (setns), non-persistent, so they
    vanish when this process exits. A packet read from any TUN is written to
    the TUN whose endpoint holds its IPv4 destination; one for nobody is
    dropped. Prints `ready`; then each stdin line is a new one-way delay in
    seconds (answered `ok`); end of stdin ends it. Packets to one endpoint
    keep their order, and one that cannot be written (a link going down) is
    lost, as on a wire.

    A timed wake-up runs late (timer slack, then the scheduler: about a
    quarter of a millisecond per direction on a busy VM), which would add
    to every delayed hop. So the lateness is learned as it happens and taken
    off each timeout; a wake-up that comes early polls until the packet is
    due, which costs CPU only for the lateness' spread.
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    owner: dict[bytes, int] = {}  # IPv4 address -> the TUN of the endpoint holding it
    for spec in specs:
        dev, ns, addr = spec.split(":")
        if ns == "-":
            fd = _open_tun(dev)
        else:
            target = os.open(_netns_path(ns), os.O_RDONLY)
            _setns(libc, target)
            fd = _open_tun(dev)
            _setns(libc, home)
            os.close(target)
        owner[ipaddress.IPv4Address(addr).packed] = fd
    tuns = list(owner.values())
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)  # a wire does not wait for the CPU: run ahead of the nodes
    except OSError:
        pass
    libc.prctl(_PR_SET_TIMERSLACK, 1)  # 1 ns instead of 50 us of slack on every timed wait
    waiting: dict[int, collections.deque] = {fd: collections.deque() for fd in tuns}  # (due, packet) to write to fd
    delay, stdin, pending = 0.0, sys.stdin.fileno(), b""
    late = 0.0  # how late a timed wake-up comes here (moving average, seconds)
    print("ready", flush=True)
    while True:
        due = min((q[0][0] for q in waiting.values() if q), default=None)
        start = time.monotonic()
        timeout = None if due is None else max(0.0, due - start - late)
        readable, _, _ = select.select([stdin, *tuns], [], [], timeout)
        now = time.monotonic()
        if not readable and timeout:
            late = 0.9 * late + 0.1 * min(2e-3, max(0.0, now - start - timeout))
        for fd in readable:
            if fd == stdin:
                data = os.read(stdin, 4096)
                if not data:
                    return 0
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    delay = float(line)
                    print("ok", flush=True)
                continue
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                # IPv4 only (the links carry no other): the destination is bytes 16-20
                to = owner.get(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
                if to is not None:
                    waiting[to].append((now + delay, packet))
        now = time.monotonic()
        for fd, q in waiting.items():
            while q and q[0][0] <= now:
                try:
                    os.write(fd, q.popleft()[1])
                except OSError:
                    pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m dgr.bench.delayline DEV:NAMESPACE:ADDR ...", file=sys.stderr)
        return 2
    return delay_line(argv)


if __name__ == "__main__":
    sys.exit(main())
