"""The topology file: data model, parsing and validation.

A topology file names the peers (their order defines the peer index used in every matrix), the
static graph, how mixing weights are derived, and optionally a seeded per-round random schedule.
Every peer loads the same file and derives the same plans from it; `Topology.hash` goes into every
payload header so a peer running a different file is rejected instead of silently mixing with the
wrong weights. The format is documented in ``topology/README.md``.

Where each peer runs is not part of the graph: an address book (`p2pfl.topology.addressbook`)
places the peers, and the hash covers the graph alone, so moving a peer to another host (compose,
Kubernetes, another machine) changes the address book, never the topology's identity. Older files
that still give each peer an address keep working: those addresses are the default address book.

Every `Topology` is valid by construction (`__post_init__` validates), so code that holds one never
has to re-check connectivity or weights.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any

import networkx as nx
import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from p2pfl.badinput import BadInput
from p2pfl.schema import from_validation_error
from p2pfl.yamlsafe import YamlLimits, load_yaml_file

from .address import AddressError, canonical_address
from .mixing import (
    TOL,
    SparseMixing,
    is_column_stochastic,
    metropolis_sparse,
    uniform_pull_sparse,
    uniform_push_sparse,
)
from .schedule import (
    SCHEDULE_KINDS,
    MixingPlan,
    Schedule,
    _check_counter,
    check_mode,
    plan_from_matrix,
    random_sparse,
)

__all__ = [
    "ExplicitWeights",
    "check_addresses",
    "Peer",
    "Topology",
    "TopologyError",
    "WEIGHT_KINDS",
    "load_topology",
    "parse_topology",
]

#: Weight kinds of the file format.
WEIGHT_KINDS = ("metropolis", "uniform", "explicit")

_TOP_KEYS = ("name", "directed", "peers", "edges", "weights", "schedule")
_WEIGHT_KEYS = ("kind", "matrix")

# Peer ids end up in certificate names, file names and log lines: keep them boring.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# host:port where host is a DNS name / IPv4 address (docker service names allow '_') or a
# bracketed IPv6 address.
_ADDRESS_RE = re.compile(
    r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?):(?P<port>[0-9]{1,5})$"
)

# Mixing matrices kept per topology: a random schedule is asked for the same (round, step) once per
# peer, so a small cache turns n matrix builds per step into one.
_CACHE_SIZE = 4


class TopologyError(BadInput):
    """A topology file (or generator request) is invalid; the message names the offending item."""


@dataclass(frozen=True)
class Peer:
    """One peer: its id (also its certificate name) and, once placed, the ``host:port`` its peer
    service listens on (None in a graph-only topology: the address book says where it runs)."""

    id: str
    address: str | None = None


@dataclass(frozen=True)
class ExplicitWeights:
    """Hand-written mixing weights: ``matrix[i][j]`` is the weight peer ``i`` gives to peer ``j`` (peer order).

    Held as nested tuples so `Topology` stays immutable and hashable.
    """

    matrix: tuple[tuple[float, ...], ...]

    kind = "explicit"

    def array(self) -> np.ndarray:
        """The matrix as a fresh float64 array."""
        return np.array(self.matrix, dtype=np.float64)


@dataclass
class _Derived:
    """Indices and caches computed once from the validated fields (not part of equality or hash)."""

    ids: tuple[str, ...]
    index: dict[str, int]
    in_nbrs: list[list[int]]
    out_nbrs: list[list[int]]
    in_cands: list[list[int]]
    out_cands: list[list[int]]
    cache: OrderedDict[tuple[Any, ...], SparseMixing] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: static topologies only: (peer index, mode) -> (self weight, in weights, out weights)
    plans: dict[tuple[int, str], tuple[float, dict[str, float], dict[str, float]]] = field(default_factory=dict)
    #: `Topology.hash`, once computed (the fields it covers never change)
    hash: str | None = None


@dataclass(frozen=True)
class Topology:
    """A validated topology: peers, static graph, weight rule and optional random schedule.

    ``edges`` are ``(src, dst)`` pairs: ``dst`` pulls from ``src`` (``src``'s value flows to ``dst``).
    When ``directed`` is false every edge is used both ways.
    """

    name: str
    peers: tuple[Peer, ...]
    directed: bool = False
    edges: tuple[tuple[str, str], ...] = ()
    weights: str | ExplicitWeights = "metropolis"
    schedule: Schedule | None = None
    _derived: _Derived = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples, so the object is immutable and hashable.
        object.__setattr__(self, "peers", tuple(self.peers))
        try:
            edges = tuple(tuple(e) for e in self.edges)
        except TypeError:
            raise TopologyError("edges must be a sequence of (src, dst) pairs") from None
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "_derived", _validate(self))

    # ---- lookups -------------------------------------------------------------------------------

    @property
    def ids(self) -> tuple[str, ...]:
        """Peer ids in peer order (index ``i`` of every matrix is ``ids[i]``)."""
        return self._derived.ids

    @property
    def n(self) -> int:
        """Number of peers."""
        return len(self.peers)

    def index(self, peer_id: str) -> int:
        """Index of ``peer_id`` in peer order; `KeyError` for an unknown peer."""
        try:
            return self._derived.index[peer_id]
        except KeyError:
            raise KeyError(f"unknown peer {peer_id!r} in topology {self.name!r}") from None

    @property
    def has_addresses(self) -> bool:
        """Whether the peers are placed (every peer has an address; a topology has all or none)."""
        return self.peers[0].address is not None

    def address(self, peer_id: str) -> str:
        """The ``host:port`` of ``peer_id``; `TopologyError` when the topology is the graph alone."""
        address = self.peers[self.index(peer_id)].address
        if address is None:
            raise TopologyError(
                f"topology {self.name!r} gives no address for peer {peer_id!r} (it describes the graph only): "
                "name an address book with network.addresses (or --addresses FILE)"
            )
        return address

    def with_addresses(self, addresses: Mapping[str, str]) -> Topology:
        """The same graph with every peer placed at ``addresses[peer_id]`` (validated; the hash is unchanged)."""
        missing = [pid for pid in self.ids if pid not in addresses]
        if missing:
            raise TopologyError(f"no address for peer {missing[0]!r} ({len(missing)} peers missing)")
        return replace(self, peers=tuple(Peer(id=p.id, address=addresses[p.id]) for p in self.peers))

    def graph_only(self) -> Topology:
        """The same graph with no addresses (what a topology file written beside an address book holds)."""
        return replace(self, peers=tuple(Peer(id=p.id) for p in self.peers))

    def graph(self) -> nx.Graph:
        """The static graph as networkx (`DiGraph` when directed), nodes are peer ids in peer order."""
        g: nx.Graph = nx.DiGraph() if self.directed else nx.Graph()
        g.add_nodes_from(p.id for p in self.peers)  # not self.ids: also used during validation
        g.add_edges_from(self.edges)
        return g

    def possible_in_neighbours(self, peer_id: str) -> frozenset[str]:
        """Every peer that may ever send to ``peer_id``, in any round and mode.

        Static graphs: its in-neighbours. Random schedules: all its candidates (its static
        in-neighbours, or every other peer when the file has no edges). Used to authorize callers.
        """
        i = self.index(peer_id)
        d = self._derived
        src = d.in_cands if self.schedule is not None else d.in_nbrs
        return frozenset(d.ids[j] for j in src[i])

    def possible_out_neighbours(self, peer_id: str) -> frozenset[str]:
        """Every peer that ``peer_id`` may ever send to (pull: who may pull from it; push: whom it pushes to)."""
        i = self.index(peer_id)
        d = self._derived
        dst = d.out_cands if self.schedule is not None else d.out_nbrs
        return frozenset(d.ids[k] for k in dst[i])

    # ---- mixing --------------------------------------------------------------------------------

    def mixing_matrix(self, round: int = 0, step: int = 0, seed: int = 0, mode: str = "pull") -> np.ndarray:
        """The n x n float64 matrix of (round, step): ``W[i, j]`` is the weight ``i`` gives ``j``'s value.

        ``mode="pull"``: row-stochastic (metropolis / uniform / explicit, or the random schedule).
        ``mode="push"``: column-stochastic — uniform out-degree splitting ``W[k, i] = 1/(d_out(i)+1)``
        (push-sum), the random schedule's pushes, or explicit weights if their columns sum to 1.
        Static topologies ignore (round, step, seed). Returns a fresh copy.
        """
        return self._matrix(round, step, seed, mode).toarray()

    def sparse_matrix(self, round: int = 0, step: int = 0, seed: int = 0, mode: str = "pull") -> SparseMixing:
        """`mixing_matrix` in sparse form (O(peers + edges) memory: what large topologies need)."""
        return self._matrix(round, step, seed, mode)

    def plan(self, peer_id: str, round: int, step: int = 0, seed: int = 0, mode: str = "pull") -> MixingPlan:
        """``peer_id``'s plan for (round, step): a pure function of (topology, seed, round, step, mode)."""
        i = self.index(peer_id)
        if self.schedule is not None:
            return plan_from_matrix(
                self.ids, self._matrix(round, step, seed, mode), i, round=round, step=step, mode=mode
            )
        # A static graph's plan is the same every (round, step): derive it once per peer and mode.
        # (Deriving it each step was ~4% of a 128-peer simulation worker's CPU.)
        for name, value in (("round", round), ("step", step), ("seed", seed)):
            _check_counter(name, value)
        d = self._derived
        hit = d.plans.get((i, mode))
        if hit is None:
            p = plan_from_matrix(self.ids, self._matrix(0, 0, 0, mode), i, round=0, step=0, mode=mode)
            hit = d.plans[(i, mode)] = (p.self_weight, p.in_weights, p.out_weights)
        return MixingPlan(peer=peer_id, round=int(round), step=int(step), mode=mode, self_weight=hit[0],
                          in_weights=dict(hit[1]), out_weights=dict(hit[2]))

    def _matrix(self, round: int, step: int, seed: int, mode: str) -> SparseMixing:
        """Cached, read-only matrix for (round, step, seed, mode)."""
        check_mode(mode)
        for name, value in (("round", round), ("step", step), ("seed", seed)):
            _check_counter(name, value)
        key: tuple[Any, ...] = (mode,) if self.schedule is None else (mode, int(round), int(step), int(seed))
        d = self._derived
        with d.lock:
            hit = d.cache.get(key)
            if hit is not None:
                d.cache.move_to_end(key)
                return hit
        w = self._build_matrix(round, step, seed, mode)
        with d.lock:
            d.cache[key] = w
            while len(d.cache) > _CACHE_SIZE:
                d.cache.popitem(last=False)
        return w

    def _build_matrix(self, round: int, step: int, seed: int, mode: str) -> SparseMixing:
        d = self._derived
        if self.schedule is not None:
            cands = d.in_cands if mode == "pull" else d.out_cands
            return random_sparse(cands, self.schedule.k, seed=seed, round=round, step=step, mode=mode)
        if isinstance(self.weights, ExplicitWeights):
            w = SparseMixing.from_dense(self.weights.array())
            if mode == "push" and not is_column_stochastic(w):
                raise TopologyError(
                    f"topology {self.name!r}: explicit weights are not column-stochastic, so they cannot be used "
                    "for push mode (push-sum needs every column to sum to 1)"
                )
            return w
        if mode == "push":
            return uniform_push_sparse(d.out_nbrs)
        if self.weights == "metropolis":
            return metropolis_sparse(d.in_nbrs)
        return uniform_pull_sparse(d.in_nbrs)

    # ---- serialization -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The file content as plain Python data (parse_topology(t.to_dict()) == t)."""
        out: dict[str, Any] = {
            "name": self.name,
            "directed": self.directed,
            "peers": [p.id if p.address is None else {"id": p.id, "address": p.address} for p in self.peers],
            "edges": [[s, t] for s, t in self.edges],
        }
        if isinstance(self.weights, ExplicitWeights):
            ids = self.ids
            out["weights"] = {
                "kind": "explicit",
                "matrix": {
                    ids[i]: {ids[j]: float(v) for j, v in enumerate(row) if v != 0.0}
                    for i, row in enumerate(self.weights.matrix)
                },
            }
        else:
            out["weights"] = self.weights
        if self.schedule is not None:
            out["schedule"] = self.schedule.to_dict()
        return out

    def hash(self) -> str:
        """First 16 hex chars of the sha256 of a canonical JSON of the content that affects mixing.

        Covers the graph: peer ids (in order), ``directed``, edges, weights and schedule; not the
        cosmetic ``name`` and not the addresses (where peers run is the address book's business, so
        simulate, launch, compose and Kubernetes agree on the hash of one graph). Edges are
        canonicalized (undirected pairs in peer order, then sorted) so two files describing the same
        graph agree.

        Computed once per `Topology` (it is immutable): every peer's Node asks for it, and at
        10,000 peers one computation took ~50 ms, so a worker building 5,000 Nodes spent minutes
        of its start-up hashing the same graph (issue 71).
        """
        d = self._derived
        if d.hash is None:
            d.hash = self._compute_hash()
        return d.hash

    def _compute_hash(self) -> str:
        """`hash`, computed: O(peers + edges) (a JSON of the whole graph and its sha256)."""
        idx = self._derived.index
        edges = []
        for s, t in self.edges:
            a, b = idx[s], idx[t]
            if not self.directed and a > b:
                a, b = b, a
            edges.append((a, b))
        ids = self.ids
        canon = {
            "peers": list(ids),
            "directed": self.directed,
            "edges": [[ids[a], ids[b]] for a, b in sorted(edges)],
            "weights": (
                {"kind": "explicit", "matrix": [list(r) for r in self.weights.matrix]}
                if isinstance(self.weights, ExplicitWeights)
                else self.weights
            ),
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
        }
        blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]

    def to_yaml(self) -> str:
        """The file as YAML text (peers and edges one per line, in flow style, for readability)."""
        data = self.to_dict()
        data["peers"] = [_FlowMap(p) if isinstance(p, dict) else p for p in data["peers"]]
        data["edges"] = [_FlowList(e) for e in data["edges"]]
        if isinstance(data["weights"], dict):
            data["weights"]["matrix"] = {k: _FlowMap(v) for k, v in data["weights"]["matrix"].items()}
        if "schedule" in data:
            data["schedule"] = dict(data["schedule"])
        header = f"# p2pfl topology {self.name!r} (hash {self.hash()}); format: topology/README.md\n"
        return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)

    def dump(self, path: str | Path) -> None:
        """Write the file (YAML) to ``path``; `load_topology` reads it back to an equal topology."""
        Path(path).write_text(self.to_yaml(), encoding="utf-8")


