"""The batched engine over torch.distributed ranks (issue 71), and its sparse mixing.

Each rank holds its peers' rows (`p2pfl.topology.placement.place`) and fetches, per gossip step, the rows
of the in-neighbours other ranks hold (`p2pfl.engine.halo`). Against one rank the sums run in
other orders (a smaller stack, the halo rows in other columns), so the runs agree within float
reassociation: `tests.test_batched._assert_agree` (final parameters and algorithm state within 1e-5
relative, scalars such as the push-sum weight 1e-6, per-round losses and consensus distances
1e-4, accuracies within 0.02, bytes counted equal). Records come in the same (round, peer) order.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from p2pfl.algorithms.combine import mix_rows, row_entries, sparse_weights
from p2pfl.config import load_config
from p2pfl.engine.batched import payload_size_keys
from p2pfl.payload import Payload
from p2pfl.simulation import SimulationError, simulate
from p2pfl.topology import generate
from p2pfl.wire.codec import wire_size
from tests.conftest import records_without_times, tiny_config
from tests.test_batched import DATA, PEERS, _algorithm, _assert_agree
from tests.test_distributed_sim import _run_torchrun, _torchrun

#: (algorithm, extra hyperparameters, ranks): pull mixing, push-sum, DisPFL's per-coordinate mean.
CASES = [("dfedavg", {}, 4), ("dfedpgp", {"mix_mode": "push"}, 2), ("dfedpgp", {"mix_mode": "push"}, 4),
         ("dispfl", {}, 2)]
IDS = [f"{n}{'-push' if e else ''}-{w}ranks" for n, e, w in CASES]


def _config(folder: Path, name: str, extra: dict, workers: int, rounds: int = 3, **more: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = tiny_config(folder, peers=PEERS, rounds=rounds, algorithm=_algorithm(name, extra), data=DATA,
                       simulation={"workers": workers, "engine": "batched"}, **more)
    if extra.get("mix_mode") == "push":  # one random out-neighbour per step: directed, irregular, mu varies
        generate("random_pull", PEERS, k=1).dump(folder / "topology.yaml")
    return path


def _read(run: Path) -> tuple[dict, list[dict]]:
    ckpts = {}
    for f in sorted((run / "checkpoints").glob("*.npz")):
        with np.load(f, allow_pickle=False) as z:
            ckpts[f.stem] = {k: z[k].copy() for k in z.files if k != "rng"}
    return ckpts, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _simulate(folder: Path, name: str, extra: dict, workers: int) -> tuple[dict, list[dict]]:
    summary = simulate(load_config(_config(folder, name, extra, workers)), folder / "run", progress=False)
    assert summary["workers"] == workers and summary["engine"] == "batched"
    return _read(folder / "run")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, extra, workers", CASES, ids=IDS)
def test_forked_ranks_agree_with_one_rank(tmp_path: Path, name: str, extra: dict, workers: int) -> None:
    one = _simulate(tmp_path / "one", name, extra, 1)
    many = _simulate(tmp_path / "many", name, extra, workers)
    push = extra.get("mix_mode") == "push"
    _assert_agree(*one, *many, push)
    # rank 0 writes every rank's records in (round, peer) order, as one rank does
    assert [(r["round"], r["peer"]) for r in one[1]] == [(r["round"], r["peer"]) for r in many[1]]
    if push:  # the push-sum weights crossed ranks: mass is conserved over all peers (sum of mu = peers)
        last = [r["mu"] for r in many[1] if r["round"] == 2]
        assert math.isclose(sum(last), PEERS, rel_tol=1e-9) and len({round(m, 6) for m in last}) > 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, extra", [("dfedavg", {}), ("dispfl", {})])
def test_ranks_whose_peers_are_not_contiguous_agree_with_one_rank(tmp_path: Path, name: str, extra: dict) -> None:
    """A random 3-regular graph of 8 peers, placed by the graph on 2 ranks: rank 0 holds p0, p2, p3, p7
    (not a block of indices), so its stack's row k is not peer k and its halo comes from both sides."""
    from p2pfl.topology.placement import place

    topo = generate("random_regular", 8, k=3, seed=1)
    assert place(topo, 2) == [0, 1, 0, 0, 1, 1, 1, 0]
    runs = []
    for workers in (1, 2):
        folder = tmp_path / f"w{workers}"
        folder.mkdir()
        path = tiny_config(folder, peers=8, rounds=3, algorithm=_algorithm(name, extra), data=DATA,
                           simulation={"workers": workers, "engine": "batched"})
        topo.dump(folder / "topology.yaml")
        assert simulate(load_config(path), folder / "run", progress=False)["workers"] == workers
        runs.append(_read(folder / "run"))
    _assert_agree(*runs[0], *runs[1], False, peers=8)
    assert [(r["round"], r["peer"]) for r in runs[0][1]] == [(r["round"], r["peer"]) for r in runs[1][1]]


