"""AlexNet adapted to 28x28 / 32x32 images, as in DePRL's Table 5 (Fashion-MNIST)."""

from __future__ import annotations

from torch import Tensor, nn

from .base import (
    PersonalModel,
    ZeroPad,
    channels_last,
    check_input_shape,
    check_num_classes,
    conv_out,
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
