"""Bad input is refused before anything starts: one line naming file and key, exit 2, nothing left behind.

Table-driven: each row is one kind of bad input a new user actually produced (issue 16) and the
part of the one-line message that must name it. A few end-to-end rows run the real ``p2pfl``
command in a subprocess to check the exit status, the single stderr line, the absence of a
traceback and of any written folder. What each kind gets is documented in ``docs/bad-input.md``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import yaml

from p2pfl.badinput import BadInput
from p2pfl.config import ConfigError, load_config
from p2pfl.topology import TopologyError, generate, load_topology, parse_topology
from p2pfl.topology.address import canonical_address, listen_address
from p2pfl.yamlsafe import YamlLimits, load_yaml_file, load_yaml_text
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]


# ---- config and --set: (overrides, text the one-line error must contain) -------------------------

CONFIG_CASES = [
    (["algorithm.lr=1e400"], "algorithm.lr: must be a finite number, got inf"),
    (["algorithm.lr=.nan"], "algorithm.lr: must be a finite number"),
    (["algorithm.lr=-0.1"], "algorithm.lr: must be > 0"),
    (["algorithm.lr=50"], "algorithm.lr: must be <= 10"),
    (["algorithm.lr=fast"], "algorithm.lr: must be a number, got 'fast'"),
    (["algorithm.local_epochs=-1"], "algorithm.local_epochs: must be > 0, got -1"),
    (["algorithm.local_epochs=0"], "algorithm.local_epochs: must be > 0"),
    (["algorithm.momentum=1"], "algorithm.momentum: must be < 1"),
    (["algorithm.lr_decay=1.5"], "algorithm.lr_decay: must be <= 1"),
    (["algorithm.lr_haed=0.1"], "algorithm.lr_haed: not a hyperparameter of dfedavg; allowed: lr"),
    (["algorithm.tau=2"], "tau is a hyperparameter of deprl, not of dfedavg"),
    (["algorithm.local_epochs=true"], "algorithm.local_epochs: must be a number"),
    (["algorithm.name=dfedavgg"], "unknown algorithm 'dfedavgg'; allowed: deprl"),
    (["algorithm.name=dfedavgg"], "did you mean 'dfedavg'?"),
    (["algorithm.preset=deprl-paper"], "preset 'deprl-paper' is not for algorithm dfedavg; allowed: dfedavg-paper"),
    (["algorithm.preset=nope"], "algorithm.preset: unknown preset"),
    (["algorithm.name=dfedpgp", "algorithm.mix_mode=sideways"], "algorithm.mix_mode: not an allowed value"),
    (["algorithm.name=deprl", "algorithm.tau_unit=steps", "algorithm.tau=1.5"], "tau counts steps and must be an integer"),
    (["algorithm.name=dfedadmm", "algorithm.lr=1", "algorithm.lam=0.1", "algorithm.lambda_semantics=equation"],
     "algorithm: lr / lambda = 10 > 2"),
    (["algorithm.name=dispfl", "algorithm.density=0"], "algorithm.density: must be > 0"),
    (["network.quorum=half"], "network.quorum: must be a number, got 'half'"),
    (["network.quorum=2"], "network.quorum: must be <= 1"),
    (["network.round_timeout_s=soon"], "network.round_timeout_s: must be a number, got 'soon'"),
    (["network.round_timeout_s=0"], "network.round_timeout_s: must be > 0"),
    (["network.chunk_kb=1.5"], "network.chunk_kb: must be an integer"),
    (["network.speed=2"], "network.speed: unknown key; allowed: round_timeout_s"),
    (["checkpoint.every=often"], "checkpoint.every: must be an integer, got 'often'"),
    (["checkpoint.enabled=maybe"], "checkpoint.enabled: must be true or false"),
    (["simulation.workers=0"], "simulation.workers: must be >= 1"),
    (["roundz=3"], "roundz: unknown key; allowed: name, seed, rounds"),
    (["roundz=3"], "did you mean 'rounds'?"),
    (["rounds=0"], "rounds: must be >= 1, got 0"),
    (["rounds=2.5"], "rounds: must be an integer, got 2.5"),
    (["seed=-1"], "seed: must be >= 0"),
    (["device=tpu"], "device: not an allowed value, got 'tpu'; allowed: cpu, cuda, cuda:N, auto"),
    (["eval_every=0"], "eval_every: must be >= 1"),
    (["data.root=/nonexistent/data"], "data.root: folder '/nonexistent/data' does not exist"),
    (["data.dataset=cifar"], "data.dataset: unknown dataset 'cifar'"),
    (["data.batch_size=0"], "data.batch_size: must be >= 1"),
    (["data.params.noize=1"], "data.params.noize: not a parameter of dataset synthetic"),
    (["data.partition.kind=dir"], "data.partition.kind: unknown partition kind 'dir'"),
    (["data.partition.alfa=0.5"], "did you mean 'alpha'?"),
    (["data.partition.alpha=null"], "data.partition.alpha: the dirichlet partition needs alpha"),
    (["data.partition.alpha=.inf"], "data.partition.alpha: must be a finite number"),
    (["data.partition.independent_test=often"], "data.partition.independent_test: must be true or false"),
    (["data.partition.independent_test=1"], "data.partition.independent_test: must be true or false, got 1"),
    (["data.partition.alpha=true"], "data.partition.alpha: must be a finite number, got True"),
    (["model.name=cnn"], "model.name: unknown model 'cnn'; allowed: alexnet"),
    (["model.width=3"], "model.width: not a parameter of model mlp; allowed: hidden"),
    (["model.name=cnn_small", "model.head_layers=0"], "model.head_layers: must be an integer in [1, 8], got 0"),
    (["model={name: alexnet_fmnist, head_layers: 4}"], "model.head_layers: must be an integer in [1, 3], got 4"),
    (["model=3"], "model: must be a mapping, got 3"),
    (["topology=missing.yaml"], "topology: topology file 'missing.yaml' not found"),
    (["rounds"], "--set: 'rounds' is not KEY=VALUE"),
    (["a..b=1"], "--set: a..b: a key part is empty"),
    (["rounds.x=1"], "cannot set it: 'rounds' is not a mapping"),
    (["rounds=[1"], "--set: rounds: value '[1' is not valid YAML"),
]


@pytest.mark.parametrize(("overrides", "needle"), CONFIG_CASES, ids=[" ".join(c[0]) for c in CONFIG_CASES])
def test_bad_config_value_is_one_line_naming_the_key(tmp_path: Path, overrides: list[str], needle: str) -> None:
    cfg = tiny_config(tmp_path)
    with pytest.raises(BadInput) as info:
        load_config(cfg, overrides)
    msg = str(info.value)
    assert needle in msg, msg
    assert "\n" not in msg and len(msg) < 700
    assert msg.startswith(("--set", str(cfg), "algorithm", "topology")), msg  # it names where


FILE_CASES = [
    ("algorithm: {name: deprl, lr: 0.1}", "algorithm.lr: not a hyperparameter of deprl; allowed: lr_head, lr_body"),
    ("algorithm: {name: dfedavg, lr: 1e400}", "algorithm.lr: must be a finite number"),
    ("algorithm: {name: dfedavg, lr: 1e-3, local_epochs: 2}", None),  # YAML 1.1 reads 1e-3 as a string: accepted
    ("network: {quorum: half}", "network.quorum: must be a number"),
    ("data: {dataset: synthetic, partitionz: {}}", "data.partitionz: unknown key"),
    ("algorithm: {lr: 0.1}", "algorithm.name: missing (required)"),
]


@pytest.mark.parametrize(("patch", "needle"), FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_value_in_the_file_names_file_and_key(tmp_path: Path, patch: str, needle: str | None) -> None:
    path = tiny_config(tmp_path)
    data = yaml.safe_load(path.read_text())
    data.update(yaml.safe_load(patch))
    path.write_text(yaml.safe_dump(data))
    if needle is None:
        assert load_config(path).algorithm["lr"] == 0.001
        return
    with pytest.raises(BadInput) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ") and needle in str(info.value), str(info.value)


def test_missing_section_and_missing_file(tmp_path: Path) -> None:
    path = tiny_config(tmp_path)
    data = yaml.safe_load(path.read_text())
    del data["model"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"model: missing \(required\)"):
        load_config(path)
    with pytest.raises(BadInput, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


# ---- switching algorithms ------------------------------------------------------------------------


def test_set_algorithm_name_runs_its_defaults_and_says_what_was_dropped() -> None:
    cfg = load_config(ROOT / "peers" / "demo.yaml", ["algorithm.name=deprl"], check_files=False)
    assert cfg.algorithm_name == "deprl"
    assert "lr" not in cfg.algorithm and "local_epochs" not in cfg.algorithm  # dfedavg's, not deprl's
    assert cfg.algorithm["momentum"] == 0.0  # shared keys of the file are kept
    assert len(cfg.notes) == 1 and "dropped dfedavg's lr, local_epochs" in cfg.notes[0]
    # what is set on the command line is never dropped: a key deprl lacks is refused instead
    with pytest.raises(BadInput, match="--set: algorithm.lr: not a hyperparameter of deprl"):
        load_config(ROOT / "peers" / "demo.yaml", ["algorithm.name=deprl", "algorithm.lr=0.1"], check_files=False)
    # switching to an algorithm with a preset of its own
    cfg = load_config(ROOT / "peers" / "demo.yaml", ["algorithm.name=dfedmdc", "algorithm.preset=dfedmdc-paper"],
                      check_files=False)
    assert cfg.algorithm["preset"] == "dfedmdc-paper" and cfg.algorithm["lr_head"] == 0.001


def test_every_algorithm_switch_from_the_demo_builds(tmp_path: Path) -> None:
    """``--set algorithm.name=X`` works for every X, and X's hyperparameters check out in the parent."""
    from p2pfl.algorithms import ALGORITHMS
    from p2pfl.experiment import Experiment

    path = tiny_config(tmp_path, algorithm={"name": "dfedavg", "lr": 0.05, "local_epochs": 1, "momentum": 0.0})
    for name in ALGORITHMS:
        cfg = load_config(path, [f"algorithm.name={name}"])
        assert Experiment.from_config(cfg).new_algorithm().name == name


