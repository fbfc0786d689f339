"""The user's own model, data loaders and training loop (nothing from fedadapt here)."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """An IID slice of scikit-learn's digits as train/test DataLoaders (with a small input-noise augmentation)."""
    d = load_digits()
    idx = np.arange(len(d.target))[partition_id::num_partitions]
    x = torch.tensor(d.data[idx] / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target[idx])
    cut = int(0.8 * len(idx))
    g = torch.Generator().manual_seed(partition_id)
    train = DataLoader(TensorDataset(x[:cut], y[:cut]), batch_size=batch_size, shuffle=True, generator=g)
    test = DataLoader(TensorDataset(x[cut:], y[cut:]), batch_size=batch_size)
    return train, test


def train(net, trainloader, epochs, lr, device, optimizer=None):
    """Train with SGD + momentum and a light input-noise augmentation; return the mean training loss."""
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = optimizer or torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        for x, y in trainloader:
            x = x + 0.01 * torch.randn_like(x)
            optimizer.zero_grad()
            loss = criterion(net(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
    return total / max(batches, 1)


def test(net, testloader, device):
    net.to(device)
    net.eval()
    correct, loss, n = 0, 0.0, 0
    with torch.no_grad():
        for x, y in testloader:
            out = net(x.to(device))
            loss += nn.functional.cross_entropy(out, y.to(device), reduction="sum").item()
            correct += (out.argmax(1) == y.to(device)).sum().item()
            n += len(y)
    return loss / n, correct / n
