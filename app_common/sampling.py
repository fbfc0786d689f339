"""Seeded sampling shared by every task (a module of its own: ``task`` and ``shakespeare`` both use it)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def seeded_subset(x: Tensor, y: Tensor, max_examples: int, seed: int) -> tuple[Tensor, Tensor]:
    """At most ``max_examples`` rows of ``(x, y)``: a sorted sample without replacement seeded by ``(seed, 7)``;
    all rows when ``max_examples <= 0`` or there are not more rows than that."""
    if 0 < max_examples < len(x):
        rng = np.random.default_rng([seed, 7])
        idx = torch.from_numpy(np.sort(rng.choice(len(x), size=max_examples, replace=False)))
        x, y = x[idx], y[idx]
    return x, y
