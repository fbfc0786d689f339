"""The launcher (``simulations.launch``): end-to-end with real Flower processes (slow) and its plumbing (fast).

The slow test starts the real processes through ``simulations.launch`` (the same code path the README uses) and
asserts nothing is left running when the launcher is stopped by SIGTERM mid-run (a completed and a failing run are
checked in ``tests/test_engine_vs_ray.py`` and ``tests/test_ray_cluster.py``).  Fast tests: run-config keys (no
duplicates, unknown keys named before anything starts) and the process clean-up on SIGINT / SIGTERM / SIGHUP with
stand-in processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from simulations.launch import APP_DIR, RunConfigError, build_run_config, launch_sim
from simulations.launch.flwr_cli import parse_run_config_arg
from simulations.launch.modes import federation_config
from tests.helpers import our_processes


# ------------------------------------------------------------------------------------------ stopping by signal
def _proc_table() -> dict[int, tuple[int, int, str, int]]:
    """``{pid: (ppid, pgid, state, start time)}`` of every live process, from /proc."""
    table = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(d.name)] = (int(fields[1]), int(fields[2]), fields[0], int(fields[19]))
    return table


def _descendants(root: int) -> dict[int, tuple[int, int, str, int]]:
    table = _proc_table()
    out, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, row in table.items():
            if row[0] == parent and pid not in out:
                out[pid] = row
                todo.append(pid)
    return out


def _left_over(started: dict[int, tuple[int, int, str, int]]) -> list[str]:
    """Processes still alive (not zombies) that are one of ``started`` (same pid and start time) or in its groups."""
    groups = {row[1] for row in started.values()}
    now = _proc_table()
    alive = [pid for pid, row in now.items() if row[2] != "Z" and (
        (pid in started and row[3] == started[pid][3]) or row[1] in groups)]
    return [f"{pid}: {_cmdline(pid)}" for pid in alive]


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(exited)"


@pytest.mark.slow
def test_sigterm_mid_run_stops_every_process_the_launcher_started(tmp_path):
    home = tmp_path / "flwr"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "simulations.launch", "sim", "--num-supernodes", "2", "--ray-cpus", "1",  # one actor
         "--flwr-home", str(home), "--run-config",
         f"num-server-rounds=200 local-steps=2 output-dir='{tmp_path / 'out'}' run-name='term'"],
        cwd=APP_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log = home / "logs" / "flwr-run.log"
        deadline = time.monotonic() + 240
        while not (log.exists() and "ROUND 2" in log.read_text(errors="replace")):  # training is under way
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not reach round 2"
            time.sleep(0.5)
        started = _descendants(launcher.pid)
        names = " ".join(_cmdline(p) for p in started)
        assert "flower-superlink" in names and "flwr" in names  # SuperLink and `flwr run` were running
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=90) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 20  # a child may still be tearing down (empty cmdline) for a moment
        while (_left_over(started) or our_processes(home)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _left_over(started) == []
        assert our_processes(home) == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


_STAND_IN = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from simulations.launch import Cluster
    home = Path(sys.argv[1])
    with Cluster(home, home / "logs", grace_s=1) as cluster:  # 1 s: the SIGTERM-ignoring group is SIGKILLed after it
        for i in range(3):  # one of them ignores SIGTERM: it must be killed after the grace period
            trap = "trap '' TERM; " if i == 0 else ""
            cluster.start(f"p{i}", ["bash", "-c", trap + "sleep 300 & wait"])
        print("started", flush=True)
        time.sleep(300)
""")


