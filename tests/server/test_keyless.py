"""A server without an API key answers requests addressed to this machine only, and only
JSON bodies: a web page cannot reach it by having its own name resolve to 127.0.0.1 (DNS
rebinding), nor post to it cross-site with a "simple" text/plain request."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import engine_config

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module", params=[(), ("evil.example",)], ids=["loopback-only", "allowed-host"])
def keyless(request, chat_checkpoint):
    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server

    running = start_server(
        engine_config(chat_checkpoint),
        ServerConfig(port=0, served_model_name="tiny", allowed_hosts=list(request.param)),
    )
    running.allowed = request.param
    yield running
    running.stop()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]"])
def test_loopback_names_are_answered(keyless, host):
    r = httpx.post(keyless.base_url + "/v1/completions", json=BODY, headers={"Host": f"{host}:{keyless.port}"})
    assert r.status_code == 200, r.text


def test_another_host_name_is_refused_unless_allowed(keyless):
    for path in ("/v1/completions", "/v1/models", "/health"):
        r = httpx.request(
            "POST" if path == "/v1/completions" else "GET",
            keyless.base_url + path,
            json=BODY if path == "/v1/completions" else None,
            headers={"Host": f"evil.example:{keyless.port}"},
        )
        if keyless.allowed:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "host_not_allowed" and "--allowed-hosts" in r.json()["error"]["message"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_declared_json_is_refused(keyless, content_type):
    import json

    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(keyless.base_url + "/v1/completions", content=json.dumps(BODY), headers=headers)
    assert r.status_code == 415, r.text
    assert "application/json" in r.json()["error"]["message"]
    ok = httpx.post(
        keyless.base_url + "/v1/completions",
        content=json.dumps(BODY),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200
