"""Is a model's representation enough for DePRL's numbers? A body trained on all peers' data at once, each
peer's head refit on its own data.

DePRL's Table 1 cells learn the body by gossip and the personal heads locally. This diagnostic takes gossip
and the ×0.96 schedule out of the body's training: one model is trained centrally on the union of the 128
peers' training sets (the same partition as a Table 1 config), then each peer freezes that body and refits
its head on its own data (the personal block, as DePRL's head phase trains it) and is evaluated on its own
test split, as the Table 1 metric. The mean over peers says what personalized accuracy this model's
representation allows when the body is trained with all the data; if it sits near the paper's DePRL
number, the model is not what limits our DePRL cells, their body training is; if it sits far under it,
the model is.

Usage: python bench/reproduce/diag_central_body.py [--set data.partition.pi=0.1] [--epochs 5]
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DEFAULT_CONFIG = ROOT / "bench" / "reproduce" / "table1" / "base.yaml"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--epochs", type=float, default=5.0, help="central epochs over all peers' training data")
    ap.add_argument("--lr", type=float, default=0.1, help="central lr (D-PSGD's rule: plain SGD, wd 5e-4)")
    ap.add_argument("--head-epochs", type=float, default=10.0, help="each peer's head refit, in epochs")
    ap.add_argument("--head-lr", type=float, default=0.005, help="the head refit's lr (DePRL's head lr)")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from p2pfl.algorithms.base import TrainContext
    from p2pfl.algorithms.local_sgd import Phase
    from p2pfl.config import load_config
    from p2pfl.data.loader import PeerData
    from p2pfl.experiment import Experiment
    from p2pfl.peerapp import PeerApp

    torch.set_num_threads(1)
    cfg = load_config(args.config, [f"topology={ROOT / 'topology' / 'ring-128.yaml'}", *args.set])
    exp = Experiment.from_config(cfg)
    part, layout = exp.partition, exp.layout
    ids = list(exp.topology.ids)
    t0 = time.perf_counter()

    # 1. one body (and head) on the union of every peer's training data, D-PSGD's local rule
    model = exp.build_model()
    flat = exp._init[1].clone()  # noqa: SLF001 - the initial weights every Table 1 cell starts from
    layout.bind(model, flat)
    union = PeerData(exp.dataset, np.concatenate(part.train), np.concatenate(part.test), cfg.data.batch_size)
    gen = torch.Generator().manual_seed(cfg.seed)
    central_loss = TrainContext(model, layout, union, gen, torch.device("cpu")).train(
        "all", Phase(lr=args.lr, amount=args.epochs, unit="epochs", weight_decay=5e-4))
    central = PeerApp("all", exp.model_factory, union, torch.device("cpu")).evaluate(model)
    t_central = time.perf_counter() - t0

    # 2. each peer: that body frozen, its own head refit on its own data, evaluated on its own split
    before, after = [], []
    for pid in ids:
        node = exp.make_node(pid, transport=None, models=None, record=lambda rec: None,  # type: ignore[arg-type]
                             run_dir=None)
        node.state.params.copy_(flat)
        peer_model = exp.build_model()
        layout.bind(peer_model, node.state.params)
        before.append(node.app.evaluate(peer_model)["acc"])
        ctx = TrainContext(peer_model, layout, node.app.data, node.generator, torch.device("cpu"))
        ctx.train("personal", Phase(lr=args.head_lr, amount=args.head_epochs, unit="epochs", weight_decay=1e-5))
        after.append(node.app.evaluate(peer_model)["acc"])
    out = {
        "config": str(Path(args.config).resolve().relative_to(ROOT)), "set": args.set, "peers": len(ids),
        "model": cfg.model["name"], "central_epochs": args.epochs, "central_lr": args.lr,
        "central_train_loss": round(float(central_loss or 0.0), 4),
        "central_acc_on_all_peers_tests": round(100 * central["acc"], 2),
        "global_head_on_own_split": round(100 * statistics.fmean(before), 2),
        "own_head_on_own_split": round(100 * statistics.fmean(after), 2),
        "head_epochs": args.head_epochs, "head_lr": args.head_lr,
        "seconds_central": round(t_central, 1), "seconds_total": round(time.perf_counter() - t0, 1),
    }
    print(f"central model on all peers' test samples {out['central_acc_on_all_peers_tests']:.2f} %; per peer, "
          f"its own split: global head {out['global_head_on_own_split']:.2f} %, own refit head "
          f"{out['own_head_on_own_split']:.2f} %")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
