"""Bad requests against the live server: the exact status, the OpenAI error shape
(Anthropic's on /v1/messages), never a 500 or a traceback, and a server that
still works afterwards."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import API_KEY

C, CHAT, MSG = "/v1/completions", "/v1/chat/completions", "/v1/messages"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "hi"}]
GOOD = {
    C: {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    CHAT: {"model": "tiny", "messages": HI, "max_tokens": 2},
    MSG: {"model": "tiny", "messages": HI, "max_tokens": 2},
}
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "internal_server_error",
}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 500: "api_error"}
ANY = object()
BOTH = pytest.mark.parametrize("path", [C, CHAT])


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def post(http, path, drop=(), headers=None, **fields):
    body = {k: v for k, v in {**GOOD[path], **fields}.items() if k not in drop}
    return http.post(path, json=body, headers=headers)


def openai_error(r, status, *, param=ANY, code=ANY, mentions=None) -> dict:
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    body = r.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == OPENAI_TYPES[status]
    if param is not ANY:
        assert error["param"] == param
    if code is not ANY:
        assert error["code"] == code
    if mentions is not None:
        assert mentions.lower() in error["message"].lower()
    return error


def anthropic_error(r, status, *, mentions=None) -> dict:
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    body = r.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == ANTHROPIC_TYPES[status]
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if mentions is not None:
        assert mentions.lower() in body["error"]["message"].lower()
    return body["error"]


def error_of(path, r, status, **expected) -> dict:
    if path == MSG:
        return anthropic_error(r, status, mentions=expected.get("mentions"))
    return openai_error(r, status, **expected)


# 1. bodies that are not a JSON object


@pytest.mark.parametrize("path", [C, CHAT, MSG])
@pytest.mark.parametrize(
    "raw, mentions", [(b"{bad", "JSON"), (b"", "empty"), (b"[1, 2]", "JSON object"), (b"\xff\xfe", "JSON")]
)
def test_body_that_is_not_a_json_object(http, path, raw, mentions):
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    error_of(path, r, 400, mentions=mentions)


# 2. wrong types name the field


@pytest.mark.parametrize(
    "path, field, value",
    [
        *[
            (p, f, v)
            for p in (C, CHAT)
            for f, v in [("max_tokens", "10"), ("temperature", "hot"), ("n", 1.5), ("stream", "yes"), ("stop", 3)]
        ],
        (C, "prompt", 5),
        (CHAT, "messages", "hi"),
        (MSG, "max_tokens", "10"),
        (MSG, "messages", "hi"),
    ],
)
def test_wrong_type_names_the_field(http, path, field, value):
    error = error_of(path, post(http, path, **{field: value}), 400, mentions=field)
    if path != MSG:
        assert error["param"] == field


# 3. unknown model


@pytest.mark.parametrize("path", [C, CHAT, MSG])
def test_unknown_model_is_404(http, path):
    error_of(path, post(http, path, model="nope"), 404, param="model", code="model_not_found", mentions="nope")


# 4, 5. context length and max_tokens


@pytest.mark.parametrize("prompt", [list(range(300)), [7] * 256])
def test_prompt_that_fills_the_context(http, prompt):
    openai_error(
        post(http, C, drop=["max_tokens"], prompt=prompt),
        400,
        param="prompt",
        code="context_length_exceeded",
        mentions="256",
    )


@pytest.mark.parametrize("path", [CHAT, MSG])
def test_chat_prompt_longer_than_the_context(http, path):
    r = post(http, path, messages=[{"role": "user", "content": "x" * 600}])
    error_of(path, r, 400, param="messages", code="context_length_exceeded", mentions="maximum context length")


@pytest.mark.parametrize("path", [C, CHAT, MSG])
@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_below_one(http, path, max_tokens):
    error_of(path, post(http, path, max_tokens=max_tokens), 400, param="max_tokens", mentions="max_tokens")


@pytest.mark.parametrize("path", [C, CHAT, MSG])
def test_prompt_plus_max_tokens_over_the_context(http, path):
    error_of(
        path,
        post(http, path, max_tokens=256),
        400,
        param="max_tokens",
        code="context_length_exceeded",
        mentions="max_tokens",
    )


def test_chat_max_completion_tokens_zero(http):
    openai_error(
        post(http, CHAT, drop=["max_tokens"], max_completion_tokens=0),
        400,
        param="max_completion_tokens",
        mentions="max_completion_tokens",
    )


# 6, 7, 8. token ids, NUL characters, empty input


@pytest.mark.parametrize("prompt", [[5, -1], [320], [1, 2, 10**6]])
def test_token_id_outside_the_vocab(http, prompt):
    openai_error(post(http, C, prompt=prompt), 400, param="prompt", mentions="320")


@pytest.mark.parametrize(
    "path, fields",
    [
        (C, {"prompt": "a\u0000b"}),
        (CHAT, {"messages": [{"role": "user", "content": "a\u0000b"}]}),
        (MSG, {"messages": [{"role": "user", "content": "a\u0000b"}]}),
        (MSG, {"system": "a\u0000b"}),
    ],
)
def test_nul_character_in_text(http, path, fields):
    error_of(path, post(http, path, **fields), 400, mentions="NUL")


@pytest.mark.parametrize(
    "path, fields, mentions",
    [
        (CHAT, {"messages": []}, "messages"),
        (MSG, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": ""}]}, "empty"),
        (MSG, {"messages": [{"role": "user", "content": ""}]}, "empty"),
        (C, {"prompt": ""}, "prompt"),
        (C, {"prompt": []}, "prompt"),
    ],
)
def test_empty_input(http, path, fields, mentions):
    error_of(path, post(http, path, **fields), 400, mentions=mentions)


# 9. parameters this server refuses


@pytest.mark.parametrize(
    "path, field, value",
    [
        (C, "foo", 1),
        (CHAT, "foo", 1),
        (C, "logit_bias", {"5": 1.0}),
        (CHAT, "logit_bias", {"5": 1.0}),
        (C, "suffix", "end"),
    ],
)
def test_unsupported_parameter(http, path, field, value):
    openai_error(
        post(http, path, **{field: value}), 400, param=field, code="unsupported_parameter", mentions=field.rstrip("s")
    )


def test_unknown_field_on_messages(http):
    anthropic_error(post(http, MSG, foo=1), 400, mentions="foo")


# 10, 11, 12. out-of-range values, the priority header, /v1/messages specifics


@pytest.mark.parametrize(
    "path, field, value",
    [
        *[
            (p, f, v)
            for p in (C, CHAT)
            for f, v in [("temperature", 3), ("top_p", 0), ("n", 0), ("presence_penalty", 5)]
        ],
        (CHAT, "top_logprobs", 2),
        (C, "logprobs", 50),
        (MSG, "temperature", 1.5),
    ],
)
def test_out_of_range_value(http, path, field, value):
    error_of(path, post(http, path, **{field: value}), 400, param=field, mentions=field)


@pytest.mark.parametrize("path", [C, CHAT, MSG])
def test_bad_priority_header(http, path):
    error_of(
        path,
        post(http, path, headers={"X-Request-Priority": "high"}),
        400,
        param="X-Request-Priority",
        mentions="X-Request-Priority",
    )


@pytest.mark.parametrize(
    "drop, fields, mentions",
    [(["max_tokens"], {}, "max_tokens"), ((), {"messages": [{"role": "system", "content": "x"}]}, "role")],
)
def test_messages_specific_errors(http, drop, fields, mentions):
    anthropic_error(post(http, MSG, drop=drop, **fields), 400, mentions=mentions)


def test_stop_token_id_outside_the_vocab_names_its_field(http):
    openai_error(post(http, C, stop_token_ids=[1000]), 400, param="stop_token_ids", mentions="stop_token_ids")


# 13. routes


@pytest.mark.parametrize("path, status, mentions", [("/v1/nothing", 404, "/v1/nothing"), (C, 405, "GET")])
def test_unknown_route_or_wrong_method(http, path, status, mentions):
    openai_error(http.get(path), status, mentions=mentions)


# 14. authentication


@pytest.mark.parametrize(
    "method, path", [("POST", C), ("POST", CHAT), ("POST", MSG), ("GET", "/v1/models"), ("GET", "/metrics")]
)
@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": API_KEY}]
)
def test_protected_route_needs_the_key(server, method, path, headers):
    r = httpx.request(method, server.base_url + path, json=GOOD.get(path), headers=headers, timeout=60)
    error_of(path, r, 401, code="invalid_api_key", mentions="API key")
    assert r.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("headers", [AUTH, {"x-api-key": API_KEY}, {"Authorization": f"bearer {API_KEY}"}])
def test_either_key_header_is_accepted(server, headers):
    r = httpx.get(server.base_url + "/v1/models", headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


def test_health_needs_no_key(server):
    r = httpx.get(server.base_url + "/health", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# 16. still serving after everything above (keep last among the tests on `server`)


@pytest.mark.parametrize("path", [C, CHAT, MSG])
def test_server_still_answers_after_the_bad_requests(http, path):
    r = post(http, path)
    assert r.status_code == 200, r.text
    assert http.get("/health").json() == {"status": "ok"}


# Integers a torch generator or tensor cannot hold are refused up front (they used to stop the engine loop).


@pytest.mark.parametrize(
    "path, fields",
    [
        (C, {"seed": 2**70}),
        (C, {"seed": -(2**70)}),
        (C, {"seed": 2**64 - 1, "n": 2}),
        (C, {"top_k": 2**70}),
        (MSG, {"top_k": 2**70}),
    ],
)
def test_huge_integer_is_refused_and_does_not_kill_the_engine(server, path, fields):
    body = {**GOOD[path], "temperature": 1.0, **fields}
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        r = client.post(path, json=body)
        health = client.get("/health")
    assert health.status_code == 200, health.text
    error_of(path, r, 400, param=next(iter(fields)))


# 500: an internal failure has the error shape and no traceback (a stub engine whose add raises)


class _StubTokenizer:
    chat_template = "stub"

    def apply_chat_template(self, messages, **kwargs):
        return "hi"

    def encode(self, text, **kwargs):
        return [1, 2, 3]


class _BrokenEngine:
    tokenizer, vocab_size, max_model_len, is_alive, error = _StubTokenizer(), 320, 256, True, None

    @property
    def stats(self):
        from engine.entrypoints.async_engine import EngineStats

        return EngineStats()

    def kv_tier_counters(self):
        return None

    def spec_decode_stats(self):
        return None

    async def add(self, *args, **kwargs):
        raise RuntimeError("secret internal detail")


@pytest.mark.parametrize("path", [C, CHAT, MSG])
def test_internal_error_is_500_without_a_traceback(path):
    from fastapi.testclient import TestClient

    from engine.config import ServerConfig
    from engine.entrypoints.api_server import build_app

    app = build_app(_BrokenEngine(), ServerConfig(api_key=API_KEY), "tiny")
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post(path, json=GOOD[path], headers=AUTH)
    error = error_of(path, r, 500, mentions="RuntimeError")
    assert "secret internal detail" not in r.text and "Traceback" not in r.text and 'File "' not in r.text
    assert "see the server log" in error["message"]


# 18. tools, tool results and reasoning


def _tool(name="f", parameters=None):
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def _anthropic_tool(name="f", schema=None):
    return {"name": name, "input_schema": schema or {"type": "object"}}


CALLED = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    },
]
USED = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
]


@pytest.mark.parametrize(
    "fields, param, mentions",
    [
        (
            {"tools": [_tool(parameters={"type": "objekt"})], "tool_choice": "required"},
            "tools.0.function.parameters",
            "parameters is not a valid JSON Schema",
        ),
        (
            {"tools": [_tool(parameters={"type": "string"})], "tool_choice": "required"},
            "tools.0.function.parameters",
            "object",
        ),
        ({"tools": [_tool(), _tool()], "tool_choice": "required"}, "tools.1.function.name", "unique"),
        ({"tools": [_tool("two words")], "tool_choice": "required"}, "tools.0.function.name", "name"),
        ({"tools": [_tool("f\n")], "tool_choice": "required"}, "tools.0.function.name", "name"),
        (
            {"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice.function.name",
            "'g'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": [_tool()]}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": [_tool()], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        (
            {"messages": [*HI, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
            "messages.1.tool_call_id",
            "call_9",
        ),
        (
            {"messages": [*CALLED, {"role": "tool", "tool_call_id": "call_2", "content": "x"}]},
            "messages.2.tool_call_id",
            "call_2",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, None, "tool_call_id"),
        (
            {
                "messages": [
                    *HI,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
            "json",
        ),
        ({"thinking_token_budget": 5}, "thinking_token_budget", "--reasoning-parser"),
        ({"thinking_token_budget": 5, "max_reasoning_tokens": 6}, "max_reasoning_tokens", "one limit"),
        ({"thinking_token_budget": -1}, "thinking_token_budget", None),
        (
            {"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "constraint",
        ),
    ],
)
def test_malformed_tools_and_reasoning_on_chat(http, fields, param, mentions):
    error = openai_error(post(http, CHAT, **fields), 400, mentions=mentions)
    if param is not None:
        assert error["param"] == param
    assert post(http, CHAT).status_code == 200  # the server still serves


@pytest.mark.parametrize(
    "fields, mentions",
    [
        (
            {"tools": [_anthropic_tool(schema={"type": "objekt"})], "tool_choice": {"type": "any"}},
            "input_schema is not",
        ),
        ({"tools": [_anthropic_tool(), _anthropic_tool()], "tool_choice": {"type": "any"}}, "unique"),
        ({"tools": [_anthropic_tool()], "tool_choice": {"type": "tool", "name": "g"}}, "'g'"),
        ({"tools": [_anthropic_tool()], "tool_choice": {"type": "tool"}}, "name"),
        ({"tool_choice": {"type": "any"}}, "tools"),
        ({"tools": [_anthropic_tool()], "tool_choice": {"type": "auto"}}, "--enable-auto-tool-choice"),
        ({"tools": [{"input_schema": {"type": "object"}}]}, "name"),
        (
            {
                "messages": [
                    *HI[:0],
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]},
                ]
            },
            "toolu_9",
        ),
        (
            {"messages": [*USED, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]}]},
            "toolu_2",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "tool_use",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}
                ]
            },
            "input",
        ),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2}}, "max_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1}}, "--reasoning-parser"),
    ],
)
def test_malformed_tools_and_thinking_on_messages(http, fields, mentions):
    anthropic_error(post(http, MSG, **fields), 400, mentions=mentions)
    assert post(http, MSG).status_code == 200


def test_malformed_count_tokens(http):
    anthropic_error(
        http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": []}), 400, mentions="messages"
    )
    anthropic_error(
        http.post(
            "/v1/messages/count_tokens", json={"model": "tiny", "messages": HI, "tools": [_anthropic_tool("a b")]}
        ),
        400,
        mentions="name",
    )
    r = http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": HI})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


# 19. the smaller rough edges


def test_a_405_names_the_methods_the_route_takes(http):
    r = http.get(C)
    openai_error(r, 405, mentions="GET")
    assert r.headers["Allow"] == "POST"
    r = http.put("/v1/models")
    assert r.status_code == 405 and r.headers["Allow"] in ("GET", "GET, HEAD")


def test_one_model_by_its_id(http):
    r = http.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    openai_error(http.get("/v1/models/other"), 404, param="model", code="model_not_found", mentions="tiny")


def test_messages_caps_stop_sequences_as_the_openai_endpoints_cap_stop(http):
    anthropic_error(post(http, MSG, stop_sequences=[f"s{i}" for i in range(17)]), 400, mentions="16")
    assert post(http, MSG, stop_sequences=[f"s{i}" for i in range(16)]).status_code == 200
    openai_error(post(http, CHAT, stop=[f"s{i}" for i in range(17)]), 400, mentions="16")


def test_a_weak_api_key_is_warned_about(caplog):
    from engine.config import ServerConfig
    from engine.entrypoints.serve import resolve_api_key

    with caplog.at_level("WARNING", logger="engine"):
        resolve_api_key(ServerConfig(api_key="x"))
    assert "1 characters" in caplog.text and "secrets.token_urlsafe" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine"):
        resolve_api_key(ServerConfig(api_key="k" * 40))
    assert caplog.text == ""


def test_a_local_directory_is_served_under_its_own_name(chat_checkpoint):
    from engine.config import EngineConfig, ServerConfig
    from engine.entrypoints.serve import served_name

    config = EngineConfig(model=str(chat_checkpoint))
    assert served_name(config, ServerConfig()) == chat_checkpoint.name
    assert served_name(config, ServerConfig(served_model_name="m")) == "m"
    assert served_name(EngineConfig(model="demo"), ServerConfig()) == "demo"


@pytest.mark.parametrize(
    "path, fields, param, mentions",
    [
        (C, {"prompt": 5}, "prompt", "a string, a list of token ids, a list of strings or a list of token-id lists"),
        (C, {"prompt": [1.0, 2.5]}, "prompt.0", "integer"),
        (C, {"stop": 5}, "stop", "a string or a list of strings"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "a string or a list"),
    ],
)
def test_a_value_no_union_member_takes_says_what_the_field_may_be(http, path, fields, param, mentions):
    error = openai_error(post(http, path, **fields), 400, param=param, mentions=mentions)
    assert "valid string" not in error["message"]
