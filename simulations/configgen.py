"""Write the run-config table of ``pyproject.toml`` from the registry.

    python -m simulations.configgen            # rewrite the generated blocks in ./pyproject.toml and ./README.md
    python -m simulations.configgen --check    # exit 1 if a block is stale

Flower only accepts ``--run-config`` keys that the app declares, so every method's hyper-parameters must be
in ``[tool.flwr.app.config]``; generating the block keeps it equal to the registry.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flower_strategies.core.hparams import _toml_value as _toml

BEGIN = "# BEGIN GENERATED RUN-CONFIG"
END = "# END GENERATED RUN-CONFIG"


def render() -> str:
    import flower_strategies  # noqa: F401 - registers every method
    from client_app.config import AppConfig
    from flower_strategies.core.registry import METHODS

    lines = [BEGIN]
    for key, value in AppConfig.defaults(None).items():
        lines.append(f"{key} = {_toml(value)}")
    for name in sorted(METHODS):
        lines.append(f"# {name}: {METHODS[name].summary}")
        for key, value in METHODS[name].defaults().items():
            lines.append(f"{key} = {_toml(value)}")
    lines.append(END)
    return "\n".join(lines)


MD_BEGIN = "<!-- BEGIN GENERATED RUN-CONFIG TABLE -->"
MD_END = "<!-- END GENERATED RUN-CONFIG TABLE -->"


def render_markdown() -> str:
    """The README's table of run-wide keys (method keys are documented on each method's page)."""
    import dataclasses

    from client_app.config import AppConfig
    from flower_strategies.core.hparams import to_key

    rows = [MD_BEGIN, "| key | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(AppConfig):
        meta = f.metadata
        extra = f" (one of: {', '.join(map(str, meta['choices']))})" if meta.get("choices") else ""
        default = _toml("" if f.default is None else f.default)
        rows.append(f"| `{to_key(f.name)}` | `{default}` | {meta.get('help', '')}{extra} |")
    rows.append(MD_END)
    return "\n".join(rows)


WIRE_BEGIN = "<!-- BEGIN GENERATED WIRE TABLE -->"
WIRE_END = "<!-- END GENERATED WIRE TABLE -->"


def render_wire() -> str:
    """Per method: what goes down and up besides the model, read off the strategies themselves (default settings,
    after round-1 initialisation on the digits MLP)."""
    import flower_strategies  # noqa: F401
    from client_app.task import build_model
    from flower_strategies.core import records as R
    from flower_strategies.core.registry import METHODS

    model = build_model("digits-mlp", 0)
    arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    common = {R.SERVER_ROUND, R.METHOD, R.CLIENT_LR, R.LOCAL_STEPS, R.LOCAL_EPOCHS, R.BATCH_SIZE}
    rows = [WIRE_BEGIN, "| method | extra downlink records | uplink records (rule) | extra round-config keys |",
            "|---|---|---|---|"]
    for name in sorted(METHODS):
        strategy = METHODS[name].build(trainable_keys=[n for n, _ in model.named_parameters()], num_rounds=10)
        strategy.current = arrays
        strategy.server_state = strategy.init_server_state(arrays)
        down = ", ".join(f"`{k}`" for k in strategy.downlink(1)) or "–"
        rules = {"mean": f"{strategy.weighting} mean"}
        up = ", ".join(f"`{s.name}` ({rules.get(s.rule, s.rule)})" for s in strategy.uplink_specs())
        keys = ", ".join(f"`{k}`" for k in strategy.round_config(1) if k not in common) or "–"
        rows.append(f"| `{name}` | {down} | {up} | {keys} |")
    rows.append(WIRE_END)
    return "\n".join(rows)


def _replace(text: str, begin: str, end: str, block: str) -> str:
    start, stop = text.index(begin), text.index(end) + len(end)
    return text[:start] + block + text[stop:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--pyproject", default="pyproject.toml")
    ap.add_argument("--readme", default="README.md")
    args = ap.parse_args(argv)
    stale = []
    for path, begin, end, block in (
        (Path(args.pyproject), BEGIN, END, render()),
        (Path(args.readme), MD_BEGIN, MD_END, render_markdown()),
        (Path(args.readme), WIRE_BEGIN, WIRE_END, render_wire()),
    ):
        text = path.read_text()
        new = _replace(text, begin, end, block)
        if new != text:
            stale.append(str(path))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"generated tables are stale in {stale}: run `python -m simulations.configgen`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
