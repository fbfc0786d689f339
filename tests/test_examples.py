"""The plug-in guide's snippets (docs/plugin.md) are the complete example files under examples/ (imports included): a
typical PyTorch Message-API app converted to fedadapt, and a user's legacy app; the README's short plug-in snippet is
made of their lines.  Both apps run with `flwr run` in Ray simulation, importing fedadapt like any user would, in
tests/test_ray_cluster.py; tests/test_dropin.py executes them in-process."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "pytorch_app" / "pytorchapp"


def test_plugin_guide_snippets_are_verbatim_copies_of_tested_files():
    guide = (ROOT / "docs" / "plugin.md").read_text()
    blocks = re.findall(r"<!-- snippet: (\S+) -->\s*```python\n(.*?)```", guide, flags=re.S)
    assert len(blocks) >= 3
    for path, code in blocks:
        assert code == (ROOT / path).read_text(), f"docs/plugin.md snippet is not the complete file {path}"


def test_readme_snippet_lines_are_lines_of_the_tested_example():
    """Each code line of the README's python block (its trailing comment aside) is a line of the example's
    client_app.py / server_app.py, so the snippet says what the tested example does; at most 15 lines."""
    readme = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    lines = block.rstrip("\n").splitlines()
    assert len(lines) <= 15
    example = {ln.strip() for f in ("client_app.py", "server_app.py") for ln in (APP / f).read_text().splitlines()}
    code = [ln.strip() for ln in lines if ln.strip()]
    assert len(code) >= 6
    missing = [ln for ln in code if ln not in example and ln.split("  #")[0].strip() not in example]
    assert not missing, f"README snippet lines not in examples/pytorch_app: {missing}"
