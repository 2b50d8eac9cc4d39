"""`p2pfl compose`: the generated docker-compose.yml matches the topology, validates with docker-compose,
references certificate files that `make_certs` creates, and the committed example is current.

Also checks the container pieces that can be checked without a docker engine: the entrypoint builds
the right `p2pfl node` / `p2pfl health` command lines, and the Dockerfile keeps its promises
(non-root user, gRPC health check, entrypoint).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from p2pfl.cli.compose import compose_command
from p2pfl.deploy.compose import (
    IN_ADDRESSES,
    IN_CERTS,
    IN_TOPOLOGY,
    ComposeError,
    compose_topology,
    render_compose,
    service_name,
)
from p2pfl.security.certs import make_certs
from p2pfl.topology import load_topology, parse_topology
from p2pfl.topology.addressbook import placed_topology
from tests.conftest import tiny_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIG = REPO / "peers" / "compose-ring4.yaml"
COMMITTED = REPO / "docker-compose.yml"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
DOCKERFILE = REPO / "docker" / "Dockerfile"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repo root: the example config names its topology relative to it (as `make demo` does)."""
    monkeypatch.chdir(REPO)


def _cli() -> typer.Typer:
    """`compose_command` as a one-command app (cli.py registers it as `p2pfl compose`)."""
    app = typer.Typer(add_completion=False)
    app.command()(compose_command)
    return app


def _bind_sources(service: dict[str, Any], base: Path) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (short syntax, relative to ``base``)."""
    out = {}
    for vol in service["volumes"]:
        src, target = vol.split(":")[:2]
        out[target] = (base / src).resolve()
    return out


def _docker_compose_config(path: Path) -> dict[str, Any]:
    """`docker-compose -f FILE config`: compose's own validation; returns the resolved document."""
    exe = shutil.which("docker-compose")
    if exe is None:
        reason = "docker-compose binary not found (apt-get install docker-compose)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    res = subprocess.run([exe, "-f", str(path), "config"], capture_output=True, text=True, timeout=60,
                         cwd=path.parent, env={**os.environ, "P2PFL_UID": "1234", "P2PFL_GID": "1234"})
    assert res.returncode == 0, f"docker-compose config failed:\n{res.stderr}\n{res.stdout}"
    print(res.stderr, end="")  # compose's warnings, if any, in the test log
    return yaml.safe_load(res.stdout)


# ---- the committed example ------------------------------------------------------------------------


def test_committed_compose_file_is_current() -> None:
    dep = render_compose(Path("peers/compose-ring4.yaml"), out=Path("docker-compose.yml"))
    assert dep.address_book is None, "the example topology must already use service-name addresses"
    assert COMMITTED.read_text(encoding="utf-8") == dep.text, (
        "docker-compose.yml is stale: regenerate it from the repo root with "
        "`p2pfl compose --config peers/compose-ring4.yaml --out docker-compose.yml`"
    )


def test_committed_compose_file_validates_and_matches_topology() -> None:
    resolved = _docker_compose_config(COMMITTED)
    doc = yaml.safe_load(COMMITTED.read_text())
    topo = load_topology(REPO / doc["x-p2pfl"]["topology"])
    assert set(resolved["services"]) == {p.address.split(":")[0] for p in topo.peers}
    for svc in resolved["services"].values():
        assert svc["user"] == "1234:1234"  # the uid comes from the environment of `docker compose`
    assert len(topo.peers) == 4 and topo.name == "compose-ring-4"


# ---- generated files ------------------------------------------------------------------------------