@pytest.mark.timeout(120)
def test_a_resume_on_two_ranks_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Stopped after round 2 of 3 (a finished 2-round run extended), resumed on 2 ranks: rank 0 puts
    the checkpoints back, every rank restores its peers' rows and generators: the run that never stopped."""
    name, extra = "dfedpgp", {"mix_mode": "push"}
    full = _config(tmp_path / "full", name, extra, 2, checkpoint={"every": 1})
    simulate(load_config(full), tmp_path / "full" / "run", progress=False)
    cut = _config(tmp_path / "cut", name, extra, 2, checkpoint={"every": 1})
    simulate(load_config(cut, ["rounds=2"]), tmp_path / "cut" / "run", progress=False)
    summary = simulate(load_config(cut), tmp_path / "cut" / "run", progress=False, resume=True)
    assert summary["resumed_from_round"] == 2
    assert records_without_times(tmp_path / "cut" / "run") == records_without_times(tmp_path / "full" / "run")
    a, _ = _read(tmp_path / "full" / "run")
    b, _ = _read(tmp_path / "cut" / "run")
    assert sorted(a) == sorted(b) == [f"p{i}" for i in range(PEERS)]
    for pid in a:
        for key in a[pid]:
            assert np.array_equal(a[pid][key], b[pid][key]), (pid, key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["train", "build"])
def test_a_rank_that_fails_ends_every_rank_with_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         where: str) -> None:
    """Rank 1 fails in round 1's training (the others wait in the step's halo exchange) or while it
    builds its peers (the others at the first records step): every rank ends, rank 0 raises rank 1's error."""
    from p2pfl.engine import batched

    if where == "train":
        real = batched.BatchedSimulation.run_round

        def run_round(self: Any, r: int) -> Any:  # the forked ranks inherit this
            if r == 1 and self.halo.ranks.rank == 1:
                raise ValueError("rank 1 cannot train")
            return real(self, r)

        monkeypatch.setattr(batched.BatchedSimulation, "run_round", run_round)
    else:
        real_restore = batched.BatchedSimulation.__init__

        def init(self: Any, *args: Any, **kw: Any) -> None:
            real_restore(self, *args, **kw)
            if self.halo.ranks.rank == 1:
                raise ValueError("rank 1 cannot train")

        monkeypatch.setattr(batched.BatchedSimulation, "__init__", init)
    with pytest.raises(SimulationError, match="(?s)rank 1 failed.*rank 1 cannot train"):
        simulate(load_config(_config(tmp_path, "dfedavg", {}, 2)), tmp_path / "run", progress=False)
    if where == "train":  # round 0 finished on every rank and was recorded; round 1 never was
        recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert {r["round"] for r in recs} == {0} and len(recs) == PEERS


