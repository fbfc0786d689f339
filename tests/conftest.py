"""Suite-wide settings: one intra-op thread, in this process and in every process the tests start.

The models here are tiny (an MLP on 8x8 digits, a linear model): torch's intra-op threads only contend for the CPUs
with each other and with the other processes of a run (two ClientApps, the ServerApp, the SuperLink).  On 2 busy cores
a 10-node, 3-round in-process run took 173-210 s with 2 threads and 7-8 s with one.  ``tests/test_fedlamb.py`` used to
set this for the whole session as a side effect of being imported; it is set here explicitly, before any test module
is imported.  ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` are inherited by the Flower processes the end-to-end tests start
(SuperLink, SuperNodes, ``flwr-clientapp``/``flwr-serverapp``, the pre-loaded SuperExec; Ray already gives its actors
one thread per CPU they reserve), so a deployment's ClientApps run with the same thread count as the in-process
engine they are compared with.  A value already set in the environment is kept.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402 - after the environment, so the thread pools start with it

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """Tests that start real processes (``slow``: Ray, SuperLink/SuperNodes, launcher signals, benchmarks) share one
    xdist group, so that with ``-n`` they run one after another on one worker (no two Flower/Ray deployments compete
    for ports and cores) while the in-process tests fill the other workers."""
    import pytest

    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("processes"))
