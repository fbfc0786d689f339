"""The method registry: run-config ``method`` name → strategy class (+ its local optimizer and hyper-parameters).

A method is one strategy class; an alias (``localadam``, ``fedda-adam``, ``fedadam``) is a registry name with
other field defaults.  Where users want a class name for an alias (``from flower_strategies import FedAdam``), the
alias is a plain subclass that names itself and states its defaults in its body, and nothing else::

    class FedAdam(FedOpt):
        method: ClassVar[str] = "fedadam"
        hparam_defaults = {"server_opt": "adam", "server_lr": 0.01}

    register(FedAdam, paper=..., summary=...)                                    # "fedadam"

``FedAdam()`` takes those defaults (``FedAdaptStrategy.make_hparams``), and so does its registry name.  An alias
without a class is a name with :func:`register`'s keyword arguments::

    register(FedLADA, name="localadam", amend_weight=1.0, paper=..., summary=...)

Run-config keys (``<name>.<field-with-dashes>``), wire keys (the same), pyproject's config table, the docs'
tables and the optimizer's keyword arguments all derive from the strategy's ``hparams_class``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .hparams import ConfigError, HParams, StrategyConfig
from .local import LocalOptimizer, add_local_optimizer, has_client_half
from .strategy import FedAdaptStrategy


@dataclass(frozen=True)
class MethodSpec:
    name: str
    strategy: type[FedAdaptStrategy]
    paper: str
    summary: str
    #: Field defaults of this registry name that differ from the declaration's (an alias's), by field name.
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def hparams(self) -> type[HParams]:
        return self.strategy.hparams_class

    @property
    def local_optimizer(self) -> type[LocalOptimizer]:
        return self.strategy.local_optimizer

    def default_hparams(self) -> HParams:
        return self.hparams().replace(**self.overrides)

    def defaults(self) -> dict[str, Any]:
        """This name's run-config keys with their defaults."""
        return self.hparams.defaults(self.name, self.overrides)

    def hparams_from_run_config(self, run_config: Mapping[str, Any]) -> HParams:
        return self.hparams.from_run_config(run_config, self.name, self.overrides)

    @property
    def needs_client_half(self) -> bool:
        """Whether this method (with its default hyper-parameters) needs its client half in your ClientApp."""
        return has_client_half(self.local_optimizer, self.default_hparams().client_values())

    @property
    def client_lr_factor(self) -> float:
        """The client lr to start from, as a multiple of an app's own SGD lr (:data:`CLIENT_LR_FACTOR`)."""
        return CLIENT_LR_FACTOR.get(self.name, 1.0)

    def build(self, hparams: HParams | None = None, **kwargs: Any) -> FedAdaptStrategy:
        """The strategy under this name (``hparams`` default: this name's defaults)."""
        return self.strategy(self.default_hparams() if hparams is None else hparams, method=self.name, **kwargs)


METHODS: dict[str, MethodSpec] = {}

#: Client lr to start from per method, as a multiple of the SGD(-momentum) lr an app already uses (1.0 where absent),
#: measured on an app of Flower quickstart-pytorch's shape (its CNN, DataLoader and momentum-SGD loop at lr 0.1) in
#: short runs — 5 nodes × 5 rounds and 10 × 10, seeds 0–3 and one unseeded start each — against stock FedAvg from the
#: same initial model: the factor whose runs never stall at one predicted class (nor diverge) and most often end
#: within 0.05 of stock FedAvg — ``python -m simulations.tools.plugin_factors``, docs/results/plugin-factors.md.
#: ``fedavg`` / ``fedavgm`` keep the app's own momentum SGD (×1: stock FedAvg's lr; ×3 oscillated into one class);
#: ``fedams`` and ``localadam`` (local AMSGrad) blow up at ×1 (localadam stalls at one class at ×0.1); the plain-SGD
#: local steps want ×3–×30 (they replace SGD with momentum 0.9).
CLIENT_LR_FACTOR: dict[str, float] = {
    "fedams": 0.1, "localadam": 0.03,
    "fedprox": 3.0, "scaffold": 3.0, "fedlocal": 3.0, "fedlocal-sync": 3.0, "localupdatedecay": 3.0,
    "fedda": 10.0, "fedda-sgdm": 10.0, "fedda-adam": 10.0, "fedda-adagrad": 10.0,
    "fedcm": 30.0, "mimelite": 30.0,
}


