"""Tests for p2pfl.data: datasets, partitions (statistics and protocol), and per-peer loaders."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pfl.data import (
    KNOWN_DATASETS,
    ArrayDataset,
    DatasetUnavailableError,
    Partition,
    PartitionError,
    PeerData,
    clear_dataset_cache,
    label_histogram,
    load_dataset,
    make_partition,
)
from p2pfl.data import datasets as ds_mod

K = 10
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch):
    """No test may download, nor see another test's cached dataset or the user's data dir."""

    def no_download(name: str, root: Path) -> None:
        raise OSError(f"offline (test): no download of {name}")

    monkeypatch.setattr(ds_mod, "_download", no_download)
    monkeypatch.delenv(ds_mod.DATA_DIR_ENV, raising=False)
    monkeypatch.delenv(ds_mod.NO_DOWNLOAD_ENV, raising=False)
    clear_dataset_cache()
    yield
    clear_dataset_cache()


def balanced_labels(n: int, k: int = K, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % k).astype(np.int64)


@pytest.fixture(scope="module")
def labels() -> tuple[np.ndarray, np.ndarray]:
    return balanced_labels(6000), balanced_labels(2000, seed=1)


def shares(train_labels: np.ndarray, idx: np.ndarray) -> np.ndarray:
    h = label_histogram(train_labels, idx, K)
    return h / h.sum()


def assert_disjoint(parts: tuple[np.ndarray, ...]) -> np.ndarray:
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "clients share train samples"
    return allidx


# --------------------------------------------------------------------------------------------
# partitions


def test_iid_equal_disjoint_and_covering(labels):
    tr, te = labels
    p = make_partition(tr, te, 20, "iid", seed=0)
    assert p.kind == "iid" and p.num_clients == 20
    assert set(p.sizes()) == {300}
    allidx = assert_disjoint(p.train)
    assert np.array_equal(np.sort(allidx), np.arange(len(tr)))
    for a in p.train:
        assert a.dtype == np.int64 and np.all(np.diff(a) > 0)  # sorted


def test_iid_uneven_and_fixed_size(labels):
    tr, te = labels
    p = make_partition(tr, te, 7, "iid", seed=0)
    assert p.sizes().max() - p.sizes().min() <= 1 and p.sizes().sum() == len(tr)
    q = make_partition(tr, te, 7, "iid", seed=0, samples_per_client=100)
    assert set(q.sizes()) == {100}
    assert_disjoint(q.train)


def test_dirichlet_equal_sizes_disjoint(labels):
    tr, te = labels
    p = make_partition(tr, te, 30, "dirichlet", seed=3, alpha=0.3)
    assert set(p.sizes()) == {6000 // 30}
    assert_disjoint(p.train)
    assert p.params["alpha"] == 0.3 and p.params["samples_per_client"] == 200
    q = make_partition(tr, te, 30, "dirichlet", seed=3, alpha=0.3, samples_per_client=50)
    assert set(q.sizes()) == {50}


def test_dirichlet_alpha_controls_concentration(labels):
    tr, te = labels

    def mean_max_share(alpha: float) -> float:
        p = make_partition(tr, te, 30, "dirichlet", seed=0, alpha=alpha, samples_per_client=100)
        return float(np.mean([shares(tr, a).max() for a in p.train]))

    low, high = mean_max_share(0.1), mean_max_share(100.0)
    assert low > 0.6, low
    assert high < 0.3, high


def test_dirichlet_exhausted_classes_are_renormalized():
    """Everything handed out while classes run out: each client still gets exactly its quota."""
    tr = np.repeat(np.arange(K), [1000, 10, 10, 10, 10, 10, 10, 10, 10, 10])
    p = make_partition(tr, tr, 10, "dirichlet", seed=5, alpha=0.05)
    assert set(p.sizes()) == {109}
    allidx = assert_disjoint(p.train)
    assert len(allidx) == 1090


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("iid", {}),
        ("dirichlet", {"alpha": 0.3}),
        ("dirichlet_per_class", {"pi": 0.3}),
        ("pathological", {"classes_per_client": 2}),
    ],
)
def test_seed_determinism(labels, kind, params):
    tr, te = labels
    a = make_partition(tr, te, 16, kind, seed=11, **params)
    b = make_partition(tr, te, 16, kind, seed=11, **params)
    c = make_partition(tr, te, 16, kind, seed=12, **params)
    assert a == b
    assert a != c
    assert any(not np.array_equal(x, y) for x, y in zip(a.train, c.train, strict=True))


def test_dirichlet_per_class_assigns_every_sample(labels):
    tr, te = labels
    p = make_partition(tr, te, 20, "dirichlet_per_class", seed=0, pi=0.1)
    allidx = assert_disjoint(p.train)
    assert np.array_equal(np.sort(allidx), np.arange(len(tr)))  # every sample of every class assigned
    assert p.sizes().min() >= 10  # default min_size
    assert p.sizes().max() > 4 * p.sizes().min()  # unbalanced at small pi
    # large pi: nearly balanced (sizes within a factor of 2)
    q = make_partition(tr, te, 20, "dirichlet_per_class", seed=0, pi=1000.0)
    assert q.sizes().max() < 2 * q.sizes().min()


def test_dirichlet_per_class_min_size_unreachable(labels):
    tr, te = labels
    with pytest.raises(PartitionError, match="min_size"):
        make_partition(tr, te, 20, "dirichlet_per_class", seed=0, pi=0.01, min_size=250, max_attempts=5)
    with pytest.raises(PartitionError, match="min_size"):
        make_partition(tr, te, 20, "dirichlet_per_class", seed=0, pi=0.5, min_size=400)


def test_dirichlet_per_class_balance_option(labels):
    tr, te = labels
    p = make_partition(tr, te, 20, "dirichlet_per_class", seed=0, pi=0.1, balance=True)
    q = make_partition(tr, te, 20, "dirichlet_per_class", seed=0, pi=0.1)
    assert_disjoint(p.train)
    assert p.sizes().sum() == len(tr)
    assert p.sizes().max() <= q.sizes().max()


def test_independent_test_split_is_a_second_draw_of_the_same_kind(labels):
    """``independent_test``: the DePRL authors' code splits its test set by a second, independent Dirichlet
    draw (GYan58/AAAI24-DePRL Utils.py:428-432): a client's test labels no longer follow its train labels,
    while the train split stays what it was."""
    tr, te = labels
    for kind, params in (("dirichlet", {"alpha": 0.1, "samples_per_client": 150}),
                         ("dirichlet_per_class", {"pi": 0.1}), ("pathological", {"classes_per_client": 2})):
        matched = make_partition(tr, te, 20, kind, seed=3, **params)
        indep = make_partition(tr, te, 20, kind, seed=3, independent_test=True, **params)
        assert indep == make_partition(tr, te, 20, kind, seed=3, independent_test=True, **params)  # seeded
        assert all(np.array_equal(a, b) for a, b in zip(matched.train, indep.train, strict=True))
        assert "independent_test" not in matched.params and indep.params["independent_test"] is True
        assert_disjoint(indep.test)  # one draw over the test set: no test sample is dealt twice
        # the share of each client's test samples whose class it trains on: all of them when matched
        covered = [float(np.isin(te[t], np.unique(tr[x])).mean()) for x, t in zip(indep.train, indep.test, strict=True)]
        assert all(np.isin(te[t], np.unique(tr[x])).all() for x, t in zip(matched.train, matched.test, strict=True))
        assert np.mean(covered) < 0.8, (kind, np.mean(covered))
    p = make_partition(tr, te, 20, "dirichlet", seed=3, alpha=0.1, samples_per_client=150, independent_test=True)
    assert {len(t) for t in p.test} == {round(150 * len(te) / len(tr))}  # the train size, scaled to the test set
    p = make_partition(tr, te, 20, "dirichlet", seed=3, alpha=0.1, samples_per_client=150, independent_test=True,
                       test_size=30)
    assert {len(t) for t in p.test} == {30}
    # a partition made before the option existed is equal to one made now without it (no new key saved)
    assert make_partition(tr, te, 20, "iid", seed=1) == Partition.from_dict(
        make_partition(tr, te, 20, "iid", seed=1, independent_test=False).to_dict())


def test_independent_test_split_refuses_what_it_cannot_make(labels):
    tr, te = labels
    with pytest.raises(PartitionError, match="test_size sets the matched test split only"):
        make_partition(tr, te, 20, "dirichlet_per_class", seed=0, pi=0.1, independent_test=True, test_size=5)
    with pytest.raises(PartitionError, match="needs more than the 2000 test samples"):
        make_partition(tr, te, 20, "dirichlet", seed=0, alpha=0.1, samples_per_client=150, independent_test=True,
                       test_size=101)
    with pytest.raises(PartitionError, match="independent_test must be true or false"):
        make_partition(tr, te, 20, "iid", seed=0, independent_test="yes")


@pytest.mark.parametrize("c", [1, 2, 3, 5])
def test_pathological_exact_classes(labels, c):
    tr, te = labels
    p = make_partition(tr, te, 25, "pathological", seed=0, classes_per_client=c)
    assert_disjoint(p.train)
    used = np.zeros(K, dtype=int)
    for a in p.train:
        present = np.flatnonzero(label_histogram(tr, a, K))
        assert len(present) == c
        used[present] += 1
    assert used.min() >= 1 and used.max() - used.min() <= 1  # every class used, evenly
    assert p.sizes().sum() == len(tr)


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("iid", {}),
        ("dirichlet", {"alpha": 0.1}),
        ("dirichlet_per_class", {"pi": 0.3}),
        ("pathological", {"classes_per_client": 3}),
    ],
)
def test_test_split_follows_train_distribution(labels, kind, params):
    tr, te = labels
    p = make_partition(tr, te, 12, kind, seed=4, test_size=150, **params)
    for a, t in zip(p.train, p.test, strict=True):
        assert len(t) == 150 and len(np.unique(t)) == len(t)  # without replacement within a client
        train_share, test_share = shares(tr, a), shares(te, t)
        assert 0.5 * np.abs(train_share - test_share).sum() < 0.05
        assert set(np.flatnonzero(test_share)) <= set(np.flatnonzero(train_share))
    # default size: proportional to the client's train size
    q = make_partition(tr, te, 12, kind, seed=4, **params)
    for a, t in zip(q.train, q.test, strict=True):
        assert len(t) == max(1, round(len(a) * len(te) / len(tr)))


def test_test_split_keeps_rare_classes(labels):
    """A class with a small train share still gets one test sample."""
    tr, te = labels
    idx = np.concatenate([np.flatnonzero(tr == 0)[:3], np.flatnonzero(tr == 1)[:297]])
    from p2pfl.data.partition import _test_counts

    cnt = _test_counts(label_histogram(tr, idx, K), 50, np.full(K, 100))
    assert cnt[0] == 1 and cnt[1] == 49 and cnt.sum() == 50  # 3/300 * 50 = 0.5 would round to 0


def test_test_split_capped_by_test_set(labels):
    """A client cannot get more test samples of a class than the test set has (no duplicates)."""
    tr, te = labels
    p = make_partition(tr, te, 10, "pathological", seed=0, classes_per_client=1, test_size=500)
    for t in p.test:
        assert len(t) == 200 and len(np.unique(t)) == 200  # the whole class, once


def test_save_load_round_trip(labels, tmp_path):
    tr, te = labels
    p = make_partition(tr, te, 8, "dirichlet", seed=2, alpha=0.5)
    json.dumps(p.to_dict())  # JSON-safe
    path = tmp_path / "partition.json"
    p.save(path)
    q = Partition.load(path)
    assert q == p
    assert q.params == {"alpha": 0.5, "samples_per_client": 750, "test_size": None}
    assert all(a.dtype == np.int64 for a in q.train + q.test)
    with pytest.raises(ValueError):
        q.train[0][0] = 1  # read-only: a partition is shared
    with pytest.raises(PartitionError):
        Partition.from_dict({"kind": "iid"})
    bad = p.to_dict()
    bad["train"][0][0] = -5
    with pytest.raises(PartitionError, match="non-negative"):
        Partition.from_dict(bad)


@pytest.mark.parametrize(
    ("n", "kind", "params", "match"),
    [
        (4, "dirichlet", {"alpha": 0.0}, "alpha"),
        (4, "dirichlet", {"alpha": -1.0}, "alpha"),
        (4, "dirichlet", {}, "alpha"),
        (4, "dirichlet_per_class", {"pi": 0}, "pi"),
        (4, "pathological", {"classes_per_client": 11}, "classes_per_client"),
        (4, "pathological", {"classes_per_client": 0}, "classes_per_client"),
        (7000, "iid", {}, "num_clients"),
        (0, "iid", {}, "num_clients"),
        (4, "shards", {}, "unknown partition kind"),
        (4, "iid", {"alpha": 0.1}, "unknown parameter"),
        (4, "dirichlet", {"alpha": 0.1, "samples_per_client": 2000}, "samples_per_client"),
    ],
)
def test_bad_params_raise(labels, n, kind, params, match):
    tr, te = labels
    with pytest.raises(PartitionError, match=match):
        make_partition(tr, te, n, kind, seed=0, **params)


def test_bad_labels_raise():
    with pytest.raises(PartitionError, match="1-D integer"):
        make_partition(np.zeros((3, 2), dtype=np.int64), np.zeros(3, dtype=np.int64), 1, "iid", 0)
    with pytest.raises(PartitionError, match="negative"):
        make_partition(np.array([0, -1]), np.array([0]), 1, "iid", 0)


def test_label_histogram():
    y = np.array([0, 1, 1, 2, 2, 2])
    assert label_histogram(y, np.array([1, 3, 4]), 4).tolist() == [0, 1, 2, 0]


def test_dispfl_scale_fashion_mnist_labels():
    """At paper scale (100 clients, 60000 samples) partitioning stays fast and exact."""
    tr, te = balanced_labels(60000), balanced_labels(10000, seed=1)
    p = make_partition(tr, te, 100, "dirichlet", seed=0, alpha=0.1)
    assert set(p.sizes()) == {600} and {len(t) for t in p.test} == {100}
    q = make_partition(tr, te, 128, "dirichlet_per_class", seed=0, pi=0.1)
    assert q.sizes().sum() == 60000 and q.sizes().min() >= 10


# --------------------------------------------------------------------------------------------
# loader


def indexed_dataset(n_train: int = 103, n_test: int = 37) -> ArrayDataset:
    """Each sample's pixel value is its own index, so batches reveal which samples they hold."""
    tx = torch.arange(n_train, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 1, 2, 2).contiguous()
    vx = torch.arange(n_test, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 1, 2, 2).contiguous()
    return ArrayDataset("indexed", tx, torch.arange(n_train) % 3, vx, torch.arange(n_test) % 3, 3)


