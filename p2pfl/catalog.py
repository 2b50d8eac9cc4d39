"""What ``p2pfl algorithms``, ``p2pfl models`` and ``p2pfl datasets`` list, without importing torch.

Why a catalog: the algorithms, models and datasets declare their metadata (hyperparameter
defaults, paper presets, constructor parameters, partition kinds) next to their implementations,
which import torch (about 3 s of CPU). Listing names must not pay for that every time, so the
listing is derived from the implementations (`build`, the one definition) once and cached as JSON
in the user's cache folder (``$XDG_CACHE_HOME/p2pfl`` or ``~/.cache/p2pfl``), keyed by a
fingerprint of the source files that declare it: any edit to them makes a new entry, so the cache
is never stale and nothing generated is committed. A read-only home just means no cache (each
listing then imports torch, as before).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

_PKG = Path(__file__).resolve().parent
#: Folders whose modules declare what the catalog lists (plus the modules ALGORITHMS names).
_SOURCES = ("algorithms", "models", "data")
_VERSION = 1  # bump when the catalog's layout changes

__all__ = ["build", "cache_dir", "fingerprint", "load"]


def _algorithms() -> list[dict[str, Any]]:
    from p2pfl.algorithms.presets import presets_for
    from p2pfl.algorithms.registry import algorithm_table, describe

    return [{"name": name, "shares": shares, "doc": doc,
             "hyperparameters": [[key, repr(default), accepted] for key, default, accepted in describe(name)],
             "presets": presets_for(name)}
            for name, shares, doc in algorithm_table()]


def _models() -> list[dict[str, Any]]:
    import inspect

    from p2pfl.models import model_names
    from p2pfl.models.registry import _REGISTRY, model_parameters

    out = []
    for name in model_names():
        sig = inspect.signature(_REGISTRY[name].__init__).parameters
        out.append({"name": name, "params": [[p, repr(sig[p].default)] for p in model_parameters(name)]})
    return out


def _datasets() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from p2pfl.data.datasets import KNOWN_DATASETS, dataset_parameters
    from p2pfl.data.partition import PARTITION_KINDS, partition_parameters

    datasets = [{"name": name, "params": [[k, repr(v)] for k, v in dataset_parameters(name).items()]}
                for name in KNOWN_DATASETS]
    partitions = []
    for kind in PARTITION_KINDS:
        keys, required = partition_parameters(kind)
        partitions.append({"kind": kind, "keys": keys, "required": required})
    return datasets, partitions


def build() -> dict[str, Any]:
    """The catalog as the implementations declare it (imports torch: seconds of CPU)."""
    datasets, partitions = _datasets()
    return {"algorithms": _algorithms(), "models": _models(), "datasets": datasets, "partitions": partitions}


def _source_files() -> list[Path]:
    files = {f for sub in _SOURCES for f in (_PKG / sub).rglob("*.py")}
    # an algorithm may live outside p2pfl/algorithms (ALGORITHMS maps name -> "module:Class")
    registry = (_PKG / "algorithms" / "__init__.py").read_text()
    for module in re.findall(r'"(p2pfl(?:\.\w+)+):\w+"', registry):
        path = _PKG.parent.joinpath(*module.split(".")).with_suffix(".py")
        if path.is_file():
            files.add(path)
    return sorted(files)


def fingerprint() -> str:
    """A hash of every source file the catalog is derived from (reads a few hundred kB: milliseconds)."""
    h = hashlib.sha256(f"catalog-v{_VERSION}".encode())
    for path in _source_files():
        h.update(str(path.relative_to(_PKG)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "p2pfl"


@cache
def load() -> dict[str, Any]:
    """The catalog: from the cache when the sources are unchanged (no torch), else built and cached."""
    path = cache_dir() / f"catalog-{fingerprint()}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # no entry yet (or a torn one): build it
        pass
    catalog = json.loads(json.dumps(build()))  # the same types a cache hit gives
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(catalog, sort_keys=True))
        os.replace(tmp, path)
        for old in path.parent.glob("catalog-*.json"):  # entries of sources that changed since
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:  # a read-only home: no cache, correct all the same
        pass
    return catalog
