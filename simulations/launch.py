"""Run the fedadapt Flower app for real and report whether the run *succeeded*.

    python -m simulations.launch sim    [--num-supernodes 10] [--run-config "method='fedadam' num-server-rounds=5"]
    python -m simulations.launch deploy [--nodes 2]           [--run-config "..."]
    python -m simulations.launch secure [--nodes 2]           [--run-config "..."]

``sim``    starts a private ``flower-superlink --simulation`` (Ray backend) on free loopback ports, then
           ``flwr run . <connection> --stream --federation-config "num-supernodes=N client-resources-num-cpus=1"``.
``deploy`` starts a ``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1, each SuperNode with
           ``--node-config "partition-id=i num-partitions=N"`` (plus ``data-path='…'`` with ``--node-data``: each
           node then trains on its own file), then ``flwr run . <connection> --stream``.
``secure`` is ``deploy`` over TLS with SuperNode authentication: it generates a throw-away CA, a server certificate
           for 127.0.0.1 and one ECDSA key per SuperNode (under ``<FLWR_HOME>/pki``), registers the N nodes' public
           keys with ``flwr supernode register``, also starts one SuperNode whose key is NOT registered (it must be
           refused), checks that a plaintext (``insecure = true``) client cannot talk to the SuperLink, then runs the
           app on the registered nodes.  Exit 0 only if all three hold and the run is ``finished:completed``.

All wait for the run to end, read its status with ``flwr ls --run-id … --format json`` (``flwr run`` exits 0 even
when the ServerApp failed), stop every process they started (by process group) and exit non-zero unless the status
is ``finished:completed``.  Runtime dependency installation is disabled (otherwise every run downloads GBs with uv),
telemetry is off, and ``FLWR_HOME`` defaults to ``<app>/.flwr`` so nothing is written to ``~/.flwr``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent.parent
BASE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "RAY_DEDUP_LOGS": "0",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    """Entry point next to the running interpreter (the venv), else on PATH."""
    cand = Path(sys.executable).parent / name
    if cand.exists():
        return str(cand)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found; is fedadapt installed in this environment?")
    return found


class Cluster:
    """Processes started for one run; all stopped (process group SIGTERM, then SIGKILL) on exit."""

    def __init__(self, flwr_home: Path, log_dir: Path) -> None:
        self.flwr_home = flwr_home
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.env = {**os.environ, **BASE_ENV, "FLWR_HOME": str(flwr_home)}
        # Flower's processes start further entry points (flower-superexec, flwr-serverapp, flwr-clientapp) by name:
        # put this interpreter's scripts directory first on PATH, so a non-activated venv works too.
        scripts = str(Path(sys.executable).parent)
        if scripts not in self.env.get("PATH", "").split(os.pathsep):
            self.env["PATH"] = os.pathsep.join(x for x in (scripts, self.env.get("PATH", "")) if x)
        flwr_home.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
            cwd=APP_DIR, start_new_session=True,
        )
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, proc in self.procs:
            _signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def write_connection(flwr_home: Path, name: str, port: int) -> None:
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )


def flwr_run(cluster: Cluster, connection: str, run_config: str | None, federation_config: str | None,
             timeout: float, app_dir: Path = APP_DIR) -> tuple[int | None, str, str]:
    """``flwr run --stream``; returns (run id, status, full output)."""
    argv = [_bin("flwr"), "run", str(app_dir), connection, "--stream"]
    if run_config:
        argv += ["--run-config", run_config]
    if federation_config:
        argv += ["--federation-config", federation_config]
    out_path = cluster.log_dir / "flwr-run.log"
    with open(out_path, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=cluster.env, cwd=APP_DIR)
        assert proc.stdout is not None
        t_end = time.monotonic() + timeout
        for line in proc.stdout:  # echo the streamed logs live
            fh.write(line)
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()
            if time.monotonic() > t_end:
                proc.kill()
                break
        proc.wait()
    text = out_path.read_text(errors="replace")
    m = re.search(r"Successfully started run (\d+)", text)
    if not m:
        return None, "not-started", text
    run_id = int(m.group(1))
    return run_id, run_status(cluster, connection, run_id), text


def run_status(cluster: Cluster, connection: str, run_id: int, wait_s: float = 30.0) -> str:
    deadline = time.monotonic() + wait_s
    status = "unknown"
    while time.monotonic() < deadline:
        res = subprocess.run(
            [_bin("flwr"), "ls", connection, "--run-id", str(run_id), "--format", "json"],
            capture_output=True, text=True, env=cluster.env, cwd=APP_DIR,
        )
        try:
            status = json.loads(res.stdout)["runs"][0]["status"]
        except (ValueError, KeyError, IndexError):
            status = "unknown"
        if status.startswith("finished"):
            return status
        time.sleep(1.0)
    return status


def launch_sim(num_supernodes: int, run_config: str | None, flwr_home: Path, timeout: float,
               app_dir: Path = APP_DIR) -> int:
    port = free_port()
    log_dir = flwr_home / "logs"
    with Cluster(flwr_home, log_dir) as cluster:
        link = cluster.start("superlink", [
            _bin("flower-superlink"), "--insecure", "--simulation", "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(port), "--database", str(flwr_home / "state.db"),
        ])
        wait_http(f"http://127.0.0.1:{port}/health", 60, link)
        write_connection(flwr_home, "fedadapt-sim", port)
        fed_cfg = f"num-supernodes={num_supernodes} client-resources-num-cpus=1"
        run_id, status, _ = flwr_run(cluster, "fedadapt-sim", run_config, fed_cfg, timeout, app_dir)
    return _report(run_id, status, log_dir)


def node_data_paths(node_data: Sequence[str | Path] | None, nodes: int) -> list[Path] | None:
    """Per-node data files: one path per node, or one directory holding ``partition-<i>.npz``
    (as written by ``python -m simulations.convert_data``)."""
    if not node_data:
        return None
    items = [Path(p).expanduser().resolve() for p in node_data]
    if len(items) == 1 and items[0].is_dir():
        items = [items[0] / f"partition-{i}.npz" for i in range(nodes)]
    if len(items) != nodes:
        raise ValueError(f"--node-data: {len(items)} paths for {nodes} nodes")
    missing = [str(p) for p in items if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"--node-data: no such file(s): {missing}")
    return items


def node_config(i: int, nodes: int, data: list[Path] | None) -> str:
    cfg = f"partition-id={i} num-partitions={nodes}"
    if data is not None:
        cfg += f" data-path='{data[i]}'"  # TOML literal string: no escapes needed
    return cfg


def launch_deploy(nodes: int, run_config: str | None, flwr_home: Path, timeout: float,
                  app_dir: Path = APP_DIR, node_data: Sequence[str | Path] | None = None,
                  task_poll_interval: float | None = None) -> int:
    data = node_data_paths(node_data, nodes)
    port = free_port()
    log_dir = flwr_home / "logs"
    with Cluster(flwr_home, log_dir) as cluster:
        link = cluster.start("superlink", [
            _bin("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(port), "--database", str(flwr_home / "state.db"),
        ], env={"FLWR_HOME": str(flwr_home / "link")})
        wait_http(f"http://127.0.0.1:{port}/health", 60, link)
        node_env: dict[str, str] = {}
        if task_poll_interval is not None:  # how often each SuperNode's SuperExec asks for a new ClientApp task
            node_env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(float(task_poll_interval))
        for i in range(nodes):
            cluster.start(f"supernode{i}", [
                _bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                "--port", str(free_port()), "--node-config", node_config(i, nodes, data),
            ], env={"FLWR_HOME": str(flwr_home / f"node{i}"), **node_env})
        write_connection(flwr_home, "fedadapt-deploy", port)
        cfg = f"min-available-nodes={nodes} min-train-nodes={min(2, nodes)}"
        if app_dir != APP_DIR:  # another app: it does not know fedadapt's run-config keys
            cfg = ""
        run_id, status, _ = flwr_run(cluster, "fedadapt-deploy", f"{cfg} {run_config or ''}".strip(), None, timeout, app_dir)
    return _report(run_id, status, log_dir)


# --------------------------------------------------------------------------------------------------------------
# Secure deployment: TLS + SuperNode authentication (``secure`` mode)
# --------------------------------------------------------------------------------------------------------------

def _check_call(argv: Sequence[str], cwd: Path) -> None:
    res = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")


def make_test_pki(pki_dir: Path, node_names: Sequence[str]) -> dict[str, Path]:
    """Throw-away CA + server certificate (SAN 127.0.0.1, ::1, localhost) with openssl, and one ECDSA P-384 key pair
    per SuperNode (OpenSSH format, as ``flwr supernode register`` wants) with ssh-keygen.  For tests/local use only:
    never commit these files."""
    pki_dir.mkdir(parents=True, exist_ok=True)
    openssl = shutil.which("openssl")
    ssh_keygen = shutil.which("ssh-keygen")
    if not openssl or not ssh_keygen:
        raise FileNotFoundError("the secure deployment needs `openssl` and `ssh-keygen` on PATH")
    _check_call([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", "ca.key",
                 "-out", "ca.crt", "-subj", "/CN=fedadapt-test-ca"], pki_dir)
    _check_call([openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
                 "-subj", "/CN=localhost"], pki_dir)
    (pki_dir / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    _check_call([openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "server.ext"], pki_dir)
    files = {"ca": pki_dir / "ca.crt", "cert": pki_dir / "server.pem", "key": pki_dir / "server.key"}
    for name in node_names:
        key = pki_dir / f"{name}_key"
        for old in (key, key.with_name(key.name + ".pub")):
            old.unlink(missing_ok=True)
        _check_call([ssh_keygen, "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-C", name, "-f", str(key)], pki_dir)
        files[name] = key
    for path in pki_dir.iterdir():
        if path.name.endswith(".key") or path.name.endswith("_key"):
            path.chmod(0o600)
    return files


def wait_https(url: str, timeout: float, cafile: Path, proc: subprocess.Popen | None = None) -> None:
    """Like :func:`wait_http` for a TLS endpoint whose certificate must verify against ``cafile``."""
    import ssl

    ctx = ssl.create_default_context(cafile=str(cafile))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1, context=ctx):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def write_secure_connections(flwr_home: Path, name: str, port: int, ca: Path, plaintext_name: str) -> None:
    """``name``: TLS connection verified against ``ca``; ``plaintext_name``: the same address with
    ``insecure = true`` (used only to show that a plaintext client is refused)."""
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n'
        f'[superlink.{name}]\naddress = "127.0.0.1:{port}"\nroot-certificates = "{ca.resolve()}"\n\n'
        f'[superlink.{plaintext_name}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )


def _flwr_cli(cluster: Cluster, args: Sequence[str], timeout: float = 120.0) -> tuple[int, str]:
    try:
        res = subprocess.run([_bin("flwr"), *args], capture_output=True, text=True, env=cluster.env, cwd=APP_DIR,
                             timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        parts = [p.decode(errors="replace") if isinstance(p, bytes) else (p or "") for p in (exc.stdout, exc.stderr)]
        return 124, "".join(parts)
    return res.returncode, res.stdout + res.stderr


def _flwr_json(cluster: Cluster, args: Sequence[str]) -> dict:
    """A ``flwr … --format json`` call as a dict (``{"success": False, …}`` when the output is not JSON)."""
    rc, out = _flwr_cli(cluster, [*args, "--format", "json"])
    try:
        data = json.loads(out[out.index("{"):])
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return {"success": False, "error-message": out[-2000:], "rc": rc}
    data["rc"] = rc
    return data


def list_supernodes(cluster: Cluster, connection: str) -> list[dict]:
    """``flwr supernode list --format json``: dicts with ``node-id`` (a string) and ``status``."""
    nodes = _flwr_json(cluster, ["supernode", "list", connection]).get("nodes", [])
    return nodes if isinstance(nodes, list) else []


@dataclass
class SecureDeployResult:
    """What :func:`launch_secure_deploy` observed; ``ok`` is the overall verdict."""

    port: int
    node_ports: list[int]
    run_id: int | None = None
    status: str = "not-started"
    registered_ids: list[int] = field(default_factory=list)
    nodes_listed: list[dict] = field(default_factory=list)
    tls_client: dict = field(default_factory=dict)
    plaintext_client: dict = field(default_factory=dict)
    plaintext_http_error: str | None = None
    unregistered_rc: list[int | None] = field(default_factory=list)
    unregistered_logs: list[str] = field(default_factory=list)
    log_dir: Path | None = None

    @property
    def plaintext_refused(self) -> bool:
        return (self.tls_client.get("success") is True and self.plaintext_client.get("success") is False
                and "unavailable" in str(self.plaintext_client.get("error-message", ""))
                and self.plaintext_http_error is not None)

    @property
    def unregistered_refused(self) -> bool:
        listed = {int(n.get("node-id", -1)) for n in self.nodes_listed}
        return (all(rc not in (None, 0) for rc in self.unregistered_rc)
                and all("Exit Code: 305" in log and "Failed to activate SuperNode" in log
                        for log in self.unregistered_logs)
                and listed == set(self.registered_ids))

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed" and self.plaintext_refused and self.unregistered_refused


def launch_secure_deploy(nodes: int, run_config: str | None, flwr_home: Path, timeout: float,
                         app_dir: Path = APP_DIR, unregistered: int = 1,
                         pki_dir: Path | None = None) -> SecureDeployResult:
    """SuperLink (TLS + ``--enable-supernode-auth``) and ``nodes`` registered SuperNodes plus ``unregistered``
    SuperNodes with unknown keys, all on 127.0.0.1; see the module docstring.  Every process is stopped on return."""
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    port = free_port()
    log_dir = flwr_home / "logs"
    names = [f"sn{i}" for i in range(nodes)] + [f"unregistered{j}" for j in range(unregistered)]
    pki = make_test_pki((pki_dir or flwr_home / "pki").resolve(), names)
    conn, plain = "fedadapt-secure", "fedadapt-plaintext"
    res = SecureDeployResult(port=port, node_ports=[], log_dir=log_dir)
    with Cluster(flwr_home, log_dir) as cluster:
        link = cluster.start("superlink", [
            _bin("flower-superlink"), "--enable-supernode-auth", "--disable-runtime-dependency-installation",
            "--ssl-ca-certfile", str(pki["ca"]), "--ssl-certfile", str(pki["cert"]), "--ssl-keyfile", str(pki["key"]),
            "--host", "127.0.0.1", "--port", str(port), "--database", str(flwr_home / "state.db"),
        ], env={"FLWR_HOME": str(flwr_home / "link")})
        wait_https(f"https://127.0.0.1:{port}/health", 60, pki["ca"], link)
        write_secure_connections(flwr_home, conn, port, pki["ca"], plain)

        # 1. A plaintext client is refused; the same CLI call over TLS works (so the refusal is about TLS).
        res.tls_client = _flwr_json(cluster, ["ls", conn])
        res.plaintext_client = _flwr_json(cluster, ["ls", plain])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                res.plaintext_http_error = None
        except urllib.error.HTTPError:  # an HTTP status line came back: the port does speak plain HTTP
            res.plaintext_http_error = None
        except Exception as exc:  # noqa: BLE001 - no HTTP answer at all (connection dropped, reset, TLS garbage)
            res.plaintext_http_error = f"{type(exc).__name__}: {exc}"

        # 2. Register the public keys of the first `nodes` SuperNodes (not the unregistered ones).
        for i in range(nodes):
            reply = _flwr_json(cluster, ["supernode", "register", f"{pki[f'sn{i}']}.pub", conn, "--name", f"sn{i}"])
            if reply.get("success") is not True or "node-id" not in reply:
                raise RuntimeError(f"registering sn{i} failed: {reply}")
            res.registered_ids.append(int(reply["node-id"]))

        # 3. Start all SuperNodes; the unregistered ones must exit with the auth failure.
        def supernode(name: str, cfg: str) -> subprocess.Popen:
            node_port = free_port()
            res.node_ports.append(node_port)
            return cluster.start(name, [
                _bin("flower-supernode"), "--superlink", f"127.0.0.1:{port}", "--root-certificates", str(pki["ca"]),
                "--auth-supernode-private-key", str(pki[name]), "--port", str(node_port), "--node-config", cfg,
            ], env={"FLWR_HOME": str(flwr_home / name)})

        for i in range(nodes):
            supernode(f"sn{i}", node_config(i, nodes, None))
        bad = [supernode(f"unregistered{j}", node_config(0, nodes, None)) for j in range(unregistered)]
        for j, proc in enumerate(bad):
            try:
                res.unregistered_rc.append(proc.wait(timeout=60))
            except subprocess.TimeoutExpired:
                res.unregistered_rc.append(None)
            res.unregistered_logs.append((log_dir / f"unregistered{j}.log").read_text(errors="replace"))

        # 4. Train on the registered nodes only.
        cfg = f"min-available-nodes={nodes} min-train-nodes={nodes}"
        if app_dir != APP_DIR:
            cfg = ""
        res.run_id, res.status, _ = flwr_run(cluster, conn, f"{cfg} {run_config or ''}".strip(), None, timeout,
                                             app_dir)
        res.nodes_listed = list_supernodes(cluster, conn)
    _report(res.run_id, res.status, log_dir)
    listed = [(n.get("node-id"), n.get("status")) for n in res.nodes_listed]
    print(f"[fedadapt] secure: plaintext client refused={res.plaintext_refused} "
          f"(flwr ls: {res.plaintext_client.get('error-message', '')!r}, http: {res.plaintext_http_error}); "
          f"unregistered refused={res.unregistered_refused} (exit codes {res.unregistered_rc}); "
          f"registered node ids {res.registered_ids}, listed {listed}", flush=True)
    return res


def _report(run_id: int | None, status: str, log_dir: Path) -> int:
    print(f"[fedadapt] run {run_id}: {status} (process logs in {log_dir})", flush=True)
    return 0 if status == "finished:completed" else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("sim", "deploy", "secure"))
    ap.add_argument("--num-supernodes", type=int, default=10, help="virtual SuperNodes (sim)")
    ap.add_argument("--nodes", type=int, default=2, help="SuperNode processes (deploy); registered SuperNodes (secure)")
    ap.add_argument("--unregistered", type=int, default=1,
                    help="secure: extra SuperNodes whose keys are not registered (they must be refused)")
    ap.add_argument("--run-config", default=None, help="run-config overrides, TOML-typed: \"method='fedadam' num-server-rounds=5\"")
    ap.add_argument("--flwr-home", default=os.environ.get("FLWR_HOME", str(APP_DIR / ".flwr")))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is abandoned")
    ap.add_argument("--app", default=str(APP_DIR), help="Flower app directory (default: this project)")
    ap.add_argument("--task-poll-interval", type=float, default=None, metavar="S",
                    help="deploy: seconds between a SuperNode's SuperExec task polls (Flower default 1.0; 0.01-60)")
    ap.add_argument("--node-data", nargs="+", default=None, metavar="PATH",
                    help="deploy: node-local data, one .npz per node or a directory of partition-<i>.npz "
                         "(python -m simulations.convert_data); passed as node config data-path")
    args = ap.parse_args(argv)
    home = Path(args.flwr_home).resolve()
    if args.mode == "sim":
        return launch_sim(args.num_supernodes, args.run_config, home, args.timeout, Path(args.app).resolve())
    if args.mode == "secure":
        res = launch_secure_deploy(args.nodes, args.run_config, home, args.timeout, Path(args.app).resolve(),
                                   unregistered=args.unregistered)
        return 0 if res.ok else 1
    return launch_deploy(args.nodes, args.run_config, home, args.timeout, Path(args.app).resolve(),
                         node_data=args.node_data, task_poll_interval=args.task_poll_interval)


if __name__ == "__main__":
    sys.exit(main())
