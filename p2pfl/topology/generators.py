"""Standard topologies used by the papers (Ring / Grid / Torus / Exp / Full / random / Erdős–Rényi), as `Topology` objects.

Graphs come from networkx; this module only maps nodes to peer ids ``p0..p{n-1}`` and addresses.
Every generated topology goes through the same validation as a hand-written file.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import networkx as nx
import numpy as np

from .schedule import Schedule
from .spec import Peer, Topology, TopologyError

#: Kinds accepted by `generate`.
KINDS = ("ring", "grid", "torus", "exponential", "full", "random_regular", "random_pull", "directed_ring",
         "erdos_renyi")

_DIRECTED_KINDS = ("random_pull", "directed_ring")

# Default neighbour count of random_pull: the Dis-PFL scheme samples 10 peers per round.
_DEFAULT_PULL_K = 10
_MAX_REGULAR_TRIES = 200
# Draws of erdos_renyi before giving up on a connected one (seed, seed + 1, ...).
_MAX_ER_TRIES = 1000


def grid_shape(n: int) -> tuple[int, int]:
    """The most nearly square ``rows x cols == n`` with ``rows <= cols``; `TopologyError` for prime ``n``.

    A prime n would give a 1 x n path, which is not a grid; ask for a ring instead.
    """
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    if rows == 1:
        raise TopologyError(f"grid/torus: n={n} does not factor as rows x cols with rows, cols >= 2")
    return rows, n // rows


def _grid(n: int, periodic: bool) -> nx.Graph:
    rows, cols = grid_shape(n)
    g = nx.grid_2d_graph(rows, cols, periodic=periodic)
    # Row-major peer index: (r, c) -> r * cols + c.
    return nx.relabel_nodes(g, {(r, c): r * cols + c for r, c in g.nodes})


def _exponential(n: int) -> nx.Graph:
    """Peer i linked to i + 2^j mod n for every 2^j < n (undirected, so also to i - 2^j)."""
    offsets = [1 << j for j in range(max(1, (n - 1).bit_length())) if (1 << j) < n]
    return nx.circulant_graph(n, offsets)


def _random_regular(n: int, k: int, seed: int) -> nx.Graph:
    """A connected random k-regular graph; reseeded deterministically from ``seed`` until connected."""
    if not 1 <= k < n:
        raise TopologyError(f"random_regular: k={k} must satisfy 1 <= k < n={n}")
    if (n * k) % 2:
        raise TopologyError(f"random_regular: n*k must be even (n={n}, k={k})")
    seeds = np.random.default_rng([seed, n, k]).integers(0, 2**31 - 1, size=_MAX_REGULAR_TRIES)
    for s in seeds:
        g = nx.random_regular_graph(k, n, seed=int(s))
        if nx.is_connected(g):
            return g
    raise TopologyError(
        f"random_regular: no connected {k}-regular graph on {n} peers after {_MAX_REGULAR_TRIES} tries"
    )


def _erdos_renyi(n: int, p: float, seed: int) -> nx.Graph:
    """The first connected draw of G(n, p) among seeds ``seed, seed + 1, ...``.

    Why: DePRL's public code draws its Random graph as G(n, 0.25), every pair of workers linked with
    probability p (GYan58/AAAI24-DePRL ``Utils.py:452-467``), and uses it whatever it draws; the
    paper asks for a connected graph ("we randomly generate a connected communication graph") and
    mixing needs one, so a disconnected draw is replaced by the next seed's, deterministically (the
    file records only the graph; at n = 128, p = 0.25 the first draw is connected in practice).
    Each draw is networkx's ``gnp_random_graph(n, p, seed=s)``, so anyone can redraw it.
    """
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < float(p) <= 1:
        raise TopologyError(f"erdos_renyi: p={p!r} must be a probability in (0, 1]")
    for s in range(seed, seed + _MAX_ER_TRIES):
        g = nx.gnp_random_graph(n, float(p), seed=s)
        if nx.is_connected(g):
            return g
    raise TopologyError(
        f"erdos_renyi: no connected G({n}, {p}) among seeds {seed}..{seed + _MAX_ER_TRIES - 1}; raise p"
    )


def generate(
    kind: str,
    n: int,
    *,
    k: int | None = None,
    p: float | None = None,
    seed: int = 0,
    host: str = "127.0.0.1",
    base_port: int = 50050,
    address_template: str | None = None,
    weights: str | None = None,
    name: str | None = None,
) -> Topology:
    """Generate a standard topology of ``n`` peers ``p0..p{n-1}``.

    Kinds: ``ring``, ``grid`` (nearly square rows x cols, row-major), ``torus`` (periodic grid),
    ``exponential`` (i ~ i + 2^j mod n), ``full``, ``random_regular`` (connected random k-regular,
    seeded), ``random_pull`` (all peers, no edges, ``schedule: {kind: random_pull, k}``; k defaults
    to min(10, n-1)), ``directed_ring`` (i -> i+1, for push-sum examples), ``erdos_renyi`` (each
    pair linked with probability ``p``; the first connected draw of seeds ``seed, seed + 1, ...``).

    Addresses are ``{host}:{base_port + i}``, or ``address_template.format(i=i, id=..., port=base_port + i)``
    (e.g. ``"peer-{i}:50051"`` for one container per peer). ``weights`` defaults to ``metropolis``
    for undirected kinds and ``uniform`` for the directed ones, where metropolis is undefined.
    """
    if kind not in KINDS:
        raise TopologyError(f"unknown topology kind {kind!r}; expected one of {', '.join(KINDS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise TopologyError(f"{kind}: need at least 2 peers, got n={n!r}")
    if k is not None and kind not in ("random_regular", "random_pull"):
        raise TopologyError(f"{kind}: k is only used by random_regular and random_pull")
    if p is not None and kind != "erdos_renyi":
        raise TopologyError(f"{kind}: p is only used by erdos_renyi")
    directed = kind in _DIRECTED_KINDS
    if weights is None:
        weights = "uniform" if directed else "metropolis"

    schedule: Schedule | None = None
    builders: dict[str, Callable[[], nx.Graph]] = {
        "ring": lambda: nx.cycle_graph(n),
        "grid": lambda: _grid(n, periodic=False),
        "torus": lambda: _grid(n, periodic=True),
        "exponential": lambda: _exponential(n),
        "full": lambda: nx.complete_graph(n),
        "directed_ring": lambda: nx.DiGraph([(i, (i + 1) % n) for i in range(n)]),
    }
    if kind == "random_regular":
        if k is None:
            raise TopologyError("random_regular needs k (the degree)")
        g: nx.Graph = _random_regular(n, k, seed)
    elif kind == "erdos_renyi":
        if p is None:
            raise TopologyError("erdos_renyi needs p (the edge probability)")
        g = _erdos_renyi(n, p, seed)
    elif kind == "random_pull":
        g = nx.empty_graph(n, create_using=nx.DiGraph)
        schedule = Schedule(kind="random_pull", k=min(_DEFAULT_PULL_K, n - 1) if k is None else k)
    else:
        g = builders[kind]()

    ids = [f"p{i}" for i in range(n)]
    if address_template is None:
        addresses = [f"{host}:{base_port + i}" for i in range(n)]
    else:
        try:
            addresses = [address_template.format(i=i, id=ids[i], port=base_port + i) for i in range(n)]
        except (KeyError, IndexError, ValueError) as e:
            raise TopologyError(
                f"address template {address_template!r}: {e} (fields: {{i}}, {{id}}, {{port}})"
            ) from None
    if directed:
        edges = sorted((int(a), int(b)) for a, b in g.edges)
    else:
        edges = sorted((min(int(a), int(b)), max(int(a), int(b))) for a, b in g.edges)
    return Topology(
        name=name or f"{kind.replace('_', '-')}-{n}",
        peers=tuple(Peer(id=ids[i], address=addresses[i]) for i in range(n)),
        directed=directed,
        edges=tuple((ids[a], ids[b]) for a, b in edges),
        weights=weights,
        schedule=schedule,
    )