def _check_deployment(compose_file: Path, ids: list[str]) -> dict[str, Any]:
    """Every peer has a service, its address is that service, and the service runs that peer."""
    base = compose_file.parent
    doc = yaml.safe_load(compose_file.read_text())
    services = doc["services"]
    mounted_topologies = {_bind_sources(svc, base)[IN_TOPOLOGY] for svc in services.values()}
    assert len(mounted_topologies) == 1, "every container must mount the same topology file"
    books = {_bind_sources(svc, base).get(IN_ADDRESSES) for svc in services.values()}
    assert len(books) == 1, "every container must mount the same address book (or none)"
    book = books.pop()
    topo = placed_topology(mounted_topologies.pop(), book)
    assert list(topo.ids) == ids
    assert len(services) == len(ids)
    for peer in topo.peers:
        host, port = peer.address.rsplit(":", 1)
        assert host in services, f"peer {peer.id} dials {host}, which is not a service"
        svc = services[host]
        assert svc["environment"]["P2PFL_PEER"] == peer.id
        assert svc["environment"]["P2PFL_PORT"] == port
        assert svc["expose"] == [port]
        assert svc["restart"] == "on-failure:3"  # bounded: a peer that crashes at every start gives up
        assert svc["cpus"] > 0 and svc["mem_limit"]
        assert svc["healthcheck"]["test"] == ["CMD", "p2pfl-entrypoint", "--healthcheck"]
        assert "depends_on" not in svc  # cyclic graphs: peers wait for each other instead
        assert svc["command"][-2:] == (["--set", f"topology={IN_TOPOLOGY}"] if book is None
                                       else ["--set", f"network.addresses={IN_ADDRESSES}"])
    assert doc["x-p2pfl"]["topology_hash"] == topo.hash()
    assert "version" not in doc  # obsolete in the Compose Specification
    # one service builds the image (compose would build it once per service), all run it by its tag
    builders = [name for name, svc in services.items() if "build" in svc]
    assert builders == [sorted(services)[0]]
    build = services[builders[0]]["build"]
    assert build["dockerfile"] == "docker/Dockerfile"
    assert (base / build["context"] / "docker" / "Dockerfile").is_file()
    assert len({svc["image"] for svc in services.values()}) == 1
    return doc


