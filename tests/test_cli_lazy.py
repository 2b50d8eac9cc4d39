"""Light commands stay light: the container healthcheck runs `p2pfl health` every 15 s in every
container, so it (and `p2pfl topology`) must not import torch or Flower (seconds of CPU per call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "flwr", "torchvision", "matplotlib", "ray")
# what the healthcheck does not need either (the topology sub-app imports them): ~0.3 s of CPU per call
HEALTH_FREE = ("numpy", "pydantic", "networkx")

# Runs the real entry point in a fresh interpreter, then reports which heavy stacks got imported.
_PROBE = """
import json, sys
from p2pfl.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = [m for m in {heavy!r} if m in sys.modules]
print("PROBE " + json.dumps({{"code": code, "heavy": heavy}}))
"""


def _probe(args: list[str], cwd: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY + HEALTH_FREE), *args], capture_output=True,
                         text=True, timeout=180, cwd=cwd)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line is not None, out.stdout + out.stderr
    return json.loads(line[len("PROBE "):])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("args, code", [
    (["health", "--help"], 0),
    # nothing listens on port 1: NOT SERVING (exit 1) after a real gRPC health call
    (["health", "127.0.0.1:1", "--insecure"], 1),
    (["topology", "--help"], 0),
    (["topology", "check", "topology/ring-8.yaml"], 0),
])
def test_light_commands_import_no_torch_or_flower(args: list[str], code: int) -> None:
    repo = Path(__file__).resolve().parents[1]
    res = _probe(args, repo)
    assert res["code"] == code, res
    heavy = [m for m in res["heavy"] if m in HEAVY or args[0] == "health"]
    assert heavy == [], f"p2pfl {' '.join(args)} imported {heavy}"


# Several commands, one interpreter: after each, which heavy stacks are loaded so far (so the first
# command that pulls one in is the one named).
_SEQUENCE_PROBE = """
import json, sys
from p2pfl.cli import main
seen = {{}}
for line in sys.argv[1:]:
    args = line.split()
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    seen[line] = {{"code": code, "heavy": [m for m in {heavy!r} if m in sys.modules]}}
print("PROBE " + json.dumps(seen))
"""

LISTING = ["algorithms", "algorithms dfedmdc", "models", "datasets", "--help", "simulate --help", "node --help",
           "launch --help", "compare --help", "flower --help", "compose --help", "watch --help", "report --help"]


@pytest.mark.timeout(300)
def test_listing_and_help_import_no_torch_or_flower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``p2pfl algorithms|models|datasets`` read the catalog cache, and ``--help`` of every command
    (heavy ones included) is built without importing torch or Flower."""
    from p2pfl import catalog

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    catalog.load.cache_clear()
    built = catalog.load()  # a miss: built from the implementations (torch is loaded here anyway)
    entry = tmp_path / "p2pfl" / f"catalog-{catalog.fingerprint()}.json"
    assert json.loads(entry.read_text()) == built
    assert {a["name"] for a in built["algorithms"]} >= {"local", "dfedavg", "dfedmdc", "dispfl"}
    catalog.load.cache_clear()

    out = subprocess.run([sys.executable, "-c", _SEQUENCE_PROBE.format(heavy=HEAVY), *LISTING], capture_output=True,
                         text=True, timeout=240, cwd=repo, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-2000:]
    seen = json.loads(line[len("PROBE "):])
    assert {k: v["code"] for k, v in seen.items()} == dict.fromkeys(LISTING, 0), out.stderr[-2000:]
    first_heavy = next(((cmd, v["heavy"]) for cmd, v in seen.items() if v["heavy"]), None)
    assert first_heavy is None, f"p2pfl {first_heavy[0]} imported {first_heavy[1]}"
    # what they print is the implementations' metadata: every algorithm, preset, model, dataset, partition
    for name in ("dfedmdc", "dispfl", "dfedmdc-demo", "cnn_small", "resnet18", "fashion_mnist", "dirichlet"):
        assert name in out.stdout, name
