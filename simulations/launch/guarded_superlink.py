"""``flower-superlink`` that serves node hosts only what SuperNodes need (``python -m
simulations.launch.guarded_superlink <flower-superlink arguments>``; the secure launch mode uses it).

Flower 1.42's SuperLink serves its Fleet API (SuperNodes), its Control API (the ``flwr`` CLI: start and list runs,
logs, SuperNode registration) and its Runtime API (ServerApp, SuperExec) on ONE address (``--host``/``--port``;
the ``--fleet-api-address``/``--control-api-address`` flags are deprecated and ignored for HTTP).  TLS authenticates
the server only, and Flower's account authentication (OIDC) is not in the open-source distribution, so every
Control API call is answered to anyone who reaches the port and trusts its certificate: a node host holding only
``ca.crt`` could register a key of its own (``flwr supernode register``, then join as a SuperNode) and read runs
(``flwr ls``).

This runs the very same ``flower-superlink`` with one ASGI middleware added in front of Flower's own: a request from
a peer that is not a loopback address may reach only the Fleet API (``/v1/fleet/…``) and ``/health``; anything else
is answered ``403`` before a Flower handler runs.  The operator uses the Control API on the SuperLink's machine (the
``flwr`` CLI with ``address = "127.0.0.1:<port>"``, or through an SSH tunnel to it).  The peer address is the TCP
peer: uvicorn trusts ``X-Forwarded-For`` only from 127.0.0.1 (its default), so a remote peer cannot claim to be local.
"""

from __future__ import annotations

import ipaddress
from typing import Any

#: What a non-loopback peer may reach: the Fleet API (every path under it) and the health check (that path).
FLEET_PREFIX = "/v1/fleet/"
HEALTH_PATH = "/health"
REFUSAL = (b"fedadapt guarded SuperLink: from a non-loopback address only the Fleet API (SuperNodes) is served; "
           b"use the Control API on the SuperLink's machine")


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` is a loopback IP address (IPv4-mapped IPv6 included)."""
    try:
        ip = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def allowed(path: str, client_host: str | None) -> bool:
    """Whether a request for ``path`` from ``client_host`` is served."""
    return is_loopback(client_host) or path == HEALTH_PATH or path.startswith(FLEET_PREFIX)


class NodeHostsFleetOnly:
    """ASGI middleware: :func:`allowed` requests go on to Flower's app, the others get ``403`` (plain text)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        client = scope.get("client") or (None, None)
        if scope["type"] == "http" and not allowed(scope.get("path", ""), client[0]):
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(REFUSAL)).encode())]})
            await send({"type": "http.response.body", "body": REFUSAL})
            return
        await self.app(scope, receive, send)


def main() -> None:
    """``flower-superlink`` (same arguments, from ``sys.argv``) with :class:`NodeHostsFleetOnly` outermost."""
    import flwr.superlink.main as superlink_app  # flwr 1.42 internals (pinned): the app's middleware list
    from flwr.superlink.cli import flower_superlink
    from starlette.middleware import Middleware

    flower_middleware = superlink_app._get_middleware
    superlink_app._get_middleware = lambda: [Middleware(NodeHostsFleetOnly), *flower_middleware()]
    flower_superlink()


if __name__ == "__main__":
    main()
