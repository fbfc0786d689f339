"""The README's plug-in snippets are the complete example files under examples/ (imports included): a typical PyTorch
Message-API app converted to fedadapt, and a user's legacy app.  Both run with `flwr run` in Ray simulation, importing
fedadapt like any user would, in tests/test_ray_cluster.py; tests/test_dropin.py executes them in-process."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_snippets_are_verbatim_copies_of_tested_files():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- snippet: (\S+) -->\s*```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 3
    for path, code in blocks:
        assert code == (ROOT / path).read_text(), f"README snippet is not the complete file {path}"
