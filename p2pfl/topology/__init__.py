"""Topology: which peers mix with which, with what weights, in every round.

Parse and validate topology files (`load_topology`), place peers with an address book
(`p2pfl.topology.addressbook`, imported on demand), generate standard graphs (`generate`), build
mixing matrices and their spectral gap, and produce each peer's per-round `MixingPlan` as a pure
function of (topology, seed, round, step). The file format is documented in ``topology/README.md``.
"""

from .generators import KINDS, generate, grid_shape
from .mixing import (
    SparseMixing,
    is_column_stochastic,
    is_doubly_stochastic,
    is_row_stochastic,
    is_symmetric,
    metropolis_matrix,
    spectral_gap,
    uniform_pull_matrix,
    uniform_push_matrix,
)
from .schedule import MODES, SCHEDULE_KINDS, MixingPlan, Schedule
from .spec import WEIGHT_KINDS, ExplicitWeights, Peer, Topology, TopologyError, load_topology, parse_topology

__all__ = [
    "KINDS",
    "MODES",
    "SCHEDULE_KINDS",
    "WEIGHT_KINDS",
    "ExplicitWeights",
    "MixingPlan",
    "Peer",
    "Schedule",
    "SparseMixing",
    "Topology",
    "TopologyError",
    "generate",
    "grid_shape",
    "is_column_stochastic",
    "is_doubly_stochastic",
    "is_row_stochastic",
    "is_symmetric",
    "load_topology",
    "metropolis_matrix",
    "parse_topology",
    "spectral_gap",
    "uniform_pull_matrix",
    "uniform_push_matrix",
]
