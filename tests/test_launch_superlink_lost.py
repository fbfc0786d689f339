"""The launcher notices a dead SuperLink: ``flwr run`` is stopped at once, the status says what happened, and every
process of the launch (orphaned descendants of the SuperLink too) is stopped within the short grace.  Here with
stand-in processes; the real deployment whose SuperLink dies is the last test of ``tests/test_deployment.py``."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from simulations.launch import flwr_cli, modes
from simulations.launch.processes import LOST_GRACE_S, Cluster


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.05)
    return path.read_text().strip()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_killed_superlink_ends_the_run_at_once_and_every_process_is_stopped(tmp_path, monkeypatch, capsys):
    orphan_pid = tmp_path / "orphan.pid"
    # a stand-in SuperLink whose child lives in a session of its own (as flower-superexec does): orphaned when the
    # SuperLink dies, out of reach of the process tree, it must still be stopped
    link_script = textwrap.dedent(f"""
        import subprocess, time
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
        open({str(orphan_pid)!r}, "w").write(str(child.pid))
        time.sleep(300)
    """)
    fake_flwr = tmp_path / "flwr"
    fake_flwr.write_text("#!/bin/sh\necho 'Successfully started run 7'\nexec sleep 300\n")
    fake_flwr.chmod(0o755)
    monkeypatch.setattr(flwr_cli, "bin_path", lambda name: str(fake_flwr))

    t0 = time.monotonic()
    with Cluster(tmp_path / "home", tmp_path / "logs") as cluster:
        link = cluster.start("superlink", [sys.executable, "-c", link_script])
        orphan = int(wait_for(orphan_pid))
        threading.Timer(1.0, lambda: os.kill(link.pid, signal.SIGKILL)).start()
        run_id, status, _ = flwr_cli.flwr_run(cluster, "conn", None, None, timeout=600)
        assert time.monotonic() - t0 < 15  # not the 30 s of run_status polling a dead SuperLink, nor the timeout
        assert alive(orphan)
        stopping = time.monotonic()
    assert time.monotonic() - stopping < LOST_GRACE_S + 6
    assert run_id == 7 and status == f"superlink-lost: the SuperLink (pid {link.pid}) exited with -9 during the run"
    deadline = time.monotonic() + 5
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(orphan), "an orphaned descendant of the SuperLink was left running"
    assert modes.report(run_id, status, tmp_path / "logs") == 1
    assert "run 7: FAILED, the SuperLink (pid" in capsys.readouterr().out
