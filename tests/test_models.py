"""Model zoo: exact sizes (computed by hand from the architectures), the head split, no buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from p2pfl.models import build_model, head_prefix, model_names, split_parameter_names


def conv(cin: int, cout: int, k: int, bias: bool = True) -> int:
    return cin * cout * k * k + (cout if bias else 0)


def lin(i: int, o: int) -> int:
    return i * o + o


def gn(c: int) -> int:
    return 2 * c  # GroupNorm affine weight + bias


def resnet18_body(cin: int) -> int:
    total = conv(cin, 64, 3, bias=False) + gn(64)
    in_ch = 64
    for out_ch, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            c_in = in_ch if block == 0 else out_ch
            total += conv(c_in, out_ch, 3, False) + gn(out_ch) + conv(out_ch, out_ch, 3, False) + gn(out_ch)
            if block == 0 and (stride != 1 or c_in != out_ch):
                total += conv(c_in, out_ch, 1, False) + gn(out_ch)
        in_ch = out_ch
    return total


def vgg_body(cin: int, plan: list[int], norm: bool = True) -> int:
    total = 0
    for c in plan:
        total += conv(cin, c, 3) + (gn(c) if norm else 0)
        cin = c
    return total


VGG11_PLAN = [64, 128, 256, 256, 512, 512, 512, 512]
DEPRL_VGG_PLAN = [64, 128, 128, 256, 256, 512, 512, 512]

# (name, input shape, classes, params) -> (body params, head in-features), all derived by hand.
CASES = {
    ("mlp", (1, 28, 28), 10): (lin(784, 200) + lin(200, 200), 200),
    ("lenet", (3, 32, 32), 10): (
        conv(3, 64, 5) + conv(64, 64, 5) + lin(64 * 5 * 5, 384) + lin(384, 192),
        192,
    ),
    ("lenet", (1, 28, 28), 10): (
        conv(1, 64, 5) + conv(64, 64, 5) + lin(64 * 4 * 4, 384) + lin(384, 192),
        192,
    ),
    ("cnn_small", (1, 28, 28), 10): (conv(1, 16, 5) + conv(16, 32, 5) + lin(32 * 4 * 4, 128), 128),
    ("cnn_small", (3, 32, 32), 10): (conv(3, 16, 5) + conv(16, 32, 5) + lin(32 * 5 * 5, 128), 128),
    ("alexnet", (1, 28, 28), 10): (
        conv(1, 64, 3)
        + conv(64, 192, 3)
        + conv(192, 384, 3)
        + conv(384, 256, 3)
        + conv(256, 256, 3)
        + lin(256 * 2 * 2, 4096)
        + lin(4096, 4096),
        4096,
    ),
    ("vgg11", (3, 32, 32), 10): (vgg_body(3, VGG11_PLAN), 512),
    ("vgg11", (1, 28, 28), 10): (vgg_body(1, VGG11_PLAN), 512),
    ("resnet18", (3, 32, 32), 100): (resnet18_body(3), 512),
    ("resnet18", (1, 28, 28), 10): (resnet18_body(1), 512),
}


@pytest.fixture(scope="module")
def built() -> dict[tuple[str, tuple[int, int, int], int], nn.Module]:
    torch.manual_seed(0)
    return {key: build_model(*key) for key in CASES}


def test_names() -> None:
    assert model_names() == sorted(["mlp", "lenet", "cnn_small", "alexnet", "alexnet_fmnist", "vgg11", "resnet18"])
    with pytest.raises(ValueError, match="resnet18"):
        build_model("resnet50", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="gn_groups"):
        build_model("resnet18", (3, 32, 32), 10, groups=4)


def test_spec_counts() -> None:
    """The hand formulas reproduce the figures the specs derive, so they are the right yardstick."""
    assert lin(784, 200) + lin(200, 200) + lin(200, 10) == 199_210  # spec 002
    assert CASES[("lenet", (3, 32, 32), 10)][0] + lin(192, 10) == 797_962  # spec 002
    assert resnet18_body(3) == 11_168_832  # specs 000, 004
    assert vgg_body(3, VGG11_PLAN) + lin(512, 10) == 9_231_114  # spec 003
    assert vgg_body(3, DEPRL_VGG_PLAN, norm=False) + 2 * lin(512, 512) == 7_533_568  # spec 004
    alex3 = conv(3, 64, 3) + conv(64, 192, 3) + conv(192, 384, 3) + conv(384, 256, 3) + conv(256, 256, 3)
    assert alex3 + lin(1024, 4096) + lin(4096, 4096) == 23_231_296  # spec 004


@pytest.mark.parametrize("key", list(CASES), ids=lambda k: f"{k[0]}-{'x'.join(map(str, k[1]))}")
def test_model(built: dict, key: tuple[str, tuple[int, int, int], int]) -> None:
    model = built[key]
    _, shape, classes = key
    body, head_in = CASES[key]
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == body + lin(head_in, classes)

    shared, personal = split_parameter_names(model)
    head = head_prefix(model)
    linear = model.get_submodule(head)
    assert isinstance(linear, nn.Linear) and linear.in_features == head_in and linear.out_features == classes
    assert personal == [f"{head}.weight", f"{head}.bias"]
    assert not set(shared) & set(personal)
    assert shared + personal == list(params)  # head registered last: names() order is [shared | personal]
    assert sum(params[n].numel() for n in shared) == body

    assert list(model.buffers()) == []
    assert not any(isinstance(m, nn.modules.batchnorm._NormBase | nn.Dropout) for m in model.modules())

    with torch.no_grad():
        out = model(torch.randn(2, *shape))
    assert out.shape == (2, classes)


def test_mlp_exact() -> None:
    model = build_model("mlp", (1, 28, 28), 10)
    assert sum(p.numel() for p in model.parameters()) == 199_210
    assert head_prefix(model) == "fc3"


def test_resnet18_shared_bytes(built: dict) -> None:
    model = built[("resnet18", (3, 32, 32), 100)]
    shared, _ = split_parameter_names(model)
    params = dict(model.named_parameters())
    nbytes = sum(params[n].numel() * params[n].element_size() for n in shared)
    assert nbytes == pytest.approx(44.7e6, rel=0.01)
    groups = [m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(groups) == 1 + 8 * 2 + 3 and set(groups) == {32}  # stem, 2 per block, 3 shortcuts


def test_vgg11_deprl_variant() -> None:
    model = build_model("vgg11", (3, 32, 32), 10, variant="deprl", gn_groups=None)
    shared, personal = split_parameter_names(model)
    params = dict(model.named_parameters())
    assert sum(params[n].numel() for n in shared) == vgg_body(3, DEPRL_VGG_PLAN, norm=False) + 2 * lin(
        512, 512
    )
    assert personal == ["classifier.weight", "classifier.bias"]
    assert not any(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert build_model("vgg11", (3, 32, 32), 10, variant="deprl")(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    with pytest.raises(ValueError):
        build_model("vgg11", (3, 32, 32), 10, variant="vgg16")


@pytest.mark.parametrize("name", ["mlp", "lenet", "cnn_small", "alexnet", "alexnet_fmnist", "vgg11", "resnet18"])
def test_reproducible_init(name: str) -> None:
    shape = (1, 28, 28)
    torch.manual_seed(7)
    a = build_model(name, shape, 10)
    torch.manual_seed(7)
    b = build_model(name, shape, 10)
    torch.manual_seed(8)
    c = build_model(name, shape, 10)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    head = split_parameter_names(a)[1][0]  # the head's first weight (a linear stack's too)
    assert not torch.equal(pa[head], pc[head])


def test_head_must_be_linear() -> None:
    class Bad(nn.Module):
        HEAD = "out"

        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Conv2d(1, 1, 1)

    class NoHead(nn.Module):
        pass

    with pytest.raises(ValueError, match="nn.Linear"):
        split_parameter_names(Bad())
    with pytest.raises(ValueError, match="HEAD"):
        head_prefix(NoHead())


def alex_fmnist_body(cin: int) -> int:
    """The authors' ``alex_fmnist`` convolutions (GYan58/AAAI24-DePRL, Models/Alex.py:9-21)."""
    return conv(cin, 64, 11) + conv(64, 192, 5) + conv(192, 384, 3) + conv(384, 256, 3) + conv(256, 256, 3)


