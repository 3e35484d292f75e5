"""app/guard.py's rules, in-process on a bare app (the live checks: test_server_doors.py)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tidal.app.errors import clean_library_message
from tidal.app.guard import RequestGuard, default_allowed_hosts, host_allowed, origin_allowed
from tidal.app.server_state import ServerSettings


def test_default_hosts_follow_the_bind_address() -> None:
    assert default_allowed_hosts("127.0.0.1") == ["localhost", "127.0.0.1", "::1"]
    assert "::1" in default_allowed_hosts("::1") and "127.0.0.2" in default_allowed_hosts(
        "127.0.0.2")
    assert default_allowed_hosts("0.0.0.0") is None and default_allowed_hosts("::") is None
    assert default_allowed_hosts("192.168.1.5") is None


def test_host_and_origin_rules() -> None:
    loop = default_allowed_hosts("127.0.0.1")
    assert host_allowed("localhost:8000", loop) and host_allowed("[::1]:8000", loop)
    assert not host_allowed("evil.example", loop) and not host_allowed("localhost.evil", loop)
    assert host_allowed("a.example.com", [".example.com"]) and host_allowed(None, loop)
    assert origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", [])
    assert origin_allowed("http://localhost", "localhost:80", [])
    assert not origin_allowed("http://127.0.0.1:3000", "127.0.0.1:8000", [])
    assert origin_allowed("http://127.0.0.1:3000", "127.0.0.1:8000", ["http://127.0.0.1:3000"])
    assert not origin_allowed("null", "127.0.0.1:8000", [])


def _client(**settings: object) -> TestClient:
    async def ok(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(p, ok) for p in ("/", "/health", "/metrics", "/load")],
                    middleware=[Middleware(RequestGuard, settings=ServerSettings(
                        served_model_name="x", **settings))])
    return TestClient(app)


def test_metrics_without_key_opens_only_metrics() -> None:
    for flag, metrics_status in ((False, 401), (True, 200)):
        client = _client(api_key="k", metrics_without_key=flag)
        assert client.get("/metrics").status_code == metrics_status
        assert client.get("/load").status_code == 401
        assert client.get("/health").status_code == client.get("/").status_code == 200


def test_a_link_to_the_page_is_no_cross_site_request() -> None:
    client = _client()
    nav = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}
    assert client.get("/", headers=nav).status_code == 200
    assert client.get("/load", headers=nav).status_code == 403
    assert client.get("/", headers={**nav, "Sec-Fetch-Mode": "no-cors"}).status_code == 403


def test_library_messages_lose_timestamps_and_paths() -> None:
    raw = ("response_format does not compile: [21:50:43] /project/cpp/regex_converter.cc:83: "
           "Regex parsing error at position 4")
    assert clean_library_message(raw) == \
        "response_format does not compile: Regex parsing error at position 4"
    assert clean_library_message("messages[0].content: 1/2 [x]") == \
        "messages[0].content: 1/2 [x]"
