"""Assemble an experiment from its config: topology, dataset, partition, model, per-peer state.

Both the simulation and a standalone node build peers through ``Experiment.make_node`` so
every mode starts from the same initial weights, data and generators (bitwise on CPU).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from p2pfl.algorithms import Algorithm, PeerState, build_algorithm
from p2pfl.algorithms.robust import MixingRule
from p2pfl.checkpoint import config_fingerprint
from p2pfl.config import ExperimentConfig
from p2pfl.data import ArrayDataset, Partition, PeerData, load_dataset, make_partition
from p2pfl.faults import ByzantineFault
from p2pfl.modelpool import ModelPool
from p2pfl.models import build_model, split_parameter_names
from p2pfl.models.layout import ParamLayout
from p2pfl.node import Node, Protocol, Recorder
from p2pfl.peerapp import PeerApp
from p2pfl.resume import ResumeCheck
from p2pfl.topology import Topology
from p2pfl.transport.base import Transport
from p2pfl.wire.compress import WireFormat
from p2pfl.wire.pipeline import PayloadPipeline

if TYPE_CHECKING:
    from p2pfl.flower.appstate import AppLayout
    from p2pfl.flower.clientapp import AppSpec, AppStart


def resolve_device(name: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU; ``cuda`` without a GPU is an error, never a silent fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def set_fp32_precision(tf32: bool) -> None:
    """How CUDA computes float32 convolutions and matrix products in this process: TF32 inputs
    (``tf32``) or IEEE float32. PyTorch's own default differs per backend (cuDNN convolutions in TF32,
    matrix products not), so a GPU run of a CNN drifts from the CPU's; the config's ``tf32`` decides
    for all of them at once. Uses the per-backend ``fp32_precision`` API where PyTorch has it (mixing
    it with the legacy ``allow_tf32`` flags is an error there)."""
    mode = "tf32" if tf32 else "ieee"
    backends = torch.backends
    if hasattr(backends.cudnn, "conv") and hasattr(backends.cudnn.conv, "fp32_precision"):
        backends.cuda.matmul.fp32_precision = mode
        backends.cudnn.conv.fp32_precision = mode
        backends.cudnn.rnn.fp32_precision = mode
    else:  # older PyTorch
        backends.cuda.matmul.allow_tf32 = tf32
        backends.cudnn.allow_tf32 = tf32


def peer_seed(seed: int, index: int) -> int:
    """A peer's own seed: a pure function of (experiment seed, peer index)."""
    return (seed * 1_000_003 + index * 7919 + 17) % (2**63 - 1)