def test_switched_algorithm_simulates(tmp_path: Path) -> None:
    from p2pfl.simulation import simulate

    path = tiny_config(tmp_path, rounds=1)
    cfg = load_config(path, ["algorithm.name=deprl", "simulation.workers=1"])
    summary = simulate(cfg, tmp_path / "run", progress=False)
    assert summary["rounds"] == 1 and summary["algorithm"] == "deprl"


def test_hyperparameter_schema_covers_every_algorithm() -> None:
    from p2pfl.algorithms import ALGORITHMS
    from p2pfl.algorithms.registry import check_hyperparameters, describe

    for name in ALGORITHMS:
        rows = describe(name)
        assert rows and all(doc for _, _, doc in rows)
        assert check_hyperparameters(name, {}) == {}  # its own defaults are valid
        for key, default, _ in rows:  # every hyperparameter refuses a value of the wrong type
            bad = "not-a-value" if not isinstance(default, str) else 12345
            with pytest.raises(BadInput, match=f"algorithm.{key}"):
                check_hyperparameters(name, {key: bad})


# ---- YAML loader -------------------------------------------------------------------------------


def _alias_bomb(levels: int = 9) -> str:
    text = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
    prev = "a"
    for i in range(levels - 1):
        name = f"l{i}"
        text += f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]\n"
        prev = name
    return text + f"peers: *{prev}\n"


