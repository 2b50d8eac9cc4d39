"""The batched engine (``simulation.engine: batched``) against the exact engine, for every algorithm.

Both run the same config through ``simulate``; the batched one steps all peers as one stack of
tensors with the same update rules, so the final parameters must agree up to float reassociation
(1e-5 relative per peer), and so must every per-round accuracy (within 0.02), the metric keys,
the checkpoints' algorithm state (duals, masks, push-sum weights) and the bytes counted.
The peers hold different amounts of data, so peers whose epoch has ended must stand still while
the others finish theirs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from p2pfl.algorithms import ALGORITHMS, algorithm_class
from p2pfl.algorithms.base import TrainContext
from p2pfl.algorithms.local_sgd import Phase
from p2pfl.config import ConfigError, load_config
from p2pfl.engine import context
from p2pfl.engine.batched import BatchedSimulation
from p2pfl.experiment import Experiment
from p2pfl.simulation import simulate
from p2pfl.topology import generate
from tests.conftest import records_without_times, tiny_config

CASES = [(name, {}) for name in sorted(ALGORITHMS) if algorithm_class(name).batched] + [
    ("dfedpgp", {"mix_mode": "push"}), ("dfedadmm", {"grad_clip": 0.05}),  # a clip that binds: per-peer norms
    # DePRL's authors' optimizer (clip and momentum in both phases; D-PSGD alike): the same rule per peer
    ("deprl", {"grad_clip": 0.05, "momentum": 0.9}), ("dpsgd", {"grad_clip": 0.05, "momentum": 0.9})]
IDS = [n + ("-push" if e.get("mix_mode") == "push" else "") + ("-clip" if e.get("grad_clip") else "") for n, e in CASES]
LIGHT = {"local_epochs": 1, "body_local": 1}
DATA = {"dataset": "synthetic", "partition": {"kind": "dirichlet_per_class", "pi": 0.5}, "batch_size": 16,
        "params": {"num_classes": 4, "train_size": 400, "test_size": 200, "shape": [1, 8, 8], "seed": 1}}
PEERS = 5


def _algorithm(name: str, extra: dict) -> dict:
    defaults = algorithm_class(name).defaults
    return {"name": name, **{k: v for k, v in LIGHT.items() if k in defaults}, **extra}


def _config(tmp_path: Path, algorithm: dict, engine: str, *, push: bool = False, device: str = "cpu",
            rounds: int = 3, **extra: Any) -> Path:
    path = tiny_config(tmp_path, peers=PEERS, rounds=rounds, algorithm=algorithm, data=DATA,
                       simulation={"workers": 1, "engine": engine}, device=device, **extra)
    if push:  # each peer pushes to one random peer: column-stochastic and irregular, so mu varies
        generate("random_pull", PEERS, k=1).dump(tmp_path / "topology.yaml")
    return path


def _run(tmp_path: Path, algorithm: dict, engine: str, push: bool, device: str = "cpu") -> tuple[dict, list[dict]]:
    folder = tmp_path / engine
    folder.mkdir()
    simulate(load_config(_config(folder, algorithm, engine, push=push, device=device)), folder / "run",
             progress=False)
    ckpts = {}
    for f in sorted((folder / "run" / "checkpoints").glob("*.npz")):
        with np.load(f, allow_pickle=False) as z:
            ckpts[f.stem] = {k: z[k].copy() for k in z.files if k != "rng"}
    recs = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    return ckpts, recs


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(a.astype(np.float64)), 1e-30))


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, dict], tuple[dict, list[dict]]]:
    """The exact engine's run of a case, computed once for both batched variants."""
    done: dict[str, tuple[dict, list[dict]]] = {}

    def get(name: str, extra: dict) -> tuple[dict, list[dict]]:
        key = f"{name}-{sorted(extra.items())}"
        if key not in done:
            tmp = tmp_path_factory.mktemp(name)
            done[key] = _run(tmp, _algorithm(name, extra), "exact", extra.get("mix_mode") == "push")
        return done[key]

    return get


#: The batched engine vmaps the peers on a GPU and loops over them on a CPU: both are checked here
#: (``vmap`` on this CPU stands in for the GPU path) for every algorithm.
@pytest.mark.timeout(180)
@pytest.mark.parametrize("vectorize", [True, False], ids=["vmap", "loop"])
@pytest.mark.parametrize("name, extra", CASES, ids=IDS)
def test_batched_equals_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exact_runs: Any, name: str,
                              extra: dict, vectorize: bool) -> None:
    monkeypatch.setattr(context, "VECTORIZE", vectorize)
    push = extra.get("mix_mode") == "push"
    _assert_agree(*exact_runs(name, extra), *_run(tmp_path, _algorithm(name, extra), "batched", push), push)


