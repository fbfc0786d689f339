"""The user's own model, DataLoaders, training loop and test (nothing from fedadapt here)."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Train/test DataLoaders over an IID slice of scikit-learn's digits."""
    d = load_digits()
    idx = np.arange(len(d.target))[partition_id::num_partitions]
    data = TensorDataset(torch.tensor(d.data[idx] / 16.0, dtype=torch.float32), torch.tensor(d.target[idx]))
    n_train = int(0.8 * len(idx))
    train_set = torch.utils.data.Subset(data, range(n_train))
    test_set = torch.utils.data.Subset(data, range(n_train, len(idx)))
    g = torch.Generator().manual_seed(partition_id)
    return DataLoader(train_set, batch_size, shuffle=True, generator=g), DataLoader(test_set, batch_size)


def train(net, trainloader, epochs, lr, device, optimizer=None):
    """SGD with momentum over the loader for `epochs` epochs; the mean batch loss."""
    net.to(device).train()
    optimizer = optimizer or torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return float(np.mean(losses)) if losses else 0.0


def test(net, testloader, device):
    """Mean loss and accuracy over the loader."""
    net.to(device).eval()
    losses, hits = [], []
    with torch.no_grad():
        for images, labels in testloader:
            logits = net(images.to(device))
            losses.append(nn.functional.cross_entropy(logits, labels.to(device), reduction="none"))
            hits.append(logits.argmax(1) == labels.to(device))
    return float(torch.cat(losses).mean()), float(torch.cat(hits).float().mean())