def register(
    strategy: type[FedAdaptStrategy], *, name: str | None = None, paper: str, summary: str, **overrides: Any
) -> MethodSpec:
    """Register ``strategy`` under ``name`` (default: its ``method``).  The name's field defaults: the class's
    :attr:`~FedAdaptStrategy.hparam_defaults`, then ``overrides`` (by field name), which only a name other than the
    class's own takes (an alias without a class; the class's own defaults are stated in its body)."""
    name = name or strategy.method
    if not name or name in METHODS:
        raise ValueError(f"method name {name!r} is empty or already registered")
    if overrides and name == strategy.method:
        raise TypeError(f"register({strategy.__name__}, {', '.join(f'{k}=...' for k in overrides)}): state "
                        f"{strategy.__name__}'s own defaults in its class body (hparam_defaults = {{...}})")
    client = set(strategy.hparams_class.client_fields())
    opt_client = set(strategy.local_optimizer.hparams_class.client_fields())
    if client != opt_client:
        raise TypeError(
            f"{strategy.__name__}'s client fields {sorted(client)} differ from its optimizer's {sorted(opt_client)}"
        )
    spec = MethodSpec(name, strategy, paper, summary, {**strategy.hparam_defaults, **overrides})
    spec.default_hparams()  # validates the defaults now, not at the first run
    add_local_optimizer(strategy.local_optimizer)  # a client finds it by the name its rounds send
    METHODS[name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}") from None


def did_you_mean(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str:
    """``"did you mean 'a' or 'b'?"``: the (at most 3) close matches of ``word`` among ``candidates``
    (:func:`difflib.get_close_matches`), never the whole list."""
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=cutoff)
    return f"did you mean {' or '.join(map(repr, close))}?" if close else "no close match"


def run_config_defaults(settings: type[StrategyConfig] = StrategyConfig) -> dict[str, Any]:
    """Every run-config key ``settings`` and the registered methods accept, with its default."""
    out = settings.defaults(None)
    for spec in METHODS.values():
        out.update(spec.defaults())
    return out


def parse_run_config(
    run_config: Mapping[str, Any], settings: type[StrategyConfig] = StrategyConfig, *, ignore_unknown: bool = False
) -> tuple[StrategyConfig, MethodSpec, HParams]:
    """Validate a run-config; raise :class:`ConfigError` naming the valid choices on any problem.

    ``ignore_unknown=True`` reads only the keys it knows (for a user's app with run-config keys of its own).
    """
    known = run_config_defaults(settings)
    unknown = sorted(set(run_config) - set(known))
    if unknown and not ignore_unknown:
        hints = "; ".join(f"{k!r}: {did_you_mean(k, known)}" for k in unknown)
        raise ConfigError(f"unknown run-config key(s) {unknown} ({hints})")
    ours = settings.keys(None)
    fed = settings.from_run_config({k: v for k, v in run_config.items() if k in ours}, None)
    spec = get_method(fed.method)
    hp = spec.hparams_from_run_config(run_config)
    # A key of another method that differs from its default is a mistake (e.g. a FedDA flag on a FedAvg run).
    # (Flower passes every declared key with its default, so only changed values can be detected.)
    foreign = sorted(
        key for name, other in METHODS.items() if name != spec.name
        for key, default in other.defaults().items()
        if key in run_config and run_config[key] != default
    )
    if foreign:
        raise ConfigError(
            f"run-config key(s) {foreign} belong to other methods, but method = {spec.name!r}; "
            f"{spec.name}'s keys are: {', '.join(spec.defaults()) or '(none)'}"
        )
    return fed, spec, hp


def build_strategy(
    run_config: Mapping[str, Any],
    trainable_keys: list[str] | None = None,
    settings: type[StrategyConfig] = StrategyConfig,
    *,
    ignore_unknown: bool = False,
) -> tuple[FedAdaptStrategy, StrategyConfig]:
    """Build the configured strategy from a run-config (validated by :func:`parse_run_config`)."""
    fed, spec, hp = parse_run_config(run_config, settings, ignore_unknown=ignore_unknown)
    return spec.build(hp, settings=fed, trainable_keys=trainable_keys, num_rounds=fed.num_server_rounds), fed