# ---- YAML helpers ---------------------------------------------------------------------------------


class _FlowList(list):  # type: ignore[type-arg]
    """A list dumped on one line: ``[p0, p1]``."""


class _FlowMap(dict):  # type: ignore[type-arg]
    """A mapping dumped on one line: ``{id: p0, address: '127.0.0.1:50050'}``."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    _FlowList, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True)
)
_Dumper.add_representer(
    _FlowMap, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True)
)




# ---- validation -----------------------------------------------------------------------------------


def _short(value: Any, limit: int = 80) -> str:
    """A user-supplied value shown in an error, cut to ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt_ids(ids: Iterable[str], limit: int = 6) -> str:
    ids = list(ids)
    shown = ", ".join(ids[:limit])
    return "{" + shown + (f", ... ({len(ids)} peers)" if len(ids) > limit else "") + "}"


def check_addresses(pairs: Iterable[tuple[str, Any]]) -> None:
    """Every ``(peer id, address)`` is a well-formed ``host:port`` and no two name the same socket
    (after normalization: ``localhost`` is 127.0.0.1, host names compare case-insensitively, ...).

    The one address check, shared by topology files that still carry addresses and address books.
    """
    by_address: dict[str, tuple[str, str]] = {}
    for pid, address in pairs:
        if not isinstance(address, str):
            raise TopologyError(f"peer {pid!r}: address must be a string 'host:port', got {_short(address)!r}")
        try:
            if _ADDRESS_RE.match(address) is None:
                raise AddressError("expected 'host:port'")
            canon = canonical_address(address)
        except AddressError as e:
            raise TopologyError(f"peer {pid!r}: malformed address {_short(address)!r} ({e})") from None
        if canon in by_address:
            first, other = by_address[canon]
            same = "" if other == address else f", the same socket as {other!r}"
            raise TopologyError(f"duplicate address {_short(address)!r} (peers {first!r} and {pid!r}{same})")
        by_address[canon] = (pid, address)


