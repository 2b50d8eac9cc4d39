"""``tf32`` (config): how CUDA computes float32 convolutions and matrix products.

PyTorch by default lets cuDNN run convolutions in TF32, so a GPU run of a CNN drifts from the CPU's
by more than float reassociation. The config's ``tf32`` (off by default) sets every backend at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from p2pfl.experiment import set_fp32_precision
from p2pfl.models.registry import build_model


def _modes() -> tuple[str, ...]:
    b = torch.backends
    return (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision)


@pytest.fixture
def restore_precision() -> Iterator[None]:
    before = _modes()
    yield
    b = torch.backends
    b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision = before


def test_one_switch_sets_every_backend(restore_precision: None) -> None:
    set_fp32_precision(True)
    assert _modes() == ("tf32",) * 3
    set_fp32_precision(False)
    assert _modes() == ("ieee",) * 3


def _grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cnn_gradients_on_cuda_equal_the_cpu_only_without_tf32(restore_precision: None) -> None:
    """cnn_small's gradients for one batch of 16 on the GPU: within float reassociation of the CPU's
    in IEEE mode; in TF32 mode measurably further away (the switch reaches cuDNN)."""
    torch.manual_seed(0)
    model = build_model("cnn_small", (1, 28, 28), 10)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    ref = _grads(model, x, y)
    gpu = model.cuda()
    err = {}
    for tf32 in (False, True):
        set_fp32_precision(tf32)
        g = _grads(gpu, x.cuda(), y.cuda()).cpu()
        err[tf32] = float((g - ref).norm() / ref.norm())
    assert err[False] <= 1e-5, err
    assert err[True] > 10 * err[False], err
