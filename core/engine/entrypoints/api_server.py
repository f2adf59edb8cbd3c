"""The HTTP server: a FastAPI app over an ``AsyncEngine``, served by uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Anthropic shape), ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
and ``GET /openapi.json``, which describes them all (``openapi_document``). Every route but ``/health``
needs the API key when one is set (``/metrics`` too, unless ``metrics_public``). A client that
disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.config import ServerConfig
from engine.entrypoints.anthropic_serving import AnthropicServing, CountTokensRequest, MessagesRequest
from engine.entrypoints.async_engine import AsyncEngine, EngineDeadError, ServerShuttingDown
from engine.entrypoints.errors import APIError, bad_request, from_validation_error, refusal
from engine.entrypoints.generation import Generation, finish_status, parse_priority
from engine.entrypoints.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from engine.entrypoints.openai_serving import OpenAIServing, PromptLimits
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, checked
from engine.entrypoints.tool_calling import ChatTools
from engine.interfaces.structured_output import ConstraintError
from engine.version import __version__

logger = logging.getLogger("engine.server")

PUBLIC_PATHS = {"/health"}
ANTHROPIC_PATHS = ("/v1/messages",)
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


# the published OpenAPI document (/openapi.json): the paths FastAPI finds, with the bodies the routes
# parse by hand, each status they answer with, and the auth they take

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")  # these may stream
OPENAPI_DESCRIPTION = (
    "OpenAI-compatible completions and chat completions, and Anthropic-compatible messages. Errors have "
    "OpenAI's shape (`OpenAIError`), and Anthropic's (`AnthropicError`) under /v1/messages. Any other path "
    "is a 404, a method a path does not take a 405 (with `Allow`), in the same shapes. A request whose "
    "headers or body do not arrive in time is answered 408 (in OpenAI's shape) and its connection closed. "
    "The request schemas state the bounds the server checks field by field; what they leave out (a "
    "prompt's tokens against the context, most checks of one field against another, NUL characters in "
    "text, whole numbers written as 1.0, which the strict integer fields refuse) is a 400 that names the "
    "parameter."
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: dict[str, Any], optional: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}, **extra}


def _array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


def _events(data: dict[str, Any], *, done: bool) -> dict[str, Any]:
    """One server-sent event whose data is JSON matching ``data`` (or ``[DONE]``, OpenAI's last)."""
    json_data = {"contentMediaType": "application/json", "contentSchema": data}
    field = {"if": {"const": "[DONE]"}, "else": json_data} if done else json_data
    return _object({"data": {"type": "string", **field}}, {"event": {"type": "string"}})


_INT, _STR = {"type": "integer"}, {"type": "string"}
_OPTIONAL_STR = {"type": ["string", "null"]}
_FINISH = {"type": ["string", "null"], "description": "stop, length, tool_calls; null until the choice ends"}
_LOGPROBS = {"type": ["object", "null"]}
RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": _object(
        {
            "error": _object(
                {"message": _STR, "type": _STR},
                {"param": _OPTIONAL_STR, "code": _OPTIONAL_STR},
                description="param: the request field at fault; code: a stable name of the error",
            )
        }
    ),
    "AnthropicError": _object({"type": {"const": "error"}, "error": _object({"type": _STR, "message": _STR})}),
    "Usage": _object(
        {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
        {"completion_tokens_details": _object({"reasoning_tokens": _INT})},
    ),
    "CompletionChoice": _object(
        {"index": _INT, "text": _STR, "logprobs": _LOGPROBS, "finish_reason": _FINISH},
        {
            "stop_reason": {"type": ["string", "integer", "null"]},
            "token_ids": _array(_INT),
            "prompt_token_ids": _array(_INT),
            "prompt_logprobs": _array({"type": ["object", "null"]}),
        },
    ),
    "Completion": _object(
        {
            "id": _STR,
            "object": {"const": "text_completion"},
            "created": _INT,
            "model": _STR,
            "choices": _array(_ref("CompletionChoice")),
        },
        {"usage": _ref("Usage")},
        description="A whole completion carries usage; a streamed chunk carries it last, when asked for.",
    ),
    "ChatCompletion": _object(
        {
            "id": _STR,
            "object": {"enum": ["chat.completion", "chat.completion.chunk"]},
            "created": _INT,
            "model": _STR,
            "choices": _array(
                _object(
                    {"index": _INT, "logprobs": _LOGPROBS, "finish_reason": _FINISH},
                    {
                        "message": _object(
                            {"role": {"const": "assistant"}, "content": _OPTIONAL_STR},
                            {"tool_calls": _array({"type": "object"}), "reasoning_content": _STR, "reasoning": _STR},
                        ),
                        "delta": {"type": "object"},
                        "stop_reason": {"type": ["string", "integer", "null"]},
                    },
                    description="a whole completion's choice has a message, a streamed chunk's a delta",
                )
            ),
        },
        {"usage": _ref("Usage")},
    ),
    "Message": _object(
        {
            "id": _STR,
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "model": _STR,
            "content": _array(_object({"type": {"enum": ["text", "thinking", "tool_use"]}})),
            "stop_reason": _OPTIONAL_STR,
            "stop_sequence": _OPTIONAL_STR,
            "usage": _object({"input_tokens": _INT, "output_tokens": _INT}),
        }
    ),
    "TokenCount": _object({"input_tokens": _INT}),
    "Model": _object(
        {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "max_model_len": _INT}
    ),
    "ModelList": _object({"object": {"const": "list"}, "data": _array(_ref("Model"))}),
}
RESPONSE_SCHEMAS["CompletionEvent"] = _events({"anyOf": [_ref("Completion"), _ref("OpenAIError")]}, done=True)
RESPONSE_SCHEMAS["ChatCompletionEvent"] = _events({"anyOf": [_ref("ChatCompletion"), _ref("OpenAIError")]}, done=True)
RESPONSE_SCHEMAS["MessageEvent"] = _events(_object({"type": _STR}), done=False)

