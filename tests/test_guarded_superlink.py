"""The guarded SuperLink's filter (``simulations.launch.guarded_superlink``): a non-loopback peer reaches only the
Fleet API and ``/health``; the Control and Runtime APIs answer it 403 before any handler runs.  In-process ASGI
calls (the deployment itself: ``tests/test_secure_deploy.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import types

import pytest

from simulations.launch.guarded_superlink import (REFUSAL, NodeHostsFleetOnly, allowed, install, is_loopback,
                                                  local_url, probe, self_check)

# The guard patches Flower internals of the release the app pins (constraints.txt): not a library test.
pytestmark = pytest.mark.pinned_flower


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
                                       ("::ffff:127.0.0.1", True), ("192.0.2.2", False), ("::ffff:192.0.2.2", False),
                                       ("fd00::2", False), ("localhost", False), ("", False), (None, False)])
def test_loopback_is_an_ip_address_test(host, loop):
    assert is_loopback(host) is loop


def call(path: str, host: str | None) -> tuple[int, bytes, list[str]]:
    """One HTTP request through the middleware: ``(status, body, the paths Flower's app saw)``."""
    seen: list[str] = []
    sent: list[dict] = []

    async def flower_app(scope, receive, send):
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(event):
        sent.append(event)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "path": path, "client": None if host is None else (host, 50000)}
    asyncio.run(NodeHostsFleetOnly(flower_app)(scope, receive, send))
    return sent[0]["status"], sent[1]["body"], seen


@pytest.mark.parametrize("path", ["/v1/control/list-runs", "/v1/control/register-node", "/v1/runtime/pull-messages",
                                  "/docs", "/v1/fleetx/create-node", "/healthz"])
def test_a_node_host_gets_403_for_anything_but_fleet_and_health(path):
    status, body, seen = call(path, "192.0.2.2")
    assert (status, body, seen) == (403, REFUSAL, [])
    assert call(path, "127.0.0.1") == (200, b"ok", [path])  # the operator, on the SuperLink's machine
    assert not allowed(path, None)  # no peer address (e.g. a Unix socket): not loopback, refused


@pytest.mark.parametrize("path", ["/v1/fleet/create-node", "/v1/fleet/push-object", "/health"])
def test_a_node_host_reaches_the_fleet_api_and_health(path):
    assert call(path, "192.0.2.2") == (200, b"ok", [path])


# ------------------------------------------------------------------ the start-up checks that the guard took effect
@contextlib.contextmanager
def served(app):
    """``app`` served by uvicorn (Flower's server, with its defaults: proxy headers trusted from 127.0.0.1 only) on a
    free loopback port, in a thread; yields the base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


async def flower_like(scope, receive, send):
    """Stands in for Flower's app: serves everything (200)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


def test_the_probe_sees_the_guard_through_a_real_server():
    """Through uvicorn: the probe (X-Forwarded-For from loopback) gets the guard's 403 where the guard is in place
    and a clear reason where it is not; the self-check then refuses, naming secure mode."""
    with served(NodeHostsFleetOnly(flower_like)) as url:
        assert probe(url) is None
        failures: list[str] = []
        self_check(url, fail=failures.append)
        assert failures == []
    with served(flower_like) as url:
        assert probe(url) == "HTTP 200: the request was served"
        failures = []
        self_check(url, fail=failures.append)
        assert len(failures) == 1 and "guard did not take effect" in failures[0] and "secure mode is refused" in \
            failures[0] and "192.0.2.1 got HTTP 200" in failures[0]
    assert probe(url, timeout=2).startswith("URLError")  # nothing answers any more: a failed probe too


def test_install_refuses_when_the_patch_target_is_missing_or_the_guard_is_not_first():
    import flwr.superlink.main as superlink_app

    ok = types.ModuleType("flwr.superlink.main")
    ok._get_middleware = superlink_app._get_middleware
    install(ok)
    assert ok._get_middleware()[0].cls is NodeHostsFleetOnly
    assert [m.cls for m in ok._get_middleware()[1:]] == [m.cls for m in superlink_app._get_middleware()]
    with pytest.raises(SystemExit, match="has no _get_middleware.*secure mode is refused"):
        install(types.ModuleType("flwr.superlink.main"))
    broken = types.ModuleType("flwr.superlink.main")
    broken._get_middleware = lambda: 1 / 0
    with pytest.raises(SystemExit, match="failed to build: ZeroDivisionError.*secure mode is refused"):
        install(broken)


@pytest.mark.parametrize("argv,url", [(["--insecure", "--port", "9001"], "http://127.0.0.1:9001"),
                                      (["--host", "0.0.0.0", "--port", "9002"], "https://127.0.0.1:9002"),
                                      (["--host", "::", "--port", "9003"], "https://[::1]:9003"),
                                      (["--host", "10.1.2.3", "--port", "9004"], "https://10.1.2.3:9004"),
                                      ([], "https://127.0.0.1:8000")])
def test_the_self_check_asks_the_address_the_superlink_listens_on(argv, url):
    assert local_url(argv) == url
