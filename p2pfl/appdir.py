"""A Flower App named by its directory, read the way ``flwr run`` reads it.

A config's ``app:`` is either ``package.module:attr`` (a ClientApp on the Python path) or a Flower
App directory: one holding the ``pyproject.toml`` that ``flwr new`` writes, whose
``[tool.flwr.app.components]`` name the ``serverapp`` and ``clientapp`` and whose
``[tool.flwr.app.config]`` holds the run config defaults. Naming the directory is all it takes:

* its package is imported from the directory itself, as ``flwr run`` does (the directory goes first
  on ``sys.path``, once per process); the directory need not be installed or on ``PYTHONPATH``;
* the run config is the pyproject's defaults (nested tables flattened to dotted keys, as Flower
  does) with the config's ``app_config`` (or ``--set app_config.KEY=V``) on top; a key the app does
  not declare is refused, with the closest declared one, where Flower would ignore it silently.

Every refusal is a `AppError` (a `BadInput`): ``error: FILE: KEY: problem`` and exit status 2, with
FILE the ``pyproject.toml`` for what it says and the experiment config for what that says.
"""

from __future__ import annotations

import functools
import importlib
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pfl.badinput import BadInput, shorten, suggest

PYPROJECT = "pyproject.toml"
COMPONENTS = "tool.flwr.app.components"
RUN_CONFIG = "tool.flwr.app.config"


class AppError(BadInput):
    """A Flower App (or the config's ``app*`` keys naming it) is unusable; the message names the file and key."""


def is_object_ref(ref: str) -> bool:
    """``package.module:attr`` rather than a directory (a directory path never needs a colon here)."""
    return ":" in ref


def load_object(ref: str, key: str, *, source: str | None = None) -> Any:
    """``"package.module:attr"`` -> the object; an `AppError` naming ``source`` and ``key`` otherwise."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise AppError(f"{shorten(ref)!r} is not 'package.module:attr'", source=source, key=key)
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise AppError(f"cannot import module {module!r} ({shorten(str(exc), 200)})", source=source,
                       key=key) from None
    except Exception as exc:  # noqa: BLE001 - the app's own import-time code failed: name it, one line
        raise AppError(f"importing module {module!r} failed: {type(exc).__name__}: {shorten(str(exc), 200)}",
                       source=source, key=key) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AppError(f"module {module!r} has no attribute {attr!r}", source=source, key=key)
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class FlowerAppDir:
    """What a Flower App directory's ``pyproject.toml`` declares (the parts a peer needs)."""

    root: Path
    clientapp: str  # "package.module:attr"
    serverapp: str  # "" when the pyproject names none
    config: dict[str, Any]  # [tool.flwr.app.config], flattened to dotted keys

    @property
    def pyproject(self) -> str:
        return str(self.root / PYPROJECT)


def read_app_dir(path: str | Path) -> FlowerAppDir:
    """Read and check a Flower App directory's ``pyproject.toml`` (cached per file version)."""
    root = Path(path)
    if not root.is_dir():
        raise AppError(f"{shorten(str(path))!r} is neither 'package.module:attr' nor a folder"
                       if not root.exists() else f"{shorten(str(path))!r} is not a folder", key="app",
                       hint="name a Flower App directory (holding pyproject.toml) or a ClientApp object")
    file = root / PYPROJECT
    if not file.is_file():
        raise AppError(f"folder {shorten(str(path))!r} holds no {PYPROJECT}: not a Flower App directory", key="app")
    st = file.stat()
    return _read(str(root.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _read(root: str, mtime_ns: int, size: int) -> FlowerAppDir:
    source = str(Path(root) / PYPROJECT)
    try:
        doc = tomllib.loads(Path(source).read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise AppError(f"not valid TOML: {shorten(str(exc), 200)}", source=source) from None
    app = doc.get("tool", {}).get("flwr", {}).get("app")
    if not isinstance(app, dict):
        raise AppError("missing: a Flower App declares its components here", source=source, key="tool.flwr.app")
    components = app.get("components")
    if not isinstance(components, dict):
        raise AppError("missing: name the serverapp and clientapp ('package.module:app')", source=source,
                       key=COMPONENTS)
    refs: dict[str, str] = {}
    for name in ("clientapp", "serverapp"):
        ref = components.get(name)
        if ref is None and name == "serverapp":
            refs[name] = ""
            continue
        if ref is None:
            raise AppError("missing: the ClientApp every peer runs, e.g. 'mypackage.client_app:app'",
                           source=source, key=f"{COMPONENTS}.{name}")
        if not isinstance(ref, str) or not is_object_ref(ref) or ref.startswith(":") or ref.endswith(":"):
            raise AppError(f"{shorten(repr(ref))} is not 'package.module:attr'", source=source,
                           key=f"{COMPONENTS}.{name}")
        refs[name] = ref
    from flwr.common.config import flatten_dict

    raw = app.get("config", {})
    if not isinstance(raw, dict):
        raise AppError("must be a table of run config values", source=source, key=RUN_CONFIG)
    try:
        config = flatten_dict(raw)
    except ValueError as exc:
        raise AppError(str(exc), source=source, key=RUN_CONFIG) from None
    return FlowerAppDir(Path(root), refs["clientapp"], refs["serverapp"], dict(config))


def importable(app: FlowerAppDir) -> None:
    """Put the app's directory first on ``sys.path`` (once), as ``flwr run`` does, so its package imports."""
    root = str(app.root)
    if root not in sys.path:
        sys.path.insert(0, root)


def run_config(app: FlowerAppDir, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The app's run config: its pyproject defaults with ``overrides`` (the config's ``app_config``) on top.

    Nested override tables are flattened to dotted keys, as Flower flattens the pyproject's. A key
    the app does not declare is refused (``app_config.KEY``), naming the closest declared key.
    """
    from flwr.common.config import flatten_dict

    try:
        flat = flatten_dict(dict(overrides))
    except ValueError as exc:
        raise AppError(str(exc), key="app_config") from None
    for key in flat:
        if key not in app.config:
            close = suggest(key, app.config)
            raise AppError(f"not a run config key of the app ({app.pyproject} [{RUN_CONFIG}])",
                           key=f"app_config.{key}", allowed=sorted(app.config) or "none",
                           hint=f"did you mean {close!r}?" if close else None)
    return {**app.config, **flat}