def batch_ids(x: torch.Tensor) -> list[int]:
    return x[:, 0, 0, 0].long().tolist()


def test_epoch_covers_each_train_index_once():
    ds = indexed_dataset()
    idx = np.arange(5, 100, 2)  # 48 samples
    peer = PeerData(ds, idx, np.arange(10), batch_size=10)
    assert peer.num_train == 48 and peer.num_test == 10 and peer.steps_per_epoch() == 5
    batches = list(peer.epoch(torch.Generator().manual_seed(0)))
    assert [len(x) for x, _ in batches] == [10, 10, 10, 10, 8]  # last partial batch kept
    seen = [i for x, _ in batches for i in batch_ids(x)]
    assert sorted(seen) == idx.tolist()
    assert seen != idx.tolist()  # shuffled
    for x, y in batches:
        assert torch.equal(y, x[:, 0, 0, 0].long() % 3)  # labels travel with their samples


def test_loader_determinism_and_global_rng_untouched():
    ds = indexed_dataset()
    idx = np.arange(0, 103, 3)
    a, b = PeerData(ds, idx, idx[:5], 8), PeerData(ds, idx, idx[:5], 8)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    ga, gb = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    ea = [batch_ids(x) for x, _ in a.epoch(ga)] + [batch_ids(a.sample_batch(ga)[0]) for _ in range(3)]
    eb = [batch_ids(x) for x, _ in b.epoch(gb)] + [batch_ids(b.sample_batch(gb)[0]) for _ in range(3)]
    assert ea == eb
    assert torch.equal(torch.get_rng_state(), state)  # only the passed generator was used
    ec = [batch_ids(x) for x, _ in a.epoch(torch.Generator().manual_seed(8))]
    assert ec != ea[: len(ec)]


