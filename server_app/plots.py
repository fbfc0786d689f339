"""The run's learning curve: ``<run dir>/learning_curve.png`` next to ``metrics.csv``.

Test accuracy (when the task has one) and test loss of the global model per round, from the ServerApp's
metrics rows (round 0 = the initial model). Matplotlib with the non-interactive Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flwr.common import log
from logging import INFO, WARNING

FILENAME = "learning_curve.png"


def write_learning_curve(rows: Sequence[dict[str, Any]], out_dir: Path, title: str = "") -> Path | None:
    """Plot ``rows`` (the metrics rows: ``round``, ``test-loss``, optional ``test-accuracy``) into
    ``out_dir/learning_curve.png``; returns the path, or ``None`` when there is nothing to plot or plotting fails
    (a missing plot never fails the run)."""
    points = [r for r in rows if r.get("test-loss") is not None]
    if not points:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rounds = [r["round"] for r in points]
        acc = [(r["round"], r["test-accuracy"]) for r in points if r.get("test-accuracy") is not None]
        fig, ax_loss = plt.subplots(figsize=(6.4, 4.0))
        ax_loss.plot(rounds, [r["test-loss"] for r in points], "o-", color="tab:red", label="test loss")
        ax_loss.set_xlabel("round")
        ax_loss.set_ylabel("test loss", color="tab:red")
        handles = ax_loss.get_lines()
        if acc:
            ax_acc = ax_loss.twinx()
            ax_acc.plot([a[0] for a in acc], [a[1] for a in acc], "s-", color="tab:blue", label="test accuracy")
            ax_acc.set_ylabel("test accuracy", color="tab:blue")
            ax_acc.set_ylim(0.0, 1.0)
            handles = [*handles, *ax_acc.get_lines()]
        ax_loss.legend(handles, [str(h.get_label()) for h in handles], loc="center right")
        ax_loss.set_title(title)
        ax_loss.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(out_dir) / FILENAME
        fig.savefig(path, dpi=100)
        plt.close(fig)
    except Exception as err:  # noqa: BLE001 - the metrics files are the record; the plot is a convenience
        log(WARNING, "fedadapt: learning curve not written (%s)", err)
        return None
    log(INFO, "fedadapt: learning curve in %s", path)
    return path
