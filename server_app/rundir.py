"""A run owns its output directory ``<output-dir>/<run-name>/``.

**A run directory belongs to one configuration.**

* **Default name.**  With ``run-name`` empty the directory is ``<method>-<task>-seed<seed>``, followed by
  ``-<8 hex digits>`` (a hash of every other key set to a non-default value, ``num-server-rounds`` and ``tracking``
  included) when there is any: two runs with different settings never share a default directory, and a run with
  only default settings keeps the short name.  Only where the files go and how the run starts are left out
  (:data:`UNHASHED`: ``output-dir``, ``run-name``, ``resume``, ``overwrite``).  A resumed run continues in the
  directory its checkpoint names (``server_app.app.run_dir``), so what a resumed run may change
  (``checkpoint.RESUMABLE_CHANGES``: ``num-server-rounds``, ``round-timeout``, …, and ``tracking``) does not move it.
  The keys behind the hash are in the run's ``summary.json`` (``run_config``).
* **One run at a time.**  A run holds an exclusive ``flock`` on ``<run dir>/.lock`` from its start to its end; a
  second run into the same directory while the first is alive fails at start with a :class:`RunDirBusy` naming
  ``run-name``/``output-dir`` and the holder's pid, and writes nothing.  The lock dies with its process (exit,
  crash, ``kill -9``): a ``.lock`` left by a dead run never blocks.
* **No take-over.**  A fresh run (``resume`` not set) into a directory that holds an earlier run's files is refused
  at start (:class:`RunDirUsed`), unless ``overwrite = true``: then those files first move aside into
  ``<output-dir>/<run-name>.prev-<n>/`` (``n`` = 1, 2, …: the first free one), so the directory then holds exactly
  the new run's files and nothing of the earlier run is lost.  A resumed run continues in its directory as it is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common import log

from flower_strategies.core.hparams import ConfigError

LOCK = ".lock"
#: Keys that never enter the default name: the name's own parts, where the files go, what only reports.
NAME_PARTS = frozenset({"method", "task", "seed"})


class RunDirBusy(ConfigError):
    """Another live run holds the run directory."""


class RunDirUsed(ConfigError):
    """A fresh run into a directory that holds an earlier run's files, without ``overwrite``."""


#: Keys left out of the default name's hash besides its parts: where the files go and how the run starts.
UNHASHED = frozenset({"output-dir", "run-name", "resume", "overwrite"})


def default_run_name(method: str, task: str, seed: int, run_config: Mapping[str, Any],
                     defaults: Mapping[str, Any], ignore: frozenset[str]) -> str:
    """``<method>-<task>-seed<seed>[-<hash>]``: the hash covers every key of ``run_config`` (as given: before
    presets, which follow from method and task) that is not at its default, except ``ignore`` and the name's parts."""
    changed = {k: v for k, v in run_config.items()
               if k not in ignore and k not in NAME_PARTS and (k not in defaults or defaults[k] != v)}
    name = f"{method}-{task}-seed{seed}"
    if not changed:
        return name
    text = json.dumps(changed, sort_keys=True, default=str)
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def _unwritable(out: Path, err: OSError) -> ConfigError:
    return ConfigError(f"output-dir: cannot write the run's metrics to {out} ({err}); "
                       f"set output-dir (and run-name) to a writable directory")


def earlier_run(out: Path) -> str:
    """A few words on the earlier run whose files are in ``out`` (from its ``summary.json``, when readable)."""
    try:
        summary = json.loads((out / "summary.json").read_text())
        return (f"a {summary.get('status', '?')} run of {summary.get('method', '?')}, {summary.get('rounds', '?')} "
                f"rounds")
    except (OSError, ValueError, AttributeError):
        return "an earlier run's files"


@contextmanager
def claim(out: Path, *, fresh: bool, overwrite: bool = False) -> Iterator[Path]:
    """Hold ``out`` for the run's life (see the module docstring).  ``fresh``: a new run, refused
    (:class:`RunDirUsed`) when ``out`` holds an earlier run's files, unless ``overwrite``: then they move aside."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise _unwritable(out, err) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "?"
            raise RunDirBusy(
                f"run-name / output-dir: another run (pid {holder}) is writing to {out}; two runs cannot share a "
                f"run directory: wait for it to end, or give this run another run-name or output-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        if fresh and earlier_files(out):
            if not overwrite:
                raise RunDirUsed(
                    f"run-name / output-dir: {out} holds {earlier_run(out)}; a run directory belongs to one run: set "
                    f"resume = <its checkpoint.npz> to continue it, overwrite = true to move its files to "
                    f"{out.name}.prev-<n>/ and start afresh, or give this run another run-name or output-dir")
            move_aside(out)
        yield out
    finally:
        os.close(fd)  # releases the lock (so does the process's death)


def earlier_files(out: Path) -> list[Path]:
    """The files an earlier run left in ``out``: every entry but the lock and another run's directory (a
    sub-directory holding its own ``.lock``: an ``output-dir`` pointed inside this run directory), which stays."""
    return sorted(p for p in out.iterdir() if p.name != LOCK and not (p.is_dir() and (p / LOCK).exists()))


def move_aside(out: Path) -> Path | None:
    """Move the files of an earlier run in ``out`` (:func:`earlier_files`) to ``<out>.prev-<n>``; return that
    path.  Only ``out``'s own files move: ``out`` is one path component inside ``output-dir`` (``run-name``,
    :func:`app_common.config.run_name_problem`), and another run's directory inside it stays where it is."""
    entries = earlier_files(out)
    if not entries:
        return None
    n = 1
    while (aside := out.with_name(f"{out.name}.prev-{n}")).exists():
        n += 1
    try:
        aside.mkdir()
        for p in entries:
            p.rename(aside / p.name)
    except OSError as err:
        raise _unwritable(out, err) from None
    log(WARNING, "fedadapt: %s held the files of an earlier run; they were moved to %s", out, aside)
    return aside
