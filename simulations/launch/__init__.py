"""Run the fedadapt Flower app for real and report whether the run *succeeded*.

    python -m simulations.launch sim    [--num-supernodes 10] [--run-config "method='fedadam' num-server-rounds=5"]
                                        [--ray-address HEAD:PORT] [--client-cpus 1] [--client-gpus 0.0]
                                        [--ray-cpus N]
    python -m simulations.launch deploy [--nodes 2]           [--run-config "..."] [--preloaded]
                                        [--task-poll-interval S]
    python -m simulations.launch secure [--nodes 2]           [--run-config "..."]

``sim``    starts a private ``flower-superlink --simulation`` (Ray backend) on free loopback ports, then
           ``flwr run . <connection> --stream --federation-config "num-supernodes=N client-resources-num-cpus=1"``;
           with ``--ray-address`` the simulation runs on that existing Ray cluster (``RAY_ADDRESS`` for the SuperLink;
           docs/deployment.md §7).
``deploy`` starts a ``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1, each SuperNode with
           ``--node-config "partition-id=i num-partitions=N"`` (plus ``data-path='…'`` with ``--node-data``: each
           node then trains on its own file), then ``flwr run . <connection> --stream``.  ``--preloaded``: SuperNodes
           with ``--isolation process``, each served by :mod:`.preloaded_exec` (forks one ClientApp process per message
           from a process that imported torch & co. once; docs/deployment.md §5).
``secure`` is ``deploy`` over TLS with SuperNode authentication: it generates a throw-away CA, a server certificate
           for 127.0.0.1 and one ECDSA key per SuperNode (under ``<FLWR_HOME>/pki``), registers the N nodes' public
           keys with ``flwr supernode register``, also starts one SuperNode whose key is NOT registered, tries a
           plaintext (``insecure = true``) client, then runs the app on the registered nodes and prints what it saw
           (``tests/test_secure_deploy.py`` asserts the refusals).

All wait for the run to end, read its status with ``flwr ls --run-id … --format json`` (``flwr run`` exits 0 even
when the ServerApp failed), stop every process they started (by process group; also on SIGINT, SIGTERM and SIGHUP,
then exit 128 + signal) and exit non-zero unless the status is ``finished:completed``.  The run-config is checked
against the app's ``[tool.flwr.app.config]`` before anything starts (unknown keys are named, exit 2);
``deploy``/``secure`` add ``min-available-nodes``/``min-train-nodes`` only when the run-config does not set them.
Runtime dependency installation is disabled (otherwise every run downloads GBs with uv), telemetry is off, and
``FLWR_HOME`` defaults to ``<app>/.flwr`` so nothing is written to ``~/.flwr``.

Modules: :mod:`.processes` (process groups, signals, health polling), :mod:`.flwr_cli` (connections, run-config
strings, ``flwr`` commands), :mod:`.pki` (openssl / ssh-keygen), :mod:`.modes` (sim / deploy / secure),
:mod:`.preloaded_exec` (the pre-loaded SuperExec),
``__main__`` (the CLI).
"""

from .flwr_cli import RunConfigError, build_run_config
from .modes import (SecureDeployResult, deploy_cluster, launch_deploy, launch_secure_deploy, launch_sim, node_config,
                    node_data_paths, start_supernode)
from .processes import APP_DIR, Cluster, Stopped

__all__ = [
    "APP_DIR", "Cluster", "RunConfigError", "SecureDeployResult", "Stopped", "build_run_config", "launch_deploy",
    "launch_secure_deploy", "launch_sim", "node_config", "node_data_paths", "deploy_cluster", "start_supernode",
]
