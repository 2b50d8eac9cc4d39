"""Centralized baselines on Flower's own runtime: a config's peers as Flower nodes under a server.

* ``p2pfl.centralized.baselines``: FedAvg, FedPer, FedRep, Ditto and FedRoD over the same
  partitions, models and local rules as the decentralized runs (``p2pfl flower``).
* ``p2pfl.centralized.app``: the same as a Flower App for ``flwr run .`` (this repository's
  ``pyproject.toml`` names its components).

It drives whole experiments (it builds an ``Experiment``), so it sits above it; the peer-side
Flower adapter it reuses is ``p2pfl.flower``. Nothing is imported at package import time.
"""
