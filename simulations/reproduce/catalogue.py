"""The reproduction catalogue: data settings and each paper's comparison set, read from the TOML files in
``catalogue/``.

``catalogue/settings.toml``::

    common = {batch-size = 32, ...}                  # run-config keys of every run
    [settings.<name>]
    run-config = {task = ..., partitioner = ...}     # the setting's run-config keys
    target = 0.3                                     # optional: test accuracy for "rounds to target"
    describe = "..."; clients = "..."                # optional: wording of plot titles / table headers
    prepare = "..."                                  # optional: the command that prepares the setting's data
    engine = "inprocess"                             # optional: the in-process engine (default vectorized)

``catalogue/<paper>.toml`` (one per paper, the file name is its key)::

    title = "..."; settings = ["dir0.3", ...]        # first = the quick / main setting
    target = 0.8; num-nodes = 10                     # optional (these defaults)
    extra = {fraction-train = 0.5}                   # optional: run-config keys of every entry
    entries = [{label = "fedadam", method = "fedadam", client-lr = 0.1, "fedadam.server-lr" = 0.03}, ...]
    presets = "fedlocal"                             # instead of entries: the tables of simulations/presets/<name>.toml
    claims = [{better = "a", worse = "b", metric = "<results column>", text = "..."}, ...]
    [setting-entries]
    shakespeare = [...]                              # optional: entries used instead on a setting
    [sweep]                                          # optional: the paper's own lr grids and selection rule
    metric = "mean_test_accuracy_last"               # the results column the sweep ranks by (higher is better
                                                     # for accuracies, lower for losses); default: the suite's rule
    grids = {fed-lamb = {client-lr = [...], "fedlamb.weight-decay" = [0.0, 0.1]}, ...}   # per label: the product

Entries name registry methods; keys of a method that is not registered (yet) are never read.  A run-config is
``common`` < the paper's ``extra`` < the setting's ``run-config`` < the entry's keys.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CATALOGUE_DIR = Path(__file__).parent / "catalogue"
PRESETS_DIR = Path(__file__).parent.parent / "presets"
SHAKESPEARE_TASK = "shakespeare-lstm"


def load(name: str) -> dict[str, Any]:
    return tomllib.loads((CATALOGUE_DIR / name).read_text())


@dataclass(frozen=True)
class Setting:
    """A data setting: run-config keys plus how to describe it and whether its data are available."""

    name: str
    run_config: Mapping[str, Any]
    target: float | None = None
    describe: str = ""
    clients: str = ""
    prepare: str = ""
    #: ``vectorized`` (clients stacked) or ``inprocess`` (one after another): equal results for models without
    #: dropout; a CNN trains faster one client at a time on a CPU (stacked convolutions become grouped ones).
    engine: str = "vectorized"

    @property
    def task(self) -> str:
        return str(self.run_config["task"])

    def title(self) -> str:
        """Data wording for plot titles: ``digits (dir0.3)`` or the setting's own ``describe``."""
        return self.describe or f"digits ({self.name})"

    def ready(self) -> str | None:
        """``None`` when the setting's data are available, else why not and how to fix it."""
        if self.task.startswith("mnist-"):
            from app_common.mnist import DEFAULT_DATA_DIR as MNIST_DIR
            from app_common.mnist import MnistCorrupt, MnistMissing, load

            try:
                load(MNIST_DIR)
            except (MnistMissing, MnistCorrupt) as err:
                return f"MNIST not prepared: {self.prepare} ({type(err).__name__})"
            return None
        if self.task != SHAKESPEARE_TASK:
            return None
        from app_common.shakespeare import DEFAULT_DATA_DIR, cache_file

        try:
            cache_file(DEFAULT_DATA_DIR)
        except FileNotFoundError:
            return f"Shakespeare cache not prepared: {self.prepare}"
        return None

    def nodes(self, default: int) -> int:
        """Clients of the federation: ``default`` (the paper's) or every prepared Shakespeare client."""
        if self.task != SHAKESPEARE_TASK:
            return default
        from app_common.shakespeare import DEFAULT_DATA_DIR, num_clients

        return num_clients(DEFAULT_DATA_DIR)


@functools.cache
def _settings_file() -> dict[str, Any]:
    return load("settings.toml")


def common() -> dict[str, Any]:
    """Run-config keys of every run."""
    return dict(_settings_file()["common"])


def settings() -> dict[str, Setting]:
    return {name: Setting(name, **{k.replace("-", "_"): v for k, v in s.items()})
            for name, s in _settings_file()["settings"].items()}


