"""Model registry and the shared/personal split that the algorithms and the flat layout rely on."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .alexnet import AlexNet, AlexNetFMNIST
from .base import PersonalModel, head_layers_problem
from .cnn import LeNet, SmallCNN
from .mlp import MLP
from .resnet import ResNet18
from .vgg import VGG11

_REGISTRY: dict[str, type[PersonalModel]] = {
    "mlp": MLP,
    "lenet": LeNet,
    "cnn_small": SmallCNN,
    "alexnet": AlexNet,
    "alexnet_fmnist": AlexNetFMNIST,
    "vgg11": VGG11,
    "resnet18": ResNet18,
}


def model_names() -> list[str]:
    """Names accepted by :func:`build_model`, sorted."""
    return sorted(_REGISTRY)


def model_parameters(name: str) -> list[str]:
    """The extra keyword arguments model ``name`` accepts (what ``model.*`` keys a config may set)."""
    return [p for p in inspect.signature(_REGISTRY[name].__init__).parameters
            if p not in ("self", "input_shape", "num_classes")]


def model_value_problem(name: str, key: str, value: Any) -> str | None:
    """Why ``model.<key>: value`` is refused for model ``name`` before any run starts (None: accepted).

    Only what needs no data shape is checked here: ``head_layers`` (``base.head_layers_problem``);
    other values are checked when the model is built.
    """
    most = getattr(_REGISTRY.get(name), "MAX_HEAD_LAYERS", None)
    if key == "head_layers" and most is not None:
        return head_layers_problem(value, most)
    return None


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int, **params: Any) -> nn.Module:
    """Build the zoo model ``name`` for ``(C, H, W)`` inputs and ``num_classes`` outputs.

    ``params`` are the model's extra keyword arguments (e.g. ``gn_groups`` for ``resnet18``,
    ``variant`` for ``vgg11``). Initialization uses PyTorch's default initializers and thus draws
    only from the global torch RNG at construction time: ``torch.manual_seed(s); build_model(...)``
    is reproducible. Why no generator argument: the default initializers take none, and seeding the
    global RNG right before construction is the one contract every caller can meet.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(model_names())}") from None
    accepted = [
        p
        for p in inspect.signature(cls.__init__).parameters
        if p not in ("self", "input_shape", "num_classes")
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"model {name!r} got unknown parameters {unknown}; accepted: {accepted}")
    return cls(tuple(input_shape), num_classes, **params)  # type: ignore[arg-type]


def head_prefix(model: nn.Module) -> str:
    """Module path of the model's personal head, its attribute ``HEAD`` (e.g. ``"fc3"``).

    Raises ``ValueError`` when the model declares no head, or the head is neither an ``nn.Linear``
    nor an ``nn.Sequential`` ending in one whose layers with parameters are all ``nn.Linear``: the
    personalized algorithms assume head = the weights and biases of the final linear layer(s).
    """
    head = getattr(model, "HEAD", "")
    if not isinstance(head, str) or not head:
        raise ValueError(f"{type(model).__name__} declares no personal head (attribute HEAD)")
    try:
        module = model.get_submodule(head)
    except AttributeError:
        raise ValueError(f"{type(model).__name__}.HEAD={head!r} names no submodule") from None
    if not is_linear_head(module):
        raise ValueError(
            f"{type(model).__name__}.HEAD={head!r} is a {type(module).__name__}, not an nn.Linear "
            "(or an nn.Sequential of linear layers ending in one)"
        )
    return head


def is_linear_head(module: nn.Module) -> bool:
    """An ``nn.Linear``, or an ``nn.Sequential`` ending in one whose parametrized layers are all ``nn.Linear``."""
    if isinstance(module, nn.Linear):
        return True
    if not isinstance(module, nn.Sequential) or len(module) == 0 or not isinstance(module[-1], nn.Linear):
        return False
    return all(isinstance(m, nn.Linear) or not any(True for _ in m.parameters()) for m in module)


def split_parameter_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(shared, personal)`` parameter names, each in ``model.named_parameters()`` order.

    Personal = every parameter under the head's path (``HEAD.weight`` and ``HEAD.bias``, or
    ``HEAD.<layer>.weight``/``bias`` for a multi-layer head); shared = every other parameter. Why by
    name: the flat layout, the wire format and checkpoints all key on these names.
    """
    prefix = head_prefix(model) + "."
    shared: list[str] = []
    personal: list[str] = []
    for name, _ in model.named_parameters():
        (personal if name.startswith(prefix) else shared).append(name)
    return shared, personal
