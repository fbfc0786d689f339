"""The ``flwr`` CLI: connections in ``<FLWR_HOME>/config.toml``, run-config strings, ``flwr run`` / ``ls`` /
``supernode``."""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flower_strategies.core.hparams import toml_value

from .processes import APP_DIR, Cluster, bin_path
from .progress import StreamView


# ------------------------------------------------------------------ connections
def write_connection(flwr_home: Path, name: str, port: int) -> None:
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )


def write_secure_connections(flwr_home: Path, name: str, port: int, ca: Path, plaintext_name: str,
                             outsider: tuple[str, str] | None = None) -> None:
    """``name``: TLS connection verified against ``ca``; ``plaintext_name``: the same address with
    ``insecure = true`` (used only to show that a plaintext client is refused); ``outsider`` = ``(name, host)``: a
    TLS connection with ``ca`` to ``host:port`` (a node host's view of the SuperLink, which must not reach the
    Control API)."""
    text = (f'[superlink]\ndefault = "{name}"\n\n'
            f'[superlink.{name}]\naddress = "127.0.0.1:{port}"\nroot-certificates = "{ca.resolve()}"\n\n'
            f'[superlink.{plaintext_name}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    if outsider is not None:
        text += f'\n[superlink.{outsider[0]}]\naddress = "{outsider[1]}:{port}"\nroot-certificates = "{ca.resolve()}"\n'
    (flwr_home / "config.toml").write_text(text)


# ------------------------------------------------------------------ run-config strings
def parse_run_config_arg(run_config: str | None) -> dict[str, Any]:
    """The user's ``--run-config`` (``"k=v k2='s'"`` or a ``.toml`` path) as flat keys, parsed as Flower parses it."""
    from flwr.common.config import parse_config_args

    return dict(parse_config_args([run_config] if run_config else None))


def format_run_config(cfg: Mapping[str, Any]) -> str:
    """``{k: v}`` → ``k=v ...`` with TOML-typed values (what ``flwr run --run-config`` reads back).  A string goes in
    single quotes (a TOML literal string) where it can: Flower splits the line at the closing quote, so a ``"`` inside
    a double-quoted value would cut it."""
    def value(v: Any) -> str:
        return f"'{v}'" if isinstance(v, str) and "'" not in v else toml_value(v)

    return " ".join(f"{k}={value(v)}" for k, v in cfg.items())


def app_config_keys(app_dir: Path) -> dict[str, Any]:
    """The app's declared run-config (``[tool.flwr.app.config]`` of its pyproject.toml) as flat keys."""
    from flwr.common.config import flatten_dict

    project = tomllib.loads((app_dir / "pyproject.toml").read_text())
    return dict(flatten_dict(project.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})))


class RunConfigError(ValueError):
    """The run-config names keys the app does not declare (Flower would answer ``[code: 15]``)."""


def unknown_keys_message(unknown: Sequence[str], known: Sequence[str], app_dir: Path) -> str:
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
        hints.append(f"{key!r}" + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""))
    return (f"unknown run-config key(s): {'; '.join(hints)} — not declared in {app_dir / 'pyproject.toml'} "
            f"[tool.flwr.app.config]")


def build_run_config(run_config: str | None, app_dir: Path, defaults: Mapping[str, Any] | None = None) -> str:
    """The ``--run-config`` to submit: the user's keys plus those of ``defaults`` the user did not set and the app
    declares (never a key twice: Flower rejects duplicates as "invalid format").  Raises :class:`RunConfigError`
    naming the user's keys the app does not declare."""
    user = parse_run_config_arg(run_config)
    known = app_config_keys(app_dir)
    unknown = [k for k in user if k not in known]
    if unknown:
        raise RunConfigError(unknown_keys_message(unknown, list(known), app_dir))
    added = {k: v for k, v in (defaults or {}).items() if k in known and k not in user}
    return format_run_config({**added, **user})