# (path, method): what a success is, as {status: (description, {media type: schema name or schema})}
SUCCESSES: dict[tuple[str, str], dict[str, tuple[str, dict[str, Any]]]] = {
    ("/health", "get"): {
        "200": ("The engine is running.", {"application/json": _object({"status": {"const": "ok"}})}),
        "503": (
            "The engine has stopped.",
            {"application/json": _object({"status": {"const": "error"}, "error": _STR})},
        ),
    },
    ("/metrics", "get"): {"200": ("Prometheus metrics.", {"text/plain": _STR})},
    ("/v1/models", "get"): {"200": ("The model this server serves.", {"application/json": "ModelList"})},
    ("/v1/models/{model_id}", "get"): {"200": ("The model.", {"application/json": "Model"})},
    ("/v1/completions", "post"): {
        "200": ("The completion, or with stream its chunks.", {"application/json": "Completion"}),
    },
    ("/v1/chat/completions", "post"): {
        "200": ("The chat completion, or with stream its chunks.", {"application/json": "ChatCompletion"}),
    },
    ("/v1/messages", "post"): {"200": ("The message, or with stream its events.", {"application/json": "Message"})},
    ("/v1/messages/count_tokens", "post"): {
        "200": ("The prompt's length in tokens.", {"application/json": "TokenCount"})
    },
    ("/openapi.json", "get"): {"200": ("This document.", {"application/json": {"type": "object"}})},
    ("/openapi.json", "head"): {"200": ("This document's headers.", {})},
}
STREAM_EVENTS = {
    "/v1/completions": "CompletionEvent",
    "/v1/chat/completions": "ChatCompletionEvent",
    "/v1/messages": "MessageEvent",
}
ERRORS = {
    "400": "The request is malformed or asks for what this server refuses; the message says which field.",
    "401": "The API key is missing or wrong.",
    "403": "Without an API key the server answers requests to localhost (or --allowed-hosts) only.",
    "404": "No such model.",
    "408": "The request's headers or body did not arrive in time; the connection is closed.",
    "413": "The body is larger than --max-request-bytes.",
    "415": "Without an API key the server takes JSON bodies only (Content-Type: application/json).",
    "500": "An internal error; the body holds no details (the server log has them).",
    "503": "The engine has stopped, or the server is shutting down.",
}
# a request of each body, whole and streamed (the model is filled in): for readers, and what a fuzzer starts from
_HI = [{"role": "user", "content": "Hello"}]
REQUEST_EXAMPLES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 4},
    "/v1/chat/completions": {"messages": _HI, "max_tokens": 4},
    "/v1/messages": {"messages": _HI, "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": _HI},
}
PRIORITY_PARAMETER = {
    "name": "X-Request-Priority",
    "in": "header",
    "required": False,
    "schema": {"type": "integer"},
    "description": "Lower runs first (default 0).",
}


@dataclass(frozen=True)
class RequestBounds:
    """What a request may ask of this server and its model, for the published schema."""

    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    max_prompt_chars: int
    max_sequences_per_request: int


