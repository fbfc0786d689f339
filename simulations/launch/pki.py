"""A throw-away PKI for local TLS + SuperNode authentication: CA, server certificate, one SSH key per SuperNode."""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path


def san(host: str) -> str:
    """``IP:<addr>`` or ``DNS:<name>`` for a certificate's subjectAltName."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"DNS:{host}"
    return f"IP:{host}"


def check_call(argv: Sequence[str], cwd: Path) -> None:
    res = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")


def make_test_pki(pki_dir: Path, node_names: Sequence[str],
                  hosts: Sequence[str] = ("127.0.0.1", "::1", "localhost")) -> dict[str, Path]:
    """Throw-away CA + server certificate (SAN: ``hosts``, IP addresses or DNS names) with openssl, and one ECDSA
    P-384 key pair per SuperNode (OpenSSH format, as ``flwr supernode register`` wants) with ssh-keygen.  For
    tests/local use only: never commit these files."""
    pki_dir.mkdir(parents=True, exist_ok=True)
    openssl = shutil.which("openssl")
    ssh_keygen = shutil.which("ssh-keygen")
    if not openssl or not ssh_keygen:
        raise FileNotFoundError("the secure deployment needs `openssl` and `ssh-keygen` on PATH")
    check_call([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", "ca.key",
                "-out", "ca.crt", "-subj", "/CN=fedadapt-test-ca"], pki_dir)
    check_call([openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
                "-subj", "/CN=localhost"], pki_dir)
    (pki_dir / "server.ext").write_text(
        f"subjectAltName={','.join(san(h) for h in hosts)}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    check_call([openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "server.ext"], pki_dir)
    files = {"ca": pki_dir / "ca.crt", "cert": pki_dir / "server.pem", "key": pki_dir / "server.key"}
    for name in node_names:
        key = pki_dir / f"{name}_key"
        for old in (key, key.with_name(key.name + ".pub")):
            old.unlink(missing_ok=True)
        check_call([ssh_keygen, "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-C", name, "-f", str(key)], pki_dir)
        files[name] = key
    for path in pki_dir.iterdir():
        if path.name.endswith(".key") or path.name.endswith("_key"):
            path.chmod(0o600)
    return files
