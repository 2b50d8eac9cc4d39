"""flower-app: the model, the data and the train / test loops.

The data is Fashion-MNIST as p2pfl's own loader reads it (the local copy under
/usr/share/datasets/fashion-mnist, normalized; no download), split with p2pfl's seeded Dirichlet
label-skew partitioner: each partition sees mostly a few classes, so a personal head pays off
(peers/flower_app.yaml keeps ``fc2`` on each peer).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from p2pfl.data import load_dataset, make_partition


class Net(nn.Module):
    """A small CNN for 1x28x28 images; ``fc2`` is the classifier head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 5)
        self.conv2 = nn.Conv2d(8, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


_partitions = {}  # Cache: one split per (partitions, size, alpha, seed) in this process


def load_data(partition_id: int, num_partitions: int, run_config):
    """This partition's train and test loaders."""
    key = (num_partitions, run_config["samples-per-partition"], run_config["alpha"], run_config["seed"])
    data = load_dataset("fashion_mnist")
    if key not in _partitions:
        _partitions[key] = make_partition(data.train_y.numpy(), data.test_y.numpy(), num_partitions, "dirichlet",
                                          int(run_config["seed"]), alpha=float(run_config["alpha"]),
                                          samples_per_client=int(run_config["samples-per-partition"]))
    split = _partitions[key]
    train_idx = torch.as_tensor(split.train[partition_id].copy())  # the split is read-only (shared)
    test_idx = torch.as_tensor(split.test[partition_id].copy())
    batch_size = int(run_config["batch-size"])
    trainloader = DataLoader(TensorDataset(data.train_x[train_idx], data.train_y[train_idx]),
                             batch_size=batch_size, shuffle=True)
    testloader = DataLoader(TensorDataset(data.test_x[test_idx], data.test_y[test_idx]), batch_size=256)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set; the mean training loss."""
    net.to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, n = 0.0, 0
    for _ in range(epochs):
        for images, labels in trainloader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(net(images), labels)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(labels)
            n += len(labels)
    return total / max(n, 1)


def test(net, testloader, device):
    """Loss and accuracy on the test set."""
    net.to(device)
    net.eval()
    correct, loss, n = 0, 0.0, 0
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += F.cross_entropy(outputs, labels, reduction="sum").item()
            correct += (outputs.argmax(1) == labels).sum().item()
            n += len(labels)
    return loss / max(n, 1), correct / max(n, 1)
