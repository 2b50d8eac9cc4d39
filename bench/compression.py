"""Wire compression: bytes per round and final accuracy per ``wire.compression`` mode.

The demo experiment (``peers/demo.yaml``), shortened with ``--rounds`` and ``--samples`` (as in
``bench/robust.py``, whose runner this uses), once per mode: ``none``, ``fp16``, ``bf16`` and
``topk`` at ``--topk-ratio``. Bytes are what the records account, which is the codec's exact
encoded size, headers included (the same bytes gRPC carries: tests/test_compression.py). DisPFL's
bit-packed masks are reported from the codec's size function (``dispfl_payload``).

Figures per mode: ``bytes_per_round`` (all peers), ``ratio`` to ``none``, final ``acc`` (mean over
peers) and ``acc_delta`` to ``none``; ``targets``: bf16 at most 0.55x the bytes within 0.02
accuracy, top-k at 10% within 0.02 accuracy. The last line is one JSON object.

Usage: python bench/compression.py [--rounds 6] [--samples 600] [--topk-ratio 0.1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def dispfl_payload() -> dict[str, int]:
    """DisPFL's payload on the demo model: float32 masks (before) against bit-packed (now)."""
    from p2pfl.config import load_config
    from p2pfl.experiment import Experiment
    from p2pfl.wire.validate import encoded_nbytes

    cfg = load_config(ROOT / "peers" / "demo.yaml", ["algorithm.name=dispfl", "device=cpu"], check_files=False)
    specs = Experiment.from_config(cfg).new_algorithm().wire_specs()
    masks = sum(s.numel for s in specs if s.dtype == "bit")
    packed = encoded_nbytes(specs, "none")
    return {"tensor_bytes": packed, "tensor_bytes_float_masks": packed - sum(-(-s.numel // 8) for s in specs
                                                                                if s.dtype == "bit") + 4 * masks}


def main() -> None:
    from robust import run_demo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--modes", default="none,fp16,bf16,topk")
    args = ap.parse_args()
    out: dict[str, dict] = {}
    for mode in args.modes.split(","):
        res = run_demo([f"wire.compression={mode}", f"wire.topk_ratio={args.topk_ratio}"], args.rounds, args.samples)
        out[mode] = res
        print(f"{mode:5s}: {res['bytes_per_round']} bytes/round, acc {res['acc']:.4f} ({res['wall_s']:.0f} s)",
              flush=True)
    base = out.get("none")
    if base:
        for res in out.values():
            res["ratio"] = round(res["bytes_per_round"] / base["bytes_per_round"], 4)
            res["acc_delta"] = round(res["acc"] - base["acc"], 4)
    targets = {}
    if base and "bf16" in out:
        targets["bf16_halves_bytes_same_acc"] = out["bf16"]["ratio"] <= 0.55 and abs(out["bf16"]["acc_delta"]) <= 0.02
    if base and "topk" in out:
        targets["topk_within_0.02"] = out["topk"]["acc_delta"] >= -0.02
    print(json.dumps({"bench": "compression", "rounds": args.rounds, "samples_per_peer": args.samples,
                      "topk_ratio": args.topk_ratio, "modes": out, "dispfl_payload": dispfl_payload(),
                      "targets": targets}))


if __name__ == "__main__":
    main()
