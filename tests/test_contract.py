"""The method contract is declared on the base class and documented where methods are written; settings are read
one way (issue 49, item 4)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flower_strategies.core.hparams import DEFENCES, DP_PROFILE, UNSET, StrategyConfig
from flower_strategies.core.strategy import FedAdaptStrategy

ROOT = Path(__file__).resolve().parents[1]
EXTENDING = ROOT / "docs" / "extending.md"


def table_names(text: str, header: str) -> list[str]:
    """The first column's `names` of the markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(re.match(r"\| `(\w+)", line).group(1))
    return rows


def test_docs_extending_lists_the_declared_method_contract():
    text = EXTENDING.read_text()
    assert table_names(text, "declaration") == list(FedAdaptStrategy.method_contract)
    assert table_names(text, "hook") == list(FedAdaptStrategy.method_hooks)


def test_every_declaration_and_hook_is_declared_and_documented_on_the_base_class():
    source = (ROOT / "flower_strategies" / "core" / "strategy.py").read_text()
    for name in FedAdaptStrategy.method_contract:
        assert name in vars(FedAdaptStrategy), name
        value = vars(FedAdaptStrategy)[name]
        documented = isinstance(value, property) and value.__doc__ or re.search(
            rf"    #: [^\n]*\n(?:    #: [^\n]*\n)*    {name}: ClassVar", source)
        assert documented, f"{name}: no docstring / #: comment on FedAdaptStrategy"
    for name in FedAdaptStrategy.method_hooks:
        assert callable(vars(FedAdaptStrategy)[name]) and vars(FedAdaptStrategy)[name].__doc__, name


def test_no_declaration_is_probed_for():
    """Read as attributes (declared on the base), never ``getattr(obj, "name", default)`` / ``hasattr``."""
    names = "|".join(FedAdaptStrategy.method_contract)
    probe = re.compile(rf"""(getattr|hasattr)\([^,]+,\s*["']({names})["']""")
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for pkg in ("flower_strategies", "server_app", "client_app")
             for p in (ROOT / pkg).rglob("*.py") for m in probe.finditer(p.read_text())]
    assert found == []


@pytest.mark.parametrize("given", [{}, {"defence": "robust"}, {"dp_clip": 1.0}, {"defence": "robust", "aggregator":
                                   "median"}, {"update_norm_ratio": 7.0, "max_weight_ratio": 2.0}])
def test_a_setting_is_read_one_way_the_attribute_is_the_value_the_run_uses(given):
    s = StrategyConfig(**given)
    assert not hasattr(s, "setting")
    for name, unset in UNSET.items():
        value = getattr(s, name)
        if name in given:
            assert value == given[name] and name not in s.decided_by_profile
        elif name == "weighting" and not s.dp_clip:
            assert value == "default"  # the method's own: FedAdaptStrategy.weighting resolves it
        else:
            assert value != unset and name in s.decided_by_profile
            profile = DP_PROFILE if s.dp_clip and name in DP_PROFILE else DEFENCES[s.defence]
            assert value == profile.get(name, 100.0)
    # a copy's profiles decide again what was left to them; what was given stays
    flipped = s.replace(dp_clip=0.0) if s.dp_clip else s.replace(defence="off" if s.defence == "robust" else "robust")
    for name in set(DEFENCES["off"]) - set(given):
        assert getattr(flipped, name) == DEFENCES[flipped.defence][name]
    for name in set(given) & set(UNSET):
        assert getattr(flipped, name) == given[name]
    if s.dp_clip:
        assert (flipped.weighting, flipped.update_norm_ratio) == ("default", 100.0)


def test_the_strategy_base_stays_within_350_lines():
    """The foundation's limit: cohesive parts live in their own modules (evaluation, references, strategy_settings,
    rounds, records), not in the base."""
    assert len((ROOT / "flower_strategies" / "core" / "strategy.py").read_text().splitlines()) <= 350
