"""VGG-11 with GroupNorm for 32x32 images (DFedSAM / DisPFL lineage; DePRL's variant on request)."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from .base import PersonalModel, ZeroPad, check_input_shape, check_num_classes, pad_amounts

# "M" = 2x2 max-pool; ints = 3x3 pad-1 conv out-channels.
_PLANS: dict[str, list[int | str]] = {
    # Canonical VGG-11 (configuration "A"), as in the DisPFL code that DFedSAM's spec points to.
    "dispfl": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    # DePRL Table 4 (spec 004 section 3.4): a non-canonical channel plan.
    "deprl": [64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, "M"],
}


class VGG11(PersonalModel):
    """VGG-11 for 32x32 inputs, no BatchNorm, head = ``classifier`` (the final Linear).

    ``variant="dispfl"`` (default; spec 003 A11 and section 3.4): canonical VGG-11 convs (3x3, pad 1,
    with bias), each followed by ``GroupNorm(gn_groups=32)`` and ReLU, five max-pools, then a single
    ``Linear(512, classes)``: 9,231,114 parameters for 3x32x32 and 10 classes, as the spec derives.

    ``variant="deprl"`` (spec 004 section 3.4, DePRL Table 4): the table's channel plan
    64/128/128/256/256/512/512/512, then ``fc9 512->512 -> fc10 512->512 -> classifier 512->classes``
    (fc9 takes 512 inputs, not the table's "4096", since a 32x32 image flattens to 512x1x1, as the
    spec notes; 10 outputs for CIFAR-10 since the tables swap class counts). The table lists no
    normalization: pass ``gn_groups=None`` for that literal reading (7,533,568 body parameters);
    by default it gets the same GroupNorm as the DisPFL variant.

    ``gn_groups=None`` drops normalization in either variant. Inputs smaller than ``min_size`` are
    zero-padded to 32x32 in ``forward`` so that 1x28x28 images still survive five pools.

    Deviation: DePRL's two ``dropout(0.2)`` layers are omitted. Dropout draws its masks from the
    global torch RNG, which peers running in threads share, so it would break per-peer bitwise
    determinism.
    """

    HEAD = "classifier"

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        variant: Literal["dispfl", "deprl"] = "dispfl",
        gn_groups: int | None = 32,
        min_size: int = 32,
    ) -> None:
        super().__init__()
        c, h, w = check_input_shape(input_shape)
        check_num_classes(num_classes)
        if variant not in _PLANS:
            raise ValueError(f"vgg11: unknown variant {variant!r}; known: {sorted(_PLANS)}")
        pad = pad_amounts(h, w, min_size)
        h, w = h + pad[2] + pad[3], w + pad[0] + pad[1]
        layers: list[nn.Module] = []
        in_ch = c
        for item in _PLANS[variant]:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
                h, w = h // 2, w // 2
                continue
            assert isinstance(item, int)
            layers.append(nn.Conv2d(in_ch, item, 3, padding=1))
            if gn_groups is not None:
                if item % gn_groups:
                    raise ValueError(f"vgg11: gn_groups={gn_groups} does not divide {item} channels")
                layers.append(nn.GroupNorm(gn_groups, item))
            layers.append(nn.ReLU(inplace=True))
            in_ch = item
        if h < 1 or w < 1:
            raise ValueError("vgg11: input too small for five 2x2 max-pools")
        self.pad = ZeroPad(pad)
        self.features = nn.Sequential(*layers)
        flat = in_ch * h * w
        if variant == "deprl":
            self.fc9: nn.Module = nn.Linear(flat, 512)
            self.fc10: nn.Module = nn.Linear(512, 512)
            flat = 512
        else:
            self.fc9 = nn.Identity()
            self.fc10 = nn.Identity()
        self.variant = variant
        self.classifier = nn.Linear(flat, num_classes)  # personal head, registered last

    def represent(self, x: Tensor) -> Tensor:
        x = self.features(self.pad(x)).flatten(1)
        if self.variant == "deprl":
            x = self.fc9(x).relu()
            x = self.fc10(x).relu()
        return x
