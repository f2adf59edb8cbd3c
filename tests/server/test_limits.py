"""Bounds a hostile client meets: a body over the size limit is refused before it is read
(from its Content-Length) or as soon as it streams past the limit (chunked), so that a
client cannot make the server hold more than the limit."""

from __future__ import annotations

import socket

import pytest
from server_helpers import API_KEY

LIMIT = 16 * 2**20  # ServerConfig.max_request_bytes' default


def _raw(server, head: str, body_parts=()) -> bytes:
    """Send ``head`` (and ``body_parts``) on a raw connection; the response's first bytes."""
    with socket.create_connection((server.host, server.port), timeout=30) as conn:
        conn.sendall(head.encode())
        for part in body_parts:
            conn.sendall(part)
        return _response(conn)


def _response(conn: socket.socket) -> bytes:
    """One whole HTTP response: its head, then as many body bytes as its Content-Length says."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _head(server, extra: str) -> str:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n{extra}\r\n"
    )


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(server):
    # no body follows: a server that read before checking would wait for 300 MiB
    response = _raw(server, _head(server, f"Content-Length: {300 * 2**20}\r\n"))
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"limit" in response


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    chunk = b"x" * 2**20
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(LIMIT // len(chunk) + 2)]
    # the body never ends (no last chunk): only a server that stops at the limit answers
    response = _raw(server, _head(server, "Transfer-Encoding: chunked\r\n"), parts)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]


def test_a_malformed_content_length_is_a_400(server):
    response = _raw(server, _head(server, "Content-Length: 12abc\r\n"))
    assert response.startswith(b"HTTP/1.1 400"), response[:200]


def test_a_client_that_leaves_mid_body_is_one_info_line(server, caplog):
    import time

    with caplog.at_level("INFO"):
        with socket.create_connection((server.host, server.port), timeout=30) as conn:
            conn.sendall(_head(server, "Content-Length: 1000\r\n").encode() + b'{"model": "tiny", "pro')
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while "went away" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "client went away while sending its request" in caplog.text
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
    assert "Traceback" not in caplog.text


@pytest.fixture(scope="module")
def impatient(chat_checkpoint):
    from server_helpers import engine_config

    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server

    running = start_server(
        engine_config(chat_checkpoint),
        ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny", header_timeout=1.0, body_timeout=1.0),
    )
    yield running
    running.stop()


def _closed_with_408(conn: socket.socket) -> bool:
    """The server answered 408 and closed (or just closed) the connection."""
    response = _response(conn)
    rest = b""
    try:
        rest = conn.recv(1024)
    except OSError:
        pass
    return (response == b"" or response.startswith(b"HTTP/1.1 408")) and rest == b""


def test_slowloris_connections_are_closed(impatient):
    import time

    slow_headers = [socket.create_connection((impatient.host, impatient.port), timeout=30) for _ in range(100)]
    slow_body = [socket.create_connection((impatient.host, impatient.port), timeout=30) for _ in range(20)]
    try:
        for conn in slow_headers:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        for conn in slow_body:
            conn.sendall(_head(impatient, "Content-Length: 1000\r\n").encode() + b'{"model": "tiny"')
        time.sleep(0.5)
        for conn in slow_headers[:10]:
            conn.sendall(b"X-Drip: 1\r\n")  # dripping does not extend the deadline
        assert all(_closed_with_408(conn) for conn in slow_headers + slow_body)
    finally:
        for conn in slow_headers + slow_body:
            conn.close()
    # the server goes on serving
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    response = _raw(impatient, _head(impatient, f"Content-Length: {len(body)}\r\n"), [body])
    assert response.startswith(b"HTTP/1.1 200"), response[:200]


def test_a_client_that_never_reads_its_stream_is_dropped_and_its_request_aborted(chat_checkpoint, caplog):
    """A streamed response to a client that stops reading fills the connection's buffers; after
    write_timeout the server drops the connection, which aborts the request and frees its blocks."""
    import logging
    import time

    from server_helpers import engine_config, free_blocks

    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server

    running = start_server(
        engine_config(chat_checkpoint),
        ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny", write_timeout=1.0),
    )
    caplog.set_level(logging.INFO)
    try:
        idle_blocks = free_blocks(running)
        body = (
            b'{"model": "tiny", "prompt": "hi", "max_tokens": 250, "ignore_eos": true, "stream": true,'
            b' "logprobs": 20, "n": 48}'
        )
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # little room: the server's buffer fills soon
        conn.connect((running.host, running.port))
        conn.sendall(_head(running, f"Content-Length: {len(body)}\r\n").encode() + body)  # then never reads
        deadline = time.monotonic() + 120
        while "has not read its response" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "has not read its response" in caplog.text
        while running.engine.call(lambda engine: engine.scheduler.has_unfinished()).result(timeout=10):
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.05)
        assert free_blocks(running) == idle_blocks
        conn.settimeout(5)
        received = b""
        try:
            while chunk := conn.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received  # cut, not finished
        conn.close()
        # the server goes on serving
        ok = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
        assert _raw(running, _head(running, f"Content-Length: {len(ok)}\r\n"), [ok]).startswith(b"HTTP/1.1 200")
    finally:
        running.stop()
