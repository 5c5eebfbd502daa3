"""Two reference vision models, written here so that tracing them needs neither torchvision nor a download.

Both match torchvision's architectures layer for layer, so parameter counts and FLOPs agree with the figures
people quote:

- ``resnet50``: He et al., "Deep Residual Learning for Image Recognition" (2015), torchvision's "v1.5" variant
  (the stride-2 convolution of a downsampling Bottleneck is its 3x3 one). 25,557,032 parameters, 4.09 GMACs
  (8.2 GFLOP) per 224 x 224 image.
- ``vit_b_16``: Dosovitskiy et al., "An Image is Worth 16x16 Words" (2020), ViT-Base/16 as torchvision builds it
  (class token, learned positions, pre-norm blocks, LayerNorm eps 1e-6). 86,567,656 parameters, 17.56 GMACs
  (35.1 GFLOP) per 224 x 224 image. Attention goes through ``scaled_dot_product_attention``, so it runs as
  fused kernels where the hardware has them.

Initialisation follows torchvision's so a model built here trains like one built there, but nothing depends
on it: the tracer builds these on fake tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4; a projection shortcut where the shape changes."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem (7x7 stride-2 convolution, max-pool), four stages of Bottlenecks, global average pool, classifier."""

    def __init__(self, stage_blocks: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_channels = 64
        stages = []
        for index, blocks in enumerate(stage_blocks):
            width = 64 * 2**index
            stride = 1 if index == 0 else 2
            stage = []
            for block in range(blocks):
                stage.append(Bottleneck(in_channels, width, stride if block == 0 else 1))
                in_channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50: Bottleneck stages of 3, 4, 6 and 3 blocks (25,557,032 parameters with 1000 classes)."""
    return ResNet((3, 4, 6, 3), num_classes)


class SelfAttention(nn.Module):
    """Multi-head self-attention with nn.MultiheadAttention's parameters (one packed q/k/v projection)."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        # (batch, tokens, 3 * hidden) -> three of (batch, heads, tokens, head_dim)
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, hidden))


class MLPBlock(nn.Sequential):
    """Linear, GELU, dropout, linear, dropout (torchvision's MLPBlock)."""

    def __init__(self, hidden: int, mlp_hidden: int, dropout: float = 0.0) -> None:
        super().__init__(
            nn.Linear(hidden, mlp_hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_hidden, hidden),
            nn.Dropout(dropout),
        )
        for module in self:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.normal_(module.bias, std=1e-6)


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, hidden: int, heads: int, mlp_hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = SelfAttention(hidden, heads)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = MLPBlock(hidden, mlp_hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    """Learned position embeddings, the blocks, a final LayerNorm."""

    def __init__(self, tokens: int, layers: int, hidden: int, heads: int, mlp_hidden: int, dropout: float = 0.0):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, hidden).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(*(EncoderBlock(hidden, heads, mlp_hidden, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(hidden, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    """Patchify with a strided convolution, prepend a class token, encode, classify the class token."""

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        layers: int = 12,
        hidden: int = 768,
        heads: int = 12,
        mlp_hidden: int = 3072,
        num_classes: int = 1000,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch_size}")
        self.patch_size = patch_size
        self.hidden = hidden
        self.conv_proj = nn.Conv2d(3, hidden, kernel_size=patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        tokens = (image_size // patch_size) ** 2 + 1
        self.encoder = Encoder(tokens, layers, hidden, heads, mlp_hidden, dropout)
        head = nn.Linear(hidden, num_classes)
        self.heads = nn.Sequential()
        self.heads.add_module("head", head)
        fan_in = 3 * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        if self.conv_proj.bias is not None:  # made with one
            nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, 3, H, W) -> (batch, hidden, H/p, W/p) -> (batch, patches, hidden)
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


def vit_b_16(image_size: int = 224, num_classes: int = 1000) -> VisionTransformer:
    """ViT-Base/16: 12 blocks, hidden 768, 12 heads, MLP 3072 (86,567,656 parameters at 224 px, 1000 classes)."""
    return VisionTransformer(image_size=image_size, num_classes=num_classes)


# name -> (builder, per-sample input shape): what a preset needs to trace one of these
ZOO: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "resnet50": (resnet50, (3, 224, 224)),
    "vit_b_16": (vit_b_16, (3, 224, 224)),
}
