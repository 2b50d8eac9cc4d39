"""Simulation engines. ``exact`` is the Node loop itself (``p2pfl.simulation``); ``batched`` (here)
runs the peers as slices of stacked tensors, one vectorized step for all of them."""

ENGINES = ("exact", "batched")

__all__ = ["ENGINES"]