def test_generated_compose_validates(tmp_path: Path) -> None:
    out = tmp_path / "deploy" / "docker-compose.yml"
    res = CliRunner().invoke(_cli(), ["--config", str(EXAMPLE_CONFIG), "--out", str(out), "--set", "rounds=3"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "p2pfl certs" in res.output  # certificates are missing: the command says how to make them
    resolved = _docker_compose_config(out)
    assert sorted(resolved["services"]) == ["peer-p0", "peer-p1", "peer-p2", "peer-p3"]
    doc = _check_deployment(out, ["p0", "p1", "p2", "p3"])
    assert doc["services"]["peer-p0"]["command"] == ["--set", "rounds=3", "--set", f"topology={IN_TOPOLOGY}"]
    # made by the generator (owned by the user), so the docker daemon does not create them as root
    assert (out.parent / "runs" / "compose-ring4").is_dir() and (out.parent / "data").is_dir()


def test_cert_paths_exist_after_make_certs(tmp_path: Path) -> None:
    out = tmp_path / "docker-compose.yml"
    dep = render_compose(EXAMPLE_CONFIG, out=out, certs=tmp_path / "certs")
    out.write_text(dep.text)
    make_certs(list(dep.topology.ids), tmp_path / "certs")
    doc = yaml.safe_load(out.read_text())
    for pid, name in dep.services.items():
        mounts = _bind_sources(doc["services"][name], tmp_path)
        certs = {target: src for target, src in mounts.items() if target.startswith(IN_CERTS + "/")}
        assert set(certs) == {f"{IN_CERTS}/ca.crt", f"{IN_CERTS}/{pid}.crt", f"{IN_CERTS}/{pid}.key"}
        for src in certs.values():
            assert src.is_file(), f"{name} mounts {src}, which make_certs did not create"
        vols = doc["services"][name]["volumes"]
        assert all(v.endswith(":ro") for v in vols if IN_CERTS in v)
        others = [q for q in dep.services if q != pid]
        assert not any(f"/{q}.key" in v for v in vols for q in others), "a container must not see other keys"


def test_loopback_topology_is_placed_by_an_address_book(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, peers=5)  # 127.0.0.1:50050.. addresses
    before = (tmp_path / "topology.yaml").read_text()
    out = tmp_path / "deploy" / "compose.yml"
    res = CliRunner().invoke(_cli(), ["--config", str(cfg), "--out", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    book = out.parent / "compose.addresses.yaml"
    assert (tmp_path / "topology.yaml").read_text() == before  # never rewritten
    assert not (out.parent / "compose.topology.yaml").exists()
    original, placed = load_topology(tmp_path / "topology.yaml"), placed_topology(tmp_path / "topology.yaml", book)
    assert placed.hash() == original.hash() and placed.edges == original.edges
    assert [p.address for p in placed.peers] == [f"peer-p{i}:{50050 + i}" for i in range(5)]
    assert yaml.safe_load(out.read_text())["x-p2pfl"]["addresses"] == "./compose.addresses.yaml"
    _check_deployment(out, [f"p{i}" for i in range(5)])
    _docker_compose_config(out)


def _devices(doc: dict[str, Any]) -> dict[str, Any]:
    return {svc["environment"]["P2PFL_PEER"]: svc["deploy"]["resources"]["reservations"]["devices"]
            for svc in doc["services"].values()}


def test_gpus_give_each_peer_its_own_device_and_validate(tmp_path: Path) -> None:
    out = tmp_path / "docker-compose.yml"
    dep = render_compose(EXAMPLE_CONFIG, out=out, gpus="4")
    out.write_text(dep.text)
    resolved = _docker_compose_config(out)
    devs = _devices(resolved)
    assert {pid: d[0]["device_ids"] for pid, d in devs.items()} == {"p0": ["0"], "p1": ["1"], "p2": ["2"], "p3": ["3"]}
    assert all(d[0]["driver"] == "nvidia" and d[0]["capabilities"] == ["gpu"] and "count" not in d[0]
               for d in devs.values())
    for svc in resolved["services"].values():
        assert svc["image"] == "p2pfl:cuda"
    assert resolved["services"]["peer-p0"]["build"]["args"]["TORCH_INDEX"].startswith("https://download.pytorch.org/whl/cu")
    # fewer GPUs than peers: round-robin; an explicit list; an explicit mapping; every GPU for every peer
    two = _devices(yaml.safe_load(render_compose(EXAMPLE_CONFIG, out=out, gpus="2").text))
    assert [two[p][0]["device_ids"] for p in ("p0", "p1", "p2", "p3")] == [["0"], ["1"], ["0"], ["1"]]
    listed = _devices(yaml.safe_load(render_compose(EXAMPLE_CONFIG, out=out, gpus="3,5").text))
    assert [listed[p][0]["device_ids"] for p in ("p0", "p1", "p2", "p3")] == [["3"], ["5"], ["3"], ["5"]]
    mapped = _devices(yaml.safe_load(render_compose(EXAMPLE_CONFIG, out=out, gpus="p0=1,p1=1,p2=0,p3=2").text))
    assert [mapped[p][0]["device_ids"] for p in ("p0", "p1", "p2", "p3")] == [["1"], ["1"], ["0"], ["2"]]
    every = _devices(yaml.safe_load(render_compose(EXAMPLE_CONFIG, out=out, gpus="all").text))
    assert all(d == [{"capabilities": ["gpu"], "count": "all", "driver": "nvidia"}] for d in every.values())
    plain = yaml.safe_load(render_compose(EXAMPLE_CONFIG, out=out).text)
    assert all("deploy" not in s and s["image"] == "p2pfl:cpu" for s in plain["services"].values())
    assert "args" not in plain["services"]["peer-p0"]["build"]
    for bad, msg in (("p0=0", "no device for"), ("p9=0,p0=0,p1=0,p2=0,p3=0", "unknown peers"), ("0,0", "distinct"),
                     ("x", "expected all, auto"), ("0", "at least 1")):
        with pytest.raises(ComposeError, match=msg):
            render_compose(EXAMPLE_CONFIG, out=out, gpus=bad)


def test_host_network_keeps_loopback_addresses_and_validates(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, peers=4, base_port=47100)
    out = tmp_path / "deploy" / "docker-compose.yml"
    res = CliRunner().invoke(_cli(), ["--config", str(cfg), "--out", str(out), "--network", "host",
                                      "--metrics-port", "47200", "--cpus", "0.5", "--memory", "1g",
                                      "--restarts", "5"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert not (out.parent / "docker-compose.addresses.yaml").exists()  # used as they are: no address book
    resolved = _docker_compose_config(out)
    doc = yaml.safe_load(out.read_text())
    assert doc["x-p2pfl"]["network"] == "host"
    assert doc["x-p2pfl"]["metrics"] == {f"p{i}": f"127.0.0.1:{47200 + i}" for i in range(4)}
    for i, name in enumerate(sorted(resolved["services"])):
        svc = resolved["services"][name]
        assert name == f"peer-p{i}" and svc["network_mode"] == "host"
        assert "expose" not in svc and "ports" not in svc
        assert svc["environment"]["P2PFL_PORT"] == str(47100 + i)
        assert svc["environment"]["P2PFL_METRICS_PORT"] == str(47200 + i)
        assert svc["environment"]["P2PFL_METRICS_HOST"] == "127.0.0.1"
        assert svc["restart"] == "on-failure:5" and svc["cpus"] == 0.5 and svc["mem_limit"] in ("1g", 1073741824)
    assert doc["services"]["peer-p0"]["build"]["network"] == "host"
    mounted = _bind_sources(doc["services"]["peer-p0"], out.parent)[IN_TOPOLOGY]
    assert [p.address for p in load_topology(mounted).peers] == [f"127.0.0.1:{47100 + i}" for i in range(4)]
    # the regeneration command in the header reproduces the file
    assert "--network host --cpus 0.5 --memory 1g --restarts 5 --metrics-port 47200" in out.read_text()
    # peers sharing the host's network need distinct ports; metrics ports must not collide with them
    shared = parse_topology({"peers": [{"id": "a", "address": "127.0.0.1:7000"}, {"id": "b", "address": "10.0.0.1:7000"}],
                             "edges": [["a", "b"]]})
    shared.dump(tmp_path / "shared.yaml")
    with pytest.raises(ComposeError, match="distinct ports"):
        render_compose(cfg, out=out, network="host", sets=[f"topology={tmp_path / 'shared.yaml'}"])
    with pytest.raises(ComposeError, match="collide"):
        render_compose(cfg, out=out, network="host", metrics_port=47098)
    for kw, msg in (({"network": "bridge"}, "expected one of"), ({"cpus": 0}, "cpus"), ({"memory": "lots"}, "memory"),
                    ({"restarts": 0}, "restarts")):
        with pytest.raises(ComposeError, match=msg):
            render_compose(cfg, out=out, **kw)


def test_insecure_mounts_no_certs_and_config_insecure_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "docker-compose.yml"
    doc = yaml.safe_load(render_compose(EXAMPLE_CONFIG, out=out, insecure=True).text)
    for svc in doc["services"].values():
        assert svc["environment"]["P2PFL_INSECURE"] == "1"
        assert not any(IN_CERTS in v for v in svc["volumes"])
    with pytest.raises(ComposeError, match="mutual TLS"):
        render_compose(EXAMPLE_CONFIG, out=out, sets=["network.insecure=true"])


def test_output_is_deterministic_and_escapes_dollars(tmp_path: Path) -> None:
    out = tmp_path / "docker-compose.yml"
    a = render_compose(EXAMPLE_CONFIG, out=out, sets=["name=x$y", "rounds=2"]).text
    b = render_compose(EXAMPLE_CONFIG, out=out, sets=["name=x$y", "rounds=2"]).text
    assert a == b
    doc = yaml.safe_load(a)
    assert doc["services"]["peer-p0"]["command"][:2] == ["--set", "name=x$$y"]  # compose turns $$ into $
    assert list(doc["services"]) == sorted(doc["services"])


def test_service_names() -> None:
    assert service_name("p0") == "peer-p0"
    assert service_name("Site_A.gpu") == "peer-site-a-gpu"
    with pytest.raises(ComposeError, match="service"):
        service_name("x" * 63)
    topo = parse_topology({"peers": [{"id": "a_b", "address": "127.0.0.1:1"}, {"id": "a-b", "address": "127.0.0.1:2"}],
                           "edges": [["a_b", "a-b"]]})
    with pytest.raises(ComposeError, match="both run as service 'peer-a-b'"):
        compose_topology(topo)
    kept = parse_topology({"peers": [{"id": "a", "address": "alpha:7000"}, {"id": "b", "address": "beta:7000"}],
                           "edges": [["a", "b"]]})
    assert compose_topology(kept) == (kept, False)
    # hosts that are IPs, localhost or shared by two peers are rewritten
    shared = parse_topology({"peers": [{"id": "a", "address": "node1:7000"}, {"id": "b", "address": "node1:7001"}],
                             "edges": [["a", "b"]]})
    assert [p.address for p in compose_topology(shared)[0].peers] == ["peer-a:7000", "peer-b:7001"]


def test_bad_config_is_a_clean_error(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "p2pfl.cli", "compose", "--config", str(tmp_path / "nope.yaml"),
                          "--out", str(tmp_path / "c.yml")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 2 and "not found" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "c.yml").exists()
    res = subprocess.run([sys.executable, "-m", "p2pfl.cli", "compose", "--config", str(EXAMPLE_CONFIG),
                          "--out", str(tmp_path / "c.yml"), "--gpus", "p0=0"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert res.returncode == 2 and "no device for" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1  # one line, the project's error style
    assert not (tmp_path / "c.yml").exists()


# ---- container pieces -----------------------------------------------------------------------------


def _fake_p2pfl(tmp_path: Path) -> dict[str, str]:
    """A PATH whose `p2pfl` and `python3` print their arguments, one per line, so the entrypoint's
    command can be read."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("p2pfl", "python3"):
        fake = bin_dir / name
        fake.write_text(f'#!/bin/sh\necho "EXE:{name}"\nfor a in "$@"; do echo "ARG:$a"; done\n')
        fake.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}


def _entry(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env, timeout=30)


def _argv(res: subprocess.CompletedProcess[str]) -> list[str]:
    return [line[4:] for line in res.stdout.splitlines() if line.startswith("ARG:")]


def test_entrypoint_runs_node_with_tls(tmp_path: Path) -> None:
    env = _fake_p2pfl(tmp_path)
    certs, run = tmp_path / "certs", tmp_path / "run"
    make_certs(["p0", "p1"], certs)
    cfg = tmp_path / "config.yaml"
    cfg.write_text("name: x\n")
    env.update(P2PFL_PEER="p0", P2PFL_CONFIG=str(cfg), P2PFL_CERTS=str(certs), P2PFL_RUN_DIR=str(run),
               P2PFL_PORT="50051")
    res = _entry(["--set", "topology=/p2pfl/topology.yaml"], env)
    assert res.returncode == 0, res.stderr
    assert _argv(res) == ["node", "--config", str(cfg), "--peer", "p0", "--out", str(run), "--certs", str(certs),
                          "--set", "topology=/p2pfl/topology.yaml"]
    assert run.is_dir()
    env.update(P2PFL_METRICS_PORT="9400", P2PFL_METRICS_HOST="0.0.0.0")
    res = _entry([], env)
    assert _argv(res)[-4:] == ["--metrics-port", "9400", "--metrics-host", "0.0.0.0"]
    # the healthcheck is the light probe module, not the CLI (no torch/Flower import every 10 s)
    res = _entry(["--healthcheck"], env)
    assert res.returncode == 0 and "EXE:python3" in res.stdout
    assert _argv(res) == ["-m", "p2pfl.health", "127.0.0.1:50051", "--certs", str(certs), "--peer", "p0"]
    res = _entry(["certs", "--config", "c.yaml"], env)  # other subcommands pass through to p2pfl
    assert _argv(res) == ["certs", "--config", "c.yaml"]


def test_entrypoint_reports_misconfiguration(tmp_path: Path) -> None:
    env = _fake_p2pfl(tmp_path)
    cfg = tmp_path / "config.yaml"
    cfg.write_text("name: x\n")
    res = _entry([], env)
    assert res.returncode == 1 and "P2PFL_PEER" in res.stderr
    env.update(P2PFL_PEER="p0", P2PFL_CONFIG=str(cfg), P2PFL_CERTS=str(tmp_path / "certs"),
               P2PFL_RUN_DIR=str(tmp_path / "run"))
    (tmp_path / "certs" / "p0.key").mkdir(parents=True)  # what docker does when the host file is missing
    (tmp_path / "certs" / "ca.crt").write_text("x")
    (tmp_path / "certs" / "p0.crt").write_text("x")
    res = _entry([], env)
    assert res.returncode == 1 and "is a folder" in res.stderr and "p2pfl certs" in res.stderr
    assert _argv(res) == []
    env["P2PFL_INSECURE"] = "true"
    res = _entry([], env)
    assert res.returncode == 0 and "--insecure" in _argv(res) and "--certs" not in _argv(res)


def test_dockerfile_promises() -> None:
    text = DOCKERFILE.read_text()
    # a base made locally (docker/base-image.sh: debootstrap + docker import), no registry pull
    assert "ARG BASE=p2pfl-base:bookworm" in text and "FROM ${BASE}" in text
    assert "p2pfl-base:bookworm" in (REPO / "docker" / "base-image.sh").read_text()
    # wheels from the wheelhouse (offline), CUDA by build argument; the wheels stay in the builder stage
    assert "--no-index --find-links /tmp/wheels" in text and "ARG TORCH_INDEX=" in text
    final = text[text.rindex("\nFROM "):]
    assert "/tmp/wheels" not in final and "COPY --from=builder /opt/p2pfl /opt/p2pfl" in final
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the peer must not run as root"
    assert "HEALTHCHECK" in text and "--healthcheck" in text
    assert 'ENTRYPOINT ["p2pfl-entrypoint"]' in text
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR, "docker/entrypoint.sh must be executable"
    assert subprocess.run(["bash", "-n", str(ENTRYPOINT)]).returncode == 0
    ignore = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert ignore[0] == "*", ".dockerignore must be an allowlist (keys never enter the build context)"
    assert "**/*.key" in ignore
    assert "!docker/wheelhouse/" in ignore and "!docker/peer_requirements.py" in ignore


def test_peer_image_carries_only_what_a_peer_imports() -> None:
    """The image installs docker/peer_requirements.py's list: pyproject's dependencies minus the Flower
    server stack, torchvision and matplotlib; `p2pfl node` and the health probe must not need them."""
    res = subprocess.run([sys.executable, str(REPO / "docker" / "peer_requirements.py")], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    reqs = res.stdout.split()
    names = {r.split(">")[0].split("=")[0].split("<")[0].lower() for r in reqs}
    assert not names & {"flwr", "torchvision", "matplotlib", "torch"}
    assert {"grpcio", "grpcio-health-checking", "cryptography", "numpy", "pyyaml"} <= names
    code = ("import sys; import p2pfl.cli as c; c._mount(['node']); "
            "import p2pfl.node_process, p2pfl.experiment, p2pfl.modelpool, p2pfl.runfolder, p2pfl.node, "
            "p2pfl.transport.grpc_transport, p2pfl.node_metrics, p2pfl.health, p2pfl.checkpoint; "
            "print(sorted(m for m in ('flwr', 'torchvision', 'matplotlib') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"a peer imports {res.stdout.strip()}, which the peer image leaves out"


def test_module_imports_lazily() -> None:
    """Registering `p2pfl compose` must not import numpy/networkx/the config loader."""
    code = ("import sys, p2pfl.deploy.compose; "
            "bad = [m for m in ('numpy', 'networkx', 'p2pfl.topology', 'p2pfl.config') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_clientapp_config_gets_the_flower_image_and_its_package(tmp_path: Path) -> None:
    """A config naming a Flower ClientApp runs on the Flower variant of the image (FLOWER=1 build argument),
    with the app's package mounted read-only on the containers' PYTHONPATH; a built-in config does not."""
    out = tmp_path / "deploy" / "docker-compose.yml"
    doc = yaml.safe_load(render_compose(REPO / "peers" / "quickstart.yaml", out=out, network="host").text)
    services = doc["services"]
    assert {svc["image"] for svc in services.values()} == {"p2pfl:cpu-flower"}
    builders = [svc for svc in services.values() if "build" in svc]
    assert len(builders) == 1 and builders[0]["build"]["args"] == {"FLOWER": "1"}
    for svc in services.values():
        assert svc["environment"]["PYTHONPATH"] == "/p2pfl/app"
        mounts = _bind_sources(svc, out.parent)
        assert mounts["/p2pfl/app/peers"] == (REPO / "peers").resolve()
        assert next(v for v in svc["volumes"] if v.split(":")[1] == "/p2pfl/app/peers").endswith(":ro")
    plain = yaml.safe_load(render_compose(EXAMPLE_CONFIG, out=out).text)["services"]
    assert all("PYTHONPATH" not in svc["environment"] and svc["image"] == "p2pfl:cpu" for svc in plain.values())
    assert all("args" not in svc.get("build", {}) for svc in plain.values())
    # the Flower variant's requirement list keeps flwr; the default one leaves it out
    res = subprocess.run([sys.executable, str(REPO / "docker" / "peer_requirements.py"), "--flower"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and any(r.startswith("flwr") for r in res.stdout.split()), res.stderr


def test_clientapp_whose_package_cannot_be_found_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "app.yaml"
    text = (REPO / "peers" / "quickstart.yaml").read_text().replace("peers.quickstart:app", "nosuchpkg_x.mod:app")
    cfg.write_text(text.replace("topology/ring-8.yaml", str(REPO / "topology" / "ring-8.yaml")))
    with pytest.raises(ComposeError, match="cannot find 'nosuchpkg_x'"):
        render_compose(cfg, out=tmp_path / "d" / "docker-compose.yml", network="host")
    assert not (tmp_path / "d").exists()


def test_a_flower_app_directory_is_mounted_and_named_for_the_containers(tmp_path: Path) -> None:
    """`app:` naming a Flower App directory: the directory is mounted read-only at one container path and
    every container is told `--set app=` that path (a host path given with --set is not passed on); the app's
    own package (here app_init's) is imported from the directory, not mounted again on the PYTHONPATH."""
    from p2pfl.topology import generate

    app = REPO / "tests" / "apps" / "flower_legacy_app"
    generate("ring", 3).dump(tmp_path / "topology.yaml")
    cfg = tmp_path / "app.yaml"
    cfg.write_text(yaml.safe_dump({"name": "appdir", "rounds": 2, "topology": "topology.yaml",
                                   "app": os.path.relpath(app, tmp_path), "app_init": "flower_legacy_app.task:Net"}))
    out = tmp_path / "deploy" / "docker-compose.yml"
    doc = yaml.safe_load(render_compose(cfg, out=out, sets=[f"app={app}", "rounds=3"]).text)
    services = doc["services"]
    assert len(services) == 3 and {svc["image"] for svc in services.values()} == {"p2pfl:cpu-flower"}
    assert [svc["build"]["args"] for svc in services.values() if "build" in svc] == [{"FLOWER": "1"}]
    for svc in services.values():
        mounts = _bind_sources(svc, out.parent)
        assert mounts["/p2pfl/flower-app"] == app.resolve()
        assert next(v for v in svc["volumes"] if v.split(":")[1] == "/p2pfl/flower-app").endswith(":ro")
        assert not any(t.startswith("/p2pfl/app/") for t in mounts)  # flower_legacy_app is the directory's
        sets = [svc["command"][i + 1] for i, a in enumerate(svc["command"]) if a == "--set"]
        assert [s for s in sets if s.startswith("app=")] == ["app=/p2pfl/flower-app"] and "rounds=3" in sets
