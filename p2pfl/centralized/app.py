"""The centralized baselines as a Flower App, for ``flwr run .`` (``[tool.flwr.app]`` in pyproject.toml).

``flwr run . --run-config "baseline='fedrep' config='peers/demo.yaml'"`` runs a config's peers as
Flower SuperNodes (one per peer: set the federation's ``num-supernodes`` to the topology's
size) under ``RecordingFedAvg``; the ServerApp writes the same run folder as ``p2pfl flower``
(``out``, default ``runs/flwr-<name>-<baseline>``). ``p2pfl flower --runtime ray`` runs this very
app the same way (``p2pfl.centralized.superlink``). Run config keys: ``config`` (a p2pfl
experiment YAML, relative to the app's folder or absolute), ``baseline``, ``rounds`` (0: the
config's), ``out``, ``resume-at`` (the round a resumed run starts at, prepared by ``p2pfl flower
--resume``; 0: from the start). With an absolute ``out`` the nodes write their checkpoint
generations there (a relative one could name another folder in a Ray worker's working directory).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import yaml
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

APP_ROOT = Path(__file__).resolve().parents[2]  # the folder holding pyproject.toml (or the installed FAB)

client_app = ClientApp()
server_app = ServerApp()

_peers: dict[tuple[str, str, int], Any] = {}
_lock = threading.Lock()


def _config(run_config: dict[str, Any]) -> Any:
    """The experiment config named by the run config, with paths made absolute against the app folder."""
    from p2pfl.config import load_config

    path = Path(str(run_config.get("config", "peers/demo.yaml")))
    if not path.is_absolute() and not path.exists():
        path = APP_ROOT / path
    sets = []
    raw = yaml.safe_load(path.read_text()) or {}
    topo = raw.get("topology")
    if isinstance(topo, str) and not Path(topo).is_absolute() and not Path(topo).exists() and (APP_ROOT / topo).exists():
        sets.append(f"topology={APP_ROOT / topo}")
    rounds = int(run_config.get("rounds", 0) or 0)
    if rounds:
        sets.append(f"rounds={rounds}")
    return load_config(path, sets)


def _out(run_config: dict[str, Any], cfg: Any, baseline: str) -> Path:
    return Path(str(run_config.get("out") or f"runs/flwr-{cfg.name}-{baseline}"))


def _baseline_peers(context: Context) -> Any:
    from p2pfl.centralized.baselines import baseline_peers, portable_config

    rc = dict(context.run_config)
    out = str(rc.get("out") or "")
    key = (str(rc.get("config")), str(rc.get("baseline", "fedper")), int(rc.get("rounds", 0) or 0), out,
           int(rc.get("resume-at", 0) or 0))
    with _lock:
        if key not in _peers:
            run_dir = out if Path(out).is_absolute() else None
            _peers[key] = baseline_peers(portable_config(_config(rc)), key[1], run_dir, key[4] if run_dir else 0)
        return _peers[key]


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    return _baseline_peers(context).train(msg, context)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _baseline_peers(context).evaluate(msg, context)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    from p2pfl.centralized.baselines import on_grid, serve_baseline

    rc = dict(context.run_config)
    cfg = _config(rc)
    baseline = str(rc.get("baseline", "fedper"))
    serve_baseline(on_grid(grid), cfg, _out(rc, cfg, baseline), baseline, runtime="flwr-run",
                   start=int(rc.get("resume-at", 0) or 0))
