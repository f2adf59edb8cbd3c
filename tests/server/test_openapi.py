"""/openapi.json: served behind the API key (to localhost alone without one), a valid OpenAPI
document that lists every route the app has, with the bounds the server enforces; and true to
what the server does, as schemathesis finds by sending what the schema allows (and what it does
not) to a live server and checking every answer against the schema."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
from server_helpers import API_KEY, engine_config

from engine.entrypoints.anthropic_serving import CountTokensRequest, MessagesRequest
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = 48  # the fuzzed server's context: max_tokens is at most 47, so every generation is short
MAX_SEQUENCES = 4  # and a request asks for at most 4 sequences (prompts × n)
BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}


@pytest.fixture(scope="module")
def keyed(chat_checkpoint):
    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server

    running = start_server(
        engine_config(chat_checkpoint, max_model_len=CONTEXT),
        ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny", max_sequences_per_request=MAX_SEQUENCES),
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def keyless(chat_checkpoint):
    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server

    running = start_server(engine_config(chat_checkpoint), ServerConfig(port=0, served_model_name="tiny"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def document(keyed) -> dict:
    r = httpx.get(keyed.base_url + "/openapi.json", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


# (a) who may read it


def test_the_schema_needs_the_key_when_one_is_set(keyed):
    r = httpx.get(keyed.base_url + "/openapi.json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.base_url + "/openapi.json", headers={"Authorization": "Bearer wrong-key"}).status_code == 401
    r = httpx.get(keyed.base_url + "/openapi.json", headers={"x-api-key": API_KEY})
    assert r.status_code == 200 and r.json()["openapi"].startswith("3.1")


def test_a_keyless_server_serves_it_to_localhost_alone(keyless):
    r = httpx.get(keyless.base_url + "/openapi.json")
    assert r.status_code == 200, r.text
    document = r.json()
    # no key to send, and the refusals a keyless server makes instead of a 401
    assert "security" not in document and "securitySchemes" not in document["components"]
    completions = document["paths"]["/v1/completions"]["post"]["responses"]
    assert "401" not in completions and {"403", "415"} <= set(completions)
    r = httpx.get(keyless.base_url + "/openapi.json", headers={"Host": f"evil.example:{keyless.port}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"


# (b) what it says


def test_the_schema_is_valid_openapi(document):
    import schemathesis

    schemathesis.openapi.from_dict(document).validate()  # against the OpenAPI 3.1 meta-schema; raises if not


def test_the_schema_lists_every_route_the_app_has(keyed, document):
    routes = set()
    for route in keyed.app.routes:
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)  # {model_id:path} is {model_id} in OpenAPI
        routes |= {(path, method.lower()) for method in route.methods}
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    assert documented == routes


def test_each_body_is_the_model_its_route_parses(document):
    schemas = document["components"]["schemas"]
    for path, model in BODIES.items():  # the models the routes hand to parse()
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True and list(body["content"]) == ["application/json"]
        schema = schemas[body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]]
        fields = {field.alias or name for name, field in model.model_fields.items()}
        assert set(schema["properties"]) == fields and schema["additionalProperties"] is False


def test_the_statuses_and_auth_are_documented(document):
    schemes = document["components"]["securitySchemes"]
    assert schemes["bearer"] == {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <key>"}
    assert schemes["x-api-key"] == {"type": "apiKey", "in": "header", "name": "x-api-key"}
    assert document["security"] == [{"bearer": []}, {"x-api-key": []}]
    health = document["paths"]["/health"]["get"]
    assert health["security"] == [] and set(health["responses"]) == {"200", "408", "503"}
    for path in BODIES:
        responses = document["paths"][path]["post"]["responses"]
        engine = {"503"} if path != "/v1/messages/count_tokens" else set()  # the engine has stopped
        assert set(responses) == {"200", "400", "401", "404", "408", "413", "500"} | engine
        shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(shape)
    streaming = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(streaming) == {"application/json", "text/event-stream"}


# each bound the schema states: its value, and the server accepts a request at it and refuses one past it
PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
BOUNDS = [
    # (path, a good body, field, keywords to the bound in its schema, the bound, the field's value at k)
    ("/v1/completions", PROMPT, "stop", ("maxItems",), 16, lambda k: ["x"] * k),
    ("/v1/completions", PROMPT, "n", ("maximum",), MAX_SEQUENCES, lambda k: k),
    ("/v1/completions", PROMPT, "prompt", ("maxItems",), MAX_SEQUENCES, lambda k: ["hi"] * k),
    # a one-token prompt leaves the whole context but it to the output
    ("/v1/completions", {**PROMPT, "prompt": [5]}, "max_tokens", ("maximum",), CONTEXT - 1, lambda k: k),
    ("/v1/completions", PROMPT, "logit_bias", ("maxProperties",), 0, lambda k: {str(i): 1.0 for i in range(k)}),
    ("/v1/completions", PROMPT, "seed", ("maximum",), 2**64 - 1, lambda k: k),
    ("/v1/chat/completions", CHAT, "n", ("maximum",), MAX_SEQUENCES, lambda k: k),
    ("/v1/chat/completions", CHAT, "stop_token_ids", ("items", "minimum"), 0, lambda k: [k]),
    ("/v1/chat/completions", CHAT, "messages", ("minItems",), 1, lambda k: CHAT["messages"] * k),
    ("/v1/chat/completions", CHAT, "max_completion_tokens", ("minimum",), 1, lambda k: k),
    ("/v1/messages", MESSAGES, "stop_sequences", ("maxItems",), 16, lambda k: ["x"] * k),
    ("/v1/messages", MESSAGES, "max_tokens", ("minimum",), 1, lambda k: k),
]


def _bound(schema: dict, keywords: tuple[str, ...]):
    """The bound under ``keywords`` in the first member of ``schema`` (or its anyOf) that has it."""
    member = next(m for m in schema.get("anyOf", [schema]) if keywords[0] in m)
    for keyword in keywords:
        member = member[keyword]
    return member


def _body_schema(document: dict, path: str) -> dict:
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]]


@pytest.mark.parametrize("path, body, field, keywords, bound, value", BOUNDS, ids=[f"{b[0]}:{b[2]}" for b in BOUNDS])
def test_each_stated_bound_is_the_one_the_server_enforces(keyed, document, path, body, field, keywords, bound, value):
    assert _bound(_body_schema(document, path)["properties"][field], keywords) == bound
    past = bound + (1 if keywords[-1].startswith("max") else -1)
    ok = httpx.post(keyed.base_url + path, json={**body, field: value(bound)}, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text
    refused = httpx.post(keyed.base_url + path, json={**body, field: value(past)}, headers=AUTH, timeout=60)
    assert refused.status_code == 400, refused.text


def test_the_model_is_one_of_the_names_the_server_answers_to(keyed, document):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES)):
        assert _bound(_body_schema(document, path)["properties"]["model"], ("enum",)) == ["tiny"]
        r = httpx.post(keyed.base_url + path, json={**body, "model": "other"}, headers=AUTH)
        assert r.status_code == 404, r.text


# (c) what the server does

# Phases: examples, fuzzing (positive and negative bodies, headers and paths) and stateful; the
# coverage phase (each boundary and each negation of every field, some 2,000 requests and two
# minutes of generation on two cores) is left out to keep this file near a minute.
SCHEMATHESIS_CONFIG = f"""
headers = {{ Authorization = "Bearer {API_KEY}" }}

[generation]
# a header the API does not define is ignored, as HTTP asks, so sending one proves nothing
allow-extra-parameters = false
database = "none"

[checks.positive_data_acceptance]
# JSON Schema cannot say all the server refuses: a whole number written 1.0 (its integers are
# strict), a conversation whose every message is empty, a prompt's tokens against the context, one
# field against another. Each is a 400 naming the field, which the other checks hold to the schema.
expected-statuses = ["2xx", "400", "401", "403", "404"]
"""


def test_schemathesis_finds_the_server_true_to_its_schema(keyed, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    # every check; streamed responses are checked too, each event against the stream's event schema
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
        "run", keyed.base_url + "/openapi.json", "--checks", "all", "--phases", "examples,fuzzing,stateful",
        "--max-examples", "12", "--seed", "0", "--generation-deterministic", "--workers", "1",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert re.search(r"\d+ generated, \d+ passed", result.stdout), result.stdout[-5000:]
