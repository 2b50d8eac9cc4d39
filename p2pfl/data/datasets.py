"""Datasets as whole, pre-normalized tensors held once per process.

Why tensors and not ``torch.utils.data.Dataset`` objects: every peer of a simulation trains on a
subset of the same data, and per-sample ``__getitem__`` plus a collate function costs more than
the small models' training step. Here a dataset is loaded once, converted to float32 and
normalized once, and each peer indexes the shared tensors with ``torch.index_select``
(see :mod:`p2pfl.data.loader`). ``load_dataset`` caches the result, so a process holds one copy of
each dataset (DESIGN, "Performance principles").

The on-disk readers are our own (idx files and the CIFAR "python" batches, in the folder layout
torchvision uses), so loading a dataset that is already present never imports torchvision (start-up
time) and never depends on torchvision's checksum of the files. torchvision is imported only to
download a missing dataset; where no network is reachable, a :class:`DatasetUnavailableError`
says which dataset, where we looked and how to get it.
"""

from __future__ import annotations

import gzip
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "ArrayDataset",
    "DatasetUnavailableError",
    "KNOWN_DATASETS",
    "clear_dataset_cache",
    "load_dataset",
    "read_idx",
]

#: Where Fashion-MNIST is looked for after ``root`` and ``$P2PFL_DATA_DIR`` (in this order). The
#: Debian package ``dataset-fashion-mnist`` installs the first one. Module-level so tests can
#: point it elsewhere.
FASHION_MNIST_DIRS: tuple[str, ...] = ("/usr/share/datasets/fashion-mnist", "./data/fashion-mnist")

#: Environment variable naming a data folder (used when ``root`` is not given).
DATA_DIR_ENV = "P2PFL_DATA_DIR"
#: Set to ``1`` to never try a download (offline clusters, CI): fail at once with the message.
NO_DOWNLOAD_ENV = "P2PFL_NO_DOWNLOAD"

# Per-channel (mean, std) of the training images scaled to [0, 1]: the constants the papers'
# code uses, so normalization does not depend on which subset was loaded.
_NORM: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}

_IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


