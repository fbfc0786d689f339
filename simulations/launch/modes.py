"""The three launch modes: Ray simulation, local deployment, and local deployment with TLS + SuperNode auth."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .flwr_cli import (build_run_config, flwr_json, flwr_run, list_supernodes, write_connection,
                       write_secure_connections)
from .pki import make_test_pki
from .processes import APP_DIR, Cluster, bin_path, free_port, wait_health


def report(run_id: int | None, status: str, log_dir: Path) -> int:
    """Print the run's outcome; 0 when it completed, else 1.  A lost SuperLink (``superlink-lost: …``) is said as
    such: every process of the launch is stopped at once (:meth:`Cluster.watch_superlink`)."""
    if status.startswith("superlink-lost"):
        print(f"[fedadapt] run {run_id}: FAILED, {status.split(': ', 1)[-1]}; every process of this launch was "
              f"stopped (process logs in {log_dir})", flush=True)
        return 1
    print(f"[fedadapt] run {run_id}: {status} (process logs in {log_dir})", flush=True)
    return 0 if status == "finished:completed" else 1


def superlink_argv(port: int, database: Path, *flags: str, host: str = "127.0.0.1", guarded: bool = False) -> list[str]:
    """``flower-superlink`` on ``host:port``; ``guarded``: through :mod:`.guarded_superlink` (only the Fleet API
    served to non-loopback peers)."""
    exe = [sys.executable, "-m", "simulations.launch.guarded_superlink"] if guarded else [bin_path("flower-superlink")]
    return [*exe, *flags, "--disable-runtime-dependency-installation",
            "--host", host, "--port", str(port), "--database", str(database)]


def ray_address_check(address: str, timeout: float = 5.0) -> str:
    """``address`` (``host:port`` of a running Ray head's GCS, as printed by ``ray start --head``) if it accepts TCP
    connections, else a clear error — instead of a simulation that fails inside the SuperLink's subprocess."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        raise ValueError(f"--ray-address {address!r}: expected host:port of the Ray head (ray start --head --port=...)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"no Ray cluster answers at {address} ({err}); start one with "
                              f"`ray start --head --port={port}` on {host}") from None
    return address


def federation_config(num_supernodes: int, client_cpus: int = 1, client_gpus: float = 0.0,
                      ray_cpus: int | None = None) -> str:
    """``--federation-config`` of a simulation run: federation size, Ray resources reserved per ClientApp actor and
    (``ray_cpus``) the CPUs of the private Ray instance (``init-args-num-cpus``)."""
    cfg = f"num-supernodes={num_supernodes} client-resources-num-cpus={int(client_cpus)}"
    cfg += f" client-resources-num-gpus={float(client_gpus)}" if client_gpus else ""
    return cfg + (f" init-args-num-cpus={int(ray_cpus)}" if ray_cpus is not None else "")