#: On a GPU the batched engine runs as in a deployment's simulation: vmapped, its data gathered on
#: the device. It must agree with the exact engine on the CPU as the CPU variants do (the MLP's
#: float32 matrix products take no TF32 shortcut by default).
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, extra", CASES, ids=IDS)
def test_batched_on_cuda_equals_exact_on_cpu(tmp_path: Path, exact_runs: Any, name: str, extra: dict) -> None:
    push = extra.get("mix_mode") == "push"
    _assert_agree(*exact_runs(name, extra), *_run(tmp_path, _algorithm(name, extra), "batched", push, "cuda"), push)


def _assert_agree(exact: dict, exact_recs: list[dict], batched: dict, batched_recs: list[dict], push: bool,
                  peers: int = PEERS) -> None:
    """Final checkpoints within 1e-5 relative, and every round's records alike (see the module doc)."""
    assert sorted(exact) == sorted(batched) == sorted(f"p{i}" for i in range(peers))
    for pid in exact:
        e, b = exact[pid], batched[pid]
        assert sorted(e) == sorted(b)  # same checkpoint entries: params, duals / masks, meta
        assert _rel(e["params"], b["params"]) <= 1e-5, pid
        for key in e:
            if key.startswith("extra/"):
                assert _rel(e[key], b[key]) <= 1e-5 or np.array_equal(e[key], b[key]), (pid, key)
        me, mb = (json.loads(bytes(x["meta"]).decode()) for x in (e, b))
        assert me["round"] == mb["round"] == 3
        assert set(me["scalars"]) == set(mb["scalars"])
        for k, v in me["scalars"].items():
            assert mb["scalars"][k] == pytest.approx(v, rel=1e-6)

    assert len(exact_recs) == len(batched_recs) == 3 * peers
    by_key = {(r["round"], r["peer"]): r for r in batched_recs}
    for r in exact_recs:
        b = by_key[(r["round"], r["peer"])]
        assert set(r) == set(b)  # the same metrics, key for key
        assert abs(r["acc"] - b["acc"]) <= 0.02
        assert r["bytes_sent"] == b["bytes_sent"] and r["bytes_recv"] == b["bytes_recv"]
        assert r["missing"] == b["missing"] == []
        assert b["train_loss"] == pytest.approx(r["train_loss"], rel=1e-4, abs=1e-6)
        assert b["consensus_dist"] == pytest.approx(r["consensus_dist"], rel=1e-4, abs=1e-6)
    if push:  # push-sum really ran: the weights moved away from 1 and agree
        mus = {round(r["mu"], 6) for r in batched_recs}
        assert len(mus) > 2


def test_peers_with_less_data_stop_when_their_epoch_ends(tmp_path: Path) -> None:
    """Two local epochs with momentum: every peer ends exactly where it would alone, though the
    peers take different numbers of steps (the stack runs until the longest epoch is over)."""
    cfg = load_config(_config(tmp_path, {"name": "local", "momentum": 0.9, "local_epochs": 2}, "batched"))
    exp = Experiment.from_config(cfg)
    sim = BatchedSimulation(exp, None, lambda rec: None)
    steps = [d.steps_per_epoch() for d in sim.ctx.datas]
    assert len(set(steps)) > 1  # the partition is uneven: the masking is exercised
    before = sim.state.params.clone()
    loss = sim.ctx.train("all", Phase(lr=0.1, amount=2, momentum=0.9, weight_decay=5e-4))
    assert loss is not None and loss.shape == (PEERS,)

    # the exact engine, peer by peer, on the same initial state and generators
    for i, pid in enumerate(exp.topology.ids):
        node = exp.make_node(pid, transport=None, models=None, record=lambda rec: None,  # type: ignore[arg-type]
                             run_dir=None)
        model = exp.build_model()
        exp.layout.bind(model, node.state.params)
        ctx = TrainContext(model, exp.layout, exp.peer_data(pid), node.generator, torch.device("cpu"))
        ref_loss = ctx.train("all", Phase(lr=0.1, amount=2, momentum=0.9, weight_decay=5e-4))
        assert torch.equal(before[i], exp._init[1])  # noqa: SLF001 - all peers start from one model
        moved = sim.state.params[i]
        rel = float(torch.linalg.vector_norm(moved - node.state.params) / torch.linalg.vector_norm(node.state.params))
        assert rel <= 1e-5, (pid, rel)
        assert float(loss[i]) == pytest.approx(ref_loss, rel=1e-4)
        assert torch.equal(node.generator.get_state(), sim.generators[i].get_state())  # same draws


