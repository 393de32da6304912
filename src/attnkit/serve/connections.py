"""What a client may send before the app sees its request: ``attnkit serve``'s HTTP protocol, uvicorn's httptools
protocol with bounds (:class:`BoundedHttp`).

uvicorn bounds neither the request line nor the headers (httptools buffers a header line, uvicorn the URL, however
long they grow), nor the time a client takes to send them, and its ``limit_concurrency`` counts a connection only
once its headers have arrived. Its h11 protocol bounds a head (``h11_max_incomplete_event_size``) but answers 400,
and parses more slowly. So the server runs this subclass of
:class:`~uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`:

=============================  ====================================================================================
bound                          a client that passes it
=============================  ====================================================================================
``Limits.max_connections``     is answered 503 (``Retry-After``) as its connection opens, before anything of it
                               is read, and the connection is closed
:data:`MAX_URL_BYTES`          414 (the request line's target)
:data:`MAX_HEAD_BYTES`         431 (the request line and the headers)
``Limits.read_timeout``        408 when a request's head has not ended that many seconds after the connection
                               opened (or after the request's first byte, on a kept-alive connection); a connection
                               that sent nothing at all is closed without an answer
=============================  ====================================================================================

Each refusal closes the connection: the server ends its side at once and drops what still comes in, then closes after
:data:`LINGER_S`, or as soon as the client ends its side (a client still sending its head reads the answer rather
than a reset). A head that has not ended is counted as it arrives and refused as soon as it
passes a bound, so at most one read of the socket beyond the bound is ever buffered; a head that has ended in
bounds' excess is marked in the request's scope (:data:`REFUSED`) and refused by the app's gate
(:class:`attnkit.serve.app._Gate`) before anything else, the API key included, so that ``/metrics`` counts it.
The body is the gate's to bound (``--max-body``, and ``read_timeout`` again: 408), where it is read.
"""

from __future__ import annotations

import json
from asyncio import TimerHandle, Transport
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .batching import Limits

__all__ = ["MAX_HEAD_BYTES", "MAX_URL_BYTES", "REFUSED", "BoundedHttp", "raw_error"]

#: The longest request target (path and query) served: 414 beyond (as nginx's and Apache's default, 8 KiB).
MAX_URL_BYTES = 8 * 1024
#: The longest head (request line and headers) served: 431 beyond (nginx's default buffers: 4 x 8 KiB).
MAX_HEAD_BYTES = 32 * 1024
#: The ASGI scope key of a complete head refused for its size: ``(status, message)`` for the gate to answer.
REFUSED = "attnkit.refused"
#: Seconds a refused connection stays open, unread, after its answer (:meth:`BoundedHttp._refuse`).
LINGER_S = 1.0


def raw_error(status: int, message: str, headers: tuple[str, ...] = ()) -> bytes:
    """The API's JSON error (``{"error": message}``) as a whole HTTP/1.1 response that closes its connection."""
    body = json.dumps({"error": message}).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class BoundedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring; ``limits``: the server's
    (``max_connections``, ``read_timeout``). uvicorn makes one per connection (``Config(http=partial(BoundedHttp,
    limits=...))``)."""

    def __init__(self, *args: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._in_head = True  # (the rest of) a request's head is awaited
        self._head_bytes = 0  # bytes received since the head began (with what came in the same reads)
        self._url_bytes = 0  # the request target's bytes so far
        self._head_timer: TimerHandle | None = None
        self._refused = False  # answered (or closing): what still comes in is let go

    # -- the connection ------------------------------------------------------------------------------

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"{self.limits.max_connections} connections are open, the limit (--max-connections); "
                              "retry shortly", ("retry-after: 1",))
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if not self._in_head or self._refused or self.transport.is_closing():
            return
        if self._url_bytes > MAX_URL_BYTES:  # a head not ended yet, already past a bound
            self._refuse(414, self._too_long_url())
        elif self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, self._too_large_head())

    # -- the parser's callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._url_bytes = True, 0
        if self._head_timer is None:  # a kept-alive connection's next request: its head has read_timeout
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        super().on_url(url)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._cancel_head_timer()
        head = self._url_bytes + sum(len(name) + len(value) + 4 for name, value in self.headers)  # ": ", CRLF
        if self._url_bytes > MAX_URL_BYTES:
            self.scope[REFUSED] = (414, self._too_long_url())  # type: ignore[literal-required]
        elif head > MAX_HEAD_BYTES:
            self.scope[REFUSED] = (431, self._too_large_head())  # type: ignore[literal-required]
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0  # what comes next is the next request's head

    # -- refusing ------------------------------------------------------------------------------------

    def _too_long_url(self) -> str:
        return f"the request target is more than {MAX_URL_BYTES} bytes long"

    def _too_large_head(self) -> str:
        return f"the request line and headers are more than {MAX_HEAD_BYTES} bytes"

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.read_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self._refused or self.transport.is_closing():
            return
        if self._head_bytes == 0 and self.cycle is None:  # a connection that never sent anything
            self._refused = True
            self.transport.close()
            return
        self._refuse(408, f"the request's head did not arrive within {self.limits.read_timeout:g} s "
                          "(--read-timeout)")

    def _refuse(self, status: int, message: str, headers: tuple[str, ...] = ()) -> None:
        """Answer ``status`` and close the connection; what the client sends after is let go. Behind a response still
        being sent (a pipelined request's head came while it was), the connection closes after it instead."""
        self._refused = True
        self._cancel_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
            return
        self.transport.write(raw_error(status, message, headers))
        # a lingering close: the client may still be sending (a head too large, a request behind a 503), and closing
        # with its bytes unread would reset the connection, taking the answer with it; so the server ends its side
        # and lets what still comes in go unread for LINGER_S, or until the client closes its side
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
