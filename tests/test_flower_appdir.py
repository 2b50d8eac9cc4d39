"""A Flower App directory, written as ``flwr new`` (PyTorch, Message API) writes one, runs peer to peer as is.

The app (tests/apps/flower_bn_app: pyproject.toml, client_app.py, server_app.py, task.py with a
BatchNorm CNN) is not installed nor on the Python path: the config names its directory and
nothing else about it. Its ServerApp decides every peer's round-0 model and the train config
(``lr``) its ClientApp reads; BatchNorm's running statistics are gossiped or kept per peer as
``sharing.running_stats`` says, and its int64 ``num_batches_tracked`` is carried by each peer.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from flwr.app import ArrayRecord
from flwr.supercore.task_identity import TaskIdentity

from p2pfl.badinput import BadInput
from p2pfl.checkpoint import load_checkpoint
from p2pfl.config import load_config
from p2pfl.experiment import Experiment
from p2pfl.flower.appstate import HELD_PREFIX, app_layout
from p2pfl.flower.records import round_content
from p2pfl.modelpool import ModelPool
from p2pfl.models.layout import ParamLayout
from p2pfl.simulation import simulate
from p2pfl.topology import generate
from p2pfl.transport.memory import MemoryHub, MemoryTransport
from tests.conftest import records_without_times
from tests.test_launch import records

APP = Path(__file__).parent / "apps" / "flower_bn_app"
PEERS = ["p0", "p1", "p2"]
ROUNDS = 2
BATCHES = 5  # 600 examples / 3 partitions * 80 % train = 160, in batches of 32
STATS = ("bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_config(tmp_path: Path, app: Path | str = APP, **extra: Any) -> Path:
    """A config naming the app by its directory, a 3-peer ring (= complete graph) and nothing else of the app."""
    generate("ring", len(PEERS)).dump(tmp_path / "topology.yaml")
    cfg = {"name": "flower-bn", "seed": 3, "rounds": ROUNDS, "topology": "topology.yaml", "app": str(app),
           "simulation": {"workers": 1}, **extra}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.timeout(240)
@pytest.mark.parametrize("running_stats", ["shared", "personal"])
def test_app_dir_runs_peer_to_peer_and_batchnorm_stats_follow_the_option(tmp_path: Path, running_stats: str) -> None:
    cfg = load_config(write_config(tmp_path, sharing={"personal": ["fc3."], "running_stats": running_stats}))
    exp = Experiment.from_config(cfg)
    layout = exp.layout
    assert set(STATS) <= set(layout.shared_names if running_stats == "shared" else layout.personal_names)
    assert {"fc3.weight", "fc3.bias"} <= set(layout.personal_names)
    assert not any(n.endswith("num_batches_tracked") for n in layout.shared_names + layout.personal_names)

    run = tmp_path / "run"
    summary = simulate(cfg, run, progress=False, experiment=exp)
    assert summary["rounds"] == ROUNDS
    recs = records(run / "metrics.jsonl")
    assert [(r["round"], r["peer"]) for r in recs] == [(r, p) for r in range(ROUNDS) for p in PEERS]
    assert all(r["acc"] == r["eval_acc"] and r["train-num-examples"] == 160 for r in recs)

    states = {p: load_checkpoint(run / "checkpoints" / f"{p}.npz")[0] for p in PEERS}
    for p, st in states.items():  # the int64 counter: each peer's own, in its checkpoint, never mixed
        for bn in ("bn1", "bn2"):
            counter = st.extra[f"{HELD_PREFIX}{bn}.num_batches_tracked"]
            assert counter.dtype == torch.int64 and counter.shape == () and int(counter) == ROUNDS * BATCHES, p
    views = {p: layout.views(st.params) for p, st in states.items()}
    for name in STATS:  # checkpoints hold the post-mixing state; the ring of 3 mixes uniformly
        same = all(torch.allclose(views["p0"][name], views[p][name], atol=1e-6) for p in PEERS[1:])
        assert same == (running_stats == "shared"), name
    assert not torch.allclose(views["p0"]["fc3.weight"], views["p1"]["fc3.weight"])


def test_the_server_app_gives_the_round0_model_and_the_train_config(tmp_path: Path) -> None:
    py_state, torch_state, identity = random.getstate(), torch.get_rng_state(), TaskIdentity._run_id
    exp = Experiment.from_config(load_config(write_config(tmp_path)))
    state, flat, start = exp._app
    # Capturing left the caller's RNGs and Flower's process identity as they were.
    assert random.getstate() == py_state and torch.equal(torch.get_rng_state(), torch_state)
    assert TaskIdentity._run_id == identity

    from flower_bn_app.task import Net  # importable now: the app's directory is on sys.path

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        expected = Net().state_dict()  # what the template's ServerApp sends as initial_arrays
    assert list(state.order) == list(expected)
    got = state.tensors(state.layout.views(flat), {HELD_PREFIX + k: v for k, v in state.held.items()})
    for k, v in expected.items():
        assert torch.equal(got[k], v.to(got[k].dtype)) and got[k].dtype == v.dtype, k
    for pid in PEERS:  # every peer's round-0 model is that one
        node = exp.make_node(pid, transport=MemoryTransport(MemoryHub(), pid), models=ModelPool(exp.model_factory, 1),
                             record=lambda rec: None, run_dir=None)
        assert torch.equal(node.state.params, flat)
        assert int(node.state.extra[HELD_PREFIX + "bn1.num_batches_tracked"]) == 0

    # The train message holds what FedAvg sends: the pyproject's lr (ServerApp: ConfigRecord({"lr": lr})).
    content = round_content(start.train, ArrayRecord(), 4)
    assert dict(content["config"]) == {"lr": 0.01, "server-round": 4}
    assert dict(round_content(start.evaluate, ArrayRecord(), 4)["config"]) == {"server-round": 4}
    assert exp.app_spec is not None and exp.app_spec.config["local-epochs"] == 1

    # --set app_config.lr reaches the ServerApp's run_config, hence the train config; app_train_config wins.
    over = Experiment.from_config(load_config(write_config(tmp_path), ["app_config.lr=0.05"]))
    assert round_content(over._app[2].train, ArrayRecord(), 1)["config"]["lr"] == 0.05
    explicit = Experiment.from_config(load_config(write_config(tmp_path, app_train_config={"lr": 0.2})))
    assert round_content(explicit._app[2].train, ArrayRecord(), 1)["config"]["lr"] == 0.2


def test_app_init_overrides_the_server_app_model(tmp_path: Path) -> None:
    exp = Experiment.from_config(load_config(write_config(tmp_path, app_init="flower_bn_app.task:Net", seed=9)))
    _, flat, start = exp._app
    from flower_bn_app.task import Net

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(9)
        expected = Net().state_dict()
    assert torch.equal(start.state["conv1.weight"], expected["conv1.weight"])
    assert start.train["config"]["lr"] == 0.01  # the train config still comes from the ServerApp


def test_integer_and_0dim_entries_are_carried_not_mixed() -> None:
    layout = ParamLayout.from_shapes({"w": (2, 3), "scale": ()}, ["w", "scale"], [])
    views = layout.views(torch.arange(7.0))
    assert views["scale"].shape == () and float(views["scale"]) == 6.0  # 0-dim: a view, no TypeError
    assert layout.views(torch.zeros(4, 7))["scale"].shape == (4,)  # with leading (batched) dimensions

    state = {"w": torch.ones(2), "scale": torch.tensor(0.5, dtype=torch.float64),
             "n": torch.tensor(7), "mask": torch.tensor([True, False])}
    app, flat = app_layout(state, [])
    assert app.layout.shared_names == ("w", "scale") and set(app.held) == {"n", "mask"}
    extra: dict[str, torch.Tensor] = {}
    app.init_extra(extra)
    rec = app.record(app.layout.views(flat), extra)
    assert list(rec) == ["w", "scale", "n", "mask"]
    assert rec["scale"].numpy().dtype.name == "float64" and rec["n"].numpy().dtype.name == "int64"
    reply = ArrayRecord({"w": torch.full((2,), 3.0), "scale": torch.tensor(2.0, dtype=torch.float64),
                         "n": torch.tensor(9), "mask": torch.tensor([False, True])})
    app.load(reply, flat, extra, "reply")
    assert flat.tolist() == [3.0, 3.0, 2.0] and int(extra[HELD_PREFIX + "n"]) == 9
    with pytest.raises(ValueError, match="'n' has dtype torch.float32, expected torch.int64"):
        app.load(ArrayRecord({"w": torch.zeros(2), "scale": torch.tensor(0.0, dtype=torch.float64),
                              "n": torch.tensor(1.0), "mask": torch.tensor([True, True])}), flat, extra, "reply")
    assert flat.tolist() == [3.0, 3.0, 2.0]  # a refused reply wrote nothing


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}  # p2pfl itself; never the app
    return subprocess.run([sys.executable, "-m", "p2pfl.cli", "simulate", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def _broken_app(tmp_path: Path, edit: str, new: str) -> Path:
    app = tmp_path / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    py = app / "pyproject.toml"
    text = py.read_text()
    assert edit in text
    py.write_text(text.replace(edit, new))
    return app


@pytest.mark.timeout(200)
def test_a_broken_app_is_one_error_line_exit_2_and_no_run_folder(tmp_path: Path) -> None:
    cases = [
        # a component that does not import: the pyproject and its key
        (_broken_app(tmp_path / "a", '"flower_bn_app.client_app:app"', '"flower_bn_app.no_such:app"'), [],
         "pyproject.toml: tool.flwr.app.components.clientapp: cannot import module 'flower_bn_app.no_such'"),
        # a run config key the app does not declare, given on the command line
        (APP, ["--set", "app_config.lrr=0.1"], "error: --set: app_config.lrr: not a run config key of the app"),
        # a ServerApp that fails before its first round (the pyproject lost its lr)
        (_broken_app(tmp_path / "b", "lr = 0.01", ""), [],
         "pyproject.toml: tool.flwr.app.components.serverapp: the ServerApp failed before its first round: "
         "KeyError"),
    ]
    for i, (app, sets, expected) in enumerate(cases):
        work = tmp_path / f"case{i}"
        work.mkdir()
        write_config(work, app=app)
        proc = _cli("-c", "config.yaml", "--out", "run", "-q", *sets, cwd=work)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
        assert expected in lines[0], lines[0]
        assert not (work / "run").exists()


def test_app_config_and_directory_errors_name_the_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"config.yaml: app_config.lrr: not a run config key.*did you mean 'lr'"):
        load_config(write_config(tmp_path, app_config={"lrr": 0.1}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match=r"config.yaml: app: folder .* holds no pyproject.toml"):
        load_config(write_config(tmp_path, app=tmp_path / "empty"))
    no_components = _broken_app(tmp_path, "[tool.flwr.app.components]", "[tool.flwr.app.parts]")
    with pytest.raises(BadInput, match=r"pyproject.toml: tool.flwr.app.components: missing"):
        load_config(write_config(tmp_path, app=no_components))
    with pytest.raises(BadInput, match=r"config.yaml: app_init: missing"):
        load_config(write_config(tmp_path, app="peers.quickstart:app"))


@pytest.mark.timeout(300)
def test_app_dir_runs_under_launch_one_process_per_peer(tmp_path: Path) -> None:
    """Each `p2pfl node` process imports the app from its directory and starts from the ServerApp's model,
    and records what simulate records: every message to the app is seeded per (run seed, peer, round,
    message type) (p2pfl.flower.clientapp), so the template's shuffling with torch's global RNG does not
    depend on which peers share a process. Metrics (less the timing fields) and checkpoints are equal."""
    cfg = write_config(tmp_path, sharing={"running_stats": "personal"})
    proc = subprocess.run([sys.executable, "-m", "p2pfl.cli", "launch", "-c", "config.yaml", "--out", "run",
                           "--timeout", "200"], capture_output=True, text=True, timeout=260, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = records(tmp_path / "run" / "metrics.jsonl")
    assert sorted((r["round"], r["peer"]) for r in recs) == [(r, p) for r in range(ROUNDS) for p in PEERS]
    for p in PEERS:
        st = load_checkpoint(tmp_path / "run" / "checkpoints" / f"{p}.npz")[0]
        assert int(st.extra[f"{HELD_PREFIX}bn1.num_batches_tracked"]) == ROUNDS * BATCHES

    simulate(load_config(cfg), tmp_path / "sim", progress=False)

    def by_key(run: Path) -> dict[tuple[str, int], dict[str, Any]]:
        return {(r["peer"], r["round"]): r for r in records_without_times(run)}

    assert by_key(tmp_path / "run") == by_key(tmp_path / "sim")
    for p in PEERS:
        launched, simulated = (load_checkpoint(tmp_path / d / "checkpoints" / f"{p}.npz")[0] for d in ("run", "sim"))
        assert torch.equal(launched.params, simulated.params), p
        assert launched.extra.keys() == simulated.extra.keys(), p
        assert all(torch.equal(launched.extra[k], simulated.extra[k]) for k in launched.extra), p


def test_capture_takes_the_strategys_own_round1_content_and_survives_except_exception() -> None:
    from flwr.app import ConfigRecord, Context, MessageType, RecordDict
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedProx

    from p2pfl.flower.capture import capture_server_start

    state = {"w": torch.arange(3.0)}
    guarded = ServerApp()

    @guarded.main()
    def main(grid: Grid, context: Context) -> None:
        try:  # an app that catches everything must not swallow the stop
            FedProx(proximal_mu=0.5, fraction_train=0.0).start(
                grid=grid, initial_arrays=ArrayRecord(state), train_config=ConfigRecord({"lr": context.run_config["lr"]}),
                evaluate_config=ConfigRecord({"batch": 8}))
        except Exception:  # noqa: BLE001
            pass
        raise AssertionError("the ServerApp went on after its strategy started")

    got = capture_server_start(guarded, {"lr": 0.3}, run_id=1, seed=0, num_nodes=1)
    assert torch.equal(torch.from_numpy(got.arrays["w"].numpy()), state["w"])
    assert got.train is not None and dict(got.train["config"]) == {"lr": 0.3, "server-round": 1}
    assert got.evaluate is not None and dict(got.evaluate["config"]) == {"batch": 8, "server-round": 1}

    own = ServerApp()

    @own.main()
    def main2(grid: Grid, context: Context) -> None:  # no strategy: it sends its own messages
        content = RecordDict({"model": ArrayRecord(state), "cfg": ConfigRecord({"lr": 0.7})})
        grid.send_and_receive([grid.create_message(content, MessageType.TRAIN, nid, "1") for nid in grid.get_node_ids()])

    got = capture_server_start(own, {}, run_id=1, seed=0, num_nodes=2)
    assert torch.equal(torch.from_numpy(got.arrays["w"].numpy()), state["w"]) and got.train is not None
    assert dict(round_content(got.train, ArrayRecord(), 2)["cfg"]) == {"lr": 0.7}
    assert list(round_content(got.train, ArrayRecord({"w": torch.zeros(3)}), 2)) == ["model", "cfg"]


def _legacy_client_fn(context: Any) -> Any:  # never called: app_init gives the model, no round runs
    raise AssertionError


def _legacy_server_fn(context: Any) -> Any:
    raise KeyError("num-server-rounds")


def _apps() -> tuple[Any, Any]:
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    return ClientApp(client_fn=_legacy_client_fn), ServerApp(server_fn=_legacy_server_fn)


LEGACY_CLIENT, LEGACY_SERVER = _apps()


def test_legacy_apps_are_taken_and_a_failing_server_fn_is_one_line(tmp_path: Path) -> None:
    """Legacy apps run (tests/test_flower_legacy.py); a server_fn that fails is named by its pyproject key."""
    from p2pfl.flower.clientapp import AppSpec, app_start

    importable_spec = AppSpec.from_raw({"app": str(APP)})  # puts the app's folder on sys.path
    start = app_start(AppSpec(app="tests.test_flower_appdir:LEGACY_CLIENT", init="flower_bn_app.task:Net"), 0, 3)
    assert start.legacy_client and start.legacy_server is None
    legacy_server = AppSpec(app=importable_spec.app, init="", server="tests.test_flower_appdir:LEGACY_SERVER",
                            root=importable_spec.root, source=importable_spec.source)
    with pytest.raises(BadInput, match=r"pyproject.toml: tool.flwr.app.components.serverapp: the ServerApp's "
                                       r"server_fn failed: KeyError: 'num-server-rounds'"):
        app_start(legacy_server, 0, 3)


def test_the_repos_flower_app_config_names_only_the_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """peers/flower_app.yaml (what `make demo` runs after the comparison): the directory, a topology and
    the personal head; the model and the train config come from its ServerApp (no data is read here)."""
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    raw = yaml.safe_load((repo / "peers" / "flower_app.yaml").read_text())
    assert raw["app"] == "peers/flower_app" and not {"app_init", "app_config", "app_train_config"} & set(raw)
    exp = Experiment.from_config(load_config(repo / "peers" / "flower_app.yaml"))
    assert exp.layout.personal_names == ("fc2.weight", "fc2.bias")
    assert round_content(exp._app[2].train, ArrayRecord(), 1)["config"]["lr"] == 0.05
