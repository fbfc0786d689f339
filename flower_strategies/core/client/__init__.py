"""The client half of every method, inside any training loop; it imports no server-side module.

* :mod:`.round` — :class:`ClientRound`: one round read from the train message, driven by your loop;
* :mod:`.loop` — :func:`train_reply`: fedadapt's own loop, one call per round;
* :mod:`.data` — the planned steps, seeded mini-batches, batch formats, the mean loss and the full local gradient;
* :mod:`.wire` — the round's ConfigRecord (what a client must know), ArrayRecord ⇄ torch, the saved client state.
"""

from .data import (
    EVAL_CHUNK, INPUT_KEYS, TARGET_KEYS, Batch, LossFn, TensorPartition, as_xy, batch_indices, concat_batches,
    full_gradient_from, loss_before_sample, mean_loss, num_examples_of, num_local_steps,
)
from .loop import train_reply
from .round import ClientRound, RoundLoader, check_bound
from .wire import (
    CLIENT_KEYS, downlink_records, load_client_state, read_round_config, record_tensors, save_client_state,
    tensor_record,
)

__all__ = [
    "CLIENT_KEYS", "EVAL_CHUNK", "INPUT_KEYS", "TARGET_KEYS", "Batch", "ClientRound", "LossFn", "RoundLoader",
    "TensorPartition", "as_xy", "batch_indices", "check_bound", "concat_batches", "downlink_records",
    "full_gradient_from", "load_client_state", "loss_before_sample", "mean_loss", "num_examples_of",
    "num_local_steps", "read_round_config", "record_tensors", "save_client_state", "tensor_record", "train_reply",
]
