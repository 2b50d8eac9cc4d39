"""The transport stays in parts, one job each (issue 68, "The transport in parts"; docs/architecture.md).

Why a test: `PeerServer` and `GrpcTransport` grew to ~870 and ~700 lines, every concern of the peer
service in two classes. The rule that undid it -- no class in ``p2pfl/transport/`` spans more than
``MAX_CLASS_LINES`` lines -- is measured here so that growing one back fails CI, not a review.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "p2pfl"
TRANSPORT = PACKAGE / "transport"

#: The longest a class of the transport may span, docstring and blank lines included.
MAX_CLASS_LINES = 400


def class_sizes(folder: Path, pattern: str = "*.py") -> dict[str, int]:
    """``module.py:Class`` -> lines the class spans (``end_lineno - lineno + 1``), nested classes included;
    ``pattern`` ``**/*.py`` names modules by their path under ``folder``."""
    sizes: dict[str, int] = {}
    for path in sorted(folder.glob(pattern)):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                sizes[f"{path.relative_to(folder)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def test_no_transport_class_spans_more_than_400_lines() -> None:
    sizes = class_sizes(TRANSPORT)
    assert "grpc_service.py:PeerServer" in sizes and "grpc_transport.py:GrpcTransport" in sizes  # it measures them
    over = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not over, f"classes over {MAX_CLASS_LINES} lines (split them by concern): {over}"


def test_the_measure_counts_a_class_from_its_first_to_its_last_line(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("class A:\n    x = 1\n\n    def f(self) -> None:\n        pass\n\n\ny = 2\n")
    assert class_sizes(tmp_path) == {"m.py:A": 5}


def test_no_class_of_the_package_spans_more_than_400_lines() -> None:
    """The same rule for the whole package (issue 67): the transport was the last place that broke it."""
    sizes = class_sizes(PACKAGE, "**/*.py")
    assert "node.py:Node" in sizes and "transport/grpc_service.py:PeerServer" in sizes  # it walks the subpackages
    over = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not over, f"classes over {MAX_CLASS_LINES} lines (split them by concern): {over}"
