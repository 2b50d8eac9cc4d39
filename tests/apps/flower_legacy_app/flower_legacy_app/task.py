"""flower-legacy-app: A Flower / PyTorch app.

The legacy quickstart's task.py with, instead of CIFAR-10 from ``flwr_datasets`` (a download),
small synthetic 3x32x32 images: one Gaussian cluster per class, split IID over the partitions,
80% train / 20% test per partition, batches of dicts as ``FederatedDataset`` gives them.
"""

from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def get_weights(net):
    return [val.cpu().numpy() for _, val in net.state_dict().items()]


def set_weights(net, parameters):
    params_dict = zip(net.state_dict().keys(), parameters)
    state_dict = OrderedDict({k: torch.tensor(v) for k, v in params_dict})
    net.load_state_dict(state_dict, strict=True)


class ImageDataset(Dataset):
    """Images and labels served as ``{"img": ..., "label": ...}`` (what the quickstart's loops read)."""

    def __init__(self, images, labels):
        self.images = torch.from_numpy(images)
        self.labels = torch.from_numpy(labels)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"img": self.images[i], "label": self.labels[i]}


NUM_EXAMPLES = 600
data = None  # Cache the synthetic dataset


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load this partition of the synthetic data."""
    global data
    if data is None:
        rng = np.random.default_rng(0)
        centers = rng.normal(0, 1, size=(10, 3, 32, 32)).astype(np.float32)
        labels = rng.integers(0, 10, size=NUM_EXAMPLES)
        images = (centers[labels] + rng.normal(0, 2.0, size=(NUM_EXAMPLES, 3, 32, 32))).astype(np.float32)
        data = (images, labels.astype(np.int64))
    images, labels = data
    idx = np.array_split(np.arange(NUM_EXAMPLES), num_partitions)[partition_id]
    # Divide data on each node: 80% train, 20% test
    cut = int(len(idx) * 0.8)
    train_idx, test_idx = idx[:cut], idx[cut:]
    trainloader = DataLoader(ImageDataset(images[train_idx], labels[train_idx]), batch_size=batch_size, shuffle=True)
    testloader = DataLoader(ImageDataset(images[test_idx], labels[test_idx]), batch_size=batch_size)
    return trainloader, testloader


def train(net, trainloader, valloader, epochs, learning_rate, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=learning_rate, momentum=0.9)
    net.train()
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"]
            labels = batch["label"]
            optimizer.zero_grad()
            criterion(net(images.to(device)), labels.to(device)).backward()
            optimizer.step()

    val_loss, val_acc = test(net, valloader, device)

    results = {
        "val_loss": val_loss,
        "val_accuracy": val_acc,
    }
    return results


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
