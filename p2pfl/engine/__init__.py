"""The simulation's two engines, side by side (`p2pfl.simulation` picks one by ``simulation.engine``):

* ``exact`` (`p2pfl.engine.exact`): the Node loop itself, peers sharded over torch.distributed
  ranks (`p2pfl.procgroup`), taking turns in each rank (`p2pfl.turns`);
* ``batched`` (`p2pfl.engine.batched`, `p2pfl.engine.context`): the peers as slices of stacked
  tensors, one vectorized step for all of them.

Both run each algorithm's one update rule (`p2pfl.algorithms`) and write the same run folder.
"""

ENGINES = ("exact", "batched")

__all__ = ["ENGINES"]