@pytest.mark.timeout(240)
def test_torchrun_batched_ranks_agree_with_the_plain_run(tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m p2pfl.cli simulate`` with the batched engine.

    Rank 1 ends as a forked rank does, without the interpreter's teardown (where torch's gloo backend
    sometimes aborted a finished launch, `p2pfl.procgroup.end_launched_rank`): an exit handler that
    every rank registers at start-up (a ``sitecustomize`` first on the path) runs on rank 0 alone."""
    path = _config(tmp_path, "dfedpgp", {"mix_mode": "push"}, 1)
    one = _simulate(tmp_path / "one", "dfedpgp", {"mix_mode": "push"}, 1)
    site, marks = tmp_path / "site", tmp_path / "exited"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, os, pathlib\n"
        "atexit.register(lambda: (pathlib.Path(os.environ['P2PFL_TEST_EXITED']) / os.environ.get('RANK', 'none'))"
        ".write_text('teardown'))\n")
    res = _run_torchrun([*_torchrun(), "--standalone", "--nproc-per-node=2", "-m", "p2pfl.cli", "simulate",
                         "-c", str(path), "--out", str(tmp_path / "tr"), "-q"], timeout=200,
                        path=[site], env={"P2PFL_TEST_EXITED": str(marks)})
    assert res.returncode == 0, res.stdout[-4000:]
    assert sorted(p.name for p in marks.iterdir()) == ["0", "none"]  # rank 1 skipped the teardown; rank 0 and torchrun did not
    assert json.loads((tmp_path / "tr" / "summary.json").read_text())["workers"] == 2
    _assert_agree(*one, *_read(tmp_path / "tr"), True)


# -- the pieces ------------------------------------------------------------------------------------
def test_sparse_mixing_equals_the_dense_product() -> None:
    """Rows normalized and mixed by the sparse matrix as by the dense one; a rectangular matrix
    (a rank's rows over own + halo columns) keeps each row's own payload in column i."""
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(3, 5, generator=g, dtype=torch.float64) * (torch.rand(3, 5, generator=g) > 0.4)
    dense[range(3), range(3)] = 0.5
    x = torch.randn(5, 7, generator=g)
    idx = dense.nonzero().T
    w = sparse_weights(idx[0], idx[1], dense[idx[0], idx[1]], (3, 5))
    ref = (dense / dense.sum(1, keepdim=True)).float() @ x
    assert torch.allclose(mix_rows(w, x), ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(mix_rows(w, x, renormalize=False), dense.float() @ x, rtol=1e-6, atol=1e-6)
    entries = row_entries(w)
    assert [cols for cols, _ in entries] == [dense[i].nonzero().flatten().tolist() for i in range(3)]


def test_wire_sizes_once_per_header_shape_equal_every_peers_own() -> None:
    """One probe per `payload_size_keys` key gives each peer's `wire_size`: ids of other lengths and
    scalars that are 0.0 (left out of the header) or -0.0 are told apart."""
    from p2pfl.models.layout import TensorSpec

    specs = (TensorSpec("w", (4,), 0, 4),)
    ids = ["p1", "p22", "p3", "p4", "p5", "p6"]
    mu = torch.tensor([1.5, 0.25, 0.0, -0.0, 3.0, 0.0], dtype=torch.float64)
    keys = payload_size_keys([len(p) for p in ids], {"mu": mu})
    flat = torch.zeros(4)
    own = [wire_size(Payload(p, 7, 0, "h", specs, flat, {"mu": float(mu[k])})) for k, p in enumerate(ids)]
    probes: dict[tuple, int] = {}
    for k, key in enumerate(keys):
        probes.setdefault(key, own[k])
        assert probes[key] == own[k]
    assert len(probes) == 4  # (2, nonzero), (3, nonzero), (2, +0.0), (2, -0.0)


@pytest.mark.parametrize(("kind", "mode", "k"), [("ring", "pull", None), ("random_regular", "pull", 3),
                                                 ("directed_ring", "push", None), ("random_pull", "pull", 3),
                                                 ("random_pull", "push", 3), ("erdos_renyi", "pull", None)])
def test_step_entries_read_off_the_matrix_are_what_the_plans_say(kind: str, mode: str, k: int | None) -> None:
    """The engine reads a step's entries off the sparse mixing matrix with numpy (`entries_from_matrix`);
    they are, array for array, what the peers' MixingPlans say (`entries_from_plans`), for every row
    subset a rank may hold (all, a non-contiguous one, one row), static and scheduled graphs, both modes."""
    from p2pfl.engine.mixing import entries_from_matrix, entries_from_plans

    topo = generate(kind, 12, **({"k": k} if k else {}), **({"p": 0.4} if kind == "erdos_renyi" else {}), seed=2)
    ids = list(topo.ids)
    index = {p: i for i, p in enumerate(ids)}
    for r, step in ((0, 0), (3, 1), (7, 0)):
        w = topo.sparse_matrix(r, step, seed=5, mode=mode)
        for rows in (list(range(12)), [9, 0, 4, 11], [6]):
            plans = [topo.plan(ids[g], r, step, seed=5, mode=mode) for g in rows]
            assert entries_from_matrix(w, rows) == entries_from_plans(plans, index), (rows, r, step)
    # a matrix with a zero diagonal entry: the self entry is still there, weight 0 (as plan.self_weight)
    from p2pfl.topology.mixing import SparseMixing

    w = SparseMixing.from_dense(np.array([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.25, 0.75]]))
    e = entries_from_matrix(w, [0, 2])
    assert e.rows.tolist() == [0, 0, 1, 1] and e.senders.tolist() == [0, 1, 2, 1]
    assert e.values.tolist() == [0.0, 1.0, 0.75, 0.25] and e.own.tolist() == [True, False, True, False]
    assert e.out_degree.tolist() == [1, 0]  # column 0: row 1 reads p0; column 2: nobody else
    assert e.readers(np.array([True, False, True])) == [1]
