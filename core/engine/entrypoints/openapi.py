"""The published OpenAPI document (``GET /openapi.json``): the paths FastAPI finds, with the
bodies the routes parse by hand, each status they answer with, the auth they take and this
server's own bounds (:func:`openapi_document`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from engine.config import ServerConfig
from engine.entrypoints.anthropic_serving import CountTokensRequest, MessagesRequest
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, checked
from engine.version import __version__

PUBLIC_PATHS = {"/health"}  # answered without the API key
ANTHROPIC_PATHS = ("/v1/messages",)  # errors in Anthropic's shape


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
