"""A pipeline stage that holds what Megatron-LM's schedules hold: ``torch.distributed.pipelining``'s
``PipelineStage``, releasing what PyTorch's schedules keep longer than the backward needs.

PyTorch's stage makes a receive buffer for each micro-batch (its input, and the gradient of its output) when the
schedule is set up, and keeps them all for the run; a stage's output stays whole in its forward cache until its
backward, and the schedules keep the handles of the sends that carried it (the interleaved schedule every one,
to the step's end; 1F1B one from its warm-up to its cool-down), and with them the sent data. Megatron allocates a
receive buffer per receive and frees it after the micro-batch's backward, and frees a sent output's data once it
is sent, keeping its autograd graph (``deallocate_output_tensor``). This stage does the same with PyTorch's own
hooks, its public per-micro-batch methods:

- receive buffers are lent to a micro-batch from its receive to the end of its backward, then lent again: a stage
  holds as many as it has micro-batches between the two, not one per micro-batch of the step;
- a sent output's data is replaced by a one-element placeholder, broadcast to its shape (the backward, PyTorch's
  ``stage_backward``, checks the gradient's shape against it), once the send holds its own reference: the data
  lives as long as the send's handle;
- when the gradient of micro-batch ``k`` arrives, the sends of this stage's outputs of micro-batches ``0..k`` have
  all been received (the next stage ran their forwards, in order, before the backward that sent it), so the data
  the schedule's handles still reference is dropped too.

Arithmetic is untouched: each micro-batch computes on the same values, so losses and gradients are bit-identical
to PyTorch's stage. An output that is a view, or a DTensor (a sequence-parallel residual stream), keeps its data.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage


class ReleasingStage(PipelineStage):
    """``PipelineStage`` that lends its receive buffers per micro-batch and drops a sent output's data once sent
    (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inputs = _ReceiveBuffers(lambda: self.args_recv_info)
        self._output_grads = _ReceiveBuffers(lambda: self.grad_recv_info)
        # micro-batch -> the references its sends hold to its output (weak: the schedule decides how long they live)
        self._sent: dict[int, list[weakref.ref[torch.Tensor]]] = {}
        # the one element each dropped tensor keeps, shared, by dtype and device
        self._scalars: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def clear_runtime_states(self) -> None:
        """A step begins: every buffer is free again (one a step cut short still lent too)."""
        super().clear_runtime_states()
        self._inputs.new_step()
        self._output_grads.new_step()
        self._sent.clear()

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        self._inputs.lend(fwd_chunk_id)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        if self.has_backward and not self.is_last:
            self._output_grads.lend(bwd_chunk_id)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not ops:  # the last stage's output goes to the loss, not to another stage
            return ops
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        self._sent[fwd_chunk_id] = [weakref.ref(op.tensor) for op in ops]
        for output in outputs:
            self._drop_data(output)
        return ops

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not self.has_backward:  # evaluation: nothing saved the input
            self._inputs.give_back(fwd_chunk_id)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        # the gradient of this micro-batch came back: the next stage has received this and every earlier output
        for chunk in [chunk for chunk in self._sent if chunk <= bwd_chunk_id]:
            for reference in self._sent.pop(chunk):
                self._drop_data(reference())
        super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._output_grads.give_back(bwd_chunk_id)
        if kwargs.get("full_backward", True):
            self._inputs.give_back(bwd_chunk_id)

    def _drop_data(self, tensor: torch.Tensor | None) -> None:
        """Free ``tensor``'s data, keeping its shape, dtype and autograd graph: its elements become one element
        broadcast (Megatron-LM's ``deallocate_output_tensor`` keeps one element too), shared by every tensor this
        stage dropped (nothing writes to them: an in-place write to a broadcast tensor is refused). A view (its
        base holds the data) and a tensor subclass (DTensor) are left as they are."""
        if type(tensor) is not torch.Tensor or tensor._base is not None:
            return
        if tensor.untyped_storage().nbytes() <= tensor.element_size():  # dropped already
            return
        key = (tensor.dtype, tensor.device)
        if key not in self._scalars:
            self._scalars[key] = torch.empty((), dtype=tensor.dtype, device=tensor.device)
        tensor.data = self._scalars[key].expand(tensor.shape)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._inputs.give_back(bwd_chunk_id)  # a split backward (zero-bubble) keeps its inputs to this half


class _ReceiveBuffers:
    """One kind of a stage's receive buffers (its inputs', or its outputs' gradients'), lent per micro-batch.

    ``table()`` is the stage's map of micro-batch -> ``_RecvInfo``s; a received tensor goes into ``info.buffer``.
    Between lends an info's buffer is an empty placeholder. The buffers PyTorch made when it set the schedule up
    are taken as the shapes to lend and then let go (on the first receive of each step: a new schedule, for
    another number of micro-batches, makes them again)."""

    def __init__(self, table: Any) -> None:
        self._table = table
        self._free: list[tuple[torch.Tensor, ...]] = []
        self._lent: dict[int, tuple[torch.Tensor, ...]] = {}
        self._shapes: tuple[tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device], ...] | None = None
        self._placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # an idle info's buffer
        self._check = True

    def new_step(self) -> None:
        self._free += self._lent.values()
        self._lent.clear()
        self._check = True

    def lend(self, chunk: int) -> None:
        if self._check:
            self._take_fresh_buffers()
        infos = _receiving(self._table()[chunk])
        if not infos or chunk in self._lent or self._shapes is None:
            return
        buffers = self._free.pop() if self._free else tuple(_empty(*shape) for shape in self._shapes)
        for info, buffer in zip(infos, buffers, strict=True):
            info.buffer = buffer
        self._lent[chunk] = buffers

    def give_back(self, chunk: int) -> None:
        buffers = self._lent.pop(chunk, None)
        if buffers is None:
            return
        for info in _receiving(self._table()[chunk]):
            info.buffer = self._placeholder(info.buffer)
        self._free.append(buffers)

    def _take_fresh_buffers(self) -> None:
        """Buffers PyTorch made (every micro-batch's, at the schedule's setup) become the shapes to lend, and go."""
        self._check = False
        ours = {id(t) for t in self._placeholders.values()}
        ours |= {id(buffer) for buffers in (*self._free, *self._lent.values()) for buffer in buffers}
        for chunk, infos in self._table().items():
            receiving = _receiving(infos)
            if chunk in self._lent or not receiving:
                continue
            if all(id(info.buffer) not in ours for info in receiving):
                shapes = tuple((b.shape, b.stride(), b.dtype, b.device) for b in (i.buffer for i in receiving))
                if shapes != self._shapes:  # a new setup, of other shapes: the free buffers no longer fit
                    self._shapes, self._free = shapes, []
            for info in receiving:
                info.buffer = self._placeholder(info.buffer)

    def _placeholder(self, like: torch.Tensor) -> torch.Tensor:
        """The empty tensor an idle info holds (one per dtype and device)."""
        key = (like.dtype, like.device)
        if key not in self._placeholders:
            self._placeholders[key] = torch.empty(0, dtype=like.dtype, device=like.device)
        return self._placeholders[key]


def _receiving(infos: Any) -> list[Any]:
    """The infos of a micro-batch that receive a tensor (not the model's own inputs, not a gradient of None)."""
    return [info for info in infos if not info.is_root_arg and info.buffer is not None]


def _empty(shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)
