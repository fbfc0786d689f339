"""The guarded SuperLink's filter (``simulations.launch.guarded_superlink``): a non-loopback peer reaches only the
Fleet API and ``/health``; the Control and Runtime APIs answer it 403 before any handler runs.  In-process ASGI
calls (the deployment itself: ``tests/test_secure_deploy.py``)."""

from __future__ import annotations

import asyncio

import pytest

from simulations.launch.guarded_superlink import REFUSAL, NodeHostsFleetOnly, allowed, is_loopback


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
