"""Plain run vs SecAgg+ run of one method on digits-mlp, in-process (docs/results/secagg/README.md).

Usage: ``python docs/results/secagg/compare_digits.py METHOD ['{"weighting": "examples"}']`` (from the repository root,
with ``PYTHONPATH=.``); prints the final rows of both runs and the max abs difference of each final array.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch

from simulations.engine.inprocess import run_inprocess


def main(method: str, extra: dict) -> None:
    out = tempfile.mkdtemp()
    base = {"method": method, "task": "digits-mlp", "num-server-rounds": 2, "local-epochs": 1, "output-dir": out,
            "learning-curve": False, "update-norm-ratio": 0.0, **extra}
    plain = run_inprocess({**base, "run-name": "plain"}, 3)
    secure = run_inprocess({**base, "run-name": "secagg", "secure-aggregation": "secaggplus"}, 3)
    a, b = torch.load(f"{out}/plain/model.pt"), torch.load(f"{out}/secagg/model.pt")
    print("plain  ", plain["final"])
    print("secagg ", secure["final"])
    print("max abs difference", {k: float((a[k] - b[k]).abs().max()) for k in a})


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
