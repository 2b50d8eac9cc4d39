"""A Flower App written with the legacy API runs peer to peer as is.

The app (tests/apps/flower_legacy_app) is Flower's PyTorch quickstart as it was before the Message
API: a ``NumPyClient`` behind ``ClientApp(client_fn)``, a ``FedAvg`` with ``initial_parameters``
and ``on_fit_config_fn`` behind ``ServerApp(server_fn)``, and a model that is an unnamed list of
arrays (``get_weights``). It is not installed nor on the Python path; the config names its
directory. Each peer gets FitIns / EvaluateIns records built by Flower's own converters and
answers with FitRes / EvaluateRes; its state is kept as named tensors (``"0"`` .. ``"9"``, or the
``app_init`` model's names), and ``sharing.personal`` names the last two arrays by index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from flwr.app import MessageType

from p2pfl.badinput import BadInput
from p2pfl.checkpoint import load_checkpoint
from p2pfl.config import load_config
from p2pfl.experiment import Experiment
from p2pfl.simulation import simulate
from p2pfl.topology import generate
from tests.test_launch import records

APP = Path(__file__).parent / "apps" / "flower_legacy_app"
PEERS = ["p0", "p1", "p2"]
ROUNDS = 2
NAMES = [str(i) for i in range(10)]  # conv1.w, conv1.b, conv2.w, conv2.b, fc1.w, fc1.b, fc2.w, fc2.b, fc3.w, fc3.b
TIMING = ("seconds", "train_seconds")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_config(tmp_path: Path, **extra: Any) -> Path:
    """A config naming the app by its directory, a 3-peer ring (= complete graph) and the head personal by index."""
    generate("ring", len(PEERS)).dump(tmp_path / "topology.yaml")
    cfg = {"name": "flower-legacy", "seed": 3, "rounds": ROUNDS, "topology": "topology.yaml", "app": str(APP),
           "sharing": {"personal": [-2, -1]}, "simulation": {"workers": 1}, **extra}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _metrics(path: Path) -> dict[tuple[int, str], dict[str, Any]]:
    return {(r["round"], r["peer"]): {k: v for k, v in r.items() if k not in TIMING} for r in records(path)}


@pytest.mark.timeout(300)
def test_legacy_app_runs_peer_to_peer_reproducibly_with_its_head_personal(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path))
    exp = Experiment.from_config(cfg)
    layout = exp.layout
    assert list(layout.personal_names) == ["8", "9"] and list(layout.shared_names) == NAMES[:8]

    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        assert simulate(load_config(write_config(tmp_path)), run, progress=False)["rounds"] == ROUNDS
    first, second = (_metrics(run / "metrics.jsonl") for run in runs)
    assert list(first) == [(r, p) for r in range(ROUNDS) for p in PEERS]
    assert first == second  # the same seed, the same numbers (the app shuffles with torch's global RNG)
    for (rnd, _), rec in first.items():
        # EvaluateRes: loss and the client's "accuracy" fill the run folder's columns; FitRes: its metrics.
        assert rec["acc"] == rec["accuracy"] and rec["loss"] is not None and rec["num-examples"] == 40
        assert rec["train-num-examples"] == 160 and "val_accuracy" in rec
        assert rec["lr"] == pytest.approx(0.1 * 0.5**rnd)  # the strategy's on_fit_config_fn, asked each round

    states = {p: load_checkpoint(runs[0] / "checkpoints" / f"{p}.npz")[0] for p in PEERS}
    views = {p: layout.views(st.params) for p, st in states.items()}
    for name in NAMES:  # checkpoints hold the post-mixing state; the ring of 3 mixes uniformly
        same = all(torch.allclose(views["p0"][name], views[p][name], atol=1e-6) for p in PEERS[1:])
        assert same == (name not in ("8", "9")), name


def test_the_legacy_server_gives_the_initial_model_and_each_rounds_config(tmp_path: Path) -> None:
    exp = Experiment.from_config(load_config(write_config(tmp_path, app_train_config={"momentum": 0.5})))
    state, flat, start = exp._app
    assert start.legacy_client and start.legacy_server is not None

    from flower_legacy_app.task import Net, get_weights  # importable now: the app's directory is on sys.path

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        expected = get_weights(Net())  # what server_fn puts in FedAvg's initial_parameters
    assert list(state.order) == NAMES
    got = state.layout.views(flat)
    for name, arr in zip(NAMES, expected, strict=True):
        assert torch.equal(got[name], torch.from_numpy(arr)), name

    for rnd in (1, 2, 3):  # on_fit_config_fn(round), with app_train_config on top; evaluate: no config fn
        assert start.config(MessageType.TRAIN, rnd) == {"learning-rate": 0.1 * 0.5 ** (rnd - 1), "momentum": 0.5}
        assert start.config(MessageType.EVALUATE, rnd) == {}

    # What the ClientApp gets is Flower's own FitIns layout, the arrays in state order.
    from flwr.common import parameters_to_ndarrays
    from flwr.compat.common.recorddict_compat import recorddict_to_fitins

    content = start.content(MessageType.TRAIN, state, state.layout.views(flat), {}, 2)
    fitins = recorddict_to_fitins(content, keep_input=True)
    assert fitins.config == {"learning-rate": 0.05, "momentum": 0.5}
    assert all(np.array_equal(a, b) for a, b in zip(parameters_to_ndarrays(fitins.parameters), expected, strict=True))


def test_app_init_names_a_legacy_apps_list(tmp_path: Path) -> None:
    """With ``app_init`` the list gets the state_dict's names, and ``sharing.personal`` takes prefixes."""
    exp = Experiment.from_config(load_config(write_config(tmp_path, app_init="flower_legacy_app.task:Net",
                                                          sharing={"personal": ["fc3."]})))
    assert exp.layout.personal_names == ("fc3.weight", "fc3.bias")
    state, flat, start = exp._app
    from flwr.common import parameters_to_ndarrays
    from flwr.compat.common.recorddict_compat import recorddict_to_evaluateins

    ins = recorddict_to_evaluateins(start.content(MessageType.EVALUATE, state, state.layout.views(flat), {}, 1),
                                    keep_input=True)
    shapes = [a.shape for a in parameters_to_ndarrays(ins.parameters)]
    assert shapes == [tuple(state.layout.views(flat)[k].shape) for k in state.order]  # state_dict order


