"""The address book: where each peer of a topology runs (peer id -> ``host:port``).

Kept apart from the topology file so the graph has one identity wherever it runs: the topology
hash (in every payload header) covers peer ids, edges, weights and schedule, and the address book
says where the peers listen. Moving a peer to another host, or deploying the same graph on
loopback, in compose (service names) or in Kubernetes (the headless service's DNS names), changes
the address book only. The simulation needs none.

File format (YAML)::

    # p2pfl address book
    peers:
      p0: 127.0.0.1:50050
      p1: 127.0.0.1:50051

Addresses are checked as in a topology file (``host:port``; two spellings of one socket are a
duplicate). A book must name exactly the topology's peers: a peer missing from it could not be
dialed, and an unknown id is almost always a typo.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from p2pfl.badinput import BadInput, shorten, suggest
from p2pfl.schema import from_validation_error
from p2pfl.yamlsafe import YamlLimits, load_yaml_file

from .spec import Topology, TopologyError, check_addresses, load_topology

__all__ = ["AddressBook", "AddressBookError", "load_address_book", "loopback_book", "parse_address_book", "placed_topology"]

#: Bounds of the loader: 100,000 peers are about 4 MiB.
ADDRESS_BOOK_LIMITS = YamlLimits(max_bytes=16 << 20, max_depth=8, max_aliases=0, max_nodes=1_000_000)


class AddressBookError(TopologyError):
    """An address book is invalid, or does not fit the topology; the message names file, key and problem."""


class _BookFile(BaseModel):
    """The typed schema: one ``peers`` mapping of id -> ``host:port`` (strings only, no other keys)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    peers: dict[str, str]


@dataclass(frozen=True)
class AddressBook:
    """Validated ``(peer id, address)`` pairs in file order (immutable; addresses as written)."""

    entries: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if not self.entries:
            raise AddressBookError("no peers: 'peers' must map at least one peer id to 'host:port'", key="peers")
        try:
            check_addresses(self.entries)
        except TopologyError as e:
            raise AddressBookError(e.problem, key="peers") from None

    @classmethod
    def from_mapping(cls, addresses: Mapping[str, str]) -> AddressBook:
        return cls(tuple(addresses.items()))

    @classmethod
    def from_topology(cls, topo: Topology) -> AddressBook:
        """The addresses a (legacy) topology file carries inline: its default address book."""
        return cls(tuple((p.id, topo.address(p.id)) for p in topo.peers))

    def as_dict(self) -> dict[str, str]:
        return dict(self.entries)

    def place(self, topo: Topology) -> Topology:
        """``topo`` with its peers at this book's addresses (same graph, same hash).

        Refused unless the book names exactly the topology's peers."""
        book = self.as_dict()
        for pid in book:
            if pid not in topo._derived.index:
                close = suggest(pid, topo.ids)
                raise AddressBookError(f"peer {shorten(pid, 64)!r} is not in topology {topo.name!r}",
                                       key=f"peers.{shorten(pid, 64)}",
                                       hint=f"did you mean {close!r}?" if close else None)
        missing = [pid for pid in topo.ids if pid not in book]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise AddressBookError(f"no address for peer {missing[0]!r}{more} of topology {topo.name!r}",
                                   key="peers")
        return topo.with_addresses(book)

    def to_yaml(self, topo: Topology | None = None) -> str:
        import yaml

        what = f" for topology {topo.name!r} (hash {topo.hash()})" if topo is not None else ""
        header = f"# p2pfl address book{what}: peer id -> host:port (format: topology/README.md)\n"
        return header + yaml.safe_dump({"peers": self.as_dict()}, sort_keys=False, default_flow_style=False,
                                       width=120)

    def dump(self, path: str | Path, topo: Topology | None = None) -> None:
        Path(path).write_text(self.to_yaml(topo), encoding="utf-8")


def parse_address_book(data: Any, source: str = "<dict>") -> AddressBook:
    """Validate parsed YAML as an address book; every failure is an `AddressBookError` naming ``source``."""
    try:
        if not isinstance(data, Mapping):
            raise AddressBookError(f"an address book is a mapping 'peers: {{id: host:port}}'; got "
                                   f"{type(data).__name__}")
        try:
            f = _BookFile.model_validate(dict(data))
        except ValidationError as exc:

            err = from_validation_error(exc, _BookFile)
            raise AddressBookError(err.problem, key=err.key, allowed=err.allowed, hint=err.hint) from None
        return AddressBook(tuple(f.peers.items()))
    except BadInput as e:
        raise AddressBookError(e.problem, source=e.source, key=e.key, line=e.line, allowed=e.allowed,
                               hint=e.hint).located(source) from None


def load_address_book(path: str | Path) -> AddressBook:
    """Read and validate an address book file (bounded YAML loader; duplicate keys refused)."""
    path = Path(path)
    try:
        data = load_yaml_file(path, "address book", ADDRESS_BOOK_LIMITS)
    except BadInput as e:
        raise AddressBookError(e.problem, source=e.source or str(path), line=e.line) from None
    return parse_address_book(data, source=str(path))


def placed_topology(topology: str | Path, addresses: str | Path | None) -> Topology:
    """The topology file's graph with its peers placed: at the address book's addresses when one is
    named (it wins over addresses the file may still carry), else as the file gives them (or unplaced:
    the simulation needs no addresses). The one place every mode resolves where peers run."""
    topo = load_topology(topology)
    if addresses is None:
        return topo
    book = load_address_book(addresses)
    try:
        return book.place(topo)
    except BadInput as e:
        raise e.located(str(addresses)) from None


def loopback_book(topo: Topology, host: str = "127.0.0.1") -> AddressBook:
    """Every peer of ``topo`` on ``host`` at a port free right now (what `p2pfl launch` uses for a
    graph-only topology with no address book: one machine, so any free ports will do)."""
    import socket

    socks: list[socket.socket] = []
    try:
        for _ in topo.ids:  # all held open at once, so no port is handed out twice
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return AddressBook(tuple((pid, f"{host}:{s.getsockname()[1]}") for pid, s in zip(topo.ids, socks,
                                                                                        strict=True)))
    finally:
        for s in socks:
            s.close()
