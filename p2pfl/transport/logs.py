"""The transport's two loggers, in a module that imports nothing but `logging`.

Why a module of its own: the push-sum weight rules (`pushsum`) log too, and the simulation imports
them without gRPC (`tests/test_sim_cpu.py` checks that ``p2pfl simulate`` never imports grpc); the
gRPC contract (`rpc`) re-exports these. They are named after the modules in front of them
(`grpc_service`, `grpc_transport`) whichever part logs, so the names logs are filtered on stay put.
"""

from __future__ import annotations

import logging

__all__ = ["SERVICE_LOG", "TRANSPORT_LOG"]

SERVICE_LOG = logging.getLogger("p2pfl.transport.grpc_service")
TRANSPORT_LOG = logging.getLogger("p2pfl.transport.grpc_transport")
