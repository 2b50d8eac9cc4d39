"""Which rank of a sharded simulation runs which peer (`place`).

A payload between two peers of one rank is a tensor handed over in memory; between ranks it is
wire-encoded, carried by an exchange step and decoded (`p2pfl.engine.exact`). Contiguous blocks of
indices (peer i -> rank i * W // N) keep a ring's or a grid's edges inside their rank, but on a
random graph almost every edge crosses (on a random 4-regular graph of 1,024 peers over 16 ranks,
15 in 16 of them). `place` partitions the graph instead: greedy graph growing, then balanced
boundary refinement, and keeps contiguous blocks whenever the partition does not cut fewer edges.

The edges counted are those a round's plans can use: each peer's possible in-neighbours
(`Topology.possible_in_neighbours`: its static in-neighbours, or a random schedule's candidates),
one per direction, so an undirected edge counts twice and a directed one once.

The result is a pure function of the topology and the world size: every rank of a torchrun launch
computes it on its own and they must agree, so nothing here draws random numbers or depends on the
iteration order of a set (which follows ``PYTHONHASHSEED`` for strings): edges are sorted by
index, and every tie is broken by index.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np

from .spec import Topology

#: Refinement passes at most (each visits every boundary peer once; they stop when nothing moves).
#: Measured on a random 4-regular graph of 100,000 peers over 16 ranks: the cut after growing
#: 44.19 % of the edges, after passes 1-4 of `_refine` 42.53, 42.35, 42.31, 42.30 %; four more
#: passes took it to 42.30 %, and cost as much CPU as the four before.
_PASSES = 4
#: Peers a rank may hold above (or below) its share while refining, as a fraction of the share (at
#: least 1): single moves need room; `_rebalance` then restores the exact sizes.
_SLACK = 0.03


def contiguous(n: int, world: int) -> list[int]:
    """Contiguous blocks of indices: peer i on rank ``i * world // n`` (what `place` falls back to)."""
    return [i * world // n for i in range(n)]


def directed_edges(topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """Every directed edge a round's plans can use, as sorted (source, destination) index arrays.

    Sorted so that nothing downstream depends on the order ``possible_in_neighbours`` (a frozenset of
    strings) yields them in, which changes with the process's hash seed.
    """
    ids = topology.ids
    index = {pid: i for i, pid in enumerate(ids)}
    src: list[int] = []
    dst: list[int] = []
    for i, pid in enumerate(ids):
        came = topology.possible_in_neighbours(pid)
        src.extend(map(index.__getitem__, came))
        dst.extend(itertools.repeat(i, len(came)))
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    order = np.lexsort((s, d))
    return s[order], d[order]


def cut_edges(topology: Topology, ranks: Sequence[int]) -> int:
    """How many of the topology's directed edges (`directed_edges`) join peers on different ranks."""
    src, dst = directed_edges(topology)
    r = np.asarray(ranks, dtype=np.int64)
    return int(np.count_nonzero(r[src] != r[dst]))


def place(topology: Topology, world: int) -> list[int]:
    """The rank of each peer (in ``topology.ids`` order) for a simulation over ``world`` ranks.

    Balanced: every rank gets ``N // world`` or ``N // world + 1`` peers. Deterministic: a pure
    function of the topology and ``world``. Never cuts more edges than contiguous blocks, which it
    returns on a tie (so a ring or a complete graph keeps the blocks it always had; a grid gets
    squares, which cut fewer edges than its blocks of rows).
    """
    n = topology.n
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= n:
        raise ValueError(f"world={world!r}: need 1 <= world <= {n} (the number of peers)")
    blocks = contiguous(n, world)
    if world in (1, n) or _complete(topology):
        return blocks  # every balanced placement cuts the same edges
    src, dst = directed_edges(topology)
    if src.size == 0:
        return blocks
    nbrs, wts = _adjacency(n, src, dst)
    sizes = np.bincount(np.asarray(blocks), minlength=world).tolist()
    part = _grow(nbrs, wts, sizes)
    low, high = n // world, -(-n // world)
    slack = max(1, int(_SLACK * high))
    _refine(nbrs, wts, part, world, low - slack, high + slack)
    _rebalance(nbrs, wts, part, world, low, high)
    r_part, r_blocks = np.asarray(part), np.asarray(blocks)
    if np.count_nonzero(r_part[src] != r_part[dst]) < np.count_nonzero(r_blocks[src] != r_blocks[dst]):
        return part
    return blocks


def _complete(topology: Topology) -> bool:
    """Whether every peer may hear from every other (then any balanced placement cuts the same edges).

    Checked without listing the n^2 edges: a schedule over a file with no edges draws from every
    other peer, and a complete edge list has n (n - 1) directed edges (half as many pairs undirected).
    """
    n = topology.n
    if topology.schedule is not None and not topology.edges:
        return True
    return len(topology.edges) == (n * (n - 1) if topology.directed else n * (n - 1) // 2)


def _adjacency(n: int, src: np.ndarray, dst: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """Each peer's neighbours either way (sorted) and the directed edges each link stands for (1 or 2)."""
    lo, hi = np.minimum(src, dst), np.maximum(src, dst)
    pairs, counts = np.unique(lo * n + hi, return_counts=True)
    a, b = pairs // n, pairs % n
    u, v, w = np.concatenate([a, b]), np.concatenate([b, a]), np.concatenate([counts, counts])
    order = np.lexsort((v, u))
    u, v, w = u[order], v[order], w[order]
    bounds = np.searchsorted(u, np.arange(n + 1)).tolist()
    vl, wl = v.tolist(), w.tolist()
    return ([vl[bounds[i]:bounds[i + 1]] for i in range(n)], [wl[bounds[i]:bounds[i + 1]] for i in range(n)])


def _farthest(nbrs: list[list[int]], start: int) -> int:
    """The last peer a breadth-first search from ``start`` reaches: a peripheral seed, so the first rank's
    block grows from the edge of the graph rather than from its middle, leaving the rest in one piece."""
    seen = bytearray(len(nbrs))
    seen[start] = 1
    frontier, last = [start], start
    while frontier:
        nxt = []
        for u in frontier:
            for v in nbrs[u]:
                if not seen[v]:
                    seen[v] = 1
                    nxt.append(v)
        if nxt:
            last = nxt[-1]
        frontier = nxt
    return last


def _grow(nbrs: list[list[int]], wts: list[list[int]], sizes: list[int]) -> list[int]:
    """Fill rank 0, then 1, ... each to its size, by greedy graph growing.

    A rank takes, one at a time, the unplaced peer that adds the fewest cut edges (most links into
    the rank against links elsewhere; ties: first reached). The next rank starts at the unplaced
    peer with most links to those already placed, so ranks grow side by side as layers and the
    unplaced rest stays compact (a rank started anywhere else leaves scattered leftovers for the last).
    """
    n = len(nbrs)
    deg = [sum(w) for w in wts]
    part = [-1] * n
    placed_links = [0] * n  # links to placed peers (for the next rank's seed)
    seeds: list[tuple[int, int]] = []  # (-placed_links, peer), lazily updated
    order = itertools.count()
    lowest = 0  # every peer below is placed (fallback seed: another component)
    first = _farthest(nbrs, _farthest(nbrs, 0))

    def next_seed() -> int:
        nonlocal lowest
        while seeds:
            key, u = heapq.heappop(seeds)
            if part[u] < 0 and -key == placed_links[u]:
                return u
        while part[lowest] >= 0:
            lowest += 1
        return lowest

    for r, size in enumerate(sizes):
        seed = first if r == 0 else next_seed()
        conn: dict[int, int] = {seed: 0}
        heap = [(deg[seed] - placed_links[seed], next(order), seed)]  # (links out to unplaced - links in, order, peer)
        taken = 0
        while taken < size:
            if not heap:  # this rank's reach is exhausted: continue from another seed
                u = next_seed()
                conn[u] = 0
                heap.append((deg[u] - placed_links[u], next(order), u))
            key, _, u = heapq.heappop(heap)
            if part[u] >= 0 or key != deg[u] - placed_links[u] - conn[u]:
                continue
            part[u] = r
            taken += 1
            for v, w in zip(nbrs[u], wts[u], strict=True):
                if part[v] < 0:
                    c = conn.get(v, 0) + w
                    conn[v] = c
                    placed_links[v] += w
                    heapq.heappush(heap, (deg[v] - placed_links[v] - c, next(order), v))
                    heapq.heappush(seeds, (-placed_links[v], v))
    return part


def _links(nbrs: list[int], wts: list[int], part: list[int]) -> dict[int, int]:
    """A peer's links to each rank (rank -> links), ranks in the order its neighbours list them."""
    out: dict[int, int] = {}
    for v, w in zip(nbrs, wts, strict=True):
        p = part[v]
        out[p] = out.get(p, 0) + w
    return out


def _boundary(nbrs: list[list[int]], part: list[int]) -> list[int]:
    """The peers with a neighbour on another rank (in index order): the only ones a move can help."""
    return [u for u, vs in enumerate(nbrs) if any(part[v] != part[u] for v in vs)]


def _sizes(part: list[int], world: int) -> list[int]:
    return np.bincount(np.asarray(part), minlength=world).tolist()


def _refine(nbrs: list[list[int]], wts: list[list[int]], part: list[int], world: int, low: int, high: int) -> None:
    """Move boundary peers to the rank they have most links to, while that cuts fewer edges (or as
    many, toward balance), keeping every rank's size within [low, high]. Stops when a pass moves nothing."""
    size = _sizes(part, world)
    for _ in range(_PASSES):
        moved = 0
        for u in _boundary(nbrs, part):
            a = part[u]
            links = _links(nbrs[u], wts[u], part)
            if len(links) == 1 and a in links:
                continue  # inside its rank since an earlier move of this pass
            own = links.get(a, 0)
            b = min((p for p in links if p != a), key=lambda p: (-links[p], size[p], p))
            gain = links[b] - own
            if (gain > 0 or (gain == 0 and size[a] > size[b] + 1)) and size[a] > low and size[b] < high:
                part[u] = b
                size[a] -= 1
                size[b] += 1
                moved += 1
        if not moved:
            return


def _rebalance(nbrs: list[list[int]], wts: list[list[int]], part: list[int], world: int, low: int,
               high: int) -> None:
    """Bring every rank's size into [low, high] by the moves that cost the fewest cut edges.

    Givers: ranks above ``high`` (or, when none is but some rank is below ``low``, those above
    ``low``); takers: ranks below ``low`` (or, when none is, those below ``high``).
    """
    size = _sizes(part, world)

    def roles() -> tuple[list[bool], list[int]]:
        under = [p for p in range(world) if size[p] < low]
        over = [p for p in range(world) if size[p] > high]
        if under:
            givers = over or [p for p in range(world) if size[p] > low]
            takers = under
        else:
            givers, takers = over, [p for p in range(world) if size[p] < high]
        giving = [False] * world
        for p in givers:
            giving[p] = True
        return giving, takers

    def best(u: int, takers: list[int]) -> tuple[int, int]:
        links = _links(nbrs[u], wts[u], part)
        b = min(takers, key=lambda p: (-links.get(p, 0), size[p], p))
        return links.get(b, 0) - links.get(part[u], 0), b

    while True:
        giving, takers = roles()
        if not takers or not any(giving):
            return
        heap = []
        for u in range(len(nbrs)):
            if giving[part[u]]:
                gain, b = best(u, takers)
                heap.append((-gain, u, b))
        heapq.heapify(heap)
        while heap:
            key, u, b = heapq.heappop(heap)
            if not giving[part[u]]:
                continue
            gain, b2 = best(u, takers)
            if (-gain, b2) != (key, b):
                heapq.heappush(heap, (-gain, u, b2))
                continue
            size[part[u]] -= 1
            size[b] += 1
            part[u] = b
            giving, takers = roles()
            if not takers or not any(giving):
                return
            for v in nbrs[u]:
                if giving[part[v]]:
                    g, c = best(v, takers)
                    heapq.heappush(heap, (-g, v, c))
