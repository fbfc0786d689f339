"""A real local deployment (SuperLink + 3 SuperNodes on 127.0.0.1) that loses a SuperNode, and one whose ServerApp
is killed and resumed (slow: real Flower processes, started with ``simulations.launch.deploy_cluster``).

* A SuperNode killed with SIGKILL after round 1 costs at most one round-timeout: round 2 proceeds with the two
  replies it has (the lost node's counts as missing), round 3 does not sample it (it sends no heartbeat), and the
  run completes (``max-idle-rounds`` is not tripped).  The SuperNodes announce a 10 s heartbeat (Flower's minimum;
  ``heartbeat_interval``) instead of 30 s, so the SuperLink gives the lost node up 20 s after its last heartbeat
  instead of a minute: the same three phases, 40 s less waiting.
* The ServerApp process (``flwr-serverapp``) killed with SIGKILL after checkpoint 1 (of 3) and resumed (``resume=``,
  a new ``flwr run``) against the same, still running SuperNodes ends bit-identical to an uninterrupted run: the
  clients' SCAFFOLD control variates (Fed-LAMB moments) come from the nodes' disks, not from the new run's empty
  ``Context.state``.

Both tests share one cluster (the module fixture :func:`cluster`: starting a SuperLink and 3 SuperNodes and waiting
until they are online costs ~20 s); the lost-SuperNode test kills a node, so it comes last in this file.  The cluster
runs the pre-loaded SuperExec (``preloaded=True``: one forked ClientApp process per message, no fresh interpreter
importing torch each time); the stock executor's path is run end to end by ``tests/test_secure_deploy.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from flower_strategies.core import checkpoint as ckpt
from simulations.launch import APP_DIR, build_run_config, deploy_cluster
from simulations.launch.flwr_cli import flwr_json, flwr_run, list_supernodes
from simulations.launch.processes import process_tree

pytestmark = pytest.mark.slow
NODES = 3


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
def cluster(tmp_path_factory):
    """SuperLink + :data:`NODES` SuperNodes (pre-loaded SuperExec, 10 s heartbeat), online, for this module's tests."""
    with deploy_cluster(NODES, tmp_path_factory.mktemp("flwr"), task_poll_interval=0.1, preloaded=True,
                        heartbeat_interval=10) as (cluster, conn):
        wait_online(cluster, conn, NODES)
        yield cluster, conn


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _serverapp_pids(cluster) -> list[int]:
    link = dict(cluster.procs)["superlink"]
    pids = []
    for pid in process_tree([link.pid]):
        try:
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"flwr-serverapp") for part in cmd[:2]):
            pids.append(pid)
    return pids


#: SCAFFOLD in CI; ``FEDADAPT_SLOW_ALL=1`` adds Fed-LAMB (same machinery, as long again).
RESUME_METHODS = ["scaffold"] + (["fedlamb"] if os.environ.get("FEDADAPT_SLOW_ALL") else [])


@pytest.mark.parametrize("method", RESUME_METHODS)
def test_killed_serverapp_resumed_against_the_same_nodes_is_bit_identical(cluster, tmp_path, method):
    """The run to kill starts first; once its ServerApp is up, the uninterrupted reference starts on the same nodes
    (client state is keyed by each run's token, so the two never share it).  The resumed run starts right after the
    kill, while the nodes may still run the killed run's in-flight messages (what they write late is never used);
    the killed run is then stopped with ``flwr stop`` instead of waiting for its ServerApp's heartbeat to expire."""
    out = tmp_path / "out"
    base = (f"method='{method}' num-server-rounds=3 local-steps=2 checkpoint-every=1 min-available-nodes={NODES} "
            f"min-train-nodes={NODES} output-dir='{out}'")
    cluster, conn = cluster
    started = sum(name == "flwr-run" for name, _ in cluster.procs)  # `flwr run`s before this test's first
    killed_log = cluster.log_dir / ("flwr-run.log" if started == 0 else f"flwr-run-{started + 1}.log")
    killed_thread, killed = start_run(cluster, conn, base + " run-name='ck'")
    wait_until(lambda: _serverapp_pids(cluster), 120, "the ServerApp of the run to kill", killed_thread)
    pids = _serverapp_pids(cluster)
    assert len(pids) == 1, pids
    ref_thread, ref = start_run(cluster, conn, base + " run-name='ref'")

    path = out / "ck" / "checkpoint.npz"
    wait_until(lambda: path.exists() and ckpt.load(path)["round"] >= 1, 400, "checkpoint 1", killed_thread)
    os.kill(pids[0], signal.SIGKILL)
    wait_until(lambda: not _alive(pids[0]), 30, "the killed ServerApp to exit")
    # killed mid-run: checkpoint 1, or 2 if round 2 ended while the kill was on its way (rounds are short here)
    killed_at = ckpt.load(path)["round"]
    assert killed_at in (1, 2), killed_at

    resumed_thread, resumed = start_run(cluster, conn, base + f" run-name='ck' resume='{path}'")
    # The SuperLink marks the killed run failed only when the dead ServerApp's heartbeat expires (about a minute);
    # stop it now, as an operator would, so that its `flwr run --stream` ends (status `finished:stopped`).
    first = killed_log.read_text(errors="replace")
    killed_id = re.search(r"Successfully started run (\d+)", first)
    assert killed_id, first[-2000:]
    reply = flwr_json(cluster, ["stop", killed_id.group(1), conn])
    assert reply.get("success") is True, reply
    for thread in (resumed_thread, ref_thread, killed_thread):
        thread.join(600)
    assert ref.get("status") == "finished:completed", ref.get("log", "")[-3000:]
    assert resumed.get("status") == "finished:completed", resumed.get("log", "")[-3000:]
    assert killed.get("status", "").startswith("finished:") and killed["status"] != "finished:completed", killed
    summary = json.loads((out / "ck" / "summary.json").read_text())
    assert summary["resumed_after_round"] == killed_at
    assert summary["client_state_after_resume"] == {"disk": NODES}
    a, b = torch.load(out / "ref" / "model.pt"), torch.load(out / "ck" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("seconds",)} for r in rs]  # noqa: E731
    assert strip(rows(out / "ref" / "metrics.jsonl")) == strip(rows(out / "ck" / "metrics.jsonl"))


def test_a_lost_supernode_costs_at_most_one_round_timeout(cluster, tmp_path):
    """Last in this file: it kills ``supernode2`` of the shared cluster."""
    cluster, conn = cluster
    out, timeout = tmp_path / "out", 30.0
    wait_online(cluster, conn, NODES)
    thread, result = start_run(cluster, conn, (
        f"method='fedavg' num-server-rounds=3 local-steps=2 round-timeout={timeout} min-available-nodes=2 "
        f"min-train-nodes=2 wait-for-nodes=60.0 output-dir='{out}' run-name='lost'"))
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
