"""One peer's batches, drawn from the shared dataset by index.

Why not ``torch.utils.data.DataLoader``: its per-sample fetch and collate cost more than a small
model's step, its worker processes would copy the dataset, and its shuffling draws from the
global RNG unless carefully wired. Here a batch is one ``torch.index_select`` on the shared,
already-normalized tensors (DESIGN: one copy of each dataset per machine), and every random
choice comes from the ``torch.Generator`` the caller passes in, so a peer's batches are a pure
function of its generator state, in any process and in any worker order.

On a CUDA device the peer's own subset is copied to the device once (it is small; the host to
device copy per batch would cost more than the step), and batches are then gathered on the device.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .datasets import ArrayDataset

__all__ = ["PeerData"]


def _index_tensor(idx: np.ndarray | torch.Tensor, n: int, what: str) -> torch.Tensor:
    # np.array copies: partition arrays are read-only, and the peer must own its index tensor.
    t = (
        idx.detach().clone()
        if isinstance(idx, torch.Tensor)
        else torch.from_numpy(np.array(idx, dtype=np.int64))
    )
    t = t.to(torch.int64).reshape(-1).cpu().contiguous()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
        raise IndexError(f"{what} indices out of range [0, {n})")
    return t


class PeerData:
    """One peer's view of a shared ArrayDataset: indices only, no copy of the dataset on CPU.

    Args:
        dataset: the shared dataset (from :func:`p2pfl.data.load_dataset`).
        train_idx, test_idx: this peer's indices into the train and test sets (a
            :class:`~p2pfl.data.partition.Partition` entry).
        batch_size: training minibatch size.
        device: where batches are returned; on CUDA the subset is moved there once.
    """

    def __init__(
        self,
        dataset: ArrayDataset,
        train_idx: np.ndarray,
        test_idx: np.ndarray,
        batch_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.num_classes = int(dataset.num_classes)
        train_t = _index_tensor(train_idx, dataset.train_y.shape[0], "train")
        test_t = _index_tensor(test_idx, dataset.test_y.shape[0], "test")
        self._train_host, self._test_host = train_t.numpy().copy(), test_t.numpy().copy()
        self._train_host.flags.writeable = False
        self._test_host.flags.writeable = False
        self.num_train = int(train_t.numel())
        self.num_test = int(test_t.numel())
        if self.device.type == "cpu":
            # Index the shared tensors per batch: no per-peer copy of the data.
            self._train_x, self._train_y, self._train_idx = dataset.train_x, dataset.train_y, train_t
            self._test_x, self._test_y, self._test_idx = dataset.test_x, dataset.test_y, test_t
        else:
            # Keep this peer's subset on the device once; batches then index it there.
            self._train_x = dataset.train_x.index_select(0, train_t).to(self.device)
            self._train_y = dataset.train_y.index_select(0, train_t).to(self.device)
            self._test_x = dataset.test_x.index_select(0, test_t).to(self.device)
            self._test_y = dataset.test_y.index_select(0, test_t).to(self.device)
            self._train_idx = torch.arange(self.num_train, device=self.device)
            self._test_idx = torch.arange(self.num_test, device=self.device)

    def __repr__(self) -> str:
        return (
            f"PeerData({self.dataset.name}, train={self.num_train}, test={self.num_test}, "
            f"batch_size={self.batch_size}, device={self.device})"
        )

    def steps_per_epoch(self) -> int:
        """Minibatches in one pass, the last partial one included (``ceil(n / batch_size)``)."""
        return -(-self.num_train // self.batch_size)

    def _perm(self, generator: torch.Generator) -> torch.Tensor:
        # Drawn on the generator's device, so the result depends only on the generator state
        # (a CPU generator gives the same batches for a CPU and a CUDA peer).
        perm = torch.randperm(self.num_train, generator=generator, device=generator.device)
        return perm.to(self._train_idx.device)

    def _gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.index_select(self._train_x, 0, rows), torch.index_select(self._train_y, 0, rows)

    def epoch(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass over the train set; the last partial batch is kept.

        The permutation is drawn when the iterator is first advanced.
        """
        for pos in self.epoch_positions(generator):
            yield self.train_batch(pos)

    def sample_batch(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One random minibatch of ``batch_size`` distinct samples (all of them if fewer)."""
        return self.train_batch(self.sample_positions(generator))

    # Positions (0..num_train-1 into this peer's own train list) rather than batches: the batched
    # engine gathers every peer's batch in one indexing op, and the frozen-body cache indexes its
    # features by them. Drawing is the same as for ``epoch``/``sample_batch``, draw for draw.
    def epoch_positions(self, generator: torch.Generator) -> Iterator[torch.Tensor]:
        """The positions of each minibatch of one shuffled pass (the permutation is drawn lazily)."""
        if self.num_train == 0:
            return
        perm = self._perm(generator)
        for start in range(0, self.num_train, self.batch_size):
            yield perm[start : start + self.batch_size]

    def sample_positions(self, generator: torch.Generator) -> torch.Tensor:
        """The positions of one random minibatch of distinct samples."""
        if self.num_train == 0:
            raise ValueError("this peer has no training samples")
        return self._perm(generator)[: self.batch_size]

    def train_batch(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``positions`` of this peer's train list."""
        return self._gather(self._train_idx.index_select(0, positions))

    def test_batches(self, batch_size: int = 1000) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The peer's test set in order, in batches of ``batch_size`` (no randomness)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for start in range(0, self.num_test, batch_size):
            rows = self._test_idx[start : start + batch_size]
            yield torch.index_select(self._test_x, 0, rows), torch.index_select(self._test_y, 0, rows)

    def train_label_counts(self) -> torch.Tensor:
        """How many of this peer's training samples have each label (int64, ``[num_classes]``, on ``device``)."""
        labels = torch.index_select(self._train_y, 0, self._train_idx)
        return torch.bincount(labels.long(), minlength=self.num_classes)

    @property
    def train_indices(self) -> np.ndarray:
        """This peer's train indices into the shared train set (read-only)."""
        return self._train_host

    @property
    def test_indices(self) -> np.ndarray:
        """This peer's test indices into the shared test set (read-only)."""
        return self._test_host
