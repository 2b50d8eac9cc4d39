"""Live watch: a real `p2pfl node` process serves Prometheus `/metrics` (scraped over HTTP on loopback)
that agree with its own metrics file, the health probe needs neither torch nor Flower, and
`p2pfl watch` shows a running deployment (through the peers' endpoints) and a finished run folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from p2pfl.cli.watch import watch_command
from p2pfl.node_metrics import MetricsServer, NodeMetrics, parse_exposition
from p2pfl.security.certs import make_certs
from p2pfl.watch import snapshot_compose, snapshot_run_dir
from tests.conftest import tiny_config
from tests.swarm import free_base_port

PEERS = ["p0", "p1", "p2", "p3"]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _one(m: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str) -> float:
    (value,) = m[name].values()
    return value


def _watch_app() -> Any:
    import typer

    app = typer.Typer(add_completion=False)
    app.command()(watch_command)
    return app


# ---- exposition ------------------------------------------------------------------------------------


def test_exposition_renders_records_and_parses_back() -> None:
    m = NodeMetrics("p0", ["p1", "p3"], rounds=5)
    m.observe({"round": 0, "peer": "p0", "acc": 0.5, "loss": 1.25, "bytes_sent": 100, "bytes_recv": 80,
               "missing": ["p3"], "seconds": 2.0, "train_seconds": 1.5})
    m.observe({"round": 1, "peer": "p0", "bytes_sent": 10, "bytes_recv": 20, "missing": [], "seconds": 1.0})
    m.link("p1", up=True, latency_s=0.004, round_=2)
    m.link("p3", up=False)
    text = m.render()
    assert "# TYPE p2pfl_bytes_sent_total counter" in text
    parsed = parse_exposition(text)
    assert _one(parsed, "p2pfl_round") == 1
    assert _one(parsed, "p2pfl_accuracy") == 0.5  # round 1 was not evaluated: the last evaluation stays
    assert _one(parsed, "p2pfl_bytes_sent_total") == 110 and _one(parsed, "p2pfl_bytes_received_total") == 100
    assert _one(parsed, "p2pfl_missing_neighbours") == 0
    up = {dict(k)["neighbour"]: v for k, v in parsed["p2pfl_neighbour_up"].items()}
    assert up == {"p1": 1, "p3": 0}
    lat = {dict(k)["neighbour"]: v for k, v in parsed["p2pfl_neighbour_latency_seconds"].items()}
    assert lat["p1"] == pytest.approx(0.004) and lat["p3"] != lat["p3"]  # NaN until the first answer
    assert all(dict(k)["peer"] == "p0" for k in parsed["p2pfl_neighbour_up"])
    # label values are escaped
    odd = NodeMetrics('a"b\\c', [], rounds=1).render()
    assert parse_exposition(odd)["p2pfl_info"] == {(("peer", 'a"b\\c'),): 1.0}


def test_metrics_server_serves_only_metrics_and_refuses_a_taken_port() -> None:
    srv = MetricsServer(NodeMetrics("p0", [], 3), "127.0.0.1", 0)
    try:
        status, ctype, body = _get(f"http://127.0.0.1:{srv.port}/metrics")
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        assert "p2pfl_rounds_total" in body
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(f"http://127.0.0.1:{srv.port}/other")
        assert err.value.code == 404
        with pytest.raises(ValueError, match=f"cannot serve metrics on 127.0.0.1:{srv.port}"):
            MetricsServer(NodeMetrics("p1", [], 3), "127.0.0.1", srv.port)
    finally:
        srv.close()


# ---- a real node process -----------------------------------------------------------------------------


def spawn_node(cfg: Path, pid: str, out: Path, certs: Path, log: Path, metrics_port: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "p2pfl.cli", "node", "--config", str(cfg), "--peer", pid, "--out", str(out),
           "--certs", str(certs)]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    return subprocess.Popen(cmd, stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.timeout(240)
def test_node_serves_metrics_and_watch_follows_the_deployment(tmp_path: Path) -> None:
    # far more than the test waits for (the peers are stopped with SIGTERM): at ~50 rounds a second,
    # 400 rounds would be over in about 8 s, and a loaded machine can take that long between two checks
    rounds = 1_000_000
    base = free_base_port(8)
    cfg = tiny_config(tmp_path, base_port=base, rounds=rounds, network={"round_timeout_s": 8.0})
    out, certs = tmp_path / "run", tmp_path / "certs"
    make_certs(PEERS, certs)
    mports = {pid: base + 4 + i for i, pid in enumerate(PEERS)}
    # p3 serves no metrics: off unless asked for
    procs = {pid: spawn_node(cfg, pid, out, certs, tmp_path / f"{pid}.log", None if pid == "p3" else mports[pid])
             for pid in PEERS}
    # what `p2pfl compose` records for `p2pfl watch --compose`
    compose = tmp_path / "docker-compose.yml"
    compose.write_text(yaml.safe_dump({"x-p2pfl": {
        "peers": {p: f"peer-{p}" for p in PEERS}, "run_dir": "./run",
        "metrics": {p: f"127.0.0.1:{mports[p]}" for p in PEERS}}, "services": {}}))
    try:
        t0 = time.monotonic()
        scraped: dict[str, Any] = {}
        while True:
            assert time.monotonic() - t0 < 150, "peers did not serve metrics with live links in time"
            for pid in ("p0", "p1", "p2"):
                assert procs[pid].poll() is None, (tmp_path / f"{pid}.log").read_text()[-3000:]
                try:
                    scraped[pid] = parse_exposition(_get(f"http://127.0.0.1:{mports[pid]}/metrics")[2])
                except OSError:
                    scraped.pop(pid, None)
            if len(scraped) == 3 and all(
                _one(m, "p2pfl_round") >= 1 and all(v == 1 for v in m["p2pfl_neighbour_up"].values())
                for m in scraped.values()
            ):
                break
            time.sleep(0.3)
        m0 = scraped["p0"]
        assert _one(m0, "p2pfl_rounds_total") == rounds and _one(m0, "p2pfl_resumed_from_round") == -1
        assert {dict(k)["neighbour"] for k in m0["p2pfl_neighbour_up"]} == {"p1", "p3"}  # ring neighbours
        lat = [v for v in m0["p2pfl_neighbour_latency_seconds"].values()]
        assert all(0 < v < 10 for v in lat)
        # the endpoint agrees with the node's own metrics file for the round it reports
        r = int(_one(m0, "p2pfl_round"))
        rec = {x["round"]: x for x in _records(out / "metrics-p0.jsonl")}[r]
        fresh = parse_exposition(_get(f"http://127.0.0.1:{mports['p0']}/metrics")[2])
        if int(_one(fresh, "p2pfl_round")) == r:
            assert _one(fresh, "p2pfl_accuracy") == pytest.approx(rec["acc"])
        assert _one(fresh, "p2pfl_bytes_sent_total") > 0
        with pytest.raises(OSError):  # p3 was not asked to serve metrics
            _get(f"http://127.0.0.1:{mports['p3']}/metrics", timeout=2)

        # the health probe answers without importing torch or Flower
        code = ("import sys; from p2pfl.health import main; rc = main(sys.argv[1:]); "
                "heavy = [m for m in ('torch', 'flwr', 'typer', 'p2pfl.config') if m in sys.modules]; "
                "print('HEAVY', heavy); sys.exit(rc if not heavy else 3)")
        res = subprocess.run([sys.executable, "-c", code, f"127.0.0.1:{base}", "--certs", str(certs), "--peer", "p0"],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "SERVING" in res.stdout and "HEAVY []" in res.stdout

        # watch --compose: live state from the endpoints; p3 has none, so it shows as down
        views = {v.peer: v for v in snapshot_compose(compose)}
        assert views["p0"].state == "running" and views["p0"].round is not None and views["p0"].rounds == rounds
        assert views["p3"].state == "down"
        assert views["p0"].links_down == []

        # a peer goes away: its neighbours' probes report the link down
        os.killpg(procs["p1"].pid, signal.SIGKILL)
        procs["p1"].wait(10)
        t1 = time.monotonic()
        while True:
            views = {v.peer: v for v in snapshot_compose(compose)}
            if "p1" in views["p0"].links_down and "p1" in views["p2"].links_down:
                break
            assert time.monotonic() - t1 < 60, f"p0/p2 never reported the link to p1 down: {views}"
            time.sleep(0.5)
        assert views["p1"].state == "down"
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    # the run folder, after the peers stopped: watch reads the per-peer files
    views = {v.peer: v for v in snapshot_run_dir(out)}
    assert set(views) == set(PEERS)
    for pid in ("p0", "p2", "p3"):
        last = max(x["round"] for x in _records(out / f"metrics-{pid}.jsonl"))
        assert views[pid].round == last and views[pid].state == "running"  # stopped before its last round
    # p1's neighbours mixed without it in the round they finished after the kill
    assert "p1" in views["p0"].links_down + views["p2"].links_down


@pytest.mark.timeout(180)
def test_watch_once_on_a_finished_simulation(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, rounds=3)
    run_dir = tmp_path / "sim"
    res = subprocess.run([sys.executable, "-m", "p2pfl.cli", "simulate", "--config", str(cfg), "--out", str(run_dir),
                          "--quiet"], capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    runner = CliRunner()
    res = runner.invoke(_watch_app(), [str(run_dir), "--once", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    peers = {p["peer"]: p for p in json.loads(res.output)["peers"]}
    assert set(peers) == set(PEERS)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for pid, view in peers.items():
        last = [r for r in recs if r["peer"] == pid and r["round"] == 2][0]
        assert view["round"] == 2 and view["rounds"] == 3 and view["state"] == "finished"
        assert view["acc"] == pytest.approx(last["acc"])
    table = runner.invoke(_watch_app(), [str(run_dir), "--once"], catch_exceptions=False)
    assert table.exit_code == 0 and "finished" in table.output and "p3" in table.output
    bad = runner.invoke(_watch_app(), [str(tmp_path / "nope"), "--once"])
    assert bad.exit_code == 2 and "not found" in bad.output
    both = runner.invoke(_watch_app(), ["--once"])
    assert both.exit_code == 2
