"""Every plain (non-TLS) real-deployment check on ONE local cluster: a SuperLink and 3 SuperNodes on 127.0.0.1, real
Flower processes started with ``simulations.launch.deploy_cluster`` (slow).

Starting a cluster (SuperLink, 3 SuperNodes, 3 pre-loaded SuperExecs importing torch) costs ~45 CPU-s and ~25 s
before the first message is served, so the module fixture :func:`deployment` starts one and the tests below run on
it in this file's order.  Those that break the cluster come last: the lost-SuperNode test kills ``supernode2``, the
SuperLink-lost test kills the SuperLink and stops everything.  The TLS + SuperNode-auth deployment (a cluster of its
own, Flower's stock executor) is ``tests/test_secure_deploy.py``.

The cluster's SuperNodes bring their own data (node config ``data-path``): the converter's 3 digits partitions (the
same rows the bundled loader gives each node), each cut to :data:`NODE_EXAMPLES` rows, so that a run's example count
(1,420 where the bundled partitions give 1,437) shows the node-local files were read.  They run the pre-loaded
SuperExec (``preloaded=True``: one forked ClientApp process per message) and announce a 10 s heartbeat (Flower's
minimum, ``heartbeat_interval``) instead of 30 s, so the SuperLink gives a lost node up 20 s after its last
heartbeat instead of a minute; idle, they ask for messages every 0.5 s instead of Flower's fixed 3 s (``idle_poll``).

1. Node-local data + pre-loaded SuperExec: the reference run (fixture :func:`reference`, SCAFFOLD, 3 rounds) trained
   on each SuperNode's own file, equals the in-process engine on the same files, and every message ran in its own
   forked process.
2. The ServerApp process (``flwr-serverapp``) killed with SIGKILL after checkpoint 1 (of 3) and resumed (``resume=``,
   a new ``flwr run``) against the same, still running SuperNodes ends bit-identical to the reference run: the
   clients' SCAFFOLD control variates come from the nodes' disks, not from the new run's empty ``Context.state``.
3. SecAgg+ in a deployment: a client-half method (fedcm) and a server-only one (fedadam), one round each, run side
   by side on the same nodes.
4. A SuperNode killed with SIGKILL after round 1 costs at most one round-timeout: round 2 proceeds with the two
   replies it has (the lost node's counts as missing), round 3 does not sample it (it sends no heartbeat), and the
   run completes (``max-idle-rounds`` is not tripped).
5. The SuperLink killed during a run: the launcher notices at once, reports it, and stops every process of the
   launch (orphaned descendants of the SuperLink too) within the short grace.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from client_app.app import app as client_app
from flower_strategies.core import checkpoint as ckpt
from server_app.app import run
from simulations.tools.convert_data import convert
from simulations.engine.inprocess import LoopbackGrid
from simulations.launch import APP_DIR, build_run_config, deploy_cluster
from simulations.launch.flwr_cli import flwr_json, flwr_run, format_run_config, list_supernodes
from simulations.launch.processes import LOST_GRACE_S, process_tree
from tests.helpers import our_processes
from tests.helpers import check_secagg_run

pytestmark = pytest.mark.slow
NODES = 3
#: Rows of each SuperNode's own file (the first rows of the converter's partition i, which has 402, 476, 559).
NODE_EXAMPLES = (400, 470, 550)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_online(cluster, conn: str, n: int, timeout: float = 90.0) -> None:
    """Until ``n`` SuperNodes are online.  Each ``flwr supernode list`` is a new interpreter (~2 CPU-s), so first
    wait for every node to log its id (it has registered with the SuperLink), then confirm with the list."""
    deadline = time.monotonic() + timeout
    logs = [cluster.log_dir / f"supernode{i}.log" for i in range(n)]
    while not all(log.exists() and "SuperNode ID:" in log.read_text(errors="replace") for log in logs):
        assert time.monotonic() < deadline, f"{n} SuperNodes did not register"
        time.sleep(0.2)
    while sum(node.get("status") == "online" for node in list_supernodes(cluster, conn)) < n:
        assert time.monotonic() < deadline, f"{n} SuperNodes did not come online"
        time.sleep(1.0)


def start_run(cluster, conn: str, run_config: str) -> tuple[threading.Thread, dict]:
    """``flwr run --stream`` in a thread; the result dict gets ``id``, ``status`` and ``log`` when it ends."""
    result: dict = {}
    cfg = build_run_config(run_config, APP_DIR)

    def target() -> None:
        result["id"], result["status"], result["log"] = flwr_run(cluster, conn, cfg, None, 600)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def wait_until(predicate, timeout: float, what: str, thread: threading.Thread | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert thread is None or thread.is_alive(), f"the run ended before {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """SuperLink + :data:`NODES` SuperNodes (own data files, pre-loaded SuperExec, 10 s heartbeat), online, for this
    module's tests; yields ``(cluster, connection, node data files)``."""
    root = tmp_path_factory.mktemp("deployment")
    files = []
    converted = convert(root / "full", NODES, task="digits-mlp", seed=0)
    for i, (full, n) in enumerate(zip(converted, NODE_EXAMPLES, strict=True)):
        with np.load(full) as z:
            assert len(z["y"]) > n
            files.append(root / f"node{i}.npz")
            np.savez(files[-1], x=z["x"][:n], y=z["y"][:n])
    with deploy_cluster(NODES, root / "flwr", node_data=files, task_poll_interval=0.5, preloaded=True,
                        heartbeat_interval=10, idle_poll=0.5) as (cluster, conn):
        wait_online(cluster, conn, NODES)
        yield cluster, conn, files


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def _serverapp_pids(cluster) -> list[int]:
    link = dict(cluster.procs)["superlink"]
    return [pid for pid in process_tree([link.pid])
            if any(part.endswith(b"flwr-serverapp") for part in _cmdline(pid).split(b" ")[:2])]


