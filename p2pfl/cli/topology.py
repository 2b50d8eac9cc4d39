"""``p2pfl topology``: generate, check and draw topology files.

The package modules (numpy, networkx, yaml) are imported inside the commands and matplotlib only
in ``show``, so mounting this app does not slow down unrelated ``p2pfl`` commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from p2pfl.topology.spec import Topology

app = typer.Typer(
    name="topology",
    help="Generate, check and draw peer topology files (format: topology/README.md).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# Lists longer than these are summarized, not printed in full.
_LIST_PEERS = 16
_LIST_EDGES = 32


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: <reason>`` on stderr and return the exit exception (2: bad input; no traceback)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=code)


def _load(path: Path) -> Topology:
    from p2pfl.topology.spec import TopologyError, load_topology

    try:
        return load_topology(path)
    except TopologyError as e:
        raise _fail(str(e)) from None


@app.command()
def gen(
    kind: Annotated[
        str,
        typer.Argument(
            help="ring | grid | torus | exponential | full | random_regular | random_pull | directed_ring"
            " | erdos_renyi"
        ),
    ],
    peers: Annotated[int, typer.Option("--peers", "-n", help="number of peers")],
    k: Annotated[
        int | None, typer.Option(help="degree (random_regular) or peers drawn per round (random_pull)")
    ] = None,
    p: Annotated[float | None, typer.Option("--p", help="edge probability (erdos_renyi)")] = None,
    seed: Annotated[int, typer.Option(help="seed of random_regular and erdos_renyi")] = 0,
    weights: Annotated[
        str | None,
        typer.Option(help="metropolis | uniform (default: metropolis if undirected, else uniform)"),
    ] = None,
    host: Annotated[str, typer.Option(help="host of every address")] = "127.0.0.1",
    base_port: Annotated[int, typer.Option(help="port of p0; peer i listens on base-port + i")] = 50050,
    address_template: Annotated[
        str | None, typer.Option(help="address pattern with {i}, {id}, {port}, e.g. 'peer-{i}:50051'")
    ] = None,
    name: Annotated[str | None, typer.Option(help="topology name (default: KIND-N)")] = None,
    out: Annotated[Path | None, typer.Option(help="output file (default: stdout)")] = None,
    addresses_out: Annotated[Path | None, typer.Option(
        "--addresses-out", help="write the addresses (--host/--base-port/--address-template) to this address "
        "book and the topology as the graph only")] = None,
) -> None:
    """Generate a standard topology and write it as YAML (with inline addresses, or the graph only
    plus an address book beside it with --addresses-out)."""
    from p2pfl.topology.generators import generate
    from p2pfl.topology.spec import TopologyError

    try:
        topo = generate(
            kind,
            peers,
            k=k,
            p=p,
            seed=seed,
            host=host,
            base_port=base_port,
            address_template=address_template,
            weights=weights,
            name=name,
        )
    except TopologyError as e:
        raise _fail(str(e)) from None
    if addresses_out is not None:
        from p2pfl.topology.addressbook import AddressBook

        graph = topo.graph_only()
        try:
            AddressBook.from_topology(topo).dump(addresses_out, graph)
        except OSError as e:
            raise _fail(f"cannot write {addresses_out}: {e.strerror or e}", code=1) from None
        typer.echo(f"wrote {addresses_out} (address book of {topo.n} peers)", err=True)
        topo = graph
    if out is None:
        typer.echo(topo.to_yaml(), nl=False)
    else:
        topo.dump(out)
        typer.echo(f"wrote {out} ({topo.n} peers, {len(topo.edges)} edges, hash {topo.hash()})", err=True)


@app.command()
def check(
    file: Annotated[Path, typer.Argument(help="topology YAML file")],
    round: Annotated[
        int, typer.Option("--round", help="round whose matrix is analysed (random schedules)")
    ] = 0,
    step: Annotated[int, typer.Option(help="gossip step whose matrix is analysed (random schedules)")] = 0,
    seed: Annotated[int, typer.Option(help="experiment seed (random schedules)")] = 0,
    mode: Annotated[str, typer.Option(help="pull (row-stochastic) | push (column-stochastic)")] = "pull",
) -> None:
    """Validate a topology file and print its peers, edges, stochasticity and spectral gap."""
    from p2pfl.topology.mixing import (
        DENSE_EIG_LIMIT,
        is_column_stochastic,
        is_doubly_stochastic,
        is_row_stochastic,
        is_symmetric,
        spectral_gap,
    )
    from p2pfl.topology.spec import ExplicitWeights, Peer, TopologyError

    topo = _load(file)
    try:
        w = topo.sparse_matrix(round=round, step=step, seed=seed, mode=mode)
    except (TopologyError, ValueError) as e:
        raise _fail(str(e)) from None

    def yes(b: bool) -> str:
        return "yes" if b else "no"

    typer.echo(f"topology: {topo.name}  (hash {topo.hash()}, {file})")
    typer.echo(f"directed: {yes(topo.directed)}")
    def at(p: Peer) -> str:
        return p.id if p.address is None else f"{p.id}@{p.address}"

    if topo.n <= _LIST_PEERS:
        typer.echo(f"peers: {topo.n}: " + ", ".join(at(p) for p in topo.peers))
    else:
        typer.echo(f"peers: {topo.n}: {at(topo.peers[0])} ... {at(topo.peers[-1])}")
    if not topo.has_addresses:
        typer.echo("addresses: none (graph only: an address book places the peers)")
    arrow = " -> " if topo.directed else " -- "
    if not topo.edges:
        typer.echo("edges: 0" + (" (candidates: all peers)" if topo.schedule is not None else ""))
    elif len(topo.edges) <= _LIST_EDGES:
        typer.echo(f"edges: {len(topo.edges)}: " + ", ".join(s + arrow + d for s, d in topo.edges))
    else:
        typer.echo(f"edges: {len(topo.edges)}")
    typer.echo(f"weights: {'explicit' if isinstance(topo.weights, ExplicitWeights) else topo.weights}")
    if topo.schedule is not None:
        typer.echo(
            f"schedule: {topo.schedule.kind}, k={topo.schedule.k}; matrix below is round {round}, "
            f"step {step}, seed {seed}"
        )
    typer.echo(f"mode: {mode}")
    typer.echo(f"row-stochastic: {yes(is_row_stochastic(w))}")
    typer.echo(f"column-stochastic: {yes(is_column_stochastic(w))}")
    typer.echo(f"doubly stochastic: {yes(is_doubly_stochastic(w))}")
    typer.echo(f"symmetric: {yes(is_symmetric(w))}")
    if w.n <= DENSE_EIG_LIMIT:
        typer.echo(f"spectral gap (1 - |lambda_2|): {spectral_gap(w):.6g}")
    else:
        typer.echo(f"spectral gap (1 - |lambda_2|): not computed for more than {DENSE_EIG_LIMIT} peers")


@app.command()
def show(
    file: Annotated[Path, typer.Argument(help="topology YAML file")],
    out: Annotated[Path, typer.Option(help="output image (PNG)")],
    round: Annotated[int, typer.Option("--round", help="round drawn for random schedules")] = 0,
    seed: Annotated[int, typer.Option(help="experiment seed (random schedules)")] = 0,
) -> None:
    """Draw the graph (for random schedules: the pull graph of one round) to an image."""
    import networkx as nx

    from p2pfl.display import figure
    from p2pfl.topology.generators import grid_shape
    from p2pfl.topology.spec import TopologyError

    topo = _load(file)
    if topo.schedule is not None:
        # Draw who pulls from whom this round: an arrow j -> i for every W[i, j] > 0, j != i.
        w = topo.mixing_matrix(round=round, seed=seed)
        g: nx.Graph = nx.DiGraph()
        g.add_nodes_from(topo.ids)
        g.add_edges_from((topo.ids[j], topo.ids[i]) for i, j in zip(*w.nonzero(), strict=True) if i != j)
        title = f"{topo.name} (round {round}, seed {seed})"
    else:
        g = topo.graph()
        title = topo.name
    base = topo.name.split("-")[0]
    pos: dict[str, tuple[float, float]]
    if base in ("grid", "torus"):
        try:
            _, cols = grid_shape(topo.n)
            pos = {pid: (float(i % cols), -float(i // cols)) for i, pid in enumerate(topo.ids)}
        except TopologyError:
            pos = nx.spring_layout(g, seed=0)
    elif base in ("ring", "directed", "exponential", "full", "random") or all(
        d == 2 for _, d in nx.Graph(g).degree
    ):
        pos = nx.circular_layout(g)
    else:
        pos = nx.spring_layout(g, seed=0)
    size = max(4.0, min(12.0, 0.6 * topo.n))
    fig, ax = figure((size, size))
    nx.draw_networkx(
        g, pos=pos, ax=ax, node_color="#9ecae1", edge_color="#555555", font_size=8, arrows=g.is_directed()
    )
    ax.set_title(title)
    ax.set_axis_off()
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise _fail(f"cannot write {out}: {e.strerror or e}", code=1) from None
    typer.echo(f"wrote {out}", err=True)