def launch_sim(num_supernodes: int, run_config: str | None, flwr_home: Path, timeout: float,
               app_dir: Path = APP_DIR, ray_address: str | None = None, client_cpus: int = 1,
               client_gpus: float = 0.0, ray_cpus: int | None = None, verbose: bool = False) -> int:
    """A private ``flower-superlink --simulation`` (Ray) + ``flwr run --federation-config num-supernodes=N``.

    ``ray_address`` (``host:port``): attach the simulation to that running Ray cluster instead of starting a private
    Ray instance.  Flower 1.42 has no federation-config key for it (its ``SimulationConfig`` knows only
    ``init-args-num-cpus/-num-gpus/-logging-level/-log-to-driver``); its Ray backend calls ``ray.init(**init_args)``
    with no address, and Ray then reads ``RAY_ADDRESS`` — so the SuperLink is started with ``RAY_ADDRESS`` set and
    its ``flwr-simulation`` child inherits it.  ``client_cpus``/``client_gpus``: Ray resources per ClientApp actor
    (``client-resources-num-cpus/-num-gpus``); the number of actors is what the cluster's resources allow.
    ``ray_cpus``: CPUs of the private Ray instance (``init-args-num-cpus``; default: all of this machine's), so
    ``ray_cpus // client_cpus`` actors (each imports torch and the app) serve the whole federation; not with an
    existing cluster, whose resources are fixed (Ray refuses ``num_cpus`` when connecting)."""
    if ray_cpus is not None and (ray_address or os.environ.get("RAY_ADDRESS")):
        raise ValueError("--ray-cpus sizes a private Ray instance; an existing cluster (--ray-address / RAY_ADDRESS) "
                         "has its own CPUs: leave --ray-cpus out, or size the cluster with `ray start --num-cpus`")
    cfg = build_run_config(run_config, app_dir)
    env = {"RAY_ADDRESS": ray_address_check(ray_address)} if ray_address else {}
    port = free_port()
    log_dir = flwr_home / "logs"
    with Cluster(flwr_home, log_dir) as cluster:
        link = cluster.start("superlink", superlink_argv(port, flwr_home / "state.db", "--insecure", "--simulation"),
                             env=env)
        wait_health(f"http://127.0.0.1:{port}/health", 60, link)
        write_connection(flwr_home, "fedadapt-sim", port)
        if ray_address:
            print(f"[fedadapt] simulation attaches to the Ray cluster at {ray_address}", flush=True)
        fed_cfg = federation_config(num_supernodes, client_cpus, client_gpus, ray_cpus)
        run_id, status, _ = flwr_run(cluster, "fedadapt-sim", cfg, fed_cfg, timeout, app_dir, verbose)
    return report(run_id, status, log_dir)


def node_data_paths(node_data: Sequence[str | Path] | None, nodes: int) -> list[Path] | None:
    """Per-node data files: one path per node, or one directory holding ``partition-<i>.npz``
    (as written by ``python -m simulations.tools.convert_data``)."""
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


@contextmanager
def deploy_cluster(nodes: int, flwr_home: Path, node_data: Sequence[str | Path] | None = None,
                   task_poll_interval: float | None = None, preloaded: bool = False,
                   heartbeat_interval: float | None = None,
                   idle_poll: float | None = None) -> Iterator[tuple[Cluster, str]]:
    """A ``flower-superlink`` and ``nodes`` ``flower-supernode`` processes on 127.0.0.1 (plaintext), stopped on exit;
    yields the cluster and the name of its ``flwr`` connection (several ``flwr run`` may use the same nodes).

    SuperNode ``i`` (process ``supernode<i>``, see :func:`start_supernode`) gets
    ``--node-config "partition-id=i num-partitions=N"`` (plus ``data-path`` with ``node_data``),
    ``FLWR_HOME=<flwr_home>/node<i>`` and the node-local client-state directory ``<flwr_home>/node<i>/client-state``.
    ``preloaded``: each SuperNode runs with ``--isolation process`` next to a pre-loaded SuperExec
    (:mod:`.preloaded_exec`) that forks one ClientApp process per message instead of starting a fresh interpreter.
    ``heartbeat_interval`` (s, 10 or more): what each SuperNode announces instead of Flower's 30 s, so that a lost node
    is marked offline (and its pending messages answered with an error) 2 intervals after its last heartbeat
    (:mod:`.heartbeat_supernode`).  ``task_poll_interval`` (s): how often every SuperExec asks for a task — the
    SuperLink's, which starts each run's ServerApp, and the SuperNodes' (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``;
    Flower's default 1 s).  ``idle_poll`` (s, at most 3): how often an idle SuperNode asks the SuperLink for
    messages instead of Flower's fixed 3 s (:mod:`.heartbeat_supernode`)."""
    data = node_data_paths(node_data, nodes)
    port = free_port()
    with Cluster(flwr_home, flwr_home / "logs") as cluster:
        node_env: dict[str, str] = {}
        if task_poll_interval is not None:  # how often each SuperExec (the SuperLink's too) asks for a new task
            node_env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(float(task_poll_interval))
        link = cluster.start("superlink", superlink_argv(port, flwr_home / "state.db", "--insecure"),
                             env={"FLWR_HOME": str(flwr_home / "link"), **node_env})
        wait_health(f"http://127.0.0.1:{port}/health", 60, link)
        cluster.superlink_port = port
        for i in range(nodes):
            start_supernode(cluster, i, nodes, data, node_env, preloaded=preloaded,
                            heartbeat_interval=heartbeat_interval, idle_poll=idle_poll)
        write_connection(flwr_home, "fedadapt-deploy", port)
        yield cluster, "fedadapt-deploy"