def _validate(t: Topology) -> _Derived:
    """Check every rule of the format; return the derived indices. Raises TopologyError."""
    if not isinstance(t.name, str) or not t.name:
        raise TopologyError("name must be a non-empty string")
    if not isinstance(t.directed, bool):
        raise TopologyError(f"directed must be true or false, got {t.directed!r}")

    # Peers.
    if not t.peers:
        raise TopologyError("no peers: a topology needs at least one peer")
    index: dict[str, int] = {}
    for i, p in enumerate(t.peers):
        if not isinstance(p, Peer):
            raise TopologyError(f"peer #{i} is not a Peer: {p!r}")
        if not isinstance(p.id, str) or not _ID_RE.match(p.id) or p.id.lower() == "ca":
            raise TopologyError(
                f"peer #{i}: invalid peer id {_short(p.id)!r} (use 1-63 letters, digits, '.', '_' or '-', starting "
                "with a letter or digit, not 'ca': it names the peer's certificate file next to ca.crt)"
            )
        if p.id in index:
            raise TopologyError(f"duplicate peer id {p.id!r} (peers #{index[p.id]} and #{i})")
        index[p.id] = i
    placed = [p for p in t.peers if p.address is not None]
    if placed and len(placed) != len(t.peers):
        bare = next(p for p in t.peers if p.address is None)
        raise TopologyError(
            f"peer {bare.id!r} has no address but peer {placed[0].id!r} has one: give every peer an address, "
            "or none (and place them with an address book)"
        )
    check_addresses((p.id, p.address) for p in placed)
    n = len(t.peers)
    ids = tuple(p.id for p in t.peers)

    # Edges.
    seen: dict[tuple[str, str], int] = {}
    for e in t.edges:
        if len(e) != 2 or not all(isinstance(x, str) for x in e):
            raise TopologyError(f"edge {list(e)!r}: an edge is a pair of peer ids [src, dst]")
        s, d = e
        for x in (s, d):
            if x not in index:
                raise TopologyError(f"edge [{s}, {d}]: unknown peer {x!r}")
        if s == d:
            raise TopologyError(f"edge [{s}, {d}]: self-edge (the self weight is implicit; remove the edge)")
        key = (s, d) if t.directed else (min(s, d, key=index.__getitem__), max(s, d, key=index.__getitem__))
        if key in seen:
            what = "duplicate edge" if t.directed else "duplicate edge (undirected edges are used both ways)"
            raise TopologyError(f"{what}: [{s}, {d}]")
        seen[key] = 1
    in_nbrs: list[list[int]] = [[] for _ in range(n)]
    out_nbrs: list[list[int]] = [[] for _ in range(n)]
    for s, d in t.edges:
        a, b = index[s], index[d]
        in_nbrs[b].append(a)
        out_nbrs[a].append(b)
        if not t.directed:
            in_nbrs[a].append(b)
            out_nbrs[b].append(a)
    for lst in (*in_nbrs, *out_nbrs):
        lst.sort()

    # Schedule (before connectivity: with no edges, a schedule's candidate graph is complete).
    sched = t.schedule
    if sched is not None:
        if not isinstance(sched, Schedule):
            raise TopologyError(f"schedule must be a Schedule, got {sched!r}")
        if sched.kind not in SCHEDULE_KINDS:
            raise TopologyError(
                f"schedule: unknown kind {sched.kind!r}; expected one of {', '.join(SCHEDULE_KINDS)}"
            )
        if isinstance(sched.k, bool) or not isinstance(sched.k, int):
            raise TopologyError(f"schedule: k must be an integer, got {sched.k!r}")
        if sched.k < 1:
            raise TopologyError(f"schedule: k={sched.k} must be at least 1")
        if sched.k >= n:
            raise TopologyError(f"schedule: k={sched.k} must be less than the number of peers ({n})")
    if t.edges:
        in_cands, out_cands = in_nbrs, out_nbrs
    else:
        everyone = list(range(n))
        in_cands = [[j for j in everyone if j != i] for i in range(n)]
        out_cands = in_cands
    if sched is not None:
        for i in range(n):
            for what, cands in (("in", in_cands[i]), ("out", out_cands[i])):
                if len(cands) < sched.k:
                    raise TopologyError(
                        f"schedule: peer {ids[i]!r} has only {len(cands)} candidate {what}-neighbours, "
                        f"fewer than k={sched.k}"
                    )

    # Connectivity of the graph that mixing can ever use.
    if n > 1 and (t.edges or sched is None):
        g = t.graph()
        if t.directed:
            if not nx.is_strongly_connected(g):
                reach = nx.descendants(g, ids[0])
                missing = [x for x in ids[1:] if x not in reach]
                if missing:
                    why = f"{ids[0]!r} cannot reach {missing[0]!r}"
                else:
                    back = nx.ancestors(g, ids[0])
                    why = f"{next(x for x in ids[1:] if x not in back)!r} cannot reach {ids[0]!r}"
                raise TopologyError(f"directed graph is not strongly connected: {why}")
        elif not nx.is_connected(g):
            comps = sorted(
                (sorted(c, key=index.__getitem__) for c in nx.connected_components(g)),
                key=lambda c: index[c[0]],
            )
            listed = " and ".join(_fmt_ids(c) for c in comps[:3])
            raise TopologyError(f"graph is disconnected: {len(comps)} components, {listed}")

    # Weights.
    w = t.weights
    if isinstance(w, ExplicitWeights):
        if sched is not None:
            raise TopologyError(
                "explicit weights cannot be combined with a random schedule (it uses 1/(k+1))"
            )
        _validate_explicit(w, ids, in_nbrs, t.directed)
    elif not isinstance(w, str) or w not in WEIGHT_KINDS:
        raise TopologyError(f"unknown weights kind {w!r}; expected one of {', '.join(WEIGHT_KINDS)}")
    elif w == "explicit":
        raise TopologyError("weights: explicit needs a matrix: weights: {kind: explicit, matrix: ...}")
    elif w == "metropolis" and t.directed:
        raise TopologyError("metropolis weights need an undirected graph (directed: false); use uniform")
    elif w == "metropolis" and sched is not None:
        raise TopologyError("a random_pull schedule mixes with uniform 1/(k+1) weights: set weights: uniform")

    return _Derived(
        ids=ids, index=index, in_nbrs=in_nbrs, out_nbrs=out_nbrs, in_cands=in_cands, out_cands=out_cands
    )


