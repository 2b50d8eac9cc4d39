"""A Flower ClientApp written the way Flower's quickstart writes one, run peer-to-peer by p2pfl.

Nothing here knows about p2pfl: it is a plain ``flwr.clientapp.ClientApp`` with a PyTorch
model, its own data loading and its own train/evaluate handlers. ``peers/quickstart.yaml``
names it (``app: peers.quickstart:app``, ``app_init: peers.quickstart:Net``) and marks the
last layer personal (``sharing: {personal: [fc2.]}``): the peers gossip the body and keep
their own head. The same app runs under a Flower server unchanged.

Run config (``app_config`` in the p2pfl config, ``context.run_config`` here):

* ``dataset``: ``fashion-mnist`` (read from the local copy the Debian package installs) or
  ``synthetic`` (tiny Gaussian clusters, for tests);
* ``lr``, ``local-epochs``, ``batch-size``, ``seed``.

Each partition holds mostly two classes (label skew), so a personal head pays off. Training
randomness comes from a generator seeded by (seed, partition, round): the same peer computes
the same numbers in any process, whoever runs it.
"""

from __future__ import annotations

import gzip
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


class Net(nn.Module):
    """A small CNN for 1x28x28 images; ``fc2`` is the classifier head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 5)
        self.conv2 = nn.Conv2d(8, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


# -- data --------------------------------------------------------------------------------------------
_cache: dict[tuple, tuple[TensorDataset, TensorDataset]] = {}
_lock = threading.Lock()


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _fashion_mnist() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    x = _read_idx(FASHION_MNIST / "train-images-idx3-ubyte.gz").astype(np.float32) / 255.0
    y = _read_idx(FASHION_MNIST / "train-labels-idx1-ubyte.gz").astype(np.int64)
    xt = _read_idx(FASHION_MNIST / "t10k-images-idx3-ubyte.gz").astype(np.float32) / 255.0
    yt = _read_idx(FASHION_MNIST / "t10k-labels-idx1-ubyte.gz").astype(np.int64)
    return (x - 0.286) / 0.353, y, (xt - 0.286) / 0.353, yt


def _synthetic(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 1, size=(10, 28, 28)).astype(np.float32)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, 10, size=n)
        return (centers[y] + rng.normal(0, 1.5, size=(n, 28, 28))).astype(np.float32), y.astype(np.int64)

    x, y = draw(2000)
    xt, yt = draw(1000)
    return x, y, xt, yt


def _two_classes(labels: np.ndarray, partition_id: int, num_partitions: int) -> np.ndarray:
    """Indices of this partition: its two classes' share of the examples (classes cycle over partitions)."""
    classes = {(2 * partition_id) % 10, (2 * partition_id + 1) % 10}
    idx = np.flatnonzero(np.isin(labels, list(classes)))
    holders = [p for p in range(num_partitions) if {(2 * p) % 10, (2 * p + 1) % 10} == classes]
    return np.array_split(idx, len(holders))[holders.index(partition_id)]


def load_data(partition_id: int, num_partitions: int, run_config: dict) -> tuple[TensorDataset, TensorDataset]:
    """This partition's train and test sets (cached per process)."""
    name = str(run_config.get("dataset", "fashion-mnist"))
    seed = int(run_config.get("seed", 0))
    key = (name, seed, partition_id, num_partitions)
    with _lock:
        if key not in _cache:
            x, y, xt, yt = _fashion_mnist() if name == "fashion-mnist" else _synthetic(seed)
            tr, te = _two_classes(y, partition_id, num_partitions), _two_classes(yt, partition_id, num_partitions)
            _cache[key] = (TensorDataset(torch.from_numpy(x[tr]).unsqueeze(1), torch.from_numpy(y[tr])),
                           TensorDataset(torch.from_numpy(xt[te]).unsqueeze(1), torch.from_numpy(yt[te])))
        return _cache[key]


# -- the ClientApp ---------------------------------------------------------------------------------------
app = ClientApp()


def _generator(context: Context, server_round: int) -> torch.Generator:
    seed = int(context.run_config.get("seed", 0))
    pid = int(context.node_config["partition-id"])
    return torch.Generator().manual_seed(seed * 1_000_003 + pid * 7919 + server_round)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Load the received weights, train locally, reply with the new weights and the training loss."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    server_round = int(msg.content["config"]["server-round"])
    trainset, _ = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                            context.run_config)
    loader = DataLoader(trainset, batch_size=int(context.run_config.get("batch-size", 32)), shuffle=True,
                        generator=_generator(context, server_round))
    opt = torch.optim.SGD(model.parameters(), lr=float(context.run_config.get("lr", 0.05)))
    model.train()
    total, n = 0.0, 0
    for _ in range(int(context.run_config.get("local-epochs", 1))):
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(y)
            n += len(y)
    # Node state that survives rounds: how many rounds this node trained.
    done = int(context.state["progress"]["rounds-trained"]) if "progress" in context.state else 0
    context.state["progress"] = ConfigRecord({"rounds-trained": done + 1})
    metrics = MetricRecord({"train_loss": total / max(n, 1), "num-examples": len(trainset)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy and loss of the received weights on this partition's own test set."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testset = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                           context.run_config)
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for x, y in DataLoader(testset, batch_size=256):
            out = model(x)
            loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
    n = max(len(testset), 1)
    metrics = MetricRecord({"eval_loss": loss_sum / n, "eval_acc": correct / n, "num-examples": len(testset)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
