"""Which neighbours answer: Status probes, neighbours marked down, refusals, and who said it finished.

Why: a neighbour that died must not cost every later round a full deadline, so a call that finds it
silent marks it down and later rounds only probe it (``probe_s``) before calling. A neighbour that
*refuses* this peer is a different fact from one that is down (`p2pfl.transport.refusals`). And in
push mode a finished peer serves on until its neighbours know it finished (`serve_on_for_ledger`),
which it learns from the same Status answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from p2pfl.proto import peer_pb2
from p2pfl.topology import Topology
from p2pfl.transport.channels import Channels
from p2pfl.transport.grpc_service import PeerServer
from p2pfl.transport.limits import bounded
from p2pfl.transport.refusals import RefusalTracker
from p2pfl.transport.rpc import TRANSPORT_LOG

__all__ = ["Liveness"]

log = TRANSPORT_LOG

#: Push-sum: how long a finished peer keeps serving for a neighbour that is down (its ledger).
_LINGER_DOWN_S = 60.0


class Liveness:
    """This peer's view of its neighbours: down or up, why a probe failed, refusing or not, finished or not.

    ``final_round`` reads the transport's `Transport.final_round` (set by the node after construction).
    """

    def __init__(self, peer_id: str, channels: Channels, probe_s: float,
                 final_round: Callable[[], int | None]) -> None:
        self.peer_id = peer_id
        self.probe_s = probe_s
        self._channels = channels
        self._final_round = final_round
        self._lock = threading.Lock()
        self._down: set[str] = set()  # neighbours noticed down: probed briefly, not waited for
        self._probe_why: dict[str, str] = {}  # neighbour -> why its last liveness probe failed
        self.refusals = RefusalTracker(peer_id)  # "refuses this peer" apart from "does not answer"
        # neighbours whose Status said they finished the run: every such answer, whichever call got
        # it, since the neighbour counts each as having told this peer (`PeerServer.told_finished`)
        self._finished: set[str] = set()

    def status(self, peer: str, timeout_s: float = 5.0, wait_for_ready: bool = True) -> peer_pb2.StatusReply:
        """Ask ``peer`` for its Status, naming this peer (raises grpc.RpcError when unreachable); an
        answer that says it finished the run is remembered (`serve_on_for_ledger`)."""
        reply = self._channels.get(peer).status(peer_pb2.StatusRequest(requester=self.peer_id), timeout=timeout_s,
                                                wait_for_ready=wait_for_ready)
        final = self._final_round()
        if final is not None and reply.round > final:
            with self._lock:
                self._finished.add(peer)
        return reply

    def mark_down(self, peer: str, why: str) -> None:
        with self._lock:
            if peer in self._down:
                return
            self._down.add(peer)
        log.warning("%s: neighbour %s is down (%s); later rounds probe it for %.1fs instead of waiting",
                    self.peer_id, peer, why[:200], self.probe_s)

    def mark_up(self, peer: str) -> None:
        with self._lock:
            if peer not in self._down:
                return
            self._down.discard(peer)
        log.warning("%s: neighbour %s answers again", self.peer_id, peer)

    def is_down(self, peer: str) -> bool:
        with self._lock:
            return peer in self._down

    def alive(self, peer: str) -> bool:
        """True unless ``peer`` is marked down and a short Status probe still gets no answer."""
        if not self.is_down(peer):
            return True
        try:
            self.status(peer, self.probe_s, wait_for_ready=False)
        except grpc.RpcError as e:  # without wait_for_ready it says why (a TLS handshake, a refused connection)
            self._probe_why[peer] = f"{e.code().name}: {bounded(e.details() or '', 300)}"
            return False
        self.mark_up(peer)
        return True

    def unanswered_probe(self, peer: str) -> str:
        """Why ``peer``'s last probe failed, as a call's reason (for the refusal tracker)."""
        return self._probe_why.get(peer, "UNAVAILABLE: no answer to a probe")

    def failed(self, peer: str, why: str) -> None:
        """A call to ``peer`` failed; a dead or silent neighbour (not a refusal) is marked down."""
        if why.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")) or why.startswith("deadline"):
            self.mark_down(peer, why)

    def serve_on_for_ledger(self, server: PeerServer, topology: Topology, final_round: int, deadline_s: float) -> None:
        """Push-sum: a finished peer serves on (at most ``_LINGER_DOWN_S``) until

        * every in-neighbour reports (Status) that it finished too: before that, one killed after this
          peer mixed its last push and before it heard the OK replays that push after its restart,
          and only this peer's answer (the push is refused "round over" with its total absorbed)
          tells it the share is given, not kept (CI of 7382d4c: a receiver that had finished and
          restarted left at once, the sender kept the share it had also given: sum mu = 4.5);
        * every out-neighbour has asked this peer's Status since it finished (it then knows, and may
          leave: without this, two finished neighbours could each wait for the other to be seen
          finished after it had already gone; a fault-free out-neighbour never leaves before it
          asked, and one that is down asks when it is back);
        * no neighbour this peer found down stays down, and one deadline has passed since the last
          came back, so a neighbour restarted after this peer finished can still recover its lost
          push here (rule 4) or settle with it (docs/protocol.md, "Push-sum mass", rule 6).
        """
        rounds = final_round + 1
        server.finish(rounds)
        ins = sorted(topology.possible_in_neighbours(self.peer_id) - {self.peer_id})
        outs = sorted(topology.possible_out_neighbours(self.peer_id) - {self.peer_id})
        nbrs = sorted(set(ins) | set(outs))
        start = time.monotonic()
        bound = start + max(deadline_s, _LINGER_DOWN_S)
        last_down: float | None = None
        said = False
        while (now := time.monotonic()) < bound:
            for p in nbrs:  # one Status call each: it also tells a finished one this peer knows
                try:
                    self.status(p, self.probe_s, wait_for_ready=False)
                except grpc.RpcError:
                    continue
                if self.is_down(p):
                    self.mark_up(p)
            with self._lock:
                finished = set(self._finished)
            if any(self.is_down(p) for p in nbrs):
                last_down = now
            waiting = [p for p in ins if p not in finished]
            # an out-neighbour down now comes back asking (a fault-free one never leaves without)
            waiting += [p for p in outs if not server.told_finished(p)]
            if not waiting and (last_down is None or now - last_down >= deadline_s):
                return
            if not said and now - start >= 2 * self.probe_s:
                log.warning("%s: finished; serving on for its ledger while %s %s", self.peer_id,
                            ",".join(sorted(set(waiting)) or [p for p in nbrs if self.is_down(p)]),
                            "not finished" if waiting else "down")
                said = True
            time.sleep(max(0.02, min(0.1, bound - time.monotonic())))
        log.warning("%s: stopping with %s not finished or down", self.peer_id,
                    ",".join(p for p in nbrs if (p in ins and p not in self._finished) or self.is_down(p)))
