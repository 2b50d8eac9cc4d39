"""What a `PeerServer` was started with, read by every part of the service.

Why: admission, the publication window, the inbox and the handlers each need a few of the same
facts (this peer's id and mode, the topology and who may call, the payload limits). One mutable
record, filled by `PeerServer.start`, is shared by reference, so no part keeps a copy that could
go stale (``wire_format`` is set after start, by `Transport.configure_wire`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pfl.models.layout import TensorSpec
from p2pfl.security.certs import TLSConfig
from p2pfl.topology import MixingPlan, Topology
from p2pfl.wire.codec import DEFAULT_CHUNK_BYTES
from p2pfl.wire.compress import WireFormat

__all__ = ["ServiceConfig"]


@dataclass
class ServiceConfig:
    """The peer service's settings (`PeerServer.start` documents each)."""

    peer_id: str = ""
    mode: str = "pull"
    tls: TLSConfig | None = None
    seed: int = 0
    topology: Topology | None = None
    topology_hash: str = ""
    expected_specs: tuple[TensorSpec, ...] = ()
    scalar_keys: frozenset[str] = frozenset()
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: wire.*: what pushes must be encoded as (Transport.configure_wire)
    wire_format: WireFormat = field(default_factory=WireFormat)
    max_bytes: int = 256 << 20
    max_wait_s: float = 300.0
    max_pending: int = 16
    max_call_s: float = 0.0
    #: who may Pull (possible out-neighbours), Push (possible in-neighbours), ask Status (any member)
    may_pull: frozenset[str] = frozenset()
    may_push: frozenset[str] = frozenset()
    members: frozenset[str] = frozenset()

    def plan(self, round: int, step: int) -> MixingPlan:
        """This peer's mixing plan of (round, step): who pulls from / pushes into it then, with what weight."""
        assert self.topology is not None
        return self.topology.plan(self.peer_id, round, step, seed=self.seed, mode=self.mode)