class DatasetUnavailableError(RuntimeError):
    """A dataset is neither on disk nor downloadable; the message says where we looked and how to get it."""


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """A whole dataset as normalized tensors, shared read-only by every peer of the process.

    ``eq=False`` because tensors have no boolean equality; identity is what matters for a cached,
    shared object. Callers must not mutate the tensors: they are shared by all peers.
    """

    name: str
    train_x: torch.Tensor  # float32 [N, C, H, W], normalized, contiguous
    train_y: torch.Tensor  # int64 [N]
    test_x: torch.Tensor  # float32 [M, C, H, W], normalized, contiguous
    test_y: torch.Tensor  # int64 [M]
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Shape of one sample ``(C, H, W)``, what a model factory needs to size its layers."""
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)

    @property
    def num_train(self) -> int:
        return int(self.train_y.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.test_y.shape[0])


# --------------------------------------------------------------------------------------------
# cache


_CACHE: dict[tuple[Any, ...], ArrayDataset] = {}
_CACHE_LOCK = threading.Lock()


def _freeze(value: Any) -> Any:
    """Turn params into a hashable, order-independent key (lists and tuples compare equal)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def clear_dataset_cache() -> None:
    """Drop every cached dataset (tests; or to free memory once no peer uses one)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def load_dataset(name: str, root: str | os.PathLike[str] | None = None, **params: Any) -> ArrayDataset:
    """Load (once per process) a dataset as normalized tensors.

    Args:
        name: one of :data:`KNOWN_DATASETS` (``fashion_mnist``, ``mnist``, ``cifar10``,
            ``cifar100``, ``synthetic``).
        root: folder to read from (and to download into); see the module docs for the search order.
        params: dataset parameters; only ``synthetic`` takes any.

    Returns the same object for the same ``(name, root, params)``: one copy per process.
    Raises ``ValueError`` for an unknown name or parameter, :class:`DatasetUnavailableError` when
    the data cannot be found or downloaded.
    """
    key_name = name.lower().replace("-", "_")
    key_name = _ALIASES.get(key_name, key_name)
    if key_name not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(KNOWN_DATASETS)}")
    defaults = _PARAM_DEFAULTS.get(key_name, {})
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        allowed = ", ".join(sorted(defaults)) or "none"
        raise ValueError(f"dataset {key_name!r}: unknown parameter(s) {unknown}; allowed: {allowed}")
    resolved = {**defaults, **params}  # defaults filled in, so equal requests share one cache entry
    key = (key_name, None if root is None else str(root), _freeze(resolved))
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            return cached
        ds = _LOADERS[key_name](None if root is None else Path(root), **resolved)
        _CACHE[key] = ds
        return ds


# --------------------------------------------------------------------------------------------
# readers


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an idx file (the MNIST format), gzip-compressed or not, into a numpy array.

    Parses the header ourselves (magic ``00 00 <type> <ndim>``, big-endian int32 dims) so that
    loading needs only numpy; only unsigned bytes (type 0x08), the MNIST family's type, are accepted.
    """
    path = Path(path)
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an idx file (bad magic)")
    dtype_code, ndim = data[2], data[3]
    if dtype_code != 0x08:
        raise ValueError(f"{path}: idx element type 0x{dtype_code:02x} unsupported (expected 0x08, ubyte)")
    dims = np.frombuffer(data, dtype=">i4", count=ndim, offset=4).astype(np.int64)
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(data) - offset != expected:
        raise ValueError(
            f"{path}: header says {tuple(dims)} ({expected} bytes), file has {len(data) - offset}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(tuple(int(d) for d in dims))


def _find_idx(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def _idx_folder_complete(folder: Path) -> bool:
    return all(_find_idx(folder, stem) is not None for stem in _IDX_FILES.values())


def _read_idx_folder(folder: Path) -> dict[str, np.ndarray]:
    arrays = {key: read_idx(_find_idx(folder, stem)) for key, stem in _IDX_FILES.items()}  # type: ignore[arg-type]
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ValueError(f"{folder}: {split} images {x.shape} and labels {y.shape} do not match")
        arrays[f"{split}_x"] = x[:, None, :, :]  # N x 1 x H x W
    return arrays


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler for the CIFAR "python" batches that refuses anything but numpy arrays and builtins.

    The batches are pickles (their official format); a pickle can run arbitrary code, so only the
    globals numpy needs to rebuild an array are let through.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how Python 3 protocol-2 pickles store an array's bytes
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing global {module}.{name} in a CIFAR batch file")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        entry = _NumpyOnlyUnpickler(f, encoding="latin1").load()
    if not isinstance(entry, dict) or "data" not in entry or label_key not in entry:
        raise ValueError(f"{path}: not a CIFAR batch (needs keys 'data' and {label_key!r})")
    x = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)  # rows are channel-major
    y = np.asarray(entry[label_key], dtype=np.int64)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{path}: {x.shape[0]} images but {y.shape[0]} labels")
    return x, y


_CIFAR_LAYOUT = {
    # name: (folder, train files, test files, label key, num classes)
    "cifar10": (
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        "labels",
        10,
    ),
    "cifar100": ("cifar-100-python", ("train",), ("test",), "fine_labels", 100),
}


def _read_cifar_folder(name: str, folder: Path) -> dict[str, np.ndarray]:
    _, train_files, test_files, label_key, _ = _CIFAR_LAYOUT[name]
    out: dict[str, np.ndarray] = {}
    for split, files in (("train", train_files), ("test", test_files)):
        parts = [_read_cifar_batch(folder / f, label_key) for f in files]
        out[f"{split}_x"] = np.concatenate([p[0] for p in parts])
        out[f"{split}_y"] = np.concatenate([p[1] for p in parts])
    return out


# --------------------------------------------------------------------------------------------
# conversion


def _to_dataset(name: str, arrays: Mapping[str, np.ndarray], num_classes: int) -> ArrayDataset:
    """uint8 arrays -> float32 normalized contiguous tensors, in place after one conversion copy."""
    mean, std = _NORM[name]
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1) * 255.0
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1) * 255.0
    tensors: dict[str, torch.Tensor] = {}
    for split in ("train", "test"):
        # astype copies (uint8 -> float32), so the in-place normalization below owns its buffer.
        x = torch.from_numpy(np.ascontiguousarray(arrays[f"{split}_x"]).astype(np.float32))
        x.sub_(m).div_(s)
        y = torch.from_numpy(np.asarray(arrays[f"{split}_y"]).astype(np.int64, copy=True))
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise ValueError(f"{name}: {split} labels outside [0, {num_classes})")
        tensors[f"{split}_x"], tensors[f"{split}_y"] = x.contiguous(), y
    return ArrayDataset(name=name, num_classes=num_classes, **tensors)