# ------------------------------------------------------------------ flwr commands
def flwr_run(cluster: Cluster, connection: str, run_config: str | None, federation_config: str | None,
             timeout: float, app_dir: Path = APP_DIR, verbose: bool = False) -> tuple[int | None, str, str]:
    """``flwr run --stream`` (a process of ``cluster``, stopped with it); returns (run id, status, full output).

    The output is also written to ``<log_dir>/flwr-run.log`` (``flwr-run-2.log``, … for further runs on the same
    cluster, which may stream at the same time).  It is echoed through :class:`.progress.StreamView`: Flower's INFO
    lines only when ``verbose``, a round bar on a terminal."""
    argv = [bin_path("flwr"), "run", str(app_dir), connection, "--stream"]
    if run_config:
        argv += ["--run-config", run_config]
    if federation_config:
        argv += ["--federation-config", federation_config]
    with cluster.starting:  # several runs may start at once (from threads): each gets its own log
        runs = sum(name == "flwr-run" for name, _ in cluster.procs)
        out_path = cluster.log_dir / ("flwr-run.log" if runs == 0 else f"flwr-run-{runs + 1}.log")
        proc = cluster.start("flwr-run", argv, capture=True)
    assert proc.stdout is not None
    watching = cluster.watch_superlink(proc)  # a dead SuperLink ends the stream at once (cluster.lost)
    lines: list[bytes] = []
    view = StreamView(verbose)
    try:
        with open(out_path, "wb") as fh:
            t_end = time.monotonic() + timeout
            for line in proc.stdout:  # echo the streamed logs live
                lines.append(line)
                fh.write(line)
                fh.flush()
                view.write(line.decode(errors="replace"))
                if time.monotonic() > t_end:
                    proc.kill()
                    break
            proc.wait()
    finally:
        watching.set()
        view.close()
    text = b"".join(lines).decode(errors="replace")
    m = re.search(r"Successfully started run (\d+)", text)
    run_id = int(m.group(1)) if m else None
    if cluster.note_lost():  # nothing to ask: the SuperLink that knew the run's status is gone
        return run_id, f"superlink-lost: {cluster.lost}", text
    if run_id is None:
        return None, "not-started", text
    return run_id, run_status(cluster, connection, run_id), text


def flwr_cli(cluster: Cluster, args: Sequence[str], timeout: float = 120.0) -> tuple[int, str]:
    try:
        res = subprocess.run([bin_path("flwr"), *args], capture_output=True, text=True, env=cluster.env, cwd=APP_DIR,
                             timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        parts = [p.decode(errors="replace") if isinstance(p, bytes) else (p or "") for p in (exc.stdout, exc.stderr)]
        return 124, "".join(parts)
    return res.returncode, res.stdout + res.stderr


def flwr_json(cluster: Cluster, args: Sequence[str]) -> dict:
    """A ``flwr … --format json`` call as a dict (``{"success": False, …}`` when the output is not JSON)."""
    rc, out = flwr_cli(cluster, [*args, "--format", "json"])
    try:
        data = json.loads(out[out.index("{"):])
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return {"success": False, "error-message": out[-2000:], "rc": rc}
    data["rc"] = rc
    return data


def run_status(cluster: Cluster, connection: str, run_id: int, wait_s: float = 30.0) -> str:
    deadline = time.monotonic() + wait_s
    status = "unknown"
    while time.monotonic() < deadline:
        try:
            status = flwr_json(cluster, ["ls", connection, "--run-id", str(run_id)])["runs"][0]["status"]
        except (KeyError, IndexError, TypeError):
            status = "unknown"
        if status.startswith("finished"):
            return status
        time.sleep(1.0)
    return status


def list_supernodes(cluster: Cluster, connection: str) -> list[dict]:
    """``flwr supernode list --format json``: dicts with ``node-id`` (a string) and ``status``."""
    nodes = flwr_json(cluster, ["supernode", "list", connection]).get("nodes", [])
    return nodes if isinstance(nodes, list) else []
