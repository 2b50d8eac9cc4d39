"""End-to-end check of the container deployment with a real Docker engine (``make e2e``).

Builds the peer image through the compose file's ``build:`` section, brings up a 4-peer ring with
``docker-compose up`` (host network, peers on 127.0.0.1 with distinct ports, mutual TLS), waits for
every container's healthcheck, scrapes each peer's ``/metrics``, then SIGKILLs one peer's process from
the host mid-run (what the kernel's OOM killer does), lets the restart policy bring the container
back, and checks that the peer resumed from its checkpoint and rejoined the ring: from two rounds
after its resume on, its records name no missing neighbour and its neighbours' records do not name
it. Then ``docker-compose down`` and the deployment folder is removed, on success, failure, timeout
or Ctrl-C alike. Images are kept: they are the build cache of the next run. Only the image this build
replaced is removed (with its own stage images): under the vfs storage driver every image is a full
copy, and each run's leftovers were ~1.5 GB (55 GB of disk on the development machine after a few days).

Why SIGKILL of the process and not ``docker kill``: the engine treats ``docker kill`` as a user's
stop and cancels the restart policy, so it cannot test crash recovery.

The last line of output is one JSON object (``containers``, ``all_rounds_completed``,
``restarted_peer_rejoined``, ``metrics_endpoint_ok``, ``image_mb``, ``build_s``, ``run_s``, ...);
the exit status is 0 only when every check passed.

    .venv/bin/python docker/e2e.py [--rounds 8] [--timeout 1500]   (root, engine running: make e2e)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from p2pfl.node_metrics import parse_exposition  # noqa: E402

PEERS = 4
VICTIM = "p1"


def log(msg: str) -> None:
    print(f"e2e [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Failure(RuntimeError):
    """A step of the e2e check failed; the message says which and why."""


def run(cmd: list[str], *, timeout: float, check: bool = True, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise Failure(f"{' '.join(cmd[:4])} ... did not finish within {timeout:.0f}s") from None
    if check and res.returncode != 0:
        raise Failure(f"{' '.join(cmd[:4])} ... exited {res.returncode}: {(res.stderr or res.stdout)[-2000:]}")
    return res


def image_id(image: str) -> str:
    """The image's id, or "" when there is none by that name."""
    res = run(["docker", "image", "inspect", "-f", "{{.Id}}", image], timeout=60, check=False)
    return res.stdout.strip() if res.returncode == 0 else ""


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free TCP ports on loopback (peers use base..base+n-1)."""
    for base in range(42000, 60000, 97):
        ok = True
        for port in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return list(range(base, base + n))
    raise Failure("no free loopback ports")


class Deployment:
    """One compose project in a temporary folder; `down` removes everything it started."""

    def __init__(self, work: Path, rounds: int, clientapp: bool = False) -> None:
        from p2pfl.topology.generators import generate

        self.work = work
        self.rounds = rounds
        self.project = f"p2pfl-e2e-{os.getpid()}"
        ports = free_ports(2 * PEERS)
        topo = generate("ring", PEERS, base_port=ports[0], name="e2e-ring-4")
        topo.dump(work / "topology.yaml")
        self.metrics_base = ports[PEERS]
        self.clientapp = clientapp
        self.sets = ["topology=topology.yaml", "name=e2e", f"rounds={rounds}", "device=cpu",
                     "network.round_timeout_s=120"]
        if clientapp:  # a Flower ClientApp written in Flower's quickstart style: the Flower image variant
            cfg = (REPO / "peers" / "quickstart.yaml").read_text()
        else:
            cfg = (REPO / "peers" / "compose-ring4.yaml").read_text()
            self.sets += ["data.partition.samples_per_client=600", "data.partition.test_size=200"]
        (work / "config.yaml").write_text(cfg)
        self.compose_file = work / "docker-compose.yml"
        self.uid = 1000 if os.geteuid() == 0 else os.getuid()
        self.env = {**os.environ, "P2PFL_UID": str(self.uid), "P2PFL_GID": str(self.uid if os.geteuid() else 1000),
                    # compose builds with the docker CLI, so its build shares the layer cache of
                    # `docker build` (docker-compose 1.29's own builder tars the context differently);
                    # the classic builder, as our engine has no buildx
                    "COMPOSE_DOCKER_CLI_BUILD": "1", "DOCKER_BUILDKIT": "0",
                    # creating a container copies the whole image with vfs: slower than compose's 60 s default
                    "COMPOSE_HTTP_TIMEOUT": "600"}
        self.up = False

    def p2pfl(self, *args: str) -> None:
        # from the repo: a ClientApp config names its app as `peers.quickstart:app`, importable from there
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        run([sys.executable, "-m", "p2pfl.cli", *args], timeout=300, cwd=self.work, env=env)

    def generate(self) -> None:
        sets = [a for s in self.sets for a in ("--set", s)]
        self.p2pfl("certs", "--config", "config.yaml", "--out", "certs", *sets)
        self.p2pfl("compose", "--config", "config.yaml", "--out", "docker-compose.yml", "--network", "host",
                   "--context", str(REPO), "--metrics-port", str(self.metrics_base), "--cpus", "1",
                   "--memory", "2g", *sets)
        if os.geteuid() == 0:  # the containers run as uid 1000: give them their keys and run folder
            for path in [self.work, *self.work.rglob("*")]:
                os.chown(path, 1000, 1000)

    def compose(self, *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(["docker-compose", "-f", str(self.compose_file), "-p", self.project, *args],
                   timeout=timeout, check=check, env=self.env, cwd=self.work)

    def doc(self) -> dict[str, Any]:
        import yaml

        return yaml.safe_load(self.compose_file.read_text())

    def container(self, service: str) -> str:
        res = self.compose("ps", "-q", service, timeout=60)
        cid = res.stdout.strip()
        if not cid:
            raise Failure(f"no container for {service}")
        return cid

    def inspect(self, cid: str) -> dict[str, Any]:
        return json.loads(run(["docker", "inspect", cid], timeout=60).stdout)[0]

    def down(self) -> None:
        if self.up:
            self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=300, check=False)
            # containers whose creation outlived compose's HTTP timeout appear after `down`: remove by label
            left = run(["docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.project}"],
                       timeout=60, check=False).stdout.split()
            if left:
                run(["docker", "rm", "-f", "-v", *left], timeout=300, check=False)
            self.up = False


def scrape(address: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/plain"):
                return None
            return parse_exposition(resp.read().decode())
    except OSError:
        return None


def gauge(m: dict[str, dict[tuple[tuple[str, str], ...], float]] | None, name: str) -> float | None:
    if not m or name not in m or not m[name]:
        return None
    return next(iter(m[name].values()))


def last_records(path: Path) -> dict[int, dict[str, Any]]:
    """round -> the last record of that round (a round re-run after a crash appears twice)."""
    out: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the kill
                out[int(rec["round"])] = rec
    return out


def e2e(args: argparse.Namespace, work: Path, result: dict[str, Any]) -> None:
    dep = Deployment(work, args.rounds, clientapp=args.clientapp)
    result["_dep"] = dep
    dep.generate()
    doc = dep.doc()
    services = doc["services"]
    metrics = doc["x-p2pfl"]["metrics"]
    peers = sorted(doc["x-p2pfl"]["peers"])
    result["containers"] = len(services)
    run_dir = (work / doc["x-p2pfl"]["run_dir"]).resolve()

    # every service runs the same image: building the one service that has the build section makes it
    builder = next(name for name, svc in services.items() if "build" in svc)
    image = services[builder]["image"]
    result["image"] = image
    log(f"building the image through the compose build section ({dep.compose_file.name}, {builder})")
    t0 = time.monotonic()
    if args.skip_build:
        log(f"--skip-build: using the existing {image}")
    else:
        before = image_id(image)
        dep.compose("build", builder, timeout=args.build_timeout)
        result["build_s"] = round(time.monotonic() - t0, 1)
        after = image_id(image)
        if before and before != after:  # the tag moved: the old image is only disk now
            gone = run(["docker", "image", "rm", before], timeout=300, check=False).returncode == 0
            result["previous_image_removed"] = gone
            log(f"previous {image} ({before[7:19]}) {'removed' if gone else 'kept (still in use)'}")
    result["image_mb"] = round(int(run(["docker", "image", "inspect", "-f", "{{.Size}}", image],
                                       timeout=60).stdout.strip()) / 1e6, 1)
    log(f"image {image}: {result['image_mb']} MB, build {result['build_s']} s")

    t_run = time.monotonic()
    deadline = t_run + args.timeout
    dep.up = True
    dep.compose("up", "-d", "--no-build", timeout=300)
    cids = {pid: dep.container(services_name) for pid, services_name in doc["x-p2pfl"]["peers"].items()}

    def wait(what: str, cond, limit: float) -> None:  # noqa: ANN001
        end = min(deadline, time.monotonic() + limit)
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(2)
        raise Failure(f"timed out waiting for {what}")

    def healthy(cid: str) -> bool:
        st = dep.inspect(cid)["State"]
        return st.get("Health", {}).get("Status") == "healthy"

    wait("every container healthy", lambda: all(healthy(c) for c in cids.values()), 400)
    result["healthy_s"] = round(time.monotonic() - t_run, 1)
    log(f"all {len(cids)} containers healthy after {result['healthy_s']} s")

    scraped = {pid: scrape(metrics[pid]) for pid in peers}
    result["metrics_endpoint_ok"] = all(
        m is not None and gauge(m, "p2pfl_rounds_total") == args.rounds and "p2pfl_neighbour_up" in m
        for m in scraped.values())

    victim_metrics = run_dir / f"metrics-{VICTIM}.jsonl"
    wait(f"{VICTIM} to complete {args.kill_after} rounds",
         lambda: len(last_records(victim_metrics)) >= args.kill_after, 600)
    # The links are up by now: every peer's probe saw its neighbours.
    scraped = {pid: scrape(metrics[pid]) for pid in peers}
    ups = [v for m in scraped.values() if m for v in m.get("p2pfl_neighbour_up", {}).values()]
    result["metrics_links_up"] = bool(ups) and all(v == 1 for v in ups)
    result["metrics_endpoint_ok"] = result["metrics_endpoint_ok"] and all(
        m is not None and (gauge(m, "p2pfl_round") or -1) >= 0 for m in scraped.values())

    victim = cids[VICTIM]
    state = dep.inspect(victim)["State"]
    init_pid = int(state["Pid"])
    children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    target = int(children[0]) if children else init_pid
    log(f"SIGKILL to {VICTIM}'s p2pfl node (host pid {target}) after {len(last_records(victim_metrics))} rounds")
    os.kill(target, signal.SIGKILL)
    result["killed_peer"] = VICTIM

    wait(f"{VICTIM} to be restarted by the restart policy",
         lambda: dep.inspect(victim)["RestartCount"] >= 1 and dep.inspect(victim)["State"]["Running"], 120)
    result["restart_count"] = dep.inspect(victim)["RestartCount"]
    def healthy_again() -> bool:
        st = dep.inspect(victim)["State"]
        if st["Status"] == "exited":
            raise Failure(f"{VICTIM} exited (code {st['ExitCode']}) before its healthcheck passed again: "
                          "the run ended too soon after the restart (more --rounds)")
        return st.get("Health", {}).get("Status") == "healthy"

    wait(f"{VICTIM} healthy again", healthy_again, 300)

    def resumed_round() -> float | None:
        return gauge(scrape(metrics[VICTIM]), "p2pfl_resumed_from_round")

    # the endpoint starts before the checkpoint is loaded: wait for the resumed round to appear
    wait(f"{VICTIM}'s /metrics to report its resume", lambda: (resumed_round() or -1) >= 0, 180)
    result["resumed_from_round"] = int(resumed_round() or -1)
    logs = dep.compose("logs", "--no-color", dep.doc()["x-p2pfl"]["peers"][VICTIM], timeout=60, check=False).stdout
    result["resume_logged"] = f"resuming at round {result['resumed_from_round']}" in logs
    log(f"{VICTIM} restarted (RestartCount {result['restart_count']}), resumed at round {result['resumed_from_round']}")

    def finished(cid: str) -> bool:
        st = dep.inspect(cid)["State"]
        return st["Status"] == "exited" and st["ExitCode"] == 0

    wait("every peer to finish its rounds", lambda: all(finished(c) for c in cids.values()), args.timeout)
    result["run_s"] = round(time.monotonic() - t_run, 1)

    recs = {pid: last_records(run_dir / f"metrics-{pid}.jsonl") for pid in peers}
    # every peer reached its last round and exited 0; every round recorded (a fast-forward skips some)
    result["all_rounds_completed"] = all(args.rounds - 1 in r for r in recs.values())
    result["every_round_recorded"] = all(set(r) == set(range(args.rounds)) for r in recs.values())
    ff = [rec["fast_forward_from"] for r in recs.values() for rec in r.values() if "fast_forward_from" in rec]
    if ff:
        result["fast_forward_from"] = ff
    r0 = result["resumed_from_round"]
    nbrs = [p for p in peers if VICTIM in dep_neighbours(work / "topology.yaml", p)]
    later = [r for r in range(r0 + 2, args.rounds)]
    own_ok = all(not recs[VICTIM][r].get("missing") for r in later if r in recs[VICTIM])
    nbr_ok = all(VICTIM not in recs[p][r].get("missing", []) for p in nbrs for r in later if r in recs[p])
    result["rejoin_rounds_checked"] = len(later)
    result["restarted_peer_rejoined"] = bool(later) and r0 >= 1 and own_ok and nbr_ok
    missing_any = sorted({(p, r, m) for p in peers for r, rec in recs[p].items() for m in rec.get("missing", [])})
    result["missing_records"] = [f"{p}@{r}:{m}" for p, r, m in missing_any][:20]
    accs = [recs[p][args.rounds - 1].get("acc") for p in peers if args.rounds - 1 in recs[p]]
    accs = [a for a in accs if isinstance(a, int | float)]
    result["final_acc_mean"] = round(sum(accs) / len(accs), 4) if accs else None


def dep_neighbours(topology: Path, peer: str) -> set[str]:
    from p2pfl.topology import load_topology

    topo = load_topology(topology)
    return set(topo.possible_in_neighbours(peer)) | set(topo.possible_out_neighbours(peer))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=80,
                        help="rounds of the run: a round takes about 0.5 s, and the restarted peer must still "
                        "have rounds to run after its healthcheck (every 10 s) passes again")
    parser.add_argument("--kill-after", type=int, default=10, help="kill the victim once it completed this many rounds")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds for the run (after the build)")
    parser.add_argument("--build-timeout", type=float, default=1200)
    parser.add_argument("--keep", action="store_true", help="leave the deployment folder (debugging)")
    parser.add_argument("--skip-build", action="store_true", help="run the existing image (no build_s)")
    parser.add_argument("--clientapp", action="store_true",
                        help="deploy peers/quickstart.yaml (a Flower ClientApp) on the Flower image variant")
    args = parser.parse_args()
    if shutil.which("docker-compose") is None:
        print("e2e: docker-compose not found (make e2e installs it)", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    result: dict[str, Any] = {"containers": 0, "all_rounds_completed": False, "restarted_peer_rejoined": False,
                              "metrics_endpoint_ok": False, "image_mb": None, "build_s": None, "run_s": None}
    work = Path(tempfile.mkdtemp(prefix="p2pfl-e2e-"))
    ok = False
    try:
        e2e(args, work, result)
        ok = all(result[k] for k in ("all_rounds_completed", "restarted_peer_rejoined", "metrics_endpoint_ok"))
    except Failure as exc:
        result["error"] = str(exc)
        log(f"FAILED: {exc}")
    except KeyboardInterrupt as exc:
        result["error"] = f"interrupted ({exc})"
        log("interrupted: cleaning up")
    finally:
        dep = result.pop("_dep", None)
        if dep is not None:
            if not ok:
                res = dep.compose("logs", "--no-color", "--tail", "30", timeout=60, check=False)
                print(res.stdout[-6000:], file=sys.stderr)
            dep.down()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["ok"] = ok
    print(json.dumps(result, sort_keys=False))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
