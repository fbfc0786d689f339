"""Per-round metrics: ``metrics.jsonl`` and ``metrics.csv``, appended as rounds finish (the CSV is rewritten only when
a row brings a new column).

Every line of ``metrics.jsonl`` is strict JSON: a non-finite value (e.g. the test loss of a diverged model) is
written as ``null``, never as the ``NaN``/``Infinity`` tokens strict parsers refuse.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flower_strategies.core.hparams import ConfigError

COLUMNS = [
    "round", "test-loss", "test-accuracy", "train-loss", "train-loss-before", "replies-used",
    "replies-rejected", "bytes-down", "bytes-up", "seconds",
]


def finite_or_none(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every NaN/±Inf float replaced by None (JSON ``null``)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


class MetricsWriter:
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.jsonl = out_dir / "metrics.jsonl"
        self.csv = out_dir / "metrics.csv"
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl.write_text("")
        except OSError as err:
            raise ConfigError(f"output-dir: cannot write the run's metrics to {out_dir} ({err}); "
                              f"set output-dir (and run-name) to a writable directory") from None
        self.rows: list[dict[str, Any]] = []
        self._columns: list[str] | None = None  # metrics.csv's header as written
        self._t = time.monotonic()

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        row = finite_or_none({**row, "seconds": round(now - self._t, 4)})
        self._t = now
        self.rows.append(row)
        with self.jsonl.open("a") as fh:
            fh.write(json.dumps(row, sort_keys=True, allow_nan=False) + "\n")
        if self._columns is not None and row.keys() <= set(self._columns):  # same header: append the row
            with self.csv.open("a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=self._columns).writerow(row)
        else:
            self._write_csv()
        return row

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Start from ``rows`` (a resumed run's checkpointed rows): rewrites metrics.jsonl and metrics.csv."""
        self.rows = [finite_or_none(r) for r in rows]
        self.jsonl.write_text("".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n" for r in self.rows))
        self._write_csv()

    def _write_csv(self) -> None:
        """Rewrite metrics.csv (a row with a new column changes the header; other rows are appended by add)."""
        cols = self._columns = COLUMNS + sorted({k for r in self.rows for k in r} - set(COLUMNS))
        with self.csv.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols)
            w.writeheader()
            w.writerows(self.rows)


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``: a duration as a person reads it."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Elapsed time and time left of a run, for its per-round lines.

    The rate is measured from the first round it is told of (round 0, the initial model's evaluation, or the last
    round before a resume), so start-up time does not inflate the estimate: ETA = seconds per round so far × rounds
    left.  ``start``: when the run started (``clock`` time; default now); ``clock``: seconds (monotonic; tests pass
    their own)."""

    def __init__(self, num_rounds: int, start: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_rounds, self.clock = num_rounds, clock
        self.t0 = clock() if start is None else start
        self.first: tuple[int, float] | None = None

    def text(self, server_round: int) -> str:
        """``elapsed 1m05s, ETA 3m10s`` (``ETA --`` until a round has finished; ``ETA 0s`` at the last round)."""
        now = self.clock()
        if self.first is None:
            self.first = (server_round, now)
        done, left = server_round - self.first[0], max(0, self.num_rounds - server_round)
        eta = duration((now - self.first[1]) / done * left) if done > 0 else "--"
        return f"elapsed {duration(now - self.t0)}, ETA {eta if left else '0s'}"


def progress_line(row: dict[str, Any], num_rounds: int, progress: Progress | None = None) -> str:
    def f(key: str, fmt: str) -> str:
        v = row.get(key)
        return "-" if v is None else format(v, fmt)

    privacy = f" | DP ε {f('dp-epsilon', '.3g')}" if "dp-sampled" in row else ""  # native DP (core/privacy.py)
    return (
        f"[fedadapt] round {row['round']:>3}/{num_rounds} | test loss {f('test-loss', '.4f')} "
        f"acc {f('test-accuracy', '.4f')} | train loss {f('train-loss', '.4f')} | replies "
        f"{row.get('replies-used', '-')} ok / {row.get('replies-rejected', '-')} rejected | "
        f"{row.get('bytes-up', 0) / 1e6:.2f} MB up{privacy} | {row['seconds']:.1f}s"
        + (f" | {progress.text(row['round'])}" if progress is not None else "")
    )
