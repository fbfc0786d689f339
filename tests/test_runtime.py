"""The launcher (``simulations.launch``): end-to-end with real Flower processes (slow) and its plumbing (fast).

Slow tests start the real processes through ``simulations.launch`` (the same code path the README uses), check the
run's status as reported by ``flwr ls`` and the metrics the ServerApp wrote, and assert nothing is left running —
also when the launcher is stopped by SIGTERM mid-run.  Fast tests: run-config keys (no duplicates, unknown keys
named before anything starts) and the process clean-up on SIGINT / SIGTERM / SIGHUP with stand-in processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from simulations.engine import run_inprocess
from simulations.launch import APP_DIR, RunConfigError, build_run_config, launch_deploy, launch_sim
from simulations.launch.flwr_cli import parse_run_config


def _our_processes(home) -> list[str]:
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if str(home) in line and not line.startswith("Z")]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_ray_simulation_failure_is_reported(tmp_path):
    rc = launch_sim(2, "method='fedadam' fedadam.beta1=3.0 num-server-rounds=1", tmp_path / "flwr", timeout=300)
    assert rc == 1
    log = (tmp_path / "flwr" / "logs" / "flwr-run.log").read_text()
    assert "fedadam.beta1 = 3.0 is out of range" in log
    assert _our_processes(tmp_path / "flwr") == []


@pytest.mark.slow
def test_preloaded_executor_deployment(tmp_path):
    """``deploy --preloaded``: SuperNodes with ``--isolation process``, each served by the pre-loaded SuperExec, which
    forks one ClientApp process per message; same numbers as the stock executor's run (same FAB code, same data).

    Also the plain (non-TLS) ``launch_deploy`` end to end: this test replaced one that ran the same federation with
    the stock executor (``flwr-clientapp`` per message), whose path ``tests/test_secure_deploy.py`` runs."""
    out = tmp_path / "out"
    cfg = f"method='fedprox' num-server-rounds=2 local-steps=10 output-dir='{out}' run-name='%s'"
    home = tmp_path / "flwr"
    rc = launch_deploy(2, cfg % "pre", home, timeout=600, task_poll_interval=0.1, preloaded=True)
    assert rc == 0
    rows = _rows(out / "pre" / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2] and all(r["replies-used"] == 2 for r in rows[1:])
    assert rows[-1]["test-loss"] < rows[0]["test-loss"]
    for i in range(2):
        log = (home / "logs" / f"superexec{i}.log").read_text()
        assert "pre-loaded SuperExec" in log and "torch" in log
        # every message the SuperNode received ran in its own forked process, which exited cleanly
        received = (home / "logs" / f"supernode{i}.log").read_text().count("Receiving: ")
        done = re.findall(r"task \d+: ClientApp process (\d+) exited (\d+)", log)
        assert received >= 2 and len(done) == received, log
        assert len({pid for pid, _ in done}) == received and {code for _, code in done} == {"0"}, log
    assert _our_processes(home) == []
    # the same federation in one process (simulations.engine, = the stock deployment / Ray: tests/test_engine_vs_ray.py)
    run_inprocess({"method": "fedprox", "num-server-rounds": 2, "local-steps": 10, "output-dir": str(out),
                   "run-name": "engine"}, 2)
    ref = _rows(out / "engine" / "metrics.jsonl")
    for a, b in zip(rows, ref, strict=True):
        assert a["test-loss"] == pytest.approx(b["test-loss"], rel=0, abs=1e-6)
        if b.get("train-loss") is None:  # round 0
            assert a.get("train-loss") is None
        else:
            assert a["train-loss"] == pytest.approx(b["train-loss"], rel=0, abs=1e-6)
    model, ref_model = torch.load(out / "pre" / "model.pt"), torch.load(out / "engine" / "model.pt")
    for k in ref_model:
        torch.testing.assert_close(model[k], ref_model[k], rtol=0, atol=1e-6)


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
        [sys.executable, "-m", "simulations.launch", "sim", "--num-supernodes", "2", "--flwr-home", str(home),
         "--run-config", f"num-server-rounds=200 local-steps=2 output-dir='{tmp_path / 'out'}' run-name='term'"],
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
        while (_left_over(started) or _our_processes(home)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _left_over(started) == []
        assert _our_processes(home) == []
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
    cfg = parse_run_config(build_run_config("min-train-nodes=3 method='fedadam' fedadam.server-lr=1e-08", APP_DIR,
                                            defaults))
    assert cfg == {"min-available-nodes": 4, "min-train-nodes": 3, "method": "fedadam", "fedadam.server-lr": 1e-08}
    both = build_run_config("min-available-nodes=5 min-train-nodes=5", APP_DIR, defaults)
    assert both.count("min-available-nodes") == 1 and both.count("min-train-nodes") == 1
    assert parse_run_config(both) == {"min-available-nodes": 5, "min-train-nodes": 5}
    assert parse_run_config(build_run_config(None, APP_DIR, defaults)) == defaults
    # another app gets only the keys it declares (the PyTorch example declares none of these)
    assert build_run_config(None, APP_DIR / "examples" / "pytorch_app", defaults) == ""


def test_a_toml_run_config_file_is_merged_too(tmp_path):
    f = tmp_path / "cfg.toml"
    f.write_text('method = "fedprox"\nmin-train-nodes = 1\n[fedprox]\nmu = 0.1\n')
    cfg = parse_run_config(build_run_config(str(f), APP_DIR, {"min-available-nodes": 2, "min-train-nodes": 2}))
    assert cfg == {"min-available-nodes": 2, "method": "fedprox", "min-train-nodes": 1, "fedprox.mu": 0.1}


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
