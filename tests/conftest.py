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

import gc
import logging
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


#: Lanes of the slow tests, by node-id prefix (first match wins): the tests of one lane run one after another on one
#: xdist worker, so a lane's module fixtures (one started cluster) are set up once and no two clusters of one kind
#: fight for the cores.  ``-n auto --dist loadgroup`` hands the lanes out first (the largest work units go first) and
#: the other tests fill every worker after them.  Both lanes spend most of their time waiting on Flower's polls,
#: heartbeats and round timeouts rather than computing, so they run side by side (every launch takes free loopback
#: ports and its own directories, so they never collide):
#:
#: * ``"deploy"``: ``tests/test_deployment.py``, five checks on ONE SuperLink + 3 SuperNodes in file order (the
#:   reference run and the resume share it; the last two tests break the cluster);
#: * ``"ray"``: the Ray tests (engine vs Ray, the shared Ray cluster of ``tests/test_ray_cluster.py``, SIGTERM
#:   mid-run), then the TLS + node-auth deployment (a cluster of its own, Flower's stock executor).
#:
#: Each lane is shorter than half the suite, so the in-process tests even the two workers out whichever lane holds
#: the TLS test (lane sums of a whole-suite run in docs/results/suite.md).
#:
#: ``None``: a slow test that starts no Flower or Ray process (in-process runs, plain child processes); it goes to any
#: worker.  Every slow test must be listed (``tests/test_suite_settings.py`` checks it in the whole-suite run).
SLOW_GROUPS: tuple[tuple[str, str | None], ...] = (
    ("tests/test_deployment.py::", "deploy"),
    ("tests/test_docs_commands.py::test_local_deployment", "deploy"),  # a SuperLink + 2 SuperNodes of its own
    ("tests/test_engine_vs_ray.py::", "ray"),
    ("tests/test_ray_cluster.py::", "ray"),  # the examples, a failing run and SecAgg+, on one shared Ray cluster
    ("tests/test_runtime.py::test_sigterm_mid_run", "ray"),
    ("tests/test_docs_commands.py::test_quick_start_ray_simulation", "ray"),  # a private Ray instance of its own
    ("tests/test_secure_deploy.py::", "ray"),  # a cluster of its own
    ("tests/test_vectorized_ray.py::", "ray"),  # a private Ray instance with 2 actors
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
    ("tests/test_robust_profile.py::", None),  # the default job, robust vs off
    ("tests/test_record_screen.py::", None),  # an in-process FedAMS run with a poisoned record
    ("tests/test_adaptive_attacks.py::", None),  # issue 48's met targets, in-process runs
    ("tests/test_replay_attack.py::", None),
    ("tests/test_privacy.py::", None),
    ("tests/test_vectorized.py::", None),  # the bench smoke: child interpreters, no Flower processes
    ("tests/test_faults.py::", None),  # tests/helpers.py::every_method: the non-representative methods of a matrix
    ("tests/test_fuzz_replies.py::", None),
    ("tests/test_legacy.py::", None),
    ("tests/test_docs_commands.py::", None),  # the docs' commands in-process, mkdocs, the reproduction commands
    ("tests/test_partitions.py::", None),  # 1,000 partitions of the digits, in-process
    ("tests/test_plugin.py::test_every_method_at_its_published_factor", None),  # the example app in-process
)


def slow_group(nodeid: str) -> str | None:
    """The lane of ``nodeid`` (None: not in a lane), as :data:`SLOW_GROUPS` lists it."""
    return next((group for prefix, group in SLOW_GROUPS if nodeid.startswith(prefix)), None)


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own: the first scheduler returned is used
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the lanes of :data:`SLOW_GROUPS` as its groups, read from the test ids.

    xdist's loadgroup takes a test's group from an ``@group`` suffix that each worker appends to the test id from the
    test's ``xdist_group`` mark; with pytest 9.2 that id change has no effect any more (pytest-xdist issue #1386),
    and a mark added by a conftest's ``pytest_collection_modifyitems`` came after it anyway.  Either way the groups
    were silently ignored: the lanes' tests were spread over both workers, each starting its own cluster.  The
    scheduler (in the controller) now maps the ids itself; everything else is xdist's loadgroup scheduling."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class LaneScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return slow_group(nodeid) or super()._split_scope(nodeid)

    return LaneScheduling(config, log)


def pytest_collection_finish(session):
    """Flower's own INFO lines stay out of the test processes unless ``--log-level`` asks for them.

    ``Strategy.start`` logs ~15 lines per round and reprints every round's metrics at the end of a run; each line
    goes through pytest's two capture handlers and Flower's console handler: ~4 % of the fast tier's CPU (py-spy),
    for text nobody reads unless a test fails.  Our own messages go through the same ``flwr`` logger: a test that
    checks an INFO line raises the level for itself (``caplog.at_level(logging.INFO, logger="flwr")``).  Warnings
    and errors are kept; processes the tests start (deployments, Ray, the launcher) log as they always do.  Set after
    collection: importing Flower sets its logger to DEBUG (only xdist workers collect; the controller never imports
    Flower)."""
    if session.config.getoption("log_level") is None:
        from flwr.common.logger import FLOWER_LOGGER

        FLOWER_LOGGER.setLevel(logging.WARNING)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Let the process end without one last walk of every object (``gc.freeze``).

    torch (with ``torch._dynamo``, which the first ``torch.optim`` optimizer imports), Flower and scikit-learn leave
    ~0.4 million objects that the collector walks again at interpreter exit, ~1 s per xdist worker on this
    project's 2-core VM, and the controller waits for its workers to end.  Frozen objects are still freed by
    reference counting; only the cycles among them are left to the process's end."""
    gc.freeze()
