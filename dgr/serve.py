"""Serve an ASGI app on trio, and report where it listens.

`serve_app` is a trio service: it calls `task_status.started(url)` once the
socket is bound, so a caller can bind port 0 and learn the real port. Given
an SSL context (dgr.security.tls), or a certificate and key, it serves
https, and the URL says so. The server is dgr.api.server's lean one (why not
hypercorn: see there).
"""

from __future__ import annotations

import signal
import socket
import ssl

from typing import Any, Callable

import trio

from dgr.api.server import serve_asgi
from dgr.security.tls import server_context

__all__ = ["serve_app", "print_ready", "run_until_signal", "server_ssl_context"]

READY_PREFIX = "dgr-ready "
_KEEP_ALIVE_S = 300  # seam connections stay open for a route's life


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """What a dgr server speaks TLS with: TLS 1.2 or later, HTTP/1.1 by ALPN, the given certificate."""
    return server_context((cert_file, key_file))


async def serve_app(app, host: str, port: int, *, tls_files: tuple[str, str] | None = None,
                    ssl_context: ssl.SSLContext | None = None, listening: socket.socket | None = None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on host:port, or on the `listening` socket given (https with `ssl_context`, or with
    `tls_files`, a (cert, key) pair); started with its URL."""
    ctx = server_ssl_context(*tls_files) if tls_files is not None and ssl_context is None else ssl_context
    await serve_asgi(app, host, port, ssl_context=ctx, keep_alive_s=_KEEP_ALIVE_S, listening=listening,
                     task_status=task_status)


def print_ready(info: dict) -> None:
    """One machine-readable line on stdout: how `dgr up` learns a child is ready."""
    import json
    import sys

    sys.stdout.write(READY_PREFIX + json.dumps(info) + "\n")
    sys.stdout.flush()


def run_until_signal(fn: Callable, *args: Any, signals: tuple[int, ...] | None = None, **kwargs: Any) -> Any:
    """trio.run(fn, ...), cancelled cleanly by SIGINT or SIGTERM (or by `signals` only: a node that drains
    handles SIGTERM itself, dgr.node.drain).

    Returns fn's result, or None when a signal stopped it first.
    """
    result: list[Any] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                with trio.open_signal_receiver(*(signals or (signal.SIGINT, signal.SIGTERM))) as received:
                    async for _ in received:
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch)
            result.append(await fn(*args, **kwargs))
            nursery.cancel_scope.cancel()

    trio.run(main)
    return result[0] if result else None
