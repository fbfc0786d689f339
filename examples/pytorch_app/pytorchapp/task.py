"""The user's own model, data loaders and training loop (nothing from fedadapt here): the shape of Flower's
quickstart-pytorch — its CNN (two conv + pool layers, three linear layers), DataLoaders yielding flwr-datasets'
``{"img": ..., "label": ...}`` batches, SGD with momentum 0.9, a loop that divides its summed loss by
``epochs * len(trainloader)`` — on scikit-learn's 8×8 digits instead of CIFAR-10."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    """The quickstart's CNN, sized for 1×8×8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Digits(Dataset):
    """Dict examples ``{"img": 1×8×8 tensor in [-1, 1], "label": int}``; ``noise`` > 0 adds Gaussian input noise
    (the training split's augmentation)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, noise: float = 0.0) -> None:
        self.images, self.labels, self.noise = images, labels, noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        img = self.images[i]
        if self.noise:
            img = img + self.noise * torch.randn_like(img)
        return {"img": img, "label": self.labels[i]}


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """An IID slice of scikit-learn's digits, 80 % train / 20 % test, as DataLoaders of dict batches."""
    d = load_digits()
    idx = np.arange(len(d.target))[partition_id::num_partitions]
    x = (torch.tensor(d.data[idx] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8) - 0.5) / 0.5
    y = torch.tensor(d.target[idx])
    cut = int(0.8 * len(idx))
    g = torch.Generator().manual_seed(partition_id)
    train = DataLoader(Digits(x[:cut], y[:cut], noise=0.02), batch_size=batch_size, shuffle=True, generator=g)
    test = DataLoader(Digits(x[cut:], y[cut:]), batch_size=batch_size)
    return train, test


def train(net, trainloader, epochs, lr, device, optimizer=None):
    """Train with SGD + momentum; return the summed batch loss divided by epochs * len(trainloader), as the
    quickstart does."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = optimizer or torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(batch["img"].to(device)), batch["label"].to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """Mean loss and accuracy over the loader."""
    net.to(device)
    net.eval()
    correct, loss, n = 0, 0.0, 0
    with torch.no_grad():
        for batch in testloader:
            images, labels = batch["img"].to(device), batch["label"].to(device)
            out = net(images)
            loss += F.cross_entropy(out, labels, reduction="sum").item()
            correct += (out.argmax(1) == labels).sum().item()
            n += len(labels)
    return loss / n, correct / n