def _merge_bomb(levels: int = 8) -> str:
    text, prev = "a: &a {x: 1, y: 2}\n", "a"
    for i in range(levels):
        text += f"b{i}: &b{i} {{<<: [" + ", ".join([f"*{prev}"] * 9) + "]}\n"
        prev = f"b{i}"
    return text


YAML_CASES = [
    ("alias bomb", _alias_bomb().encode(), "refused: aliases expand to more than"),
    ("merge-key bomb", _merge_bomb().encode(), "refused: aliases expand to more than"),
    ("recursive alias", b"a: &a [1, *a]\n", "refused: recursive alias"),
    ("too many aliases", b"a: &a 1\nb: [" + b",".join([b"*a"] * 2000) + b"]\n", "more than 1000 aliases"),
    ("deep flow nesting", b"[" * 100_000 + b"]" * 100_000, "line 1: refused: nesting deeper than 64 levels"),
    ("deep block nesting", "".join(f"{'  ' * i}k:\n" for i in range(200)).encode(), "nesting deeper than 64"),
    ("utf-16 with BOM", "rounds: 3\n".encode("utf-16"), "encoding: the file is UTF-16"),
    ("utf-16 without BOM", "rounds: 3\n".encode("utf-16-le"), "encoding: NUL bytes"),
    ("latin-1", "name: caf\xe9\n".encode("latin-1"), "line 1: encoding: byte 0xe9 is not valid UTF-8"),
    ("duplicate key", b"rounds: 1\nseed: 2\nrounds: 3\n", "line 3: invalid YAML: while constructing a mapping found "
     "duplicate key 'rounds'"),
    ("syntax error line", b"rounds: 1\nseed: 2\n  name: x\n", "line 3: invalid YAML: mapping values are not allowed"),
    ("unclosed bracket", b"rounds: 1\nseed: [1,\nname: x\n", "(the construct began on line 2)"),
]