def start_supernode(cluster: Cluster, i: int, nodes: int, data: list[Path] | None = None,
                    env: dict[str, str] | None = None, *, preloaded: bool = False,
                    heartbeat_interval: float | None = None, idle_poll: float | None = None) -> subprocess.Popen:
    """Start (or restart: same node-local directories) SuperNode ``i`` of a :func:`deploy_cluster`.

    Its client state (SCAFFOLD's c_i, Fed-LAMB's m, …) is kept in ``<FLWR_HOME>/node<i>/client-state``
    (``FEDADAPT_CLIENT_STATE_DIR``, :mod:`client_app.client_state`), so a resumed run continues it exactly."""
    home = cluster.flwr_home / f"node{i}"
    node_env = {"FLWR_HOME": str(home), "FEDADAPT_CLIENT_STATE_DIR": str(home / "client-state"), **(env or {})}
    node_port = free_port()
    exe = [bin_path("flower-supernode")]
    if heartbeat_interval is not None or idle_poll is not None:  # Flower's SuperNode with these two settings
        from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL

        exe = [sys.executable, "-m", "simulations.launch.heartbeat_supernode",
               str(float(HEARTBEAT_DEFAULT_INTERVAL if heartbeat_interval is None else heartbeat_interval)),
               *(["--idle-poll", str(float(idle_poll))] if idle_poll is not None else [])]
    node = cluster.start(f"supernode{i}", [
        *exe, "--insecure", "--superlink", f"127.0.0.1:{cluster.superlink_port}",
        "--port", str(node_port), "--node-config", node_config(i, nodes, data),
        *(["--isolation", "process"] if preloaded else []),
    ], env=node_env)
    if preloaded:  # the SuperNode starts no executor; this one connects to its Runtime API
        cluster.start(f"superexec{i}", [
            sys.executable, "-m", "simulations.launch.preloaded_exec", "--insecure",
            "--runtime-api-address", f"127.0.0.1:{node_port}", "--parent-pid", str(node.pid),
        ], env=node_env)
    return node


def launch_deploy(nodes: int, run_config: str | None, flwr_home: Path, timeout: float,
                  app_dir: Path = APP_DIR, node_data: Sequence[str | Path] | None = None,
                  task_poll_interval: float | None = None, preloaded: bool = False, verbose: bool = False) -> int:
    """:func:`deploy_cluster`, then ``flwr run`` on it.

    ``min-available-nodes = nodes`` and ``min-train-nodes = min(2, nodes)`` unless the run-config sets them; a
    lower ``min-available-nodes`` lets the run go on with the nodes that remain when some are lost."""
    cfg = build_run_config(run_config, app_dir, {"min-available-nodes": nodes, "min-train-nodes": min(2, nodes)})
    with deploy_cluster(nodes, flwr_home, node_data, task_poll_interval, preloaded) as (cluster, conn):
        run_id, status, _ = flwr_run(cluster, conn, cfg, None, timeout, app_dir, verbose)
    return report(run_id, status, flwr_home / "logs")


