"""``p2pfl simulate``: every peer of the config on this machine (or across the ranks of a
``torchrun`` launch), with one of the two engines that sit side by side in `p2pfl.engine`:

* ``exact`` (the default, `p2pfl.engine.exact`): each peer runs the deployment's own Node loop with
  an in-memory transport, peers sharded over the ranks of a torch.distributed group; bitwise equal
  to `p2pfl launch` and independent of the number of ranks;
* ``batched`` (`p2pfl.engine.batched`): the peers as rows of stacked tensors, one vectorized
  step for all of a rank's peers, over the same ranks (each rank its peers' rows, the rows of
  other ranks' in-neighbours exchanged per gossip step); equal to ``exact`` up to float reassociation.

Both write the same run folder (`p2pfl.runfolder`) and resume from the same checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from p2pfl.config import ConfigError, ExperimentConfig
from p2pfl.engine.exact import SimulationError, simulate_exact
from p2pfl.experiment import Experiment

__all__ = ["SimulationError", "simulate"]


def simulate(cfg: ExperimentConfig, out_dir: str | Path, *, progress: bool = True,
             experiment: Experiment | None = None, resume: bool = False,
             accept_config_change: bool = False) -> dict[str, Any]:
    """Run the experiment; write the run folder; return the summary (on rank 0; ``{}`` on the
    other ranks of a ``torchrun`` launch).

    ``resume``: continue an interrupted run in ``out_dir`` from the last round that *every* peer
    checkpointed (see :func:`p2pfl.resume.prepare_resume`); from round 0 when there is none. The
    checkpoints are verified first (`Experiment.resume_check`); ``accept_config_change``: go on although the
    config differs from theirs (recorded in the run folder).
    """
    if cfg.network.mode == "async":
        raise ConfigError("network.mode: async runs under `p2pfl launch` / `p2pfl node` (one process per peer); "
                          "the in-memory simulation is synchronous")
    torch.set_num_threads(1)  # before any torch work, so a forked rank inherits no thread pool
    run_dir = Path(out_dir)
    exp = experiment or Experiment.from_config(cfg)
    if (cfg.raw.get("simulation") or {}).get("engine", "exact") == "batched":
        from p2pfl.engine.batched import simulate_batched

        return simulate_batched(cfg, exp, run_dir, progress=progress, resume=resume,
                                accept_config_change=accept_config_change)
    return simulate_exact(cfg, exp, run_dir, progress=progress, resume=resume,
                          accept_config_change=accept_config_change)
