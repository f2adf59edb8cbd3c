"""``engine serve``: build the engine, wrap it in the HTTP app, run uvicorn."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, ServerConfig
from engine.entrypoints.http_protocol import bounded_h11_protocol

logger = logging.getLogger("engine.server")

API_KEY_ENV = "ENGINE_API_KEY"


@dataclass
class RunningServer:
    """A server started on a thread (``start_server``): its address and how to stop it."""

    host: str
    port: int
    app: Any
    engine: Any  # AsyncEngine
    _server: Any
    _thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self.engine.shutdown()


# after the engine stopped on an error: how long in-flight requests have to get their error reply
# before the server shuts down
DEAD_ENGINE_GRACE_S = 1.0


def make_app(
    engine_config: EngineConfig, server_config: ServerConfig, *, progress: bool = True, on_error: Any = None
) -> tuple[Any, Any]:
    """(FastAPI app, AsyncEngine) for these settings; the model is loaded here. ``on_error``:
    see :class:`AsyncEngine`."""
    from engine.engine.llm_engine import LLMEngine, freeze_startup_objects
    from engine.entrypoints.api_server import build_app
    from engine.entrypoints.async_engine import AsyncEngine
    from engine.model_loader.checkpoint import sampling_defaults

    llm_engine = LLMEngine(engine_config, progress=progress)
    defaults = sampling_defaults(llm_engine.model_path)
    if defaults:
        logger.info("sampling defaults from generation_config.json: %s", defaults)
    engine = AsyncEngine(llm_engine, on_error=on_error)
    freeze_startup_objects()
    model_name = served_name(engine_config, server_config)
    # a directory served under its own name still answers to the path it was given as
    aliases = (engine_config.model,) if not server_config.served_model_name else ()
    return build_app(engine, server_config, model_name, defaults, aliases), engine


def served_name(engine_config: EngineConfig, server_config: ServerConfig) -> str:
    """The model id clients send: ``--served-model-name``, else the model argument as given
    for a built-in or Hub name, else a local directory's own name (not its whole path)."""
    if server_config.served_model_name:
        return server_config.served_model_name
    model = engine_config.model
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve().name
    return model


WEAK_KEY_CHARS = 16


def resolve_api_key(server_config: ServerConfig) -> ServerConfig:
    """``--api-key`` wins; else ``$ENGINE_API_KEY`` when set."""
    if server_config.api_key is None and os.environ.get(API_KEY_ENV):
        server_config = server_config.model_copy(update={"api_key": os.environ[API_KEY_ENV]})
    key = server_config.api_key
    if key is not None and len(key) < WEAK_KEY_CHARS:
        logger.warning(
            "the API key has %d characters: one that short can be guessed; use at least %d random ones "
            "(python -c 'import secrets; print(secrets.token_urlsafe(32))')",
            len(key),
            WEAK_KEY_CHARS,
        )
    return server_config


def serve(engine_config: EngineConfig, server_config: ServerConfig, *, log_level: str = "info") -> int:
    """Run until interrupted (Ctrl-C / SIGTERM stop it cleanly) or until the engine stops on
    an error (a tensor-parallel worker died, ...): the requests in flight get their error
    reply, then the server shuts down and this returns status 1."""
    import uvicorn

    server_config = resolve_api_key(server_config)
    server: Any = None
    failed = threading.Event()

    def on_error(exc: BaseException) -> None:
        failed.set()
        logger.critical("the engine stopped (%s: %s); shutting the server down", type(exc).__name__, exc)

        def shut_down() -> None:
            if server is not None:
                server.should_exit = True

        timer = threading.Timer(DEAD_ENGINE_GRACE_S, shut_down)
        timer.daemon = True
        timer.start()

    sock = listen(server_config.host, server_config.port)  # a busy port is refused before the model loads
    try:
        app, engine = make_app(engine_config, server_config, on_error=on_error)
    except BaseException:
        sock.close()
        raise
    if server_config.api_key is None and server_config.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", server_config.host)
    logger.info(
        "serving %s on http://%s:%d",
        served_name(engine_config, server_config),
        server_config.host,
        sock.getsockname()[1],
    )
    server = draining_server_class()(
        uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=server_config.shutdown_timeout + FLUSH_S,
            http=bounded_h11_protocol(
                server_config.header_timeout, server_config.body_timeout, server_config.write_timeout
            ),
        ),
        engine,
        server_config.shutdown_timeout,
    )
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a second Ctrl-C forces the exit
        pass
    finally:
        engine.shutdown()  # the engine's own close: a KV tier writes what it holds
    logger.info("the server has shut down")
    return 1 if failed.is_set() else 0


FLUSH_S = 2.0  # after the shutdown timeout: time for the stopped requests' error replies to go out


def draining_server_class() -> type:
    """``uvicorn.Server`` that shuts down by draining: it stops accepting, lets running requests
    finish for ``shutdown_timeout`` seconds, then stops those still running (each gets its error
    reply or stream event), and returns instead of re-raising the signal it stopped on (the
    process then exits 0 after the engine closes)."""
    import contextlib
    import signal

    import uvicorn

    class _DrainingServer(uvicorn.Server):
        def __init__(self, config: Any, engine: Any, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.engine = engine
            self.shutdown_timeout = shutdown_timeout

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets: Any = None) -> None:
            import asyncio

            from engine.entrypoints.async_engine import ServerShuttingDown

            logger.info("shutting down: no new requests; running ones have %g s to finish", self.shutdown_timeout)
            timeout = self.shutdown_timeout
            handle = asyncio.get_running_loop().call_later(
                timeout, self.engine.stop_requests, ServerShuttingDown(timeout)
            )
            try:
                await super().shutdown(sockets)
            finally:
                handle.cancel()

    return _DrainingServer


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port) and listening, made before anything
    slow happens, so that a port another process holds is refused at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; another process holds the port, or the "
            f"address is not this machine's. Choose another with --port (0 picks a free one) or --host."
        ) from None
    sock.set_inheritable(True)
    return sock


def start_server(engine_config: EngineConfig, server_config: ServerConfig, *, progress: bool = False) -> RunningServer:
    """Start the server on a background thread and return once it accepts connections.

    With ``port=0`` a free port is chosen; ``RunningServer.port`` tells which.
    """
    import uvicorn

    server_config = resolve_api_key(server_config)
    sock = listen(server_config.host, server_config.port)
    try:
        app, engine = make_app(engine_config, server_config, progress=progress)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            http=bounded_h11_protocol(
                server_config.header_timeout, server_config.body_timeout, server_config.write_timeout
            ),
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    if not server.started:
        engine.shutdown()
        raise RuntimeError(f"The server did not start on {host}:{port}.")
    return RunningServer(host, port, app, engine, server, thread)
