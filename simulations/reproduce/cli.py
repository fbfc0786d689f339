"""``python -m simulations.reproduce``: argument parsing and the five commands (paper/all, sweep, theory, report)."""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import __doc__ as DOC
from .catalogue import Entry, Paper, papers, registered, settings
from .report import markdown_table, rewrite, write_outputs, write_summary
from .runner import Progress, run_grid
from .sweep import PARAMS, overrides_from_sweep, sweep, sweep_for
from .theory import theory

DEFAULT_OUT = Path("outputs") / "reproduce"


def reproduce(keys: Sequence[str], *, quick: bool, seeds: int, rounds: int | None, out: Path,
              lrs_from: Sequence[Path] | None = None, command: str = "",
              only_settings: Sequence[str] | None = None, jobs: int = 1,
              labels: Sequence[str] = (), keys_set: Mapping[str, Any] | None = None) -> dict[str, dict[str, Path]]:
    """Run the papers ``keys`` on their settings (quick: the first only); write every output; return the files.
    ``labels``: only these entries (every entry when empty); ``keys_set``: run-config keys set on the entries
    (:func:`with_keys`)."""
    table = {k: with_keys(only_labels(p, labels), keys_set or {}) for k, p in papers().items()}
    plan: list[tuple[Paper, str]] = [
        (table[k], s) for k in keys for s in (table[k].settings[:1] if quick else table[k].settings)
        if not only_settings or s in only_settings
    ]
    seed_list = list(range(seeds))
    methods = registered()
    prog = Progress(sum(sum(1 for e in p.entries_for(s) if e.method in methods) * len(seed_list) for p, s in plan))
    sweeps = [json.loads(Path(f).read_text()) for f in (lrs_from or ())]
    written: dict[str, dict[str, Path]] = {}
    t0 = time.monotonic()
    for p, setting in plan:
        mine = sweep_for(sweeps, p.key, setting)
        sub = out / p.key / setting
        results = run_grid(p, setting, seed_list, rounds or (8 if quick else 50), sub,
                           overrides_from_sweep(mine) if mine else None, prog, jobs)
        written[f"{p.key}/{setting}"] = write_outputs(p, setting, results, sub, command, quick=quick)
        print(markdown_table(p, setting, results, command, quick), flush=True)
    print(f"[reproduce] {prog.done} runs in {time.monotonic() - t0:.1f}s → {out} (claims: {write_summary(out)})",
          flush=True)
    return written


def only_labels(paper: Paper, labels: Sequence[str]) -> Paper:
    """``paper`` with only the entries labelled ``labels`` (all of them when empty); its claims stay, and a claim
    whose two sides are not both run is left out of the tables (:meth:`Paper.claims_for`)."""
    if not labels:
        return paper
    keep = lambda entries: tuple(e for e in entries if e.label in labels)  # noqa: E731
    return dataclasses.replace(paper, entries=keep(paper.entries),
                               setting_entries={s: keep(v) for s, v in paper.setting_entries.items()})


def with_keys(paper: Paper, keys: Mapping[str, Any]) -> Paper:
    """``paper`` with run-config ``keys`` set on its entries: a method's own key (``fedlamb.layers``) on the entries
    of that method only, any other key on every entry (over the entry's own value)."""
    if not keys:
        return paper

    def entry(e: Entry) -> Entry:
        mine = {k: v for k, v in keys.items() if "." not in k or k.partition(".")[0] == e.method}
        return Entry(e.label, {**e.overrides, **mine})

    return dataclasses.replace(paper, entries=tuple(map(entry, paper.entries)), setting_entries={
        s: tuple(map(entry, v)) for s, v in paper.setting_entries.items()})


