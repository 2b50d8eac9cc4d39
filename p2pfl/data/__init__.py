"""Data: datasets as shared normalized tensors, seeded partitions, and per-peer batch views."""

from .datasets import (
    KNOWN_DATASETS,
    ArrayDataset,
    DatasetUnavailableError,
    clear_dataset_cache,
    load_dataset,
)
from .loader import PeerData
from .partition import PARTITION_KINDS, Partition, PartitionError, label_histogram, make_partition

__all__ = [
    "KNOWN_DATASETS",
    "PARTITION_KINDS",
    "ArrayDataset",
    "DatasetUnavailableError",
    "Partition",
    "PartitionError",
    "PeerData",
    "clear_dataset_cache",
    "label_histogram",
    "load_dataset",
    "make_partition",
]
