"""Shared fixtures: small synthetic experiments that run in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from p2pfl.topology import generate


def tiny_config(tmp_path: Path, *, peers: int = 4, rounds: int = 3, algorithm: dict[str, Any] | None = None,
                kind: str = "ring", base_port: int = 50050, **extra: Any) -> Path:
    """Write a 4-peer synthetic experiment (and its topology) into ``tmp_path``; return the config path."""
    topo = generate(kind, peers, base_port=base_port)
    topo.dump(tmp_path / "topology.yaml")
    cfg = {
        "name": "tiny", "seed": 3, "rounds": rounds, "device": "cpu",
        "topology": str(tmp_path / "topology.yaml"),
        "data": {"dataset": "synthetic", "partition": {"kind": "dirichlet", "alpha": 0.5}, "batch_size": 16,
                 "params": {"num_classes": 4, "train_size": 800, "test_size": 400, "shape": [1, 8, 8], "seed": 1}},
        "model": {"name": "mlp", "hidden": 32},
        "algorithm": algorithm or {"name": "dfedavg", "lr": 0.1, "local_epochs": 1},
        "simulation": {"workers": 2},
    }
    cfg.update(extra)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return tiny_config(tmp_path)