def parse_keys(pairs: Sequence[str]) -> dict[str, Any]:
    """``["fedlamb.layers=module", "seed=3"]`` → run-config values (TOML values; a bare word is a string)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set takes KEY=VALUE, got {pair!r}")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value.strip()
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m simulations.reproduce", description=DOC.splitlines()[0])
    ap.add_argument("what", help="paper key (000..004), 'all', 'sweep', 'theory' or 'report' (re-tabulate --out)")
    ap.add_argument("paper", nargs="?", help="for 'sweep': the paper key")
    ap.add_argument("--quick", action="store_true", help="first data setting only, 8 rounds (CI-sized)")
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds 0..N-1 (default 3, quick 2)")
    ap.add_argument("--rounds", type=int, default=None, help="server rounds (default 50, quick 8; sweep 20)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--setting", default=None,
                    help="data setting(s), comma-separated (sweep: one, default the paper's first; "
                         f"a run: only these); of {', '.join(settings())}")
    ap.add_argument("--lrs", default=None,
                    help="sweep: comma-separated client lrs for every entry (default: per-entry grid)")
    ap.add_argument("--param", default="both", choices=PARAMS,
                    help="sweep: which learning rates to sweep "
                         "(default both: client × server for server-tuned methods)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a run-config key set on every entry (a method's own key: on that method's entries); "
                         "repeatable, e.g. --set fedlamb.layers=module")
    ap.add_argument("--labels", default="",
                    help="comma-separated entry labels: run (or sweep) only these entries of the paper")
    ap.add_argument("--thin", type=int, default=0,
                    help="sweep: at most N values of each client-lr grid and of each key of a paper's own grids, "
                         "evenly spread with both ends kept (default 0: the whole grids)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs in parallel worker processes (default 1; 2 on a 2-core machine halves the wall time)")
    ap.add_argument("--lrs-from", type=Path, action="append", default=None,
                    help="use the learning rates chosen in a sweep.json (repeatable: one per paper/setting)")
    return ap


def cmd_theory(args: argparse.Namespace, ap: argparse.ArgumentParser, command: str) -> int:
    for path in theory(args.out / "theory"):
        print(f"wrote {path}")
    return 0


def cmd_report(args: argparse.Namespace, ap: argparse.ArgumentParser, command: str) -> int:
    for folder in rewrite(args.out):
        print(f"rewrote {folder}")
    print(f"wrote {write_summary(args.out)}")
    return 0


def cmd_sweep(args: argparse.Namespace, ap: argparse.ArgumentParser, command: str) -> int:
    table = papers()
    if args.paper not in table:
        ap.error(f"sweep needs a paper key: one of {', '.join(table)}")
    p = only_labels(table[args.paper], [x for x in args.labels.split(",") if x])
    setting = args.setting or p.settings[0]
    if setting not in p.settings:
        ap.error(f"paper {p.key} has no setting {setting!r}; its settings: {', '.join(p.settings)}")
    if why := settings()[setting].ready():
        print(f"[reproduce] cannot sweep {p.key}/{setting}: {why}", file=sys.stderr)
        return 2
    grid = [float(v) for v in args.lrs.split(",")] if args.lrs else None
    res = sweep(p, setting, list(range(args.seeds or 2)), args.rounds or (8 if args.quick else 20),
                args.out / "sweep" / p.key / setting, grid, args.param, args.jobs, args.thin)
    for label, c in res["chosen"].items():
        edge = f"  [at grid edge: {', '.join(c['at_edge'])}]" if c["at_edge"] else ""
        print(f"{label}: {', '.join(f'{k} {v:g}' for k, v in c['overrides'].items())}{edge}")
    return 0


def cmd_run(args: argparse.Namespace, ap: argparse.ArgumentParser, command: str) -> int:
    table = papers()
    keys = list(table) if args.what == "all" else [args.what]
    if any(k not in table for k in keys):
        ap.error(f"unknown paper {args.what!r}; choose one of {', '.join(table)}, all, sweep, theory")
    only = args.setting.split(",") if args.setting else []
    if bad := [x for x in only if x not in settings()]:
        ap.error(f"unknown setting(s) {', '.join(bad)}; choose from {', '.join(settings())}")
    if only and not any(x in table[k].settings for k in keys for x in only):
        ap.error(f"no selected paper has setting(s) {args.setting!r}")
    reproduce(keys, quick=args.quick, seeds=args.seeds or (2 if args.quick else 3), rounds=args.rounds, out=args.out,
              lrs_from=args.lrs_from, command=command, only_settings=only, jobs=args.jobs,
              labels=[x for x in args.labels.split(",") if x], keys_set=parse_keys(args.set))
    return 0


COMMANDS = {"theory": cmd_theory, "report": cmd_report, "sweep": cmd_sweep}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    args = ap.parse_args(argv)
    command = "python -m simulations.reproduce " + " ".join(argv)
    return COMMANDS.get(args.what, cmd_run)(args, ap, command)
