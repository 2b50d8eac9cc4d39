"""Algorithms, selected by ``algorithm.name`` in the experiment config."""

from __future__ import annotations

from typing import Any

from p2pfl.algorithms.base import Algorithm, HyperparameterError, PeerState, TrainContext
from p2pfl.models.layout import ParamLayout


def registry() -> dict[str, type[Algorithm]]:
    """Name -> class for every algorithm (imported lazily: the CLI starts fast)."""
    from p2pfl.algorithms import baselines

    classes: list[type[Algorithm]] = [baselines.Local, baselines.DFedAvg]
    return {c.name: c for c in classes}


def build_algorithm(name: str, hp: dict[str, Any], layout: ParamLayout) -> Algorithm:
    algos = registry()
    if name not in algos:
        raise HyperparameterError(f"unknown algorithm {name!r} (known: {sorted(algos)})")
    return algos[name](hp, layout)


__all__ = ["Algorithm", "HyperparameterError", "PeerState", "TrainContext", "build_algorithm", "registry"]
