"""The zoo's ResNet-50 and ViT-B/16 are torchvision's architectures: the same parameter counts, the FLOPs
torchvision publishes (4.09 and 17.56 GMACs per 224 px image; PyTorch's counter counts 2 FLOPs per MAC), and
they really run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from redline.workload import zoo  # noqa: E402
from redline.workload.trace import trace_module  # noqa: E402


@pytest.fixture(scope="module")
def resnet50_profile():
    return trace_module(zoo.resnet50, (3, 224, 224), name="resnet50", source="zoo")


@pytest.fixture(scope="module")
def vit_profile():
    return trace_module(zoo.vit_b_16, (3, 224, 224), name="vit_b_16", source="zoo")


def test_resnet50_matches_torchvision(resnet50_profile):
    profile = resnet50_profile
    assert profile.params_total == 25_557_032
    assert profile.params_trainable == 25_557_032
    assert profile.forward_flops_per_sample == pytest.approx(2 * 4.09e9, rel=0.01)
    # each Bottleneck is a block: 3 + 4 + 6 + 3, between the stem and the pooled classifier
    assert [layer.kind for layer in profile.blocks] == ["Bottleneck"] * 16
    assert profile.blocks[0].name == "layer1.0" and profile.blocks[-1].name == "layer4.2"
    assert profile.layers[0].name == "stem" and profile.layers[-1].name == "head"
    assert profile.layers[-1].params == 2048 * 1000 + 1000
    assert profile.largest_module_params == 512 * 512 * 9  # layer4's 3x3 convolutions
    assert profile.sample_unit == "image" and profile.tokens_per_sample == 1
    # the first block's input: the stem's 64 x 56 x 56 output, 16-bit under autocast (convolution, batch norm
    # and ReLU all stay in it)
    assert profile.blocks[0].input_bytes_per_sample == {"fp32": 64 * 56 * 56 * 4, "16bit": 64 * 56 * 56 * 2}


@pytest.mark.slow
def test_vit_b_16_matches_torchvision(vit_profile):
    profile = vit_profile
    assert profile.params_total == 86_567_656
    assert profile.forward_flops_per_sample == pytest.approx(2 * 17.56e9, rel=0.01)
    assert [layer.name for layer in profile.blocks] == [f"encoder.layers.{i}" for i in range(12)]
    assert {layer.params for layer in profile.blocks} == {7_087_872}
    # stem: patch projection, class token, positions; head: final LayerNorm and classifier
    assert profile.layers[0].params == 768 * 3 * 16 * 16 + 768 + 768 + 197 * 768
    assert profile.layers[-1].params == 2 * 768 + 768 * 1000 + 1000
    # a block's input: 197 tokens of 768 values, in fp32 under autocast too (class token and positions are added
    # to the 16-bit patch projections in fp32)
    assert profile.blocks[0].input_bytes_per_sample == {"fp32": 197 * 768 * 4, "16bit": 197 * 768 * 4}


def test_zoo_lists_both_with_their_input_shapes():
    assert set(zoo.ZOO) == {"resnet50", "vit_b_16"}
    assert all(shape == (3, 224, 224) for _, shape in zoo.ZOO.values())


def test_small_zoo_models_run_forward_and_backward_on_real_tensors():
    torch.manual_seed(0)
    resnet = zoo.ResNet((1, 1, 1, 1), num_classes=10)
    vit = zoo.VisionTransformer(image_size=32, patch_size=16, layers=2, hidden=64, heads=4, mlp_hidden=128)
    for model, size in ((resnet, 64), (vit, 32)):
        out = model(torch.randn(2, 3, size, size))
        assert out.shape == (2, 10 if model is resnet else 1000)
        out.sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_self_attention_computes_what_multihead_attention_does():
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(64, 4, batch_first=True)
    ours = zoo.SelfAttention(64, 4)
    with torch.no_grad():
        ours.qkv.weight.copy_(reference.in_proj_weight)
        ours.qkv.bias.copy_(reference.in_proj_bias)
        ours.proj.weight.copy_(reference.out_proj.weight)
        ours.proj.bias.copy_(reference.out_proj.bias)
    x = torch.randn(2, 5, 64)
    expected, _ = reference(x, x, x, need_weights=False)
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())
