"""The address book (peer id -> host:port) kept apart from the topology: the hash covers the graph
only; compose and Kubernetes place a graph-only topology through a book without rewriting it; bad
books are refused with one line and nothing written; a real loopback launch runs from a book."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from p2pfl.config import ConfigError, load_config
from p2pfl.deploy.compose import IN_ADDRESSES, render_compose
from p2pfl.deploy.k8s import GRPC_PORT, SERVICE, render_k8s
from p2pfl.experiment import Experiment
from p2pfl.topology import TopologyError, generate, load_topology, parse_topology
from p2pfl.topology.addressbook import (
    AddressBook,
    AddressBookError,
    load_address_book,
    loopback_book,
    parse_address_book,
    placed_topology,
)
from tests.conftest import tiny_config
from tests.swarm import free_base_port

REPO = Path(__file__).resolve().parents[1]


def split_config(tmp_path: Path, peers: int = 4, ports: list[int] | None = None, **extra) -> Path:
    """A tiny config whose topology is the graph only, placed by ``addresses.yaml`` (network.addresses)."""
    cfg = tiny_config(tmp_path, peers=peers, **extra)
    topo = load_topology(tmp_path / "topology.yaml")
    topo.graph_only().dump(tmp_path / "topology.yaml")
    ports = ports or [47300 + i for i in range(peers)]
    AddressBook(tuple((pid, f"127.0.0.1:{ports[i]}") for i, pid in enumerate(topo.ids))).dump(
        tmp_path / "addresses.yaml")
    data = yaml.safe_load(cfg.read_text())
    data.setdefault("network", {})["addresses"] = "addresses.yaml"  # relative to the config's folder
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def test_hash_covers_the_graph_not_the_addresses() -> None:
    inline = generate("ring", 5)
    graph = inline.graph_only()
    moved = inline.with_addresses({pid: f"peer-{pid}.example.org:7000" for pid in inline.ids})
    assert graph.hash() == inline.hash() == moved.hash()
    assert not graph.has_addresses and moved.has_addresses and moved != inline
    # the graph-only file form round-trips, and a book places it back exactly where the inline file had it
    text = graph.to_yaml()
    assert "address" not in text and parse_topology(yaml.safe_load(text)) == graph
    book = AddressBook.from_topology(inline)
    assert book.place(graph) == inline
    assert parse_address_book(yaml.safe_load(book.to_yaml(graph))) == book
    # ... while the graph still decides: another edge, another hash
    assert generate("ring", 5).hash() != generate("full", 5).hash()
    with pytest.raises(TopologyError, match="describes the graph only"):
        graph.address("p0")


def test_config_key_places_the_topology_and_simulation_needs_none(tmp_path: Path) -> None:
    cfg_path = split_config(tmp_path)
    cfg = load_config(cfg_path)
    assert cfg.network.addresses == str(tmp_path / "addresses.yaml")  # resolved against the config's folder
    exp = Experiment.from_config(cfg)
    assert exp.topology.address("p2") == "127.0.0.1:47302"
    assert exp.topology.hash() == load_topology(tmp_path / "topology.yaml").hash()
    # without the key the graph-only topology loads unplaced: all the simulation needs
    bare = load_config(cfg_path, ["network.addresses=null"])
    assert bare.network.addresses is None and not Experiment.from_config(bare).topology.has_addresses
    # ... and a peer process refuses to start unplaced, before it writes anything
    from p2pfl.node_process import run_node

    with pytest.raises(TopologyError, match="gives no address for peer 'p0'"):
        run_node(bare, "p0", tmp_path / "node", insecure=True)
    assert not (tmp_path / "node").exists()
    # the book wins over addresses a (legacy) topology file still carries
    generate("ring", 4).dump(tmp_path / "topology.yaml")
    assert Experiment.from_config(load_config(cfg_path)).topology.address("p0") == "127.0.0.1:47300"


BAD_BOOKS = [
    ("peers:\n  p0: 'not an address'\n", "peers: peer 'p0': malformed address"),
    ("peers:\n  p0: 127.0.0.1:1\n  p1: localhost:1\n", "duplicate address 'localhost:1' (peers 'p0' and 'p1', the same socket"),
    ("peers:\n  p0: 127.0.0.1:1\n  p0: 127.0.0.1:2\n", "line 3: invalid YAML: while constructing a mapping found duplicate key 'p0'"),
    ("peers:\n  p0: 127.0.0.1:99999\n", "port must be 1-65535"),
    ("peers:\n  p0: 5\n", "peers.p0: must be a string"),
    ("peerz: {}\n", "addresses.yaml: "),
    ("- p0\n", "an address book is a mapping"),
    ("peers: {}\n", "no peers"),
    ("peers: {p0: 'a:1', p1: 'b:1', p2: 'c:1', p3: 'd:1', p9: 'e:1'}\n", "peers.p9: peer 'p9' is not in topology"),
    ("peers: {p0: 'a:1', p1: 'b:1'}\n", "no address for peer 'p2' (and 1 more)"),
]


@pytest.mark.parametrize(("text", "message"), BAD_BOOKS, ids=[m[:24] for _, m in BAD_BOOKS])
def test_bad_address_books_are_refused_by_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    cfg = split_config(tmp_path)
    (tmp_path / "addresses.yaml").write_text(text)
    with pytest.raises(AddressBookError) as err:
        load_config(cfg)
    line = str(err.value)
    assert "\n" not in line and line.startswith(str(tmp_path / "addresses.yaml")) and message in line, line


def test_bad_book_on_the_command_line_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    cfg = split_config(tmp_path)
    (tmp_path / "addresses.yaml").write_text("peers: {p0: 'h:1', p1: 'H:1', p2: 'x:2', p3: 'y:3'}\n")
    out = tmp_path / "deploy"
    res = subprocess.run([sys.executable, "-m", "p2pfl.cli", "compose", "--config", str(cfg), "--out",
                          str(out / "docker-compose.yml")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "addresses.yaml: peers: duplicate address 'H:1'" in lines[0], res.stderr
    assert not out.exists(), f"compose wrote {list(out.rglob('*'))}"
    with pytest.raises(AddressBookError, match="duplicate address 'H:1'"):
        render_k8s(cfg)  # before anything is written, like every other bad input
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"network.addresses: address book .*nope.yaml' not found"):
        load_config(cfg, [f"network.addresses={missing}"])


def test_compose_and_k8s_place_a_graph_only_topology_without_rewriting_it(tmp_path: Path) -> None:
    cfg = split_config(tmp_path, ports=[47400, 47410, 47420, 47430])
    topo_text = (tmp_path / "topology.yaml").read_text()
    graph_hash = load_topology(tmp_path / "topology.yaml").hash()
    sim_hash = Experiment.from_config(load_config(cfg)).topology.hash()
    from p2pfl.cli.compose import compose_command
    from p2pfl.cli.topology import app as topology_app

    app = typer.Typer(add_completion=False)
    app.command()(compose_command)
    # compose network: service names, ports from the book; the book the containers read is written beside the file
    out = tmp_path / "deploy" / "docker-compose.yml"
    res = CliRunner().invoke(app, ["--config", str(cfg), "--out", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load(out.read_text())
    book = load_address_book(out.parent / "docker-compose.addresses.yaml").as_dict()
    assert book == {f"p{i}": f"peer-p{i}:{47400 + 10 * i}" for i in range(4)}
    assert doc["x-p2pfl"]["topology_hash"] == graph_hash == sim_hash
    for svc in doc["services"].values():
        assert svc["command"][-2:] == ["--set", f"network.addresses={IN_ADDRESSES}"]
        assert "./docker-compose.addresses.yaml:/p2pfl/addresses.yaml:ro" in svc["volumes"]
        assert "../topology.yaml:/p2pfl/topology.yaml:ro" in svc["volumes"]  # the graph, as it is
    # host network: the book's loopback addresses as they are
    host = render_compose(cfg, out=out, network="host")
    assert [host.topology.address(p) for p in host.topology.ids] == [f"127.0.0.1:{47400 + 10 * i}" for i in range(4)]
    assert host.topology.hash() == graph_hash
    # Kubernetes: the headless service's DNS names; the topology file goes in byte for byte
    man = render_k8s(cfg, insecure=True)
    (cm,) = [d for d in man.documents if d["kind"] == "ConfigMap"]
    assert cm["data"]["topology.yaml"] == topo_text
    pods = parse_address_book(yaml.safe_load(cm["data"]["addresses.yaml"]))
    assert pods.as_dict() == {f"p{i}": f"peer-p{i}-0.{SERVICE}:{GRPC_PORT}" for i in range(4)}
    assert pods.place(parse_topology(yaml.safe_load(topo_text))).hash() == graph_hash
    assert (tmp_path / "topology.yaml").read_text() == topo_text  # never rewritten
    # the generator writes the same split: the graph, and the book beside it
    gen = tmp_path / "gen"
    gen.mkdir()
    res = CliRunner().invoke(topology_app, ["gen", "ring", "-n", "4", "--out", str(gen / "t.yaml"),
                                   "--addresses-out", str(gen / "a.yaml"), "--address-template", "node{i}:7000"])
    assert res.exit_code == 0, res.output
    assert not load_topology(gen / "t.yaml").has_addresses and load_topology(gen / "t.yaml").hash() == graph_hash
    assert placed_topology(gen / "t.yaml", gen / "a.yaml").address("p3") == "node3:7000"


def test_loopback_book_gives_distinct_free_ports() -> None:
    book = loopback_book(generate("ring", 6).graph_only())
    ports = {int(a.rpartition(":")[2]) for _, a in book.entries}
    assert len(ports) == 6 and all(a.startswith("127.0.0.1:") for _, a in book.entries)


@pytest.mark.timeout(240)
def test_launch_on_loopback_from_a_separate_address_book(tmp_path: Path) -> None:

    base = free_base_port(2)
    cfg = split_config(tmp_path, peers=2, rounds=1, ports=[base, base + 1])
    data = yaml.safe_load(cfg.read_text())
    del data["network"]  # the book comes from --addresses, as a user would give it
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "launch"
    proc = subprocess.run([sys.executable, "-m", "p2pfl.cli", "launch", "--config", str(cfg), "--out", str(out),
                           "--addresses", str(tmp_path / "addresses.yaml"), "--timeout", "180"],
                          capture_output=True, text=True, timeout=220, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tls"] is True and not summary["failed_peers"] and summary["rounds"] == 1
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(recs) == 2 and all(r["bytes_recv"] > 0 and not r["missing"] for r in recs)
    assert not (out / "addresses.yaml").exists()  # placed by the given book, not by launch's own
