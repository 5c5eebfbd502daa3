"""CUDA's autocast policy on the CPU: the ops CUDA runs in fp32 run in fp32 while the policy is entered, on real
and fake tensors, autograd records the cast, and CPU autocast is itself again afterwards."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from redline.workload.cuda_autocast import (  # noqa: E402
    FP32_OPS,
    FP32_UNLESS_DTYPE_OPS,
    PROMOTE_OPS,
    cuda_autocast_policy,
)
from redline.workload.trace import trace_module  # noqa: E402

bf16 = torch.bfloat16


def test_fp32_ops_run_in_fp32_and_only_while_entered() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with cuda_autocast_policy() as changed, torch.autocast("cpu", dtype=bf16):
        y = layer(x)
        assert y.dtype == bf16  # matmuls stay 16-bit, as on CUDA
        assert (y**3).dtype == torch.float32
        assert y.exp().dtype == torch.float32
        assert y.sum().dtype == torch.float32
        assert torch.softmax(y, -1).dtype == torch.float32
        assert torch.softmax(y, -1, dtype=bf16).dtype == bf16  # a given dtype is kept, as CUDA keeps it
        assert nn.functional.layer_norm(y, (8,)).dtype == torch.float32
        assert torch.relu(y).dtype == bf16  # not on CUDA's list
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
            cube = y**3
        assert saved == [torch.float32]  # pow keeps its input for backward: the fp32 cast, as on a GPU
        cube.sum().backward()  # the recorded cast sends the gradient back through bf16 to the layer
    assert 40 < changed <= len(FP32_OPS) + len(FP32_UNLESS_DTYPE_OPS) + len(PROMOTE_OPS)
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
    with torch.autocast("cpu", dtype=bf16):
        assert (layer(x) ** 3).dtype == bf16  # CPU autocast's own behaviour is back


def test_a_reduction_given_no_dtype_computes_in_fp32_and_keeps_its_16_bit_input() -> None:
    """CUDA asks such reductions for an fp32 result (``dtype=float32``) rather than casting their input first:
    a norm's backward then keeps the 16-bit input."""
    y = torch.randn(4, 8, dtype=bf16, requires_grad=True)
    saved = []
    with (
        cuda_autocast_policy(),
        torch.autocast("cpu", dtype=bf16),
        torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t),
    ):
        norm = torch.linalg.vector_norm(y, dim=-1)
        assert torch.cumsum(y, 0, dtype=bf16).dtype == bf16
    assert norm.dtype == torch.float32 and bf16 in saved


def test_ops_refusing_mixed_types_get_the_widest_as_on_cuda() -> None:
    """Scattering 16-bit values into an fp32 buffer (a mixture-of-experts' combine) fails under CPU autocast and
    runs in fp32 under CUDA's; the gradient goes back to the 16-bit values through the recorded cast."""
    experts = torch.randn(6, 4, dtype=bf16, requires_grad=True)
    index = torch.tensor([0, 1, 0, 2, 1, 2]).unsqueeze(1).expand(6, 4)
    with torch.autocast("cpu", dtype=bf16), pytest.raises(RuntimeError):
        torch.zeros(3, 4).scatter_add(0, index, experts)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=bf16):
        combined = torch.zeros(3, 4).scatter_add(0, index, experts)
        assert combined.dtype == torch.float32
        assert torch.dot(experts[0], torch.ones(4)).dtype == torch.float32
        assert torch.dot(experts[0], experts[1]).dtype == bf16  # nothing wider to promote to
        with pytest.raises(RuntimeError):  # CUDA's autocast leaves float64 alone, and refuses this too
            torch.dot(torch.ones(4), torch.ones(4, dtype=torch.float64))
    combined.sum().backward()
    assert experts.grad.dtype == bf16 and torch.equal(experts.grad, torch.ones(6, 4, dtype=bf16))


def test_nested_entries_share_one_registration() -> None:
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=bf16):
        with cuda_autocast_policy():
            pass
        assert torch.ones(2, dtype=bf16).exp().dtype == torch.float32  # the inner exit left it in place
    with torch.autocast("cpu", dtype=bf16):
        assert torch.ones(2, dtype=bf16).exp().dtype == bf16


def test_on_fake_tensors() -> None:
    with FakeTensorMode(), cuda_autocast_policy(), torch.autocast("cpu", dtype=bf16):
        y = nn.Linear(8, 8)(torch.randn(4, 8)) ** 3
        assert y.dtype == torch.float32 and y.shape == (4, 8)


class Cube(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) ** 3


def test_the_tracer_measures_16_bit_activations_as_cuda_keeps_them() -> None:
    (layer,) = trace_module(Cube, (8,), name="cube", source="test").layers
    # the loop's fp32 input (8 x 4) and the Linear's 16-bit copy of it (8 x 2); pow's input, cast to fp32 as
    # CUDA casts it (16 x 4, where CPU autocast would keep it in 16 x 2), and its fp32 output, held (16 x 4)
    assert layer.activation_bytes_per_sample["16bit"] == 8 * 4 + 8 * 2 + 16 * 4 + 16 * 4
