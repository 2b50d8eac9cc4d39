"""Algorithms, selected by ``algorithm.name`` in the experiment config."""

from __future__ import annotations

import importlib
from typing import Any

from p2pfl.algorithms.base import Algorithm, HyperparameterError, PeerState, TrainContext
from p2pfl.models.layout import ParamLayout

# name -> "module:Class"; modules are imported only when their algorithm is used.
ALGORITHMS: dict[str, str] = {
    "local": "p2pfl.algorithms.baselines:Local",
    "dfedavg": "p2pfl.algorithms.baselines:DFedAvg",
    "dpsgd": "p2pfl.algorithms.baselines:DPSGD",
    "dfedavgm": "p2pfl.algorithms.baselines:DFedAvgM",
    "dfedsam": "p2pfl.algorithms.dfedsam:DFedSAM",
    "dfedsam_mgs": "p2pfl.algorithms.dfedsam:DFedSAMMGS",
    "dfedadmm": "p2pfl.algorithms.dfedadmm:DFedADMM",
    "dfedadmm_sam": "p2pfl.algorithms.dfedadmm:DFedADMMSAM",
    "dfedmdc": "p2pfl.algorithms.dfedmdc:DFedMDC",
    "dfedsmdc": "p2pfl.algorithms.dfedmdc:DFedSMDC",
    "deprl": "p2pfl.algorithms.deprl:DePRL",
    "dfedpgp": "p2pfl.algorithms.dfedpgp:DFedPGP",
    "dispfl": "p2pfl.algorithms.dispfl:DisPFL",
    "ditto": "p2pfl.flower.ditto:Ditto",  # a parameter-server local rule (p2pfl flower --baseline ditto)
    "fedrod": "p2pfl.flower.fedrod:FedRoD",  # a parameter-server local rule (p2pfl flower --baseline fedrod)
}


def algorithm_class(name: str) -> type[Algorithm]:
    if name not in ALGORITHMS:
        raise HyperparameterError(f"unknown algorithm {name!r} (known: {sorted(ALGORITHMS)})")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def registry() -> dict[str, type[Algorithm]]:
    return {name: algorithm_class(name) for name in ALGORITHMS}


def build_algorithm(name: str, hp: dict[str, Any], layout: ParamLayout) -> Algorithm:
    return algorithm_class(name)(hp, layout)


__all__ = ["ALGORITHMS", "Algorithm", "HyperparameterError", "PeerState", "TrainContext", "algorithm_class",
           "build_algorithm", "registry"]
