"""Named hyperparameter presets (``algorithm.preset`` in a config); config keys override them.

Each algorithm module declares its papers' presets in a module-level ``PRESETS`` dict (next to
the algorithm, with the ambiguity choices in its docstring); this collects them.
"""

from __future__ import annotations

import importlib
from typing import Any


def all_presets() -> dict[str, dict[str, Any]]:
    from p2pfl.algorithms.registry import ALGORITHMS

    out: dict[str, dict[str, Any]] = {}
    for module in sorted({target.split(":")[0] for target in ALGORITHMS.values()}):
        out.update(getattr(importlib.import_module(module), "PRESETS", {}))
    return out


def presets_for(algorithm: str) -> list[str]:
    """The presets whose every key is a hyperparameter of ``algorithm`` (its papers' settings)."""
    from p2pfl.algorithms.registry import ALGORITHMS, algorithm_class

    if algorithm not in ALGORITHMS:
        return []
    keys = set(algorithm_class(algorithm).defaults)
    return sorted(name for name, hp in all_presets().items() if set(hp) <= keys)
