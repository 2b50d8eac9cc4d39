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
preset (see ``presets.py``). Both are listed by ``p2pfl algorithms``. This module knows no
algorithm by name: looking a name up (and the checks that need every algorithm, such as "``tau``
is a hyperparameter of deprl, not of dfedavg") is ``registry.py``'s job, one floor up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from p2pfl.badinput import BadInput, suggest
from p2pfl.schema import from_validation_error, yaml_number

__all__ = ["HyperparameterError", "hyperparameter_docs", "typed_hyperparameters"]


class HyperparameterError(BadInput):
    """An algorithm was given an unknown or invalid hyperparameter."""


def _number(value: Any) -> Any:
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


def hyperparameter_docs(cls: type) -> dict[str, str]:
    """Each hyperparameter of ``cls`` -> one line saying which values it accepts."""
    return _schema(cls)[1]


def typed_hyperparameters(cls: type, hp: dict[str, Any], owners: Callable[[str], list[str]] | None = None
                          ) -> dict[str, Any]:
    """``cls.defaults`` overridden by ``hp`` (``preset`` ignored), schema-checked; HyperparameterError otherwise.

    ``owners(key)`` names the algorithms that do have an unknown ``key`` (the registry passes it, so
    the error can say where the key belongs).
    """
    name = cls.name
    given = {k: _number(v) for k, v in hp.items() if k != "preset"}
    allowed = list(cls.defaults)
    for key in given:
        if key not in cls.defaults:
            close = suggest(key, allowed)
            others = [a for a in owners(key) if a != name] if owners else []
            hint = (f"did you mean {close!r}?" if close else
                    f"{key} is a hyperparameter of {', '.join(others)}, not of {name}" if others else None)
            raise HyperparameterError(f"not a hyperparameter of {name}", key=f"algorithm.{key}", allowed=allowed,
                                      hint=hint)
    model, _ = _schema(cls)
    try:
        model.model_validate(given)
    except ValidationError as exc:
        err = from_validation_error(exc, model, prefix="algorithm")
        raise HyperparameterError(err.problem, key=err.key, allowed=err.allowed, hint=err.hint) from None
    return {**cls.defaults, **given}