def test_alexnet_fmnist_is_the_authors_model_with_its_classifier_personal() -> None:
    model = build_model("alexnet_fmnist", (1, 28, 28), 10)  # zero-padded to 32x32: 256 features
    params = dict(model.named_parameters())
    classifier = lin(256, 128) + lin(128, 128) + lin(128, 10)
    assert (alex_fmnist_body(1), classifier) == (2_454_208, 50_698)
    assert sum(p.numel() for p in params.values()) == 2_504_906 == alex_fmnist_body(1) + classifier  # "~2.5 M"
    shared, personal = split_parameter_names(model)
    assert head_prefix(model) == "classifier"
    assert personal == [f"classifier.{i}.{w}" for i in (0, 2, 4) for w in ("weight", "bias")]
    assert sum(params[n].numel() for n in personal) == classifier and shared + personal == list(params)
    assert [type(m).__name__ for m in model.classifier] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert list(model.buffers()) == [] and not any(isinstance(m, nn.Dropout) for m in model.modules())
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert model(x).shape == (2, 10)
        assert torch.equal(model.head()(model.represent(x)), model(x))
    # head_layers counts the classifier's personal layers from the output; the network stays the same
    for k, size in ((1, lin(128, 10)), (2, lin(128, 128) + lin(128, 10))):
        torch.manual_seed(0)
        m = build_model("alexnet_fmnist", (1, 28, 28), 10, head_layers=k)
        mp = dict(m.named_parameters())
        sh, pe = split_parameter_names(m)
        assert sum(p.numel() for p in mp.values()) == 2_504_906
        assert sum(mp[n].numel() for n in pe) == size and sh + pe == list(mp)
    with pytest.raises(ValueError, match="head_layers"):
        build_model("alexnet_fmnist", (1, 28, 28), 10, head_layers=0)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_cnn_small_takes_a_multi_layer_head(layers: int) -> None:
    model = build_model("cnn_small", (1, 28, 28), 10, head_layers=layers)
    params = dict(model.named_parameters())
    shared, personal = split_parameter_names(model)
    convs = conv(1, 16, 5) + conv(16, 32, 5)
    widths = [512] + [128] * (max(2, layers) - 1) + [10]
    mlp = sum(lin(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))
    assert sum(p.numel() for p in params.values()) == convs + mlp
    assert sum(params[n].numel() for n in personal) == (lin(128, 10) if layers == 1 else mlp)
    assert shared + personal == list(params)
    if layers == 1:  # the network as before, names and all (existing runs and checkpoints are unchanged)
        assert personal == ["fc2.weight", "fc2.bias"] and head_prefix(model) == "fc2"
        assert type(model).HEAD == "fc2"
    else:
        assert head_prefix(model) == "classifier" and shared == ["conv1.weight", "conv1.bias", "conv2.weight",
                                                                 "conv2.bias"]
        assert sum(isinstance(m, nn.Linear) for m in model.classifier) == max(2, layers)
    with torch.no_grad():
        x = torch.randn(3, 1, 28, 28)
        assert torch.equal(model.head()(model.represent(x)), model(x)) and model(x).shape == (3, 10)


