"""Single-host simulation: every peer of the config in one process, through the same Node loop.

Each peer runs its Node in a thread with an in-memory transport; a pool of ``workers`` model
objects caps how many peers compute at once (torch uses one thread per worker, which keeps both
cores busy and stays bitwise deterministic: each peer's randomness is its own generator).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from p2pfl.config import ExperimentConfig
from p2pfl.experiment import Experiment
from p2pfl.modelpool import ModelPool
from p2pfl.runfolder import MetricsWriter, plot_accuracy, sort_metrics, summarize, write_inputs, write_summary
from p2pfl.transport.memory import MemoryHub, MemoryTransport

log = logging.getLogger(__name__)

# In one process nobody is late: a peer waits for its neighbours however long their compute takes.
SIM_DEADLINE_S = 7 * 24 * 3600.0


class SimulationError(RuntimeError):
    pass


def simulate(cfg: ExperimentConfig, out_dir: str | Path, *, progress: bool = True,
             experiment: Experiment | None = None) -> dict[str, Any]:
    """Run the experiment; write the run folder; return the summary."""
    torch.set_num_threads(1)
    run_dir = Path(out_dir)
    exp = experiment or Experiment.from_config(cfg)
    topo = exp.topology
    write_inputs(run_dir, cfg.raw, topo.to_dict(), exp.partition)
    hub = MemoryHub()
    models = ModelPool(exp.model_factory, cfg.workers)
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    errors: list[BaseException] = []
    done = threading.Semaphore(0)
    nodes = []
    for pid in topo.ids:
        node = exp.make_node(pid, transport=MemoryTransport(hub, pid), models=models, record=writer,
                             run_dir=run_dir, on_round=lambda _r: done.release())
        node.deadline_s = SIM_DEADLINE_S
        nodes.append(node)

    def run_node(node) -> None:
        try:
            node.run()
        except BaseException as exc:  # noqa: BLE001 - every failure must stop the whole simulation
            errors.append(exc)
            log.exception("peer %s failed", node.peer_id)
            hub.abort(f"peer {node.peer_id} failed: {exc!r}")
            done.release()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run_node, args=(n,), name=f"peer-{n.peer_id}", daemon=True) for n in nodes]
    for t in threads:
        t.start()
    total = len(nodes) * cfg.rounds
    _wait(done, total, cfg.rounds, len(nodes), errors, progress)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    writer.close()
    if errors:
        raise SimulationError(f"simulation failed: {errors[0]!r}") from errors[0]
    recs = sort_metrics(run_dir / "metrics.jsonl", list(topo.ids))
    summary = summarize(recs, {
        "name": cfg.name, "algorithm": cfg.algorithm_name, "seed": cfg.seed, "mode": "simulate",
        "wall_seconds": wall, "wall_seconds_per_round": wall / cfg.rounds, "workers": cfg.workers,
    })
    write_summary(run_dir, summary)
    plot_accuracy(recs, run_dir / "accuracy.png", f"{cfg.name}: {cfg.algorithm_name}")
    return summary


def _wait(done: threading.Semaphore, total: int, rounds: int, peers: int, errors: list, progress: bool) -> None:
    if not progress:
        for _ in range(total):
            done.acquire()
            if errors:
                return
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]simulating"), BarColumn(), MofNCompleteColumn(), TextColumn("peer-rounds"),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task("sim", total=total)
        for _ in range(total):
            done.acquire()
            if errors:
                return
            bar.advance(task)
