"""A run owns its output directory (server_app.rundir): a lock for the run's life, a default name per configuration,
an earlier run's files moved aside."""

from __future__ import annotations

import json
import threading

import pytest

from app_common.config import AppConfig
from flower_strategies.core.registry import parse_run_config
from server_app import rundir
from server_app.app import run_dir
from simulations.engine.inprocess import run_inprocess

BASE = {"method": "fedavg", "num-server-rounds": 2, "local-steps": 2, "batch-size": 16}


def rounds(out):
    return [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def default_dir(cfg):
    fed, _, _ = parse_run_config(cfg, AppConfig)
    return run_dir(fed, cfg)


def test_two_runs_at_once_into_one_directory_the_second_fails_and_the_first_is_intact(tmp_path):
    cfg = {**BASE, "output-dir": str(tmp_path), "run-name": "shared"}
    in_round_1, second_done = threading.Event(), threading.Event()

    def hold_round_1(request, reply, partition_id):
        in_round_1.set()
        second_done.wait(30)
        return reply

    result: dict = {}
    first = threading.Thread(target=lambda: result.update(run_inprocess(cfg, 2, intercept=hold_round_1)))
    first.start()
    try:
        assert in_round_1.wait(30)
        with pytest.raises(rundir.RunDirBusy, match=r"run-name / output-dir: another run \(pid \d+\) is writing to "
                                                    rf"{tmp_path / 'shared'}"):
            run_inprocess({**cfg, "seed": 1}, 2)
    finally:
        second_done.set()
        first.join(60)
    out = tmp_path / "shared"
    assert result["status"] == "completed" and rounds(out) == [0, 1, 2]
    assert "seed" not in json.loads((out / "summary.json").read_text())["run_config"]  # the first run's summary
    assert not list(tmp_path.glob("shared.prev-*"))
    with pytest.raises(rundir.RunDirUsed, match="holds a completed run of fedavg, 2 rounds; a run directory belongs "
                                                "to one run: set resume"):
        run_inprocess(cfg, 2)  # the lock went with the first run, but its files stay its own
    run_inprocess({**cfg, "overwrite": True}, 2)  # explicitly: the earlier files move aside
    assert rounds(out) == [0, 1, 2] and rounds(tmp_path / "shared.prev-1") == [0, 1, 2]


def test_a_lock_file_left_by_a_dead_run_does_not_block(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / ".lock").write_text("999999\n")  # no process holds a flock on it
    assert run_inprocess({**BASE, "output-dir": str(tmp_path), "run-name": "r"}, 2)["status"] == "completed"
    assert rounds(out) == [0, 1, 2]


def test_claim_holds_the_directory_until_released(tmp_path):
    out = tmp_path / "x"
    with rundir.claim(out, fresh=True):
        with pytest.raises(rundir.RunDirBusy, match="run-name / output-dir"), rundir.claim(out, fresh=True):
            pass
        (out / "summary.json").write_text("{}")
    with rundir.claim(out, fresh=False):  # resume: the files stay
        assert (out / "summary.json").exists()
    # a fresh run: refused, the earlier files stay
    with pytest.raises(rundir.RunDirUsed, match="overwrite = true"), rundir.claim(out, fresh=True):
        pass
    assert (out / "summary.json").exists()
    with rundir.claim(out, fresh=True, overwrite=True):  # a fresh run told to: the earlier files move aside
        assert [p.name for p in out.iterdir()] == [".lock"]
        assert (tmp_path / "x.prev-1" / "summary.json").exists()


def test_default_run_names_differ_for_settings_that_change_results(tmp_path):
    cfg = {"method": "fedavg", "output-dir": str(tmp_path)}
    plain = default_dir(cfg)
    assert plain.name == "fedavg-digits-mlp-seed0"
    names = {plain, default_dir({**cfg, "client-lr": 0.1}), default_dir({**cfg, "partitioner": "iid"}),
             default_dir({**cfg, "client-lr": 0.1, "partitioner": "iid"}), default_dir({**cfg, "seed": 1})}
    assert len(names) == 5
    assert default_dir({**cfg, "client-lr": 0.1}).name.startswith("fedavg-digits-mlp-seed0-")
    # keys at their defaults, where the files go and how the run starts keep the name
    defaults_given = {**cfg, "client-lr": AppConfig.defaults(None)["client-lr"], "run-name": "", "tracking": "none",
                      "resume": "x.npz", "overwrite": True}
    assert default_dir(defaults_given) == plain
    # a run with other rounds or tracking is another configuration: its own directory (issue 37: a 1-round run
    # moved a finished 10-round run aside)
    assert len({plain, default_dir({**cfg, "num-server-rounds": 1}), default_dir({**cfg, "tracking": "tensorboard"}),
                default_dir({**cfg, "checkpoint-every": 3})}) == 4


def test_a_seed_beyond_32_bits_is_a_config_error_naming_the_bound(tmp_path):
    from flower_strategies.core.hparams import ConfigError

    with pytest.raises(ConfigError, match=r"seed = 4294967296 is out of range; must be <= 4294967295"):
        run_inprocess({**BASE, "seed": 2**32, "output-dir": str(tmp_path)}, 2)
    assert not any(tmp_path.iterdir())  # refused at parse time, before anything is written
    assert parse_run_config({"seed": 2**32 - 1}, AppConfig)[0].seed == 2**32 - 1


def test_a_deployed_run_with_the_declared_defaults_keeps_the_short_name(tmp_path):
    """Flower hands the ServerApp every key of pyproject's [tool.flwr.app.config]: at their defaults, no hash."""
    from simulations.launch.flwr_cli import app_config_keys
    from simulations.launch.processes import APP_DIR

    declared = app_config_keys(APP_DIR)
    assert default_dir({**declared, "output-dir": str(tmp_path)}).name == "fedavg-digits-mlp-seed0"
    assert default_dir({**declared, "output-dir": str(tmp_path), "client-lr": 0.1}).name != "fedavg-digits-mlp-seed0"


@pytest.mark.parametrize("name,rule", [
    ("/tmp/elsewhere", "one path component inside output-dir"),
    ("../x", "one path component inside output-dir"),
    ("a/b", "one path component inside output-dir"),
    ("a\\b", "one path component inside output-dir"),
    (".", "names output-dir itself or its parent"),
    ("..", "names output-dir itself or its parent"),
    ("a\x00b", "holds a NUL byte"),
    ("x" * 129, "129 characters; at most 128"),
    ("mine.prev-1", "ending in .prev-<n> are where earlier runs' files are moved aside"),
], ids=["absolute", "dotdot-x", "separator", "backslash", "dot", "dotdot", "nul", "too-long", "prev-suffix"])
def test_a_run_name_that_is_not_one_safe_path_component_is_refused_at_config_time(tmp_path, name, rule):
    from flower_strategies.core.hparams import ConfigError

    out = tmp_path / "out"
    sibling = tmp_path / "sibling"  # what ".." and "." used to move or write into
    sibling.mkdir()
    (sibling / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"run-name = .* is not valid: .*{rule.replace('.', '[.]')}"):
        parse_run_config({"run-name": name}, AppConfig)
    with pytest.raises(ConfigError, match="run-name"):
        run_inprocess({**BASE, "output-dir": str(out), "run-name": name}, 2)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["sibling"]
    assert (sibling / "summary.json").exists()
    assert parse_run_config({"run-name": "x" * 128}, AppConfig)[0].run_name == "x" * 128


def test_a_fresh_run_moves_only_its_own_files_never_another_runs_directory(tmp_path):
    out = tmp_path / "r"
    other = out / "nested-run"  # another run's directory: an output-dir pointed inside this one
    other.mkdir(parents=True)
    (other / ".lock").write_text("1\n")
    (other / "summary.json").write_text("{}")
    (out / "summary.json").write_text("{}")
    assert rundir.move_aside(out) == tmp_path / "r.prev-1"
    assert sorted(p.name for p in out.iterdir()) == ["nested-run"] and (other / "summary.json").exists()
    assert [p.name for p in (tmp_path / "r.prev-1").iterdir()] == ["summary.json"]


def test_a_run_with_other_rounds_gets_its_own_directory_and_a_rerun_is_refused_unless_told(tmp_path):
    cfg = {**BASE, "output-dir": str(tmp_path)}
    run_inprocess(cfg, 2)
    run_inprocess({**cfg, "num-server-rounds": 1}, 2)  # another configuration: another directory, nothing moved
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert len(dirs) == 2 and not any(".prev-" in d for d in dirs)
    assert sorted(len(rounds(tmp_path / d)) for d in dirs) == [2, 3]
    with pytest.raises(rundir.RunDirUsed, match=r"holds a completed run of fedavg, 2 rounds"):
        run_inprocess(cfg, 2)  # the same configuration again
    assert sorted(p.name for p in tmp_path.iterdir()) == dirs  # refused before anything moved or was written


def test_a_resumed_run_with_more_rounds_continues_in_its_directory(tmp_path):
    cfg = {**BASE, "output-dir": str(tmp_path), "checkpoint-every": 1}
    run_inprocess(cfg, 2)
    (first,) = tmp_path.iterdir()
    more = {**cfg, "num-server-rounds": 3, "resume": str(first / "checkpoint.npz"), "tracking": "none"}
    assert run_inprocess(more, 2)["status"] == "completed"
    assert [p.name for p in tmp_path.iterdir()] == [first.name] and rounds(first) == [0, 1, 2, 3]
