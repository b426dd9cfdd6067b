"""Connection hygiene under uvicorn: a header-read timeout and a cap on open connections.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`), but a connection that is opened
and then sends its request headers slowly (slowloris) is held forever, and every such socket is a file
descriptor. `protocol_class(header_timeout, max_connections)` returns uvicorn's HTTP protocol with:
- a header timer: armed when a connection opens and when the first bytes of a next request arrive on
  a kept-alive one; a connection whose request headers are not complete `header_timeout` seconds
  later is closed. A request that has its headers runs as long as it needs (bodies have their own
  limit, responses may stream for minutes).
- connection caps: a connection opened while `max_connections` are open, or while its peer address holds
  `max_connections_per_client`, is answered 503 (OpenAI's error shape, Retry-After) at once and closed
  after a moment (a lingering close, so the answer is not lost to a reset): a client at the cap gets an
  answer rather than a silent refusal at the file-descriptor limit (`raise_fd_limit` lifts the soft
  limit), and one peer cannot hold every connection.
"""
from __future__ import annotations

import collections
import json
import logging
import resource

log = logging.getLogger("atlas_jax.server")


def _refusal_bytes() -> bytes:
    body = json.dumps({"error": {"message": "server has too many open connections; retry later",
                                 "type": "service_unavailable", "param": None, "code": None}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def protocol_class(header_timeout: float | None, max_connections: int | None,
                   max_connections_per_client: int | None = None):
    """uvicorn's HTTP protocol (httptools or h11, as uvicorn would pick) with the timer and the caps
    (max_connections_per_client: per peer address)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    refusal = _refusal_bytes()
    per_peer: collections.Counter = collections.Counter()

    class GuardedProtocol(AutoHTTPProtocol):
        _header_timer = None
        _header_cycle = None                    # the request cycle when the timer was armed
        _refused = False
        _peer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._peer = self.client[0] if self.client else None
            per_peer[self._peer] += 1
            if max_connections is not None and len(self.connections) > max_connections:
                self._refuse(f"{len(self.connections) - 1} connections open (--max-connections {max_connections})")
            elif max_connections_per_client is not None and per_peer[self._peer] > max_connections_per_client:
                self._refuse(f"{self._peer} has {per_peer[self._peer] - 1} connections open "
                             f"(--max-connections-per-client {max_connections_per_client})")
            else:
                self._arm()

        def _refuse(self, why: str) -> None:
            """503 at once, then a lingering close: the client's request bytes are read and dropped for a
            moment, so the refusal is not lost to a reset."""
            log.warning("refusing a connection: %s", why)
            self._refused = True
            self.transport.write(refusal)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(1.0, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()                     # the first bytes of a next request on a kept-alive connection
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._header_cycle:
                self._disarm()                  # its headers are complete

        def connection_lost(self, exc) -> None:
            self._disarm()
            per_peer[self._peer] -= 1
            if per_peer[self._peer] <= 0:
                del per_peer[self._peer]
            super().connection_lost(exc)

        def _arm(self) -> None:
            if header_timeout is not None:
                self._header_cycle = self.cycle
                self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is self._header_cycle and not self.transport.is_closing():
                log.info("closing a connection whose request headers took over %.0f s", header_timeout)
                self.transport.close()

    return GuardedProtocol


def raise_fd_limit() -> int:
    """Lift the soft open-file limit to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft
