"""Algorithms, selected by ``algorithm.name`` in the experiment config (see ``registry.py``)."""

from __future__ import annotations

from p2pfl.algorithms.base import Algorithm, PeerState
from p2pfl.algorithms.hyperparameters import HyperparameterError
from p2pfl.algorithms.local_sgd import TrainContext
from p2pfl.algorithms.registry import (
           ALGORITHMS,
           AlgorithmChoice,
           algorithm_class,
           build_algorithm,
           registry,
           resolve,
)

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmChoice", "HyperparameterError", "PeerState", "TrainContext",
           "algorithm_class", "build_algorithm", "registry", "resolve"]
