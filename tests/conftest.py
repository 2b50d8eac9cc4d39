"""Shared fixtures: small synthetic experiments that run in seconds."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from p2pfl.topology import generate

#: Loggers that report Flower's deprecations: flwr's own, and p2pfl's relay of a ``flwr run`` subprocess's.
DEPRECATION_LOGGERS = ("flwr", "p2pfl.centralized.superlink")


class _Deprecations(logging.Handler):
    """Collects warnings that name a deprecated feature ("DEPRECATED FEATURE: ...", "... is deprecated")."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "deprecat" in msg.lower():
            self.seen.append(f"{record.name}: {msg.strip()}")


@pytest.fixture(autouse=True)
def flower_deprecations() -> Iterator[list[str]]:
    """Fail any test during which Flower reports a deprecated feature.

    Why a log handler: flwr announces deprecations with ``log(WARNING, "DEPRECATED FEATURE: ...")``
    on its ``flwr`` logger (``flwr.supercore.logger.warn_deprecated_feature``), not with
    ``warnings.warn``, so pyproject's ``filterwarnings`` (which turns flwr's DeprecationWarnings into
    errors) does not see them. The list is the test's to inspect (and clear, to expect one).
    """
    handler = _Deprecations()
    loggers = [logging.getLogger(name) for name in DEPRECATION_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.seen
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    if handler.seen:
        pytest.fail("Flower reported a deprecated feature:\n" + "\n".join(handler.seen), pytrace=False)


#: Fields of a metrics record that time the run: they differ between any two runs of the same config
#: (``time``, the wall clock a launched peer writes its record at, is in its run folder's records only).
TIMES = ("seconds", "train_seconds", "time")


def records_without_times(run_dir: Path) -> list[dict[str, Any]]:
    """A run's ``metrics.jsonl`` records, in file order, less the fields that time the run."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMES} for line in lines]


def assert_same_bytes(sim: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Per (peer, round) ``bytes_sent``/``bytes_recv`` equal in both runs, and sent == received in total."""
    def by_key(recs: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[int, int]]:
        return {(r["peer"], r["round"]): (r["bytes_sent"], r["bytes_recv"]) for r in recs}

    assert by_key(records) == by_key(sim)
    for recs in (sim, records):
        assert sum(r["bytes_sent"] for r in recs) == sum(r["bytes_recv"] for r in recs) > 0


def tiny_config(tmp_path: Path, *, peers: int = 4, rounds: int = 3, algorithm: dict[str, Any] | None = None,
                kind: str = "ring", base_port: int = 50050, **extra: Any) -> Path:
    """Write a 4-peer synthetic experiment (and its topology) into ``tmp_path``; return the config path."""
    topo = generate(kind, peers, base_port=base_port)
    topo.dump(tmp_path / "topology.yaml")
    cfg = {
        "name": "tiny", "seed": 3, "rounds": rounds, "device": "cpu",
        "topology": str(tmp_path / "topology.yaml"),
        "data": {"dataset": "synthetic", "partition": {"kind": "dirichlet", "alpha": 0.5}, "batch_size": 16,
                 "params": {"num_classes": 4, "train_size": 800, "test_size": 400, "shape": [1, 8, 8], "seed": 1}},
        "model": {"name": "mlp", "hidden": 32},
        "algorithm": algorithm or {"name": "dfedavg", "lr": 0.1, "local_epochs": 1},
        "simulation": {"workers": 2},
    }
    cfg.update(extra)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return tiny_config(tmp_path)


def train_then_evaluate_one_client(cfg: Any, exp: Any, baseline: str) -> tuple[Any, Any, Any]:
    """One Flower baseline client (``p2``) by hand: a train then an evaluate instruction, both carrying
    the initial model at server round 1. Returns (the BaselinePeers, the client's Context, the
    evaluate reply's metrics)."""
    import json

    from flwr.app import ConfigRecord, Context, MessageType, RecordDict

    from p2pfl.centralized.baselines import BaselinePeers, initial_arrays
    from p2pfl.flower.records import instruction

    peers = BaselinePeers(json.loads(json.dumps(cfg.raw)), baseline)
    ctx = Context(run_id=7, node_id=2, node_config={"peer-id": "p2"}, state=RecordDict(), run_config={})
    arrays = initial_arrays(exp, "all")

    def message(kind: str) -> Any:
        return instruction(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}), kind,
                           run_id=7, src_node_id=1, dst_node_id=2, message_id=f"m-{kind}")

    peers.train(message(MessageType.TRAIN), ctx)
    reported = peers.evaluate(message(MessageType.EVALUATE), ctx).content.metric_records["metrics"]
    return peers, ctx, reported
