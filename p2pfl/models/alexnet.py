"""AlexNet adapted to 28x28 / 32x32 images: DePRL's Table 5 (``alexnet``) and its public code's (``alexnet_fmnist``)."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from .base import (
    PersonalModel,
    ZeroPad,
    channels_last,
    check_head_layers,
    check_input_shape,
    check_num_classes,
    conv_out,
    linear_stack,
    pad_amounts,
)


class AlexNet(PersonalModel):
    """DePRL Table 5 AlexNet (spec 004 section 3.4), all convs 3x3 pad 1 with bias, ReLU everywhere.

    ``conv1 C->64 stride 2 -> maxpool2 -> conv2 64->192 -> maxpool2 -> conv3 192->384 ->
    conv4 384->256 -> conv5 256->256 -> maxpool2 -> fc6 1024->4096 -> fc7 4096->4096 ->
    fc8 4096->classes`` (fc8 = the personal head, "the final fully-connected layer").

    Choices where the table is ambiguous, as the spec suggests:

    - Bias sizes follow the out-channels (the table's bias column is inconsistent).
    - ``in_channels`` comes from ``input_shape`` (1 for Fashion-MNIST, not the table's 3), and inputs
      smaller than ``min_size`` (32) are zero-padded to 32x32 inside ``forward``, because fc6's 1024
      inputs (256x2x2) only arise from a 32x32 image (28x28 would give 256x1x1). With 3x32x32 and
      10 classes the body is 23,231,296 parameters, as the spec derives.

    Deviation: the table's two ``dropout(0.2)`` layers are omitted. Dropout draws its masks from the
    global torch RNG, which peers running in threads share, so it would break per-peer bitwise
    determinism.
    """

    HEAD = "fc8"

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, min_size: int = 32) -> None:
        super().__init__()
        c, h, w = check_input_shape(input_shape)
        check_num_classes(num_classes)
        pad = pad_amounts(h, w, min_size)
        h, w = h + pad[2] + pad[3], w + pad[0] + pad[1]
        for k, s, p in ((3, 2, 1), (2, 2, 0), (2, 2, 0), (2, 2, 0)):  # conv1 and the three pools
            h, w = conv_out(h, k, s, p), conv_out(w, k, s, p)
        if h < 1 or w < 1:
            raise ValueError("alexnet: input too small")
        self.pad = ZeroPad(pad)
        self.conv1 = nn.Conv2d(c, 64, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(64, 192, 3, padding=1)
        self.conv3 = nn.Conv2d(192, 384, 3, padding=1)
        self.conv4 = nn.Conv2d(384, 256, 3, padding=1)
        self.conv5 = nn.Conv2d(256, 256, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc6 = nn.Linear(256 * h * w, 4096)
        self.fc7 = nn.Linear(4096, 4096)
        self.fc8 = nn.Linear(4096, num_classes)  # personal head, registered last

    def represent(self, x: Tensor) -> Tensor:
        x = self.pad(x)
        x = self.pool(channels_last(self.conv1(x)).relu())
        x = self.pool(self.conv2(x).relu())
        x = self.conv3(x).relu()
        x = self.conv4(x).relu()
        x = self.pool(self.conv5(x).relu())
        x = x.flatten(1)
        x = self.fc6(x).relu()
        return self.fc7(x).relu()


class AlexNetFMNIST(PersonalModel):
    """The Fashion-MNIST model of DePRL's public code (``alex_fmnist``, about 2.5 M parameters).

    Why a second AlexNet: the paper's Table 5 describes a 23 M-parameter AlexNet (``AlexNet``), but
    the authors' code (GYan58/AAAI24-DePRL at 341e890, ``Models/Alex.py:5-39``) trains a much smaller
    one, and makes its whole classifier personal (``Utils.py:747-753``: every parameter whose name
    contains ``classifier``). Re-expressed here from that file, not copied:

    ``features``: conv 11x11 stride 4 pad 5 (C->64), maxpool 2, conv 5x5 pad 2 (64->192), maxpool 2,
    conv 3x3 pad 1 (192->384), conv 3x3 (384->256), conv 3x3 (256->256), maxpool 2, ReLU after each
    conv (``Alex.py:8-22``); then ``classifier``: Linear 256->128, ReLU, Linear 128->128, ReLU,
    Linear 128->classes (``Alex.py:23-31``). On 1x32x32 and 10 classes: 2,454,208 body and 50,698
    classifier parameters, 2,504,906 in all.

    ``head_layers`` (default 3: the authors' split) is how many of the classifier's three linear
    layers are personal, counted from the output; the others are shared. ``head_layers: 1`` is the
    paper text's split (the final linear layer) on the authors' model.

    Deviations: (1) the authors resize 28x28 images to 32x32 (``Utils.py:323, 368``); the data
    pipeline here has no resizing, so inputs smaller than ``min_size`` are zero-padded to 32x32, as
    in ``AlexNet`` (the conv stack needs 32: at 28 the last pool gets a 1x1 map). (2) The two
    ``Dropout(0.05)`` of their classifier (``Alex.py:24, 27``) are omitted, as in ``AlexNet``: dropout
    draws from the global torch RNG and would break per-peer determinism.
    """

    HEAD = "classifier"
    MAX_HEAD_LAYERS: ClassVar[int] = 3

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, head_layers: int = 3,
                 min_size: int = 32) -> None:
        super().__init__()
        c, h, w = check_input_shape(input_shape)
        check_num_classes(num_classes)
        check_head_layers("alexnet_fmnist", head_layers, self.MAX_HEAD_LAYERS)
        pad = pad_amounts(h, w, min_size)
        h, w = h + pad[2] + pad[3], w + pad[0] + pad[1]
        # conv1 and pool, conv2 and pool, the last pool (conv3-5 keep the size)
        for k, s, p in ((11, 4, 5), (2, 2, 0), (5, 1, 2), (2, 2, 0), (2, 2, 0)):
            h, w = conv_out(h, k, s, p), conv_out(w, k, s, p)
        if h < 1 or w < 1:
            raise ValueError("alexnet_fmnist: input too small")
        self.pad = ZeroPad(pad)
        self.conv1 = nn.Conv2d(c, 64, 11, stride=4, padding=5)
        self.features = nn.Sequential(
            nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),
        )
        widths = [256 * h * w, 128, 128, num_classes]
        shared = len(widths) - 1 - head_layers  # linear layers of the classifier kept in the body
        self.fc: nn.Module = linear_stack(widths[: shared + 1], relu_last=True) if shared else nn.Identity()
        self.classifier = linear_stack(widths[shared:])  # personal head, registered last

    def represent(self, x: Tensor) -> Tensor:
        x = channels_last(self.conv1(self.pad(x)))
        return self.fc(self.features(x).flatten(1))
