"""The example apps under examples/ (a typical PyTorch Message-API app converted to fedadapt, and a user's legacy app)
run with `flwr run` in Ray simulation, importing fedadapt like any user would; the README's plug-in snippets are the
complete example files (imports included), which these tests and tests/test_dropin.py execute."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from simulations.launch import launch_sim

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_pytorch_example_runs_a_client_half_method_in_simulation(tmp_path):
    out = tmp_path / "model.pt"
    rc = launch_sim(3, f"num-server-rounds=1 method='scaffold' output='{out}'", tmp_path / "flwr", timeout=600,
                    app_dir=ROOT / "examples" / "pytorch_app")
    assert rc == 0
    assert set(torch.load(out)) >= {"body.0.weight", "body.2.bias"}


@pytest.mark.slow
def test_legacy_example_runs_in_simulation(tmp_path):
    out = tmp_path / "out.json"
    rc = launch_sim(3, f"num-server-rounds=1 method='fedadam' output='{out}'", tmp_path / "flwr", timeout=600,
                    app_dir=ROOT / "examples" / "legacy_app")
    assert rc == 0
    assert json.loads(out.read_text())["method"] == "fedadam"


def test_readme_snippets_are_verbatim_copies_of_tested_files():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- snippet: (\S+) -->\s*```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 3
    for path, code in blocks:
        assert code == (ROOT / path).read_text(), f"README snippet is not the complete file {path}"