@dataclass
class Experiment:
    cfg: ExperimentConfig
    device: torch.device

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> Experiment:
        device = resolve_device(cfg.device)
        if device.type == "cuda":
            set_fp32_precision(cfg.tf32)
        return cls(cfg, device)

    @cached_property
    def topology(self) -> Topology:
        """The config's graph, with its peers placed by ``network.addresses`` when the config names an
        address book (the hash is the graph's either way; the simulation needs no addresses)."""
        from p2pfl.topology.addressbook import placed_topology

        return placed_topology(self.cfg.topology, getattr(self.cfg.network, "addresses", None))

    @cached_property
    def dataset(self) -> ArrayDataset:
        return load_dataset(self.cfg.data.dataset, self.cfg.data.root, **self.cfg.data.params)

    @cached_property
    def app_spec(self) -> AppSpec | None:
        """The config's ClientApp (``app:``), or None for a built-in algorithm."""
        if not self.cfg.raw.get("app"):
            return None
        from p2pfl.flower.clientapp import AppSpec

        return AppSpec.from_raw(self.cfg.raw)

    @cached_property
    def partition(self) -> Partition | None:
        if self.app_spec is not None:
            return None  # a ClientApp partitions its own data (context.node_config's partition-id)
        p = dict(self.cfg.data.partition)
        kind = p.pop("kind")
        return make_partition(self.dataset.train_y.numpy(), self.dataset.test_y.numpy(),
                              len(self.topology.peers), kind, self.cfg.seed, **p)

    def build_model(self) -> torch.nn.Module:
        params = {k: v for k, v in self.cfg.model.items() if k != "name"}
        return build_model(self.cfg.model["name"], self.dataset.input_shape, self.dataset.num_classes, **params)

    @cached_property
    def _init(self) -> tuple[ParamLayout, torch.Tensor]:
        """One initial model for every peer (identical phi(0), as all papers recommend)."""
        if self.app_spec is not None:
            return self._app_init[:2]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            model = self.build_model()
        shared, personal = split_parameter_names(model)
        layout = ParamLayout.from_model(model, shared, personal)
        return layout, layout.flatten(model)

    @cached_property
    def _app(self) -> tuple[AppLayout, torch.Tensor, AppStart]:
        """A ClientApp run's state layout, initial flat buffer and message contents (``clientapp.app_start``).

        Built once per process, before any peer starts: a wrong app is refused here.
        """
        from p2pfl.flower.clientapp import app_layout, app_start

        spec = self.app_spec
        assert spec is not None
        start = app_start(spec, self.cfg.seed, len(self.topology.ids), self.topology.ids[0])
        state, flat = app_layout(start.state, spec.personal, spec.running_stats)  # type: ignore[arg-type]
        return state, flat, start

    @property
    def _app_init(self) -> tuple[ParamLayout, torch.Tensor, dict[str, torch.dtype]]:
        """(layout, initial flat buffer, every state entry's dtype) of a ClientApp run."""
        state, flat, _ = self._app
        return state.layout, flat, state.dtypes

    @property
    def layout(self) -> ParamLayout:
        return self._init[0]

    def new_algorithm(self) -> Algorithm:
        if self.app_spec is not None:
            from p2pfl.flower.clientapp import ClientAppAlgorithm

            state, _, start = self._app
            algo: Algorithm = ClientAppAlgorithm(self.app_spec, state, start, run_id=self.cfg.seed)
        elif self.cfg.choice is not None:
            algo = self.cfg.choice.build(self.layout)
        else:  # a config assembled by hand rather than by load_config
            algo = build_algorithm(self.cfg.algorithm_name, self.cfg.hyperparameters(), self.layout)
        m = self.cfg.mixing
        algo.mixing = MixingRule(m.robust, m.trim, float(m.clip_radius))  # checked by the config (robust.py)
        return algo

    @property
    def wire_format(self) -> WireFormat:
        """``wire.*``: how every payload of the run is encoded."""
        return WireFormat(self.cfg.wire.compression, float(self.cfg.wire.topk_ratio))

    def pipeline(self, peer_id: str) -> PayloadPipeline:
        """``peer_id``'s outgoing/incoming payload transforms: its ``faults.byzantine`` entry, the wire format."""
        fault = next((ByzantineFault(b.peer, b.kind, float(b.scale)) for b in self.cfg.faults.byzantine
                      if b.peer == peer_id), None)
        return PayloadPipeline(self.wire_format, fault, self.cfg.seed)

    def model_factory(self) -> torch.nn.Module:
        if self.app_spec is not None:
            from p2pfl.flower.clientapp import carrier_module

            return carrier_module(self.layout).to(self.device)
        return self.build_model().to(self.device)

    def peer_data(self, peer_id: str) -> PeerData:
        i = self.topology.index(peer_id)
        return PeerData(self.dataset, self.partition.train[i], self.partition.test[i],
                        self.cfg.data.batch_size, self.device)

    def protocol(self, peer_id: str) -> Protocol:
        """The round protocol's settings for ``peer_id`` (``network.*``, docs/protocol.md)."""
        net = self.cfg.network
        return Protocol(asynchronous=net.mode == "async", window=net.window, probe_s=float(net.probe_s),
                        max_staleness=net.max_staleness, staleness_exp=float(net.staleness_exp),
                        slowdown=float(net.slowdown.get(peer_id, 1.0)))

    @cached_property
    def fingerprint(self) -> dict[str, str]:
        """The run's fingerprint every checkpoint carries (`p2pfl.checkpoint.config_fingerprint`)."""
        return config_fingerprint(self.cfg.raw, self.topology.hash())

    def resume_check(self, run_dir: Path, accept_config_change: bool = False) -> ResumeCheck:
        """What a resume verifies in a checkpoint of this run before it touches the run folder."""
        return ResumeCheck(run_dir, self.cfg.raw, self.fingerprint, self.checkpoint_shapes, accept=accept_config_change)

    def checkpoint_shapes(self, peer_id: str) -> dict[str, tuple[int, ...]]:
        """The shapes of the tensors a checkpoint of ``peer_id`` holds under this config (a fresh
        state: ``params`` and the algorithm's ``extra/<name>``), which a resume checks first."""
        state = PeerState(peer_id=peer_id, params=self._init[1].clone())
        if self.app_spec is not None:  # a ClientApp's algorithm state needs its peer bound: params only
            return {"params": tuple(state.params.shape)}
        gen = torch.Generator(device="cpu")
        gen.manual_seed(peer_seed(self.cfg.seed, self.topology.index(peer_id)))
        self.new_algorithm().init_state(state, gen)
        return {"params": tuple(state.params.shape), **{f"extra/{k}": tuple(v.shape) for k, v in state.extra.items()}}

    def make_node(self, peer_id: str, *, transport: Transport, models: ModelPool, record: Recorder,
                  run_dir: Path | None, stop: threading.Event | None = None, on_round=None,
                  rounds: int | None = None) -> Node:
        i = self.topology.index(peer_id)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(peer_seed(self.cfg.seed, i))
        algorithm = self.new_algorithm()
        state = PeerState(peer_id=peer_id, params=self._init[1].clone().to(self.device))
        app: Any
        if self.app_spec is not None:
            from p2pfl.flower.clientapp import ClientAppEvaluator

            algorithm.bind_peer(peer_id, i, len(self.topology.ids))  # type: ignore[attr-defined]
            app = ClientAppEvaluator(algorithm)  # type: ignore[arg-type]
        else:
            app = PeerApp(peer_id, self.model_factory, self.peer_data(peer_id), self.device)
        algorithm.init_state(state, gen)
        if transport is not None:  # the batched engine builds nodes without one
            transport.configure_wire(self.wire_format, int(self.cfg.network.chunk_kb) * 1024)
        ckpt = (run_dir / "checkpoints" / f"{peer_id}.npz") if (run_dir and self.cfg.checkpoint_every) else None
        node = Node(peer_id=peer_id, topology=self.topology, algorithm=algorithm, app=app, transport=transport,
                    models=models, layout=self.layout, state=state, generator=gen, seed=self.cfg.seed,
                    rounds=rounds or self.cfg.rounds, deadline_s=self.cfg.network.round_timeout_s, record=record,
                    eval_every=self.cfg.eval_every, checkpoint_path=ckpt, checkpoint_every=self.cfg.checkpoint_every,
                    stop=stop, on_round=on_round, quorum=self.cfg.network.quorum,
                    protocol=self.protocol(peer_id), pipeline=self.pipeline(peer_id),
                    eval_pre_gossip=self.cfg.eval_pre_gossip)
        node.checkpoint_meta = {"run": self.fingerprint}
        return node
