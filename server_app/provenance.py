"""What ``summary.json`` records about a run besides its results: the resolved configuration, the versions of the
software, the git commit of the app's checkout and the host."""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from flower_strategies.core.hparams import to_key

#: The directory holding ``server_app/`` (a git checkout of the project, or an unpacked FAB).
APP_ROOT = Path(__file__).resolve().parent.parent


def resolved_config(settings: Any, method: str, hparams: Any) -> dict[str, Any]:
    """Every run-config key of the run with the value it ran with: the app settings (``settings``, after presets
    and defaults, a defence key left unset as its profile gives it) and ``method``'s hyper-parameters
    (``<method>.<key>``); ``None`` stays ``null``."""
    config = {to_key(f.name): getattr(settings, f.name) for f in dataclasses.fields(settings)}
    config.update({f"{method}.{to_key(f.name)}": getattr(hparams, f.name) for f in dataclasses.fields(hparams)})
    return config


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _versions() -> tuple[tuple[str, str | None], ...]:
    import numpy
    import torch

    from flower_strategies import __version__

    return (("python", platform.python_version()), ("torch", torch.__version__), ("flwr", _version("flwr")),
            ("numpy", numpy.__version__), ("fedadapt", __version__))


def versions() -> dict[str, str | None]:
    """The versions of the software this process runs (read once per process: the imported modules cannot change,
    and Flower's version comes from its installed metadata, a search of ``sys.path``)."""
    return dict(_versions())


def _git(*args: str, timeout: float) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(APP_ROOT), *args], capture_output=True, text=True, timeout=timeout,
                              check=False)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(timeout: float = 5.0) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` when the app runs from a git checkout of this project, else nulls (a FAB
    has no ``.git``; a FAB unpacked inside some other repository is recognised by its files not being tracked)."""
    none: dict[str, Any] = {"commit": None, "dirty": None}
    if _git("ls-files", "--error-unmatch", "server_app/app.py", timeout=timeout) is None:
        return none
    # One call for both: porcelain v2 with --branch heads its output with "# branch.oid <sha>" ("(initial)" before
    # the first commit); every other line is a changed tracked file.
    status = _git("status", "--porcelain=v2", "--branch", "--untracked-files=no", timeout=timeout)
    lines = [] if status is None else status.splitlines()
    commit = next((line.split()[2] for line in lines if line.startswith("# branch.oid ")), None)
    if commit is None or commit == "(initial)":
        return none
    return {"commit": commit, "dirty": any(not line.startswith("#") for line in lines)}


def host() -> dict[str, Any]:
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count()}


def run_info(settings: Any, method: str, hparams: Any) -> dict[str, Any]:
    """The summary's provenance fields: ``config``, ``versions``, ``git``, ``host``.  ``git`` is a
    :class:`~concurrent.futures.Future` of :func:`git_state`: its two git subprocesses run in a background thread
    while the run trains; :func:`resolved` waits for it."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedadapt-git")
    git = pool.submit(git_state)
    pool.shutdown(wait=False)  # the probe finishes; nothing else runs in this thread
    return {"config": resolved_config(settings, method, hparams), "versions": versions(), "git": git, "host": host()}


def resolved(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` (:func:`run_info`) with its ``git`` probe's result."""
    git = info["git"]
    return {**info, "git": git.result() if isinstance(git, Future) else git}
