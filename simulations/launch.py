"""Run the fedadapt Flower app for real and report whether the run *succeeded*.

    python -m simulations.launch sim    [--num-supernodes 10] [--run-config "method='fedadam' num-server-rounds=5"]
    python -m simulations.launch deploy [--nodes 2]           [--run-config "..."]

``sim``    starts a private ``flower-superlink --simulation`` (Ray backend) on free loopback ports, then
           ``flwr run . <connection> --stream --federation-config "num-supernodes=N client-resources-num-cpus=1"``.
``deploy`` starts a ``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1, each SuperNode with
           ``--node-config "partition-id=i num-partitions=N"`` (plus ``data-path='…'`` with ``--node-data``: each
           node then trains on its own file), then ``flwr run . <connection> --stream``.

Both wait for the run to end, read its status with ``flwr ls --run-id … --format json`` (``flwr run`` exits 0 even
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
import urllib.request
from collections.abc import Sequence
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


def _report(run_id: int | None, status: str, log_dir: Path) -> int:
    print(f"[fedadapt] run {run_id}: {status} (process logs in {log_dir})", flush=True)
    return 0 if status == "finished:completed" else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("sim", "deploy"))
    ap.add_argument("--num-supernodes", type=int, default=10, help="virtual SuperNodes (sim)")
    ap.add_argument("--nodes", type=int, default=2, help="SuperNode processes (deploy)")
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
    return launch_deploy(args.nodes, args.run_config, home, args.timeout, Path(args.app).resolve(),
                         node_data=args.node_data, task_poll_interval=args.task_poll_interval)


if __name__ == "__main__":
    sys.exit(main())
