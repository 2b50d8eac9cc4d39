"""The ground floor of every typed schema: pydantic's errors as one ``error: FILE: KEY: problem`` line.

Every file a user writes (the experiment config, a topology, an address book, an algorithm's
hyperparameters) is checked by a pydantic model; this module turns the first validation error of
any of them into one `ConfigError` naming the dotted key, with the allowed keys or values and a
close match. It sits below everything that validates (``config``, ``topology``, ``algorithms``) so
that none of them has to import another to share the one error style.
"""

from __future__ import annotations

import math
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from p2pfl.badinput import BadInput, shorten, suggest

__all__ = ["ConfigError", "dotted", "from_validation_error", "yaml_number"]


class ConfigError(BadInput):
    """A config file or override is malformed; the message names the file and key."""


# YAML 1.1 reads ``1e-3`` (no dot) as a string; accept such numbers where a float is expected.
_SCI = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def yaml_number(value: Any) -> Any:
    """``"1e-3"`` -> 0.001 (YAML 1.1 leaves it a string); anything else unchanged for the schema."""
    if isinstance(value, str) and _SCI.match(value.strip()):
        return float(value)
    return value



_PHRASES = {
    "missing": "missing (required)",
    "bool_type": "must be true or false",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
}


def _inner_model(ann: Any) -> type[BaseModel] | None:
    """The BaseModel inside an annotation such as ``Section``, ``list[Entry] | None``."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in typing.get_args(ann):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at ``loc`` (for 'unknown key' messages)."""
    for part in loc:
        if isinstance(part, int):
            continue  # a list index: same model
        fld = model.model_fields.get(str(part))
        inner = _inner_model(fld.annotation) if fld else None
        if inner is None:
            break
        model = inner
    return list(model.model_fields)


def dotted(loc: tuple[Any, ...], prefix: str = "") -> str:
    """('peers', 0, 'id') -> 'peers[0].id'."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) not in ("", "function-after[_device(), str]"):
            out = f"{out}.{part}" if out else str(part)
    return out


def from_validation_error(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> ConfigError:
    """The first pydantic error as one ConfigError line naming the dotted key."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(err["loc"])
    key = dotted(loc, prefix)
    typ, ctx = err["type"], err.get("ctx") or {}
    got = err.get("input")
    shown = "" if typ == "missing" else f", got {shorten(repr(got), 60)}"
    if typ == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        close = suggest(loc[-1], allowed)
        return ConfigError("unknown key", key=key, allowed=allowed,
                           hint=f"did you mean {close!r}?" if close else None)
    if isinstance(got, float) and not math.isfinite(got):
        return ConfigError(f"must be a finite number{shown}", key=key)
    if typ in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[typ]
        bound = next(iter(ctx.values()))
        return ConfigError(f"must be {op} {bound}{shown}", key=key)
    if typ == "literal_error":
        return ConfigError(f"not an allowed value{shown}", key=key, allowed=ctx.get("expected", ""))
    if typ == "value_error":
        msg = str(ctx.get("error", err["msg"]))
        head, _, allowed = msg.partition("allowed: ")
        return ConfigError(f"not an allowed value{shown}", key=key, allowed=allowed or None) if allowed \
            else ConfigError(f"{msg}{shown}", key=key)
    phrase = _PHRASES.get(typ) or err["msg"].replace("Input should be", "must be")
    return ConfigError(f"{phrase}{shown}", key=key)
