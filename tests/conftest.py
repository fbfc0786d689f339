"""Suite-wide settings: one intra-op thread, in this process and in every process the tests start.

The models here are tiny (an MLP on 8x8 digits, a linear model): torch's intra-op threads only contend for the CPUs
with each other and with the other processes of a run (two ClientApps, the ServerApp, the SuperLink).  On 2 busy cores
a 10-node, 3-round in-process run took 173-210 s with 2 threads and 7-8 s with one.  ``tests/test_fedlamb.py`` used to
set this for the whole session as a side effect of being imported; it is set here explicitly, before any test module
is imported.  ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` are inherited by the Flower processes the end-to-end tests start
(SuperLink, SuperNodes, ``flwr-clientapp``/``flwr-serverapp``, the pre-loaded SuperExec; Ray already gives its actors
one thread per CPU they reserve), so a deployment's ClientApps run with the same thread count as the in-process
engine they are compared with.  A value already set in the environment is kept (``MKL_NUM_THREADS`` follows
``OMP_NUM_THREADS`` unless set).  torch sizes its intra-op pool from them when it is first imported, which is after
this file (``tests/test_suite_settings.py`` checks it), so this file does not import torch: the xdist controller,
which runs no test, starts its workers ~2 s sooner.

Bytecode caches are written even where ``PYTHONDONTWRITEBYTECODE`` is set (some container images set it): without them
every pytest process (each xdist worker) re-parses, assertion-rewrites and compiles the ~70 test modules and every
project module it imports, about 5 CPU-s per process on this project's 2-core VM.  The caches go to the gitignored
``__pycache__`` folders; the processes the tests start keep the environment's setting.
"""

from __future__ import annotations

import os
import sys

sys.dont_write_bytecode = False
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])  # torch takes the smaller of the two

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_learning_curve(request, monkeypatch):
    """In-process runs skip the learning-curve png unless the test is marked ``learning_curve``.

    Drawing and saving the png costs 0.3-0.7 CPU-s per run (plus matplotlib's import), more than a whole short
    federated run on the synthetic tasks, and the suite makes hundreds of such runs; skipping it is what
    ``learning-curve = false`` does, which changes nothing else bit for bit (``test_app.py``'s lean-settings test,
    marked, checks that).  Processes the tests start (deployments, Ray, the launcher) still draw it."""
    if request.node.get_closest_marker("learning_curve") is None:
        from server_app import plots

        monkeypatch.setattr(plots, "write_learning_curve", lambda *args, **kwargs: None)


#: xdist group of the slow tests that start a Flower deployment or Ray, by node-id prefix (first match wins).  The
#: tests of one group run one after another on one worker; the two groups run side by side (every launch takes
#: free loopback ports and its own directories, so they never collide), and each spends much of its time waiting on
#: Flower's fixed 3 s polls and 30 s heartbeats, which the other group and the in-process tests fill.  A slow test
#: listed under ``None`` starts no Flower or Ray process (in-process runs, plain child processes) and goes to any
#: worker.  A slow test not listed joins ``"deploy"``: a new end-to-end test is serialised unless placed here.
SLOW_GROUPS: tuple[tuple[str, str | None], ...] = (
    ("tests/test_engine_vs_ray.py::", "ray"),
    ("tests/test_ray_cluster.py::", "ray"),  # the examples, a failing run and SecAgg+, on one shared Ray cluster
    ("tests/test_runtime.py::test_sigterm_mid_run", "ray"),
    ("tests/test_runtime.py::test_stop_signals_stop_every_started_process_group", None),
    ("tests/test_perf.py::", None),  # the bench smoke tests: child interpreters, no Ray (no --ray) or Flower
    ("tests/test_node_data.py::test_converter_command_line", None),
    ("tests/test_checkpoint.py::", None),
    ("tests/test_app.py::", None),
    ("tests/test_attacks.py::", None),
    ("tests/test_docs_facts.py::", None),
    ("tests/test_hub_data.py::", None),
    ("tests/test_presets.py::", None),
    ("tests/test_reproduce.py::", None),
    ("tests/test_shakespeare.py::", None),
    ("tests/test_robustness_matrix.py::", None),  # in-process runs
    ("tests/test_replay_attack.py::", None),
    ("tests/test_privacy.py::", None),
    ("tests/test_vectorized.py::", None),  # the bench smoke: child interpreters, no Flower processes
    ("tests/test_faults.py::", None),  # tests/helpers.py::every_method: the non-representative methods of a matrix
    ("tests/test_fuzz_replies.py::", None),
    ("tests/test_legacy.py::", None),
)


def slow_group(nodeid: str) -> str | None:
    return next((group for prefix, group in SLOW_GROUPS if nodeid.startswith(prefix)), "deploy")


def pytest_collection_modifyitems(config, items):
    """Tests that start real Flower/Ray processes (``slow``: Ray, SuperLink/SuperNodes, launcher signals) get an xdist
    group (:data:`SLOW_GROUPS`), so that with ``-n`` no two deployments of one kind compete for the cores while the
    in-process tests fill the other workers."""
    for item in items:
        if item.get_closest_marker("slow") is not None and (group := slow_group(item.nodeid)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