#: The reference run: SCAFFOLD (client state kept on the nodes' disks), 3 rounds, a checkpoint after each (the
#: kill after checkpoint 1 leaves round 3 to resume even when the test sees the checkpoint late).
SCAFFOLD = {"method": "scaffold", "num-server-rounds": 3, "local-steps": 2, "checkpoint-every": 1,
            "min-available-nodes": NODES, "min-train-nodes": NODES, "learning-curve": False}


@pytest.fixture(scope="module")
def reference(deployment, tmp_path_factory) -> tuple[Path, str]:
    """One uninterrupted :data:`SCAFFOLD` run on the cluster: what the resumed run must equal bit for bit, and what
    the in-process engine on the same node files must equal (one run checks both); ``(output dir, streamed log)``."""
    cluster, conn, _ = deployment
    out = tmp_path_factory.mktemp("reference")
    cfg = build_run_config(format_run_config({**SCAFFOLD, "output-dir": str(out), "run-name": "ref"}), APP_DIR)
    run_id, status, log = flwr_run(cluster, conn, cfg, None, 600)
    assert status == "finished:completed", (run_id, status, log[-3000:])
    return out / "ref", log


def test_preloaded_deployment_where_each_supernode_trains_on_its_own_file_matches_the_engine(deployment, reference,
                                                                                              tmp_path):
    """The reference run (first on the fresh cluster) checks:

    * the node-local files reach the ClientApp: the ServerApp's aggregate (streamed by ``flwr run``) counts 1,420
      examples, which only these files give;
    * the pre-loaded SuperExec ran every message each SuperNode received in its own forked process, which exited 0;
    * the global model and every round's losses equal the in-process engine's on the same files (float32 math in
      both; 1e-6 absolute allows a different summation order)."""
    cluster, conn, files = deployment
    ref_dir, log = reference
    got = rows(ref_dir / "metrics.jsonl")
    assert [r["round"] for r in got] == [0, 1, 2, 3]
    assert all(r["replies-used"] == NODES and r["replies-rejected"] == 0 and r["updated"] for r in got[1:])
    assert got[-1]["test-loss"] < got[0]["test-loss"]
    assert f"'num-examples': {float(sum(NODE_EXAMPLES))}" in log
    for i in range(NODES):
        exec_log = (cluster.log_dir / f"superexec{i}.log").read_text()
        assert "pre-loaded SuperExec" in exec_log and "torch" in exec_log
        received = (cluster.log_dir / f"supernode{i}.log").read_text().count("Receiving: ")
        done = re.findall(r"task \d+: ClientApp process (\d+) exited (\d+)", exec_log)
        assert received >= 2 and len(done) == received, exec_log
        assert len({pid for pid, _ in done}) == received and {code for _, code in done} == {"0"}, exec_log

    cfg = {**SCAFFOLD, "output-dir": str(tmp_path)}
    grid = LoopbackGrid(client_app, NODES, cfg)
    # what --node-config "data-path='…'" gives each SuperNode
    for ctx, f in zip(grid.contexts.values(), files, strict=True):
        ctx.node_config["data-path"] = str(f)
    run(grid, {**cfg, "run-name": "engine"})
    ref = rows(tmp_path / "engine" / "metrics.jsonl")
    for a, b in zip(got, ref, strict=True):
        assert a["test-loss"] == pytest.approx(b["test-loss"], rel=0, abs=1e-6)
        assert (a.get("train-loss") is None) == (b.get("train-loss") is None)
        if b.get("train-loss") is not None:
            assert a["train-loss"] == pytest.approx(b["train-loss"], rel=0, abs=1e-6)
    model, ref_model = torch.load(ref_dir / "model.pt"), torch.load(tmp_path / "engine" / "model.pt")
    assert model.keys() == ref_model.keys()
    for k in ref_model:
        torch.testing.assert_close(model[k], ref_model[k], rtol=0, atol=1e-6)


