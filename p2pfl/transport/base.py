"""The Transport seam: hand over this peer's payload for (round, step), get the neighbours'.

Synchronous rounds: ``exchange`` publishes (pull mode) or pushes (push mode) the peer's own
message, then waits until every in-neighbour of the plan has delivered or the deadline passes.
What arrived is returned; who was missing is reported, and the Node mixes over what arrived.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from p2pfl.messages import Message
from p2pfl.topology import MixingPlan


@dataclass
class ExchangeResult:
    received: dict[str, Message]
    missing: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_recv: int = 0


class TransportError(RuntimeError):
    """The exchange could not happen at all (e.g. the simulation was aborted)."""


class Transport(ABC):
    @abstractmethod
    def exchange(self, message: Message, plan: MixingPlan, deadline_s: float) -> ExchangeResult:
        """Deliver ``message`` per ``plan`` and collect the in-neighbours' messages for the same (round, step)."""

    def linger(self, deadline_s: float) -> None:
        """After the last round: keep serving until neighbours got our last payload (default: nothing to do)."""
        return None

    def close(self) -> None:
        """Release sockets/threads (nothing to release by default)."""
        return None
