"""Secure local deployment: TLS + SuperNode authentication with real Flower processes.

``simulations.launch.launch_secure_deploy`` generates a throw-away CA, a server certificate for 127.0.0.1 and one
ECDSA key per SuperNode in ``tmp_path``, starts ``flower-superlink --enable-supernode-auth`` with TLS, registers two
SuperNodes' public keys, starts those two plus one SuperNode whose key is not registered, and runs one round.
The test checks: the registered nodes train (run ``finished:completed``, 2 replies used, both nodes online), the
unregistered node is refused (its process exits with Flower's 305 "Failed to activate SuperNode" and it never appears
in the federation), a plaintext client cannot connect (``flwr ls`` over an ``insecure = true`` connection fails while
the same call over TLS works, and plain HTTP to the port gets no answer), and nothing is left running.

With a non-loopback address of this machine (``public_host``) the SuperLink listens on all interfaces, the SuperNodes
connect through that address as node hosts would, and an outsider holding only ``ca.crt`` connects through it too:
it can neither list runs (``flwr ls``) nor register a key of its own (``flwr supernode register``) — the Control API
is served to loopback peers only (``simulations.launch.guarded_superlink``).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import subprocess

import pytest

from simulations.launch import launch_secure_deploy

pytestmark = pytest.mark.slow


def _our_processes(home, ports) -> list[str]:
    """Live processes whose command line names the test's FLWR_HOME or one of its loopback ports (the SuperNodes'
    ``flower-superexec`` children only name their SuperNode's port)."""
    pattern = re.compile("|".join([re.escape(str(home)), *(rf"[0-9.]+:{p}\b" for p in ports)]))
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if pattern.search(line) and not line.startswith("Z")]


def public_ipv4() -> str | None:
    """A non-loopback IPv4 address of this machine: the source address of its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1; connect() on UDP only picks the route
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if ipaddress.ip_address(addr).is_loopback or addr == "0.0.0.0" else addr


def outsider_refused(res) -> bool:
    """With ca.crt alone, through the public address: no run listed, no key registered (HTTP 403 from the guard)."""
    return (res.outsider_ls.get("success") is False and res.outsider_register.get("success") is False
            and "runs" not in res.outsider_ls and "node-id" not in res.outsider_register)


def plaintext_refused(res) -> bool:
    """A plaintext client is refused while the same CLI call over TLS works (so the refusal is about TLS), and plain
    HTTP to the port gets no HTTP answer at all."""
    return (res.tls_client.get("success") is True and res.plaintext_client.get("success") is False
            and "unavailable" in str(res.plaintext_client.get("error-message", ""))
            and res.plaintext_http_error is not None)


def unregistered_refused(res) -> bool:
    """Every unregistered SuperNode exited with Flower's auth failure and only the registered nodes are listed."""
    listed = {int(n.get("node-id", -1)) for n in res.nodes_listed}
    return (all(rc not in (None, 0) for rc in res.unregistered_rc)
            and all("Exit Code: 305" in log and "Failed to activate SuperNode" in log for log in res.unregistered_logs)
            and listed == set(res.registered_ids))


def test_tls_auth_deployment_registered_trains_unregistered_and_plaintext_refused(tmp_path):
    home, out = tmp_path / "flwr", tmp_path / "out"
    public = public_ipv4()
    res = launch_secure_deploy(2, f"num-server-rounds=1 local-steps=3 output-dir='{out}' run-name='secure'", home,
                               timeout=300, unregistered=1, public_host=public)

    # A registered node trains: the run completed with exactly the 2 registered nodes' replies.
    assert res.status == "finished:completed"
    rows = [json.loads(line) for line in (out / "secure" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[-1]["replies-used"] == 2
    assert len(res.registered_ids) == 2
    assert sorted(int(n["node-id"]) for n in res.nodes_listed) == sorted(res.registered_ids)
    assert all(n["status"] == "online" for n in res.nodes_listed)

    # An unregistered node is refused: its SuperNode exits with the auth failure and never joins.
    assert len(res.unregistered_rc) == 1 and res.unregistered_rc[0] not in (None, 0)
    assert "Exit Code: 305" in res.unregistered_logs[0]
    assert "Failed to activate SuperNode" in res.unregistered_logs[0]
    assert unregistered_refused(res)

    # A plaintext client cannot connect; the same CLI call over TLS (verified against the test CA) can.
    assert res.tls_client["success"] is True
    assert res.plaintext_client["success"] is False
    assert "Connection to the SuperLink is unavailable" in res.plaintext_client["error-message"]
    assert res.plaintext_http_error is not None
    assert plaintext_refused(res)

    # Keys and certificates were generated for this test only, and every process was stopped.
    assert (home / "pki" / "ca.crt").is_file() and (home / "pki" / "sn0_key.pub").is_file()
    assert _our_processes(home, [res.port, *res.node_ports]) == []

    # A node host's view (ca.crt alone, through the public address): the Control API refuses it; the registered
    # SuperNodes, connected through the same address, trained above (Fleet API served).
    if public is None:
        pytest.skip("this machine has no non-loopback IPv4 address: the outsider probe was not run")
    assert outsider_refused(res), (res.outsider_ls, res.outsider_register)
    assert "403" in res.outsider_ls["error-message"] + res.outsider_register["error-message"]