# --------------------------------------------------------------------------------------------------------------
# Secure deployment: TLS + SuperNode authentication (``secure`` mode)
# --------------------------------------------------------------------------------------------------------------
@dataclass
class SecureDeployResult:
    """What :func:`launch_secure_deploy` observed (the tests judge it)."""

    port: int
    node_ports: list[int]
    run_id: int | None = None
    status: str = "not-started"
    registered_ids: list[int] = field(default_factory=list)
    nodes_listed: list[dict] = field(default_factory=list)
    tls_client: dict = field(default_factory=dict)  # `flwr ls` over TLS verified against the CA
    plaintext_client: dict = field(default_factory=dict)  # the same call over an `insecure = true` connection
    plaintext_http_error: str | None = None  # why plain HTTP to the port got no answer (None: it answered)
    outsider_ls: dict = field(default_factory=dict)  # `flwr ls` from `public_host` with ca.crt alone
    outsider_register: dict = field(default_factory=dict)  # `flwr supernode register` of its own key, from there
    unregistered_rc: list[int | None] = field(default_factory=list)  # exit codes of the unregistered SuperNodes
    unregistered_logs: list[str] = field(default_factory=list)
    log_dir: Path | None = None


def _plain_http_error(port: int) -> str | None:
    """``None`` if ``http://127.0.0.1:<port>/health`` answers with any HTTP status line, else why not."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
            return None
    except urllib.error.HTTPError:  # an HTTP status line came back: the port does speak plain HTTP
        return None
    except Exception as exc:  # noqa: BLE001 - no HTTP answer at all (connection dropped, reset, TLS garbage)
        return f"{type(exc).__name__}: {exc}"


def launch_secure_deploy(nodes: int, run_config: str | None, flwr_home: Path, timeout: float,
                         app_dir: Path = APP_DIR, unregistered: int = 1,
                         pki_dir: Path | None = None, public_host: str | None = None,
                         verbose: bool = False) -> SecureDeployResult:
    """SuperLink (TLS + ``--enable-supernode-auth``, :mod:`.guarded_superlink`: only the Fleet API served to
    non-loopback peers), ``nodes`` registered SuperNodes and ``unregistered`` SuperNodes with unknown keys; probes a
    plaintext client; runs the app on the registered nodes (``min-available-nodes = min-train-nodes = nodes`` unless
    the run-config sets them).  Every process is stopped on return.

    ``public_host`` (a non-loopback address of this machine): the SuperLink listens on all interfaces, its
    certificate names ``public_host`` too, the SuperNodes connect through ``public_host`` (as node hosts would), and
    an outsider holding only ``ca.crt`` tries ``flwr ls`` and ``flwr supernode register`` through it (both must
    fail).  ``None``: everything on 127.0.0.1."""
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    cfg = build_run_config(run_config, app_dir, {"min-available-nodes": nodes, "min-train-nodes": nodes})
    port = free_port()
    log_dir = flwr_home / "logs"
    names = [f"sn{i}" for i in range(nodes)] + [f"unregistered{j}" for j in range(unregistered)] + ["outsider"]
    hosts = ("127.0.0.1", "::1", "localhost", *([public_host] if public_host else []))
    pki = make_test_pki((pki_dir or flwr_home / "pki").resolve(), names, hosts)
    conn, plain, outsider = "fedadapt-secure", "fedadapt-plaintext", "fedadapt-outsider"
    node_host = public_host or "127.0.0.1"
    res = SecureDeployResult(port=port, node_ports=[], log_dir=log_dir)
    with Cluster(flwr_home, log_dir) as cluster:
        link = cluster.start("superlink", superlink_argv(
            port, flwr_home / "state.db", "--enable-supernode-auth", "--ssl-ca-certfile", str(pki["ca"]),
            "--ssl-certfile", str(pki["cert"]), "--ssl-keyfile", str(pki["key"]),
            host="0.0.0.0" if public_host else "127.0.0.1", guarded=True),
            env={"FLWR_HOME": str(flwr_home / "link")})
        wait_health(f"https://127.0.0.1:{port}/health", 60, link, cafile=pki["ca"])
        from . import guarded_superlink  # here: `python -m` runs that module; imported by the package, it would warn

        guard_failure = guarded_superlink.probe(f"https://127.0.0.1:{port}", cafile=str(pki["ca"]))
        if guard_failure is not None:  # the SuperLink stops itself too; the cluster stops everything on the way out
            raise RuntimeError(guarded_superlink.refusal(f"the launcher's probe got {guard_failure}"))
        write_secure_connections(flwr_home, conn, port, pki["ca"], plain,
                                 (outsider, public_host) if public_host else None)

        def supernode(name: str, node_cfg: str) -> subprocess.Popen:
            node_port = free_port()
            res.node_ports.append(node_port)
            return cluster.start(name, [
                bin_path("flower-supernode"), "--superlink", f"{node_host}:{port}", "--root-certificates",
                str(pki["ca"]), "--auth-supernode-private-key", str(pki[name]), "--port", str(node_port),
                "--node-config", node_cfg,
            ], env={"FLWR_HOME": str(flwr_home / name),
                    "FEDADAPT_CLIENT_STATE_DIR": str(flwr_home / name / "client-state")})

        # 1. The SuperNodes whose keys are NOT registered try to join; meanwhile (every `flwr` call is a fresh
        # interpreter, seconds of start-up, so they run side by side): the same CLI call over TLS and over plaintext,
        # plain HTTP to the port, the outsider's two attempts, and the registration of the first `nodes` keys.
        bad = [supernode(f"unregistered{j}", node_config(0, nodes, None)) for j in range(unregistered)]
        with ThreadPoolExecutor(max_workers=4 + nodes) as pool:
            tls = pool.submit(flwr_json, cluster, ["ls", conn])
            plaintext = pool.submit(flwr_json, cluster, ["ls", plain])
            http_error = pool.submit(_plain_http_error, port)
            if public_host:  # a node host with ca.crt alone: neither a SuperNode of its own nor the runs
                outsider_ls = pool.submit(flwr_json, cluster, ["ls", outsider])
                outsider_register = pool.submit(flwr_json, cluster, ["supernode", "register",
                                                                     f"{pki['outsider']}.pub", outsider,
                                                                     "--name", "outsider"])
            registered = [pool.submit(flwr_json, cluster, ["supernode", "register", f"{pki[f'sn{i}']}.pub", conn,
                                                           "--name", f"sn{i}"]) for i in range(nodes)]
        res.tls_client, res.plaintext_client, res.plaintext_http_error = (
            tls.result(), plaintext.result(), http_error.result())
        if public_host:
            res.outsider_ls, res.outsider_register = outsider_ls.result(), outsider_register.result()
        for i, future in enumerate(registered):
            reply = future.result()
            if reply.get("success") is not True or "node-id" not in reply:
                raise RuntimeError(f"registering sn{i} failed: {reply}")
            res.registered_ids.append(int(reply["node-id"]))

        # 2. Start the registered SuperNodes; record how the unregistered ones ended.
        for i in range(nodes):
            supernode(f"sn{i}", node_config(i, nodes, None))
        for j, proc in enumerate(bad):
            try:
                res.unregistered_rc.append(proc.wait(timeout=60))
            except subprocess.TimeoutExpired:
                res.unregistered_rc.append(None)
            res.unregistered_logs.append((log_dir / f"unregistered{j}.log").read_text(errors="replace"))

        # 3. Train on the registered nodes only.
        res.run_id, res.status, _ = flwr_run(cluster, conn, cfg, None, timeout, app_dir, verbose)
        res.nodes_listed = list_supernodes(cluster, conn)
    report(res.run_id, res.status, log_dir)
    listed = [(n.get("node-id"), n.get("status")) for n in res.nodes_listed]
    plaintext_ls = "failed" if res.plaintext_client.get("success") is False else "WORKED"
    print(f"[fedadapt] secure: plaintext flwr ls {plaintext_ls} "
          f"({res.plaintext_client.get('error-message', '')!r}), plain HTTP: {res.plaintext_http_error or 'ANSWERED'}; "
          f"unregistered SuperNodes' exit codes {res.unregistered_rc}; "
          f"registered node ids {res.registered_ids}, listed {listed}", flush=True)
    return res
