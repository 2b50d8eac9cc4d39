"""A restarted push-mode receiver's repair of what it mixed after its checkpoint and lost with its state.

Why (docs/protocol.md, "Push-sum mass", rules 4 and 6): a peer killed after it mixed a push and
before it checkpointed that round replays the round from its checkpoint. Its senders, answered OK,
no longer hold those shares, so the mass would be lost. While it waits for the resumed round's
pushes it asks each sender (a Pull, in push mode) for the push it may have given (`recover_one`);
what recovery cannot bring back comes from its write-ahead log of totals absorbed
(`restore_logged`, `pushsum.logged_totals`), less the pushes whose senders answer they kept the
share. Senders' claims are held (not settled) until the resumed round is over, so nothing counts twice.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path

from p2pfl.storage import atomic_write
from p2pfl.topology import Topology
from p2pfl.transport.grpc_service import PeerServer
from p2pfl.transport.pull_client import PullClient
from p2pfl.transport.pushsum import Key, logged_totals, parse_absorb_line
from p2pfl.transport.rpc import TRANSPORT_LOG

__all__ = ["PushRecovery", "load_absorb_log"]

log = TRANSPORT_LOG


class PushRecovery:
    """The resumed round's recovery pulls and the write-ahead log restored after it, for one restarted peer.

    ``restarted``: the peer has a checkpoint, or a pushes log from an earlier start. ``pushes_log``
    (push mode): its write-ahead log of totals absorbed is ``pushes_log.with_suffix(".absorbed")``.
    """

    def __init__(self, peer_id: str, topology: Topology, server: PeerServer, puller: PullClient,
                 pushes_log: Path | None, restarted: bool) -> None:
        self.peer_id = peer_id
        self.server = server
        self._puller = puller
        self._lock = threading.Lock()
        self.resumed_round = server.round if restarted else -1
        # The write-ahead log's lines for rounds >= the checkpoint's: what this peer mixed after its
        # checkpoint and lost with its state (restored after its first exchange, `pushsum.logged_totals`),
        # less the pushes their senders answer they kept (`_kept`: the OK never reached them).
        self._logged: list[tuple[str, int, int, float]] = []
        self._ckpt_absorbed: dict[str, float] = {}
        self._kept: set[Key] = set()
        if pushes_log is not None and server.mode == "push":
            server.ledger.log_path = pushes_log.with_suffix(".absorbed")
            self._logged = load_absorb_log(server.ledger.log_path, server.round)
            for j, _, _, total in self._logged:  # totals told in an OK: an honest sender may claim up to them
                server.ledger.raise_high(j, total)
            if restarted:
                server.ledger.held = frozenset(topology.possible_in_neighbours(peer_id))

    def restore_checkpoint(self, absorbed: Mapping[str, float], high: Mapping[str, float] | None = None) -> None:
        """The totals absorbed saved with the checkpoint being resumed: the server's ledger and the log's
        base; ``high``: the checkpoint's high-water marks (`ReceiverLedger.restore`)."""
        self._ckpt_absorbed = {str(k): float(v) for k, v in dict(absorbed).items()}
        self.server.restore_absorbed(self._ckpt_absorbed, high)

    def start(self, round: int, keys: Sequence[Key], deadline: float, pool: futures.ThreadPoolExecutor) -> None:
        """In the resumed round, ask each sender of ``keys`` for its push in parallel (answers land in
        the inbox, or close the key, while `PeerServer.take` waits)."""
        if round != self.resumed_round:
            return
        for key in keys:
            self.server.recovering(key, True)
            pool.submit(self.recover_one, key, deadline)

    def recover_one(self, key: Key, deadline: float) -> None:
        """After a restart, while waiting for the pushes of the resumed round: ask the sender (Pull,
        in push mode) whether it had given this peer that round's push, then lost with the
        uncheckpointed state. Given: recovered into the inbox. Given, but the payload no longer held
        (ALREADY_EXISTS: in the sender's durable log of OKs): closed; the write-ahead log restores its
        share. Kept by the sender (ABORTED: it moved past the round without an OK): closed, and a
        share this peer's write-ahead log holds for it is *not* restored -- its OK never reached the
        sender, which kept the share (issue 68: both counted it, sum mu = 4.5). Not decided yet
        (NOT_FOUND): the push itself will come.
        """
        try:
            msg, nbytes, why = self._puller.pull_one(key[0], key[1], key[2], deadline)
            if msg is not None:
                log.warning("%s: recovered the round %d step %d push of %s lost in the restart",
                            self.peer_id, key[1], key[2], key[0])
                self.server.deliver(key, msg, nbytes)
            elif why.startswith("ABORTED"):
                with self._lock:
                    self._kept.add(key)
                self.server.close(key)
            elif why.startswith("ALREADY_EXISTS"):
                self.server.close(key)
        finally:
            self.server.recovering(key, False)

    def finish_round(self, round: int, tag: str) -> None:
        """After ``round``'s pushes were decided: once the resumed round is over, claims settle again,
        and what recovery (rule 4) did not bring back is restored from the write-ahead log (once)."""
        if round >= self.resumed_round:
            self.server.ledger.held = frozenset()  # recovery is over: claims settle again
        if self._logged:  # the resumed round: what recovery (rule 4) did not bring back
            with self._lock:
                kept = set(self._kept)
            for j, total in logged_totals(self._ckpt_absorbed, self._logged, kept).items():
                got_back = self.server.raise_absorbed(j, total)
                if got_back:
                    log.warning("%s %s: %.6g of push-sum weight from %s, mixed before the restart, restored "
                                "from the write-ahead log", self.peer_id, tag, got_back, j)
                self.server.note_settled(j, got_back)
            self._logged = []


def load_absorb_log(path: Path, round: int) -> list[tuple[str, int, int, float]]:
    """The write-ahead log's lines (sender, round, step, total absorbed after it) at rounds >= ``round``,
    in order; the log keeps just those lines. A line torn by a kill or a full disk fails its CRC and is
    dropped (its OK was never sent: the OK leaves only after the whole line is fsync'd)."""
    lines: list[tuple[str, int, int, float]] = []
    keep: list[str] = []
    if path.exists():
        for line in path.read_text().splitlines():
            got = parse_absorb_line(line)
            if got is not None and got[1] >= round:
                lines.append(got)
                keep.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "".join(x + "\n" for x in keep))
    return lines