def test_a_head_may_be_a_stack_of_linear_layers_only() -> None:
    class Stack(nn.Module):
        HEAD = "head"

        def __init__(self, last: nn.Module) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), last)

    assert split_parameter_names(Stack(nn.Linear(4, 2)))[1] == ["head.0.weight", "head.0.bias", "head.2.weight",
                                                                 "head.2.bias"]
    with pytest.raises(ValueError, match="nn.Linear"):
        split_parameter_names(Stack(nn.Conv1d(4, 2, 1)))  # a stack must end in a linear layer
    with pytest.raises(ValueError, match="nn.Linear"):
        split_parameter_names(Stack(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))))  # and hold linear layers only


def test_bad_shapes() -> None:
    with pytest.raises(ValueError):
        build_model("lenet", (1, 8, 8), 10)
    with pytest.raises(ValueError):
        build_model("mlp", (784,), 10)  # type: ignore[arg-type]


# -- channels-last activations on a CPU (models.base.channels_last) ------------------------------


@pytest.mark.parametrize("name", ["cnn_small", "lenet", "alexnet"])
def test_conv_nets_pool_channels_last_and_match_the_nchw_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pools see channels-last activations on a CPU; outputs and gradients are the NCHW path's
    up to float reassociation, and the parameters (views of the flat buffer) stay contiguous."""
    import sys

    import torch.nn.functional as F

    torch.manual_seed(3)
    model = build_model(name, (1, 28, 28), 10)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    seen: list[bool] = []
    hooks = [m.register_forward_pre_hook(lambda _m, a: seen.append(a[0].is_contiguous(memory_format=torch.channels_last)))
             for m in model.modules() if isinstance(m, nn.MaxPool2d)]

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(x)
        F.cross_entropy(out, y).backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    out_cl, g_cl = step()
    assert seen and all(seen), "every pool input is channels-last"
    assert all(p.is_contiguous() and p.grad.is_contiguous() for p in model.parameters())
    seen.clear()
    monkeypatch.setattr(sys.modules[type(model).__module__], "channels_last", lambda t: t)
    out_ref, g_ref = step()
    assert not any(seen), "the reference path pools NCHW"
    for h in hooks:
        h.remove()
    torch.testing.assert_close(out_cl, out_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_cl, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_channels_last_leaves_batched_tensors_and_3d_inputs_alone() -> None:
    from torch.func import vmap

    from p2pfl.models.base import channels_last

    x = torch.randn(2, 4, 5, 6)
    assert channels_last(x).is_contiguous(memory_format=torch.channels_last)
    assert channels_last(x[0]).is_contiguous()  # 3-D: nothing to do
    # under vmap the tensor a model sees is a per-peer view: returned as it is, values unchanged
    stacked = torch.randn(3, 2, 4, 5, 6)
    torch.testing.assert_close(vmap(lambda t: channels_last(t) * 1.0)(stacked), stacked, rtol=0, atol=0)


def test_a_conv_net_trains_under_vmap_and_grad_on_a_cpu() -> None:
    """The batched engine's GPU path (``vmap(grad(...))``) run on a CPU: under ``grad`` the tensor a
    model sees is a grad-tracking wrapper, not a batched tensor, and it must be left alone too
    (functorch refuses a channels-last clone): the gradients are each peer's own."""
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(4)
    model = build_model("cnn_small", (1, 28, 28), 10)
    params = {n: torch.stack([p.detach(), p.detach() * 0.5]) for n, p in model.named_parameters()}
    x, y = torch.randn(2, 4, 1, 28, 28), torch.randint(0, 10, (2, 4))

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    stacked = vmap(grad(loss))(params, x, y)
    for i in range(2):
        own = grad(loss)({n: v[i] for n, v in params.items()}, x[i], y[i])
        for n in own:
            torch.testing.assert_close(stacked[n][i], own[n], rtol=1e-4, atol=1e-6)
