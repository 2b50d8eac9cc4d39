"""Model zoo: the papers' models with a declared personal head (final linear, or a linear stack) and a shared body.

Every model carries only parameters (GroupNorm instead of BatchNorm, no buffers) and no dropout,
so that mixing flat parameter buffers is the whole story and peers stay bitwise deterministic.
"""

from .alexnet import AlexNet, AlexNetFMNIST
from .base import PersonalModel
from .cnn import LeNet, SmallCNN
from .mlp import MLP
from .registry import build_model, head_prefix, model_names, split_parameter_names
from .resnet import ResNet18
from .vgg import VGG11

__all__ = [
    "MLP",
    "VGG11",
    "AlexNet",
    "AlexNetFMNIST",
    "LeNet",
    "PersonalModel",
    "ResNet18",
    "SmallCNN",
    "build_model",
    "head_prefix",
    "model_names",
    "split_parameter_names",
]