def strategy_from_run_config(
    run_config: Mapping[str, Any],
    *,
    method: str | None = None,
    names: Mapping[str, str] | None = None,
    trainable_keys: list[str] | None = None,
    app_keys: Iterable[str] = (),
    **overrides: Any,
) -> FedAdaptStrategy:
    """A strategy from a Flower app's own ``context.run_config``, reading only the keys it knows.

    ``method``: the registry name (default: the run-config's ``method`` key).  ``names`` maps the app's own keys
    to fedadapt's, e.g. ``{"learning-rate": "client-lr", "local-epochs": "local-epochs", "batch-size":
    "batch-size"}``; every other key of the app is ignored.  Method keys are ``<method>.<key>`` (print the lines
    to declare with ``python -m flower_strategies.config <method>``).  ``overrides``: strategy keyword arguments
    (e.g. ``fraction_evaluate=0.0``).  Unlike fedadapt's own app (which evaluates centrally), the default
    ``fraction_evaluate`` here is Flower's 1.0: your ClientApp's ``@app.evaluate()`` runs on every node each round
    unless the run-config sets ``fraction-evaluate``.

    Strict (:class:`ConfigError`, naming the close matches): an unknown method, a ``names`` entry whose app key
    is not in the run-config or whose fedadapt key is not a strategy key, a ``<method>.<key>`` that the method
    does not have, and a key that looks like a misspelled fedadapt key (``client-lrr``, ``fedlda.amend-weight``).
    ``app_keys``: your app's own keys that the last check would take for a misspelling.
    """
    ours = StrategyConfig.keys(None)
    names = dict(names or {})
    for theirs, key in names.items():
        if key not in ours:
            raise ConfigError(f"names maps {theirs!r} to {key!r}, which is not a strategy key; "
                              f"{did_you_mean(key, ours)} (the strategy keys: {', '.join(sorted(ours))})")
        if theirs not in run_config:
            raise ConfigError(f"names maps {theirs!r} to {key!r}, but the run-config has no key {theirs!r}; "
                              f"{did_you_mean(theirs, run_config)} (the run-config's keys: "
                              f"{', '.join(sorted(run_config)) or 'none'})")
    name = str(method if method is not None else run_config.get("method", "fedavg"))
    if name not in METHODS:
        where = "" if method is not None else " (run-config key 'method')"
        raise ConfigError(f"unknown method {name!r}{where}; {did_you_mean(name, METHODS)} "
                          "(`python -m flower_strategies.config --list` lists the methods)")
    check_key_spelling(run_config, exempt=set(names) | set(app_keys))
    config = {k: v for k, v in run_config.items() if k.startswith(name + ".") or k in ours}
    for theirs, key in names.items():
        config[key] = run_config[theirs]
    config["method"] = name
    fed, spec, hp = parse_run_config(config)
    if "fraction-evaluate" not in config:
        fed = fed.replace(fraction_evaluate=1.0)  # Flower's default for its own strategies
    overrides = {"num_rounds": fed.num_server_rounds, **overrides}
    return spec.build(hp, settings=fed, trainable_keys=trainable_keys, **overrides)


#: How close (:func:`difflib.get_close_matches` ratio) an app's key must be to a fedadapt key or method name to be
#: taken for a misspelling of it (``client-lrr`` ≈ ``client-lr``: 0.95; ``fraction-fit`` ≉ ``fraction-train``).
MISSPELLING_CUTOFF = 0.85


def check_key_spelling(run_config: Mapping[str, Any], exempt: Iterable[str] = ()) -> None:
    """Raise :class:`ConfigError` for every key of ``run_config`` (less ``exempt``) that is a ``<method>.<key>`` the
    registered method does not have, or looks like a misspelled strategy key or method prefix; each is listed with
    its close matches only."""
    ours = StrategyConfig.keys(None)
    skip = set(exempt)
    problems: list[str] = []
    for key in sorted(set(run_config) - skip - set(ours)):
        prefix, dot, _ = key.partition(".")
        if dot and prefix in METHODS:
            own = METHODS[prefix].defaults()
            if key not in own:
                problems.append(f"{key!r} is not a key of method {prefix}: {did_you_mean(key, own)}")
        elif dot:
            close = difflib.get_close_matches(prefix, list(METHODS), n=3, cutoff=MISSPELLING_CUTOFF)
            if close:
                keys = [k for m in close for k in METHODS[m].defaults()]
                problems.append(f"{key!r}: {prefix!r} is not a method; {did_you_mean(key, keys)}")
        elif difflib.get_close_matches(key, list(ours), n=1, cutoff=MISSPELLING_CUTOFF):
            problems.append(f"{key!r} is not a strategy key: {did_you_mean(key, ours, MISSPELLING_CUTOFF)}")
    if problems:
        raise ConfigError("run-config key(s) that look misspelled: " + "; ".join(problems)
                          + " (a key of your app's own: pass it in app_keys=)")


def config_lines(method: str) -> str:
    """The ``[tool.flwr.app.config]`` lines an app declares to set ``method``'s keys with ``--run-config``."""
    from .hparams import toml_value

    spec = get_method(method)
    lines = [f"# fedadapt: {spec.name} ({spec.summary})", f'method = "{spec.name}"']
    lines += [f"{k} = {toml_value(v)}" for k, v in spec.defaults().items()]
    return "\n".join(lines)


# ------------------------------------------------------------------ the built-in methods
# Registered here, where METHODS is defined, so that it is complete whoever reads it and however fedadapt was
# imported (the method modules import nothing of this module; a plug-in method calls register() itself).
from ..methods import (  # noqa: E402
    baselines, fedcm, fedda, fedlada, fedlamb, fedlocal, localupdate, mimelite, scaffold,
)

