"""Print the Python requirements of the peer image, one per line: pyproject's runtime dependencies
without what a peer never imports.

Why a script: the peer image must carry no unused stack (Flower's server/simulation stack, the
torchvision dataset downloader, matplotlib's plotting), yet stay in step with ``pyproject.toml`` when a
dependency is added. Both the host-side wheelhouse (``docker/wheelhouse.sh``) and the Dockerfile run
this, so they always agree. PyTorch is left out too: the image installs it on its own (CPU wheel from
the wheelhouse, or a CUDA wheel index), pinned by a build argument. Standard library only (tomllib),
so it runs with the base image's bare ``python3``.

``--flower`` keeps Flower in the list: the image variant for configs that run a user's Flower
ClientApp (``app:``), built with ``--build-arg FLOWER=1`` (``p2pfl compose`` does so for such a config).
Flower brings its server stack along (fastapi, sqlalchemy, uvicorn, uv: about 100 MB), which a peer
running a built-in algorithm never imports, so the default image goes without it.

    python3 docker/peer_requirements.py [--flower] [pyproject.toml]
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

#: Distributions a peer never imports (tests/test_compose.py checks `p2pfl node`'s imports).
EXCLUDED = frozenset({"flwr", "torch", "torchvision", "matplotlib"})


def peer_requirements(pyproject: Path, *, flower: bool = False) -> list[str]:
    """The runtime requirement strings of ``pyproject`` minus `EXCLUDED` (Flower kept if ``flower``)."""
    deps = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    excluded = EXCLUDED - {"flwr"} if flower else EXCLUDED
    out = []
    for dep in deps:
        name = re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0].lower().replace("_", "-")
        if name not in excluded:
            out.append(dep.strip())
    return out


if __name__ == "__main__":
    argv = sys.argv[1:]
    with_flower = "--flower" in argv
    argv = [a for a in argv if a != "--flower"]
    path = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "pyproject.toml"
    print("\n".join(peer_requirements(path, flower=with_flower)))
