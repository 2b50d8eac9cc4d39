"""`p2pfl k8s`: the manifests are consistent Kubernetes objects, checked offline (no kubectl here).

The checks are the ones the API server and the kubelet would make first: every object has an
apiVersion/kind/name, names are DNS labels, each StatefulSet's selector matches its pod labels and names
the headless Service, every volumeMount names a volume or claim template, every ConfigMap/Secret a pod
uses exists with the keys it mounts, probes and Service target ports name container ports. And the
p2pfl-specific promises: one pod per peer, each pod mounts only its own key, the topology in the
ConfigMap points every peer at its pod's DNS name, GPUs are requested per pod.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from p2pfl.cli.k8s import k8s_command
from p2pfl.deploy.compose import ComposeError
from p2pfl.deploy.k8s import APP_MAX_BYTES, GRPC_PORT, SERVICE, render_k8s
from p2pfl.security.certs import make_certs
from p2pfl.topology import load_topology, parse_topology
from p2pfl.topology.addressbook import parse_address_book

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIG = REPO / "peers" / "compose-ring4.yaml"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")  # a ConfigMap key
KINDS = {("v1", "ConfigMap"), ("v1", "Service"), ("v1", "Secret"), ("apps/v1", "StatefulSet")}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def validate(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Offline schema and cross-reference checks; returns (kind, name) -> object."""
    objs: dict[tuple[str, str], dict[str, Any]] = {}
    for d in docs:
        assert (d.get("apiVersion"), d.get("kind")) in KINDS, d.get("kind")
        name = d["metadata"]["name"]
        assert DNS_LABEL.match(name), name
        assert (d["kind"], name) not in objs, f"duplicate {d['kind']} {name}"
        objs[(d["kind"], name)] = d
    for (kind, name), d in objs.items():
        if kind == "Service":
            spec = d["spec"]
            assert spec["clusterIP"] == "None"  # headless: one DNS record per pod
            assert all(isinstance(p["port"], int) and p["name"] for p in spec["ports"])
        if kind == "ConfigMap" or kind == "Secret":
            assert all(isinstance(v, str) for v in d["data"].values())
        if kind == "Secret":
            for v in d["data"].values():
                base64.b64decode(v, validate=True)
        if kind != "StatefulSet":
            continue
        spec = d["spec"]
        assert spec["replicas"] == 1
        svc = objs[("Service", spec["serviceName"])]
        pod = spec["template"]
        labels = pod["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), "selector must match the pod labels"
        assert svc["spec"]["selector"].items() <= labels.items(), "the headless service must select the pod"
        pspec = pod["spec"]
        volumes = {v["name"]: v for v in pspec["volumes"]}
        claims = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])}
        assert not set(volumes) & claims
        for c in pspec["containers"]:
            assert c["name"] and c["image"]
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for sp in svc["spec"]["ports"]:
                assert sp["targetPort"] in ports, f"service port {sp['name']} targets no container port"
            for probe in ("readinessProbe", "livenessProbe"):
                assert c[probe]["exec"]["command"] == ["p2pfl-entrypoint", "--healthcheck"]
            for m in c["volumeMounts"]:
                assert m["name"] in volumes or m["name"] in claims, f"{name}: mount {m['name']} has no volume"
                vol = volumes.get(m["name"], {})
                if "configMap" in vol:
                    cm = objs[("ConfigMap", vol["configMap"]["name"])]
                    items = vol["configMap"].get("items")
                    if items is None or "subPath" in m:
                        assert m.get("subPath") in cm["data"], f"{name}: ConfigMap has no key {m.get('subPath')}"
                    for item in items or []:  # keys cannot hold '/': each item maps a key to a relative path
                        assert item["key"] in cm["data"] and DNS_KEY.match(item["key"]), item["key"]
                        assert not item["path"].startswith("/") and ".." not in item["path"].split("/")
                    assert len({item["path"] for item in items or []}) == len(items or [])
            for key in ("requests", "limits"):
                assert set(c["resources"][key]) >= {"cpu", "memory"}
            env = {e["name"]: e["value"] for e in c["env"]}
            assert all(isinstance(v, str) for v in env.values())
    return objs


