"""Write the run-config table of ``pyproject.toml`` from the registry.

    python -m simulations.configgen            # rewrite the generated block in ./pyproject.toml
    python -m simulations.configgen --check    # exit 1 if the block is stale

Flower only accepts ``--run-config`` keys that the app declares, so every method's hyper-parameters must be
in ``[tool.flwr.app.config]``; generating the block keeps it equal to the registry.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BEGIN = "# BEGIN GENERATED RUN-CONFIG"
END = "# END GENERATED RUN-CONFIG"


def render() -> str:
    import flower_strategies  # noqa: F401 - registers every method
    from flower_strategies.hparams import FederationConfig
    from flower_strategies.registry import METHODS

    lines = [BEGIN]
    for key, value in FederationConfig.defaults(None).items():
        lines.append(f"{key} = {_toml(value)}")
    for name in sorted(METHODS):
        lines.append(f"# {name}: {METHODS[name].summary}")
        for key, value in METHODS[name].hparams.defaults(name).items():
            lines.append(f"{key} = {_toml(value)}")
    lines.append(END)
    return "\n".join(lines)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--pyproject", default="pyproject.toml")
    args = ap.parse_args(argv)
    path = Path(args.pyproject)
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + render() + text[end:]
    if args.check:
        if new != text:
            print("pyproject.toml run-config table is stale: run `python -m simulations.configgen`", file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
