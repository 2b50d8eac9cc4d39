"""The batched engine's training context: every peer a slice of one stacked ``[peers, numel]`` buffer.

It offers what ``TrainContext`` offers the algorithms (``train(block, phase)``, ``gradients``,
``layout``, ``batched``), so each algorithm's ``local_update`` runs unchanged on a stack of peers:
one forward/backward for all peers per step (``torch.func.vmap`` over ``functional_call`` with
``grad``; on a CPU a loop over the peers instead, see ``_per_peer``), then the shared update
rules of ``p2pfl.algorithms.rules`` on the stacked tensors.

Each peer draws its minibatches from its own generator through ``position_batches``, exactly the
draws of the exact engine. Peers whose data differ in size take different numbers of steps: a
batch shorter than the longest is padded (its padding has weight 0 in the loss), and a peer whose
epoch has ended is inactive for the remaining steps of the phase: it does not move, nor does its
momentum buffer. The vmapped path computes the active peers only (``COMPACT``): with a skewed
partition most steps of an epoch are the largest peers' alone (DePRL's Fashion-MNIST split at
pi 0.1: 29.8 steps per epoch on average, 142 for the largest peer, so four fifths of a padded
stack's arithmetic would be for peers that do not move).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_map

from p2pfl.algorithms.local_sgd import (
    GradTerm,
    Phase,
    block_names,
    can_represent,
    frozen_cache_pays,
    phase_plan,
    position_batches,
    use_frozen_cache,
)
from p2pfl.algorithms.rules import clip_grads, sam_perturbation, sgd_step_
from p2pfl.data.datasets import ArrayDataset
from p2pfl.data.loader import PeerData
from p2pfl.models.layout import ParamLayout

#: Most samples one vectorized evaluation forward holds (peers x rows), to bound memory.
EVAL_ROWS = 8192
#: ``vmap`` the peers (True) or loop over them (False); None: vmap on a GPU, loop on a CPU.
VECTORIZE: bool | None = None
#: On the vmapped path, run a step's forward/backward (and a body-feature or evaluation chunk) on the
#: peers that have rows in it only, their parameters gathered into a smaller stack (True), or on every
#: peer with zero-weight padding (False: the same arithmetic for the active peers, up to the kernels'
#: choice for another stack size). The loop path never computes an idle peer.
COMPACT: bool = True


def _h2d(t: Tensor, device: torch.device) -> Tensor:
    """A small host tensor onto ``device`` without waiting for the GPU: from pinned memory, queued
    behind the kernels already in flight (a copy from pageable memory would block the host until
    they finish, so the next step's Python could not overlap the current step's kernels)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _active(live: list[bool], device: torch.device) -> Tensor | None:
    """Which peers step (``[peers]`` bool), or None when all do: then the update takes the
    multi-tensor path (two calls for all parameters instead of a few ops each), same bits."""
    return None if all(live) else _h2d(torch.tensor(live), device)


def _live_rows(live: list[bool], device: torch.device) -> tuple[Tensor, list[int]] | None:
    """The indices of the live peers (on ``device``, and as a list), or None when every peer is live
    (nothing to drop) or compaction is off."""
    if not COMPACT or all(live):
        return None
    ids = [i for i, v in enumerate(live) if v]
    return _h2d(torch.tensor(ids, dtype=torch.int64), device), ids


