"""The HTTP/1.1 protocol the server runs: uvicorn's h11 protocol with read deadlines, so that
a client that sends its headers or its body a byte at a time (slowloris) cannot hold a
connection: the headers of each request must arrive within ``header_timeout`` seconds of the
connection opening (or of the last response, on a kept-alive one), and its body within
``body_timeout`` of the headers; otherwise the connection is closed (with a 408 when nothing
of a response has gone out). A client that stops reading its response cannot hold one either:
once the connection's send buffer is full, the response may wait ``write_timeout`` seconds for
the client to read; then the connection is dropped, which aborts its request (its sequences
and KV blocks are freed)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("engine.server")


def bounded_h11_protocol(header_timeout: float, body_timeout: float, write_timeout: float = 60.0) -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._deadline = None
            self._reading = None  # "headers" or "body": what the deadline waits for
            self._stalled = None  # the deadline of a response the client does not read
            self._arm("headers", header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._unstall()
            super().connection_lost(exc)

        def pause_writing(self) -> None:  # the send buffer is full: the client is not reading
            super().pause_writing()
            if self._stalled is None:
                self._stalled = self.loop.call_later(write_timeout, self._not_read)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._unstall()

        def _unstall(self) -> None:
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None

        def _not_read(self) -> None:
            self._stalled = None
            if self.transport.is_closing():
                return
            logger.info("dropping a connection whose client has not read its response for %.0f s", write_timeout)
            self.transport.abort()  # close() would wait to flush what the client does not read

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.SEND_BODY and self._reading != "body":
                self._arm("body", body_timeout)
            elif state is h11.DONE or state is h11.MUST_CLOSE or state is h11.CLOSED:
                self._disarm()  # the request is in: the app runs as long as it takes
            elif state is h11.IDLE and self._reading is None:
                self._arm("headers", header_timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm("headers", header_timeout)

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._reading = what
            self._deadline = self.loop.call_later(seconds, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._reading = None, None

        def _timed_out(self) -> None:
            what = self._reading
            self._deadline, self._reading = None, None
            if self.transport.is_closing():
                return
            logger.info("closing a connection whose request %s did not arrive in time", what)
            cycle = getattr(self, "cycle", None)
            if cycle is None or not cycle.response_started:  # nothing of a response has gone out: say why
                try:
                    body = (
                        b'{"error": {"message": "The request was not sent in time.", "type": "invalid_request_error"}}'
                    )
                    self.transport.write(
                        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                    )
                except Exception:  # the transport is going away anyway
                    pass
            self.transport.close()

    return BoundedH11Protocol