@pytest.mark.parametrize("block", ["all", "personal"])
def test_the_vmapped_path_computes_only_the_peers_still_in_their_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       block: str) -> None:
    """On the vmapped (GPU) path a step's forward/backward, a body-feature chunk and an evaluation
    chunk run on the live peers only (``context.COMPACT``): the same parameters, losses and
    accuracies as the padded stack, with fewer peer-rows computed once the smaller peers' epochs end
    (a head phase of two epochs trains on cached body features: its feature chunks are compacted)."""
    monkeypatch.setattr(context, "VECTORIZE", True)
    monkeypatch.setattr(context, "EVAL_ROWS", 16 * PEERS)  # chunks of 16 rows: the smaller peers' end early
    phase = Phase(lr=0.1, amount=2, momentum=0.9, weight_decay=5e-4)
    results = {}
    for compact in (False, True):
        monkeypatch.setattr(context, "COMPACT", compact)
        folder = tmp_path / str(compact)
        folder.mkdir()
        # seed 1: the largest peers are the last ones, so the live peers of a late step are not a prefix
        exp = Experiment.from_config(load_config(tiny_config(
            folder, peers=PEERS, algorithm={"name": "local"}, data=DATA, seed=1,
            simulation={"workers": 1, "engine": "batched"})))
        sim = BatchedSimulation(exp, None, lambda rec: None)
        steps = [d.steps_per_epoch() for d in sim.ctx.datas]
        assert steps[0] < max(steps)  # uneven, and peer 0 idles before the last step
        rows: list[int] = []
        for name in ("_grad", "_head_grad", "_represent"):
            if hasattr(sim.ctx, name):
                inner = getattr(sim.ctx, name)

                def counted(*args: Any, inner: Any = inner, rows: list[int] = rows) -> Any:
                    rows.append(int(args[-1].shape[0]))  # the peer dimension of the batch
                    return inner(*args)

                setattr(sim.ctx, name, counted)
        start = sim.state.params.clone()
        loss = sim.ctx.train(block, phase)
        results[compact] = (start, sim.state.params.clone(), loss, sim.ctx.evaluate(), rows)
    (s0, p0, l0, e0, rows0), (s1, p1, l1, e1, rows1) = results[False], results[True]
    assert torch.equal(s0, s1) and not torch.equal(p1, s1)  # same start; the phase moved the peers
    assert torch.allclose(p0, p1, rtol=1e-6, atol=1e-7)
    assert torch.allclose(l0, l1, rtol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(e0, e1, strict=True))
    assert set(rows0) == {PEERS}  # padded: every peer, every step
    assert min(rows1) < PEERS and sum(rows1) < sum(rows0)  # compacted: the live peers only


@pytest.mark.timeout(180)
def test_the_model_before_gossip_is_evaluated_alike_in_both_engines(tmp_path: Path) -> None:
    """``eval_pre_gossip``: each evaluated round also records the model as local training left it, before
    it mixes (DePRL spec 004 §1.7 item 5: log the other one too). Both engines record it alike; it is not
    the post-gossip number (DePRL's head was fit to the body before mixing), and off, it is absent."""
    algorithm = {"name": "deprl", "tau": 2, "tau_unit": "epochs", "rep_steps": 1, "rep_unit": "epochs",
                 "lr_head": 0.1, "lr_body": 0.1}
    runs = {}
    for engine in ("exact", "batched"):
        folder = tmp_path / engine
        folder.mkdir()
        path = _config(folder, algorithm, engine)
        cfg = load_config(path, ["eval_pre_gossip=true"])
        simulate(cfg, folder / "run", progress=False)
        runs[engine] = {(r["round"], r["peer"]): r for r in
                        map(json.loads, (folder / "run" / "metrics.jsonl").read_text().splitlines())}
    assert runs["exact"].keys() == runs["batched"].keys() and len(runs["exact"]) == 3 * PEERS
    for key, e in runs["exact"].items():
        b = runs["batched"][key]
        assert {"acc_pre_gossip", "loss_pre_gossip"} <= set(e) and set(e) == set(b)
        assert abs(e["acc_pre_gossip"] - b["acc_pre_gossip"]) <= 0.02
        assert b["loss_pre_gossip"] == pytest.approx(e["loss_pre_gossip"], rel=1e-4)
    assert any(abs(r["loss_pre_gossip"] - r["loss"]) > 1e-4 for r in runs["exact"].values())
    off = tmp_path / "off"
    off.mkdir()
    _, recs = _run(off, algorithm, "exact", False)
    assert not any("acc_pre_gossip" in r for r in recs)


