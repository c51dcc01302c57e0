"""TLS on trio with OpenSSL reading and writing the socket itself: the seam's encrypted links, at half the cost.

trio.SSLStream runs OpenSSL over memory buffers and moves every record
between them and the socket in Python: on loopback it doubled a link's
round trip (31.5 -> 63.5 us, a 2,368-byte decode frame each way), and a
token crosses several links. `SocketTLS` hands OpenSSL the non-blocking
socket instead (ssl.SSLSocket) and only waits for readiness in trio, as a
plain SocketStream does: 42.9 us (`python -m dgr.bench.tls --links`,
docs/perf/archive/tls). Both ends of the seam speak it (dgr.api.server's
listener, dgr.seam.transport's pool); httpx clients keep trio.SSLStream.

Rules:
- A receive is cancel-safe: it is cancelled only while it waits for the
  socket, before a byte is taken (so dgr.api.server reads it as it reads a
  plain socket). A send that is cancelled leaves the stream unusable, as
  trio's own.
- The handshake is lazy on a server (OpenSSL makes it inside the first
  read) and explicit on a client (`do_handshake`); its failures, and any
  other, are `trio.BrokenResourceError`.
- An end without close_notify reads as an end (https-compatible, as
  trio.SSLListener(https_compatible=True)); `aclose` sends none.

Left out: half-closes, and a second task sending or receiving at once (the
callers never do; trio's streams would raise, this one does not check).
"""

from __future__ import annotations

import select
import socket
import ssl

import attrs
import trio

__all__ = ["SocketTLS", "TlsListener"]

_RECEIVE = 65536


async def _wait(waiter, sock: ssl.SSLSocket) -> None:
    try:
        await waiter(sock)
    except trio.BusyResourceError:  # the other direction waits on the socket: a rare handshake-time turn
        await trio.sleep(0.001)


@attrs.define(eq=False)
class SocketTLS(trio.abc.Stream):
    """A trio Stream of TLS over a non-blocking ssl.SSLSocket."""

    socket: ssl.SSLSocket  # named as trio.SocketStream's: the server reads the peer's address through it

    @classmethod
    def wrap(cls, stream: trio.SocketStream, ctx: ssl.SSLContext, *, server_side: bool,
             server_hostname: str | None = None) -> SocketTLS:
        """Take over `stream`'s socket (the stream is spent) and speak TLS on it with `ctx`.

        Raises:
            OSError: the peer is gone already (a socket that is not connected would be read in clear).
        """
        raw = stream.socket
        plain = socket.socket(raw.family, raw.type, raw.proto, fileno=raw.detach())
        plain.setblocking(False)
        tls = ctx.wrap_socket(plain, server_side=server_side, server_hostname=server_hostname,
                              do_handshake_on_connect=False)
        try:
            tls.getpeername()
        except OSError:
            tls.close()
            raise
        return cls(tls)

    async def do_handshake(self) -> None:
        """Raises: trio.BrokenResourceError (the peer, or its certificate, was refused)."""
        while True:
            try:
                self.socket.do_handshake()
                return
            except ssl.SSLWantReadError:
                await _wait(trio.lowlevel.wait_readable, self.socket)
            except ssl.SSLWantWriteError:
                await _wait(trio.lowlevel.wait_writable, self.socket)
            except OSError as exc:
                raise trio.BrokenResourceError(f"TLS handshake: {exc}") from exc

    def _check_open(self) -> None:
        if self.socket.fileno() < 0:
            raise trio.ClosedResourceError("this TLS stream was closed")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        view = memoryview(data)
        while view:
            try:
                sent = self.socket.send(view)  # all of it, or a retry of the same bytes (no partial writes)
                view = view[sent:]
            except (ssl.SSLWantWriteError, BlockingIOError):
                await _wait(trio.lowlevel.wait_writable, self.socket)
            except ssl.SSLWantReadError:
                await _wait(trio.lowlevel.wait_readable, self.socket)
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self.socket)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        while True:
            try:
                data = self.socket.recv(max_bytes or _RECEIVE)
            except ssl.SSLWantReadError:
                await _wait(trio.lowlevel.wait_readable, self.socket)  # nothing taken yet: cancel-safe
                continue
            except ssl.SSLWantWriteError:
                await _wait(trio.lowlevel.wait_writable, self.socket)
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                data = b""  # close_notify, or an end without one
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            await trio.lowlevel.cancel_shielded_checkpoint()
            return data

    def is_readable(self) -> bool:
        """Whether a read would not wait: for an idle pooled connection, that its peer closed it (or sent what
        nobody asked for). Raises: OSError."""
        return self.socket.pending() > 0 or bool(select.select([self.socket], [], [], 0)[0])

    async def aclose(self) -> None:
        if self.socket.fileno() >= 0:
            trio.lowlevel.notify_closing(self.socket)
            self.socket.close()
        await trio.lowlevel.checkpoint()


@attrs.define(eq=False)
class TlsListener(trio.abc.Listener[SocketTLS]):
    """Accepts from `listener` and speaks TLS with `ctx` (the handshake comes with the first read)."""

    listener: trio.SocketListener
    ctx: ssl.SSLContext

    async def accept(self) -> SocketTLS:
        while True:
            stream = await self.listener.accept()
            try:
                return SocketTLS.wrap(stream, self.ctx, server_side=True)
            except OSError:  # gone before a byte: take the next
                continue

    async def aclose(self) -> None:
        await self.listener.aclose()
