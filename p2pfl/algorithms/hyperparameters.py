"""Typed hyperparameter schemas: every algorithm's keys, their types, ranges and defaults.

Why a table keyed by hyperparameter *name*: the same name means the same thing in every
algorithm (``lr`` is an SGD step size, ``momentum`` a heavy-ball coefficient, ``local_unit`` a
phase unit), so one declaration per name gives every algorithm its type and range, and a new
algorithm only declares ``defaults``. A name missing from the table falls back to the type of its
default (so an algorithm added elsewhere is still type-checked). Cross-field rules (DFedADMM's
``lr <= 2 * lambda``, integer step counts when the unit is steps) stay in each algorithm's
``validate()``, which `check_hyperparameters` runs in the parent process too, so a bad value is
refused before any run folder exists, not in a worker.

Each algorithm's defaults are its class ``defaults``; ``algorithm.preset`` names a paper's
preset (see ``presets.py``). Both are listed by ``p2pfl algorithms``.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from p2pfl.badinput import BadInput, shorten, suggest

__all__ = ["algorithm_table", "check_hyperparameters", "describe", "hyperparameter_names", "typed_hyperparameters"]


def _number(value: Any) -> Any:
    from p2pfl.config import yaml_number

    return yaml_number(value)


def _float(**bounds: float) -> Any:
    return Annotated[float, BeforeValidator(_number), Field(allow_inf_nan=False, **bounds)]


def _int(**bounds: int) -> Any:
    return Annotated[int, Field(**bounds)]


def _choices(module: str, const: str, fallback: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return tuple(getattr(importlib.import_module(module), const))
    except (ImportError, AttributeError):  # pragma: no cover - a refactor moved the constant
        return fallback


# name -> (annotation, one-line description of the accepted values)
def _table() -> dict[str, tuple[Any, str]]:
    units = _choices("p2pfl.algorithms.local_sgd", "UNITS", ("steps", "epochs"))
    lam_sem = _choices("p2pfl.algorithms.dfedadmm", "LAMBDA_SEMANTICS", ("prox_coef", "equation"))
    duals = _choices("p2pfl.algorithms.dfedadmm", "MESSAGE_DUALS", ("old", "new"))
    dists = _choices("p2pfl.algorithms.dispfl", "DISTRIBUTIONS", ("erk", "uniform"))
    regrow = _choices("p2pfl.algorithms.dispfl", "REGROW", ("gradient", "random"))
    modes = _choices("p2pfl.topology.schedule", "MODES", ("pull", "push"))
    lr = (_float(gt=0, le=10), "number in (0, 10]")
    amount = (_float(ge=0, le=100_000), "number >= 0 (an integer when its unit is steps)")
    return {
        "lr": lr, "lr_head": lr, "lr_body": lr,
        "lr_decay": (_float(gt=0, le=1), "number in (0, 1] (multiplies the lr after every round)"),
        "local_epochs": (_float(gt=0, le=10_000), "number in (0, 10000] (fractions allowed)"),
        "local_steps": (_int(ge=0, le=10_000_000), "integer >= 0 (0: use local_epochs)"),
        "momentum": (_float(ge=0, lt=1), "number in [0, 1)"),
        "weight_decay": (_float(ge=0, le=1), "number in [0, 1]"),
        "rho": (_float(ge=0, le=100), "number in [0, 100] (SAM radius)"),
        "gossip_steps": (_int(ge=1, le=1000), "integer in [1, 1000]"),
        "lam": (_float(gt=0, le=1e6), "number in (0, 1e6]"),
        "lambda_semantics": (Literal[lam_sem], " | ".join(lam_sem)),
        "message_dual": (Literal[duals], " | ".join(duals)),
        "body_local": amount, "head_local": amount, "tau": amount, "rep_steps": amount,
        "local_unit": (Literal[units], " | ".join(units)),
        "tau_unit": (Literal[units], " | ".join(units)),
        "rep_unit": (Literal[units], " | ".join(units)),
        "sam_on": (Literal["body", "head", "both"], "body | head | both"),
        "mix_mode": (Literal[modes], " | ".join(modes)),
        "grad_clip": (_float(ge=0, le=1e6), "number >= 0 (0: no clipping)"),
        "density": (_float(gt=0, le=1), "number in (0, 1]"),
        "distribution": (Literal[dists], " | ".join(dists)),
        "anneal_factor": (_float(ge=0, le=1), "number in [0, 1]"),
        "anneal_rounds": (_int(ge=1, le=10_000_000), "integer >= 1"),
        "regrow": (Literal[regrow], " | ".join(regrow)),
        "evolve_masks": (bool, "true | false"),
    }


def _fallback(default: Any) -> tuple[Any, str]:
    if isinstance(default, bool):
        return bool, "true | false"
    if isinstance(default, int):
        return _int(), "integer"
    if isinstance(default, float):
        return _float(), "number"
    if isinstance(default, str):
        return str, "string"
    return Any, "any"  # None, lists, mappings: the algorithm's validate() checks them


def _algorithm_class(name: str) -> type:
    from p2pfl.algorithms import ALGORITHMS, algorithm_class

    if not isinstance(name, str) or name not in ALGORITHMS:
        close = suggest(name, ALGORITHMS)
        raise BadInput(f"unknown algorithm {shorten(repr(name))}", key="algorithm.name", allowed=sorted(ALGORITHMS),
                       hint=f"did you mean {close!r}?" if close else None)
    return algorithm_class(name)


def _owners(key: str) -> list[str]:
    from p2pfl.algorithms import ALGORITHMS

    return [a for a in ALGORITHMS if key in _algorithm_class(a).defaults]


@cache
def _schema(cls: type) -> tuple[type[BaseModel], dict[str, str]]:
    table = _table()
    fields: dict[str, Any] = {}
    docs: dict[str, str] = {}
    for key, default in cls.defaults.items():
        ann, doc = table.get(key) or _fallback(default)
        fields[key] = (ann, default)
        docs[key] = doc
    model = create_model(f"{cls.__name__}Hyperparameters",
                         __config__=ConfigDict(extra="forbid", strict=True), **fields)
    return model, docs


def hyperparameter_names(name: str) -> list[str]:
    """The hyperparameters algorithm ``name`` accepts (BadInput for an unknown algorithm)."""
    return list(_algorithm_class(name).defaults)


def typed_hyperparameters(cls: type, hp: dict[str, Any]) -> dict[str, Any]:
    """``cls.defaults`` overridden by ``hp`` (``preset`` ignored), schema-checked; HyperparameterError otherwise."""
    from p2pfl.algorithms.base import HyperparameterError
    from p2pfl.config import from_validation_error

    name = cls.name
    given = {k: _number(v) for k, v in hp.items() if k != "preset"}
    allowed = list(cls.defaults)
    for key in given:
        if key not in cls.defaults:
            close = suggest(key, allowed)
            owners = [a for a in _owners(key) if a != name]
            hint = (f"did you mean {close!r}?" if close else
                    f"{key} is a hyperparameter of {', '.join(owners)}, not of {name}" if owners else None)
            raise HyperparameterError(f"not a hyperparameter of {name}", key=f"algorithm.{key}", allowed=allowed,
                                      hint=hint)
    model, _ = _schema(cls)
    try:
        model.model_validate(given)
    except ValidationError as exc:
        err = from_validation_error(exc, model, prefix="algorithm")
        raise HyperparameterError(err.problem, key=err.key, allowed=err.allowed, hint=err.hint) from None
    return {**cls.defaults, **given}


def check_hyperparameters(name: str, hp: dict[str, Any]) -> dict[str, Any]:
    """Validate algorithm ``name`` with ``hp`` as a worker would build it, without a model.

    Returns ``hp`` as given (numbers written ``1e-3`` read as floats); raises BadInput naming the key.
    """
    from p2pfl.algorithms.base import HyperparameterError

    cls = _algorithm_class(name)
    merged = typed_hyperparameters(cls, hp)
    probe = cls.__new__(cls)  # validate() reads only self.hp / self.name: no layout needed
    probe.hp = merged
    probe.layout = None
    try:
        probe.validate()
    except HyperparameterError as exc:
        if exc.key:
            raise
        problem = exc.problem.removeprefix(f"{name}: ")
        raise HyperparameterError(problem, key="algorithm") from None
    return {k: _number(v) for k, v in hp.items()}


def describe(name: str) -> list[tuple[str, Any, str]]:
    """(hyperparameter, default, accepted values) of algorithm ``name``, for ``p2pfl algorithms``."""
    cls = _algorithm_class(name)
    _, docs = _schema(cls)
    return [(k, v, docs[k]) for k, v in cls.defaults.items()]


def algorithm_table() -> list[tuple[str, str, str]]:
    """(name, shares, first docstring line) of every algorithm."""
    from p2pfl.algorithms import ALGORITHMS

    out = []
    for name in ALGORITHMS:
        cls = _algorithm_class(name)
        doc = (cls.__doc__ or "").strip().splitlines()
        out.append((name, getattr(cls, "shares", "shared"), doc[0] if doc else ""))
    return out
