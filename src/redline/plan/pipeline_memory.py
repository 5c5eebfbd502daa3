"""What a pipeline rank holds beyond one micro-batch's activations, by schedule: the micro-batches in flight, the
LM head's (once), the stage outputs the sends still reference, the schedule's tensors of the whole step. Pure
arithmetic for ``plan.memory.stage_memory``, as redline's runtime runs the schedules
(``torch.distributed.pipelining`` with ``runtime.pipeline_stage.ReleasingStage``, which frees a sent output's data
and lends receive buffers per micro-batch in flight, as Megatron-LM does).

Checked against what each rank of a CPU step holds (``tests/runtime/test_activation_memory.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from redline.plan.dtypes import activation_key, block_input_bytes
from redline.plan.strategy import Strategy

if TYPE_CHECKING:
    from redline.plan.memory import Stage
    from redline.workload.profile import WorkloadProfile

TOKEN_ID_BYTES = 8  # an LM's targets: int64 token ids
# the element a dropped output keeps (broadcast to its shape), one per sending chunk: at most fp32
DROPPED_SCALAR_BYTES = 4


def in_flight_micro_batches(strategy: Strategy, stage_index: int) -> float:
    """How many micro-batches' activations of its whole stage a pipeline rank holds at once, by schedule (p
    stages, m micro-batches, v virtual stages; stage i from 0):

    - GPipe (Huang et al. 2019) runs every forward before any backward: all m, on every stage;
    - 1F1B (Narayanan et al. 2021, section 2.2) starts a backward once stage i has p - i forwards in flight:
      min(p - i, m), the first stage the most (p: the activations of L layers, whatever p is);
    - interleaved 1F1B holds (p - i - 1) x 2 + (v - 1) x p + 1 chunks of 1/v of the stage in warm-up
      (Megatron-LM's schedule): p + (p - 1)/v stages' worth on the first stage, which is Korthikanti et al. 2022's
      factor 1 + (p - 1)/(p v) over 1F1B's p; at most m.

    Without a pipeline micro-batches run one after the other: 1.
    """
    p, m, v = strategy.pipeline, strategy.accumulation, strategy.virtual_stages
    if p == 1:
        return 1.0
    if strategy.schedule == "gpipe":
        return float(m)
    if strategy.schedule == "interleaved":
        return min(((p - stage_index - 1) * 2 + (v - 1) * p + 1) / v, float(m))
    return float(min(p - stage_index, m))


def head_micro_batches(strategy: Strategy) -> float:
    """How many micro-batches' activations of the layers after the last block (an LM's final norm, head and loss)
    the last stage holds at once. GPipe runs every forward before any backward: all m. Under 1F1B and interleaved
    1F1B the model's last stage warms up with one forward and then runs each micro-batch's backward right after
    its forward (Megatron-LM's interleaved schedule starts its backwards with the last model chunk): one, however
    many micro-batches the rank's other chunks hold. Without a pipeline: one."""
    if strategy.pipeline > 1 and strategy.schedule == "gpipe":
        return float(strategy.accumulation)
    return 1.0


def outside_blocks_micro_batches(strategy: Strategy, stage: Stage, in_flight: float) -> float:
    """How many micro-batches' activations of the stage's layers outside the blocks are held at once: on the last
    stage of a pipeline (the head) ``head_micro_batches``; on the first stage of an interleaved one (the
    embedding, in the rank's first chunk, which runs the most forwards before its first backward) at most every
    chunk's micro-batch in flight on the rank, v x ``in_flight`` (of at most m); elsewhere the stage's
    ``in_flight``."""
    if strategy.pipeline > 1 and stage.index == strategy.pipeline - 1:
        return min(in_flight, head_micro_batches(strategy))
    if strategy.pipeline > 1 and stage.index == 0 and strategy.schedule == "interleaved":
        return min(float(strategy.accumulation), strategy.virtual_stages * in_flight)
    return in_flight


def held_stage_outputs(profile: WorkloadProfile, strategy: Strategy, stage: Stage, in_flight: float) -> float:
    """Bytes of the stage outputs a pipeline rank holds, all but the model's output: a block's input's shape
    each, split along the sequence under sequence parallelism. Nothing saves a stage's last output for the
    backward (its residual add saves nothing); the runtime frees its data once sent, and the data lives only as
    long as the schedule's handles of the send reference it, dropped at the micro-batch's backward at the latest
    (``ReleasingStage``). So, as a backward begins:

    - 1F1B: the latest forward's output (its send waits to go with the next backward's receive) and, on a stage
      that warms up with three forwards or more, the last warm-up send's, whose handle the schedule keeps until
      its backward: min(2, warm-up - 1);
    - GPipe: the schedule keeps every send's handle until all forwards are done: all m but the one whose
      backward begins;
    - interleaved 1F1B: ``PipelineScheduleRuntime`` keeps every send's handle to the step's end: each chunk's
      output of each micro-batch in flight (v x ``in_flight`` of them) but the one whose backward begins.

    And the one element the dropped outputs of a chunk share. Under sequence parallelism the output is a DTensor,
    which the runtime does not drop: each micro-batch's in flight, to its backward. Megatron-LM holds none (a send
    there is done before the next compute); PyTorch's own stage keeps every output whole to its backward, and the
    interleaved schedule's to the step's end. Measured on the CPU (tiny GPT-2, PP=2, 1F1B, micro-batch 2): its
    first stage then held two micro-batches' 4,096-byte outputs, redline's one."""
    sending = strategy.virtual_stages - (1 if stage.index == strategy.pipeline - 1 else 0)
    if strategy.pipeline == 1 or not stage.blocks or sending == 0:
        return 0.0
    output = _block_io_bytes(profile, strategy, stage)
    # under sequence parallelism a stage's output is a DTensor, whose data the runtime keeps to its backward
    whole = strategy.sequence_parallel and strategy.tensor > 1
    if strategy.schedule == "gpipe":
        held = strategy.accumulation - (0.0 if whole else 1.0)
    elif strategy.schedule == "interleaved":
        held = max(0.0, strategy.virtual_stages * in_flight - (0 if whole else 1))
    else:
        held = in_flight if whole else max(0.0, min(2.0, in_flight - 1))
    return output * held + DROPPED_SCALAR_BYTES * sending


def pipeline_step_tensors(profile: WorkloadProfile, strategy: Strategy, stage: Stage, in_flight: float) -> float:
    """Bytes a pipeline rank holds beyond what its micro-batches in flight keep, as redline's runtime runs the
    schedules:

    - the first stage: the step's inputs of the micro-batches not in flight (the schedule splits the batch into
      views of it; the embedding saves those in flight);
    - a stage's input's receive buffers are lent from the receive to the end of the micro-batch's backward, and
      its first block saves that input: they count with the micro-batches in flight. The interleaved schedule
      (``PipelineScheduleRuntime``) posts the next forward's receive before the backward that precedes it: one
      more. (PyTorch's own stage keeps one for every micro-batch of the step, m per chunk, made with the schedule;
      Megatron-LM receives into a new tensor, as redline's runtime lends them.)
    - a rank with a chunk that sends its output on (all but the last stage; interleaved, every rank): the
      gradient of that output received for the backward that runs, lent likewise; the interleaved schedule's last
      rank has posted the next one's receive too;
    - the last stage: the targets, all m micro-batches (an LM's, int64 token ids shaped as its input), each
      micro-batch's loss, kept for the step's mean, and the backward's seed gradient.

    Measured on the CPU (PP=2, m=4): without them a tiny GPT-2 under 1F1B held 3,584 and 13,316 bytes more than
    planned on its two stages."""
    if strategy.pipeline == 1:
        return 0.0
    key, b, m = activation_key(strategy), strategy.micro_batch, strategy.accumulation
    last = stage.index == strategy.pipeline - 1
    interleaved = strategy.schedule == "interleaved"
    held = 0.0
    if stage.index == 0 and profile.layers:
        waiting = max(0.0, m - outside_blocks_micro_batches(strategy, stage, in_flight))
        held += profile.layers[0].input_bytes_per_sample.get(key, 0.0) * b * waiting
    if stage.blocks:
        block_io = _block_io_bytes(profile, strategy, stage)
        received_early = 1 if interleaved else 0
        gradients = (1 if strategy.virtual_stages - (1 if last else 0) > 0 else 0) + (1 if interleaved and last else 0)
        held += block_io * (received_early + gradients)
    if last:
        held += 4 * (m + 1)  # each micro-batch's loss, the seed gradient
        if profile.loss_vocab:
            held += TOKEN_ID_BYTES * profile.tokens_per_sample * b * m
    return held


def _block_io_bytes(profile: WorkloadProfile, strategy: Strategy, stage: Stage) -> float:
    """Bytes of one micro-batch of a stage's input or output (a block's input: the residual stream, in the width
    the runtime runs it, ``plan.dtypes.block_input_bytes``), split along the sequence under sequence parallelism."""
    per_sample = block_input_bytes(profile, stage.blocks[-1], strategy)
    return per_sample * strategy.micro_batch / (strategy.tensor if strategy.sequence_parallel else 1)
