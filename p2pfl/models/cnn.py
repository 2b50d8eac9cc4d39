"""Small convolutional nets: DFedADMM's LeNet-style "FedAvg CNN" and a fast demo CNN."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from .base import (
    PersonalModel,
    channels_last,
    check_head_layers,
    check_input_shape,
    check_num_classes,
    conv_out,
    linear_stack,
)


def _two_conv_flat(h: int, w: int, kernel: int, name: str) -> tuple[int, int]:
    """Spatial size after two (valid conv k -> maxpool 2) stages; errors if the image is too small."""
    for _ in range(2):
        h, w = conv_out(h, kernel) // 2, conv_out(w, kernel) // 2
    if h < 1 or w < 1:
        raise ValueError(f"{name}: input too small for two conv{kernel}+pool stages")
    return h, w


class LeNet(PersonalModel):
    """LeNet-style CNN of DFedADMM (spec 002 section 4.3, the "FedAvg CNN" lineage).

    ``Conv(C->64, k5) -> ReLU -> MaxPool2 -> Conv(64->64, k5) -> ReLU -> MaxPool2 -> FC(->384) -> ReLU
    -> FC(384->192) -> ReLU -> FC(192->classes)``, no padding. On 3x32x32 the first FC has
    64*5*5 = 1600 inputs and the model has 797,962 parameters (spec: "797,962 params"); the pooling
    after *both* convs follows the lineage code, as the spec resolves the paper's contradiction.
    On 1x28x28 the first FC has 64*4*4 = 1024 inputs.
    """

    HEAD = "fc3"

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = check_input_shape(input_shape)
        check_num_classes(num_classes)
        fh, fw = _two_conv_flat(h, w, 5, "lenet")
        self.conv1 = nn.Conv2d(c, 64, 5)
        self.conv2 = nn.Conv2d(64, 64, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(64 * fh * fw, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, num_classes)  # personal head, registered last

    def represent(self, x: Tensor) -> Tensor:
        x = self.pool(channels_last(self.conv1(x)).relu())
        x = self.pool(self.conv2(x).relu())
        x = x.flatten(1)
        x = self.fc1(x).relu()
        return self.fc2(x).relu()


class SmallCNN(PersonalModel):
    """A small, fast CNN for demos and tests (not from a paper).

    ``Conv(C->c1, k5) -> ReLU -> MaxPool2 -> Conv(c1->c2, k5) -> ReLU -> MaxPool2 -> FC(->hidden)
    -> ReLU -> FC(hidden->classes)``. Why the defaults (16, 32, 128): on one CPU thread an epoch of
    7,500 Fashion-MNIST samples (batch 64, SGD) takes about 1.5 s, against about 4.6 s for
    (32, 64, 128), with little accuracy to gain on 28x28 images; pass ``channels``/``hidden`` to
    change it.

    ``head_layers`` (default 1) makes the personal head a multi-layer classifier, as DePRL's public
    code does (its whole classifier is personal, spec 004 §9): the classifier then has
    ``max(2, head_layers)`` linear layers (``hidden`` wide), all of them personal, under the name
    ``classifier`` (``linear_stack``); the body is the two convolutions. ``head_layers: 2`` is the
    default network with its whole classifier personal, ``head_layers: 3`` adds a hidden layer to
    mirror the authors' three-layer classifier. ``head_layers: 1`` is the network as before, the
    parameter names (``fc1``, ``fc2``) included, so existing runs and checkpoints are unchanged.
    """

    HEAD = "fc2"
    MAX_HEAD_LAYERS: ClassVar[int] = 8  # a bound on the classifier's depth, not a paper's value

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        channels: tuple[int, int] = (16, 32),
        hidden: int = 128,
        head_layers: int = 1,
    ) -> None:
        super().__init__()
        c, h, w = check_input_shape(input_shape)
        check_num_classes(num_classes)
        check_head_layers("cnn_small", head_layers, self.MAX_HEAD_LAYERS)
        c1, c2 = channels
        fh, fw = _two_conv_flat(h, w, 5, "cnn_small")
        self.conv1 = nn.Conv2d(c, c1, 5)
        self.conv2 = nn.Conv2d(c1, c2, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.multi = head_layers > 1
        if self.multi:
            widths = [c2 * fh * fw] + [hidden] * (head_layers - 1) + [num_classes]
            self.classifier = linear_stack(widths)  # personal head, registered last
            self.HEAD = "classifier"
        else:
            self.fc1 = nn.Linear(c2 * fh * fw, hidden)
            self.fc2 = nn.Linear(hidden, num_classes)  # personal head, registered last

    def represent(self, x: Tensor) -> Tensor:
        x = self.pool(channels_last(self.conv1(x)).relu())
        x = self.pool(self.conv2(x).relu())
        return x.flatten(1) if self.multi else self.fc1(x.flatten(1)).relu()
