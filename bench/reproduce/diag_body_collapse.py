"""Diagnostic: has a personalized run's shared body collapsed, leaving each peer's head to learn its label prior?

DFedSMDC at the paper's SAM radius (ρ 0.7) on ``cnn_small`` ends near 41-45 % personalized accuracy, where
DFedMDC (the same rule without SAM) reaches 92. A head on a body whose features no longer depend on the input
can only learn its peer's label prior: it predicts the class most frequent in the peer's training split for
every sample, and scores that class's share of the peer's own test split. This script tests that reading
two ways, per run folder:

1. from the run's evidence alone (``metrics.jsonl[.gz]`` and ``partition.json[.gz]``, so it works on the
   committed folders under ``docs/results/runs/``): the mean final accuracy against the mean of that
   prior-only score, and how many peers score it exactly (within half a test sample);
2. where the folder still has the peers' final checkpoints (``runs/reproduce/...`` only: checkpoints are
   never committed): the body's features (the input of the head) over the first 2,000 Fashion-MNIST test
   images, as the standard deviation across inputs averaged over features and peers. A collapsed body
   gives nearly the same features for every image.

    python bench/reproduce/diag_body_collapse.py RUN_FOLDER [RUN_FOLDER ...] [--out OUT.json]

Prints one line per folder, then one JSON line with every folder's figures.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

FEATURE_INPUTS = 2000


def _open(folder: Path, name: str) -> Any:
    """``name`` or ``name.gz`` in ``folder`` (the committed evidence is gzipped), as text."""
    if (folder / name).is_file():
        return open(folder / name)
    if (folder / f"{name}.gz").is_file():
        return gzip.open(folder / f"{name}.gz", "rt")
    raise SystemExit(f"{folder}: has neither {name} nor {name}.gz")


def accuracies_by_round(folder: Path) -> dict[int, dict[str, float]]:
    """Every evaluated round's accuracy of each peer (rounds without an evaluation are left out)."""
    by_round: dict[int, dict[str, float]] = {}
    with _open(folder, "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("acc") is not None:
                by_round.setdefault(int(rec["round"]), {})[str(rec["peer"])] = float(rec["acc"])
    if not by_round:
        raise SystemExit(f"{folder}/metrics.jsonl: no evaluated round")
    return by_round


def final_accuracies(folder: Path) -> tuple[int, dict[str, float]]:
    """(last evaluated round, each peer's accuracy at it)."""
    by_round = accuracies_by_round(folder)
    last = max(by_round)
    return last, by_round[last]


def prior_only_scores(partition: dict[str, Any], train_y: np.ndarray, test_y: np.ndarray,
                      num_classes: int) -> list[tuple[float, float]]:
    """Per peer: (score of predicting its training split's most frequent class, half a test sample)."""
    out = []
    for train_idx, test_idx in zip(partition["train"], partition["test"], strict=True):
        majority = int(np.bincount(train_y[train_idx], minlength=num_classes).argmax())
        test = test_y[test_idx]
        out.append((float((test == majority).mean()), 0.5 / max(len(test), 1)))
    return out


def feature_spread(folder: Path, cfg: dict[str, Any], dataset: Any) -> float | None:
    """Std of the body's features across the first test images, mean over features and peers; None without
    the final checkpoints."""
    import torch

    from p2pfl.checkpoint import load_checkpoint
    from p2pfl.models.layout import ParamLayout
    from p2pfl.models.registry import build_model, split_parameter_names

    ckpts = sorted((folder / "checkpoints").glob("*.npz")) if (folder / "checkpoints").is_dir() else []
    if not ckpts:
        return None
    model_cfg = dict(cfg["model"])
    model = build_model(str(model_cfg.pop("name")), dataset.input_shape, dataset.num_classes, **model_cfg)
    layout = ParamLayout.from_model(model, *split_parameter_names(model))  # the runs' flat [shared | personal]
    x = dataset.test_x[:FEATURE_INPUTS]
    spreads = []
    for path in ckpts:
        state, _, meta = load_checkpoint(path)
        if int(meta["round"]) != int(cfg["rounds"]):
            raise SystemExit(f"{path}: a round-{meta['round']} checkpoint, not the run's final ({cfg['rounds']})")
        layout.bind(model, state.params.float().contiguous())
        with torch.no_grad():
            spreads.append(float(model.represent(x).std(0).mean()))
    return statistics.fmean(spreads)


@functools.cache
def _dataset(name: str) -> Any:
    """Loaded once per name: every folder of a call usually shares one dataset."""
    from p2pfl.data.datasets import load_dataset

    return load_dataset(name)


def diagnose(folder: Path) -> dict[str, Any]:
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    dataset = _dataset(str(cfg["data"]["dataset"]))
    with _open(folder, "partition.json") as f:
        partition = json.load(f)
    last, accs = final_accuracies(folder)
    prior = prior_only_scores(partition, dataset.train_y.numpy(), dataset.test_y.numpy(), dataset.num_classes)
    if len(prior) != len(accs):
        raise SystemExit(f"{folder}: {len(accs)} peers evaluated at round {last}, {len(prior)} in partition.json")
    order = sorted(accs, key=lambda p: int(p.lstrip("p")))  # peers p0..p{N-1}, the partition's order
    at_prior = sum(abs(accs[p] - score) <= tol for p, (score, tol) in zip(order, prior, strict=True))
    return {
        "run": folder.resolve().relative_to(ROOT).as_posix() if folder.resolve().is_relative_to(ROOT) else str(folder),
        "algorithm": cfg["algorithm"]["name"], "rho": cfg["algorithm"].get("rho"), "seed": int(cfg["seed"]),
        "round": last + 1, "peers": len(accs),
        "final_acc_mean": round(100 * statistics.fmean(accs.values()), 2),
        "prior_only_acc_mean": round(100 * statistics.fmean(s for s, _ in prior), 2),
        "peers_at_prior_only": at_prior,
        "body_feature_std": None if (s := feature_spread(folder, cfg, dataset)) is None else round(s, 4),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = ap.parse_args(argv)
    rows = []
    for folder in args.folders:
        row = diagnose(folder)
        rows.append(row)
        spread = "no checkpoints" if row["body_feature_std"] is None else f"feature std {row['body_feature_std']}"
        print(f"{row['run']}: round {row['round']}, {row['final_acc_mean']} % against {row['prior_only_acc_mean']}"
              f" prior-only, {row['peers_at_prior_only']} of {row['peers']} peers at it, {spread}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(json.dumps({"diag_body_collapse": rows}))


if __name__ == "__main__":
    main()