@pytest.mark.slow  # real child processes / many end-to-end runs: the full suite runs it
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_stop_signals_stop_every_started_process_group(tmp_path, sig):
    proc = subprocess.Popen([sys.executable, "-c", _STAND_IN, str(tmp_path)], cwd=APP_DIR, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        started = _descendants(proc.pid)
        assert len({row[1] for row in started.values()}) == 3  # three process groups, each with a `sleep` child
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
        assert _left_over(started) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------ run-config keys
def test_min_node_keys_are_added_only_when_the_user_did_not_set_them():
    defaults = {"min-available-nodes": 4, "min-train-nodes": 2}
    cfg = parse_run_config_arg(build_run_config("min-train-nodes=3 method='fedadam' fedadam.server-lr=1e-08", APP_DIR,
                                            defaults))
    assert cfg == {"min-available-nodes": 4, "min-train-nodes": 3, "method": "fedadam", "fedadam.server-lr": 1e-08}
    both = build_run_config("min-available-nodes=5 min-train-nodes=5", APP_DIR, defaults)
    assert both.count("min-available-nodes") == 1 and both.count("min-train-nodes") == 1
    assert parse_run_config_arg(both) == {"min-available-nodes": 5, "min-train-nodes": 5}
    assert parse_run_config_arg(build_run_config(None, APP_DIR, defaults)) == defaults
    # another app gets only the keys it declares (the PyTorch example declares none of these)
    assert build_run_config(None, APP_DIR / "examples" / "pytorch_app", defaults) == ""


def test_a_toml_run_config_file_is_merged_too(tmp_path):
    f = tmp_path / "cfg.toml"
    f.write_text('method = "fedprox"\nmin-train-nodes = 1\n[fedprox]\nmu = 0.1\n')
    cfg = parse_run_config_arg(build_run_config(str(f), APP_DIR, {"min-available-nodes": 2, "min-train-nodes": 2}))
    assert cfg == {"min-available-nodes": 2, "method": "fedprox", "min-train-nodes": 1, "fedprox.mu": 0.1}


def test_ray_cpus_sizes_only_a_private_ray_instance(tmp_path, monkeypatch):
    """``--ray-cpus`` becomes ``init-args-num-cpus``; with an existing cluster (``--ray-address`` or an inherited
    ``RAY_ADDRESS``), whose CPUs Ray will not change, it is refused before anything starts."""
    assert federation_config(10, 1, 0.0, 1) == "num-supernodes=10 client-resources-num-cpus=1 init-args-num-cpus=1"
    assert federation_config(3, 2, 0.5) == "num-supernodes=3 client-resources-num-cpus=2 client-resources-num-gpus=0.5"
    with pytest.raises(ValueError, match="--ray-cpus sizes a private Ray instance"):
        launch_sim(2, None, tmp_path / "flwr", 10, ray_address="127.0.0.1:1", ray_cpus=1)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ValueError, match="leave --ray-cpus out"):
        launch_sim(2, None, tmp_path / "flwr", 10, ray_cpus=1)
    assert not (tmp_path / "flwr").exists()  # nothing was started


