"""``engine serve`` as the README's first command runs it: a separate process on the
built-in demo model, answered over HTTP, stopped with Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(
    args: list[str], env: dict[str, str] | None = None, plugins: str = "cpu,llama"
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", *args, "--port", str(port), "--plugins", plugins],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240  # includes compiling the CPU kernels on a cold cache
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"engine serve exited with {process.returncode}:\n{process.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("engine serve did not come up in 240 s")


def stop(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGINT)
    try:
        output, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("engine serve did not stop within 30 s of Ctrl-C") from None
    return output


def test_serve_without_a_model_answers_chat_in_english():
    process, url = start([], env={"ENGINE_API_KEY": ""})
    try:
        models = httpx.get(url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["demo"]
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "What does json.dumps do?"}],
            "max_tokens": 60,
            "temperature": 0,
        }
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        text = reply["choices"][0]["message"]["content"]
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 5, text
        assert reply["usage"]["completion_tokens"] <= 60
    finally:
        output = stop(process)
    assert process.returncode == 0, output
    assert "request_id=chatcmpl-" in output  # one structured log line per request


def test_serve_api_key_from_the_environment(chat_checkpoint):
    process, url = start(
        [str(chat_checkpoint), "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", "0.02"],
        env={"ENGINE_API_KEY": "env-secret"},
    )
    try:
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer env-secret"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
    finally:
        stop(process)


def test_serve_rejects_bad_options_in_one_line(chat_checkpoint):
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", str(chat_checkpoint), "--max-num-seqs", "0", "--plugins", ""],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == "engine serve: error: --max-num-seqs: Input should be greater than or equal to 1"


def test_a_busy_port_is_refused_before_the_model_loads():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--plugins", "cpu,llama"],
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "ENGINE_API_KEY": ""},
        )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert f"engine serve: error: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "--port" in result.stderr
    # refused first: the model was never loaded and nothing claimed to serve
    assert "engine ready" not in output and "serving" not in output and "Traceback" not in output


def _stream(url: str, max_tokens: int, out: list) -> None:
    body = {"model": "demo", "prompt": "The", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.TransportError as exc:  # a stream cut without a word is what must not happen
        events.append(f"cut: {exc!r}")
    out.append(events)


def test_sigterm_drains_running_requests_then_exits_0(tmp_path):
    import threading

    process, url = start(
        ["--shutdown-timeout", "1", "--kv-tier", "disk", "--kv-tier-config", f'{{"path": "{tmp_path}"}}'],
        env={"ENGINE_API_KEY": ""},
        plugins="cpu,llama,kv_tier_disk",
    )
    results: list = []
    threads = [threading.Thread(target=_stream, args=(url, n, results)) for n in (4, 900, 900)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # the short one is done; the long ones run
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    for thread in threads:
        thread.join(timeout=60)
    assert process.returncode == 0, output
    assert "Traceback" not in output and "Event loop is closed" not in output, output
    assert len(results) == 3
    for events in results:
        assert events, "a stream got nothing"
        last = events[-1]
        # each stream either completed or was told why it stopped, in the stream
        assert last == "[DONE]" or ("error" in last and "shutting down" in last), events[-3:]
    assert any(e[-1] == "[DONE]" for e in results)
    assert list(tmp_path.iterdir()), "the disk tier wrote nothing on shutdown"