def _download_allowed() -> bool:
    return os.environ.get(NO_DOWNLOAD_ENV, "").strip().lower() not in ("1", "true", "yes")


def _download(name: str, root: Path) -> None:
    """Download ``name`` with torchvision into ``root`` (torchvision's folder layout).

    Imported lazily: torchvision costs start-up time and is not needed when data is on disk.
    Tests replace this function, since nothing can be downloaded there.
    """
    import torchvision.datasets as tvd  # lazy on purpose

    cls = {
        "mnist": tvd.MNIST,
        "fashion_mnist": tvd.FashionMNIST,
        "cifar10": tvd.CIFAR10,
        "cifar100": tvd.CIFAR100,
    }[name]
    root.mkdir(parents=True, exist_ok=True)
    for train in (True, False):
        cls(str(root), train=train, download=True)


def _try_download(name: str, root: Path) -> str | None:
    """Attempt a download; return ``None`` on success, else a one-line reason for the error message."""
    if not _download_allowed():
        return f"download skipped (${NO_DOWNLOAD_ENV} is set)"
    try:
        _download(name, root)
    except Exception as exc:  # any failure -> a clear DatasetUnavailableError
        return f"download into {root} failed: {type(exc).__name__}: {exc}"
    return None


def _default_root(root: Path | None) -> Path:
    if root is not None:
        return root
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else Path("./data")


def _unique(paths: Iterable[Path]) -> list[Path]:
    seen: set[str] = set()
    out = []
    for p in paths:
        if str(p) not in seen:
            seen.add(str(p))
            out.append(p)
    return out


# --------------------------------------------------------------------------------------------
# loaders


def _load_fashion_mnist(root: Path | None) -> ArrayDataset:
    """Fashion-MNIST from local idx files: root, $P2PFL_DATA_DIR, the Debian package's folder, ./data."""
    bases: list[Path] = []
    if root is not None:
        bases.append(root)
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        bases.append(Path(env))
    candidates: list[Path] = []
    for base in bases:  # a folder with the files, or a data folder holding them in a subfolder
        candidates += [base, base / "fashion-mnist", base / "FashionMNIST" / "raw"]
    candidates += [Path(d) for d in FASHION_MNIST_DIRS]
    download_root = root if root is not None else Path("./data")
    candidates.append(download_root / "FashionMNIST" / "raw")  # where torchvision puts it
    candidates = _unique(candidates)
    for folder in candidates:
        if _idx_folder_complete(folder):
            return _to_dataset("fashion_mnist", _read_idx_folder(folder), 10)
    reason = _try_download("fashion_mnist", download_root)
    tv_folder = download_root / "FashionMNIST" / "raw"
    if reason is None and _idx_folder_complete(tv_folder):
        return _to_dataset("fashion_mnist", _read_idx_folder(tv_folder), 10)
    raise DatasetUnavailableError(
        "Fashion-MNIST is not available. Looked for "
        f"{', '.join(s + '[.gz]' for s in _IDX_FILES.values())} in: "
        f"{', '.join(str(c) for c in candidates)}; {reason or 'download gave no files'}. "
        "To get it: install the Debian package `dataset-fashion-mnist` (apt-get install "
        "dataset-fashion-mnist, files under /usr/share/datasets/fashion-mnist), or put the four idx "
        f"files in a folder and pass it as root or set ${DATA_DIR_ENV}, or run once where the "
        "network allows the torchvision download."
    )


def _load_mnist(root: Path | None) -> ArrayDataset:
    """MNIST in torchvision's layout ``<root>/MNIST/raw`` (read locally, downloaded if missing)."""
    base = _default_root(root)
    folder = base / "MNIST" / "raw"
    reason = None
    if not _idx_folder_complete(folder):
        reason = _try_download("mnist", base)
    if _idx_folder_complete(folder):
        return _to_dataset("mnist", _read_idx_folder(folder), 10)
    raise DatasetUnavailableError(
        f"MNIST is not available: looked for {', '.join(_IDX_FILES.values())}[.gz] in {folder}; "
        f"{reason}. To get it: run once where the network allows torchvision's download "
        f"(load_dataset('mnist', root=...)), or copy the idx files into {folder}."
    )


