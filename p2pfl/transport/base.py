"""The Transport seam: hand over this peer's payload for (round, step), get the neighbours'.

Synchronous rounds: ``exchange`` publishes (pull mode) or pushes (push mode) the peer's own
message, then waits until every in-neighbour of the plan has delivered or the deadline passes.
What arrived is returned; who was missing is reported, and the Node mixes over what arrived.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

from p2pfl.payload import Payload
from p2pfl.topology import MixingPlan
from p2pfl.wire.compress import WireFormat


@dataclass
class ExchangeResult:
    """What one exchange brought. ``undelivered`` (push mode): out-neighbours that did not mix this
    peer's push; the peer keeps their share of its mass (docs/protocol.md). ``mu_settle`` (push
    mode): push-sum weight the ledger moved to (+) or from (-) this peer to repair a loss or a
    double count after a restart; the node adds it to its mu. ``withheld``: in-neighbours that kept
    their whole share this step on purpose (not missing)."""

    received: dict[str, Payload]
    missing: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_recv: int = 0
    undelivered: list[str] = field(default_factory=list)
    mu_settle: float = 0.0
    withheld: list[str] = field(default_factory=list)


class TransportError(RuntimeError):
    """The exchange could not happen at all (e.g. the simulation was aborted)."""


class Transport(ABC):
    #: ``wire.*``: how payloads are encoded; receivers refuse any other (set by ``configure_wire``).
    wire_format: WireFormat = WireFormat()
    #: Bytes per data chunk (``network.chunk_kb``), for transports that count bytes by the codec's sizes.
    chunk_bytes: int = 1 << 20
    #: Whether ``exchange`` takes ``withhold=True`` (push-sum: keep the whole share this step).
    can_withhold: bool = False
    #: The run's last round (set by the Node). Push-sum: a debt the ledger finds there is paid in
    #: full, since no later push would settle the rest (docs/protocol.md, "Push-sum mass").
    final_round: int | None = None

    def configure_wire(self, fmt: WireFormat, chunk_bytes: int | None = None) -> None:
        """Set the run's wire format (and chunk size) before the first exchange."""
        self.wire_format = fmt
        if chunk_bytes is not None:
            self.chunk_bytes = int(chunk_bytes)

    @abstractmethod
    def exchange(self, message: Payload, plan: MixingPlan, deadline_s: float) -> ExchangeResult:
        """Deliver ``message`` per ``plan`` and collect the in-neighbours' messages for the same (round, step)."""

    def exchange_latest(self, message: Payload, plan: MixingPlan, max_staleness: int,
                        wait_s: float) -> ExchangeResult:
        """Asynchronous gossip: publish ``message`` and return the freshest payload held from each
        in-neighbour (any round >= ``message.round - max_staleness``), without a round barrier."""
        raise NotImplementedError(f"{type(self).__name__} has no asynchronous mode")

    def ledger_state(self) -> dict[str, dict[str, float]] | None:
        """Push-sum running totals to checkpoint with the state (None: this transport loses no mass)."""
        return None

    def late_settlement(self) -> float:
        """Push-sum weight settled since the last exchange (e.g. a mixed push whose OK could not be
        sent), for the node to add to its mu before it checkpoints (0 by default)."""
        return 0.0

    def defer_settlement(self, amount: float) -> None:
        """Take back a settlement the node could not apply yet (``pushsum.debit``): it comes again with
        the next exchange's (or checkpoint's) settlement. Only a transport that settles gets one."""
        raise NotImplementedError(f"{type(self).__name__} settles nothing")

    def restore_ledger(self, ledger: dict | None) -> None:
        """Restore the running totals of the checkpoint being resumed (nothing by default)."""
        return None

    def resumed_round(self) -> int:
        """The round this peer restarted at, whose lost pushes it recovers first (-1: a fresh start)."""
        return -1

    def proven_rounds(self, peers: Iterable[str], probe: Iterable[str], timeout_s: float) -> dict[str, int]:
        """Per peer of ``peers``, the highest round of a payload from it that passed validation: the
        only evidence a catch-up may act on (``p2pfl/transport/progress.py``). Those in ``probe`` are
        asked first, each within ``timeout_s``. None known here (a transport without faults)."""
        return {}

    def sleep(self, seconds: float) -> None:
        """Idle for ``seconds`` (a slowed-down peer): a transport whose peers take turns lets the others run."""
        time.sleep(seconds)

    def linger(self, deadline_s: float) -> None:
        """After the last round: keep serving until neighbours got our last payload (default: nothing to do)."""
        return None

    def close(self) -> None:
        """Release sockets/threads (nothing to release by default)."""
        return None