def test_killed_serverapp_resumed_against_the_same_nodes_is_bit_identical(deployment, reference, tmp_path):
    """The ServerApp of a :data:`SCAFFOLD` run is killed as soon as checkpoint 1 exists (round 2 takes seconds: a
    node poll, a ClientApp process, the evaluation); the resumed run starts right after the kill, while the nodes may
    still run the killed run's in-flight messages (what they write late is never used); the killed run is then
    stopped with ``flwr stop`` instead of waiting for its ServerApp's heartbeat to expire.  Client state is keyed by
    each run's token, so the resumed run continues the killed run's, never the reference's."""
    cluster, conn, _ = deployment
    ref_dir, _ = reference
    out = tmp_path / "out"
    base = format_run_config({**SCAFFOLD, "output-dir": str(out), "run-name": "ck"})
    started = sum(name == "flwr-run" for name, _ in cluster.procs)  # `flwr run`s before this test's first
    killed_log = cluster.log_dir / ("flwr-run.log" if started == 0 else f"flwr-run-{started + 1}.log")
    before = set(_serverapp_pids(cluster))
    killed_thread, killed = start_run(cluster, conn, base)
    wait_until(lambda: set(_serverapp_pids(cluster)) - before, 120, "the ServerApp of the run to kill", killed_thread)
    pids = sorted(set(_serverapp_pids(cluster)) - before)
    assert len(pids) == 1, pids

    path = out / "ck" / "checkpoint.npz"
    wait_until(lambda: path.exists() and ckpt.load(path)["round"] >= 1, 400, "checkpoint 1", killed_thread)
    os.kill(pids[0], signal.SIGKILL)
    wait_until(lambda: not _alive(pids[0]), 30, "the killed ServerApp to exit")
    killed_at = ckpt.load(path)["round"]
    assert killed_at in (1, 2), f"the ServerApp finished round {killed_at} of 3 before the kill reached it"

    resumed_thread, resumed = start_run(cluster, conn, base + f" resume='{path}'")
    # The SuperLink marks the killed run failed only when the dead ServerApp's heartbeat expires (about a minute);
    # stop it now, as an operator would, so that its `flwr run --stream` ends (status `finished:stopped`).
    first = killed_log.read_text(errors="replace")
    killed_id = re.search(r"Successfully started run (\d+)", first)
    assert killed_id, first[-2000:]
    reply = flwr_json(cluster, ["stop", killed_id.group(1), conn])
    assert reply.get("success") is True, reply
    for thread in (resumed_thread, killed_thread):
        thread.join(600)
    assert resumed.get("status") == "finished:completed", resumed.get("log", "")[-3000:]
    assert killed.get("status", "").startswith("finished:") and killed["status"] != "finished:completed", killed
    summary = json.loads((out / "ck" / "summary.json").read_text())
    assert summary["resumed_after_round"] == killed_at
    assert summary["client_state_after_resume"] == {"disk": NODES}
    a, b = torch.load(ref_dir / "model.pt"), torch.load(out / "ck" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("seconds",)} for r in rs]  # noqa: E731
    assert strip(rows(ref_dir / "metrics.jsonl")) == strip(rows(out / "ck" / "metrics.jsonl"))


