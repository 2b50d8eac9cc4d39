"""Every algorithm gives bitwise the same per-peer parameters over real gRPC (mutual TLS, loopback)
as in the in-memory simulation: the proof that the simulation measures the real system.

The four peers run in one test process (threads) to keep CI fast, but each has its own gRPC
server and channels, and every payload crosses the wire codec and a TLS socket; the separate-process
path (`p2pfl launch`) is checked against the simulation in test_launch.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from p2pfl.algorithms import ALGORITHMS
from p2pfl.config import load_config
from p2pfl.simulation import simulate
from tests.conftest import tiny_config
from tests.swarm import free_base_port, run_grpc

CASES = [(name, {}) for name in sorted(ALGORITHMS)] + [("dfedpgp", {"mix_mode": "push"})]
LIGHT = {"local_epochs": 1, "body_local": 1}  # keep every case around a second


def _algorithm(name: str, extra: dict) -> dict:
    cls_defaults = __import__("p2pfl.algorithms", fromlist=["algorithm_class"]).algorithm_class(name).defaults
    return {"name": name, **{k: v for k, v in LIGHT.items() if k in cls_defaults}, **extra}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, extra", CASES, ids=[f"{n}{'-push' if e else ''}" for n, e in CASES])
def test_grpc_equals_simulation_bitwise(tmp_path: Path, name: str, extra: dict) -> None:
    kind = "directed_ring" if extra.get("mix_mode") == "push" else "ring"
    cfg_path = tiny_config(tmp_path, base_port=free_base_port(), kind=kind, algorithm=_algorithm(name, extra))
    cfg = load_config(cfg_path)
    sim_dir = tmp_path / "sim"
    simulate(cfg, sim_dir, progress=False)

    nodes, records = run_grpc(cfg, tmp_path)
    assert len(records) == 4 * cfg.rounds and not any(r["missing"] for r in records)
    assert all((r["bytes_recv"] > 0) == (name != "local") for r in records)
    for node in nodes:
        with np.load(sim_dir / "checkpoints" / f"{node.peer_id}.npz") as z:
            assert np.array_equal(node.state.params.numpy(), z["params"]), node.peer_id
            for key, value in node.state.extra.items():
                assert np.array_equal(value.numpy(), z[f"extra/{key}"]), key
