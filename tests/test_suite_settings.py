"""The suite-wide settings of ``tests/conftest.py`` reach the test processes."""

from __future__ import annotations

import os
import sys

import torch


def test_one_intra_op_thread_from_the_environment():
    """conftest sets ``OMP_NUM_THREADS`` (default 1) without importing torch; torch reads it at its first import."""
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_bytecode_caches_are_written():
    assert sys.dont_write_bytecode is False


def test_the_lanes_of_slow_groups_are_the_xdist_scheduler_groups(request, monkeypatch):
    """With ``--dist loadgroup`` the scheduler is conftest's (``tryfirst``: xdist's own would ignore the lanes, see
    ``pytest_xdist_make_scheduler``), and its work units are the lanes: every test of ``tests/test_deployment.py``
    in ``deploy``, the Ray tests and the TLS deployment in ``ray``; any other test is a unit of its own (xdist's
    ``@group`` ids still group as xdist says)."""
    from xdist.remote import Producer
    from xdist.scheduler import LoadGroupScheduling

    impl = [i for i in request.config.pluginmanager.hook.pytest_xdist_make_scheduler.get_hookimpls()
            if str(getattr(i.plugin, "__file__", "")).endswith("conftest.py")]
    assert len(impl) == 1 and impl[0].tryfirst
    monkeypatch.setattr(request.config.option, "dist", "loadgroup")
    monkeypatch.setattr(request.config.option, "tx", ["popen"] * 2)  # what -n 2 sets
    sched = impl[0].function(config=request.config, log=Producer("test", enabled=False))
    assert isinstance(sched, LoadGroupScheduling)
    ids = {
        "tests/test_deployment.py::test_secaggplus_in_a_real_deployment": "deploy",
        "tests/test_deployment.py::test_a_real_deployment_whose_superlink_dies_is_reported_and_stopped": "deploy",
        "tests/test_engine_vs_ray.py::test_ray_simulation_with_10_supernodes_matches_the_inprocess_engine": "ray",
        "tests/test_ray_cluster.py::test_legacy_example_runs_in_simulation": "ray",
        "tests/test_runtime.py::test_sigterm_mid_run_stops_every_process_the_launcher_started": "ray",
        "tests/test_secure_deploy.py::test_tls_auth_deployment_registered_trains_unregistered_and_plaintext_refused":
            "ray",
        "tests/test_runtime.py::test_stop_signals_stop_every_started_process_group[15]":
            "tests/test_runtime.py::test_stop_signals_stop_every_started_process_group[15]",
        "tests/test_app.py::test_x[a@b]": "tests/test_app.py::test_x[a@b]",
        "tests/test_app.py::test_y@g": "g",
    }
    assert {nodeid: sched._split_scope(nodeid) for nodeid in ids} == ids
    monkeypatch.setattr(request.config.option, "dist", "load")
    assert impl[0].function(config=request.config, log=None) is None


def test_every_slow_test_of_the_session_is_listed_in_slow_groups(request):
    """A new slow test must say whether it starts Flower/Ray processes (a lane) or not (``None``): unlisted, it would
    run on any worker beside the lanes.  Checks the tests of this session, so the whole-suite run checks them all."""
    from tests.conftest import SLOW_GROUPS

    slow = [item.nodeid for item in request.session.items if item.get_closest_marker("slow") is not None]
    assert [n for n in slow if not any(n.startswith(prefix) for prefix, _ in SLOW_GROUPS)] == []
