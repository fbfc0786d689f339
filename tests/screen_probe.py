"""A pytest plugin measuring what the direction screen and the norm bounds would see on honest runs.

    python -m pytest -n 0 -m "not slow" -p tests.screen_probe tests/test_fedopt.py tests/test_fedlada.py …

Every strategy built in the session screens directions with ``update-cosine-floor`` −0.99999 when it is off (the
cosines are computed, no reply is ever rejected, so every run and every assertion is unchanged).  At the end it
prints, over every round with at least 3 replies, how many honest replies had a cosine with the round's centre
below each floor and a norm above each multiple of the round's lower-median norm — how often a default screen at
that setting would have fired — by the number of replies in the round (docs/robustness.md, "A default on evidence").

It patches the screen (``ScreenPolicy.from_settings``, ``centre_cosines``) because the library has no hook that
shows a round's cosines and norms, and adding one to ``core/screen.py`` for a measurement would be library API
that no user needs; the patch computes what the screen would compute and rejects nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flower_strategies.core import screen as S
from flower_strategies.core.robust import lower_median

FLOORS = (0.0, -0.1, -0.5, -0.9)
RATIOS = (3.0, 5.0, 10.0)
_STATS: dict[int, dict[str, Any]] = defaultdict(lambda: {"rounds": 0, "replies": 0, "min-cosine": 1.0,
                                                        "max-norm-ratio": 0.0, "tests": set()})
_TEST = {"id": ""}
_cosines = S.centre_cosines
_from_settings = S.ScreenPolicy.from_settings.__func__  # type: ignore[attr-defined]


def _policy(cls: type[S.ScreenPolicy], settings: Any, weighting: str) -> S.ScreenPolicy:
    policy = _from_settings(cls, settings, weighting)
    off = policy.update_cosine_floor <= -1
    return dataclasses.replace(policy, update_cosine_floor=-0.99999) if off else policy


def _measured(items: Sequence[Mapping[str, np.ndarray]], reference: Mapping[str, np.ndarray],
              norms: Sequence[float]) -> list[float]:
    cosines = _cosines(items, reference, norms)
    median = lower_median(norms)
    ratios = [n / median if median > 0 else 0.0 for n in norms]
    row = _STATS[len(cosines)]
    row["rounds"] += 1
    row["replies"] += len(cosines)
    row["min-cosine"] = min(row["min-cosine"], *cosines)
    row["max-norm-ratio"] = max(row["max-norm-ratio"], *ratios)
    row["tests"].add(_TEST["id"])
    for floor in FLOORS:
        row[f"cosine < {floor:g}"] = row.get(f"cosine < {floor:g}", 0) + sum(c < floor for c in cosines)
    for ratio in RATIOS:
        row[f"norm > {ratio:g}x"] = row.get(f"norm > {ratio:g}x", 0) + sum(r > ratio for r in ratios)
    return cosines


def pytest_configure(config: Any) -> None:
    """Patch the screen only when pytest loads this module as a plugin (``-p tests.screen_probe``): importing
    it (the docs tests import every dotted name the docs mention) changes nothing."""
    S.ScreenPolicy.from_settings = classmethod(_policy)  # type: ignore[method-assign, assignment]
    S.centre_cosines = _measured


def pytest_runtest_setup(item: Any) -> None:
    _TEST["id"] = item.nodeid


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    rows = {n: {**row, "tests": len(row["tests"])} for n, row in sorted(_STATS.items())}
    print("\nscreen probe (replies per round: counts):\n" + json.dumps(rows, indent=1))
