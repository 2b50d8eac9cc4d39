"""Every algorithm gives bitwise the same per-peer parameters over real gRPC (mutual TLS, loopback)
as in the in-memory simulation: the proof that the simulation measures the real system.

The four peers run in one test process (threads) to keep CI fast, but each has its own gRPC
server and channels, and every payload crosses the wire codec and a TLS socket; the separate-process
path (`p2pfl launch`) is checked against the simulation in test_launch.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pfl.algorithms import ALGORITHMS
from p2pfl.config import load_config
from p2pfl.experiment import Experiment
from p2pfl.modelpool import ModelPool
from p2pfl.node_process import network_for
from p2pfl.security.certs import make_certs
from p2pfl.simulation import simulate
from p2pfl.transport.grpc_transport import start_grpc_peer
from tests.conftest import tiny_config
from tests.test_launch import free_base_port

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

    certs = tmp_path / "certs"
    exp = Experiment.from_config(cfg)
    make_certs(list(exp.topology.ids), certs)
    network = network_for(cfg, certs, insecure=False)
    algo = exp.new_algorithm()
    grpc_dir = tmp_path / "grpc"
    transports = [start_grpc_peer(exp.topology, pid, network, expected_specs=algo.wire_specs(),
                                  scalar_keys=algo.wire_scalars(), seed=cfg.seed, mode=algo.mode)
                  for pid in exp.topology.ids]
    records: list[dict] = []
    errors: list[BaseException] = []
    torch.set_num_threads(1)
    try:
        nodes = [exp.make_node(pid, transport=t, models=ModelPool(exp.model_factory, 1), record=records.append,
                               run_dir=grpc_dir) for pid, t in zip(exp.topology.ids, transports, strict=True)]

        def run(node) -> None:
            try:
                node.run()
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
    finally:
        for t in transports:
            t.close()
    assert len(records) == 4 * cfg.rounds and not any(r["missing"] for r in records)
    assert all((r["bytes_recv"] > 0) == (name != "local") for r in records)
    for node in nodes:
        with np.load(sim_dir / "checkpoints" / f"{node.peer_id}.npz") as z:
            assert np.array_equal(node.state.params.numpy(), z["params"]), node.peer_id
            for key, value in node.state.extra.items():
                assert np.array_equal(value.numpy(), z[f"extra/{key}"]), key
