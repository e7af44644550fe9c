"""A bound on how long a connection may take to send a request's head, for uvicorn.

uvicorn closes a keep-alive connection that stays idle after an answer, but sets no time on a
connection that opens and sends nothing, or that trickles a request's head a byte at a time (the
"slow loris" attack): each holds a socket and a file descriptor for as long as its client likes,
and enough of them leave none for anybody else. ``http_protocol`` is uvicorn's own HTTP protocol
(httptools where installed, else h11) with one timer more, as nginx's ``client_header_timeout``:
a request's head must be whole within ``head_timeout_s`` of the connection's opening, or of the
first byte sent after an answer; otherwise the connection is closed. A request's body is bounded
by ``operator.BodyLimits``.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: seconds a client has to send a request's whole head (method, path, headers), as nginx's default
HEAD_TIMEOUT_S = 60.0


def http_protocol(head_timeout_s: float = HEAD_TIMEOUT_S) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with the head timer; pass it as ``uvicorn.Config(http=..., ws="none")`` (a
    connection upgraded to a websocket would keep the timer, and these servers have no websocket routes)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # no httptools: uvicorn's pure-Python h11 protocol
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]

    class HeadTimeout(base):  # type: ignore[valid-type, misc]
        """Closes the connection when no new request's head is whole ``head_timeout_s`` after the timer was
        set: at the connection's opening, and at the first byte after an answer (while uvicorn's keep-alive
        timeout bounds the silence before it). A request is a new ``cycle`` of uvicorn's, made once its head is
        whole."""

        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None

        def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and (self._head_timer is None or self._head_cycle is not self.cycle):
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle
            self._head_timer = asyncio.get_running_loop().call_later(head_timeout_s, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is self._head_cycle and not self.transport.is_closing():
                self.logger.debug("closed a connection whose request head took over %g s", head_timeout_s)
                self.transport.close()

    return HeadTimeout
