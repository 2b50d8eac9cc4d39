"""Evidence of the neighbours' progress: besides its own training, the only thing that moves a peer's round.

A peer that fell behind (it restarted, was stalled, started late) fast-forwards to where its
neighbours are (docs/protocol.md, "Catching up"). What it may believe about where they are is
*evidence*, never a claim: the round of a payload from an in-neighbour that passed validation
(authenticated sender, header round and step, manifest, checksum, finiteness) and was accepted --
a push taken into the inbox, a Pull answered with the payload. The round named in a request (a
Pull or a Push header, whatever its fate) or in a Status answer is a claim: it may say where to
*look* for evidence, but it moves nothing, and a refused message leaves no trace here at all.

Before this, the server recorded the round a caller claimed before checking it, and the catch-up
trusted that record: one authenticated neighbour sending a single Pull or Push for round 280 was
refused "more than 2 rounds ahead", yet made its target skip ~250 rounds, and the target's
neighbours followed (issue 68).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["RoundEvidence", "catch_up_target", "majority_round"]


class RoundEvidence:
    """Per in-neighbour, the highest round of a validated, accepted payload from it (thread-safe).

    Written by the server (a push accepted into the inbox) and by the client side (a pulled payload
    that passed validation); read by the node at the start of each round.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}

    def saw(self, peer: str, round: int) -> None:
        """A payload of ``peer`` for ``round`` passed validation and was accepted."""
        with self._lock:
            if round > self._seen.get(peer, -1):
                self._seen[peer] = int(round)

    def rounds(self, peers: Iterable[str]) -> dict[str, int]:
        """The proven rounds of those of ``peers`` a payload was seen from."""
        with self._lock:
            return {p: self._seen[p] for p in peers if p in self._seen}


def majority_round(proven: Mapping[str, int], in_neighbours: Sequence[str]) -> int:
    """The highest round that a strict majority of ``in_neighbours`` proved to have reached (-1: none).

    Why a majority and not one: a peer that is really behind is behind *all* its in-neighbours
    (they moved on without it), so the rule costs nothing then; while one in-neighbour alone --
    faulty, or a stolen certificate -- cannot make a peer whose other in-neighbours are in step
    skip rounds. On an in-degree-1 graph (a directed ring) the majority is that one in-neighbour.
    The round is the least advanced of the majority, so none of them is asked for a round it
    never reached.
    """
    if not in_neighbours:
        return -1
    need = len(in_neighbours) // 2 + 1
    ordered = sorted((proven.get(j, -1) for j in in_neighbours), reverse=True)
    return ordered[need - 1]


def catch_up_target(current: int, proven: Mapping[str, int], in_neighbours: Sequence[str], *,
                    push: bool, window: int, rounds: int) -> int | None:
    """The round to fast-forward to from ``current``, or None to stay.

    Push mode: an in-neighbour can finish round r only once this peer decided the fate of its
    round-r push (in this peer's round r) or its deadline passed (a fault), so proof of any later
    round means it gave the rounds in between up (and kept those shares): move to it. Pull mode:
    in-neighbours legitimately run ahead (they do not wait for this peer) and keep serving the last
    ``window`` rounds, so this peer moves only when they are further ahead than that -- its rounds
    are no longer served. Never to or past the run's end (a finished neighbour's last round).
    """
    target = majority_round(proven, in_neighbours)
    ahead = target - current
    if ahead > (0 if push else window) and target < rounds:
        return target
    return None
