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

The middleware is put in by replacing a private function of Flower's (``flwr.superlink.main._get_middleware``), so
this checks that it took effect: before Flower starts, that the function exists and now puts the guard first; once
the SuperLink answers ``/health``, a probe (:func:`probe`) sends a Control API request as a non-loopback peer (from
127.0.0.1 with ``X-Forwarded-For: 192.0.2.1``, which uvicorn honours from loopback only) and must get the guard's
403.  Otherwise the process exits with :data:`EXIT_GUARD_FAILED` and a message: secure mode is refused rather than
served unguarded.  The launcher (:func:`.modes.launch_secure_deploy`) runs the same probe before it goes on.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

#: What a non-loopback peer may reach: the Fleet API (every path under it) and the health check (that path).
FLEET_PREFIX = "/v1/fleet/"
HEALTH_PATH = "/health"
REFUSAL = (b"fedadapt guarded SuperLink: from a non-loopback address only the Fleet API (SuperNodes) is served; "
           b"use the Control API on the SuperLink's machine")


#: The probe: a Control API path, asked for as this non-loopback peer (TEST-NET-1: no host has it).
PROBE_PATH = "/v1/control/list-runs"
PROBE_PEER = "192.0.2.1"
#: Exit status of a guarded SuperLink whose guard did not take effect.
EXIT_GUARD_FAILED = 78


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


def probe(base_url: str, cafile: str | None = None, timeout: float = 10.0) -> str | None:
    """``None`` when the SuperLink at ``base_url`` (``http(s)://127.0.0.1:PORT``) answers a Control API request from a
    non-loopback peer with the guard's 403, else what it answered.  Over TLS the certificate is checked against
    ``cafile`` when given (the launcher), not at all otherwise (the SuperLink probing itself over loopback: the probe
    asks nothing and sends nothing secret)."""
    ctx = None
    if base_url.startswith("https:"):
        ctx = ssl.create_default_context(cafile=cafile)
        if cafile is None:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    request = urllib.request.Request(base_url + PROBE_PATH, data=b"", method="POST",
                                     headers={"X-Forwarded-For": PROBE_PEER, "Content-Type": "application/protobuf"})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=ctx) as resp:
            return f"HTTP {resp.status}: the request was served"
    except urllib.error.HTTPError as err:
        body = err.read()
        if err.code == 403 and body == REFUSAL:
            return None
        return f"HTTP {err.code} {body[:200]!r}"
    except Exception as err:  # noqa: BLE001 - no answer at all is a failed probe too
        return f"{type(err).__name__}: {err}"


def refusal(reason: str) -> str:
    """The message of a guard that did not take effect."""
    return (f"fedadapt guarded SuperLink: the Control API guard did not take effect ({reason}); a non-loopback peer "
            f"could reach the Control API, so secure mode is refused (the guard is written for flwr 1.42's SuperLink)")


def self_check(base_url: str, fail: Callable[[str], None] | None = None) -> None:
    """Wait until ``base_url``'s ``/health`` answers (nothing is served before), then :func:`probe` it; on failure
    ``fail(message)`` (default: print it and end this process with :data:`EXIT_GUARD_FAILED`)."""
    def default_fail(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_GUARD_FAILED)  # from a thread: Flower's server loop would otherwise keep serving

    ctx = None
    if base_url.startswith("https:"):
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    while True:
        try:
            with urllib.request.urlopen(base_url + HEALTH_PATH, timeout=2, context=ctx):
                break
        except urllib.error.HTTPError:
            break  # it answers HTTP: it serves
        except OSError:
            time.sleep(0.2)
    reason = probe(base_url)
    if reason is not None:
        (fail or default_fail)(refusal(f"a Control API request from {PROBE_PEER} got {reason}, expected the "
                                       f"guard's 403"))


def install(superlink_app: Any) -> None:
    """Put :class:`NodeHostsFleetOnly` outermost in Flower's middleware list (``superlink_app``: the module
    ``flwr.superlink.main``); raise ``SystemExit`` with :func:`refusal` when the patch target is missing or the list
    does not then start with the guard."""
    from starlette.middleware import Middleware

    flower_middleware = getattr(superlink_app, "_get_middleware", None)
    if not callable(flower_middleware):
        raise SystemExit(refusal(f"{superlink_app.__name__} has no _get_middleware"))
    superlink_app._get_middleware = lambda: [Middleware(NodeHostsFleetOnly), *flower_middleware()]
    try:
        first = superlink_app._get_middleware()[0]
    except Exception as err:  # noqa: BLE001 - Flower's own list failed to build: the guard is not in place
        raise SystemExit(refusal(f"its middleware list failed to build: {type(err).__name__}: {err}")) from err
    if getattr(first, "cls", None) is not NodeHostsFleetOnly:
        raise SystemExit(refusal("the middleware list does not start with the guard"))


def local_url(argv: list[str]) -> str:
    """``http(s)://HOST:PORT`` through which this machine reaches the SuperLink that ``flower-superlink`` ``argv``
    starts: loopback when it listens on a wildcard or loopback address, else that address (a non-loopback peer
    itself)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)  # Flower 1.42's defaults
    parser.add_argument("--insecure", action="store_true")
    args, _ = parser.parse_known_args(argv)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(args.host, args.host)
    if ":" in host:
        host = f"[{host}]"
    return f"{'http' if args.insecure else 'https'}://{host}:{args.port}"


def main() -> None:
    """``flower-superlink`` (same arguments, from ``sys.argv``) with :class:`NodeHostsFleetOnly` outermost, checked
    (:func:`install`, then :func:`self_check` of the running SuperLink)."""
    try:
        import flwr.superlink.main as superlink_app  # flwr 1.42 internals: the app's middleware list
    except ImportError as err:  # a Flower without the HTTP SuperLink app
        raise SystemExit(refusal(f"{type(err).__name__}: {err}")) from err
    from flwr.superlink.cli import flower_superlink

    install(superlink_app)
    threading.Thread(target=self_check, args=(local_url(sys.argv[1:]),), name="guard-check", daemon=True).start()
    flower_superlink()


if __name__ == "__main__":
    main()
