"""The MNIST MLP of DFedADMM: 784-200-200-10 with ReLU ("three FC layers", spec 002 section 4.3)."""

from __future__ import annotations

from torch import Tensor, nn

from .base import PersonalModel, check_input_shape, check_num_classes


class MLP(PersonalModel):
    """Two hidden ReLU layers; flattens its input, so it takes any ``(C, H, W)``.

    For 1x28x28 and 10 classes this is 784-200-200-10 = 199,210 parameters, as in the spec.
    """

    HEAD = "fc3"

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 200) -> None:
        super().__init__()
        c, h, w = check_input_shape(input_shape)
        check_num_classes(num_classes)
        self.fc1 = nn.Linear(c * h * w, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)  # personal head, registered last

    def represent(self, x: Tensor) -> Tensor:
        x = x.flatten(1)
        x = self.fc1(x).relu()
        return self.fc2(x).relu()