def _validate_explicit(
    w: ExplicitWeights, ids: tuple[str, ...], in_nbrs: list[list[int]], directed: bool
) -> None:
    n = len(ids)
    if len(w.matrix) != n or any(len(r) != n for r in w.matrix):
        raise TopologyError(f"explicit weights: matrix must be {n} x {n} (one row and column per peer)")
    m = w.array()
    for i in range(n):
        allowed = set(in_nbrs[i])
        for j in range(n):
            v = m[i, j]
            if not math.isfinite(v):
                raise TopologyError(
                    f"explicit weights: row {ids[i]}, column {ids[j]}: weight {v} is not finite"
                )
            if v < 0:
                raise TopologyError(f"explicit weights: row {ids[i]}, column {ids[j]}: negative weight {v}")
            if v != 0 and j != i and j not in allowed:
                raise TopologyError(
                    f"explicit weights: row {ids[i]}, column {ids[j]}: weight {v} on a non-edge "
                    f"({ids[j]} -> {ids[i]} is not an edge)"
                )
    rows = m.sum(axis=1)
    for i in range(n):
        if abs(rows[i] - 1.0) > TOL:
            raise TopologyError(f"explicit weights: row {ids[i]} sums to {rows[i]:.9g}, not 1")
    if not directed:
        bad = np.argwhere(np.abs(m - m.T) > TOL)
        if bad.size:
            i, j = bad[0]
            raise TopologyError(
                f"explicit weights on an undirected graph must be symmetric: row {ids[i]}, column {ids[j]} is "
                f"{m[i, j]:.9g} but row {ids[j]}, column {ids[i]} is {m[j, i]:.9g}"
            )
        cols = m.sum(axis=0)
        for j in range(n):  # implied by symmetry + rows, kept for a clear message with a looser tolerance
            if abs(cols[j] - 1.0) > TOL:
                raise TopologyError(f"explicit weights: column {ids[j]} sums to {cols[j]:.9g}, not 1")


