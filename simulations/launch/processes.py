"""Processes of one launch: started in their own process groups, all stopped on exit, SIGINT, SIGTERM or SIGHUP."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
import contextlib

APP_DIR = Path(__file__).resolve().parent.parent.parent
BASE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}
#: Signals that stop a launch: every started process is stopped, then the launcher exits with 128 + signal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(SystemExit):
    """Raised in the launcher's main thread by :data:`STOP_SIGNALS`; exit status 128 + signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bin_path(name: str) -> str:
    """Entry point next to the running interpreter (the venv), else on PATH."""
    cand = Path(sys.executable).parent / name
    if cand.exists():
        return str(cand)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found; is fedadapt installed in this environment?")
    return found


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def start_time(pid: int) -> str | None:
    """The start time of ``pid`` (``/proc/<pid>/stat`` field 22), telling a process from a later one with its pid."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_tree(roots: Sequence[int]) -> dict[int, int]:
    """``{pid: process group}`` of ``roots`` and all their descendants, from ``/proc`` (Linux; elsewhere: the roots).

    Flower starts some children detached in sessions of their own (``flower-superexec``), so killing the groups of
    the processes we started is not enough: their descendants' groups are signalled too."""
    parent: dict[int, int] = {}
    group: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)], group[int(d.name)] = int(fields[1]), int(fields[2])
    tree = {r: group.get(r, r) for r in roots}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in tree:
                tree[child] = group[child]
                todo.append(child)
    return tree


#: Seconds between two looks of :meth:`Cluster.watch_superlink` at the SuperLink and the process tree.
WATCH_INTERVAL_S = 0.5
#: Grace (SIGTERM → SIGKILL) when the SuperLink is gone: its federation cannot go on, so nothing waits long.
LOST_GRACE_S = 3.0


class Cluster:
    """Processes started for one run, each in its own process group (session).

    Used as a context manager: on leaving it — normally, by an exception, or by SIGINT / SIGTERM / SIGHUP, which
    raise :class:`Stopped` while it is active — every group gets SIGTERM, then SIGKILL after ``grace_s``.  Signals
    are ignored while stopping, so a second Ctrl-C cannot interrupt the clean-up.

    While a run is streamed (:meth:`watch_superlink`) the cluster notes every descendant of its processes: when the
    SuperLink dies its children (``flower-superexec``, ``flwr-serverapp``) are orphaned, out of reach of
    :func:`process_tree`, and are stopped from that record (a pid is signalled only while it is the same process).
    """

    def __init__(self, flwr_home: Path, log_dir: Path, grace_s: float = 20.0) -> None:
        self.flwr_home = flwr_home
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.procs: list[tuple[str, subprocess.Popen]] = []
        #: The port of the SuperLink a deployment mode started (its SuperNodes connect to it).
        self.superlink_port: int | None = None
        self.env = {**os.environ, **BASE_ENV, "FLWR_HOME": str(flwr_home)}
        # Flower's processes start further entry points (flower-superexec, flwr-serverapp, flwr-clientapp) by name:
        # put this interpreter's scripts directory first on PATH, so a non-activated venv works too.
        scripts = str(Path(sys.executable).parent)
        if scripts not in self.env.get("PATH", "").split(os.pathsep):
            self.env["PATH"] = os.pathsep.join(x for x in (scripts, self.env.get("PATH", "")) if x)
        self._old_handlers: dict[int, Any] = {}
        #: Why the federation was lost (the SuperLink exited during a run), else None.
        self.lost: str | None = None
        self._seen: dict[int, tuple[int, str | None]] = {}  # pid → (process group, start time) of every descendant
        #: Held while a process is named and started, so that runs started from several threads get distinct logs.
        self.starting = threading.Lock()
        flwr_home.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              capture: bool = False) -> subprocess.Popen:
        """Start ``argv`` in a new session; output to ``<log_dir>/<name>.log``, or a pipe with ``capture``."""
        out: Any = subprocess.PIPE if capture else open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115
        try:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                                    cwd=APP_DIR, start_new_session=True)
        finally:
            if not capture:
                out.close()  # the child holds its own descriptor
        self.procs.append((name, proc))
        return proc

    def snapshot(self) -> None:
        """Note every live descendant of the started processes (see the class docstring)."""
        for pid, pgid in process_tree([proc.pid for _, proc in self.procs]).items():
            if pid not in self._seen:
                self._seen[pid] = (pgid, start_time(pid))

    def superlink(self) -> subprocess.Popen | None:
        return next((proc for name, proc in self.procs if name == "superlink"), None)

    def watch_superlink(self, run_proc: subprocess.Popen) -> threading.Event:
        """Watch the SuperLink while ``run_proc`` (``flwr run --stream``) runs; set the returned event to stop.

        If the SuperLink exits first, :attr:`lost` says so and ``run_proc`` is killed at once (its stream ends), so
        the launcher reports the loss and stops every process instead of waiting for them to notice."""
        done = threading.Event()
        link = self.superlink()
        if link is None:
            return done

        def watch(link: subprocess.Popen) -> None:
            while not done.wait(WATCH_INTERVAL_S):
                self.snapshot()
                if link.poll() is not None and run_proc.poll() is None:
                    self.note_lost()
                    signal_group(run_proc.pid, signal.SIGKILL)
                    return

        self.snapshot()
        threading.Thread(target=watch, args=(link,), name="superlink-watch", daemon=True).start()
        return done

    def note_lost(self) -> bool:
        """Whether the SuperLink has exited; if so, :attr:`lost` says so.  Also called once ``flwr run`` has ended:
        when the SuperLink dies, ``flwr run --stream`` may exit on its own ("Connection to the SuperLink is
        unavailable") before the watcher's next look, and asking the dead SuperLink for the status would only wait."""
        link = self.superlink()
        rc = None if link is None else link.poll()
        if link is not None and rc is not None and self.lost is None:
            self.lost = f"the SuperLink (pid {link.pid}) exited with {rc} during the run"
        return rc is not None

    def stop(self) -> None:
        """SIGTERM to the process group of every started process and of each of its descendants (those noted by
        :meth:`snapshot` too), SIGKILL to those groups after ``grace_s`` (:data:`LOST_GRACE_S` when the SuperLink
        was lost; also when a group's leader has exited)."""
        tree = process_tree([proc.pid for _, proc in reversed(self.procs)])
        orphans = {pgid for pid, (pgid, started) in self._seen.items()
                   if pid not in tree and started is not None and start_time(pid) == started}
        groups = list(dict.fromkeys([*tree.values(), *sorted(orphans)]))
        for pgid in groups:
            signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + (min(self.grace_s, LOST_GRACE_S) if self.lost else self.grace_s)
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for pgid in groups:
            signal_group(pgid, signal.SIGKILL)
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.procs.clear()
        self._seen.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        raise Stopped(signum)

    def __enter__(self) -> Cluster:
        try:
            for sig in STOP_SIGNALS:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: the caller handles signals
            self._old_handlers.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in self._old_handlers:
            signal.signal(sig, signal.SIG_IGN)
        try:
            self.stop()
        finally:
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
            self._old_handlers.clear()


def wait_health(url: str, timeout: float, proc: subprocess.Popen | None = None, cafile: Path | None = None) -> None:
    """Poll ``url`` until it answers (TLS verified against ``cafile`` when given); fail early if ``proc`` exits."""
    ctx = ssl.create_default_context(cafile=str(cafile)) if cafile is not None else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1, context=ctx):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")
