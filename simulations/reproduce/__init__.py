"""Reproduction suite: each paper's own comparison set on offline data, over seeds, with tables and plots.

    python -m simulations.reproduce 002 --quick --seeds 2            # one paper, CI-sized smoke run, not a reproduction
    python -m simulations.reproduce all [--seeds 3] [--rounds 50]    # every paper, every data setting
    python -m simulations.reproduce sweep 002 [--lrs 0.01,0.1,1]     # pick client lrs by the papers' rule
    python -m simulations.reproduce theory                            # paper 000 Fig. 1 + paper 003 surrogate plots
    python -m simulations.reproduce report --out DIR                  # rewrite tables/plots from DIR's results.json

Every run is the real ServerApp logic driving the real ClientApp in this process
(:func:`simulations.engine.inprocess.run_inprocess`), so a row of ``results.csv`` is exactly what ``flwr run`` with the
same run-config computes (the engine is deterministic for a seed).  For each paper and data setting the suite writes,
under ``--out`` (default ``outputs/reproduce``)::

    <paper>/<setting>/runs/<label>-seed<s>/metrics.{jsonl,csv}, summary.json   (the engine's own files)
    <paper>/<setting>/results.csv, results.json     one row per method × seed (+ one row per skipped method)
    <paper>/<setting>/table.md                      mean ± std over seeds, rounds to target, bytes/round, claims
    <paper>/<setting>/accuracy.png, loss.png        test accuracy / loss vs round, mean ± std band per method

The catalogue — data settings, each paper's entries and claims, the sweep's grids, the theory runs — is data:
``catalogue/*.toml`` (format in :mod:`.catalogue`).  Grids list registry names; a method that is not registered (yet)
in this installation is reported as ``skipped``.
Learning rates: each grid entry carries a default client lr (documented in ``docs/reproduce.md``); ``sweep``
re-picks the client (and server) lr of every entry from a small grid by the papers' rule — lowest mean training loss
of the global model (``train-loss-before``: the clients' loss at the broadcast model) over the last rounds — and
writes ``sweep.json``, which ``--lrs-from`` feeds back into a reproduction run.

Modules: :mod:`.catalogue` (the data), :mod:`.runner` (runs → result rows), :mod:`.report` (aggregates, verdicts,
files, plots), :mod:`.sweep`, :mod:`.theory`, :mod:`.cli` (``__main__``).
"""

from .catalogue import Claim, Entry, Paper, Setting, papers, registered, run_config_for, safe, settings
from .cli import main, reproduce
from .report import (
    COLUMNS, NO_TARGET, SMOKE_HEADING, aggregate, judge, markdown_table, rewrite, verdicts, write_outputs,
    write_summary,
)
from .runner import Progress, execute, last_window, run_grid, run_one, server_lr_of, summarize
from .sweep import overrides_from_sweep, server_factors, server_grid, server_tuned, sweep_for, sweep_grid

# The submodules ``sweep`` (:func:`.sweep.sweep`) and ``theory`` (:func:`.theory.theory`) keep their names here.
__all__ = [
    "COLUMNS", "NO_TARGET", "SMOKE_HEADING", "Claim", "Entry", "Paper", "Progress", "Setting", "aggregate", "execute",
    "judge", "last_window", "main",
    "markdown_table", "overrides_from_sweep", "papers", "registered", "reproduce", "rewrite", "run_config_for",
    "run_grid", "run_one", "safe", "server_factors", "server_grid", "server_lr_of", "server_tuned", "settings",
    "summarize", "sweep", "sweep_for", "sweep_grid", "theory", "verdicts", "write_outputs", "write_summary",
]