@pytest.mark.parametrize(("raw", "needle"), [c[1:] for c in YAML_CASES], ids=[c[0] for c in YAML_CASES])
def test_yaml_loader_refuses_fast_and_small(tmp_path: Path, raw: bytes, needle: str) -> None:
    path = tmp_path / "in.yaml"
    path.write_bytes(raw)
    tracemalloc.start()
    try:
        with pytest.raises(BadInput) as info:
            load_yaml_file(path, "config file")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(info.value).startswith(f"{path}: ") and needle in str(info.value), str(info.value)
    assert peak < 64 << 20, peak  # an alias bomb used to take > 4 GiB


def test_yaml_size_limit_and_utf8_bom(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# " + b"x" * 2000 + b"\n")
    with pytest.raises(BadInput, match="refused: larger than 1000 bytes"):
        load_yaml_file(big, limits=YamlLimits(max_bytes=1000))
    assert load_yaml_text("a: &x {b: 1}\nc: *x\n", "s") == {"a": {"b": 1}, "c": {"b": 1}}  # modest aliases are fine
    bom = tmp_path / "bom.yaml"
    bom.write_bytes("\ufeffrounds: 2\n".encode())
    assert load_yaml_file(bom) == {"rounds": 2}


def test_topology_alias_bomb_and_encoding_are_topology_errors(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    t0 = time.perf_counter()
    with pytest.raises(TopologyError, match="alias bomb"):
        load_topology(bomb)
    assert time.perf_counter() - t0 < 30  # was > 30 s and > 4 GiB; now milliseconds (loose bound: shared CI)
    u16 = tmp_path / "u16.yaml"
    u16.write_bytes((ROOT / "topology" / "ring-4.yaml").read_text().encode("utf-16"))
    with pytest.raises(TopologyError, match="UTF-16"):
        load_topology(u16)


# ---- topology: ids, addresses, binding -------------------------------------------------------------


def _topo(*peers: tuple[str, str]) -> dict:
    ids = [p for p, _ in peers]
    return {"peers": [{"id": i, "address": a} for i, a in peers],
            "edges": [[ids[k], ids[k + 1]] for k in range(len(ids) - 1)]}


TOPOLOGY_CASES = [
    ("peer id CA", _topo(("CA", "127.0.0.1:5000"), ("p1", "127.0.0.1:5001")), "invalid peer id 'CA'"),
    ("peer id ca", _topo(("ca", "127.0.0.1:5000"), ("p1", "127.0.0.1:5001")), "not 'ca'"),
    ("localhost = 127.0.0.1", _topo(("p0", "localhost:5000"), ("p1", "127.0.0.1:5000")),
     "duplicate address '127.0.0.1:5000' (peers 'p0' and 'p1', the same socket as 'localhost:5000')"),
    ("host case", _topo(("p0", "LOCALHOST:5000"), ("p1", "localhost:5000")), "duplicate address"),
    ("dns name case", _topo(("p0", "Peer-A:5000"), ("p1", "peer-a:5000")), "duplicate address"),
    ("ipv6 forms", _topo(("p0", "[::1]:5000"), ("p1", "[0:0:0:0:0:0:0:1]:5000")), "duplicate address"),
    ("ipv4-mapped ipv6", _topo(("p0", "127.0.0.1:5000"), ("p1", "[::ffff:127.0.0.1]:5000")), "duplicate address"),
    ("bogus ipv4", _topo(("p0", "999.1.1.1:5000"), ("p1", "127.0.0.1:5001")), "999.1.1.1 is not an IPv4 address"),
    ("bogus name", _topo(("p0", "a..b:5000"), ("p1", "127.0.0.1:5001")), "is not a valid host name"),
    ("bogus ipv6", _topo(("p0", "[12345::1]:5000"), ("p1", "127.0.0.1:5001")), "is not an IPv6 address"),
    ("unbracketed ipv6", _topo(("p0", "::1:5000"), ("p1", "127.0.0.1:5001")), "malformed address"),
    ("unspecified", _topo(("p0", "0.0.0.0:5000"), ("p1", "127.0.0.1:5001")), "cannot be dialed"),
    ("port 0", _topo(("p0", "127.0.0.1:0"), ("p1", "127.0.0.1:5001")), "port must be 1-65535"),
]


@pytest.mark.parametrize(("data", "needle"), [c[1:] for c in TOPOLOGY_CASES], ids=[c[0] for c in TOPOLOGY_CASES])
def test_bad_topology_is_refused(data: dict, needle: str) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(data, source="t.yaml")
    assert str(info.value).startswith("t.yaml: ") and needle in str(info.value), str(info.value)


@pytest.mark.parametrize(("address", "canonical", "listen"), [
    ("LOCALHOST:5000", "127.0.0.1:5000", "localhost:5000"),  # never all interfaces
    ("localhost:5000", "127.0.0.1:5000", "localhost:5000"),
    ("127.0.0.1:5000", "127.0.0.1:5000", "127.0.0.1:5000"),
    ("[0:0:0:0:0:0:0:1]:5000", "[::1]:5000", "[::1]:5000"),
    ("[::FFFF:127.0.0.1]:5000", "127.0.0.1:5000", "127.0.0.1:5000"),
    ("10.1.2.3:7000", "10.1.2.3:7000", "10.1.2.3:7000"),  # an IP literal: exactly that interface
    ("Peer-3:50051", "peer-3:50051", "[::]:50051"),  # a service name: this container, every interface
])
def test_addresses_normalize_and_bind_exactly(address: str, canonical: str, listen: str) -> None:
    from p2pfl.transport.grpc_transport import bind_address

    assert canonical_address(address) == canonical
    assert listen_address(address) == listen == bind_address(address)


def test_localhost_upper_case_listens_on_loopback_only() -> None:
    """A real server for ``LOCALHOST:PORT`` is reachable on loopback and not on the other interfaces."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port(listen_address(f"LOCALHOST:{free}"))
    server.start()
    try:
        assert port > 0
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        others = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
        others = [a for a in others if not a.startswith("127.")]
        for addr in others:  # an external interface, if this machine has one, must refuse
            with pytest.raises(OSError):
                socket.create_connection((addr, port), timeout=5).close()
    finally:
        server.stop(None)


# ---- sparse mixing ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ring", "grid", "random_regular", "exponential", "random_pull", "directed_ring"])
def test_sparse_matrix_equals_dense(kind: str) -> None:
    topo = generate(kind, 16, k=3 if kind in ("random_regular", "random_pull") else None)
    for mode in ("pull", "push"):
        for rnd in (0, 1):
            sp = topo.sparse_matrix(round=rnd, mode=mode)
            assert np.array_equal(sp.toarray(), topo.mixing_matrix(round=rnd, mode=mode))
            assert np.array_equal(sp.transpose().toarray(), sp.toarray().T)


def test_large_ring_checks_without_a_dense_matrix(tmp_path: Path) -> None:
    """Memory stays O(peers): 4,000 peers here (the dense matrix would be 128 MB); the 20,000-peer
    figures (time, peak RSS) are measured by ``bench/topology_check.py``."""
    from p2pfl.topology.mixing import is_doubly_stochastic, is_symmetric

    n = 4_000
    path = tmp_path / "ring.yaml"
    generate("ring", n, base_port=20_000).dump(path)
    tracemalloc.start()
    try:
        topo = load_topology(path)
        w = topo.sparse_matrix()
        assert is_doubly_stochastic(w) and is_symmetric(w) and w.nnz == 3 * n
        plan = topo.plan("p7", 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert set(plan.in_weights) == {"p6", "p8"}
    assert peak < 64 << 20, peak  # the dense matrix alone is 128 MB


# ---- end to end: the real command --------------------------------------------------------------


def _p2pfl(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pfl.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _main(args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
          ) -> subprocess.CompletedProcess:
    """``p2pfl ARGS`` in this process (cheaper than a subprocess), as a CompletedProcess."""
    from p2pfl.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, int(info.value.code or 0), out.out, out.err)


def _assert_refused(res: subprocess.CompletedProcess, needle: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_cli_simulate_refuses_bad_lr_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    tiny_config(tmp_path)
    res = _p2pfl("simulate", "-c", "config.yaml", "--out", "run", "--set", "algorithm.lr=1e400", cwd=tmp_path)
    _assert_refused(res, "--set: algorithm.lr: must be a finite number, got inf")
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("P2PFL_DEBUG", "0")  # restored after the test (--debug sets it for child processes)
    debug = _main(["simulate", "-c", "config.yaml", "--out", "run", "--set", "algorithm.lr=1e400", "--debug"],
                  tmp_path, monkeypatch, capsys)
    assert debug.returncode == 2 and "Traceback" in debug.stderr and not (tmp_path / "run").exists()
    assert debug.stderr.strip().splitlines()[-1].startswith("error: --set: algorithm.lr")


def test_cli_simulate_partition_refused_after_data_load_leaves_no_folder(tmp_path: Path) -> None:
    tiny_config(tmp_path)
    res = _p2pfl("simulate", "-c", "config.yaml", "--out", "run", "--set",
                 "data.partition={kind: pathological, classes_per_client: 50}", cwd=tmp_path)
    _assert_refused(res, "config.yaml: data.partition: pathological: classes_per_client=50")
    assert not (tmp_path / "run").exists()


def test_cli_node_launch_certs_leave_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    tiny_config(tmp_path, peers=2)
    res = _p2pfl("node", "-c", "config.yaml", "--peer", "p9", "--out", "nodeout", cwd=tmp_path)
    _assert_refused(res, "--peer: peer 'p9' is not in topology")
    res = _main(["node", "-c", "config.yaml", "--peer", "p0", "--out", "nodeout", "--certs", "nocerts"], tmp_path,
                monkeypatch, capsys)
    _assert_refused(res, "--certs: ca.crt, p0.crt, p0.key not found in nocerts")
    assert not (tmp_path / "nodeout").exists()
    # an early runtime failure (its port is taken) exits 1 and leaves no empty --out either
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        topo = yaml.safe_load((tmp_path / "topology.yaml").read_text())
        topo["peers"][0]["address"] = f"127.0.0.1:{busy.getsockname()[1]}"
        (tmp_path / "busy.yaml").write_text(yaml.safe_dump(topo))
        res = _main(["node", "-c", "config.yaml", "--set", "topology=busy.yaml", "--peer", "p0", "--out", "nodeout",
                     "--insecure"], tmp_path, monkeypatch, capsys)
    assert res.returncode == 1 and "cannot listen" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "nodeout").exists()
    topo = yaml.safe_load((tmp_path / "topology.yaml").read_text())
    topo["peers"][0]["id"] = "CA"
    topo["edges"] = [["CA", "p1"]]
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topo))
    res = _main(["certs", "-c", "config.yaml", "--out", "certs"], tmp_path, monkeypatch, capsys)
    _assert_refused(res, "invalid peer id 'CA'")
    res = _p2pfl("launch", "-c", "config.yaml", "--out", "run", cwd=tmp_path)
    _assert_refused(res, "invalid peer id 'CA'")
    assert not (tmp_path / "certs").exists() and not (tmp_path / "run").exists()


def test_cli_usage_errors_and_listings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    res = _p2pfl("simulate", cwd=tmp_path)
    _assert_refused(res, "p2pfl simulate: Missing option '--config'")
    res = _main(["simulate", "-c", "c.yaml", "--rounds", "many"], tmp_path, monkeypatch, capsys)
    _assert_refused(res, "Invalid value for '--rounds'")
    res = _main(["algorithms"], tmp_path, monkeypatch, capsys)
    assert res.returncode == 0 and "deprl" in res.stdout and "lr_head" in res.stdout and "deprl-paper" in res.stdout
    res = _main(["algorithms", "dfedavgg"], tmp_path, monkeypatch, capsys)
    _assert_refused(res, "did you mean 'dfedavg'?")
    res = _main(["models"], tmp_path, monkeypatch, capsys)
    assert res.returncode == 0 and "resnet18" in res.stdout
    res = _main(["datasets"], tmp_path, monkeypatch, capsys)
    assert res.returncode == 0 and "fashion_mnist" in res.stdout and "dirichlet" in res.stdout
    bad_topo = tmp_path / "t.yaml"
    bad_topo.write_bytes("peers: []\n".encode("utf-16"))
    res = _main(["topology", "check", str(bad_topo)], tmp_path, monkeypatch, capsys)
    _assert_refused(res, "encoding: the file is UTF-16")
