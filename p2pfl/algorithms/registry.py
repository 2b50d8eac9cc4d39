"""The algorithm registry: ``algorithm.name`` resolved once into a class and its typed hyperparameters.

Everything that turns a name into an algorithm goes through here: the config check (before any
run folder exists), ``p2pfl algorithms``, ``p2pfl compare`` and the engines that build one
algorithm per peer. Modules are imported only when their algorithm is used (``"module:Class"``
strings), so listing the names costs nothing and a new algorithm is one line in ``ALGORITHMS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p2pfl.algorithms.hyperparameters import HyperparameterError, hyperparameter_docs, typed_hyperparameters
from p2pfl.badinput import BadInput, shorten, suggest

if TYPE_CHECKING:
    from p2pfl.algorithms.base import Algorithm
    from p2pfl.models.layout import ParamLayout

__all__ = ["ALGORITHMS", "AlgorithmChoice", "algorithm_class", "algorithm_table", "build_algorithm",
           "check_hyperparameters", "describe", "hyperparameter_names", "lookup", "registry", "resolve"]

# name -> "module:Class"; modules are imported only when their algorithm is used.
ALGORITHMS: dict[str, str] = {
    "local": "p2pfl.algorithms.full_sharing:Local",
    "dfedavg": "p2pfl.algorithms.full_sharing:DFedAvg",
    "dpsgd": "p2pfl.algorithms.full_sharing:DPSGD",
    "dfedavgm": "p2pfl.algorithms.full_sharing:DFedAvgM",
    "dfedsam": "p2pfl.algorithms.dfedsam:DFedSAM",
    "dfedsam_mgs": "p2pfl.algorithms.dfedsam:DFedSAMMGS",
    "dfedadmm": "p2pfl.algorithms.dfedadmm:DFedADMM",
    "dfedadmm_sam": "p2pfl.algorithms.dfedadmm:DFedADMMSAM",
    "dfedmdc": "p2pfl.algorithms.dfedmdc:DFedMDC",
    "dfedsmdc": "p2pfl.algorithms.dfedmdc:DFedSMDC",
    "deprl": "p2pfl.algorithms.deprl:DePRL",
    "dfedpgp": "p2pfl.algorithms.dfedpgp:DFedPGP",
    "dispfl": "p2pfl.algorithms.dispfl:DisPFL",
    "ditto": "p2pfl.algorithms.ditto:Ditto",  # a parameter-server local rule (p2pfl flower --baseline ditto)
    "fedrod": "p2pfl.algorithms.fedrod:FedRoD",  # a parameter-server local rule (p2pfl flower --baseline fedrod)
}


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered as ``name`` (HyperparameterError for an unknown name)."""
    if name not in ALGORITHMS:
        raise HyperparameterError(f"unknown algorithm {name!r} (known: {sorted(ALGORITHMS)})")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def lookup(name: object) -> type[Algorithm]:
    """``algorithm_class`` for a name a user wrote: BadInput on ``algorithm.name`` with a close match."""
    if not isinstance(name, str) or name not in ALGORITHMS:
        close = suggest(name, ALGORITHMS)
        raise BadInput(f"unknown algorithm {shorten(repr(name))}", key="algorithm.name", allowed=sorted(ALGORITHMS),
                       hint=f"did you mean {close!r}?" if close else None)
    return algorithm_class(name)


def registry() -> dict[str, type[Algorithm]]:
    return {name: algorithm_class(name) for name in ALGORITHMS}


def _owners(key: str) -> list[str]:
    """The algorithms that have hyperparameter ``key`` (for "it belongs to X" hints)."""
    return [a for a in ALGORITHMS if key in algorithm_class(a).defaults]


@dataclass(frozen=True)
class AlgorithmChoice:
    """An algorithm resolved once: its name, its class and its typed, checked hyperparameters.

    ``hp`` is the class defaults overridden by the config (every key present, values typed), so a
    peer built from it needs no lookup and repeats no check but the cheap schema one.
    """

    name: str
    cls: type[Algorithm]
    hp: dict[str, Any] = field(default_factory=dict)

    def build(self, layout: ParamLayout) -> Algorithm:
        return self.cls(self.hp, layout)

    @property
    def mode(self) -> str:
        """The mixing mode (pull | push) the topology plans with, read without building a peer."""
        return self.cls.mode_of(self.hp)


def resolve(name: object, hp: dict[str, Any]) -> AlgorithmChoice:
    """Look ``name`` up and check ``hp`` (types, ranges, unknown keys, cross-field rules); BadInput otherwise."""
    cls = lookup(name)
    assert isinstance(name, str)
    merged = typed_hyperparameters(cls, hp, owners=_owners)
    try:
        cls.check(merged)
    except HyperparameterError as exc:
        if exc.key:
            raise
        problem = exc.problem.removeprefix(f"{name}: ")
        raise HyperparameterError(problem, key="algorithm") from None
    return AlgorithmChoice(name, cls, merged)


def hyperparameter_names(name: str) -> list[str]:
    """The hyperparameters algorithm ``name`` accepts (BadInput for an unknown algorithm)."""
    return list(lookup(name).defaults)


def check_hyperparameters(name: str, hp: dict[str, Any]) -> dict[str, Any]:
    """Validate algorithm ``name`` with ``hp`` as a worker would build it, without a model.

    Returns ``hp`` as given (numbers written ``1e-3`` read as floats); raises BadInput naming the key.
    """
    resolve(name, hp)
    from p2pfl.schema import yaml_number

    return {k: yaml_number(v) for k, v in hp.items()}


def build_algorithm(name: str, hp: dict[str, Any], layout: ParamLayout) -> Algorithm:
    return algorithm_class(name)(hp, layout)


def describe(name: str) -> list[tuple[str, Any, str]]:
    """(hyperparameter, default, accepted values) of algorithm ``name``, for ``p2pfl algorithms``."""
    cls = lookup(name)
    docs = hyperparameter_docs(cls)
    return [(k, v, docs[k]) for k, v in cls.defaults.items()]


def algorithm_table() -> list[tuple[str, str, str]]:
    """(name, shares, first docstring line) of every algorithm."""
    out = []
    for name in ALGORITHMS:
        cls = lookup(name)
        doc = (cls.__doc__ or "").strip().splitlines()
        out.append((name, getattr(cls, "shares", "shared"), doc[0] if doc else ""))
    return out
