"""Error responses: the OpenAI shape everywhere, the Anthropic shape on /v1/messages.

Bad input is always a 4xx with a message that says what was wrong; an internal
failure is a 500 whose body holds no traceback (the log has it, under the
request id).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

# OpenAI error "type" per status
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# Anthropic error "type" per status
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ParamError(ValueError):
    """Raised inside request validation to name the parameter at fault (``param``)."""

    code: str | None = None

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class APIError(Exception):
    """An error the client sees: its HTTP status, message, and optionally the offending parameter."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _OPENAI_TYPES.get(
                    self.status, "invalid_request_error" if self.status < 500 else "internal_server_error"
                ),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def refusal(exc: ValueError, default_param: str | None = None) -> APIError:
    """A ``ValueError`` from ``SamplingParams`` or the engine as a 400. Their messages
    start with the field they are about ("seed must be ...", "stop_token_ids must ..."),
    which becomes ``param``."""
    message = str(exc)
    match = re.match(r"[a-z][a-z_]*", message)
    param = match.group(0) if match and match.group(0) in _sampling_fields() else default_param
    return bad_request(message, param=param)


@functools.lru_cache(maxsize=1)
def _sampling_fields() -> frozenset[str]:
    from engine.sampling_params import SamplingParams

    return frozenset(f.name for f in dataclasses.fields(SamplingParams))


def from_validation_error(exc: ValidationError) -> APIError:
    """A pydantic error on a request body, as one 400 naming the first bad field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc), "type": ""}
    # a value that matches no member of a union fails once per member: the member that got
    # furthest into it says best what is wrong (a content block of an unknown type, not "not a string")
    same_field = [e for e in errors if e.get("loc", ())[:1] == first.get("loc", ())[:1]]
    first = max(same_field, key=lambda e: len(e.get("loc", ())), default=first)
    members = _union_members(same_field, first)
    if members:  # no member got further than another: say what the field may be
        loc = [str(part) for part in first["loc"] if not _is_union_tag(part)]
        param = ".".join(loc)
        return bad_request(f"Invalid value for {param}: expected {members}.", param=param)
    ctx = first.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, ParamError):
        return bad_request(str(cause), param=cause.param, code=cause.code)
    if first.get("type") == "json_invalid":
        return bad_request(
            f"The request body is not valid JSON: {ctx.get('error', first['msg'])}.", code="invalid_json"
        )
    loc = [str(part) for part in first.get("loc", ()) if not _is_union_tag(part)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        message = f"Unsupported parameter: {param!r} is not a parameter of this endpoint."
        return bad_request(message, param=param, code="unsupported_parameter")
    if first.get("type") == "model_type" and not loc:
        return bad_request("The request body must be a JSON object.", code="invalid_request")
    if first.get("type") == "missing":
        return bad_request(f"Missing required parameter: {param!r}.", param=param, code="missing_required_parameter")
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    where = f"{param}: " if param else ""
    return bad_request(f"Invalid value for {where}{message}" if param else f"Invalid request: {message}", param=param)


_MEMBER_NAMES = {
    "str": "a string",
    "list[int]": "a list of token ids",
    "list[str]": "a list of strings",
    "list[list[int]]": "a list of token-id lists",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "dict": "an object",
    "list": "a list",
}


def _union_members(errors: list[dict], deepest: dict) -> str | None:
    """For a value no member of its union accepts, each member failing at the value itself
    (none got into it), the members in words: "a string or a list of token ids"."""
    loc = tuple(deepest.get("loc", ()))
    if not loc or not _is_union_tag(loc[-1]):
        return None
    depth = len(loc)
    tags = []
    for error in errors:
        where = tuple(error.get("loc", ()))
        if len(where) == depth and where[:-1] == loc[:-1] and _is_union_tag(where[-1]):
            tags.append(str(where[-1]))
    if len(tags) < 2:
        return None
    names = list(dict.fromkeys(_MEMBER_NAMES.get(tag, "a list" if tag.startswith("list[") else tag) for tag in tags))
    return ", ".join(names[:-1]) + " or " + names[-1]


def _is_union_tag(part: Any) -> bool:
    # pydantic names union members in locations ("list[int]", "str"); they are not field names
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})