def _load_cifar(name: str, root: Path | None) -> ArrayDataset:
    """CIFAR-10/100 "python" batches in torchvision's layout (read locally, downloaded if missing)."""
    sub, train_files, test_files, _, num_classes = _CIFAR_LAYOUT[name]
    base = _default_root(root)
    folder = base / sub
    files = [folder / f for f in (*train_files, *test_files)]
    reason = None
    if not all(f.is_file() for f in files):
        reason = _try_download(name, base)
    if all(f.is_file() for f in files):
        return _to_dataset(name, _read_cifar_folder(name, folder), num_classes)
    raise DatasetUnavailableError(
        f"{name.upper()} is not available: looked for {', '.join(f.name for f in files)} in {folder}; "
        f"{reason}. To get it: run once where the network allows torchvision's download "
        f"(load_dataset({name!r}, root=...)), or unpack the official python-version archive into {base}."
    )


def _load_synthetic(
    root: Path | None,
    *,
    num_classes: int = 10,
    train_size: int = 2000,
    test_size: int = 1000,
    shape: Iterable[int] = (1, 28, 28),
    noise: float = 1.0,
    seed: int = 0,
) -> ArrayDataset:
    """A small learnable task for fast tests: class prototype images plus Gaussian noise.

    Each class has a fixed random N(0, 1) prototype; a sample is its class prototype plus
    ``noise`` times N(0, 1), divided by ``sqrt(1 + noise**2)`` so that, like the real datasets,
    values are about zero-mean and unit-variance. Labels are balanced (``i % num_classes``) and
    shuffled. Everything comes from ``numpy.random.default_rng(seed)``: same params, same bytes.
    ``root`` is ignored.
    """
    del root
    shape_t = tuple(int(s) for s in shape)
    if len(shape_t) != 3 or min(shape_t) < 1:
        raise ValueError(f"synthetic: shape must be (C, H, W) with positive sizes, got {shape_t}")
    if num_classes < 2 or train_size < 1 or test_size < 1:
        raise ValueError("synthetic: need num_classes >= 2, train_size >= 1 and test_size >= 1")
    if noise < 0:
        raise ValueError(f"synthetic: noise must be >= 0, got {noise}")
    rng = np.random.default_rng(seed)
    protos = rng.standard_normal((num_classes, *shape_t), dtype=np.float32)
    scale = np.float32(1.0 / np.sqrt(1.0 + float(noise) ** 2))

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = rng.permutation(np.arange(n, dtype=np.int64) % num_classes)
        x = rng.standard_normal((n, *shape_t), dtype=np.float32)
        x *= np.float32(noise)
        x += protos[y]
        x *= scale
        return torch.from_numpy(x), torch.from_numpy(y)

    train_x, train_y = draw(int(train_size))
    test_x, test_y = draw(int(test_size))
    return ArrayDataset("synthetic", train_x, train_y, test_x, test_y, int(num_classes))


_LOADERS: dict[str, Callable[..., ArrayDataset]] = {
    "fashion_mnist": _load_fashion_mnist,
    "mnist": _load_mnist,
    "cifar10": lambda root: _load_cifar("cifar10", root),
    "cifar100": lambda root: _load_cifar("cifar100", root),
    "synthetic": _load_synthetic,
}
_PARAM_DEFAULTS: dict[str, dict[str, Any]] = {
    "synthetic": {
        "num_classes": 10,
        "train_size": 2000,
        "test_size": 1000,
        "shape": (1, 28, 28),
        "noise": 1.0,
        "seed": 0,
    },
}
_ALIASES = {
    "fashionmnist": "fashion_mnist",
    "fmnist": "fashion_mnist",
    "cifar_10": "cifar10",
    "cifar_100": "cifar100",
}

def dataset_parameters(name: str) -> dict[str, Any]:
    """Dataset ``name``'s parameters with their defaults (``data.params``); KeyError if unknown."""
    key = _ALIASES.get(name.lower().replace("-", "_"), name.lower().replace("-", "_"))
    if key not in _LOADERS:
        raise KeyError(name)
    return dict(_PARAM_DEFAULTS.get(key, {}))


#: Names ``load_dataset`` accepts.
KNOWN_DATASETS: tuple[str, ...] = tuple(_LOADERS)
