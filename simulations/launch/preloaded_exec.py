"""A pre-loaded SuperExec for SuperNodes started with ``--isolation process``: forks one ClientApp process per task.

    flower-supernode --isolation process --port 9094 ...            # the SuperNode starts no executor
    python -m simulations.launch.preloaded_exec --runtime-api-address 127.0.0.1:9094 --insecure \\
        [--parent-pid <supernode pid>]                               # same arguments as flower-superexec

Flower 1.42's SuperNode runs every message in a new ``flwr-clientapp`` process started by ``flower-superexec``
(``SubprocessExecutor.launch`` → ``Popen(["flwr-clientapp", ...])``), which re-imports flwr, torch and the data
libraries — seconds per message.  With ``--isolation process`` the SuperNode leaves that job to an external process
that polls its Runtime API (the supported hook).  This module is that process: Flower's own SuperExec loop
(``flwr.supercore.cli.flower_superexec``: arguments, task polling, signal handling) with one change — its executor
*forks* a child per ClientApp task from a process that has already imported the heavy third-party modules, and the
child runs Flower's own ``flwr.supernode.runtime.run_clientapp.run_clientapp`` (pull the task, install the FAB,
load the ClientApp *from the FAB*, run it, push the reply, exit).  Each message still gets its own process (same
isolation, same crash containment, fresh ``Context`` from the SuperNode); only the imports are shared.

Only third-party modules are pre-imported, never the app's own packages (``client_app``, ``flower_strategies``):
Flower's ``load_app`` reuses a module already in ``sys.modules``, so pre-importing them would run the executor's copy
instead of the code shipped in the run's FAB.  Tasks that are not ClientApp tasks, and runs with runtime dependency
installation (their child needs another environment), go to Flower's ``SubprocessExecutor`` unchanged.

Relies on flwr 1.42 internals (``run_superexec.get_executor``, the ``Executor`` protocol, ``run_clientapp``); the
end-to-end test ``test_preloaded_deployment_where_each_supernode_trains_on_its_own_file_matches_the_engine``
(``tests/test_deployment.py``) runs it against real SuperNodes.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from typing import Any

#: Third-party modules the ClientApp processes import; loaded once, before any fork.
#: ``torch._dynamo`` is imported lazily by the first ``torch.optim.Optimizer(...)`` (``torch._compile._disable_dynamo``)
#: and costs more than ``import torch`` itself.
PRELOAD = (
    "numpy", "torch", "torch._dynamo", "torch.optim", "sklearn.datasets", "sklearn.model_selection", "datasets",
    "flwr_datasets.partitioner", "flwr.supernode.runtime.run_clientapp", "flwr.clientapp", "flwr.app",
)


def preload(modules: tuple[str, ...] = PRELOAD) -> list[str]:
    """Import ``modules`` (missing optional ones are skipped); returns those imported."""
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
            done.append(name)
        except ImportError:
            pass
    return done


class ForkExecutor:
    """Flower ``Executor`` (``flwr.supercore.superexec.executor.types.Executor``) that forks ClientApp tasks."""

    def __init__(self) -> None:
        from flwr.supercore.superexec.executor import SubprocessExecutor

        self.fallback = SubprocessExecutor()
        self.children: set[int] = set()

    def get_eligible_capacity(self, supported_task_types: set, **kw: Any) -> tuple[set, set[str]]:
        return self.fallback.get_eligible_capacity(supported_task_types, **kw)

    def wait_for_capacity(self, task_type: Any = None, **kw: Any) -> None:
        self.fallback.wait_for_capacity(task_type, **kw)

    def launch(self, spec: Any) -> Any:
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP or spec.runtime_dependency_install:
            return self.fallback.launch(spec)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child: becomes exactly what `flwr-clientapp` would have been, minus the imports
            t0 = time.monotonic()
            code = _run_child(spec)
            print(f"[fedadapt] task {spec.task_id}: ClientApp process {os.getpid()} exited {code} after "
                  f"{time.monotonic() - t0:.2f} s", flush=True)
            os._exit(code)
        self.children.add(pid)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Reap finished children (called by the SuperExec loop before every poll)."""
        for pid in list(self.children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.children.discard(pid)

    def close(self) -> None:
        self.fallback.close()


def _run_child(spec: Any) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    code = 1
    try:
        from flwr.supernode.runtime.run_clientapp import run_clientapp

        certificates = None
        if not spec.insecure and spec.root_certificates_path:
            with open(spec.root_certificates_path, "rb") as fh:
                certificates = fh.read()
        run_clientapp(runtime_api_address=spec.runtime_api_address, token=spec.token, insecure=spec.insecure,
                      certificates=certificates, parent_pid=spec.parent_pid, runtime_dependency_install=False)
        code = 0
    except SystemExit as exc:  # run_clientapp ends with flwr_exit → sys.exit
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - never return into the parent's loop
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def main(argv: list[str] | None = None) -> None:
    """``flower-superexec`` with :class:`ForkExecutor`; same command-line arguments."""
    loaded = preload()
    import flwr.supercore.superexec.run_superexec as superexec
    from flwr.supercore.cli.flower_superexec import flower_superexec

    superexec.get_executor = lambda *a, **k: ForkExecutor()  # the one substitution; see the module docstring
    print(f"[fedadapt] pre-loaded SuperExec (pid {os.getpid()}): imported {', '.join(loaded)}", flush=True)
    sys.argv = ["flower-superexec", *(sys.argv[1:] if argv is None else argv)]
    flower_superexec()


if __name__ == "__main__":
    main()
