"""The HTTP server: a FastAPI app over an ``AsyncEngine``, served by uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Anthropic shape), ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
and ``GET /openapi.json``, which describes them all (``engine.entrypoints.openapi``). Every route but ``/health``
needs the API key when one is set (``/metrics`` too, unless ``metrics_public``). A client that
disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.config import ServerConfig
from engine.entrypoints.anthropic_serving import AnthropicServing, CountTokensRequest, MessagesRequest
from engine.entrypoints.async_engine import AsyncEngine, EngineDeadError, ServerShuttingDown
from engine.entrypoints.errors import APIError, bad_request, from_validation_error, refusal
from engine.entrypoints.generation import Generation, finish_status, parse_priority
from engine.entrypoints.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from engine.entrypoints.openai_serving import OpenAIServing, PromptLimits
from engine.entrypoints.openapi import ANTHROPIC_PATHS, PUBLIC_PATHS, RequestBounds, openapi_document
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from engine.entrypoints.tool_calling import ChatTools
from engine.interfaces.structured_output import ConstraintError
from engine.version import __version__

logger = logging.getLogger("engine.server")

DISCONNECT_POLL_SECONDS = 0.1
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/messages": "messages"}


def build_app(
    engine: AsyncEngine,
    config: ServerConfig,
    model_name: str,
    sampling_defaults: dict[str, Any] | None = None,
    model_aliases: tuple[str, ...] = (),
) -> FastAPI:
    """The app for ``engine`` serving ``model_name``. The caller owns the engine's lifetime.
    ``sampling_defaults`` fill the sampling fields a request leaves out; requests may also name
    the model by ``model_aliases`` (the model argument as given, when it is served under
    another name)."""
    app = FastAPI(title="engine", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    metrics = ServerMetrics(model_name, lambda: engine.stats, engine.kv_tier_counters, engine.spec_decode_stats)
    chat_tools = ChatTools(
        getattr(engine, "tool_parser_cls", None),
        getattr(engine, "reasoning_parser_cls", None),
        engine.tokenizer,
        config.enable_auto_tool_choice,
    )
    limits = PromptLimits(
        max_prompt_chars=config.max_prompt_chars,
        max_sequences_per_request=config.max_sequences_per_request,
        trust_request_chat_template=config.trust_request_chat_template,
    )
    openai = OpenAIServing(engine, metrics, model_name, sampling_defaults, chat_tools, limits)
    openai.model_aliases = frozenset(model_aliases)
    anthropic = AnthropicServing(openai)
    public = set(PUBLIC_PATHS) | ({"/metrics"} if config.metrics_public else set())
    app.state.engine, app.state.metrics, app.state.config = engine, metrics, config
    app_started = time.time()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            bounds = RequestBounds(
                model_names=(model_name, *model_aliases),
                max_model_len=engine.max_model_len,
                vocab_size=engine.vocab_size,
                max_prompt_chars=openai.max_prompt_chars,
                max_sequences_per_request=config.max_sequences_per_request,
            )
            app.openapi_schema = openapi_document(app.routes, config, bounds)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def error_response(path: str, error: APIError) -> JSONResponse:
        body = error.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else error.openai_body()
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(body, status_code=error.status, headers=headers)

    # the address the server was told to listen on is a name of this machine too (not the wildcard)
    own = {config.host.lower().strip("[]")} - {"0.0.0.0", "::"}
    allowed_hosts = LOOPBACK_HOSTS | own | {h.lower() for h in config.allowed_hosts}

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if config.api_key is None:
            # no key: answer only requests addressed to this machine by name (a web page that had its own
            # name resolved to 127.0.0.1 is not), with a JSON body (no cross-site "simple" text/plain post)
            host = _host_name(request.headers.get("host", ""))
            if "*" not in allowed_hosts and host not in allowed_hosts:
                error = APIError(
                    403,
                    f"The Host {host!r} is not allowed: without an API key this server answers requests to "
                    f"localhost only. Add it with --allowed-hosts, or set --api-key.",
                    code="host_not_allowed",
                )
                return error_response(request.url.path, error)
            if request.method == "POST" and not _is_json(request.headers.get("content-type", "")):
                error = APIError(
                    415,
                    "Send the request body as JSON, with Content-Type: application/json.",
                    code="invalid_content_type",
                )
                return error_response(request.url.path, error)
        if config.api_key is not None and request.url.path not in public:
            if not _key_matches(request, config.api_key):
                error = APIError(
                    401,
                    "Missing or invalid API key. Send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                    code="invalid_api_key",
                )
                return error_response(request.url.path, error)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        endpoint = ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            metrics.count_rejected(endpoint, exc.status)
        return error_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"No route {request.url.path}.", 405: f"{request.method} is not allowed on {request.url.path}."}
        response = error_response(
            request.url.path, APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)))
        )
        if exc.headers and "Allow" in exc.headers:  # a 405 says which methods the route takes
            response.headers["Allow"] = exc.headers["Allow"]
        return response

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # not the server's fault, and a client can do it at will: one line, no traceback
        logger.info("client went away while sending its request to %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(request.url.path, _internal_error(exc))

    async def read_body(request: Request) -> bytes:
        """The body, refused (413) as soon as it is known to pass the limit: from its
        Content-Length before reading any of it, else while it streams in."""
        limit = config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise bad_request(f"The Content-Length header must be a number of bytes, got {declared!r}.")
            if int(declared) > limit:
                raise APIError(413, f"The request body has {int(declared)} bytes; the limit is {limit}.")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"The request body passed the limit of {limit} bytes; it was not read further.")
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        body = await read_body(request)
        if not body.strip():
            raise bad_request("The request body is empty: send a JSON object.", code="invalid_json")
        try:
            return model.model_validate_json(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None

    # routes

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return JSONResponse(
                {"status": "error", "error": "the engine has stopped; see the server log"}, status_code=503
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": int(app_started),
            "owned_by": "engine",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        openai.check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_route(request, CompletionRequest, openai.completions, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await openai_route(request, ChatCompletionRequest, openai.chat, "chat")

    async def openai_route(request: Request, model: type[BaseModel], start: Callable, endpoint: str) -> Response:
        body = await parse(request, model)
        generation, formatter = await start(body, parse_priority(request.headers))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(
            request, generation, formatter.whole, lambda g: formatter.stream(g, include_usage), body.stream, endpoint
        )

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await parse(request, MessagesRequest)
        generation, reader = await anthropic.messages(body, parse_priority(request.headers))
        return await respond(
            request,
            generation,
            lambda g: anthropic.whole(g, reader),
            lambda g: anthropic.stream(g, reader),
            body.stream,
            "messages",
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        return await anthropic.count_tokens(await parse(request, CountTokensRequest))

    async def respond(
        request: Request,
        generation: Generation,
        whole: Callable[[Generation], Awaitable[dict]],
        stream: Callable[[Generation], AsyncIterator[str]],
        streaming: bool,
        endpoint: str,
    ) -> Response:
        try:
            await generation.start()
        except ConstraintError as exc:  # an output constraint that does not compile
            raise bad_request(str(exc), param=generation.constraint_param, code="invalid_constraint") from None
        except ValueError as exc:  # the engine refused the request
            raise refusal(exc, default_param="prompt") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        if streaming:
            return StreamingResponse(
                _guarded_stream(generation, stream(generation), endpoint, request.url.path),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": generation.request_id},
            )
        task = asyncio.ensure_future(whole(generation))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    generation.close()
                    generation.record("abort")
                    return Response(status_code=499)
            result = task.result()
        except (EngineDeadError, ServerShuttingDown) as exc:
            raise APIError(503, str(exc)) from None
        finally:
            if not task.done():
                task.cancel()
            generation.close()
        generation.record(finish_status(generation))
        return JSONResponse(result, headers={"X-Request-Id": generation.request_id})

    async def _guarded_stream(
        generation: Generation, events: AsyncIterator[str], endpoint: str, path: str
    ) -> AsyncIterator[str]:
        status = "abort"
        try:
            async for event in events:
                yield event
            status = finish_status(generation)
        except Exception as exc:  # mid-stream failure: the status line has gone out, so say it in the stream
            if isinstance(exc, ServerShuttingDown):
                logger.info("request_id=%s stopped by the shutdown", generation.request_id)
                status = "503"
            else:
                logger.error("request_id=%s stream failed", generation.request_id, exc_info=exc)
                status = "500"
            error = _internal_error(exc) if not isinstance(exc, APIError) else exc
            body = error.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else error.openai_body()
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            generation.close()  # a disconnect cancels this generator: abort at once
            generation.record(status)

    return app


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def _host_name(header: str) -> str:
    """The name in a Host header, without its port: ``[::1]:8000`` is ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _key_matches(request: Request, key: str) -> bool:
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key.encode())


def _internal_error(exc: BaseException) -> APIError:
    if isinstance(exc, (EngineDeadError, ServerShuttingDown)):
        return APIError(503, str(exc))
    return APIError(500, f"Internal server error ({type(exc).__name__}); see the server log.")