def _env(sts: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_manifests_validate_and_give_each_peer_its_pod_key_and_address(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    make_certs(["p0", "p1", "p2", "p3"], certs)
    man = render_k8s(EXAMPLE_CONFIG, sets=["rounds=5"], certs=certs, namespace="fl")
    objs = validate(man.documents + man.secrets)
    sts = {d["metadata"]["name"]: d for d in man.documents if d["kind"] == "StatefulSet"}
    assert sorted(sts) == ["peer-p0", "peer-p1", "peer-p2", "peer-p3"]
    assert all(d["metadata"]["namespace"] == "fl" for d in man.documents + man.secrets)
    # the pods read the topology file unchanged (same graph hash everywhere) and an address book
    # placing each peer at its own pod's stable DNS name behind the headless service
    data = objs[("ConfigMap", "p2pfl-config")]["data"]
    assert data["topology.yaml"] == (REPO / "topology" / "compose-ring-4.yaml").read_text()
    topo = parse_address_book(yaml.safe_load(data["addresses.yaml"])).place(parse_topology(yaml.safe_load(
        data["topology.yaml"])))
    assert topo.hash() == load_topology(REPO / "topology" / "compose-ring-4.yaml").hash()
    for peer in topo.peers:
        assert peer.address == f"peer-{peer.id}-0.{SERVICE}:{GRPC_PORT}"
        s = sts[f"peer-{peer.id}"]
        assert f"peer-{peer.id}-0" == f"{s['metadata']['name']}-0" and s["spec"]["serviceName"] == SERVICE
        env = _env(s)
        assert env["P2PFL_PEER"] == peer.id and env["P2PFL_PORT"] == str(GRPC_PORT)
        assert env["P2PFL_METRICS_HOST"] == "0.0.0.0"
        args = s["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args == ["--set", "rounds=5", "--set", "topology=/p2pfl/topology.yaml",
                        "--set", "network.addresses=/p2pfl/addresses.yaml"]
        mounts = {m["mountPath"]: m["subPath"] for m in s["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                  if m["name"] == "config"}
        assert mounts["/p2pfl/addresses.yaml"] == "addresses.yaml"
        # only its own key: the Secret it mounts holds exactly ca.crt and its certificate and key
        (secret_vol,) = [v for v in s["spec"]["template"]["spec"]["volumes"] if "secret" in v]
        secret = objs[("Secret", secret_vol["secret"]["secretName"])]
        assert set(secret["data"]) == {"ca.crt", f"{peer.id}.crt", f"{peer.id}.key"}
        assert base64.b64decode(secret["data"][f"{peer.id}.key"]) == (certs / f"{peer.id}.key").read_bytes()
        assert s["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        assert "nvidia.com/gpu" not in s["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    # the pods read the original config (with its own relative topology path), overridden by --set
    assert yaml.safe_load(objs[("ConfigMap", "p2pfl-config")]["data"]["config.yaml"])["name"] == "compose-ring4"


def test_gpus_are_requested_per_pod() -> None:
    man = render_k8s(EXAMPLE_CONFIG, gpus=1)
    for d in man.documents:
        if d["kind"] == "StatefulSet":
            c = d["spec"]["template"]["spec"]["containers"][0]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
            assert c["image"] == "p2pfl:cuda"


def test_command_writes_manifests_and_private_secrets(tmp_path: Path) -> None:
    import typer

    app = typer.Typer(add_completion=False)
    app.command()(k8s_command)
    certs = tmp_path / "certs"
    make_certs(["p0", "p1", "p2", "p3"], certs)
    out = tmp_path / "k8s"
    res = CliRunner().invoke(app, ["--config", str(EXAMPLE_CONFIG), "--out", str(out), "--certs", str(certs),
                                   "--image", "registry.example/p2pfl:cpu"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    docs = list(yaml.safe_load_all((out / "p2pfl.yaml").read_text()))
    secrets = list(yaml.safe_load_all((out / "secrets.yaml").read_text()))
    docs, secrets = [d for d in docs if d], [s for s in secrets if s]
    assert not any(d["kind"] == "Secret" for d in docs), "keys must stay out of the main manifest"
    assert stat.S_IMODE((out / "secrets.yaml").stat().st_mode) == 0o600
    validate(docs + secrets)
    assert {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in docs if d["kind"] == "StatefulSet"} == {
        "registry.example/p2pfl:cpu"}
    # without --certs: no secrets.yaml, the output says how to make them
    out2 = tmp_path / "k8s2"
    res = CliRunner().invoke(app, ["--config", str(EXAMPLE_CONFIG), "--out", str(out2)], catch_exceptions=False)
    assert res.exit_code == 0 and "kubectl create secret generic p2pfl-certs-p0" in res.output
    assert not (out2 / "secrets.yaml").exists()


def test_bad_options_are_refused(tmp_path: Path) -> None:
    for kw, msg in (({"memory": "lots"}, "quantity"), ({"gpus": -1}, ">= 0"), ({"namespace": "Bad_NS"}, "DNS label"),
                    ({"certs": tmp_path}, "not found")):
        with pytest.raises(ComposeError, match=msg):
            render_k8s(EXAMPLE_CONFIG, **kw)


APP = REPO / "tests" / "apps" / "flower_bn_app"


def _app_config(tmp_path: Path, app: Path) -> Path:
    from p2pfl.topology import generate

    generate("ring", 3).dump(tmp_path / "topology.yaml")
    cfg = tmp_path / "app.yaml"
    cfg.write_text(yaml.safe_dump({"name": "appdir", "rounds": 2, "topology": "topology.yaml",
                                   "app": os.path.relpath(app, tmp_path)}))
    return cfg


def test_a_flower_app_directory_travels_in_a_configmap(tmp_path: Path) -> None:
    """`app:` naming a Flower App directory: its files go into a ConfigMap whose items rebuild the tree, mounted
    read-only where compose mounts it; every pod runs the Flower image and is told `--set app=` that path (a
    host path given with --set is not passed on); caches and hidden files stay behind."""
    app = tmp_path / "flower_bn_app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "flower_bn_app" / "__pycache__").mkdir()
    (app / "flower_bn_app" / "__pycache__" / "task.cpython-312.pyc").write_bytes(b"\x00\xff")
    (app / ".git").mkdir()
    (app / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (app / ".env").write_text("SECRET=1\n")
    man = render_k8s(_app_config(tmp_path, app), sets=[f"app={app}", "rounds=3"])
    objs = validate(man.documents)
    cm = objs[("ConfigMap", "p2pfl-app")]
    sts = [d for d in man.documents if d["kind"] == "StatefulSet"]
    assert len(sts) == 3
    want = {p.relative_to(APP).as_posix(): p.read_text() for p in APP.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert {"pyproject.toml", "flower_bn_app/__init__.py", "flower_bn_app/client_app.py",
            "flower_bn_app/server_app.py", "flower_bn_app/task.py"} <= set(want)
    for s in sts:
        pod = s["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["image"] == "p2pfl:cpu-flower"
        sets = [c["args"][i + 1] for i, a in enumerate(c["args"]) if a == "--set"]
        assert [x for x in sets if x.startswith("app=")] == ["app=/p2pfl/flower-app"] and "rounds=3" in sets
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/p2pfl/flower-app"]
        assert mount["readOnly"] is True and "subPath" not in mount
        (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert vol["configMap"]["name"] == "p2pfl-app"
        tree = {item["path"]: cm["data"][item["key"]] for item in vol["configMap"]["items"]}
        assert tree == want  # the directory byte for byte, nothing else (no cache, no hidden files)
    assert render_k8s(_app_config(tmp_path, app), gpus=1).documents[-1]["spec"]["template"]["spec"][
        "containers"][0]["image"] == "p2pfl:cuda-flower"
    assert "p2pfl-app" not in str(render_k8s(EXAMPLE_CONFIG).documents)  # no app: no ConfigMap, the plain image


@pytest.mark.parametrize("problem", ["oversize", "binary"])
def test_an_app_directory_a_configmap_cannot_carry_is_one_line_and_nothing_written(
        tmp_path: Path, problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    from p2pfl.cli.main import main

    app = tmp_path / "flower_bn_app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    if problem == "oversize":  # text, but more than a ConfigMap holds
        (app / "flower_bn_app" / "weights.py").write_text("# " + "x" * APP_MAX_BYTES + "\n")
    else:
        (app / "flower_bn_app" / "data.bin").write_bytes(bytes(range(256)))
    cfg = _app_config(tmp_path, app)
    out = tmp_path / "k8s"
    with pytest.raises(SystemExit) as exc:
        main(["k8s", "-c", str(cfg), "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {cfg}: app: "), line
    assert ("900 KiB" in line) if problem == "oversize" else ("data.bin" in line and "UTF-8" in line), line
    assert not out.exists()
