"""Flower at the library's edges: a user's ClientApp as a peer, and the centralized baselines.

* ``p2pfl.flower.clientapp``: a config's ``app: "module:attr"`` (a ``flwr.clientapp.ClientApp``)
  runs as a peer of the decentralized round loop: the Node sends it train and evaluate
  ``Message``s and gossips the arrays the config marks shared.
* ``p2pfl.flower.baselines``: FedAvg, FedPer and FedRep on Flower's own runtime
  (``flwr.simulation.run_simulation``, Ray), over the same partitions, models and local rules as
  the decentralized runs; ``p2pfl.flower.app`` exposes them to ``flwr run .``.
* ``p2pfl.flower.records``: the conversions at the boundary (tensors <-> records, messages).

Only Flower's public API is used. Flower ``Message`` objects never go on the peer wire; the
conversion happens here. Nothing is imported at package import time: ``flwr`` is heavy.
"""