def test_secaggplus_in_a_real_deployment(deployment, tmp_path):
    """Two SecAgg+ runs side by side on the same 3 SuperNodes: fedcm (client half; weighting = examples) and fedadam
    (server-only), one round each."""
    cluster, conn, _ = deployment
    out = tmp_path / "out"
    runs = {"cl": "method='fedcm' weighting='examples'", "so": "method='fedadam'"}
    started = {name: start_run(cluster, conn, (
        f"{method} secure-aggregation='secaggplus' num-server-rounds=1 local-epochs=1 learning-curve=false "
        f"output-dir='{out}' run-name='{name}' min-available-nodes={NODES} min-train-nodes=2"))
        for name, method in runs.items()}
    for name, (thread, result) in started.items():
        thread.join(600)
        assert result.get("status") == "finished:completed", (name, result.get("log", "")[-3000:])
        (tmp_path / f"{name}.log").write_text(result["log"])
        check_secagg_run(tmp_path / f"{name}.log", out / name)


def test_a_lost_supernode_costs_at_most_one_round_timeout(deployment, tmp_path):
    """Kills ``supernode2`` of the shared cluster: only the SuperLink-lost test comes after it."""
    cluster, conn, _ = deployment
    out, timeout = tmp_path / "out", 30.0
    wait_online(cluster, conn, NODES)
    thread, result = start_run(cluster, conn, (
        f"method='fedavg' num-server-rounds=3 local-steps=2 round-timeout={timeout} min-available-nodes=2 "
        f"min-train-nodes=2 wait-for-nodes=60.0 learning-curve=false output-dir='{out}' run-name='lost'"))
    metrics = out / "lost" / "metrics.jsonl"
    wait_until(lambda: len(rows(metrics)) >= 2, 300, "round 1", thread)  # rows of rounds 0, 1
    victim = dict(cluster.procs)["supernode2"]
    victim.send_signal(signal.SIGKILL)
    thread.join(600)
    assert not thread.is_alive()
    assert result["status"] == "finished:completed", result["log"][-3000:]
    got = rows(metrics)
    assert [r["round"] for r in got] == [0, 1, 2, 3]
    assert [r["replies-used"] for r in got[1:]] == [3, 2, 2]
    assert [r["replies-missing"] for r in got[1:]] == [0, 1, 0]  # the next round does not sample the lost node
    assert all(r["updated"] for r in got[1:])
    assert (out / "lost" / "model.pt").exists()
    summary = json.loads((out / "lost" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_without_update"] == []
    # the lost node cost one round-timeout at most (Flower reports it unavailable <= 20 s after its last heartbeat)
    assert got[2]["seconds"] <= timeout + 10 and got[3]["seconds"] < got[2]["seconds"], [r["seconds"] for r in got]


def test_a_real_deployment_whose_superlink_dies_is_reported_and_stopped(deployment, tmp_path):
    """Last: on the 2 SuperNodes left, a long run; the SuperLink gets SIGKILL after round 1.  ``flwr run`` ends at
    once with status ``superlink-lost: …``, and stopping the cluster (what leaving ``deploy_cluster`` does) ends
    every process of the launch, the SuperLink's orphaned ServerApp and SuperExec too, within the short grace."""
    cluster, conn, _ = deployment
    out = tmp_path / "out"
    metrics = out / "r" / "metrics.jsonl"
    thread, result = start_run(cluster, conn, (
        f"method='fedavg' num-server-rounds=50 local-steps=2 learning-curve=false output-dir='{out}' run-name='r' "
        "min-available-nodes=2 min-train-nodes=2"))
    wait_until(lambda: len(rows(metrics)) >= 2, 300, "round 1", thread)
    link = dict(cluster.procs)["superlink"]
    started = [pid for pid in process_tree([link.pid]) if pid != link.pid]
    assert any(b"flwr-serverapp" in _cmdline(pid) for pid in started), [_cmdline(p) for p in started]
    killed = time.monotonic()
    link.send_signal(signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - killed < 5, "the launcher did not notice at once"
    assert result["status"].startswith(f"superlink-lost: the SuperLink (pid {link.pid}) exited with -9")
    stopping = time.monotonic()
    cluster.stop()
    assert time.monotonic() - stopping < LOST_GRACE_S + 6
    time.sleep(0.5)
    assert not [(_cmdline(pid), pid) for pid in started if _alive(pid)], "processes of the launch outlived it"
    assert our_processes(cluster.flwr_home) == []