def test_unknown_run_config_keys_are_named_before_anything_starts(tmp_path):
    with pytest.raises(RunConfigError) as err:
        build_run_config("num-server-round=2 seed=1", APP_DIR)
    assert "'num-server-round' (did you mean 'num-server-rounds'" in str(err.value)
    assert "seed" not in str(err.value).split("—")[0]
    res = subprocess.run([sys.executable, "-m", "simulations.launch", "sim", "--flwr-home", str(tmp_path / "flwr"),
                          "--run-config", "method='fedavg' no-such-key=1"], cwd=APP_DIR, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "unknown run-config key(s): 'no-such-key'" in res.stderr
    assert not (tmp_path / "flwr" / "logs").exists()  # nothing was started


def test_preloaded_executor_never_preimports_the_apps_own_packages():
    """Flower's ``load_app`` reuses modules already in ``sys.modules``: a pre-imported ``client_app`` would run the
    executor's copy instead of the run's FAB.  Only third-party modules may be pre-loaded."""
    from simulations.launch.preloaded_exec import PRELOAD

    own = {"client_app", "flower_strategies", "server_app", "simulations"}
    assert PRELOAD and not [m for m in PRELOAD if m.split(".")[0] in own]
    assert "torch._dynamo" in PRELOAD  # imported by the first torch.optim.Optimizer(...): the largest single cost


@pytest.mark.pinned_flower
def test_heartbeat_supernode_sets_the_interval_flower_announces_and_keeps(monkeypatch):
    """``simulations.launch.heartbeat_supernode SECONDS …`` sets ``SECONDS`` where Flower's SuperNode reads its 30 s
    heartbeat interval (what it announces, how often it sends); an interval the SuperLink would refuse is named before
    anything starts.  The lost-SuperNode deployment test (``tests/test_deployment.py``) runs the entry point
    for real: with Flower's 30 s its lost node would still be sampled in round 3."""
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection

    from simulations.launch.heartbeat_supernode import set_heartbeat_interval

    modules = (heartbeat, fleet_http_connection)
    for module in modules:  # restored after the test
        monkeypatch.setattr(module, "HEARTBEAT_DEFAULT_INTERVAL", module.HEARTBEAT_DEFAULT_INTERVAL)
    assert [m.HEARTBEAT_DEFAULT_INTERVAL for m in modules] == [30, 30]
    set_heartbeat_interval(12.0)
    assert [m.HEARTBEAT_DEFAULT_INTERVAL for m in modules] == [12.0, 12.0]
    with pytest.raises(SystemExit, match="heartbeat interval 5.0 s: the SuperLink accepts 10 to 1800 s"):
        set_heartbeat_interval(5.0)
    assert [m.HEARTBEAT_DEFAULT_INTERVAL for m in modules] == [12.0, 12.0]


@pytest.mark.pinned_flower
def test_heartbeat_supernode_shortens_only_the_idle_poll_of_the_supernode_loop(monkeypatch):
    """``--idle-poll S``: the SuperNode loop's idle ``time.sleep(3)`` sleeps ``S``; its other sleeps (0.5 s while a
    reply is awaited) and the real ``time`` module are unchanged; a value out of range is named before anything
    starts.  ``tests/test_deployment.py`` runs the entry point for real."""
    import time as real_time

    from flwr.supernode import start_client_internal

    from simulations.launch import heartbeat_supernode as hb

    monkeypatch.setattr(start_client_internal, "time", start_client_internal.time)  # restored after the test
    slept: list[float] = []
    monkeypatch.setattr(real_time, "sleep", slept.append)
    hb.set_idle_poll(0.25)
    start_client_internal.time.sleep(3)
    start_client_internal.time.sleep(0.5)
    assert slept == [0.25, 0.5] and start_client_internal.time.monotonic is real_time.monotonic
    for bad in (0.0, 4.0):
        with pytest.raises(SystemExit, match=f"idle poll {bad} s: expected more than 0 and at most 3 s"):
            hb.set_idle_poll(bad)


@pytest.mark.pinned_flower
def test_heartbeat_supernode_refuses_a_patch_that_would_not_take_effect(monkeypatch):
    """The patch fails loudly, before Flower starts, where it would silently do nothing: the constant is gone from a
    module, or nothing there reads it when it runs (e.g. it became a default argument); the same for the loop's
    ``time``."""
    import sys
    import types

    import flwr.supercore
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection, start_client_internal

    from simulations.launch import heartbeat_supernode as hb

    assert hb._read_at_call_time(heartbeat, "HEARTBEAT_DEFAULT_INTERVAL")
    assert hb._read_at_call_time(fleet_http_connection, "HEARTBEAT_DEFAULT_INTERVAL")  # inside decorated functions
    monkeypatch.setattr(fleet_http_connection, "HEARTBEAT_DEFAULT_INTERVAL", 30)  # restored after the test
    monkeypatch.setattr(heartbeat, "HEARTBEAT_DEFAULT_INTERVAL", 30)
    monkeypatch.delattr(heartbeat, "HEARTBEAT_DEFAULT_INTERVAL")
    with pytest.raises(SystemExit, match="flwr.supercore.heartbeat has no HEARTBEAT_DEFAULT_INTERVAL"):
        hb.set_heartbeat_interval(12.0)

    frozen = types.ModuleType("flwr.supercore.heartbeat")  # the interval only as a default, bound at import
    exec("HEARTBEAT_DEFAULT_INTERVAL = 30\ndef send(interval=HEARTBEAT_DEFAULT_INTERVAL):\n    return interval",
         frozen.__dict__)
    assert not hb._read_at_call_time(frozen, "HEARTBEAT_DEFAULT_INTERVAL")
    monkeypatch.setitem(sys.modules, "flwr.supercore.heartbeat", frozen)
    monkeypatch.setattr(flwr.supercore, "heartbeat", frozen)
    with pytest.raises(SystemExit, match="no code in flwr.supercore.heartbeat reads HEARTBEAT_DEFAULT_INTERVAL"):
        hb.set_heartbeat_interval(12.0)
    assert frozen.HEARTBEAT_DEFAULT_INTERVAL == 30 and fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL == 30

    monkeypatch.setattr(start_client_internal, "time", start_client_internal.time)
    monkeypatch.setattr(hb, "_read_at_call_time", lambda module, name: False)
    with pytest.raises(SystemExit, match="reads its 'time' module when it runs"):
        hb.set_idle_poll(0.25)
