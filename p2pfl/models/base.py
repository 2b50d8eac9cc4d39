"""What every model in the zoo has in common: one declared personal head, no buffers, no randomness.

Why a single attribute: the personalized algorithms (DFedMDC, DFedPGP, DePRL, FedRep-style
baselines) all split a model into a shared body that is gossiped and a personal head that never
leaves the peer. Declaring the head in exactly one place (``HEAD``) keeps the split, the flat
``[shared | personal]`` layout and the wire format from drifting apart.

The head is one module: the final ``nn.Linear`` (the papers' "final fully-connected layer"), or an
``nn.Sequential`` classifier of several linear layers (``linear_stack``), which is how DePRL's public
code splits its models (every parameter of the ``classifier``; spec 004 §9). A model whose head
depth is a choice takes a ``head_layers`` argument (``model.head_layers`` in a config) and sets
``HEAD`` on the instance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

InputShape = tuple[int, int, int]


class PersonalModel(nn.Module):
    """Base class of the zoo's models.

    Subclasses set ``HEAD`` to the module path of their personal head (its final ``nn.Linear``, or
    an ``nn.Sequential`` of linear layers ending in one: every parameter under that path is personal)
    and register that module *last*, so that ``named_parameters()`` lists the shared body first and
    the head at the end. ``HEAD`` is a class attribute; a model whose head depends on a constructor
    argument (``head_layers``) sets it on the instance.

    Subclasses implement ``represent(x)``, the body's features; ``forward`` is the head applied to
    them. Why the split: an algorithm that trains the head with the body frozen (DePRL, DFedMDC,
    DFedPGP) computes the features of its minibatches once per phase instead of once per step.
    """

    HEAD: str = ""

    def represent(self, x: Tensor) -> Tensor:
        """The body's output: what the head (``HEAD``) is applied to."""
        raise NotImplementedError

    def head(self) -> nn.Module:
        """The personal head module (an ``nn.Linear``, or a ``linear_stack``)."""
        return getattr(self, self.HEAD)

    def forward(self, x: Tensor) -> Tensor:
        return getattr(self, self.HEAD)(self.represent(x))


def linear_stack(widths: Sequence[int], *, relu_last: bool = False) -> nn.Sequential:
    """``Linear(w0, w1), ReLU, Linear(w1, w2), ..., Linear(w_{n-1}, w_n)``: an MLP classifier or a part of one.

    ``relu_last`` adds a ReLU after the last layer too (a part that feeds further layers). No
    dropout: the zoo's models draw nothing at forward time (see ``AlexNet``).
    """
    if len(widths) < 2:
        raise ValueError(f"a linear stack needs at least two widths, got {list(widths)}")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if relu_last or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def head_layers_problem(head_layers: object, most: int) -> str | None:
    """Why ``head_layers`` is refused (None: accepted): an int in ``[1, most]``, the linear layers
    that can be personal. One rule for the constructors and the config check (``model.head_layers``)."""
    if isinstance(head_layers, bool) or not isinstance(head_layers, int) or not 1 <= head_layers <= most:
        return f"must be an integer in [1, {most}], got {head_layers!r}"
    return None


def check_head_layers(model: str, head_layers: int, most: int) -> int:
    """``head_layers`` checked by ``head_layers_problem``; ``ValueError`` naming the model otherwise."""
    problem = head_layers_problem(head_layers, most)
    if problem is not None:
        raise ValueError(f"{model}: head_layers {problem}")
    return head_layers


def check_input_shape(input_shape: tuple[int, ...]) -> InputShape:
    """Validate a ``(C, H, W)`` shape; models size their layers from it, so fail early and clearly."""
    shape = tuple(input_shape)
    if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"input_shape must be (C, H, W) with positive ints, got {input_shape!r}")
    return shape  # type: ignore[return-value]


def check_num_classes(num_classes: int) -> int:
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    return num_classes


def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial output size of a conv/pool layer (floor mode), as PyTorch computes it."""
    return (size + 2 * padding - kernel) // stride + 1


def pad_amounts(height: int, width: int, min_size: int) -> tuple[int, int, int, int]:
    """``F.pad`` amounts (left, right, top, bottom) that centre an image in a ``min_size`` square.

    Why: the CIFAR-sized nets (AlexNet per DePRL Table 5, VGG-11) need a 32x32 input; Fashion-MNIST
    is 28x28, and zero-padding to 32x32 is the usual fix (the DePRL spec names it as an option).
    """
    dh, dw = max(0, min_size - height), max(0, min_size - width)
    return (dw // 2, dw - dw // 2, dh // 2, dh - dh // 2)


class ZeroPad(nn.Module):
    """Parameter-free zero padding (identity when no padding is needed)."""

    def __init__(self, pad: tuple[int, int, int, int]) -> None:
        super().__init__()
        self.pad = pad

    def forward(self, x: Tensor) -> Tensor:
        return F.pad(x, self.pad) if any(self.pad) else x

    def extra_repr(self) -> str:
        return f"pad={self.pad}"


def channels_last(x: Tensor) -> Tensor:
    """``x`` in channels-last memory on a CPU (a conv output, before its ReLU); as it is elsewhere.

    Why: PyTorch's CPU max-pool kernel for NCHW tensors is scalar, its channels-last kernel is
    vectorized, and oneDNN runs every later convolution in its input's layout. Converting once,
    right after the first convolution, keeps the ReLUs, pools and convs (and their backward
    passes) in one layout; converting at the pool instead left the ReLU's backward with mixed
    layouts and gained nothing. Measured on one core, cnn_small at batch 16: the NCHW pools were a
    third of a training step's CPU time (figures in ``bench/model_layout.py``). Values agree to
    float reassociation (the channels-last convolution sums in another order). On other devices,
    and under any torch.func transform (``vmap``, ``grad``: the batched engine on a GPU), ``x`` is returned
    as it is (functorch refuses a channels-last clone). Parameters are
    untouched: they stay contiguous views of the peer's flat buffer.
    """
    if x.device.type == "cpu" and x.dim() == 4 and not torch._C._functorch.is_functorch_wrapped_tensor(x):
        return x.contiguous(memory_format=torch.channels_last)
    return x