def openapi_document(routes: list[Any], config: ServerConfig, bounds: RequestBounds) -> dict[str, Any]:
    """The OpenAPI document of an app with ``routes`` run with ``config``: FastAPI's paths, with the
    request bodies the routes parse themselves, their responses, and the auth ``config`` asks for."""
    document = get_openapi(title="engine", version=__version__, description=OPENAPI_DESCRIPTION, routes=routes)
    _, definitions = models_json_schema(
        [(model, "validation") for model in REQUEST_MODELS.values()], ref_template="#/components/schemas/{model}"
    )
    schemas = {**definitions["$defs"], **RESPONSE_SCHEMAS}
    _bound_requests(schemas, bounds)
    document["components"] = {"schemas": schemas}
    keyed = config.api_key is not None
    if keyed:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <key>"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        document["security"] = [{"bearer": []}, {"x-api-key": []}]
    public = set(PUBLIC_PATHS) | ({"/metrics"} if config.metrics_public else set())
    paths = document.setdefault("paths", {})
    paths["/openapi.json"] = {
        "get": {"summary": "The OpenAPI document", "operationId": "openapi"},
        "head": {"summary": "The OpenAPI document's headers", "operationId": "openapi_head"},
    }
    for path, item in paths.items():
        for method, operation in item.items():
            operation["responses"] = _responses(path, method, keyed=keyed, public=path in public)
            if path in public and keyed:
                operation["security"] = []
            if path in REQUEST_MODELS:
                example = {"model": bounds.model_names[0], **REQUEST_EXAMPLES[path]}
                examples = {"whole": {"value": example}}
                if path in GENERATION_PATHS:
                    examples["streamed"] = {"value": {**example, "stream": True}}
                body = {"schema": _ref(REQUEST_MODELS[path].__name__), "examples": examples}
                operation["requestBody"] = {"required": True, "content": {"application/json": body}}
            if path in GENERATION_PATHS:
                operation["parameters"] = [*operation.get("parameters", []), PRIORITY_PARAMETER]
    return document


def _responses(path: str, method: str, *, keyed: bool, public: bool) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for status, (description, content) in SUCCESSES[(path, method)].items():
        media = {kind: {"schema": _ref(s) if isinstance(s, str) else s} for kind, s in content.items()}
        responses[status] = {"description": description, **({"content": media} if media else {})}
    if path in GENERATION_PATHS:
        responses["200"]["content"]["text/event-stream"] = {"schema": _ref(STREAM_EVENTS[path])}
        responses["200"]["headers"] = {"X-Request-Id": {"required": True, "schema": _STR}}
    statuses = ["408", "401" if keyed and not public else None, None if keyed else "403"]
    if path in REQUEST_MODELS:
        statuses += ["400", "404", "413", None if keyed else "415", "500"]
    elif path.startswith("/v1/models/"):
        statuses.append("404")
    if path in GENERATION_PATHS:  # those that run the engine
        statuses.append("503")
    shape = "AnthropicError" if path.startswith(ANTHROPIC_PATHS) else "OpenAIError"
    for status in filter(None, statuses):
        error = {"schema": _ref("OpenAIError" if status == "408" else shape)}  # 408 comes from the HTTP layer
        responses[status] = {"description": ERRORS[status], "content": {"application/json": error}}
    if "401" in responses:
        responses["401"]["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"const": "Bearer"}}}
    return dict(sorted(responses.items()))


def _bound_requests(schemas: dict[str, Any], bounds: RequestBounds) -> None:
    """The bounds of this server and model in the request schemas: the model names it answers to,
    output limits below the context, and prompts within --max-prompt-chars, the vocabulary and
    --max-sequences-per-request."""
    for name in ("CompletionRequest", "ChatCompletionRequest", "MessagesRequest", "CountTokensRequest"):
        properties = schemas[name]["properties"]
        for member in properties["model"].get("anyOf", [properties["model"]]):
            if member.get("type") == "string":
                member["enum"] = list(bounds.model_names)
        limit = bounds.max_model_len - 1  # a prompt has a token at least
        if "max_completion_tokens" in properties:  # chat: max_tokens counts only without it (CHAT_MAX_TOKENS_SCHEMA)
            checked(maximum=limit)(properties["max_completion_tokens"])
            schemas[name]["else"]["properties"]["max_tokens"]["maximum"] = limit
        elif "max_tokens" in properties:
            checked(maximum=limit)(properties["max_tokens"])
        if "n" in properties:
            properties["n"]["maximum"] = min(properties["n"]["maximum"], bounds.max_sequences_per_request)
    text = {"type": "string", "minLength": 1, "maxLength": bounds.max_prompt_chars}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": bounds.vocab_size - 1}}
    batch = {"type": "array", "minItems": 1, "maxItems": bounds.max_sequences_per_request}
    schemas["CompletionRequest"]["properties"]["prompt"] = {
        "title": "Prompt",
        "description": "Text or token ids, or a batch of either (prompts × n at most --max-sequences-per-request).",
        "anyOf": [text, ids, {**batch, "items": text}, {**batch, "items": ids}],
    }