# ---- parsing --------------------------------------------------------------------------------------


def _check_keys(where: str, data: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise TopologyError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")


def _number(where: str, v: Any) -> float:
    """A weight: int, float, or a string such as "1/3" (exact fractions avoid rounding in files)."""
    if isinstance(v, bool):
        raise TopologyError(f"{where}: weight must be a number, got {v!r}")
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(Fraction(v.strip()))
        except (ValueError, ZeroDivisionError):
            pass
    raise TopologyError(f"{where}: weight must be a number or a fraction like '1/3', got {v!r}")


def _parse_matrix(raw: Any, ids: list[str]) -> ExplicitWeights:
    n = len(ids)
    pos = {p: i for i, p in enumerate(ids)}
    rows: list[list[float]] = [[0.0] * n for _ in range(n)]
    if isinstance(raw, list):
        if len(raw) != n:
            raise TopologyError(
                f"weights.matrix: {len(raw)} rows, expected {n} (one per peer, in peer order)"
            )
        for i, row in enumerate(raw):
            if not isinstance(row, list) or len(row) != n:
                raise TopologyError(f"weights.matrix: row {ids[i]} must be a list of {n} numbers")
            rows[i] = [
                _number(f"weights.matrix: row {ids[i]}, column {ids[j]}", v) for j, v in enumerate(row)
            ]
    elif isinstance(raw, Mapping):
        for rid, row in raw.items():
            if rid not in pos:
                raise TopologyError(f"weights.matrix: unknown peer {rid!r} (row)")
            i = pos[rid]
            if isinstance(row, list):
                if len(row) != n:
                    raise TopologyError(f"weights.matrix: row {rid} must have {n} numbers")
                rows[i] = [
                    _number(f"weights.matrix: row {rid}, column {ids[j]}", v) for j, v in enumerate(row)
                ]
            elif isinstance(row, Mapping):
                for cid, v in row.items():
                    if cid not in pos:
                        raise TopologyError(f"weights.matrix: row {rid}: unknown peer {cid!r} (column)")
                    rows[i][pos[cid]] = _number(f"weights.matrix: row {rid}, column {cid}", v)
            else:
                raise TopologyError(f"weights.matrix: row {rid} must be a mapping {{peer: weight}} or a list")
    else:
        raise TopologyError(
            "weights.matrix must be a mapping {peer: {peer: weight}} or a list of rows in peer order"
        )
    return ExplicitWeights(tuple(tuple(r) for r in rows))


def parse_topology(data: Mapping[str, Any], source: str = "<dict>") -> Topology:
    """Build and validate a `Topology` from parsed YAML / JSON data; never mutates ``data``.

    Errors are `TopologyError` with ``source`` as a prefix, e.g. ``ring-8.yaml: edge [p0, p9]:
    unknown peer 'p9'``.
    """
    try:
        return _parse(data, source)
    except TopologyError as e:
        raise e.located(source) from None


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _PeerEntry(_Entry):
    id: str
    address: str | None = None


class _ScheduleEntry(_Entry):
    kind: str
    k: int


class TopologyFile(_Entry):
    """The typed schema of a topology file (field types and unknown keys); the graph rules
    (ids, addresses, edges, connectivity, weights) are checked by `Topology` itself."""

    name: str | None = None
    directed: bool = False
    peers: list[_PeerEntry] | None = None  # ids (graph only), or {id, address} (addresses inline)
    edges: list[Annotated[list[str], Field(min_length=2, max_length=2)]] | None = None
    weights: Any = None  # a kind name, or {kind: explicit, matrix: ...}: checked below
    schedule: _ScheduleEntry | None = None

    @model_validator(mode="before")
    @classmethod
    def _bare_ids(cls, data: Any) -> Any:
        """A peer given by its id alone (``- p0``, the graph-only form) is ``{id: p0}``."""
        if isinstance(data, dict) and isinstance(data.get("peers"), list):
            data = {**data, "peers": [{"id": p} if isinstance(p, str) else p for p in data["peers"]]}
        return data


def _parse(data: Any, source: str) -> Topology:
    if not isinstance(data, Mapping):
        raise TopologyError(
            f"a topology file is a mapping with keys {', '.join(_TOP_KEYS)}; got {type(data).__name__}"
        )
    try:
        f = TopologyFile.model_validate(dict(data))
    except ValidationError as exc:

        err = from_validation_error(exc, TopologyFile)
        raise TopologyError(err.problem, key=err.key, allowed=err.allowed, hint=err.hint) from None

    name = f.name
    if name is None:
        name = Path(source).stem if source and not source.startswith("<") else "topology"
    if not name:
        raise TopologyError("name must be a non-empty string", key="name")
    directed = f.directed
    if not f.peers:
        raise TopologyError("no peers: 'peers' must list at least one peer id")
    peers = [Peer(id=p.id, address=p.address) for p in f.peers]
    edges: list[tuple[str, str]] = [(e[0], e[1]) for e in f.edges or []]
    schedule = None if f.schedule is None else Schedule(kind=f.schedule.kind, k=f.schedule.k)

    raw_w = data.get("weights")
    weights: str | ExplicitWeights
    if raw_w is None:
        # Metropolis where it is defined (static undirected graphs), uniform otherwise.
        weights = "metropolis" if not directed and schedule is None else "uniform"
    elif isinstance(raw_w, str):
        weights = raw_w
    elif isinstance(raw_w, Mapping):
        _check_keys("weights", raw_w, _WEIGHT_KEYS)
        kind = raw_w.get("kind")
        if kind != "explicit":
            raise TopologyError(f"weights: a mapping must have kind: explicit (got kind {kind!r})")
        if "matrix" not in raw_w:
            raise TopologyError("weights: explicit needs a matrix")
        weights = _parse_matrix(raw_w["matrix"], [p.id for p in peers])
    else:
        raise TopologyError(f"unknown weights kind {raw_w!r}; expected one of {', '.join(WEIGHT_KINDS)}")

    return Topology(
        name=name,
        peers=tuple(peers),
        directed=directed,
        edges=tuple(edges),
        weights=weights,
        schedule=schedule,
    )


#: Bounds of the topology loader: a 100,000-peer ring is about 8 MiB and 800,000 nodes.
TOPOLOGY_LIMITS = YamlLimits(max_bytes=64 << 20, max_depth=32, max_aliases=10_000, max_nodes=4_000_000)


def load_topology(path: str | Path) -> Topology:
    """Read, parse and validate a topology file; every failure is a `TopologyError` naming the file.

    The YAML is read by the bounded loader (size, encoding, depth and alias limits, no duplicate keys).
    Loaded once per file content (its path and the sha256 of its bytes): a `Topology` is immutable,
    so every caller may share it, and `p2pfl simulate` parsed the same file three times before its
    first peer ran (the config's two checks, the experiment), ~1.1 s each at 10,000 peers (issue 71).
    Keyed by content, not modification time, whose granularity lets a quick rewrite of the same size
    pass for the old file. Errors are not remembered: a fixed file is read again.
    """
    p = Path(path)
    try:
        blob = p.read_bytes() if p.is_file() and p.stat().st_size <= TOPOLOGY_LIMITS.max_bytes else None
    except OSError:
        blob = None
    if blob is None:
        return _load_topology(p)  # let the bounded loader say what is wrong with the path
    return _load_topology_version(str(path), hashlib.sha256(blob).hexdigest())


@functools.lru_cache(maxsize=8)
def _load_topology_version(path: str, digest: str) -> Topology:
    """`load_topology` of one content of a file (the key); ``path`` as the caller named it, for errors."""
    return _load_topology(Path(path))


def _load_topology(path: Path) -> Topology:
    try:
        data = load_yaml_file(path, "topology file", TOPOLOGY_LIMITS)
    except BadInput as e:
        raise TopologyError(e.problem, source=e.source, line=e.line) from None
    return parse_topology(data, source=str(path))
