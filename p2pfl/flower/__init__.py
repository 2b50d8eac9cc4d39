"""Flower at the peer's edge: a user's ClientApp as a peer of the decentralized round loop.

* ``p2pfl.flower.clientapp``: a config's ``app: "module:attr"`` (a ``flwr.clientapp.ClientApp``)
  runs as a peer: the Node sends it train and evaluate ``Message``s and gossips the arrays the
  config marks shared.
* ``p2pfl.flower.records``: the conversions at the boundary (tensors <-> records, messages).

This package sits below ``Experiment`` (which builds peers from it). The centralized baselines,
which drive whole experiments on Flower's own runtime, sit above it in ``p2pfl.centralized``.
Only Flower's public API is used. Flower ``Message`` objects never go on the peer wire; the
conversion happens here. Nothing is imported at package import time: ``flwr`` is heavy.
"""