class _WithParams:
    """A NumPyClient whose get_parameters is the model (what Flower's server asks when a strategy has none)."""

    @staticmethod
    def client_fn(context: Any) -> Any:
        from flwr.client import NumPyClient

        class Client(NumPyClient):
            def get_parameters(self, config: dict) -> list[np.ndarray]:
                return [torch.randn(2, 3).numpy(), np.arange(4, dtype=np.int64)]

        return Client().to_client()


def _no_params_client_fn(context: Any) -> Any:
    from flwr.client import NumPyClient

    return NumPyClient().to_client()


def _legacy_apps() -> tuple[Any, Any]:
    from flwr.client import ClientApp

    return ClientApp(client_fn=_WithParams.client_fn), ClientApp(client_fn=_no_params_client_fn)


WITH_PARAMS, NO_PARAMS = _legacy_apps()


def test_without_initial_parameters_the_first_peers_get_parameters_is_the_model() -> None:
    from p2pfl.flower.clientapp import AppSpec, app_start

    starts = [app_start(AppSpec(app="tests.test_flower_legacy:WITH_PARAMS", init=""), seed, 3, "p0")
              for seed in (5, 5, 6)]
    assert list(starts[0].state) == ["0", "1"] and starts[0].state["1"].dtype == torch.int64
    assert torch.equal(starts[0].state["0"], starts[1].state["0"])  # under torch.manual_seed(seed)
    assert not torch.equal(starts[0].state["0"], starts[2].state["0"])
    with pytest.raises(BadInput, match=r"^app_init: missing: .*get_parameters failed"):
        app_start(AppSpec(app="tests.test_flower_legacy:NO_PARAMS", init=""), 0, 3)


def _cli(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}  # p2pfl itself; never the app
    return subprocess.run([sys.executable, "-m", "p2pfl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def test_a_personal_index_out_of_range_is_one_error_line(tmp_path: Path) -> None:
    write_config(tmp_path, sharing={"personal": [10]})
    proc = _cli("simulate", "-c", "config.yaml", "--out", "run", "-q", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and "sharing.personal: index 10 is out of range" in lines[0], lines[0]
    assert "10 arrays" in lines[0] and not (tmp_path / "run").exists()


@pytest.mark.timeout(400)
def test_launch_gives_the_numbers_simulate_gives(tmp_path: Path) -> None:
    """One `p2pfl node` process per peer computes exactly what the peers of one simulate worker compute:
    the app's draws from torch's global RNG are seeded per peer, round and message."""
    write_config(tmp_path)
    proc = _cli("launch", "-c", "config.yaml", "--out", "launched", "--timeout", "250", cwd=tmp_path, timeout=320)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert simulate(load_config(tmp_path / "config.yaml"), tmp_path / "simulated", progress=False)
    launched, simulated = (_metrics(tmp_path / d / "metrics.jsonl") for d in ("launched", "simulated"))
    assert sorted(launched) == sorted(simulated)
    for key, rec in simulated.items():
        other = launched[key]
        assert {k: other[k] for k in rec if k not in ("bytes_recv", "bytes_sent")} == \
            {k: v for k, v in rec.items() if k not in ("bytes_recv", "bytes_sent")}, key
    cfg = json.loads((tmp_path / "launched" / "summary.json").read_text())
    assert cfg["rounds"] == ROUNDS
