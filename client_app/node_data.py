"""Node-local training data: a SuperNode brings its own data file instead of a bundled-dataset partition.

Start the SuperNode with ``--node-config "data-path='/abs/path/train.npz'"`` (optionally also ``partition-id=<i>``,
which then only seeds this client's mini-batch order and lets the server sample reproducibly; without it the
node id is used).  The file is a NumPy ``.npz`` archive (``np.savez``) with two arrays:

``x``
    the inputs, floating point (float32 recommended), shape ``[n, ...]`` as the task's model expects it
    (``digits-*``: ``[n, 64]`` pixel values in 0…16; ``synthetic-linear``: ``[n, synthetic-dim]``).
``y``
    the targets, ``n`` of them: integer class labels ``[n]`` for classification tasks (``digits-*``: 0…9),
    floating regression targets ``[n]`` or ``[n, 1]`` for ``synthetic-linear``.

The arrays are converted to the run's ``precision`` (float32/float64) like the bundled data.
``python -m simulations.tools.convert_data`` writes such files from the bundled data sets (one per partition).
The server never reads these files: only the node that holds one does.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

NODE_DATA_KEY = "data-path"


def load_node_data(path: str | Path, *, classification: bool, precision: str = "float32") -> tuple[Tensor, Tensor]:
    """Read and check a node-local ``.npz`` data file; errors name the file and what is wrong."""
    p = Path(path).expanduser()
    where = f"node data file {str(p)!r} (node config {NODE_DATA_KEY})"
    x, y = _read_npz(p, where)
    if x.ndim < 1 or len(x) == 0:
        raise ValueError(f"{where}: 'x' must have shape [n, ...] with n > 0, got {x.shape}")
    if len(y) != len(x):
        raise ValueError(f"{where}: 'x' has {len(x)} rows but 'y' has {len(y)}")
    if x.dtype.kind != "f":
        raise ValueError(f"{where}: 'x' must be floating point, got {x.dtype}")
    if classification:
        if y.dtype.kind not in "iu" or y.ndim != 1:
            raise ValueError(f"{where}: 'y' must be integer class labels of shape [n], got {y.dtype} {y.shape}")
        if (y < 0).any():
            raise ValueError(f"{where}: 'y' holds negative class labels")
        yt = torch.from_numpy(y.astype(np.int64))
    else:
        if y.dtype.kind != "f":
            raise ValueError(f"{where}: 'y' must be floating regression targets, got {y.dtype}")
        yt = torch.from_numpy(np.ascontiguousarray(y.reshape(len(y), -1)))
    xt = torch.from_numpy(np.ascontiguousarray(x))
    dtype = torch.float64 if precision == "float64" else torch.float32
    return xt.to(dtype), (yt if classification else yt.to(dtype))


def _read_npz(p: Path, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The arrays ``x`` and ``y`` of the ``.npz`` file ``p``; errors name the file (``where``) and what is wrong."""
    if not p.is_file():
        raise FileNotFoundError(f"{where} does not exist")
    try:
        z = np.load(p, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise ValueError(f"{where} is not a readable .npz archive ({err})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ValueError(f"{where} is not a readable .npz archive (a single .npy array; use np.savez(path, x=…, y=…))")
    with z:
        missing = [k for k in ("x", "y") if k not in z.files]
        if missing:
            raise ValueError(f"{where} lacks array(s) {missing}; it holds {sorted(z.files)} (need 'x' and 'y')")
        try:
            x, y = np.asarray(z["x"]), np.asarray(z["y"])
        except (zipfile.BadZipFile, OSError, ValueError) as err:
            raise ValueError(f"{where} is not a readable .npz archive ({err})") from None
    return x, y
