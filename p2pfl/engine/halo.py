"""The batched engine over ranks: the rows of other ranks' peers a rank mixes at a gossip step (its halo).

Each rank holds the stacked rows of its own peers (`p2pfl.topology.placement.place`). At a gossip step
its peers read their in-neighbours' payloads; those held by other ranks are fetched here, and
only those, with the group's tensor collectives (``all_to_all_single``; no pickling, no object
collectives): a rank tells each other rank which of its rows it needs (an index list), then every
rank sends the rows asked of it together with a few float64 numbers per row (the step's scalars,
e.g. the push-sum weight, and whether the payload is finite). Any placement works: ranks are
told apart by the rank of each peer, never by block bounds.

The first collective of a step (the counts) also carries a failure flag: a rank whose peers failed
before or during the step sends it (`Halo.fail`), and every rank then raises `RankFailed` at the
same point, so all of them leave the round together and the error reaches rank 0 at its end.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from p2pfl.procgroup import Ranks, RanksError


class RankFailed(RuntimeError):
    """A rank reported a failure at a halo exchange: every rank leaves the round (rank 0 reports why)."""


class Halo:
    """One rank's side of the halo exchanges: ``owner[g]`` is the rank of peer ``g``; ``local`` the
    peers of this rank, in the order of its rows."""

    def __init__(self, ranks: Ranks, owner: Sequence[int], local: Sequence[int]) -> None:
        self.ranks = ranks
        self.owner = list(owner)
        self.row = {g: k for k, g in enumerate(local)}
        self.heads = 0  # count exchanges taken (the round's driver knows from it whether it owes one)

    def exchange(self, need: Iterable[int], rows: torch.Tensor, meta: torch.Tensor
                 ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The rows (and ``meta``, float64 ``[rows, k]``) of the peers ``need`` (held by other ranks):
        returns their order (by rank, then index) and the rows and meta in that order. Called by every
        rank at every gossip step, ``rows``/``meta`` being this rank's own ``[local, ...]``."""
        order = sorted(need, key=lambda g: (self.owner[g], g))
        counts = [0] * self.ranks.world
        for g in order:
            counts[self.owner[g]] += 1
        served = self._head(counts, failed=False)
        if self.ranks.world == 1:
            if order:
                raise ValueError(f"peers {order[:5]} are needed but no other rank holds them")
            return [], rows[:0], meta[:0]
        asked = self._all_to_all(torch.tensor(order, dtype=torch.int64), counts, served)
        rows_at = torch.tensor([self.row[g] for g in asked.tolist()], dtype=torch.int64, device=rows.device)
        halo = self._all_to_all(rows.index_select(0, rows_at), served, counts).to(rows.device)
        halo_meta = self._all_to_all(meta.index_select(0, rows_at.to(meta.device)), served, counts).to(meta.device)
        return order, halo, halo_meta

    def fail(self) -> None:
        """This rank's part in the step's count exchange after its peers failed: every rank raises `RankFailed`."""
        self._head([0] * self.ranks.world, failed=True)

    def _head(self, counts: list[int], failed: bool) -> list[int]:
        """Send each rank how many rows this one needs of it, and the failure flag; get what each asks of this one."""
        self.heads += 1
        if self.ranks.world == 1:
            return [0]
        send = torch.tensor([[c, int(failed)] for c in counts], dtype=torch.int64)
        got = self._all_to_all(send, [1] * self.ranks.world, [1] * self.ranks.world)
        if bool(got[:, 1].any()):
            raise RankFailed("a peer of another rank failed (rank 0 reports which)")
        return [int(c) for c in got[:, 0].tolist()]

    def _all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """``all_to_all_single`` along the first dimension, on the group's device; the result there too."""
        import torch.distributed as dist

        device = self.ranks.device
        recv = torch.empty(sum(recv_splits), *send.shape[1:], dtype=send.dtype, device=device)
        try:
            dist.all_to_all_single(recv, send.to(device).contiguous(), output_split_sizes=recv_splits,
                                   input_split_sizes=send_splits)
        except RuntimeError as exc:
            raise RanksError(f"rank {self.ranks.rank}: halo exchange with the other ranks failed: {exc}") from exc
        return recv
