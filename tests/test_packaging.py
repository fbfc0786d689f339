"""What a user's ``pip install`` of the library brings: what the library imports, as ranges; the app and the tools as
extras; the exact versions CI tests in constraints.txt.  The wheel itself (``python -m build``, ``twine check``) and
the install into a project that already has its own Flower and torch run in ``.ci/compat``."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

from flower_strategies.core.hparams import ConfigError, StrategyConfig

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

#: What the library (``flower_strategies``) may import outside the standard library, and whether at module level.
LIBRARY_IMPORTS = {"flwr": True, "torch": True, "numpy": True, "dp_accounting": False}
#: Distributions that belong to the app or the tools, never to the library's base requirements.
APP_ONLY = {"ray", "torchvision", "flwr-datasets", "datasets", "scikit-learn", "matplotlib", "dp-accounting",
            "tensorboard"}


def requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def library_imports() -> dict[str, bool]:
    """``{top-level module: imported at module level somewhere}`` for every non-stdlib import of the library."""
    found: dict[str, bool] = {}
    for path in (ROOT / "flower_strategies").rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "flower_strategies":
                    found[top] = found.get(top, False) or id(node) in top_level
    return found


def test_the_library_imports_only_flower_torch_numpy_and_lazily_the_dp_accountant():
    found = library_imports()
    assert set(found) <= set(LIBRARY_IMPORTS), sorted(set(found) - set(LIBRARY_IMPORTS))
    assert not [m for m, eager in found.items() if eager and not LIBRARY_IMPORTS[m]]  # dp_accounting: lazily only


def test_base_requirements_are_ranges_of_what_the_library_imports():
    base = PROJECT["dependencies"]
    assert {requirement_name(r) for r in base} == {"flwr", "torch", "numpy"}
    assert not [r for r in base if "==" in r or "[" in r], base  # no pins, no flwr[simulation] (Ray)
    flwr = next(r for r in base if requirement_name(r) == "flwr")
    assert re.search(r">=\s*1\.\d+", flwr) and "<2" in flwr.replace(" ", "")  # a tested floor, below the next major
    assert not APP_ONLY & {requirement_name(r) for r in base}


def test_the_app_and_the_tools_are_extras_and_dev_installs_the_app():
    extras = PROJECT["optional-dependencies"]
    assert extras["dp"] and requirement_name(extras["dp"][0]) == "dp-accounting"
    assert "fedadapt[dp,data]" in extras["app"] and "flwr[simulation]" in extras["app"]
    assert any(r.startswith("fedadapt[app") for r in extras["dev"])


def test_constraints_pin_every_requirement_ci_installs_within_the_declared_ranges():
    from packaging.requirements import Requirement

    pins = constraints()
    declared = [*PROJECT["dependencies"], *(r for rs in PROJECT["optional-dependencies"].values() for r in rs)]
    for text in declared:
        req = Requirement(text)
        if req.name == "fedadapt":
            continue
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"constraints.txt does not pin {name}"
        assert req.specifier.contains(pins[name], prereleases=True), (text, pins[name])


def test_native_dp_without_the_accountant_names_the_extra(monkeypatch):
    """``dp-noise-multiplier`` > 0 needs dp-accounting (the ``dp`` extra) to report ε: refused at config time, naming
    the install; clipping alone reports no ε and needs nothing more."""
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # as if not installed: find_spec answers None
    with pytest.raises(ConfigError, match=r"pip install 'fedadapt\[dp\]'"):
        StrategyConfig(dp_clip=1.0, dp_noise_multiplier=1.0)
    assert StrategyConfig(dp_clip=1.0).dp_noise_multiplier == 0.0