def test_engine_key_is_checked(tmp_path: Path) -> None:
    path = tiny_config(tmp_path, simulation={"workers": 1, "engine": "vectorized"})
    with pytest.raises(ConfigError, match="engine"):
        load_config(path)


def test_a_rule_written_for_one_peer_is_refused_by_the_batched_engine_before_it_runs(tmp_path: Path) -> None:
    """FedRoD's own losses run through the exact engine only: the batched engine says so in one line."""
    from p2pfl.engine.batched import BatchedEngineError, BatchedSimulation
    from p2pfl.experiment import Experiment

    assert not algorithm_class("fedrod").batched and algorithm_class("ditto").batched
    with pytest.raises(ConfigError, match="does not run fedrod.*use engine exact"):
        _run(tmp_path, {"name": "fedrod"}, "batched", False)
    assert not (tmp_path / "batched" / "run").exists()  # refused before anything is written
    # the engine itself refuses it too (an Experiment built without the config check)
    exp = Experiment.from_config(load_config(_config(tmp_path, {"name": "fedrod"}, "exact", push=False)))
    with pytest.raises(BatchedEngineError, match="does not run 'fedrod'.*use engine 'exact'"):
        BatchedSimulation(exp, None, lambda rec: None)


def test_checkpoints_taken_off_the_device_in_chunks_are_the_same_files(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched engine copies peer state off the device a few peers at a time (host memory stays
    bounded for large models): chunks of 2 of 5 peers, the last one short, write the same bits."""
    from p2pfl.engine import batched

    algorithm = _algorithm("dfedadmm", {})  # a dual per peer: extra state in every checkpoint
    (tmp_path / "whole").mkdir()
    whole, _ = _run(tmp_path / "whole", algorithm, "batched", False)
    per_peer = sum(v.nbytes for k, v in whole["p0"].items() if k == "params" or k.startswith("extra/"))
    assert any(k.startswith("extra/") for k in whole["p0"])
    monkeypatch.setattr(batched, "CHECKPOINT_CHUNK_BYTES", 2 * per_peer + 1)
    (tmp_path / "chunked").mkdir()
    chunked, _ = _run(tmp_path / "chunked", algorithm, "batched", False)
    assert sorted(whole) == sorted(chunked) == [f"p{i}" for i in range(PEERS)]
    for pid in whole:
        assert sorted(whole[pid]) == sorted(chunked[pid])
        for key in whole[pid]:
            assert np.array_equal(whole[pid][key], chunked[pid][key]), (pid, key)



@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, extra", CASES, ids=IDS)
def test_a_resumed_batched_run_equals_the_uninterrupted_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                            extra: dict) -> None:
    """The batched engine keeps checkpoint generations and resumes from them as the exact engine does:
    a run stopped after round 2 (of 4) and resumed computes rounds 2-3 bitwise as the run that never
    stopped, RNG streams included, and keeps its records of rounds 0-1."""
    import p2pfl.engine.batched as batched

    push = extra.get("mix_mode") == "push"
    algorithm = _algorithm(name, extra)

    for folder in (tmp_path / "full", tmp_path / "cut"):
        folder.mkdir()
        _config(folder, algorithm, "batched", push=push, rounds=4, checkpoint={"every": 2})
    simulate(load_config(tmp_path / "full" / "config.yaml"), tmp_path / "full" / "run", progress=False)
    assert not (tmp_path / "full" / "run" / "checkpoints" / "gen").exists()  # a finished run keeps its last only

    cut = tmp_path / "cut" / "run"
    monkeypatch.setattr(batched, "drop_generations", lambda run_dir: None)  # as if killed after the last round
    simulate(load_config(tmp_path / "cut" / "config.yaml"), cut, progress=False)
    monkeypatch.undo()
    (cut / "summary.json").unlink()
    gens = sorted(f.name for f in (cut / "checkpoints" / "gen").iterdir())
    assert gens == sorted(f"p{i}.r{r}.npz" for i in range(PEERS) for r in (2, 4))
    for f in (cut / "checkpoints" / "gen").glob("*.r4.npz"):
        f.unlink()  # killed before round 4's checkpoint
    summary = simulate(load_config(tmp_path / "cut" / "config.yaml"), cut, progress=False, resume=True)
    assert summary["resumed_from_round"] == 2

    assert records_without_times(cut) == records_without_times(tmp_path / "full" / "run")
    for i in range(PEERS):
        with np.load(tmp_path / "full" / "run" / "checkpoints" / f"p{i}.npz") as a, \
                np.load(cut / "checkpoints" / f"p{i}.npz") as b:
            assert sorted(a.files) == sorted(b.files)
            for key in a.files:
                assert np.array_equal(a[key], b[key]), (i, key)  # parameters, algorithm state, RNG, meta
