"""Write the run-config table of ``pyproject.toml`` and the docs' generated tables from the registry.

    python -m simulations.tools.configgen              # rewrite the generated blocks in pyproject.toml and docs/
    python -m simulations.tools.configgen --check      # exit 1 if a block is stale
    python -m simulations.tools.configgen --accuracy   # also re-measure the per-method accuracy table (22 runs, ~2 min)

Flower only accepts ``--run-config`` keys that the app declares, so every method's hyper-parameters must be
in ``[tool.flwr.app.config]``; generating the block keeps it equal to the registry.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flower_strategies.core.hparams import toml_value as _toml

BEGIN = "# BEGIN GENERATED RUN-CONFIG"
END = "# END GENERATED RUN-CONFIG"


def render() -> str:
    from app_common.config import AppConfig
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
    """docs/run-config.md's table of run-wide keys (method keys are documented on each method's page)."""
    import dataclasses

    from app_common.config import AppConfig
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
    from app_common.task import build_model
    from flower_strategies.core import records as R
    from flower_strategies.core.registry import METHODS

    model = build_model("digits-mlp", 0)
    arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    common = {R.SERVER_ROUND, R.METHOD, R.CLIENT_LR, R.LOCAL_STEPS, R.LOCAL_EPOCHS, R.BATCH_SIZE,
              R.CLIENT_HALF, R.LOCAL_OPTIMIZER, R.LOSS_BEFORE, R.FULL_GRADIENT}
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


ACC_BEGIN = "<!-- BEGIN GENERATED ACCURACY TABLE -->"
ACC_END = "<!-- END GENERATED ACCURACY TABLE -->"


def measure_accuracy(output_dir: str) -> dict[str, float]:
    """Final test accuracy of the default job (every run-config key at its default, seed 0, 10 nodes, in-process
    engine) with only ``method`` changed, for every registered method."""
    import json

    import flower_strategies  # noqa: F401
    from flower_strategies.core.registry import METHODS
    from simulations.engine.inprocess import run_inprocess

    out = {}
    for name in sorted(METHODS):
        run_inprocess({"method": name, "run-name": name, "output-dir": output_dir, "learning-curve": False}, 10)
        summary = json.loads((Path(output_dir) / name / "summary.json").read_text())
        out[name] = summary["final"]["test-accuracy"]
    return out


def render_accuracy(accuracy: dict[str, float]) -> str:
    """docs/methods/index.md's table: each method's preset on the default job and the accuracy it reaches."""
    from server_app.presets import PRESETS

    rows = [ACC_BEGIN, "| method | preset (on top of the app defaults) | test accuracy |", "|---|---|---|"]
    for name in sorted(accuracy):
        preset = ", ".join(f"`{k}={_toml(v)}`" for k, v in PRESETS["digits-mlp"].get(name, {}).items()) or "–"
        rows.append(f"| `{name}` | {preset} | {accuracy[name]:.3f} |")
    rows.append(ACC_END)
    return "\n".join(rows)


def _replace(text: str, begin: str, end: str, block: str) -> str:
    start, stop = text.index(begin), text.index(end) + len(end)
    return text[:start] + block + text[stop:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--pyproject", default="pyproject.toml")
    ap.add_argument("--docs", default="docs", help="the documentation folder")
    ap.add_argument("--accuracy", action="store_true",
                    help="also run every method on the default job and write its final test accuracy")
    args = ap.parse_args(argv)
    docs = Path(args.docs)
    blocks = [
        (Path(args.pyproject), BEGIN, END, render()),
        (docs / "run-config.md", MD_BEGIN, MD_END, render_markdown()),
        (docs / "plugin.md", WIRE_BEGIN, WIRE_END, render_wire()),
    ]
    if args.accuracy:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            blocks.append((docs / "methods" / "index.md", ACC_BEGIN, ACC_END, render_accuracy(measure_accuracy(tmp))))
    stale = []
    for path, begin, end, block in blocks:
        text = path.read_text()
        new = _replace(text, begin, end, block)
        if new != text:
            stale.append(str(path))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"generated tables are stale in {stale}: run `python -m simulations.tools.configgen`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