# baselines.py
_BASELINES_REDDI = "Reddi et al., Adaptive Federated Optimization, ICLR 2021"
register(baselines.FedAvg, paper="McMahan et al., AISTATS 2017", summary="local SGD + (weighted) model averaging")
register(baselines.FedAvgM, paper="Hsu et al., 2019", summary="FedAvg + server heavy-ball momentum")
register(baselines.FedAdagrad, paper=_BASELINES_REDDI, summary="local SGD + server AdaGrad")
register(baselines.FedAdam, paper=_BASELINES_REDDI, summary="local SGD + server Adam")
register(baselines.FedYogi, paper=_BASELINES_REDDI, summary="local SGD + server Yogi")
register(baselines.FedProx, paper="Li et al., MLSys 2020", summary="local SGD with proximal term + FedAvg")
# fedlocal.py
_FEDLOCAL_PAPER = (
    "Wang, Xu, Garrett, Charles, Liu, Joshi: Local Adaptivity in Federated Learning: Convergence and Consistency, 2021"
)
register(
    fedlocal.FedLocal, paper=_FEDLOCAL_PAPER,
    summary="restarted local SGD/SGDM/AdaGrad/Adam/Yogi + none/local/joint correction + FedOpt server",
)
register(
    fedlocal.FedLocalSync, paper=_FEDLOCAL_PAPER,
    summary="FedLocal with server-averaged client optimizer states (paper's comparison; extra communication)",
)
# fedda.py
_FEDDA_PAPER = "Jin et al., Accelerated Federated Learning with Decoupled Adaptive Optimization, ICML 2022"
register(fedda.FedDA, paper=_FEDDA_PAPER,
         summary="local SGD + decoupled global momentum; server SGDM/Adam/AdaGrad (fedda.variant)")
register(fedda.FedDASGDM, paper=_FEDDA_PAPER, summary="FedDA with server SGDM (Algorithm 1)")
register(fedda.FedDAAdam, paper=_FEDDA_PAPER, summary="FedDA with server Adam on the recovered gradient (Algorithm 2)")
register(fedda.FedDAAdagrad, paper=_FEDDA_PAPER,
         summary="FedDA with server AdaGrad on the recovered gradient (Algorithm 2)")
# fedlada.py
_FEDLADA_PAPER = (
    "Sun et al., Efficient Federated Learning via Local Adaptive Amended Optimizer with Linear Speedup, 2023"
)
register(fedlada.FedLADA, paper=_FEDLADA_PAPER, summary="local AMSGrad amended by the global offset g_a + averaged v̂")
register(fedlada.FedLADA, name="localadam", amend_weight=1.0, paper=_FEDLADA_PAPER,
         summary="FedLADA with α = 1: local AMSGrad + model/v̂ averaging")
# fedcm.py
register(
    fedcm.FedCM,
    paper="Xu et al., FedCM: Federated Learning with Client-level Momentum, 2021 (baseline of paper 002)",
    summary="local SGD on α·g + (1−α)·Δ_t (broadcast global update) + model averaging",
)
# scaffold.py
register(
    scaffold.Scaffold,
    paper="Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020",
    summary="SGD corrected by control variates (option II, persistent c_i) + model averaging",
)
# localupdate.py
_LOCALUPDATE_PAPER = "Charles & Konečný, On the Outsized Importance of Learning Rates in Local Update Methods, 2020"
register(localupdate.LocalUpdate, paper=_LOCALUPDATE_PAPER,
         summary="clients upload Θ-weighted sums of local gradients; server step η (or FedOpt) on their mean")
register(localupdate.LocalUpdateDecay, paper=_LOCALUPDATE_PAPER,
         summary="LocalUpdate + decay of client/server lr on training-loss plateaus (window, patience, cooldown)")
# fedlamb.py
_FEDLAMB_PAPER = "Karimi, Li, Li: FED-LAMB: Layer-wise and Dimension-wise Locally Adaptive Optimization (2021)"
register(fedlamb.FedLAMB, paper=_FEDLAMB_PAPER,
         summary="local AMSGrad + LAMB trust ratio; model averaging + max-merged v̂")
register(fedlamb.FedAMS, paper="Chen et al. 2020, as used in " + _FEDLAMB_PAPER,
         summary="local AMSGrad; model averaging + max-merged v̂")
register(fedlamb.AdpFed, paper="Reddi et al. 2021, as written in " + _FEDLAMB_PAPER,
         summary="FedAdam with paper 004's settings (v₀ = 0, β2 = 0.999)")
# mimelite.py
register(
    mimelite.MimeLite,
    paper="Karimireddy et al., Mime: Mimicking Centralized Stochastic Algorithms in Federated Learning, ICLR 2021",
    summary=(
        "local steps with frozen server optimizer statistics; server averages models, updates stats with full gradients"
    ),
)
