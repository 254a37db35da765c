"""Browsers: `kvstore serve --allowed-origins` (CORS), off unless asked.

A web page may read the API's answers only where the server names its origin: by default none is
named (a page elsewhere that posts to the loopback server cannot read what comes back, and its
preflighted requests never run); with `--allowed-origins`, pages of those origins get the
preflight's yes and every answer, errors and streams included, readable. `*` without API keys
would open every session to any page the user visits: refused unless `--allow-unauthenticated`.
"""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from kvstore_cli.main import cli
from kvstore_serve import command
from serve_kit import MODEL_NAME, LiveServer
from test_serve_guard import model_dir  # noqa: F401 (the fixture)

PAGE = "http://localhost:3000"
OTHER = "https://elsewhere.example"
KEY = "key-cors-0123456789"


@pytest.fixture(scope="module")
def open_to_page(tmp_path_factory, model_dir):
    """A server with API keys whose API pages of PAGE may call."""
    root = tmp_path_factory.mktemp("serve-cors")
    keys = root / "keys.txt"
    keys.write_text(KEY + "\n", encoding="utf-8")
    with LiveServer(root / "home", model_dir, "--threads", "1", "--api-key-file", str(keys),
                    "--allowed-origins", f"{PAGE},http://127.0.0.1:5173") as live:
        yield live


@pytest.fixture(scope="module")
def closed(tmp_path_factory, model_dir):
    """A server as it starts by default: no origin named."""
    with LiveServer(tmp_path_factory.mktemp("serve-no-cors") / "home", model_dir, "--threads", "1") as live:
        yield live


def preflight(server, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.options(server.url + path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,x-session-id,last-event-id"}, timeout=30)


def chat(server, origin: str, key: str | None = KEY, stream: bool = False, **extra) -> httpx.Response:
    headers = {"Origin": origin, **({"Authorization": f"Bearer {key}"} if key else {})}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "stream": stream, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_an_allowed_pages_preflight_is_answered_yes(open_to_page):
    for origin in (PAGE, "http://127.0.0.1:5173"):
        r = preflight(open_to_page, origin)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        allowed = r.headers["access-control-allow-headers"].lower()
        assert all(h in allowed for h in ("authorization", "content-type", "x-session-id", "last-event-id"))


def test_an_allowed_page_reads_answers_errors_and_streams(open_to_page):
    ok = chat(open_to_page, PAGE)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
    no_key = chat(open_to_page, PAGE, key=None)  # the page reads why: 401 in OpenAI's shape
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == PAGE
    assert no_key.json()["error"]["type"]
    bad = chat(open_to_page, PAGE, n=17)  # above the limit
    assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == PAGE
    streamed = chat(open_to_page, PAGE, stream=True)
    assert streamed.status_code == 200 and streamed.headers["access-control-allow-origin"] == PAGE
    assert streamed.text.rstrip().endswith("data: [DONE]")
    models = httpx.get(open_to_page.url + "/v1/models", headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
    assert models.headers["access-control-allow-origin"] == PAGE


def test_other_pages_get_no_yes(open_to_page):
    r = preflight(open_to_page, OTHER)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    answered = chat(open_to_page, OTHER)  # a client that is no browser still gets its answer
    assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers


def test_by_default_no_page_may_read_the_api(closed):
    r = preflight(closed, PAGE)
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    answered = chat(closed, PAGE, key=None)
    assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers


@pytest.mark.parametrize("args,env,origins", [
    (["--allowed-origins", "http://localhost:3000, https://chat.example.org:8443"], {},
     ["http://localhost:3000", "https://chat.example.org:8443"]),
    (["--allowed-origins", "http://[::1]:8080", "--allowed-origins", "http://127.0.0.1"], {},
     ["http://[::1]:8080", "http://127.0.0.1"]),
    (["--allowed-origins", "*"], {"KVSTORE_API_KEYS": "key-one-11111111"}, ["*"]),  # every call needs a key
    (["--allowed-origins", "*", "--allow-unauthenticated"], {}, ["*"]),  # the operator says so explicitly
    ([], {}, []),
])
def test_origins_that_may_be_allowed(args, env, origins, tmp_path, model_dir, monkeypatch):
    started = []
    monkeypatch.setattr(command, "run", started.append)
    result = CliRunner().invoke(cli, ["serve", "--model", model_dir, *args], env={"KVSTORE_API_KEYS": "", **env})
    assert result.exit_code == 0, result.output
    assert started[0].allowed_origins == origins


@pytest.mark.parametrize("value,error", [
    ("*", "any web page the user opens"),  # no keys
    ("localhost:3000", "is not an origin"),  # no scheme
    ("http://localhost:3000/app", "is not an origin"),  # a path
    ("ftp://files.example", "is not an origin"),
])
def test_origins_that_may_not_be(value, error, tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(command, "run", lambda config: pytest.fail("started"))
    result = CliRunner().invoke(cli, ["serve", "--model", model_dir, "--allowed-origins", value],
                                env={"KVSTORE_API_KEYS": ""})
    assert result.exit_code == 2 and error in result.output, result.output
