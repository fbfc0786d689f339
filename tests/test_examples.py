"""The two example apps under examples/ (a user's Message-API app and a user's legacy app) run with `flwr run` in Ray
simulation, importing fedadapt like any user would; and the README's plug-in snippets are verbatim copies of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from simulations.launch import launch_sim

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("app,method", [("message_api_app", "fedprox"), ("legacy_app", "fedadam")])
def test_example_app_runs_in_simulation(tmp_path, app, method):
    out = tmp_path / "out.json"
    rc = launch_sim(3, f"num-server-rounds=2 method='{method}' output='{out}'", tmp_path / "flwr", timeout=600,
                    app_dir=ROOT / "examples" / app)
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["method"] == method


def test_readme_snippets_are_verbatim_copies_of_tested_files():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- snippet: (\S+) -->\s*```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 4
    for path, code in blocks:
        assert code.strip() in (ROOT / path).read_text(), f"README snippet differs from {path}"
