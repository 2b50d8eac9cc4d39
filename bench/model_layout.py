"""The zoo's conv nets on a CPU: channels-last activations (``models.base.channels_last``) vs NCHW.

For each model, one training step (cross-entropy, backward) at batch 16 and one evaluation
forward at batch 256, on one torch thread, with the first conv's output converted to
channels-last (the default) and with the conversion turned off (the former path), alternating
every repeat. Random inputs of Fashion-MNIST's shape (1x28x28), ten classes; the models are
built as `p2pfl.models.build_model` builds them. Also reported: the largest relative difference
between the two paths' gradients (float reassociation: the channels-last convolution sums in
another order).

Why it matters: PyTorch's CPU max-pool kernel for NCHW tensors is scalar (a third of a cnn_small
training step's CPU time went into it); the channels-last kernel is vectorized and oneDNN keeps
the later convs in that layout.

Figures (2026-11-25, 2-core box, the reproduction sweep paused; min over 3 repeats, ms):

* cnn_small: step 2.81 -> 2.21 (0.79x), eval 31.2 -> 18.8 (0.60x); grads agree to 6e-7 relative
* lenet: step 12.7 -> 10.4 (0.82x), eval 155 -> 128 (0.83x); 1.2e-6
* alexnet: step 143 -> 144 (1.01x), eval 323 -> 290 (0.90x); 1.3e-6

Usage: python bench/model_layout.py [--repeats 3] [--models cnn_small,lenet,alexnet]
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: training steps / evaluation passes per timing, per model (about a second each on one core)
REPS: dict[str, tuple[int, int]] = {"cnn_small": (200, 20), "lenet": (40, 4), "alexnet": (8, 2)}


def measure(name: str, repeats: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import p2pfl.models.base as base
    from p2pfl.models.registry import build_model

    steps, evals = REPS[name]
    torch.manual_seed(0)
    model = build_model(name, (1, 28, 28), 10)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    xe = torch.randn(256, 1, 28, 28)
    real = base.channels_last
    mod = sys.modules[type(model).__module__]

    def layout(on: bool) -> None:  # the models call the name they imported
        mod.channels_last = real if on else (lambda t: t)  # type: ignore[attr-defined]

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    try:
        layout(False)
        g_old = step()
        layout(True)
        g_new = step()
        rel = max(float((a - b).abs().max() / (a.abs().max() + 1e-30)) for a, b in zip(g_old, g_new, strict=True))
        times: dict[str, list[float]] = {}
        for rep in range(repeats):
            for tag in (("nchw", "channels_last") if rep % 2 == 0 else ("channels_last", "nchw")):
                layout(tag == "channels_last")
                t = time.process_time()
                for _ in range(steps):
                    step()
                times.setdefault(f"{tag}_step_ms", []).append((time.process_time() - t) / steps * 1e3)
                with torch.no_grad():
                    t = time.process_time()
                    for _ in range(evals):
                        model(xe)
                times.setdefault(f"{tag}_eval_ms", []).append((time.process_time() - t) / evals * 1e3)
    finally:
        layout(True)
    out: dict[str, Any] = {k: round(min(v), 3) for k, v in times.items()}
    out["step_ratio"] = round(out["channels_last_step_ms"] / out["nchw_step_ms"], 3)
    out["eval_ratio"] = round(out["channels_last_eval_ms"] / out["nchw_eval_ms"], 3)
    out["grad_max_rel_diff"] = rel
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default=",".join(REPS))
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    for name in args.models.split(","):
        if name not in REPS:
            raise SystemExit(f"--models: unknown model {name!r}; known: {', '.join(REPS)}")
        res[name] = measure(name, args.repeats)
        r = res[name]
        print(f"{name}: step {r['nchw_step_ms']:.2f} -> {r['channels_last_step_ms']:.2f} ms ({r['step_ratio']}x), "
              f"eval {r['nchw_eval_ms']:.1f} -> {r['channels_last_eval_ms']:.1f} ms ({r['eval_ratio']}x), "
              f"grads within {r['grad_max_rel_diff']:.1e}", flush=True)
    print(json.dumps({"device": "cpu", "threads": 1, "repeats": args.repeats, "models": res}))


if __name__ == "__main__":
    main()
