"""Progress a person can read: round r/R with elapsed time and ETA, Flower's INFO lines only with ``--verbose``, a bar
on a terminal (plain lines elsewhere), and a short ``--help`` with the examples at the end."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

from server_app.metrics import Progress, duration, progress_line
from simulations.launch.__main__ import main, parser
from simulations.launch.processes import APP_DIR
from simulations.launch.progress import StreamView, is_flower_info, quiet_flower

# Lines as `flwr run --stream` delivers them (colour codes included), from a real `launch sim` run.
FLOWER_INFO = ["\x1b[92mINFO \x1b[0m:      [ROUND 1/2]\n", "\x1b[92mINFO \x1b[0m:      configure_train: sampled 2 of 2 "
               "nodes\n", "\x1b[92mINFO \x1b[0m:      \n", "\x1b[92mINFO \x1b[0m:      \t│\t├── server_lr = 1.0\n",
               "INFO :      Starting Flower Simulation\n",
               "/v/lib/python3.11/site-packages/ray/_private/worker.py:2051: FutureWarning: Tip: In future versions of "
               "Ray, Ray will no longer override accelerator visible devices env var if num_gpus=0\n",
               "  warnings.warn(\n"]
KEPT = ["\x1b[92mINFO \x1b[0m:      fedadapt: finished; metrics in /tmp/x\n",
        "\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n",
        "\x1b[36m(ClientAppActor pid=24153)\x1b[0m \x1b[93mWARNING \x1b[0m:   Manually terminating ClientAppActor\n",
        "[fedadapt] round   1/2 | test loss 2.2670 acc 0.1583 | 0.04 MB up | 23.2s | elapsed 25s, ETA 12s\n",
        "Successfully started run 14855585676973561474\n"]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_duration_reads_like_a_person_writes_it() -> None:
    assert [duration(s) for s in (0, 4.4, 59.6, 65, 3599, 3725, 90000)] == [
        "0s", "4s", "1m00s", "1m05s", "59m59s", "1h02m", "25h00m"]


def test_eta_is_the_rate_since_the_first_round_times_the_rounds_left() -> None:
    clock = Clock()
    p = Progress(10, clock=clock)  # the run starts at t = 0
    clock.t = 5.0  # round 0 (the initial model's evaluation) after 5 s of start-up
    assert p.text(0) == "elapsed 5s, ETA --"
    clock.t = 15.0  # round 1 took 10 s: 9 more rounds at 10 s
    assert p.text(1) == "elapsed 15s, ETA 1m30s"
    clock.t = 45.0  # rounds 1-4 took 40 s: 6 more at 10 s
    assert p.text(4) == "elapsed 45s, ETA 1m00s"
    clock.t = 105.0
    assert p.text(10) == "elapsed 1m45s, ETA 0s"
    resumed = Progress(10, start=0.0, clock=clock)  # a resumed run: the rate counts from its first round
    assert resumed.text(7) == "elapsed 1m45s, ETA --"
    clock.t = 125.0
    assert resumed.text(8) == "elapsed 2m05s, ETA 40s"


def test_the_round_line_carries_round_elapsed_and_eta() -> None:
    clock = Clock()
    p = Progress(10, clock=clock)
    row = {"round": 0, "test-loss": 2.3, "test-accuracy": 0.1, "seconds": 1.0}
    progress_line(row, 10, p)
    clock.t = 12.0
    line = progress_line({**row, "round": 3}, 10, p)
    assert line.startswith("[fedadapt] round   3/10 |") and line.endswith("| elapsed 12s, ETA 28s")
    assert "elapsed" not in progress_line(row, 10)  # without a Progress: the line as before


def test_flower_info_lines_are_recognised_and_fedadapts_are_not() -> None:
    assert all(is_flower_info(line) for line in FLOWER_INFO[:-2])  # the last two: Ray's warning (NOISE)
    assert not any(is_flower_info(line) for line in KEPT)


@pytest.mark.parametrize("verbose", [False, True])
def test_stream_view_leaves_flowers_info_out_unless_verbose(verbose: bool) -> None:
    out = io.StringIO()
    view = StreamView(verbose, out=out, tty=False)
    for line in [*FLOWER_INFO, *KEPT]:
        view.write(line)
    view.close()
    shown = out.getvalue().splitlines(keepends=True)
    assert shown == ([*FLOWER_INFO, *KEPT] if verbose else KEPT)  # not a terminal: no bar, the plain lines


def test_on_a_terminal_a_bar_counts_the_rounds() -> None:
    out = io.StringIO()
    view = StreamView(out=out, tty=True)
    for r in range(4):
        view.write(f"[fedadapt] round {r:>3}/3 | test loss 1.0 | elapsed {r}s, ETA {3 - r}s\n")
    assert view.bar is not None and view.bar.n == 3 and view.bar.total == 3
    view.close()
    text = out.getvalue()
    assert "round 2/3" in text and "[fedadapt] round   2/3 | test loss 1.0 | elapsed 2s, ETA 1s" in text


def test_quiet_flower_filters_this_process_logger(caplog: pytest.LogCaptureFixture) -> None:
    from flwr.common import log

    with caplog.at_level(logging.INFO, logger="flwr"):
        for verbose in (False, True):
            with quiet_flower(verbose):
                log(logging.INFO, "[ROUND 1/2] %s", verbose)
                log(logging.INFO, "fedadapt: kept %s", verbose)
                log(logging.WARNING, "warned %s", verbose)
    assert [r.getMessage() for r in caplog.records] == [
        "fedadapt: kept False", "warned False", "[ROUND 1/2] True", "fedadapt: kept True", "warned True"]


@pytest.mark.parametrize("verbose", [False, True])
def test_launcher_verbose_brings_flowers_info_lines_back(verbose, tmp_path, caplog, capsys) -> None:
    cfg = (f"num-server-rounds=2 local-steps=1 min-available-nodes=2 min-train-nodes=2 learning-curve=false "
           f"output-dir='{tmp_path}' run-name='v{int(verbose)}'")
    with caplog.at_level(logging.INFO, logger="flwr"):  # tests/conftest.py keeps Flower's logger at WARNING
        assert main(["sim", "--engine", "inprocess", "--num-supernodes", "2", "--run-config", cfg,
                     *(["--verbose"] if verbose else [])]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("fedadapt: method=fedavg") for m in messages)  # fedadapt's INFO lines: always
    assert any("[ROUND 2/2]" in m for m in messages) == verbose  # Flower's: only with --verbose
    out = capsys.readouterr().out
    assert "[fedadapt] round   2/2 |" in out and "ETA 0s" in out
    assert logging.getLogger("flwr").filters == []  # nothing left behind


def test_help_is_short_options_first_examples_last() -> None:
    text = parser().format_help()
    lines = text.splitlines()
    assert lines[0] == "usage: python -m simulations.launch {sim,deploy,secure} [options]"
    assert len(lines) <= 60, len(lines)
    # a short description, then the options; the examples close it
    assert lines.index("options:") < 12
    examples = lines.index("examples:")
    assert examples > lines.index("deploy / secure:") and len(lines) - examples <= 8
    assert all(line.startswith("  python -m simulations.launch ") for line in lines[examples + 1:] if line)
    for flag in ("--verbose", "--run-config", "--num-supernodes", "--engine", "--nodes", "--seeds"):
        assert flag in text
    # what `python -m simulations.launch --help` prints is this
    res = subprocess.run([sys.executable, "-m", "simulations.launch", "--help"], cwd=APP_DIR, capture_output=True,
                         text=True, timeout=120, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin",
                                                      "PYTHONPATH": str(APP_DIR)})
    assert res.returncode == 0 and res.stdout.splitlines()[0] == lines[0] and "examples:" in res.stdout
