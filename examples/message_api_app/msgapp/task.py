"""The user's own model and data (nothing from fedadapt here)."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


def load_partition(partition_id: int, num_partitions: int):
    d = load_digits()
    idx = np.arange(len(d.target))[partition_id::num_partitions]
    x = torch.tensor(d.data[idx] / 16.0, dtype=torch.float32)
    return x, torch.tensor(d.target[idx])


def new_model() -> Net:
    torch.manual_seed(0)
    return Net()
