"""Light commands stay light: the container healthcheck runs `p2pfl health` every 15 s in every
container, so it (and `p2pfl topology`) must not import torch or Flower (seconds of CPU per call)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "flwr", "torchvision", "matplotlib", "ray")

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
    out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), *args], capture_output=True, text=True,
                         timeout=180, cwd=cwd)
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
    assert res["heavy"] == [], f"p2pfl {' '.join(args)} imported {res['heavy']}"