@dataclass(frozen=True)
class Entry:
    """One line of a paper's comparison: a label and run-config overrides (must include ``method``)."""

    label: str
    overrides: Mapping[str, Any]

    @property
    def method(self) -> str:
        return str(self.overrides["method"])


@dataclass(frozen=True)
class Claim:
    """The paper's direction of effect: ``better`` beats ``worse`` on ``metric`` (mean over seeds)."""

    better: str
    worse: str
    metric: str  # a results column; higher is better for accuracies, lower for losses / rounds
    text: str


@dataclass(frozen=True)
class Paper:
    key: str
    title: str
    settings: tuple[str, ...]  # first = the quick / main setting
    entries: tuple[Entry, ...]
    claims: tuple[Claim, ...] = ()
    target: float = 0.8  # test accuracy for "rounds to target"
    num_nodes: int = 10
    extra: Mapping[str, Any] = field(default_factory=dict)  # run-config keys for every entry of the paper
    #: Entries used instead of :attr:`entries` on a setting (e.g. Shakespeare: fewer entries, other lrs).
    setting_entries: Mapping[str, tuple[Entry, ...]] = field(default_factory=dict)
    #: The paper's own sweep: ranking column (``""``: the suite's rule) and per label the run-config keys and values
    #: swept as a product (``catalogue/<paper>.toml [sweep]``); labels without a grid use ``sweep.toml``'s rules.
    sweep_metric: str = ""
    sweep_grids: Mapping[str, Mapping[str, tuple[Any, ...]]] = field(default_factory=dict)

    def entries_for(self, setting: str) -> tuple[Entry, ...]:
        return self.setting_entries.get(setting, self.entries)

    def claims_for(self, setting: str) -> tuple[Claim, ...]:
        """The claims whose two sides are both entries on ``setting``."""
        labels = {e.label for e in self.entries_for(setting)}
        return tuple(c for c in self.claims if c.better in labels and c.worse in labels)

    def target_for(self, setting: str) -> float:
        own = settings()[setting].target if setting in settings() else None
        return self.target if own is None else own

    def nodes_for(self, setting: str) -> int:
        return settings()[setting].nodes(self.num_nodes)


def _entries(rows: list[Mapping[str, Any]]) -> tuple[Entry, ...]:
    return tuple(Entry(str(r["label"]), {k: v for k, v in r.items() if k != "label"}) for r in rows)


def load_paper(path: Path) -> Paper:
    d = tomllib.loads(path.read_text())
    if "presets" in d:
        table = tomllib.loads((PRESETS_DIR / f"{d['presets']}.toml").read_text())
        entries = tuple(Entry(name, dict(keys)) for name, keys in table.items())
    else:
        entries = _entries(d["entries"])
    return Paper(
        path.stem, d["title"], tuple(d["settings"]), entries,
        claims=tuple(Claim(**c) for c in d.get("claims", ())),
        target=float(d.get("target", 0.8)), num_nodes=int(d.get("num-nodes", 10)), extra=dict(d.get("extra", {})),
        setting_entries={s: _entries(rows) for s, rows in d.get("setting-entries", {}).items()},
        sweep_metric=str(d.get("sweep", {}).get("metric", "")),
        sweep_grids={label: {k: tuple(v) for k, v in keys.items()}
                     for label, keys in d.get("sweep", {}).get("grids", {}).items()},
    )


def papers() -> dict[str, Paper]:
    """Every paper of ``catalogue/`` by key (``000`` … ``004``, ``004-mnist``)."""
    return {p.stem: load_paper(p) for p in sorted(CATALOGUE_DIR.glob("[0-9]*.toml"), key=lambda p: p.stem)}


def run_config_for(paper: Paper, setting: str, entry: Entry, seed: int, rounds: int, out_dir: Path,
                   overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run-config of one run: common < paper extra < setting < entry < ``overrides`` (e.g. a sweep's lrs)."""
    cfg: dict[str, Any] = {**common(), **paper.extra, **settings()[setting].run_config, **entry.overrides,
                           **(overrides or {})}
    cfg.update({"seed": seed, "num-server-rounds": rounds, "output-dir": str(out_dir),
                "run-name": f"{safe(entry.label)}-seed{seed}"})
    return cfg


def safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)


def registered() -> Mapping[str, Any]:
    """The method registry of this installation (the registry registers every method the library ships)."""
    from flower_strategies.core.registry import METHODS

    return METHODS
