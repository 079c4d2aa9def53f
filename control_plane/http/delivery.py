"""How far an HTTP client has read its response: bytes its TCP stack acknowledged.

A write to a client that reads nothing completes as long as the kernel buffers take it: on
loopback the sender's send buffer alone grows to 4 MiB (``tcp_wmem``), a few thousand SSE chunks,
so a write timeout that waits for ``send`` to block starts only after megabytes, if the
generation is that long at all. What tells whether the *consumer* progresses is the peer's
acknowledgements: a client whose receive buffer is full advertises a zero window and
acknowledges nothing more, while the bytes it owes wait in our send queue.

`DeliveryProgress` reads both from the connection's socket (Linux): ``TCP_INFO``'s
``tcpi_bytes_acked`` (bytes the peer acknowledged, cumulative) and ``SIOCOUTQ`` (bytes sent but
not yet acknowledged, plus bytes not sent yet). `DeliveryProgress.stalled_for` says for how long
bytes have been pending while the acknowledged count stood still.

The connection reaches the response through the ASGI scope: the HTTP server's protocol
(``control_plane.http.server.GuardedH11Protocol``) puts its transport under
``scope["extensions"][TRANSPORT_EXTENSION]["transport"]`` (ASGI extensions are dicts).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time
from collections.abc import Mapping
from typing import Any

TRANSPORT_EXTENSION = "loraplane.transport"
"""Key in ``scope["extensions"]`` of ``{"transport": the connection's asyncio transport}``."""
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_OFFSET = 120  # struct tcp_info: tcpi_bytes_acked (Linux 4.1 on), after tcpi_max_pacing_rate
_TCP_INFO_LEN = 232


class DeliveryProgress:
    """Acknowledged and pending bytes of one TCP connection, sampled on demand.

    Use `of` to build one (None when the connection is not a TCP socket this can read);
    call `stalled_for` periodically.
    """

    def __init__(self, transport: Any, sock: Any) -> None:
        self.transport = transport
        self._sock = sock
        self._acked: int | None = None
        self._since = time.monotonic()

    @classmethod
    def of(cls, scope: Mapping[str, Any]) -> DeliveryProgress | None:
        """The connection of an ASGI ``scope``, or None: no transport in the scope (another
        server), not a TCP socket, or a kernel without ``tcpi_bytes_acked``."""
        transport = scope.get("extensions", {}).get(TRANSPORT_EXTENSION, {}).get("transport")
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        progress = cls(transport, sock)
        return progress if progress.sample() is not None else None

    def sample(self) -> tuple[int, int] | None:
        """(bytes acknowledged by the peer, bytes pending: sent unacknowledged or unsent);
        None once the socket cannot be read (closed)."""
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            if len(info) < _BYTES_ACKED_OFFSET + _BYTES_ACKED.size:
                return None
            (acked,) = _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_OFFSET)
            pending = struct.unpack("i", fcntl.ioctl(self._sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError, AttributeError):  # AttributeError: no TCP_INFO / TIOCOUTQ here
            return None
        return acked, pending + self.transport.get_write_buffer_size()

    def reset(self) -> None:
        """Reset the connection (RST): unlike a close, which would keep the bytes owed queued in
        the kernel until the client reads them or the connection times out, this frees them now."""
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # closed already
        self.transport.abort()

    def stalled_for(self) -> float:
        """Seconds the client has owed bytes without acknowledging any (0.0 while it acknowledges,
        or owes nothing, or the socket cannot be read any more)."""
        now = time.monotonic()
        sampled = self.sample()
        if sampled is None:
            return 0.0
        acked, pending = sampled
        if pending == 0 or acked != self._acked:
            self._acked, self._since = acked, now
            return 0.0
        return now - self._since


__all__ = ["TRANSPORT_EXTENSION", "DeliveryProgress"]
