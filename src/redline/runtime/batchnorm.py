"""BatchNorm over the global batch on CPU ranks.

PyTorch's ``SyncBatchNorm`` runs on GPUs only (its statistics kernels are CUDA's). On CPU ranks (gloo) each
rank would normalise its own share of the batch by that share's statistics, which is not what one process
computes on the whole batch (a small CNN's weights differed from one process by 0.17 after a few steps).
``CrossRankBatchNorm`` sums each channel's count, sum and sum of squares over the ranks with one differentiable
all-reduce (``_SumOverRanks``: its backward sums the gradients over the ranks, as the forward sums the values),
so the forward, the backward and the running statistics are those of the global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _SumOverRanks(torch.autograd.Function):
    """A sum over the ranks that autograd goes through: every rank's value feeds every rank's sum, so each
    rank's gradient is the sum of all ranks' gradients. (``torch.distributed.nn.functional.all_reduce`` did
    this and is deprecated without an autograd successor.)"""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total)
        return total


class CrossRankBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm layer (any of 1d/2d/3d) whose training statistics are the global batch's."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training or not self.track_running_stats):
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        local = torch.cat(
            [
                input.sum(dims),
                (input * input).sum(dims),
                input.new_full((1,), input.numel() / channels),
            ]
        )
        total = _SumOverRanks.apply(local)
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels : 2 * channels] / count - mean * mean  # biased, as BatchNorm normalises with
        if self.training and self.track_running_stats:
            tracked, running_mean, running_var = self.num_batches_tracked, self.running_mean, self.running_var
            if tracked is None or running_mean is None or running_var is None:  # a layer made without them
                raise ValueError("track_running_stats is set on a BatchNorm layer built without running statistics")
            with torch.no_grad():
                tracked.add_(1)
                momentum = 1.0 / float(tracked) if self.momentum is None else self.momentum
                unbiased = var * count / (count - 1).clamp(min=1)
                running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


def cross_rank_batchnorm(module: nn.Module) -> int:
    """Every BatchNorm layer below ``module`` made a ``CrossRankBatchNorm`` in place, its weights and running
    statistics kept; the number replaced."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(child, CrossRankBatchNorm):
            replacement = CrossRankBatchNorm(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            # the same parameter and buffer objects: an optimizer built on the model still holds them
            for tensors in (replacement._parameters, replacement._buffers):
                for key in tensors:
                    tensors[key] = getattr(child, key)
            replacement.train(child.training)
            setattr(module, name, replacement)
            count += 1
        else:
            count += cross_rank_batchnorm(child)
    return count
