"""Seeded partitions of a dataset across peers, saved with each run.

A partition is only indices (no data), so it is cheap to save as JSON next to the run's results
and to send to every peer; each peer rebuilds its view from the one shared dataset
(:class:`p2pfl.data.loader.PeerData`).

Kinds (all a pure function of the labels, the kind's params and ``seed``):

``iid``
    shuffle, then split into equal parts (sizes differ by at most one when ``N`` is not a
    multiple of the client count; ``samples_per_client`` fixes an exact size).
``dirichlet`` (``alpha``; DisPFL / DFedMDC protocol, spec 000 §5)
    equal client sizes; client ``i`` has a class prior ``q_i ~ Dir(alpha·1)``; samples are drawn
    one at a time, for clients in a random interleaving, the label drawn from ``q_i``
    renormalized over the classes that still have samples, without replacement.
``dirichlet_per_class`` (``pi``; DePRL / Hsu-Wang protocol, spec 004 §3.2)
    for each class ``k``, ``p_k ~ Dir(pi·1)`` over clients and client ``i`` gets a ``p_k,i``
    share of class ``k`` (unbalanced sizes); redrawn until every client has ``min_size`` samples.
``pathological`` (``classes_per_client`` = c)
    each client holds c distinct classes, classes spread as evenly as possible over clients;
    each class's samples are split evenly among the clients holding it.

The test split is the same for every kind: each client's test indices are drawn from the test set
with that client's *training* label distribution (spec 000 §5 "the distribution of the test
datasets is the same as in training datasets"; spec 004 §3.2 NOTE), so personalized accuracy is
measured on the client's own task. Per-client size: ``test_size`` or ``round(n_i * M / N)``;
per-class counts by largest remainder, at least one per class the client trains on where the size
allows, and never more than the test set holds of a class (no duplicates within a client).
Clients may share test samples.

``independent_test: true`` (any kind) draws the test split instead as the train split is drawn, on
the test set, with a stream of its own: each client's test label mix is then independent of its
training mix (a second Dirichlet draw, as the DePRL authors' public code makes it:
GYan58/AAAI24-DePRL at 30ad0bf, ``Utils.py:428-432``, where the proportions meant to be reused are never set;
spec 004 section 9). Per-client sizes: ``test_size``, else ``samples_per_client`` scaled by the
test-to-train ratio; ``dirichlet_per_class`` and ``pathological`` sizes follow their own draw.

flwr-datasets partitioners are not used: the package is not a dependency of this project, and
these protocols need a test split tied to each client's train split and DisPFL's equal-size
sampling, which are implemented here directly on numpy label arrays.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from p2pfl.badinput import BadInput

__all__ = ["PARTITION_KINDS", "Partition", "PartitionError", "label_histogram", "make_partition"]

_FORMAT_VERSION = 1


class PartitionError(BadInput):
    """A partition cannot be made with these parameters (the message names the problem)."""


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.flags.writeable = False  # a partition is shared and saved with the run: never mutate it
    return a


@dataclass(frozen=True, eq=False)
class Partition:
    """Per-client train and test indices, plus how they were made (to save with the run)."""

    kind: str
    params: dict
    seed: int
    num_clients: int
    train: tuple[np.ndarray, ...]  # per client, sorted int64 indices into the train set
    test: tuple[np.ndarray, ...]  # per client, sorted int64 indices into the test set

    def __post_init__(self) -> None:
        if len(self.train) != self.num_clients or len(self.test) != self.num_clients:
            raise PartitionError(
                f"partition has {len(self.train)} train and {len(self.test)} test index sets "
                f"for {self.num_clients} clients"
            )
        train = tuple(_frozen(a) for a in self.train)
        test = tuple(_frozen(a) for a in self.test)
        if any(a.ndim != 1 or (a.size and a.min() < 0) for a in train + test):
            raise PartitionError("partition indices must be 1-D and non-negative")
        object.__setattr__(self, "train", train)
        object.__setattr__(self, "test", test)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return (
            self.kind == other.kind
            and self.params == other.params
            and self.seed == other.seed
            and self.num_clients == other.num_clients
            and all(np.array_equal(a, b) for a, b in zip(self.train, other.train, strict=True))
            and all(np.array_equal(a, b) for a, b in zip(self.test, other.test, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]  (mutable-looking arrays: not hashable)

    def sizes(self) -> np.ndarray:
        """Number of train samples per client."""
        return np.array([len(a) for a in self.train], dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (plain ints and lists) that :meth:`from_dict` turns back into ``self``."""
        return {
            "format": _FORMAT_VERSION,
            "kind": self.kind,
            "params": _json_safe(self.params),
            "seed": int(self.seed),
            "num_clients": int(self.num_clients),
            "train": [a.tolist() for a in self.train],
            "test": [a.tolist() for a in self.test],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Partition:
        """Inverse of :meth:`to_dict`; validates the structure (the file may come from anywhere)."""
        try:
            if int(d.get("format", _FORMAT_VERSION)) != _FORMAT_VERSION:
                raise PartitionError(f"unsupported partition format {d.get('format')!r}")
            train = tuple(np.asarray(a, dtype=np.int64).reshape(-1) for a in d["train"])
            test = tuple(np.asarray(a, dtype=np.int64).reshape(-1) for a in d["test"])
            return cls(
                kind=str(d["kind"]),
                params=dict(d["params"]),
                seed=int(d["seed"]),
                num_clients=int(d["num_clients"]),
                train=train,
                test=test,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PartitionError):
                raise
            raise PartitionError(f"not a valid partition dict: {type(exc).__name__}: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write as JSON (compact: index lists are long), atomically (`p2pfl.storage.atomic_write`)."""
        from p2pfl.storage import atomic_write

        atomic_write(path, json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Partition:
        """Read a file written by :meth:`save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def _json_safe(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def label_histogram(labels: np.ndarray, indices: np.ndarray, num_classes: int) -> np.ndarray:
    """Count of each class among ``labels[indices]`` (int64, length ``num_classes``)."""
    labels = np.asarray(labels)
    return np.bincount(labels[np.asarray(indices, dtype=np.int64)], minlength=num_classes).astype(np.int64)


# --------------------------------------------------------------------------------------------
# train splits: each returns a list of per-client index arrays (unsorted)


def _iid(
    labels: np.ndarray, n: int, num_classes: int, rng: np.random.Generator, p: dict[str, Any]
) -> list[np.ndarray]:
    perm = rng.permutation(len(labels))
    spc = p["samples_per_client"]
    if spc is None:
        return list(np.array_split(perm, n))
    return [perm[i * spc : (i + 1) * spc] for i in range(n)]


def _sample_rows(cdf: np.ndarray, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling of one class per entry, from the row ``rows[j]`` of ``cdf``, vectorized.

    Rows are offset by their index so that one ``searchsorted`` over the flattened CDFs serves all.
    """
    n, k = cdf.shape
    flat = (cdf + np.arange(n)[:, None]).ravel()
    pos = np.searchsorted(flat, rows + u, side="right")
    return np.minimum(pos - rows * k, k - 1)


def _dirichlet(
    labels: np.ndarray, n: int, num_classes: int, rng: np.random.Generator, p: dict[str, Any]
) -> list[np.ndarray]:
    """Equal-size Dirichlet split (DisPFL's ``partition_data(..., 'dir')``), vectorized.

    DisPFL draws one sample at a time: a random non-full client, a class from its prior, redrawn
    while that class is exhausted. Here the client order is a random interleaving of the
    clients' quotas, and the draws between two class exhaustions are independent, so they are
    drawn in one vectorized batch; at the first draw that would take from an exhausted class, the
    batch is cut, that class leaves the support (the priors are renormalized), and drawing
    resumes. At most ``num_classes + 1`` batches. Then each class's shuffled pool is dealt out in
    the drawn counts.
    """
    spc = p["samples_per_client"]
    priors = rng.dirichlet(np.full(num_classes, p["alpha"]), size=n)
    pools = [np.flatnonzero(labels == k) for k in range(num_classes)]
    avail = np.array([len(pool) for pool in pools], dtype=np.int64)
    seq = rng.permutation(np.repeat(np.arange(n), spc))
    counts = np.zeros((n, num_classes), dtype=np.int64)
    pos = 0
    while pos < len(seq):
        active = avail > 0
        q = priors * active
        tot = q.sum(axis=1, keepdims=True)
        # A prior can put (numerically) all its mass on exhausted classes at tiny alpha: such a
        # client then draws uniformly from what is left.
        q = np.where(tot > 0, q / np.where(tot > 0, tot, 1.0), active / active.sum())
        cdf = np.cumsum(q, axis=1)
        cdf /= cdf[:, -1:]  # exactly 1 at the end; exhausted trailing classes get zero width
        rows = seq[pos:]
        drawn = _sample_rows(cdf, rows, rng.random(len(rows)))
        # Rounding at an interval edge must never pick a class without mass (it would stall the
        # loop): move such draws to the row's last class with mass.
        bad = q[rows, drawn] <= 0
        if bad.any():
            last = num_classes - 1 - np.argmax(q[:, ::-1] > 0, axis=1)
            drawn[bad] = last[rows[bad]]
        # first position at which some class is drawn once more than it has samples left
        order = np.argsort(drawn, kind="stable")
        per_class = np.bincount(drawn, minlength=num_classes)
        starts = np.concatenate(([0], np.cumsum(per_class)[:-1]))
        over = np.flatnonzero(per_class > avail)
        cut = len(rows) if len(over) == 0 else int(order[starts[over] + avail[over]].min())
        np.add.at(counts, (rows[:cut], drawn[:cut]), 1)
        avail -= np.bincount(drawn[:cut], minlength=num_classes)
        pos += cut
    return _deal(pools, counts, rng)


def _deal(pools: list[np.ndarray], counts: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Give client ``i`` ``counts[i, k]`` samples of class ``k``, disjointly, from shuffled pools."""
    n = counts.shape[0]
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for k, pool in enumerate(pools):
        shuffled = rng.permutation(pool)
        bounds = np.concatenate(([0], np.cumsum(counts[:, k])))
        for i in np.flatnonzero(counts[:, k]):
            parts[i].append(shuffled[bounds[i] : bounds[i + 1]])
    return [np.concatenate(ps) if ps else np.zeros(0, dtype=np.int64) for ps in parts]


def _dirichlet_per_class(
    labels: np.ndarray, n: int, num_classes: int, rng: np.random.Generator, p: dict[str, Any]
) -> list[np.ndarray]:
    """Per-class Dirichlet split (Hsu et al. 2019; Wang et al. 2020 / FedMA ``hetero-dir``).

    Like the reference code, the whole draw is repeated until every client has ``min_size``
    samples; only the counts are drawn per attempt (cheap), the indices once at the end. With
    ``balance=True``, FedMA's extra rule applies: a client already above ``N/n`` samples gets no
    share of the following classes.
    """
    pools = [np.flatnonzero(labels == k) for k in range(num_classes)]
    sizes = np.array([len(pool) for pool in pools], dtype=np.int64)
    pi, min_size, balance = p["pi"], p["min_size"], p["balance"]
    if min_size * n > len(labels):
        raise PartitionError(f"min_size={min_size} x {n} clients exceeds the {len(labels)} train samples")
    for _ in range(p["max_attempts"]):
        props = rng.dirichlet(np.full(n, pi), size=num_classes)  # [K, n]
        if balance:
            counts = np.zeros((n, num_classes), dtype=np.int64)
            for k in range(num_classes):
                pk = props[k] * (counts.sum(axis=1) < len(labels) / n)
                pk = pk if pk.sum() > 0 else props[k]
                counts[:, k] = _split_counts(pk[None, :] / pk.sum(), sizes[k : k + 1])[0]
        else:
            counts = _split_counts(props, sizes).T
        if counts.sum(axis=1).min() >= min_size:
            return _deal(pools, counts, rng)
    raise PartitionError(
        f"dirichlet_per_class: no draw with pi={pi} gave every one of {n} clients >= {min_size} "
        f"samples in {p['max_attempts']} attempts; raise pi or max_attempts, or lower min_size / clients"
    )


def _split_counts(props: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Per-class counts ``[K, n]`` from cut points ``floor(cumsum(p_k) * |class k|)``, as in the
    reference code (vectorized over classes: this runs once per attempt)."""
    cuts = (np.cumsum(props, axis=1) * totals[:, None]).astype(np.int64)
    cuts[:, -1] = totals
    return np.diff(cuts, axis=1, prepend=0)


def _pathological(
    labels: np.ndarray, n: int, num_classes: int, rng: np.random.Generator, p: dict[str, Any]
) -> list[np.ndarray]:
    """c distinct classes per client, chosen greedily among the least-used classes (random ties).

    Greedy least-used keeps class usage within one of even, so every class is used as soon as
    ``n * c >= num_classes``, and a client never gets the same class twice (a plain shard split
    cannot promise either).
    """
    c = p["classes_per_client"]
    usage = np.zeros(num_classes, dtype=np.int64)
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for i in range(n):
        chosen = np.argsort(usage + 0.5 * rng.random(num_classes), kind="stable")[:c]
        usage[chosen] += 1
        for k in chosen:
            holders[int(k)].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for k in range(num_classes):
        if not holders[k]:
            continue
        pool = rng.permutation(np.flatnonzero(labels == k))
        for i, chunk in zip(holders[k], np.array_split(pool, len(holders[k])), strict=True):
            parts[i].append(chunk)
    return [np.concatenate(ps) for ps in parts]


# --------------------------------------------------------------------------------------------
# test split


def _test_counts(train_hist: np.ndarray, total: int, test_avail: np.ndarray) -> np.ndarray:
    """Per-class test counts summing to ``total`` in the proportions of ``train_hist``.

    Largest-remainder rounding; then every class present in training gets at least one test
    sample where ``total`` allows it (taken from the class most above its exact share); finally
    capped by what the test set has of each class.
    """
    present = train_hist > 0
    ideal = total * train_hist / train_hist.sum()
    cnt = np.floor(ideal).astype(np.int64)
    short = total - int(cnt.sum())
    if short > 0:
        cnt[np.argsort(-(ideal - cnt), kind="stable")[:short]] += 1
    if total >= int(present.sum()):
        for k in np.flatnonzero(present & (cnt == 0)):
            donors = np.flatnonzero(cnt > 1)
            if len(donors) == 0:
                break
            d = donors[np.argmax(cnt[donors] - ideal[donors])]
            cnt[d] -= 1
            cnt[k] = 1
    return np.minimum(cnt, test_avail)


def _test_split(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    train: list[np.ndarray],
    num_classes: int,
    rng: np.random.Generator,
    test_size: int | None,
) -> list[np.ndarray]:
    pools = [np.flatnonzero(test_labels == k) for k in range(num_classes)]
    avail = np.array([len(pool) for pool in pools], dtype=np.int64)
    ratio = len(test_labels) / len(train_labels)
    out = []
    for idx in train:
        hist = label_histogram(train_labels, idx, num_classes)
        if hist.sum() == 0:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        total = test_size if test_size is not None else max(1, round(len(idx) * ratio))
        cnt = _test_counts(hist, total, avail)
        chunks = [pools[k][rng.choice(avail[k], size=cnt[k], replace=False)] for k in np.flatnonzero(cnt)]
        out.append(np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64))
    return out


# --------------------------------------------------------------------------------------------
# entry point

_SPLITTERS = {
    "iid": (_iid, {"samples_per_client": None}),
    "dirichlet": (_dirichlet, {"alpha": None, "samples_per_client": None}),
    "dirichlet_per_class": (
        _dirichlet_per_class,
        {"pi": None, "min_size": 10, "max_attempts": 10000, "balance": False},
    ),
    "pathological": (_pathological, {"classes_per_client": None}),
}
_REQUIRED = {"dirichlet": "alpha", "dirichlet_per_class": "pi", "pathological": "classes_per_client"}
#: Parameters of every kind that take true or false (the others are numbers).
BOOL_PARAMETERS = frozenset({"balance", "independent_test"})

#: Partition kinds ``make_partition`` accepts.
PARTITION_KINDS: tuple[str, ...] = tuple(_SPLITTERS)


def partition_parameters(kind: str) -> tuple[list[str], str | None]:
    """(parameter names, the required one or None) of partition ``kind``; KeyError if unknown."""
    return [*_SPLITTERS[kind][1], "test_size", "independent_test"], _REQUIRED.get(kind)


def _as_labels(a: Any, what: str) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor
        a = a.detach().cpu().numpy()
    arr = np.asarray(a)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise PartitionError(f"{what} must be a non-empty 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.min() < 0:
        raise PartitionError(f"{what} has negative labels")
    return arr.astype(np.int64, copy=False)


def _check_params(
    kind: str, params: dict[str, Any], n: int, n_train: int, num_classes: int
) -> dict[str, Any]:
    """Resolve defaults and reject bad values with a message naming the problem."""
    defaults = dict(_SPLITTERS[kind][1])
    defaults["test_size"] = None
    defaults["independent_test"] = False
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise PartitionError(f"{kind}: unknown parameter(s) {unknown}; allowed: {sorted(defaults)}")
    required = _REQUIRED.get(kind)
    if required is not None and params.get(required) is None:
        raise PartitionError(f"{kind}: parameter {required!r} is required")
    p = {**defaults, **params}
    if n > n_train:
        raise PartitionError(f"num_clients={n} exceeds the {n_train} train samples")
    for name in ("alpha", "pi"):
        if name in p:
            v = float(p[name])
            if not np.isfinite(v) or v <= 0:
                raise PartitionError(f"{kind}: {name} must be > 0, got {p[name]}")
            p[name] = v
    if "samples_per_client" in p:
        spc = p["samples_per_client"]
        if spc is None:
            if kind == "dirichlet":
                p["samples_per_client"] = n_train // n
        else:
            spc = int(spc)
            if spc < 1 or spc * n > n_train:
                raise PartitionError(
                    f"{kind}: samples_per_client={spc} x {n} clients must be >= 1 and <= {n_train} train samples"
                )
            p["samples_per_client"] = spc
    if kind == "pathological":
        c = int(p["classes_per_client"])
        if not 1 <= c <= num_classes:
            raise PartitionError(
                f"pathological: classes_per_client={c} must be in [1, {num_classes}] classes"
            )
        p["classes_per_client"] = c
    if kind == "dirichlet_per_class":
        p["min_size"], p["max_attempts"], p["balance"] = (
            int(p["min_size"]),
            int(p["max_attempts"]),
            bool(p["balance"]),
        )
        if p["min_size"] < 0 or p["max_attempts"] < 1:
            raise PartitionError("dirichlet_per_class: need min_size >= 0 and max_attempts >= 1")
    if p["test_size"] is not None:
        p["test_size"] = int(p["test_size"])
        if p["test_size"] < 0:
            raise PartitionError(f"{kind}: test_size must be >= 0, got {p['test_size']}")
    if not isinstance(p["independent_test"], bool):
        raise PartitionError(f"{kind}: independent_test must be true or false, got {p['independent_test']!r}")
    if p["independent_test"] and p["test_size"] is not None and "samples_per_client" not in p:
        raise PartitionError(f"{kind}: test_size sets the matched test split only; an independent test split "
                             f"of a {kind} partition takes its sizes from its own draw")
    if not p["independent_test"]:
        del p["independent_test"]  # the default: partitions made before it existed stay equal
    return p


def _independent_test_split(
    kind: str, test_labels: np.ndarray, n: int, num_classes: int, rng: np.random.Generator, p: dict[str, Any],
    ratio: float,
) -> list[np.ndarray]:
    """The test split drawn as the train split is, on the test set (``independent_test``)."""
    q = {k: v for k, v in p.items() if k not in ("test_size", "independent_test")}
    if q.get("samples_per_client") is not None:
        q["samples_per_client"] = p["test_size"] if p["test_size"] is not None else max(
            1, round(q["samples_per_client"] * ratio))
        if q["samples_per_client"] * n > len(test_labels):
            raise PartitionError(f"{kind}: an independent test split of {q['samples_per_client']} x {n} clients "
                                 f"needs more than the {len(test_labels)} test samples")
    elif p["test_size"] is not None:  # iid over the whole test set unless test_size fixes the size
        q["samples_per_client"] = p["test_size"]
    return _SPLITTERS[kind][0](test_labels, n, num_classes, rng, q)


def make_partition(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    kind: str,
    seed: int,
    **params: Any,
) -> Partition:
    """Split a dataset across ``num_clients`` peers; deterministic in ``(labels, kind, params, seed)``.

    The train and test splits use independent streams spawned from ``seed``, so changing
    ``test_size`` leaves the train split unchanged. ``Partition.params`` holds the resolved
    params (defaults included), so a saved partition says exactly how it was made.
    """
    if kind not in _SPLITTERS:
        raise PartitionError(f"unknown partition kind {kind!r}; known kinds: {', '.join(PARTITION_KINDS)}")
    train_labels = _as_labels(train_labels, "train_labels")
    test_labels = _as_labels(test_labels, "test_labels")
    n = int(num_clients)
    if n < 1:
        raise PartitionError(f"num_clients must be >= 1, got {num_clients}")
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    p = _check_params(kind, dict(params), n, len(train_labels), num_classes)
    train_ss, test_ss = np.random.SeedSequence(int(seed)).spawn(2)
    splitter = _SPLITTERS[kind][0]
    train = splitter(train_labels, n, num_classes, np.random.default_rng(train_ss), p)
    train = [np.sort(a) for a in train]
    if p.get("independent_test"):
        test = _independent_test_split(kind, test_labels, n, num_classes, np.random.default_rng(test_ss), p,
                                       len(test_labels) / len(train_labels))
    else:
        test = _test_split(
            train_labels, test_labels, train, num_classes, np.random.default_rng(test_ss), p["test_size"]
        )
    return Partition(
        kind=kind,
        params=_json_safe(p),
        seed=int(seed),
        num_clients=n,
        train=tuple(train),
        test=tuple(np.sort(a) for a in test),
    )
