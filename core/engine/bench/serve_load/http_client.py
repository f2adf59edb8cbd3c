"""A small HTTP/1.1 client over asyncio streams, enough for an OpenAI-compatible server:
one connection per request (``Connection: close``), a JSON body out, the response read
whole or line by line as it arrives (chunked, Content-Length or close-delimited).

The engine's own dependencies hold no HTTP client (httpx comes only with the test
extras), and a load generator needs the time each body line arrived, so this reads
the socket itself.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

# an SSE line of a response with logprobs can be long; the StreamReader's default limit is 64 KiB
LINE_LIMIT = 1 << 24


class ConnectError(OSError):
    """The server could not be reached: refused, unknown host, or the connection broke before a status line."""


@dataclass(frozen=True)
class Server:
    """Where requests go: ``http(s)://host:port`` and a path prefix (``/v1`` added when missing)."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def from_url(cls, base_url: str) -> "Server":
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--base-url must look like http://host:port, got {base_url!r}.")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        prefix = parts.path.rstrip("/")
        if not prefix.endswith("/v1"):
            prefix += "/v1"
        return cls(parts.scheme, parts.hostname, port, prefix)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}"


class Response:
    """A response whose status line and headers have been read; the body is read once,
    with :meth:`lines` (as it arrives) or :meth:`read` (whole)."""

    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader

    async def _chunks(self) -> AsyncIterator[bytes]:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await self._reader.readline()
                if not size_line:
                    raise ConnectError("the connection closed inside a chunked body")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while (await self._reader.readline()).strip():  # trailers
                        pass
                    return
                yield await self._reader.readexactly(size)
                await self._reader.readline()  # the CRLF after the chunk
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                data = await self._reader.read(min(remaining, 1 << 16))
                if not data:
                    raise ConnectError(f"the connection closed with {remaining} body bytes unread")
                remaining -= len(data)
                yield data
        else:  # delimited by the server closing the connection
            while data := await self._reader.read(1 << 16):
                yield data

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines without their line ends, each as soon as its end arrived (the last one
        also when the body ends without a line end)."""
        pending = b""
        async for data in self._chunks():
            pending += data
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", errors="replace")

    async def read(self) -> bytes:
        return b"".join([data async for data in self._chunks()])

    async def json(self) -> Any:
        return json.loads(await self.read())


class Connection:
    """One request on its own connection: ``async with Connection(server) as c: response = await c.send(...)``."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None

    async def __aenter__(self) -> "Connection":
        context = ssl.create_default_context() if self.server.scheme == "https" else None
        try:
            self._reader, self._writer = await asyncio.open_connection(
                self.server.host, self.server.port, ssl=context, limit=LINE_LIMIT
            )
        except ConnectionRefusedError:
            raise ConnectError(f"connection refused by {self.server.host}:{self.server.port}") from None
        except OSError as exc:
            raise ConnectError(exc.strerror or str(exc)) from None
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass

    async def send(self, method: str, path: str, headers: dict[str, str] | None = None, body: Any = None) -> Response:
        """Send ``method`` on the server's prefix + ``path`` with ``body`` as JSON; returns once
        the status line and headers are in."""
        assert self._reader is not None and self._writer is not None, "use the Connection as an async context"
        data = b"" if body is None else json.dumps(body).encode()
        host = self.server.host if ":" not in self.server.host else f"[{self.server.host}]"
        head = {
            "Host": f"{host}:{self.server.port}",
            "User-Agent": "engine-bench-serve",
            "Accept": "application/json, text/event-stream",
            "Connection": "close",
            **({"Content-Type": "application/json", "Content-Length": str(len(data))} if body is not None else {}),
            **(headers or {}),
        }
        request = f"{method} {self.server.prefix}{path} HTTP/1.1\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in head.items()
        )
        self._writer.write(request.encode("latin-1") + b"\r\n" + data)
        try:
            await self._writer.drain()
            status_line = await self._reader.readline()
        except OSError as exc:
            raise ConnectError(exc.strerror or str(exc)) from None
        parts = status_line.decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise ConnectError(f"no HTTP status line from the server (got {status_line[:80]!r})")
        response_headers: dict[str, str] = {}
        while (line := await self._reader.readline()).strip():
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
        return Response(int(parts[1]), response_headers, self._reader)


def error_message(status: int, body: bytes) -> str:
    """``HTTP 404: <the error's message>`` from an OpenAI-shaped error body (or FastAPI's
    ``detail``), else the body's first 200 characters."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        message = error.get("message") if isinstance(error, dict) else error or parsed.get("detail")
        if message:
            return f"HTTP {status}: {message}"
    return f"HTTP {status}: {text[:200]}" if text else f"HTTP {status}"
