"""The averaged-model metric (DFedADMM / DFedSAM papers): mean of all peers' final models on the global test set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from p2pfl.checkpoint import load_checkpoint, save_checkpoint
from p2pfl.config import load_config
from p2pfl.data import load_dataset
from p2pfl.models import build_model
from p2pfl.report import ReportError, averaged_model_accuracy
from p2pfl.simulation import simulate
from tests.conftest import tiny_config


@pytest.mark.timeout(120)
def test_averaged_model_accuracy_matches_an_independent_average(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=2, algorithm={"name": "dfedavg", "lr": 0.1, "local_epochs": 1}))
    run = tmp_path / "run"
    simulate(cfg, run, progress=False)
    got = averaged_model_accuracy(run)
    assert got["peers"] == 4 and got["round"] == 2

    # independent: numpy mean of the four checkpoint vectors, loaded into a fresh model by name order
    flats = []
    for pid in ("p0", "p1", "p2", "p3"):
        with np.load(run / "checkpoints" / f"{pid}.npz", allow_pickle=False) as z:
            flats.append(z["params"].astype(np.float64))
    mean = torch.from_numpy(np.mean(flats, axis=0).astype(np.float32))
    data = load_dataset(cfg.data.dataset, cfg.data.root, **cfg.data.params)
    model = build_model(cfg.model["name"], data.input_shape, data.num_classes,
                        **{k: v for k, v in cfg.model.items() if k != "name"})
    offset = 0
    with torch.no_grad():
        for p in model.parameters():  # the flat layout is the model's parameter order
            p.copy_(mean[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        acc = float((model(data.test_x).argmax(1) == data.test_y).float().mean())
    assert offset == mean.numel()
    assert got["acc"] == pytest.approx(acc, abs=1e-6)
    assert got["test_examples"] == data.num_test


@pytest.mark.timeout(120)
def test_averaged_model_accuracy_refuses_incomplete_checkpoints(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=1))
    run = tmp_path / "run"
    simulate(cfg, run, progress=False)
    (run / "checkpoints" / "p2.npz").unlink()
    with pytest.raises(ReportError, match="no final checkpoint"):
        averaged_model_accuracy(run)


@pytest.mark.timeout(120)
def test_a_diverged_peer_is_named_and_the_others_are_scored_apart(tmp_path: Path) -> None:
    """A peer with non-finite parameters makes x̄ non-finite (the paper's metric, kept as it is); the
    result names it and scores the mean of the other peers' models as a separate diagnostic."""
    cfg = load_config(tiny_config(tmp_path, rounds=2, algorithm={"name": "dfedavg", "lr": 0.1, "local_epochs": 1}))
    run = tmp_path / "run"
    simulate(cfg, run, progress=False)
    healthy = averaged_model_accuracy(run)
    assert healthy["nonfinite_peers"] == [] and "acc_finite_peers" not in healthy

    # the reference: set p2 to the mean of p0, p1 and p3, so that x̄ of all four equals their mean, and score it
    # p2's checkpoint is rewritten the way its peer would write it (save_checkpoint: its own checksum)
    path = run / "checkpoints" / "p2.npz"
    state, rng, meta = load_checkpoint(path)
    gen = torch.Generator()
    gen.set_state(rng)
    meta = {k: v for k, v in meta.items() if k not in ("format", "peer", "round", "scalars", "crc32")}
    flats = []
    for pid in ("p0", "p1", "p3"):
        with np.load(run / "checkpoints" / f"{pid}.npz", allow_pickle=False) as z:
            flats.append(z["params"].astype(np.float64))
    state.params = torch.from_numpy(np.mean(flats, axis=0).astype(np.float32))  # p2 := the others' mean
    save_checkpoint(path, state, gen, meta)
    others = averaged_model_accuracy(run)  # the mean of 4 where p2 is the mean of 3 = the mean of those 3

    state.params[:5] = float("nan")  # p2 diverged
    save_checkpoint(path, state, gen, meta)
    got = averaged_model_accuracy(run)
    assert got["nonfinite_peers"] == ["p2"] and got["peers"] == 4
    assert got["loss"] is None  # x̄ itself is not finite: no loss to write
    assert got["acc_finite_peers"] == pytest.approx(others["acc"], abs=1e-6)
    assert got["loss_finite_peers"] == pytest.approx(others["loss"], rel=1e-5)
