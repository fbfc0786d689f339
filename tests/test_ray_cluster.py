"""Simulation on an existing Ray cluster (``python -m simulations.launch sim --ray-address HOST:PORT``), for real.

A two-node Ray cluster is started on 127.0.0.1 with ``ray start`` (head + one worker, 1 CPU each, own ``--temp-dir``,
small object store), a 3-SuperNode, 2-round simulation is attached to it, and Ray's GCS is asked which actors ran
where.  The cluster is stopped by process group, NOT with ``ray stop``: ``ray stop`` kills every Ray process of the
machine, including other users' simulations.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from simulations.launch import Cluster, launch_sim
from simulations.launch.processes import bin_path, free_port, process_tree

pytestmark = pytest.mark.slow

#: Run as a separate Ray driver: the cluster's alive nodes and every actor it has seen (alive or dead), from the GCS.
PROBE = r"""
import json, sys, time
import ray
from ray._private.state import actors
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
want, deadline = int(sys.argv[2]), time.monotonic() + 60
while True:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) >= want or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({
    "nodes": {n["NodeID"]: n["Resources"].get("CPU", 0) for n in nodes},
    "actors": [{"class": a["ActorClassName"], "node": a["Address"]["NodeID"], "state": a["State"]}
               for a in actors().values()],
}))
"""


def probe(address: str, nodes: int, cluster: Cluster) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, address, str(nodes)], capture_output=True, text=True,
                         env=cluster.env, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def ray_start(cluster: Cluster, name: str, temp_dir: Path, *args: str) -> subprocess.Popen:
    """``ray start --block`` (stays in the foreground, so stopping its process group stops the node)."""
    ports = [str(free_port()) for _ in range(4)]  # agents' ports: the defaults would collide between the two nodes
    return cluster.start(name, [
        bin_path("ray"), "start", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0", f"--object-store-memory={80 * 2**20}",
        f"--temp-dir={temp_dir}", "--dashboard-agent-listen-port", ports[0], "--dashboard-agent-grpc-port", ports[1],
        "--runtime-env-agent-port", ports[2], "--metrics-export-port", ports[3],
        "--min-worker-port=0", "--max-worker-port=0", *args,  # workers bind OS-chosen ports (as ray.cluster_utils)
    ])


@pytest.fixture
def ray_temp_dir():
    # short path: Ray's unix sockets live under --temp-dir and must stay below 108 characters
    path = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_simulation_attaches_to_an_existing_two_node_ray_cluster(tmp_path, ray_temp_dir, capsys):
    temp_dir = ray_temp_dir
    out = tmp_path / "out"
    t0 = time.monotonic()
    with Cluster(tmp_path / "ray", tmp_path / "ray" / "logs", grace_s=15) as ray_cluster:
        port = free_port()
        address = f"127.0.0.1:{port}"
        head = ray_start(ray_cluster, "ray-head", temp_dir, "--head", f"--port={port}", "--include-dashboard=false",
                         f"--ray-client-server-port={free_port()}")
        probe(address, 1, ray_cluster)  # the head is up before the worker joins
        worker = ray_start(ray_cluster, "ray-worker", temp_dir, f"--address={address}")
        before = probe(address, 2, ray_cluster)
        assert worker.poll() is None, (ray_cluster.log_dir / "ray-worker.log").read_text()[-3000:]
        assert len(before["nodes"]) == 2 and sorted(before["nodes"].values()) == [1.0, 1.0], before
        assert not [a for a in before["actors"] if a["class"] == "ClientAppActor"]

        rc = launch_sim(3, f"num-server-rounds=2 local-steps=3 output-dir='{out}' run-name='raycluster'",
                        tmp_path / "flwr", timeout=300, ray_address=address, client_cpus=1)
        after = probe(address, 2, ray_cluster)
        ray_pids = process_tree([head.pid, worker.pid])
    left = [pid for pid in ray_pids if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]
    elapsed = time.monotonic() - t0

    assert rc == 0
    assert f"simulation attaches to the Ray cluster at {address}" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "raycluster" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2] and all(r["replies-used"] == 3 for r in rows[1:])
    # the run's ClientApp actors were created on the existing cluster (a private Ray instance would not show them
    # here), one per CPU: on both nodes, the worker's included
    actors = [a for a in after["actors"] if a["class"] == "ClientAppActor"]
    assert len(actors) == 2, after
    assert {a["node"] for a in actors} == set(before["nodes"]), after
    # every Ray process of the two nodes is gone (head, worker, raylets, GCS, agents, ClientApp actors)
    assert len(ray_pids) > 4 and left == [], [_cmdline(p) for p in left]
    assert not _processes_mentioning(temp_dir)
    assert elapsed < 240, elapsed


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(exited)"


def _processes_mentioning(text: Path) -> list[str]:
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        cmd = _cmdline(int(d.name))
        if str(text) in cmd and _state(int(d.name)) != "Z":
            found.append(cmd)
    return found
