"""Simulations on one Ray cluster started for this module (``python -m simulations.launch sim --ray-address ADDR``),
for real: the example apps, a failing run, and SecAgg+ on two Ray nodes.

Each run is a ``launch_sim`` of its own (private SuperLink, ``flwr run``, status from ``flwr ls``, nothing of the
launch left running); only Ray is shared, so no run pays Ray's start-up or a second ClientApp actor: the head has 1 CPU,
so each run gets exactly one actor, which serves all of its SuperNodes.  The last test adds a worker node (1 CPU) and
checks, through Ray's GCS, that that run's two actors ran one on each node.  ``flwr run`` starting a private Ray
instance (the default path) is covered by ``tests/test_engine_vs_ray.py`` and the SIGTERM test of
``tests/test_runtime.py``.

The nodes are started with ``ray start --block`` (own ``--temp-dir``, private agent ports, small object store) and
stopped by process group, NOT with ``ray stop``: ``ray stop`` kills every Ray process of the machine, including other
users' simulations.  The module's teardown asserts that no process of the cluster is left.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from simulations.launch import Cluster, launch_sim
from simulations.launch.processes import bin_path, free_port, process_tree
from tests.helpers import our_processes
from tests.helpers import check_secagg_run

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent

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
    "actors": [{"id": actor_id, "class": a["ActorClassName"], "node": a["Address"]["NodeID"], "state": a["State"]}
               for actor_id, a in actors().items()],
}))
"""


class RayCluster:
    """Ray nodes started with ``ray start --block`` in one :class:`Cluster` (stopping its groups stops the nodes)."""

    def __init__(self, home: Path, temp_dir: Path) -> None:
        self.temp_dir = temp_dir
        self.procs = Cluster(home, home / "logs", grace_s=15)
        self.address = f"127.0.0.1:{free_port()}"
        self.nodes: list[subprocess.Popen] = []

    def start_node(self, name: str, *args: str) -> subprocess.Popen:
        """A node with 1 CPU; returns once its raylet is up (``ray start`` prints "Ray runtime started.")."""
        ports = [str(free_port()) for _ in range(4)]  # agents' ports: the defaults would collide between the nodes
        node = self.procs.start(name, [
            bin_path("ray"), "start", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0", f"--object-store-memory={80 * 2**20}",
            f"--temp-dir={self.temp_dir}", "--dashboard-agent-listen-port", ports[0], "--dashboard-agent-grpc-port",
            ports[1], "--runtime-env-agent-port", ports[2], "--metrics-export-port", ports[3],
            "--min-worker-port=0", "--max-worker-port=0", *args,  # workers bind OS-chosen ports (as ray.cluster_utils)
        ])
        log, deadline = self.procs.log_dir / f"{name}.log", time.monotonic() + 120
        while "Ray runtime started." not in log.read_text(errors="replace"):
            assert node.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        self.nodes.append(node)
        return node

    def probe(self, nodes: int) -> dict:
        out = subprocess.run([sys.executable, "-c", PROBE, self.address, str(nodes)], capture_output=True, text=True,
                             env=self.procs.env, timeout=150)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Iterator[RayCluster]:
    """A one-node Ray cluster (the head, 1 CPU) for the module; afterwards no process of it (or of a node a test
    added) is left, and none mentions its temp dir."""
    # short path: Ray's unix sockets live under --temp-dir and must stay below 108 characters
    temp_dir = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
    cluster = RayCluster(tmp_path_factory.mktemp("ray"), temp_dir)
    try:
        with cluster.procs:
            cluster.start_node("ray-head", "--head", f"--port={cluster.address.rsplit(':', 1)[1]}",
                               "--include-dashboard=false", f"--ray-client-server-port={free_port()}")
            yield cluster
            ray_pids = process_tree([node.pid for node in cluster.nodes])
        left = [pid for pid in ray_pids if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]
        assert len(ray_pids) > 4 and left == [], [_cmdline(p) for p in left]
        assert not _processes_mentioning(temp_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_pytorch_example_runs_a_client_half_method_in_simulation(ray_cluster, tmp_path):
    out = tmp_path / "model.pt"
    rc = launch_sim(3, f"num-server-rounds=1 method='scaffold' output='{out}'", tmp_path / "flwr", timeout=600,
                    app_dir=ROOT / "examples" / "pytorch_app", ray_address=ray_cluster.address)
    assert rc == 0
    assert set(torch.load(out)) >= {"conv1.weight", "fc3.bias"}


def test_legacy_example_runs_in_simulation(ray_cluster, tmp_path):
    out = tmp_path / "out.json"
    rc = launch_sim(3, f"num-server-rounds=1 method='fedadam' output='{out}'", tmp_path / "flwr", timeout=600,
                    app_dir=ROOT / "examples" / "legacy_app", ray_address=ray_cluster.address)
    assert rc == 0
    assert json.loads(out.read_text())["method"] == "fedadam"


def test_ray_simulation_failure_is_reported(ray_cluster, tmp_path):
    rc = launch_sim(2, "method='fedadam' fedadam.beta1=3.0 num-server-rounds=1", tmp_path / "flwr", timeout=300,
                    ray_address=ray_cluster.address)
    assert rc == 1
    log = (tmp_path / "flwr" / "logs" / "flwr-run.log").read_text()
    assert "fedadam.beta1 = 3.0 is out of range" in log
    assert our_processes(tmp_path / "flwr") == []


def test_secaggplus_simulation_on_an_existing_two_node_ray_cluster(ray_cluster, tmp_path, capsys):
    """fedadam (server-only) under SecAgg+ (3 SuperNodes, 1 round, digits-mlp) on the head plus a worker node: the
    run's ClientApp actors were created on the existing cluster (a private Ray instance would not show them in its
    GCS), one per CPU, on both nodes."""
    if len(ray_cluster.nodes) == 1:
        worker = ray_cluster.start_node("ray-worker", f"--address={ray_cluster.address}")
        assert worker.poll() is None
    before = ray_cluster.probe(2)
    assert len(before["nodes"]) == 2 and sorted(before["nodes"].values()) == [1.0, 1.0], before
    out = tmp_path / "out"
    cfg = (f"method='fedadam' secure-aggregation='secaggplus' num-server-rounds=1 local-epochs=1 "
           f"learning-curve=false output-dir='{out}' run-name='sa'")
    rc = launch_sim(3, cfg, tmp_path / "flwr", timeout=300, ray_address=ray_cluster.address, client_cpus=1)
    after = ray_cluster.probe(2)

    assert rc == 0
    assert f"simulation attaches to the Ray cluster at {ray_cluster.address}" in capsys.readouterr().out
    check_secagg_run(tmp_path / "flwr" / "logs" / "flwr-run.log", out / "sa")
    seen = {a["id"] for a in before["actors"]}
    actors = [a for a in after["actors"] if a["class"] == "ClientAppActor" and a["id"] not in seen]
    assert len(actors) == 2, after
    assert {a["node"] for a in actors} == set(before["nodes"]), after


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