def test_sample_batch_distinct_and_within_subset():
    ds = indexed_dataset()
    idx = np.arange(20, 60)
    peer = PeerData(ds, idx, np.arange(3), batch_size=16)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = peer.sample_batch(g)
        ids = batch_ids(x)
        assert len(ids) == 16 and len(set(ids)) == 16 and set(ids) <= set(idx.tolist())
    small = PeerData(ds, np.arange(5), np.arange(3), batch_size=16)
    assert sorted(batch_ids(small.sample_batch(g)[0])) == [0, 1, 2, 3, 4]


def test_test_batches_in_order():
    ds = indexed_dataset()
    test_idx = np.array([1, 4, 9, 16, 25, 36])
    peer = PeerData(ds, np.arange(10), test_idx, batch_size=4)
    out = list(peer.test_batches(batch_size=4))
    assert [len(x) for x, _ in out] == [4, 2]
    assert [i for x, _ in out for i in batch_ids(x)] == test_idx.tolist()


def test_loader_rejects_out_of_range():
    with pytest.raises(IndexError):
        PeerData(indexed_dataset(), np.array([0, 500]), np.arange(3), batch_size=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peer_matches_cpu_peer():
    ds = indexed_dataset()
    idx = np.arange(0, 90, 2)
    cpu, gpu = PeerData(ds, idx, idx[:7], 8), PeerData(ds, idx, idx[:7], 8, device="cuda")
    ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for (xa, ya), (xb, yb) in zip(cpu.epoch(ga), gpu.epoch(gb), strict=True):
        assert xb.is_cuda and torch.equal(xa, xb.cpu()) and torch.equal(ya, yb.cpu())
    assert torch.equal(cpu.sample_batch(ga)[0], gpu.sample_batch(gb)[0].cpu())


# --------------------------------------------------------------------------------------------
# datasets


def test_synthetic_deterministic_cached_and_learnable():
    a = load_dataset("synthetic", num_classes=4, train_size=400, test_size=200, shape=[1, 8, 8], seed=3)
    b = load_dataset("synthetic", num_classes=4, train_size=400, test_size=200, shape=(1, 8, 8), seed=3)
    assert a is b  # cached: one copy per process
    clear_dataset_cache()
    c = load_dataset("synthetic", num_classes=4, train_size=400, test_size=200, shape=(1, 8, 8), seed=3)
    assert c is not a and torch.equal(a.train_x, c.train_x) and torch.equal(a.test_y, c.test_y)
    d = load_dataset("synthetic", num_classes=4, train_size=400, test_size=200, shape=(1, 8, 8), seed=4)
    assert not torch.equal(a.train_x, d.train_x)
    assert a.input_shape == (1, 8, 8) and a.num_classes == 4
    assert a.train_x.dtype == torch.float32 and a.train_y.dtype == torch.int64
    assert a.train_x.shape == (400, 1, 8, 8) and a.test_x.shape == (200, 1, 8, 8)
    assert abs(a.train_x.mean().item()) < 0.2 and abs(a.train_x.std().item() - 1) < 0.2
    assert torch.bincount(a.train_y).tolist() == [100] * 4
    # learnable: nearest class mean of the training set classifies the test set
    means = torch.stack([a.train_x[a.train_y == k].mean(0) for k in range(4)]).flatten(1)
    pred = torch.cdist(a.test_x.flatten(1), means).argmin(1)
    assert (pred == a.test_y).float().mean().item() > 0.9
    assert load_dataset("synthetic") is load_dataset("synthetic", seed=0)  # defaults resolved


def test_unknown_dataset_and_params():
    with pytest.raises(ValueError, match="fashion_mnist"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="unknown parameter"):
        load_dataset("synthetic", colour=True)
    with pytest.raises(ValueError, match="unknown parameter"):
        load_dataset("mnist", seed=1)
    assert set(KNOWN_DATASETS) == {"fashion_mnist", "mnist", "cifar10", "cifar100", "synthetic"}


def write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + np.asarray(arr.shape, dtype=">i4").tobytes()
    data = header + arr.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def write_fake_mnist(folder: Path, gz: bool, n_train: int = 12, n_test: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(n_test) % 10,
    }
    for stem, arr in arrays.items():
        write_idx(folder / stem, arr, gz)
    return arrays


def test_mnist_from_torchvision_layout(tmp_path):
    raw = write_fake_mnist(tmp_path / "MNIST" / "raw", gz=False)
    ds = load_dataset("mnist", root=tmp_path)
    assert ds.train_x.shape == (12, 1, 28, 28) and ds.test_x.shape == (5, 1, 28, 28)
    assert ds.train_y.tolist() == raw["train-labels-idx1-ubyte"].tolist()
    expect = (torch.from_numpy(raw["train-images-idx3-ubyte"]).float() / 255 - 0.1307) / 0.3081
    assert torch.allclose(ds.train_x[:, 0], expect, atol=1e-5)
    assert ds.train_x.is_contiguous() and ds.num_classes == 10


def test_fashion_mnist_from_root_and_env(tmp_path, monkeypatch):
    write_fake_mnist(tmp_path / "a", gz=True)
    ds = load_dataset("fashion_mnist", root=tmp_path / "a")  # root is searched first
    assert ds.train_x.shape == (12, 1, 28, 28) and ds.name == "fashion_mnist"
    write_fake_mnist(tmp_path / "b" / "fashion-mnist", gz=True, n_train=7)
    monkeypatch.setenv(ds_mod.DATA_DIR_ENV, str(tmp_path / "b"))
    monkeypatch.setattr(ds_mod, "FASHION_MNIST_DIRS", ())
    assert load_dataset("fashion_mnist").train_x.shape[0] == 7


def test_missing_fashion_mnist_message(tmp_path, monkeypatch):
    monkeypatch.setattr(ds_mod, "FASHION_MNIST_DIRS", (str(tmp_path / "nowhere"),))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetUnavailableError) as err:
        load_dataset("fashion_mnist", root=tmp_path / "empty")
    msg = str(err.value)
    assert "Fashion-MNIST" in msg and "dataset-fashion-mnist" in msg
    assert str(tmp_path / "empty") in msg and str(tmp_path / "nowhere") in msg
    assert "offline (test)" in msg  # the download was tried, and why it failed is said