def _select(tree: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The rows ``rows`` of every stacked tensor (a copy: a smaller stack for vmap)."""
    return {k: v.index_select(0, rows) for k, v in tree.items()}


def _spread(t: Tensor, rows: Tensor, peers: int) -> Tensor:
    """``t`` (one row per live peer) placed at ``rows`` of a ``[peers, ...]`` zero tensor."""
    return t.new_zeros((peers, *t.shape[1:])).index_copy_(0, rows, t)


def _weighted_ce(logits: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """Mean cross-entropy over the real (weight 1) samples of a padded batch."""
    return (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum().clamp(min=1.0)


class _Rows:
    """Where peer i's train (or test) position p lives in the tensors the engine gathers from.

    On CPU: the shared dataset itself (row = the peer's dataset index); on a GPU: one device copy
    of all peers' subsets, concatenated (row = offset_i + p), gathered by one ``index_select``.
    """

    def __init__(self, x: Tensor, y: Tensor, indices: list[np.ndarray], device: torch.device) -> None:
        idx = [torch.from_numpy(np.array(i, dtype=np.int64)) for i in indices]
        cat = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
        #: peer i's position p is entry offsets[i] + p of ``rows``
        self.offsets = torch.tensor(np.cumsum([0] + [len(i) for i in idx[:-1]]), dtype=torch.int64)
        if device.type == "cpu":
            self.x, self.y, self.rows = x, y, cat
        else:
            self.x = x.index_select(0, cat).to(device)
            self.y = y.index_select(0, cat).to(device)
            self.rows = torch.arange(len(cat), dtype=torch.int64)
        self.device = device

    def gather(self, positions: list[Tensor | None], width: int,
               peers: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``x [len(positions), width, ...]``, ``y [len(positions), width]`` and weights (1 real, 0
        padding); entry k holds the positions of peer ``peers[k]`` (default: peer k)."""
        rows = torch.zeros(len(positions), width, dtype=torch.int64)
        w = torch.zeros(len(positions), width)
        owner = list(range(len(positions))) if peers is None else peers
        live = [(k, p) for k, p in enumerate(positions) if p is not None and p.numel()]
        if live:  # a few ops for all peers, not a few per peer
            lens = torch.tensor([int(p.numel()) for _, p in live])
            slot = torch.tensor([k for k, _ in live]).repeat_interleave(lens)
            peer = torch.tensor([owner[k] for k, _ in live]).repeat_interleave(lens)
            pos = torch.cat([p for _, p in live]).cpu()
            col = torch.arange(len(pos)) - (torch.cumsum(lens, 0) - lens).repeat_interleave(lens)
            rows[slot, col] = self.rows[self.offsets[peer] + pos]
            w[slot, col] = 1.0
        flat = _h2d(rows.reshape(-1), self.device)
        x = self.x.index_select(0, flat).reshape(len(positions), width, *self.x.shape[1:])
        y = self.y.index_select(0, flat).reshape(len(positions), width)
        return x, y, _h2d(w, self.device)

    def gather_live(self, positions: list[Tensor | None], width: int,
                    compact: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``gather`` of the live peers only (those with positions) when ``compact`` and some peer is
        idle, with their indices (on the device) as the fourth item; else every peer's, and None."""
        sel = _live_rows([p is not None for p in positions], self.device) if compact else None
        if sel is None:
            return (*self.gather(positions, width), None)
        rows, ids = sel
        return (*self.gather([positions[i] for i in ids], width, ids), rows)


class BatchedContext:
    """Train and evaluate a stack of peers whose parameters are the rows of ``flat``."""

    batched: ClassVar[bool] = True

    def __init__(self, model: nn.Module, layout: ParamLayout, dataset: ArrayDataset, datas: list[PeerData],
                 generators: list[torch.Generator], flat: Tensor, device: torch.device) -> None:
        self.model = model.to(device)
        self.layout = layout
        self.datas = datas
        self.generators = generators
        self.flat = flat
        self.device = device
        self.num_peers = len(datas)
        self._train = _Rows(dataset.train_x, dataset.train_y, [d.train_indices for d in datas], device)
        self._test = _Rows(dataset.test_x, dataset.test_y, [d.test_indices for d in datas], device)

        def loss(trained: dict[str, Tensor], frozen: dict[str, Tensor], x: Tensor, y: Tensor, w: Tensor):
            out = _weighted_ce(functional_call(self.model, {**trained, **frozen}, (x,)), y, w)
            return out, out.detach()

        # one forward/backward for every peer: vmap over the peer dimension of all arguments
        self.vectorize = device.type != "cpu" if VECTORIZE is None else VECTORIZE
        self._grad = self._per_peer(grad(loss, has_aux=True))
        self.cache_frozen: bool | None = None  # as TrainContext.cache_frozen
        if can_represent(self.model):
            body, head = _Represent(self.model), self.model.head()  # type: ignore[operator]

            def represent(p: dict[str, Tensor], x: Tensor) -> Tensor:
                return functional_call(body, {"m." + k: v for k, v in p.items()}, (x,))

            def head_loss(p: dict[str, Tensor], f: Tensor, y: Tensor, w: Tensor):
                out = _weighted_ce(functional_call(head, p, (f,)), y, w)
                return out, out.detach()

            self._represent = self._per_peer(represent, trim=False)
            self._head_grad = self._per_peer(grad(head_loss, has_aux=True))

    # -- what algorithms call -------------------------------------------------------------------
    def train(self, block: str, phase: Phase, *, grad_term: GradTerm | None = None,
              project: Tensor | None = None) -> Tensor | None:
        """One phase for every peer at once; the mean loss per peer (``[peers]``), None if empty."""
        if phase.empty:
            return None
        names = block_names(self.layout, block)
        views = self.layout.views(self.flat)
        trained = {n: views[n] for n in names}
        frozen = {n: v for n, v in views.items() if n not in trained}
        masks = self.layout.views(project) if project is not None else None
        lr = _uniform(phase.lr)
        bufs: list[Tensor | None] = [None] * len(names)
        loss_sum = torch.zeros(self.num_peers, device=self.device)
        steps = torch.zeros(self.num_peers, device=self.device)
        model_mode(self.model, train=True)
        if block == "personal" and use_frozen_cache(self.cache_frozen) and can_represent(self.model) \
                and any(frozen_cache_pays(phase, d) for d in self.datas):
            source = self._head_steps(phase, names)
        else:
            source = self._data_steps(phase, frozen)
        for active, grad_at in source:
            grads, loss = grad_at(trained)
            g = [grads[n] for n in names]
            if phase.sam_rho > 0:  # the gradient again at w + rho g / ||g||, on the same minibatch
                e = sam_perturbation(g, phase.sam_rho, bdims=1)
                grads, _ = grad_at({n: trained[n] + en for n, en in zip(names, e, strict=True)})
                g = [grads[n] for n in names]
            if phase.grad_clip > 0:
                g = clip_grads(g, phase.grad_clip, bdims=1)
            if grad_term is not None:
                g = [gn.add(grad_term(n, trained[n])) for n, gn in zip(names, g, strict=True)]
            sgd_step_([trained[n] for n in names], g, bufs, lr=lr, momentum=phase.momentum,
                      weight_decay=phase.weight_decay, active=active)
            if masks is not None:
                for n, v in views.items():
                    v.mul_(masks[n])
            if active is None:
                loss_sum += loss
                steps += 1.0
            else:
                loss_sum += torch.where(active, loss, 0.0)
                steps += active.to(steps.dtype)
        return loss_sum / steps.clamp(min=1.0)

    def gradients(self, names: list[str]) -> dict[str, Tensor]:
        """Per peer, the loss gradient of the named parameters on one minibatch from its generator."""
        positions: list[Tensor | None] = [d.sample_positions(g) for d, g in zip(self.datas, self.generators,
                                                                               strict=True)]
        views = self.layout.views(self.flat)
        trained = {n: views[n] for n in names}
        frozen = {n: v for n, v in views.items() if n not in trained}
        x, y, w = self._train.gather(positions, max(int(p.numel()) for p in positions if p is not None))
        model_mode(self.model, train=True)
        grads, _ = self._grad(trained, frozen, x, y, w)
        return {n: grads[n] for n in names}

    # -- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> tuple[Tensor, Tensor]:
        """Per peer: (mean test loss, accuracy) on its own test split, as ``PeerApp.evaluate``."""
        model_mode(self.model, train=False)
        params = self.layout.views(self.flat)
        counts = [d.num_test for d in self.datas]
        loss_sum = torch.zeros(self.num_peers, dtype=torch.float64, device=self.device)
        correct = torch.zeros(self.num_peers, dtype=torch.float64, device=self.device)
        width = max(1, EVAL_ROWS // max(1, self.num_peers))
        if not self.vectorize:  # per peer, its own test batches (as PeerApp.evaluate)
            for i, d in enumerate(self.datas):
                own = {k: v[i] for k, v in params.items()}
                for x, y in d.test_batches():
                    out = functional_call(self.model, own, (x.to(self.device), ))
                    y = y.to(self.device)
                    loss_sum[i] += F.cross_entropy(out, y, reduction="sum").double()
                    correct[i] += (out.argmax(1) == y).sum().double()
            n = torch.tensor(counts, dtype=torch.float64, device=self.device).clamp(min=1.0)
            return loss_sum / n, correct / n

        def forward(p: dict[str, Tensor], x: Tensor) -> Tensor:
            return functional_call(self.model, p, (x,))

        batched_forward = vmap(forward)
        for start in range(0, max(counts, default=0), width):
            positions: list[Tensor | None] = [
                torch.arange(start, min(n, start + width)) if start < n else None for n in counts]
            x, y, w, rows = self._test.gather_live(positions, width, compact=True)
            if rows is None:
                logits = batched_forward(params, x)
            else:  # peers whose test split ended: not computed (zero weight either way)
                logits = batched_forward(_select(params, rows), x)
                logits, y, w = (_spread(t, rows, self.num_peers) for t in (logits, y, w))
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(w)
            loss_sum += (ce * w).sum(1).double()
            correct += ((logits.argmax(-1) == y).to(w.dtype) * w).sum(1).double()
        n = torch.tensor(counts, dtype=torch.float64, device=self.device).clamp(min=1.0)
        return loss_sum / n, correct / n

    # -- internals ------------------------------------------------------------------------------
    def _per_peer(self, fn: Any, trim: bool = True) -> Any:
        """``fn`` over the leading peer dimension of every argument: ``vmap`` on a GPU (one kernel
        per op for all peers); on a CPU a loop over the peers, stacked (measured: a vmapped small
        CNN runs its grouped convolutions and pooling several times slower than per-peer ones on
        a CPU, where arithmetic, not launches, is the limit)."""
        if self.vectorize:
            return vmap(fn)

        def looped(*args: Any) -> Any:
            # ``trim``: the last three arguments are a padded batch (inputs, labels, weights): each
            # peer computes on its real rows only, and a peer with none (its phase is over) on nothing
            n = tree_flatten(args)[0][0].shape[0]
            outs: list[Any] = []
            for i in range(n):
                own = tree_map(lambda t, i=i: t[i], args)
                if not trim:
                    outs.append(fn(*own))
                    continue
                rows = int(own[-1].sum())
                outs.append(fn(*own[:-3], *(t[:rows] for t in own[-3:])) if rows else None)
            done = next(o for o in outs if o is not None)
            outs = [tree_map(torch.zeros_like, done) if o is None else o for o in outs]
            return tree_map(lambda *xs: torch.stack(xs), *outs)

        return looped

    def _lockstep(self, phase: Phase) -> Iterator[list[Tensor | None]]:
        """Each step, every peer's next minibatch positions (None once its phase has ended)."""
        iters = [position_batches(d, g, **phase.work()) for d, g in zip(self.datas, self.generators, strict=True)]
        live = [True] * len(iters)
        while True:
            out: list[Tensor | None] = []
            for i, it in enumerate(iters):
                pos = next(it, None) if live[i] else None
                live[i] = pos is not None
                out.append(pos)
            if not any(live):
                return
            yield out

    def _data_steps(self, phase: Phase, frozen: dict[str, Tensor]) -> Iterator[tuple[Tensor | None, GradAt]]:
        """Per step: which peers step, and the vmapped gradient on their minibatches."""
        for positions in self._lockstep(phase):
            live = [p is not None for p in positions]
            active = _active(live, self.device)
            width = max(int(p.numel()) for p in positions if p is not None)
            x, y, w, rows = self._train.gather_live(positions, width, compact=self.vectorize)
            if rows is None:

                def grad_at(params: dict[str, Tensor], x: Tensor = x, y: Tensor = y, w: Tensor = w):
                    return self._grad(params, frozen, x, y, w)
            else:  # the live peers' minibatches and parameters only; idle rows get zero gradients
                fro = _select(frozen, rows)  # once per step (SAM takes a second gradient)

                def grad_at(params: dict[str, Tensor], x: Tensor = x, y: Tensor = y, w: Tensor = w,
                            rows: Tensor = rows, fro: dict[str, Tensor] = fro):
                    grads, loss = self._grad(_select(params, rows), fro, x, y, w)
                    n = self.num_peers
                    return {k: _spread(g, rows, n) for k, g in grads.items()}, _spread(loss, rows, n)

            yield active, grad_at

    def _head_steps(self, phase: Phase, names: list[str]) -> Iterator[tuple[Tensor | None, GradAt]]:
        """A head phase on cached body features: each peer's body runs once per distinct sample."""
        plans = [phase_plan(d, g, phase) for d, g in zip(self.datas, self.generators, strict=True)]
        feats, labels = self._features([needed for _, needed, _ in plans])
        prefix = self.model.HEAD + "."  # type: ignore[operator]
        local = {n: n[len(prefix):] for n in names}
        for k in range(max((len(rows) for _, _, rows in plans), default=0)):
            rows = [r[k] if k < len(r) else None for _, _, r in plans]
            active = _active([r is not None for r in rows], self.device)
            width = max(int(r.numel()) for r in rows if r is not None)
            idx = torch.zeros(self.num_peers, width, dtype=torch.int64)
            w = torch.zeros(self.num_peers, width)
            for i, r in enumerate(rows):
                if r is not None:
                    idx[i, : r.numel()] = r
                    w[i, : r.numel()] = 1.0
            idx, w = _h2d(idx, self.device), _h2d(w, self.device)
            f = torch.gather(feats, 1, idx.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
            y = torch.gather(labels, 1, idx)

            def grad_at(params: dict[str, Tensor], f: Tensor = f, y: Tensor = y, w: Tensor = w):
                return self._head_grad({local[n]: p for n, p in params.items()}, f, y, w)

            yield active, _renamed(grad_at, {v: k for k, v in local.items()})

    @torch.no_grad()
    def _features(self, needed: list[Tensor]) -> tuple[Tensor, Tensor]:
        """``[peers, max distinct, features]`` body outputs (and labels) of each peer's needed samples."""
        width = max((int(n.numel()) for n in needed), default=0)
        params = self.layout.views(self.flat)
        chunk = max(1, EVAL_ROWS // max(1, self.num_peers))
        feats, labels = [], []
        for start in range(0, width, chunk):
            positions: list[Tensor | None] = [n[start : start + chunk] if start < n.numel() else None for n in needed]
            x, y, _, rows = self._train.gather_live(positions, min(chunk, width - start), compact=self.vectorize)
            if rows is None:
                feats.append(self._represent(params, x))
            else:  # peers whose needed samples ended get zero rows, never read (their weight is 0)
                feats.append(_spread(self._represent(_select(params, rows), x), rows, self.num_peers))
                y = _spread(y, rows, self.num_peers)
            labels.append(y)
        return torch.cat(feats, dim=1), torch.cat(labels, dim=1)


GradAt = Any  # (trained params) -> (grads by name, loss per peer)


def _renamed(grad_at: Any, names: dict[str, str]) -> Any:
    """Wrap a head gradient function so its gradients carry the model's parameter names."""

    def wrapped(params: dict[str, Tensor]):
        grads, loss = grad_at(params)
        return {names[k]: v for k, v in grads.items()}, loss

    return wrapped


class _Represent(nn.Module):
    """``model.represent`` as a module's forward, for ``functional_call``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x: Tensor) -> Tensor:
        return self.m.represent(x)  # type: ignore[operator]


def _uniform(lr: Any) -> Any:
    """A per-peer learning rate that is the same for every peer becomes a float (the exact path's op)."""
    if isinstance(lr, Tensor):
        if lr.numel() and bool((lr == lr.reshape(-1)[0]).all()):
            return float(lr.reshape(-1)[0])
        return lr
    return float(lr)


def model_mode(model: nn.Module, *, train: bool) -> None:
    """``train()``/``eval()`` only when it changes (the zoo has no mode-dependent layer, but users may)."""
    if model.training != train:
        model.train(train)
