"""Print the Python requirements of the peer image, one per line: pyproject's runtime dependencies
without what a peer never imports.

Why a script: the peer image must carry no unused stack (Flower's server/simulation stack, the
torchvision dataset downloader, matplotlib's plotting), yet stay in step with ``pyproject.toml`` when a
dependency is added. Both the host-side wheelhouse (``docker/wheelhouse.sh``) and the Dockerfile run
this, so they always agree. PyTorch is left out too: the image installs it on its own (CPU wheel from
the wheelhouse, or a CUDA wheel index), pinned by a build argument. Standard library only (tomllib),
so it runs with the base image's bare ``python3``.

    python3 docker/peer_requirements.py [pyproject.toml]
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

#: Distributions a peer never imports (tests/test_compose.py checks `p2pfl node`'s imports).
EXCLUDED = frozenset({"flwr", "torch", "torchvision", "matplotlib"})


def peer_requirements(pyproject: Path) -> list[str]:
    """The runtime requirement strings of ``pyproject`` minus `EXCLUDED`, comments stripped."""
    deps = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    out = []
    for dep in deps:
        name = re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0].lower().replace("_", "-")
        if name not in EXCLUDED:
            out.append(dep.strip())
    return out


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "pyproject.toml"
    print("\n".join(peer_requirements(path)))