@pytest.mark.parametrize("name", ["mnist", "cifar10", "cifar100"])
def test_missing_torchvision_dataset_message(tmp_path, name):
    with pytest.raises(DatasetUnavailableError) as err:
        load_dataset(name, root=tmp_path)
    assert str(tmp_path) in str(err.value) and "download" in str(err.value)


def test_no_download_env_skips_download(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(ds_mod, "_download", lambda name, root: calls.append(name))
    monkeypatch.setenv(ds_mod.NO_DOWNLOAD_ENV, "1")
    with pytest.raises(DatasetUnavailableError, match=ds_mod.NO_DOWNLOAD_ENV):
        load_dataset("mnist", root=tmp_path)
    assert calls == []


def test_download_then_read(tmp_path, monkeypatch):
    """A successful download (here: writing fake files) is read from torchvision's layout."""
    monkeypatch.setattr(
        ds_mod, "_download", lambda name, root: write_fake_mnist(root / "MNIST" / "raw", gz=True)
    )
    assert load_dataset("mnist", root=tmp_path).train_x.shape == (12, 1, 28, 28)


def write_cifar_batch(path: Path, n: int, label_key: str, num_classes: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({"data": data, label_key: [i % num_classes for i in range(n)]}, f, protocol=2)
    return data


def test_cifar10_and_cifar100_python_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    first = write_cifar_batch(folder / "data_batch_1", 4, "labels", 10, 0)
    for i in range(2, 6):
        write_cifar_batch(folder / f"data_batch_{i}", 4, "labels", 10, i)
    write_cifar_batch(folder / "test_batch", 3, "labels", 10, 9)
    c10 = load_dataset("cifar10", root=tmp_path)
    assert (
        c10.train_x.shape == (20, 3, 32, 32) and c10.test_x.shape == (3, 3, 32, 32) and c10.num_classes == 10
    )
    # rows are channel-major: the first 1024 bytes are the red plane
    red = (torch.from_numpy(first[0, :1024].reshape(32, 32)).float() / 255 - 0.4914) / 0.2470
    assert torch.allclose(c10.train_x[0, 0], red, atol=1e-5)

    folder = tmp_path / "cifar-100-python"
    write_cifar_batch(folder / "train", 6, "fine_labels", 100, 0)
    write_cifar_batch(folder / "test", 2, "fine_labels", 100, 1)
    c100 = load_dataset("cifar100", root=tmp_path)
    assert c100.train_x.shape == (6, 3, 32, 32) and c100.num_classes == 100
    assert c100.train_y.tolist() == list(range(6))


def test_cifar_refuses_code_in_pickles(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for f in ("train", "test"):
        with open(folder / f, "wb") as fh:
            pickle.dump({"data": Evil(), "fine_labels": [0]}, fh)
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        load_dataset("cifar100", root=tmp_path)


@pytest.mark.skipif(
    not (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists(), reason="Fashion-MNIST not installed"
)
def test_real_fashion_mnist():
    ds = load_dataset("fashion_mnist")
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10
    assert ds.train_x.dtype == torch.float32 and ds.train_x.is_contiguous()
    assert abs(ds.train_x.mean().item()) < 0.01 and abs(ds.train_x.std().item() - 1) < 0.01
    assert torch.bincount(ds.train_y).tolist() == [6000] * 10
    assert torch.bincount(ds.test_y).tolist() == [1000] * 10
    # a paper-style partition of the real labels, and a peer view over the shared tensors
    p = make_partition(ds.train_y.numpy(), ds.test_y.numpy(), 100, "dirichlet", seed=0, alpha=0.3)
    peer = PeerData(ds, p.train[0], p.test[0], batch_size=128)
    assert peer.steps_per_epoch() == 5
    x, y = next(peer.epoch(torch.Generator().manual_seed(0)))
    assert x.shape == (128, 1, 28, 28) and set(y.tolist()) <= set(
        np.flatnonzero(shares(ds.train_y.numpy(), p.train[0]))
    )
