"""Run an ASGI app under hypercorn on trio, and report where it listens.

`serve_app` is a trio service: it calls `task_status.started(url)` once the
socket is bound, so a caller can bind port 0 and learn the real port. Given
a certificate and key it serves https, and the URL says so.
"""

from __future__ import annotations

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

__all__ = ["serve_app", "print_ready"]

READY_PREFIX = "dgr-ready "


async def serve_app(app, host: str, port: int, *, tls_files: tuple[str, str] | None = None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on host:port (https with `tls_files`, a (cert, key) pair); started with its URL."""
    config = Config()
    config.bind = [f"{host}:{port}"]
    if tls_files is not None:
        config.certfile, config.keyfile = tls_files
    config.accesslog = None
    config.loglevel = "WARNING"
    config.keep_alive_timeout = 300  # seam connections stay open for a route's life
    config.graceful_timeout = 1.0
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(hypercorn_serve, app, config)
        task_status.started(binds[0])


def print_ready(info: dict) -> None:
    """One machine-readable line on stdout: how `dgr up` learns a child is ready."""
    import json
    import sys

    sys.stdout.write(READY_PREFIX + json.dumps(info) + "\n")
    sys.stdout.flush()
