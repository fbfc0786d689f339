"""What the launcher shows while a run streams: fedadapt's lines, a bar on a terminal, Flower's INFO on request.

The ServerApp prints one line per round with ``round r/R``, the elapsed time and the ETA
(:func:`server_app.metrics.progress_line`).  The launcher echoes the streamed output through :class:`StreamView`:

* Flower's own INFO lines (``INFO :  [ROUND 2/10]``, ``configure_train: sampled …``, the strategy's settings tree) are
  left out unless ``--verbose``; fedadapt's INFO lines (``fedadapt: …``), every WARNING/ERROR and every other line are
  shown (but Ray's FutureWarning tip, :data:`NOISE`).  ``<FLWR_HOME>/logs/flwr-run.log`` always holds the whole
  stream.
* On a terminal a tqdm bar (round r/R, elapsed, time left) stays under the lines; when stdout is not a terminal (a
  file, a pipe, CI) there is no bar, only the plain lines.

The in-process engines log in this process: :func:`quiet_flower` applies the same rule to Flower's logger there.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: A Flower log line (possibly prefixed by Ray's ``(ClientAppActor pid=…)``): level, then the message.
LOG_LINE = re.compile(r"^(?:\(\S+ pid=\d+\)\s*)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s?(.*)$", re.S)
ROUND_LINE = re.compile(r"^\[fedadapt\] round\s+(\d+)/(\d+)\b")


#: Lines of no use to a person watching a run, left out unless ``--verbose``: Ray's tip about accelerator variables
#: (a FutureWarning printed by every actor: the warning line and its source line).
NOISE = re.compile(r"FutureWarning: Tip: In future versions of Ray|^\s+warnings\.warn\($")


def is_flower_info(line: str) -> bool:
    """Whether ``line`` is one of Flower's INFO/DEBUG log lines (fedadapt's own ``fedadapt: …`` lines are not)."""
    m = LOG_LINE.match(ANSI.sub("", line))
    return m is not None and m.group(1) in ("DEBUG", "INFO") and not m.group(2).strip().startswith("fedadapt")


class StreamView:
    """Echo a run's streamed lines: Flower's INFO lines only when ``verbose``; a round bar when ``tty``.

    ``tty`` default: whether ``out`` is a terminal."""

    def __init__(self, verbose: bool = False, out: TextIO | None = None, tty: bool | None = None) -> None:
        self.verbose, self.out = verbose, out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.bar: Any = None

    def write(self, line: str) -> None:
        if not self.verbose and (is_flower_info(line) or NOISE.search(ANSI.sub("", line))):
            return
        m = ROUND_LINE.match(line)
        if self.tty and m:
            self._round(int(m.group(1)), int(m.group(2)))
        if self.bar is not None:
            self.bar.write(line.rstrip("\n"), file=self.out)
        else:
            self.out.write(line if line.endswith("\n") else line + "\n")
            self.out.flush()

    def _round(self, done: int, total: int) -> None:
        try:
            from tqdm import tqdm  # a dependency of datasets (flwr-datasets)
        except ImportError:  # no bar, plain lines
            self.tty = False
            return
        if self.bar is None:
            self.bar = tqdm(total=total, initial=done, file=self.out, dynamic_ncols=True, leave=False,
                            bar_format="{l_bar}{bar}| round {n}/{total} [{elapsed} elapsed, {remaining} left]",
                            desc="[fedadapt]")
        else:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _QuietFlower(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or str(record.getMessage()).lstrip().startswith("fedadapt")


@contextmanager
def quiet_flower(verbose: bool = False) -> Iterator[None]:
    """Within: Flower's logger in this process drops its INFO/DEBUG records but fedadapt's (``verbose``: nothing)."""
    logger, quiet = logging.getLogger("flwr"), _QuietFlower()
    if not verbose:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
